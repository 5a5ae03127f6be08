"""Activation, gates, failure isolation and messages, each run in a fresh interpreter."""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import sys
import warnings
from typing import Any

from children.classes import changed, import_all, precision_class, shim_warnings, snapshot, statuses, wrappers


def import_needs_neither_torch_nor_lightning() -> dict[str, Any]:
    class Block:
        def find_spec(self, name: str, path: object = None, target: object = None) -> None:
            if name.partition(".")[0] in ("torch", "lightning", "pytorch_lightning", "lightning_fabric"):
                raise ImportError(f"blocked: {name}")

    sys.meta_path.insert(0, Block())
    import fsdp_shim

    # The patching code (wrapt, packaging, logging) waits for Lightning's import.
    heavy = ("torch", "lightning", "wrapt", "packaging", "fsdp_shim.integration")
    loaded = sorted(m for m in heavy if m in sys.modules)
    status = fsdp_shim.status()
    return {
        "loaded": loaded,
        "active": status.active,
        "version": fsdp_shim.__version__,
        "after_status": sorted(m for m in ("torch", "lightning") if m in sys.modules),
    }


def activate_many_times() -> dict[str, Any]:
    import fsdp_shim
    from fsdp_shim.patching import is_shim_wrapper, wrapper_chain

    import_all()
    first = snapshot()
    for _ in range(5):
        fsdp_shim.activate()
    after = snapshot()
    layers = {key: sum(is_shim_wrapper(layer) for layer in wrapper_chain(obj)) for key, obj in after.items()}
    return {"changed": changed(first, after), "layers": layers, "wrappers": wrappers()}


def deactivate_restores_identity() -> dict[str, Any]:
    import_all()
    pristine = snapshot()
    import fsdp_shim

    patched = changed(pristine, snapshot())
    fsdp_shim.deactivate()
    restored = changed(pristine, snapshot())
    fsdp_shim.activate()
    repatched = changed(pristine, snapshot())
    fsdp_shim.deactivate()
    return {
        "patched": patched,
        "restored": restored,
        "repatched": repatched,
        "final": changed(pristine, snapshot()),
        "inherits": inherits_convert_module(),
        "status": statuses(),
    }


def inherits_convert_module() -> dict[str, bool]:
    """Per Trainer namespace: does the precision class get ``convert_module`` exactly as shipped?"""
    from fsdp_shim.patching import is_shim_wrapper

    out = {}
    for namespace in ("lightning.pytorch", "pytorch_lightning"):
        if namespace not in sys.modules:
            continue
        module = importlib.import_module(f"{namespace}.plugins.precision.fsdp")
        cls = getattr(module, "FSDPPrecision", None) or getattr(module, "FSDPPrecisionPlugin", None)
        if cls is None:  # 2.0.x: no true-precision FSDP plugin at all
            continue
        if "convert_module" in cls.__dict__:  # fixed upstream: its own method, never the shim's
            out[namespace] = not is_shim_wrapper(cls.__dict__["convert_module"])
            continue
        base = next(b for b in cls.__mro__[1:] if "convert_module" in b.__dict__)
        out[namespace] = cls.convert_module is base.__dict__["convert_module"]
    return out


def import_in_order(modules: list[str]) -> dict[str, Any]:
    for name in modules:
        importlib.import_module(name)
    from children.classes import NAMESPACES

    return {"wrappers": wrappers(), "imported": [n for n in NAMESPACES if n in sys.modules]}


def shim_after_lightning() -> dict[str, Any]:
    import_all()
    pristine = snapshot()
    import fsdp_shim  # noqa: F401

    return {"changed": changed(pristine, snapshot()), "status": statuses()}


def without_class(namespace: str, class_name: str) -> dict[str, Any]:
    """A Lightning that renamed a class the shim needs: imported first, the class removed, then the
    shim. Every other class, including the deprecated subclass of the same name family, stays."""
    importlib.import_module(namespace)
    module = importlib.import_module(f"{namespace}.plugins.precision.fsdp")
    delattr(module, class_name)
    pristine = snapshot()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            import fsdp_shim  # activates, and patches at once: Lightning is imported

            fsdp_shim.activate()  # activating again neither retries nor warns again
            fsdp_shim.activate()
            error = None
        except Exception as raised:  # the class is not imported before the shim is: it would activate it
            if type(raised).__name__ != "FSDPShimError":
                raise
            error = str(raised)
    out = {"warnings": shim_warnings(caught), "changed": changed(pristine, snapshot()), "error": error}
    if error is None:
        out["status"] = statuses()
    return out


