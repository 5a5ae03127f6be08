"""The rank check: every rank of a distributed job runs the same fixes and dtype, or the job stops naming the ranks.

Real FSDP through Lightning's Trainer and Fabric (gloo, CPU), each rank a process of its own started by torchrun, as
on a cluster; ``tests/scenarios/fsdp_train.py``'s per-rank options set a rank apart the way a node is. torchrun's
``--tee 3`` prefixes every line with its local rank (``[default1]:``), so each assertion reads the rank it is about.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import (
    BYTE_KEYS,
    DTYPES,
    ROOT,
    SCENARIO,
    Layout,
    affected_layout,
    clean_env,
    is_fixed_release,
    run_command,
    run_on_a_free_port,
    scenario_results,
    torchrun,
)

from _fsdp_shim import failures
from _fsdp_shim._version import __version__ as SHIM_VERSION
from _fsdp_shim.config import base_release, rank_check_timeout

CASE = "init+pretrained:bf16-true"
"""A layer built in ``__init__`` and an fp32 ``from_pretrained``-style one: float32 on 2.4.0 without the cast."""
BF16 = DTYPES["bf16-true"]
GRACE = 30
"""The documented wait after every rank joined the process group, when ``FSDP_SHIM_RANK_CHECK_TIMEOUT`` is unset."""
HOST = socket.gethostname()
DOCS = "https://fsdp-shim.github.io/fsdp-shim/cluster.html"


# ----------------------------------------------------------------------------- torchrun jobs
def run_job(
    ranks: int, program: list[str], env: dict[str, str | None], expect_ok: bool = True, options: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    """``program`` on ``ranks`` ranks of one torchrun node (``options`` go to torchrun), only the shim's warnings shown,
    each every time it is issued; it exits 0 or not, as ``expect_ok`` says."""

    def attempt(retry: bool) -> tuple[list[str], dict[str, str]]:  # a new port each time
        environ = clean_env(**{"PYTHONWARNINGS": "ignore,always:fsdp-shim", **env})
        return [*torchrun(ranks), "--tee", "3", *options, *program], environ

    proc, command = run_on_a_free_port(attempt, timeout=300)
    assert expect_ok == (proc.returncode == 0), f"exit {proc.returncode}: {command}\n{proc.stderr[-8000:]}"
    return proc


def torchrun_job(
    tmp_path: Path,
    ranks: int,
    layout: Layout,
    *extra: str,
    api: str = "trainer",
    env: dict[str, str] | None = None,
    options: tuple[str, ...] = (),
    expect_ok: bool = True,
    late: tuple[int, float] | None = None,
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """``tests/scenarios/fsdp_train.py`` in ``run_job``, fsdp_shim imported first on each rank (``FSDP_SHIM=0`` still
    switches a rank off); ``late``: (rank, seconds) that rank's interpreter starts so much later."""
    out = tmp_path / "job"
    arguments = ["--api", api, "--package", layout.package, "--shim", "before", "--devices", str(ranks)]
    program = [str(SCENARIO), *arguments, "--cases", CASE, "--out", str(out), *extra]
    if late is not None:
        wait = f'[ "$RANK" = {late[0]} ] && sleep {late[1]:g}; exec "$@"'
        program = ["--no-python", "bash", "-c", wait, "bash", sys.executable, *program]
    return run_job(ranks, program, env or {}, expect_ok, options), out


def by_rank(proc: subprocess.CompletedProcess[str]) -> dict[int, str]:
    """What each local rank printed (``--tee 3``'s ``[defaultR]:`` prefixes)."""
    lines: dict[int, list[str]] = {}
    for found in re.finditer(r"^\[default(\d+)\]:(.*)$", proc.stdout + proc.stderr, re.M):
        lines.setdefault(int(found[1]), []).append(found[2])
    return {rank: "\n".join(text) for rank, text in lines.items()}


def shim_errors(text: str) -> list[str]:
    """The ``FSDPShimError`` messages in one rank's output, each once (torch repeats an uncaught error's last line)."""
    return list(dict.fromkeys(re.findall(r"FSDPShimError: (fsdp-shim: .*)", text)))


def shim_warnings(text: str) -> list[str]:
    return re.findall(r"FSDPShimWarning: (fsdp-shim: .*)", text)


