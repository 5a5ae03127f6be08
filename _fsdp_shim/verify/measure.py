"""What a verify run (and the benchmarks and tests) measures, as a Callback so the user's module runs unchanged."""

from __future__ import annotations

import hashlib
import re
from typing import Any, Optional

WRAPPERS = re.compile(r"(_forward_module|_fsdp_wrapped_module|_checkpoint_wrapped_module)\.")  # clean_tensor_name's


def flat_parameters(root: Any) -> list[Any]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return [m._handle.flat_param for m in root.modules() if isinstance(m, FSDP) and m._handle is not None]


def nbytes(tensors: list[Any]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def sharded_grad_bytes(root: Any) -> int:
    """Bytes of the sharded gradients; with ``use_orig_params`` they sit on the original parameters."""
    grads = [p.grad for p in flat_parameters(root) if p.grad is not None]
    return nbytes(grads or [p.grad for p in root.parameters() if p.grad is not None])


def optimizer_state_bytes(optimizer: Any) -> int:
    """Without 0-dim counters such as Adam's ``step``: they are float32 whatever the model."""
    import torch

    return nbytes([v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0])


def parameter_hashes(root: Any) -> dict[str, str]:
    """SHA-256 of this rank's shard of every parameter, by name (``use_orig_params``: each is a view)."""
    import torch

    hashes = {}
    for name, parameter in root.named_parameters():
        data = parameter.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        hashes[WRAPPERS.sub("", name)] = hashlib.sha256(str(parameter.dtype).encode() + data.tobytes()).hexdigest()
    return hashes


def measuring_callback(pl: Any, count: tuple[type, ...] = ()) -> Any:
    """A ``pl.Callback`` recording the gradient bytes and the losses, and counting the modules of ``count``."""

    class Measure(pl.Callback):
        grad_bytes, checkpointed, losses = 0, 0, list[Optional[float]]()

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.checkpointed, self.losses = sum(isinstance(m, count) for m in trainer.strategy.model.modules()), []

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            self.grad_bytes = sharded_grad_bytes(trainer.strategy.model)

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            loss: Any = outputs.get("loss") if isinstance(outputs, dict) else outputs
            self.losses.append(float(loss.detach().float().item()) if hasattr(loss, "detach") else None)

    return Measure()
