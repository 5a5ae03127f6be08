"""verify's probe, a fresh process per shim state: reads Lightning, refuses unusable user modules, trains its runs."""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # by path, never -c or -m (which put the current folder, a user's yaml.py, first)
    here = os.path.dirname(os.path.realpath(__file__))  # off sys.path: its modules would shadow the user's
    sys.path[:] = [entry for entry in sys.path if os.path.realpath(entry or os.curdir) != here]
    if (root := os.path.dirname(os.path.dirname(here))) not in {os.path.realpath(e or os.curdir) for e in sys.path}:
        sys.path.insert(0, root)  # a clone's, so the probe imports the fsdp_shim that started it

import importlib
import json
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

from _fsdp_shim.activation import status
from _fsdp_shim.config import CAST, TRAINER_NAMESPACES
from _fsdp_shim.status import distribution_of, import_failure, installed_packages
from _fsdp_shim.verify import PACKAGES
from _fsdp_shim.verify.command import SHIM, Options, RankResult

VOCAB, SEQUENCE, BATCH, WIDTH = 256, 32, 4, 32  # the seed model's


class ProbeStop(Exception):  # end the probe, writing record as its error report: exit 2 for "usage", 1 for "user"
    def __init__(self, kind: str, message: str, **record: Any) -> None:
        super().__init__(message)
        self.code, self.record = 2 if kind == "usage" else 1, {"kind": kind, "message": message, **record}


def one_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"


def user_error(phase: str, error: BaseException, **extra: int) -> ProbeStop:
    """``error``, raised by the user's code: its traceback, and whether a recompute of torch's checkpoint raised it."""
    frames = [Path(frame.filename).parts[-3:] for frame in traceback.extract_tb(error.__traceback__)]
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    in_recompute = ("torch", "utils", "checkpoint.py") in frames
    return ProbeStop("user", one_line(error), phase=phase, traceback=text, in_recompute=in_recompute, **extra)


def resolve(spec: str, expected: str, usable: Callable[[Any], bool]) -> Any:
    """``package.module:attribute`` (or ``:Class.factory``) -> the attribute, refused unless ``usable``."""
    module_name, _, attribute = spec.partition(":")  # an empty part splits into [""], no identifier
    if not all(part.isidentifier() for part in [*module_name.split("."), *attribute.split(".")]):
        raise ProbeStop("usage", f"{spec!r} is not MODULE:ATTR (e.g. my_project.model:MyModel)")
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as error:
        if isinstance(error, ModuleNotFoundError) and error.name and module_name.startswith(error.name):
            message = f"cannot import {module_name!r} ({spec}) from the current folder ({os.getcwd()}) or PYTHONPATH"
            raise ProbeStop("usage", message) from error
        raise user_error(f"importing {module_name}", error) from error
    for name in attribute.split("."):
        target = getattr(target, name, None)
    if not usable(target):
        raise ProbeStop("usage", f"{spec} is not {expected}")
    return target


def namespace_of(obj: Any, kind: str) -> str | None:
    """The Trainer namespace whose ``kind`` class (LightningModule...) ``obj`` (class or instance) derives from."""
    cls = obj if isinstance(obj, type) else type(obj)
    return next((ns for ns in TRAINER_NAMESPACES if issubclass(cls, getattr(sys.modules.get(ns), kind, ()))), None)


def checked(spec: str, kind: str, build: bool) -> Any:
    """The class or factory ``spec`` names, refused unless it gives a Lightning ``kind``; where ``build``, called
    with no arguments."""
    expected = f"a Lightning {kind} class or a factory that returns one"
    target = resolve(spec, expected, lambda t: callable(t) and not (isinstance(t, type) and not namespace_of(t, kind)))
    try:
        built = target() if build else target
    except Exception as error:
        raise user_error(f"constructing {spec}", error) from error
    if build and namespace_of(built, kind) is None:  # a factory's product
        raise ProbeStop("usage", f"{spec} is not {expected}")
    return built


