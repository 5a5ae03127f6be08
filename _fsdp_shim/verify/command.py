"""``fsdp-shim verify``: read the installed Lightning once (the gate probe), decide from the gates what
needs no training, train the rest with the shim off and on, and print a verdict per fix. It never
answers for the wrong package: every installed Trainer namespace is checked, one that fails to import
is a FAILED verdict naming the cause, and a release that has the cast is "not needed" straight from
the gates (``--measure`` trains anyway, and so does ``--activation-checkpointing``: no release has the
recompute). Exit codes: 0 every verdict is "fixed" or "not needed"; 1 a FAILED verdict, or the user's
model raised (their traceback is printed); 2 a usage problem or an environment verify cannot run in.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from _fsdp_shim.config import CAST, FIXES, RECOMPUTE, TRAINER_NAMESPACES, base_release
from _fsdp_shim.distributions import describe_import_failure, installed_packages
from _fsdp_shim.verify.output import Progress, render
from _fsdp_shim.verify.protocol import GATE_STEP, Stop, run_gate, run_measure
from _fsdp_shim.verify.records import NamespaceGate, Options, RankResult
from _fsdp_shim.verify.verdict import Section, fix_entries, judge, judge_recompute, overall


def environment_problem() -> str | None:
    """Why verify cannot run in this interpreter at all (no torch, no Lightning), if it cannot."""
    if importlib.util.find_spec("torch") is None:
        return (
            f"torch is not installed in this interpreter ({sys.executable}); install torch (pinned) and "
            "Lightning first, then run verify again"
        )
    if not any(ns.partition(".")[0] in installed_packages() for ns in TRAINER_NAMESPACES):
        return f"neither lightning nor pytorch_lightning is installed in this interpreter ({sys.executable})"
    return None


def main(options: Options) -> int:
    problem = environment_problem()
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
        seconds = round(time.monotonic() - start, 1)
        document = {"verdict": verdict, "reason": reason, **asdict(options), "seconds": seconds}
        print(json.dumps({**document, "sections": [asdict(section) for section in sections]}, indent=2))
    else:
        print(f"{render(sections, options)}\n(took {time.monotonic() - start:.0f} s)")
    return 1 if verdict == "FAILED" else 0


def _decided(namespace: str, info: NamespaceGate, options: Options) -> Section | None:
    """A section decided from the gates alone, or ``None`` when the namespace must be trained."""
    if info.import_failure is not None:
        return Section(namespace, None, "FAILED", describe_import_failure(namespace, info.import_failure))
    version, release = info.version, base_release(info.version)
    verdicts = {fix.name: ("not needed", fix.unaffected_reason(version)) for fix in FIXES if not fix.affects(version)}
    reason = CAST.unaffected_reason(version)
    if release is None or release >= CAST.first_affected:  # 2.0.x has no "true" precisions: never trained
        if CAST.affects(version) or options.measure or options.activation_checkpointing:
            return None
        reason += "; nothing was trained (--measure trains anyway)"
    fixes = fix_entries(info.fixes, {**verdicts, CAST.name: ("not needed", reason)})
    return Section(namespace, version, "not needed", reason, fixes)


def _measured(options: Options, workdir: Path, progress: Progress, namespace: str | None, label: str) -> Section:
    """Train with the shim off and on (and each with checkpointing, with ``--activation-checkpointing``),
    and judge every fix the runs show."""
    runs: dict[tuple[str, bool], list[RankResult]] = {}
    for ac in (False, True) if options.activation_checkpointing else (False,):
        for shim, state in (("0", "off"), ("1", "on")):
            step = f"{label}: training with the shim {state}" + (", with activation checkpointing" if ac else "")
            progress.phase(step)
            results, error = run_measure(options, workdir, namespace, shim, step, ac)
            if error:
                return Section(namespace or "model", None, "FAILED", error, [], runs.get(("0", False)), results or None)
            runs[shim, ac] = results
    off, on = runs["0", False], runs["1", False]
    verdicts = {CAST.name: judge(off, on, options.precision, seed_model=options.model is None)}
    if options.activation_checkpointing:
        classes = ", ".join(spec.rpartition(":")[2] for spec in options.activation_checkpointing)
        verdicts[RECOMPUTE.name] = judge_recompute(off, on, runs["0", True], runs["1", True], classes)
    fixes, checkpointed = fix_entries(on[0].fixes, verdicts), (runs.get(("0", True)), runs.get(("1", True)))
    return Section(on[0].namespace, on[0].lightning, *verdicts[CAST.name], fixes, off, on, *checkpointed)


def verify(options: Options, workdir: Path) -> list[Section]:
    """Every section, in the order of ``TRAINER_NAMESPACES`` (the user's model last); probes write
    their files in ``workdir``."""
    with Progress(not options.as_json) as progress:
        progress.phase(GATE_STEP)
        gate, error = run_gate(options, workdir)
    if error:
        return [Section("Lightning", None, "FAILED", error)]
    sections: list[Section] = []
    to_measure: list[tuple[str | None, str]] = []
    for namespace, info in gate.namespaces.items():
        if options.model is not None and info.import_failure is None:
            continue  # with --model, the model's own namespace is judged below; a broken one is still reported
        decided = _decided(namespace, info, options)
        if decided is not None:
            sections.append(decided)
        else:
            to_measure.append((namespace, f"{namespace} {info.version}"))
    if options.model is not None:
        importable = [ns for ns in gate.model_namespaces if ns in gate.namespaces and gate.importable(ns)]
        decided_all = [_decided(ns, gate.namespaces[ns], options) for ns in importable]
        if importable and all(decided_all):
            sections += [d for d in decided_all if d is not None]
        else:
            to_measure.append((None, options.model))
    total = len(to_measure) * (4 if options.activation_checkpointing else 2)  # runs, each counted once
    with Progress(not options.as_json, total) as progress:
        for namespace, label in to_measure:
            sections.append(_measured(options, workdir, progress, namespace, label))
    order = {name: index for index, name in enumerate(TRAINER_NAMESPACES)}
    return sorted(sections, key=lambda section: order.get(section.namespace, len(order)))
