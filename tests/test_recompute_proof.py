"""The recompute fix says it is in effect only where it has shown it on the torch in hand.

Its wrappers sit on private names of torch (``_fsdp_shim.fixes``: the reentrant ``CheckpointFunction.forward``,
the non-reentrant generator torch calls, the composable checkpoint's own reference), so each is a guess about
torch's call path; ``_fsdp_shim.recompute_check`` checks the guess at run time, per path, in a thread of its own
and without switching the default dtype. Here, on the session's torch: what is wrapped and shown; a torch whose
checkpoint calls other names (simulated: ``hide_checkpoint_internals``) is reported "not in effect" for that path
and left as it was there; a context at the import that fails a check switches nothing off; switching the fix off
in a running process takes it off; what the pins leave behind, whatever ends them and whatever another thread
does with the default dtype. The torch sessions of the matrix run the ``per_release`` ones on the newest and an
old torch.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from children.recompute_proof import CONTEXTS
from conftest import ROOT, Layout, an_affected_namespace, child_json, clean_env, fsdp_shim, installed_versions

from _fsdp_shim.config import CAST, RECOMPUTE, base_release

HIDE = "from children.recompute_proof import hide_checkpoint_internals; hide_checkpoint_internals()\n"
MOVED = "torch recomputed it without the shim's pinned function (its checkpoint calls other functions)"


def affected_trainer(layouts: dict[str, Layout]) -> str:
    """A Trainer namespace that lacks the recompute fix (skips where none is installed)."""
    return an_affected_namespace(layouts, "trainer", fix=RECOMPUTE.name)[0]


def torch_release() -> tuple[int, int, int]:
    import torch

    release = base_release(torch.__version__)
    assert release is not None
    return release


@pytest.mark.per_release
def test_every_checkpoint_path_of_this_torch_is_wrapped_and_shown(layouts: dict[str, Layout]) -> None:
    """The generator torch calls is the one wrapped (``_impl`` from torch 2.14, the old name before), in
    ``torch.utils.checkpoint`` and in the composable checkpoint's module; the check passes with the
    shim on and fails on the same torch once ``deactivate()`` put torch's own functions back."""
    result = child_json("recompute_proof:wrapped_and_shown", {"package": affected_trainer(layouts)})
    generator = result["generators"][0]
    assert generator == (
        "_checkpoint_without_reentrant_generator_impl"
        if torch_release() >= (2, 14, 0)
        else "_checkpoint_without_reentrant_generator"
    )
    assert result["checkpoint"] == {
        **{name: "ShimWrapper" for name in result["generators"][:1]},
        **{name: "function" for name in result["generators"][1:]},
        "CheckpointFunction.forward": "ShimWrapper",
    }
    assert result["composable"] == {generator: "ShimWrapper"}
    for status in result["status"].values():
        assert status["patched"] is True, status
        assert status["targets"] == [
            "torch.utils.checkpoint.CheckpointFunction.forward",
            f"torch.utils.checkpoint.{generator}",
            f"torch.distributed._composable.checkpoint_activation.{generator}",
        ]
    paths = ("reentrant", "non-reentrant", "composable")
    assert result["check_on"] == {path: [True, "", False] for path in paths}
    assert result["check_off"] == {path: [False, MOVED, True] for path in paths}
    assert result["checkpoint_off"]["CheckpointFunction.forward"] == "staticmethod"
    assert result["composable_off"] == {generator: "function"}


