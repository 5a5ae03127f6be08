"""What verify checks and in which order: read the installed Lightning once, decide from the gates
what needs no training, train the rest with the shim off and on.

It never answers for the wrong package: every installed namespace is checked, one that fails to
import is a FAILED verdict naming the cause, and a release that already has the fix is "not needed"
straight from the gates, without training (``--measure`` trains anyway).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from _fsdp_shim.config import CAST, TRAINER_NAMESPACES, base_release
from _fsdp_shim.distributions import describe_import_failure, installed_packages
from _fsdp_shim.verify.options import Options
from _fsdp_shim.verify.progress import Progress
from _fsdp_shim.verify.protocol import GATE_STEP, run_gate, run_measure
from _fsdp_shim.verify.results import NamespaceGate, RankResult
from _fsdp_shim.verify.verdict import Section, judge


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


def _not_measured(namespace: str, info: NamespaceGate, options: Options) -> Section | None:
    """A section decided from the gates alone, or ``None`` when the namespace must be measured."""
    if info.import_failure is not None:
        return Section(namespace, None, "FAILED", describe_import_failure(namespace, info.import_failure))
    version = info.version
    release = base_release(version)
    if release is not None and release < CAST.first_affected:
        return Section(namespace, version, "not needed", CAST.unaffected_reason(version))
    if not info.affected and not options.measure:
        reason = f"{CAST.unaffected_reason(version)}; nothing was trained (--measure trains anyway)"
        return Section(namespace, version, "not needed", reason)
    return None


def _measured(options: Options, workdir: Path, progress: Progress, namespace: str | None, label: str) -> Section:
    runs: dict[str, list[RankResult]] = {}
    for shim, state in (("0", "off"), ("1", "on")):
        step = f"{label}: training with the shim {state}"
        progress.phase(step)
        results, error = run_measure(options, workdir, namespace, shim, step)
        if error:
            return Section(namespace or "model", None, "FAILED", error, runs.get("0"), results or None)
        runs[shim] = results
    on = runs["1"][0]
    verdict, reason = judge(runs["0"], runs["1"], options.precision, seed_model=options.model is None)
    return Section(on.namespace, on.lightning, verdict, reason, runs["0"], runs["1"])


def verify(options: Options, workdir: Path) -> list[Section]:
    """Every section, in the order of ``TRAINER_NAMESPACES`` (the user's model last); probes write
    their files in ``workdir``."""
    with Progress(not options.as_json, total=0) as progress:
        progress.phase(GATE_STEP)
        gate, error = run_gate(options, workdir)
    if error:
        return [Section("Lightning", None, "FAILED", error)]
    sections: list[Section] = []
    to_measure: list[tuple[str | None, str]] = []
    for namespace, info in gate.namespaces.items():
        if options.model is not None and info.import_failure is None:
            continue  # with --model, the model's own namespace is judged below; a broken one is still reported
        decided = _not_measured(namespace, info, options)
        if decided is not None:
            sections.append(decided)
        else:
            to_measure.append((namespace, f"{namespace} {info.version}"))
    if options.model is not None:
        importable = [ns for ns in gate.model_namespaces if gate.importable(ns)]
        decided_all = [_not_measured(ns, gate.namespaces[ns], options) for ns in importable]
        if importable and all(decided_all):
            sections += [d for d in decided_all if d is not None]
        else:
            to_measure.append((None, options.model))
    with Progress(not options.as_json, total=2 * len(to_measure)) as progress:
        for namespace, label in to_measure:
            sections.append(_measured(options, workdir, progress, namespace, label))
    order = {name: index for index, name in enumerate(TRAINER_NAMESPACES)}
    return sorted(sections, key=lambda section: order.get(section.namespace, len(order)))
