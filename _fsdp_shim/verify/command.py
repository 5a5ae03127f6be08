"""``fsdp-shim verify``: for every installed Lightning Trainer namespace (or the user's own model),
train with the shim off and on in fresh processes, compare, and give a verdict it can stand by.

This module only runs it: a temporary folder for the probes' files, the plan (``plan.py``), and the
output (``render.py``, or ``--json``). How a probe runs is ``protocol.py`` (the process) and
``probe.py`` (inside it), what it measures ``measure.py``, and the verdicts ``verdict.py``.

Exit codes: 0 every verdict is "fixed" or "not needed"; 1 a FAILED verdict, or the user's model
raised (their traceback is printed); 2 a usage problem or an environment verify cannot run in.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from _fsdp_shim.verify.options import Options
from _fsdp_shim.verify.plan import environment_problem, verify
from _fsdp_shim.verify.protocol import Stop
from _fsdp_shim.verify.render import render
from _fsdp_shim.verify.verdict import overall


def main(options: Options) -> int:
    problem = environment_problem()
    if problem is not None:
        print(f"fsdp-shim verify: {problem}", file=sys.stderr)
        return 2
    start = time.monotonic()
    try:
        tmp = tempfile.mkdtemp(prefix="fsdp-shim-verify-")
    except OSError as error:
        print(
            f"fsdp-shim verify: no usable temporary folder ({type(error).__name__}: {error}); "
            "set TMPDIR to a writable folder",
            file=sys.stderr,
        )
        return 2
    try:
        sections = verify(options, Path(tmp))
    except Stop as stop:
        print(stop.message, file=sys.stderr)
        return stop.code
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    verdict, reason = overall(sections)
    if options.as_json:
        document = {
            "verdict": verdict,
            "reason": reason,
            "precision": options.precision,
            "devices": options.devices,
            "steps": options.steps,
            "model": options.model,
            "seconds": round(time.monotonic() - start, 1),
            "sections": [asdict(section) for section in sections],
        }
        print(json.dumps(document, indent=2))
    else:
        print(render(sections, options))
        print(f"(took {time.monotonic() - start:.0f} s)")
    return 1 if verdict == "FAILED" else 0
