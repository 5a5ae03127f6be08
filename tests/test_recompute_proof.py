"""The recompute fix is called patched only where it was shown working on the torch in hand.

Its wrappers sit on private names of torch, so each is a guess about torch's call path; ``recompute_check`` checks
the guess per path, in a thread of its own, without switching the default dtype. Each test runs its child's code
(``run_code``) with the shim and the session's Lightning; a torch whose checkpoint calls other names is simulated
(``children.recompute_proof.hide_checkpoint_internals``). The torch sessions run the ``per_release`` ones.
"""

from __future__ import annotations

import json
import os
import re
from importlib.metadata import version
from importlib.util import find_spec
from pathlib import Path
from string import Template
from typing import Any

import pytest
from conftest import ROOT, Layout, an_affected_namespace, clean_env, code_json, fsdp_shim
from packaging.version import Version

PATHS = ["reentrant", "non-reentrant", "composable"]
MOVED = "torch recomputed it without the shim's pinned function (its checkpoint calls other functions)"
if find_spec("torch") is None:
    pytest.skip("needs torch", allow_module_level=True)
TORCH = version("torch")
SAID = re.search(r"__version__ = '([^']+)'", (Path(find_spec("torch").origin).parent / "version.py").read_text())[1]
"""What ``torch.__version__`` says, as the shim's messages do: ``2.3.1+cu121`` where the metadata says 2.3.1."""
NEW, OLD = "_checkpoint_without_reentrant_generator_impl", "_checkpoint_without_reentrant_generator"
GENERATOR, OTHERS = (NEW, [OLD]) if Version(TORCH).release >= (2, 14) else (OLD, [])
"""The non-reentrant generator this torch's ``checkpoint`` calls (renamed in torch 2.14, which keeps the old name)."""


def trainer(layouts: dict[str, Layout]) -> str:
    """A Trainer namespace that lacks the recompute fix (every one since 2.1; skips where none is installed)."""
    return an_affected_namespace(layouts, "trainer", fix="recompute")[0]


def child(code: str, namespace: str, **options: Any) -> Any:
    """``code_json`` of ``code`` with ``$namespace`` (and each ``$option``) put in as Python literals."""
    values = {"namespace": repr(namespace), **{key: repr(value) for key, value in options.pop("values", {}).items()}}
    return code_json(Template(code).substitute(values), **options)


@pytest.mark.per_release
def test_every_checkpoint_path_of_this_torch_is_wrapped_and_shown(layouts: dict[str, Layout]) -> None:
    """The generator torch calls is wrapped (in ``torch.utils.checkpoint`` and the composable checkpoint's module),
    with ``CheckpointFunction.forward``; every path is shown with the shim on, without loading the pins, and the
    same check fails on the same torch once ``deactivate()`` put torch's own functions back."""
    result = child(
        """
        import importlib, json, sys
        import fsdp_shim
        from _fsdp_shim import recompute_check
        from _fsdp_shim.config import RECOMPUTE
        from _fsdp_shim.status import reading
        from children.recompute_proof import COMPOSABLE, held
        importlib.import_module($namespace)

        def check():
            return {p: [f.shown, f.why, f.holds] for p, f in recompute_check.prove(frozenset()).items()}

        found = {"on": [held(), held(COMPOSABLE), check()], "pins loaded": "_fsdp_shim.pins" in sys.modules}
        fix = reading($namespace, RECOMPUTE)
        found["fix"] = [fix.state.value, list(fix.targets)]
        fsdp_shim.deactivate()
        found["off"] = [held(), held(COMPOSABLE), check()]
        print(json.dumps(found))
        """,
        trainer(layouts),
    )
    other = dict.fromkeys(OTHERS, "function")
    assert result["pins loaded"] is False  # the check hands torch a marked function: the pins load at a checkpoint
    assert result["fix"] == [
        "patched",
        [
            "torch.utils.checkpoint.CheckpointFunction.forward",
            f"torch.utils.checkpoint.{GENERATOR}",
            f"torch.distributed._composable.checkpoint_activation.{GENERATOR}",
        ],
    ]
    assert result["on"] == [
        {GENERATOR: "ShimWrapper", **other, "CheckpointFunction.forward": "ShimWrapper"},
        {GENERATOR: "ShimWrapper"},
        {path: [True, "", False] for path in PATHS},
    ]
    assert result["off"] == [
        {GENERATOR: "function", **other, "CheckpointFunction.forward": "staticmethod"},
        {GENERATOR: "function"},
        {path: [False, MOVED, True] for path in PATHS},
    ]


