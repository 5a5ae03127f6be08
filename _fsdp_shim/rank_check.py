"""The rank check (docs/cluster.md): every rank of a job runs the same fixes, or the job stops before any model is
wrapped. Ranks meet in the process group's store, which a rank without the shim never writes to."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextvars import ContextVar
from datetime import timedelta
from typing import Any

from _fsdp_shim import log, recompute_check, wrappers
from _fsdp_shim._version import __version__
from _fsdp_shim.config import FIXES, RECOMPUTE, State, rank_check_timeout

DEFAULT_TIMEOUT_SECONDS = 1800.0  # where the group's own timeout cannot be read (torch's default)
GRACE_SECONDS = 30.0
POLL_SECONDS = 5.0  # how often the wait asks the store whether every rank has joined
Report = dict[str, Any]  # what a rank says: its fixes, dtype, host and releases (``decide``)

_lock = threading.Lock()
_checked: list[tuple[Any, Exception | None]] = []  # each group checked, in order, and how a failed one fails again
setting_up: ContextVar[bool] = ContextVar("fsdp_shim_setting_up", default=False)  # a set-up the check follows
_present_in: list[Any] = []  # the rendezvous store this rank said it has the shim in, for the check that follows


def confirm_every_rank(namespace: str, dtype: Any, joined_here: bool = False) -> None:
    """Publish this rank's fixes and wait for every rank's: one missing or different raises ``FSDPShimError``, a check
    that fails follows the failure policy. ``joined_here``: this set-up created the group, so the grace applies."""
    present, _present_in[:] = (_present_in[-1] if _present_in and joined_here else None), []
    try:
        problem = _check(namespace, dtype, joined_here, present)
    except Exception as error:
        _failures().rank_check_failed(error)
        return
    if problem is not None:
        raise problem


def _check(namespace: str, dtype: Any, joined_here: bool, present: Any) -> Exception | None:
    """The check of the default group, once per group: the error that stops the job, if any."""
    dist: Any = sys.modules.get("torch.distributed")
    if not process_group_exists() or (world_size := dist.get_world_size()) < 2:
        return None
    group, store = dist.distributed_c10d._get_default_group(), dist.distributed_c10d._get_default_store()
    with _lock:
        if done := [problem for checked, problem in _checked if checked is group]:  # held strongly: ids are reused
            return done[0]
        _checked.append((group, None))
        number = len(_checked)
    seconds, problem = rank_check_timeout()
    try:
        limit = float(store.timeout.total_seconds()) if seconds is None else seconds
    except Exception:
        limit = DEFAULT_TIMEOUT_SECONDS
    if problem is not None:
        _failures().unreadable_rank_check_timeout(problem, limit)
    if limit == 0:
        return None
    grace = GRACE_SECONDS if seconds is None and joined_here else None  # set, the variable is the whole wait
    report, rank, started = decide(namespace, dtype), dist.get_rank(), time.monotonic()
    reports, early = exchange(store, number, rank, world_size, report, limit, grace, present)
    missing = [r for r in range(world_size) if r not in reports]
    if missing or len({behaviour(sent) for sent in reports.values()}) > 1:
        waited, paused = (grace if early and grace else limit), present_ranks(present, missing, number)
        error = _failures().rank_check_error(missing, reports, world_size, waited, early, paused)
        _checked[number - 1] = (group, error)
        return error
    if rank == 0:
        line = "fsdp-shim: patched on all %d ranks (%s), confirmed in %.2f s"
        log.announce(line, world_size, report["summary"], time.monotonic() - started)
    return None


def process_group_exists() -> bool:
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def decide(namespace: str, dtype: Any) -> Report:
    """This rank's report: per fix who provides it and the paths torch passes it by, the dtype, host and releases."""
    version = getattr(sys.modules.get(namespace), "__version__", None) or ""
    fixes = {}
    for fix in FIXES:
        if fix.built_in(version) or wrappers.state(namespace, fix) is State.TORCH_HAS_IT:
            by = "Lightning" if fix.built_in(version) else "torch"
        else:  # not "patched": a path still to check acts, whatever the context
            by = "fsdp-shim" if wrappers.acting(namespace, fix) else "off"
        passed_by = recompute_check.found(shown=False, holds=True) if by == "fsdp-shim" and fix is RECOMPUTE else []
        fixes[fix.name] = {"by": by, "except": passed_by}
    report = {"fixes": fixes, "dtype": str(dtype), "host": socket.gethostname(), "namespace": namespace}
    return {**report, "lightning": version, "fsdp_shim": __version__, "summary": summary(fixes, dtype)}


