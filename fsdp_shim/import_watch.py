"""A start-up-cheap watcher for the first import of a Lightning package.

wrapt's post-import hooks are the right tool once Lightning is being imported, but importing wrapt
itself costs tens of milliseconds (wrapt 2.x pulls in ``importlib.metadata`` and ``asyncio``). A
start-up file runs in *every* Python process of an environment (pip, compilers, data-loader
workers), so the shim arms this stdlib-only finder instead and loads wrapt only when a process
actually imports Lightning.
"""

# No `from __future__ import annotations`: it is a real import, and this module runs at every
# interpreter start. Annotations that need newer syntax are strings instead.

import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence
    from importlib.machinery import ModuleSpec
    from types import ModuleType


class FirstImportWatcher:
    """``sys.meta_path`` entry that calls back once, when one of ``names`` is first looked up.

    It never finds a module itself. After the callback it repeats the lookup, because finders that
    the callback inserted ahead of it (wrapt's) were skipped by the search already under way and
    would otherwise miss this very import.
    """

    def __init__(self, names: "Iterable[str]", on_first_import: "Callable[[], None]") -> None:
        self._names = frozenset(names)
        self._on_first_import = on_first_import

    def find_spec(
        self,
        fullname: str,
        path: "Sequence[str] | None" = None,
        target: "ModuleType | None" = None,
    ) -> "ModuleSpec | None":
        if fullname not in self._names:
            return None
        # Off the list before the callback, so imports it makes (wrapt) do not call back again.
        self.disarm()
        self._on_first_import()
        import importlib.util

        return importlib.util.find_spec(fullname)

    def arm(self) -> None:
        """Put the watcher at the front of ``sys.meta_path`` (once)."""
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def disarm(self) -> None:
        """Take the watcher off ``sys.meta_path``; harmless if it is not there."""
        try:  # noqa: SIM105 - contextlib is not loaded at start-up; importing it here would cost time
            sys.meta_path.remove(self)
        except ValueError:
            pass

    @property
    def armed(self) -> bool:
        return self in sys.meta_path
