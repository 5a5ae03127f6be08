"""The rank check (docs/cluster.md): every rank of a job runs the same fixes, or the job stops before any model is
wrapped. Ranks meet in the process group's store, which a rank without the shim never writes to: the wait ends
``GRACE_SECONDS`` after every rank joined the group unless each silent rank said at the rendezvous it has the shim."""

from __future__ import annotations

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
from _fsdp_shim.config import FIXES, RECOMPUTE, State, rank_check_timeout

DEFAULT_TIMEOUT_SECONDS = 1800.0  # where the group's own timeout cannot be read (torch's default)
GRACE_SECONDS = 30.0
EVIDENCE_POLL_SECONDS = 5.0

_lock = threading.Lock()
_checked: list[tuple[Any, Exception | None]] = []  # each group checked, in order, and how a failed one fails again
setting_up: ContextVar[bool] = ContextVar("fsdp_shim_setting_up", default=False)  # a set-up the check follows
_present_in: list[Any] = []  # the rendezvous store this rank said it has the shim in, for the check that follows


def confirm_every_rank(namespace: str, dtype: Any, joined_here: bool = False) -> None:
    """Publish this rank's fixes and wait for every rank's: one missing or different raises ``FSDPShimError`` in
    every mode; the check itself failing follows the failure policy. ``joined_here``: the group was created by
    this set-up, so the wait may end ``GRACE_SECONDS`` after every rank joined it."""
    present, _present_in[:] = (_present_in[-1] if _present_in and joined_here else None), []
    try:
        found = _process_group()
    except Exception as error:
        _messages().could_not_check(error)
        return
    if found is None:
        return
    group, store, rank, world_size = found
    with _lock:
        for checked, problem in _checked:  # strong references: an id could be reused
            if checked is group and problem is not None:
                raise problem
            if checked is group:
                return
        _checked.append((group, None))
        number = len(_checked)
    limit, explicit = _wait_seconds(store)
    if limit == 0:
        return
    grace = None if explicit or not joined_here else GRACE_SECONDS
    decision, started = decide(namespace, dtype), time.monotonic()
    try:
        reports, early = exchange(store, number, rank, world_size, decision, limit, grace, present=present)
    except Exception as error:
        _messages().could_not_check(error)
        return
    missing = [r for r in range(world_size) if r not in reports]
    if missing or len({behaviour(report) for report in reports.values()}) > 1:
        waited = grace if early and grace is not None else limit
        paused = present_ranks(present, missing, number)
        problem = _messages().stop(missing, reports, world_size, waited, early, paused)
        with _lock:
            _checked[number - 1] = (group, problem)
        raise problem
    if rank == 0:
        line = "fsdp-shim: patched on all %d ranks (%s), confirmed in %.2f s"
        log.announce(line, world_size, decision["summary"], time.monotonic() - started)


def process_group_exists() -> bool:
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
    """``FSDP_SHIM_RANK_CHECK_TIMEOUT`` (explicit: ``True``), else the process group's own timeout."""
    seconds, problem = rank_check_timeout()
    if seconds is not None:
        return seconds, True
    try:
        default = float(store.timeout.total_seconds())
    except Exception:
        default = DEFAULT_TIMEOUT_SECONDS
    if problem is not None:
        _messages().unreadable_timeout(problem, default)
    return default, False


def decide(namespace: str, dtype: Any) -> dict[str, Any]:
    """This rank's report: per fix who provides it (``fsdp-shim``, ``Lightning``, ``torch`` or ``off``) and the paths
    torch passes the shim's by (``except``), the dtype, and where it runs and its ``summary`` (for messages)."""
    from _fsdp_shim._version import __version__

    version = getattr(sys.modules.get(namespace), "__version__", None) or ""
    fixes = {}
    for fix in FIXES:
        if fix.built_in(version):
            fixes[fix.name] = {"by": "Lightning", "except": []}
        elif wrappers.state(namespace, fix) is State.TORCH_HAS_IT:
            fixes[fix.name] = {"by": "torch", "except": []}
        elif wrappers.acting(namespace, fix):  # not "patched": a path still to check acts, whatever the context
            passed_by = recompute_check.found(shown=False, holds=True) if fix is RECOMPUTE else []
            fixes[fix.name] = {"by": "fsdp-shim", "except": passed_by}
        else:
            fixes[fix.name] = {"by": "off", "except": []}
    where = {"host": socket.gethostname(), "pid": os.getpid(), "namespace": namespace, "lightning": version}
    report = {"fixes": fixes, "dtype": str(dtype), **where, "fsdp_shim": __version__}
    return {**report, "summary": summary(report)}