@pytest.mark.per_release
def test_a_torch_whose_checkpoint_calls_other_names_is_reported_not_in_effect_and_left_alone(
    layouts: dict[str, Layout],
) -> None:
    """Every namespace says "not in effect on torch X.Y" for the path torch no longer calls (the non-reentrant
    one: ``hide_checkpoint_internals`` moves only the module's functions) and in effect for the paths shown;
    one warning for all of them; torch holds its own generator again; the rank check names the path."""
    import torch

    packages = [name for name in ("lightning.pytorch", "lightning.fabric", "pytorch_lightning") if _importable(name)]
    affected_trainer(layouts)
    result = child_json("recompute_proof:moved_internals", {"packages": packages})
    where = f"not in effect on torch {torch.__version__}"
    shown = "in effect for the reentrant and composable checkpoints"
    expected = f"{where} for the non-reentrant checkpoint ({MOVED}); {shown}"
    assert result["status"], result
    for namespace, status in result["status"].items():
        assert (status["patched"], status["reason"]) == (False, expected), (namespace, status)
        assert result["rank_check"][namespace]["recompute"] == "fsdp-shim except the non-reentrant checkpoint"
    (warning,) = [w for w in result["warnings"] if "recompute" in w]
    assert warning == (
        f"fsdp-shim: the recompute fix is {where} for the non-reentrant checkpoint ({MOVED}); torch was left as "
        "it was there, so this fix is off for that checkpoint in this process"
    )
    generators = {name: kind for name, kind in result["checkpoint"].items() if name != "CheckpointFunction.forward"}
    assert set(generators.values()) == {"function"}, result["checkpoint"]
    assert result["checkpoint"]["CheckpointFunction.forward"] == "ShimWrapper"


def test_strict_mode_raises_where_the_recompute_is_not_in_effect(layouts: dict[str, Layout]) -> None:
    namespace = affected_trainer(layouts)
    result = child_json("recompute_proof:moved_internals", {"packages": [namespace], "strict": True})
    assert result["raised"].startswith("FSDPShimError: fsdp-shim: the recompute fix is not in effect on torch"), result
    assert "for the non-reentrant checkpoint" in result["raised"], result
    assert result["raised"].endswith("(FSDP_SHIM_STRICT is on)"), result


def test_status_python_check_and_json_say_not_in_effect(layouts: dict[str, Layout], tmp_path: Path) -> None:
    """``fsdp-shim status --python-check --json`` in an environment whose every interpreter has the moved
    checkpoint (a ``sitecustomize`` that hides it): exit 1, the problem named, the child's JSON status."""
    affected_trainer(layouts)
    (tmp_path / "sitecustomize.py").write_text(f"import sys\nsys.path.insert(0, {str(ROOT / 'tests')!r})\n" + HIDE)
    pythonpath = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    proc = fsdp_shim("status", "--python-check", "--json", env=clean_env(PYTHONPATH=pythonpath, FSDP_SHIM="1"))
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    problems = [p for p in report["problems"] if "lacks the recompute fix, and it was not applied: not in effect" in p]
    assert problems, report["problems"]
    fixes = [f for ns in report["child"]["status"]["namespaces"] if ns["imported"] for f in ns["fixes"]]
    assert any(f["fix"] == "recompute" and f["reason"].startswith("not in effect on torch") for f in fixes)


def test_status_says_per_fix_whether_this_environment_still_needs_it(layouts: dict[str, Layout]) -> None:
    """``fsdp-shim status --json``'s ``still_needed``: the cast from the Lightning releases installed (needed where
    one lacks it), the recompute from torch's checkpoint file, which restores the dtype for none of its paths
    (torch as released: the patched copy is read by ``restored_in_file``'s own test)."""
    import torch

    affected_trainer(layouts)
    proc = fsdp_shim("status", "--json")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    answers = json.loads(proc.stdout)["still_needed"]
    lacking = [f"{ns} {v}" for ns, v in sorted(installed_versions(layouts).items()) if CAST.affects(v)]
    named = lacking[0] if len(lacking) == 1 else f"{', '.join(lacking[:-1])} and {lacking[-1]}"
    assert answers["cast"] == {
        "needed": True,
        "why": f"{named} lack it; it can go once every environment runs Lightning 2.5.0 or later",
    }
    paths = "the reentrant, non-reentrant and composable checkpoints"
    assert answers["recompute"] == {
        "needed": True,
        "why": "with activation checkpointing: no Lightning release restores the default dtype for a recompute, nor "
        f"does torch {torch.__version__}'s checkpoint for {paths}; it can go once torch's does, or where you train "
        "without activation checkpointing",
    }


