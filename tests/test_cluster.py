"""Every rank or none: the rank check, on ranks that torchrun starts, and on real cluster launchers.

**The rank check** (``_fsdp_shim/rank_check.py``; every test here up to the cluster section, in the
default session). Real FSDP through Lightning's Trainer and Fabric (gloo, CPU), each rank its own
process started by torchrun, as on a cluster; a rank is set apart the way a node is: ``FSDP_SHIM=0``,
another ``FSDP_SHIM_RANK_CHECK_TIMEOUT``, another Lightning on its ``PYTHONPATH``, a late start, a
restart (``tests/scenarios/fsdp_train.py``'s per-rank options), an interpreter that starts late; the
early end's evidence on the torch in hand, in two ranks of a bare process group (``per_release``: the
torch sessions run it on torch 2.3 and the newest). torchrun's ``--tee 3`` prefixes every
line with the local rank (``[default1]:``), so each assertion reads the rank it is about. The
expected line and messages are built from ``_fsdp_shim.config`` (which fixes a release lacks or ships)
and the layouts installed, and the expected dtypes and bytes from other runs of the same job.

**Real cluster launchers** (the section at the end; only in the ``cluster`` nox session, which
installs and starts SLURM, sets ``FSDP_SHIM_TEST_CLUSTER=1`` and ``SLURM_CONF``, and stops the
daemons afterwards: ``nox -s cluster``): a real SLURM (two slurmd "nodes" on this machine) and two
torchrun nodes side by side on loopback, running real FSDP (Trainer and Fabric, bf16-true) in every
way the shim can be activated, with the dtype and the exact bytes checked on every rank. Expected
bytes are computed, not written down: the ``FSDP_SHIM=0`` run of the same job (float32, checked)
holds exactly twice each rank's bytes of a correctly converted bfloat16 run, because every tensor of
the models in ``tests/scenarios/fsdp_train.py`` shards without padding. Each test prints a table
(rank, node, API, dtype, bytes) for the log.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    BYTE_KEYS,
    CHILD,
    DTYPES,
    FSDP_SHIM,
    NAMESPACES,
    ROOT,
    SCENARIO,
    Layout,
    affected_layout,
    clean_env,
    free_port,
    is_fixed_release,
    make_venv,
    run_on_a_free_port,
    scenario_results,
    torchrun,
)

from _fsdp_shim._version import __version__ as shim_version
from _fsdp_shim.config import (
    FIXES,
    MAX_RANK_CHECK_SECONDS,
    RANK_CHECK_TIMEOUT_VARIABLE,
    Release,
    base_release,
    rank_check_timeout,
)
from _fsdp_shim.rank_check import GRACE_SECONDS
from _fsdp_shim.startup_files import PTH_NAME

CASE = "init+pretrained:bf16-true"
"""A layer built in ``__init__`` and an fp32 ``from_pretrained``-style one: float32 on 2.4.0 without the cast."""
BF16 = DTYPES["bf16-true"]
SHOWN_WARNINGS = "ignore,always:fsdp-shim"
"""Every warning off (Lightning's are noise here) but the shim's, each one shown every time it is issued,
so a count of them is the shim's own "once". (A filter by category cannot name the shim's class: at
start-up, Python could not import ``_fsdp_shim`` here to resolve it, "Invalid -W option ignored".)"""
JOB_TIMEOUT = 300
"""Seconds a torchrun job of this section may take (about 10-30 s here)."""


# ----------------------------------------------------------------------------- torchrun jobs of the rank check
def torchrun_job(
    tmp_path: Path,
    name: str,
    ranks: int,
    *,
    api: str = "trainer",
    package: str,
    extra: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    options: tuple[str, ...] = (),
    expect_ok: bool = True,
    timeout: float = JOB_TIMEOUT,
    late: tuple[int, float] | None = None,
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """``tests/scenarios/fsdp_train.py`` on ``ranks`` ranks of one torchrun node (``options`` go to
    torchrun: ``--max-restarts``), fsdp_shim imported first on every rank (``FSDP_SHIM=0`` still switches
    a rank off), with ``--tee 3`` and only the shim's warnings shown. ``late``: (rank, seconds) that rank's
    interpreter starts so much later (a slow node; ``--delay-rank`` delays a rank that has joined the group).
    ``run_scenario`` has no place for torchrun's options."""
    out = tmp_path / name
    arguments = ["--api", api, "--package", package, "--shim", "before", "--devices", str(ranks)]
    arguments += ["--cases", CASE, "--out", str(out), *extra]
    program = [str(SCENARIO)]
    if late is not None:
        wait = f'[ "$RANK" = {late[0]} ] && sleep {late[1]:g}; exec "$@"'
        program = ["--no-python", "bash", "-c", wait, "bash", sys.executable, str(SCENARIO)]

    def attempt(retry: bool) -> tuple[list[str], dict[str, str]]:
        command = [*torchrun(ranks), "--tee", "3", *options, *program, *arguments]
        return command, clean_env(PYTHONWARNINGS=SHOWN_WARNINGS, **(env or {}))

    proc, command = run_on_a_free_port(attempt, timeout)
    if expect_ok != (proc.returncode == 0):
        raise AssertionError(
            f"expected {'success' if expect_ok else 'failure'}, got exit {proc.returncode}: {shlex.join(command)}\n"
            f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
        )
    return proc, out


