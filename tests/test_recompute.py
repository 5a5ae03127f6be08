"""The recompute fix, with real Lightning, FSDP and DDP (gloo, CPU): a run with activation checkpointing equals the
same run without it, bit for bit: the loss and the gradients of every step and every rank's final parameters.

The runs are ``tests/scenarios/recompute.py``'s; every expectation is another run of it (the same case without
checkpointing, or without the shim). Each block makes a tensor without an explicit dtype, so a recompute outside
the forward's dtype context differs from the forward. The whole matrix (Trainer and Fabric, 1 and 2 ranks in
``bf16-true``, one in ``16-true``, every block and checkpointing mode) runs on the releases of ``PROOF_RELEASES``
on wrapt 2; one rank in ``bf16-true`` on every other release and on wrapt 1; and on every release, the bug without
the shim, so that a Lightning release that fixes it fails its session here.
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
"""Each compared with the same block without checkpointing (``none``)."""
COMPOSABLE_CASES = ["ones:composable", "mask:composable"]
"""FSDP2's composable checkpoint, on one block of each kind of failure (a dtype mismatch and a
``CheckpointError``): it shares the non-reentrant generator with the other modes."""
PROOF_RELEASES = {(2, 1, 4), (2, 4, 0), (2, 6, 6)}
"""Where the whole matrix runs (issue 25, item 4): the first release line, the last affected by the cast,
and the newest."""
WITHOUT_RECOMPUTE_FIX = {"FSDP_SHIM_DISABLED_FIXES": "recompute"}
BUG = ("CheckpointError", "RuntimeError")
"""What torch raises when a recompute's tensors do not match the forward's."""


def run(tmp_path: Path, api: str, cases: list[str], **options: Any) -> dict[int, dict[str, Any]]:
    """One scenario run (Lightning's own launcher starts the other ranks); every rank's results."""
    return run_with_output(tmp_path, api, cases, **options)[0]


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
    """``run``, and what every rank printed (the ranks Lightning launches share its stderr)."""
    out = tmp_path / f"{api}-{strategy}-{devices}-{precision}-{shim}-{len(list(tmp_path.iterdir()))}"
    arguments = ["--api", api, "--strategy", strategy, "--devices", str(devices), "--precision", precision]
    arguments += ["--shim", shim, "--package", package, "--cases", ",".join(cases), "--out", str(out)]
    arguments += ["--direct-backward"] if direct_backward else []
    arguments += ["--logging", logging_setup]

    def attempt(retry: bool) -> tuple[list[str], dict[str, str]]:  # every attempt draws its port anew
        return [sys.executable, str(SCRIPT), *arguments], clean_env(
            **{"PYTHONWARNINGS": "ignore", **(env or {}), "MASTER_PORT": str(free_port())}
        )

    proc, command = run_on_a_free_port(attempt)
    assert proc.returncode == 0, f"{command}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return scenario_results(out, devices), proc.stdout + proc.stderr


def confirmations(output: str) -> list[str]:
    """The shim's confirmation lines in a run's output (``fsdp-shim 0.2.0: active; recompute acted (...)``)."""
    return [line for line in output.splitlines() if line.startswith("fsdp-shim ") and ": active; " in line]


def recompute_acted(dtype: str) -> str:
    return f"; recompute acted (a checkpointed block recomputed in {dtype}, its forward's dtype, not float32)"


def first_fix_acted(layout: Layout, api: str, dtype: str) -> str:
    """How the confirmation line ends: the cast's, before the first forward, where the release lacks it (before
    Lightning 2.5.0), else the recompute's, in the first checkpointed backward: what acted first, and nothing else."""
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
    """On wrapt 1 (its own session, next to the same release on wrapt 2) what depends on wrapt, training
    through the wrappers, is the one-rank ``bf16-true`` run: the rest of the matrix runs on wrapt 2."""
    release = Version(layout.trainer_version).release
    return (*release, 0, 0)[:3] in PROOF_RELEASES and int(wrapt.__version__.split(".")[0]) >= 2


def assert_like_the_run_without_checkpointing(results: dict[int, dict[str, Any]], cases: list[str]) -> None:
    for rank, by_case in results.items():
        assert by_case["_shim"]["active"] is True
        for case in cases:
            assert by_case[case]["error"] is None, (rank, case, by_case[case].get("traceback"))
            block, mode = case.split(":")
            reference = by_case[f"{block}:{'loss-none' if mode.startswith('loss-') else 'none'}"]
            assert by_case[case]["losses"] == reference["losses"], (rank, case)
            assert by_case[case]["gradients"] == reference["gradients"], (rank, case)
            assert by_case[case]["params"] == reference["params"], (rank, case)


