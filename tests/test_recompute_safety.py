"""What the recompute fix's pins leave behind: torch's default dtype is one for the whole process, so a pin notes
the dtype it replaced and puts it back unless other code changed it meanwhile (docs/how-it-works.md, "Threads").
Threads, a fork, an error or Ctrl-C in a recompute, code being traced: each child runs its code (``run_code``)
with the shim and the session's Lightning.
"""

from __future__ import annotations

import textwrap
from string import Template
from typing import Any

import pytest
from conftest import Layout, an_affected_namespace, clean_env, code_json

SETUP = """
import importlib, json, os, sys, threading, time, warnings
import torch
import torch.utils.checkpoint as checkpoint
import fsdp_shim
from _fsdp_shim.pins import pins
from children.recompute_proof import checkpointed_forward
NAMESPACE = $namespace
importlib.import_module(NAMESPACE)
"""
"""Each child's first lines: torch, the shim and an affected Trainer (``NAMESPACE``) imported."""


def child(layouts: dict[str, Layout], code: str, **options: Any) -> Any:
    namespace = an_affected_namespace(layouts, "trainer", fix="recompute")[0]
    return code_json(Template(SETUP).substitute(namespace=repr(namespace)) + textwrap.dedent(code), **options)


def test_pins_leave_the_default_dtype_to_whoever_else_set_it(layouts: dict[str, Layout]) -> None:
    """A forward is never pinned (a checkpoint nested in a region with its own dtype, a function that sets the dtype
    keep theirs); a recompute's end leaves a dtype other code set meanwhile; pins ending in the order they started
    put back the first one's. Thread A in Lightning's forward context and thread P in a pinned recompute,
    overlapping in every order, leave the dtype the same order leaves with P in Lightning's context instead, or
    float32 where that one leaves a dtype behind."""
    result = child(
        layouts,
        """
        seen = {}
        def outer(x):
            torch.set_default_dtype(torch.float32)
            y = checkpoint.checkpoint(lambda t: t * 2, x, use_reentrant=True)
            seen["after the inner checkpoint"] = str(torch.get_default_dtype())
            torch.set_default_dtype(torch.float64)
            return y

        torch.set_default_dtype(torch.float64)
        checkpoint.checkpoint(outer, torch.ones(2, dtype=torch.float64, requires_grad=True), use_reentrant=True)
        seen["after the outer checkpoint"] = str(torch.get_default_dtype())
        torch.set_default_dtype(torch.float32)

        def setter(x):
            torch.set_default_dtype(torch.float64)
            return x * 2

        checkpoint.checkpoint(setter, torch.ones(2, requires_grad=True), use_reentrant=True)
        seen["after a function that sets it"] = str(torch.get_default_dtype())
        torch.set_default_dtype(torch.float32)
        pin = []
        pins._enter(torch.bfloat16, pin)
        torch.set_default_dtype(torch.float16)  # other code, e.g. another thread's forward context
        pins._leave(pin[0])
        seen["after other code changed it"] = str(torch.get_default_dtype())
        torch.set_default_dtype(torch.float32)
        first, second = [], []
        pins._enter(torch.bfloat16, first)
        pins._enter(torch.float64, second)
        pins._leave(first[0])
        seen["the first ended"] = str(torch.get_default_dtype())
        pins._leave(second[0])
        seen["both ended"] = str(torch.get_default_dtype())

        fabric = "lightning.fabric" if NAMESPACE.startswith("lightning.") else "lightning_fabric"
        lightning_context = importlib.import_module(f"{fabric}.plugins.precision.utils")._DtypeContextManager

        def overlapping(order, dtypes, pinned):
            # A: Lightning's forward context in dtypes[0]; P: a pinned recompute or Lightning's context in dtypes[1];
            # each steps (e: enter, x: exit) when ``order`` says. The default dtype after both.
            steps = [order[i : i + 2] for i in range(0, len(order), 2)]
            turn, done = ({step: threading.Event() for step in steps} for _ in range(2))

            def lightning(name, dtype):
                turn[name + "e"].wait(30)
                manager = lightning_context(dtype)
                manager.__enter__()
                done[name + "e"].set()
                turn[name + "x"].wait(30)
                manager.__exit__(None, None, None)
                done[name + "x"].set()

            def pin(dtype):
                turn["Pe"].wait(30)
                pins.call(dtype, lambda: (done["Pe"].set(), turn["Px"].wait(30)))
                done["Px"].set()

            a = threading.Thread(target=lightning, args=("A", dtypes[0]))
            p = threading.Thread(target=pin, args=(dtypes[1],)) if pinned else threading.Thread(
                target=lightning, args=("P", dtypes[1])
            )
            a.start(), p.start()
            for step in steps:
                turn[step].set()
                done[step].wait(30)
            a.join(30), p.join(30)
            after = str(torch.get_default_dtype())
            torch.set_default_dtype(torch.float32)
            return after

        overlaps = {}
        for order in ("AePeAxPx", "AePePxAx", "PeAePxAx", "PeAeAxPx"):
            for dtypes in ((torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float16)):
                overlaps[f"{order} {dtypes}"] = [overlapping(order, dtypes, pinned) for pinned in (True, False)]
        print(json.dumps({"seen": seen, "overlaps": overlaps}))
        """,
    )
    assert result["seen"] == {
        "after the inner checkpoint": "torch.float32",
        "after the outer checkpoint": "torch.float64",
        "after a function that sets it": "torch.float64",
        "after other code changed it": "torch.float16",
        "the first ended": "torch.float64",
        "both ended": "torch.float32",
    }
    overlaps = result["overlaps"]
    assert len(overlaps) == 8, overlaps
    for case, (pinned, lightnings) in overlaps.items():
        assert pinned in (lightnings, "torch.float32"), (case, pinned, lightnings)
    assert {pinned for pinned, _ in overlaps.values()} > {"torch.float32"}, "some order must leave A's dtype"


