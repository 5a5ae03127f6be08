"""What a verify run measures, as a Lightning Callback, so the user's module is run unchanged.

Exact byte counts (``numel × element_size``) of FSDP's sharded flat parameters, their gradients and
the optimizer's tensor state (0-dim counters such as Adam's ``step`` are left out: they are float32
whatever the model), the training losses, and the peak memory: ``torch.cuda.max_memory_allocated``
on CUDA, and on CPU the peak RSS above the RSS once torch and Lightning are imported (the interpreter
and the libraries are most of a small model's RSS, and do not change with the shim).

Nothing from the package is imported at the top: the tests' training scenario loads this file by its
path to count bytes the same way in runs that must never import (and so activate) fsdp_shim.
"""

from __future__ import annotations

import math
import resource
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from _fsdp_shim.verify.results import RankResult


def flat_parameters(root: Any) -> list[Any]:
    """FSDP's flat parameters under ``root``, one per FSDP unit that holds parameters."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return [
        m._handle.flat_param
        for m in root.modules()
        if isinstance(m, FullyShardedDataParallel) and m._handle is not None
    ]


def nbytes(tensors: list[Any]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def sharded_grad_bytes(root: Any) -> int:
    """Bytes of the sharded gradients; with ``use_orig_params`` they sit on the original parameters."""
    grads = [p.grad for p in flat_parameters(root) if p.grad is not None]
    return nbytes(grads or [p.grad for p in root.parameters() if p.grad is not None])


def optimizer_state_bytes(optimizer: Any) -> int:
    import torch

    return nbytes([v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0])


def rss_bytes() -> int:
    """Peak RSS of this process so far (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def loss_value(outputs: Any) -> float | None:
    loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
    try:
        return float(loss.detach().float().item())
    except AttributeError:
        return None


def finite(values: list[float | None]) -> bool:
    return all(v is not None and math.isfinite(v) for v in values)


def measuring_callback(pl: Any) -> Any:
    """A ``pl.Callback`` subclass for the namespace ``pl`` (its Callback class is its own)."""

    class Measure(pl.Callback):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            self.grad_bytes = 0
            self.losses: list[float | None] = []

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            self.grad_bytes = sharded_grad_bytes(trainer.strategy.model)

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.losses.append(loss_value(outputs))

    return Measure()


def report(
    trainer: Any, model: Any, callback: Any, baseline_rss: int, units: dict[str, Any], pl: Any, cast: Any
) -> RankResult:
    """Rank-local figures after ``trainer.fit``. ``units`` names sub-modules whose FSDP unit is
    reported on its own (the seed's two models); ``pl`` is the Lightning namespace trained (its
    module), ``cast`` what the shim's cast fix did to it (``status().namespace(...).fix("cast")``)."""
    import torch

    from _fsdp_shim.verify.results import RankResult

    flat = flat_parameters(trainer.strategy.model)
    cuda = torch.cuda.is_available()
    peak = torch.cuda.max_memory_allocated() if cuda else rss_bytes() - baseline_rss
    return RankResult(
        rank=trainer.global_rank,
        device="cuda" if cuda else "cpu",
        backend="nccl" if cuda else "gloo",
        module_dtype=str(model.dtype),
        flat_param_dtypes=sorted({str(p.dtype) for p in flat}),
        param_bytes=nbytes(flat),
        grad_bytes=callback.grad_bytes,
        optimizer_state_bytes=optimizer_state_bytes(trainer.optimizers[0]),
        unit_param_bytes={name: nbytes(flat_parameters(unit)) for name, unit in units.items()},
        peak_memory_bytes=peak,
        peak_memory_kind="torch.cuda.max_memory_allocated" if cuda else "peak RSS above the import baseline",
        losses=callback.losses,
        lightning=pl.__version__,
        namespace=pl.__name__,
        shim_patched=cast.patched,
        shim_reason=cast.reason,
    )
