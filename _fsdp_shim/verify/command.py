"""``fsdp-shim verify`` (docs/verify.md): train the seed model (or ``--model``) with the shim on and off in fresh
processes (probes; the first reads the installed Lightning before it trains), judge each fix, and report."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Optional

from _fsdp_shim.config import CAST, DOCS, FIXES, RECOMPUTE, Fix, State
from _fsdp_shim.distributions import describe_import_failure, installed_packages

PROBE_SCRIPT = Path(__file__).resolve().with_name("probe.py")
PROBE_TIMEOUT = 1800  # seconds one step (reading Lightning, or one training run) may take (--timeout)
PACKAGES = {"lightning": "lightning.pytorch", "pytorch_lightning": "pytorch_lightning"}  # --package: namespace
READING = "reading the installed Lightning"
DTYPES = {"bf16-true": "torch.bfloat16", "16-true": "torch.float16"}
BYTE_KEYS = ("param_bytes", "grad_bytes", "optimizer_state_bytes")
FIGURES = ("module_dtype", "flat_param_dtypes", *BYTE_KEYS, "losses")
NOT_CHECKED = "--activation-checkpointing MODULE:CLASS[,...] trains your checkpointed blocks with it"
SHIM = {"0": "off", "1": "on"}
SLOTS = {  # a run's (FSDP_SHIM, checkpointed): where a Section holds its figures
    ("0", False): "shim_off",
    ("1", False): "shim_on",
    ("0", True): "checkpointed_shim_off",
    ("1", True): "checkpointed_shim_on",
}


@dataclass(frozen=True)
class Options:  # what the command line asked for, in --json's order
    precision: str = "bf16-true"
    devices: int = 1
    steps: int = 3
    as_json: bool = False
    model: str | None = None
    init_args: dict[str, Any] = field(default_factory=dict)
    datamodule: str | None = None
    timeout: float = PROBE_TIMEOUT
    model_path: str | None = None
    activation_checkpointing: list[str] = field(default_factory=list)
    package: str | None = None  # the seed's Lightning (PACKAGES); None: lightning where installed


@dataclass(frozen=True)
class ProbeRequest:
    out: str  # a path prefix: shim1, shim0 in verify's folder
    options: Options
    namespace: str | None = None  # None: the first probe, which reads Lightning (gate.json) and picks it
    runs: list[tuple[int, bool]] = field(default_factory=list)  # (number in the plan, checkpointed)


@dataclass(frozen=True)
class RankResult:
    """One rank's figures from one run; a checkpointed run that raised has ``error``, ``checkpointed``, ``fixes``."""

    rank: int
    module_dtype: str = ""
    flat_param_dtypes: list[str] = field(default_factory=list)
    param_bytes: int = 0
    grad_bytes: int = 0
    optimizer_state_bytes: int = 0
    losses: list[float | None] = field(default_factory=list)
    param_hashes: dict[str, str] = field(default_factory=dict)  # SHA-256 of this rank's shards, by name
    checkpointed: int = 0  # modules of the checkpointed classes (or their checkpoint wrappers)
    lightning: str = ""
    namespace: str = ""
    fixes: dict[str, dict[str, Any]] = field(default_factory=dict)  # the shim's FixStatus.as_dict(), per fix
    error: str | None = None


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
            raise Stop(f"torch is not installed {here}; install torch and Lightning, then run verify again", 2)
        if not set(PACKAGES) & set(installed_packages()):
            raise Stop(f"neither lightning nor pytorch_lightning is installed {here}", 2)
        if options.package and options.package not in installed_packages():
            raise Stop(f"--package {options.package} is not installed {here}", 2)
        try:
            workdir = tempfile.mkdtemp(prefix="fsdp-shim-verify-")
        except OSError as error:
            raise Stop(f"no usable temporary folder ({error}); set TMPDIR to a writable folder", 2) from None
        try:
            section, others = verify(options, Path(workdir))
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    except Stop as stop:
        print(stop, file=sys.stderr)
        return stop.code
    verdict, seconds = overall(section), time.monotonic() - start
    if options.as_json:
        document = {"verdict": verdict, **asdict(options), "seconds": round(seconds, 1), "not_checked": others}
        print(json.dumps({**document, "sections": [asdict(section)]}, indent=2))
    else:
        print(f"{render(section, options, others)}\n(took {seconds:.0f} s)")
    return 1 if verdict == "FAILED" else 0


