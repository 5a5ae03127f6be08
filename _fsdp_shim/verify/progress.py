"""verify's one status line on stderr, so a run of minutes never looks hung.

On a terminal it is redrawn every 0.2 s with the phase ("[1/2] ...") and the seconds spent on it, and
cleared at the end; elsewhere (a log, CI) each phase is one plain line; with ``--json`` nothing.
"""

from __future__ import annotations

import sys
import threading
import time

from _fsdp_shim.verify.render import WIDTH


class Progress:
    """One status line on stderr with the phase ("[1/2] ...") and the seconds spent on it."""

    def __init__(self, enabled: bool, total: int) -> None:
        self._animated = enabled and sys.stderr.isatty()
        self._quiet = not enabled
        self._total = total
        self._done = 0
        self._label = ""
        self._start = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Progress:
        if self._animated:
            self._thread = threading.Thread(target=self._draw, daemon=True)
            self._thread.start()
        return self

    def phase(self, label: str) -> None:
        """Start the next phase; with ``total`` 0 (the gate, before the number of runs is known) it is
        not numbered, so the counter never reads "[1/1]" and then starts again."""
        self._done += 1
        counter = f"[{self._done}/{self._total}] " if self._total else ""
        self._label, self._start = f"{counter}{label}", time.monotonic()
        if not self._animated and not self._quiet:
            print(f"fsdp-shim verify: {self._label} ...", file=sys.stderr, flush=True)

    def _draw(self) -> None:
        frames = "|/-\\"
        tick = 0
        while not self._stop.wait(0.2):
            if self._label:
                seconds = time.monotonic() - self._start
                sys.stderr.write(f"\r{frames[tick % 4]} {self._label} ({seconds:4.0f}s)   ")
                sys.stderr.flush()
            tick += 1

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            sys.stderr.write("\r" + " " * WIDTH + "\r")
            sys.stderr.flush()
