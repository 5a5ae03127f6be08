"""The verify child process: ``python fsdp_shim/_children/verify_probe.py REQUEST_JSON`` runs :func:`main`
with a :class:`~fsdp_shim.verify.options.ProbeRequest` (the mode, where to write, verify's options).

``gate`` imports every installed Lightning Trainer namespace (and the user's module, with
``--model``) with the shim on and reports versions, import failures and what the shim did: enough
to answer "not needed" without training. ``measure`` trains for a few steps with FSDP and writes
one :class:`~fsdp_shim.verify.results.RankResult` per rank; ``fsdp-shim verify`` runs it once with
``FSDP_SHIM=0`` and once with ``FSDP_SHIM=1``. Lightning's launcher re-runs the entry script, with the
same request, on every other rank.

Exit codes: 0 done; 1 the user's code raised (the traceback is in the report); 2 a usage problem
(a ``--model`` that is no LightningModule, a module without training data). Anything else is a
failure of the check itself.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import fsdp_shim  # before Lightning: FSDP_SHIM decides whether it does anything
from _fsdp_shim.verify.options import Options, ProbeRequest
from _fsdp_shim.verify.results import GateResult, NamespaceGate, RankResult

USER_ERROR = 1
USAGE_ERROR = 2


class ProbeStop(Exception):
    """End the probe with ``code``, after writing ``record`` as its error report."""

    def __init__(self, code: int, record: dict[str, Any]) -> None:
        super().__init__(record.get("message", ""))
        self.code = code
        self.record = record


def user_error(phase: str) -> ProbeStop:
    return ProbeStop(USER_ERROR, {"kind": "user", "phase": phase, "traceback": traceback.format_exc()})


def usage_error(message: str) -> ProbeStop:
    return ProbeStop(USAGE_ERROR, {"kind": "usage", "message": message})


def resolve(spec: str) -> Any:
    """``package.module:attribute`` (or ``:Class.factory``) -> the attribute. Importing the user's
    module runs their code."""
    module_name, _, attribute = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name and module_name.startswith(error.name):
            raise usage_error(
                f"cannot import {module_name!r} (from {spec!r}): run verify where it is importable "
                "(the current folder, --model-path DIR, or PYTHONPATH)"
            ) from error
        raise user_error(f"importing {module_name}") from error
    except Exception as error:
        raise user_error(f"importing {module_name}") from error
    target: Any = module
    for index, name in enumerate(attribute.split(".")):
        try:
            target = getattr(target, name)
        except AttributeError as error:
            owner = ".".join([module_name, *attribute.split(".")[:index]])
            raise usage_error(f"{owner} has no attribute {name!r} (from {spec!r})") from error
    return target


def trainer_namespace_of(obj: Any, kind: str) -> str | None:
    """The Lightning Trainer namespace whose ``kind`` base class (LightningModule, LightningDataModule)
    ``obj`` (a class or an instance) derives from."""
    from _fsdp_shim.config import TRAINER_NAMESPACES

    cls = obj if isinstance(obj, type) else type(obj)
    for namespace in TRAINER_NAMESPACES:
        base = getattr(sys.modules.get(namespace), kind, None)
        if isinstance(base, type) and issubclass(cls, base):
            return namespace
    return None


def check_callable(spec: str, target: Any, kind: str) -> None:
    if not callable(target):
        raise usage_error(f"{spec} is {type(target).__name__!r}, not a {kind} class or a factory that returns one")
    if isinstance(target, type) and trainer_namespace_of(target, kind) is None:
        raise usage_error(f"{spec} is a class, but not a subclass of Lightning's {kind}")


def check_training_data(spec: str, target: Any, namespace: str) -> None:
    """A LightningModule class without ``train_dataloader`` (and no ``--datamodule``) cannot train."""
    base = sys.modules[namespace].LightningModule
    if getattr(target, "train_dataloader", None) is getattr(base, "train_dataloader", None):
        raise usage_error(f"{spec} has no train_dataloader; pass --datamodule module:attr")


def construct(spec: str, init_args: dict[str, Any], kind: str) -> Any:
    target = resolve(spec)
    check_callable(spec, target, kind)
    try:
        instance = target(**init_args)
    except Exception as error:
        raise user_error(f"constructing {spec}") from error
    if trainer_namespace_of(instance, kind) is None:
        raise usage_error(f"{spec} gave a {type(instance).__name__}, which is not a Lightning {kind}")
    return instance


# ----------------------------------------------------------------------------- gate
def gate(model: str | None, datamodule: str | None) -> GateResult:
    from _fsdp_shim.config import CAST, TRAINER_NAMESPACES
    from _fsdp_shim.distributions import import_failure, installed_packages

    result = GateResult()
    if model is not None:
        target = resolve(model)
        check_callable(model, target, "LightningModule")
        imported = [ns for ns in TRAINER_NAMESPACES if ns in sys.modules]
        own = trainer_namespace_of(target, "LightningModule") if isinstance(target, type) else None
        if own is not None and datamodule is None:
            check_training_data(model, target, own)
        if datamodule is not None:
            check_callable(datamodule, resolve(datamodule), "LightningDataModule")
        result.model_namespaces.extend([own] if own else imported)
    packages = installed_packages()
    for namespace in TRAINER_NAMESPACES:
        if namespace.partition(".")[0] not in packages:
            continue
        try:
            module = importlib.import_module(namespace)
        except Exception as error:
            result.namespaces[namespace] = NamespaceGate(import_failure=import_failure(error))
            continue
        version = getattr(module, "__version__", None) or "(unknown)"
        cast = fsdp_shim.status().namespace(namespace).fix(CAST.name)
        result.namespaces[namespace] = NamespaceGate(
            version=version,
            affected=CAST.affects(version),
            shim_patched=cast.patched,
            shim_reason=cast.reason,
        )
    return result


# ----------------------------------------------------------------------------- measure
def train_and_measure(out: str, namespace: str | None, options: Options) -> RankResult:
    """Train ``options.steps`` steps with FSDP (the seed's model for ``namespace``, or the user's
    ``--model``) and write this rank's figures to ``<out>.rank<N>.json``."""
    import torch

    from _fsdp_shim.verify import measure, seed

    cuda = torch.cuda.is_available()
    if options.model is None:
        assert namespace is not None, "the seed model is trained for one namespace"
        pl = importlib.import_module(namespace)
        baseline = measure.rss_bytes()
        model, loader, strategy_options = seed.build(pl, namespace, options.steps, options.devices)
        datamodule = None
    else:
        model = construct(options.model, options.init_args, "LightningModule")
        namespace = trainer_namespace_of(model, "LightningModule")
        pl = importlib.import_module(namespace)  # type: ignore[arg-type]
        baseline = measure.rss_bytes()
        datamodule = (
            construct(options.datamodule, {}, "LightningDataModule") if options.datamodule is not None else None
        )
        loader, strategy_options = None, {}
        is_overridden = importlib.import_module(f"{namespace}.utilities.model_helpers").is_overridden
        if datamodule is None and not is_overridden("train_dataloader", model):
            raise usage_error(f"{options.model} has no train_dataloader; pass --datamodule module:attr")
    if not cuda:
        from _fsdp_shim.verify import cpu_guards

        cpu_guards.lift(namespace)
    callback = measure.measuring_callback(pl)
    trainer = pl.Trainer(
        accelerator="cuda" if cuda else "cpu",
        devices=options.devices,
        strategy=importlib.import_module(f"{namespace}.strategies").FSDPStrategy(**strategy_options),
        precision=options.precision,
        max_steps=options.steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    try:
        if datamodule is not None:
            trainer.fit(model, datamodule=datamodule)
        else:
            trainer.fit(model, loader)
    except Exception as error:
        stop = user_error("training")
        stop.record["rank"] = trainer.global_rank
        raise stop from error
    units = seed.units(model) if options.model is None else {}
    cast = fsdp_shim.status().namespace(namespace).fix("cast")  # type: ignore[arg-type]
    result = measure.report(trainer, model, callback, baseline, units, pl, cast)
    Path(f"{out}.rank{trainer.global_rank}.json").write_text(result.to_json())
    return result


def leave_process_group(code: int = 0) -> None:
    """Leave together, then end this probe process without interpreter finalization.

    The report is written before the barrier. Finalization can free objects that still hold
    torch.distributed state after the interpreter is half gone; a C++ thread that needs the GIL then
    aborts the process ("terminate called without an active exception"), intermittently, which
    `verify` would report as a failed check although the run was complete. This is the probe's own
    child process, never the user's. After an error the barrier is skipped: other ranks may be gone.
    """
    torch = sys.modules.get("torch")
    if torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        if code == 0:
            torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str]) -> None:
    """Run the probe that ``argv[0]`` (a :class:`ProbeRequest` as JSON) asks for; never returns."""
    request = ProbeRequest.from_json(argv[0])
    options = request.options
    if options.model_path is not None:  # only for --model/--datamodule: the user's modules, from their folder
        sys.path.insert(0, options.model_path)
    try:
        if request.mode == "gate":
            Path(request.out).write_text(gate(options.model, options.datamodule).to_json())
        else:
            train_and_measure(request.out, request.namespace, options)
    except ProbeStop as stop:
        rank = stop.record.get("rank", int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0"))))
        Path(f"{request.out}.rank{rank}.error.json").write_text(json.dumps(stop.record))
        leave_process_group(stop.code)
    leave_process_group(0)


if __name__ == "__main__":  # verify runs it through fsdp_shim/_children/verify_probe.py; this is for a person debugging
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main(sys.argv[1:])
