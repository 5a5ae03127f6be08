"""The recompute fix is called patched only where it was shown working on the torch in hand: its wrappers sit on
private names of torch, and ``recompute_check`` checks, per path, in a thread of its own, that torch's recompute calls
the function the wrapper handed it. A torch whose checkpoint calls other names is simulated
(``children.recompute_proof.hide_checkpoint_internals``). Each test runs its child's code with the shim.
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

if find_spec("torch") is None:
    pytest.skip("needs torch", allow_module_level=True)
PATHS = ["reentrant", "non-reentrant", "composable"]
MOVED = "torch recomputed it without the shim's pinned function (its checkpoint calls other functions)"
TORCH = version("torch")
SAID = re.search(r"__version__ = '([^']+)'", (Path(find_spec("torch").origin).parent / "version.py").read_text())[1]
"""What ``torch.__version__`` says, as the shim's messages do: ``2.3.1+cu121`` where the metadata says 2.3.1."""
NEW, OLD = "_checkpoint_without_reentrant_generator_impl", "_checkpoint_without_reentrant_generator"
GENERATOR, OTHERS = (NEW, [OLD]) if Version(TORCH).release >= (2, 14) else (OLD, [])
"""The non-reentrant generator this torch's ``checkpoint`` calls (renamed in torch 2.14, which keeps the old name)."""
BFLOAT16_GRADS = {"non-reentrant": "torch.bfloat16", "reentrant": "torch.bfloat16"}
"""``recompute_grads()`` where every recompute ran in its forward's dtype."""


def child(code: str, layouts: dict[str, Layout], **options: Any) -> Any:
    """``code_json`` of ``code`` with ``$namespace`` (a Trainer lacking the recompute fix) and each of ``values``
    put in as Python literals; skips where no such Trainer is installed."""
    namespace = an_affected_namespace(layouts, "trainer", fix="recompute")[0]
    values = {key: repr(value) for key, value in {"namespace": namespace, **options.pop("values", {})}.items()}
    return code_json(Template(code).substitute(values), **options)


@pytest.mark.per_release
def test_every_checkpoint_path_of_this_torch_is_wrapped_and_shown(layouts: dict[str, Layout]) -> None:
    """The generator torch calls (in ``torch.utils.checkpoint`` and the composable checkpoint's module) and
    ``CheckpointFunction.forward`` are wrapped; every path is shown without loading the pins, and the same check
    fails on the same torch once ``deactivate()`` put torch's own functions back."""
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
        layouts,
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
    """The path torch no longer calls (non-reentrant: only the module's functions are moved) is "not in effect" in
    every namespace, one warning says so, torch holds its own generator again, the rank check names the path; the
    paths shown keep their wrappers. Strict mode raises instead."""
    names = [
        name for name in ("lightning.pytorch", "lightning.fabric", "pytorch_lightning") if find_spec(name.split(".")[0])
    ]
    result = child(MOVED_INTERNALS, layouts, values={"namespaces": names})
    assert result["states"] == dict.fromkeys(names, "not in effect")
    assert result["rank_check"] == {name: {"by": "fsdp-shim", "except": ["non-reentrant"]} for name in names}
    (warning,) = [w for w in result["warnings"] if "recompute" in w]
    assert f"not in effect on torch {SAID} for the non-reentrant checkpoint ({MOVED})" in warning
    assert result["held"] == {
        **dict.fromkeys([GENERATOR, *OTHERS], "function"),
        "CheckpointFunction.forward": "ShimWrapper",
    }
    strict = child(MOVED_INTERNALS, layouts, values={"namespaces": names[:1]}, env=clean_env(FSDP_SHIM_STRICT="1"))
    raised = strict["raised"]
    assert raised.startswith("FSDPShimError: fsdp-shim: the recompute fix is not in effect on torch"), raised
    assert "for the non-reentrant checkpoint" in raised and raised.endswith("(FSDP_SHIM_STRICT is on)"), raised