def confirmations(proc: subprocess.CompletedProcess[str]) -> list[str]:
    """Every "patched on all" line of the job, with the rank that printed it."""
    return re.findall(r"^\[default\d+\]:fsdp-shim: patched on all .*$", proc.stdout + proc.stderr, re.M)


def seconds_waited(line: str) -> float:
    return float(line.rpartition(" in ")[2].removesuffix(" s"))


def assert_bf16(out: Path, ranks: int) -> None:
    results = scenario_results(out, ranks)
    assert [results[rank][CASE]["flat_param_dtypes"] for rank in range(ranks)] == [[BF16]] * ranks, results


def assert_nobody_trained(out: Path, ranks: int) -> None:
    """A stopped job wrote no result: the scenario writes it after training."""
    assert not [rank for rank in range(ranks) if Path(f"{out}.rank{rank}.json").exists()]


def fixed_layout(layouts: dict[str, Layout]) -> Layout:
    """An installed layout whose Trainer has the cast built in (the standalone 2.6.6 of the default session)."""
    for layout in layouts.values():
        if is_fixed_release(layout.trainer_version):
            return layout
    pytest.skip("needs an installed Lightning release with the cast built in")


def fixed_matrix_folder() -> tuple[Path, str]:
    """A ``.matrix`` folder with a unified ``lightning`` that has the cast built in, and its release: what another
    node's ``PYTHONPATH`` gives it (the nox sessions install these folders)."""
    for info in sorted((ROOT / ".matrix").glob("*/lightning-*.dist-info")):
        version = info.name.removeprefix("lightning-").removesuffix(".dist-info")
        if is_fixed_release(version) and (info.parent / "lightning" / "pytorch").is_dir():
            return info.parent, version
    pytest.skip("needs a .matrix folder with a fixed unified lightning (nox -s tests-lightning-2.6.6 makes one)")


# ----------------------------------------------------------------------------- ranks that agree
def test_trainer_ranks_agree_once_per_process_group_waiting_for_a_late_rank(tmp_path, layouts):
    """Trainer, 2 ranks, on a Lightning with the cast built in (the shim leaves its ``convert_module`` alone), default
    settings, lazy gloo (as NCCL: rank 0 joins the group at once); rank 1's interpreter starts the grace + 12 s late,
    and the wait's grace starts only once every rank joined. Fit, validate, test and predict run in the same process
    group, a Trainer each: rank zero's one line says the check ran once, and waited past the grace."""
    layout = fixed_layout(layouts)
    extra = ("--stages", "fit,validate,test,predict")
    proc, out = torchrun_job(tmp_path, 2, layout, *extra, env={"TORCH_GLOO_LAZY_INIT": "1"}, late=(1, GRACE + 12))
    assert_bf16(out, 2)
    results = scenario_results(out, 2)
    for rank in range(2):
        assert results[rank][CASE]["stages"] == ["fit", "validate", "test", "predict"]
        assert results[rank]["_shim"]["trainer_convert_module"] is False, results[rank]["_shim"]
    (line,) = confirmations(proc)
    expected = "[default0]:fsdp-shim: patched on all 2 ranks (bfloat16; fixes: cast (Lightning's own), recompute)"
    assert line.startswith(f"{expected}, confirmed in "), line
    assert GRACE < seconds_waited(line) < 120, line
    assert not shim_warnings(proc.stdout + proc.stderr)


def test_fabric_ranks_agree_with_an_extra_model_and_unbounded_waits(tmp_path, layouts):
    """Fabric, 3 ranks; rank 0 sets up one more model than the others (it converts twice, they once), and waits with
    ``FSDP_SHIM_RANK_CHECK_TIMEOUT=1e20``, rank 1 with ``inf``: both mean as long as it takes, so both wait for rank 2,
    which joins 6 s late, silently. The job trains, and rank zero says so once."""
    layout = affected_layout(layouts)
    extra = ("--delay-rank", "2:6", "--extra-model-on-rank", "0")
    timeouts = ("--env-on-rank", "0:FSDP_SHIM_RANK_CHECK_TIMEOUT=1e20")
    timeouts += ("--env-on-rank", "1:FSDP_SHIM_RANK_CHECK_TIMEOUT=inf")
    proc, out = torchrun_job(tmp_path, 3, layout, *extra, *timeouts, api="fabric")
    assert_bf16(out, 3)
    (line,) = confirmations(proc)
    assert line.startswith("[default0]:fsdp-shim: patched on all 3 ranks (bfloat16; fixes: cast, recompute), "), line
    assert 4 <= seconds_waited(line) < 60, line
    assert not shim_warnings(proc.stdout + proc.stderr)


