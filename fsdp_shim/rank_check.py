"""Every rank of a distributed job runs the same fix, or the job stops before its first step.

A job in which some ranks have the shim and others do not (``FSDP_SHIM=0`` on one node, a node whose
environment lacks the start-up file, a launcher that dropped ``PYTHONPATH``) trains without any error:
compute agrees, because Lightning's "true" plugins all-gather in the low dtype, but the ranks hold
their shards, gradients and optimizer state in different dtypes, and the job dies at its first
checkpoint in a gloo/NCCL collective whose message names no cause. So each rank that converts a model
says so in the process group's key-value store and waits, bounded, for every other rank to say the
same.

Why the store and not a collective: a rank without the shim never runs this code, so a collective
here would hang the ranks that do (or pair with an unrelated collective of the other rank and corrupt
the job). A key that never appears only costs the waiting ranks their timeout, after which they stop
with an error that names the missing ranks.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from _fsdp_shim_startup import SHIM_VARIABLE
from fsdp_shim import failures
from fsdp_shim.errors import FSDPShimError

TIMEOUT_VARIABLE = "FSDP_SHIM_RANK_CHECK_TIMEOUT"
DEFAULT_TIMEOUT_SECONDS = 300.0
"""Long enough for a rank that reaches its FSDP setup minutes after the others (loading a large
checkpoint from a slow file system); ranks that agree never wait for it."""

_KEY_PREFIX = "fsdp_shim/rank_check"

_count_lock = threading.Lock()
_conversions = 0
"""How many models this process has converted in a distributed job. Every rank of a job runs the
same program, so the n-th conversion of each rank belongs together (Fabric's ``setup_module`` for two
models, or ``fit`` and then ``test``)."""


def timeout_seconds(environ: Mapping[str, str] | None = None) -> float:
    """The bounded wait; ``0`` turns the check off. An unreadable value keeps the default and warns:
    a check that guards against silent corruption should not be switched off by a typo."""
    env = os.environ if environ is None else environ
    raw = env.get(TIMEOUT_VARIABLE, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_SECONDS
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value < 0 or value != value or value == float("inf"):
        failures.warn_once(
            f"fsdp-shim: {TIMEOUT_VARIABLE}={raw!r} is not a number of seconds >= 0; "
            f"the cross-rank check waits the default {DEFAULT_TIMEOUT_SECONDS:g} s",
            key=f"rank-timeout:{raw}",
        )
        return DEFAULT_TIMEOUT_SECONDS
    return value


def confirm_every_rank(dtype: Any, namespace: str) -> None:
    """Publish this rank's decision and wait until every rank of the job has published the same.

    Raises ``FSDPShimError`` (in every mode: a half-patched job is never what anyone wants) when a rank
    does not report in time or reports a different dtype. Anything else going wrong in the check
    itself follows the failure policy: a warning (strict: an error), and training goes on.
    """
    try:
        group = _process_group()
    except Exception as error:
        _could_not_check(error)
        return
    if group is None:
        return
    store, rank, world_size = group
    limit = timeout_seconds()
    if limit == 0:
        return
    number = _next_conversion()
    started = time.monotonic()
    try:
        reports = _exchange(store, number, rank, world_size, _decision(dtype, namespace), limit)
    except Exception as error:
        _could_not_check(error)
        return
    missing = [r for r in range(world_size) if r not in reports]
    if missing:
        raise FSDPShimError(_missing_message(missing, reports, world_size, limit, dtype))
    dtypes = {r: report.get("dtype") for r, report in reports.items()}
    if len(set(dtypes.values())) > 1:
        raise FSDPShimError(_disagreement_message(reports, world_size))
    if rank == 0:
        waited = time.monotonic() - started
        failures.announce(
            "fsdp-shim: patched on all %d ranks (%s), confirmed in %.2f s", world_size, _short(dtype), waited
        )


def _process_group() -> tuple[Any, int, int] | None:
    """The default group's store, this rank and the world size; ``None`` outside a multi-rank job."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    world_size = dist.get_world_size()
    if world_size < 2:
        return None
    store = dist.distributed_c10d._get_default_store()
    return store, dist.get_rank(), world_size


