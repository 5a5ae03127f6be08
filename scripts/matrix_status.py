"""Record one matrix session's outcome: what the shim decided per namespace, and the test counts.

Usage: matrix_status.py SESSION OUT.json JUNIT.xml  (run with the session's PYTHONPATH)
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import xml.etree.ElementTree as ET
from importlib import metadata
from pathlib import Path

PROBE = Path(__file__).resolve().parent / "matrix_probe.py"
"""Run by its path in the session's interpreter; prints the shim's decisions as one JSON line."""


def test_counts(junit: Path) -> dict[str, int]:
    if not junit.exists():
        return {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    root = ET.parse(junit).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    return counts


def torch_version() -> str:
    """The session's torch, also where the probe failed (the probe's own record says the same)."""
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "not installed"


def main(session: str, out: str, junit: str) -> None:
    probe = subprocess.run([sys.executable, str(PROBE)], capture_output=True, text=True)
    state = (
        json.loads(probe.stdout.strip().splitlines()[-1]) if probe.returncode == 0 else {"error": probe.stderr[-2000:]}
    )
    counts = test_counts(Path(junit))
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    record = {
        "session": session,
        "python": platform.python_version(),
        "torch": torch_version(),
        **state,
        "counts": counts,
    }
    Path(out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:4])