def test_timeout_zero_switches_the_check_off(tmp_path, layouts):
    """With ``FSDP_SHIM_RANK_CHECK_TIMEOUT=0``, a half-patched job trains as it would without the check: rank 1 in
    float32 with twice rank 0's bytes, exit 0, nothing said."""
    layout = affected_layout(layouts)
    env = {"FSDP_SHIM_RANK_CHECK_TIMEOUT": "0"}
    proc, out = torchrun_job(tmp_path, 2, layout, "--shim-off-rank", "1", env=env)
    on, off = (scenario_results(out, 2)[rank][CASE] for rank in range(2))
    assert (on["flat_param_dtypes"], off["flat_param_dtypes"]) == ([BF16], [DTYPES["32-true"]])
    assert all(off[key] == 2 * on[key] for key in BYTE_KEYS), (on, off)
    assert not confirmations(proc) and not shim_errors(proc.stdout + proc.stderr)


# ----------------------------------------------------------------------------- ranks that do not
def test_a_rank_without_the_shim_stops_the_job_within_a_minute_by_default(tmp_path, layouts):
    """Trainer, 2 ranks, on a Lightning with the cast built in, rank 1 with ``FSDP_SHIM=0``, every setting default (the
    group's 1,800 s timeout), not strict: rank 0 stops in the strategy's ``setup_environment`` 30 s after every rank
    joined the group, naming rank 1 without a dtype it never sent and saying what rank 0 runs. Nobody trains."""
    layout = fixed_layout(layouts)
    started = time.monotonic()
    proc, out = torchrun_job(
        tmp_path, 2, layout, "--shim-off-rank", "1", env={"FSDP_SHIM_STRICT": "0"}, expect_ok=False
    )
    wall = time.monotonic() - started
    output = by_rank(proc)
    (message,) = shim_errors(output[0])
    assert message.startswith(
        f"fsdp-shim: rank 1 of 2 joined the process group but did not report within {GRACE} s which fixes it runs, so "
        f"this job may be half-patched (rank 0 on {HOST}: bfloat16; fixes: cast (Lightning's own), recompute "
        f"(pytorch_lightning {layout.trainer_version}, fsdp-shim {SHIM_VERSION})). Stopping before any model"
    ), message
    assert "FSDP_SHIM=0 in its environment" in message and DOCS in message, message
    assert "float32" not in message, message
    assert "in confirm_every_rank_after_setup" in output[0]
    assert not shim_errors(output.get(1, "")), "rank 1 has no shim to raise"
    assert_nobody_trained(out, 2)
    print(f"half-patched job stopped after {wall:.0f} s")
    assert GRACE < wall < 90, wall


def test_without_the_variable_the_wait_is_the_process_groups_timeout(tmp_path, layouts):
    """Fabric, 3 ranks, strict mode, ``FSDPStrategy(timeout=10 s)``; ``FSDP_SHIM_RANK_CHECK_TIMEOUT`` unset on rank 0,
    ``abc`` on rank 1, and rank 2 with ``FSDP_SHIM=0``. Ranks 0 and 1 wait the group's own 10 s, so the shim names the
    cause before torch's first collective would time out. ``abc`` warns once, on its rank only; strict mode makes
    no error of it."""
    layout = affected_layout(layouts)
    extra = ("--process-group-timeout", "10", "--env-on-rank", "1:FSDP_SHIM_RANK_CHECK_TIMEOUT=abc")
    env = {"FSDP_SHIM_STRICT": "1"}
    proc, out = torchrun_job(
        tmp_path, 3, layout, *extra, "--shim-off-rank", "2", api="fabric", env=env, expect_ok=False
    )
    output = by_rank(proc)
    (message,) = shim_errors(output[0])
    assert message.startswith("fsdp-shim: rank 2 of 3 did not report within 10 s which fixes it runs"), message
    assert shim_errors(output[1]) in ([], [message]), output[1][-3000:]  # unless torchrun ended it first
    assert shim_warnings(output[0]) == []
    assert shim_warnings(output[1]) == [
        "fsdp-shim: FSDP_SHIM_RANK_CHECK_TIMEOUT='abc' is not a number of seconds >= 0; the cross-rank check waits as "
        "long as the process group's timeout (10 s)"
    ], output[1][-3000:]
    assert_nobody_trained(out, 3)


