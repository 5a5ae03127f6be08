"""``fsdp-shim verify`` (docs/verify.md): read every installed Trainer namespace (the gate probe), train what it
cannot decide with the shim off and on, in fresh processes (measure probes), judge each fix, and report."""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

from _fsdp_shim.config import CAST, DOCS, FIXES, RECOMPUTE, TRAINER_NAMESPACES, Fix, State
from _fsdp_shim.distributions import describe_import_failure, installed_packages
from _fsdp_shim.verify.records import SEED_CHECKPOINTED, UNITS, Options, ProbeRequest, RankResult, Skipped, select

PROBE_SCRIPT = Path(__file__).resolve().parent.parent / "children" / "verify_probe.py"
GATE_STEP = "reading the installed Lightning"
DTYPES = {"bf16-true": "torch.bfloat16", "16-true": "torch.float16"}
BYTE_KEYS = ("param_bytes", "grad_bytes", "optimizer_state_bytes")
NOT_CHECKED = "not checked: --activation-checkpointing MODULE:CLASS[,...] trains your checkpointed blocks with it"
WIDTH, LABEL, VALUE = 100, 46, 22  # the report's columns
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


class Stop(Exception):
    """End verify: ``before`` (the user's traceback), then ``fsdp-shim verify: MESSAGE`` on stderr; exit ``code``."""

    def __init__(self, message: str, code: int = 1, before: str = "") -> None:
        super().__init__(f"{before}fsdp-shim verify: {message}")
        self.code = code


def main(options: Options) -> int:
    """Run verify: 0 fixed or not needed; 1 FAILED, the user's code raised, or a timeout; 2 cannot run; 130 Ctrl-C."""
    start, here = time.monotonic(), f"in this interpreter ({sys.executable})"
    try:
        if importlib.util.find_spec("torch") is None:
            message = (
                f"torch is not installed {here}; install torch (pinned) and Lightning first, then run verify again"
            )
            raise Stop(message, 2)
        if not any(ns.partition(".")[0] in installed_packages() for ns in TRAINER_NAMESPACES):
            raise Stop(f"neither lightning nor pytorch_lightning is installed {here}", 2)
        try:
            workdir = tempfile.mkdtemp(prefix="fsdp-shim-verify-")
        except OSError as error:
            raise Stop(
                f"no usable temporary folder ({type(error).__name__}: {error}); set TMPDIR to a writable folder", 2
            ) from None
        try:
            sections, skipped = verify(options, Path(workdir))
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    except Stop as stop:
        print(stop, file=sys.stderr)
        return stop.code
    (verdict, reason), seconds = overall(sections), time.monotonic() - start
    if options.as_json:
        document = {"verdict": verdict, "reason": reason, **asdict(options), "seconds": round(seconds, 1)}
        document.update(skipped=[asdict(s) for s in skipped], sections=[asdict(s) for s in sections])
        print(json.dumps(document, indent=2))
    else:
        print(f"{render(sections, options, skipped)}\n(took {seconds:.0f} s)")
    return 1 if verdict == "FAILED" else 0


def say(step: str) -> None:
    print(f"fsdp-shim verify: {step} ...", file=sys.stderr, flush=True)  # with --json, stdout is the document


def run_probe(request: ProbeRequest, shim: str, step: str) -> str | dict[str, Any]:
    """Run one probe in a session of its own, SIGKILLed whatever happens (a rank hung in a collective survives
    SIGTERM): ``""``, why it failed, or the user's error record. Only user modules get a folder on its path."""
    options, out = request.options, Path(request.out)
    path = (options.model_path or os.getcwd()) if options.model or options.activation_checkpointing else None
    argument = json.dumps(asdict(replace(request, options=replace(options, model_path=path))))
    command = [sys.executable, str(PROBE_SCRIPT), argument]
    with open(f"{out}.stderr", "w") as log:
        env = dict(os.environ, FSDP_SHIM=shim, PYTHONWARNINGS="ignore")
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, env=env, start_new_session=True)
    try:
        proc.wait(options.timeout)
    except subprocess.TimeoutExpired:
        message = f"{step} did not finish within {options.timeout:g} s, so verify stopped it and every process it"
        raise Stop(f"{message} started; --timeout SECONDS allows longer") from None
    except KeyboardInterrupt:
        raise Stop(f"interrupted while {step}; every process it started was stopped", 130) from None
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: the group's id is its pid
        proc.wait()
    for error in sorted(out.parent.glob(f"{out.name}.rank*.error.json"))[:1]:
        record: dict[str, Any] = json.loads(error.read_text())
        if record["kind"] == "usage":
            raise Stop(record["message"], 2)
        return record
    last = (Path(f"{out}.stderr").read_text(errors="replace").strip().splitlines() or ["(no output)"])[-1]
    return "" if proc.returncode == 0 else f"failed (exit {proc.returncode}): {last}"


