"""The verify child process: ``python fsdp_shim/_children/verify_probe.py gate|measure ...`` runs :func:`main`.

``gate`` imports every installed Lightning Trainer namespace (and the user's module, with
``--model``) with the shim on and reports versions, import failures and what the shim did: enough
to answer "not needed" without training. ``measure`` trains for a few steps with FSDP and writes
one JSON report per rank; ``fsdp-shim verify`` runs it once with ``FSDP_SHIM=0`` and once with
``FSDP_SHIM=1``. Lightning's launcher re-runs this module on every rank.

Exit codes: 0 done; 1 the user's code raised (the traceback is in the report); 2 a usage problem
(a ``--model`` that is no LightningModule, a module without training data). Anything else is a
failure of the check itself.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import fsdp_shim  # before Lightning: FSDP_SHIM decides whether it does anything

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
    from fsdp_shim.lightning_install import TRAINER_NAMESPACES

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
def gate(model: str | None, datamodule: str | None) -> dict[str, Any]:
    from fsdp_shim.backport import is_affected_release
    from fsdp_shim.lightning_install import TRAINER_NAMESPACES, import_failure, installed_packages

    result: dict[str, Any] = {"namespaces": {}}
    if model is not None:
        target = resolve(model)
        check_callable(model, target, "LightningModule")
        imported = [ns for ns in TRAINER_NAMESPACES if ns in sys.modules]
        own = trainer_namespace_of(target, "LightningModule") if isinstance(target, type) else None
        if own is not None and datamodule is None:
            check_training_data(model, target, own)
        if datamodule is not None:
            check_callable(datamodule, resolve(datamodule), "LightningDataModule")
        result["model_namespaces"] = [own] if own else imported
    packages = installed_packages()
    for namespace in TRAINER_NAMESPACES:
        if namespace.partition(".")[0] not in packages:
            continue
        try:
            module = importlib.import_module(namespace)
        except Exception as error:
            result["namespaces"][namespace] = {"import_failure": import_failure(error)}
            continue
        version = getattr(module, "__version__", None) or "(unknown)"
        status = fsdp_shim.status().namespace(namespace)
        result["namespaces"][namespace] = {
            "version": version,
            "affected": is_affected_release(version),
            "shim_patched": status.patched,
            "shim_reason": status.reason,
        }
    return result


# ----------------------------------------------------------------------------- measure
def train_and_measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from fsdp_shim.verify import measure, seed

    cuda = torch.cuda.is_available()
    if args.model is None:
        namespace = args.namespace
        pl = importlib.import_module(namespace)
        baseline = measure.rss_bytes()
        model, loader, strategy_options = seed.build(pl, namespace, args.steps, args.devices)
        datamodule = None
    else:
        model = construct(args.model, json.loads(args.init_args), "LightningModule")
        namespace = trainer_namespace_of(model, "LightningModule")
        pl = importlib.import_module(namespace)  # type: ignore[arg-type]
        baseline = measure.rss_bytes()
        datamodule = construct(args.datamodule, {}, "LightningDataModule") if args.datamodule is not None else None
        loader, strategy_options = None, {}
        is_overridden = importlib.import_module(f"{namespace}.utilities.model_helpers").is_overridden
        if datamodule is None and not is_overridden("train_dataloader", model):
            raise usage_error(f"{args.model} has no train_dataloader; pass --datamodule module:attr")
    if not cuda:
        from fsdp_shim.verify import cpu_guards

        cpu_guards.lift(namespace)
    callback = measure.measuring_callback(pl)
    trainer = pl.Trainer(
        accelerator="cuda" if cuda else "cpu",
        devices=args.devices,
        strategy=importlib.import_module(f"{namespace}.strategies").FSDPStrategy(**strategy_options),
        precision=args.precision,
        max_steps=args.steps,
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
    units = seed.units(model) if args.model is None else {}
    report = measure.report(trainer, model, callback, baseline, units)
    status = fsdp_shim.status().namespace(namespace)
    report.update(lightning=pl.__version__, namespace=namespace, shim_patched=status.patched, shim_reason=status.reason)
    Path(f"{args.out}.rank{trainer.global_rank}.json").write_text(json.dumps(report))
    return report


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


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m fsdp_shim.verify.probe")
    parser.add_argument("mode", choices=("gate", "measure"))
    parser.add_argument("--out", required=True)
    parser.add_argument("--namespace", default=None)
    parser.add_argument("--precision", default="bf16-true")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--model", default=None)
    parser.add_argument("--init-args", default="{}")
    parser.add_argument("--datamodule", default=None)
    parser.add_argument("--model-path", default=None)
    return parser.parse_args(argv)


def main(argv: list[str]) -> None:
    args = parse(argv)
    if args.model_path is not None:  # only for --model/--datamodule: the user's modules, from their folder
        sys.path.insert(0, args.model_path)
    try:
        if args.mode == "gate":
            Path(args.out).write_text(json.dumps(gate(args.model, args.datamodule)))
        else:
            train_and_measure(args)
    except ProbeStop as stop:
        rank = stop.record.get("rank", int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0"))))
        Path(f"{args.out}.rank{rank}.error.json").write_text(json.dumps(stop.record))
        leave_process_group(stop.code)
    leave_process_group(0)


if __name__ == "__main__":  # verify runs it through fsdp_shim/_children/verify_probe.py; this is for a person debugging
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main(sys.argv[1:])
