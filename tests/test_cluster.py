"""Real cluster launchers: a real SLURM (two slurmd "nodes" on this machine) and two torchrun nodes
side by side on loopback, running real FSDP (Trainer and Fabric, bf16-true) in every way the shim
can be activated, with the dtype and the exact bytes checked on every rank.

These run only in the ``cluster`` nox session, which installs and starts SLURM, sets
``FSDP_SHIM_TEST_CLUSTER=1`` and ``SLURM_CONF``, and stops the daemons afterwards::

    nox -s cluster

Expected bytes are computed, not written down: the ``FSDP_SHIM=0`` run of the same job (float32,
checked) holds exactly twice each rank's bytes of a correctly converted bfloat16 run, because every
tensor of the models in ``tests/scenarios/fsdp_train.py`` shards without padding. Each test prints
a table (rank, node, API, dtype, bytes) for the log.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, clean_env, free_port, make_venv

pytestmark = [
    pytest.mark.release_independent,
    pytest.mark.skipif(
        os.environ.get("FSDP_SHIM_TEST_CLUSTER") != "1", reason="cluster launchers run in the `cluster` nox session"
    ),
]

PROGRAM = ROOT / "tests" / "cluster" / "train_both.py"
APIS = ("trainer", "fabric")
BYTE_KEYS = ("flat_param_bytes", "grad_bytes", "optimizer_state_bytes")
JOB_TIMEOUT = 240
"""Seconds one job may take (about 10-40 s here); a hung rank fails the test and its job is killed."""
RANK_CHECK_TIMEOUT = "10"
"""Seconds the shimmed ranks of a half-patched job wait: the ranks reach their FSDP setup within a
second or two of each other (they have just met in the process group's rendezvous)."""
SLURM_TIME_LIMIT = "5"  # minutes: SLURM ends the job itself if the test's own kill did not reach it


# ----------------------------------------------------------------------------- running jobs
def python() -> str:
    return sys.executable


def shim_command() -> list[str]:
    """The ``fsdp-shim`` console script next to this interpreter (what users type)."""
    script = shutil.which("fsdp-shim", path=os.path.dirname(sys.executable))
    return [script] if script else [sys.executable, "-m", "fsdp_shim"]


def launch(commands: list[list[str]], env: dict[str, str], timeout: float = JOB_TIMEOUT) -> list[tuple[int, str]]:
    """Start the commands side by side (one per torchrun node, or one srun), each in its own process
    group; return (exit code, stdout+stderr) per command. Past ``timeout`` every group is sent
    SIGTERM (srun passes it on and ends the job step), then SIGKILL 10 s later."""
    procs = [
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
    deadline = time.monotonic() + timeout
    outputs: list[tuple[int, str]] = []
    try:
        for proc in procs:
            try:
                output, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                kill_all(procs)
                output, _ = proc.communicate()
                raise AssertionError(f"job still running after {timeout:.0f} s: {commands}\n{output[-6000:]}") from None
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


def read_ranks(out: Path, world: int) -> list[dict[str, Any]]:
    missing = [rank for rank in range(world) if not Path(f"{out}.rank{rank}.json").exists()]
    assert not missing, f"ranks {missing} wrote no result"
    return [json.loads(Path(f"{out}.rank{rank}.json").read_text()) for rank in range(world)]


def report(text: str) -> None:
    """Print to the log; the cluster session also collects these in a file for the closing note."""
    print(text, flush=True)
    tables = os.environ.get("FSDP_SHIM_TEST_CLUSTER_TABLES")
    if tables:
        with open(tables, "a") as file:
            file.write(text + "\n")


def print_table(title: str, command: list[str] | str, ranks: list[dict[str, Any]]) -> None:
    """The per-rank table for the log."""
    shown = command if isinstance(command, str) else shlex.join(command)
    lines = [f"\n=== {title}", f"$ {shown}", "rank  node   api      dtype           flat bytes  grad bytes  adam bytes"]
    for result in ranks:
        for api in APIS:
            row = result[api]
            dtype = ",".join(d.removeprefix("torch.") for d in row["flat_param_dtypes"])
            lines.append(
                f"{result['rank']:<5} {result['node']:<6} {api:<8} {dtype:<15} "
                f"{row['flat_param_bytes']:>10}  {row['grad_bytes']:>10}  {row['optimizer_state_bytes']:>10}"
            )
    report("\n".join(lines))


def assert_placement(ranks: list[dict[str, Any]], nodes: int, per_node: int) -> None:
    """The job really spans the nodes: each node holds ``per_node`` ranks, and Lightning agrees on the rank."""
    by_node: dict[str, int] = {}
    for result in ranks:
        by_node[result["node"]] = by_node.get(result["node"], 0) + 1
        assert result["world_size"] == nodes * per_node
        assert result["trainer_rank"] == result["rank"]
    assert sorted(by_node.values()) == [per_node] * nodes, by_node


def assert_float32(ranks: list[dict[str, Any]]) -> None:
    for result in ranks:
        for api in APIS:
            row = result[api]
            assert row["flat_param_dtypes"] == ["torch.float32"], (result["rank"], api, row)
            assert row["flat_param_bytes"] == 4 * row["flat_param_numel"], (result["rank"], api, row)
        assert result["trainer"]["module_dtype"] == "torch.float32"


def assert_patched(ranks: list[dict[str, Any]], baseline: list[dict[str, Any]]) -> None:
    """bfloat16 on every rank, for both APIs, with exactly half of the same rank's FSDP_SHIM=0 bytes."""
    assert len(ranks) == len(baseline)
    for result, unpatched in zip(ranks, baseline):
        assert result["rank"] == unpatched["rank"]
        for api in APIS:
            row, base = result[api], unpatched[api]
            assert row["flat_param_dtypes"] == ["torch.bfloat16"], (result["rank"], api, row)
            assert row["flat_param_numel"] == base["flat_param_numel"]
            for key in BYTE_KEYS:
                assert base[key] % 2 == 0 and row[key] == base[key] // 2, (result["rank"], api, key, row, base)
        assert result["trainer"]["module_dtype"] == "torch.bfloat16"
        facts = result["shim"]
        assert facts and facts["trainer_convert_module"] and facts["fabric_convert_module"], facts


# ----------------------------------------------------------------------------- the start-up file
@pytest.fixture(scope="module")
def startup_python(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The interpreter of a new virtual environment that sees this one's packages, with the start-up
    file written by ``fsdp-shim install`` into its site-packages; uninstalled afterwards, and the
    environment is a temporary folder, so nothing outside the test is changed."""
    venv = make_venv(tmp_path_factory.mktemp("startup") / "venv", [str(ROOT), sysconfig.get_paths()["purelib"]])
    venv.run("-m", "fsdp_shim", "install")
    assert (venv.site_packages / "fsdp_shim.pth").exists()
    yield venv.python
    venv.run("-m", "fsdp_shim", "uninstall")
    assert not (venv.site_packages / "fsdp_shim.pth").exists()


# ----------------------------------------------------------------------------- SLURM
SLURM_TOPOLOGIES = {"2x1": 1, "2x2": 2}  # -N 2, --ntasks-per-node


def slurm_env(**overrides: str | None) -> dict[str, str]:
    if not os.environ.get("SLURM_CONF"):
        pytest.skip("SLURM_CONF is not set: the `cluster` nox session starts SLURM")
    # Lightning takes MASTER_ADDR from the first node name (n1), which does not resolve here.
    return clean_env(PYTHONWARNINGS="ignore", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), **overrides)


def srun(per_node: int, *options: str) -> list[str]:
    return [
        "srun",
        "-N",
        "2",
        "--ntasks-per-node",
        str(per_node),
        "--kill-on-bad-exit=1",
        f"--time={SLURM_TIME_LIMIT}",
        "--job-name",
        "fsdp-shim-test",  # not `bash`: Lightning ignores SLURM for jobs named bash or interactive
        *options,
    ]


def program(per_node: int, out: Path, shim: str = "off", interpreter: str | None = None) -> list[str]:
    return [
        interpreter or python(),
        str(PROGRAM),
        "--shim",
        shim,
        "--num-nodes",
        "2",
        "--devices",
        str(per_node),
        "--out",
        str(out),
    ]


def slurm_mode_command(
    mode: str, per_node: int, out: Path, startup: str | None = None
) -> tuple[list[str], dict[str, str]]:
    if mode == "srun fsdp-shim run python":
        return [*srun(per_node), *shim_command(), "run", *program(per_node, out)], slurm_env()
    if mode == "fsdp-shim run srun python":
        return [*shim_command(), "run", *srun(per_node), *program(per_node, out)], slurm_env()
    if mode == "start-up file":
        return [*srun(per_node), *program(per_node, out, interpreter=startup)], slurm_env()
    if mode == "FSDP_SHIM=1":
        return [*srun(per_node), *program(per_node, out)], slurm_env(FSDP_SHIM="1")
    if mode == "import fsdp_shim":
        return [*srun(per_node), *program(per_node, out, shim="before")], slurm_env()
    raise AssertionError(mode)


class Jobs:
    """Runs a job once and keeps its per-rank results (the FSDP_SHIM=0 baselines are shared)."""

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
            for code, output in results:
                assert code == 0, f"{name}: exit {code}\n{output[-8000:]}"
            self.cache[name] = read_ranks(self.out(name), world)
            self.outputs[name] = "\n".join(output for _, output in results)
            shown = " & ".join(shlex.join(c) for c in commands)
            print_table(f"{name} ({time.monotonic() - started:.0f} s)", shown, self.cache[name])
        return self.cache[name]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Jobs:
    return Jobs(tmp_path_factory.mktemp("cluster"))


def slurm_baseline(jobs: Jobs, per_node: int) -> list[dict[str, Any]]:
    name = f"slurm 2x{per_node} FSDP_SHIM=0"
    command = [*srun(per_node), *shim_command(), "run", *program(per_node, jobs.out(name))]
    ranks = jobs.run(name, [command], slurm_env(FSDP_SHIM="0"), 2 * per_node)
    assert_placement(ranks, 2, per_node)
    assert_float32(ranks)
    return ranks


@pytest.mark.parametrize("topology", SLURM_TOPOLOGIES)
def test_slurm_fsdp_shim_0_trains_float32_on_every_rank(jobs: Jobs, topology: str) -> None:
    """The kill switch under ``srun ... fsdp-shim run python``: every rank float32 (and the baseline)."""
    slurm_baseline(jobs, SLURM_TOPOLOGIES[topology])


SLURM_MODES = (
    "srun fsdp-shim run python",
    "fsdp-shim run srun python",
    "start-up file",
    "import fsdp_shim",
    "FSDP_SHIM=1",
)


@pytest.mark.parametrize("topology", SLURM_TOPOLOGIES)
@pytest.mark.parametrize("mode", SLURM_MODES)
def test_slurm_every_rank_trains_bfloat16(jobs: Jobs, startup_python: str, mode: str, topology: str) -> None:
    per_node = SLURM_TOPOLOGIES[topology]
    ranks = slurm_job(jobs, mode, per_node, startup_python)
    assert_placement(ranks, 2, per_node)
    assert_patched(ranks, slurm_baseline(jobs, per_node))


def slurm_job(jobs: Jobs, mode: str, per_node: int, startup: str | None = None) -> list[dict[str, Any]]:
    name = f"slurm 2x{per_node} {mode}"
    command, env = slurm_mode_command(mode, per_node, jobs.out(name), startup)
    return jobs.run(name, [command], env, 2 * per_node)


def half_patched_slurm_command(per_node: int, out: Path) -> list[str]:
    """``srun fsdp-shim run python`` with ``FSDP_SHIM=0`` on node n2 only (set inside the task)."""
    inner = shlex.join([*shim_command(), "run", *program(per_node, out)])
    return [*srun(per_node), "bash", "-c", f'[ "$SLURMD_NODENAME" = n2 ] && export FSDP_SHIM=0; exec {inner}']


def rank_lines(outputs: list[tuple[int, str]]) -> dict[int, dict[str, str]]:
    """What ``train_both.py`` printed per rank: node, FSDP_SHIM and, if it failed, why."""
    ranks: dict[int, dict[str, str]] = {}
    for _, output in outputs:
        for line in output.splitlines():
            words = line.split()
            if words[:2] != ["train_both:", "rank"]:
                continue
            entry = ranks.setdefault(int(words[2]), {"failed": ""})
            if words[3] == "node":
                entry.update(node=words[4], shim=words[5].partition("=")[2])
            elif words[3] == "failed:":
                entry["failed"] = " ".join(words[4:])
    return ranks


def check_half_patched(title: str, commands: list[list[str]], outputs: list[tuple[int, str]], world: int) -> None:
    """The job stops (non-zero exit), every rank with the shim raises FSDPShimError naming exactly the
    ranks with FSDP_SHIM=0, and those ranks do not report success either. Prints the per-rank table."""
    ranks = rank_lines(outputs)
    lines = [f"\n=== {title}", "$ " + " & ".join(shlex.join(c) for c in commands)]
    lines += [f"exit codes: {[code for code, _ in outputs]}", "rank  node   FSDP_SHIM  outcome"]
    for rank in sorted(ranks):
        entry = ranks[rank]
        outcome = entry["failed"][:160] or "-"
        lines.append(f"{rank:<5} {entry.get('node', '?'):<6} {entry.get('shim', '?'):<10} {outcome}")
    report("\n".join(lines))
    assert sorted(ranks) == list(range(world)), "\n".join(output[-6000:] for _, output in outputs)
    assert any(code != 0 for code, _ in outputs), "a half-patched job must not succeed"
    unshimmed = sorted(rank for rank, entry in ranks.items() if entry.get("shim") == "0")
    assert 0 < len(unshimmed) < world, ranks
    noun = "rank" if len(unshimmed) == 1 else "ranks"
    named = f"{noun} {', '.join(map(str, unshimmed))} of {world} did not confirm"
    for rank, entry in ranks.items():
        if rank not in unshimmed:
            assert entry["failed"].startswith("FSDPShimError") and named in entry["failed"], (rank, entry)


@pytest.mark.parametrize("topology", SLURM_TOPOLOGIES)
def test_slurm_half_patched_job_stops_naming_the_ranks_without_the_shim(jobs: Jobs, topology: str) -> None:
    per_node = SLURM_TOPOLOGIES[topology]
    name = f"slurm 2x{per_node} half-patched (n2: FSDP_SHIM=0)"
    command = half_patched_slurm_command(per_node, jobs.out(name))
    started = time.monotonic()
    outputs = launch([command], slurm_env(FSDP_SHIM_RANK_CHECK_TIMEOUT=RANK_CHECK_TIMEOUT))
    check_half_patched(f"{name} ({time.monotonic() - started:.0f} s)", [command], outputs, 2 * per_node)


@pytest.mark.parametrize("topology", SLURM_TOPOLOGIES)
def test_slurm_rank_zero_confirms_every_rank_once_per_api(jobs: Jobs, topology: str) -> None:
    """The shimmed jobs above say so: one line from rank zero per conversion (Trainer, Fabric)."""
    per_node = SLURM_TOPOLOGIES[topology]
    slurm_job(jobs, "srun fsdp-shim run python", per_node)
    output = jobs.outputs[f"slurm 2x{per_node} srun fsdp-shim run python"]
    assert output.count(f"fsdp-shim: patched on all {2 * per_node} ranks (bfloat16)") == len(APIS), output[-6000:]


REPORT_SHIM = "import os; print('FSDP_SHIM of task', os.environ['SLURM_PROCID'], '=', os.environ.get('FSDP_SHIM'))"


@pytest.mark.parametrize(
    ("export", "warned", "reaches"), [("MASTER_ADDR,PATH", True, "None"), ("MASTER_ADDR,PATH,FSDP_SHIM=1", False, "1")]
)
def test_fsdp_shim_run_srun_export_warns_once_when_it_drops_the_shim(export: str, warned: bool, reaches: str) -> None:
    """``srun --export=MASTER_ADDR,PATH`` drops PYTHONPATH and FSDP_SHIM, so no task gets the shim:
    ``fsdp-shim run`` says so once, before the job starts. With ``FSDP_SHIM=1`` in the list every task
    gets it, and nothing is said. (A tiny task: what matters is what reaches the tasks.)"""
    command = [*shim_command(), "run", *srun(1, f"--export={export}"), python(), "-c", REPORT_SHIM]
    ((code, output),) = launch([command], slurm_env(), timeout=60)
    report(f"\n=== fsdp-shim run srun --export={export}\n$ {shlex.join(command)}\n{output.strip()}")
    assert code == 0, output
    warnings = [line for line in output.splitlines() if line.startswith("fsdp-shim run:")]
    assert len(warnings) == (1 if warned else 0), output
    if warned:
        assert warnings[0].startswith("fsdp-shim run: warning:") and f"--export={export}" in warnings[0], output
    assert sorted(line for line in output.splitlines() if line.startswith("FSDP_SHIM of task")) == [
        f"FSDP_SHIM of task {task} = {reaches}" for task in (0, 1)
    ], output


# ----------------------------------------------------------------------------- torchrun
RENDEZVOUS = ("static", "c10d")


def torchrun_nodes(
    rendezvous: str, out: Path, prefixes: tuple[list[str], list[str]], interpreter: str | None = None, shim: str = "off"
) -> list[list[str]]:
    """Two ``torchrun`` nodes of one rank each, side by side on 127.0.0.1 and a free port; each node's
    command starts with its prefix (``fsdp-shim run``, ``env FSDP_SHIM=0``)."""
    port = free_port()
    if rendezvous == "static":
        rdzv = ["--master-addr", "127.0.0.1", "--master-port", str(port)]
    else:
        rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"fsdp-shim-{port}"]
    return [
        [
            *prefixes[node_rank],
            interpreter or python(),
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            "--node-rank",
            str(node_rank),
            *rdzv,
            *program(1, out, shim=shim)[1:],
        ]
        for node_rank in (0, 1)
    ]


def torchrun_env(**overrides: str | None) -> dict[str, str]:
    return clean_env(PYTHONWARNINGS="ignore", **overrides)


def torchrun_baseline(jobs: Jobs, rendezvous: str) -> list[dict[str, Any]]:
    name = f"torchrun {rendezvous} FSDP_SHIM=0"
    run = [*shim_command(), "run"]
    commands = torchrun_nodes(rendezvous, jobs.out(name), (run, run))
    ranks = jobs.run(name, commands, torchrun_env(FSDP_SHIM="0"), 2)
    assert_placement(ranks, 2, 1)
    assert_float32(ranks)
    return ranks


@pytest.mark.parametrize("rendezvous", RENDEZVOUS)
def test_torchrun_fsdp_shim_0_trains_float32_on_every_rank(jobs: Jobs, rendezvous: str) -> None:
    torchrun_baseline(jobs, rendezvous)


TORCHRUN_MODES = {
    "static": ("fsdp-shim run torchrun", "start-up file", "import fsdp_shim", "FSDP_SHIM=1"),
    # The rendezvous changes where the store lives (the agent's, for c10d), not how the shim is
    # activated: c10d runs the way the docs recommend, besides FSDP_SHIM=0 and the half-patched job.
    "c10d": ("FSDP_SHIM=1",),
}
"""Every activation mode once (static rendezvous); a torchrun job costs about 20-40 s here."""


def torchrun_mode_commands(
    mode: str, rendezvous: str, out: Path, startup: str
) -> tuple[list[list[str]], dict[str, str]]:
    if mode == "fsdp-shim run torchrun":
        run = [*shim_command(), "run"]
        return torchrun_nodes(rendezvous, out, (run, run)), torchrun_env()
    if mode == "start-up file":
        return torchrun_nodes(rendezvous, out, ([], []), interpreter=startup), torchrun_env()
    if mode == "import fsdp_shim":
        return torchrun_nodes(rendezvous, out, ([], []), shim="before"), torchrun_env()
    if mode == "FSDP_SHIM=1":
        return torchrun_nodes(rendezvous, out, ([], [])), torchrun_env(FSDP_SHIM="1")
    raise AssertionError(mode)


@pytest.mark.parametrize(
    ("rendezvous", "mode"), [(rendezvous, mode) for rendezvous, modes in TORCHRUN_MODES.items() for mode in modes]
)
def test_torchrun_every_rank_trains_bfloat16(jobs: Jobs, startup_python: str, mode: str, rendezvous: str) -> None:
    baseline = torchrun_baseline(jobs, rendezvous)
    name = f"torchrun {rendezvous} {mode}"
    commands, env = torchrun_mode_commands(mode, rendezvous, jobs.out(name), startup_python)
    ranks = jobs.run(name, commands, env, 2)
    assert_placement(ranks, 2, 1)
    assert_patched(ranks, baseline)


@pytest.mark.parametrize("rendezvous", RENDEZVOUS)
def test_torchrun_half_patched_job_stops_naming_the_rank_without_the_shim(jobs: Jobs, rendezvous: str) -> None:
    name = f"torchrun {rendezvous} half-patched (node 1: FSDP_SHIM=0)"
    run = [*shim_command(), "run"]
    commands = torchrun_nodes(rendezvous, jobs.out(name), (run, ["env", "FSDP_SHIM=0", *run]))
    started = time.monotonic()
    outputs = launch(commands, torchrun_env(FSDP_SHIM_RANK_CHECK_TIMEOUT=RANK_CHECK_TIMEOUT))
    check_half_patched(f"{name} ({time.monotonic() - started:.0f} s)", commands, outputs, 2)
