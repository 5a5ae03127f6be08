"""The recompute fix, with real Lightning, FSDP and DDP (gloo, CPU): a run with activation checkpointing equals the
same run without it, bit for bit: the loss and the gradients of every step and every rank's final parameters.

Every expectation is another run of ``tests/scenarios/recompute.py`` (the same case without checkpointing, or
without the shim). The whole matrix runs on the releases of ``PROOF_RELEASES`` on wrapt 2; one rank in
``bf16-true`` on every other release and on wrapt 1; and on every release, the bug without the shim, so that a
Lightning release that fixes it fails its session here.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import wrapt
from conftest import DTYPES, NAMESPACES, ROOT, Layout, clean_env, free_port, run_on_a_free_port, scenario_results
from packaging.version import Version

SCRIPT = ROOT / "tests" / "scenarios" / "recompute.py"
BLOCKS = ("ones", "scalar", "mask", "castback")
MODES = ("policy", "nonreentrant", "reentrant")
EXTRA_CASES = ["ones:composable", "mask:composable", "probe:none", "probe:nonreentrant", "probe:reentrant"]
EXTRA_CASES += ["ones:loss-none", "ones:loss-nonreentrant", "ones:loss-reentrant"]
"""FSDP2's composable checkpoint on a block of each failure (a dtype mismatch, a ``CheckpointError``), the probe, and
a loss checkpointed in the training step: under Fabric outside the model's forward, in float32, as its recompute."""
PROOF_RELEASES = {(2, 1, 4), (2, 4, 0), (2, 6, 6)}
"""Where the whole matrix runs: the first release line, the last affected by the cast, and the newest."""
BUG = ("CheckpointError", "RuntimeError")
"""What torch raises when a recompute's tensors do not match the forward's."""


def run_with_output(
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
    direct_backward: bool = False,
    logging_setup: str = "none",
) -> tuple[dict[int, dict[str, Any]], str]:
    """One scenario run (Lightning's launcher starts the other ranks): every rank's results, and what they printed."""
    out = tmp_path / f"{api}-{strategy}-{devices}-{precision}-{shim}-{len(list(tmp_path.iterdir()))}"
    arguments = ["--api", api, "--strategy", strategy, "--devices", str(devices), "--precision", precision]
    arguments += ["--shim", shim, "--package", package, "--cases", ",".join(cases), "--out", str(out)]
    arguments += [*(["--direct-backward"] if direct_backward else []), "--logging", logging_setup]

    def attempt(retry: bool) -> tuple[list[str], dict[str, str]]:  # every attempt draws its port anew
        variables = {"PYTHONWARNINGS": "ignore", **(env or {}), "MASTER_PORT": str(free_port())}
        return [sys.executable, str(SCRIPT), *arguments], clean_env(**variables)

    proc, command = run_on_a_free_port(attempt)
    assert proc.returncode == 0, f"{command}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return scenario_results(out, devices), proc.stdout + proc.stderr


def confirmations(output: str) -> list[str]:
    """The shim's confirmation lines in a run's output (``fsdp-shim 0.2.0: active; recompute acted (...)``)."""
    return [line for line in output.splitlines() if line.startswith("fsdp-shim ") and ": active; " in line]


def recompute_acted(dtype: str) -> str:
    return f"; recompute acted (a checkpointed block recomputed in {dtype}, its forward's dtype, not float32)"


def first_fix_acted(layout: Layout, api: str, dtype: str) -> str:
    """How the confirmation line ends: the cast's before Lightning 2.5.0 (it acts before the first forward), else
    the recompute's (at the first checkpointed backward)."""
    version = layout.version(api)
    if Version(version) >= Version("2.5.0rc0"):
        return recompute_acted(dtype)
    namespace = NAMESPACES[layout.package][api == "fabric"]
    return f"; cast acted ({namespace} {version}: the model cast to {dtype} before FSDP wraps it)"


def trainer_layout(layouts: dict[str, Layout]) -> Layout:
    """The layout the session's Lightning is checked on: the unified package where it is installed."""
    if not layouts:
        pytest.skip("needs an installed Lightning")
    layout = layouts.get("lightning") or layouts["standalone"]
    if Version(layout.trainer_version) < Version("2.1.0"):
        pytest.skip(f"Lightning {layout.trainer_version} has no 'true' precisions for FSDP")
    return layout


