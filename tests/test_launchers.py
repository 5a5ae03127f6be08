"""Real cluster launchers: a real SLURM (two slurmd "nodes" on this machine) and two torchrun nodes on loopback, each
rank training with real FSDP (Trainer, then Fabric, bf16-true) in every way the shim is activated.

Only the ``cluster`` nox session runs these (``nox -s cluster``: it installs and starts SLURM, sets
``FSDP_SHIM_TEST_CLUSTER=1`` and ``SLURM_CONF``, and stops the daemons afterwards). Expected bytes come from the
``FSDP_SHIM=0`` run of the same job (float32, checked): exactly twice each rank's bytes in bfloat16, because every
tensor of ``tests/scenarios/fsdp_train.py``'s models shards without padding. Each job prints a per-rank table.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import BYTE_KEYS, DTYPES, FSDP_SHIM, ROOT, clean_env, free_port

pytestmark = [
    pytest.mark.launchers,
    pytest.mark.skipif(os.environ.get("FSDP_SHIM_TEST_CLUSTER") != "1", reason="runs in the `cluster` nox session"),
]

PROGRAM = ROOT / "tests" / "cluster" / "train_both.py"
APIS = ("trainer", "fabric")
BF16 = DTYPES["bf16-true"]
CONFIRMED = "fsdp-shim: patched on all {} ranks (bfloat16; fixes: cast, recompute), confirmed in "
"""Rank zero's line on the cluster session's Lightning (2.4.0: both fixes the shim's)."""
JOB_TIMEOUT = 240  # seconds; a hung rank fails the test and its job is killed
SLURM_TIME_LIMIT = "5"  # minutes: SLURM ends the job itself if the test's own kill did not reach it
PER_NODE = 2  # srun -N 2 --ntasks-per-node 2: two tasks on each slurmd


def shim_command() -> list[str]:
    """The ``fsdp-shim`` console script next to this interpreter (what users type)."""
    return [FSDP_SHIM] if os.path.exists(FSDP_SHIM) else [sys.executable, "-m", "fsdp_shim"]


def launch(commands: list[list[str]], env: dict[str, str]) -> list[tuple[int, str]]:
    """Start the commands side by side (one per torchrun node, or one srun), each in its own process group; return
    (exit code, output) per command. Past ``JOB_TIMEOUT`` every group gets SIGTERM (srun ends its job step), then
    SIGKILL."""
    return finish(start(commands, env), commands)


def start(commands: list[list[str]], env: dict[str, str]) -> list[subprocess.Popen[str]]:
    return [
        subprocess.Popen(
            command,
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for command in commands
    ]


def finish(procs: list[subprocess.Popen[str]], commands: list[list[str]]) -> list[tuple[int, str]]:
    deadline = time.monotonic() + JOB_TIMEOUT
    outputs: list[tuple[int, str]] = []
    try:
        for proc in procs:
            try:
                output, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                kill_all(procs)
                output, _ = proc.communicate()
                raise AssertionError(f"job still running after {JOB_TIMEOUT} s: {commands}\n{output[-6000:]}") from None
            outputs.append((proc.returncode, output))
    finally:
        kill_all(procs)
    return outputs


def kill_all(procs: list[subprocess.Popen[str]]) -> None:
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        alive = [proc for proc in procs if proc.poll() is None]
        for proc in alive:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
        end = time.monotonic() + grace
        for proc in alive:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, end - time.monotonic()))


def report(text: str) -> None:
    """Print to the log; the cluster session also collects these in a file for its closing note."""
    print(text, flush=True)
    tables = os.environ.get("FSDP_SHIM_TEST_CLUSTER_TABLES")
    if tables:
        with open(tables, "a") as file:
            file.write(text + "\n")


