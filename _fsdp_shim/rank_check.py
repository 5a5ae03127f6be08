"""The rank check (docs/cluster.md): every rank of a distributed job runs the same fixes, or the job stops before
any model is wrapped, instead of training in different dtypes and dying in a collective that names no cause.
Ranks meet in the process group's key-value store, not in a collective, which a rank without the shim would never
join. A failed group fails again at every later call, so a loop that catches the error never trains half-patched.

By default the wait is the process group's timeout, but it ends ``GRACE_SECONDS`` after the store shows that every
rank has joined the process group (gloo's address keys): a rank with the shim reports within moments of joining,
so one still silent then has gone past the point where it would have reported. Without that evidence (NCCL, which
connects at the first collective; a group created before Lightning's set-up) the whole wait stands."""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from datetime import timedelta
from typing import Any

from _fsdp_shim import failures, wrappers
from _fsdp_shim.config import FIXES, RANK_CHECK_TIMEOUT_VARIABLE, SHIM_VARIABLE, rank_check_timeout
from _fsdp_shim.failures import FSDPShimError
from _fsdp_shim.status import NOT_NEEDED_ON_TORCH

DEFAULT_TIMEOUT_SECONDS = 1800.0  # where the group's own timeout cannot be read (torch's default for it)
GRACE_SECONDS = 30.0
"""How long ranks get to report once every rank has joined the process group, by default. A rank with the shim
reports at the end of the same ``setup_environment`` that joined it, a fraction of a second later even on a loaded
machine (docs/cluster.md has the measurements); a rank still silent then runs no shim, or another strategy."""
EVIDENCE_POLL_SECONDS = 5.0
"""While that evidence is missing, how often each rank asks the store for it (one request)."""

_lock = threading.Lock()
_checked: list[Any] = []  # the groups checked, in order (strong references: an id could be reused)
_failed: list[tuple[Any, FSDPShimError]] = []  # the groups whose check stopped the job, with the error


def confirm_every_rank(namespace: str, dtype: Any, joined_here: bool = False) -> None:
    """Publish this rank's fixes and wait for every rank's: one late or different raises ``FSDPShimError``
    in every mode; the check itself failing follows the failure policy, and training goes on. ``joined_here``:
    the caller's set-up created the process group just now, so every rank (running the same set-up) reports
    right after joining it, and the wait may end ``GRACE_SECONDS`` after every rank has joined."""
    try:
        found = _process_group()
    except Exception as error:
        _could_not_check(error)
        return
    if found is None:
        return
    group, store, rank, world_size = found
    with _lock:
        for failed, error in _failed:  # type: ignore[misc]  # the name the except above deleted, reused
            if failed is group:
                raise error  # type: ignore[misc]
        if any(checked is group for checked in _checked):
            return
        _checked.append(group)
        number = len(_checked)
    limit, explicit = _wait_seconds(store)
    if limit == 0:
        return
    grace = None if explicit or not joined_here else GRACE_SECONDS
    decision, started = _decision(namespace, dtype), time.monotonic()
    try:
        reports, early = exchange(store, number, rank, world_size, decision, limit, grace)
    except Exception as error:
        _could_not_check(error)
        return
    missing = [r for r in range(world_size) if r not in reports]
    if missing or len({_behaviour(report) for report in reports.values()}) > 1:
        waited = grace if early and grace is not None else limit
        message = _missing_message(missing, reports, world_size, waited, early) if missing else ""
        problem = FSDPShimError(message or _disagreement_message(reports, world_size))
        with _lock:
            _failed.append((group, problem))
        raise problem
    if rank == 0:
        summary, seconds = _summary(decision), time.monotonic() - started
        failures.announce("fsdp-shim: patched on all %d ranks (%s), confirmed in %.2f s", world_size, summary, seconds)