MOVED_INTERNALS = """
import importlib, json, warnings
from children.recompute_proof import hide_checkpoint_internals, held
hide_checkpoint_internals()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import fsdp_shim
    try:
        for name in $namespaces:
            importlib.import_module(name)
    except Exception as error:
        print(json.dumps({"raised": f"{type(error).__name__}: {error}"}))
        raise SystemExit
import torch
from _fsdp_shim import rank_check
from _fsdp_shim.config import RECOMPUTE
from _fsdp_shim.status import reading
print(json.dumps({
    "states": {name: reading(name, RECOMPUTE).state.value for name in $namespaces},
    "rank_check": {name: rank_check.decide(name, torch.bfloat16)["fixes"]["recompute"] for name in $namespaces},
    "warnings": [str(w.message) for w in caught if type(w.message).__name__ == "FSDPShimWarning"],
    "held": held(),
}))
"""


@pytest.mark.per_release
def test_a_torch_whose_checkpoint_calls_other_names_is_reported_not_in_effect_and_left_alone(
    layouts: dict[str, Layout],
) -> None:
    """The path torch no longer calls (non-reentrant: ``hide_checkpoint_internals`` moves only the module's
    functions) is "not in effect" in every namespace, one warning says so, torch holds its own generator again,
    the rank check names the path; the paths shown keep their wrappers. Strict mode raises instead."""
    trainer(layouts)
    namespaces = [name for name in ("lightning.pytorch", "lightning.fabric", "pytorch_lightning") if _has(name)]
    result = child(MOVED_INTERNALS, "", values={"namespaces": namespaces})
    assert result["states"] == dict.fromkeys(namespaces, "not in effect")
    assert result["rank_check"] == {name: {"by": "fsdp-shim", "except": ["non-reentrant"]} for name in namespaces}
    (warning,) = [w for w in result["warnings"] if "recompute" in w]
    assert f"not in effect on torch {SAID} for the non-reentrant checkpoint ({MOVED})" in warning
    assert result["held"] == {
        **dict.fromkeys([GENERATOR, *OTHERS], "function"),
        "CheckpointFunction.forward": "ShimWrapper",
    }
    strict = child(MOVED_INTERNALS, "", values={"namespaces": namespaces[:1]}, env=clean_env(FSDP_SHIM_STRICT="1"))
    raised = strict["raised"]
    assert raised.startswith("FSDPShimError: fsdp-shim: the recompute fix is not in effect on torch"), raised
    assert "for the non-reentrant checkpoint" in raised and raised.endswith("(FSDP_SHIM_STRICT is on)"), raised


def test_status_says_not_in_effect_and_that_this_torch_still_needs_the_fix(
    layouts: dict[str, Layout], tmp_path: Path
) -> None:
    """``fsdp-shim status --python-check --json`` where every interpreter has the moved checkpoint (a
    ``sitecustomize`` that hides it): exit 1, the problem named, the child's status "not in effect"; and
    ``still_needed`` says the recompute is needed, torch's checkpoint restoring the dtype for none of its paths."""
    trainer(layouts)
    hide = "from children.recompute_proof import hide_checkpoint_internals; hide_checkpoint_internals()\n"
    (tmp_path / "sitecustomize.py").write_text(f"import sys\nsys.path.insert(0, {str(ROOT / 'tests')!r})\n{hide}")
    pythonpath = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    proc = fsdp_shim("status", "--python-check", "--json", env=clean_env(PYTHONPATH=pythonpath, FSDP_SHIM="1"))
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    problems = [p for p in report["problems"] if "lacks the recompute fix, and it was not applied: not in effect" in p]
    assert problems, report["problems"]
    fixes = [f for ns in report["child"]["status"]["namespaces"] if ns["imported"] for f in ns["fixes"]]
    assert {f["state"] for f in fixes if f["fix"] == "recompute"} == {"not in effect"}, fixes
    needed = report["still_needed"]["recompute"]
    assert needed["needed"] is True, needed
    assert "the reentrant, non-reentrant and composable checkpoints" in needed["why"], needed


