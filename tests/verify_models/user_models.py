"""User code for ``fsdp-shim verify --model`` tests: modules as a team would write them, nothing
fsdp-shim-specific in them. ``FSDP_SHIM_TEST_LIGHTNING`` picks the Lightning they are written against
(``lightning.pytorch`` by default, ``pytorch_lightning`` for the standalone package)."""

from __future__ import annotations

import importlib
import os
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pl = importlib.import_module(os.environ.get("FSDP_SHIM_TEST_LIGHTNING", "lightning.pytorch"))

FEATURES = 16


def _data() -> DataLoader:
    features = torch.randn(64, FEATURES, generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(features), batch_size=4)


class ThreeWays(pl.LightningModule):
    """Layers built in ``__init__``, in ``configure_model`` and loaded from a float32 state dict:
    all three are float32 when FSDP wraps them on an affected Lightning."""

    def __init__(self, hidden: int = 32, eps: float = 1e-8) -> None:
        super().__init__()
        self.hidden = hidden
        self.eps = eps
        self.encoder = nn.Linear(FEATURES, hidden)  # built in __init__: float32
        self.block: nn.Module | None = None
        self.head: nn.Module | None = None

    def configure_model(self) -> None:
        if self.block is not None:
            return
        self.block = nn.Sequential(nn.Linear(self.hidden, self.hidden), nn.ReLU()).float()  # as from_pretrained
        # As read from a float32 checkpoint (inside configure_model the default dtype is the precision's).
        pretrained = {
            "weight": torch.randn(FEATURES, self.hidden, dtype=torch.float32),
            "bias": torch.zeros(FEATURES, dtype=torch.float32),
        }
        self.head = nn.Linear(self.hidden, FEATURES)
        self.head.load_state_dict(pretrained, assign=True)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return self.head(self.block(self.encoder(x.to(self.encoder.weight.dtype)))).float().pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.trainer.model.parameters(), lr=1e-3, eps=self.eps)

    def train_dataloader(self) -> DataLoader:
        return _data()


def make_model() -> ThreeWays:
    """A factory, as a team's code often has one."""
    return ThreeWays(hidden=48)


class NoData(ThreeWays):
    train_dataloader = pl.LightningModule.train_dataloader  # as if never defined


class Data(pl.LightningDataModule):
    def train_dataloader(self) -> DataLoader:
        return _data()


class RaisesInTrainingStep(ThreeWays):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        raise ValueError("a bug in the user's training_step")


_built_here = 0


class BuiltOncePerProcess(ThreeWays):
    """Ends its process when built a second time in it, as a native library initialized twice may crash."""

    def __init__(self) -> None:
        global _built_here
        _built_here += 1
        if _built_here > 1:
            os._exit(3)
        super().__init__()


class CastsItself(pl.LightningModule):
    """Casts itself to bfloat16 in ``__init__``: right without the shim, which changes nothing for it."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(FEATURES, FEATURES)
        self.to(torch.bfloat16)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return self.layer(x.to(torch.bfloat16)).float().pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.trainer.model.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        return _data()


class Block(nn.Module):
    """A block that makes a tensor without a dtype in its forward, as causal masks and rotary
    frequencies often are: the precision's dtype in Lightning's forward, float32 where activation
    checkpointing recomputes the block, in the backward. ``cast`` converts it to the input's dtype
    (as ``mask.to(scores.dtype)``): then the dtype is the same and only the values differ."""

    def __init__(self, cast: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(FEATURES, FEATURES)
        self.cast = cast

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.lin(x))
        if self.cast:
            return h * torch.linspace(0.5, 1.5, FEATURES).to(h.dtype)
        return h * torch.ones(FEATURES)


class Checkpointed(pl.LightningModule):
    """Two such blocks and a head, built in ``__init__``: ``--activation-checkpointing user_models:Block``."""

    def __init__(self, cast: bool = False) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Block(cast), Block(cast))
        self.head = nn.Linear(FEATURES, FEATURES)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return self.head(self.blocks(x.to(self.head.weight.dtype))).float().pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.trainer.model.parameters(), lr=1e-2)

    def train_dataloader(self) -> DataLoader:
        return _data()


def casting_checkpointed() -> Checkpointed:
    """``Checkpointed`` whose blocks cast what they make to the input's dtype."""
    return Checkpointed(cast=True)


class ChecksItsOwnForward(pl.LightningModule):
    """Checkpoints its blocks in its own forward with ``torch.utils.checkpoint`` (no Lightning policy), built in
    ``configure_model``, so they are the precision's dtype with the shim or without: unpatched, the recompute
    makes ``torch.ones`` in float32, and the backward raises, so the run without the shim never trains."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks: nn.ModuleList | None = None
        self.head: nn.Module | None = None

    def configure_model(self) -> None:
        if self.blocks is not None:
            return
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(FEATURES, FEATURES)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        h = x.to(self.head.weight.dtype)
        for block in self.blocks:
            h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)
        return self.head(h).float().pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.trainer.model.parameters(), lr=1e-2)

    def train_dataloader(self) -> DataLoader:
        return _data()
