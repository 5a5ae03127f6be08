"""The verify probe: ``gate`` reads every installed Trainer namespace and refuses unusable user modules before
anything trains; ``measure`` trains with FSDP and writes a ``RankResult`` per rank."""

from __future__ import annotations

import importlib
import json
import os
import sys
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Any

from _fsdp_shim.activation import status
from _fsdp_shim.config import TRAINER_NAMESPACES
from _fsdp_shim.verify.records import Options, ProbeRequest, RankResult

USER_ERROR, USAGE_ERROR = 1, 2


class ProbeStop(Exception):
    """End the probe with ``code``, after writing ``record`` as its error report."""

    def __init__(self, code: int, record: dict[str, Any]) -> None:
        super().__init__(record.get("message", ""))
        self.code, self.record = code, record


def one_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"


def user_error(phase: str, **extra: int) -> ProbeStop:
    """The exception being handled, as the user's: its traceback, one line, and whether it was raised in a
    recompute of torch's checkpoint (a frame of ``torch/utils/checkpoint.py``)."""
    error = sys.exc_info()[1]
    files = [frame.filename for frame in traceback.extract_tb(error.__traceback__)] if error else []
    record = {"kind": "user", "phase": phase, "traceback": traceback.format_exc(), **extra}
    in_recompute = any(Path(name).parts[-3:] == ("torch", "utils", "checkpoint.py") for name in files)
    return ProbeStop(USER_ERROR, {**record, "error": one_line(error) if error else "", "in_recompute": in_recompute})


def raised_in_torch_fsdp(error: BaseException) -> str | None:
    """Where ``error`` was raised, as ``torch/distributed/fsdp/FILE: FUNCTION``, when it was raised inside
    torch's FSDP: the innermost frames are torch's own, and one of them is FSDP's; else ``None``."""
    import torch

    root = Path(torch.__file__).resolve().parent
    frames = traceback.extract_tb(error.__traceback__)
    for frame in reversed(frames):
        path = Path(frame.filename).resolve()
        if not path.is_relative_to(root):
            return None  # code torch called (or its caller) raised it before any FSDP frame
        if path.is_relative_to(root / "distributed" / "fsdp"):
            return f"torch/{path.relative_to(root).as_posix()}: {frame.name}"
    return None


def check_fsdp_on_cpu() -> None:
    """Train one step of a one-layer FSDP model in a one-rank gloo group, as the CPU check does, before any
    user code runs: a torch that cannot run FSDP on CPU (torch 2.1's CPU device handle has no streams:
    ``TypeError: Stream() takes no arguments``) is named here, not blamed on the model."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel

    release = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    try:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    except Exception as error:
        message = f"torch {release} cannot start a gloo process group on this machine ({one_line(error)})"
        raise ProbeStop(USAGE_ERROR, {"kind": "usage", "message": message}) from error
    try:
        model = FullyShardedDataParallel(torch.nn.Linear(2, 2), device_id=torch.device("cpu"))
        model(torch.ones(1, 2)).sum().backward()
    except Exception as error:
        where = raised_in_torch_fsdp(error)
        if where is None:
            raise
        message = f"torch {release} cannot run FSDP on this machine's CPU ({one_line(error)}, raised in {where})"
        raise ProbeStop(USAGE_ERROR, {"kind": "usage", "message": message}) from error
    finally:
        dist.destroy_process_group()


def usage_error(message: str) -> ProbeStop:
    return ProbeStop(USAGE_ERROR, {"kind": "usage", "message": message})


def resolve(spec: str) -> Any:
    """``package.module:attribute`` (or ``:Class.factory``) -> the attribute; importing runs the user's code."""
    module_name, _, attribute = spec.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as error:
        if isinstance(error, ModuleNotFoundError) and error.name and module_name.startswith(error.name):
            raise usage_error(
                f"cannot import {module_name!r} (from {spec!r}): run verify where it is importable "
                "(the current folder, --model-path DIR, or PYTHONPATH)"
            ) from error
        raise user_error(f"importing {module_name}") from error
    for index, name in enumerate(attribute.split(".")):
        try:
            target = getattr(target, name)
        except AttributeError as error:
            owner = ".".join([module_name, *attribute.split(".")[:index]])
            raise usage_error(f"{owner} has no attribute {name!r} (from {spec!r})") from error
    return target


