"""How every test program that used torch.distributed ends: the scenarios, and ``tests/child.py``.

Imported by path-neighbours (the scenario scripts run from this folder) and as
``scenarios.scenario_exit`` (``tests/child.py``); it imports nothing at module level, so a ``--shim off``
run stays free of fsdp_shim and torch is imported only where the program already has it.
"""

from __future__ import annotations

import os
import sys


def leave_process_group() -> None:
    """Leave together, tear gloo down, then end the process without interpreter finalization.

    Every rank has written its report before the barrier, so nothing is left to do. Finalization
    is skipped because it is not what these runs measure and it is not reliable: objects still
    holding torch.distributed state are freed while the interpreter is half gone, and a C++ thread
    that needs the GIL then aborts the process ("terminate called without an active exception"),
    intermittently, after a run whose results were complete (seen in CI in 3 of 15 matrix
    sessions with the barrier and destroy_process_group already in place, and in a one-process
    Trainer child on Lightning 2.1.4). It mirrors ``_fsdp_shim.verify.probe.leave_process_group``,
    which the package's probes use, because these programs must run without importing fsdp_shim.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
