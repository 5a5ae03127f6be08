"""What the recompute fix's pins leave behind: torch's default dtype is one for the whole process, so a pin notes
the dtype it replaced and puts it back unless other code changed it meanwhile (docs/how-it-works.md, "Threads").
Each child runs its code (``code_json``) with the shim and an affected Trainer imported (``SETUP``).
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


def child(layouts: dict[str, Layout], code: str, **options: Any) -> Any:
    namespace = an_affected_namespace(layouts, "trainer", fix="recompute")[0]
    return code_json(Template(SETUP).substitute(namespace=repr(namespace)) + textwrap.dedent(code), **options)


def test_pins_leave_the_default_dtype_to_whoever_else_set_it(layouts: dict[str, Layout]) -> None:
    """A forward is never pinned (an inner checkpoint, a function that sets the dtype keep theirs); a pin's end leaves
    a dtype other code set meanwhile; pins ending in the order they started put back the first one's. A pin and
    Lightning's forward context, overlapping in every order, leave what two Lightning contexts leave, or float32."""
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
        setter = lambda x: (torch.set_default_dtype(torch.float64), x * 2)[1]
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
        lightning = importlib.import_module(f"{fabric}.plugins.precision.utils")._DtypeContextManager

        def overlapping(order, dtypes, pinned):
            # A: Lightning's context in dtypes[0]; P: a pin, or Lightning's context, in dtypes[1]. The dtype is one
            # for the process: the order of the steps (e: enter, x: exit), not the threads, decides what is left.
            held, contexts = [], {}
            for step in [order[i : i + 2] for i in range(0, len(order), 2)]:
                name, dtype = step[0], dtypes[step[0] == "P"]
                if step == "Pe" and pinned:
                    pins._enter(dtype, held)
                elif step == "Px" and pinned:
                    held and pins._leave(held[0])
                elif step[1] == "e":
                    contexts[name] = lightning(dtype)
                    contexts[name].__enter__()
                else:
                    contexts[name].__exit__(None, None, None)
            after = str(torch.get_default_dtype())
            torch.set_default_dtype(torch.float32)
            return after

        overlaps = {
            f"{order} {dtypes}": [overlapping(order, dtypes, pinned) for pinned in (True, False)]
            for order in ("AePeAxPx", "AePePxAx", "PeAePxAx", "PeAeAxPx")
            for dtypes in ((torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float16))
        }
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


@pytest.mark.parametrize("dtypes", [["bfloat16", "bfloat16"], ["bfloat16", "float16"]])
def test_backwards_in_two_threads_leave_the_default_dtype_as_it_was(dtypes: list[str], layouts: dict) -> None:
    """30 rounds of two checkpointed backwards at once, their recomputes overlapping: in one dtype (one model on two
    devices' autograd threads) each recompute in its forward's (without the shim, in float32); in two they cannot
    both be (one default dtype per process): said once. Either way float32 after every round."""
    code = """
        seen = {name: [] for name in $dtypes}
        after, errors = [], []

        def block(name, x):
            seen[name].append(str(torch.get_default_dtype()))
            time.sleep(0.005)
            return x * torch.ones(1)  # the default dtype's: the recompute's dtype decides the product's

        def backward(barrier, out):
            barrier.wait()
            try:
                out.sum().backward()
            except Exception as error:
                errors.append(f"{type(error).__name__}: {error}"[:200])

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
                threads = [threading.Thread(target=backward, args=(barrier, out)) for out in outputs]
                [thread.start() for thread in threads]
                [thread.join() for thread in threads]
                after.append(str(torch.get_default_dtype()))
        warned = [str(w.message) for w in caught if type(w.message).__name__ == "FSDPShimWarning"]
        print(json.dumps({"seen": seen, "after": after, "errors": errors, "warnings": warned}))
        """
    result = child(layouts, Template(code).substitute(dtypes=repr(dtypes)), env=clean_env(PYTHONWARNINGS="ignore"))
    assert result["after"] == ["torch.float32"] * 30
    if len(set(dtypes)) == 1:
        assert set(result["seen"][dtypes[0]]) == {f"torch.{dtypes[0]}"}
        assert result["errors"] == [] and result["warnings"] == []
    else:
        (warning,) = result["warnings"]
        assert "two activation-checkpointed recomputes ran at once in different default dtypes" in warning


