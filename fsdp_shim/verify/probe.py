"""The verify child: one short FSDP training run of the seed's model, reported as JSON.

Run by :mod:`fsdp_shim.verify.command` as ``python -m fsdp_shim.verify.probe``, once with
``FSDP_SHIM=0`` and once with ``FSDP_SHIM=1``. The LightningModule holds two models: the one from the
PR discussion (``demos.Transformer`` built on the meta device in ``configure_model``: already in the
precision's dtype on affected releases, but ``LightningModule.dtype`` says float32) and a second one
loaded in float32, as ``from_pretrained`` does (the memory bug). Each is its own FSDP unit, since one
flat parameter cannot mix dtypes. Lightning's launcher re-runs this module on every rank.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import resource
import sys
from pathlib import Path
from typing import Any

import fsdp_shim  # before Lightning: FSDP_SHIM decides whether it does anything

VOCAB = 256
SEQUENCE = 32


def trainer_namespace() -> str:
    for name in ("lightning.pytorch", "pytorch_lightning"):
        try:
            importlib.import_module(name)
            return name
        except ImportError:
            continue
    raise SystemExit("Lightning is not installed (neither `lightning` nor `pytorch_lightning` imports)")


def flat_parameters(root: Any) -> list[Any]:
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


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--precision", default="bf16-true")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    namespace = trainer_namespace()
    pl = importlib.import_module(namespace)
    from fsdp_shim.versions import base_release

    release = base_release(pl.__version__)
    if release is not None and release < (2, 1, 0):  # "bf16-true"/"16-true" are invalid there
        Path(f"{args.out}.rank0.json").write_text(
            json.dumps({"lightning": pl.__version__, "namespace": namespace, "unsupported": True})
        )
        return
    Transformer = importlib.import_module(f"{namespace}.demos").Transformer
    cuda = torch.cuda.is_available()
    if not cuda:
        from fsdp_shim.verify import cpu_guards

        cpu_guards.lift(namespace)

    class SeedModel(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model: nn.Module | None = None
            self.pretrained: nn.Module | None = None
            self.grad_bytes = 0

        def configure_model(self) -> None:
            if self.model is not None:
                return
            with torch.device("meta"):  # the seed
                self.model = Transformer(vocab_size=VOCAB, nlayers=2, nhid=256, ninp=128, nhead=4, dropout=0.0)
            pretrained = Transformer(vocab_size=VOCAB, nlayers=2, nhid=256, ninp=128, nhead=4, dropout=0.0)
            self.pretrained = pretrained.float()  # weights loaded in float32, as from_pretrained does

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (tokens,) = batch
            inputs, target = tokens[:, :-1], tokens[:, 1:]
            losses = [F.nll_loss(m(inputs, target).float(), target.reshape(-1)) for m in (self.model, self.pretrained)]
            return losses[0] + losses[1]

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            self.grad_bytes = sharded_grad_bytes(self.trainer.strategy.model)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.trainer.model.parameters(), lr=1e-4)

    tokens = torch.randint(
        0, VOCAB, (4 * args.steps * args.devices, SEQUENCE + 1), generator=torch.Generator().manual_seed(0)
    )
    strategy = importlib.import_module(f"{namespace}.strategies").FSDPStrategy(auto_wrap_policy={Transformer})
    trainer = pl.Trainer(
        accelerator="cuda" if cuda else "cpu",
        devices=args.devices,
        strategy=strategy,
        precision=args.precision,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = SeedModel()
    trainer.fit(model, DataLoader(TensorDataset(tokens), batch_size=4))

    flat = flat_parameters(trainer.strategy.model)
    optimizer_state = [
        v for s in trainer.optimizers[0].state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0
    ]
    peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    shim = fsdp_shim.status().namespace(namespace)
    report = {
        "rank": trainer.global_rank,
        "device": "cuda" if cuda else "cpu",
        "backend": "nccl" if cuda else "gloo",
        "lightning": pl.__version__,
        "namespace": namespace,
        "shim_patched": shim.patched,
        "shim_reason": shim.reason,
        "module_dtype": str(model.dtype),
        "flat_param_dtypes": sorted({str(p.dtype) for p in flat}),
        "param_bytes": nbytes(flat),
        "grad_bytes": model.grad_bytes,
        "optimizer_state_bytes": nbytes(optimizer_state),
        "peak_memory_bytes": peak,
        "peak_memory_kind": "torch.cuda.max_memory_allocated" if cuda else "peak RSS",
    }
    Path(f"{args.out}.rank{trainer.global_rank}.json").write_text(json.dumps(report))
    leave_process_group()


def leave_process_group() -> None:
    """Leave together, then end this probe process without interpreter finalization.

    The report is written before the barrier. Finalization can free objects that still hold
    torch.distributed state after the interpreter is half gone; a C++ thread that needs the GIL then
    aborts the process ("terminate called without an active exception"), intermittently, which
    `verify` would report as a failed check although the run was complete. This is the probe's own
    child process, never the user's.
    """
    import torch

    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main(sys.argv[1:])
