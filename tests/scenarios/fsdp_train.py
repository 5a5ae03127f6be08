"""Train tiny models with real FSDP on CPU and report dtypes and exact byte counts, per rank.

Run as a script (Lightning's launcher re-runs ``sys.argv`` on every rank)::

    python fsdp_train.py --api trainer --package lightning --shim before --devices 2 \
        --cases init+pretrained:bf16-true --out /tmp/result

Each rank writes ``<out>.rank<N>.json``. The tests compare these numbers across runs (shim off,
shim on, a fixed Lightning, plain PyTorch FSDP); nothing here knows what the answer should be.

``--shim``: ``off`` never imports fsdp_shim; ``before`` imports it before Lightning; ``after``
imports it after Lightning (patch-at-once path). ``FSDP_SHIM`` in the environment still applies.
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
import torch.nn.functional as F
from torch import nn

from _fsdp_shim.verify import cpu_guards, measure  # importing _fsdp_shim activates nothing
from _fsdp_shim.verify.probe import leave_process_group

flat_parameters = measure.flat_parameters
grad_bytes = measure.sharded_grad_bytes
optimizer_state_bytes = measure.optimizer_state_bytes

SEQ = 8
VOCAB = 64
FEATURES = 16


# Every parameter below has a multiple of 8 elements and every model a multiple of 16, so FSDP adds
# no alignment or world-size padding in fp32, bf16 or fp16: byte counts scale exactly with the dtype.
def make_body() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, FEATURES))


def make_head() -> nn.Module:
    return nn.Linear(FEATURES, FEATURES)


def make_transformer(transformer_class: type) -> nn.Module:
    return transformer_class(vocab_size=VOCAB, ninp=32, nhead=2, nhid=64, nlayers=1, dropout=0.0)


MODEL_KINDS = ("init", "pretrained", "init+pretrained", "setup_hook", "seed", "float64")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--api", choices=("trainer", "fabric", "torch"), required=True)
    parser.add_argument("--package", choices=("lightning", "standalone"), default="lightning")
    parser.add_argument("--shim", choices=("off", "before", "after"), default="off")
    parser.add_argument("--devices", type=int, default=1, help="per node")
    parser.add_argument("--num-nodes", type=int, default=1, help="trainer only, under torchrun")
    parser.add_argument("--cases", required=True, help="comma-separated MODEL:PRECISION")
    parser.add_argument("--checkpoint-dir", default=None, help="trainer only: fit, save, resume")
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--shim-off-rank", type=int, default=None, help="this global rank (RANK, under torchrun) runs with FSDP_SHIM=0"
    )
    parser.add_argument(
        "--precision-on-rank", default=None, help="RANK:PRECISION: that rank (RANK, under torchrun) uses another one"
    )
    parser.add_argument(
        "--delay-rank", default=None, help="RANK:SECONDS: that rank sleeps after joining the process group"
    )
    parser.add_argument(
        "--env-on-rank",
        action="append",
        default=[],
        help="RANK:NAME=VALUE (repeatable): that rank (RANK, under torchrun) runs with NAME=VALUE in its "
        "environment, as a node configured differently would; PYTHONPATH's entries also go on sys.path where "
        "start-up puts them (after the script's folder), before anything imports Lightning",
    )
    parser.add_argument(
        "--restart-without-shim",
        type=int,
        default=None,
        help="RANK: under torchrun --max-restarts, that rank fails after training in the job's first attempt "
        "(TORCHELASTIC_RESTART_COUNT 0) and comes back with FSDP_SHIM=0 in every later attempt",
    )
    parser.add_argument(
        "--extra-model-on-rank",
        type=int,
        default=None,
        help="RANK: fabric only: that rank sets up one more model with fabric.setup_module, before the common one",
    )
    parser.add_argument(
        "--stages",
        default="fit",
        help="trainer only: comma-separated stages, fit first (fit,validate,test,predict); each stage after "
        "fit runs in the same processes with a new Trainer and model",
    )
    parser.add_argument(
        "--process-group-timeout",
        type=float,
        default=None,
        help="SECONDS: the FSDP strategy's timeout= (the process group's own timeout), else Lightning's default",
    )
    return parser.parse_args(argv)


def configure_this_rank(args: argparse.Namespace) -> None:
    """What ``--env-on-rank`` and ``--restart-without-shim`` give this rank, before fsdp_shim or
    Lightning is imported (``FSDP_SHIM`` is read there, ``FSDP_SHIM_RANK_CHECK_TIMEOUT`` at the check)."""
    rank = os.environ.get("RANK")
    for setting in args.env_on_rank:
        target, _, assignment = setting.partition(":")
        name, _, value = assignment.partition("=")
        if rank != target:
            continue
        os.environ[name] = value
        if name == "PYTHONPATH":
            sys.path[1:1] = [os.path.abspath(entry) for entry in value.split(os.pathsep) if entry]
    if os.environ.get("FSDP_SHIM_TEST_HIDE_CHECKPOINT_INTERNALS") == "1":  # a node whose torch moved them
        sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
        from children.recompute_proof import hide_checkpoint_internals

        hide_checkpoint_internals()
    restarted = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
    if args.restart_without_shim is not None and restarted:
        forget_gloo_addresses_of_the_last_attempt()
        if rank == str(args.restart_without_shim):
            os.environ["FSDP_SHIM"] = "0"  # the node came back without the shim


def forget_gloo_addresses_of_the_last_attempt() -> None:
    """Let a restarted gloo group connect: remove this rank's gloo address of the last attempt from
    torchrun's store, and wait until every rank has, before Lightning creates the process group.

    torchrun's store outlives a restart, and the torch here (2.13) gives the workers no per-attempt
    prefix (see pytorch/pytorch#135712), so gloo's rendezvous keys of the first attempt are still there:
    a rank that reads a peer's key before the peer wrote its new one connects to the dead process (here
    7 of 9 restarts without this failed: 4 with "connectFullMesh ... Connection refused", 3 hung in
    ``init_process_group``). Only gloo's own keys go
    (``default_pg/0//cpu/...``: group ``0``, its CPU backend); every other key, fsdp-shim's
    (``default_pg/0//fsdp_shim/...``) included, stays as torch leaves it.
    """
    from datetime import timedelta

    rank, world_size = os.environ["RANK"], int(os.environ["WORLD_SIZE"])
    store = torch.distributed.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=120)
    )
    for key in store.list_keys():
        if key.startswith("default_pg/0//cpu/") and key.endswith(f"/{rank}"):
            store.delete_key(key)
    done = f"fsdp_train/attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}/forgot"
    store.set(f"{done}/{rank}", "1")
    store.wait([f"{done}/{r}" for r in range(world_size)])


def fail_first_attempt_if_asked(args: argparse.Namespace) -> None:
    """``--restart-without-shim``: end this rank with an error after its first attempt trained."""
    if args.restart_without_shim is None or os.environ.get("RANK") != str(args.restart_without_shim):
        return
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        print(f"fsdp_train: rank {os.environ['RANK']} fails once after training (--restart-without-shim)", flush=True)
        sys.stderr.flush()
        os._exit(1)  # as a node that died: no finalization, no barrier


def delay_after_joining(delay: str | None) -> None:
    """Make one rank sleep right after it joins the process group, inside the strategy's
    ``setup_environment``, before the rank check at its end (a slow rank): torch's
    ``init_process_group``, which Lightning calls by attribute, sleeps on its way out, once."""
    if delay is None:
        return
    import time

    import torch.distributed as dist

    rank, seconds = delay.split(":")
    join = dist.init_process_group

    def join_then_sleep(*args: Any, **kwargs: Any) -> Any:
        dist.init_process_group = join
        result = join(*args, **kwargs)
        if dist.get_rank() == int(rank):
            time.sleep(float(seconds))
        return result

    dist.init_process_group = join_then_sleep


def namespaces(package: str) -> tuple[str, str]:
    return (
        ("lightning.pytorch", "lightning.fabric")
        if package == "lightning"
        else ("pytorch_lightning", "lightning_fabric")
    )


def figures(fsdp_root: nn.Module, optimizer: torch.optim.Optimizer, grads: int) -> dict[str, Any]:
    flat = flat_parameters(fsdp_root)
    return {
        "flat_param_dtypes": sorted({str(p.dtype) for p in flat}),
        "flat_param_numel": sum(p.numel() for p in flat),
        "flat_param_bytes": measure.nbytes(flat),
        "grad_bytes": grads,
        "optimizer_state_bytes": optimizer_state_bytes(optimizer),
        "param_dtypes": sorted({str(p.dtype) for p in fsdp_root.parameters()}),
    }


def shim_active() -> bool:
    """Whether the shim was activated in this process (``_fsdp_shim.activation`` is imported by the
    probe module too, which activates nothing)."""
    return getattr(sys.modules.get("_fsdp_shim.activation"), "_active", None) is True


def shim_facts(trainer_ns: str, fabric_ns: str) -> dict[str, Any]:
    """What the shim did to the classes this process used (read from the classes, not the shim)."""
    from _fsdp_shim.wrappers import is_shim_wrapper

    def wrapped(module: str, cls: str, attr: str) -> bool:
        owner = getattr(importlib.import_module(module), cls, None)
        return owner is not None and is_shim_wrapper(owner.__dict__.get(attr))

    precision_cls = (
        "FSDPPrecision"
        if hasattr(importlib.import_module(f"{trainer_ns}.plugins.precision.fsdp"), "FSDPPrecision")
        else "FSDPPrecisionPlugin"
    )
    return {
        "trainer_convert_module": wrapped(f"{trainer_ns}.plugins.precision.fsdp", precision_cls, "convert_module"),
        "fabric_convert_module": wrapped(f"{fabric_ns}.plugins.precision.fsdp", "FSDPPrecision", "convert_module"),
        "trainer_setup": wrapped(f"{trainer_ns}.strategies.fsdp", "FSDPStrategy", "setup"),
        "trainer_connect": wrapped(f"{trainer_ns}.strategies.fsdp", "FSDPStrategy", "connect"),
    }


def token_batches() -> torch.Tensor:
    return torch.randint(0, VOCAB, (8, SEQ + 1), generator=torch.Generator().manual_seed(0))


def feature_batches(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(8, FEATURES, generator=torch.Generator().manual_seed(0), dtype=dtype)


def seed_loss(transformer: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    output = transformer(batch[:, :-1], batch[:, 1:])
    return F.nll_loss(output, batch[:, 1:].reshape(-1))


# ----------------------------------------------------------------------------- Trainer
def run_trainer_case(
    pl: Any,
    strategy_cls: type,
    kind: str,
    precision: str,
    devices: int,
    ckpt_dir: str | None,
    num_nodes: int = 1,
    stages: tuple[str, ...] = ("fit",),
    strategy_kwargs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    from torch.utils.data import DataLoader, TensorDataset

    transformer_class = importlib.import_module(f"{pl.__name__}.demos").Transformer

    class Probe(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.body: nn.Module | None = None
            self.head: nn.Module | None = None
            self.transformer: nn.Module | None = None
            self.grad_bytes = 0
            if kind in ("init", "init+pretrained"):
                self.body = make_body()
            if kind == "float64":
                self.body = make_body().double()

        def setup(self, stage: str) -> None:
            if kind == "setup_hook" and self.body is None:
                self.body = make_body()
                self.head = make_head()

        def configure_model(self) -> None:
            if kind == "pretrained" and self.body is None:
                self.body = make_body().float()  # what from_pretrained does: fp32 weights
            if kind in ("pretrained", "init+pretrained") and self.head is None:
                self.head = make_head().float()
            if kind == "seed" and self.transformer is None:
                with torch.device("meta"):
                    self.transformer = make_transformer(transformer_class)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (x,) = batch
            if self.transformer is not None:
                return seed_loss(self.transformer, x)
            y = self.body(x)
            if self.head is not None:
                y = self.head(y)
            return (y.float() ** 2).mean()

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            self.grad_bytes = grad_bytes(self.trainer.strategy.model)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            # The wrapped model: 2.0.x needs it (no use_orig_params), later releases accept it too.
            return torch.optim.Adam(self.trainer.model.parameters(), lr=1e-3)

    class ProbeWithStages(Probe):
        """``--stages``: the steps validate, test and predict need (only then, so plain runs keep ``Probe``)."""

        def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.training_step(batch, batch_idx)

        def test_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.training_step(batch, batch_idx)

        def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.training_step(batch, batch_idx)

    data = token_batches() if kind == "seed" else feature_batches()
    loader = DataLoader(TensorDataset(data), batch_size=4)
    common = dict(
        accelerator="cpu",
        devices=devices,
        num_nodes=num_nodes,
        precision=precision,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    model = ProbeWithStages() if tuple(stages) != ("fit",) else Probe()
    strategy_kwargs = strategy_kwargs or {}
    trainer = pl.Trainer(strategy=strategy_cls(**strategy_kwargs), max_steps=2, enable_checkpointing=False, **common)
    trainer.fit(model, loader)
    result = {"module_dtype": str(model.dtype), "global_step": trainer.global_step}
    result.update(figures(trainer.strategy.model, trainer.optimizers[0], model.grad_bytes))
    for stage in stages[1:]:  # in the same process group, each with a Trainer and a model of its own
        evaluated = ProbeWithStages()
        getattr(pl.Trainer(strategy=strategy_cls(**strategy_kwargs), **common), stage)(evaluated, loader)
    if len(stages) > 1:
        result["stages"] = list(stages)
    if ckpt_dir is not None:
        path = os.path.join(ckpt_dir, "probe.ckpt")
        trainer.save_checkpoint(path)
        resumed_model = Probe()
        resumed = pl.Trainer(
            strategy=strategy_cls(**strategy_kwargs), max_steps=4, enable_checkpointing=False, **common
        )
        resumed.fit(resumed_model, loader, ckpt_path=path)
        result["resumed"] = {"module_dtype": str(resumed_model.dtype), "global_step": resumed.global_step}
        result["resumed"].update(figures(resumed.strategy.model, resumed.optimizers[0], resumed_model.grad_bytes))
    return result


# ----------------------------------------------------------------------------- Fabric
def build_plain_model(kind: str, pretrained_context: Any) -> nn.Module:
    model = nn.Module()
    if kind == "float64":
        model.body = make_body().double()
        return model
    if kind in ("init", "init+pretrained"):
        model.body = make_body()
    if kind in ("pretrained", "init+pretrained"):
        with pretrained_context():
            if kind == "pretrained":
                model.body = make_body().float()
            model.head = make_head().float()
    return model


def plain_forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    y = model.body(x)
    if hasattr(model, "head"):
        y = model.head(y)
    return (y.float() ** 2).mean()


class Plain(nn.Module):
    """Holds the layers and gives them a forward, so FSDP wraps one root module."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return plain_forward(self.inner, x)


def train_plain(model: nn.Module, optimizer: torch.optim.Optimizer, backward: Any, input_dtype: torch.dtype) -> int:
    grads = 0
    for x in feature_batches().split(4):
        loss = model(x.to(input_dtype))
        backward(loss)
        grads = grad_bytes(model)
        optimizer.step()
        optimizer.zero_grad()
    return grads


def run_fabric_case(fabric: Any, kind: str, precision: str, extra_model_on_rank: int | None = None) -> dict[str, Any]:
    model = Plain(build_plain_model(kind, getattr(fabric, "init_module", None)))  # 2.0.x has none
    if extra_model_on_rank is not None and fabric.global_rank == extra_model_on_rank:
        # A model only this rank sets up (an EMA copy, a teacher on rank zero): one more conversion here.
        fabric.setup_module(Plain(build_plain_model("init", getattr(fabric, "init_module", None))))
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-3))
    fsdp_root = model._forward_module
    # 2.0.x gives FSDP with "32-true" a plain Precision, which has no _desired_input_dtype.
    input_dtype = getattr(fabric._precision, "_desired_input_dtype", torch.float32)
    grads = train_plain(fsdp_root, optimizer, fabric.backward, input_dtype)
    return figures(fsdp_root, optimizer, grads)