def users_code_raised(record: dict[str, Any], shim: str, also: str = "") -> Stop:
    message = f"your code raised while {record['phase']} (shim {'off' if shim == '0' else 'on'}){also}; the traceback"
    return Stop(f"{message} above is from your model, not from fsdp-shim.", 1, record["traceback"].rstrip() + "\n\n")


def plan(options: Options, version: str | None) -> list[tuple[str, bool]]:
    """A section's runs, as (FSDP_SHIM, checkpointed): none where the gate decides (2.0.x; 2.5+ unless --measure,
    --activation-checkpointing or the seed's recompute). Last: the run a model that raised without the shim skips."""
    seed_only = options.model is None and not options.measure and not options.activation_checkpointing
    if version is not None and not CAST.affects(version):
        seed_recompute = options.model is None and RECOMPUTE.affects(version)
        if not CAST.built_in(version) or not (options.measure or options.activation_checkpointing or seed_recompute):
            return []
        if seed_only:
            return [("1", False), ("1", True), ("0", True)]  # the seed, for the recompute only
    checking = options.model is None or bool(options.activation_checkpointing)
    return [("0", False), ("1", False), *([("1", True), ("0", True)] if checking else [])]


def decided(namespace: str, info: dict[str, Any], options: Options) -> Section | None:
    """A section decided from the gate alone, or ``None`` to train it."""
    if info["import_failure"] is not None:
        return Section(namespace, None, "FAILED", describe_import_failure(namespace, info["import_failure"]))
    if plan(options, version := info["version"]):
        return None
    reason = unaffected_reason(CAST, version)
    reason += "; nothing was trained (--measure trains anyway)" if CAST.built_in(version) else ""
    verdicts = {fix.name: ("not needed", unaffected_reason(fix, version)) for fix in FIXES if not fix.affects(version)}
    fixes = fix_entries(info["fixes"], {**verdicts, CAST.name: ("not needed", reason)})
    return Section(namespace, version, "not needed", reason, fixes)