def by_rank(proc: subprocess.CompletedProcess[str]) -> dict[int, str]:
    """What each local rank printed (``--tee 3``'s ``[defaultR]:`` prefixes), by rank."""
    lines: dict[int, list[str]] = {}
    for line in (proc.stdout + proc.stderr).splitlines():
        found = re.match(r"\[default(\d+)\]:(.*)", line)
        if found:
            lines.setdefault(int(found[1]), []).append(found[2])
    return {rank: "\n".join(text) for rank, text in lines.items()}


def shim_errors(text: str) -> list[str]:
    """The ``FSDPShimError`` messages in one rank's output, each once (torch repeats an uncaught
    exception's last line under its ``[rankR]:`` prefix)."""
    found = re.findall(r"FSDPShimError: (fsdp-shim: .*)", text)
    return list(dict.fromkeys(found))


def shim_warnings(text: str) -> list[str]:
    return re.findall(r"FSDPShimWarning: (fsdp-shim: .*)", text)


def confirmations(proc: subprocess.CompletedProcess[str]) -> list[str]:
    """Every "patched on all" line of the job, whichever rank printed it."""
    return [line for line in (proc.stdout + proc.stderr).splitlines() if "fsdp-shim: patched on all" in line]


def summary(version: str, dtype: str = BF16) -> str:
    """What the rank check says a rank runs on ``version``, from the fixes' own release ranges:
    ``bfloat16; fixes: cast, recompute`` (2.4.0) or ``...; fixes: cast (Lightning's own), recompute`` (2.6.6)."""
    fixes = [
        f"{fix.name} (Lightning's own)" if fix.built_in(version) else fix.name
        for fix in FIXES
        if fix.built_in(version) or fix.affects(version)
    ]
    return f"{dtype.removeprefix('torch.')}; fixes: {', '.join(fixes)}"


def reported(ranks: str, namespace: str, version: str, dtype: str = BF16) -> str:
    """How a message describes ranks that reported: ``rank 0 on HOST: bfloat16; fixes: cast, recompute
    (lightning.pytorch 2.4.0, fsdp-shim 0.2.0)`` (every rank of these jobs runs on this machine)."""
    noun = "rank" if "," not in ranks else "ranks"
    releases = f"({namespace} {version}, fsdp-shim {shim_version})"
    return f"{noun} {ranks} on {socket.gethostname()}: {summary(version, dtype)} {releases}"


def confirmation(ranks: int, version: str) -> str:
    return f"fsdp-shim: patched on all {ranks} ranks ({summary(version)}), confirmed in "


def seconds_waited(line: str) -> float:
    return float(line.rpartition(" in ")[2].removesuffix(" s"))


def assert_nobody_trained(out: Path, ranks: int) -> None:
    """A stopped job wrote no result: the scenario writes it after training."""
    written = [rank for rank in range(ranks) if Path(f"{out}.rank{rank}.json").exists()]
    assert not written, f"ranks {written} finished training"


def fixed_layout(layouts: dict[str, Layout]) -> Layout:
    """An installed layout whose Trainer has the cast built in (the standalone 2.6.6 of the default session)."""
    for layout in layouts.values():
        if is_fixed_release(layout.trainer_version):
            return layout
    pytest.skip("needs an installed Lightning release with the cast built in")


def fixed_matrix_folder() -> tuple[Path, str]:
    """A ``.matrix`` folder holding a unified ``lightning`` with the cast built in, and its release: what
    another node's ``PYTHONPATH`` gives it (the nox sessions install these folders)."""
    for info in sorted((ROOT / ".matrix").glob("*/lightning-*.dist-info")):
        version = info.name.removeprefix("lightning-").removesuffix(".dist-info")
        if is_fixed_release(version) and (info.parent / "lightning" / "pytorch").is_dir():
            return info.parent, version
    pytest.skip("needs a .matrix folder with a fixed unified lightning (nox -s tests-lightning-2.6.6 makes one)")


# ----------------------------------------------------------------------------- ranks that agree
def test_fit_validate_test_and_predict_are_checked_once_per_process_group(tmp_path, layouts):
    """Trainer, 2 ranks: fit, then validate, test and predict (a Trainer and a model each) in the same
    processes, so the same process group. Every rank trains in bfloat16, and rank zero says so in one
    line, though each stage converts a model: the check runs once per process group (5f37aee checked
    and printed once per conversion: four lines). The line names the dtype and the fixes, and how long
    the check waited: rank 1 reached its FSDP setup 6 s late, and the check waited for it, no longer."""
    layout = affected_layout(layouts)
    proc, out = torchrun_job(
        tmp_path,
        "stages",
        2,
        package=layout.package,
        extra=("--delay-rank", "1:6", "--stages", "fit,validate,test,predict"),
    )
    results = scenario_results(out, 2)
    for rank in range(2):
        assert results[rank][CASE]["flat_param_dtypes"] == [BF16], (rank, results[rank][CASE])
        assert results[rank][CASE]["stages"] == ["fit", "validate", "test", "predict"]
    lines = confirmations(proc)
    assert len(lines) == 1, "\n".join(lines) or proc.stderr[-4000:]
    assert lines[0].startswith(f"[default0]:{confirmation(2, layout.trainer_version)}"), lines
    assert 4 <= seconds_waited(lines[0]) < 60, lines
    assert not shim_warnings(proc.stdout + proc.stderr)


