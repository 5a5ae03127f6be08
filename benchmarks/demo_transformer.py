"""Memory and step time of the Lightning PR discussion's seed example, FSDP "bf16-true", in one invocation.

The model is Lightning's own demo ``Transformer`` (``lightning.pytorch.demos``) at the seed's size:
16 encoder and 16 decoder layers, ``nhid=4096``, ``ninp=1024``, ``nhead=32``, WikiText2's vocabulary
(33,278 tokens), 538.5M parameters (2.0 GiB in float32). It is built in the LightningModule's
``__init__``, in float32, as the demo's ``LightningTransformer`` builds it: the memory bug. (Built in
``configure_model``, Lightning's init context already makes it bfloat16 on 2.4.0 and only
``LightningModule.dtype`` is wrong.) Synthetic token batches (16 x 35 tokens, the demo's block size) replace WikiText2, which is not downloaded. It is trained with Lightning's Trainer,
``FSDPStrategy`` (each ``nn.TransformerEncoderLayer`` and ``nn.TransformerDecoderLayer``, the classes
the demo is built from, is its own FSDP unit), ``precision="bf16-true"`` and Adam, in six runs, each
in a child process of its own:

* Lightning 2.4.0 with the shim off (``FSDP_SHIM=0``; fsdp_shim is never imported);
* Lightning 2.4.0 with the shim on (``FSDP_SHIM=1``, ``import fsdp_shim`` before Lightning);
* Lightning 2.6.6, fixed upstream, with the shim off;

each without and with activation checkpointing
(``activation_checkpointing_policy={TransformerEncoderLayer, TransformerDecoderLayer}``; the table's
``ckpt`` column counts the layers it wrapped).

Per run and rank: exact sharded bytes (FSDP flat parameters, their gradients, Adam's state; counted
by ``_fsdp_shim/verify/measure.py``), the flat parameters' dtypes, ``LightningModule.dtype``, the
losses, the peak memory (on CUDA, one device with NCCL: ``torch.cuda.max_memory_allocated()`` after
training; on CPU, gloo: the peak RSS above the RSS once torch and Lightning are imported) and the
median training-step time (the first step, which includes lazy set-up, is left out). The ratios
2.4.0 on / 2.4.0 off, 2.4.0 on / 2.6.6 and with / without checkpointing are computed from the runs of
the same invocation.

Each Lightning comes from a folder that ``pip install --no-deps --target DIR lightning==X`` filled; it
goes first on the children's ``PYTHONPATH``, then this checkout (so "shim on" measures its
``fsdp_shim``). Each child checks that it imported ``lightning`` from that folder, at that release.
The defaults are the folders the nox sessions fill::

    python benchmarks/demo_transformer.py                        # the seed's size on CUDA, small on CPU
    python benchmarks/demo_transformer.py --size full --steps 5 --json demo.json
    python benchmarks/demo_transformer.py --size small --lightning-2.4 .matrix/mixed-2.4.0 \\
        --lightning-2.6 .matrix/lightning-2.6.6

``--size small`` (2+2 layers, ``nhid=256``, ``ninp=128``, ``nhead=4``, 256 tokens, 2 x 32 tokens a batch)
runs on CPU in about 5 s per run, most of it importing torch and Lightning. ``--steps N`` sets the
steps per run (default 5), ``--devices N`` the ranks (default 1).

On CPU, Lightning refuses FSDP without a GPU: the children lift that guard for themselves with
``_fsdp_shim.verify.cpu_guards`` (importing ``_fsdp_shim`` activates nothing).
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
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

NAMESPACE = "lightning.pytorch"
PRECISION = "bf16-true"
LIGHTNING_FOLDERS = {"2.4": ".matrix/mixed-2.4.0", "2.6": ".matrix/lightning-2.6.6"}
RUNS = (("2.4", "off"), ("2.4", "on"), ("2.6", "off"))  # (Lightning release line, shim)


@dataclass(frozen=True)
class Size:
    nlayers: int
    nhid: int
    ninp: int
    nhead: int
    vocab_size: int
    seq: int
    batch: int


SIZES = {
    # Every parameter has a multiple of 8 elements, so FSDP pads nothing in float32 or bfloat16: byte counts
    # scale exactly with the dtype.
    "small": Size(nlayers=2, nhid=256, ninp=128, nhead=4, vocab_size=256, seq=32, batch=2),
    # The seed's model; WikiText2's vocabulary and the demo's block size (35), 16 sequences a batch.
    "full": Size(nlayers=16, nhid=4096, ninp=1024, nhead=32, vocab_size=33278, seq=35, batch=16),
}


# ----------------------------------------------------------------------------- child


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # this process's peak; Linux says kilobytes


def check_lightning(lightning: ModuleType, line: str, folder: str) -> None:
    """Fail loudly when the child imported another Lightning than its flag names."""
    version = lightning.__version__
    where = Path(lightning.__file__).resolve()
    if version.split(".")[:2] != line.split(".") or Path(folder).resolve() not in where.parents:
        raise SystemExit(
            f"expected Lightning {line}.x from {folder} (--lightning-{line}), imported lightning {version} from {where}"
        )


def child(spec: dict[str, Any]) -> None:
    """One run: train, write this rank's figures to ``<out>.rank<N>.json``, exit."""
    switch = "1" if spec["shim"] == "on" else "0"
    if os.environ.get("FSDP_SHIM") != switch:
        raise SystemExit(f"a run with the shim {spec['shim']} needs FSDP_SHIM={switch}")
    if spec["shim"] == "on":
        import fsdp_shim  # before Lightning; FSDP_SHIM=1 switches it on

    import lightning
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.utils.data import DataLoader, TensorDataset

    check_lightning(lightning, spec["line"], spec["folder"])
    pl = importlib.import_module(NAMESPACE)
    from _fsdp_shim.verify import cpu_guards, measure  # activate nothing
    from _fsdp_shim.verify.probe import leave_process_group

    cuda = torch.cuda.is_available()
    if not cuda:
        cpu_guards.lift(NAMESPACE)
    baseline_rss = peak_rss_bytes()

    size = Size(**spec["size"])
    layers = {nn.TransformerEncoderLayer, nn.TransformerDecoderLayer}
    transformer = importlib.import_module(f"{NAMESPACE}.demos").Transformer

    class DemoTransformer(pl.LightningModule):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.model = transformer(
                vocab_size=size.vocab_size, ninp=size.ninp, nhead=size.nhead, nhid=size.nhid, nlayers=size.nlayers
            )

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (tokens,) = batch
            inputs, target = tokens[:, :-1], tokens[:, 1:]
            return F.nll_loss(self.model(inputs, target), target.reshape(-1))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.trainer.model.parameters(), lr=1e-4)

    class StepTimer(pl.Callback):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            self.seconds: list[float] = []
            self._start = 0.0

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if cuda:
                torch.cuda.synchronize()
            self._start = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if cuda:
                torch.cuda.synchronize()
            self.seconds.append(time.perf_counter() - self._start)

    torch.manual_seed(0)
    model = DemoTransformer()
    built_layers = sum(isinstance(m, tuple(layers)) for m in model.modules())
    assert built_layers == 2 * size.nlayers, f"the demo Transformer has {built_layers} layers of {layers}"
    parameters = sum(p.numel() for p in model.parameters())  # before FSDP shards them
    tokens = torch.randint(
        0,
        size.vocab_size,
        (size.batch * spec["steps"] * spec["devices"], size.seq + 1),
        generator=torch.Generator().manual_seed(0),
    )
    measuring, timer = measure.measuring_callback(pl), StepTimer()
    strategy = importlib.import_module(f"{NAMESPACE}.strategies").FSDPStrategy(
        auto_wrap_policy=layers, activation_checkpointing_policy=layers if spec["checkpointing"] else None
    )
    trainer = pl.Trainer(
        accelerator="cuda" if cuda else "cpu",
        devices=spec["devices"],
        strategy=strategy,
        precision=PRECISION,
        max_steps=spec["steps"],
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[measuring, timer],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(TensorDataset(tokens), batch_size=size.batch))

    root = trainer.strategy.model
    flat = measure.flat_parameters(root)
    activation = sys.modules.get("_fsdp_shim.activation")  # the probe module imports it; it activates nothing
    shim: dict[str, Any] = {"active": getattr(activation, "_active", None) is True}
    if spec["shim"] == "on":
        import fsdp_shim

        status = fsdp_shim.status().namespace(NAMESPACE)
        if not status.patched:
            raise SystemExit(f"the shim did not patch {NAMESPACE} {lightning.__version__}: {status.reason}")
        shim.update(patched=status.patched, reason=status.reason, file=fsdp_shim.__file__)
    elif shim["active"]:
        raise SystemExit("the shim was active in a run with the shim off")
    result = {
        "rank": trainer.global_rank,
        "lightning": lightning.__version__,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "backend": "nccl" if cuda else "gloo",
        "parameters": parameters,
        "module_dtype": str(model.dtype),
        "flat_param_dtypes": sorted({str(p.dtype) for p in flat}),
        "fsdp_units": len(flat),
        "checkpointed_layers": sum(isinstance(m, CheckpointWrapper) for m in root.modules()),
        "param_bytes": measure.nbytes(flat),
        "grad_bytes": measuring.grad_bytes,
        "optimizer_state_bytes": measure.optimizer_state_bytes(trainer.optimizers[0]),
        "peak_memory_bytes": torch.cuda.max_memory_allocated() if cuda else peak_rss_bytes() - baseline_rss,
        "peak_memory_kind": "torch.cuda.max_memory_allocated" if cuda else "peak RSS above the RSS after imports",
        "step_seconds": statistics.median(timer.seconds[1:]),
        "step_seconds_all": timer.seconds,
        "losses": measuring.losses,
        "shim": shim,
    }
    Path(f"{spec['out']}.rank{trainer.global_rank}.json").write_text(json.dumps(result))
    leave_process_group()