def measured(
    options: Options, workdir: Path, steps: Iterator[str], target: tuple[str | None, str, str | None]
) -> Section:
    """Train one section's runs and judge each fix. A user's model that raised without the shim is trained with it
    too; a checkpointed run that raised may end before every rank wrote: one rank's error result is enough."""
    (namespace, label, version), runs = target, dict[tuple[str, bool], Runs]()
    raised: dict[str, Any] | None = None  # the user's error record of the run without the shim
    for shim, ac in plan(options, version):
        step = f"{label}: training with the shim {'off' if shim == '0' else 'on'}"
        step += ", with activation checkpointing" if ac else ""
        if raised is not None and (shim, ac) == ("0", True):  # the last run: the counter still reaches its total
            say(f"{next(steps)} {step}: skipped, it raised without the shim already")
            break
        say(f"{next(steps)} {step}")
        out = workdir / f"{namespace or 'model'}-shim{shim}{'-ac' if ac else ''}"
        failed = run_probe(ProbeRequest("measure", str(out), options, namespace, ac), shim, step)
        if isinstance(failed, dict) and (shim, ac) == ("0", False):
            raised = failed  # the run with the shim follows: does the shim make it train?
        elif isinstance(failed, dict):
            also = f", and with the shim on too ({failed['message']})" if raised else ""
            raise users_code_raised(raised or failed, "0" if raised else shim, also)
        else:
            paths = workdir.glob(f"{out.name}.rank*.json")
            results = sorted((RankResult(**json.loads(p.read_text())) for p in paths), key=lambda r: r.rank)
            if failed or (len(results) != options.devices and not any(result.error for result in results)):
                error = f"the run with FSDP_SHIM={shim} {failed or 'wrote no result on some rank'}"
                return Section(namespace or "model", None, "FAILED", error, [], runs.get(("0", False)), results or None)
            runs[shim, ac] = results
    on, on_ac, off, off_ac = runs["1", False], runs.get(("1", True)), runs.get(("0", False)), runs.get(("0", True))
    classes = ", ".join(spec.rpartition(":")[2] for spec in options.activation_checkpointing) or SEED_CHECKPOINTED
    if raised is not None:
        verdicts = judge_raised_without_shim(raised, on, on_ac, options.precision, classes)
    elif off is None:
        recompute_only = "not measured: trained for the recompute only (--measure measures it)"
        verdicts = {CAST.name: ("not needed", f"{unaffected_reason(CAST, on[0].lightning)}; {recompute_only}")}
    else:
        verdicts = {CAST.name: judge(off, on, options.precision, seed_model=options.model is None)}
    if on_ac and off_ac:
        verdicts[RECOMPUTE.name] = judge_recompute(off or on, on, off_ac, on_ac, classes)
    verdict, reason = verdicts[CAST.name]
    fixes = fix_entries((on_ac or on)[0].fixes, verdicts)
    shim_off_error = raised["traceback"] if raised else None
    section = Section(on[0].namespace, on[0].lightning, verdict or "not checked", reason, fixes, off, on, off_ac)
    return replace(section, checkpointed_shim_on=on_ac, shim_off_error=shim_off_error)


def verify(options: Options, workdir: Path) -> tuple[list[Section], list[Skipped]]:
    """Every section, in ``TRAINER_NAMESPACES``' order (the user's model last), and the installed namespaces the
    seed model was not trained with; the probes write in ``workdir``."""
    say(GATE_STEP)
    failed = run_probe(ProbeRequest("gate", str(out := workdir / "gate.json"), options), "1", GATE_STEP)
    if isinstance(failed, dict):
        raise users_code_raised(failed, "1")
    if failed or not out.exists():
        return [Section("Lightning", None, "FAILED", f"{GATE_STEP} {failed or 'wrote nothing'}")], []
    gate = json.loads(out.read_text())
    namespaces: dict[str, dict[str, Any]] = gate["namespaces"]
    chosen, skipped = list(namespaces), list[Skipped]()
    if options.model is None:
        try:
            chosen, skipped = select(options.package, {ns: info["version"] for ns, info in namespaces.items()})
        except ValueError as error:
            raise Stop(f"{error} ({sys.executable})", 2) from None
    sections: list[Section] = []
    targets: list[tuple[str | None, str, str | None]] = []
    for namespace in chosen:  # with --model, only a broken namespace is judged here; the model's below
        info = namespaces[namespace]
        if options.model is None or info["import_failure"] is not None:
            section = decided(namespace, info, options)
            sections += [section] if section else []
            targets += [] if section else [(namespace, f"{namespace} {info['version']}", info["version"])]
    if options.model is not None:
        importable = [ns for ns in gate["model_namespaces"] if namespaces.get(ns, {}).get("import_failure", 1) is None]
        model_sections = [decided(ns, namespaces[ns], options) for ns in importable]
        if model_sections and all(model_sections):
            sections += [section for section in model_sections if section]
        else:
            targets.append((None, options.model, None))
    total = sum(len(plan(options, version)) for _, _, version in targets)  # counted once, skipped runs too
    steps = (f"[{number}/{total}]" for number in itertools.count(1))
    sections += [measured(options, workdir, steps, target) for target in targets]
    order = {name: index for index, name in enumerate(TRAINER_NAMESPACES)}
    return sorted(sections, key=lambda section: order.get(section.namespace, len(order))), skipped