@pytest.mark.per_release
@pytest.mark.parametrize(("devices", "precision"), [(1, "bf16-true"), (2, "bf16-true"), (1, "16-true")])
@pytest.mark.parametrize("api", ["trainer", "fabric"])
def test_fsdp_with_checkpointing_equals_fsdp_without(
    api: str, devices: int, precision: str, layouts: dict[str, Layout], tmp_path: Path
) -> None:
    """Lightning's ``activation_checkpointing_policy`` and the user's own ``torch.utils.checkpoint``,
    reentrant and not, for every block, and the composable checkpoint (each block is its own FSDP unit:
    ``auto_wrap_policy``). Two ranks in ``bf16-true``; ``16-true`` on one (its dtype is what differs)."""
    layout = trainer_layout(layouts)
    if not in_proof_release(layout) and (devices, precision) != (1, "bf16-true"):
        pytest.skip(f"the whole matrix runs on {sorted(PROOF_RELEASES)}; this release runs one rank in bf16-true")
    cases = [f"{block}:{mode}" for block in BLOCKS for mode in ("none", *MODES)] + COMPOSABLE_CASES
    options = {"devices": devices, "precision": precision, "package": layout.package}
    results, output = run_with_output(tmp_path, api, cases, **options)
    assert_like_the_run_without_checkpointing(results, cases)
    assert len({by_case["ones:none"]["params"] for by_case in results.values()}) == devices  # each rank its shard
    # One line for the job, from rank zero, naming the first fix that acted.
    (line,) = confirmations(output)
    assert line.endswith(first_fix_acted(layout, api, DTYPES[precision].removeprefix("torch."))), line


@pytest.mark.per_release
@pytest.mark.parametrize(
    ("api", "strategy", "devices"),
    [("trainer", "single", 1), ("manual", "single", 1), ("fabric", "ddp", 2)],
)
def test_the_half_precision_plugin_gets_the_same_fix(
    api: str, strategy: str, devices: int, layouts: dict[str, Layout], tmp_path: Path
) -> None:
    """``HalfPrecision``, the "true"-precision plugin of one device and of DDP, has the same gap and is
    covered by the same wrappers. (DDP with reentrant checkpointing is torch's own restriction: not run.)"""
    layout = trainer_layout(layouts)
    if not in_proof_release(layout):
        pytest.skip(f"runs on {sorted(PROOF_RELEASES)}")
    modes = ("nonreentrant",) if strategy == "ddp" else ("nonreentrant", "reentrant")
    cases = [f"{block}:{mode}" for block in BLOCKS for mode in ("none", *modes)]
    on, output = run_with_output(tmp_path, api, cases, strategy=strategy, devices=devices, package=layout.package)
    assert_like_the_run_without_checkpointing(on, cases)
    if api == "manual":
        # manual_backward runs inside training_step, so inside the forward's context already: the
        # shim changes nothing there, which the run without it shows, and says nothing.
        off = run(tmp_path, api, cases, strategy=strategy, devices=devices, package=layout.package, shim="off")
        assert {c: off[0][c]["params"] for c in cases} == {c: on[0][c]["params"] for c in cases}
        assert confirmations(output) == [], output[-3000:]
    else:  # one line, from rank zero, whatever the number of ranks and recomputes
        lines = confirmations(output)
        assert len(lines) == 1 and lines[0].endswith(recompute_acted("bfloat16")), output[-3000:]


@pytest.mark.per_release
@pytest.mark.parametrize("api", ["trainer", "fabric"])
def test_without_the_shim_every_release_recomputes_in_float32(
    api: str, layouts: dict[str, Layout], tmp_path: Path
) -> None:
    """The bug, on the session's release as shipped: so the gate stays honest. When a Lightning release
    fixes it, this fails there and says which bound to set."""
    layout = trainer_layout(layouts)
    cases = [
        "probe:nonreentrant",
        "ones:none",
        "ones:policy",
        "ones:nonreentrant",
        "mask:policy",
        "ones:composable",
        "castback:none",
        "castback:reentrant",
    ]
    off = run(tmp_path, api, cases, package=layout.package, shim="off")[0]
    version = off["_lightning"]["version"]
    assert off["_shim"]["active"] is False
    fixed_upstream = (
        f"Lightning {version} recomputes in the forward's dtype itself: set RECOMPUTE.fixed_in in "
        "_fsdp_shim/config.py to its release, and keep the shim off that release"
    )
    # the blocks' forwards in bfloat16, their recomputes in float32
    assert set(off["probe:nonreentrant"]["block_dtypes"]) == {"torch.bfloat16", "torch.float32"}, fixed_upstream
    for case in ("ones:policy", "ones:nonreentrant", "mask:policy", "ones:composable"):
        assert (off[case]["error"] or "").startswith(BUG), (case, off[case], fixed_upstream)
    assert off["castback:reentrant"]["error"] is None
    # silently differs: in the gradients (in bfloat16 parameters, 3 small steps can round that away)
    assert off["castback:reentrant"]["gradients"] != off["castback:none"]["gradients"], fixed_upstream