@pytest.mark.parametrize(
    ("shim", "dtypes"),
    [(True, ["bfloat16", "bfloat16"]), (True, ["bfloat16", "float16"]), (False, ["bfloat16", "bfloat16"])],
)
def test_backwards_in_two_threads_leave_the_default_dtype_as_it_was(
    shim: bool, dtypes: list[str], layouts: dict[str, Layout]
) -> None:
    """30 rounds of two checkpointed backwards at once, their recomputes overlapping. In one dtype (one model's
    blocks on two devices' autograd threads) each recompute runs in its forward's dtype; in two they cannot both
    (one default dtype per process): said once. Either way the dtype is float32 after every round. Without the
    shim every recompute runs in float32 (the bug these threads would hide)."""
    code = """
        seen = {name: [] for name in $dtypes}
        after, errors = [], []

        def block(name, x):
            seen[name].append(str(torch.get_default_dtype()))
            time.sleep(0.005)
            return x * torch.ones(1)  # the default dtype's: the recompute's dtype decides the product's

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(30):
                outputs = []
                for name in $dtypes:
                    x = torch.ones(4, dtype=getattr(torch, name), requires_grad=True)
                    torch.set_default_dtype(getattr(torch, name))
                    outputs.append(checkpoint.checkpoint(block, name, x, use_reentrant=False))
                    torch.set_default_dtype(torch.float32)
                barrier = threading.Barrier(len(outputs))

                def backward(out):
                    barrier.wait()
                    try:
                        out.sum().backward()
                    except Exception as error:
                        errors.append(f"{type(error).__name__}: {error}"[:200])

                threads = [threading.Thread(target=backward, args=(out,)) for out in outputs]
                [thread.start() for thread in threads]
                [thread.join() for thread in threads]
                after.append(str(torch.get_default_dtype()))
        warned = [str(w.message) for w in caught if type(w.message).__name__ == "FSDPShimWarning"]
        print(json.dumps({"seen": seen, "after": after, "errors": errors, "warnings": warned}))
        """
    env = clean_env(PYTHONWARNINGS="ignore", FSDP_SHIM=None if shim else "0")
    result = child(layouts, Template(code).substitute(dtypes=repr(dtypes)), env=env)
    assert result["after"] == ["torch.float32"] * 30
    seen = [dtype for each in result["seen"].values() for dtype in each]  # 30 forwards, 30 recomputes each
    if not shim:
        assert seen.count("torch.float32") == 30 * len(dtypes), result["seen"]
        assert result["errors"], "without the shim the recomputes' ones(1) must differ from the forward's"
    elif len(set(dtypes)) == 1:
        assert set(result["seen"][dtypes[0]]) == {f"torch.{dtypes[0]}"}
        assert result["errors"] == [] and result["warnings"] == []
    else:
        (warning,) = result["warnings"]
        assert "two activation-checkpointed recomputes ran at once in different default dtypes" in warning