def unaffected_reason(fix: Fix, version: str) -> str:
    if fix.built_in(version):
        return f"Lightning {version} already contains it ({fix.upstream}); left untouched"
    return f"Lightning {version} has no 'true' precisions for FSDP; nothing to fix"


def unapplied(state: dict[str, Any], namespace: str) -> list[str]:
    """Nothing where the shim applied the fix (its ``FixStatus.as_dict()``), else why it did not."""
    said = {State.PATCHED.value: [], State.NOT_IN_EFFECT.value: [f"the shim's fix is {state['reason']}"]}
    return said.get(state["state"], [f"the shim did not apply it to {namespace}: {state['reason']}"])


def fix_entries(states: dict[str, dict[str, Any]], verdicts: dict[str, Verdict]) -> list[dict[str, Any]]:
    """Per fix: its verdict, reason, and ``shim``: its state in a probe; one not in effect on this torch is FAILED."""
    entries = []
    for fix in FIXES:
        (verdict, why), state = verdicts.get(fix.name, (None, NOT_CHECKED)), states.get(fix.name)
        if state and state["state"] == State.NOT_IN_EFFECT.value and verdict != "FAILED":
            verdict, why = "FAILED", unapplied(state, "")[0]
        entries.append({"fix": fix.name, "verdict": verdict, "reason": why, "shim": state})
    return entries


def finite(values: list[float | None]) -> bool:
    return all(v is not None and math.isfinite(v) for v in values)


def dtype_problems(runs: Runs, want: str) -> list[str]:
    """Each rank's ``LightningModule.dtype`` and flat-parameter dtypes that are not ``want``."""
    problems = []
    for r in runs:
        rank = f" on rank {r.rank}" if len(runs) > 1 else ""
        if r.module_dtype != want:
            problems.append(f"LightningModule.dtype is {r.module_dtype}{rank}, expected {want}")
        if r.flat_param_dtypes != [want]:
            problems.append(f"flat parameters are {', '.join(r.flat_param_dtypes)}{rank}, expected {want}")
    return problems


