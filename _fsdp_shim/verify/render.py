"""verify's text output: per section a table of rank 0's figures (shim off, shim on, change), the
verdict in words, the terms used explained once, and the overall verdict; it fits 100 columns.

``--json`` is not rendered here: ``command.main`` prints the sections as they are.
"""

from __future__ import annotations

import textwrap
from typing import Any

from _fsdp_shim.verify import seed
from _fsdp_shim.verify.options import Options
from _fsdp_shim.verify.verdict import Section, overall

WIDTH = 100
"""verify's output fits a 100-column terminal: the table, the verdicts (wrapped) and the terms."""
LABEL, VALUE = 46, 22

TERMS = {
    "GPU guards lifted": "Lightning refuses FSDP without a GPU; verify lifts that check in its own processes only, "
    "never in your training processes, to run the same code on CPU with gloo.",
    "flat parameter": "FSDP keeps the parameters of each wrapped unit in one flat tensor per rank; its dtype is "
    "what the sharded parameter, gradient and optimizer-state bytes are made of.",
    "seed model": "verify's own model when --model is not given: two copies of Lightning's demo Transformer, "
    "one built in configure_model, one loaded in float32 as from_pretrained does.",
}


def _cell(key: str, value: Any) -> str:
    if key == "flat_param_dtypes":
        return ", ".join(v.removeprefix("torch.") for v in value)
    if key == "module_dtype":
        return str(value).removeprefix("torch.")
    if key == "peak_memory_bytes":
        return f"{value / 2**20:,.1f} MiB"
    if key == "losses":  # as many as fit the column (--json has them all)
        texts = ["nan" if v is None else f"{v:.3g}" for v in value]
        shown = ""
        for count in range(len(texts), 0, -1):
            shown = ", ".join(texts[:count]) + (", ..." if count < len(texts) else "")
            if len(shown) < VALUE - 1:
                break
        return shown
    return f"{value:,}" if isinstance(value, int) else str(value)


def _change(off: Any, on: Any) -> str:
    if isinstance(off, int) and isinstance(on, int) and off:
        return f"{(on - off) / off:+.0%}"
    return ""


def _row(label: str, key: str, off: Any, on: Any, indent: int = 2) -> str:
    row = f"{'':<{indent}}{label:<{LABEL - indent}}{_cell(key, off):>{VALUE}}{_cell(key, on):>{VALUE}}"
    return f"{row}  {_change(off, on)}".rstrip()


def _wrapped(text: str, indent: str) -> list[str]:
    return textwrap.wrap(text, WIDTH, initial_indent=indent, subsequent_indent=indent + "  ")


def render_section(section: Section, options: Options, used: set[str] | None = None) -> list[str]:
    """One section's lines; ``used`` collects the terms it shows, explained once under all sections."""
    used = set() if used is None else used
    lines = [f"{section.namespace} {section.version or ''}".rstrip()]
    if section.shim_off and section.shim_on:
        off, on = section.shim_off[0], section.shim_on[0]
        if on.device == "cuda":
            lines.append(f"  CUDA with NCCL, {options.devices} GPU(s).")
        else:
            lines.append(f"  CPU check with gloo, {options.devices} process(es); GPU guards lifted (see Terms).")
            used.add("GPU guards lifted")
        lines += ["  Figures are rank 0's; --json has every rank.", ""]
        lines.append(f"  {'':<{LABEL - 2}}{'shim off':>{VALUE}}{'shim on':>{VALUE}}")
        rows = [
            ("LightningModule.dtype", "module_dtype"),
            ("flat-parameter dtypes", "flat_param_dtypes"),
            ("sharded parameter bytes", "param_bytes"),
        ]
        used.add("flat parameter")
        lines += [_row(label, key, getattr(off, key), getattr(on, key)) for label, key in rows]
        for unit, label in seed.UNITS.items() if options.model is None else ():
            lines.append(_row(label, "bytes", off.unit_param_bytes[unit], on.unit_param_bytes[unit], indent=4))
        if options.model is None:
            used.add("seed model")
        rows = [
            ("sharded gradient bytes", "grad_bytes"),
            ("optimizer-state bytes", "optimizer_state_bytes"),
            ("peak memory", "peak_memory_bytes"),
            (f"losses ({len(on.losses)} steps)", "losses"),
        ]
        lines += [_row(label, key, getattr(off, key), getattr(on, key)) for label, key in rows]
        lines.append(f"    (peak memory: {on.peak_memory_kind})")
        lines.append("")
    lines += _wrapped(f"{section.verdict}: {section.reason}", "  ")
    return lines


def render(sections: list[Section], options: Options) -> str:
    """The whole text report: a header, every section, the terms used, and the overall verdict."""
    lines = [f"fsdp-shim verify ({options.precision}, {options.devices} device(s), {options.steps} steps)", ""]
    used: set[str] = set()
    for section in sections:
        lines += [*render_section(section, options, used), ""]
    if used:
        lines.append("Terms:")
        for term, meaning in TERMS.items():
            if term in used:
                lines += _wrapped(f"{term}: {meaning}", "  ")
        lines.append("")
    verdict, reason = overall(sections)
    lines += _wrapped(f"verdict: {verdict} ({reason})", "")
    return "\n".join(lines)
