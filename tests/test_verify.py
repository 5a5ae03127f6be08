"""``fsdp-shim verify`` end to end, in fresh processes, on whatever Lightning this session holds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, Layout, clean_env

from fsdp_shim.versions import base_release, is_affected_release


def verify(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fsdp_shim", "verify", *args],
        capture_output=True,
        text=True,
        env=env or clean_env(),
        cwd=ROOT,
        timeout=600,
    )


def trainer_version(layouts: dict[str, Layout]) -> str:
    for package in ("lightning", "standalone"):  # the probe prefers lightning.pytorch
        if package in layouts:
            return layouts[package].trainer_version
    pytest.skip("no Lightning installed")


@pytest.mark.parametrize("precision", ["bf16-true", pytest.param("16-true", marks=pytest.mark.release_independent)])
def test_verify_gives_the_verdict_this_release_deserves(precision: str, layouts: dict[str, Layout]) -> None:
    version = trainer_version(layouts)
    proc = verify("--precision", precision, "--json")
    report = json.loads(proc.stdout)
    if is_affected_release(version):
        assert proc.returncode == 0, proc.stderr
        assert report["verdict"] == "fixed", report["reason"]
        off, on = report["shim_off"][0], report["shim_on"][0]
        want = {"bf16-true": "torch.bfloat16", "16-true": "torch.float16"}[precision]
        assert (off["module_dtype"], on["module_dtype"]) == ("torch.float32", want)
        assert off["flat_param_dtypes"] == sorted([want, "torch.float32"]) and on["flat_param_dtypes"] == [want]
        # Two equal models, one already half-precision, one loaded in float32 (twice the bytes):
        # unpatched 1 + 2 = 3 units, patched 1 + 1 = 2.
        for key in ("param_bytes", "grad_bytes", "optimizer_state_bytes"):
            assert on[key] * 3 == off[key] * 2, key
    else:
        assert proc.returncode == 0, proc.stderr
        assert report["verdict"] == "not needed"
        if base_release(version) >= (2, 5, 0):
            assert "already contains the fix" in report["reason"]
            assert report["shim_off"][0]["param_bytes"] == report["shim_on"][0]["param_bytes"]


@pytest.mark.release_independent
def test_verify_table_and_two_processes(layouts: dict[str, Layout]) -> None:
    version = trainer_version(layouts)
    if not is_affected_release(version):
        pytest.skip("the table's 'fixed' row needs an affected release")
    proc = verify("--devices", "2")
    assert proc.returncode == 0, proc.stderr
    assert "CPU check with gloo, 2 process(es)" in proc.stdout
    assert "verdict: fixed" in proc.stdout
    for row in (
        "LightningModule.dtype",
        "flat-parameter dtype",
        "sharded parameter bytes",
        "sharded gradient bytes",
        "optimizer-state bytes",
        "peak memory (peak RSS)",
    ):
        assert row in proc.stdout


@pytest.mark.release_independent
def test_verify_fails_clearly_without_lightning(tmp_path: Path) -> None:
    for name in ("lightning", "pytorch_lightning"):
        (tmp_path / f"{name}.py").write_text(f"raise ImportError('{name} is hidden for this test')\n")
    env = clean_env()
    env["PYTHONPATH"] = f"{tmp_path}:{env.get('PYTHONPATH', '')}"
    proc = verify(env=env)
    assert proc.returncode == 1
    assert "verdict: FAILED" in proc.stdout and "Lightning is not installed" in proc.stdout