def test_status_says_that_this_torch_still_needs_the_fix(layouts: dict[str, Layout], tmp_path: Path) -> None:
    """``fsdp-shim status --json`` where every interpreter has the moved checkpoint (a ``sitecustomize`` hides it):
    ``still_needed`` says the recompute is needed, torch's checkpoint restoring the dtype for none of its paths."""
    an_affected_namespace(layouts, "trainer", fix="recompute")
    hide = "from children.recompute_proof import hide_checkpoint_internals; hide_checkpoint_internals()\n"
    (tmp_path / "sitecustomize.py").write_text(f"import sys\nsys.path.insert(0, {str(ROOT / 'tests')!r})\n{hide}")
    pythonpath = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    proc = fsdp_shim("status", "--json", env=clean_env(PYTHONPATH=pythonpath, FSDP_SHIM="1"))
    needed = json.loads(proc.stdout)["still_needed"]["recompute"]
    assert needed["needed"] is True, needed
    assert "the reentrant, non-reentrant and composable checkpoints" in needed["why"], needed


IMPORTED_INSIDE = """
import contextlib, importlib, json, threading, warnings
import torch
import torch.utils.checkpoint as checkpoint
from children.recompute_proof import held, recompute_grads

entered = contextlib.ExitStack()
if $context == "checkpoint debug mode":
    entered.enter_context(checkpoint.set_checkpoint_debug_enabled(True))
else:  # thread-local state of the importing thread, and a default dtype and warning filter of the whole process
    torch.set_default_dtype(torch.bfloat16)
    entered.callback(torch.set_default_dtype, torch.float32)
    entered.enter_context(torch.autograd.graph.disable_saved_tensors_hooks("the user's"))
    for context in (torch.no_grad(), torch.inference_mode(), torch.device("meta")):
        entered.enter_context(context)

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
    "grads": recompute_grads(), "dtype": str(torch.get_default_dtype()), "warnings": [str(w.message) for w in caught],
}))
"""


@pytest.mark.parametrize("context", ["checkpoint debug mode", "the importing thread's state"])
def test_a_context_lightning_is_imported_in_switches_nothing_off(context: str, layouts: dict[str, Layout]) -> None:
    """Lightning imported (strict mode on, warnings as errors) in a context the check's calls would trip over: only
    checkpoint debug mode, module-wide, keeps the composable path "not shown yet" (checked again later). No dtype
    switched, nothing warns, every wrapper stays and acts."""
    if context == "checkpoint debug mode" and Version(TORCH).release < (2, 2):
        pytest.skip("torch before 2.2 has no checkpoint debug mode")
    result = child(IMPORTED_INSIDE, layouts, values={"context": context}, env=clean_env(FSDP_SHIM_STRICT="1"))
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
    assert result["held"]["CheckpointFunction.forward"] == result["held"][GENERATOR] == "ShimWrapper"
    assert result["grads"] == BFLOAT16_GRADS
    assert (result["dtype"], result["warnings"]) == ("torch.float32", [])


def test_a_checkpoint_replaced_by_a_library_is_not_blamed_on_torch(layouts: dict[str, Layout]) -> None:
    """torch's checkpoint served from bytecode only, a library's function at its ``checkpoint`` at Lightning's import:
    not torch's own, so "not shown yet" (not "not in effect"), the wrappers stay; wrapping torch's (``__wrapped__``),
    or torch's own put back, the next status shows it "patched"; the pins act."""
    result = child(
        """
        import compileall, functools, importlib, importlib.machinery, importlib.util, json, shutil, sys, tempfile
        from pathlib import Path

        # torch/utils/checkpoint.py compiled to checkpoint.pyc, the .py removed: its functions name the .py
        folder = Path(tempfile.mkdtemp())
        shutil.copy(Path(importlib.util.find_spec("torch").origin).parent / "utils" / "checkpoint.py", folder)
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
        import torch.utils.checkpoint as checkpoint
        assert checkpoint.__file__ == compiled, checkpoint.__file__
        from children.recompute_proof import recompute_grads
        torchs = checkpoint.checkpoint
        wrapping = functools.wraps(torchs)(lambda *args, **kwargs: torchs(*args, **kwargs))

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
        layouts,
    )
    state, detail = result.pop("replaced")
    assert state == "not shown yet", detail
    assert "checkpoint is __main__.own, not torch's own" in detail, detail
    assert result == {"wrapping torch's": "patched", "put back": "patched", "grads": BFLOAT16_GRADS}