def trainer_namespace_of(obj: Any, kind: str) -> str | None:
    """The Trainer namespace whose ``kind`` class (LightningModule...) ``obj`` (class or instance) derives from."""
    cls = obj if isinstance(obj, type) else type(obj)
    bases = {namespace: getattr(sys.modules.get(namespace), kind, None) for namespace in TRAINER_NAMESPACES}
    return next((ns for ns, base in bases.items() if isinstance(base, type) and issubclass(cls, base)), None)


def checked(spec: str, kind: str) -> Any:
    """The class or factory ``spec`` names, refused unless it can give a Lightning ``kind``."""
    target = resolve(spec)
    if not callable(target):
        raise usage_error(f"{spec} is {type(target).__name__!r}, not a {kind} class or a factory that returns one")
    if isinstance(target, type) and trainer_namespace_of(target, kind) is None:
        raise usage_error(f"{spec} is a class, but not a subclass of Lightning's {kind}")
    return target


def check_training_data(spec: str, model: Any, namespace: str) -> None:
    cls: Any = model if isinstance(model, type) else type(model)
    if cls.train_dataloader is sys.modules[namespace].LightningModule.train_dataloader:
        raise usage_error(f"{spec} has no train_dataloader; pass --datamodule module:attr")


def construct(spec: str, init_args: dict[str, Any], kind: str) -> Any:
    target = checked(spec, kind)
    try:
        instance = target(**init_args)
    except Exception as error:
        raise user_error(f"constructing {spec}") from error
    if trainer_namespace_of(instance, kind) is None:
        raise usage_error(f"{spec} gave a {type(instance).__name__}, which is not a Lightning {kind}")
    return instance


def checkpointed_classes(specs: list[str]) -> set[type]:
    """``--activation-checkpointing``'s classes, as Lightning's ``activation_checkpointing_policy`` takes them."""
    from torch.nn import Module

    classes = [resolve(spec) for spec in specs]
    for spec, cls in zip(specs, classes):
        if not (isinstance(cls, type) and issubclass(cls, Module)):
            raise usage_error(f"--activation-checkpointing: {spec} is not a torch.nn.Module class")
    return set(classes)


def fix_states(namespace: str) -> dict[str, dict[str, Any]]:
    return {fix.fix: fix.as_dict() for fix in status().namespace(namespace).fixes}


def gate(options: Options) -> dict[str, Any]:
    """Every installed Trainer namespace's ``version`` and the shim's ``fixes``, or its ``import_failure``;
    with ``--model``, ``model_namespaces``: the namespace of the model's class, or those imported with it."""
    import torch

    from _fsdp_shim.distributions import import_failure, installed_packages

    if not torch.cuda.is_available():
        check_fsdp_on_cpu()
    namespaces: dict[str, dict[str, Any]] = {}
    model_namespaces: list[str] = []
    if options.model is not None:
        target = checked(options.model, "LightningModule")
        own = trainer_namespace_of(target, "LightningModule") if isinstance(target, type) else None
        if options.datamodule is not None:
            checked(options.datamodule, "LightningDataModule")
        elif own is not None:
            check_training_data(options.model, target, own)
        model_namespaces = [own] if own else [ns for ns in TRAINER_NAMESPACES if ns in sys.modules]
    checkpointed_classes(options.activation_checkpointing)
    for namespace in [ns for ns in TRAINER_NAMESPACES if ns.partition(".")[0] in installed_packages()]:
        try:
            version = getattr(importlib.import_module(namespace), "__version__", None) or "(unknown)"
        except Exception as error:
            namespaces[namespace] = {"version": "", "fixes": {}, "import_failure": import_failure(error)}
        else:
            namespaces[namespace] = {"version": version, "fixes": fix_states(namespace), "import_failure": None}
    return {"namespaces": namespaces, "model_namespaces": model_namespaces}