def judge(off: Runs, on: Runs, precision: str, seed_model: bool) -> Verdict:
    """The cast's verdict: ``fixed`` must hold on every rank, exactly; ``not needed`` if the shim changes nothing."""
    version, want = on[0].lightning, DTYPES[precision]
    short = want.removeprefix("torch.")
    if not CAST.affects(version):
        keys = ("module_dtype", "flat_param_dtypes", *BYTE_KEYS, "unit_param_bytes")
        if all(getattr(a, key) == getattr(b, key) for a, b in zip(off, on) for key in keys):
            return "not needed", f"{unaffected_reason(CAST, version)}; measured: the shim changes nothing"
        return "FAILED", f"{unaffected_reason(CAST, version)}, but the figures differ with the shim on"
    problems = unapplied(on[0].fixes[CAST.name], on[0].namespace) + dtype_problems(on, want)
    for a, b in zip(off, on):
        rank = f" on rank {b.rank}" if len(on) > 1 else ""
        for key in BYTE_KEYS:
            before, after = getattr(a, key), getattr(b, key)
            if after > before or (a.flat_param_dtypes != [want] and after >= before > 0):  # SGD keeps no state
                problems.append(f"{key.replace('_', ' ')} did not shrink{rank} ({before:,} -> {after:,})")
        if seed_model and b.unit_param_bytes["pretrained"] * 2 != a.unit_param_bytes["pretrained"]:
            problems.append(f"the model loaded in float32 is not exactly half{rank}")
    numerics = f"{precision} with this optimizer; see {DOCS}numerics.html"
    if finite(off[0].losses) and not finite(on[0].losses):
        problems.append(
            "memory is fixed, but the training losses are not finite with the shim while they are without it: "
            f"{precision} keeps weights and optimizer state in {short} (see {DOCS}numerics.html: use bf16-true or a "
            "larger optimizer eps)"
        )
    if problems:
        return "FAILED", "; ".join(problems)
    if not seed_model and not dtype_problems(off, want):
        return "not needed", (
            f"this model is already {short} without the shim (it casts itself), so the shim changes nothing for "
            "this model: measured, every dtype and byte count is the same with it on"
        )
    note = "" if finite(on[0].losses) else f"; note: the losses are not finite in either run ({numerics})"
    before, after = (sum(getattr(r, key) for key in BYTE_KEYS) for r in (off[0], on[0]))
    if before == after:
        return "fixed", f"the parameters were already {short}; LightningModule.dtype is now right{note}"
    reason = f"sharded parameters, gradients and optimizer state are {1 - after / before:.0%} smaller on rank 0"
    if seed_model:
        reason += f" (the model loaded in float32 is exactly half; the seed's model was already {short} and only "
        reason += "its LightningModule.dtype was wrong)"
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
    state, changed, unfixed = on_ac[0].fixes[RECOMPUTE.name], what_changed(on, on_ac), what_changed(off, off_ac)
    if state["state"] == State.TORCH_HAS_IT.value:  # torch restores the dtype itself: nothing wrapped
        if changed or unfixed:
            return "FAILED", f"{state['reason']}, but the checkpointed run {changed or unfixed}"
        return "not needed", f"{state['reason']}; measured: {blocks} changes nothing, with the shim on and off"
    problems = unapplied(state, on[0].namespace) + [f"with the shim, the checkpointed run {changed}"] * bool(changed)
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
    version, want, namespace = on[0].lightning, DTYPES[precision], on[0].namespace
    by_recompute = RECOMPUTE.affects(version) and (raised["in_recompute"] or not CAST.affects(version))
    who = "a recompute of torch's checkpoint" if raised["in_recompute"] else "training"
    without = f"without the shim, {who} raised {raised['message']}"
    verdicts: dict[str, Verdict] = {CAST.name: ("not needed", unaffected_reason(CAST, version))}
    if CAST.affects(version):
        problems = unapplied(on[0].fixes[CAST.name], namespace) + [
            f"with the shim, {p}" for p in dtype_problems(on, want)
        ]
        right = f"with the shim, LightningModule.dtype and every flat parameter are {want[6:]} on every rank"
        if problems:
            verdicts[CAST.name] = ("FAILED", "; ".join(problems))
        elif by_recompute:
            verdicts[CAST.name] = (None, f"not checked: {without}, so there is nothing to compare with; {right}")
        else:
            verdicts[CAST.name] = ("fixed", f"{without}; with the shim it trains, and {right}")
    changed = what_changed(on, on_ac) if on_ac else None
    problems = [f"with the shim, the checkpointed run {changed}"] if changed else []
    problems += unapplied(on[0].fixes[RECOMPUTE.name], namespace) if by_recompute else []
    checked = f"with the shim, checkpointing {classes} changes nothing, bit for bit" if on_ac else ""
    if problems:
        verdicts[RECOMPUTE.name] = ("FAILED", f"{problems[0]} ({without})")
    elif by_recompute:
        verdicts[RECOMPUTE.name] = ("fixed", "; ".join(filter(None, [without, "with the shim it trains", checked])))
    elif on_ac:  # measured with the shim only: no verdict, and no "not checked" beside what was measured
        verdicts[RECOMPUTE.name] = (None, f"{checked}; {without}, so no run without the shim shows the bug")
    return verdicts


def overall(sections: list[Section]) -> tuple[str, str]:
    """One verdict for the whole run, and every section's in one line."""
    verdicts = {s.verdict for s in sections} | {e["verdict"] for s in sections for e in s.fixes}
    texts = []
    for s in sections:
        recompute = next((e["verdict"] for e in s.fixes if e["fix"] == RECOMPUTE.name), None)
        said = f"cast {s.verdict}, recompute {recompute}" if recompute else s.verdict
        texts.append(f"{s.namespace} {s.version or ''}: {said}".replace(" :", ":"))
    return next((v for v in ("FAILED", "fixed") if v in verdicts), "not needed"), "; ".join(texts)


def cell(key: str, value: Any) -> str:
    if key.endswith(("dtype", "dtypes")):
        return ", ".join(v.removeprefix("torch.") for v in ([value] if isinstance(value, str) else value))
    if key == "peak_memory_bytes":
        return f"{value / 2**20:,.1f} MiB"
    if key == "losses":  # as many as fit the column (--json has them all)
        texts = ["nan" if v is None else f"{v:.3g}" for v in value]
        shown = [", ".join(texts[:n]) + (", ..." if n < len(texts) else "") for n in range(len(texts), 0, -1)]
        return next((text for text in shown if len(text) < VALUE - 1), shown[-1] if shown else "")
    return f"{value:,}" if isinstance(value, int) else str(value)


