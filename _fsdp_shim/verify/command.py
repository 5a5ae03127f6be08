"""``fsdp-shim verify`` (docs/verify.md): read every installed Trainer namespace (the gate probe), train what it
cannot decide with the shim off and on, in fresh processes (measure probes), and print a verdict per fix."""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from _fsdp_shim.config import CAST, FIXES, RECOMPUTE, TRAINER_NAMESPACES
from _fsdp_shim.distributions import describe_import_failure, installed_packages
from _fsdp_shim.verify.records import SEED_CHECKPOINTED, Options, ProbeRequest, RankResult, Skipped, select
from _fsdp_shim.verify.report import (
    Runs,
    Section,
    fix_entries,
    judge,
    judge_raised_without_shim,
    judge_recompute,
    overall,
    render,
    unaffected_reason,
)

PROBE_SCRIPT = Path(__file__).resolve().parent.parent / "children" / "verify_probe.py"
GATE_STEP = "reading the installed Lightning"


class Stop(Exception):
    """End verify with ``message`` and exit ``code`` (the user's code raised, a usage problem, a timeout)."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code, self.message = code, message


def main(options: Options) -> int:
    """Run verify: 0 fixed or not needed; 1 FAILED, the user's code raised, or a timeout; 2 cannot run; 130 Ctrl-C."""
    start, tmp, problem = time.monotonic(), "", None
    if importlib.util.find_spec("torch") is None:
        problem = (
            f"torch is not installed in this interpreter ({sys.executable}); install torch (pinned) and Lightning "
            "first, then run verify again"
        )
    elif not any(ns.partition(".")[0] in installed_packages() for ns in TRAINER_NAMESPACES):
        problem = f"neither lightning nor pytorch_lightning is installed in this interpreter ({sys.executable})"
    else:
        try:
            tmp = tempfile.mkdtemp(prefix="fsdp-shim-verify-")
        except OSError as error:
            problem = f"no usable temporary folder ({type(error).__name__}: {error}); set TMPDIR to a writable folder"
    if problem is not None:
        print(f"fsdp-shim verify: {problem}", file=sys.stderr)
        return 2
    try:
        sections, skipped = verify(options, Path(tmp))
    except Stop as stop:
        print(stop.message, file=sys.stderr)
        return stop.code
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    (verdict, reason), seconds = overall(sections), time.monotonic() - start
    if options.as_json:
        document = {"verdict": verdict, "reason": reason, **asdict(options), "seconds": round(seconds, 1)}
        document.update(skipped=[asdict(s) for s in skipped], sections=[asdict(s) for s in sections])
        print(json.dumps(document, indent=2))
    else:
        print(f"{render(sections, options, skipped)}\n(took {seconds:.0f} s)")
    return 1 if verdict == "FAILED" else 0


def say(step: str) -> None:
    """What verify is doing, on stderr (with ``--json`` too: stdout holds only the document)."""
    print(f"fsdp-shim verify: {step} ...", file=sys.stderr, flush=True)


def run_probe(request: ProbeRequest, shim: str, step: str) -> str | dict[str, Any]:
    """Run one probe in a session of its own, SIGKILLed whatever happens (a rank hung in a collective survives
    SIGTERM): ``""``, why it failed, or the user's error record. Only user modules get a folder on its path."""
    options = request.options
    user_modules = options.model or options.datamodule or options.activation_checkpointing or options.auto_wrap
    probe = replace(
        request, options=replace(options, model_path=(options.model_path or os.getcwd()) if user_modules else None)
    )
    command = [sys.executable, str(PROBE_SCRIPT), json.dumps(asdict(probe))]
    env = dict(os.environ, FSDP_SHIM=shim, PYTHONWARNINGS="ignore")
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        _, stderr = proc.communicate(timeout=options.timeout)
    except subprocess.TimeoutExpired:
        raise Stop(
            f"fsdp-shim verify: {step} did not finish within {options.timeout:g} s, so verify stopped it and every "
            "process it started; --timeout SECONDS allows longer"
        ) from None
    except KeyboardInterrupt:
        raise Stop(f"fsdp-shim verify: interrupted while {step}; every process it started was stopped", 130) from None
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: the group's id is its pid
        if proc.returncode is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.communicate(timeout=30)
    out = Path(request.out)
    for error in sorted(out.parent.glob(f"{out.name}.rank*.error.json"))[:1]:
        record: dict[str, Any] = json.loads(error.read_text())
        if record["kind"] == "usage":
            raise Stop(f"fsdp-shim verify: {record['message']}", 2)
        return record
    last = (stderr.strip().splitlines() or ["(no output)"])[-1]
    return "" if proc.returncode == 0 else f"failed (exit {proc.returncode}): {last}"


