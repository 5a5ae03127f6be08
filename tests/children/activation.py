"""Activation, gates, toggles, failure isolation and messages, each run in a fresh interpreter: every
function decides its own import order (nothing here imports Lightning or fsdp_shim at module level)."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import importlib
import json
import logging
import os
import pkgutil
import sys
import warnings
from typing import Any

from children.classes import (
    NAMESPACES,
    as_shipped,
    changed,
    checkpoint_generator,
    converted_dtype,
    import_all,
    layers,
    precision_class,
    recompute_dtypes,
    shim_warnings,
    snapshot,
    statuses,
    wrappers,
)

HEAVY = ("torch", "lightning", "pytorch_lightning", "lightning_fabric", "wrapt", "packaging")
PATCHING_CODE = ("_fsdp_shim.wrappers", "_fsdp_shim.fixes", "_fsdp_shim.rank_check")
NOT_INERT = ("_fsdp_shim.bootstrap", "_fsdp_shim.children")
"""Start-up and entry scripts, which exist to run when imported: ``fsdp-shim run``'s ``sitecustomize``
arms the shim, and ``children/`` are run by path."""


def _line_marked(marker: str) -> int:
    with open(__file__) as source:
        for number, line in enumerate(source, 1):
            if f"# {marker}" in line:
                return number
    raise LookupError(marker)


def _finders() -> list[str]:
    return [getattr(finder, "__name__", type(finder).__name__) for finder in sys.meta_path]


def _caught(caught: list[Any]) -> tuple[list[str], list[list[Any]]]:
    found = [w for w in caught if w.category.__name__ == "FSDPShimWarning"]
    return [str(w.message) for w in found], [[w.filename, w.lineno] for w in found]


# ----------------------------------------------------------------------------- what importing loads
def import_cost() -> dict[str, Any]:
    """``import fsdp_shim`` with torch, Lightning, wrapt and packaging unimportable: it must not need
    them, nor load the patching code, and ``status()`` must work without them."""

    class Block:
        def find_spec(self, name: str, path: object = None, target: object = None) -> None:
            if name.partition(".")[0] in HEAVY:
                raise ImportError(f"blocked: {name}")

    before = sorted(m for m in (*HEAVY, *PATCHING_CODE) if m in sys.modules)
    sys.meta_path.insert(0, Block())
    import _fsdp_shim
    import _fsdp_shim.failures
    import fsdp_shim
    import fsdp_shim.errors

    after_import = sorted(m for m in (*HEAVY, *PATCHING_CODE) if m in sys.modules)
    status = fsdp_shim.status()
    text = str(status)
    return {
        "before": before,
        "after_import": after_import,
        "after_status": sorted(m for m in (*HEAVY, *PATCHING_CODE) if m in sys.modules),
        "active": status.active,
        "sources": list(status.sources),
        "first_finder": _finders()[0],  # arm() puts it in front of everything, Block included
        "version": fsdp_shim.__version__,
        "status_text": text,
        "one_warning_class": fsdp_shim.FSDPShimWarning is _fsdp_shim.FSDPShimWarning,
        "one_error_class": fsdp_shim.errors.FSDPShimError is _fsdp_shim.failures.FSDPShimError,
        "warning_category": [c.__name__ for c in fsdp_shim.FSDPShimWarning.__mro__],
    }


def report_at_exit() -> None:
    """For a ``sitecustomize`` put in front of a command: at exit, write to ``$CHILD_REPORT_FILE`` whether
    the shim was imported, armed or activated in that process."""

    def report() -> None:
        startup = sys.modules.get("_fsdp_shim")
        activation = sys.modules.get("_fsdp_shim.activation")
        with open(os.environ["CHILD_REPORT_FILE"], "w") as out:
            json.dump(
                {
                    "fsdp_shim_imported": "fsdp_shim" in sys.modules,
                    "finders": _finders(),
                    "armed_by": list(getattr(startup, "ARMED_BY", [])),
                    "active": getattr(activation, "_active", None),
                    "patching_code_loaded": [m for m in PATCHING_CODE if m in sys.modules],
                },
                out,
            )

    atexit.register(report)


# ----------------------------------------------------------------------------- one process, whole lifecycle
def _inert_modules() -> list[str]:
    import _fsdp_shim

    return [
        module.name
        for module in pkgutil.walk_packages(_fsdp_shim.__path__, "_fsdp_shim.")
        if not module.name.startswith(NOT_INERT)
    ]


def lifecycle() -> dict[str, Any]:
    """Every module of ``_fsdp_shim`` imported, then Lightning (nothing may be armed or patched), then
    ``import fsdp_shim``, activate five more times, deactivate, activate, deactivate; then activate, a
    reload of the patching code (Jupyter's autoreload), activate, deactivate: the classes read
    directly after each step."""
    from _fsdp_shim import activation

    imported = _inert_modules()
    for name in imported:
        importlib.import_module(name)
    import_all()
    pristine = snapshot()
    inert = {
        "modules": imported,
        "finders": _finders(),
        "armed_by": list(sys.modules["_fsdp_shim"].ARMED_BY),
        "wrappers": wrappers(),
        "as_shipped": as_shipped(pristine),
        "active": activation.status().active,
    }
    import fsdp_shim

    patched = snapshot()
    statuses_on = statuses()
    text = str(fsdp_shim.status())
    for _ in range(5):
        fsdp_shim.activate()
    again = snapshot()
    layers_after_activations = layers()
    fsdp_shim.deactivate()
    restored = snapshot()
    statuses_off = statuses()
    fsdp_shim.activate()
    repatched = snapshot()
    fsdp_shim.deactivate()
    final = snapshot()

    import _fsdp_shim.fixes
    import _fsdp_shim.wrappers

    fsdp_shim.activate()
    before_reload = snapshot()
    importlib.reload(_fsdp_shim.wrappers)
    importlib.reload(_fsdp_shim.fixes)
    fsdp_shim.activate()
    after_reload = snapshot()
    layers_after_reload = layers()
    statuses_after_reload = statuses()
    fsdp_shim.deactivate()
    final_after_reload = snapshot()
    return {
        "inert": inert,
        "pristine_keys": sorted(pristine),
        "patched": changed(pristine, patched),
        "statuses_on": statuses_on,
        "status_text": text,
        "changed_by_activations": changed(patched, again),
        "layers_after_activations": layers_after_activations,
        "restored": changed(pristine, restored),
        "statuses_off": statuses_off,
        "repatched": changed(pristine, repatched),
        "final": changed(pristine, final),
        "final_as_shipped": as_shipped(final),
        "patched_before_reload": changed(pristine, before_reload),
        "changed_by_reload": changed(before_reload, after_reload),
        "layers_after_reload": layers_after_reload,
        "statuses_after_reload": statuses_after_reload,
        "final_after_reload": changed(pristine, final_after_reload),
        "final_after_reload_as_shipped": as_shipped(final_after_reload),
    }


def import_order(imports: list[str]) -> dict[str, Any]:
    """Import these modules in this order (``fsdp_shim`` among them), then read the classes."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name in imports:
            importlib.import_module(name)

    return {
        "wrappers": wrappers(),
        "imported": [n for n in NAMESPACES if n in sys.modules],
        "warnings": shim_warnings(caught),
    }


# ----------------------------------------------------------------------------- gates and failures
def without_class(namespace: str, class_name: str) -> dict[str, Any]:
    """A Lightning that renamed a class the shim needs: imported first, the class removed, then the
    shim, activated twice more (no retry, no second warning). Then strict mode and a later activation:
    the error must surface as itself."""
    importlib.import_module(namespace)
    module = importlib.import_module(f"{namespace}.plugins.precision.fsdp")
    delattr(module, class_name)
    pristine = snapshot()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import fsdp_shim  # activates, and patches at once: Lightning is imported

        fsdp_shim.activate()
        fsdp_shim.activate()
    out: dict[str, Any] = {
        "warnings": shim_warnings(caught),
        "keys": sorted(pristine),
        "changed": changed(pristine, snapshot()),
        "status": statuses()[namespace],
    }
    os.environ["FSDP_SHIM_STRICT"] = "1"
    fsdp_shim.deactivate()
    try:
        fsdp_shim.activate()
        out["error"] = None
    except fsdp_shim.FSDPShimError as error:
        out["error"] = str(error)
        out["error_type"] = f"{type(error).__module__}.{type(error).__qualname__}"
    return out


def _rename_the_cast_target() -> None:
    """The cast's table names a class Lightning does not have (what a Lightning rename looks like)."""
    from _fsdp_shim import fixes

    original = fixes.PLANS["cast"]
    fixes.PLANS["cast"] = lambda namespace, version: tuple(
        dataclasses.replace(target, class_name="RenamedPrecision") if target.attribute == "convert_module" else target
        for target in original(namespace, version)
    )


def with_renamed_target(namespace: str) -> dict[str, Any]:
    import fsdp_shim

    _rename_the_cast_target()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        importlib.import_module(namespace)  # WARNING-LINE: the shim's warning must point here
        fsdp_shim.activate()
    messages, locations = _caught(caught)
    return {
        "warnings": messages,
        "locations": locations,
        "expected_location": [__file__, _line_marked("WARNING-LINE")],
        "wrappers": wrappers(),
        "status": statuses()[namespace],
    }


def import_with_renamed_target(namespace: str) -> None:
    """As above, without catching anything: strict mode or ``-W error`` decide what escapes."""
    import fsdp_shim  # noqa: F401

    _rename_the_cast_target()
    importlib.import_module(namespace)


def with_broken_patch(namespace: str, then: str | None) -> dict[str, Any]:
    """A bug in the shim's patching code: the user's import of ``namespace`` must still work. Then
    strict mode: the import of ``then`` (or, without one, the next activation) fails with an error
    that says it is the shim's."""
    import fsdp_shim
    from _fsdp_shim import wrappers as patching

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("simulated bug in the shim")

    patching.patch = broken  # type: ignore[assignment]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        importlib.import_module(namespace)
    out: dict[str, Any] = {"warnings": shim_warnings(caught), "wrappers": wrappers()}
    os.environ["FSDP_SHIM_STRICT"] = "true"
    try:
        if then is not None:
            importlib.import_module(then)
        else:
            fsdp_shim.activate()
        out["strict_error"] = None
    except fsdp_shim.FSDPShimError as error:
        out["strict_error"] = str(error)
    return out


def toggle(namespace: str, set_in_script: str | None) -> dict[str, Any]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import fsdp_shim  # TOGGLE-LINE

        if set_in_script is not None:
            os.environ["FSDP_SHIM"] = set_in_script
        importlib.import_module(namespace)
        fsdp_shim.status()
    messages, locations = _caught(caught)
    return {
        "wrappers": wrappers(),
        "warnings": messages,
        "locations": locations,
        "expected_location": [__file__, _line_marked("TOGGLE-LINE")],
        "status": statuses()[namespace],
    }


def disabled_fixes(settings: list[str]) -> list[dict[str, Any]]:
    """Lightning imported, then ``import fsdp_shim`` under the first ``FSDP_SHIM_DISABLED_FIXES`` value
    (from the environment); each further value is set in the script between ``deactivate()`` and
    ``activate()``, which reads it again. The classes are read directly after each."""
    import_all()
    pristine = snapshot()
    results = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import fsdp_shim

        for number, setting in enumerate(settings):
            if number:
                fsdp_shim.deactivate()
                os.environ["FSDP_SHIM_DISABLED_FIXES"] = setting
                fsdp_shim.activate()
            assert os.environ["FSDP_SHIM_DISABLED_FIXES"] == setting
            status = fsdp_shim.status()
            results.append(
                {
                    "setting": setting,
                    "changed": changed(pristine, snapshot()),
                    "wrappers": wrappers(),
                    "statuses": statuses(),
                    "disabled_fixes": list(status.disabled_fixes),
                    "status_text": str(status),
                    "warnings": shim_warnings(caught),
                }
            )
    return results


# ----------------------------------------------------------------------------- the recompute's shared wrappers
def _torch_targets() -> dict[str, Any]:
    """What torch's checkpoint modules hold now, in the class and module dicts (a staticmethod itself)."""
    from torch.distributed._composable import checkpoint_activation
    from torch.utils import checkpoint

    return {
        "forward": checkpoint.CheckpointFunction.__dict__["forward"],
        "generator": checkpoint.__dict__[checkpoint_generator()],
        "composable": checkpoint_activation.__dict__[checkpoint_generator()],
    }


def _recompute_entries(namespaces: list[str]) -> dict[str, dict[str, Any]]:
    found = statuses()
    return {ns: next(fix for fix in found[ns]["fixes"] if fix["fix"] == "recompute") for ns in namespaces}


def shared_wrappers() -> dict[str, Any]:
    """The recompute fix's wrappers on torch, shared by every namespace that needs it, in one process:

    1. ``FSDP_SHIM_DISABLED_FIXES=recompute`` at ``import fsdp_shim``, then ``deactivate()`` and
       ``activate()``; then the variable deleted and ``activate()`` again (review C1: the fix stayed
       unpatched while status said "patched").
    2. Which wrapper objects each namespace's record holds; then ``unpatch`` (what ``deactivate()``
       runs per namespace) namespace by namespace: torch's objects stay until the last one.
    3. ``activate()``, and ``torch.set_default_dtype`` counted: a checkpoint whose forward and backward
       both run in float32, one whose forward ran in bfloat16, and the latter after ``deactivate()``.

    torch's objects are compared with the very ones it shipped (read before anything else ran)."""
    import torch

    originals = _torch_targets()
    imported = import_all()
    pristine = snapshot()
    namespaces = [name for name in NAMESPACES if name in sys.modules]
    os.environ["FSDP_SHIM_DISABLED_FIXES"] = "recompute"
    import fsdp_shim
    from _fsdp_shim import wrappers as layer
    from _fsdp_shim.config import RECOMPUTE

    def state() -> dict[str, Any]:
        now = _torch_targets()
        return {
            "torch": {
                key: "as shipped" if obj is originals[key] else "shim" if layer.is_shim_wrapper(obj) else "other"
                for key, obj in now.items()
            },
            "changed": changed(pristine, snapshot()),
            "recompute": _recompute_entries(namespaces),
            "patched": {ns: status["patched"] for ns, status in statuses().items() if ns in namespaces},
            "recompute_dtypes": recompute_dtypes(),
        }

    out: dict[str, Any] = {"imported": imported, "namespaces": namespaces, "switched_off": state()}
    fsdp_shim.deactivate()
    fsdp_shim.activate()
    out["switched_off_again"] = state()
    del os.environ["FSDP_SHIM_DISABLED_FIXES"]
    fsdp_shim.activate()
    out["switched_on"] = state()
    on_torch = _torch_targets()
    out["layers"] = {key: n for key, n in layers().items() if key.startswith("torch.")}
    out["held"] = {  # the very objects on torch, in each namespace's record (the shim's bookkeeping)
        ns: [key for key, obj in on_torch.items() if any(w is obj for w in layer._records[(ns, "recompute")].wrappers)]
        for ns in namespaces
    }
    steps = []
    for ns in namespaces:
        returned = layer.unpatch(ns, RECOMPUTE)
        steps.append(
            {
                "namespace": ns,
                "returned": [key for key, obj in on_torch.items() if any(w is obj for w, _ in returned)],
                "still_the_shims": {key: obj is on_torch[key] for key, obj in _torch_targets().items()},
                **state(),
            }
        )
    out["unpatched"] = steps
    out["restored"] = {key: obj is originals[key] for key, obj in _torch_targets().items()}

    fsdp_shim.activate()
    calls: list[str] = []
    real = torch.set_default_dtype

    def counting(dtype: Any) -> None:
        calls.append(str(dtype))
        real(dtype)

    torch.set_default_dtype = counting  # type: ignore[assignment]
    counted: dict[str, Any] = {}
    for name, forward in (("same", "torch.float32"), ("changed", "torch.bfloat16")):
        calls.clear()
        counted[name] = {"recompute_dtypes": recompute_dtypes(forward, "torch.float32"), "calls": len(calls)}
    fsdp_shim.deactivate()
    calls.clear()
    counted["changed_unpatched"] = {"recompute_dtypes": recompute_dtypes(), "calls": len(calls)}
    torch.set_default_dtype = real  # type: ignore[assignment]
    out["set_default_dtype"] = counted
    out["final"] = {
        "restored": {key: obj is originals[key] for key, obj in _torch_targets().items()},
        "changed": changed(pristine, snapshot()),
        "as_shipped": all(as_shipped(snapshot()).values()),
    }
    return out


# ----------------------------------------------------------------------------- armed at start-up
def armed_at_startup(patched_at_import: str, imported_while_off: str) -> dict[str, Any]:
    """``FSDP_SHIM=1`` in the environment (the ``.pth`` file arms the finder at start-up): the first
    namespace is imported and patched at its import; the second is imported with ``FSDP_SHIM=0`` set in
    the script (not handed over); then ``FSDP_SHIM=1`` again and ``import fsdp_shim`` (review C2). Then
    ``FSDP_SHIM=0`` set after Lightning was patched (review C3): what ``status()`` says, and that
    ``deactivate()`` still removes everything."""
    import _fsdp_shim

    out: dict[str, Any] = {"armed_by_at_start": list(_fsdp_shim.ARMED_BY)}
    importlib.import_module(patched_at_import)
    out["at_import"] = wrappers()
    os.environ["FSDP_SHIM"] = "0"
    importlib.import_module(imported_while_off)
    out["while_off"] = wrappers()
    os.environ["FSDP_SHIM"] = "1"
    import fsdp_shim

    out["on"] = {"statuses": statuses(), "wrappers": wrappers(), "sources": list(fsdp_shim.status().sources)}
    os.environ["FSDP_SHIM"] = "0"
    status = fsdp_shim.status()
    out["off"] = {"text": str(status), "statuses": statuses(), "wrappers": wrappers(), "enabled": status.enabled}
    fsdp_shim.deactivate()
    out["deactivated"] = {"wrappers": wrappers(), "as_shipped": all(as_shipped(snapshot()).values())}
    return out


# ----------------------------------------------------------------------------- logging
def logs(namespace: str) -> None:
    """The records at import (logging configured at DEBUG, to stdout); then, with logging
    unconfigured again (as in most scripts), conversions to bf16-true and 32-true, a marker on stderr,
    and conversions to 16-true: the float16 notice must reach stderr by itself, once."""
    logging.basicConfig(level=logging.DEBUG, stream=sys.stdout, format="%(name)s %(levelname)s %(message)s")
    import fsdp_shim  # noqa: F401

    import_all()
    sys.stdout.flush()
    for handler in list(logging.root.handlers):
        logging.root.removeHandler(handler)
    logging.root.setLevel(logging.WARNING)
    plugin_class = precision_class(namespace)
    for precision in ("bf16-true", "32-true"):
        for _ in range(2):
            converted_dtype(plugin_class, precision)
    sys.stderr.write("MARKER: 16-true from here\n")
    sys.stderr.flush()
    for _ in range(2):
        converted_dtype(plugin_class, "16-true")


# ----------------------------------------------------------------------------- glue that fails at call time
def _checkpoint_by_keyword(block: Any, x: Any) -> Any:
    """A non-reentrant checkpoint written against another calling convention of torch's generator (its
    function by keyword), the way ``torch.utils.checkpoint.checkpoint`` drives it: what a torch that
    changed its convention looks like to the shim's wrapper."""
    from torch.utils import checkpoint

    generator = checkpoint._checkpoint_without_reentrant_generator(fn=block, preserve_rng_state=True, x=x)
    next(generator)
    out = block(x=x)
    with contextlib.suppress(StopIteration):
        next(generator)
    return out


def _recompute_by_keyword() -> str:
    """``recompute_dtype(reentrant=False)`` through ``_checkpoint_by_keyword``."""
    import torch

    from children.classes import default_dtype

    seen: list[str] = []

    def block(x: torch.Tensor) -> torch.Tensor:
        seen.append(str(torch.get_default_dtype()))
        return torch.sin(x)

    x = torch.ones(2, requires_grad=True)
    with default_dtype("torch.bfloat16"):
        out = _checkpoint_by_keyword(block, x)
    out.sum().backward()
    forward, recompute = seen
    assert forward == "torch.bfloat16", forward
    return recompute


def _strategy(namespace: str, plugin: Any) -> Any:
    """Fabric's FSDP strategy on this CPU with ``plugin``, as Fabric's connector builds it."""
    import torch

    accelerator = importlib.import_module(f"{namespace}.accelerators").CPUAccelerator()
    environment = importlib.import_module(f"{namespace}.plugins.environments").LightningEnvironment()
    fsdp = importlib.import_module(f"{namespace}.strategies.fsdp")
    return fsdp.FSDPStrategy(
        accelerator=accelerator,
        parallel_devices=[torch.device("cpu")],
        cluster_environment=environment,
        precision=plugin,
    )


def glue_fallback(namespace: str) -> dict[str, Any]:
    """What the shim's wrappers read went missing at call time: a cast whose plugin lost
    ``_desired_input_dtype`` (a renamed Lightning attribute), a non-reentrant checkpoint that hands
    torch's generator its function by keyword (torch changed its calling convention), and Fabric's
    ``FSDPStrategy.setup_environment`` whose precision plugin has no ``precision``. Each call falls back
    to the function the shim wrapped, once said; healthy calls keep both fixes. Then the same in
    strict mode: errors, and no claim of falling back. The rank check is counted where the shim's body
    calls it (``rank_check.confirm_every_rank``: in one process it returns at once)."""
    import torch

    import fsdp_shim
    from _fsdp_shim import rank_check

    importlib.import_module(namespace)
    fsdp_class = precision_class(namespace)
    confirmed: list[list[str]] = []
    confirm = rank_check.confirm_every_rank

    def counting(where: str, dtype: Any, joined_here: bool = False) -> None:
        confirmed.append([where, str(dtype)])
        confirm(where, dtype, joined_here)

    rank_check.confirm_every_rank = counting  # type: ignore[assignment]

    class WithoutPrecision(fsdp_class):  # type: ignore[misc, valid-type]
        @property
        def precision(self) -> str:
            raise AttributeError("'precision' is gone (what a Lightning rename looks like)")

    def without_precision() -> Any:
        plugin = fsdp_class(precision="bf16-true")  # its __init__ reads `precision`: the class changes after
        plugin.__class__ = WithoutPrecision
        return plugin

    def without_dtype() -> Any:
        plugin = fsdp_class(precision="bf16-true")
        del plugin._desired_input_dtype  # instance-only: `precision` has a class default
        return plugin

    def call(name: str) -> Any:
        if name == "cast":
            return str(without_dtype().convert_module(torch.nn.Linear(2, 2)).weight.dtype)
        if name == "checkpoint":
            return _recompute_by_keyword()
        before = len(confirmed)
        _strategy(namespace, without_precision()).setup_environment()
        return f"rank checks: {len(confirmed) - before}"

    names = ("cast", "checkpoint", "setup_environment")
    results: dict[str, list[str]] = {}
    errors: dict[str, list[str]] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name in names:
            results[name] = [call(name) for _ in range(2)]
    out: dict[str, Any] = {"results": results, "warnings": shim_warnings(caught)}
    out["status"] = fsdp_shim.status().namespace(namespace).as_dict()
    _strategy(namespace, fsdp_class(precision="bf16-true")).setup_environment()
    out["healthy"] = {
        "cast": converted_dtype(fsdp_class),
        **recompute_dtypes(),
        "setup_environment": confirmed,
    }
    os.environ["FSDP_SHIM_STRICT"] = "1"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name in names:
            errors[name] = []
            for _ in range(2):
                try:
                    call(name)
                except fsdp_shim.FSDPShimError as error:
                    errors[name].append(str(error))
    out.update(strict_errors=errors, strict_warnings=shim_warnings(caught))
    return out


# ----------------------------------------------------------------------------- real FSDP
def late_activation(namespace: str) -> dict[str, Any]:
    """Activation after Lightning's import patches at once and says so; a model FSDP wrapped before
    keeps its dtype, and the user is told once."""
    import torch

    from _fsdp_shim.verify import cpu_guards

    pl = importlib.import_module(namespace)
    cpu_guards.lift(namespace)

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(8, 8)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.layer(batch[0]).float().pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.trainer.model.parameters())

    def fit() -> Any:
        model = Tiny()
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=1,
            strategy=importlib.import_module(f"{namespace}.strategies").FSDPStrategy(),
            precision="bf16-true",
            max_steps=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        data = torch.utils.data.TensorDataset(torch.randn(4, 8))
        trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=4))
        return model, trainer

    before, _trainer = fit()  # kept alive: the shim counts the FSDP models that exist
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import fsdp_shim
    after, _ = fit()
    status = fsdp_shim.status().namespace(namespace)
    return {
        "warnings": shim_warnings(caught),
        "late": status.activated_after_import,
        "patched": status.patched,
        "before": str(before.dtype),
        "after": str(after.dtype),
    }