# ----------------------------------------------------------------------------- parent
def run_id(line: str, shim: str, checkpointing: bool) -> str:
    return f"{line}-{shim}" + ("-ckpt" if checkpointing else "")


def child_env(folder: str, shim: str) -> dict[str, str]:
    """This environment without the shim's variables, FSDP_SHIM set for the run, the Lightning folder and
    this checkout first on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FSDP_SHIM")}
    env["FSDP_SHIM"] = "1" if shim == "on" else "0"
    inherited = [str(Path(entry).resolve()) for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry]
    env["PYTHONPATH"] = os.pathsep.join([folder, str(ROOT), *inherited])  # absolute: the children run elsewhere
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    return env


def run_all(size: str, steps: int, devices: int, folders: dict[str, str]) -> dict[str, Any]:
    runs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for checkpointing in (False, True):
            for line, shim in RUNS:
                key = run_id(line, shim, checkpointing)
                out = Path(tmp) / key
                spec = {
                    "line": line,
                    "folder": folders[line],
                    "shim": shim,
                    "checkpointing": checkpointing,
                    "size": asdict(SIZES[size]),
                    "steps": steps,
                    "devices": devices,
                    "out": str(out),
                }
                print(f"running {key} ...", end=" ", file=sys.stderr, flush=True)
                start = time.perf_counter()
                log = Path(tmp) / f"{key}.log"
                with log.open("w") as stream:
                    proc = subprocess.run(
                        [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)],
                        env=child_env(folders[line], shim),
                        stdout=stream,
                        stderr=subprocess.STDOUT,
                        cwd=tmp,
                    )
                print(f"{time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
                ranks = [Path(f"{out}.rank{rank}.json") for rank in range(devices)]
                if proc.returncode != 0 or not all(path.exists() for path in ranks):
                    sys.stderr.write(log.read_text()[-6000:])
                    raise SystemExit(f"run {key} failed (exit {proc.returncode})")
                runs[key] = {
                    "line": line,
                    "shim": shim,
                    "checkpointing": checkpointing,
                    "ranks": [json.loads(path.read_text()) for path in ranks],
                }
    return runs


RATIO_KEYS = ("param_bytes", "grad_bytes", "optimizer_state_bytes", "peak_memory_bytes", "step_seconds")


def ratios(runs: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Ratios of the figures summed over ranks, labelled with the releases the runs imported."""

    def total(key: str, figure: str) -> float:
        return sum(rank[figure] for rank in runs[key]["ranks"])

    def label(key: str) -> str:
        run = runs[key]
        return f"{run['ranks'][0]['lightning']}" + (f" {run['shim']}" if run["line"] == "2.4" else "")

    pairs = []
    for checkpointing in (False, True):
        on, off, fixed = (run_id(*run, checkpointing) for run in (("2.4", "on"), ("2.4", "off"), ("2.6", "off")))
        suffix = ", checkpointing" if checkpointing else ""
        pairs += [
            (f"{label(on)} / {label(off)}{suffix}", on, off),
            (f"{label(on)} / {label(fixed)}{suffix}", on, fixed),
        ]
    for line, shim in RUNS:
        plain = run_id(line, shim, False)
        pairs.append((f"checkpointing / none, {label(plain)}", run_id(line, shim, True), plain))
    return {name: {k: total(a, k) / total(b, k) for k in RATIO_KEYS} for name, a, b in pairs}


