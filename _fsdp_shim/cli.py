"""The ``fsdp-shim`` command (also ``python -m fsdp_shim``): its parser, ``run``, and calls into status and verify."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path
from typing import Any

from _fsdp_shim._version import __version__
from _fsdp_shim.config import SHIM_VARIABLE, switch_state
from _fsdp_shim.verify import PACKAGES, PROBE_TIMEOUT

BOOTSTRAP = str(Path(__file__).resolve().parent / "bootstrap")  # its sitecustomize arms the shim, then the user's
COMMANDS = {  # each command's description (its summary up to the colon) and example
    "run": "Run CMD with the shim active in every Python process it starts: a bootstrap sitecustomize goes\n"
    "first on PYTHONPATH, which torchrun workers, Lightning's launcher and spawned processes inherit.\n"
    "The command replaces fsdp-shim (exec): its exit code and signals are its own.\n\n"
    "example:\n  fsdp-shim run torchrun --nproc-per-node 8 train.py",
    "status": "What is installed and active, and whether the pieces agree: fsdp-shim run and FSDP_SHIM, the\n"
    "Lightning releases installed (read from metadata) and whether they still need each fix. Exit code 1,\n"
    "with a PROBLEM line, where the pieces disagree.\n\nexample:\n  fsdp-shim status --json",
    "verify": "Train a model for a few steps with FSDP, with the shim off and on, in fresh processes: a verdict\n"
    "per fix. Exit codes: 0 fixed or not needed; 1 FAILED, your model raised, --timeout; 2 cannot run; 130 Ctrl-C.\n\n"
    "example:\n  fsdp-shim verify --model my_project.model:MyModel --devices 2",
}


def _parser() -> argparse.ArgumentParser:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="fsdp-shim",
        description="Fixes for Lightning's FSDP 'true' precisions: the cast (2.1-2.4, as 2.5.0 does it) and\n"
        "the recompute (activation checkpointing in the forward's dtype, every release from 2.1).",
        epilog="example:\n  fsdp-shim verify          # does the shim fix this environment?\n"
        "  fsdp-shim run python train.py\n\n'fsdp-shim COMMAND --help' describes each command.",
        formatter_class=raw,
    )
    parser.add_argument("--version", action="version", version=f"fsdp-shim {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    add = {}
    for name, text in COMMANDS.items():
        description, _, epilog = text.partition("\n\n")
        summary = text[0].lower() + text[1 : text.index(":")]
        add[name] = commands.add_parser(name, help=summary, description=description, epilog=epilog, formatter_class=raw)
    add["run"].add_argument("cmd", nargs=argparse.REMAINDER, help="the command and its arguments")
    add["status"].add_argument("--json", action="store_true", help="machine-readable output")
    verify, default = add["verify"].add_argument, "(default: %(default)s)"
    verify("--precision", choices=("bf16-true", "16-true"), default="bf16-true", help=default)
    verify("--devices", type=_positive, default=1, metavar="N", help=f"processes (GPUs with CUDA) {default}")
    verify("--steps", type=_positive, default=3, metavar="N", help=f"training steps per run {default}")
    verify("--model", metavar="MODULE:ATTR", help="a LightningModule class or factory (default: the seed)")
    verify("--datamodule", metavar="MODULE:ATTR", help="a LightningDataModule class or factory for --model")
    classes: dict[str, Any] = {"type": lambda text: [item.strip() for item in text.split(",")], "default": []}
    checkpointed = "classes to checkpoint (default: the seed model's own causal block; with --model, not checked)"
    verify("--activation-checkpointing", **classes, metavar="MODULE:CLASS[,...]", help=checkpointed)
    seconds = f"how long one probe process (per shim state, with its ranks) may take {default}"
    verify("--timeout", type=lambda t: _positive(t, float), default=PROBE_TIMEOUT, metavar="SECONDS", help=seconds)
    verify("--package", choices=PACKAGES, help="for the seed model (default: lightning, else pytorch_lightning)")
    verify("--json", action="store_true", dest="as_json", help="machine-readable output, every figure per rank")
    return parser


def _positive(text: str, kind: type[float] = int) -> float:  # an argparse type: a number of kind above 0
    with contextlib.suppress(ValueError):
        if (value := kind(text)) > 0:
            return value
    raise argparse.ArgumentTypeError(f"{text!r} is not a positive {'whole ' * (kind is int)}number")


def _verify(args: argparse.Namespace) -> int:
    if args.model is None and args.datamodule:
        problem = "--datamodule needs --model"
    elif args.model is not None and args.package is not None:
        problem = "--package is for the seed model; with --model, your model's imports decide"
    else:
        from _fsdp_shim.verify.command import Options, main

        return main(Options(**{name: value for name, value in vars(args).items() if name != "command"}))
    print(f"fsdp-shim verify: {problem}", file=sys.stderr)
    return 2


def _run(args: argparse.Namespace) -> int:
    """Exec CMD with ``FSDP_SHIM=1`` where unset and the bootstrap first on PYTHONPATH, once; returns only where CMD
    cannot start: 127 or 126, as a shell."""
    command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not command:
        print("fsdp-shim run: no command given. Usage: fsdp-shim run CMD [ARGS...]", file=sys.stderr)
        return 2
    current = os.environ.get("PYTHONPATH", "")
    entries = [e for e in current.split(os.pathsep) if current and not (e and os.path.realpath(e) == BOOTSTRAP)]
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([BOOTSTRAP, *entries])}
    if switch_state(environ.get(SHIM_VARIABLE)) == "unset":
        environ[SHIM_VARIABLE] = "1"
    try:
        os.execvpe(command[0], command, environ)
    except (FileNotFoundError, PermissionError) as error:
        denied = isinstance(error, PermissionError)
        print(f"fsdp-shim run: {'permission denied' if denied else 'command not found'}: {command[0]}", file=sys.stderr)
        return 126 if denied else 127


def _status(args: argparse.Namespace) -> int:
    from _fsdp_shim import status

    return status.main(args.json)


def main(argv: list[str] | None = None) -> int:
    """Run one command; its exit code. Characters the terminal cannot show are escaped, and a reader that goes
    away (``fsdp-shim status | head -1``) ends it quietly with 141, the shell's code for a SIGPIPE stop."""
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):  # a TextIOWrapper, not a replacement (or None)
            stream.reconfigure(errors="backslashreplace")
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        if args.command is None:  # a bare `fsdp-shim`, as a bare `git`: what there is to do
            parser.print_help()
        code = {"run": _run, "status": _status, "verify": _verify}[args.command](args) if args.command else 0
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the flush at exit is silent too
        return 141
    return code
