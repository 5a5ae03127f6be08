"""The failure policy (strict mode raises; otherwise one warning at the user's line) and the text of each failure."""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Sequence
from types import FrameType
from typing import Any

from _fsdp_shim import FSDPShimWarning, config
from _fsdp_shim.log import first_time, process_rank


class FSDPShimError(RuntimeError):
    """A problem of the shim in strict mode (``FSDP_SHIM_STRICT``), or ranks of one job that run different fixes."""

    __module__ = "fsdp_shim"  # where users import it from


def read_switch(name: str, meaning: str) -> str:
    """``switch_state`` of the variable ``name``, warning once per unreadable value (``meaning``: what it does)."""
    raw = os.environ.get(name)
    state = config.switch_state(raw)
    if state == "invalid":
        warn_once(
            f"fsdp-shim: {name}={raw!r} is not a valid value and {meaning}. "
            f"Valid values (case-insensitive): {config.VALID_SWITCH_VALUES}.",
            key=f"toggle:{name}={raw}",
        )
    return state


def unreadable_settings() -> None:
    """``FSDP_SHIM_DISABLED_FIXES`` names that are no fix, and an unreadable ``FSDP_SHIM_LOG``: a warning each."""
    unknown, problem = config.disabled_fixes()[1], config.log_setting()[1]
    if unknown:
        warn_once(
            f"fsdp-shim: {config.DISABLED_FIXES_VARIABLE} names {', '.join(map(repr, unknown))}, which is no fix of "
            f"fsdp-shim (its fixes: {', '.join(config.FIX_NAMES)}); that name is ignored",
            key=f"disabled:{','.join(unknown)}",
        )
    if problem is not None:
        warn_once(f"fsdp-shim: {problem}", key=problem)


def internal_error(error: Exception, *, doing: str, key: str, cannot: str | None = None) -> None:
    """The shim's own error while ``doing``; what it raises on purpose (strict mode, the rank check) goes on.
    ``cannot``: what a missing dependency of the shim (wrapt, packaging) stops."""
    if isinstance(error, (FSDPShimError, Warning)):
        raise error
    if isinstance(error, ImportError) and cannot is not None:
        consequence = "Lightning was left unchanged, so no fix applies"
        report(f"fsdp-shim: cannot {cannot}: {type(error).__name__}: {error}", consequence, key=key, cause=error)
        return
    problem = f"fsdp-shim: internal error while {doing} ({type(error).__name__}: {error})"
    report(problem, "see fsdp_shim.status() for what is in effect", key=key, cause=error)


def glue_failed(wrapper: Any, error: Exception) -> None:
    """A wrapper could not read what it needs: Lightning's or torch's own function ran for this call."""
    what = "rank check" if wrapper.fix == config.RANK_CHECK.name else f"{wrapper.fix} fix"
    problem = f"fsdp-shim: {wrapper.label} could not read what it needs ({error})"
    said = f"{owners_own(wrapper)} was used for this call, so it runs without the {what}"
    report(problem, said, key=f"glue:{wrapper.label}", cause=error)


def owners_own(wrapper: Any) -> str:
    return "torch's own function" if wrapper.target.shared else "Lightning's own method"


def cannot_patch(namespace: str, fix: Any, record: Any) -> None:
    """A namespace that could not be patched, and why (``record.detail``): left unchanged."""
    which, without = (f" ({fix.name} fix)", f"it runs without the {fix.name} fix") if record.affected else ("", "")
    problem = f"fsdp-shim: cannot patch {namespace} {record.version or '(unknown version)'}{which}: {record.detail}"
    key = f"patch:{namespace}:{fix.name}:{record.detail}"
    report(problem, f"Lightning was left unchanged, so {without or 'no fix applies'}", key=key)


def wrapper_left(label: str, top: str, gone: bool) -> None:
    """``deactivate()`` found another library's object on top of, or instead of, the shim's wrapper on ``label``."""
    said = (
        f"its wrapper on {label} had already been replaced by other code ({top}); nothing of the shim's is left there "
        "to remove"
        if gone
        else f"deactivated its wrapper on {label} in place, because other code ({top}) has wrapped it since; it now "
        "passes every call through, and the other code's wrapper is left as it is"
    )
    warn_once(f"fsdp-shim: {said}", key=f"{'gone' if gone else 'buried'}:{label}")


