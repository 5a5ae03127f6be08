"""The shim next to other code that patches the same functions (a tracer, a profiler, a hot-fix) or imports
Lightning itself (an instrumenting import hook), in fresh interpreters with real Lightning, read by identity.

Each check runs on one target of each kind the shim wraps: the cast's ``convert_module`` (inherited from
``Precision``), the recompute's ``CheckpointFunction.forward`` (a staticmethod in torch's class) and its
non-reentrant generator (a function of ``torch.utils.checkpoint``), shared by every namespace."""

from __future__ import annotations

import textwrap
from typing import Any

import pytest
from children.classes import STATES
from conftest import NAMESPACES, Layout, clean_env, code_json
from test_failures import FIT

QUIET = ("-W", "ignore::DeprecationWarning")
ON, OFF = "torch.bfloat16", "torch.float32"
"""What each target gives with the fix (a bf16-true plugin's cast, or a recompute in the forward's bfloat16) and
without it (Lightning's own: no cast; torch's own: the recompute in float32)."""

TARGETS = """
    import importlib, json, os, sys, warnings
    import torch.utils.checkpoint as checkpoint
    from children.classes import *

    class Target:
        def __init__(self, kind):
            importlib.import_module(FABRIC)
            self.kind, self.calls = kind, []
            self.fix = "cast" if kind == "convert" else "recompute"
            self.owner, self.attribute, self.label = {
                "convert": (precision_class(FABRIC), "convert_module", FABRIC + ".plugins.precision.fsdp"),
                "reentrant": (checkpoint.CheckpointFunction, "forward", "torch.utils.checkpoint"),
                "non_reentrant": (checkpoint, checkpoint_generator(), "torch.utils.checkpoint"),
            }[kind]
            owner = "" if kind == "non_reentrant" else f".{self.owner.__name__}"
            self.label += f"{owner}.{self.attribute}"

        def dtype(self):
            return converted_dtype(self.owner) if self.kind == "convert" else recompute_dtype(self.kind == "reentrant")

        def on_class(self):
            return self.owner.__dict__.get(self.attribute)

        def status(self):
            return statuses()[FABRIC][self.fix]

        def tracer(self, wrapped, instance, args, kwargs):
            self.calls.append("theirs")
            return wrapped(*args, **kwargs)

        def wrap_with_wrapt(self):
            import wrapt

            wrapt.wrap_function_wrapper(self.owner, self.attribute, self.tracer)

        def replace_with_plain_function(self):  # a hot-fix: calls what was there, a staticmethod where that was one
            previous, calls = getattr(self.owner, self.attribute), self.calls

            def theirs(*args, **kwargs):
                calls.append("theirs")
                return previous(*args, **kwargs)

            static = isinstance(self.on_class(), staticmethod)
            setattr(self.owner, self.attribute, staticmethod(theirs) if static else theirs)

        def counted(self, what):
            before = len(self.calls)
            return [what(), len(self.calls) - before]

    targets = {kind: Target(kind) for kind in ("convert", "reentrant", "non_reentrant")}
    out = {kind: {"label": target.label} for kind, target in targets.items()}
"""


def run(layouts: dict[str, Layout], code: str) -> dict[str, Any]:
    """``TARGETS`` then ``code`` in a fresh interpreter, on the Fabric of a layout that lacks the cast."""
    package = next((p for p, layout in layouts.items() if STATES[layout.fabric_version][0] == "patched"), None)
    if package is None:
        pytest.skip("needs a Lightning release that lacks the cast")
    script = (TARGETS + code + "\n    print(json.dumps(out))\n").replace("FABRIC", repr(NAMESPACES[package][1]))
    return code_json(script, env=clean_env(), python_args=QUIET)


def about(label: str, said: list[str]) -> list[str]:
    return [message for message in said if f" {label} " in message]


