"""One rank of a cluster job: real FSDP with the Trainer, then with Fabric, in one process.

Started by a cluster launcher (srun, torchrun), never by Lightning's own launcher: Lightning finds
the launcher's environment (SLURMEnvironment, TorchElasticEnvironment) and starts no processes.
Both APIs run in one process so that a job pays for one Python and one Lightning import per rank.
The models, the training and the measuring are ``tests/scenarios/fsdp_train.py``'s (imported, not
copied); only the CPU guards are lifted, here in the training program and nowhere else.

Each rank prints ``train_both: rank R node N FSDP_SHIM=V`` first, ``train_both: rank R failed: ...``
if it fails, and writes ``<out>.rank<N>.json``: its rank, node, the Trainer's and Fabric's measurements,
and what the shim did to the classes (read from the classes; empty where the shim was never
activated: every activation mode activates it, only one imports ``fsdp_shim``). ``--shim before``
imports fsdp_shim before Lightning (the ``import fsdp_shim`` mode); ``off`` never imports it, so any
shim seen comes from ``fsdp-shim run`` or ``FSDP_SHIM``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import socket
import sys
import time
from pathlib import Path

SCENARIOS = Path(__file__).resolve().parents[1] / "scenarios"
sys.path.insert(0, str(SCENARIOS))

CASE = "init+pretrained"
"""A layer built in ``__init__`` and an fp32 ``from_pretrained``-style layer: float32 on 2.4.0 without the fix."""


def node_name() -> str:
    if "SLURMD_NODENAME" in os.environ:
        return os.environ["SLURMD_NODENAME"]
    if "GROUP_RANK" in os.environ:  # torchrun's node rank
        return f"node{os.environ['GROUP_RANK']}"
    return socket.gethostname()


def launcher_rank() -> str:
    """The rank the launcher gave this process (before any process group exists)."""
    return os.environ.get("RANK", os.environ.get("SLURM_PROCID", "?"))


def main(argv: list[str]) -> None:
    """Say which rank runs where and with which ``FSDP_SHIM``, and how it ends: a job that fails
    (half-patched) writes no result files, and its tests read these lines instead."""
    rank, node = launcher_rank(), node_name()
    print(f"train_both: rank {rank} node {node} FSDP_SHIM={os.environ.get('FSDP_SHIM', '(unset)')}", flush=True)
    try:
        train(argv)
    except BaseException as error:
        print(f"train_both: rank {rank} failed: {type(error).__name__}: {error}", flush=True)
        raise


def train(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shim", choices=("off", "before"), default="off")
    parser.add_argument("--num-nodes", type=int, required=True)
    parser.add_argument("--devices", type=int, required=True, help="ranks per node")
    parser.add_argument("--precision", default="bf16-true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    started = time.monotonic()
    if args.shim == "before":
        import fsdp_shim  # noqa: F401
    import fsdp_train

    trainer_ns, fabric_ns = fsdp_train.namespaces("lightning")
    pl = importlib.import_module(trainer_ns)
    fabric_module = importlib.import_module(fabric_ns)
    fsdp_train.cpu_guards.lift(trainer_ns, fabric_ns)
    strategy_cls = importlib.import_module(f"{trainer_ns}.strategies").FSDPStrategy
    trainer = fsdp_train.run_trainer_case(
        pl, strategy_cls, CASE, args.precision, args.devices, None, num_nodes=args.num_nodes
    )
    fabric = fabric_module.Fabric(
        accelerator="cpu",
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=importlib.import_module(f"{fabric_ns}.strategies").FSDPStrategy(),
        precision=args.precision,
    )
    fabric.launch()
    result = {
        "rank": fabric.global_rank,
        "world_size": fabric.world_size,
        "trainer_rank": pl.utilities.rank_zero_only.rank,
        "node": node_name(),
        "trainer": trainer,
        "fabric": fsdp_train.run_fabric_case(fabric, CASE, args.precision),
        "shim": fsdp_train.shim_facts(trainer_ns, fabric_ns) if fsdp_train.shim_active() else {},
        "lightning": pl.__version__,
        "seconds": round(time.monotonic() - started, 1),
    }
    Path(f"{args.out}.rank{fabric.global_rank}.json").write_text(json.dumps(result, indent=1))
    fsdp_train.leave_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