@pytest.mark.parametrize(("precision", "dtype"), [("16-true", "torch.float16"), ("32-true", "torch.float32")])
def test_a_recompute_runs_in_its_forwards_dtype_and_switching_the_fix_off_brings_the_bug_back(
    precision: str, dtype: str, layouts: dict[str, Layout], tmp_path: Path
) -> None:
    """Every recompute runs in its forward's dtype (in "32-true" both are float32); the backward of an
    ``autograd.Function`` that makes a tensor without a dtype runs in float32 as Lightning leaves it; a run
    without checkpointing is the same with ``FSDP_SHIM_DISABLED_FIXES=recompute``, which switches this fix off
    alone: the recompute in float32 again, the cast left on. A case that raises is reported, so comparing fails."""
    layout = trainer_layout(layouts)
    cases = ["probe:none", "probe:nonreentrant", "probe:reentrant"]
    results, output = run_with_output(tmp_path, "trainer", cases, precision=precision, package=layout.package)
    on = results[0]
    off_cases = ["probe:none", "probe:nonreentrant", "ones:policy", "nosuchblock:none"]
    off_results, off_output = run_with_output(
        tmp_path, "trainer", off_cases, precision=precision, package=layout.package, env=WITHOUT_RECOMPUTE_FIX
    )
    off = off_results[0]
    for case in cases:
        assert on[case]["error"] is None, on[case]
        assert set(on[case]["block_dtypes"]) == {dtype}, case
        assert set(on[case]["backward_dtypes"]) == {"torch.float32"}, case
    assert len(on["probe:nonreentrant"]["block_dtypes"]) == 2 * len(on["probe:none"]["block_dtypes"])  # recomputed
    assert (on["probe:none"]["losses"], on["probe:none"]["params"]) == (
        off["probe:none"]["losses"],
        off["probe:none"]["params"],
    )
    assert off["nosuchblock:none"]["error"] == "ValueError: nosuchblock"
    with pytest.raises(AssertionError):
        assert_like_the_run_without_checkpointing(off_results, ["nosuchblock:none"])
    if precision == "32-true":  # nothing to change: nothing said
        assert confirmations(output) == confirmations(off_output) == [], output[-3000:]
        assert off["ones:policy"]["error"] is None
        return
    assert set(off["probe:nonreentrant"]["block_dtypes"]) == {dtype, "torch.float32"}
    assert off["ones:policy"]["error"].startswith(BUG), off["ones:policy"]
    first = first_fix_acted(layout, "trainer", "float16")
    (line,) = confirmations(output)
    assert line.endswith(first), line
    assert confirmations(off_output) == ([line] if "; cast acted" in first else []), off_output[-3000:]


@pytest.mark.per_release
@pytest.mark.parametrize("api", ["trainer", "fabric"])
def test_a_checkpoint_outside_the_models_forward_recomputes_in_its_own_dtype(
    api: str, layouts: dict[str, Layout], tmp_path: Path
) -> None:
    """A loss checkpointed in the training step: under Fabric it runs outside the model's forward, in
    float32, and its recompute must too; under the Trainer the step is inside the forward's context."""
    layout = trainer_layout(layouts)
    if not in_proof_release(layout):
        pytest.skip(f"runs on {sorted(PROOF_RELEASES)}")
    cases = ["ones:loss-none", "ones:loss-nonreentrant", "ones:loss-reentrant"]
    assert_like_the_run_without_checkpointing(run(tmp_path, api, cases, package=layout.package), cases)


@pytest.mark.per_release
@pytest.mark.parametrize(("precision", "direct_backward"), [("64-true", False), ("bf16-true", True)])
def test_other_precisions_and_a_direct_backward_are_covered_too(
    precision: str, direct_backward: bool, layouts: dict[str, Layout], tmp_path: Path
) -> None:
    """The fix sits in torch's checkpoint, not in a precision plugin: ``"64-true"`` (Lightning's
    ``DoublePrecision``, the same gap in float64) and Fabric's ``loss.backward()`` (allowed on one
    device) recompute in the forward's dtype as well."""
    layout = trainer_layout(layouts)
    if not in_proof_release(layout):
        pytest.skip(f"runs on {sorted(PROOF_RELEASES)}")
    cases = [
        f"{block}:{mode}" for block in ("ones", "mask", "castback") for mode in ("none", "nonreentrant", "reentrant")
    ]
    on = run(
        tmp_path,
        "fabric",
        cases,
        strategy="single",
        precision=precision,
        package=layout.package,
        direct_backward=direct_backward,
    )
    assert_like_the_run_without_checkpointing(on, cases)


TRANSFORMERS_VARIABLE = "FSDP_SHIM_TEST_TRANSFORMERS"
TRANSFORMERS_FOLDER = os.environ.get(TRANSFORMERS_VARIABLE)
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
    env = {TRANSFORMERS_VARIABLE: TRANSFORMERS_FOLDER} if TRANSFORMERS_FOLDER else None  # clean_env drops it
    results = run(tmp_path, "trainer", cases, devices=devices, package=layout.package, env=env)
    assert_like_the_run_without_checkpointing(results, cases)
