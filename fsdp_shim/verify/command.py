"""``fsdp-shim verify``: for every installed Lightning Trainer namespace (or the user's own model),
train with the shim off and on in fresh processes, compare, and give a verdict it can stand by.

It never answers for the wrong package: every installed namespace is checked, one that fails to
import is a FAILED verdict naming the cause, and a release that already has the fix is "not needed"
straight from the gates, without training (``--measure`` trains anyway).

Exit codes: 0 every verdict is "fixed" or "not needed"; 1 a FAILED verdict, or the user's model
raised (their traceback is printed); 2 a usage problem or an environment verify cannot run in.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fsdp_shim import cli
from fsdp_shim.backport import FIRST_AFFECTED, base_release, is_affected_release, unaffected_reason
from fsdp_shim.lightning_install import TRAINER_NAMESPACES, describe_import_failure, installed_packages
from fsdp_shim.verify import measure, seed

DTYPES = {"bf16-true": "torch.bfloat16", "16-true": "torch.float16"}
BYTE_KEYS = ("param_bytes", "grad_bytes", "optimizer_state_bytes")
PROBE_TIMEOUT = cli.PROBE_TIMEOUT
"""Seconds one probe (reading Lightning, or one training run) may take before verify stops it (--timeout)."""


@dataclass(frozen=True)
class Options:
    precision: str = "bf16-true"
    devices: int = 1
    steps: int = 3
    measure: bool = False
    as_json: bool = False
    model: str | None = None
    init_args: dict[str, Any] = field(default_factory=dict)
    datamodule: str | None = None
    timeout: float = PROBE_TIMEOUT
    model_path: str | None = None
    """The folder ``--model`` and ``--datamodule`` are imported from (default: the current folder)."""


@dataclass
class Section:
    """The verdict for one Lightning namespace (or the user's model), with every figure behind it."""

    namespace: str
    version: str | None
    verdict: str
    """``fixed``, ``not needed`` or ``FAILED``."""
    reason: str
    shim_off: list[dict[str, Any]] | None = None
    shim_on: list[dict[str, Any]] | None = None


class Stop(Exception):
    """End verify with ``code`` and ``message`` (the user's code raised, or a usage problem)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class Progress:
    """One status line on stderr with the phase ("[1/2] ...") and the seconds spent on it."""

    def __init__(self, enabled: bool, total: int) -> None:
        self._animated = enabled and sys.stderr.isatty()
        self._quiet = not enabled
        self._total = total
        self._done = 0
        self._label = ""
        self._start = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Progress:
        if self._animated:
            self._thread = threading.Thread(target=self._draw, daemon=True)
            self._thread.start()
        return self

    def phase(self, label: str) -> None:
        """Start the next phase; with ``total`` 0 (the gate, before the number of runs is known) it is
        not numbered, so the counter never reads "[1/1]" and then starts again."""
        self._done += 1
        counter = f"[{self._done}/{self._total}] " if self._total else ""
        self._label, self._start = f"{counter}{label}", time.monotonic()
        if not self._animated and not self._quiet:
            print(f"fsdp-shim verify: {self._label} ...", file=sys.stderr, flush=True)

    def _draw(self) -> None:
        frames = "|/-\\"
        tick = 0
        while not self._stop.wait(0.2):
            if self._label:
                seconds = time.monotonic() - self._start
                sys.stderr.write(f"\r{frames[tick % 4]} {self._label} ({seconds:4.0f}s)   ")
                sys.stderr.flush()
            tick += 1

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            sys.stderr.write("\r" + " " * WIDTH + "\r")
            sys.stderr.flush()


# ----------------------------------------------------------------------------- running the probe
PROBE_SCRIPT = Path(__file__).resolve().parent.parent / "_children" / "verify_probe.py"
"""The probe's entry script, run by its path so nothing from the current folder runs in the probe;
Lightning's launcher re-runs it on every other rank."""


def _probe_command(mode: str, out: Path, options: Options, namespace: str | None = None) -> list[str]:
    command = [sys.executable, str(PROBE_SCRIPT), mode, "--out", str(out)]
    command += ["--precision", options.precision, "--devices", str(options.devices), "--steps", str(options.steps)]
    if namespace is not None:
        command += ["--namespace", namespace]
    if options.model is not None:
        command += ["--model", options.model, "--init-args", json.dumps(options.init_args)]
    if options.datamodule is not None:
        command += ["--datamodule", options.datamodule]
    if options.model is not None or options.datamodule is not None:
        command += ["--model-path", options.model_path or os.getcwd()]
    return command


def _run_probe(command: list[str], shim: str, out: Path, step: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run one probe in a session of its own, and leave none of its processes behind.

    The probe and every process it starts (the other ranks Lightning's launcher starts, their workers)
    share one process group, which is killed whatever happens: after the probe ends, when it runs past
    ``timeout``, when the user presses Ctrl-C (the terminal's SIGINT reaches only verify's own group),
    and when verify itself fails. A rank that hangs in a collective survives SIGTERM, hence SIGKILL.
    """
    env = dict(os.environ, FSDP_SHIM=shim, PYTHONWARNINGS="ignore")
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        raise Stop(
            1,
            f"fsdp-shim verify: {step} did not finish within {timeout:g} s, so verify stopped it and every "
            "process it started; --timeout SECONDS allows longer",
        ) from None
    except KeyboardInterrupt:
        _kill_group(proc)
        raise Stop(130, f"fsdp-shim verify: interrupted while {step}; every process it started was stopped") from None
    finally:
        _kill_group(proc)
    errors = sorted(out.parent.glob(f"{out.name}.rank*.error.json"))
    if errors:
        record = json.loads(errors[0].read_text())
        state = "off" if shim == "0" else "on"
        if record["kind"] == "usage":
            raise Stop(2, f"fsdp-shim verify: {record['message']}")
        raise Stop(
            1,
            f"{record['traceback'].rstrip()}\n\nfsdp-shim verify: your code raised while {record['phase']} "
            f"(shim {state}); the traceback above is from your model, not from fsdp-shim.",
        )
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def _kill_group(proc: subprocess.Popen[str]) -> None:
    """SIGKILL the probe's process group (its own session's id is its pid), then reap the probe."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    if proc.returncode is None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.communicate(timeout=30)


def _failure(proc: subprocess.CompletedProcess[str], what: str) -> str:
    tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
    return f"{what} failed (exit {proc.returncode}): {tail}"


GATE_STEP = "reading the installed Lightning"


def run_gate(options: Options, workdir: Path) -> tuple[dict[str, Any], str]:
    """The gate probe's findings, or an error when the probe itself failed."""
    out = workdir / "gate.json"
    proc = _run_probe(_probe_command("gate", out, options), "1", out, GATE_STEP, options.timeout)
    if proc.returncode != 0 or not out.exists():
        return {}, _failure(proc, "reading the installed Lightning")
    return json.loads(out.read_text()), ""


def run_measure(
    options: Options, workdir: Path, namespace: str | None, shim: str, step: str = "training"
) -> tuple[list[dict[str, Any]], str]:
    out = workdir / f"{namespace or 'model'}-shim{shim}"
    proc = _run_probe(_probe_command("measure", out, options, namespace), shim, out, step, options.timeout)
    reports = [json.loads(p.read_text()) for p in sorted(workdir.glob(f"{out.name}.rank*.json"))]
    if proc.returncode != 0 or len(reports) != options.devices:
        return reports, _failure(proc, f"the run with FSDP_SHIM={shim}")
    return sorted(reports, key=lambda report: report["rank"]), ""


# ----------------------------------------------------------------------------- verdicts
def _figures(report: dict[str, Any]) -> tuple[Any, ...]:
    keys = ("module_dtype", "flat_param_dtypes", *BYTE_KEYS, "unit_param_bytes")
    return tuple(json.dumps(report[key]) for key in keys)


def judge(off: list[dict[str, Any]], on: list[dict[str, Any]], precision: str, seed_model: bool) -> tuple[str, str]:
    """The verdict from both runs, every rank. ``fixed`` must hold on every rank, exactly."""
    version = on[0]["lightning"]
    if not is_affected_release(version):
        if all(_figures(a) == _figures(b) for a, b in zip(off, on)):
            return "not needed", f"{unaffected_reason(version)}; measured: the shim changes nothing"
        return "FAILED", f"{unaffected_reason(version)}, but the figures differ with the shim on"
    want = DTYPES[precision]
    problems = []
    if not on[0]["shim_patched"]:
        problems.append(f"the shim did not patch {on[0]['namespace']}: {on[0]['shim_reason']}")
    for a, b in zip(off, on):
        rank = f" on rank {b['rank']}" if len(on) > 1 else ""
        if b["module_dtype"] != want:
            problems.append(f"LightningModule.dtype is {b['module_dtype']}{rank}, expected {want}")
        if b["flat_param_dtypes"] != [want]:
            problems.append(f"flat parameters are {', '.join(b['flat_param_dtypes'])}{rank}, expected {want}")
        for key in BYTE_KEYS:
            if b[key] > a[key] or (a["flat_param_dtypes"] != [want] and b[key] >= a[key]):
                problems.append(f"{key.replace('_', ' ')} did not shrink{rank} ({a[key]:,} -> {b[key]:,})")
        if seed_model and b["unit_param_bytes"]["pretrained"] * 2 != a["unit_param_bytes"]["pretrained"]:
            problems.append(f"the model loaded in float32 is not exactly half{rank}")
    if measure.finite(off[0]["losses"]) and not measure.finite(on[0]["losses"]):
        problems.append(
            "memory is fixed, but the training losses are not finite with the shim while they are without it: "
            f"{precision} keeps weights and optimizer state in {want.removeprefix('torch.')} "
            "(see docs/numerics.md: use bf16-true or a larger optimizer eps)"
        )
    if problems:
        return "FAILED", "; ".join(problems)
    already_right = all(a["module_dtype"] == want and a["flat_param_dtypes"] == [want] for a in off)
    if not seed_model and already_right and all(_figures(a) == _figures(b) for a, b in zip(off, on)):
        return "not needed", (
            f"this model is already {want.removeprefix('torch.')} without the shim (it casts itself), so the shim "
            "changes nothing for this model: measured, every dtype and byte count is the same with it on"
        )
    note = ""
    if not measure.finite(on[0]["losses"]):
        note = (
            f"; note: the losses are not finite in either run ({precision} with this optimizer; see docs/numerics.md)"
        )
    total = {run: sum(r[k] for k in BYTE_KEYS) for run, r in (("off", off[0]), ("on", on[0]))}
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
    verdicts = {s.verdict for s in sections}
    verdict = "FAILED" if "FAILED" in verdicts else ("fixed" if "fixed" in verdicts else "not needed")
    return verdict, "; ".join(f"{s.namespace} {s.version or ''}: {s.verdict}".replace(" :", ":") for s in sections)


# ----------------------------------------------------------------------------- the plan
def _environment_problem() -> str | None:
    if importlib.util.find_spec("torch") is None:
        return (
            f"torch is not installed in this interpreter ({sys.executable}); install torch (pinned) and "
            "Lightning first, then run verify again"
        )
    if not any(ns.partition(".")[0] in installed_packages() for ns in TRAINER_NAMESPACES):
        return f"neither lightning nor pytorch_lightning is installed in this interpreter ({sys.executable})"
    return None


def _not_measured(namespace: str, info: dict[str, Any], options: Options) -> Section | None:
    """A section decided from the gates alone, or ``None`` when the namespace must be measured."""
    if "import_failure" in info:
        return Section(namespace, None, "FAILED", describe_import_failure(namespace, info["import_failure"]))
    version = info["version"]
    release = base_release(version)
    if release is not None and release < FIRST_AFFECTED:
        return Section(namespace, version, "not needed", unaffected_reason(version))
    if not info["affected"] and not options.measure:
        reason = f"{unaffected_reason(version)}; nothing was trained (--measure trains anyway)"
        return Section(namespace, version, "not needed", reason)
    return None


def _measured(options: Options, workdir: Path, progress: Progress, namespace: str | None, label: str) -> Section:
    runs: dict[str, list[dict[str, Any]]] = {}
    for shim, state in (("0", "off"), ("1", "on")):
        step = f"{label}: training with the shim {state}"
        progress.phase(step)
        reports, error = run_measure(options, workdir, namespace, shim, step)
        if error:
            return Section(namespace or "model", None, "FAILED", error, runs.get("0"), reports or None)
        runs[shim] = reports
    on = runs["1"][0]
    verdict, reason = judge(runs["0"], runs["1"], options.precision, seed_model=options.model is None)
    return Section(on["namespace"], on["lightning"], verdict, reason, runs["0"], runs["1"])


def verify(options: Options, workdir: Path) -> list[Section]:
    with Progress(not options.as_json, total=0) as progress:
        progress.phase(GATE_STEP)
        gate, error = run_gate(options, workdir)
    if error:
        return [Section("Lightning", None, "FAILED", error)]
    sections: list[Section] = []
    to_measure: list[tuple[str | None, str]] = []
    for namespace, info in gate["namespaces"].items():
        if options.model is not None and "import_failure" not in info:
            continue  # with --model, the model's own namespace is judged below; a broken one is still reported
        decided = _not_measured(namespace, info, options)
        if decided is not None:
            sections.append(decided)
        else:
            to_measure.append((namespace, f"{namespace} {info['version']}"))
    if options.model is not None:
        importable = [ns for ns in gate["model_namespaces"] if "import_failure" not in gate["namespaces"].get(ns, {})]
        decided_all = [_not_measured(ns, gate["namespaces"][ns], options) for ns in importable]
        if importable and all(decided_all):
            sections += [d for d in decided_all if d is not None]
        else:
            to_measure.append((None, options.model))
    with Progress(not options.as_json, total=2 * len(to_measure)) as progress:
        for namespace, label in to_measure:
            sections.append(_measured(options, workdir, progress, namespace, label))
    order = {name: index for index, name in enumerate(TRAINER_NAMESPACES)}
    return sorted(sections, key=lambda section: order.get(section.namespace, len(order)))


# ----------------------------------------------------------------------------- output
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
        if on["device"] == "cuda":
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
        lines += [_row(label, key, off[key], on[key]) for label, key in rows]
        for unit, label in seed.UNITS.items() if options.model is None else ():
            lines.append(_row(label, "bytes", off["unit_param_bytes"][unit], on["unit_param_bytes"][unit], indent=4))
        if options.model is None:
            used.add("seed model")
        rows = [
            ("sharded gradient bytes", "grad_bytes"),
            ("optimizer-state bytes", "optimizer_state_bytes"),
            ("peak memory", "peak_memory_bytes"),
            (f"losses ({len(on['losses'])} steps)", "losses"),
        ]
        lines += [_row(label, key, off[key], on[key]) for label, key in rows]
        lines.append(f"    (peak memory: {on['peak_memory_kind']})")
        lines.append("")
    lines += _wrapped(f"{section.verdict}: {section.reason}", "  ")
    return lines


def render(sections: list[Section], options: Options) -> str:
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


def main(options: Options) -> int:
    problem = _environment_problem()
    if problem is not None:
        print(f"fsdp-shim verify: {problem}", file=sys.stderr)
        return 2
    start = time.monotonic()
    try:
        tmp = tempfile.mkdtemp(prefix="fsdp-shim-verify-")
    except OSError as error:
        print(
            f"fsdp-shim verify: no usable temporary folder ({type(error).__name__}: {error}); "
            "set TMPDIR to a writable folder",
            file=sys.stderr,
        )
        return 2
    try:
        sections = verify(options, Path(tmp))
    except Stop as stop:
        print(stop.message, file=sys.stderr)
        return stop.code
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    verdict, reason = overall(sections)
    if options.as_json:
        document = {
            "verdict": verdict,
            "reason": reason,
            "precision": options.precision,
            "devices": options.devices,
            "steps": options.steps,
            "model": options.model,
            "seconds": round(time.monotonic() - start, 1),
            "sections": [asdict(section) for section in sections],
        }
        print(json.dumps(document, indent=2))
    else:
        print(render(sections, options))
        print(f"(took {time.monotonic() - start:.0f} s)")
    return 1 if verdict == "FAILED" else 0
