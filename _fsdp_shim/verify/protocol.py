"""Running one probe process: its command line, its time limit, and leaving none of its processes behind.

Every step of verify (reading the installed Lightning, each training run) is a probe, a fresh
interpreter started from ``fsdp_shim/_children/verify_probe.py`` by its path (so nothing from the
current folder runs in it) with a :class:`~fsdp_shim.verify.options.ProbeRequest` as JSON. It
writes its findings to files, never to stdout: ``gate.json``, one ``<out>.rank<N>.json`` per rank, or
``<out>.rank<N>.error.json`` when the user's code raised or was unusable, which ends verify
(:class:`Stop`) with the user's traceback or the usage message.
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

from _fsdp_shim.verify.options import Options, ProbeRequest
from _fsdp_shim.verify.results import GateResult, RankResult

PROBE_SCRIPT = Path(__file__).resolve().parent.parent / "_children" / "verify_probe.py"
"""The probe's entry script, run by its path so nothing from the current folder runs in the probe;
Lightning's launcher re-runs it on every other rank."""

GATE_STEP = "reading the installed Lightning"


class Stop(Exception):
    """End verify with ``code`` and ``message`` (the user's code raised, or a usage problem)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def probe_command(mode: str, out: Path, options: Options, namespace: str | None = None) -> list[str]:
    """The probe's command line. With ``--model`` or ``--datamodule`` the user's modules are imported
    from ``--model-path``, by default the folder verify runs in; no other probe gets a folder."""
    user_code = options.model is not None or options.datamodule is not None
    options = replace(options, model_path=(options.model_path or os.getcwd()) if user_code else None)
    request = ProbeRequest(mode=mode, out=str(out), options=options, namespace=namespace)
    return [sys.executable, str(PROBE_SCRIPT), request.to_json()]


def run_probe(command: list[str], shim: str, out: Path, step: str, timeout: float) -> subprocess.CompletedProcess[str]:
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


def run_gate(options: Options, workdir: Path) -> tuple[GateResult, str]:
    """The gate probe's findings, or an error when the probe itself failed."""
    out = workdir / "gate.json"
    proc = run_probe(probe_command("gate", out, options), "1", out, GATE_STEP, options.timeout)
    if proc.returncode != 0 or not out.exists():
        return GateResult(), _failure(proc, "reading the installed Lightning")
    return GateResult.from_json(out.read_text()), ""


def run_measure(
    options: Options, workdir: Path, namespace: str | None, shim: str, step: str = "training"
) -> tuple[list[RankResult], str]:
    """One training run with ``FSDP_SHIM=shim``: every rank's result, sorted by rank, or an error
    (with whatever results were written) when the run failed or a rank wrote none."""
    out = workdir / f"{namespace or 'model'}-shim{shim}"
    proc = run_probe(probe_command("measure", out, options, namespace), shim, out, step, options.timeout)
    results = [RankResult.from_json(p.read_text()) for p in sorted(workdir.glob(f"{out.name}.rank*.json"))]
    if proc.returncode != 0 or len(results) != options.devices:
        return results, _failure(proc, f"the run with FSDP_SHIM={shim}")
    return sorted(results, key=lambda result: result.rank), ""