def test_switching_a_fix_off_in_a_running_process_takes_it_off(layouts: dict[str, Layout]) -> None:
    """``FSDP_SHIM_DISABLED_FIXES`` then ``activate()``: torch and Lightning hold their own functions, as
    status says; unset and ``activate()`` again: both fixes back (a Trainer that lacks both)."""
    namespace = an_affected_namespace(layouts, "trainer", fix=CAST.name)[0]
    result = child_json("recompute_proof:switched_off_in_process", {"package": namespace})
    wrapped = {"CheckpointFunction.forward": "ShimWrapper"}
    assert result["before"]["status"] == {"cast": "patched", "recompute": "patched"}
    assert result["before"]["checkpoint"]["CheckpointFunction.forward"] == "ShimWrapper"
    off = result["off"]
    assert off["status"] == {fix: "switched off by FSDP_SHIM_DISABLED_FIXES" for fix in ("cast", "recompute")}
    assert "ShimWrapper" not in off["checkpoint"].values(), off
    assert off["convert_module_on_class"] is False  # the inherited identity again
    assert result["on_again"] == result["before"]
    assert wrapped.items() <= result["on_again"]["checkpoint"].items()


def test_the_check_holds_whatever_context_lightning_is_imported_in(layouts: dict[str, Layout]) -> None:
    """Imported under ``inference_mode``, a meta default device and a bfloat16 default dtype, the fix is
    still shown (its check runs its own tensors on the CPU with autograd on) and leaves all three as they were."""
    namespace = affected_trainer(layouts)
    result = child_json("recompute_proof:imported_inside_contexts", {"package": namespace})
    assert result == {
        "reason": "patched",
        "inside": {"inference_mode": True, "device": "meta"},
        "dtype": "torch.bfloat16",
    }


@pytest.mark.parametrize("context", CONTEXTS)
def test_a_context_lightning_is_imported_in_switches_nothing_off(context: str, layouts: dict[str, Layout]) -> None:
    """Lightning imported (strict mode on) inside a context the check's calls would trip over in the importing
    thread: the check runs in a thread of its own, so only checkpoint debug mode, which is module-wide, keeps
    one path from being shown, and that path is checked again later. Nothing raises, nothing warns, the user's
    mode sees none of the check's calls, torch keeps every wrapper, status blames no torch, and once outside
    the context status says "patched" and a bfloat16 checkpointed backward recomputes in bfloat16."""
    import torch
    import torch.utils.checkpoint

    if context == "checkpoint debug mode" and not hasattr(torch.utils.checkpoint, "set_checkpoint_debug_enabled"):
        pytest.skip("torch before 2.2 has no checkpoint debug mode")

    namespace = affected_trainer(layouts)
    result = child_json("recompute_proof:imported_inside", {"package": namespace, "context": context, "strict": True})
    if context == "checkpoint debug mode":
        assert result["inside"] == (
            f"not shown yet on torch {torch.__version__} for the composable checkpoint (its check could not run here "
            "(ValueError: debug=True is incompatible with non-default context_fn); checked again at a later "
            "checkpoint call, fsdp_shim.activate() or status()); in effect for the reentrant and non-reentrant "
            "checkpoints"
        )
    else:
        assert result["inside"] == "patched"
    assert result["after"] == [True, "patched"]
    wrapped = [name for name, kind in result["checkpoint"].items() if kind == "ShimWrapper"]
    assert len(wrapped) == 2 and "CheckpointFunction.forward" in wrapped, result["checkpoint"]  # and the generator
    assert result["backward"] == {"non-reentrant": "torch.bfloat16", "reentrant": "torch.bfloat16"}
    assert (result["dtype"], result["warnings"], result["seen_by_mode"]) == ("torch.float32", [], [])


