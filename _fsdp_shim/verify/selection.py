"""Which installed Trainer namespaces verify's seed model trains: those ``--package`` names, else every installed
one but the standalone ``pytorch_lightning`` next to ``lightning``. From 2.1 on, ``pip install lightning==X``
brings the newest standalone along (an unpinned requirement of ``lightning``), whether or not the user's code
imports it: training it too answered a question nobody asked, in three of seven runs (2.4.0 with 2.6.6)."""

from __future__ import annotations

from dataclasses import dataclass

PACKAGES = {"lightning": "lightning.pytorch", "pytorch_lightning": "pytorch_lightning"}
"""``--package``'s values, as users import them, and the Trainer namespace each names."""
ALL = "all"
CHOICES = (*PACKAGES, ALL)


@dataclass(frozen=True)
class Skipped:
    """An installed namespace verify did not check, and why (``--json``'s ``skipped``)."""

    namespace: str
    version: str
    reason: str


def select(package: str | None, installed: dict[str, str]) -> tuple[list[str], list[Skipped]]:
    """The namespaces to check, in ``installed``'s order (namespace: version, ``""`` where its import fails), and
    every other one with why. ``ValueError`` where ``package`` names a package that is not installed."""
    if package == ALL:
        return list(installed), []
    if package is not None:
        if PACKAGES[package] not in installed:
            raise ValueError(f"--package {package}: {package} is not installed in this interpreter")
        chosen, why = [PACKAGES[package]], f"not checked (--package {package}; --package all checks every one)"
    elif all(namespace in installed for namespace in PACKAGES.values()):
        chosen = [namespace for namespace in installed if namespace != PACKAGES["pytorch_lightning"]]
        why = (
            "not checked: installed next to lightning (pip brings it along with lightning 2.1 and later, whether "
            "or not your code imports it), so verify checks lightning, the package of `import lightning`. If your "
            "code imports pytorch_lightning: --package pytorch_lightning (--package all checks both)"
        )
    else:
        chosen, why = list(installed), ""
    return chosen, [Skipped(ns, version, why) for ns, version in installed.items() if ns not in chosen]
