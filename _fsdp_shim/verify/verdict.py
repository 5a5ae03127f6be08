"""The verdicts: from both runs' figures, "fixed", "not needed" or "FAILED", with the reason in words.

Kept apart from running the probes and from the output so that what verify promises (``fixed`` holds
on every rank, exactly; ``not needed`` only when the shim measurably changes nothing) is in one place.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from _fsdp_shim.config import CAST
from _fsdp_shim.verify import measure
from _fsdp_shim.verify.results import RankResult

DTYPES = {"bf16-true": "torch.bfloat16", "16-true": "torch.float16"}
BYTE_KEYS = ("param_bytes", "grad_bytes", "optimizer_state_bytes")


@dataclass
class Section:
    """The verdict for one Lightning namespace (or the user's model), with every figure behind it."""

    namespace: str
    version: str | None
    verdict: str
    """``fixed``, ``not needed`` or ``FAILED``."""
    reason: str
    shim_off: list[RankResult] | None = None
    shim_on: list[RankResult] | None = None


def _figures(result: RankResult) -> tuple[str, ...]:
    keys = ("module_dtype", "flat_param_dtypes", *BYTE_KEYS, "unit_param_bytes")
    return tuple(json.dumps(getattr(result, key)) for key in keys)


def judge(off: list[RankResult], on: list[RankResult], precision: str, seed_model: bool) -> tuple[str, str]:
    """The verdict from both runs, every rank. ``fixed`` must hold on every rank, exactly."""
    version = on[0].lightning
    if not CAST.affects(version):
        if all(_figures(a) == _figures(b) for a, b in zip(off, on)):
            return "not needed", f"{CAST.unaffected_reason(version)}; measured: the shim changes nothing"
        return "FAILED", f"{CAST.unaffected_reason(version)}, but the figures differ with the shim on"
    want = DTYPES[precision]
    problems = []
    if not on[0].shim_patched:
        problems.append(f"the shim did not patch {on[0].namespace}: {on[0].shim_reason}")
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
    if measure.finite(off[0].losses) and not measure.finite(on[0].losses):
        problems.append(
            "memory is fixed, but the training losses are not finite with the shim while they are without it: "
            f"{precision} keeps weights and optimizer state in {want.removeprefix('torch.')} "
            "(see docs/numerics.md: use bf16-true or a larger optimizer eps)"
        )
    if problems:
        return "FAILED", "; ".join(problems)
    already_right = all(a.module_dtype == want and a.flat_param_dtypes == [want] for a in off)
    if not seed_model and already_right and all(_figures(a) == _figures(b) for a, b in zip(off, on)):
        return "not needed", (
            f"this model is already {want.removeprefix('torch.')} without the shim (it casts itself), so the shim "
            "changes nothing for this model: measured, every dtype and byte count is the same with it on"
        )
    note = ""
    if not measure.finite(on[0].losses):
        note = (
            f"; note: the losses are not finite in either run ({precision} with this optimizer; see docs/numerics.md)"
        )
    total = {run: sum(getattr(r, k) for k in BYTE_KEYS) for run, r in (("off", off[0]), ("on", on[0]))}
    if total["on"] == total["off"]:
        already = f"the parameters were already {want.removeprefix('torch.')}; LightningModule.dtype is now right"
        return "fixed", already + note
    reason = (
        f"sharded parameters, gradients and optimizer state are {1 - total['on'] / total['off']:.0%} smaller on rank 0"
    )
    if seed_model:
        reason += (
            f" (the model loaded in float32 is exactly half; the seed's model was already "
            f"{want.removeprefix('torch.')} and only its LightningModule.dtype was wrong)"
        )
    return "fixed", reason + note


def overall(sections: list[Section]) -> tuple[str, str]:
    """One verdict for the whole run: FAILED if any section failed, else fixed if any was fixed."""
    verdicts = {s.verdict for s in sections}
    verdict = "FAILED" if "FAILED" in verdicts else ("fixed" if "fixed" in verdicts else "not needed")
    return verdict, "; ".join(f"{s.namespace} {s.version or ''}: {s.verdict}".replace(" :", ":") for s in sections)
