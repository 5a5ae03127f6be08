"""The recompute fix's runtime: a checkpointed function pinned to the default dtype its forward had; torch's default
dtype is one per process, so the newest pin's end puts back what it replaced (docs/how-it-works.md, "Threads")."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from _fsdp_shim import log

if TYPE_CHECKING:
    import torch


@dataclass
class _Pin:
    thread: int
    dtype: torch.dtype
    before: torch.dtype | None  # what its end puts back; handed up to a newer pin still running


class _Pins:
    """The pinned calls running now in the whole process; a lock guards the list and every dtype change."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: list[_Pin] = []

    def reset(self) -> None:
        """In a forked child: put back what the parent's other threads' pins replaced; they are not here to."""
        running, me = self._running, threading.get_ident()
        self.__init__()  # type: ignore[misc]
        if running and running[0].before is not None and all(pin.thread != me for pin in running):
            import torch

            torch.set_default_dtype(running[0].before)

    def call(self, dtype: torch.dtype, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        held: list[_Pin] = []  # filled inside _enter before anything changes: a pin is never lost
        try:
            if self._enter(dtype, held):
                from _fsdp_shim import failures  # loaded where something is said

                failures.threads_clashed()
            if held and held[0].before != dtype and "recompute" not in log.named:
                now, before = (str(d).removeprefix("torch.") for d in (dtype, held[0].before))
                said = f"a checkpointed block recomputed in {now}, its forward's dtype, not {before}"
                log.confirm("recompute", f"recompute acted ({said})")
            return function(*args, **kwargs)
        finally:
            # Ctrl-C raised at ``_leave``'s first call: caught, ``_leave`` runs again to its end, then it is raised.
            raised: BaseException | None = None
            for _ in range(3 if held else 0):
                try:
                    self._leave(held[0])
                    break
                except BaseException as error:  # a signal's exception: raised once the pin has ended
                    raised = raised or error
            if raised is not None:
                raise raised

    def _enter(self, dtype: torch.dtype, held: list[_Pin]) -> bool:
        """Register the pin in ``held`` and the list, then switch; whether another thread pins another dtype."""
        import torch

        with self._lock:
            current = torch.get_default_dtype()
            if current == dtype and not self._running:
                return False
            pin = _Pin(threading.get_ident(), dtype, current)
            held.append(pin)
            clash = any(other.dtype != dtype and other.thread != pin.thread for other in self._running)
            self._running.append(pin)
            if current != dtype:
                torch.set_default_dtype(dtype)
        return clash

    def _leave(self, pin: _Pin) -> None:
        """Take the pin off and put back what it replaced; run again after a signal, it does no step twice."""
        import torch

        with self._lock:
            index = next((i for i, other in enumerate(self._running) if other is pin), None)
            if index is not None:
                if pin.before is not None and index + 1 < len(self._running):  # a newer pin puts it back
                    self._running[index + 1].before, pin.before = pin.before, None
                del self._running[index]
            if pin.before is not None and pin.before != pin.dtype and torch.get_default_dtype() == pin.dtype:
                torch.set_default_dtype(pin.before)
            pin.before = None


pins = _Pins()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=pins.reset)


def in_forward_dtype(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function``, to run later in the default dtype current now; code being traced is left as torch makes it."""
    import torch  # imported already by Lightning; not at the top, so importing this module does not

    dtype = torch.get_default_dtype()

    def run_in_forward_dtype(*args: Any, **kwargs: Any) -> Any:
        return function(*args, **kwargs) if tracing(torch) else pins.call(dtype, function, *args, **kwargs)

    return run_in_forward_dtype


def tracing(torch: Any) -> bool:
    """Whether this thread's code is being traced: by dynamo, or by FX under a proxy mode (compiled autograd)."""
    dynamo = getattr(getattr(torch, "compiler", None), "is_dynamo_compiling", None)
    if dynamo is not None and dynamo():
        return True
    key = getattr(getattr(torch._C, "_TorchDispatchModeKey", None), "PROXY", None)
    get_mode = getattr(torch._C, "_get_dispatch_mode", None)
    return key is not None and get_mode is not None and get_mode(key) is not None