class Jobs:
    """Runs a job once and keeps its per-rank results and output (the FSDP_SHIM=0 baselines are shared)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.cache: dict[str, list[dict[str, Any]]] = {}
        self.outputs: dict[str, str] = {}

    def out(self, name: str) -> Path:
        return self.workdir / re.sub(r"[^A-Za-z0-9_.-]+", "_", name)

    def run(self, name: str, commands: list[list[str]], env: dict[str, str], world: int) -> list[dict[str, Any]]:
        if name not in self.cache:
            started = time.monotonic()
            results = launch(commands, env)
            assert all(code == 0 for code, _ in results), "\n".join(output[-8000:] for _, output in results)
            missing = [rank for rank in range(world) if not Path(f"{self.out(name)}.rank{rank}.json").exists()]
            assert not missing, f"ranks {missing} wrote no result"
            self.cache[name] = [json.loads(Path(f"{self.out(name)}.rank{r}.json").read_text()) for r in range(world)]
            self.outputs[name] = "\n".join(output for _, output in results)
            lines = [f"\n=== {name} ({time.monotonic() - started:.0f} s)", "$ " + " & ".join(map(shlex.join, commands))]
            lines.append("rank  node   api      dtype           flat bytes  grad bytes  adam bytes")
            for result in self.cache[name]:
                for api in APIS:
                    row = result[api]
                    dtype = ",".join(d.removeprefix("torch.") for d in row["flat_param_dtypes"])
                    lines.append(
                        f"{result['rank']:<5} {result['node']:<6} {api:<8} {dtype:<15} {row['flat_param_bytes']:>10}"
                        f"  {row['grad_bytes']:>10}  {row['optimizer_state_bytes']:>10}"
                    )
            report("\n".join(lines))
        return self.cache[name]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Jobs:
    return Jobs(tmp_path_factory.mktemp("cluster"))


def assert_placement(ranks: list[dict[str, Any]], per_node: int) -> None:
    """The job spans both nodes, ``per_node`` ranks each, and Lightning agrees on every rank."""
    by_node: dict[str, int] = {}
    for result in ranks:
        by_node[result["node"]] = by_node.get(result["node"], 0) + 1
        assert result["world_size"] == 2 * per_node and result["trainer_rank"] == result["rank"], result
    assert sorted(by_node.values()) == [per_node, per_node], by_node


def assert_float32(ranks: list[dict[str, Any]]) -> None:
    for result in ranks:
        assert result["trainer"]["module_dtype"] == DTYPES["32-true"]
        for api in APIS:
            row = result[api]
            assert row["flat_param_dtypes"] == [DTYPES["32-true"]], (result["rank"], api, row)
            assert row["flat_param_bytes"] == 4 * row["flat_param_numel"], (result["rank"], api, row)


def assert_patched(ranks: list[dict[str, Any]], baseline: list[dict[str, Any]], output: str) -> None:
    """bfloat16 on every rank, for both APIs, with exactly half of the same rank's FSDP_SHIM=0 bytes; rank zero says
    so once for the job, though each rank converts twice (Trainer, then Fabric, in one process group)."""
    assert [result["rank"] for result in ranks] == [result["rank"] for result in baseline]
    for result, unpatched in zip(ranks, baseline):
        assert result["trainer"]["module_dtype"] == BF16
        for api in APIS:
            row, base = result[api], unpatched[api]
            assert row["flat_param_dtypes"] == [BF16], (result["rank"], api, row)
            assert row["flat_param_numel"] == base["flat_param_numel"]
            for key in BYTE_KEYS:
                assert base[key] % 2 == 0 and row[key] == base[key] // 2, (result["rank"], api, key, row, base)
        facts = result["shim"]
        assert facts and facts["trainer_convert_module"] and facts["fabric_convert_module"], facts
    assert output.count("fsdp-shim: patched on all") == 1, output[-6000:]
    assert output.count(CONFIRMED.format(len(ranks))) == 1, output[-6000:]


def program(out: Path, per_node: int, shim: str = "off") -> list[str]:
    """``train_both.py``; ``--shim before`` imports fsdp_shim first, ``off`` leaves the shim to the launcher."""
    arguments = ["--shim", shim, "--num-nodes", "2", "--devices", str(per_node), "--out", str(out)]
    return [sys.executable, str(PROGRAM), *arguments]


def check_half_patched(title: str, commands: list[list[str]], outputs: list[tuple[int, str]], named: str) -> None:
    """The job fails, and every rank with the shim raises FSDPShimError starting ``named`` (the ranks with
    ``FSDP_SHIM=0``, as ``train_both.py``'s lines show them); prints the per-rank table."""
    ranks: dict[int, dict[str, str]] = {}
    for line in "\n".join(output for _, output in outputs).splitlines():
        words = line.split()
        if words[:2] == ["train_both:", "rank"]:
            entry = ranks.setdefault(int(words[2]), {"failed": ""})
            if words[3] == "node":
                entry.update(node=words[4], shim=words[5].partition("=")[2])
            elif words[3] == "failed:":
                entry["failed"] = " ".join(words[4:])
    lines = [f"\n=== {title}", "$ " + " & ".join(map(shlex.join, commands)), "rank  node   FSDP_SHIM  outcome"]
    for rank, entry in sorted(ranks.items()):
        lines.append(
            f"{rank:<5} {entry.get('node', '?'):<6} {entry.get('shim', '?'):<10} {entry['failed'][:160] or '-'}"
        )
    report("\n".join(lines))
    assert any(code != 0 for code, _ in outputs), "a half-patched job must not succeed"
    unshimmed = sorted(rank for rank, entry in ranks.items() if entry.get("shim") == "0")
    noun = "rank" if len(unshimmed) == 1 else "ranks"
    assert named.startswith(f"{noun} {', '.join(map(str, unshimmed))} of {len(ranks)} "), (named, ranks)
    for rank, entry in ranks.items():
        if rank not in unshimmed:
            assert entry["failed"].startswith(f"FSDPShimError: fsdp-shim: {named}"), (rank, entry)


# ----------------------------------------------------------------------------- SLURM
def slurm_env(**overrides: str) -> dict[str, str]:
    if not os.environ.get("SLURM_CONF"):
        pytest.skip("SLURM_CONF is not set: the `cluster` nox session starts SLURM")
    # Lightning takes MASTER_ADDR from the first node name (n1), which does not resolve here.
    return clean_env(PYTHONWARNINGS="ignore", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), **overrides)


