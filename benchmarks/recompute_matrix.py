"""The recompute fix across torch releases: for each torch environment given, each Lightning layout, the
Trainer and Fabric on FSDP (CPU, gloo), every checkpoint path compared with the same run without
checkpointing: without the shim on 1 rank (on more, the first case that raises ends the run: the ranks
no longer agree on their collectives) and with it on 2. Prints a Markdown table; each cell says whether the
checkpointed run equals the unchecked one bit for bit (every step's loss and gradients, every rank's
final parameters), differs, or raised.

    python benchmarks/recompute_matrix.py --lightning .matrix/mixed-2.4.0 \\
        --python .venv/bin/python --python /path/to/torch-2.15-env/bin/python

``--with-patch`` adds a column: torch's checkpoint as docs/upstream/checkpoint-default-dtype.patch makes it
(tests/patched_checkpoint, a copy; the installed torch is not touched), with the shim's recompute fix off
(``FSDP_SHIM_DISABLED_FIXES=recompute``), on as many ranks as the shim's column; "does not apply" where the
patch does not apply to that torch.

The runs are ``tests/scenarios/recompute.py``'s (blocks ``ones`` and ``mask``: a tensor made without a
dtype, and a causal mask); each interpreter must have torch, and this checkout on its path (it is put
there). Not a test: the test suite runs the same comparisons per session (``tests/test_recompute.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCENARIO = ROOT / "tests" / "scenarios" / "recompute.py"
PATCHED_CHECKPOINT = ROOT / "tests" / "patched_checkpoint"
BLOCKS = ("ones", "mask")
PATHS = {
    "policy": "Lightning's activation_checkpointing_policy",
    "nonreentrant": "checkpoint(use_reentrant=False)",
    "reentrant": "checkpoint(use_reentrant=True)",
    "composable": "torch.distributed._composable.checkpoint",
}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def run(
    python: str, lightning: str, package: str, api: str, devices: int, shim: str, out: Path, patched: bool = False
) -> dict:
    cases = [f"{block}:{mode}" for block in BLOCKS for mode in ("none", *PATHS)]
    command = [python, str(SCENARIO), "--api", api, "--strategy", "fsdp", "--devices", str(devices)]
    command += ["--precision", "bf16-true", "--shim", shim, "--package", package, "--cases", ",".join(cases)]
    command += ["--out", str(out)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([lightning, str(ROOT)]), "PYTHONWARNINGS": "ignore"}
    env["MASTER_PORT"] = str(free_port())
    if patched:
        env["PYTHONPATH"] = os.pathsep.join([str(PATCHED_CHECKPOINT), env["PYTHONPATH"]])
        env["FSDP_SHIM_DISABLED_FIXES"] = "recompute"
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    if patched and "PatchDoesNotApply" in proc.stderr:
        return {"rows": None}
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{proc.stderr[-3000:]}")
    ranks = [json.loads(Path(f"{out}.rank{rank}.json").read_text()) for rank in range(devices)]
    return {"rows": [{row["case"]: row for row in rows} for rows in ranks]}


def verdict(result: dict, case: str) -> str:
    block = case.split(":")[0]
    if result["rows"] is None:
        return "does not apply"
    for rows in result["rows"]:
        if case not in rows:
            return "not run (an earlier case raised)"
        if rows[case]["error"]:
            return "raised " + rows[case]["error"].split(":")[0]
        reference = rows[f"{block}:none"]
        if any(rows[case][key] != reference[key] for key in ("losses", "gradients", "params")):
            return "differs"
    return "equal"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", action="append", required=True, help="an interpreter with torch (repeatable)")
    parser.add_argument("--lightning", required=True, help="a folder with lightning and pytorch_lightning")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--with-patch", action="store_true", help="add the upstream patch's column")
    args = parser.parse_args()
    header = f"| torch | Lightning | API | path | block | without the shim (1 rank) | with it ({args.devices} ranks) |"
    if args.with_patch:
        header += f" torch patched, shim's recompute off ({args.devices} ranks) |"
    print(header)
    print("|---|---|---|---|---|---|---|" + ("---|" if args.with_patch else ""))
    with tempfile.TemporaryDirectory() as folder:
        for python in args.python:
            torch = subprocess.run(
                [python, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True, check=True
            ).stdout.strip()
            for package in ("lightning", "standalone"):
                for api in ("trainer", "fabric"):
                    results = {}
                    runs = [("off", "off", 1), ("on", "on", args.devices)]
                    runs += [("patched", "on", args.devices)] if args.with_patch else []
                    for name, shim, devices in runs:
                        out = Path(folder) / f"{len(list(Path(folder).iterdir()))}-{name}"
                        patched = name == "patched"
                        results[name] = run(python, args.lightning, package, api, devices, shim, out, patched)
                    version = results["on"]["rows"][0]["_lightning"]["version"]
                    for mode, path in PATHS.items():
                        for block in BLOCKS:
                            case = f"{block}:{mode}"
                            off, on = verdict(results["off"], case), verdict(results["on"], case)
                            row = f"| {torch} | {package} {version} | {api} | {path} | {block} | {off} | {on} |"
                            if args.with_patch:
                                row += f" {verdict(results['patched'], case)} |"
                            print(row)
                    sys.stdout.flush()


if __name__ == "__main__":
    main()
