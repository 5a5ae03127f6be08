"""``fsdp-shim verify`` (docs/verify.md): read every installed Trainer namespace (the gate probe), train what it
cannot decide with the shim off and on (measure probes), print a verdict per fix."""

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
import time
from dataclasses import asdict, replace
from pathlib import Path
from subprocess import PIPE
from typing import Any

from _fsdp_shim.config import CAST, FIXES, RECOMPUTE, TRAINER_NAMESPACES, base_release
from _fsdp_shim.distributions import describe_import_failure, installed_packages
from _fsdp_shim.verify import seed, selection
from _fsdp_shim.verify.output import Progress, render
from _fsdp_shim.verify.records import Options, ProbeRequest, RankResult
from _fsdp_shim.verify.verdict import (
    Section,
    fix_entries,
    judge,
    judge_raised_without_shim,
    judge_recompute,
    overall,
    unaffected_reason,
)

PROBE_SCRIPT = Path(__file__).resolve().parent.parent / "children" / "verify_probe.py"
GATE_STEP = "reading the installed Lightning"


class Stop(Exception):
    """End verify with ``message`` and exit ``code`` (the user's code raised, or a usage problem)."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code, self.message = code, message


def environment_problem() -> str | None:
    if importlib.util.find_spec("torch") is None:
        return (
            f"torch is not installed in this interpreter ({sys.executable}); install torch (pinned) and "
            "Lightning first, then run verify again"
        )
    if not any(ns.partition(".")[0] in installed_packages() for ns in TRAINER_NAMESPACES):
        return f"neither lightning nor pytorch_lightning is installed in this interpreter ({sys.executable})"
    return None


def main(options: Options) -> int:
    start, problem = time.monotonic(), environment_problem()
    try:
        tmp = tempfile.mkdtemp(prefix="fsdp-shim-verify-") if problem is None else ""
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
        document["skipped"] = [asdict(skip) for skip in skipped]
        print(json.dumps({**document, "sections": [asdict(section) for section in sections]}, indent=2))
    else:
        print(f"{render(sections, options, skipped)}\n(took {seconds:.0f} s)")
    return 1 if verdict == "FAILED" else 0


def run_probe(request: ProbeRequest, shim: str, step: str, keep_user_error: bool = False) -> str | dict[str, Any]:
    """Run one probe; ``""``, or why it failed. Its session (the ranks, their workers) is SIGKILLed whatever
    happens (a rank hung in a collective survives SIGTERM). Only user modules get a folder on its path. An
    exception in the user's code ends verify (``Stop``), or with ``keep_user_error`` is returned: its record."""
    options = request.options
    user_modules = options.model or options.datamodule or options.activation_checkpointing
    folder = (options.model_path or os.getcwd()) if user_modules else None
    probe = replace(request, options=replace(options, model_path=folder))
    command = [sys.executable, str(PROBE_SCRIPT), json.dumps(asdict(probe))]
    env = dict(os.environ, FSDP_SHIM=shim, PYTHONWARNINGS="ignore")
    proc = subprocess.Popen(command, stdout=PIPE, stderr=PIPE, text=True, env=env, start_new_session=True)
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
        record = json.loads(error.read_text())
        if record["kind"] == "usage":
            raise Stop(f"fsdp-shim verify: {record['message']}", 2)
        if keep_user_error:
            return record
        raise users_code_raised(record, shim)
    last = (stderr.strip().splitlines() or ["(no output)"])[-1]
    return "" if proc.returncode == 0 else f"failed (exit {proc.returncode}): {last}"


def users_code_raised(record: dict[str, Any], shim: str, also: str = "") -> Stop:
    return Stop(
        f"{record['traceback'].rstrip()}\n\nfsdp-shim verify: your code raised while {record['phase']} "
        f"(shim {'off' if shim == '0' else 'on'}){also}; the traceback above is from your model, not from fsdp-shim."
    )