def users_code_raised(record: dict[str, Any], shim: str, also: str = "") -> Stop:
    return Stop(
        f"{record['traceback'].rstrip()}\n\nfsdp-shim verify: your code raised while {record['phase']} "
        f"(shim {'off' if shim == '0' else 'on'}){also}; the traceback above is from your model, not from fsdp-shim."
    )


def decided(namespace: str, info: dict[str, Any], options: Options) -> Section | None:
    """A section decided from the gate alone, or ``None`` to train: a release that lacks the cast, the seed's
    checkpointed block on a release that lacks the recompute, ``--measure``, ``--activation-checkpointing``."""
    if info["import_failure"] is not None:
        return Section(namespace, None, "FAILED", describe_import_failure(namespace, info["import_failure"]))
    version = info["version"]
    reason = unaffected_reason(CAST, version)
    if CAST.affects(version) or CAST.built_in(version):  # 2.0.x has no "true" precisions to train
        seed_recompute = options.model is None and RECOMPUTE.affects(version)
        if CAST.affects(version) or options.measure or options.activation_checkpointing or seed_recompute:
            return None
        reason += "; nothing was trained (--measure trains anyway)"
    verdicts = {fix.name: ("not needed", unaffected_reason(fix, version)) for fix in FIXES if not fix.affects(version)}
    fixes = fix_entries(info["fixes"], {**verdicts, CAST.name: ("not needed", reason)})
    return Section(namespace, version, "not needed", reason, fixes)


def plan(options: Options, version: str | None) -> list[tuple[str, bool]]:
    """The runs of one section, as (FSDP_SHIM, checkpointed); the seed's block checks the recompute, and a release
    that has the cast trains the seed for it only. Last: the run a model that raised without the shim skips."""
    seed_only = options.model is None and not options.measure and not options.activation_checkpointing
    if seed_only and version is not None and not CAST.affects(version):
        return [("1", False), ("1", True), ("0", True)]
    checking = bool(options.activation_checkpointing) or options.model is None
    return [("0", False), ("1", False), *([("1", True), ("0", True)] if checking else [])]


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
            continue
        if isinstance(failed, dict):
            also = f", and with the shim on too ({failed['error']})" if raised else ""
            raise users_code_raised(raised or failed, "0" if raised else shim, also)
        results = sorted(
            (RankResult(**json.loads(p.read_text())) for p in workdir.glob(f"{out.name}.rank*.json")),
            key=lambda r: r.rank,
        )
        if failed or (len(results) != options.devices and not any(result.error for result in results)):
            error = f"the run with FSDP_SHIM={shim} {failed or 'wrote no result on some rank'}"
            return Section(namespace or "model", None, "FAILED", error, [], runs.get(("0", False)), results or None)
        runs[shim, ac] = results
    on, on_ac, off, off_ac = runs["1", False], runs.get(("1", True)), runs.get(("0", False)), runs.get(("0", True))
    classes = ", ".join(spec.rpartition(":")[2] for spec in options.activation_checkpointing) or SEED_CHECKPOINTED
    states, version = (on_ac or on)[0].fixes, on[0].lightning
    if raised is not None:
        verdicts = judge_raised_without_shim(raised, on, on_ac, options.precision, classes)
        cast = verdicts[CAST.name]
        section = Section(on[0].namespace, version, cast[0] or "not checked", cast[1], fix_entries(states, verdicts))
        return replace(section, shim_on=on, checkpointed_shim_on=on_ac, shim_off_error=raised["traceback"])
    if off is None:
        recompute_only = "not measured: trained for the recompute only (--measure measures it)"
        verdicts = {CAST.name: ("not needed", f"{unaffected_reason(CAST, version)}; {recompute_only}")}
    else:
        verdicts = {CAST.name: judge(off, on, options.precision, seed_model=options.model is None)}
    if on_ac and off_ac:
        verdicts[RECOMPUTE.name] = judge_recompute(off or on, on, off_ac, on_ac, classes)
    verdict, reason = verdicts[CAST.name]
    return Section(
        on[0].namespace, version, verdict or "", reason, fix_entries(states, verdicts), off, on, off_ac, on_ac
    )


def verify(options: Options, workdir: Path) -> tuple[list[Section], list[Skipped]]:
    """Every section, in ``TRAINER_NAMESPACES``' order (the user's model last), and the installed namespaces the
    seed model was not trained with; the probes write in ``workdir``."""
    out = workdir / "gate.json"
    say(GATE_STEP)
    failed = run_probe(ProbeRequest("gate", str(out), options), "1", GATE_STEP)
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
            raise Stop(f"fsdp-shim verify: {error} ({sys.executable})", 2) from None
    sections: list[Section] = []
    targets: list[tuple[str | None, str, str | None]] = []
    for namespace in chosen:
        info = namespaces[namespace]
        if options.model is not None and info["import_failure"] is None:
            continue  # with --model, the model's own namespace is judged below; a broken one is still reported
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
