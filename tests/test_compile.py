"""``torch.compile`` with the ``aot_eager`` backend and compiled autograd, a reentrant checkpoint and a
bfloat16 default dtype around the forward (Lightning's ``bf16-true``): no worse with the shim than
without. It was reported that such a run trained without the shim and failed with it ("expected m1 and
m2 to have the same dtype"): the pin switched the default dtype inside the region compiled autograd
traces. ``in_forward_dtype`` now leaves the call alone while ``torch.compiler.is_compiling()``.

This model does not bring the reported failure back: with the skip taken out (in a throwaway
process, torch 2.13.0) its first two cases and a non-reentrant one came out as below too, so the test
guards "no worse with the shim", not that one report.

Each side runs in a fresh interpreter (``tests/children/compile_runs.py``): without the shim (fsdp_shim
never imported) and with it (``import fsdp_shim; import lightning`` before the model is built). Same
outcome for every case, and where both train, the same losses and gradients bit for bit. The cases:

* ``reentrant``/``plain``: a checkpointed block that gives every tensor an explicit dtype: trains both
  ways, bit for bit alike (torch 2.13.0 and 2.15.0).
* ``reentrant``/``ones``: the block makes ``torch.ones`` without a dtype: fails both ways ("mat1 and mat2
  must have the same dtype"); eager, the shim makes it train.
* ``none``/``ones``: the same block without any checkpoint already fails under ``aot_eager`` without the
  shim ("expected m1 and m2 to have the same dtype"), and the same with it: not a checkpoint problem.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
from conftest import CHILD, clean_env, last_json

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch"),
    pytest.mark.skipif(
        not any(importlib.util.find_spec(name) for name in ("lightning", "pytorch_lightning")),
        reason="needs Lightning (the shim patches torch's checkpoint when Lightning is imported)",
    ),
]

CASES = [["reentrant", "plain"], ["reentrant", "ones"], ["none", "ones"]]
TIMEOUT = 600


def _compile_unavailable() -> str | None:
    """Why torch.compile cannot run here (aot_eager needs no C compiler), or None."""
    probe = (
        "import sys, torch\n"
        "if not hasattr(torch, 'compile') or not hasattr(torch.compiler, 'is_compiling'): sys.exit('no compile')\n"
        "import torch._dynamo\n"
        "if not torch._dynamo.is_dynamo_supported(): sys.exit('dynamo unsupported on this Python')\n"
        "if not hasattr(torch._dynamo.config, 'compiled_autograd'): sys.exit('no compiled autograd config')\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=clean_env(), timeout=300)
    return None if proc.returncode == 0 else (proc.stderr.strip().splitlines() or ["unknown"])[-1]


def test_compiled_autograd_no_worse_with_the_shim() -> None:
    reason = _compile_unavailable()
    if reason is not None:
        pytest.skip(f"torch.compile cannot run here: {reason}")
    procs = {
        shim: subprocess.Popen(
            [
                sys.executable,
                str(CHILD),
                "children.compile_runs:train_cases",
                json.dumps({"shim": shim, "cases": CASES}),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=clean_env(),
        )
        for shim in (False, True)
    }  # both at once: each is mostly one core's compiling
    results = {}
    for shim, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=TIMEOUT)
        assert proc.returncode == 0, f"child (shim={shim}) failed:\n{stdout[-3000:]}\n{stderr[-5000:]}"
        results[shim] = last_json(subprocess.CompletedProcess(proc.args, 0, stdout, stderr))
    without, with_shim = results[False], results[True]
    assert [r["wrapper"] for r in without] == [["staticmethod"]] * len(CASES)  # the shim really off ...
    assert [r["wrapper"] for r in with_shim] == [["ShimWrapper"]] * len(CASES)  # ... and really on
    for case, off, on in zip(CASES, without, with_shim):
        assert on["outcome"] == off["outcome"], (case, off, on)
        if off["outcome"] == "trained":
            assert on["losses"] == off["losses"], case
            assert on["grads"] == off["grads"], case
        else:
            assert on["error"] == off["error"], case
    # What this test stands on: the report's model trains without the shim.
    assert without[0]["outcome"] == "trained", without[0]