@pytest.mark.parametrize("kind", ["plain", pytest.param("wrapt", marks=pytest.mark.per_release)])
def test_a_wrapper_put_there_first_is_composed_with(kind: str, layouts: dict[str, Layout]) -> None:
    """Their wrapper was there before the shim: the shim wraps it (both run), status says "patched", and
    ``deactivate()`` puts back their object itself."""
    result = run(
        layouts,
        f"""
    for target in targets.values():
        target.{"wrap_with_wrapt" if kind == "wrapt" else "replace_with_plain_function"}()
    theirs = {{kind: target.on_class() for kind, target in targets.items()}}
    import fsdp_shim

    for kind, target in targets.items():
        out[kind]["on"] = target.counted(target.dtype) + [target.status()]
    fsdp_shim.deactivate()
    for kind, target in targets.items():
        out[kind]["off"] = target.counted(target.dtype) + [target.on_class() is theirs[kind]]
    """,
    )
    for kind, one in result.items():
        assert one["on"] == [ON, 1, ["patched", ""]], kind
        assert one["off"] == [OFF, 1, True], kind


def test_a_wrapper_put_on_top_is_never_taken_for_the_shims_own(layouts: dict[str, Layout]) -> None:
    """Their wrapt wrapper on top of the shim's (which answers every attribute of what it wraps): ``deactivate()``
    switches the shim's off in place, says so once per target and leaves theirs; ``activate()`` switches it back
    on, stacking nothing."""
    result = run(
        layouts,
        """
    from _fsdp_shim.wrappers import is_shim_wrapper, wrapper_chain
    import fsdp_shim

    for kind, target in targets.items():
        target.wrap_with_wrapt()
        out[kind]["on"] = [is_shim_wrapper(target.on_class()), target.dtype(), target.status()]
    theirs = {kind: target.on_class() for kind, target in targets.items()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fsdp_shim.deactivate()
    out["said"] = shim_warnings(caught)
    for kind, target in targets.items():
        out[kind]["off"] = [target.on_class() is theirs[kind], target.dtype(), target.status()[0]]
    fsdp_shim.activate()
    for kind, target in targets.items():
        layers = sum(map(is_shim_wrapper, wrapper_chain(target.on_class())))
        out[kind]["again"] = [target.on_class() is theirs[kind], layers, target.dtype(), target.status()[0]]
    fsdp_shim.deactivate()
    for kind, target in targets.items():
        out[kind]["end"] = [target.on_class() is theirs[kind], target.dtype(), len(target.calls)]
    """,
    )
    said = result.pop("said")
    for kind, one in result.items():
        [warning] = about(one["label"], said)
        assert "has wrapped it since" in warning and "passes every call through" in warning, kind
        assert one["on"] == [False, ON, ["patched", ""]], kind
        assert one["off"] == [True, OFF, "deactivated"], kind
        assert one["again"] == [True, 1, ON, "patched"], kind
        assert one["end"] == [True, OFF, 4], kind  # every call above went through theirs
    assert len(said) == len(result)


def test_a_replaced_wrapper_is_reported_and_the_replacement_kept(layouts: dict[str, Layout]) -> None:
    """Other code replaces (not wraps) the shim's wrapper: status stops saying patched, and ``deactivate()``
    says so and keeps the replacement."""
    result = run(
        layouts,
        """
    import fsdp_shim

    replacements = {}
    for kind, target in targets.items():
        def replacement(*args, **kwargs):
            raise AssertionError("never called")

        replacements[kind] = staticmethod(replacement) if kind == "reentrant" else replacement
        setattr(target.owner, target.attribute, replacements[kind])
        out[kind]["status"] = target.status()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fsdp_shim.deactivate()
    out["said"] = shim_warnings(caught)
    for kind, target in targets.items():
        out[kind]["kept"] = target.on_class() is replacements[kind]
    """,
    )
    said = result.pop("said")
    for kind, one in result.items():
        [warning] = about(one["label"], said)
        assert "had already been replaced by other code" in warning, kind
        state, detail = one["status"]
        assert state == "failed" and f"other code replaced its wrapper on {one['label']} (" in detail, kind
        assert one["kept"] is True, kind


