"""A test that hangs fails within its timeout, by name, and leaves no process of its behind.

Run on a throwaway test file in a fresh pytest, with the same plugins as this suite: a test that
starts a child which starts a grandchild, then waits forever (as a rank waiting for a dead peer does).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT

pytestmark = pytest.mark.release_independent

HANGING_TEST = """
import subprocess, sys, time
from pathlib import Path

def test_waits_for_a_peer_that_died(tmp_path):
    child = (
        "import subprocess, sys, time; "
        "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
        "open(sys.argv[1], 'w').write(str(g.pid)); time.sleep(600)"
    )
    proc = subprocess.Popen([sys.executable, "-c", child, PIDS])
    proc.wait()
"""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="the cleanup reads /proc")
def test_a_hanging_test_fails_by_name_and_its_processes_are_killed(tmp_path: Path) -> None:
    pids = tmp_path / "grandchild.pid"
    (tmp_path / "test_hang.py").write_text(f"PIDS = {str(pids)!r}\n" + HANGING_TEST)
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "process_cleanup", "--timeout", "5"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT / "tests")},
        timeout=120,
    )
    took = time.monotonic() - start
    assert proc.returncode == 1, proc.stdout[-2000:]
    assert "FAILED test_hang.py::test_waits_for_a_peer_that_died" in proc.stdout
    assert "Timeout" in proc.stdout
    assert took < 60, took
    grandchild = int(pids.read_text())
    deadline = time.monotonic() + 5
    while alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(grandchild), f"grandchild {grandchild} outlived the timed-out test"