def test_ranks_that_run_other_fixes_or_dtypes_stop_the_job(tmp_path, layouts):
    """Trainer, 4 ranks, each with the shim, on Lightning 2.4.0: rank 1 configured for 16-true; rank 2's
    ``PYTHONPATH`` gives it a Lightning with the cast built in and ``FSDP_SHIM_DISABLED_FIXES=recompute``; rank 3's
    torch checkpoint calls names the shim did not wrap (its recompute fix is not in effect for the non-reentrant
    checkpoint). Every rank stops before any model is wrapped, naming each rank with its fixes and release."""
    layout = affected_layout(layouts, "lightning")
    folder, version = fixed_matrix_folder()
    extra = ("--precision-on-rank", "1:16-true", "--env-on-rank", f"2:PYTHONPATH={folder}")
    extra += ("--env-on-rank", "2:FSDP_SHIM_DISABLED_FIXES=recompute")
    extra += ("--env-on-rank", "3:FSDP_SHIM_TEST_HIDE_CHECKPOINT_INTERNALS=1")
    env = {"FSDP_SHIM_RANK_CHECK_TIMEOUT": "60"}
    proc, out = torchrun_job(tmp_path, 4, layout, *extra, env=env, expect_ok=False)
    ours, theirs = (
        f"(lightning.pytorch {release}, fsdp-shim {SHIM_VERSION})" for release in (layout.trainer_version, version)
    )
    ranks = [
        f"rank 0 on {HOST}: bfloat16; fixes: cast, recompute {ours}",
        f"rank 1 on {HOST}: float16; fixes: cast, recompute {ours}",
        f"rank 2 on {HOST}: bfloat16; fixes: cast (Lightning's own) {theirs}",
        f"rank 3 on {HOST}: bfloat16; fixes: cast, recompute (except the non-reentrant checkpoint) {ours}",
    ]
    expected = (
        f"fsdp-shim: the 4 ranks of this job run different fixes or dtypes ({'; '.join(ranks)}), so their shards, "
        "gradients and optimizer state would not match. Stopping before any model is wrapped."
    )
    output = by_rank(proc)
    for rank in range(4):
        (message,) = shim_errors(output[rank])
        assert message.startswith(expected), (rank, message)
    assert_nobody_trained(out, 4)


def test_an_elastic_restart_without_the_shim_stops_the_job(tmp_path, layouts):
    """torchrun ``--max-restarts 1``: the first attempt passes the check and trains, then rank 1 dies and comes back
    with ``FSDP_SHIM=0``. torchrun's store outlives the restart, and the second attempt must not count the first's
    keys: rank 0 stops naming rank 1, and "patched on all 2 ranks" is said once, by the first attempt."""
    layout = affected_layout(layouts)
    env = {"FSDP_SHIM_RANK_CHECK_TIMEOUT": "5"}
    options = ("--max-restarts", "1")
    proc, out = torchrun_job(
        tmp_path, 2, layout, "--restart-without-shim", "1", env=env, options=options, expect_ok=False
    )
    output = by_rank(proc)
    assert "fails once after training" in output[1], output[1][-3000:]
    assert len(confirmations(proc)) == 1, confirmations(proc)
    assert output[0].index("patched on all 2 ranks") < output[0].index("FSDPShimError")
    (message,) = shim_errors(output[0])
    assert message.startswith("fsdp-shim: rank 1 of 2 did not report within 5 s which fixes it runs"), message
    assert not Path(f"{out}.rank1.json").exists()


