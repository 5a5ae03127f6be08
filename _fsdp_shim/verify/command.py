"""``fsdp-shim verify`` (docs/verify.md): train with the shim on and off in fresh processes, judge each fix, report."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from _fsdp_shim.config import CAST, DOCS, FIXES, RECOMPUTE, Fix, State
from _fsdp_shim.status import describe_import_failure
from _fsdp_shim.verify import PROBE_TIMEOUT

PROBE_SCRIPT = Path(__file__).resolve().with_name("probe.py")
DTYPES = {"bf16-true": "torch.bfloat16", "16-true": "torch.float16"}
BYTE_KEYS = ("param_bytes", "grad_bytes", "optimizer_state_bytes")
FIGURES = ("module_dtype", "flat_param_dtypes", *BYTE_KEYS, "losses")
NOT_CHECKED = "--activation-checkpointing MODULE:CLASS[,...] trains your checkpointed blocks with it"
SHIM = {"0": "off", "1": "on"}
Verdict = tuple[Optional[str], str]  # None: not checked
Runs = list["RankResult"]  # every rank's, by rank


@dataclass(frozen=True)
class Options:  # what the command line asked for, in --json's order
    precision: str = "bf16-true"
    devices: int = 1
    steps: int = 3
    as_json: bool = False
    model: str | None = None
    datamodule: str | None = None
    timeout: float = PROBE_TIMEOUT
    activation_checkpointing: list[str] = field(default_factory=list)
    package: str | None = None  # the seed's Lightning (PACKAGES); None: lightning where installed


@dataclass(frozen=True)
class RankResult:  # one rank's figures from one run; a checkpointed run that raised: error, checkpointed, fixes
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


@dataclass
class Section:  # one namespace: verdict and reason are the cast's, fixes every fix's; each run's figures in its slot
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


class Stop(Exception):  # end verify: before (the user's traceback), then "fsdp-shim verify: MESSAGE"; exit code
    def __init__(self, message: str, code: int = 1, before: str = "") -> None:
        super().__init__(f"{before}fsdp-shim verify: {message}")
        self.code = code


def main(options: Options) -> int:
    """Run verify: 0 fixed or not needed; 1 FAILED, the user's code raised, or a timeout; 2 cannot run; 130 Ctrl-C."""
    start = time.monotonic()
    try:
        if importlib.util.find_spec("torch") is None:  # no Lightning, or not --package's: the probe says so, exit 2
            raise Stop(f"torch is not installed in this interpreter ({sys.executable}); install torch and Lightning", 2)
        try:
            workdir = tempfile.TemporaryDirectory(prefix="fsdp-shim-verify-")
        except OSError as error:
            raise Stop(f"no usable temporary folder ({error}); set TMPDIR to a writable folder", 2) from None
        with workdir:
            section, others = verify(options, Path(workdir.name))
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


def run_probe(workdir: Path, options: Options, shim: str, step: str, slots: list[str] | None = None) -> Any:
    """Run a probe in its own session, SIGKILLing its group after (hung ranks outlive SIGTERM): "", failure, record."""
    print(f"fsdp-shim verify: {step} ...", file=sys.stderr, flush=True)  # with --json, stdout is the document
    out = workdir / f"shim{shim}"  # the prefix of its files
    with open(f"{out}.stderr", "w") as log:
        env = dict(os.environ, FSDP_SHIM=shim, PYTHONWARNINGS="ignore")
        command = [sys.executable, str(PROBE_SCRIPT), str(out), json.dumps(asdict(options))]
        command += [json.dumps(slots)] * bool(slots)
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, env=env, start_new_session=True)
    try:
        proc.wait(options.timeout)
    except subprocess.TimeoutExpired:
        raise Stop(f"{step} ran past --timeout {options.timeout:g} s; every process it started was stopped") from None
    except KeyboardInterrupt:
        raise Stop(f"interrupted while {step}; every process it started was stopped", 130) from None
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: the group's id is its pid
        proc.wait()
    for record in [json.loads(p.read_text()) for p in sorted(workdir.glob(f"{out.name}.rank*.error.json"))][:1]:
        if record["kind"] == "usage":
            raise Stop(record["message"], 2)
        return record
    last = (Path(f"{out}.stderr").read_text(errors="replace").strip().splitlines() or ["(no output)"])[-1]
    return "" if proc.returncode == 0 else f"failed (exit {proc.returncode}): {last}"