def test_a_checkpoint_replaced_by_a_library_is_not_blamed_on_torch(layouts: dict[str, Layout]) -> None:
    """A library's function at ``torch.utils.checkpoint.checkpoint`` at Lightning's import: the check runs
    torch's own (found through ``__wrapped__``) or, where the replacement does not wrap it, cannot run: "not
    shown yet", the wrappers stay on torch's functions, which code that imported them still calls; with
    torch's put back, the next status shows the fix."""
    import torch

    namespace = affected_trainer(layouts)
    result = child_json("recompute_proof:checkpoint_replaced_by_a_library", {"package": namespace})
    replaced = result.pop("replaced")
    where = "for the reentrant and non-reentrant checkpoints"
    assert replaced.startswith(f"not shown yet on torch {torch.__version__} {where} "), replaced
    assert "checkpoint_replaced_by_a_library.<locals>.own, not torch's own); checked again at " in replaced
    assert result == {"wrapping torch's": "patched", "put back": "patched", "backward": "torch.bfloat16"}


def test_a_thread_making_tensors_during_the_first_lightning_import_gets_only_float32(
    layouts: dict[str, Layout],
) -> None:
    """The check switches no default dtype: no call of ``torch.set_default_dtype`` during the import, and a
    thread making tensors all along gets float32 only."""
    namespace = affected_trainer(layouts)
    result = child_json("recompute_proof:import_watched", {"package": namespace})
    assert (result["switches"], result["reason"]) == ([], "patched")
    assert list(result["seen"]) == ["torch.float32"] and result["seen"]["torch.float32"] > 0, result["seen"]


def test_a_pin_ended_by_an_error_leaves_neither_its_dtype_nor_itself(layouts: dict[str, Layout]) -> None:
    """Two threads' pins in bfloat16 and float16 under ``simplefilter("error")``: the float16 one raises the
    shim's warning as an error, and afterwards the default dtype is float32 and no pin is left; the same for
    ``KeyboardInterrupt`` raised inside a recompute, and raised where the pin ends (Ctrl-C during the recompute's
    last torch operation: Python raises it at the next call, the pin's end or its ``torch.set_default_dtype``)."""
    namespace = affected_trainer(layouts)
    ended = {"dtype": "torch.float32", "pins": 0}
    assert child_json("recompute_proof:pins_left_by_errors", {"package": namespace}) == {
        "warning as error": {"errors": ["FSDPShimWarning"], **ended, "after": "torch.float32"},
        "KeyboardInterrupt": {"raised": "KeyboardInterrupt", **ended},
        "KeyboardInterrupt at _leave": {"raised": "KeyboardInterrupt", **ended},
        "KeyboardInterrupt at _leave:set_default_dtype": {"raised": "KeyboardInterrupt", **ended},
        "KeyboardInterrupt at _enter:set_default_dtype": {"raised": "KeyboardInterrupt", **ended},
    }


def test_a_process_forked_during_another_threads_recompute_starts_in_the_dtype_before_it(
    layouts: dict[str, Layout],
) -> None:
    """The child of a fork has none of the parent's other threads, so their pins would never end there: it
    starts with the dtype they replaced, and no pin; the parent's recompute ends as usual."""
    namespace = affected_trainer(layouts)
    float32 = {"dtype": "torch.float32", "pins": 0}
    assert child_json("recompute_proof:forked_during_a_recompute", {"package": namespace}) == {
        "parent during": "torch.bfloat16",
        "child": {**float32, "tensor": "torch.float32"},
        "parent after": float32,
    }


def test_a_pin_overlapping_another_threads_forward_context_leaves_no_more_than_lightnings_own(
    layouts: dict[str, Layout],
) -> None:
    """Thread A in Lightning's forward context, thread P in a pinned recompute, overlapping in every order, in one
    dtype and in two: the default dtype left after both is the one the same order leaves with P in a forward
    context of Lightning's instead, or float32 where that one leaves a dtype behind (docs/how-it-works.md,
    "Threads"). The default dtype is one global: A can run in float32 inside its section either way."""
    namespace = affected_trainer(layouts)
    pairs = [["bfloat16", "bfloat16"], ["bfloat16", "float16"]]
    result = child_json("recompute_proof:sections_overlapping", {"package": namespace, "pairs": pairs})
    assert len(result) == 4 * len(pairs), result
    for case, after in result.items():
        assert after["pin"] in (after["lightning"], "torch.float32"), (case, after)
    assert {after["pin"] for after in result.values()} > {"torch.float32"}, "some order must leave A's capture"