# ----------------------------------------------------------------------------- every strategy, a paused rank
STRATEGY_JOB = """\
import os, signal, subprocess, sys
api, strategy = sys.argv[1:3]
rank = os.environ.get("RANK", "0")  # torchrun sets it; ddp_fork forks after this
if rank in os.environ.get("OFF_RANKS", "").split(","):
    os.environ["FSDP_SHIM"] = "0"
if rank in os.environ.get("UNCHECKED_RANKS", "").split(","):
    os.environ["FSDP_SHIM_RANK_CHECK_TIMEOUT"] = "0"
import fsdp_shim  # noqa: F401
import torch
import torch.distributed
from torch.utils.checkpoint import checkpoint
from lightning.fabric import Fabric, strategies as fabric_strategies
from lightning.pytorch import LightningModule, Trainer, strategies as trainer_strategies

pause = dict(item.split(":") for item in os.environ.get("PAUSE", "").split(",") if item)
if rank in pause:  # stopped right after joining the process group, as by a debugger or a suspended node
    joining = torch.distributed.init_process_group

    def joined_then_stopped(*args, **kwargs):
        joining(*args, **kwargs)
        subprocess.Popen(["sh", "-c", f"sleep {pause[rank]}; kill -CONT {os.getpid()}"])
        os.kill(os.getpid(), signal.SIGSTOP)

    torch.distributed.init_process_group = joined_then_stopped


class Block(torch.nn.Module):  # makes a default-dtype tensor, as rotary embeddings do
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        return checkpoint(lambda x: self.linear(x) * torch.linspace(0, 1, 8), x, use_reentrant=False).float().sum()


def fully_shard(module, mesh):
    from torch.distributed._composable.fsdp import fully_shard

    return fully_shard(module, mesh=mesh["data_parallel"])


sizes, parallel = dict(data_parallel_size=2, tensor_parallel_size=1), strategy == "model_parallel"
if api == "fabric":
    ddp = fabric_strategies.DDPStrategy
    chosen = fabric_strategies.ModelParallelStrategy(fully_shard, **sizes) if parallel else ddp()
    fabric = Fabric(accelerator="cpu", devices=2, strategy=chosen, precision="bf16-true")
    fabric.launch()
    with fabric.init_module():
        block = Block()
    fabric.backward(fabric.setup(block)(torch.ones(4, 8)))
else:
    class Module(LightningModule):
        def __init__(self):
            super().__init__()
            self.block = Block()

        def configure_model(self):
            if parallel:
                fully_shard(self.block, self.device_mesh)

        def training_step(self, batch, index):
            return self.block(batch)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    chosen = trainer_strategies.ModelParallelStrategy(**sizes) if parallel else trainer_strategies.DDPStrategy()
    chosen = "ddp_fork" if strategy == "ddp_fork" else chosen
    options = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer = Trainer(accelerator="cpu", devices=2, strategy=chosen, precision="bf16-true", max_steps=1, **options)
    trainer.fit(Module(), torch.utils.data.DataLoader(torch.ones(4, 8), batch_size=2))
print("trained", flush=True)
if torch.distributed.is_initialized():  # ddp_fork: only the forked ranks have one
    torch.distributed.destroy_process_group()  # as torch asks: without it, gloo's threads may abort the exit
"""


def strategy_job(
    tmp_path: Path, api: str, strategy: str, expect_ok: bool, **env: str
) -> tuple[subprocess.CompletedProcess[str], dict[int, str]]:
    """``STRATEGY_JOB`` on two torchrun ranks (unified ``lightning``): a checkpointed block in bf16-true."""
    script = tmp_path / "strategy_job.py"
    script.write_text(STRATEGY_JOB)
    proc = run_job(2, [str(script), api, strategy], env, expect_ok)
    return proc, by_rank(proc)