def users_code_raised(record: dict[str, Any], shim: str, also: str = "") -> Stop:
    message = f"your code raised while {record['phase']} (shim {SHIM[shim]}){also}; the traceback above is from your"
    return Stop(f"{message} model, not from fsdp-shim.", 1, record["traceback"].rstrip() + "\n\n")


def verify(options: Options, workdir: Path) -> tuple[Section, dict[str, str]]:
    """The section of the namespace checked, from the first probe's gate and the runs; and the other ones installed."""
    shim1 = run_probe(workdir, options, "1", "reading the installed Lightning, then training with the shim on")
    if not (workdir / "shim1.gate.json").exists():
        if isinstance(shim1, dict):
            raise users_code_raised(shim1, "1")
        return Section("Lightning", None, "FAILED", f"reading the installed Lightning {shim1 or 'wrote nothing'}"), {}
    gate = json.loads((workdir / "shim1.gate.json").read_text())
    namespace, version, others, plan = gate["namespace"], gate["version"], gate["others"], gate["plan"]
    if gate["import_failure"] is not None:
        return Section(namespace, None, "FAILED", describe_import_failure(namespace, gate["import_failure"])), others
    if not plan:
        unneeded = {f.name: unaffected(f, version, "; nothing was trained") for f in FIXES if not f.affects(version)}
        return Section(namespace, version, *unneeded[CAST.name], fix_entries(gate["fixes"], unneeded)), others
    step = f"training {namespace} {version} with the shim off"
    only = ["shim_off"] if isinstance(shim1, dict) else None  # the user's code raised with the shim: does it without?
    shim0 = shim1 if shim1 and isinstance(shim1, str) else run_probe(workdir, options, "0", step, only)  # 1 failed
    raised = shim0 if isinstance(shim0, dict) else None  # without the shim only: judged by what the shim made train
    if isinstance(shim1, dict):
        also = f", and with the shim on too ({shim1['message']})" if raised else ""
        raise users_code_raised(raised or shim1, "0" if raised else "1", also)
    runs: dict[str, Runs] = {}
    for slot in [s for s in plan if not (raised and s.endswith("_off"))]:  # raised: judged by the runs with the shim
        paths = workdir.glob(f"{slot}.rank*.json")
        found = runs[slot] = sorted((RankResult(**json.loads(p.read_text())) for p in paths), key=lambda r: r.rank)
        shim, probe = ("1", shim1) if slot.endswith("_on") else ("0", shim0)
        last = f"checkpointed_{slot}" not in plan  # a failed probe: its first run lacking a rank's result, else last
        if (probe and last) or (len(found) != options.devices and not any(r.error for r in found)):
            run = f"the {'checkpointed ' * slot.startswith('checkpointed')}run with FSDP_SHIM={shim}"
            failure = f"{run} {probe or 'wrote no result on some rank'}"
            trained: dict[str, Any] = {s: r or None for s, r in runs.items()}
            return Section(namespace, version, "FAILED", failure, **trained), others
    on, off = runs["shim_on"], runs.get("shim_off")  # a model that raised without the shim: judged by those with it
    on_ac, off_ac = runs.get("checkpointed_shim_on"), runs.get("checkpointed_shim_off")
    cast = judge(off, on, options.precision) if off else unaffected(CAST, version, "; trained for the recompute only")
    verdicts = judge_raised(raised, on, on_ac, options.precision) if raised else {CAST.name: cast}
    if on_ac and off_ac:  # 2.5+: the run without the shim is the one with it
        classes = ", ".join(spec.rpartition(":")[2] for spec in options.activation_checkpointing) or "CausalBlock"
        verdicts[RECOMPUTE.name] = judge_recompute(off or on, on, off_ac, on_ac, classes)
    (verdict, reason), fixes = verdicts[CAST.name], fix_entries((on_ac or on)[0].fixes, verdicts)
    error = raised["traceback"] if raised else None
    return Section(namespace, version, verdict or "not checked", reason, fixes, **runs, shim_off_error=error), others


def unaffected(fix: Fix, version: str, then: str) -> tuple[str, str]:
    if fix.built_in(version):
        return "not needed", f"Lightning {version} already contains it ({fix.upstream}); left untouched{then}"
    return "not needed", f"Lightning {version} has no 'true' precisions for FSDP; nothing to fix"


