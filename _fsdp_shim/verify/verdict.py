"""The verdicts per fix: what verify promises. The recompute compares each checkpointed run with the unchecked one
in the same shim state (on 2.1-2.4 the cast alone makes shim-off and shim-on runs differ)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from _fsdp_shim.config import CAST, FIXES, RECOMPUTE, Fix, State
from _fsdp_shim.verify.measure import finite
from _fsdp_shim.verify.records import RankResult

DTYPES = {"bf16-true": "torch.bfloat16", "16-true": "torch.float16"}
BYTE_KEYS = ("param_bytes", "grad_bytes", "optimizer_state_bytes")
NOT_CHECKED = "not checked: --activation-checkpointing MODULE:CLASS[,...] trains your checkpointed blocks with it"


def unaffected_reason(fix: Fix, version: str) -> str:
    """Why a release this fix does not apply to needs nothing."""
    if fix.built_in(version):
        return f"Lightning {version} already contains it ({fix.upstream}); left untouched"
    return f"Lightning {version} has no 'true' precisions for FSDP; nothing to fix"


@dataclass
class Section:
    """One namespace (or the user's model): ``verdict`` and ``reason`` are the cast's, ``fixes`` every fix's."""

    namespace: str
    version: str | None
    verdict: str
    reason: str
    fixes: list[dict[str, Any]] = field(default_factory=list)
    shim_off: list[RankResult] | None = None
    shim_on: list[RankResult] | None = None
    checkpointed_shim_off: list[RankResult] | None = None
    checkpointed_shim_on: list[RankResult] | None = None
    shim_off_error: str | None = None  # the traceback of a user's model that raised without the shim


def fix_entries(states: dict[str, dict[str, Any]], verdicts: dict[str, tuple[str | None, str]]) -> list[dict[str, Any]]:
    """Per fix: its verdict (``None`` where not checked), reason, and ``shim``: its ``FixStatus`` read in a probe.
    A fix the shim says is not in effect on this torch is ``FAILED`` with that reason, checked or not."""
    rows = [(fix.name, *verdicts.get(fix.name, (None, NOT_CHECKED))) for fix in FIXES]
    rows = [
        (f, "FAILED", states[f]["reason"]) if not_in_effect(states.get(f)) and v != "FAILED" else (f, v, why)
        for f, v, why in rows
    ]
    return [{"fix": fix, "verdict": verdict, "reason": why, "shim": states.get(fix)} for fix, verdict, why in rows]


def not_in_effect(state: dict[str, Any] | None) -> bool:
    """Whether a ``FixStatus`` (as a dict) says the fix is not in effect on this torch."""
    return bool(state) and state["state"] == State.NOT_IN_EFFECT.value  # type: ignore[index]


def _not_applied(state: dict[str, Any], namespace: str) -> str:
    if not_in_effect(state):
        return f"the shim's fix is {state['reason']}"
    return f"the shim did not apply it to {namespace}: {state['reason']}"


def _same_figures(off: list[RankResult], on: list[RankResult]) -> bool:
    keys = ("module_dtype", "flat_param_dtypes", *BYTE_KEYS, "unit_param_bytes")
    return all([getattr(a, k) for k in keys] == [getattr(b, k) for k in keys] for a, b in zip(off, on))


def judge(off: list[RankResult], on: list[RankResult], precision: str, seed_model: bool) -> tuple[str, str]:
    """The cast's verdict: ``fixed`` must hold on every rank, exactly; ``not needed`` if the shim changes nothing."""
    version, want, short = on[0].lightning, DTYPES[precision], DTYPES[precision].removeprefix("torch.")
    if not CAST.affects(version):
        if _same_figures(off, on):
            return "not needed", f"{unaffected_reason(CAST, version)}; measured: the shim changes nothing"
        return "FAILED", f"{unaffected_reason(CAST, version)}, but the figures differ with the shim on"
    state = on[0].fixes[CAST.name]
    problems = [] if state["patched"] else [f"the shim did not patch {on[0].namespace}: {state['reason']}"]
    for a, b in zip(off, on):
        rank = f" on rank {b.rank}" if len(on) > 1 else ""
        if b.module_dtype != want:
            problems.append(f"LightningModule.dtype is {b.module_dtype}{rank}, expected {want}")
        if b.flat_param_dtypes != [want]:
            problems.append(f"flat parameters are {', '.join(b.flat_param_dtypes)}{rank}, expected {want}")
        for key in BYTE_KEYS:
            before, after = getattr(a, key), getattr(b, key)
            if after > before or (a.flat_param_dtypes != [want] and after >= before):
                problems.append(f"{key.replace('_', ' ')} did not shrink{rank} ({before:,} -> {after:,})")
        if seed_model and b.unit_param_bytes["pretrained"] * 2 != a.unit_param_bytes["pretrained"]:
            problems.append(f"the model loaded in float32 is not exactly half{rank}")
    if finite(off[0].losses) and not finite(on[0].losses):
        problems.append(
            "memory is fixed, but the training losses are not finite with the shim while they are without it: "
            f"{precision} keeps weights and optimizer state in {short} (see docs/numerics.md: use bf16-true or a "
            "larger optimizer eps)"
        )
    if problems:
        return "FAILED", "; ".join(problems)
    already_right = all(a.module_dtype == want and a.flat_param_dtypes == [want] for a in off)
    if not seed_model and already_right and _same_figures(off, on):
        return "not needed", (
            f"this model is already {short} without the shim (it casts itself), so the shim changes nothing for "
            "this model: measured, every dtype and byte count is the same with it on"
        )
    note = f"; note: the losses are not finite in either run ({precision} with this optimizer; see docs/numerics.md)"
    note = "" if finite(on[0].losses) else note
    before, after = (sum(getattr(r, k) for k in BYTE_KEYS) for r in (off[0], on[0]))
    if before == after:
        return "fixed", f"the parameters were already {short}; LightningModule.dtype is now right{note}"
    reason = f"sharded parameters, gradients and optimizer state are {1 - after / before:.0%} smaller on rank 0"
    if seed_model:
        reason += (
            f" (the model loaded in float32 is exactly half; the seed's model was already {short} and only its "
            "LightningModule.dtype was wrong)"
        )
    return "fixed", reason + note


def what_changed(plain: list[RankResult], checkpointed: list[RankResult]) -> str | None:
    """What the checkpointed run raised, or its first loss or parameter shard not the same bit for bit."""
    if checkpointed[0].error:
        return f"raised {checkpointed[0].error}"
    for a, b in zip(plain, checkpointed):
        rank = f" on rank {a.rank}" if len(plain) > 1 else ""
        for step, (x, y) in enumerate(zip(a.losses, b.losses), 1):
            if (x, y) != (None, None) and (x is None or y is None or float(x).hex() != float(y).hex()):
                return f"differs first in the loss of step {step}{rank} ({x} without checkpointing, {y} with it)"
        for name, digest in a.param_hashes.items():
            if b.param_hashes.get(name) != digest:
                return f"differs first in parameter {name}{rank}"
    return None


def judge_recompute(
    off: list[RankResult] | None, on: list[RankResult], off_ac: list[RankResult], on_ac: list[RankResult], classes: str
) -> tuple[str, str]:
    """``fixed`` when, with the shim, checkpointing changes nothing bit for bit, and without it something."""
    count = on_ac[0].checkpointed or off_ac[0].checkpointed
    blocks = f"checkpointing {classes} ({count} module{'' if count == 1 else 's'})"
    state = on_ac[0].fixes[RECOMPUTE.name]
    changed, unfixed = what_changed(on, on_ac), what_changed(off or [], off_ac)
    if state["state"] == State.TORCH_HAS_IT.value:  # torch restores the dtype itself: nothing wrapped
        if changed or unfixed:
            return "FAILED", f"{state['reason']}, but the checkpointed run {changed or unfixed}"
        return "not needed", f"{state['reason']}; measured: {blocks} changes nothing, with the shim on and off"
    problems = [] if state["patched"] else [_not_applied(state, on[0].namespace)]
    problems += [f"with the shim, the checkpointed run {changed}"] if changed else []
    finding = f"with the shim off, the checkpointed run {unfixed}" if unfixed else ""
    if problems:
        return "FAILED", "; ".join(problems) + (f" ({finding})" if finding else "")
    if not finding:
        return "not needed", (
            f"{blocks} changes nothing with the shim off either: every loss and every rank's parameters are the "
            "same, bit for bit. These blocks give every tensor they make an explicit dtype, so their recompute "
            "does not depend on the default dtype, and the shim's fix is not needed for them"
        )
    return "fixed", (
        f"with the shim, {blocks} changes nothing: every step's loss and every rank's parameters equal the run "
        f"without it, bit for bit; {finding}"
    )


def judge_raised_without_shim(
    raised: dict[str, Any], on: list[RankResult], on_ac: list[RankResult] | None, precision: str, classes: str
) -> dict[str, tuple[str | None, str]]:
    """The verdicts for a user's model that raised without the shim and trains with it. The recompute made it
    train where the error came from a recompute of torch's checkpoint, or where the release lacks no other
    fix; else the cast did. Nothing is compared with a run without the shim: there is none."""
    version, error, want = on[0].lightning, raised["error"], DTYPES[precision]
    short = want.removeprefix("torch.")
    by_recompute = RECOMPUTE.affects(version) and (raised["in_recompute"] or not CAST.affects(version))
    who = "a recompute of torch's checkpoint" if raised["in_recompute"] else "training"
    without = f"without the shim, {who} raised {error}"
    verdicts: dict[str, tuple[str | None, str]] = {}
    cast_state, recompute_state = on[0].fixes[CAST.name], on[0].fixes[RECOMPUTE.name]
    if not CAST.affects(version):
        verdicts[CAST.name] = ("not needed", unaffected_reason(CAST, version))
    else:
        problems = [] if cast_state["patched"] else [_not_applied(cast_state, on[0].namespace)]
        for result in on:
            rank = f" on rank {result.rank}" if len(on) > 1 else ""
            if result.module_dtype != want or result.flat_param_dtypes != [want]:
                problems.append(f"with the shim, LightningModule.dtype or the flat parameters are not {short}{rank}")
        right = f"with the shim, LightningModule.dtype and every flat parameter are {short} on every rank"
        if problems:
            verdicts[CAST.name] = ("FAILED", "; ".join(problems))
        elif by_recompute:
            verdicts[CAST.name] = (None, f"not checked: {without}, so there is nothing to compare with; {right}")
        else:
            verdicts[CAST.name] = ("fixed", f"{without}; with the shim it trains, and {right}")
    changed = what_changed(on, on_ac) if on_ac else None
    checked = f"; with the shim, checkpointing {classes} changes nothing, bit for bit" if on_ac and not changed else ""
    if changed:
        verdicts[RECOMPUTE.name] = ("FAILED", f"with the shim, the checkpointed run {changed} ({without})")
    elif by_recompute and not recompute_state["patched"]:
        verdicts[RECOMPUTE.name] = ("FAILED", f"{_not_applied(recompute_state, on[0].namespace)} ({without})")
    elif by_recompute:
        verdicts[RECOMPUTE.name] = ("fixed", f"{without}; with the shim it trains{checked}")
    elif on_ac:
        verdicts[RECOMPUTE.name] = (None, f"not checked: {without}, so there is nothing to compare with{checked}")
    return verdicts


def overall(sections: list[Section]) -> tuple[str, str]:
    """One verdict for the whole run, and every section's in one line."""
    verdicts = {s.verdict for s in sections} | {e["verdict"] for s in sections for e in s.fixes}
    verdict = "FAILED" if "FAILED" in verdicts else ("fixed" if "fixed" in verdicts else "not needed")
    parts = [(s, next((e["verdict"] for e in s.fixes if e["fix"] == RECOMPUTE.name), None)) for s in sections]
    texts = [
        f"{s.namespace} {s.version or ''}: " + (f"cast {s.verdict}, recompute {r}" if r else s.verdict)
        for s, r in parts
    ]
    return verdict, "; ".join(text.replace(" :", ":") for text in texts)
