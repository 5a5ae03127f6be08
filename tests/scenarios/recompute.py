"""Train one small model per case, with and without activation checkpointing, and record per rank what must match
bit for bit. Run as a script (Lightning's launcher re-runs ``sys.argv`` on every rank)::

    python recompute.py --api trainer --devices 2 --precision bf16-true --cases ones:none,mask:policy --out /tmp/r

A case is ``BLOCK:MODE``. Every block makes a tensor without an explicit dtype, which is the precision's dtype in
the forward (Lightning's "true" precisions set the default dtype there) and float32 in a recompute outside it:
``ones``, ``scalar``, ``mask`` (a causal mask), ``castback`` (computes in float32 and casts back: only the values
differ, which reentrant checkpointing does not check), ``probe`` (records the default dtype at every run of its
forward and in an ``autograd.Function``'s backward), ``llama`` (a tiny Hugging Face ``LlamaForCausalLM``).
Modes: ``none``, ``policy`` (Lightning's ``activation_checkpointing_policy``, FSDP only), ``nonreentrant`` and
``reentrant`` (``torch.utils.checkpoint`` in the model's forward), ``composable`` (FSDP2's checkpoint on each block),
``loss-none``, ``loss-nonreentrant`` and ``loss-reentrant`` (the loss checkpointed in the training step, outside the
model's forward). APIs: ``trainer``, ``manual`` (``manual_backward``), ``fabric`` (``--direct-backward``:
``loss.backward()``). Strategies: ``fsdp``, ``ddp``, ``single``.

Each rank writes ``<out>.rank<N>.json``: per case ``losses``, ``gradients`` (a SHA-256 of this rank's gradients
before each step), ``params`` (of its final parameters), the probe's ``block_dtypes`` and ``backward_dtypes`` and
``error``; then the rows ``_lightning`` and ``_shim``. After an error on more than one rank the run stops (the
ranks could no longer agree on their collectives). Nothing here knows what the answer should be: the tests compare.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from _fsdp_shim.verify.probe import leave_process_group  # activates nothing

FEATURES, SEQ, BATCH, STEPS = 16, 8, 4, 3
Run = tuple[list[float], list[str], str, int]  # losses and gradient hashes per step, the parameters' hash, the rank
BLOCK_DTYPES: list[str] = []  # the default dtype at every run of the probe's forward (forwards and recomputes)
BACKWARD_DTYPES: list[str] = []  # the default dtype in the backward of the probe's autograd.Function


class _RecordDefaultDtype(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        BACKWARD_DTYPES.append(str(torch.get_default_dtype()))
        return grad * (1 - torch.tensor(0.3))  # made in the default dtype of the backward


class Block(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind, self.lin = kind, nn.Linear(FEATURES, FEATURES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "probe":  # first: a recompute stops as soon as it has the tensors it needs
            BLOCK_DTYPES.append(str(torch.get_default_dtype()))
        h = torch.relu(self.lin(x))
        if self.kind == "mask":
            scores = h @ h.transpose(-1, -2) + torch.full((SEQ, SEQ), float("-inf")).triu(1)
            return torch.softmax(scores, dim=-1) @ h
        return {
            "ones": lambda: h * torch.ones(FEATURES),
            "scalar": lambda: h * (1 + torch.tensor(0.25)),
            "castback": lambda: (h.float() * torch.tensor(0.1)).to(h.dtype),
            "probe": lambda: _RecordDefaultDtype.apply(h),
        }[self.kind]()


class Net(nn.Module):
    """An input layer, two blocks (checkpointed in the ``*reentrant`` modes) and an output layer."""

    def __init__(self, kind: str, mode: str) -> None:
        super().__init__()
        self.mode, self.inp, self.out = mode, nn.Linear(FEATURES, FEATURES), nn.Linear(FEATURES, FEATURES)
        self.blocks = nn.ModuleList([Block(kind), Block(kind)])
        if mode == "composable":  # FSDP2's checkpoint: hooks on each block, which checkpoint its forward
            from torch.distributed._composable import checkpoint as composable_checkpoint

            for block in self.blocks:
                composable_checkpoint(block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            checkpointed = self.mode in ("reentrant", "nonreentrant")  # not the loss-* modes
            h = checkpoint(block, h, use_reentrant=self.mode == "reentrant") if checkpointed else block(h)
        return self.out(h)


def llama(mode: str) -> tuple[nn.Module, type]:
    """A tiny Llama and its decoder-layer class; ``*reentrant`` modes use Hugging Face's own switch. transformers may
    live in a folder of its own (``FSDP_SHIM_TEST_TRANSFORMERS``, noxfile.py), put last on the path only here."""
    if folder := os.environ.get("FSDP_SHIM_TEST_TRANSFORMERS"):
        sys.path.append(folder)
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ, attn_implementation="eager",
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    if mode in ("reentrant", "nonreentrant"):
        model.gradient_checkpointing_enable({"use_reentrant": mode == "reentrant"})
    return model, LlamaDecoderLayer


def build(kind: str, mode: str) -> tuple[nn.Module, set[type]]:
    torch.manual_seed(0)
    if kind == "llama":
        model, layer = llama(mode)
        return model, {layer}
    return Net(kind, mode), {Block}


def batches(kind: str, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    if kind == "llama":
        tokens = torch.randint(0, 64, (count, BATCH, SEQ + 1), generator=generator)
        return [(t[:, :-1], t[:, 1:]) for t in tokens]
    x = torch.randn(count, BATCH, SEQ, FEATURES, generator=generator)
    return list(zip(x, torch.randn(count, BATCH, SEQ, FEATURES, generator=generator)))


def loss_of(model: nn.Module, kind: str, mode: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if kind == "llama":
        logits = model(input_ids=x, use_cache=False).logits  # a cache would grow again in each recompute
        return nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
    out = model(x)
    if mode in ("loss-reentrant", "loss-nonreentrant"):
        return checkpoint(weighted_loss, out, y, use_reentrant=mode == "loss-reentrant")
    return weighted_loss(out, y) if mode == "loss-none" else ((out.float() - y.float()) ** 2).mean()


def weighted_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A loss that makes a tensor without an explicit dtype (``loss-*`` modes)."""
    return ((out.float() - y.float()) ** 2 * torch.tensor(1 / 3)).mean()  # a bfloat16 1/3 is 0.333984


