"""Running one probe process: its command line, its time limit, and leaving none of its processes behind.

Every step of verify (reading the installed Lightning, each training run) is a probe, a fresh
interpreter started from ``_fsdp_shim/children/verify_probe.py`` by its path (so nothing from the
current folder runs in it) with a ``records.ProbeRequest`` as JSON. It writes its findings to files,
never to stdout: ``gate.json``, one ``<out>.rank<N>.json`` per rank, or ``<out>.rank<N>.error.json``
when the user's code raised or was unusable, which ends verify (:class:`Stop`) with the user's
traceback or the usage message.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from _fsdp_shim.verify.records import GateResult, Options, ProbeRequest, RankResult, to_json

PROBE_SCRIPT = Path(__file__).resolve().parent.parent / "children" / "verify_probe.py"
GATE_STEP = "reading the installed Lightning"


class Stop(Exception):
    """End verify with ``code`` and ``message`` (the user's code raised, or a usage problem)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


def run_probe(request: ProbeRequest, shim: str, step: str) -> str:
    """Run one probe in a session of its own and leave none of its processes behind; ``""``, or why
    it failed. Only a probe for modules the user named gets a folder (``--model-path``, by default the
    current one). The probe and every process it starts (the ranks Lightning's launcher starts, their
    workers) share one process group, which is killed whatever happens: after the probe ends, past
    ``--timeout``, on Ctrl-C (the terminal's SIGINT reaches only verify's own group), and when verify
    itself fails. A rank that hangs in a collective survives SIGTERM, hence SIGKILL.
    """
    options = request.options
    folder = (
        (options.model_path or os.getcwd())
        if options.model or options.datamodule or options.activation_checkpointing
        else None
    )
    command = [
        sys.executable,
        str(PROBE_SCRIPT),
        to_json(replace(request, options=replace(options, model_path=folder))),
    ]
    env = dict(os.environ, FSDP_SHIM=shim, PYTHONWARNINGS="ignore")
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        _, stderr = proc.communicate(timeout=options.timeout)
    except subprocess.TimeoutExpired:
        raise Stop(
            1,
            f"fsdp-shim verify: {step} did not finish within {options.timeout:g} s, so verify stopped it and every "
            "process it started; --timeout SECONDS allows longer",
        ) from None
    except KeyboardInterrupt:
        raise Stop(130, f"fsdp-shim verify: interrupted while {step}; every process it started was stopped") from None
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
            raise Stop(2, f"fsdp-shim verify: {record['message']}")
        raise Stop(
            1,
            f"{record['traceback'].rstrip()}\n\nfsdp-shim verify: your code raised while {record['phase']} "
            f"(shim {'off' if shim == '0' else 'on'}); the traceback above is from your model, not from fsdp-shim.",
        )
    return (
        ""
        if proc.returncode == 0
        else f"failed (exit {proc.returncode}): {(stderr.strip().splitlines() or ['(no output)'])[-1]}"
    )


def run_gate(options: Options, workdir: Path) -> tuple[GateResult, str]:
    """The gate probe's findings, or an error when the probe itself failed."""
    out = workdir / "gate.json"
    failed = run_probe(ProbeRequest("gate", str(out), options), "1", GATE_STEP)
    if failed or not out.exists():
        return GateResult(), f"{GATE_STEP} {failed or 'wrote nothing'}"
    return GateResult.read(out.read_text()), ""


def run_measure(
    options: Options, workdir: Path, namespace: str | None, shim: str, step: str, ac: bool
) -> tuple[list[RankResult], str]:
    """One training run with ``FSDP_SHIM=shim`` (``ac``: with activation checkpointing): every rank's
    result, sorted by rank, or an error (with whatever results were written) when the run failed or a
    rank wrote none. A checkpointed run that raised ends on the first rank that wrote so: enough."""
    out = workdir / f"{namespace or 'model'}-shim{shim}{'-ac' if ac else ''}"
    failed = run_probe(ProbeRequest("measure", str(out), options, namespace, ac), shim, step)
    results = [RankResult(**json.loads(p.read_text())) for p in workdir.glob(f"{out.name}.rank*.json")]
    if failed or (len(results) != options.devices and not any(result.error for result in results)):
        return results, f"the run with FSDP_SHIM={shim} {failed or 'wrote no result on some rank'}"
    return sorted(results, key=lambda result: result.rank), ""
