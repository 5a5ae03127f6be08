"""The fix offered to torch (docs/upstream.md): docs/upstream/checkpoint-default-dtype.patch, applied to a copy
of torch's ``torch.utils.checkpoint`` that only the tests' children import (tests/patched_checkpoint), fixes
the recompute on its own, with the shim's recompute fix off, and changes nothing else.

* the project's recompute cases (tests/scenarios/recompute.py: every block and checkpoint path, Lightning's
  policy included, in ``bf16-true`` and ``16-true``) train as they do without checkpointing, bit for bit;
* torch's checkpoint alone (tests/children/checkpoint_behaviours.py: both reentrant modes, nested,
  selective, without early stop, ``checkpoint_sequential``, ``debug``, RNG preserved or not): in float32
  the same as torch's own, bit for bit; in bfloat16 and float16 the same as without checkpointing, where
  torch's own fails or recomputes in float32;
* the test written for torch (docs/upstream/test_checkpoint_default_dtype.py) passes on the patched copy,
  and each of its tests fails on torch's own.

Where it runs: the torch session the patch applies to (2.15.0, whose checkpoint it was written against:
``per_release``); a torch it does not apply to refuses the patched copy by name (the default session's).
"""

from __future__ import annotations

import re
import sys
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    DTYPES,
    ROOT,
    UPSTREAM_PATCH_PROBLEM,
    Layout,
    child_json,
    clean_env,
    needs_patched_checkpoint,
    patched_checkpoint_env,
    run_command,
    verify,
)
from test_recompute import BLOCKS, assert_like_the_run_without_checkpointing, run_with_output, trainer_layout

PATCH = ROOT / "docs" / "upstream" / "checkpoint-default-dtype.patch"
PAGE = ROOT / "docs" / "upstream.md"
TORCH_STYLE_TEST = ROOT / "docs" / "upstream" / "test_checkpoint_default_dtype.py"
PATHS = ("policy", "nonreentrant", "reentrant", "composable")
"""Every checkpoint path of the scenario, each compared with the same block without checkpointing."""
REFUSED = {
    "lightning-context-fn-debug": "ValueError: debug=True is incompatible with non-default context_fn",
    "lightning-context-fn-reentrant": "ValueError: Passing `context_fn`",
}
"""The behaviours' cases that torch refuses, patched or not: the Lightning-side ``context_fn`` with ``debug=True``
and with reentrant checkpointing."""


def test_the_page_shows_the_patch_as_it_is() -> None:
    """docs/upstream.md shows the patch file; its one line over 100 columns (the docs' limit) is broken
    there with a trailing backslash, its continuation indented: joined again, the block is the file."""
    page = PAGE.read_text()
    (block,) = re.findall(r"^```diff\n(.*?)^```$", page, flags=re.S | re.M)
    lines = block.splitlines()
    joined: list[str] = []
    for line in lines:
        if joined and joined[-1].endswith(" \\"):
            joined[-1] = joined[-1][:-1] + line[1:].lstrip()
        else:
            joined.append(line)
    assert "\n".join(joined) + "\n" == PATCH.read_text()


@pytest.mark.skipif(UPSTREAM_PATCH_PROBLEM is None, reason="the patch applies to this torch")
def test_a_torch_the_patch_does_not_apply_to_is_refused_by_name() -> None:
    """No child runs on torch's own checkpoint believing it patched: ``import torch`` fails, naming the release."""
    proc = run_command([sys.executable, "-c", "import torch"], env=patched_checkpoint_env())
    assert proc.returncode != 0
    refusal = f"PatchDoesNotApply: {PATCH.name} does not apply to torch {version('torch')} ("
    assert refusal in proc.stderr, proc.stderr[-3000:]


def unittest_counts(output: str) -> tuple[int, int]:
    """Tests run, and tests failed or in error, from the end of a ``unittest`` run's output."""
    ran = int(re.search(r"^Ran (\d+) tests? in ", output, flags=re.M).group(1))  # type: ignore[union-attr]
    failed = sum(int(n) for n in re.findall(r"(?:failures|errors)=(\d+)", output.splitlines()[-1]))
    return ran, failed


