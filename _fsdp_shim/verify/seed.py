"""The model verify trains without ``--model``: two copies of Lightning's demo Transformer, one built in
``configure_model``, one loaded in float32 as ``from_pretrained`` does, and a small causal block that makes
tensors without an explicit dtype, as causal masks often are; each its own FSDP unit (no mixed dtypes). The
runs that check the recompute checkpoint the block (``CHECKPOINTED``) with Lightning's policy."""

from __future__ import annotations

import functools
import importlib
from typing import Any

VOCAB, SEQUENCE, BATCH, WIDTH = 256, 32, 4, 32
UNITS = {
    "pretrained": "model loaded in float32 (from_pretrained)",
    "model": "seed model, built in configure_model",
    "block": "causal block, built in configure_model",
}


CHECKPOINTED = "CausalBlock"
"""The seed's checkpointed class, named as the recompute verdict names ``--activation-checkpointing`` classes."""


@functools.cache
def causal_block() -> type:
    """``CausalBlock``, made once (torch is imported only here: verify's own process imports this module)."""
    import torch
    from torch import nn

    class CausalBlock(nn.Module):
        """Attention over the tokens up to each one, with a causal mask from ``torch.full(..., -inf).triu(1)``
        and a scale from ``torch.ones``: neither has an explicit dtype, so both are the precision's dtype in
        Lightning's forward, and float32 where activation checkpointing recomputes the block in the backward."""

        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, WIDTH)
            self.out = nn.Linear(WIDTH, VOCAB)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            h = self.embed(tokens) * torch.ones(WIDTH)
            length = tokens.shape[-1]
            mask = torch.full((length, length), float("-inf")).triu(1)
            scores = h @ h.transpose(-1, -2) * WIDTH**-0.5 + mask
            return torch.log_softmax(self.out(scores.softmax(-1) @ h), -1)

    return CausalBlock


def build(pl: Any, steps: int, devices: int) -> tuple[Any, Any, dict[str, Any]]:
    """The seed LightningModule, its training data, and the FSDPStrategy keyword arguments."""
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    transformer = importlib.import_module(f"{pl.__name__}.demos").Transformer
    make = functools.partial(transformer, vocab_size=VOCAB, nlayers=2, nhid=256, ninp=128, nhead=4, dropout=0.0)

    class SeedModel(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model: nn.Module | None = None
            self.pretrained: nn.Module | None = None
            self.block: nn.Module | None = None

        def configure_model(self) -> None:
            if self.model is not None:
                return
            with torch.device("meta"):
                self.model = make()
            self.pretrained = make().float()
            self.block = causal_block()()  # the precision's dtype on every release: Lightning's init context

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (tokens,) = batch
            inputs, target = tokens[:, :-1], tokens[:, 1:]
            models = (self.model, self.pretrained)
            losses = [F.nll_loss(m(inputs, target).float(), target.reshape(-1)) for m in models]  # type: ignore[misc]
            block = F.nll_loss(self.block(inputs).float().reshape(-1, VOCAB), target.reshape(-1))  # type: ignore[misc]
            return losses[0] + losses[1] + block

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.trainer.model.parameters(), lr=1e-4)

    shape = (BATCH * steps * devices, SEQUENCE + 1)
    tokens = torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(tokens), batch_size=BATCH)
    return SeedModel(), loader, {"auto_wrap_policy": {transformer, causal_block()}}