def run_probe(request: ProbeRequest, shim: str, step: str, started: Callable[[], str | None]) -> Any:
    """Run one probe in a session of its own, SIGKILLed whatever happens (a rank hung in a collective survives
    SIGTERM): ``""``, why it failed, or the user's error record. ``started``: the step of a run it has started since,
    if any (each step has ``--timeout``). Only user modules get a folder on its path."""
    options, out = request.options, Path(request.out)
    path = (options.model_path or os.getcwd()) if options.model or options.activation_checkpointing else None
    argument = json.dumps(asdict(replace(request, options=replace(options, model_path=path))))
    with open(f"{out}.stderr", "w") as log:
        env = dict(os.environ, FSDP_SHIM=shim, PYTHONWARNINGS="ignore")
        command = [sys.executable, str(PROBE_SCRIPT), argument]
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, env=env, start_new_session=True)
    deadline = time.monotonic() + options.timeout
    try:
        while True:
            done = proc.poll() is not None
            while (new := started()) is not None:
                step, deadline = new, time.monotonic() + options.timeout
            if done:
                break
            if time.monotonic() > deadline:
                message = f"{step} did not finish within {options.timeout:g} s, so verify stopped it and every process"
                raise Stop(f"{message} it started; --timeout SECONDS allows longer")
            time.sleep(0.1)
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
    message = f"your code raised while {record['phase']} (shim {SHIM[shim]}){also}; the traceback above is from your"
    return Stop(f"{message} model, not from fsdp-shim.", 1, record["traceback"].rstrip() + "\n\n")


def verify(options: Options, workdir: Path) -> tuple[Section, dict[str, str]]:
    """The section of the Lightning namespace checked, and the other installed ones, not checked. Two probes: the
    first reads Lightning into ``gate.json`` (the namespace, the fix states, the runs planned), then trains the runs
    with the shim on; the second, those with it off."""
    print(f"fsdp-shim verify: {READING} ...", file=sys.stderr, flush=True)  # with --json, stdout is the document
    gate, gate_file, said = dict[str, Any](), workdir / "gate.json", 0  # said: the last run said to have started

    def step(number: int, then: str = " ...") -> str:
        """Run ``number``'s step, said on stderr, numbered out of all the runs planned (each counted once)."""
        nonlocal said
        if not gate:  # the first probe wrote it before it started run 1
            gate.update(json.loads(gate_file.read_text()))
        (shim, ac), said = gate["plan"][number - 1], number
        text = f"[{number}/{len(gate['plan'])}] {gate['namespace']} {gate['version']}: training with the shim"
        text += f" {SHIM[shim]}{', checkpointed' * ac}"
        print(f"fsdp-shim verify: {text}{then}", file=sys.stderr, flush=True)
        return text

    def started() -> str | None:
        """The step of a run the probe started since the last one said, if any (the probe writes ``runN`` first)."""
        return step(said + 1) if (workdir / f"run{said + 1}").exists() else None

    on = run_probe(ProbeRequest(str(workdir / "shim1"), options), "1", READING, started)
    if not gate and gate_file.exists():
        gate.update(json.loads(gate_file.read_text()))
    if not gate and isinstance(on, dict):
        raise users_code_raised(on, "1")
    if not gate:
        return Section("Lightning", None, "FAILED", f"{READING} {on or 'wrote nothing'}"), {}
    namespace, version, others, plan = gate["namespace"], gate["version"], gate["others"], gate["plan"]
    if gate["import_failure"] is not None:
        return Section(namespace, None, "FAILED", describe_import_failure(namespace, gate["import_failure"])), others
    if not plan:
        reason = unaffected(CAST, version) + "; nothing was trained" * CAST.built_in(version)
        verdicts = {fix.name: ("not needed", unaffected(fix, version)) for fix in FIXES if not fix.affects(version)}
        fixes = fix_entries(gate["fixes"], {**verdicts, CAST.name: ("not needed", reason)})
        return Section(namespace, version, "not needed", reason, fixes), others
    # With the shim on, the user's code raised: does it without the shim too? Only the run without checkpointing.
    runs = [(n, ac) for n, (shim, ac) in enumerate(plan, 1) if shim == "0" and not (ac and isinstance(on, dict))]
    if isinstance(on, dict) and not runs:  # 2.5+: no run without the shim and checkpointing to compare with
        raise users_code_raised(on, "1")
    request = ProbeRequest(str(workdir / "shim0"), options, namespace, runs)
    off = on if isinstance(on, str) and on else run_probe(request, "0", step(runs[0][0]), started)  # on failed: none
    raised = off if isinstance(off, dict) else None  # without the shim only: judged by what the shim made train
    if isinstance(on, dict):
        also = f", and with the shim on too ({on['message']})" if raised else ""
        raise users_code_raised(raised or on, "0" if raised else "1", also)
    if raised and plan[-1] == ["0", True]:
        step(len(plan), ": skipped, it raised without the shim")
    results = dict[tuple[str, bool], Runs]()
    for number, (shim, ac) in enumerate(plan, 1):
        if shim == "0" and raised:
            continue  # judged by the runs with the shim
        paths = workdir.glob(f"run{number}.rank*.json")
        results[shim, ac] = sorted((RankResult(**json.loads(p.read_text())) for p in paths), key=lambda r: r.rank)
        probe, last = (on if shim == "1" else off), all(other != shim for other, _ in plan[number:])
        found = results[shim, ac]
        if (probe and last) or (len(found) != options.devices and not any(r.error for r in found)):
            # a probe that failed: its first run without every rank's result, else its last run
            error = f"the {'checkpointed ' * ac}run with FSDP_SHIM={shim} {probe or 'wrote no result on some rank'}"
            trained: dict[str, Any] = {SLOTS[key]: runs or None for key, runs in results.items()}
            return replace(Section(namespace, version, "FAILED", error), **trained), others
    return judged(options, version, results, raised), others


