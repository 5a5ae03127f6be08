"""A user's module that hangs, for ``fsdp-shim verify --timeout`` and Ctrl-C tests.

Every process that hangs records its pid in ``FSDP_SHIM_TEST_PIDS`` (a folder) first, and starts a
child that sleeps too, as Lightning's launcher starts the other ranks: verify must stop them all.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path


def hang() -> None:
    pids = Path(os.environ["FSDP_SHIM_TEST_PIDS"])
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    (pids / f"{helper.pid}.pid").write_text("helper")
    (pids / f"{os.getpid()}.pid").write_text("probe")
    time.sleep(3600)


hang()  # while verify reads the installed Lightning (its first probe imports this module before it trains)
