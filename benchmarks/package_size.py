"""The package's size, and how much of it a training process loads.

1. Lines of every top-level package the wheel ships (``fsdp_shim``, ``_fsdp_shim``), the version file excluded.
2. Lines of the package modules in ``sys.modules`` at the end of a 2-rank FSDP Fabric job in ``bf16-true``, armed
   by ``FSDP_SHIM=1`` (the start-up file of an installed fsdp-shim), on CPU with gloo. The job lifts Lightning's
   "FSDP needs a GPU" guards in its own processes, without the package's help, so that nothing else is loaded.

Usage: PYTHONPATH=.matrix/mixed-2.4.0 python benchmarks/package_size.py   (needs torch, Lightning 2.1+, fsdp-shim)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("fsdp_shim", "_fsdp_shim")

JOB = """
import json, sys
import torch
import lightning as L
from lightning.fabric.strategies import FSDPStrategy
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

init = FSDP.__init__
FSDP.__init__ = lambda self, *a, device_id=None, **k: init(self, *a, device_id=device_id or torch.device("cpu"), **k)
import lightning.fabric.connector as connector
connector._Connector._check_strategy_and_fallback = lambda self: None

fabric = L.Fabric(accelerator="cpu", devices=2, strategy=FSDPStrategy(), precision="bf16-true")
fabric.launch()
model = fabric.setup_module(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)))
optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
fabric.backward(model(torch.ones(2, 16)).float().sum())
optimizer.step()
loaded = sorted({
    m.__file__ for name, m in list(sys.modules.items())
    if name.split(".")[0] in ("fsdp_shim", "_fsdp_shim") and name != "_fsdp_shim._version" and getattr(m, "__file__", None)
})
if fabric.global_rank == 0:
    print("LOADED " + json.dumps(loaded))
"""


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def main() -> None:
    shipped = {
        str(path.relative_to(ROOT)): lines(path)
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        if path.name != "_version.py"
    }
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "job.py"
        script.write_text(JOB)
        path = os.pathsep.join(
            os.path.abspath(entry) for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry
        )
        env = {**os.environ, "FSDP_SHIM": "1", "MASTER_ADDR": "127.0.0.1", "PYTHONPATH": path}
        proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=folder)
    found = [line for line in proc.stdout.splitlines() if line.startswith("LOADED ")]
    if proc.returncode != 0 or not found:
        sys.exit(f"the job failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    loaded = {str(Path(path).resolve().relative_to(ROOT)): lines(Path(path)) for path in json.loads(found[0][7:])}
    print(f"package: {sum(shipped.values())} lines in {len(shipped)} files")
    print(f"loaded by a 2-rank FSDP Fabric job armed by FSDP_SHIM=1: {sum(loaded.values())} lines")
    for name, count in loaded.items():
        print(f"  {count:5}  {name}")


if __name__ == "__main__":
    main()