def process_group_exists() -> bool:
    """Whether this process has joined a default process group (``confirm_every_rank``'s ``joined_here``)."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def _process_group() -> tuple[Any, Any, int, int] | None:
    """The default group, its store, this rank and the world size; ``None`` outside a multi-rank job."""
    dist: Any = sys.modules.get("torch.distributed")
    if not process_group_exists() or dist.get_world_size() < 2:
        return None
    c10d = dist.distributed_c10d
    return c10d._get_default_group(), c10d._get_default_store(), dist.get_rank(), dist.get_world_size()


def _wait_seconds(store: Any) -> tuple[float, bool]:
    """``FSDP_SHIM_RANK_CHECK_TIMEOUT`` (explicit: ``True``), or the process group's own timeout (its store's)."""
    seconds, problem = rank_check_timeout()
    if seconds is not None:
        return seconds, True
    try:
        default = float(store.timeout.total_seconds())
    except Exception:  # a store without a readable timeout
        default = DEFAULT_TIMEOUT_SECONDS
    if problem is not None:
        failures.warn_once(
            f"fsdp-shim: {problem}; the cross-rank check waits as long as the process group's timeout ({default:g} s)",
            key=f"rank-timeout:{problem}",
        )
    return default, False


def _decision(namespace: str, dtype: Any) -> dict[str, Any]:
    """Per fix, who provides it ("fsdp-shim", "Lightning" or "off"), the dtype, and where (for messages)."""
    from _fsdp_shim._version import __version__

    module = sys.modules.get(namespace)
    version = getattr(module, "__version__", None) or ""
    fixes = {}
    for fix in FIXES:
        state = wrappers.status(namespace, fix)
        if fix.built_in(version):
            fixes[fix.name] = "Lightning"
        elif state.reason.startswith(NOT_NEEDED_ON_TORCH):
            fixes[fix.name] = "torch"
        elif wrappers.acting(namespace, fix):  # not "patched": a path still to check acts, whatever the context
            passed_by = wrappers.passed_by(namespace, fix)
            fixes[fix.name] = "fsdp-shim" + (f" except {wrappers.the_checkpoints(passed_by)}" if passed_by else "")
        else:
            fixes[fix.name] = "off"
    where = {"host": socket.gethostname(), "pid": os.getpid(), "namespace": namespace, "lightning": version}
    return {"fixes": fixes, "dtype": str(dtype), **where, "fsdp_shim": __version__}


def _behaviour(report: dict[str, Any]) -> tuple[Any, ...]:
    """What must agree across ranks: the dtype, and which fixes are in effect (whoever provides them), with
    the paths the shim's is not (``fsdp-shim except ...``)."""
    by_fix = report.get("fixes", {})
    return (report.get("dtype"), *(_in_effect(by_fix.get(fix.name, "off")) for fix in FIXES))


def _in_effect(by: str) -> str:
    """``off``, ``on``, or ``on except the ... checkpoint``."""
    return "off" if by == "off" else "on" + by.partition(" except")[1] + by.partition(" except")[2]


def exchange(
    store: Any,
    number: int,
    rank: int,
    world_size: int,
    decision: dict[str, Any],
    limit: float,
    grace: float | None,
    poll: float = EVIDENCE_POLL_SECONDS,
) -> tuple[dict[int, dict[str, Any]], bool]:
    """Write this rank's key (per torchrun attempt: its store outlives a restart), wait ``limit`` s for the others',
    or less: ``grace`` s from the moment every rank is seen to have joined the process group (looked for every
    ``poll`` s). Returns the reports and whether the grace, not the limit, ended the wait."""
    attempt = f"{os.environ.get('TORCHELASTIC_RUN_ID', '-')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    keys = [f"fsdp_shim/rank_check/{attempt}/{number}/{r}" for r in range(world_size)]
    store.set(keys[rank], json.dumps(decision))
    limit_end = end = time.monotonic() + limit
    looking = grace is not None
    while True:
        now = time.monotonic()
        if looking and grace is not None and every_rank_joined(store, world_size):
            looking, end = False, min(limit_end, now + grace)
        step = min(end - now, poll) if looking else end - now
        if step < 0.01 or _wait(store, keys, step):
            break
    reports = {r: json.loads(store.get(key)) for r, key in enumerate(keys) if r == rank or store.check([key])}
    return reports, end < limit_end


def _wait(store: Any, keys: list[str], seconds: float) -> bool:
    """Whether every key is in the store within ``seconds``."""
    try:
        store.wait(keys, timedelta(seconds=seconds))
    except Exception as error:  # the store says "timeout" in a type that differs across torch releases
        if not ("timeout" in f"{type(error).__name__} {error}".lower() or "timed out" in str(error).lower()):
            raise
        return False
    return True