# ----------------------------------------------------------------------------- plain PyTorch
TORCH_DTYPES = {"bf16-true": torch.bfloat16, "16-true": torch.float16, "32-true": torch.float32}


def run_torch_case(trainer_ns: str, kind: str, precision: str) -> dict[str, Any]:
    """What plain PyTorch FSDP does with the same layers cast to the precision's dtype."""
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision

    dtype = TORCH_DTYPES[precision]
    if kind == "seed":  # the same demo class the Trainer run used
        model: nn.Module = make_transformer(importlib.import_module(f"{trainer_ns}.demos").Transformer)
    else:
        layers = build_plain_model("init+pretrained" if kind == "setup_hook" else kind, _null_context)
        model = Plain(layers)
    model = model.to(dtype=dtype)
    policy = MixedPrecision(param_dtype=dtype, reduce_dtype=dtype, buffer_dtype=dtype)
    fsdp = FullyShardedDataParallel(model, device_id=torch.device("cpu"), mixed_precision=policy, use_orig_params=True)
    optimizer = torch.optim.Adam(fsdp.parameters(), lr=1e-3)
    if kind == "seed":
        grads = 0
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # what Lightning's "-true" forward context does
        try:
            for batch in token_batches().split(4):
                seed_loss(fsdp, batch).backward()
                grads = grad_bytes(fsdp)
                optimizer.step()
                optimizer.zero_grad()
        finally:
            torch.set_default_dtype(previous)
    else:
        grads = train_plain(fsdp, optimizer, lambda loss: loss.backward(), dtype)
    return figures(fsdp, optimizer, grads)