def test_the_pin_leaves_the_default_dtype_to_whoever_set_it(layouts: dict[str, Layout]) -> None:
    """A forward is never pinned (a checkpoint nested in a region with its own dtype, a function that sets
    the dtype keep theirs); a recompute's end leaves a dtype other code set meanwhile; pins that end in the
    order they started put back the dtype the first one replaced."""
    namespace = affected_trainer(layouts)
    assert child_json("recompute_proof:pins_in_one_thread", {"package": namespace}) == {
        "after_the_inner_checkpoint": "torch.float32",
        "after_the_outer_checkpoint": "torch.float64",
        "after_a_function_that_sets_it": "torch.float64",
        "after_other_code_changed_it": "torch.float16",
        "the_first_ended": "torch.float64",
        "both_ended": "torch.float32",
    }


@pytest.mark.parametrize(
    ("shim", "dtypes"),
    [(True, ["bfloat16", "bfloat16"]), (True, ["bfloat16", "float64"]), (False, ["bfloat16", "bfloat16"])],
)
def test_backwards_in_two_threads_leave_the_default_dtype_as_it_was(
    shim: bool, dtypes: list[str], layouts: dict[str, Layout]
) -> None:
    """30 rounds of two checkpointed backwards at once. In one dtype (one model's blocks on two devices'
    autograd threads) each recompute runs in its forward's dtype; in two dtypes they cannot both (torch's
    default dtype is one per process): said once. Either way the process's default dtype is float32 after
    every round. Without the shim every recompute runs in float32 (the bug these threads would hide)."""
    affected_trainer(layouts)
    result = child_json(
        "recompute_proof:backwards_in_threads",
        {"shim": shim, "dtypes": dtypes, "rounds": 30},
        env=clean_env(PYTHONWARNINGS="ignore"),
    )
    assert result["after"] == ["torch.float32"] * 30
    seen = [dtype for each in result["seen"].values() for dtype in each]  # 30 forwards, 30 recomputes each
    if not shim:
        assert seen.count("torch.float32") == 30 * len(dtypes), result["seen"]
        assert result["errors"], "without the shim the recomputes' ones(1) must differ from the forward's"
    elif len(set(dtypes)) == 1:
        assert set(result["seen"][dtypes[0]]) == {f"torch.{dtypes[0]}"}
        assert result["errors"] == [] and result["warnings"] == []
    else:
        (warning,) = result["warnings"]
        assert "two activation-checkpointed recomputes ran at once in different default dtypes" in warning


def _importable(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:
        return False


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


def test_whether_torch_restores_the_dtype_is_read_from_its_code(tmp_path: Path) -> None:
    """``fsdp-shim status`` reads torch's checkpoint.py without importing it: the upstream patch's shape
    restores every path; the dtype read only in the helper (not captured at the forward) restores none;
    the session's own torch, none (no release has it). Compiled, never run: the files import nothing."""
    import importlib.util

    from _fsdp_shim.recompute_check import restored_in_file

    def read(source: str) -> list[str]:
        (tmp_path / "checkpoint.py").write_text(source)
        return sorted(restored_in_file(tmp_path / "checkpoint.py"))

    assert read(RESTORING) == ["composable", "non-reentrant", "reentrant"]
    not_captured = RESTORING.replace("    default_dtype = torch.get_default_dtype()\n", "    default_dtype = None\n")
    assert read(not_captured) == ["reentrant"]
    assert read(RESTORING.replace("ctx.default_dtype = torch.get_default_dtype()", "ctx.default_dtype = 0")) == [
        "composable",
        "non-reentrant",
    ]
    spec = importlib.util.find_spec("torch")  # found, not imported
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("needs torch")
    own = Path(next(iter(spec.submodule_search_locations)), "utils", "checkpoint.py")
    assert restored_in_file(own) == frozenset()