def user_modules(options: Options, build: bool) -> tuple[Any, Any, set[type], list[str]]:
    """The model and datamodule (built, or class or factory), checkpointed classes, and the model's namespaces."""
    from torch.nn import Module

    model, datamodule, namespaces = None, None, list[str]()
    if options.model is not None:
        model = checked(options.model, "LightningModule", build)
        cls = type(model) if build else model  # a factory's namespaces are those it imported
        own = namespace_of(model, "LightningModule") if isinstance(cls, type) else None
        if options.datamodule is not None:
            datamodule = checked(options.datamodule, "LightningDataModule", build)
        elif own and cls.train_dataloader is sys.modules[own].LightningModule.train_dataloader:
            raise ProbeStop("usage", f"{options.model} has no train_dataloader; pass --datamodule module:attr")
        namespaces = [own] if own else [ns for ns in TRAINER_NAMESPACES if ns in sys.modules]
    classes = {
        resolve(spec, "a torch.nn.Module class", lambda t: isinstance(t, type) and issubclass(t, Module))
        for spec in options.activation_checkpointing
    }
    return model, datamodule, classes, namespaces


def plan(options: Options, version: str) -> list[str]:
    """The runs, by ``Section`` slot: none on 2.0.x, nor on 2.5+ without a recompute to check; 2.5+: no ``shim_off``."""
    checking = options.model is None or bool(options.activation_checkpointing)
    if CAST.affects(version):
        return ["shim_on", *["checkpointed_shim_on"] * checking, "shim_off", *["checkpointed_shim_off"] * checking]
    return ["shim_on", "checkpointed_shim_on", "checkpointed_shim_off"] if checking and CAST.built_in(version) else []


def read_lightning(options: Options) -> dict[str, Any]:
    """What the probe reads of Lightning: the namespace checked and its release, fix states and runs; the others'."""
    installed = [ns for ns in TRAINER_NAMESPACES if ns.partition(".")[0] in installed_packages()]
    namespace = PACKAGES[options.package] if options.package else (installed or ["Lightning"])[0]
    if namespace in installed and not options.package:  # the model's own (its module runs: after this check)
        namespace = (user_modules(options, build=False)[-1] + [namespace])[0]
    if namespace not in installed:  # none, or imported by the model yet not where Lightning packages are looked for
        raise ProbeStop("usage", f"{namespace} is not installed in this interpreter ({sys.executable})")
    try:
        version, failure = getattr(importlib.import_module(namespace), "__version__", None) or "(unknown)", None
    except Exception as error:
        version, failure = "", import_failure(error)
    fixes, runs = (fix_states(namespace), plan(options, version)) if failure is None else ({}, [])
    found = {ns: distribution_of(ns.partition(".")[0]) for ns in installed if ns != namespace}
    others = {ns: distribution[1] if distribution else "(unknown)" for ns, distribution in found.items()}
    return dict(namespace=namespace, version=version, import_failure=failure, fixes=fixes, plan=runs, others=others)


def fix_states(namespace: str) -> dict[str, dict[str, Any]]:
    return {fix.fix: fix.as_dict() for fix in status().namespace(namespace).fixes}


