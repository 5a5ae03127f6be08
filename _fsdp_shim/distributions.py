"""Which Lightning packages are installed and why one fails to import, from metadata (``status``, ``verify``)."""

from __future__ import annotations

import contextlib
import importlib.util
from importlib import metadata

from _fsdp_shim.config import LIGHTNING_PACKAGES


def installed_packages() -> list[str]:
    """The Lightning top-level packages this interpreter can find, without importing them."""
    found = []
    for package in LIGHTNING_PACKAGES:
        with contextlib.suppress(ImportError, ValueError):  # a broken entry on sys.path: not importable either
            found += [package] if importlib.util.find_spec(package) is not None else []
    return found


def distribution_of(package: str) -> tuple[str, str] | None:
    """``(distribution, version)`` that provides ``package``, from metadata (so also where its import fails)."""
    packages_distributions = getattr(metadata, "packages_distributions", None)  # Python 3.10+
    names = packages_distributions().get(package, []) if packages_distributions else [package.replace("_", "-")]
    for name in names:
        with contextlib.suppress(metadata.PackageNotFoundError):
            return name, metadata.version(name)
    return None


def import_failure(error: BaseException) -> list[str | None]:
    """An import error as ``[type name, message, missing module]``, as JSON reports carry it."""
    return [type(error).__name__, str(error), getattr(error, "name", None)]


def describe_import_failure(name: str, failure: list[str | None]) -> str:
    """One line naming the package or namespace ``name``, its release, the cause, and the fix where known."""
    kind, message, missing = failure
    found = distribution_of(name.partition(".")[0])
    installed = f" ({found[0]} {found[1]})" if found else ""
    hint = "; Lightning 2.1-2.3 needs setuptools<81 (pip install 'setuptools<81')" if missing == "pkg_resources" else ""
    return f"{name}{installed} is installed but fails to import ({kind}: {message}){hint}"
