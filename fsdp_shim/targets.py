"""What the shim patches: the Lightning namespaces and, per release, the methods it wraps.

This is the one place that names Lightning internals. Every name below is checked before anything
is changed (:func:`fsdp_shim.integration.patch`), so a Lightning release that renames one is left
untouched with a warning instead of half-patched.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from fsdp_shim import conversion
from fsdp_shim.versions import converts_only_in_connect

Wrapper = Callable[[Callable[..., Any], Any, tuple[Any, ...], dict[str, Any]], Any]


@dataclass(frozen=True)
class Namespace:
    """One importable copy of Lightning's Trainer or Fabric code.

    The unified ``lightning`` package and the standalone ``pytorch_lightning`` / ``lightning_fabric``
    packages are generated from the same source but hold *different* class objects, and one
    environment can hold an affected ``lightning`` next to a fixed ``pytorch_lightning``
    (``pip install lightning==2.4.0`` does exactly that), so each is gated and patched on its own.
    """

    name: str
    kind: Literal["trainer", "fabric"]

    @property
    def top_level(self) -> str:
        return self.name.partition(".")[0]


NAMESPACES: tuple[Namespace, ...] = (
    Namespace("lightning.fabric", "fabric"),
    Namespace("lightning.pytorch", "trainer"),
    Namespace("lightning_fabric", "fabric"),
    Namespace("pytorch_lightning", "trainer"),
)


@dataclass(frozen=True)
class PatchTarget:
    """A method on a Lightning class that the shim wraps.

    ``inherited`` says what the unpatched class must look like: ``True`` means the class inherits the
    method (the shim adds a wrapper of the inherited function to the class, and removing it restores
    inheritance); ``False`` means the class defines it (the shim replaces it with a wrapper of it).
    """

    module: str
    class_names: tuple[str, ...]
    attribute: str
    inherited: bool
    wrapper: Wrapper

    def module_in(self, namespace: Namespace) -> str:
        return f"{namespace.name}.{self.module}"

    def describe(self, namespace: Namespace, owner: type) -> str:
        """Name the target by the class actually found (2.1.0's is ``FSDPPrecisionPlugin``)."""
        return f"{self.module_in(namespace)}.{owner.__name__}.{self.attribute}"


# 2.1.0 names the Trainer's class FSDPPrecisionPlugin; 2.1.1+ renamed it to FSDPPrecision and keeps
# the old name as an alias of the same object.
PRECISION_CONVERT_MODULE = PatchTarget(
    module="plugins.precision.fsdp",
    class_names=("FSDPPrecision", "FSDPPrecisionPlugin"),
    attribute="convert_module",
    inherited=True,
    wrapper=conversion.convert_module_as_in_2_5,
)

STRATEGY_CONNECT = PatchTarget(
    module="strategies.fsdp",
    class_names=("FSDPStrategy",),
    attribute="connect",
    inherited=True,
    wrapper=conversion.connect_without_early_conversion,
)

STRATEGY_SETUP = PatchTarget(
    module="strategies.fsdp",
    class_names=("FSDPStrategy",),
    attribute="setup",
    inherited=False,
    wrapper=conversion.convert_before_setup,
)


def patch_plan(namespace: Namespace, version: str) -> tuple[PatchTarget, ...]:
    """The targets that make an affected release behave like 2.5.0.

    Fabric and the 2.2.0–2.4.x Trainer already call ``convert_module`` where 2.5.0 does, so the
    missing method is all they need. The 2.1.x Trainer calls it only in ``Strategy.connect``, too
    early, so it also needs 2.2.0's call site in ``FSDPStrategy.setup`` and none in ``connect``.
    """
    if namespace.kind == "trainer" and converts_only_in_connect(version):
        return (PRECISION_CONVERT_MODULE, STRATEGY_CONNECT, STRATEGY_SETUP)
    return (PRECISION_CONVERT_MODULE,)
