"""The demo-Transformer benchmark (``benchmarks/demo_transformer.py``) at its small size, on CPU.

It runs against the Lightning folders the nox sessions fill (``.matrix/mixed-2.4.0`` and
``.matrix/lightning-2.6.6``, which ``nox`` fills before the default session runs this test) and is
skipped where either is missing. Every expectation is derived from the benchmark's own runs: no byte
count is written down here. Six child processes, each importing torch and Lightning (training is
under a second of it): about 25 s on 2 idle cores, 50 s on 2 cores shared with another job.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
from conftest import ROOT, run_command

SCRIPT = ROOT / "benchmarks" / "demo_transformer.py"
FOLDERS = {"2.4": ROOT / ".matrix" / "mixed-2.4.0", "2.6": ROOT / ".matrix" / "lightning-2.6.6"}
BYTES = ("param_bytes", "grad_bytes", "optimizer_state_bytes")
STEPS = 3


def lightning_folder(line: str) -> Path:
    folder = FOLDERS[line]
    if not list(folder.glob(f"lightning-{line}.*.dist-info")):
        pytest.skip(f"needs lightning {line}.x installed in {folder} (pip install --no-deps --target {folder} ...)")
    return folder


@pytest.mark.release_independent
def test_demo_transformer_small(tmp_path: Path) -> None:
    folders = {line: lightning_folder(line) for line in FOLDERS}
    out = tmp_path / "demo.json"
    command = [sys.executable, str(SCRIPT), "--size", "small", "--steps", str(STEPS), "--json", str(out)]
    command += ["--lightning-2.4", str(folders["2.4"]), "--lightning-2.6", str(folders["2.6"])]
    run_command(command, check=True)
    runs = {key: run["ranks"][0] for key, run in json.loads(out.read_text())["runs"].items()}

    for suffix in ("", "-ckpt"):
        off, on, fixed = runs[f"2.4-off{suffix}"], runs[f"2.4-on{suffix}"], runs[f"2.6-off{suffix}"]
        assert off["lightning"].startswith("2.4.") and on["lightning"] == off["lightning"]
        assert fixed["lightning"].startswith("2.6.")
        # 2.4.0 without the shim keeps the float32 model: twice the bytes of the shim's run.
        assert off["flat_param_dtypes"] == ["torch.float32"]
        for key in BYTES:
            assert off[key] == 2 * on[key] > 0, key
        # The shim gives what Lightning's own fix gives.
        for key in ("flat_param_dtypes", "module_dtype", *BYTES):
            assert on[key] == fixed[key], key
        assert not off["shim"]["imported"] and not fixed["shim"]["imported"]
        assert on["shim"]["patched"]

    for run in ("2.4-off", "2.4-on", "2.6-off"):
        plain, checkpointed = runs[run], runs[f"{run}-ckpt"]
        assert checkpointed["checkpointed_layers"] > 0 == plain["checkpointed_layers"], run
        for key in ("flat_param_dtypes", "module_dtype", *BYTES, "losses"):
            assert checkpointed[key] == plain[key], (run, key)  # the demo's blocks give every tensor a dtype

    for key, result in runs.items():
        assert len(result["losses"]) == STEPS and all(math.isfinite(loss) for loss in result["losses"]), key