def with_renamed_target(namespace: str) -> dict[str, Any]:
    """The shim's target table names a class Lightning does not have; the hook fires at import."""
    import fsdp_shim.backport as backport

    original = backport.precision_convert_module
    backport.precision_convert_module = lambda ns, version: dataclasses.replace(  # type: ignore[assignment]
        original(ns, version), class_name="RenamedPrecision"
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        importlib.import_module(namespace)  # WARNING-LINE: the shim's warning must point here
        import fsdp_shim

        fsdp_shim.activate()
    found = [w for w in caught if w.category.__name__ == "FSDPShimWarning"]
    return {
        "warnings": [str(w.message) for w in found],
        "locations": [[w.filename, w.lineno] for w in found],
        "expected_location": [__file__, _line_marked("WARNING-LINE")],
        "wrappers": wrappers(),
        "status": statuses(),
    }


def _line_marked(marker: str) -> int:
    with open(__file__) as source:
        for number, line in enumerate(source, 1):
            if f"# {marker}" in line:
                return number
    raise LookupError(marker)


def import_with_renamed_target(namespace: str) -> None:
    """As above, without catching anything: strict mode or ``-W error`` decide what escapes."""
    import fsdp_shim.backport as backport

    original = backport.precision_convert_module
    backport.precision_convert_module = lambda ns, version: dataclasses.replace(  # type: ignore[assignment]
        original(ns, version), class_name="RenamedPrecision"
    )
    importlib.import_module(namespace)


def with_broken_patch(namespace: str) -> dict[str, Any]:
    import fsdp_shim  # noqa: F401
    import fsdp_shim.integration as integration

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("simulated bug in the shim")

    integration.patch = broken  # type: ignore[assignment]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        importlib.import_module(namespace)
    return {"warnings": shim_warnings(caught), "wrappers": wrappers()}


def toggle(namespace: str, set_in_script: str | None) -> dict[str, Any]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import fsdp_shim  # TOGGLE-LINE

        if set_in_script is not None:
            os.environ["FSDP_SHIM"] = set_in_script
        importlib.import_module(namespace)
        fsdp_shim.status()
    found = [w for w in caught if w.category.__name__ == "FSDPShimWarning"]
    return {
        "wrappers": wrappers(),
        "warnings": [str(w.message) for w in found],
        "locations": [[w.filename, w.lineno] for w in found],
        "expected_location": [__file__, _line_marked("TOGGLE-LINE")],
        "status": statuses(),
    }


def log_lines() -> None:
    logging.basicConfig(level=logging.DEBUG, stream=sys.stdout, format="%(name)s %(levelname)s %(message)s")
    import fsdp_shim  # noqa: F401

    import_all()


def glue_fallback(namespace: str) -> dict[str, Any]:
    """A plugin missing an attribute the shim reads (what a renamed Lightning attribute looks like)."""
    import torch

    import fsdp_shim
    from fsdp_shim.errors import FSDPShimError

    importlib.import_module(namespace)
    plugin = precision_class(namespace)(precision="bf16-true")
    del plugin._desired_input_dtype  # instance-only: `precision` has a class default
    results, errors = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            try:
                results.append(str(plugin.convert_module(torch.nn.Linear(2, 2)).weight.dtype))
            except FSDPShimError as error:
                errors.append(str(error))
    healthy = precision_class(namespace)(precision="bf16-true").convert_module(torch.nn.Linear(2, 2))
    return {
        "dtypes": results,
        "errors": errors,
        "warnings": shim_warnings(caught),
        "status": fsdp_shim.status().namespace(namespace).as_dict(),
        "healthy_plugin_dtype": str(healthy.weight.dtype),
    }


def late_activation(namespace: str) -> dict[str, Any]:
    """Activation after Lightning's import patches at once and says so; a model FSDP wrapped before
    keeps its dtype, and the user is told once."""
    import torch

    from children.cpu import lift_gpu_guards

    pl = importlib.import_module(namespace)
    lift_gpu_guards(namespace)

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

    before, _trainer = fit()
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


def reload_and_deactivate() -> dict[str, Any]:
    """A reloaded copy of the shim's modules (Jupyter's autoreload) finds the wrappers the first copy
    installed, takes them over instead of wrapping them again, and still restores Lightning exactly."""
    import_all()
    pristine = snapshot()
    import fsdp_shim
    import fsdp_shim.integration
    import fsdp_shim.patching

    patched = snapshot()
    importlib.reload(fsdp_shim.patching)
    importlib.reload(fsdp_shim.integration)
    fsdp_shim.activate()
    changed_by_reload = changed(patched, snapshot())
    from fsdp_shim.patching import is_shim_wrapper, wrapper_chain

    layers = {key: sum(is_shim_wrapper(layer) for layer in wrapper_chain(obj)) for key, obj in snapshot().items()}
    status_after_reload = statuses()
    fsdp_shim.deactivate()
    return {
        "changed_by_reload": changed_by_reload,
        "layers": layers,
        "patched_keys": changed(pristine, patched),
        "status_after_reload": status_after_reload,
        "final": changed(pristine, snapshot()),
    }


def convert_with(namespace: str, precisions: list[str]) -> None:
    """Convert twice per precision; the shim's float16 notice goes to stderr through logging."""
    import torch

    import fsdp_shim  # noqa: F401

    importlib.import_module(namespace)
    for precision in precisions:
        for _ in range(2):
            precision_class(namespace)(precision=precision).convert_module(torch.nn.Linear(2, 2))