def _next_conversion() -> int:
    global _conversions
    with _count_lock:
        number = _conversions
        _conversions += 1
    return number


def _decision(dtype: Any, namespace: str) -> dict[str, Any]:
    from fsdp_shim._version import __version__

    module = __import__(namespace.partition(".")[0])
    return {
        "dtype": str(dtype),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "namespace": namespace,
        "lightning": getattr(module, "__version__", None),
        "fsdp_shim": __version__,
    }


def _exchange(
    store: Any, number: int, rank: int, world_size: int, decision: dict[str, Any], limit: float
) -> dict[int, dict[str, Any]]:
    """Write this rank's key, wait for the others' up to ``limit`` seconds, read what is there."""
    keys = [f"{_KEY_PREFIX}/{number}/{r}" for r in range(world_size)]
    store.set(keys[rank], json.dumps(decision))
    try:
        store.wait(keys, timedelta(seconds=limit))
    except Exception as error:  # the store says "timeout" in a type that differs across torch releases
        if not _is_timeout(error):
            raise
    reports = {}
    for r, key in enumerate(keys):
        if r == rank or store.check([key]):
            reports[r] = json.loads(store.get(key))
    return reports


def _is_timeout(error: BaseException) -> bool:
    return "timeout" in f"{type(error).__name__} {error}".lower() or "timed out" in str(error).lower()


def _short(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def _missing_message(
    missing: list[int], reports: dict[int, dict[str, Any]], world_size: int, limit: float, dtype: Any
) -> str:
    hosts = sorted({str(report.get("host")) for report in reports.values()})
    noun = "rank" if len(missing) == 1 else "ranks"
    holders = "rank {} (on {}) holds its" if len(reports) == 1 else "ranks {} (on {}) hold their"
    return (
        f"fsdp-shim: {noun} {_ranks(missing)} of {world_size} did not confirm the FSDP precision fix within "
        f"{limit:g} s, so this job is half-patched: {holders.format(_ranks(sorted(reports)), ', '.join(hosts))} "
        f"shards, gradients and optimizer state in {_short(dtype)}, the others most likely in float32, "
        "and it would fail or mix dtypes at its first checkpoint. Stopping before training. Likely causes on "
        f"the ranks that did not answer: {SHIM_VARIABLE}=0 in their environment; a node whose Python "
        "environment lacks fsdp-shim or its start-up file; a launcher that dropped PYTHONPATH or "
        f"{SHIM_VARIABLE} (srun/sbatch --export=..., env -i, sudo, a job script that sets PYTHONPATH). "
        f"Activate it on every rank ({SHIM_VARIABLE}=1 with fsdp-shim installed in every node's environment, "
        f"see docs/cluster.md); a rank that only starts later than {limit:g} s after the others needs a larger "
        f"{TIMEOUT_VARIABLE}."
    )


def _disagreement_message(reports: dict[int, dict[str, Any]], world_size: int) -> str:
    groups: dict[str, list[int]] = {}
    for r, report in sorted(reports.items()):
        label = (
            f"{_short(report.get('dtype'))} ({report.get('namespace')} {report.get('lightning')}, "
            f"fsdp-shim {report.get('fsdp_shim')})"
        )
        groups.setdefault(label, []).append(r)
    described = "; ".join(
        f"{'rank' if len(ranks) == 1 else 'ranks'} {_ranks(ranks)}: {label}" for label, ranks in groups.items()
    )
    return (
        f"fsdp-shim: the {world_size} ranks of this job converted their models to different dtypes ({described}), "
        "so their shards, gradients and optimizer state would not match. Stopping before training. Use one "
        "Lightning release, one fsdp-shim release and one precision on every node."
    )


def _could_not_check(error: BaseException) -> None:
    failures.report(
        f"fsdp-shim: could not check that every rank of this job runs the fix ({type(error).__name__}: {error})",
        f"training goes on unchecked; make sure every rank has the shim ({SHIM_VARIABLE}=1 on every node)",
        key="rank-check",
        cause=error,
    )
