"""What verify shows a person: a status line on stderr while it runs, so that a run of minutes never
looks hung, and the text report, which fits a 100-column terminal."""

from __future__ import annotations

import contextlib
import itertools
import sys
import textwrap
import threading
import time
from collections.abc import Sequence
from typing import Any

from _fsdp_shim.verify import seed
from _fsdp_shim.verify.records import Options
from _fsdp_shim.verify.selection import Skipped
from _fsdp_shim.verify.verdict import Section, overall

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


class Progress(contextlib.AbstractContextManager):
    """The phase ("[1/2] ...", unnumbered with ``total`` 0) on stderr: redrawn every 0.2 s on a terminal."""

    def __init__(self, enabled: bool, total: int = 0) -> None:
        self.enabled, self.total, self.done, self.label, self.start = enabled, total, 0, "", 0.0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._draw, daemon=True) if enabled and sys.stderr.isatty() else None
        if self.thread is not None:
            self.thread.start()

    def phase(self, label: str) -> None:
        self.done += 1
        self.label = f"[{self.done}/{self.total}] {label}" if self.total else label
        self.start = time.monotonic()
        if self.enabled and self.thread is None:
            print(f"fsdp-shim verify: {self.label} ...", file=sys.stderr, flush=True)

    def _draw(self) -> None:
        for frame in itertools.cycle("|/-\\"):
            if self.stop.wait(0.2):
                return
            sys.stderr.write(f"\r{frame} {self.label} ({time.monotonic() - self.start:4.0f}s)   ")
            sys.stderr.flush()

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join()
            print("\r" + " " * WIDTH + "\r", end="", file=sys.stderr, flush=True)


def _cell(key: str, value: Any) -> str:
    if key.endswith("dtype") or key.endswith("dtypes"):
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


def _table(section: Section, options: Options, used: set[str]) -> list[str]:
    off, on = section.shim_off[0], section.shim_on[0]  # type: ignore[index]
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
    if options.model is None:  # the seed's two models, each its own FSDP unit
        used.add("seed model")
        lines += [_row(text, "", off.unit_param_bytes[u], on.unit_param_bytes[u], 4) for u, text in seed.UNITS.items()]
    rows = [("sharded gradient bytes", "grad_bytes"), ("optimizer-state bytes", "optimizer_state_bytes")]
    rows += [("peak memory", "peak_memory_bytes"), (f"losses ({len(on.losses)} steps)", "losses")]
    lines += [_row(label, key, getattr(off, key), getattr(on, key)) for label, key in rows]
    return [*lines, f"    (peak memory: {on.peak_memory_kind})", ""]


def render_section(section: Section, options: Options, used: set[str]) -> list[str]:
    """One section's lines; ``used`` collects the terms it shows, explained once under all sections."""
    lines = [f"{section.namespace} {section.version or ''}".rstrip()]
    if section.shim_off and section.shim_on:
        lines += _table(section, options, used)
    if not section.fixes:
        return lines + _wrapped(f"{section.verdict}: {section.reason}", "  ")
    shim = [e["shim"] for e in section.fixes if e["shim"] and e["shim"]["affected"]]
    lacking = [f"{s['fix']} ({'applied by the shim' if s['patched'] else 'NOT applied: ' + s['reason']})" for s in shim]
    lines += _wrapped(f"fixes this release lacks: {', '.join(lacking) or 'none'}", "  ")
    for e in section.fixes:
        lines += _wrapped(f"{e['fix']}: {e['verdict'] + ': ' if e['verdict'] else ''}{e['reason']}", "  ")
    return lines


def render(sections: list[Section], options: Options, skipped: Sequence[Skipped] = ()) -> str:
    lines = [f"fsdp-shim verify ({options.precision}, {options.devices} device(s), {options.steps} steps)", ""]
    used: set[str] = set()
    for section in sections:
        lines += [*render_section(section, options, used), ""]
    for skip in skipped:  # installed, not checked: said after what was, with how to check it
        lines += [f"{skip.namespace} {skip.version}".rstrip(), *_wrapped(skip.reason, "  "), ""]
    terms = [line for term, meaning in TERMS.items() if term in used for line in _wrapped(f"{term}: {meaning}", "  ")]
    lines += ["Terms:", *terms, ""] if terms else []
    verdict, reason = overall(sections)
    lines += _wrapped(f"verdict: {verdict} ({reason})", "")
    return "\n".join(lines)