def behaviour(report: Report) -> tuple[Any, ...]:
    """What must agree across ranks: the dtype, and per fix whether it is in effect and where not."""
    effect = [report.get("fixes", {}).get(fix.name, {"by": "off"}) for fix in FIXES]
    return (report.get("dtype"), *((entry["by"] != "off", tuple(entry.get("except", []))) for entry in effect))


def summary(fixes: dict[str, dict[str, Any]], dtype: Any) -> str:
    """``bfloat16; fixes: cast (Lightning's own), recompute (except the reentrant checkpoint)``."""
    named = []
    for fix, entry in fixes.items():
        if entry["except"]:
            named.append(f"{fix} (except {_failures().the_checkpoints(entry['except'])})")
        elif entry["by"] != "off":
            named.append(fix if entry["by"] == "fsdp-shim" else f"{fix} ({entry['by']}'s own)")
    return f"{str(dtype).replace('torch.', '')}; fixes: {', '.join(named) or 'none'}"


def say_present(rendezvous: Iterator[tuple[Any, int, int]]) -> Iterator[tuple[Any, int, int]]:
    """What torch's rendezvous yields, once this rank's presence is in its store: then its silence is a pause."""
    for store, rank, world_size in rendezvous:
        with contextlib.suppress(Exception):  # without it, this rank's pause could be taken for a missing shim
            store.set(_key(f"present/{len(_checked) + 1}", rank), "1")  # before the check it precedes
            _present_in.append(store)
        yield store, rank, world_size


def present_ranks(present: Any, ranks: list[int], number: int) -> list[int]:
    """Those of ``ranks`` whose presence before check ``number`` is in the rendezvous store ``present``."""
    try:
        return [r for r in ranks if present is not None and present.check([_key(f"present/{number}", r)])]
    except Exception:  # a store that went away holds no evidence
        return []


def _key(what: str, rank: int) -> str:
    """A rank's key for ``what``, per torchrun attempt: torchrun's store outlives a restart."""
    attempt = f"{os.environ.get('TORCHELASTIC_RUN_ID', '-')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return f"fsdp_shim/rank_check/{attempt}/{what}/{rank}"


def exchange(
    store: Any, number: int, rank: int, world_size: int, report: Report, limit: float, grace: float | None, present: Any
) -> tuple[dict[int, Report], bool]:
    """Write this rank's report and wait ``limit`` s for the others', or ``grace`` s once every rank joined the group
    (gloo's ``cpu//0/<rank>`` keys) unless each silent rank is ``present``: the reports, and whether grace ended it."""
    keys = [_key(str(number), r) for r in range(world_size)]
    store.set(keys[rank], json.dumps(report))
    end, grace_end, early = time.monotonic() + limit, None, False
    while (step := min(end - time.monotonic(), POLL_SECONDS)) >= 0.01:
        if grace is not None and grace_end is None and store.check([f"cpu//0/{r}" for r in range(world_size)]):
            grace_end = time.monotonic() + grace
        if grace_end is not None and time.monotonic() >= grace_end:
            silent = [r for r, key in enumerate(keys) if not store.check([key])]
            early = present_ranks(present, silent, number) != silent
            if early:
                break
            grace = grace_end = None  # every silent rank has the shim: wait for them as long as the limit
        try:
            store.wait(keys, timedelta(seconds=step))
            break
        except Exception as error:  # the store's timeout error differs across torch releases
            if not ("timeout" in f"{type(error).__name__} {error}".lower() or "timed out" in str(error).lower()):
                raise
    return {r: json.loads(store.get(key)) for r, key in enumerate(keys) if store.check([key])}, early


def _failures() -> Any:
    """The failure policy and the rank check's messages, loaded only where something is said."""
    from _fsdp_shim import failures

    return failures