@pytest.mark.parametrize("api", ["trainer", "fabric"])
@pytest.mark.parametrize("strategy", ["ddp", "model_parallel"])
@pytest.mark.parametrize("half", [True, False], ids=["half-patched", "fully-patched"])
def test_every_strategy_that_runs_a_fix_checks_its_ranks(tmp_path, layouts, api, strategy, half):
    """DDP and ModelParallel (FSDP2), Trainer and Fabric, bf16-true, a checkpointed block that makes a default-dtype
    tensor. Rank 1 with ``FSDP_SHIM=0``: rank 0 names it and nobody trains (unchecked, rank 1 recomputed in float32:
    a ``CheckpointError`` naming no cause). Every rank with the shim: one "patched on all" line, and both train."""
    layout = affected_layout(layouts, "lightning", fix="recompute")
    if strategy == "model_parallel" and (base_release(layout.version(api)) or (0,)) < (2, 3, 0):
        pytest.skip(f"Lightning {layout.version(api)} has no ModelParallelStrategy")
    env = {"FSDP_SHIM_RANK_CHECK_TIMEOUT": "2", "OFF_RANKS": "1"} if half else {}  # the default wait: below
    proc, output = strategy_job(tmp_path, api, strategy, expect_ok=not half, **env)
    namespace = "lightning.fabric" if api == "fabric" else "lightning.pytorch"
    if half:
        (message,) = shim_errors(output[0])
        assert message.startswith(
            f"fsdp-shim: rank 1 of 2 did not report within 2 s which fixes it runs, so this job may be half-patched "
            f"(rank 0 on {HOST}: bfloat16; fixes: cast, recompute ({namespace} {layout.version(api)}, "
        ), message
        assert "trained" not in output[0] and "CheckpointError" not in proc.stdout + proc.stderr
        return
    (line,) = confirmations(proc)
    assert line.startswith("[default0]:fsdp-shim: patched on all 2 ranks (bfloat16; fixes: cast, recompute), "), line
    assert all("trained" in output[rank] for rank in range(2)), proc.stdout[-3000:]


def test_a_rank_that_switched_its_check_off_is_named_as_one_without_the_shim(tmp_path, layouts):
    """Trainer, DDP, default settings but ``FSDP_SHIM_RANK_CHECK_TIMEOUT=0`` on rank 1: rank 1 never reports, so it
    must not say at the rendezvous that it has the shim either; rank 0 names it 30 s after it joined, as a rank
    without the shim, not after the group's 30 minutes."""
    affected_layout(layouts, "lightning", fix="recompute")
    started = time.monotonic()
    _, output = strategy_job(tmp_path, "trainer", "ddp", expect_ok=False, UNCHECKED_RANKS="1")
    (message,) = shim_errors(output[0])
    assert message.startswith(f"fsdp-shim: rank 1 of 2 joined the process group but did not report within {GRACE} s"), (
        message
    )
    assert "had fsdp-shim" not in message and time.monotonic() - started < 120, message


def test_lightnings_own_fork_launcher_checks_its_ranks(tmp_path, layouts):
    """Trainer, ``strategy="ddp_fork"``: Lightning's launcher forks the ranks of one process the shim is active in;
    each rank checks in the set-up, and rank zero says every rank agrees, once. The job trains."""
    affected_layout(layouts, "lightning", fix="recompute")
    script = tmp_path / "strategy_job.py"
    script.write_text(STRATEGY_JOB)
    proc = run_command([sys.executable, str(script), "trainer", "ddp_fork"], env=clean_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-5000:]
    output = proc.stdout + proc.stderr
    said = re.findall(r"^fsdp-shim: patched on all .*$", output, re.M)
    assert [line.rpartition(", confirmed in")[0] for line in said] == [
        "fsdp-shim: patched on all 2 ranks (bfloat16; fixes: cast, recompute)"
    ], output[-3000:]
    assert "trained" in output and not shim_errors(output), output[-3000:]


def test_a_rank_stopped_right_after_joining_is_waited_for(tmp_path, layouts):
    """Trainer, DDP, default settings: rank 1 is stopped (SIGSTOP) for the grace + 10 s right after
    ``init_process_group`` returns. It said at the rendezvous that it has the shim, so rank 0 waits for it past the
    grace, and the job trains; a rank without the shim is still named 30 s after joining (the FSDP test above)."""
    affected_layout(layouts, "lightning", fix="recompute")
    proc, output = strategy_job(tmp_path, "trainer", "ddp", expect_ok=True, PAUSE=f"1:{GRACE + 10}")
    (line,) = confirmations(proc)
    assert line.startswith("[default0]:fsdp-shim: patched on all 2 ranks (bfloat16; fixes: cast, recompute)"), line
    assert GRACE + 5 < seconds_waited(line) < 120, line
    assert all("trained" in output[rank] for rank in range(2)), proc.stdout[-3000:]
    assert not shim_errors(proc.stdout + proc.stderr)


