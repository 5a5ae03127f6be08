"""verify's verdicts, from the runs' figures and each fix's ``state`` in them, and its text report (100 columns). The
recompute is judged by comparing each checkpointed run with an unchecked one (on 2.1-2.4 the cast alone makes
shim-off and shim-on runs differ)."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from _fsdp_shim.config import CAST, DOCS, FIXES, RECOMPUTE, Fix, State
from _fsdp_shim.verify.records import UNITS, Options, RankResult, Skipped

DTYPES = {"bf16-true": "torch.bfloat16", "16-true": "torch.float16"}
BYTE_KEYS = ("param_bytes", "grad_bytes", "optimizer_state_bytes")
NOT_CHECKED = "not checked: --activation-checkpointing MODULE:CLASS[,...] trains your checkpointed blocks with it"
WIDTH, LABEL, VALUE = 100, 46, 22
TERMS = {
    "GPU guards lifted": "Lightning refuses FSDP without a GPU; verify lifts that check in its own processes only, "
    "never in your training processes, to run the same code on CPU with gloo.",
    "flat parameter": "FSDP keeps the parameters of each wrapped unit in one flat tensor per rank; its dtype is "
    "what the sharded parameter, gradient and optimizer-state bytes are made of.",
    "seed model": "verify's own model when --model is not given: two copies of Lightning's demo Transformer, "
    "one built in configure_model, one loaded in float32 as from_pretrained does, and a causal block that makes "
    "its mask without a dtype, checkpointed in the runs that check the recompute.",
}
Runs = list[RankResult]
Verdict = tuple[Optional[str], str]  # None: not checked


@dataclass
class Section:
    """One namespace (or the user's model): ``verdict`` and ``reason`` are the cast's, ``fixes`` every fix's."""

    namespace: str
    version: str | None
    verdict: str
    reason: str
    fixes: list[dict[str, Any]] = field(default_factory=list)
    shim_off: Runs | None = None
    shim_on: Runs | None = None
    checkpointed_shim_off: Runs | None = None
    checkpointed_shim_on: Runs | None = None
    shim_off_error: str | None = None  # the traceback of a user's model that raised without the shim


def unaffected_reason(fix: Fix, version: str) -> str:
    if fix.built_in(version):
        return f"Lightning {version} already contains it ({fix.upstream}); left untouched"
    return f"Lightning {version} has no 'true' precisions for FSDP; nothing to fix"


def is_(state: dict[str, Any] | None, value: State) -> bool:
    """Whether a ``FixStatus.as_dict()`` is in ``value``'s state."""
    return state is not None and state["state"] == value.value


def not_applied(state: dict[str, Any], namespace: str) -> str:
    if is_(state, State.NOT_IN_EFFECT):
        return f"the shim's fix is {state['reason']}"
    return f"the shim did not apply it to {namespace}: {state['reason']}"


def fix_entries(states: dict[str, dict[str, Any]], verdicts: dict[str, Verdict]) -> list[dict[str, Any]]:
    """Per fix: its verdict, reason, and ``shim``: its state in a probe. A fix not in effect on this torch is
    ``FAILED``, checked or not."""
    entries = []
    for fix in FIXES:
        (verdict, why), state = verdicts.get(fix.name, (None, NOT_CHECKED)), states.get(fix.name)
        if is_(state, State.NOT_IN_EFFECT) and verdict != "FAILED":
            verdict, why = "FAILED", f"the shim's fix is {state['reason']}"  # type: ignore[index]
        entries.append({"fix": fix.name, "verdict": verdict, "reason": why, "shim": state})
    return entries


def finite(values: list[float | None]) -> bool:
    return all(v is not None and math.isfinite(v) for v in values)


def _same_figures(off: Runs, on: Runs) -> bool:
    keys = ("module_dtype", "flat_param_dtypes", *BYTE_KEYS, "unit_param_bytes")
    return all([getattr(a, k) for k in keys] == [getattr(b, k) for k in keys] for a, b in zip(off, on))


def judge(off: Runs, on: Runs, precision: str, seed_model: bool) -> Verdict:
    """The cast's verdict: ``fixed`` must hold on every rank, exactly; ``not needed`` if the shim changes nothing."""
    version, want, short = on[0].lightning, DTYPES[precision], DTYPES[precision].removeprefix("torch.")
    if not CAST.affects(version):
        if _same_figures(off, on):
            return "not needed", f"{unaffected_reason(CAST, version)}; measured: the shim changes nothing"
        return "FAILED", f"{unaffected_reason(CAST, version)}, but the figures differ with the shim on"
    state = on[0].fixes[CAST.name]
    problems = [] if is_(state, State.PATCHED) else [not_applied(state, on[0].namespace)]
    for a, b in zip(off, on):
        rank = f" on rank {b.rank}" if len(on) > 1 else ""
        if b.module_dtype != want:
            problems.append(f"LightningModule.dtype is {b.module_dtype}{rank}, expected {want}")
        if b.flat_param_dtypes != [want]:
            problems.append(f"flat parameters are {', '.join(b.flat_param_dtypes)}{rank}, expected {want}")
        for key in BYTE_KEYS:
            before, after = getattr(a, key), getattr(b, key)
            if after > before or (a.flat_param_dtypes != [want] and after >= before > 0):  # SGD keeps no state
                problems.append(f"{key.replace('_', ' ')} did not shrink{rank} ({before:,} -> {after:,})")
        if seed_model and b.unit_param_bytes["pretrained"] * 2 != a.unit_param_bytes["pretrained"]:
            problems.append(f"the model loaded in float32 is not exactly half{rank}")
    if finite(off[0].losses) and not finite(on[0].losses):
        problems.append(
            "memory is fixed, but the training losses are not finite with the shim while they are without it: "
            f"{precision} keeps weights and optimizer state in {short} (see {DOCS}numerics.html: use bf16-true or a "
            "larger optimizer eps)"
        )
    if problems:
        return "FAILED", "; ".join(problems)
    if not seed_model and all(a.module_dtype == want and a.flat_param_dtypes == [want] for a in off):
        return "not needed", (
            f"this model is already {short} without the shim (it casts itself), so the shim changes nothing for "
            "this model: measured, every dtype and byte count is the same with it on"
        )
    note = f"; note: the losses are not finite in either run ({precision} with this optimizer; see {DOCS}numerics.html)"
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


def what_changed(plain: Runs, checkpointed: Runs) -> str | None:
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


def judge_recompute(off: Runs, on: Runs, off_ac: Runs, on_ac: Runs, classes: str) -> Verdict:
    """``fixed`` when, with the shim, checkpointing changes nothing bit for bit, and without it something (``off``
    is ``on`` where the release has the cast: the shim changes nothing there without checkpointing)."""
    count = on_ac[0].checkpointed or off_ac[0].checkpointed
    blocks = f"checkpointing {classes} ({count} module{'' if count == 1 else 's'})"
    state = on_ac[0].fixes[RECOMPUTE.name]
    changed, unfixed = what_changed(on, on_ac), what_changed(off, off_ac)
    if is_(state, State.TORCH_HAS_IT):  # torch restores the dtype itself: nothing wrapped
        if changed or unfixed:
            return "FAILED", f"{state['reason']}, but the checkpointed run {changed or unfixed}"
        return "not needed", f"{state['reason']}; measured: {blocks} changes nothing, with the shim on and off"
    problems = [] if is_(state, State.PATCHED) else [not_applied(state, on[0].namespace)]
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
    raised: dict[str, Any], on: Runs, on_ac: Runs | None, precision: str, classes: str
) -> dict[str, Verdict]:
    """A user's model that raised without the shim and trains with it: the recompute made it train where a recompute
    of torch's checkpoint raised, or where the release lacks no other fix; else the cast did."""
    version, short, namespace = on[0].lightning, DTYPES[precision].removeprefix("torch."), on[0].namespace
    by_recompute = RECOMPUTE.affects(version) and (raised["in_recompute"] or not CAST.affects(version))
    who = "a recompute of torch's checkpoint" if raised["in_recompute"] else "training"
    without, want = f"without the shim, {who} raised {raised['error']}", DTYPES[precision]
    cast, recompute = on[0].fixes[CAST.name], on[0].fixes[RECOMPUTE.name]
    verdicts: dict[str, Verdict] = {CAST.name: ("not needed", unaffected_reason(CAST, version))}
    if CAST.affects(version):
        problems = [] if is_(cast, State.PATCHED) else [not_applied(cast, namespace)]
        wrong = [r for r in on if r.module_dtype != want or r.flat_param_dtypes != [want]]
        ranks = f" on rank {', '.join(str(r.rank) for r in wrong)}" if len(on) > 1 else ""
        problems += (
            [f"with the shim, LightningModule.dtype or the flat parameters are not {short}{ranks}"] if wrong else []
        )
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
    elif by_recompute and not is_(recompute, State.PATCHED):
        verdicts[RECOMPUTE.name] = ("FAILED", f"{not_applied(recompute, namespace)} ({without})")
    elif by_recompute:
        verdicts[RECOMPUTE.name] = ("fixed", f"{without}; with the shim it trains{checked}")
    elif on_ac:  # measured with the shim only: no verdict, and no "not checked" beside what was measured
        verdicts[RECOMPUTE.name] = (None, f"{checked[2:]}; {without}, so no run without the shim shows the bug")
    return verdicts


