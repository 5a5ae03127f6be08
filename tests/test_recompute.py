"""The recompute fix, with real Lightning, FSDP and DDP (gloo, CPU): a run with activation checkpointing
equals the same run without it, bit for bit: the loss of every step and every rank's final parameters.

The runs are ``tests/scenarios/recompute.py``'s; every expectation is another run of it (the same
case without checkpointing, or without the shim). Each block makes a tensor without an explicit dtype,
so a recompute outside the forward's dtype context differs from the forward.

Where it runs: the whole matrix of issue 25 (Trainer and Fabric, 1 and 2 ranks, ``bf16-true`` and
``16-true``, every block and checkpointing mode) on the releases of ``PROOF_RELEASES``; one rank in
``bf16-true`` on every other release; and on every release, the bug without the shim, so that the day
a Lightning release runs the backward in the forward's dtype itself, its session fails here and names
the gate to bound.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, Layout, clean_env, free_port, run_on_a_free_port, scenario_results

from _fsdp_shim.config import RECOMPUTE, base_release

SCRIPT = ROOT / "tests" / "scenarios" / "recompute.py"
BLOCKS = ("ones", "scalar", "mask", "castback")
MODES = ("policy", "nonreentrant", "reentrant")
"""Each compared with the same block without checkpointing (``none``)."""
PROOF_RELEASES = {(2, 1, 4), (2, 4, 0), (2, 6, 6)}
"""Where the whole matrix runs (issue 25, item 4): the first release line, the last affected by the cast,
and the newest."""
BUG = ("CheckpointError", "RuntimeError")
"""What torch raises when a recompute's tensors do not match the forward's."""


def run(
    tmp_path: Path,
    api: str,
    cases: list[str],
    *,
    strategy: str = "fsdp",
    devices: int = 1,
    precision: str = "bf16-true",
    shim: str = "on",
    package: str = "lightning",
    env: dict[str, str] | None = None,
) -> dict[int, dict[str, Any]]:
    """One scenario run (Lightning's own launcher starts the other ranks); every rank's results."""
    out = tmp_path / f"{api}-{strategy}-{devices}-{precision}-{shim}-{len(list(tmp_path.iterdir()))}"
    arguments = ["--api", api, "--strategy", strategy, "--devices", str(devices), "--precision", precision]
    arguments += ["--shim", shim, "--package", package, "--cases", ",".join(cases), "--out", str(out)]

    def attempt(retry: bool) -> tuple[list[str], dict[str, str]]:  # every attempt draws its port anew
        return [sys.executable, str(SCRIPT), *arguments], clean_env(
            PYTHONWARNINGS="ignore", MASTER_PORT=str(free_port()), **(env or {})
        )

    proc, command = run_on_a_free_port(attempt)
    assert proc.returncode == 0, f"{command}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return scenario_results(out, devices)


def trainer_layout(layouts: dict[str, Layout]) -> Layout:
    """The layout the session's Lightning is checked on: the unified package where it is installed."""
    if not layouts:
        pytest.skip("needs an installed Lightning")
    layout = layouts.get("lightning") or layouts["standalone"]
    if not RECOMPUTE.affects(layout.trainer_version):
        pytest.skip(f"Lightning {layout.trainer_version} has no 'true' precisions for FSDP")
    return layout


def in_proof_release(layout: Layout) -> bool:
    return base_release(layout.trainer_version) in PROOF_RELEASES


def assert_like_the_run_without_checkpointing(results: dict[int, dict[str, Any]], cases: list[str]) -> None:
    for rank, by_case in results.items():
        assert by_case["_shim"]["active"] is True
        for case in cases:
            assert by_case[case]["error"] is None, (rank, case, by_case[case].get("traceback"))
            block, _ = case.split(":")
            reference = by_case[f"{block}:none"]
            assert by_case[case]["losses"] == reference["losses"], (rank, case)
            assert by_case[case]["params"] == reference["params"], (rank, case)


@pytest.mark.per_release
@pytest.mark.parametrize("precision", ["bf16-true", "16-true"])
@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize("api", ["trainer", "fabric"])
def test_fsdp_with_checkpointing_equals_fsdp_without(
    api: str, devices: int, precision: str, layouts: dict[str, Layout], tmp_path: Path
) -> None:
    """Lightning's ``activation_checkpointing_policy`` and the user's own ``torch.utils.checkpoint``,
    reentrant and not, for every block (each block is its own FSDP unit: ``auto_wrap_policy``)."""
    layout = trainer_layout(layouts)
    if not in_proof_release(layout) and (devices, precision) != (1, "bf16-true"):
        pytest.skip(f"the whole matrix runs on {sorted(PROOF_RELEASES)}; this release runs one rank in bf16-true")
    cases = [f"{block}:{mode}" for block in BLOCKS for mode in ("none", *MODES)]
    results = run(tmp_path, api, cases, devices=devices, precision=precision, package=layout.package)
    assert_like_the_run_without_checkpointing(results, cases)
    assert len({by_case["ones:none"]["params"] for by_case in results.values()}) == devices  # each rank its shard


@pytest.mark.per_release
@pytest.mark.parametrize(
    ("api", "strategy", "devices"),
    [
        ("trainer", "single", 1),
        ("manual", "single", 1),
        ("fabric", "single", 1),
        ("trainer", "ddp", 2),
        ("fabric", "ddp", 2),
    ],
)
def test_the_half_precision_plugin_gets_the_same_fix(
    api: str, strategy: str, devices: int, layouts: dict[str, Layout], tmp_path: Path
) -> None:
    """``HalfPrecision``, the "true"-precision plugin of one device and of DDP, has the same gap and gets
    the same wrapper. (DDP with reentrant checkpointing is torch's own restriction: not run.)"""
    layout = trainer_layout(layouts)
    if not in_proof_release(layout):
        pytest.skip(f"runs on {sorted(PROOF_RELEASES)}")
    modes = ("nonreentrant",) if strategy == "ddp" else ("nonreentrant", "reentrant")
    cases = [f"{block}:{mode}" for block in BLOCKS for mode in ("none", *modes)]
    on = run(tmp_path, api, cases, strategy=strategy, devices=devices, package=layout.package)
    assert_like_the_run_without_checkpointing(on, cases)
    if api == "manual":
        # manual_backward runs inside training_step, so inside the forward's context already: the
        # shim changes nothing there, which the run without it shows.
        off = run(tmp_path, api, cases, strategy=strategy, devices=devices, package=layout.package, shim="off")
        assert {c: off[0][c]["params"] for c in cases} == {c: on[0][c]["params"] for c in cases}


@pytest.mark.per_release
@pytest.mark.parametrize("api", ["trainer", "fabric"])
def test_without_the_shim_every_release_recomputes_in_float32(
    api: str, layouts: dict[str, Layout], tmp_path: Path
) -> None:
    """The bug, on the session's release as shipped: so the gate stays honest. When a Lightning release
    fixes it, this fails there and says which bound to set."""
    layout = trainer_layout(layouts)
    cases = [
        "probe:none",
        "ones:none",
        "ones:policy",
        "ones:nonreentrant",
        "mask:policy",
        "castback:none",
        "castback:reentrant",
    ]
    off = run(tmp_path, api, cases, package=layout.package, shim="off")[0]
    version = off["_lightning"]["version"]
    assert off["_shim"]["active"] is False
    fixed_upstream = (
        f"Lightning {version} recomputes in the forward's dtype itself: set RECOMPUTE.first_fixed in "
        "_fsdp_shim/config.py to its release, and keep the shim off that release"
    )
    assert set(off["probe:none"]["backward_dtypes"]) == {"torch.float32"}, fixed_upstream
    for case in ("ones:policy", "ones:nonreentrant", "mask:policy"):
        assert (off[case]["error"] or "").startswith(BUG), (case, off[case], fixed_upstream)
    assert off["castback:reentrant"]["error"] is None
    assert off["castback:reentrant"]["params"] != off["castback:none"]["params"], fixed_upstream  # silently differs


def test_switching_the_fix_off_brings_the_bug_back_and_leaves_the_cast(
    layouts: dict[str, Layout], tmp_path: Path
) -> None:
    """``FSDP_SHIM_DISABLED_FIXES=recompute`` switches this fix off alone."""
    layout = trainer_layout(layouts)
    cases = ["probe:none", "ones:policy"]
    off = run(tmp_path, "trainer", cases, package=layout.package, env={"FSDP_SHIM_DISABLED_FIXES": "recompute"})[0]
    assert off["_shim"]["active"] is True
    assert set(off["probe:none"]["backward_dtypes"]) == {"torch.float32"}
    assert off["ones:policy"]["error"].startswith(BUG)
    on = run(tmp_path, "trainer", cases, package=layout.package)[0]
    assert set(on["probe:none"]["backward_dtypes"]) == {"torch.bfloat16"}
    assert on["ones:policy"]["error"] is None


@pytest.mark.parametrize(("precision", "backward_dtype"), [("16-true", "torch.float16"), ("32-true", "torch.float32")])
def test_only_the_true_half_precisions_change_the_backwards_dtype(
    precision: str, backward_dtype: str, layouts: dict[str, Layout], tmp_path: Path
) -> None:
    """The backward runs in the forward's default dtype for "16-true" too; "32-true" is left as it is
    (so is every "*-mixed" precision: the wrapper passes it through untouched)."""
    layout = trainer_layout(layouts)
    result = run(tmp_path, "trainer", ["probe:none"], precision=precision, package=layout.package)[0]
    assert set(result["probe:none"]["backward_dtypes"]) == {backward_dtype}


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
@pytest.mark.parametrize("devices", [1, 2])
def test_a_hugging_face_llama_with_checkpointing_equals_it_without(
    devices: int, layouts: dict[str, Layout], tmp_path: Path
) -> None:
    """``activation_checkpointing_policy={LlamaDecoderLayer}`` and Hugging Face's own gradient
    checkpointing, under the shim: the same losses and parameters as without checkpointing."""
    layout = trainer_layout(layouts)
    cases = ["llama:none", "llama:policy", "llama:nonreentrant"]
    assert_like_the_run_without_checkpointing(
        run(tmp_path, "trainer", cases, devices=devices, package=layout.package), cases
    )


def test_the_scenario_reports_an_error_instead_of_passing_silently(layouts: dict[str, Layout], tmp_path: Path) -> None:
    """The comparisons above can fail: a case that raises is reported as such (and a run with an
    unknown block raises)."""
    trainer_layout(layouts)
    result = run(tmp_path, "trainer", ["nosuchblock:none"])[0]
    assert result["nosuchblock:none"]["error"] == "ValueError: nosuchblock"
    with pytest.raises(AssertionError):
        assert_like_the_run_without_checkpointing({0: result}, ["nosuchblock:none"])
