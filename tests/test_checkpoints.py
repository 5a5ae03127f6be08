"""Turning the shim on mid-training, 1 process, ``full`` and ``sharded`` state dicts:

* a float32 checkpoint saved without the shim resumes with it: parameters and Adam's moments are cast
  down to bfloat16, each value exactly its bfloat16 rounding;
* a checkpoint saved with the shim loads exactly on the fixed Lightning, and the other way round;
* a checkpoint saved with the shim resumes with ``FSDP_SHIM=0`` in float32, every value exact.

Every expectation comes from the saving run's own numbers (tests/scenarios/checkpoint_resume.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, Layout, clean_env, is_fixed_release

from _fsdp_shim.config import CAST

SCENARIO = ROOT / "tests" / "scenarios" / "checkpoint_resume.py"
TENSORS = ("params", "exp_avg", "exp_avg_sq")
STATE_DICT_TYPES = ["full", "sharded"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory, layouts: dict[str, Layout]) -> Path:
    lightning, standalone = layouts.get("lightning"), layouts.get("standalone")
    if not (lightning and standalone and CAST.affects(lightning.trainer_version)):
        pytest.skip("needs an affected `lightning` next to a fixed `pytorch_lightning`")
    if not is_fixed_release(standalone.trainer_version):
        pytest.skip("needs a fixed `pytorch_lightning`")
    return tmp_path_factory.mktemp("checkpoints")


@cache
def _run(workdir: Path, mode: str, package: str, shim: str, state_dict_type: str, checkpoint: str) -> dict[str, Any]:
    out = workdir / f"{mode}-{package}-{shim}-{state_dict_type}-{Path(checkpoint).name}.json"
    command = [sys.executable, str(SCENARIO), mode, "--package", package, "--state-dict-type", state_dict_type]
    command += ["--checkpoint", checkpoint, "--out", str(out)]
    proc = subprocess.run(
        command,
        capture_output=True,
        text=True,
        env=clean_env(FSDP_SHIM=shim, PYTHONWARNINGS="ignore"),
        cwd=ROOT,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def saved(workdir: Path, package: str, shim: str, state_dict_type: str) -> tuple[str, dict[str, Any]]:
    checkpoint = str(workdir / f"{package}-shim{shim}-{state_dict_type}.ckpt")
    return checkpoint, _run(workdir, "save", package, shim, state_dict_type, checkpoint)


def resumed(workdir: Path, checkpoint: str, package: str, shim: str, state_dict_type: str) -> dict[str, Any]:
    return _run(workdir, "resume", package, shim, state_dict_type, checkpoint)


def values(report: dict[str, Any], key: str) -> list[float]:
    return report[key]["values"]


def bf16_rounding(values_: list[float]) -> list[float]:
    import torch

    return torch.tensor(values_, dtype=torch.float32).bfloat16().double().tolist()


@pytest.mark.parametrize("state_dict_type", STATE_DICT_TYPES)
def test_a_float32_checkpoint_resumes_with_the_shim_cast_down_to_bf16(workdir: Path, state_dict_type: str) -> None:
    checkpoint, before = saved(workdir, "lightning", "0", state_dict_type)
    after = resumed(workdir, checkpoint, "lightning", "1", state_dict_type)
    assert after["global_step"] == before["global_step"]
    assert (before["module_dtype"], after["module_dtype"]) == ("torch.float32", "torch.bfloat16")
    for key in TENSORS:
        assert (before[key]["dtype"], after[key]["dtype"]) == ("torch.float32", "torch.bfloat16"), key
        assert values(after, key) == bf16_rounding(values(before, key)), key
    largest = max(abs(a - b) for a, b in zip(values(after, "params"), values(before, "params")))
    assert 0 < largest < 2e-3  # rounded, not lost: what the docs quote as "about 1e-3"


@pytest.mark.parametrize("state_dict_type", STATE_DICT_TYPES)
@pytest.mark.parametrize(("saver", "loader"), [("lightning", "standalone"), ("standalone", "lightning")])
def test_shim_and_fixed_release_checkpoints_load_exactly_on_each_other(
    workdir: Path, state_dict_type: str, saver: str, loader: str
) -> None:
    checkpoint, before = saved(workdir, saver, "1", state_dict_type)
    after = resumed(workdir, checkpoint, loader, "1", state_dict_type)
    assert before["lightning"] != after["lightning"]  # 2.4.0 with the shim <-> 2.5+ as shipped
    assert after["global_step"] == before["global_step"]
    for key in TENSORS:
        assert before[key]["dtype"] == after[key]["dtype"] == "torch.bfloat16", key
        assert values(after, key) == values(before, key), key


@pytest.mark.parametrize("state_dict_type", STATE_DICT_TYPES)
def test_a_shim_checkpoint_resumes_with_the_shim_off_in_float32(workdir: Path, state_dict_type: str) -> None:
    checkpoint, before = saved(workdir, "lightning", "1", state_dict_type)
    after = resumed(workdir, checkpoint, "lightning", "0", state_dict_type)
    assert after["module_dtype"] == "torch.float32"
    for key in TENSORS:
        assert after[key]["dtype"] == "torch.float32", key
        assert values(after, key) == values(before, key), key  # bfloat16 -> float32 is exact
