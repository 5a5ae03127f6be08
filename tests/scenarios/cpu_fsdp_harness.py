"""The CPU harness for test processes that must not import fsdp_shim (a run with the shim off).

It loads ``fsdp_shim/verify/cpu_guards.py``, the one implementation of the GPU-guard lift, by file
path: importing it as a package module would run ``fsdp_shim/__init__`` and activate the shim.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "fsdp_shim" / "verify" / "cpu_guards.py"


def lift_gpu_guards(*namespaces: str) -> None:
    module = sys.modules.get("_fsdp_shim_test_cpu_guards")
    if module is None:
        spec = importlib.util.spec_from_file_location("_fsdp_shim_test_cpu_guards", _PATH)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    module.lift(*namespaces)