def train_and_measure(request: ProbeRequest) -> None:
    """Train the seed's model for ``request.namespace`` (or ``--model``) with FSDP; write this rank's result."""
    import torch

    from _fsdp_shim.verify import cpu_guards, measure, seed

    options, namespace, cuda = request.options, request.namespace, torch.cuda.is_available()
    torch.manual_seed(0)  # the runs compared bit for bit start from the same weights
    loader, datamodule = None, None
    strategy_options: dict[str, Any] = {}
    if options.model is None:
        pl = importlib.import_module(namespace)  # type: ignore[arg-type]
        model, loader, strategy_options = seed.build(pl, options.steps, options.devices)
    else:
        model = construct(options.model, options.init_args, "LightningModule")
        namespace = trainer_namespace_of(model, "LightningModule")
        pl = importlib.import_module(namespace)  # type: ignore[arg-type]
        if options.datamodule:
            datamodule = construct(options.datamodule, {}, "LightningDataModule")
        else:
            check_training_data(options.model, model, namespace)  # type: ignore[arg-type]
    baseline, classes = measure.rss_bytes(), checkpointed_classes(options.activation_checkpointing)
    if options.model is None and not classes:
        classes = {seed.causal_block()}  # the seed's own block that makes tensors without a dtype
    counted = tuple(classes)  # a checkpointed run counts the wrappers Lightning's policy put in
    if request.checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

        strategy_options["activation_checkpointing_policy"], counted = classes, (CheckpointWrapper,)
    if not cuda:
        cpu_guards.lift(namespace)  # type: ignore[arg-type]
    callback = measure.measuring_callback(pl, counted)
    trainer = pl.Trainer(
        accelerator="cuda" if cuda else "cpu",
        devices=options.devices,
        strategy=importlib.import_module(f"{namespace}.strategies").FSDPStrategy(**strategy_options),
        precision=options.precision,
        max_steps=options.steps,
        deterministic=bool(classes),  # compared bit for bit, also on CUDA
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[callback],
        **dict.fromkeys(("logger", "enable_checkpointing", "enable_progress_bar", "enable_model_summary"), False),
    )
    error = None
    try:
        trainer.fit(model, loader, datamodule=datamodule)
    except Exception as raised:
        if not request.checkpointing:
            raise user_error("training", rank=trainer.global_rank) from raised
        error = one_line(raised)
    if options.activation_checkpointing and not callback.checkpointed and not error:
        names = ", ".join(options.activation_checkpointing)
        raise usage_error(f"--activation-checkpointing: this model has no module of {names} to checkpoint")
    fixes = fix_states(namespace)  # type: ignore[arg-type]
    if error:
        result = RankResult(trainer.global_rank, checkpointed=callback.checkpointed, fixes=fixes, error=error)
    else:
        units = {name: getattr(model, name) for name in seed.UNITS} if options.model is None else {}
        result = callback.report(trainer, baseline, units, fixes)
    Path(f"{request.out}.rank{trainer.global_rank}.json").write_text(json.dumps(asdict(result)))
    leave_process_group(0, barrier=not error)  # after an error a collective may be pending: no barrier


def leave_process_group(code: int = 0, barrier: bool = True) -> None:
    """Leave together (no barrier after an error) and end without finalization, only in our own children: it
    can free torch.distributed state in a half-gone interpreter, aborting a C++ thread after complete results."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        if code == 0 and barrier:
            torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str]) -> None:
    """Run the probe that ``argv[0]`` (a ``records.ProbeRequest`` as JSON) asks for; never returns."""
    import fsdp_shim  # noqa: F401  (activates, before Lightning is imported, unless FSDP_SHIM=0)

    data = json.loads(argv[0])
    request = ProbeRequest(**{**data, "options": Options(**data["options"])})
    if request.options.model_path is not None:  # only for the modules the user named, from their folder
        sys.path.insert(0, request.options.model_path)
    try:
        if request.mode == "gate":
            Path(request.out).write_text(json.dumps(gate(request.options)))
        else:
            train_and_measure(request)
    except ProbeStop as stop:
        rank = stop.record.get("rank", int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0"))))
        Path(f"{request.out}.rank{rank}.error.json").write_text(json.dumps(stop.record))
        leave_process_group(stop.code)
    leave_process_group()