def _decided(namespace: str, info: dict[str, Any], options: Options) -> Section | None:
    """A section decided from the gate's ``info``, or ``None`` to train: a release that lacks the cast, the
    seed's checkpointed block on a release that lacks the recompute, --measure, --activation-checkpointing."""
    if info["import_failure"] is not None:
        return Section(namespace, None, "FAILED", describe_import_failure(namespace, info["import_failure"]))
    version, release = info["version"], base_release(info["version"])
    verdicts = {fix.name: ("not needed", unaffected_reason(fix, version)) for fix in FIXES if not fix.affects(version)}
    reason = unaffected_reason(CAST, version)
    if release is None or release >= (base_release(CAST.since) or release):  # 2.0.x: nothing ever trained
        seed_recompute = options.model is None and RECOMPUTE.affects(version)
        if CAST.affects(version) or options.measure or options.activation_checkpointing or seed_recompute:
            return None
        reason += "; nothing was trained (--measure trains anyway)"
    fixes = fix_entries(info["fixes"], {**verdicts, CAST.name: ("not needed", reason)})
    return Section(namespace, version, "not needed", reason, fixes)


class _Failed(Exception):
    """A run that failed outside the user's code: its section says so."""

    def __init__(self, section: Section) -> None:
        super().__init__(section.reason)
        self.section = section


def _plan(options: Options, version: str | None) -> list[tuple[str, bool]]:
    """The runs of one section, as (FSDP_SHIM, checkpointed): the seed's model checks the recompute with its
    own block. A release that has the cast trains it only for the recompute: the run with the shim off
    and without checkpointing is added only where the checkpointed one trains (``_measured``)."""
    checking = bool(options.activation_checkpointing) or options.model is None
    seed_only = options.model is None and not options.measure and not options.activation_checkpointing
    if seed_only and version is not None and not CAST.affects(version):
        return [("1", False), ("1", True), ("0", True)]
    return [("0", False), ("1", False), *([("0", True), ("1", True)] if checking else [])]


def _measured(
    options: Options, workdir: Path, progress: Progress, namespace: str | None, label: str, version: str | None
) -> Section:
    """Train with the shim off and on (also checkpointed: the seed's block, or ``--activation-checkpointing``);
    judge each fix. A checkpointed run that raised may end before every rank wrote: one rank's error result
    is enough. A user's model that raises without the shim is trained with it too (``judge_raised_without_shim``)."""
    runs: dict[tuple[str, bool], list[RankResult]] = {}
    raised: dict[str, Any] | None = None  # the user's error record of the run without the shim

    def train(shim: str, ac: bool, keep_user_error: bool = False) -> dict[str, Any] | None:
        state = "off" if shim == "0" else "on"
        step = f"{label}: training with the shim {state}" + (", with activation checkpointing" if ac else "")
        progress.phase(step)
        out = workdir / f"{namespace or 'model'}-shim{shim}{'-ac' if ac else ''}"
        request = ProbeRequest("measure", str(out), options, namespace, ac)
        failed = run_probe(request, shim, step, keep_user_error)
        if isinstance(failed, dict):
            return failed
        results = [RankResult(**json.loads(p.read_text())) for p in workdir.glob(f"{out.name}.rank*.json")]
        if failed or (len(results) != options.devices and not any(result.error for result in results)):
            error = f"the run with FSDP_SHIM={shim} {failed or 'wrote no result on some rank'}"
            section = Section(namespace or "model", None, "FAILED", error, [], runs.get(("0", False)), results or None)
            raise _Failed(section)
        runs[shim, ac] = sorted(results, key=lambda result: result.rank)
        return None

    try:
        for shim, ac in _plan(options, version):
            if raised is not None and shim == "0":
                progress.total -= 1  # it raised without the shim already without checkpointing
                continue
            keep = options.model is not None and not ac and (shim == "0" or raised is not None)
            record = train(shim, ac, keep_user_error=keep)
            if record is not None and shim == "0":
                raised = record  # the run with the shim follows: does the shim make it train?
            elif record is not None and raised is not None:
                raise users_code_raised(raised, "0", f", and with the shim on too ({record['error']})")
        if ("0", False) not in runs and ("0", True) in runs and runs["0", True][0].error is None:
            progress.total += 1
            train("0", False)  # the checkpointed run trained: the one without checkpointing to compare with
    except _Failed as failed:
        return failed.section
    on = runs["1", False]
    if raised is not None:
        verdicts = judge_raised_without_shim(raised, on, runs.get(("1", True)), options.precision, _classes(options))
        fixes = fix_entries(on[0].fixes, verdicts)
        cast = verdicts[CAST.name]
        section = Section(on[0].namespace, on[0].lightning, cast[0] or "not checked", cast[1], fixes, None, on)
        return replace(section, checkpointed_shim_on=runs.get(("1", True)), shim_off_error=raised["traceback"])
    off = runs.get(("0", False))
    if off is None:
        version = on[0].lightning
        reason = (
            f"{unaffected_reason(CAST, version)}; not measured: trained for the recompute only (--measure measures it)"
        )
        cast = ("not needed", reason)
    else:
        cast = judge(off, on, options.precision, seed_model=options.model is None)
    verdicts = {CAST.name: cast}
    if ("1", True) in runs:
        verdicts[RECOMPUTE.name] = judge_recompute(off, on, runs["0", True], runs["1", True], _classes(options))
    fixes, checkpointed = fix_entries(on[0].fixes, verdicts), (runs.get(("0", True)), runs.get(("1", True)))
    return Section(on[0].namespace, on[0].lightning, *cast, fixes, off, on, *checkpointed)


