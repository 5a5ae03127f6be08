"""Save FSDP checkpoints with one setup and resume them with another, 1 process, and report exactly what each
run holds: the dtypes and every value of the flat parameters and of Adam's moments.

    python checkpoint_resume.py save   --package lightning  --checkpoints A --out A.json
    python checkpoint_resume.py resume --package standalone --checkpoints A,B --out B.json

Each checkpoint name is saved or resumed once per state dict type (``A-full.ckpt``, ``A-sharded.ckpt``); the
report is ``{file name: {state_dict_type: figures}}``.

``FSDP_SHIM`` decides whether the shim acts; ``fsdp_shim`` is imported only when it is not "0", so a run
with the shim off is Lightning as shipped. The tests compare the numbers across runs; nothing here
knows what they should be.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from _fsdp_shim.verify.probe import leave_process_group  # activates nothing

FEATURES = 16
STEPS = 2


def trainer_namespace(package: str) -> str:
    return "lightning.pytorch" if package == "lightning" else "pytorch_lightning"


def flat_values(model: Any) -> torch.Tensor:
    from torch.distributed.fsdp import FullyShardedDataParallel

    flats = [m._handle.flat_param for m in model.modules() if isinstance(m, FullyShardedDataParallel) and m._handle]
    return torch.cat([f.detach().reshape(-1) for f in flats])


def adam_moments(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {
        key: torch.cat([optimizer.state[p][key].detach().reshape(-1) for p in params if p in optimizer.state])
        for key in ("exp_avg", "exp_avg_sq")
    }


def describe(tensor: torch.Tensor) -> dict[str, Any]:
    """Dtype and exact values (as float64, which holds every float32 and bfloat16 value exactly)."""
    return {"dtype": str(tensor.dtype), "values": tensor.to(torch.float64).tolist()}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("save", "resume"))
    parser.add_argument("--package", choices=("lightning", "standalone"), required=True)
    parser.add_argument("--checkpoints", required=True, help="comma-separated names (paths without suffix)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    if os.environ.get("FSDP_SHIM", "1") != "0":
        import fsdp_shim  # noqa: F401
    namespace = trainer_namespace(args.package)
    pl = importlib.import_module(namespace)
    from _fsdp_shim.verify import cpu_guards  # activates nothing

    cpu_guards.lift(namespace)
    from torch.utils.data import DataLoader, TensorDataset

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            # Built in __init__: float32 on an affected Lightning without the shim, bf16 with it.
            self.body = nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, FEATURES))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (x,) = batch
            return self.body(x.to(self.body[0].weight.dtype)).float().pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.trainer.model.parameters(), lr=1e-2)

    def run(checkpoint: str, state_dict_type: str) -> dict[str, Any]:
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=1,
            strategy=importlib.import_module(f"{namespace}.strategies").FSDPStrategy(state_dict_type=state_dict_type),
            precision="bf16-true",
            max_steps=STEPS,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        x = torch.randn(8, FEATURES, generator=torch.Generator().manual_seed(0))
        # Resuming at the saved step trains no further: what is measured is what was restored.
        trainer.fit(
            Model(), DataLoader(TensorDataset(x), batch_size=4), ckpt_path=checkpoint if args.mode == "resume" else None
        )
        if args.mode == "save":
            trainer.save_checkpoint(checkpoint)
        return {
            "lightning": pl.__version__,
            "global_step": trainer.global_step,
            "module_dtype": str(trainer.lightning_module.dtype),
            "params": describe(flat_values(trainer.strategy.model)),
            **{key: describe(value) for key, value in adam_moments(trainer.optimizers[0]).items()},
        }

    report = {
        Path(name).name: {kind: run(f"{name}-{kind}.ckpt", kind) for kind in ("full", "sharded")}
        for name in args.checkpoints.split(",")
    }
    Path(args.out).write_text(json.dumps(report))
    leave_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