def in_proof_release(layout: Layout) -> bool:
    """On wrapt 1 (its own session, next to the same release on wrapt 2) only the one-rank ``bf16-true`` run, which
    trains through the wrappers, depends on wrapt: the rest of the matrix runs on wrapt 2."""
    release = Version(layout.trainer_version).release
    return (*release, 0, 0)[:3] in PROOF_RELEASES and int(wrapt.__version__.split(".")[0]) >= 2


def assert_like_the_run_without_checkpointing(results: dict[int, dict[str, Any]], cases: list[str]) -> None:
    for rank, by_case in results.items():
        assert by_case["_shim"]["active"] is True
        for case in cases:
            assert by_case[case]["error"] is None, (rank, case, by_case[case].get("traceback"))
            block, mode = case.split(":")
            reference = by_case[f"{block}:{'loss-none' if mode.startswith('loss-') else 'none'}"]
            for key in ("losses", "gradients", "params"):
                assert by_case[case][key] == reference[key], (rank, case, key)


@pytest.mark.per_release
@pytest.mark.parametrize(("devices", "precision"), [(1, "bf16-true"), (2, "bf16-true"), (1, "16-true")])
@pytest.mark.parametrize("api", ["trainer", "fabric"])
def test_fsdp_with_checkpointing_equals_fsdp_without(
    api: str, devices: int, precision: str, layouts: dict[str, Layout], tmp_path: Path
) -> None:
    """Lightning's ``activation_checkpointing_policy``, the user's ``torch.utils.checkpoint`` reentrant and not, the
    composable checkpoint and a checkpointed loss, each block its own FSDP unit; only each recompute runs in its
    forward's dtype (an ``autograd.Function``'s backward in float32, as Lightning leaves it). One line, from rank 0."""
    layout = trainer_layout(layouts)
    if not in_proof_release(layout) and (devices, precision) != (1, "bf16-true"):
        pytest.skip(f"the whole matrix runs on {sorted(PROOF_RELEASES)}; this release runs one rank in bf16-true")
    cases = [f"{block}:{mode}" for block in BLOCKS for mode in ("none", *MODES)] + EXTRA_CASES
    results, output = run_with_output(
        tmp_path, api, cases, devices=devices, precision=precision, package=layout.package
    )
    assert_like_the_run_without_checkpointing(results, cases)
    assert len({by_case["ones:none"]["params"] for by_case in results.values()}) == devices  # each rank its shard
    for by_case in results.values():
        forwards = len(by_case["probe:none"]["block_dtypes"])
        for mode, runs in (("none", 1), ("nonreentrant", 2), ("reentrant", 2)):  # a forward, and its recompute
            assert by_case[f"probe:{mode}"]["block_dtypes"] == [DTYPES[precision]] * runs * forwards, mode
            assert set(by_case[f"probe:{mode}"]["backward_dtypes"]) == {"torch.float32"}, mode
    (line,) = confirmations(output)
    assert line.endswith(first_fix_acted(layout, api, DTYPES[precision].removeprefix("torch."))), line