def threads_clashed() -> None:
    """Two recomputes in different default dtypes at once: torch's default dtype is one per process."""
    warn_once(
        "fsdp-shim: two activation-checkpointed recomputes ran at once in different default dtypes (two threads' "
        "backwards); torch's default dtype is one for the whole process, so one of them ran in the other's dtype. "
        f"The default dtype is put back when both end. See {config.DOCS}how-it-works.html#threads",
        key="recompute:threads",
    )


def recompute_passed_by(paths: list[str], findings: dict[str, Any]) -> None:
    """torch's call path passes the recompute fix's wrappers by on ``paths`` (its check showed it): taken off there."""
    checkpoints, why = the_checkpoints(paths), whys(paths, findings)
    problem = f"the recompute fix is not in effect on torch {torch_version()} for {checkpoints} ({why})"
    said = "torch was left as it was there, so this fix is off for that checkpoint in this process"
    report(f"fsdp-shim: {problem}", said, key=f"proof:{checkpoints}")


def joined(names: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``: a list in a message."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def the_checkpoints(paths: list[str]) -> str:
    """``the reentrant checkpoint``, ``the reentrant and composable checkpoints``."""
    return f"the {joined(paths)} checkpoint{'s' if len(paths) > 1 else ''}"


def whys(paths: list[str], findings: dict[str, Any]) -> str:
    """What the recompute check found for ``paths``: one reason, or each path's."""
    if len({findings[path].why for path in paths}) == 1:
        return str(findings[paths[0]].why)
    return "; ".join(f"the {path} checkpoint: {findings[path].why}" for path in paths)


def torch_version() -> str:
    return str(getattr(sys.modules.get("torch"), "__version__", "?"))


# ----------------------------------------------------------------------------- the rank check
def rank_check_error(
    silent: list[int], reports: dict[int, Any], world_size: int, waited: float, joined: bool, paused: list[int]
) -> Exception:
    """The ``FSDPShimError`` that stops the job: ranks ``silent`` did not report (``joined``: seen to join the group,
    ``paused``: said at the rendezvous they have the shim), or, none silent, the ranks run different fixes or dtypes."""
    if not silent:
        return FSDPShimError(
            f"fsdp-shim: the {world_size} ranks of this job run different fixes or dtypes ({described(reports)}), so "
            "their shards, gradients and optimizer state would not match. Stopping before any model is wrapped. Use "
            "one Lightning release, fsdp-shim release, precision and FSDP_SHIM_DISABLED_FIXES on every node."
        )
    shim, wait = config.SHIM_VARIABLE, config.RANK_CHECK_TIMEOUT_VARIABLE
    if paused == silent:
        why = "have been paused since (a debugger, a suspended node), have failed its own check (see its output)"
    else:
        why = (
            f"lack the shim ({shim}=0 in its environment, fsdp-shim or its start-up file missing on its node, a "
            f"launcher or job script that dropped {shim} or PYTHONPATH: srun --export, env -i, sudo), be still busy "
            + (f"{waited:g} s after joining it" if joined else f"after {waited:g} s")
        )
    had = f" ({_ranks_named(paused)} had fsdp-shim when joining the group)" if paused else ""
    joined_but = "joined the process group but " if joined else ""
    return FSDPShimError(
        f"fsdp-shim: {_ranks_named(silent)} of {world_size} {joined_but}did not report within {waited:g} s which "
        f"fixes it runs{had}, so this job may be half-patched ({described(reports)}). Stopping before any model is "
        f"wrapped. A rank that did not report may {why}, or run another precision or strategy. {shim}=1 on every "
        f"rank activates fsdp-shim; {wait} sets the wait: {config.DOCS}cluster.html"
    )


def _ranks_named(ranks: Sequence[int]) -> str:
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(str(r) for r in ranks)}"