def test_an_error_ctrl_c_or_a_fork_ends_a_pin_cleanly(layouts: dict[str, Layout]) -> None:
    """Two threads' pins in bfloat16 and float16 under ``simplefilter("error")`` (the float16 one raises the shim's
    warning), ``KeyboardInterrupt`` inside a recompute and where the pin starts or ends (Ctrl-C during a torch
    operation is raised at the next Python call): afterwards float32 and no pin. A process forked while another
    thread's recompute holds its pin starts in the dtype the pin replaced, with no pin (the thread is not there)."""
    result = child(
        layouts,
        """
        found = {}
        inside, release, errors, calls = threading.Barrier(2), threading.Event(), [], {}

        def recompute(dtype, wait):
            def block(x):
                calls[dtype].append("recompute" if calls[dtype] else "forward")
                if wait and calls[dtype][-1] == "recompute":  # pinned: hold the pin while the other one starts
                    inside.wait(30)
                    release.wait(30)
                return x * torch.ones(1)

            calls[dtype] = []
            try:
                _, out = checkpointed_forward(block, dtype, reentrant=True)
                out.sum().backward()
            except BaseException as error:
                errors.append(type(error).__name__)

        with warnings.catch_warnings():
            warnings.simplefilter("error")
            first = threading.Thread(target=recompute, args=(torch.bfloat16, True))
            first.start()
            inside.wait(30)  # the bfloat16 recompute is pinned and waits; now a float16 one clashes with it
            second = threading.Thread(target=recompute, args=(torch.float16, False))
            second.start()
            second.join(60)
            release.set()
            first.join(60)
        found["warning as error"] = [sorted(errors), str(torch.get_default_dtype()), len(pins._running)]

        def interrupted(x):
            if torch.get_default_dtype() == torch.bfloat16 and torch.is_grad_enabled():  # the recompute
                raise KeyboardInterrupt
            return x * 2

        def ended(run):
            try:
                run()
                raised = "nothing"
            except KeyboardInterrupt:
                raised = "KeyboardInterrupt"
            return [raised, str(torch.get_default_dtype()), len(pins._running)]

        found["KeyboardInterrupt"] = ended(checkpointed_forward(interrupted, torch.bfloat16, True)[1].sum().backward)
        for where in ("_leave", "_leave:set_default_dtype", "_enter:set_default_dtype"):
            caller, _, name = where.rpartition(":")
            delivered = []

            def deliver(frame, event, arg):  # raises it, once, as the signal's handler would
                if event == "call" and frame.f_code.co_name == name and not delivered:
                    if not caller or frame.f_back.f_code.co_name == caller:
                        delivered.append(where)
                        raise KeyboardInterrupt

            _, out = checkpointed_forward(lambda x: x * torch.ones(1), torch.bfloat16, True)
            sys.setprofile(deliver)
            try:
                found[where] = ended(out.sum().backward)
            finally:
                sys.setprofile(None)
            found[where][0] = found[where][0] if delivered else "not delivered"

        pinned, done, calls = threading.Event(), threading.Event(), []

        def block(x):
            calls.append("recompute" if calls else "forward")
            if calls[-1] == "recompute":  # pinned, in bfloat16: the fork happens now
                pinned.set()
                done.wait(30)
            return x * torch.ones(1)

        thread = threading.Thread(target=lambda: checkpointed_forward(block, torch.bfloat16, True)[1].sum().backward())
        thread.start()
        pinned.wait(30)
        during = str(torch.get_default_dtype())
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.write(write, f"{torch.get_default_dtype()} {len(pins._running)} {torch.zeros(1).dtype}".encode())
            os._exit(0)
        os.close(write)
        with os.fdopen(read) as forked:
            found["fork"] = [during, forked.read().split()]
        os.waitpid(pid, 0)
        done.set()
        thread.join(60)
        found["fork"].append([str(torch.get_default_dtype()), len(pins._running)])
        print(json.dumps(found))
        """,
    )
    ended = ["KeyboardInterrupt", "torch.float32", 0]
    assert result == {
        "warning as error": [["FSDPShimWarning"], "torch.float32", 0],
        "KeyboardInterrupt": ended,
        "_leave": ended,
        "_leave:set_default_dtype": ended,
        "_enter:set_default_dtype": ended,
        "fork": ["torch.bfloat16", ["torch.float32", "0", "torch.float32"], ["torch.float32", 0]],
    }