class _null_context:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def init_torch_distributed(devices: int) -> int:
    """Plain PyTorch needs its own process group: under torchrun for 2 ranks, or a 1-rank group."""
    import torch.distributed as dist

    rank = int(os.environ.get("RANK", "0"))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", rank=rank, world_size=int(os.environ.get("WORLD_SIZE", devices)))
    return rank


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    cases = [tuple(case.split(":")) for case in args.cases.split(",")]
    if args.precision_on_rank is not None:
        rank_text, _, other = args.precision_on_rank.partition(":")
        if os.environ.get("RANK") == rank_text:  # a node configured differently from the others
            cases = [(kind, other) for kind, _ in cases]
    trainer_ns, fabric_ns = namespaces(args.package)
    configure_this_rank(args)
    delay_after_joining(args.delay_rank)
    if args.shim_off_rank is not None and os.environ.get("RANK") == str(args.shim_off_rank):
        os.environ["FSDP_SHIM"] = "0"  # what a node exported with FSDP_SHIM=0 looks like to its ranks
    if args.shim == "before":
        import fsdp_shim
    results: list[dict[str, Any]] = []
    rank = 0
    if args.api == "torch":
        rank = init_torch_distributed(args.devices)
        for kind, precision in cases:
            results.append({"case": f"{kind}:{precision}", **run_torch_case(trainer_ns, kind, precision)})
    else:
        pl = importlib.import_module(trainer_ns)
        fabric_module = importlib.import_module(fabric_ns)
        if args.shim == "after":
            import fsdp_shim  # noqa: F401
        cpu_guards.lift(trainer_ns, fabric_ns)
        strategy_kwargs: dict[str, Any] = {}
        if args.process_group_timeout is not None:
            from datetime import timedelta

            strategy_kwargs["timeout"] = timedelta(seconds=args.process_group_timeout)
        if args.api == "trainer":
            strategy_cls = importlib.import_module(f"{trainer_ns}.strategies").FSDPStrategy
            for kind, precision in cases:
                result = run_trainer_case(
                    pl,
                    strategy_cls,
                    kind,
                    precision,
                    args.devices,
                    args.checkpoint_dir,
                    args.num_nodes,
                    tuple(args.stages.split(",")),
                    strategy_kwargs,
                )
                results.append({"case": f"{kind}:{precision}", **result})
                fail_first_attempt_if_asked(args)
            rank = pl.utilities.rank_zero_only.rank
        else:
            fabric_strategy = importlib.import_module(f"{fabric_ns}.strategies").FSDPStrategy
            for kind, precision in cases:
                fabric = fabric_module.Fabric(
                    accelerator="cpu",
                    devices=args.devices,
                    num_nodes=args.num_nodes,
                    strategy=fabric_strategy(**strategy_kwargs),
                    precision=precision,
                )
                fabric.launch()
                result = run_fabric_case(fabric, kind, precision, args.extra_model_on_rank)
                results.append({"case": f"{kind}:{precision}", **result})
                fail_first_attempt_if_asked(args)
                rank = fabric.global_rank
        active = shim_active()
        results.append({"case": "_shim", **(shim_facts(trainer_ns, fabric_ns) if active else {})})
        results.append({"case": "_versions", "trainer": pl.__version__, "fabric": fabric_module.__version__})
    Path(f"{args.out}.rank{rank}.json").write_text(json.dumps(results, indent=1))
    leave_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