def test_fabric_ranks_agree_with_an_extra_model_and_unbounded_waits(tmp_path, layouts):
    """Fabric, 4 ranks, rank 3 late by 6 s. Rank 0 sets up one more model than the others (a
    ``setup_module`` only rank zero runs, before the common one), so it converts twice and the others
    once: the job trains, no false stop (5f37aee paired rank 0's second conversion with a third the
    others never made, and stopped). Rank 0 waits with ``FSDP_SHIM_RANK_CHECK_TIMEOUT=1e20`` and rank 1
    with ``inf``: both mean "as long as it takes" (clamped to a year), so both wait for rank 3, silently
    (5f37aee: 1e20 overflowed the store's wait, a warning and no check; inf was refused with a warning)."""
    layout = affected_layout(layouts)
    proc, out = torchrun_job(
        tmp_path,
        "fabric",
        4,
        api="fabric",
        package=layout.package,
        extra=(
            "--delay-rank",
            "3:6",
            "--extra-model-on-rank",
            "0",
            "--env-on-rank",
            f"0:{RANK_CHECK_TIMEOUT_VARIABLE}=1e20",
            "--env-on-rank",
            f"1:{RANK_CHECK_TIMEOUT_VARIABLE}=inf",
        ),
    )
    results = scenario_results(out, 4)
    for rank in range(4):
        assert results[rank][CASE]["flat_param_dtypes"] == [BF16], (rank, results[rank][CASE])
    lines = confirmations(proc)
    assert len(lines) == 1, "\n".join(lines) or proc.stderr[-4000:]
    assert lines[0].startswith(f"[default0]:{confirmation(4, layout.fabric_version)}"), lines
    assert 4 <= seconds_waited(lines[0]) < 60, lines
    assert not shim_warnings(proc.stdout + proc.stderr)


# ----------------------------------------------------------------------------- ranks that do not
def test_a_rank_without_the_shim_stops_the_job_within_a_minute_by_default(tmp_path, layouts):
    """Trainer, 2 ranks, rank 1 with ``FSDP_SHIM=0``, the shim's settings all default (a 1,800 s process-group
    timeout): every rank's gloo address is in the store when rank 0 checks, so rank 1 has joined the group and
    gone past the point where it would have reported; rank 0 raises FSDPShimError ``GRACE_SECONDS`` later,
    naming rank 1 as joined but silent, says what it runs itself, and names no dtype for rank 1, whose dtype
    it never saw. Nobody trains, and the job ends in under two minutes (before: 30 minutes of silence)."""
    layout = affected_layout(layouts)
    started = time.monotonic()
    proc, out = torchrun_job(
        tmp_path,
        "off",
        2,
        package=layout.package,
        env={"FSDP_SHIM_STRICT": "0"},
        extra=("--shim-off-rank", "1"),
        expect_ok=False,
    )
    wall = time.monotonic() - started
    (message,) = shim_errors(by_rank(proc)[0])
    assert message.startswith(
        f"fsdp-shim: rank 1 of 2 joined the process group but did not report within {GRACE_SECONDS:g} s which "
        "fixes it runs"
    ), message
    assert f"half-patched ({reported('0', NAMESPACES[layout.package][0], layout.trainer_version)})." in message
    assert "Stopping before any model is wrapped." in message
    assert "FSDP_SHIM=0 in their environment" in message
    assert "float32" not in message, message
    assert not shim_errors(by_rank(proc).get(1, "")), "rank 1 has no shim and cannot raise its error"
    assert_nobody_trained(out, 2)
    assert GRACE_SECONDS < wall < 120, wall


def test_a_rank_that_starts_late_is_waited_for_past_the_grace(tmp_path, layouts):
    """Trainer, 2 ranks with the shim, default settings; rank 1's interpreter starts ``GRACE_SECONDS`` + 10 s
    late. gloo connects lazily here (``TORCH_GLOO_LAZY_INIT=1``, as NCCL does), so rank 0 joins the group
    and reaches the check at once, long before rank 1 has joined: without the evidence that every rank has
    joined, the grace does not start, and rank 0 waits (by torch's default, eager gloo, that wait is in
    ``init_process_group`` instead, measured under SLURM in docs/cluster.md). The job trains, both ranks in
    bfloat16, and rank zero's line says it waited longer than the grace."""
    layout = affected_layout(layouts)
    proc, out = torchrun_job(
        tmp_path,
        "late-start",
        2,
        package=layout.package,
        env={"TORCH_GLOO_LAZY_INIT": "1"},
        late=(1, GRACE_SECONDS + 10),
    )
    results = scenario_results(out, 2)
    for rank in range(2):
        assert results[rank][CASE]["flat_param_dtypes"] == [BF16], (rank, results[rank][CASE])
    lines = confirmations(proc)
    assert len(lines) == 1, "\n".join(lines) or proc.stderr[-4000:]
    assert lines[0].startswith(f"[default0]:{confirmation(2, layout.trainer_version)}"), lines
    assert seconds_waited(lines[0]) > GRACE_SECONDS, lines
    assert not shim_warnings(proc.stdout + proc.stderr)