BYTECODE_ONLY = """
import compileall, importlib, importlib.machinery, importlib.util, json, shutil, sys, tempfile
from pathlib import Path

# torch/utils/checkpoint as bytecode only: the file compiled with `compileall -b`, the .py removed.
torch_folder = Path(importlib.util.find_spec("torch").submodule_search_locations[0])
folder = Path(tempfile.mkdtemp())
shutil.copy(torch_folder / "utils" / "checkpoint.py", folder / "checkpoint.py")
assert compileall.compile_file(str(folder / "checkpoint.py"), legacy=True, quiet=1)
(folder / "checkpoint.py").unlink()
compiled = str(folder / "checkpoint.pyc")

class BytecodeOnly:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == "torch.utils.checkpoint":
            loader = importlib.machinery.SourcelessFileLoader(name, compiled)
            return importlib.util.spec_from_file_location(name, compiled, loader=loader)

sys.meta_path.insert(0, BytecodeOnly)
import torch.utils.checkpoint
assert torch.utils.checkpoint.__file__ == compiled, torch.utils.checkpoint.__file__
import fsdp_shim
from _fsdp_shim.config import RECOMPUTE
from _fsdp_shim.status import reading
from children.recompute_proof import recompute_grads
importlib.import_module($namespace)
fix = reading($namespace, RECOMPUTE)
print(json.dumps({"state": fix.state.value, "detail": fix.detail, "grads": recompute_grads()}))
"""


def test_a_torch_whose_checkpoint_is_bytecode_only_is_shown_patched(layouts: dict[str, Layout]) -> None:
    """torch's checkpoint served from a ``.pyc`` whose source was removed (its functions name the ``.py``, the
    module the ``.pyc``): still torch's own, so the check runs, the fix is "patched", and the pins act."""
    result = child(BYTECODE_ONLY, trainer(layouts))
    assert result == {
        "state": "patched",
        "detail": "",
        "grads": {"non-reentrant": "torch.bfloat16", "reentrant": "torch.bfloat16"},
    }


IMPORTED_INSIDE = """
import contextlib, importlib, json, threading, warnings
import torch
import torch.utils.checkpoint as checkpoint
from torch.overrides import TorchFunctionMode
from children.recompute_proof import held, recompute_grads

seen_by_mode = []

class Rejecting(TorchFunctionMode):
    # A user's mode that rejects float64 and notes every op on a tensor that requires grad.
    def __torch_function__(self, func, types, args=(), kwargs=None):
        values = [*args, *(kwargs or {}).values()]
        if torch.float64 in values or any(getattr(v, "dtype", None) == torch.float64 for v in values):
            raise RuntimeError("this user's mode rejects float64")
        if any(isinstance(v, torch.Tensor) and v.requires_grad for v in values):
            seen_by_mode.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))

@contextlib.contextmanager
def default_dtype(dtype):
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(torch.float32)

entered = contextlib.ExitStack()
if $context == "checkpoint debug mode":
    entered.enter_context(checkpoint.set_checkpoint_debug_enabled(True))
else:  # thread-local state of the importing thread, and a default dtype and warning filter of the whole process
    entered.enter_context(default_dtype(torch.bfloat16))
    entered.enter_context(torch.autograd.graph.disable_saved_tensors_hooks("the user's"))
    entered.enter_context(torch.no_grad())
    entered.enter_context(torch.inference_mode())
    entered.enter_context(torch.device("meta"))
    entered.enter_context(Rejecting())

# Every torch.set_default_dtype call during the import, and a thread making tensors all along.
switches, made, done, original = [], {}, threading.Event(), torch.set_default_dtype
torch.set_default_dtype = lambda dtype: (switches.append(str(dtype)), original(dtype))[1]

def make_tensors():
    while not done.is_set():
        dtype = str(torch.zeros(1, device="cpu").dtype)
        made[dtype] = made.get(dtype, 0) + 1

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("error")
    with entered:
        maker = threading.Thread(target=make_tensors)
        maker.start()
        try:
            import fsdp_shim
            from _fsdp_shim.config import RECOMPUTE
            from _fsdp_shim.status import reading
            importlib.import_module($namespace)
        finally:
            done.set()
            maker.join()
            torch.set_default_dtype = original
        inside = reading($namespace, RECOMPUTE)
        inside = [inside.state.value, inside.detail, str(torch.get_default_dtype())]
after = fsdp_shim.status().namespace($namespace).fix("recompute").state.value
print(json.dumps({
    "inside": inside, "after": after, "switches": switches, "made": sorted(made), "held": held(),
    "grads": recompute_grads(), "dtype": str(torch.get_default_dtype()), "seen_by_mode": seen_by_mode,
    "warnings": [str(w.message) for w in caught],
}))
"""