def row(label: str, key: str, off: Any, on: Any, indent: int = 2) -> str:
    change = f"{(on - off) / off:+.0%}" if isinstance(off, int) and isinstance(on, int) and off else ""
    cells = f"{cell(key, off):>{VALUE}}{cell(key, on):>{VALUE}}"
    return f"{'':<{indent}}{label:<{LABEL - indent}}{cells}  {change}".rstrip()


def wrapped(text: str, indent: str = "  ") -> list[str]:
    return textwrap.wrap(text, WIDTH, initial_indent=indent, subsequent_indent=indent + "  ")


def table(off: RankResult, on: RankResult, options: Options, used: set[str]) -> list[str]:
    """Rank 0's figures, shim off and on; the seed's units indented under the parameter bytes."""
    cpu, seed = on.device != "cuda", options.model is None
    used.update(["flat parameter", *["GPU guards lifted"] * cpu, *["seed model"] * seed])
    lines = [f"  CPU check with gloo, {options.devices} process(es); GPU guards lifted (see Terms)."]
    lines = lines if cpu else [f"  CUDA with NCCL, {options.devices} GPU(s)."]
    lines += ["  Figures are rank 0's; --json has every rank.", "", row("", "", "shim off", "shim on")]
    rows = [("LightningModule.dtype", "module_dtype"), ("flat-parameter dtypes", "flat_param_dtypes")]
    rows += [("sharded parameter bytes", "param_bytes"), *((text, unit) for unit, text in UNITS.items() if seed)]
    rows += [("sharded gradient bytes", "grad_bytes"), ("optimizer-state bytes", "optimizer_state_bytes")]
    rows += [("peak memory", "peak_memory_bytes"), (f"losses ({len(on.losses)} steps)", "losses")]
    for label, key in rows:
        a, b = (r.unit_param_bytes[key] if key in UNITS else getattr(r, key) for r in (off, on))
        lines.append(row(label, key, a, b, 4 if key in UNITS else 2))
    return [*lines, f"    (peak memory: {on.peak_memory_kind})", ""]


def render(sections: list[Section], options: Options, skipped: Sequence[Skipped] = ()) -> str:
    """The text report: per section a table where both runs trained, the fixes and a line per verdict; then the
    namespaces not checked, with how to check them, the terms it used, and the overall verdict."""
    lines = [f"fsdp-shim verify ({options.precision}, {options.devices} device(s), {options.steps} steps)", ""]
    used: set[str] = set()
    for section in sections:
        lines.append(f"{section.namespace} {section.version or ''}".rstrip())
        if section.shim_off and section.shim_on:
            lines += table(section.shim_off[0], section.shim_on[0], options, used)
        if not section.fixes:
            lines += [*wrapped(f"{section.verdict}: {section.reason}"), ""]
            continue
        states = [e["shim"] for e in section.fixes if e["shim"] and e["shim"]["affected"]]
        said = [
            f"{s['fix']} ({'NOT applied: ' + s['reason'] if unapplied(s, '') else 'applied by the shim'})"
            for s in states
        ]
        lines += wrapped(f"fixes this release lacks: {', '.join(said) or 'none'}")
        for e in section.fixes:
            lines += wrapped(f"{e['fix']}: {e['verdict'] + ': ' if e['verdict'] else ''}{e['reason']}")
        lines.append("")
    for skip in skipped:
        lines += [f"{skip.namespace} {skip.version}".rstrip(), *wrapped(skip.reason), ""]
    terms = [line for term, meaning in TERMS.items() if term in used for line in wrapped(f"{term}: {meaning}")]
    verdict, reason = overall(sections)
    return "\n".join(lines + (["Terms:", *terms, ""] if terms else []) + wrapped(f"verdict: {verdict} ({reason})", ""))