def test_an_error_ctrl_c_or_a_fork_ends_a_pin_cleanly(layouts: dict[str, Layout]) -> None:
    """The shim's own warning raised by ``simplefilter("error")`` and ``KeyboardInterrupt`` in a recompute, or where
    the pin starts or ends, leave float32 and no pin. A process forked while another thread's recompute holds its
    pin starts in the dtype the pin replaced, with no pin (the thread is not there)."""
    result = child(
        layouts,
        """
        found, errors, pinned, done = {}, [], threading.Event(), threading.Event()

        def pin(dtype, hold):  # a recompute's pin, held until ``done`` where asked
            try:
                pins.call(dtype, lambda: hold and (pinned.set(), done.wait(30)))
            except BaseException as error:
                errors.append(type(error).__name__)

        def in_a_thread(dtype):
            thread = threading.Thread(target=pin, args=(dtype, True))
            thread.start()
            pinned.wait(30)
            return thread

        with warnings.catch_warnings():
            warnings.simplefilter("error")
            first = in_a_thread(torch.bfloat16)
            pin(torch.float16, False)  # clashes with the bfloat16 pin: the shim's warning, raised
            done.set()
            first.join(60)
        found["warning as error"] = [sorted(errors), str(torch.get_default_dtype()), len(pins._running)]

        def ended(run):
            try:
                run()
                raised = "nothing"
            except KeyboardInterrupt:
                raised = "KeyboardInterrupt"
            return [raised, str(torch.get_default_dtype()), len(pins._running)]

        def interrupted(x):
            if torch.get_default_dtype() == torch.bfloat16 and torch.is_grad_enabled():  # the recompute
                raise KeyboardInterrupt
            return x * 2

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

        pinned.clear(), done.clear()
        thread = in_a_thread(torch.bfloat16)
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


def test_code_being_traced_is_left_as_torch_makes_it(layouts: dict[str, Layout]) -> None:
    """A recompute pinned to bfloat16, called while dynamo (``torch.compile(fullgraph=True)``) or FX under a proxy
    mode (``make_fx``, as compiled autograd) traces it, runs unpinned: no lock or dtype switch in traced code."""
    result = child(
        layouts,
        """
        import torch._dynamo
        from torch.fx.experimental.proxy_tensor import make_fx
        from _fsdp_shim.pins import in_forward_dtype
        if not torch._dynamo.is_dynamo_supported():
            print(json.dumps({"skip": "torch.compile cannot run here"}))
            raise SystemExit
        seen = []
        torch.set_default_dtype(torch.bfloat16)  # the forward's, as "bf16-true" runs it
        pinned = in_forward_dtype(lambda x: (seen.append(str(torch.get_default_dtype())), x * 2)[1])
        torch.set_default_dtype(torch.float32)  # the backward's
        x = torch.ones(2, dtype=torch.bfloat16)
        found = {}
        for name, run in (("called", pinned), ("compiled", torch.compile(pinned, backend="eager", fullgraph=True))):
            try:
                run(x)
                found[name] = seen.pop()
            except Exception as error:
                found[name] = type(error).__name__
        make_fx(pinned)(x)
        found["traced"] = seen.pop()
        print(json.dumps({**found, "after": str(torch.get_default_dtype()), "pins": len(pins._running)}))
        """,
    )
    if "skip" in result:
        pytest.skip(result["skip"])
    expected = {"called": "torch.bfloat16", "compiled": "torch.float32", "traced": "torch.float32"}
    assert result == {**expected, "after": "torch.float32", "pins": 0}