# ----------------------------------------------------------------------------- the wait and the words, in process
def test_the_timeout_variable_is_read_as_seconds():
    """Unset: the process group's timeout (``None``). Seconds as a float; ``0`` switches the check off; more than a
    year (``1e20``, ``inf``) is a year, which every store accepts; a value that is no wait says why."""
    read = {value: rank_check_timeout({"FSDP_SHIM_RANK_CHECK_TIMEOUT": value}) for value in (" 12.5 ", "0", "")}
    assert read == {" 12.5 ": (12.5, None), "0": (0, None), "": (None, None)} and rank_check_timeout({}) == (None, None)
    for value in ("1e20", "inf", "Infinity"):
        assert rank_check_timeout({"FSDP_SHIM_RANK_CHECK_TIMEOUT": value}) == (365 * 24 * 3600, None), value
    for value in ("abc", "-1", "nan", "-inf", "5s"):
        problem = f"FSDP_SHIM_RANK_CHECK_TIMEOUT={value!r} is not a number of seconds >= 0"
        assert rank_check_timeout({"FSDP_SHIM_RANK_CHECK_TIMEOUT": value}) == (None, problem), value


def test_a_silent_rank_is_named_without_a_dtype_it_did_not_send():
    """The message describes only what the ranks that reported sent (alike ranks together, with hosts and releases),
    never a guess at a silent rank's dtype; whether the silent ranks were seen to join, and which of them said at the
    rendezvous that they have the shim, decide the causes it gives."""
    sent = {"summary": "bfloat16; fixes: cast, recompute", "host": "n1", "namespace": "lightning.pytorch"}
    sent |= {"lightning": "2.4.0", "fsdp_shim": "0.3.0"}
    reports = {0: sent, 2: {**sent, "host": "n2"}}
    late = str(failures.rank_check_error([1], reports, 3, 2, False, []))
    assert late.startswith(
        "fsdp-shim: rank 1 of 3 did not report within 2 s which fixes it runs, so this job may be half-patched "
        "(ranks 0, 2 on n1, n2: bfloat16; fixes: cast, recompute (lightning.pytorch 2.4.0, fsdp-shim 0.3.0))."
    ), late
    assert "FSDP_SHIM=0 in its environment" in late and "still busy after 2 s" in late and late.endswith(DOCS)
    assert set(re.findall(r"\b(b?float\d+)\b", late)) == {"bfloat16"}, late
    silent = str(failures.rank_check_error([1], reports, 3, 30, True, []))
    assert "rank 1 of 3 joined the process group but did not report within 30 s" in silent
    assert "still busy 30 s after joining it" in silent, silent
    paused = str(failures.rank_check_error([1], reports, 3, 1800, False, [1]))
    assert "within 1800 s which fixes it runs (rank 1 had fsdp-shim when joining the group), so" in paused, paused
    assert "paused since (a debugger" in paused and "FSDP_SHIM=0" not in paused, paused
    some = str(failures.rank_check_error([1, 2], {0: sent}, 3, 1800, False, [2]))
    assert "ranks 1, 2 of 3 did not report within 1800 s which fixes it runs (rank 2 had fsdp-shim when" in some
    assert "FSDP_SHIM=0 in its environment" in some, some


# ----------------------------------------------------------------------------- on torch alone
BARE_JOB = """\
import json, os, sys, time
from datetime import timedelta

rank, case = int(os.environ["RANK"]), sys.argv[1]
if rank == 1 and case == "early_end":
    time.sleep({late_by})  # a slow start, before importing torch; it never reports, as a rank without the shim
import torch
import torch.distributed as dist
from _fsdp_shim import rank_check
from _fsdp_shim.failures import FSDPShimError

if "{backend}" == "nccl":
    torch.cuda.set_device(rank)
joining = time.time()
dist.init_process_group("{backend}", timeout=timedelta(seconds={wait} + 60))  # longer than rank 0's wait
store, result = dist.distributed_c10d._get_default_store(), {{"rank": rank, "joining": joining}}
if case == "early_end" and rank == 0:
    rank_check.POLL_SECONDS = 0.2
    result.update(checking=time.time(), joined_then=store.check(["cpu//0/0", "cpu//0/1"]))
    reports, early = rank_check.exchange(store, 1, 0, 2, {{"rank": 0}}, {wait}, {grace}, None)
    result.update(ended=time.time(), reported=sorted(reports), early=early)
if case == "garbled":  # rank 1 reports what no fsdp-shim writes; rank 0's check cannot read it
    if rank == 1:
        store.set(rank_check._key("1", 1), "{{garbled")
    else:
        try:
            rank_check.confirm_every_rank("lightning.pytorch", torch.bfloat16, joined_here=True)
        except FSDPShimError as error:
            result.update(raised=str(error))
    dist.barrier()
print(json.dumps(result), flush=True)
"""
WAIT, SHORT_GRACE = 20.0, 2.0  # rank 0's whole wait, and its grace, in ``BARE_JOB``'s early end


