"""Checkpoints of the cast, real FSDP on 1 process, ``full`` and ``sharded`` state dicts: a resume keeps dtypes
and step; a float32 checkpoint saved without the shim resumes with it cast to bfloat16, each value exactly its
bfloat16 rounding; shim and fixed-release checkpoints load exactly on each other; a shim checkpoint resumes with
``FSDP_SHIM=0`` in float32, every value exact. Expectations come from the saving run's own numbers."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from children.classes import STATES
from conftest import ROOT, Layout, OncePerRun, clean_env, layout_or_skip, run_command

SCENARIO = ROOT / "tests" / "scenarios" / "checkpoint_resume.py"
TENSORS = ("params", "exp_avg", "exp_avg_sq")
KINDS = ("full", "sharded")


class Runs:
    """``tests/scenarios/checkpoint_resume.py`` runs, each once in the test run; a checkpoint is named by the
    package and shim state that saved it."""

    def __init__(self, folder: Path, once: OncePerRun) -> None:
        self.folder, self.once = folder, once

    def _run(self, mode: str, package: str, shim: str, names: list[str]) -> dict[str, Any]:
        def compute() -> dict[str, Any]:
            out = self.folder / f"{mode}-{package}-{shim}-{'+'.join(names)}.json"
            checkpoints = ",".join(str(self.folder / name) for name in names)
            command = [str(SCENARIO), mode, "--package", package, "--checkpoints", checkpoints, "--out", str(out)]
            env = clean_env(FSDP_SHIM=shim, PYTHONWARNINGS="ignore")
            run_command([sys.executable, *command], env=env, check=True)
            return json.loads(out.read_text())

        return self.once.get(json.dumps(["checkpoint_resume", str(self.folder), mode, package, shim, names]), compute)

    def saved(self, package: str, shim: str) -> dict[str, Any]:
        name = f"{package}-shim{shim}"
        return self._run("save", package, shim, [name])[name]

    def resumed(self, package: str, shim: str, *savers: tuple[str, str]) -> dict[str, dict[str, Any]]:
        for saver in savers:
            self.saved(*saver)
        return self._run("resume", package, shim, [f"{p}-shim{s}" for p, s in savers])


@pytest.fixture(scope="session")
def runs(tmp_path_factory: pytest.TempPathFactory, once_per_run: OncePerRun) -> Runs:
    shared = Path(tmp_path_factory.getbasetemp()).parent / "checkpoint-resume"
    shared.mkdir(exist_ok=True)
    return Runs(shared, once_per_run)


@pytest.fixture(scope="module")
def mixed(layouts: dict[str, Layout]) -> None:
    lightning, standalone = layouts.get("lightning"), layouts.get("standalone")
    if not (lightning and standalone and STATES[lightning.trainer_version][0] == "patched"):
        pytest.skip("needs an affected `lightning` next to a fixed `pytorch_lightning`")
    if STATES[standalone.trainer_version][0] != "built in":
        pytest.skip("needs a fixed `pytorch_lightning`")


def values(report: dict[str, Any], key: str) -> list[float]:
    return report[key]["values"]


@pytest.mark.per_release
@pytest.mark.parametrize("package", ["lightning", "standalone"])
def test_a_resume_keeps_dtypes_and_step(package: str, layouts: dict[str, Layout], runs: Runs) -> None:
    layout = layout_or_skip(layouts, package)
    if STATES[layout.trainer_version][0] == "not affected":
        pytest.skip("no 'true' precisions for FSDP before Lightning 2.1")
    before = runs.saved(package, "1")
    after = runs.resumed(package, "1", (package, "1"))[f"{package}-shim1"]
    for kind in KINDS:
        assert before[kind]["global_step"] == after[kind]["global_step"] == 2, kind
        assert before[kind]["module_dtype"] == after[kind]["module_dtype"] == "torch.bfloat16", kind
        for key in TENSORS:
            assert before[kind][key] == after[kind][key], (kind, key)
            assert after[kind][key]["dtype"] == "torch.bfloat16", (kind, key)


@pytest.mark.usefixtures("mixed")
def test_a_float32_checkpoint_resumes_with_the_shim_cast_down_to_bf16(runs: Runs) -> None:
    import torch

    saved = runs.saved("lightning", "0")
    resumed = runs.resumed("lightning", "1", ("lightning", "0"), ("standalone", "1"))["lightning-shim0"]
    for kind in KINDS:
        before, after = saved[kind], resumed[kind]
        assert after["global_step"] == before["global_step"]
        assert (before["module_dtype"], after["module_dtype"]) == ("torch.float32", "torch.bfloat16")
        for key in TENSORS:
            assert (before[key]["dtype"], after[key]["dtype"]) == ("torch.float32", "torch.bfloat16"), key
            rounded = torch.tensor(values(before, key), dtype=torch.float32).bfloat16().double().tolist()
            assert values(after, key) == rounded, key
        largest = max(abs(a - b) for a, b in zip(values(after, "params"), values(before, "params")))
        assert 0 < largest < 2e-3  # rounded, not lost: what the docs quote as "about 1e-3"


@pytest.mark.usefixtures("mixed")
@pytest.mark.parametrize(("saver", "loader"), [("lightning", "standalone"), ("standalone", "lightning")])
def test_shim_and_fixed_release_checkpoints_load_exactly_on_each_other(saver: str, loader: str, runs: Runs) -> None:
    saved = runs.saved(saver, "1")
    others = {"lightning": [("lightning", "0"), ("standalone", "1")], "standalone": [("lightning", "1")]}[loader]
    resumed = runs.resumed(loader, "1", *others)[f"{saver}-shim1"]
    for kind in KINDS:
        before, after = saved[kind], resumed[kind]
        assert before["lightning"] != after["lightning"]  # 2.4.0 with the shim <-> 2.5+ as shipped
        assert after["global_step"] == before["global_step"]
        for key in TENSORS:
            assert before[key]["dtype"] == after[key]["dtype"] == "torch.bfloat16", key
            assert values(after, key) == values(before, key), key


@pytest.mark.usefixtures("mixed")
def test_a_shim_checkpoint_resumes_with_the_shim_off_in_float32(runs: Runs) -> None:
    saved = runs.saved("lightning", "1")
    resumed = runs.resumed("lightning", "0", ("lightning", "1"))["lightning-shim1"]
    for kind in KINDS:
        assert resumed[kind]["module_dtype"] == "torch.float32"
        for key in TENSORS:
            assert resumed[kind][key]["dtype"] == "torch.float32", key
            assert values(resumed[kind], key) == values(saved[kind], key), key  # bfloat16 -> float32 is exact