def parameters_hash(module: nn.Module, of: str = "data") -> str:
    """SHA-256 of this rank's parameters (``of="grad"``: their gradients), FSDP's flat (sharded) ones if any."""
    from _fsdp_shim.verify import measure  # activates nothing

    digest = hashlib.sha256()
    for tensor in measure.flat_parameters(module) or list(module.parameters()):
        value = tensor.detach() if of == "data" else tensor.grad
        found = b"no gradient" if value is None else str(value.dtype).encode() + value.float().cpu().numpy().tobytes()
        digest.update(found)
    return digest.hexdigest()


def strategy_for(args: argparse.Namespace, namespace: str, mode: str, layers: set[type]) -> Any:
    if args.strategy != "fsdp":
        return "ddp" if args.strategy == "ddp" else "auto"
    fsdp = importlib.import_module(f"{namespace}.strategies").FSDPStrategy
    return fsdp(auto_wrap_policy=layers, activation_checkpointing_policy=layers if mode == "policy" else None)


def run_trainer(args: argparse.Namespace, namespace: str, kind: str, mode: str) -> Run:
    pl = importlib.import_module(namespace)
    net, layers = build(kind, mode)
    data = batches(kind, STEPS * args.devices)
    manual = args.api == "manual"

    class Model(pl.LightningModule):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.net, self.automatic_optimization = net, not manual
            self.losses: list[float] = []
            self.gradients: list[str] = []

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            loss = loss_of(self.net, kind, mode, *batch)
            self.losses.append(loss.item())
            if not manual:
                return loss
            optimizer = self.optimizers()
            self.manual_backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            return None

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            self.gradients.append(parameters_hash(self.trainer.strategy.model, "grad"))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.trainer.model.parameters(), lr=0.05)

    model = Model()
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.devices, strategy=strategy_for(args, namespace, mode, layers),
        precision=args.precision, max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    loader = torch.utils.data.DataLoader(data, batch_size=None)
    trainer.fit(model, loader)
    return model.losses, model.gradients, parameters_hash(trainer.strategy.model), trainer.global_rank