SRUN = ["srun", "-N", "2", "--ntasks-per-node", str(PER_NODE), "--kill-on-bad-exit=1", f"--time={SLURM_TIME_LIMIT}"]
SRUN += ["--job-name", "fsdp-shim-test"]  # not `bash`: Lightning ignores SLURM for jobs named bash or interactive


def slurm_baseline(jobs: Jobs) -> list[dict[str, Any]]:
    name = "slurm FSDP_SHIM=0"
    command = [*SRUN, *shim_command(), "run", *program(jobs.out(name), PER_NODE)]
    return jobs.run(name, [command], slurm_env(FSDP_SHIM="0"), 2 * PER_NODE)


@pytest.fixture(scope="module")
def half_patched_slurm_job(jobs: Jobs) -> Iterator[dict[str, Any]]:
    """``srun fsdp-shim run python`` whose tasks on n2 export ``FSDP_SHIM=0`` first, every setting default, started
    with the first SLURM test and read by the last test of this file: its ranks' 30 s wait overlaps the other jobs
    (the nodes are shared: OverSubscribe), and its end is taken where its output ends."""
    name = "slurm half-patched (n2: FSDP_SHIM=0)"
    inner = shlex.join([*shim_command(), "run", *program(jobs.out(name), PER_NODE)])
    job: dict[str, Any] = {"name": name, "started": time.monotonic()}
    job["commands"] = [[*SRUN, "bash", "-c", f'[ "$SLURMD_NODENAME" = n2 ] && export FSDP_SHIM=0; exec {inner}']]
    procs = start(job["commands"], slurm_env())

    def wait() -> None:
        job["outputs"] = finish(procs, job["commands"])
        job["ended"] = time.monotonic()

    job["waiter"] = threading.Thread(target=wait, daemon=True)
    job["waiter"].start()
    yield job
    kill_all(procs)
    job["waiter"].join(30)


def test_slurm_fsdp_shim_0_trains_float32_on_every_rank(jobs: Jobs, half_patched_slurm_job: dict[str, Any]) -> None:
    """The kill switch under ``srun fsdp-shim run python``: every rank float32 (the half-patched job starts here)."""
    ranks = slurm_baseline(jobs)
    assert_placement(ranks, PER_NODE)
    assert_float32(ranks)


@pytest.mark.parametrize(
    "mode", ["srun fsdp-shim run python", "fsdp-shim run srun python", "import fsdp_shim", "FSDP_SHIM=1"]
)
def test_slurm_every_rank_trains_bfloat16_and_rank_zero_confirms_once(jobs: Jobs, mode: str) -> None:
    """Every activation on two nodes of two tasks each."""
    out, env = jobs.out(f"slurm {mode}"), slurm_env(**({"FSDP_SHIM": "1"} if mode == "FSDP_SHIM=1" else {}))
    command = {
        "srun fsdp-shim run python": [*SRUN, *shim_command(), "run", *program(out, PER_NODE)],
        "fsdp-shim run srun python": [*shim_command(), "run", *SRUN, *program(out, PER_NODE)],
        "import fsdp_shim": [*SRUN, *program(out, PER_NODE, shim="before")],
        "FSDP_SHIM=1": [*SRUN, *program(out, PER_NODE)],
    }[mode]
    ranks = jobs.run(f"slurm {mode}", [command], env, 2 * PER_NODE)
    assert_placement(ranks, PER_NODE)
    assert_patched(ranks, slurm_baseline(jobs), jobs.outputs[f"slurm {mode}"])