def judged(options: Options, version: str, runs: dict[tuple[str, bool], Runs], raised: Any) -> Section:
    """The section of a namespace trained: each fix judged from its runs (a model that ``raised`` without the shim is
    judged by the runs with it)."""
    on, on_ac, off, off_ac = runs["1", False], runs.get(("1", True)), runs.get(("0", False)), runs.get(("0", True))
    classes = ", ".join(spec.rpartition(":")[2] for spec in options.activation_checkpointing) or "CausalBlock"
    if raised is not None:
        verdicts = judge_raised(raised, on, on_ac, options.precision)
    elif off is None:
        verdicts = {CAST.name: ("not needed", f"{unaffected(CAST, version)}; trained for the recompute only")}
    else:
        verdicts = {CAST.name: judge(off, on, options.precision)}
    if on_ac and off_ac:
        verdicts[RECOMPUTE.name] = judge_recompute(off or on, on, off_ac, on_ac, classes)
    (verdict, reason), fixes = verdicts[CAST.name], fix_entries((on_ac or on)[0].fixes, verdicts)
    section = Section(on[0].namespace, version, verdict or "not checked", reason, fixes, off, on, off_ac, on_ac)
    return replace(section, shim_off_error=raised["traceback"] if raised else None)


def unaffected(fix: Fix, version: str) -> str:
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
        if r.module_dtype != want:
            problems.append(f"LightningModule.dtype is {r.module_dtype} on rank {r.rank}, expected {want}")
        if r.flat_param_dtypes != [want]:
            problems.append(f"flat parameters are {', '.join(r.flat_param_dtypes)} on rank {r.rank}, expected {want}")
    return problems


def judge(off: Runs, on: Runs, precision: str) -> Verdict:
    """The cast's verdict, on a release that lacks it (the only one trained without the shim unchecked): ``fixed``
    must hold on every rank, exactly; ``not needed`` if the shim changes nothing."""
    want = DTYPES[precision]
    problems = unapplied(on[0].fixes[CAST.name], on[0].namespace) + dtype_problems(on, want)
    for a, b in zip(off, on):
        for key in BYTE_KEYS:
            before, after = getattr(a, key), getattr(b, key)
            if after > before or (a.flat_param_dtypes != [want] and after >= before > 0):  # SGD keeps no state
                problems.append(f"{key} did not shrink on rank {b.rank} ({before:,} -> {after:,})")
    if finite(off[0].losses) and not finite(on[0].losses):
        problems.append(f"the losses are not finite with the shim, while they are without it ({DOCS}numerics.html)")
    if problems:
        return "FAILED", "; ".join(problems)
    if not dtype_problems(off, want):
        return "not needed", "this model is already in the precision's dtype without the shim (it casts itself)"
    before, after = (sum(getattr(r, key) for key in BYTE_KEYS) for r in (off[0], on[0]))
    note = "" if finite(on[0].losses) else f"; the losses are not finite in either run ({DOCS}numerics.html)"
    return "fixed", f"sharded parameters, gradients and optimizer state are {1 - after / before:.0%} smaller{note}"


def what_changed(plain: Runs, checkpointed: Runs) -> str | None:
    """What the checkpointed run raised, or its first loss or parameter shard not the same bit for bit."""
    if checkpointed[0].error:
        return f"raised {checkpointed[0].error}"
    for a, b in zip(plain, checkpointed):
        for step, (x, y) in enumerate(zip(a.losses, b.losses), 1):
            if (x, y) != (None, None) and (x is None or y is None or float(x).hex() != float(y).hex()):
                return f"differs first in the loss of step {step} on rank {a.rank} ({x}, checkpointed {y})"
        for name, digest in a.param_hashes.items():
            if b.param_hashes.get(name) != digest:
                return f"differs first in parameter {name} on rank {a.rank}"
    return None