def unapplied(state: dict[str, Any], namespace: str) -> list[str]:
    """Nothing where the shim applied the fix (its ``FixStatus.as_dict()``), else why it did not."""
    said = {State.PATCHED.value: [], State.NOT_IN_EFFECT.value: [f"the shim's fix is {state['reason']}"]}
    return said.get(state["state"], [f"the shim did not apply it to {namespace}: {state['reason']}"])


def fix_entries(states: dict[str, dict[str, Any]], verdicts: Mapping[str, Verdict]) -> list[dict[str, Any]]:
    """Per fix: its verdict, reason, and ``shim``: its state in a probe; one not in effect on this torch is FAILED."""
    entries = []
    for fix in FIXES:
        (verdict, why), state = verdicts.get(fix.name, (None, NOT_CHECKED)), states.get(fix.name)
        if state and state["state"] == State.NOT_IN_EFFECT.value and verdict != "FAILED":
            verdict, why = "FAILED", unapplied(state, "")[0]
        entries.append({"fix": fix.name, "verdict": verdict, "reason": why, "shim": state})
    return entries


def dtype_problems(runs: Runs, want: str) -> list[str]:
    """Each rank's ``LightningModule.dtype`` and flat-parameter dtypes that are not ``want``."""
    problems = []
    for r in runs:
        wrong = {"LightningModule.dtype is": [r.module_dtype], "flat parameters are": r.flat_param_dtypes}
        problems += [f"{k} {', '.join(v)} on rank {r.rank}, expected {want}" for k, v in wrong.items() if v != [want]]
    return problems


def judge(off: Runs, on: Runs, precision: str) -> Verdict:
    """The cast's verdict: ``fixed`` only where it holds on every rank, exactly; ``not needed`` if nothing changes."""
    want = DTYPES[precision]
    off_finite, on_finite = (all(v is not None and math.isfinite(v) for v in r[0].losses) for r in (off, on))
    problems = unapplied(on[0].fixes[CAST.name], on[0].namespace) + dtype_problems(on, want)
    for a, b in zip(off, on):
        for key, before, after in ((key, getattr(a, key), getattr(b, key)) for key in BYTE_KEYS):
            if after > before or (a.flat_param_dtypes != [want] and after >= before > 0):  # SGD keeps no state
                problems.append(f"{key} did not shrink on rank {b.rank} ({before:,} -> {after:,})")
    if off_finite and not on_finite:
        problems.append(f"the losses are not finite with the shim, while they are without it ({DOCS}numerics.html)")
    if problems:
        return "FAILED", "; ".join(problems)
    if not dtype_problems(off, want):
        return "not needed", "this model is already in the precision's dtype without the shim (it casts itself)"
    before, after = (sum(getattr(r, key) for key in BYTE_KEYS) for r in (off[0], on[0]))
    note = "" if on_finite else f"; the losses are not finite in either run ({DOCS}numerics.html)"
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
    """``fixed`` when, with the shim, checkpointing changes nothing bit for bit, and without it something."""
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
    """A model that raised only without the shim: the fix that made it train (the recompute where torch's checkpoint
    raised or the release has the cast, else the cast) is ``fixed``; the other has nothing to compare with."""
    who = "a recompute of torch's checkpoint" if raised["in_recompute"] else "training"
    by = RECOMPUTE if raised["in_recompute"] or not CAST.affects(on[0].lightning) else CAST
    changed = what_changed(on, on_ac) if on_ac else None
    problems = {CAST: dtype_problems(on, DTYPES[precision])}
    problems[RECOMPUTE] = [f"the checkpointed run {changed}"] * bool(changed)
    verdicts: dict[str, Verdict] = {}
    for fix in FIXES:
        found = unapplied(on[0].fixes[fix.name], on[0].namespace) * (fix is by) + problems[fix]
        said = "with the shim it trains" if fix is by else "so there is no run without the shim to compare with"
        reason = f"without the shim, {who} raised {raised['message']}; " + ("; ".join(found) if found else said)
        verdicts[fix.name] = "FAILED" if found else "fixed" if fix is by else None, reason
    return verdicts


def overall(section: Section) -> str:
    verdicts = {section.verdict, *(e["verdict"] for e in section.fixes)}
    return next((v for v in ("FAILED", "fixed") if v in verdicts), "not needed")


def render(section: Section, options: Options, others: dict[str, str]) -> str:
    """The text report: rank 0's figures (where both runs trained), each fix's verdict, the namespaces not checked."""
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