# ----------------------------------------------------------------------------- torchrun nodes
def torchrun_nodes(
    rendezvous: str, out: Path, prefixes: tuple[list[str], list[str]], shim: str = "off"
) -> list[list[str]]:
    """Two ``torchrun`` nodes of one rank each, side by side on 127.0.0.1 and a free port; each node's command starts
    with its prefix (``fsdp-shim run``, ``env FSDP_SHIM=0``)."""
    port = free_port()
    if rendezvous == "static":
        rdzv = ["--master-addr", "127.0.0.1", "--master-port", str(port)]
    else:
        rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"fsdp-shim-{port}"]
    node = ["-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1"]
    return [
        [*prefixes[rank], sys.executable, *node, "--node-rank", str(rank), *rdzv, *program(out, 1, shim)[1:]]
        for rank in (0, 1)
    ]


def torchrun_baseline(jobs: Jobs, rendezvous: str) -> list[dict[str, Any]]:
    name = f"torchrun {rendezvous} FSDP_SHIM=0"
    run = [*shim_command(), "run"]
    commands = torchrun_nodes(rendezvous, jobs.out(name), (run, run))
    return jobs.run(name, commands, clean_env(PYTHONWARNINGS="ignore", FSDP_SHIM="0"), 2)


@pytest.mark.parametrize("rendezvous", ["static", "c10d"])
def test_torchrun_fsdp_shim_0_trains_float32_on_every_rank(jobs: Jobs, rendezvous: str) -> None:
    ranks = torchrun_baseline(jobs, rendezvous)
    assert_placement(ranks, 1)
    assert_float32(ranks)


@pytest.mark.parametrize(
    ("rendezvous", "mode"),
    # The rendezvous changes where the store lives (the agent's, for c10d), not how the shim is activated.
    [
        ("static", "fsdp-shim run torchrun"),
        ("static", "import fsdp_shim"),
        ("static", "FSDP_SHIM=1"),
        ("c10d", "FSDP_SHIM=1"),
    ],
)
def test_torchrun_every_rank_trains_bfloat16_and_rank_zero_confirms_once(
    jobs: Jobs, rendezvous: str, mode: str
) -> None:
    name = f"torchrun {rendezvous} {mode}"
    run = [*shim_command(), "run"] if mode == "fsdp-shim run torchrun" else []
    commands = torchrun_nodes(
        rendezvous, jobs.out(name), (run, run), shim="before" if mode == "import fsdp_shim" else "off"
    )
    env = clean_env(PYTHONWARNINGS="ignore", **({"FSDP_SHIM": "1"} if mode == "FSDP_SHIM=1" else {}))
    ranks = jobs.run(name, commands, env, 2)
    assert_placement(ranks, 1)
    assert_patched(ranks, torchrun_baseline(jobs, rendezvous), jobs.outputs[name])


@pytest.mark.parametrize("rendezvous", ["static", "c10d"])
def test_torchrun_half_patched_job_stops_naming_the_rank_without_the_shim(jobs: Jobs, rendezvous: str) -> None:
    """Node 1 runs ``env FSDP_SHIM=0 fsdp-shim run``; the shimmed rank waits ``FSDP_SHIM_RANK_CHECK_TIMEOUT=5`` s."""
    name = f"torchrun {rendezvous} half-patched (node 1: FSDP_SHIM=0)"
    run = [*shim_command(), "run"]
    commands = torchrun_nodes(rendezvous, jobs.out(name), (run, ["env", "FSDP_SHIM=0", *run]))
    started = time.monotonic()
    outputs = launch(commands, clean_env(PYTHONWARNINGS="ignore", FSDP_SHIM_RANK_CHECK_TIMEOUT="5"))
    title = f"{name} ({time.monotonic() - started:.0f} s)"
    check_half_patched(title, commands, outputs, "rank 1 of 2 did not report within 5 s")


def test_slurm_half_patched_job_stops_naming_the_ranks_without_the_shim(half_patched_slurm_job: dict[str, Any]) -> None:
    """The half-patched SLURM job: the shimmed ranks stop 30 s after every rank joined the process group, naming
    ranks 2 and 3, in under two minutes in all."""
    job = half_patched_slurm_job
    job["waiter"].join(JOB_TIMEOUT + 30)  # finish() kills the job at JOB_TIMEOUT
    assert "ended" in job, f"{job['name']} did not end within {JOB_TIMEOUT} s"
    wall = job["ended"] - job["started"]
    named = "ranks 2, 3 of 4 joined the process group but did not report within 30 s"
    check_half_patched(f"{job['name']} ({wall:.0f} s)", job["commands"], job["outputs"], named)
    assert wall < 120, wall