def overall(sections: list[Section]) -> tuple[str, str]:
    """One verdict for the whole run, and every section's in one line."""
    verdicts = {s.verdict for s in sections} | {e["verdict"] for s in sections for e in s.fixes}
    verdict = "FAILED" if "FAILED" in verdicts else ("fixed" if "fixed" in verdicts else "not needed")
    texts = []
    for s in sections:
        recompute = next((e["verdict"] for e in s.fixes if e["fix"] == RECOMPUTE.name), None)
        texts.append(
            f"{s.namespace} {s.version or ''}: "
            + (f"cast {s.verdict}, recompute {recompute}" if recompute else s.verdict)
        )
    return verdict, "; ".join(text.replace(" :", ":") for text in texts)


def _cell(key: str, value: Any) -> str:
    if key.endswith(("dtype", "dtypes")):
        return ", ".join(v.removeprefix("torch.") for v in ([value] if isinstance(value, str) else value))
    if key == "peak_memory_bytes":
        return f"{value / 2**20:,.1f} MiB"
    if key == "losses":  # as many as fit the column (--json has them all)
        texts = ["nan" if v is None else f"{v:.3g}" for v in value]
        shown = [", ".join(texts[:n]) + (", ..." if n < len(texts) else "") for n in range(len(texts), 0, -1)]
        return next((text for text in shown if len(text) < VALUE - 1), shown[-1] if shown else "")
    return f"{value:,}" if isinstance(value, int) else str(value)