@pytest.mark.parametrize("context", ["checkpoint debug mode", "the importing thread's state"])
def test_a_context_lightning_is_imported_in_switches_nothing_off(context: str, layouts: dict[str, Layout]) -> None:
    """Lightning imported (strict mode on, warnings as errors) inside a context the check's calls would trip over:
    the check runs in a thread of its own, so only checkpoint debug mode, which is module-wide, keeps the composable
    path from being shown ("not shown yet", checked again later). No ``set_default_dtype`` call, a thread making
    tensors meanwhile gets the dtype in force only, nothing warns, the user's mode sees none of the check's calls,
    every wrapper stays; outside the context the fix is "patched" and a bfloat16 backward recomputes in bfloat16."""
    if context == "checkpoint debug mode" and Version(TORCH).release < (2, 2):
        pytest.skip("torch before 2.2 has no checkpoint debug mode")
    env = clean_env(FSDP_SHIM_STRICT="1")
    result = child(IMPORTED_INSIDE, trainer(layouts), values={"context": context}, env=env)
    dtype = "torch.float32" if context == "checkpoint debug mode" else "torch.bfloat16"
    state, detail, inside_dtype = result["inside"]
    if context == "checkpoint debug mode":
        assert state == "not shown yet", result["inside"]
        assert detail.startswith(f"on torch {SAID} for the composable checkpoint (its check could not")
        assert "in effect for the reentrant and non-reentrant checkpoints" in detail, detail
    else:
        assert state == "patched", result["inside"]
    assert (inside_dtype, result["switches"], result["made"]) == (dtype, [], [dtype])
    assert result["after"] == "patched"
    assert result["held"]["CheckpointFunction.forward"] == "ShimWrapper"
    assert result["held"][GENERATOR] == "ShimWrapper"
    assert result["grads"] == {"non-reentrant": "torch.bfloat16", "reentrant": "torch.bfloat16"}
    assert (result["dtype"], result["warnings"], result["seen_by_mode"]) == ("torch.float32", [], [])


def test_a_checkpoint_replaced_by_a_library_is_not_blamed_on_torch(layouts: dict[str, Layout]) -> None:
    """A library's function at ``torch.utils.checkpoint.checkpoint`` at Lightning's import: the check runs torch's
    own, found through ``__wrapped__``, or, where the replacement does not wrap it, cannot run: "not shown yet"
    (not "not in effect"), the wrappers stay on torch's functions; with torch's put back the next status shows it."""
    result = child(
        """
        import functools, importlib, json
        import torch.utils.checkpoint as checkpoint
        from children.recompute_proof import recompute_grads
        torchs = checkpoint.checkpoint

        @functools.wraps(torchs)
        def wrapping(*args, **kwargs):
            return torchs(*args, **kwargs)

        def own(function, *args, use_reentrant=None, **kwargs):
            return function(*args)  # a library's own implementation

        import fsdp_shim
        from _fsdp_shim.config import RECOMPUTE
        from _fsdp_shim.status import reading
        checkpoint.checkpoint = own
        importlib.import_module($namespace)
        fix = reading($namespace, RECOMPUTE)
        found = {"replaced": [fix.state.value, fix.detail]}
        checkpoint.checkpoint = wrapping  # status() checks again what was not shown
        found["wrapping torch's"] = fsdp_shim.status().namespace($namespace).fix("recompute").state.value
        checkpoint.checkpoint = torchs
        found["put back"] = fsdp_shim.status().namespace($namespace).fix("recompute").state.value
        found["grads"] = recompute_grads()
        print(json.dumps(found))
        """,
        trainer(layouts),
    )
    state, detail = result.pop("replaced")
    assert state == "not shown yet", detail
    assert "checkpoint is __main__.own, not torch's own" in detail, detail
    assert result == {
        "wrapping torch's": "patched",
        "put back": "patched",
        "grads": {"non-reentrant": "torch.bfloat16", "reentrant": "torch.bfloat16"},
    }


def _has(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:
        return False