@pytest.mark.per_release
@needs_patched_checkpoint
def test_the_torch_style_test_passes_on_the_patched_checkpoint_and_fails_on_torchs_own() -> None:
    """Run as a torch developer runs it, outside CI: with ``CI`` set (as CI sets it), torch's ``run_tests``
    writes XML reports through ``xmlrunner``, a dependency of torch's own CI only."""
    command = [sys.executable, str(TORCH_STYLE_TEST)]
    patched = run_command(command, env=patched_checkpoint_env(PYTHONWARNINGS="ignore", CI=None))
    ran, failed = unittest_counts(patched.stderr)
    assert (patched.returncode, failed) == (0, 0) and ran >= 15, patched.stderr[-5000:]
    own = run_command(command, env=clean_env(PYTHONWARNINGS="ignore", CI=None))
    assert (own.returncode != 0, unittest_counts(own.stderr)) == (True, (ran, ran)), own.stderr[-5000:]


@pytest.mark.per_release
@needs_patched_checkpoint
@pytest.mark.parametrize(("precision", "recompute_fix"), [("bf16-true", "on"), ("16-true", "off")])
def test_the_patch_alone_fixes_the_projects_recompute_cases(
    precision: str, recompute_fix: str, layouts: dict[str, Layout], tmp_path: Path
) -> None:
    """Lightning's policy, ``checkpoint`` reentrant and not and the composable checkpoint, every block, with the
    shim's recompute fix off, or on, where it steps aside (it wraps nothing: its debug log names no wrapper, and
    no recompute acted line): each trains as without checkpointing, bit for bit; the probe's recomputes run in
    the precision's dtype, its ``autograd.Function`` backward in float32 as Lightning leaves it. Without the
    patch these cases raise or train differently (tests/test_recompute.py:
    ``test_without_the_shim_every_release_recomputes_in_float32``)."""
    layout = trainer_layout(layouts)
    cases = [f"{block}:{mode}" for block in (*BLOCKS, "probe") for mode in ("none", *PATHS)]
    env = {"PYTHONPATH": patched_checkpoint_env()["PYTHONPATH"], "FSDP_SHIM_LOG": "debug"}
    env.update({"FSDP_SHIM_DISABLED_FIXES": "recompute"} if recompute_fix == "off" else {})
    results, output = run_with_output(tmp_path, "trainer", cases, precision=precision, package=layout.package, env=env)
    assert "recompute (torch.utils.checkpoint" not in output, output[-3000:]
    assert "recompute acted" not in output, output[-3000:]
    if recompute_fix == "on":
        assert "recompute fix: not needed on torch" in output, output[-3000:]
    assert_like_the_run_without_checkpointing(results, cases)
    by_case = results[0]
    forwards = len(by_case["probe:none"]["block_dtypes"])
    for mode in PATHS:
        probe = by_case[f"probe:{mode}"]
        assert probe["block_dtypes"] == [DTYPES[precision]] * 2 * forwards, mode  # every recompute in it
        assert set(probe["backward_dtypes"]) == {"torch.float32"}, mode


@pytest.fixture(scope="module")
def behaviours() -> dict[str, dict[str, Any]]:
    """tests/children/checkpoint_behaviours.py on torch's own checkpoint and on the patched copy."""
    arguments = {"dtypes": ["float32", "bfloat16", "float16"]}
    return {
        "own": child_json("checkpoint_behaviours:behaviours", arguments, env=clean_env(PYTHONWARNINGS="ignore")),
        "patched": child_json(
            "checkpoint_behaviours:behaviours", arguments, env=patched_checkpoint_env(PYTHONWARNINGS="ignore")
        ),
    }


@pytest.mark.per_release
@needs_patched_checkpoint
def test_the_patch_changes_no_checkpoint_where_the_default_dtype_stays(behaviours: dict[str, Any]) -> None:
    """In float32 every way of checkpointing gives what torch's own gives, bit for bit: outputs,
    gradients, the dtypes seen, the RNG (dropout) preserved or not."""
    own, patched = behaviours["own"], behaviours["patched"]
    assert (own["patched"], patched["patched"]) == (False, True)
    assert own["torch"] == patched["torch"] and own["file"] != patched["file"]
    assert patched["results"]["float32"] == own["results"]["float32"]
    for name, case in own["results"]["float32"].items():
        assert (case["error"] or "").startswith(REFUSED.get(name, "")) and bool(case["error"]) == (name in REFUSED)
    assert len(patched["results"]["float32"]) >= 16