def _row(label: str, key: str, off: Any, on: Any, indent: int = 2) -> str:
    change = f"{(on - off) / off:+.0%}" if isinstance(off, int) and isinstance(on, int) and off else ""
    row = f"{'':<{indent}}{label:<{LABEL - indent}}{_cell(key, off):>{VALUE}}{_cell(key, on):>{VALUE}}"
    return f"{row}  {change}".rstrip()


def _wrapped(text: str, indent: str) -> list[str]:
    return textwrap.wrap(text, WIDTH, initial_indent=indent, subsequent_indent=indent + "  ")


def _table(off: RankResult, on: RankResult, options: Options, used: set[str]) -> list[str]:
    used.add("flat parameter")
    if on.device == "cuda":
        lines = [f"  CUDA with NCCL, {options.devices} GPU(s)."]
    else:
        lines = [f"  CPU check with gloo, {options.devices} process(es); GPU guards lifted (see Terms)."]
        used.add("GPU guards lifted")
    lines += ["  Figures are rank 0's; --json has every rank.", "", _row("", "", "shim off", "shim on")]
    rows = [("LightningModule.dtype", "module_dtype"), ("flat-parameter dtypes", "flat_param_dtypes")]
    lines += [_row(label, key, getattr(off, key), getattr(on, key)) for label, key in rows]
    lines.append(_row("sharded parameter bytes", "", off.param_bytes, on.param_bytes))
    if options.model is None:  # the seed's units, each its own FSDP unit
        used.add("seed model")
        lines += [_row(text, "", off.unit_param_bytes[u], on.unit_param_bytes[u], 4) for u, text in UNITS.items()]
    rows = [("sharded gradient bytes", "grad_bytes"), ("optimizer-state bytes", "optimizer_state_bytes")]
    rows += [("peak memory", "peak_memory_bytes"), (f"losses ({len(on.losses)} steps)", "losses")]
    lines += [_row(label, key, getattr(off, key), getattr(on, key)) for label, key in rows]
    return [*lines, f"    (peak memory: {on.peak_memory_kind})", ""]


def render(sections: list[Section], options: Options, skipped: Sequence[Skipped] = ()) -> str:
    """The text report: a section per namespace (a table where both runs trained, the fixes, a line per verdict),
    the namespaces not checked, the terms it used, and the overall verdict."""
    lines = [f"fsdp-shim verify ({options.precision}, {options.devices} device(s), {options.steps} steps)", ""]
    used: set[str] = set()
    for section in sections:
        lines.append(f"{section.namespace} {section.version or ''}".rstrip())
        if section.shim_off and section.shim_on:
            lines += _table(section.shim_off[0], section.shim_on[0], options, used)
        if not section.fixes:
            lines += [*_wrapped(f"{section.verdict}: {section.reason}", "  "), ""]
            continue
        shim = [e["shim"] for e in section.fixes if e["shim"] and e["shim"]["affected"]]
        said = [
            f"{s['fix']} ({'applied by the shim' if is_(s, State.PATCHED) else 'NOT applied: ' + s['reason']})"
            for s in shim
        ]
        lines += _wrapped(f"fixes this release lacks: {', '.join(said) or 'none'}", "  ")
        for e in section.fixes:
            lines += _wrapped(f"{e['fix']}: {e['verdict'] + ': ' if e['verdict'] else ''}{e['reason']}", "  ")
        lines.append("")
    for skip in skipped:  # installed, not checked: said after what was, with how to check it
        lines += [f"{skip.namespace} {skip.version}".rstrip(), *_wrapped(skip.reason, "  "), ""]
    terms = [line for term, meaning in TERMS.items() if term in used for line in _wrapped(f"{term}: {meaning}", "  ")]
    lines += ["Terms:", *terms, ""] if terms else []
    verdict, reason = overall(sections)
    return "\n".join(lines + _wrapped(f"verdict: {verdict} ({reason})", ""))
