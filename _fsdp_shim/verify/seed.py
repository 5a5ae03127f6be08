"""The model verify trains without ``--model``: two copies of Lightning's demo Transformer, one built in
``configure_model``, one loaded in float32 as ``from_pretrained`` does, each its own FSDP unit (no mixed dtypes)."""

from __future__ import annotations

import functools
import importlib
from typing import Any

VOCAB, SEQUENCE, BATCH = 256, 32, 4
UNITS = {"pretrained": "model loaded in float32 (from_pretrained)", "model": "seed model, built in configure_model"}


def build(pl: Any, steps: int, devices: int) -> tuple[Any, Any, dict[str, Any]]:
    """The seed LightningModule, its training data, and the FSDPStrategy keyword arguments."""
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    transformer = importlib.import_module(f"{pl.__name__}.demos").Transformer
    make = functools.partial(transformer, vocab_size=VOCAB, nlayers=2, nhid=256, ninp=128, nhead=4, dropout=0.0)

    class SeedModel(pl.LightningModule):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.model: torch.nn.Module | None = None
            self.pretrained: torch.nn.Module | None = None

        def configure_model(self) -> None:
            if self.model is not None:
                return
            with torch.device("meta"):
                self.model = make()
            self.pretrained = make().float()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (tokens,) = batch
            inputs, target = tokens[:, :-1], tokens[:, 1:]
            losses = [F.nll_loss(m(inputs, target).float(), target.reshape(-1)) for m in (self.model, self.pretrained)]
            return losses[0] + losses[1]

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.trainer.model.parameters(), lr=1e-4)

    shape = (BATCH * steps * devices, SEQUENCE + 1)
    tokens = torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(tokens), batch_size=BATCH)
    return SeedModel(), loader, {"auto_wrap_policy": {transformer}}