def described(reports: dict[int, dict[str, Any]]) -> str:
    """Alike ranks together: ``ranks 0, 1 on n1: bfloat16; fixes: cast (lightning.pytorch 2.4.0, fsdp-shim 0.3.0)``."""
    groups: dict[str, list[int]] = {}
    for r, report in sorted(reports.items()):
        releases = f"{report.get('namespace')} {report.get('lightning')}, fsdp-shim {report.get('fsdp_shim')}"
        groups.setdefault(f"{report.get('summary')} ({releases})", []).append(r)
    hosts = {label: ", ".join(sorted({str(reports[r].get("host")) for r in ranks})) for label, ranks in groups.items()}
    return "; ".join(f"{_ranks_named(ranks)} on {hosts[label]}: {label}" for label, ranks in groups.items())


def rank_check_failed(error: BaseException) -> None:
    problem = f"could not check that every rank of this job runs the same fixes ({type(error).__name__}: {error})"
    said = f"training goes on unchecked; make sure every rank has the shim ({config.SHIM_VARIABLE}=1 on every node)"
    report(f"fsdp-shim: {problem}", said, key="rank-check", cause=error)


def unreadable_rank_check_timeout(problem: str, default: float) -> None:
    said = f"the cross-rank check waits as long as the process group's timeout ({default:g} s)"
    warn_once(f"fsdp-shim: {problem}; {said}", key=f"rank-timeout:{problem}")


def warn_about_models_already_wrapped() -> None:
    """After a late patch: models FSDP wrapped before keep their dtype, said once if there is any."""
    import gc  # a walk of every object, with type(): proxies warn on __class__

    fsdp = getattr(sys.modules.get("torch.distributed.fsdp"), "FullyShardedDataParallel", None)
    if isinstance(fsdp, type) and any(issubclass(type(o), fsdp) for o in gc.get_objects()):
        warn_once(
            "fsdp-shim was activated after FSDP had already wrapped a model: its parameters keep the dtype they were "
            "wrapped with. The fix applies from the next setup on. Import fsdp_shim before Lightning, or use "
            "`fsdp-shim run` or the start-up file.",
            key="late",
        )


def float16_notice() -> None:
    """Once, on rank zero: ``16-true`` now keeps float16 weights, which AdamW's default ``eps`` cannot train."""
    if first_time("log:float16") and process_rank() == 0:
        import logging

        logging.getLogger("fsdp_shim").warning(
            "fsdp-shim: precision='16-true' now keeps the model's weights and optimizer state in float16, as "
            "Lightning 2.5+ does (unpatched 2.1-2.4 kept them in float32). AdamW's default eps=1e-8 is 0 in "
            "float16 and gives NaN losses: use precision='bf16-true', or eps >= 1e-4. See %snumerics.html",
            config.DOCS,
        )


def strict_mode() -> bool:
    return read_switch(config.STRICT_VARIABLE, "turned strict mode ON (failures raise)") in ("on", "invalid")


def report(problem: str, consequence: str, *, key: str, cause: BaseException | None = None) -> None:
    """Raise in strict mode; otherwise warn ``problem; consequence`` once per ``key``."""
    if strict_mode():
        raise FSDPShimError(f"{problem} ({config.STRICT_VARIABLE} is on)") from cause
    warn_once(f"{problem}; {consequence}", key=key)


def warn_once(message: str, *, key: str) -> None:
    """One ``FSDPShimWarning`` per ``key`` per process, pointing at the user's line."""
    if not first_time(key):
        return
    frame = user_frame()
    if frame is None:
        warnings.warn(message, FSDPShimWarning, stacklevel=1)
        return
    found = frame.f_globals
    source = found if found.get("__file__") else None  # `python -c`'s loader raises when asked for source
    registry = found.setdefault("__warningregistry__", {})
    warnings.warn_explicit(
        message, FSDPShimWarning, frame.f_code.co_filename, frame.f_lineno, found.get("__name__"), registry, source
    )


def user_frame() -> FrameType | None:
    """The innermost frame outside fsdp-shim, the import machinery, wrapt and Lightning, where warnings point."""
    packages = ("_fsdp_shim", "fsdp_shim", "importlib", "wrapt", *config.LIGHTNING_PACKAGES)
    files = [getattr(sys.modules.get(name), "__file__", None) for name in packages]
    internal = ("<frozen importlib", *(os.path.join(os.path.dirname(os.path.abspath(f)), "") for f in files if f))
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(internal):
        frame = frame.f_back
    return frame