def bare_job(tmp_path: Path, case: str, backend: str = "gloo", **env: str | None) -> tuple[dict[int, str], list[dict]]:
    """``BARE_JOB``'s ``case`` on two torchrun ranks, no Lightning (in ``early_end`` rank 1 starts 4 s late): each
    rank's output, and the JSON each printed last."""
    script = tmp_path / "bare_job.py"
    script.write_text(BARE_JOB.format(backend=backend, late_by=4.0, wait=WAIT, grace=SHORT_GRACE))
    output = by_rank(run_job(2, [str(script), case], env))
    return output, [json.loads(re.findall(r"^\{.*$", text, re.M)[-1]) for _, text in sorted(output.items())]


def cuda_devices() -> int:
    """GPUs ``nvidia-smi`` lists (this process imports no torch)."""
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60).stdout.count("GPU ")
    except (OSError, subprocess.TimeoutExpired):
        return 0


@pytest.mark.per_torch  # torch's own store keys and gloo
@pytest.mark.parametrize("backend", ["gloo", "lazy gloo", "nccl"])
def test_the_early_end_waits_for_every_rank_to_join_the_process_group(tmp_path, backend):
    """Rank 0 reports and waits; rank 1 starts 4 s late and never reports. gloo ends the wait early, never sooner
    than the grace after rank 1 began to join: eager gloo holds rank 0 in ``init_process_group`` until rank 1 arrives;
    lazy gloo lets rank 0 check at once, and the grace starts when rank 1's address is in the store. NCCL (two GPUs)
    writes no address: the whole wait."""
    if backend == "nccl" and cuda_devices() < 2:
        pytest.skip("needs two GPUs (nvidia-smi -L)")
    torch = importlib.metadata.version("torch")
    if backend == "lazy gloo" and tuple(map(int, re.findall(r"\d+", torch)[:2])) < (2, 8):
        pytest.skip(f"torch {torch} has no lazy gloo (TORCH_GLOO_LAZY_INIT, torch 2.8)")
    lazy = backend == "lazy gloo"
    _, (checker, silent) = bare_job(
        tmp_path, "early_end", backend.split()[-1], TORCH_GLOO_LAZY_INIT="1" if lazy else None
    )
    assert checker["reported"] == [0], checker
    if backend == "nccl":
        assert not checker["joined_then"] and not checker["early"], checker
        assert checker["ended"] - checker["checking"] >= WAIT, checker
        return
    assert checker["early"] and checker["ended"] - checker["checking"] < WAIT, checker
    assert checker["ended"] >= silent["joining"] + SHORT_GRACE, (checker, silent)
    assert checker["joined_then"] is not lazy, checker
    assert not lazy or checker["checking"] < silent["joining"], (checker, silent)


@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict"])
def test_a_check_that_cannot_run_follows_the_failure_policy(tmp_path, strict):
    """Rank 1's report is garbled (no fsdp-shim writes it): rank 0's check cannot read it, so it warns and goes on,
    or in strict mode raises ``FSDPShimError`` saying so; it never names a disagreement it could not see."""
    output, results = bare_job(tmp_path, "garbled", FSDP_SHIM_STRICT="1" if strict else "0")
    said = "fsdp-shim: could not check that every rank of this job runs the same fixes (JSONDecodeError: "
    if strict:
        assert results[0]["raised"].startswith(said), results[0]
        assert not shim_warnings(output[0]), output[0][-3000:]
        return
    assert "raised" not in results[0] and [w[: len(said)] for w in shim_warnings(output[0])] == [said], output[0]
    assert "training goes on unchecked" in output[0] and not shim_errors(output[0]), output[0][-3000:]
