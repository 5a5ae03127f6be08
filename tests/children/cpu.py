"""The CPU harness for children that must not import fsdp_shim before they choose to."""

from __future__ import annotations

import sys
from pathlib import Path


def lift_gpu_guards(*namespaces: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scenarios"))
    from cpu_fsdp_harness import lift_gpu_guards as lift

    lift(*namespaces)