def _classes(options: Options) -> str:
    """The checkpointed classes, by name, as the recompute's verdict says them."""
    return ", ".join(spec.rpartition(":")[2] for spec in options.activation_checkpointing) or seed.CHECKPOINTED


def verify(options: Options, workdir: Path) -> tuple[list[Section], list[selection.Skipped]]:
    """Every section, in the order of ``TRAINER_NAMESPACES`` (the user's model last), and the installed namespaces
    the seed model was not trained with (``selection``); probes write in ``workdir``."""
    out = workdir / "gate.json"
    with Progress(not options.as_json) as progress:
        progress.phase(GATE_STEP)
        failed = run_probe(ProbeRequest("gate", str(out), options), "1", GATE_STEP)
    if failed or not out.exists():
        return [Section("Lightning", None, "FAILED", f"{GATE_STEP} {failed or 'wrote nothing'}")], []
    gate = json.loads(out.read_text())
    chosen: list[str] = list(gate["namespaces"])
    skipped: list[selection.Skipped] = []
    if options.model is None:
        try:
            installed = {ns: info["version"] for ns, info in gate["namespaces"].items()}
            chosen, skipped = selection.select(options.package, installed)
        except ValueError as error:
            raise Stop(f"fsdp-shim verify: {error} ({sys.executable})", 2) from None
    sections: list[Section] = []
    to_measure: list[tuple[str | None, str, str | None]] = []
    for namespace, info in gate["namespaces"].items():
        if namespace not in chosen:
            continue
        if options.model is not None and info["import_failure"] is None:
            continue  # with --model, the model's own namespace is judged below; a broken one is still reported
        if (decided := _decided(namespace, info, options)) is None:
            to_measure.append((namespace, f"{namespace} {info['version']}", info["version"]))
        else:
            sections.append(decided)
    if options.model is not None:
        importable = {ns: info for ns, info in gate["namespaces"].items() if info["import_failure"] is None}
        decided_all = [_decided(ns, importable[ns], options) for ns in gate["model_namespaces"] if ns in importable]
        if decided_all and all(decided_all):
            sections += [d for d in decided_all if d is not None]
        else:
            to_measure.append((None, options.model, None))
    total = sum(len(_plan(options, version)) for _, _, version in to_measure)  # runs, each counted once
    with Progress(not options.as_json, total) as progress:
        sections += [_measured(options, workdir, progress, *measured) for measured in to_measure]
    order = {name: index for index, name in enumerate(TRAINER_NAMESPACES)}
    return sorted(sections, key=lambda section: order.get(section.namespace, len(order))), skipped