def judge_recompute(off: Runs, on: Runs, off_ac: Runs, on_ac: Runs, classes: str) -> Verdict:
    """``fixed`` when, with the shim, checkpointing changes nothing bit for bit, and without it something (``off``
    is ``on`` where the release has the cast: the shim changes nothing there without checkpointing)."""
    count = on_ac[0].checkpointed or off_ac[0].checkpointed
    blocks = f"checkpointing {classes} ({count} module{'' if count == 1 else 's'}) changes nothing"
    state, changed, unfixed = on_ac[0].fixes[RECOMPUTE.name], what_changed(on, on_ac), what_changed(off, off_ac)
    if state["state"] == State.TORCH_HAS_IT.value:  # torch restores the dtype itself: nothing wrapped
        if changed or unfixed:
            return "FAILED", f"{state['reason']}, but the checkpointed run {changed or unfixed}"
        return "not needed", f"{state['reason']}; measured: {blocks}, with the shim on and off"
    problems = unapplied(state, on[0].namespace) + [f"with the shim, the checkpointed run {changed}"] * bool(changed)
    if problems:
        return "FAILED", "; ".join(problems + [f"with the shim off, the checkpointed run {unfixed}"] * bool(unfixed))
    if not unfixed:
        return "not needed", f"{blocks} with the shim off either (its blocks give every tensor an explicit dtype)"
    return "fixed", f"with the shim, {blocks}, bit for bit; with the shim off, the checkpointed run {unfixed}"


def judge_raised(raised: dict[str, Any], on: Runs, on_ac: Runs | None, precision: str) -> dict[str, Verdict]:
    """A user's model that raised without the shim and trains with it: the recompute made it train where torch's
    checkpoint raised, else the cast did; the other fix has no run without the shim to compare with."""
    by = RECOMPUTE if raised["in_recompute"] else CAST  # only a release that lacks the cast trains without the shim
    who = "a recompute of torch's checkpoint" if raised["in_recompute"] else "training"
    without, changed = f"without the shim, {who} raised {raised['message']}", what_changed(on, on_ac) if on_ac else None
    problems = {
        CAST: dtype_problems(on, DTYPES[precision]),
        RECOMPUTE: [f"the checkpointed run {changed}"] * bool(changed),
    }
    verdicts: dict[str, Verdict] = {}
    for fix in FIXES:
        found = unapplied(on[0].fixes[fix.name], on[0].namespace) * (fix is by) + problems[fix]
        verdict = "FAILED" if found else "fixed" if fix is by else None
        said = "with the shim it trains" if fix is by else "so there is no run without the shim to compare with"
        verdicts[fix.name] = verdict, f"{without}; " + ("; ".join(found) if found else said)
    return verdicts


def overall(section: Section) -> str:
    verdicts = {section.verdict, *(e["verdict"] for e in section.fixes)}
    return next((v for v in ("FAILED", "fixed") if v in verdicts), "not needed")


def render(section: Section, options: Options, others: dict[str, str]) -> str:
    """The text report: rank 0's figures where both runs trained, each fix's shim state, verdict and reason, the
    installed namespaces not checked, and the overall verdict."""
    lines = [f"fsdp-shim verify ({options.precision}, {options.devices} device(s), {options.steps} steps)", ""]
    lines.append(f"{section.namespace} {section.version or ''}".rstrip())
    if section.shim_off and section.shim_on:
        lines.append("  rank 0, shim off -> on (--json has every rank; on CPU, Lightning's GPU guards are lifted):")
        lines += [f"    {k}: {getattr(section.shim_off[0], k)} -> {getattr(section.shim_on[0], k)}" for k in FIGURES]
    for e in section.fixes or [{"fix": "", "verdict": section.verdict, "reason": section.reason, "shim": None}]:
        shim = f" [shim: {e['shim']['reason']}]" if e["shim"] and e["shim"]["affected"] else ""
        lines.append(f"  {e['fix']}{shim}: {e['verdict'] or 'not checked'}: {e['reason']}".replace("  : ", "  "))
    hint = "" if options.model else " (--package {} checks it)"
    lines += [f"  not checked: {ns} {v}" + hint.format(ns.partition(".")[0]) for ns, v in others.items()]
    return "\n".join([*lines, "", f"verdict: {overall(section)}"])