def behaviour(report: dict[str, Any]) -> tuple[Any, ...]:
    """What must agree across ranks: the dtype, and per fix whether it is in effect and where not."""
    by_fix = report.get("fixes", {})
    effect = [by_fix.get(fix.name, {"by": "off"}) for fix in FIXES]
    return (report.get("dtype"), *((entry["by"] != "off", tuple(entry.get("except", []))) for entry in effect))


def say_present(rendezvous: Iterator[tuple[Any, int, int]]) -> Iterator[tuple[Any, int, int]]:
    """What torch's rendezvous yields, once this rank's presence is in its store: seen by the others, a silence
    after joining is a pause, not a missing shim."""
    for store, rank, world_size in rendezvous:
        try:
            store.set(_key(f"present/{len(_checked) + 1}", rank), "1")  # before the check it precedes
            _present_in.append(store)
        except Exception as error:  # without it, this rank's pause could be taken for a missing shim, as before
            log.debug("fsdp-shim: could not say at the rendezvous that rank %s has the shim: %s", rank, error)
        yield store, rank, world_size


def _key(what: str, rank: int) -> str:
    """A rank's key for ``what``, per torchrun attempt: torchrun's store outlives a restart."""
    attempt = f"{os.environ.get('TORCHELASTIC_RUN_ID', '-')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return f"fsdp_shim/rank_check/{attempt}/{what}/{rank}"


def exchange(
    store: Any,
    number: int,
    rank: int,
    world_size: int,
    decision: dict[str, Any],
    limit: float,
    grace: float | None,
    poll: float = EVIDENCE_POLL_SECONDS,
    present: Any = None,
) -> tuple[dict[int, dict[str, Any]], bool]:
    """Write this rank's report and wait ``limit`` s for the others', or ``grace`` s from when every rank joined the
    group unless every silent rank's presence is in ``present`` (the rendezvous store); the reports, and whether
    the grace ended the wait."""
    keys = [_key(str(number), r) for r in range(world_size)]
    store.set(keys[rank], json.dumps(decision))
    end, grace_end, early = time.monotonic() + limit, None, False
    while True:
        now = time.monotonic()
        if grace is not None and grace_end is None and every_rank_joined(store, world_size):
            grace_end = now + grace
        if grace_end is not None and now >= grace_end:
            silent = [r for r, key in enumerate(keys) if not store.check([key])]
            if present_ranks(present, silent, number) != silent:
                early = True
                break
            grace_end = float("inf")  # every silent rank has the shim: wait for them as long as the limit
        step = min(end - now, poll)
        if step < 0.01 or _wait(store, keys, step):
            break
    reports = {r: json.loads(store.get(key)) for r, key in enumerate(keys) if r == rank or store.check([key])}
    return reports, early


def present_ranks(present: Any, ranks: list[int], number: int) -> list[int]:
    """Those of ``ranks`` whose presence before check ``number`` is in the rendezvous store ``present``."""
    try:
        return [r for r in ranks if present is not None and present.check([_key(f"present/{number}", r)])]
    except Exception:  # a store that went away holds no evidence
        return []


def _wait(store: Any, keys: list[str], seconds: float) -> bool:
    try:
        store.wait(keys, timedelta(seconds=seconds))
    except Exception as error:  # the store's timeout error differs across torch releases
        if not ("timeout" in f"{type(error).__name__} {error}".lower() or "timed out" in str(error).lower()):
            raise
        return False
    return True


def every_rank_joined(store: Any, world_size: int) -> bool:
    """Whether every rank's gloo address is in the default store (``cpu//0/<rank>``, torch 2.3 to 2.15)."""
    return bool(store.check([f"cpu//0/{r}" for r in range(world_size)]))


def summary(report: dict[str, Any]) -> str:
    """``bfloat16; fixes: cast (Lightning's own), recompute (except the reentrant checkpoint)``."""
    named = []
    for fix, entry in report.get("fixes", {}).items():
        if entry["by"] == "fsdp-shim" and entry.get("except"):
            from _fsdp_shim.failures import the_checkpoints  # a path passed by: loaded already, to say so

            named.append(f"{fix} (except {the_checkpoints(entry['except'])})")
        elif entry["by"] != "off":
            named.append(fix if entry["by"] == "fsdp-shim" else f"{fix} ({entry['by']}'s own)")
    return f"{str(report.get('dtype')).replace('torch.', '')}; fixes: {', '.join(named) or 'none'}"


def _messages() -> Any:
    """What the rank check says when it fails, loaded only then."""
    from _fsdp_shim import rank_check_messages

    return rank_check_messages