def run_fabric(args: argparse.Namespace, namespace: str, kind: str, mode: str) -> Run:
    net, layers = build(kind, mode)
    strategy = strategy_for(args, namespace, mode, layers)
    fabric = importlib.import_module(namespace).Fabric(
        accelerator="cpu", devices=args.devices, strategy=strategy, precision=args.precision
    )
    fabric.launch()
    model = fabric.setup_module(net)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.05))
    losses, gradients = [], []
    for x, y in batches(kind, STEPS * args.devices)[fabric.global_rank :: args.devices]:
        loss = loss_of(model, kind, mode, x, y)
        loss.backward() if args.direct_backward else fabric.backward(loss)
        gradients.append(parameters_hash(model._forward_module, "grad"))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, gradients, parameters_hash(model._forward_module), fabric.global_rank


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--api", choices=("trainer", "manual", "fabric"), required=True)
    parser.add_argument("--strategy", choices=("fsdp", "ddp", "single"), default="fsdp")
    parser.add_argument("--package", choices=("lightning", "standalone"), default="lightning")
    parser.add_argument("--shim", choices=("off", "on"), default="on")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--precision", default="bf16-true")
    parser.add_argument("--cases", required=True, help="comma-separated BLOCK:MODE")
    parser.add_argument("--direct-backward", action="store_true", help="Fabric: loss.backward()")
    parser.add_argument("--logging", choices=("none", "info"), default="none", help="info: logging.basicConfig at INFO")
    parser.add_argument("--out", required=True)
    return parser.parse_args(argv)


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if args.logging == "info":  # as Ray Train's workers and many scripts do, before anything logs
        import logging

        logging.basicConfig(level=logging.INFO)
    if args.shim == "on":
        import fsdp_shim  # noqa: F401
    packages = {
        "lightning": ("lightning.pytorch", "lightning.fabric"),
        "standalone": ("pytorch_lightning", "lightning_fabric"),
    }
    namespace = packages[args.package][args.api == "fabric"]
    importlib.import_module(namespace)
    if args.strategy == "fsdp":
        from _fsdp_shim.verify import cpu_guards  # activates nothing

        cpu_guards.lift(namespace)
    run = run_fabric if args.api == "fabric" else run_trainer
    results: dict[str, Any] = {}
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    for case in args.cases.split(","):
        kind, mode = case.split(":")
        BLOCK_DTYPES.clear()
        BACKWARD_DTYPES.clear()
        try:
            losses, gradients, params, rank = run(args, namespace, kind, mode)
            results[case] = {"losses": losses, "gradients": gradients, "params": params, "error": None}
            results[case].update(block_dtypes=list(BLOCK_DTYPES), backward_dtypes=list(BACKWARD_DTYPES))
        except Exception as error:
            message = str(error).strip().splitlines()[0] if str(error).strip() else ""
            results[case] = {"error": f"{type(error).__name__}: {message}", "traceback": traceback.format_exc()[-2000:]}
            if args.devices > 1:
                break
    results["_lightning"] = {"version": importlib.import_module(namespace).__version__, "namespace": namespace}
    activation = sys.modules.get("_fsdp_shim.activation")  # imported by probe, which activates nothing
    results["_shim"] = {"active": getattr(activation, "_active", None) is True}
    rows = [{"case": case, **row} for case, row in results.items()]
    Path(f"{args.out}.rank{rank}.json").write_text(json.dumps(rows, indent=1))
    if any(case.get("error") for case in results.values()) and args.devices > 1:
        sys.stdout.flush()
        os._exit(0)  # no barrier: after an error the ranks may no longer meet
    leave_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
