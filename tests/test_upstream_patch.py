"""The fix offered to torch (docs/upstream.md): docs/upstream/checkpoint-default-dtype.patch, applied to a copy of
torch's ``torch.utils.checkpoint`` that only the tests' children import (tests/patched_checkpoint), fixes the
recompute on its own and changes nothing else; the shim steps aside on such a torch. These run in the torch session
the patch applies to (2.15.0: ``per_release``); a torch it does not apply to refuses the copy by name.
"""

from __future__ import annotations

import json
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
    code_json,
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
    shim's recompute fix off, or on, where it steps aside (that it wraps nothing there:
    ``test_the_shim_steps_aside_where_torch_restores_the_dtype_itself``): each trains as without checkpointing, bit
    for bit; the probe's recomputes run in the precision's dtype, its ``autograd.Function`` backward in float32 as
    Lightning leaves it. Without the patch these cases raise or train differently (tests/test_recompute.py:
    ``test_without_the_shim_every_release_recomputes_in_float32``)."""
    layout = trainer_layout(layouts)
    cases = [f"{block}:{mode}" for block in (*BLOCKS, "probe") for mode in ("none", *PATHS)]
    env = {"PYTHONPATH": patched_checkpoint_env()["PYTHONPATH"]}
    env.update({"FSDP_SHIM_DISABLED_FIXES": "recompute"} if recompute_fix == "off" else {})
    results, _ = run_with_output(tmp_path, "trainer", cases, precision=precision, package=layout.package, env=env)
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
def test_the_patch_changes_nothing_where_the_dtype_stays_and_fixes_every_way_of_checkpointing(
    behaviours: dict[str, Any],
) -> None:
    """In float32 every way of checkpointing gives what torch's own gives, bit for bit: outputs, gradients, the
    dtypes seen, the RNG (dropout) preserved or not. With the forward under a bfloat16 or float16 default dtype and
    the backward outside it, each recomputes in the forward's dtype and equals the run without checkpointing, where
    torch's own recomputes in float32 (raising ``CheckpointError`` where the non-reentrant check sees it)."""
    own, patched = behaviours["own"], behaviours["patched"]
    assert (own["patched"], patched["patched"]) == (False, True)
    assert own["torch"] == patched["torch"] and own["file"] != patched["file"]
    assert patched["results"]["float32"] == own["results"]["float32"]
    for name, case in own["results"]["float32"].items():
        assert (case["error"] or "").startswith(REFUSED.get(name, "")) and bool(case["error"]) == (name in REFUSED)
    assert len(patched["results"]["float32"]) >= 16
    for dtype in ("bfloat16", "float16"):
        mine, fixed = own["results"][dtype], patched["results"][dtype]
        for name, case in fixed.items():
            if name.startswith("lightning-"):
                continue
            assert case["error"] is None, (dtype, name, case)
            assert set(case["seen"]) == {f"torch.{dtype}"}, (dtype, name)
            assert case["default_dtype_after"] == "torch.float32", (dtype, name)
            reference = fixed["rng-none" if name.startswith("rng-") else "none"]
            if name.startswith("rng-not-preserved"):
                assert case["grads"] != reference["grads"], name  # torch's rule: another dropout mask
            elif name not in ("none", "rng-none"):
                assert len(case["seen"]) > 1 and case["output"] == reference["output"], (dtype, name)
                assert case["grads"] == reference["grads"], (dtype, name)
                assert mine[name]["error"] is not None or "torch.float32" in mine[name]["seen"], (dtype, name)
        assert (mine["none"], mine["rng-none"]) == (fixed["none"], fixed["rng-none"])


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


STEPPED_ASIDE = """
import importlib, importlib.util, json, sys
from pathlib import Path
import torch
import fsdp_shim
from _fsdp_shim import rank_check
from _fsdp_shim.config import RECOMPUTE
from _fsdp_shim.status import environment_report
from _fsdp_shim.status import reading
from children.recompute_proof import COMPOSABLE, held, recompute_grads
packages = {"lightning.pytorch": "lightning", "pytorch_lightning": "pytorch_lightning"}
namespaces = [name for name, package in packages.items() if importlib.util.find_spec(package)]
for name in namespaces:
    importlib.import_module(name)
shim_code = str(Path(fsdp_shim.__file__).resolve().parents[1] / "_fsdp_shim")
by_shim, original = [], torch.set_default_dtype

def watched(dtype):  # every torch.set_default_dtype call the shim's own code makes
    if sys._getframe(1).f_code.co_filename.startswith(shim_code):
        by_shim.append(str(dtype))
    original(dtype)

torch.set_default_dtype = watched
grads = recompute_grads()
torch.set_default_dtype = original
print(json.dumps({
    "states": {name: reading(name, RECOMPUTE).state.value for name in namespaces},
    "rank_check": {name: rank_check.decide(name, torch.bfloat16)["fixes"]["recompute"] for name in namespaces},
    "held": [*held().values(), *held(COMPOSABLE).values()],
    "still_needed": environment_report()["still_needed"]["recompute"]["needed"],
    "set_by_the_shim": by_shim,
    "grads": grads,
}))
"""


