"""The worked example of docs/verify-your-model.md: a model as a team writes it, nothing of fsdp-shim in it.

Its encoder is built in ``__init__`` and its head is loaded from a float32 checkpoint in
``configure_model``, as ``from_pretrained`` does: on Lightning 2.1–2.4 both stay float32 under FSDP
with ``precision="bf16-true"``.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class MyModel(L.LightningModule):
    def __init__(self, features: int = 64, hidden: int = 256) -> None:
        super().__init__()
        self.features, self.hidden = features, hidden
        self.encoder = nn.Sequential(
            nn.Linear(features, hidden),
            nn.GELU(),
            nn.Linear(hidden, hidden),
        )
        self.head: nn.Module | None = None

    def configure_model(self) -> None:
        if self.head is not None:
            return
        std = self.hidden**-0.5
        checkpoint = {  # what torch.load gives for a float32 checkpoint
            "weight": torch.randn(self.features, self.hidden, dtype=torch.float32) * std,
            "bias": torch.zeros(self.features, dtype=torch.float32),
        }
        self.head = nn.Linear(self.hidden, self.features)
        self.head.load_state_dict(checkpoint, assign=True)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        x = x.to(self.encoder[0].weight.dtype)
        return nn.functional.mse_loss(self.head(self.encoder(x)).float(), x.float())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        data = torch.randn(256, self.features, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(data), batch_size=16)