@pytest.mark.per_release
@pytest.mark.parametrize(
    ("api", "strategy", "devices", "precision", "direct_backward"),
    [
        ("trainer", "single", 1, "bf16-true", False),
        ("manual", "single", 1, "bf16-true", False),
        ("fabric", "ddp", 2, "bf16-true", False),
        ("fabric", "single", 1, "64-true", False),
        ("fabric", "single", 1, "bf16-true", True),
    ],
)
def test_the_other_true_precision_plugins_and_backwards_get_the_same_fix(
    api: str, strategy: str, devices: int, precision: str, direct_backward: bool, layouts: dict, tmp_path: Path
) -> None:
    """The fix sits in torch's checkpoint: ``HalfPrecision`` (one device, DDP), ``DoublePrecision`` and Fabric's
    ``loss.backward()`` recompute in the forward's dtype too; ``manual_backward``, already inside the forward's
    context, is left as it is, silently. (DDP with reentrant checkpointing is torch's own restriction: not run.)"""
    layout = trainer_layout(layouts)
    if not in_proof_release(layout):
        pytest.skip(f"runs on {sorted(PROOF_RELEASES)}")
    modes = ("nonreentrant",) if strategy == "ddp" else ("nonreentrant", "reentrant")
    cases = [f"{block}:{mode}" for block in BLOCKS for mode in ("none", *modes)]
    options = {"strategy": strategy, "devices": devices, "precision": precision, "package": layout.package}
    on, output = run_with_output(tmp_path, api, cases, direct_backward=direct_backward, **options)
    assert_like_the_run_without_checkpointing(on, cases)
    if api == "manual":  # the run without the shim trains the same, and the shim says nothing
        off = run_with_output(tmp_path, api, cases, shim="off", **options)[0]
        assert {c: off[0][c]["params"] for c in cases} == {c: on[0][c]["params"] for c in cases}
        assert confirmations(output) == [], output[-3000:]
    else:  # one line, from rank zero, whatever the number of ranks and recomputes
        dtype = "float64" if precision == "64-true" else "bfloat16"
        assert [line[-len(recompute_acted(dtype)) :] for line in confirmations(output)] == [recompute_acted(dtype)]


@pytest.mark.per_release
@pytest.mark.parametrize("api", ["trainer", "fabric"])
def test_without_the_shim_every_release_recomputes_in_float32(
    api: str, layouts: dict[str, Layout], tmp_path: Path
) -> None:
    """The bug, on the session's release as shipped (so the gate stays honest): ``CheckpointError`` on every
    non-reentrant path, a silent difference on the reentrant one. A release that fixes it fails here."""
    layout = trainer_layout(layouts)
    raising = ["ones:policy", "ones:nonreentrant", "mask:policy", "ones:composable"]
    cases = ["probe:nonreentrant", "ones:none", *raising, "castback:none", "castback:reentrant"]
    off = run_with_output(tmp_path, api, cases, package=layout.package, shim="off")[0][0]
    fixed_upstream = (
        f"Lightning {off['_lightning']['version']} recomputes in the forward's dtype itself: set RECOMPUTE.fixed_in "
        "in _fsdp_shim/config.py to its release, and keep the shim off that release"
    )
    assert off["_shim"]["active"] is False
    assert set(off["probe:nonreentrant"]["block_dtypes"]) == {"torch.bfloat16", "torch.float32"}, fixed_upstream
    for case in raising:
        assert (off[case]["error"] or "").startswith(BUG), (case, off[case], fixed_upstream)
    assert off["castback:reentrant"]["error"] is None
    # silently differs: in the gradients (in bfloat16 parameters, 3 small steps can round that away)
    assert off["castback:reentrant"]["gradients"] != off["castback:none"]["gradients"], fixed_upstream


TRANSFORMERS_FOLDER = os.environ.get("FSDP_SHIM_TEST_TRANSFORMERS")
"""Where the matrix installs transformers, apart from Lightning (see tests/scenarios/recompute.py)."""


@pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None and not TRANSFORMERS_FOLDER,
    reason="needs transformers, installed or in FSDP_SHIM_TEST_TRANSFORMERS (nox does that)",
)
@pytest.mark.parametrize("devices", [1, 2])
def test_a_hugging_face_llama_with_checkpointing_equals_it_without(
    devices: int, layouts: dict[str, Layout], tmp_path: Path
) -> None:
    """``activation_checkpointing_policy={LlamaDecoderLayer}`` and Hugging Face's own gradient
    checkpointing, under the shim: the same losses and parameters as without checkpointing."""
    layout = trainer_layout(layouts)
    cases = ["llama:none", "llama:policy", "llama:nonreentrant"]
    env = {"FSDP_SHIM_TEST_TRANSFORMERS": TRANSFORMERS_FOLDER} if TRANSFORMERS_FOLDER else None  # clean_env drops it
    results = run_with_output(tmp_path, "trainer", cases, devices=devices, package=layout.package, env=env)[0]
    assert_like_the_run_without_checkpointing(results, cases)
