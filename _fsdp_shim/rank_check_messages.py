"""What the rank check says when ranks do not agree (which ranks, on which hosts, with which fixes, and why), or when
it cannot check."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from _fsdp_shim.config import DOCS, RANK_CHECK_TIMEOUT_VARIABLE, SHIM_VARIABLE


def stop(
    silent: list[int], reports: dict[int, Any], world_size: int, waited: float, joined: bool, paused: list[int]
) -> Exception:
    """The ``FSDPShimError`` that stops the job: ranks ``silent`` (``paused``: those that said they have the shim), or
    ranks that run different fixes or dtypes."""
    from _fsdp_shim.failures import FSDPShimError

    if silent:
        return FSDPShimError(missing(silent, reports, world_size, waited, joined, paused))
    return FSDPShimError(disagreement(reports, world_size))


def _ranks(ranks: Sequence[int]) -> str:
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(str(r) for r in ranks)}"


def missing(
    missing: list[int],
    reports: dict[int, dict[str, Any]],
    world_size: int,
    waited: float,
    joined: bool,
    paused: Sequence[int] = (),
) -> str:
    """Ranks that did not report; ``paused``: those of them that said at the rendezvous they have the shim."""
    joined_but = "joined the process group but " if joined else ""
    busy = f"{waited:g} s after joining it" if joined else f"after {waited:g} s"
    start = (
        f"fsdp-shim: {_ranks(missing)} of {world_size} {joined_but}did not report within {waited:g} s which fixes "
        f"it runs"
    )
    stopping = f", so this job may be half-patched ({described(reports)}). Stopping before any model is wrapped."
    if list(paused) == list(missing):
        return (
            f"{start} (each had fsdp-shim when it joined the group){stopping} Such a rank was stopped or busy since "
            "(a debugger, a suspended or swapping node), its own check could not run (its output says why), or it "
            f"set up another precision or strategy ({RANK_CHECK_TIMEOUT_VARIABLE} sets the wait; see {DOCS}"
            "cluster.html)."
        )
    had = f" ({_ranks(paused)} had fsdp-shim when joining the group)" if paused else ""
    return (
        f"{start}{had}{stopping} On the ranks that did not report, fsdp-shim may not be active ({SHIM_VARIABLE}=0 "
        "in their environment; a node whose Python environment lacks fsdp-shim or its start-up file; a launcher that "
        f"dropped PYTHONPATH or {SHIM_VARIABLE}: srun/sbatch --export=..., env -i, sudo, a job script that sets "
        f"PYTHONPATH), they may run another precision or strategy, or they were still busy {busy} "
        f"({RANK_CHECK_TIMEOUT_VARIABLE} sets the wait). Activate it on every rank ({SHIM_VARIABLE}=1 with fsdp-shim "
        f"installed in every node's environment, see {DOCS}cluster.html)."
    )


def disagreement(reports: dict[int, dict[str, Any]], world_size: int) -> str:
    return (
        f"fsdp-shim: the {world_size} ranks of this job run different fixes or dtypes ({described(reports)}), so "
        "their shards, gradients and optimizer state would not match. Stopping before any model is wrapped. Use one "
        "Lightning release, one fsdp-shim release, one precision and one FSDP_SHIM_DISABLED_FIXES on every node."
    )


def described(reports: dict[int, dict[str, Any]]) -> str:
    """Alike ranks together: ``ranks 0, 1 on n1: bfloat16; fixes: cast (lightning.pytorch 2.4.0, fsdp-shim 0.3.0)``;
    each report carries its ``summary``."""
    groups: dict[str, list[int]] = {}
    for r, report in sorted(reports.items()):
        releases = f"{report.get('namespace')} {report.get('lightning')}, fsdp-shim {report.get('fsdp_shim')}"
        groups.setdefault(f"{report['summary']} ({releases})", []).append(r)
    hosts = {label: ", ".join(sorted({str(reports[r].get("host")) for r in ranks})) for label, ranks in groups.items()}
    return "; ".join(f"{_ranks(ranks)} on {hosts[label]}: {label}" for label, ranks in groups.items())


def could_not_check(error: BaseException) -> None:
    from _fsdp_shim import failures

    failures.report(
        f"fsdp-shim: could not check that every rank of this job runs the same fixes ({type(error).__name__}: {error})",
        f"training goes on unchecked; make sure every rank has the shim ({SHIM_VARIABLE}=1 on every node)",
        key="rank-check",
        cause=error,
    )


def unreadable_timeout(problem: str, default: float) -> None:
    from _fsdp_shim import failures

    failures.warn_once(
        f"fsdp-shim: {problem}; the cross-rank check waits as long as the process group's timeout ({default:g} s)",
        key=f"rank-timeout:{problem}",
    )
