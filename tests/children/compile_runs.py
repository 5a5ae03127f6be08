"""``torch.compile`` (``aot_eager``) with a bfloat16 default dtype around the forward, as Lightning's
``bf16-true`` runs it, with or without fsdp-shim, for ``tests/test_compile.py``.

``train`` builds a small bfloat16 model, compiles it, runs a few steps (forward under
``torch.set_default_dtype(torch.bfloat16)``, the default dtype put back before the backward) and says
how it went: ``{"outcome": "trained", "losses": [...], "grads": [...]}`` (every value as
``float.hex``, so the comparison is bit for bit) or ``{"outcome": "failed", "error": "..."}``.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any


def train_cases(shim: bool, cases: list[list[str]], steps: int = 2) -> list[dict[str, Any]]:
    """``train`` for each ``[checkpoint, block]`` in one process (compiled autograd on, ``aot_eager``),
    with torch.compile's caches reset between cases."""
    results = []
    for checkpoint, block in cases:
        results.append(train(shim, checkpoint, block, steps=steps))
        import torch._dynamo

        torch._dynamo.reset()
    return results


def train(
    shim: bool,
    checkpoint: str = "reentrant",
    block: str = "ones",
    compiled_autograd: bool = True,
    backend: str = "aot_eager",
    steps: int = 2,
) -> dict[str, Any]:
    """``checkpoint``: ``none``, ``reentrant`` or ``nonreentrant`` around the block; ``block``: ``ones``
    (makes a tensor without an explicit dtype, as a causal mask from ``torch.full`` does) or ``plain``."""
    if shim:
        importlib.import_module("fsdp_shim")  # first, as a training script does
        # the shim patches torch's checkpoint when Lightning is imported (either layout)
        importlib.import_module("lightning" if importlib.util.find_spec("lightning") else "pytorch_lightning")
    import torch
    import torch._dynamo
    import torch.utils.checkpoint

    from_shim = [type(vars(torch.utils.checkpoint.CheckpointFunction)["forward"]).__name__]
    if compiled_autograd:
        torch._dynamo.config.compiled_autograd = True

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = torch.nn.Linear(16, 16)
            self.fc2 = torch.nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.relu(self.fc1(x))
            if block == "ones":
                h = h * torch.ones(h.shape[-1])  # the default dtype's: bfloat16 in the forward
            return self.fc2(h)

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = torch.nn.Linear(16, 16)
            self.block = Block()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.inner(x)
            if checkpoint == "none":
                h = self.block(h)
            else:
                h = torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=checkpoint == "reentrant")
            return h.float().pow(2).mean()

    torch.manual_seed(0)
    model = Model().to(torch.bfloat16)
    compiled = torch.compile(model, backend=backend)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    losses: list[str] = []
    grads: list[str] = []
    try:
        for _ in range(steps):
            torch.set_default_dtype(torch.bfloat16)
            try:
                loss = compiled(x)
            finally:
                torch.set_default_dtype(torch.float32)
            loss.backward()
            losses.append(float(loss.detach()).hex())
            grads.extend(float(p.grad.float().sum()).hex() for p in model.parameters())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    except Exception as error:  # the outcome is what the test compares
        lines = [line.strip() for line in str(error).strip().splitlines()]
        message = next((line for line in lines if "dtype" in line), lines[0] if lines else "")
        return {
            "outcome": "failed",
            "error": f"{type(error).__name__}: {message}",
            "wrapper": from_shim,
            "torch": torch.__version__,
        }
    return {"outcome": "trained", "losses": losses, "grads": grads, "wrapper": from_shim, "torch": torch.__version__}