LAZY_GLOO_SINCE: Release = (2, 8, 0)
"""The first torch whose gloo connects lazily with ``TORCH_GLOO_LAZY_INIT=1`` (pytorch/pytorch#150801);
an older one ignores the variable and connects while joining: the test's eager case."""


def cuda_devices() -> int:
    """GPUs ``nvidia-smi`` lists (this process imports no torch)."""
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return listed.count("GPU ")


@pytest.mark.per_torch  # torch's own key names: the torch sessions (2.3, the newest); on 2.13 the end-to-end tests
@pytest.mark.parametrize("backend", ["gloo", "lazy gloo", "nccl"])
def test_the_early_end_waits_for_every_rank_to_join_the_process_group(backend: str) -> None:
    """Two ranks of a real process group under torchrun, no Lightning: rank 0 reports and waits (the rank
    check's own wait: 20 s at most, a 2 s grace); rank 1 starts 4 s late and never reports, as a rank
    without the shim. gloo: rank 0's wait ends early, with only its own report, and never sooner than the
    grace after rank 1 began to join: eager gloo keeps rank 0 in ``init_process_group`` until rank 1
    arrives, so the store shows every rank joined when the check starts; lazy gloo lets rank 0 check at
    once, while rank 1's address is not in the store yet, and the grace starts only once it is. NCCL
    (two GPUs; docs/cluster.md) writes no such address: the whole wait, as without the early end."""
    if backend == "nccl" and cuda_devices() < 2:
        pytest.skip("needs two GPUs (nvidia-smi -L): the NCCL case of docs/cluster.md")
    torch_version = importlib.metadata.version("torch")
    if backend == "lazy gloo" and (base_release(torch_version) or (0, 0, 0)) < LAZY_GLOO_SINCE:
        pytest.skip(f"torch {torch_version} has no lazy gloo (TORCH_GLOO_LAZY_INIT): its gloo is the eager case")
    wait, grace, late_by = 20.0, 2.0, 4.0
    arguments = {"backend": backend.split()[-1], "late_by": late_by, "wait": wait, "grace": grace, "poll": 0.2}
    env = clean_env(**({"TORCH_GLOO_LAZY_INIT": "1"} if backend == "lazy gloo" else {}))

    def attempt(retry: bool) -> tuple[list[str], dict[str, str]]:
        command = [*torchrun(2), "--tee", "3", str(CHILD), "children.rank_evidence:rank", json.dumps(arguments)]
        return command, {**env, "MASTER_PORT": str(free_port())}

    proc, command = run_on_a_free_port(attempt, timeout=180)
    assert proc.returncode == 0, f"{shlex.join(command)}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    ranks = {rank: json.loads(re.findall(r"^\{.*$", text, re.M)[-1]) for rank, text in by_rank(proc).items()}
    checker, silent = ranks[0], ranks[1]
    print(f"{backend}: the store's keys when rank 0 checks: {checker['keys']}")
    assert checker["reported"] == [0], checker
    if backend == "nccl":
        assert checker["joined_then"] is False and checker["early"] is False, checker
        assert checker["ended"] - checker["checking"] >= wait, checker
        return
    assert checker["early"] is True, checker
    assert checker["ended"] >= silent["joining"] + grace, (checker, silent)
    assert checker["ended"] - checker["checking"] < wait, checker
    lazy = backend == "lazy gloo"
    assert checker["joined_then"] is not lazy, checker
    if lazy:
        assert checker["checking"] < silent["joining"], (checker, silent)


def test_a_late_rank_is_named_without_a_dtype_it_did_not_send(tmp_path, layouts):
    """Trainer, 2 ranks, both with the shim; rank 1 reaches its FSDP setup 8 s late, past a 2 s wait.
    Rank 0's message says that rank 1 did not report within 2 s, lists being busy among the causes, and
    describes only what rank 0 runs: 5f37aee said the others were "most likely in float32", a dtype
    no rank had reported (rank 1 was about to convert to bfloat16)."""
    layout = affected_layout(layouts)
    proc, out = torchrun_job(
        tmp_path,
        "late",
        2,
        package=layout.package,
        env={RANK_CHECK_TIMEOUT_VARIABLE: "2"},
        extra=("--delay-rank", "1:8"),
        expect_ok=False,
    )
    (message,) = shim_errors(by_rank(proc)[0])
    assert message.startswith("fsdp-shim: rank 1 of 2 did not report within 2 s which fixes it runs"), message
    assert "still busy after 2 s" in message, message
    named = set(re.findall(r"\b(b?float\d+)\b", message))
    assert named == {BF16.removeprefix("torch.")}, message
    assert_nobody_trained(out, 2)


def test_without_the_variable_the_wait_is_the_process_groups_timeout(tmp_path, layouts):
    """Fabric, 4 ranks, strict mode, ``FSDPStrategy(timeout=10 s)``; rank 3 with ``FSDP_SHIM=0``.
    ``FSDP_SHIM_RANK_CHECK_TIMEOUT`` is unset on rank 0, ``abc`` on rank 1 and ``-1`` on rank 2: all
    three wait as long as the process group's own timeout, the one torch gives the collectives of the
    job, so the shim never stops a job that torch would have let run, and names the cause before torch
    would time out. Rank 0 raises FSDPShimError naming rank 3 and those 10 s (5f37aee waited 300 s: rank
    3's first all-gather timed out after 10 s instead, and the job ended in a gloo error that named no
    cause). A value that is no wait warns once, on its rank only, naming the wait it uses instead;
    strict mode makes no error of it (the check still runs)."""
    layout = affected_layout(layouts)
    proc, out = torchrun_job(
        tmp_path,
        "process-group-timeout",
        4,
        api="fabric",
        package=layout.package,
        env={"FSDP_SHIM_STRICT": "1"},
        extra=(
            "--process-group-timeout",
            "10",
            "--env-on-rank",
            f"1:{RANK_CHECK_TIMEOUT_VARIABLE}=abc",
            "--env-on-rank",
            f"2:{RANK_CHECK_TIMEOUT_VARIABLE}=-1",
            "--shim-off-rank",
            "3",
        ),
        expect_ok=False,
        timeout=180,
    )
    output = by_rank(proc)
    (message,) = shim_errors(output[0])
    assert message.startswith("fsdp-shim: rank 3 of 4 did not report within 10 s which fixes it runs"), message
    for rank in (1, 2):  # they raise the same, unless torchrun ended them first, when rank 0 failed
        assert shim_errors(output[rank]) in ([], [message]), output[rank][-3000:]
    assert shim_warnings(output[0]) == []
    for rank, value in ((1, "abc"), (2, "-1")):
        assert shim_warnings(output[rank]) == [
            f"fsdp-shim: {RANK_CHECK_TIMEOUT_VARIABLE}={value!r} is not a number of seconds >= 0; the cross-rank "
            "check waits as long as the process group's timeout (10 s)"
        ], output[rank][-3000:]
    assert_nobody_trained(out, 4)


def test_ranks_with_different_dtypes_stop_the_job(tmp_path, layouts):
    """Every rank has the shim, but rank 1 was configured for 16-true: both ranks raise FSDPShimError
    naming what each runs, with its host and release."""
    layout = affected_layout(layouts)
    proc, out = torchrun_job(
        tmp_path, "dtypes", 2, package=layout.package, extra=("--precision-on-rank", "1:16-true"), expect_ok=False
    )
    trainer, version = NAMESPACES[layout.package][0], layout.trainer_version
    described = f"{reported('0', trainer, version)}; {reported('1', trainer, version, DTYPES['16-true'])}"
    output = by_rank(proc)
    for rank in range(2):
        (message,) = shim_errors(output[rank])
        assert message.startswith(
            f"fsdp-shim: the 2 ranks of this job run different fixes or dtypes ({described}), "
        ), message
    assert_nobody_trained(out, 2)


def test_timeout_zero_switches_the_check_off(tmp_path, layouts):
    """With the check off, the half-patched job trains as it would without it: mixed dtypes, exit 0."""
    layout = affected_layout(layouts)
    proc, out = torchrun_job(
        tmp_path,
        "check-off",
        2,
        package=layout.package,
        env={RANK_CHECK_TIMEOUT_VARIABLE: "0"},
        extra=("--shim-off-rank", "1"),
    )
    results = scenario_results(out, 2)
    on, off = results[0][CASE], results[1][CASE]
    assert on["flat_param_dtypes"] == [BF16]
    assert off["flat_param_dtypes"] == [DTYPES["32-true"]]
    for key in BYTE_KEYS:
        assert off[key] == 2 * on[key], key
    assert not confirmations(proc)
    assert not shim_errors(proc.stdout + proc.stderr)


def test_the_timeout_variable_is_read_as_seconds():
    """Unset: the process group's timeout (``None``). Seconds as a float, ``0`` switches the check off;
    anything larger than a year (``1e20``, ``inf``) is a year, which every store accepts; a value that
    is no wait keeps the default and says why (the job above shows the one warning it becomes)."""
    assert rank_check_timeout({}) == (None, None)
    assert rank_check_timeout({RANK_CHECK_TIMEOUT_VARIABLE: " 12.5 "}) == (12.5, None)
    assert rank_check_timeout({RANK_CHECK_TIMEOUT_VARIABLE: "0"}) == (0, None)
    for value in ("1e20", "inf", "Infinity"):
        assert rank_check_timeout({RANK_CHECK_TIMEOUT_VARIABLE: value}) == (MAX_RANK_CHECK_SECONDS, None), value
    assert MAX_RANK_CHECK_SECONDS == 365 * 24 * 3600
    for value in ("abc", "-1", "nan", "-inf", "5s"):
        seconds, problem = rank_check_timeout({RANK_CHECK_TIMEOUT_VARIABLE: value})
        assert seconds is None, value
        assert problem == f"{RANK_CHECK_TIMEOUT_VARIABLE}={value!r} is not a number of seconds >= 0", problem


def test_an_elastic_restart_without_the_shim_stops_the_job(tmp_path, layouts):
    """torchrun ``--max-restarts 1``: the first attempt passes the check and trains, then rank 1 dies,
    and torchrun restarts both ranks; rank 1 comes back with ``FSDP_SHIM=0``. torchrun's store outlives
    the restart, so the first attempt's keys are still there: the second attempt must not count them.
    Rank 0 stops naming rank 1, and "patched on all 2 ranks" is said once, by the first attempt
    (5f37aee found rank 1's old key, printed the line again and trained the restarted job half-patched,
    exit 0)."""
    layout = affected_layout(layouts)
    proc, out = torchrun_job(
        tmp_path,
        "restart",
        2,
        package=layout.package,
        env={RANK_CHECK_TIMEOUT_VARIABLE: "10"},
        extra=("--restart-without-shim", "1"),
        options=("--max-restarts", "1"),
        expect_ok=False,
    )
    output = by_rank(proc)
    assert "fails once after training" in output[1], output[1][-3000:]
    assert len(confirmations(proc)) == 1, confirmations(proc)
    assert output[0].index("patched on all 2 ranks") < output[0].index("FSDPShimError")
    (message,) = shim_errors(output[0])
    assert message.startswith("fsdp-shim: rank 1 of 2 did not report within 10 s which fixes it runs"), message
    assert not Path(f"{out}.rank1.json").exists()


def test_a_node_with_another_release_and_other_fixes_stops_the_job_named_with_its_release(tmp_path, layouts):
    """Trainer, 2 ranks with the shim; rank 1's ``PYTHONPATH`` gives it a Lightning with the cast built
    in (2.6.6 next to a 2.4.0 node) and ``FSDP_SHIM_DISABLED_FIXES=recompute``. Every rank reports at
    the end of ``FSDPStrategy.setup_environment``, before any model is wrapped, so the check sees both
    releases: both ranks stop, and the message names each rank with its fixes and its release."""
    layout = affected_layout(layouts, "lightning")
    folder, version = fixed_matrix_folder()
    proc, out = torchrun_job(
        tmp_path,
        "mixed-releases",
        2,
        package=layout.package,
        env={RANK_CHECK_TIMEOUT_VARIABLE: "30"},
        extra=("--env-on-rank", f"1:PYTHONPATH={folder}", "--env-on-rank", "1:FSDP_SHIM_DISABLED_FIXES=recompute"),
        expect_ok=False,
    )
    output = by_rank(proc)
    assert f"{folder}/lightning/pytorch/" in output[1], f"rank 1 ran Lightning {version}: " + output[1][-3000:]
    assert f"{folder}/" not in output[0]
    rank1 = f"rank 1 on {socket.gethostname()}: bfloat16; fixes: cast (Lightning's own) (lightning.pytorch {version}"
    for rank in (0, 1):
        (message,) = shim_errors(output[rank])
        assert message.startswith("fsdp-shim: the 2 ranks of this job run different fixes or dtypes ("), message
        assert reported("0", "lightning.pytorch", layout.trainer_version) in message, message
        assert rank1 in message, message
    assert_nobody_trained(out, 2)


def test_a_rank_whose_torch_recomputes_past_the_fix_stops_the_job(tmp_path, layouts):
    """Rank 1's torch checkpoint calls names the shim did not wrap (``hide_checkpoint_internals``): its
    recompute fix is not in effect for the non-reentrant checkpoint, so it runs other fixes than rank 0, and
    both ranks stop before any model is wrapped, naming what rank 1 runs."""
    layout = affected_layout(layouts, "lightning")
    proc, out = torchrun_job(
        tmp_path,
        "moved-checkpoint",
        2,
        package=layout.package,
        env={RANK_CHECK_TIMEOUT_VARIABLE: "30"},
        extra=("--env-on-rank", "1:FSDP_SHIM_TEST_HIDE_CHECKPOINT_INTERNALS=1"),
        expect_ok=False,
    )
    output = by_rank(proc)
    fixes = "cast, recompute (except the non-reentrant checkpoint)"
    rank1 = f"rank 1 on {socket.gethostname()}: bfloat16; fixes: {fixes} (lightning.pytorch {layout.trainer_version}"
    assert "the recompute fix is not in effect on torch" in output[1], output[1][-3000:]
    for rank in (0, 1):
        (message,) = shim_errors(output[rank])
        assert message.startswith("fsdp-shim: the 2 ranks of this job run different fixes or dtypes ("), message
        assert reported("0", "lightning.pytorch", layout.trainer_version) in message, message
        assert rank1 in message, message
    assert_nobody_trained(out, 2)


def test_on_a_release_with_the_cast_built_in_ranks_agree_before_the_model_is_wrapped(tmp_path, layouts):
    """Trainer, 2 ranks, a Lightning that casts itself (the shim leaves its ``convert_module`` alone) and
    lacks the recompute fix: the check runs at the end of ``setup_environment`` through the recompute
    fix's wrapper, every rank trains in bfloat16, and rank zero's one line names both fixes, the cast as
    Lightning's own."""
    layout = fixed_layout(layouts)
    proc, out = torchrun_job(tmp_path, "fixed", 2, package=layout.package)
    results = scenario_results(out, 2)
    for rank in range(2):
        assert results[rank][CASE]["flat_param_dtypes"] == [BF16]
        assert results[rank]["_shim"]["trainer_convert_module"] is False, results[rank]["_shim"]
    lines = confirmations(proc)
    assert len(lines) == 1, "\n".join(lines) or proc.stderr[-4000:]
    assert lines[0].startswith(f"[default0]:{confirmation(2, layout.trainer_version)}"), lines
    assert "(Lightning's own)" in lines[0]


def test_on_a_release_with_the_cast_built_in_a_rank_without_the_shim_stops_the_job(tmp_path, layouts):
    """The same job with rank 1 at ``FSDP_SHIM=0``: rank 0 stops in ``setup_environment`` (its traceback
    goes through the recompute fix's check, not the cast's), naming rank 1 and its own release."""
    layout = fixed_layout(layouts)
    proc, out = torchrun_job(
        tmp_path,
        "fixed-off",
        2,
        package=layout.package,
        env={RANK_CHECK_TIMEOUT_VARIABLE: "5"},
        extra=("--shim-off-rank", "1"),
        expect_ok=False,
    )
    rank0 = by_rank(proc)[0]
    (message,) = shim_errors(rank0)
    assert message.startswith("fsdp-shim: rank 1 of 2 did not report within 5 s which fixes it runs"), message
    assert f"half-patched ({reported('0', NAMESPACES[layout.package][0], layout.trainer_version)})." in message
    assert "in confirm_every_rank_after_setup" in rank0 and "in convert_module_as_in_2_5" not in rank0
    assert_nobody_trained(out, 2)


# ----------------------------------------------------------------------------- real cluster launchers
_IN_THE_CLUSTER_SESSION = pytest.mark.skipif(
    os.environ.get("FSDP_SHIM_TEST_CLUSTER") != "1", reason="cluster launchers run in the `cluster` nox session"
)


def cluster(test: Any) -> Any:
    """A launcher test: marked ``launchers`` (the ``cluster`` session runs ``-m launchers``, these alone:
    the rank-check tests above run in the default session) and skipped outside that session."""
    return pytest.mark.launchers(_IN_THE_CLUSTER_SESSION(test))


PROGRAM = ROOT / "tests" / "cluster" / "train_both.py"
APIS = ("trainer", "fabric")
CLUSTER_JOB_TIMEOUT = 240
"""Seconds one job may take (about 10-40 s here); a hung rank fails the test and its job is killed."""
RANK_CHECK_TIMEOUT = "10"
"""Seconds the shimmed ranks of a half-patched job wait: the ranks reach their FSDP setup within a
second or two of each other (they have just met in the process group's rendezvous)."""
SLURM_TIME_LIMIT = "5"  # minutes: SLURM ends the job itself if the test's own kill did not reach it


def python() -> str:
    return sys.executable


def shim_command() -> list[str]:
    """The ``fsdp-shim`` console script next to this interpreter (what users type)."""
    return [FSDP_SHIM] if os.path.exists(FSDP_SHIM) else [sys.executable, "-m", "fsdp_shim"]


def launch(
    commands: list[list[str]], env: dict[str, str], timeout: float = CLUSTER_JOB_TIMEOUT
) -> list[tuple[int, str]]:
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
            assert row["flat_param_dtypes"] == [DTYPES["32-true"]], (result["rank"], api, row)
            assert row["flat_param_bytes"] == 4 * row["flat_param_numel"], (result["rank"], api, row)
        assert result["trainer"]["module_dtype"] == DTYPES["32-true"]


def assert_patched(ranks: list[dict[str, Any]], baseline: list[dict[str, Any]]) -> None:
    """bfloat16 on every rank, for both APIs, with exactly half of the same rank's FSDP_SHIM=0 bytes."""
    assert len(ranks) == len(baseline)
    for result, unpatched in zip(ranks, baseline):
        assert result["rank"] == unpatched["rank"]
        for api in APIS:
            row, base = result[api], unpatched[api]
            assert row["flat_param_dtypes"] == [BF16], (result["rank"], api, row)
            assert row["flat_param_numel"] == base["flat_param_numel"]
            for key in BYTE_KEYS:
                assert base[key] % 2 == 0 and row[key] == base[key] // 2, (result["rank"], api, key, row, base)
        assert result["trainer"]["module_dtype"] == BF16
        facts = result["shim"]
        assert facts and facts["trainer_convert_module"] and facts["fabric_convert_module"], facts


@pytest.fixture(scope="module")
def startup_python(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The interpreter of a new virtual environment that sees this one's packages, with the start-up
    file written by ``fsdp-shim install`` into its site-packages; uninstalled afterwards, and the
    environment is a temporary folder, so nothing outside the test is changed."""
    venv = make_venv(tmp_path_factory.mktemp("startup") / "venv", [str(ROOT), sysconfig.get_paths()["purelib"]])
    venv.run("-m", "fsdp_shim", "install")
    assert (venv.site_packages / PTH_NAME).exists()
    yield venv.python
    venv.run("-m", "fsdp_shim", "uninstall")
    assert not (venv.site_packages / PTH_NAME).exists()


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


@cluster
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


@cluster
@pytest.mark.parametrize(
    ("mode", "topology"), [*((mode, "2x2") for mode in SLURM_MODES), ("srun fsdp-shim run python", "2x1")]
)
def test_slurm_every_rank_trains_bfloat16(jobs: Jobs, startup_python: str, mode: str, topology: str) -> None:
    """Every activation on two nodes of two tasks each; one task per node with the first (CI time: what a mode
    does per task does not change with the number of tasks on a node)."""
    per_node = SLURM_TOPOLOGIES[topology]
    ranks = slurm_job(jobs, mode, per_node, startup_python)
    assert_placement(ranks, 2, per_node)
    assert_patched(ranks, slurm_baseline(jobs, per_node))


def slurm_job(jobs: Jobs, mode: str, per_node: int, startup: str | None = None) -> list[dict[str, Any]]:
    name = f"slurm 2x{per_node} {mode}"
    command, env = slurm_mode_command(mode, per_node, jobs.out(name), startup)
    return jobs.run(name, [command], env, 2 * per_node)


def on_one_node_slurm_command(per_node: int, out: Path, node: str, step: str) -> list[str]:
    """``srun fsdp-shim run python`` whose tasks on ``node`` alone run ``step`` first, in their shell
    (``export FSDP_SHIM=0``, ``sleep 40``)."""
    inner = shlex.join([*shim_command(), "run", *program(per_node, out)])
    return [*srun(per_node), "bash", "-c", f'[ "$SLURMD_NODENAME" = {node} ] && {step}; exec {inner}']


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


def check_half_patched(
    title: str, commands: list[list[str]], outputs: list[tuple[int, str]], world: int, wait: str | None
) -> None:
    """The job stops (non-zero exit), every rank with the shim raises FSDPShimError naming exactly the
    ranks with FSDP_SHIM=0 and the wait (``FSDP_SHIM_RANK_CHECK_TIMEOUT``; ``None``: unset, so the grace
    after every rank joined the process group), and those ranks do not report success either. Prints the
    per-rank table."""
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
    joined, seconds = ("", wait) if wait else ("joined the process group but ", f"{GRACE_SECONDS:g}")
    named = f"{noun} {', '.join(map(str, unshimmed))} of {world} {joined}did not report within {seconds} s"
    for rank, entry in ranks.items():
        if rank not in unshimmed:
            assert entry["failed"].startswith("FSDPShimError") and named in entry["failed"], (rank, entry)


@cluster
@pytest.mark.parametrize(("topology", "wait"), [("2x1", None), ("2x2", RANK_CHECK_TIMEOUT)])
def test_slurm_half_patched_job_stops_naming_the_ranks_without_the_shim(
    jobs: Jobs, topology: str, wait: str | None
) -> None:
    """2x1 at the shim's default settings: the job ends ``GRACE_SECONDS`` after every rank joined the
    process group, in under two minutes; 2x2 with ``FSDP_SHIM_RANK_CHECK_TIMEOUT=10``, which waits that long."""
    per_node = SLURM_TOPOLOGIES[topology]
    name = f"slurm 2x{per_node} half-patched (n2: FSDP_SHIM=0, {RANK_CHECK_TIMEOUT_VARIABLE}={wait or 'unset'})"
    command = on_one_node_slurm_command(per_node, jobs.out(name), "n2", "export FSDP_SHIM=0")
    started = time.monotonic()
    outputs = launch([command], slurm_env(FSDP_SHIM_RANK_CHECK_TIMEOUT=wait))
    wall = time.monotonic() - started
    check_half_patched(f"{name} ({wall:.0f} s)", [command], outputs, 2 * per_node, wait)
    assert wall < 120, wall


@cluster
@pytest.mark.parametrize("topology", SLURM_TOPOLOGIES)
def test_slurm_rank_zero_confirms_every_rank_once(jobs: Jobs, topology: str) -> None:
    """The shimmed jobs above say so: one line from rank zero for the job, though each rank converts
    twice (Trainer, then Fabric, in one process group), naming the dtype and the fixes."""
    per_node = SLURM_TOPOLOGIES[topology]
    ranks = slurm_job(jobs, "srun fsdp-shim run python", per_node)
    output = jobs.outputs[f"slurm 2x{per_node} srun fsdp-shim run python"]
    expected = confirmation(2 * per_node, ranks[0]["lightning"])
    assert output.count("fsdp-shim: patched on all") == 1, output[-6000:]
    assert output.count(expected) == 1, output[-6000:]


REPORT_SHIM = "import os; print('FSDP_SHIM of task', os.environ['SLURM_PROCID'], '=', os.environ.get('FSDP_SHIM'))"


@cluster
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


@cluster
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


@cluster
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
    output = jobs.outputs[name]
    assert output.count("fsdp-shim: patched on all") == 1, output[-6000:]
    assert output.count(confirmation(2, ranks[0]["lightning"])) == 1, output[-6000:]


@cluster
@pytest.mark.parametrize("rendezvous", RENDEZVOUS)
def test_torchrun_half_patched_job_stops_naming_the_rank_without_the_shim(jobs: Jobs, rendezvous: str) -> None:
    name = f"torchrun {rendezvous} half-patched (node 1: FSDP_SHIM=0)"
    run = [*shim_command(), "run"]
    commands = torchrun_nodes(rendezvous, jobs.out(name), (run, ["env", "FSDP_SHIM=0", *run]))
    started = time.monotonic()
    outputs = launch(commands, torchrun_env(FSDP_SHIM_RANK_CHECK_TIMEOUT=RANK_CHECK_TIMEOUT))
    check_half_patched(f"{name} ({time.monotonic() - started:.0f} s)", commands, outputs, 2, RANK_CHECK_TIMEOUT)