def test_a_library_that_wraps_the_base_class_after_the_shim_still_runs(layouts: dict[str, Layout]) -> None:
    """The FSDP precision class inherits ``convert_module`` (2.1-2.4) and the shim wrapped it there; a tracer then
    wraps the base class's ``Precision.convert_module``: it runs for every FSDP plugin, with the shim's cast too
    (its wrapper looks the inherited method up at each call); ``deactivate()`` restores inheritance, theirs kept."""
    result = run(
        layouts,
        """
    import wrapt
    import fsdp_shim

    fsdp_class = targets["convert"].owner
    base = importlib.import_module(FABRIC + ".plugins.precision").Precision
    calls = []
    tracer = lambda wrapped, instance, args, kwargs: (calls.append(type(instance).__name__), wrapped(*args, **kwargs))
    wrapt.wrap_function_wrapper(base, "convert_module", lambda *call: tracer(*call)[1])
    theirs = base.__dict__["convert_module"]
    out = {"on": [issubclass(fsdp_class, base), "convert_module" in fsdp_class.__dict__, converted_dtype(fsdp_class)]}
    out["on"].append(list(calls))
    fsdp_shim.deactivate()
    calls.clear()
    out["off"] = ["convert_module" in fsdp_class.__dict__, base.__dict__["convert_module"] is theirs]
    out["off"] += [converted_dtype(fsdp_class), list(calls)]
    """,
    )
    assert result == {"on": [True, True, ON, ["FSDPPrecision"]], "off": [False, True, OFF, ["FSDPPrecision"]]}


# ----------------------------------------------------------------------------- a finder in front of the shim's
FIT_PAST_A_FINDER = """
    import importlib, importlib.machinery, json, sys, warnings
    from children.classes import PACKAGES, shim_warnings

    class Instrumenter:  # answers for every Lightning module with the path finder's spec
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in PACKAGES:
                return importlib.machinery.PathFinder.find_spec(name, path)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        IMPORT_SHIM
        sys.meta_path.insert(0, Instrumenter())
        model, trainer = fit(importlib.import_module(TRAINER))
    status = sys.modules["_fsdp_shim.activation"].status()
    print(json.dumps({
        "sources": list(status.sources),
        "dtypes": sorted({str(p.dtype) for p in trainer.strategy.model.parameters()} | {str(model.dtype)}),
        "patched": status.namespace(TRAINER).patched,
        "said": shim_warnings(caught),
    }))
"""
"""After ``FIT`` (tests/test_failures.py), which imports torch and lifts the CPU guards, not Lightning."""


@pytest.mark.parametrize(
    ("import_shim", "env", "source"),
    [
        ("import fsdp_shim", {"FSDP_SHIM_STRICT": "1"}, "import fsdp_shim"),
        ("", {"FSDP_SHIM": "1"}, "FSDP_SHIM=1 (start-up file installed with the package)"),
    ],
    ids=["import-strict", "start-up-file"],
)
def test_a_finder_in_front_loads_lightning_and_the_shim_patches_it_at_the_next_import(
    import_shim: str, env: dict[str, str], source: str, layouts: dict[str, Layout]
) -> None:
    """An instrumenting finder in front of the shim's loads Lightning itself: the shim notices at the next import and
    patches then, before any model is wrapped, so the model trains in bfloat16 and nothing is said (strict mode does
    not raise). Had FSDP wrapped a model before, the late warning would say so (tests/test_failures.py)."""
    package = next((p for p, layout in layouts.items() if STATES[layout.trainer_version][0] == "patched"), None)
    if package is None:
        pytest.skip("needs a Lightning release that lacks the cast")
    trainer = NAMESPACES[package][0]
    script = FIT_PAST_A_FINDER.replace("IMPORT_SHIM", import_shim or "pass").replace("TRAINER", repr(trainer))
    result = code_json(FIT + textwrap.dedent(script), env=clean_env(PYTHONWARNINGS="ignore", **env))
    assert result == {"sources": [source], "dtypes": ["torch.bfloat16"], "patched": True, "said": []}