def every_rank_joined(store: Any, world_size: int) -> bool:
    """Whether every rank's gloo address is in the default group's store: each rank writes its own while it joins
    the group (``ProcessGroupGloo`` under the group's ``cpu/`` prefix, gloo's first device ``0``; the same keys
    on torch 2.3 to 2.15, eager or ``TORCH_GLOO_LAZY_INIT``), shim or not. NCCL writes none there on joining."""
    return bool(store.check([f"cpu//0/{r}" for r in range(world_size)]))


def _summary(report: dict[str, Any]) -> str:
    """``bfloat16; fixes: cast, recompute`` (a fix Lightning ships itself is named as such)."""
    by_fix = report.get("fixes", {})
    fixes = [_named(name, by) for name, by in by_fix.items() if by != "off"]
    return f"{str(report.get('dtype')).replace('torch.', '')}; fixes: {', '.join(fixes) or 'none'}"


def _named(fix: str, by: str) -> str:
    """``recompute``, ``cast (Lightning's own)``, ``recompute (except the non-reentrant checkpoint)``."""
    if by.startswith("fsdp-shim"):
        return fix + (f" ({by.removeprefix('fsdp-shim ')})" if by != "fsdp-shim" else "")
    return f"{fix} ({by}'s own)"


def _ranks(ranks: list[int]) -> str:
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(str(r) for r in ranks)}"


def _missing_message(
    missing: list[int], reports: dict[int, dict[str, Any]], world_size: int, waited: float, joined: bool
) -> str:
    """``joined``: the wait ended ``waited`` s after every rank had joined the process group."""
    joined_but = "joined the process group but " if joined else ""
    busy = f"{waited:g} s after joining it" if joined else f"after {waited:g} s"
    return (
        f"fsdp-shim: {_ranks(missing)} of {world_size} {joined_but}did not report within {waited:g} s which fixes "
        f"it runs, so this job may be half-patched ({_described(reports)}). Stopping before any model is wrapped. "
        f"On the ranks that did not report, fsdp-shim may not be active ({SHIM_VARIABLE}=0 in their environment; a "
        "node whose Python environment lacks fsdp-shim or its start-up file; a launcher that dropped PYTHONPATH or "
        f"{SHIM_VARIABLE}: srun/sbatch --export=..., env -i, sudo, a job script that sets PYTHONPATH), they may run "
        f"another precision or strategy, or they were still busy {busy} ({RANK_CHECK_TIMEOUT_VARIABLE} sets the "
        f"wait). Activate it on every rank ({SHIM_VARIABLE}=1 with fsdp-shim installed in every node's environment, "
        "see docs/cluster.md)."
    )


def _disagreement_message(reports: dict[int, dict[str, Any]], world_size: int) -> str:
    return (
        f"fsdp-shim: the {world_size} ranks of this job run different fixes or dtypes ({_described(reports)}), so "
        "their shards, gradients and optimizer state would not match. Stopping before any model is "
        "wrapped. Use one Lightning release, one fsdp-shim release, one precision and one FSDP_SHIM_DISABLED_FIXES "
        "on every node."
    )


def _described(reports: dict[int, dict[str, Any]]) -> str:
    """Alike ranks together: ``ranks 0, 1 on n1: bfloat16; fixes: cast (lightning.pytorch 2.4.0, fsdp-shim 0.2.0)``."""
    groups: dict[str, list[int]] = {}
    for r, report in sorted(reports.items()):
        releases = f"{report.get('namespace')} {report.get('lightning')}, fsdp-shim {report.get('fsdp_shim')}"
        groups.setdefault(f"{_summary(report)} ({releases})", []).append(r)
    hosts = {label: ", ".join(sorted({str(reports[r].get("host")) for r in ranks})) for label, ranks in groups.items()}
    return "; ".join(f"{_ranks(ranks)} on {hosts[label]}: {label}" for label, ranks in groups.items())


def _could_not_check(error: BaseException) -> None:
    failures.report(
        f"fsdp-shim: could not check that every rank of this job runs the same fixes ({type(error).__name__}: {error})",
        f"training goes on unchecked; make sure every rank has the shim ({SHIM_VARIABLE}=1 on every node)",
        key="rank-check",
        cause=error,
    )