COMPILED = """
import json, sys
if $shim:
    import fsdp_shim
    importlib.import_module($namespace)
import torch, torch._dynamo
import torch.utils.checkpoint
torch._dynamo.config.compiled_autograd = True


def train(mode, block):
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

        def forward(self, x):
            h = torch.relu(self.fc1(x))
            return self.fc2(h * torch.ones(h.shape[-1]) if block == "ones" else h)  # ones: the default dtype's

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.block = torch.nn.Linear(16, 16), Block()

        def forward(self, x):
            h = self.inner(x)
            if mode == "none":
                return self.block(h).float().pow(2).mean()
            h = torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=True)
            return h.float().pow(2).mean()

    torch.manual_seed(0)
    model = Model().to(torch.bfloat16)
    compiled = torch.compile(model, backend="aot_eager")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    found = []
    try:
        for _ in range(2):
            torch.set_default_dtype(torch.bfloat16)  # around the forward, as "bf16-true" runs it
            try:
                loss = compiled(x)
            finally:
                torch.set_default_dtype(torch.float32)
            loss.backward()
            found += [float(loss.detach()).hex(), *(float(p.grad.float().sum()).hex() for p in model.parameters())]
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    except Exception as error:
        lines = [line.strip() for line in str(error).strip().splitlines()] or [""]
        return {"error": type(error).__name__ + ": " + next((l for l in lines if "dtype" in l), lines[0])}
    finally:
        torch._dynamo.reset()
    return {"trained": found}


wrapper = type(vars(torch.utils.checkpoint.CheckpointFunction)["forward"]).__name__
print(json.dumps([wrapper, [train(*case) for case in $cases]]))
"""


def test_code_being_compiled_trains_no_worse_with_the_shim(layouts: dict[str, Layout]) -> None:
    """``torch.compile`` (``aot_eager``) with compiled autograd, a reentrant checkpoint and a bfloat16 default dtype
    around the forward: the pin leaves code being traced alone. With the shim, each case ends as without it, and
    where both train, with the same losses and gradients. The cases: a block giving every tensor a dtype (trains
    both ways), one making ``torch.ones`` without one, checkpointed and not (both fail under ``aot_eager`` either
    way: not a checkpoint problem)."""
    import subprocess
    import sys

    probe = "import torch._dynamo as d; assert d.is_dynamo_supported() and hasattr(d.config, 'compiled_autograd')"
    if subprocess.run([sys.executable, "-c", probe], env=clean_env(), capture_output=True).returncode != 0:
        pytest.skip("torch.compile with compiled autograd cannot run here")
    namespace = an_affected_namespace(layouts, "trainer", fix="recompute")[0]
    cases = [["reentrant", "plain"], ["reentrant", "ones"], ["none", "ones"]]
    results = {
        shim: code_json(Template("import importlib\n" + COMPILED).substitute(
            shim=shim, namespace=repr(namespace), cases=repr(cases)
        ))
        for shim in (False, True)
    }  # fmt: skip
    (off_wrapper, without), (on_wrapper, with_shim) = results[False], results[True]
    assert (off_wrapper, on_wrapper) == ("staticmethod", "ShimWrapper")  # the shim really off, and on
    assert with_shim == without
    assert "trained" in without[0], without[0]  # what this test stands on: that model trains without the shim
