"""The ``fsdp-shim`` command (also ``python -m fsdp_shim``)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from fsdp_shim import __version__, startup_files


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fsdp-shim",
        description="Lightning 2.5.0's FSDP 'true'-precision fix for Lightning 2.1–2.4.",
    )
    parser.add_argument("--version", action="version", version=f"fsdp-shim {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="run CMD with the shim active in every Python process it starts")
    run.add_argument("cmd", nargs=argparse.REMAINDER, help="the command and its arguments")

    for name, text in (("install", "write"), ("uninstall", "remove")):
        sub = commands.add_parser(name, help=f"{text} the environment-wide start-up file")
        where = sub.add_mutually_exclusive_group()
        where.add_argument("--user", action="store_true", help="the user site-packages instead")
        where.add_argument("--target", type=Path, metavar="DIR", help="this directory instead")

    status = commands.add_parser("status", help="what is installed and active, and whether it agrees")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.add_argument("--python-check", action="store_true", help="also ask a fresh interpreter")

    verify = commands.add_parser("verify", help="train the seed's model with the shim off and on, and compare")
    verify.add_argument("--precision", choices=("bf16-true", "16-true"), default="bf16-true")
    verify.add_argument("--devices", type=int, default=1)
    verify.add_argument("--steps", type=int, default=3)
    verify.add_argument("--json", action="store_true", help="machine-readable output")
    return parser


def _directory(args: argparse.Namespace) -> Path:
    return args.target if args.target is not None else startup_files.default_directory(user=args.user)


def _install(args: argparse.Namespace) -> int:
    directory = _directory(args)
    written, unchanged = startup_files.install(directory)
    for path in written:
        print(f"wrote {path}")
    for path in unchanged:
        print(f"already installed: {path}")
    if args.target is None and directory.resolve() not in {
        d.resolve() for d in startup_files.site_directories() if d.exists()
    }:
        print(f"note: {sys.executable} does not read {directory} at start-up", file=sys.stderr)
    return 0


def _uninstall(args: argparse.Namespace) -> int:
    directory = _directory(args)
    removed = startup_files.uninstall(directory)
    for path in removed:
        print(f"removed {path}")
    if not removed:
        print(f"nothing to remove in {directory}")
    return 0


def _status(args: argparse.Namespace) -> int:
    from fsdp_shim import environment_report

    report = environment_report.collect(python_check=args.python_check)
    print(json.dumps(report.as_dict(), indent=2) if args.json else environment_report.render(report))
    return 0 if report.consistent else 1


def _verify(args: argparse.Namespace) -> int:
    from fsdp_shim.verify import command

    return command.main(precision=args.precision, devices=args.devices, steps=args.steps, as_json=args.json)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "run":
        from fsdp_shim.runner import run

        command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        return run(command)
    handlers = {"install": _install, "uninstall": _uninstall, "status": _status, "verify": _verify}
    return handlers[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
