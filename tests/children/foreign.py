"""A finder in front of the shim's import watcher that loads Lightning itself, as instrumenting import
hooks do, then a real FSDP fit on CPU: does the model end up in the precision's dtype?"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import warnings
from typing import Any

from children.classes import PACKAGES


class Instrumenter:
    """Answers for every Lightning module with the path finder's spec: the shim's watcher never sees them."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> Any:
        if name.partition(".")[0] in PACKAGES:
            return importlib.machinery.PathFinder.find_spec(name, path)  # type: ignore[arg-type]
        return None

    def __repr__(self) -> str:
        return "<test Instrumenter>"


def fit(namespace: str, import_shim: bool) -> dict[str, Any]:
    """``import_shim``: ``import fsdp_shim`` first; else a start-up file must have armed the shim."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if import_shim:
            import fsdp_shim  # noqa: F401
        sys.meta_path.insert(0, Instrumenter())
        pl = importlib.import_module(namespace)
        import torch
        from torch.utils.data import DataLoader, TensorDataset

        from _fsdp_shim.verify import cpu_guards

        cpu_guards.lift(namespace)

        class Model(pl.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.layer = torch.nn.Linear(8, 8)

            def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
                (x,) = batch
                return self.layer(x.to(self.layer.weight.dtype)).float().pow(2).mean()

            def configure_optimizers(self) -> torch.optim.Optimizer:
                return torch.optim.SGD(self.trainer.model.parameters(), lr=0.1)

        model = Model()
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
        trainer.fit(model, DataLoader(TensorDataset(torch.randn(8, 8)), batch_size=4))
    activation = sys.modules.get("_fsdp_shim.activation")
    status = activation.status() if activation is not None else None
    return {
        "loaded": activation is not None,
        "sources": list(status.sources) if status else [],
        "param_dtypes": sorted({str(p.dtype) for p in trainer.strategy.model.parameters()}),
        "module_dtype": str(model.dtype),
        "status": status.namespace(namespace).as_dict() if status else None,
        "warnings": [str(w.message) for w in caught if w.category.__name__ == "FSDPShimWarning"],
    }