@pytest.mark.per_release
@needs_patched_checkpoint
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_patch_fixes_every_way_of_checkpointing_a_block(dtype: str, behaviours: dict[str, Any]) -> None:
    """With the forward under a bfloat16 or float16 default dtype and the backward outside it, each way of
    checkpointing recomputes in the forward's dtype and equals the run without checkpointing; torch's own
    recomputes each in float32 (raising ``CheckpointError`` where the non-reentrant check sees it)."""
    own, patched = behaviours["own"]["results"][dtype], behaviours["patched"]["results"][dtype]
    for name, case in patched.items():
        if name.startswith("lightning-"):
            continue
        assert case["error"] is None, (name, case)
        assert set(case["seen"]) == {f"torch.{dtype}"}, name
        assert case["default_dtype_after"] == "torch.float32", name
        reference = patched["rng-none" if name.startswith("rng-") else "none"]
        if name.startswith("rng-not-preserved"):
            assert case["grads"] != reference["grads"], name  # torch's rule: another dropout mask
        elif name not in ("none", "rng-none"):
            assert len(case["seen"]) > 1 and case["output"] == reference["output"], name
            assert case["grads"] == reference["grads"], name
            assert own[name]["error"] is not None or "torch.float32" in own[name]["seen"], (name, own[name])
    assert (own["none"], own["rng-none"]) == (patched["none"], patched["rng-none"])


@pytest.mark.per_release
@needs_patched_checkpoint
def test_the_lightning_side_alternative_fixes_its_policy_only_without_debug(behaviours: dict[str, Any]) -> None:
    """On torch's own checkpoint, the ``context_fn`` docs/upstream.md offers Lightning, passed through torch's
    ``checkpoint_wrapper`` as Lightning's policy wraps a block: the recompute in bfloat16, the run as without
    checkpointing; with ``debug=True`` and with reentrant checkpointing torch refuses it (its limits)."""
    own = behaviours["own"]["results"]["bfloat16"]
    case = own["lightning-context-fn"]
    assert case["error"] is None and case["seen"] == ["torch.bfloat16"] * 2, case
    assert case["default_dtype_after"] == "torch.float32"  # the backward's, put back after the recompute
    assert (case["output"], case["grads"]) == (own["none"]["output"], own["none"]["grads"])
    for name, refusal in REFUSED.items():
        assert (own[name]["error"] or "").startswith(refusal), own[name]


@pytest.mark.per_release
@needs_patched_checkpoint
def test_the_shim_steps_aside_where_torch_restores_the_dtype_itself(layouts: dict[str, Layout]) -> None:
    """With the patched copy and the shim on: every namespace says the recompute is not needed on this torch,
    the rank line names it torch's own, torch holds its own functions (decided from its code: no check that
    switches the dtype), torch's file reads as restoring every path, and a bfloat16 checkpointed backward,
    reentrant and not, recomputes in bfloat16 with no ``set_default_dtype`` call from the shim's code."""
    trainer_layout(layouts)
    packages = [name for name in ("lightning.pytorch", "pytorch_lightning") if _importable(name)]
    result = child_json("recompute_proof:stepped_aside", {"packages": packages}, env=patched_checkpoint_env())
    reason = (
        f"not needed on torch {result['torch']}: its checkpoint restores the forward's default dtype for every "
        "recompute itself; torch left untouched"
    )
    assert result["recompute"] and all(state == [False, reason] for state in result["recompute"].values()), result
    assert all(line.endswith("recompute (torch's own)") for line in result["rank_check"].values()), result
    assert "ShimWrapper" not in [*result["checkpoint"].values(), *result["composable"].values()], result
    assert result["read_from_file"] == ["composable", "non-reentrant", "reentrant"]
    assert result["set_by_the_shim"] == []
    assert result["grads"] == {"non-reentrant": "torch.bfloat16", "reentrant": "torch.bfloat16"}


def _importable(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:
        return False


@pytest.mark.per_release
@needs_patched_checkpoint
def test_verify_says_the_recompute_is_not_needed_on_a_torch_that_has_it(layouts: dict[str, Layout]) -> None:
    """``fsdp-shim verify`` with the patched copy: the seed model's checkpointed runs, shim off and on, equal
    the runs without checkpointing, and the recompute's verdict is "not needed", with the shim's reason."""
    import json

    layout = trainer_layout(layouts)
    package = "lightning" if layout.package == "lightning" else "pytorch_lightning"
    proc = verify("--package", package, "--steps", "1", "--json", env=patched_checkpoint_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (section,) = json.loads(proc.stdout)["sections"]
    recompute = next(entry for entry in section["fixes"] if entry["fix"] == "recompute")
    assert recompute["verdict"] == "not needed", recompute
    assert recompute["reason"].startswith("not needed on torch "), recompute
    assert "with the shim on and off" in recompute["reason"], recompute