def render(result: dict[str, Any]) -> str:
    runs, size = result["runs"], Size(**result["size"])
    first = next(iter(runs.values()))["ranks"][0]
    lines = [
        f"demo Transformer: {size.nlayers}+{size.nlayers} layers, nhid {size.nhid}, ninp {size.ninp}, nhead {size.nhead}, "
        f"vocabulary {size.vocab_size}, {first['parameters']:,} parameters; batch {size.batch} x {size.seq} tokens, "
        f"{result['steps']} steps, {PRECISION}, Adam",
        f"{first['device']} ({first['backend']}), {result['devices']} device(s), torch {first['torch']}; "
        f"peak memory: {first['peak_memory_kind']}",
        "",
        f"{'run':<16} {'ckpt':>4} {'rank':>4} {'flat params':<12} {'module':<9} {'param B':>13} {'grad B':>13} "
        f"{'optim B':>14} {'peak MiB':>10} {'step s':>8}  losses",
    ]
    for run in runs.values():
        for r in run["ranks"]:
            name = f"{r['lightning']} shim {run['shim']}"
            dtypes = ",".join(d.removeprefix("torch.") for d in r["flat_param_dtypes"])
            losses = ", ".join(f"{loss:.3f}" for loss in r["losses"])
            lines.append(
                f"{name:<16} {r['checkpointed_layers']:>4} {r['rank']:>4} {dtypes:<12} "
                f"{r['module_dtype'].removeprefix('torch.'):<9} {r['param_bytes']:>13,} {r['grad_bytes']:>13,} "
                f"{r['optimizer_state_bytes']:>14,} {r['peak_memory_bytes'] / 2**20:>10,.1f} {r['step_seconds']:>8.3f}  {losses}"
            )
    lines += [
        "",
        f"{'ratio (ranks summed)':<36} {'param B':>8} {'grad B':>8} {'optim B':>8} {'peak mem':>9} {'step time':>10}",
    ]
    for name, ratio in result["ratios"].items():
        lines.append(
            f"{name:<36} {ratio['param_bytes']:>8.3f} {ratio['grad_bytes']:>8.3f} {ratio['optimizer_state_bytes']:>8.3f} "
            f"{ratio['peak_memory_bytes']:>9.3f} {ratio['step_seconds']:>10.3f}"
        )
    return "\n".join(lines)


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), help="default: full where CUDA is available, else small")
    parser.add_argument("--steps", type=int, default=5, help="training steps per run, at least 2 (default 5)")
    parser.add_argument("--devices", type=int, default=1, help="ranks per run (default 1)")
    for line, folder in LIGHTNING_FOLDERS.items():
        parser.add_argument(
            f"--lightning-{line}",
            dest=f"lightning_{line.replace('.', '_')}",
            default=str(ROOT / folder),
            metavar="DIR",
            help=f"a folder holding lightning {line}.x (default: {folder} under the repository root)",
        )
    parser.add_argument("--json", metavar="PATH", help="also write every figure and ratio to PATH")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(json.loads(args.child))
    if args.steps < 2:
        parser.error("--steps must be at least 2: the first step is left out of the step time")
    folders = {
        line: str(Path(getattr(args, f"lightning_{line.replace('.', '_')}")).resolve()) for line in LIGHTNING_FOLDERS
    }
    for line, folder in folders.items():
        if not (Path(folder) / "lightning" / "__init__.py").is_file():
            parser.error(f"--lightning-{line}: {folder} holds no lightning package")
    size = args.size or ("full" if cuda_available() else "small")
    runs = run_all(size, args.steps, args.devices, folders)
    result = {
        "size": asdict(SIZES[size]),
        "size_name": size,
        "steps": args.steps,
        "devices": args.devices,
        "precision": PRECISION,
        "runs": runs,
        "ratios": ratios(runs),
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(render(result))


if __name__ == "__main__":
    main()
