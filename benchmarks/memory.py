"""Memory and step time of FSDP "bf16-true" training, side by side in one invocation, 2 CPU ranks.

Four runs of the same ~50M-parameter model (layers built in ``__init__`` in float32, as a model
loaded with ``from_pretrained`` is), each on 2 ranks with gloo:

* ``unpatched``  Lightning 2.4.0 (``lightning.pytorch``) with ``FSDP_SHIM=0``
* ``patched``    the same with the shim on
* ``2.6.x``      the newest Lightning, fixed upstream (``pytorch_lightning`` 2.6.x)
* ``pytorch``    plain ``torch.distributed.fsdp``: the model cast to bf16 and wrapped directly with the
                 same mixed-precision policy Lightning uses for "bf16-true" (bf16 params/reduce/buffers)

It reports exact sharded bytes per rank (flat parameters, gradients, Adam state), peak RSS per rank,
and the median training-step time, with the ratios patched / 2.6.x, patched / pytorch and
patched / unpatched. It needs the environment that ``pip install lightning==2.4.0`` creates
(an affected ``lightning`` and a fixed ``pytorch_lightning``), e.g.

    PYTHONPATH=.matrix/mixed-2.4.0 python benchmarks/memory.py

The GPU guards are lifted in the benchmark's own processes with ``_fsdp_shim.verify.cpu_guards``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _fsdp_shim.verify.measure import flat_parameters, nbytes, sharded_grad_bytes
from _fsdp_shim.verify.probe import leave_process_group

WIDTH = 2048
LAYERS = 12  # 12 x (2048 x 2048 + 2048) = 50.36M parameters
BATCH = 8
RUNS = {
    "unpatched": ("lightning.pytorch", "0"),
    "patched": ("lightning.pytorch", "1"),
    "2.6.x": ("pytorch_lightning", "0"),
    "pytorch": ("torch", "0"),
}


def build_model() -> Any:
    from torch import nn

    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


def measure(root: Any, optimizer: Any, grad_bytes: int, step_times: list[float]) -> dict[str, Any]:
    import torch

    flat = flat_parameters(root)
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    return {
        "flat_param_dtypes": sorted({str(p.dtype) for p in flat}),
        "param_bytes": nbytes(flat),
        "grad_bytes": grad_bytes,
        "optimizer_state_bytes": nbytes(state),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "step_seconds": statistics.median(step_times[1:]),  # the first step includes lazy set-up
    }


def child_lightning(namespace: str, steps: int, out: str) -> None:
    import torch

    import fsdp_shim  # noqa: F401  (FSDP_SHIM decides)
    from _fsdp_shim.verify import cpu_guards

    pl = importlib.import_module(namespace)
    cpu_guards.lift(namespace)

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layers = build_model()
            self.grad_bytes = 0
            self.step_times: list[float] = []
            self._start = 0.0

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            (x,) = batch
            return self.layers(x).float().pow(2).mean()

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            self._start = time.perf_counter()

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.step_times.append(time.perf_counter() - self._start)

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            self.grad_bytes = sharded_grad_bytes(self.trainer.strategy.model)

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.trainer.model.parameters(), lr=1e-4)

    data = torch.utils.data.TensorDataset(
        torch.randn(BATCH * steps * 2, WIDTH, generator=torch.Generator().manual_seed(0))
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=importlib.import_module(f"{namespace}.strategies").FSDPStrategy(),
        precision="bf16-true",
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Model()
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=BATCH))
    report = {
        "version": pl.__version__,
        **measure(trainer.strategy.model, trainer.optimizers[0], model.grad_bytes, model.step_times),
    }
    Path(f"{out}.rank{trainer.global_rank}.json").write_text(json.dumps(report))
    leave_process_group()


def child_torch(steps: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dtype = torch.bfloat16
    model = build_model().to(dtype=dtype)
    fsdp = FullyShardedDataParallel(
        model,
        device_id=torch.device("cpu"),
        use_orig_params=True,
        mixed_precision=MixedPrecision(param_dtype=dtype, reduce_dtype=dtype, buffer_dtype=dtype),
    )
    optimizer = torch.optim.Adam(fsdp.parameters(), lr=1e-4)
    data = torch.randn(BATCH * steps * 2, WIDTH, generator=torch.Generator().manual_seed(0)).split(BATCH)[rank::2]
    step_times, grads = [], 0
    for x in data[:steps]:
        start = time.perf_counter()
        fsdp(x.to(dtype)).float().pow(2).mean().backward()
        grads = sharded_grad_bytes(fsdp)
        optimizer.step()
        optimizer.zero_grad()
        step_times.append(time.perf_counter() - start)
    report = {"version": f"torch {torch.__version__}", **measure(fsdp, optimizer, grads, step_times)}
    Path(f"{out}.rank{rank}.json").write_text(json.dumps(report))
    leave_process_group()


def run_all(steps: int) -> dict[str, list[dict[str, Any]]]:
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (namespace, shim) in RUNS.items():
            out = str(Path(tmp) / name)
            env = dict(os.environ, FSDP_SHIM=shim, PYTHONWARNINGS="ignore", MASTER_ADDR="127.0.0.1")
            if namespace == "torch":
                command = [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--nproc-per-node",
                    "2",
                    "--master-addr",
                    "127.0.0.1",
                    "--master-port",
                    "29517",
                    __file__,
                    "--child",
                    "torch",
                    "--steps",
                    str(steps),
                    "--out",
                    out,
                ]
            else:
                command = [sys.executable, __file__, "--child", namespace, "--steps", str(steps), "--out", out]
            print(f"running {name} ...", file=sys.stderr, flush=True)
            subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
            results[name] = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in (0, 1)]
    return results


def render(results: dict[str, list[dict[str, Any]]]) -> str:
    lines = [
        f"{'run':<10} {'version':<22} {'rank':>4} {'dtype':<16} {'param B':>12} {'grad B':>12} {'optim B':>12} {'peak RSS MiB':>13} {'step s':>7}"
    ]
    for name, ranks in results.items():
        for rank, r in enumerate(ranks):
            lines.append(
                f"{name:<10} {r['version']:<22} {rank:>4} {','.join(d.removeprefix('torch.') for d in r['flat_param_dtypes']):<16} "
                f"{r['param_bytes']:>12,} {r['grad_bytes']:>12,} {r['optimizer_state_bytes']:>12,} "
                f"{r['peak_rss_bytes'] / 2**20:>13,.1f} {r['step_seconds']:>7.3f}"
            )

    def ratio(a: str, b: str, key: str) -> float:
        return sum(r[key] for r in results[a]) / sum(r[key] for r in results[b])

    lines.append("")
    for key in ("param_bytes", "grad_bytes", "optimizer_state_bytes", "peak_rss_bytes"):
        lines.append(
            f"{key:<22} patched/2.6.x {ratio('patched', '2.6.x', key):.3f}   patched/pytorch {ratio('patched', 'pytorch', key):.3f}   "
            f"patched/unpatched {ratio('patched', 'unpatched', key):.3f}"
        )
    step = statistics.median(r["step_seconds"] for r in results["patched"]) / statistics.median(
        r["step_seconds"] for r in results["2.6.x"]
    )
    lines.append(f"{'step time':<22} patched/2.6.x {step:.3f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child == "torch":
        return child_torch(args.steps, args.out)
    if args.child:
        return child_lightning(args.child, args.steps, args.out)
    results = run_all(args.steps)
    print(json.dumps(results, indent=2) if args.json else render(results))


if __name__ == "__main__":
    main()
