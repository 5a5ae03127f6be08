"""The rank check (docs/cluster.md): every rank of a distributed job runs the same fixes, or the job stops before
its first optimizer step, instead of training in different dtypes and dying in a collective that names no cause.
Ranks meet in the process group's key-value store, not in a collective, which a rank without the shim would never
join. A failed group fails again at every later call, so a loop that catches the error never trains half-patched."""

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

DEFAULT_TIMEOUT_SECONDS = 1800.0  # where the group's own timeout cannot be read (torch's default for it)

_lock = threading.Lock()
_checked: list[Any] = []  # the groups checked, in order (strong references: an id could be reused)
_failed: list[tuple[Any, FSDPShimError]] = []  # the groups whose check stopped the job, with the error


def confirm_every_rank(namespace: str, dtype: Any) -> None:
    """Publish this rank's fixes and wait for every rank's: one late or different raises ``FSDPShimError``
    in every mode; the check itself failing follows the failure policy, and training goes on."""
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
    limit = _wait_seconds(store)
    if limit == 0:
        return
    decision, started = _decision(namespace, dtype), time.monotonic()
    try:
        reports = _exchange(store, number, rank, world_size, decision, limit)
    except Exception as error:
        _could_not_check(error)
        return
    missing = [r for r in range(world_size) if r not in reports]
    if missing or len({_behaviour(report) for report in reports.values()}) > 1:
        message = _missing_message(missing, reports, world_size, limit) if missing else ""
        problem = FSDPShimError(message or _disagreement_message(reports, world_size))
        with _lock:
            _failed.append((group, problem))
        raise problem
    if rank == 0:
        summary, seconds = _summary(decision), time.monotonic() - started
        failures.announce("fsdp-shim: patched on all %d ranks (%s), confirmed in %.2f s", world_size, summary, seconds)


def _process_group() -> tuple[Any, Any, int, int] | None:
    """The default group, its store, this rank and the world size; ``None`` outside a multi-rank job."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    c10d = dist.distributed_c10d
    return c10d._get_default_group(), c10d._get_default_store(), dist.get_rank(), dist.get_world_size()


def _wait_seconds(store: Any) -> float:
    """``FSDP_SHIM_RANK_CHECK_TIMEOUT``, or the process group's own timeout (its store's)."""
    seconds, problem = rank_check_timeout()
    if seconds is not None:
        return seconds
    try:
        default = float(store.timeout.total_seconds())
    except Exception:  # a store without a readable timeout
        default = DEFAULT_TIMEOUT_SECONDS
    if problem is not None:
        failures.warn_once(
            f"fsdp-shim: {problem}; the cross-rank check waits as long as the process group's timeout ({default:g} s)",
            key=f"rank-timeout:{problem}",
        )
    return default


def _decision(namespace: str, dtype: Any) -> dict[str, Any]:
    """Per fix, who provides it ("fsdp-shim", "Lightning" or "off"), the dtype, and where (for messages)."""
    from _fsdp_shim._version import __version__

    module = sys.modules.get(namespace)
    version = getattr(module, "__version__", None) or ""
    fixes = {}
    for fix in FIXES:
        if fix.built_in(version):
            fixes[fix.name] = "Lightning"
        else:
            fixes[fix.name] = "fsdp-shim" if wrappers.status(namespace, fix).patched else "off"
    where = {"host": socket.gethostname(), "pid": os.getpid(), "namespace": namespace, "lightning": version}
    return {"fixes": fixes, "dtype": str(dtype), **where, "fsdp_shim": __version__}


def _behaviour(report: dict[str, Any]) -> tuple[Any, ...]:
    """What must agree across ranks: the dtype, and which fixes are in effect (whoever provides them)."""
    return (report.get("dtype"), *(report.get("fixes", {}).get(fix.name, "off") != "off" for fix in FIXES))


def _exchange(
    store: Any, number: int, rank: int, world_size: int, decision: dict[str, Any], limit: float
) -> dict[int, dict[str, Any]]:
    """Write this rank's key (per torchrun attempt: its store outlives a restart), wait ``limit`` s for the others'."""
    attempt = f"{os.environ.get('TORCHELASTIC_RUN_ID', '-')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    keys = [f"fsdp_shim/rank_check/{attempt}/{number}/{r}" for r in range(world_size)]
    store.set(keys[rank], json.dumps(decision))
    try:
        store.wait(keys, timedelta(seconds=limit))
    except Exception as error:  # the store says "timeout" in a type that differs across torch releases
        if not ("timeout" in f"{type(error).__name__} {error}".lower() or "timed out" in str(error).lower()):
            raise
    return {r: json.loads(store.get(key)) for r, key in enumerate(keys) if r == rank or store.check([key])}


def _summary(report: dict[str, Any]) -> str:
    """``bfloat16; fixes: cast, recompute`` (a fix Lightning ships itself is named as such)."""
    by_fix = report.get("fixes", {})
    fixes = [name if by == "fsdp-shim" else f"{name} (Lightning's own)" for name, by in by_fix.items() if by != "off"]
    return f"{str(report.get('dtype')).replace('torch.', '')}; fixes: {', '.join(fixes) or 'none'}"


def _ranks(ranks: list[int]) -> str:
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(str(r) for r in ranks)}"


def _missing_message(missing: list[int], reports: dict[int, dict[str, Any]], world_size: int, limit: float) -> str:
    return (
        f"fsdp-shim: {_ranks(missing)} of {world_size} did not report within {limit:g} s which fixes "
        f"it runs, so this job may be half-patched ({_described(reports)}). Stopping before the first optimizer "
        f"step. On the ranks that did not report, fsdp-shim may not be active ({SHIM_VARIABLE}=0 in their "
        "environment; a node whose Python environment lacks fsdp-shim or its start-up file; a launcher that "
        f"dropped PYTHONPATH or {SHIM_VARIABLE}: srun/sbatch --export=..., env -i, sudo, a job script that sets "
        f"PYTHONPATH), they may run another precision or strategy, or they were still busy after {limit:g} s "
        f"({RANK_CHECK_TIMEOUT_VARIABLE} sets the wait). Activate it on every rank ({SHIM_VARIABLE}=1 with "
        "fsdp-shim installed in every node's environment, see docs/cluster.md)."
    )


def _disagreement_message(reports: dict[int, dict[str, Any]], world_size: int) -> str:
    return (
        f"fsdp-shim: the {world_size} ranks of this job run different fixes or dtypes ({_described(reports)}), so "
        "their shards, gradients and optimizer state would not match. Stopping before the first optimizer "
        "step. Use one Lightning release, one fsdp-shim release, one precision and one FSDP_SHIM_DISABLED_FIXES "
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
