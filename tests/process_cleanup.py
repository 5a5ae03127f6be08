"""A pytest plugin: no process a test started outlives the test.

A hung rank (waiting for a peer that died) used to hold a test until CI's limit. pytest-timeout
fails the test by its name; this plugin then kills everything the test started, grandchildren
included. Orphans would escape to init when their parent dies (torchrun killed, its workers left),
so the test process makes itself their "subreaper" (Linux ``PR_SET_CHILD_SUBREAPER``): orphaned
descendants are re-parented to it, and it can find them and end them.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Iterator

import pytest

_PR_SET_CHILD_SUBREAPER = 36


def _become_subreaper() -> None:
    # Without prctl, orphans escape, and the per-session bound is what ends them.
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _parents() -> dict[int, int]:
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as stat:
                    fields = stat.read().rsplit(b")", 1)[1].split()
                parents[int(entry)] = int(fields[1])
            except (OSError, IndexError, ValueError):
                continue
    return parents


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid``, children first."""
    parents = _parents()
    found: list[int] = []
    frontier = [pid]
    while frontier:
        current = frontier.pop()
        children = [child for child, parent in parents.items() if parent == current]
        found += children
        frontier += children
    return found


def kill_descendants(spare: set[int]) -> list[int]:
    killed = [pid for pid in descendants(os.getpid()) if pid not in spare]
    for pid in killed:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for _ in killed:  # reap what is ours, so none stays a zombie
        try:
            os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
    return killed


def pytest_configure(config: pytest.Config) -> None:
    _become_subreaper()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """Only what the test itself started: processes of fixtures set up before it (a cluster's
    daemons, kept for the whole session) are spared."""
    tracked = os.path.isdir("/proc")
    before = set(descendants(os.getpid())) if tracked else set()
    yield
    if tracked:
        kill_descendants(spare=before)
