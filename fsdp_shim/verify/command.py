"""``fsdp-shim verify``: run the probe with the shim off and on, compare, and give a verdict."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from fsdp_shim.versions import base_release, is_affected_release

DTYPES = {"bf16-true": "torch.bfloat16", "16-true": "torch.float16"}
ROWS = (
    ("Lightning", "lightning"),
    ("LightningModule.dtype", "module_dtype"),
    ("flat-parameter dtype", "flat_param_dtypes"),
    ("sharded parameter bytes", "param_bytes"),
    ("sharded gradient bytes", "grad_bytes"),
    ("optimizer-state bytes", "optimizer_state_bytes"),
    ("peak memory", "peak_memory_bytes"),
)


class Progress:
    """One status line on stderr that shows the phase and the seconds spent, while a child runs."""

    def __init__(self, enabled: bool) -> None:
        self._enabled = enabled
        self._label = ""
        self._start = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Progress:
        if self._enabled:
            self._thread = threading.Thread(target=self._draw, daemon=True)
            self._thread.start()
        return self

    def phase(self, label: str) -> None:
        self._label, self._start = label, time.monotonic()
        if not self._enabled:
            print(f"fsdp-shim verify: {label} ...", file=sys.stderr, flush=True)

    def _draw(self) -> None:
        frames = "|/-\\"
        tick = 0
        while not self._stop.wait(0.2):
            seconds = time.monotonic() - self._start
            sys.stderr.write(f"\r{frames[tick % 4]} {self._label} ({seconds:4.0f}s)   ")
            sys.stderr.flush()
            tick += 1

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            sys.stderr.write("\r" + " " * 70 + "\r")
            sys.stderr.flush()


def run_probe(shim: str, precision: str, devices: int, steps: int, workdir: Path) -> tuple[list[dict[str, Any]], str]:
    """Run one probe in a fresh interpreter; returns the per-rank reports and an error, if any."""
    out = workdir / f"shim-{shim}"
    env = dict(os.environ, FSDP_SHIM=shim, PYTHONWARNINGS="ignore")
    command = [
        sys.executable,
        "-m",
        "fsdp_shim.verify.probe",
        "--precision",
        precision,
        "--devices",
        str(devices),
        "--steps",
        str(steps),
        "--out",
        str(out),
    ]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    reports = [json.loads(p.read_text()) for p in sorted(workdir.glob(f"shim-{shim}.rank*.json"))]
    if proc.returncode != 0 or not reports:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return reports, f"the check with FSDP_SHIM={shim} failed (exit {proc.returncode}): {tail}"
    return reports, ""


def verdict(off: dict[str, Any], on: dict[str, Any], precision: str) -> tuple[str, str]:
    """("fixed" | "not needed" | "FAILED", reason)."""
    version = on["lightning"]
    if on.get("unsupported") or not is_affected_release(version):
        release = base_release(version)
        if release is not None and release >= (2, 5, 0):
            return "not needed", "this Lightning already contains the fix (Lightning #20323, 2.5.0)"
        return "not needed", f"Lightning {version} has no 'true' precisions for FSDP"
    want = DTYPES[precision]
    problems = []
    if not on["shim_patched"]:
        problems.append(f"the shim did not patch {on['namespace']}: {on['shim_reason']}")
    if on["module_dtype"] != want:
        problems.append(f"LightningModule.dtype is {on['module_dtype']}, expected {want}")
    if on["flat_param_dtypes"] != [want]:
        problems.append(f"flat parameters are {', '.join(on['flat_param_dtypes'])}, expected {want}")
    for key in ("param_bytes", "grad_bytes", "optimizer_state_bytes"):
        if on[key] >= off[key]:
            problems.append(f"{key.replace('_', ' ')} did not shrink ({off[key]} -> {on[key]})")
    if problems:
        return "FAILED", "; ".join(problems)
    saved = 1 - (on["param_bytes"] + on["grad_bytes"] + on["optimizer_state_bytes"]) / (
        off["param_bytes"] + off["grad_bytes"] + off["optimizer_state_bytes"]
    )
    return "fixed", f"sharded parameters, gradients and optimizer state are {saved:.0%} smaller on rank 0"


def _cell(key: str, value: Any) -> str:
    if key == "flat_param_dtypes":
        return ", ".join(v.removeprefix("torch.") for v in value)
    if key == "module_dtype":
        return str(value).removeprefix("torch.")
    if key == "peak_memory_bytes":
        return f"{value / 2**20:,.1f} MiB"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def render(off: dict[str, Any], on: dict[str, Any], result: str, reason: str, devices: int) -> str:
    where = (
        f"CUDA with NCCL, {devices} GPU(s)"
        if on["device"] == "cuda"
        else f"CPU check with gloo, {devices} process(es); GPU guards lifted in the check's own processes"
    )
    lines = [f"fsdp-shim verify: {where}. Figures are rank 0's.", ""]
    lines.append(f"{'':<32}{'shim off':>22}{'shim on':>22}")
    for label, key in ROWS:
        if key == "peak_memory_bytes":
            label = f"peak memory ({on['peak_memory_kind']})"
        lines.append(f"{label:<32}{_cell(key, off[key]):>22}{_cell(key, on[key]):>22}")
    lines += ["", f"verdict: {result}: {reason}"]
    return "\n".join(lines)


def main(precision: str = "bf16-true", devices: int = 1, steps: int = 3, as_json: bool = False) -> int:
    with (
        tempfile.TemporaryDirectory(prefix="fsdp-shim-verify-") as tmp,
        Progress(sys.stderr.isatty() and not as_json) as progress,
    ):
        results = {}
        for shim, label in (("0", "training with the shim off"), ("1", "training with the shim on")):
            progress.phase(label)
            reports, error = run_probe(shim, precision, devices, steps, Path(tmp))
            if error:
                result, reason = "FAILED", error
                break
            results[shim] = reports
        else:
            result, reason = verdict(results["0"][0], results["1"][0], precision)
    if as_json:
        print(
            json.dumps(
                {
                    "verdict": result,
                    "reason": reason,
                    "precision": precision,
                    "devices": devices,
                    "shim_off": results.get("0"),
                    "shim_on": results.get("1"),
                },
                indent=2,
            )
        )
    elif "0" in results and "1" in results and not results["1"][0].get("unsupported"):
        print(render(results["0"][0], results["1"][0], result, reason, devices))
    else:
        print(f"verdict: {result}: {reason}")
    return 1 if result == "FAILED" else 0