def seed_model(pl: Any, steps: int, devices: int) -> tuple[Any, Any, type]:
    """The seed model, its data, and its block to checkpoint, whose mask and scale have no dtype (docs/verify.md)."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    class CausalBlock(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.out = torch.nn.Embedding(VOCAB, WIDTH), torch.nn.Linear(WIDTH, VOCAB)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            h = self.embed(tokens) * torch.ones(WIDTH)
            mask = torch.full((tokens.shape[-1], tokens.shape[-1]), float("-inf")).triu(1)
            scores = h @ h.transpose(-1, -2) * WIDTH**-0.5 + mask
            return torch.log_softmax(self.out(scores.softmax(-1) @ h), -1)

    class SeedModel(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.block = CausalBlock()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            logits = self.block(batch[0][:, :-1]).float().reshape(-1, VOCAB)
            return torch.nn.functional.nll_loss(logits, batch[0][:, 1:].reshape(-1))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.trainer.model.parameters(), lr=1e-3)

    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH * steps * devices, SEQUENCE + 1), generator=generator)
    return SeedModel(), DataLoader(TensorDataset(tokens), batch_size=BATCH), CausalBlock


def train(options: Options, namespace: str, checkpointing: bool, out: Path) -> str | None:
    """Train the model with FSDP from the same weights as every run; write this rank's result; a checkpointed error."""
    import torch
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from _fsdp_shim.verify import cpu_guards, measure

    cuda = torch.cuda.is_available()
    torch.manual_seed(0)  # the runs compared bit for bit start from the same weights
    model, datamodule, classes, _ = user_modules(options, build=True)
    pl, loader = importlib.import_module(namespace), None
    if options.model is None:
        model, loader, block = seed_model(pl, options.steps, options.devices)
        classes = classes or {block}
    if not cuda:
        cpu_guards.lift(namespace)
    callback = measure.measuring_callback(pl, (CheckpointWrapper,) if checkpointing else tuple(classes))
    strategy = pl.strategies.FSDPStrategy(**({"activation_checkpointing_policy": classes} if checkpointing else {}))
    quiet = dict.fromkeys(("logger", "enable_checkpointing", "enable_progress_bar", "enable_model_summary"), False)
    steps = {"max_steps": options.steps, "limit_val_batches": 0, "num_sanity_val_steps": 0, "callbacks": [callback]}
    device = {"accelerator": "cuda" if cuda else "cpu", "devices": options.devices, "deterministic": bool(classes)}
    trainer = pl.Trainer(strategy=strategy, precision=options.precision, **device, **steps, **quiet)  # bit for bit
    error = None
    try:
        trainer.fit(model, loader, datamodule=datamodule)
    except Exception as raised:
        if not checkpointing and options.model is not None:
            raise user_error("training", raised, rank=trainer.global_rank) from raised
        if not checkpointing:
            raise  # the seed's: verify's failure, not the user's
        error = one_line(raised)
    if options.activation_checkpointing and not callback.checkpointed and not error:
        names = ", ".join(options.activation_checkpointing)
        raise ProbeStop("usage", f"--activation-checkpointing: this model has no module of {names} to checkpoint")
    rank, root, figures = trainer.global_rank, trainer.strategy.model, dict[str, Any]()
    if not error:
        flat = measure.flat_parameters(root)
        figures = dict(
            module_dtype=str(trainer.lightning_module.dtype),
            flat_param_dtypes=sorted({str(p.dtype) for p in flat}),
            param_bytes=measure.nbytes(flat),
            grad_bytes=callback.grad_bytes,
            optimizer_state_bytes=measure.optimizer_state_bytes(trainer.optimizers[0]),
            losses=callback.losses,
            param_hashes=measure.parameter_hashes(root),
            lightning=pl.__version__,
            namespace=pl.__name__,
        )
    result = RankResult(rank, checkpointed=callback.checkpointed, fixes=fix_states(namespace), error=error, **figures)
    Path(f"{out}.rank{rank}.json").write_text(json.dumps(asdict(result)))
    return error


def leave_process_group(code: int = 0, barrier: bool = True) -> None:
    """Leave together and end without finalization (only in our own children), which can abort a C++ thread."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        if code == 0 and barrier:
            torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str]) -> None:
    """Run the probe (never returns): ``argv`` is its files' prefix, the ``Options`` as JSON, and the slots to train."""
    import fsdp_shim  # noqa: F401  (activates, before Lightning is imported, unless FSDP_SHIM=0)

    out, options = Path(argv[0]), Options(**json.loads(argv[1]))
    if options.model or options.activation_checkpointing:  # only for the modules the user named, from their folder
        sys.path.insert(0, os.getcwd())
    try:
        gate = read_lightning(options)
        if os.environ.get("LOCAL_RANK", "0") == "0":  # Lightning's launcher gives the other ranks theirs
            Path(f"{out}.gate.json").write_text(json.dumps(gate))
        mine = [slot for slot in gate["plan"] if slot.endswith(SHIM[os.environ["FSDP_SHIM"]])]
        for slot in json.loads(argv[2]) if argv[2:] else mine:
            if train(options, gate["namespace"], slot.startswith("checkpointed"), out.parent / slot):
                leave_process_group(0, barrier=False)  # after an error a collective may be pending: no barrier
    except ProbeStop as stop:
        rank = stop.record.get("rank", int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0"))))
        Path(f"{out}.rank{rank}.error.json").write_text(json.dumps(stop.record))
        leave_process_group(stop.code)
    leave_process_group()


if __name__ == "__main__":  # Lightning's launcher re-runs sys.argv (this file, its arguments) on every other rank
    main(sys.argv[1:])