@pytest.mark.per_release
@needs_patched_checkpoint
def test_the_shim_steps_aside_where_torch_restores_the_dtype_itself(layouts: dict[str, Layout]) -> None:
    """With the patched copy and the shim on: the recompute is "torch has it" in every namespace, the rank check
    names it torch's own, ``fsdp-shim status`` says it is not needed, torch holds its own functions (decided from
    its code: no check that switches the dtype), and a bfloat16 checkpointed backward, reentrant and not,
    recomputes in bfloat16 with no ``set_default_dtype`` call from the shim's code."""
    trainer_layout(layouts)
    result = code_json(STEPPED_ASIDE, env=patched_checkpoint_env())
    assert result["states"] and set(result["states"].values()) == {"torch has it"}, result
    assert list(result["rank_check"].values()) == [{"by": "torch", "except": []}] * len(result["states"]), result
    assert "ShimWrapper" not in result["held"], result
    assert (result["still_needed"], result["set_by_the_shim"]) == (False, []), result
    assert result["grads"] == {"non-reentrant": "torch.bfloat16", "reentrant": "torch.bfloat16"}


@pytest.mark.per_release
@needs_patched_checkpoint
def test_verify_says_the_recompute_is_not_needed_on_a_torch_that_has_it(layouts: dict[str, Layout]) -> None:
    """``fsdp-shim verify`` with the patched copy: the seed model's checkpointed runs, shim off and on, equal the
    runs without checkpointing, and the recompute's verdict is "not needed"."""
    layout = trainer_layout(layouts)
    package = "lightning" if layout.package == "lightning" else "pytorch_lightning"
    proc = verify("--package", package, "--steps", "1", "--json", env=patched_checkpoint_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (section,) = json.loads(proc.stdout)["sections"]
    recompute = next(entry for entry in section["fixes"] if entry["fix"] == "recompute")
    assert recompute["verdict"] == "not needed", recompute
    assert "with the shim on and off" in recompute["reason"], recompute


RESTORING = """
import contextlib
import torch


@contextlib.contextmanager
def _default_dtype_context(dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class CheckpointFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run_function, preserve_rng_state, *args):
        ctx.default_dtype = torch.get_default_dtype()
        return run_function(*args)

    @staticmethod
    def backward(ctx, *args):
        with _default_dtype_context(ctx.default_dtype):
            return ctx.run_function(*args)


def _checkpoint_without_reentrant_generator_impl(fn, args, kwargs):
    default_dtype = torch.get_default_dtype()

    def recompute_fn(*inputs):
        with _default_dtype_context(default_dtype):
            fn(*inputs)

    yield
"""
"""The patch's shape: the forward reads the default dtype, the recompute sets it through a module helper."""


def test_whether_a_path_restores_the_dtype_is_read_from_torchs_code() -> None:
    """Each path on its own: restored where its forward reads the dtype and its recompute sets it (through the
    module's helper); not where the forward does not read it, so the shim keeps its pin for that path alone.
    Compiled, never run."""
    from types import CodeType

    from _fsdp_shim.recompute_check import restores

    def paths(source: str) -> list[str]:
        module = compile(source, "checkpoint.py", "exec")
        code = {c.co_name: c for c in module.co_consts if isinstance(c, CodeType)}
        methods = {c.co_name: c for c in code["CheckpointFunction"].co_consts if isinstance(c, CodeType)}
        helpers = {"_default_dtype_context": code["_default_dtype_context"]}
        generator = code["_checkpoint_without_reentrant_generator_impl"]
        found = ["reentrant"] if restores(methods["forward"], methods["backward"], helpers) else []
        return found + (["non-reentrant"] if restores(generator, None, helpers) else [])

    assert paths(RESTORING) == ["reentrant", "non-reentrant"]
    not_captured = RESTORING.replace("    default_dtype = torch.get_default_dtype()\n", "    default_dtype = None\n")
    assert paths(not_captured) == ["reentrant"]
    assert paths(RESTORING.replace("ctx.default_dtype = torch.get_default_dtype()", "ctx.default_dtype = 0")) == [
        "non-reentrant"
    ]
    assert paths(RESTORING.replace("set_default_dtype", "manual_seed")) == []  # the helper sets nothing
