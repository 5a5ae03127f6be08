"""What the rank check says when ranks do not agree (which ranks, on which hosts, with which fixes, and why), or when
it cannot check: loaded only then."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from _fsdp_shim.config import DOCS, RANK_CHECK_TIMEOUT_VARIABLE, SHIM_VARIABLE


def stop(
    silent: list[int], reports: dict[int, Any], world_size: int, waited: float, joined: bool, paused: list[int]
) -> Exception:
    """The ``FSDPShimError`` that stops the job: ranks ``silent`` did not report (``joined``: seen to join the group,
    ``paused``: said at the rendezvous they have the shim), or, none silent, the ranks run different fixes or dtypes."""
    from _fsdp_shim.failures import FSDPShimError

    if not silent:
        return FSDPShimError(
            f"fsdp-shim: the {world_size} ranks of this job run different fixes or dtypes ({described(reports)}), so "
            "their shards, gradients and optimizer state would not match. Stopping before any model is wrapped. Use "
            "one Lightning release, fsdp-shim release, precision and FSDP_SHIM_DISABLED_FIXES on every node."
        )
    if paused == silent:
        why = "have been paused since (a debugger, a suspended node), have failed its own check (see its output)"
    else:
        busy = f"{waited:g} s after joining it" if joined else f"after {waited:g} s"
        why = (
            f"lack the shim ({SHIM_VARIABLE}=0 in its environment, fsdp-shim or its start-up file missing on its "
            f"node, a launcher or job script that dropped {SHIM_VARIABLE} or PYTHONPATH: srun --export, env -i, sudo), "
            f"be still busy {busy}"
        )
    had = f" ({_ranks(paused)} had fsdp-shim when joining the group)" if paused else ""
    joined_but = "joined the process group but " if joined else ""
    return FSDPShimError(
        f"fsdp-shim: {_ranks(silent)} of {world_size} {joined_but}did not report within {waited:g} s which fixes it "
        f"runs{had}, so this job may be half-patched ({described(reports)}). Stopping before any model is wrapped. "
        f"A rank that did not report may {why}, or run another precision or strategy. {SHIM_VARIABLE}=1 on every "
        f"rank activates fsdp-shim; {RANK_CHECK_TIMEOUT_VARIABLE} sets the wait: {DOCS}cluster.html"
    )


def _ranks(ranks: Sequence[int]) -> str:
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(str(r) for r in ranks)}"


def described(reports: dict[int, dict[str, Any]]) -> str:
    """Alike ranks together: ``ranks 0, 1 on n1: bfloat16; fixes: cast (lightning.pytorch 2.4.0, fsdp-shim 0.3.0)``."""
    groups: dict[str, list[int]] = {}
    for r, report in sorted(reports.items()):
        releases = f"{report.get('namespace')} {report.get('lightning')}, fsdp-shim {report.get('fsdp_shim')}"
        groups.setdefault(f"{report.get('summary')} ({releases})", []).append(r)
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
