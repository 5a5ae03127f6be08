"""Model shapes for the cast fix, trained with real FSDP on one CPU rank (see ``tests/child.py``):
a model holding bfloat16 and float32 layers (Lightning #20239), and one with BatchNorm."""

from __future__ import annotations

import importlib
import sys
from typing import Any


def fit_all(runs: list[tuple[str, str, bool]], import_shim: bool) -> list[dict[str, Any]]:
    """:func:`fit` for each ``(namespace, shape, auto_wrap)`` in turn, in this one interpreter (an
    interpreter per run would cost each the import of torch and Lightning again): each run is a Trainer
    or Fabric of its own on the one process group, and a run that raised leaves the next as it found it."""
    if import_shim:
        import fsdp_shim  # noqa: F401
    return [fit(*run) for run in runs]


def fit(namespace: str, shape: str, auto_wrap: bool) -> dict[str, Any]:
    """Two steps of ``bf16-true`` with FSDP through the Trainer or Fabric; the parameters' dtypes
    after training, or the error training raised."""
    import torch
    from torch import nn

    from _fsdp_shim.verify import cpu_guards

    importlib.import_module(namespace)
    cpu_guards.lift(namespace)

    def model() -> nn.Module:
        torch.manual_seed(0)
        if shape == "batchnorm":
            return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 8))
        return nn.Sequential(nn.Linear(8, 8).to(torch.bfloat16), nn.Linear(8, 8))  # #20239: bf16 next to fp32

    policy = {"auto_wrap_policy": {nn.Linear, nn.BatchNorm1d}} if auto_wrap else {}
    strategy = importlib.import_module(f"{namespace}.strategies").FSDPStrategy(**policy)
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    try:
        if namespace in ("lightning.fabric", "lightning_fabric"):
            fabric = sys.modules[namespace].Fabric(
                accelerator="cpu", devices=1, strategy=strategy, precision="bf16-true"
            )
            fabric.launch()
            module = fabric.setup_module(model())
            optimizer = fabric.setup_optimizers(torch.optim.SGD(module.parameters(), lr=0.1))
            for batch in x.split(8):
                fabric.backward(module(batch).float().pow(2).mean())
                optimizer.step()
                optimizer.zero_grad()
            wrapped = module
        else:
            pl = sys.modules[namespace]

            class Model(pl.LightningModule):  # type: ignore[misc, name-defined]
                def __init__(self) -> None:
                    super().__init__()
                    self.net = model()

                def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
                    return self.net(batch[0]).float().pow(2).mean()

                def configure_optimizers(self) -> torch.optim.Optimizer:
                    return torch.optim.SGD(self.trainer.model.parameters(), lr=0.1)

            trainer = pl.Trainer(
                accelerator="cpu", devices=1, strategy=strategy, precision="bf16-true", max_steps=2, logger=False,
                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            )  # fmt: skip
            trainer.fit(Model(), torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=8))
            wrapped = trainer.strategy.model
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}"}
    dtypes = {name: str(p.dtype) for name, p in wrapped.named_parameters()}
    norm = {name: dtype for name, dtype in dtypes.items() if ".1." in f".{name}."}  # the layer at index 1
    return {"error": None, "dtypes": sorted(set(dtypes.values())), "batchnorm": sorted(set(norm.values()))}
