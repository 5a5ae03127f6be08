"""Every Lightning internal fsdp-shim touches in a training process, and which it wraps on which release.

Read this file to answer "what does the shim change on my Lightning?":

=================  ===================================================  ==================================
Lightning          Trainer (``lightning.pytorch``, ``pytorch_lightning``)  Fabric (``lightning.fabric``,
                                                                         ``lightning_fabric``)
=================  ===================================================  ==================================
2.0.x              nothing (no "true" precisions for FSDP)              nothing
2.1.0              ``FSDPPrecisionPlugin.convert_module``,              ``FSDPPrecision.convert_module``
                   ``FSDPStrategy.connect``, ``FSDPStrategy.setup``
2.1.1–2.1.4        ``FSDPPrecision.convert_module``,                    ``FSDPPrecision.convert_module``
                   ``FSDPStrategy.connect``, ``FSDPStrategy.setup``
2.2.0–2.4.x        ``FSDPPrecision.convert_module``                     ``FSDPPrecision.convert_module``
2.5.0rc0 and on    nothing (fixed upstream)                             nothing
=================  ===================================================  ==================================

Every target is resolved and checked before anything is changed (``fsdp_shim.integration.patch``),
so a Lightning that renamed one is left untouched, with a warning, instead of half-patched. The
namespaces come from ``_fsdp_shim_startup.LIGHTNING_NAMESPACES``, the one table of them, which the
start-up code reads without importing this package. The only other Lightning names the shim reads are
in ``MODEL_HOLDERS``. (``fsdp-shim verify`` lifts Lightning's GPU checks in its own processes;
those names are in ``fsdp_shim.verify.cpu_guards``, which training processes never import.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from _fsdp_shim_startup import LIGHTNING_NAMESPACES
from fsdp_shim import conversion
from fsdp_shim.versions import converts_only_in_connect, has_fsdp_precision_class

Conversion = Callable[[Callable[..., Any], Any, tuple[Any, ...], dict[str, Any]], Any]
Kind = Literal["trainer", "fabric"]


@dataclass(frozen=True)
class Namespace:
    """One importable copy of Lightning's Trainer or Fabric code (see ``LIGHTNING_NAMESPACES``)."""

    name: str
    kind: Kind


NAMESPACES: tuple[Namespace, ...] = tuple(Namespace(name, kind) for name, kind in LIGHTNING_NAMESPACES)  # type: ignore[arg-type]


def namespace_named(name: str) -> Namespace:
    for namespace in NAMESPACES:
        if namespace.name == name:
            return namespace
    raise KeyError(name)


@dataclass(frozen=True)
class PatchTarget:
    """A method on a Lightning class that the shim wraps.

    ``inherited`` says how Lightning ships it: ``True``, the class inherits it (the shim puts a
    wrapper of the inherited function on the class, and removing it restores inheritance); ``False``,
    the class defines it (the shim replaces it with a wrapper of it, and puts it back on removal).
    """

    module: str
    class_name: str
    attribute: str
    inherited: bool
    conversion: Conversion

    def module_in(self, namespace: Namespace) -> str:
        return f"{namespace.name}.{self.module}"

    def label(self, namespace: Namespace) -> str:
        return f"{self.module_in(namespace)}.{self.class_name}.{self.attribute}"


def precision_convert_module(namespace: Namespace, version: str) -> PatchTarget:
    """Lightning 2.5.0's ``FSDPPrecision.convert_module``, on the class the release uses.

    2.1.0 names the Trainer's class ``FSDPPrecisionPlugin``. From 2.2.0 that name is a deprecated
    subclass of ``FSDPPrecision``: patching it would leave the class the Trainer uses unfixed, so the
    old name is used on 2.1.0 only, and a release without ``FSDPPrecision`` fails loudly.
    """
    trainer_2_1_0 = namespace.kind == "trainer" and not has_fsdp_precision_class(version)
    return PatchTarget(
        module="plugins.precision.fsdp",
        class_name="FSDPPrecisionPlugin" if trainer_2_1_0 else "FSDPPrecision",
        attribute="convert_module",
        inherited=True,
        conversion=conversion.convert_module_as_in_2_5,
    )


STRATEGY_CONNECT = PatchTarget(
    module="strategies.fsdp",
    class_name="FSDPStrategy",
    attribute="connect",
    inherited=True,
    conversion=conversion.connect_without_early_conversion,
)

STRATEGY_SETUP = PatchTarget(
    module="strategies.fsdp",
    class_name="FSDPStrategy",
    attribute="setup",
    inherited=False,
    conversion=conversion.convert_before_setup,
)


def patch_plan(namespace: Namespace, version: str) -> tuple[PatchTarget, ...]:
    """The targets that make an affected release behave like 2.5.0.

    Fabric and the 2.2.0–2.4.x Trainer already call ``convert_module`` where 2.5.0 does, so the
    missing method is all they need. The 2.1.x Trainer calls it only in ``Strategy.connect``, too
    early, so it also needs 2.2.0's call site in ``FSDPStrategy.setup`` and none in ``connect``.
    """
    precision = precision_convert_module(namespace, version)
    if namespace.kind == "trainer" and converts_only_in_connect(version):
        return (precision, STRATEGY_CONNECT, STRATEGY_SETUP)
    return (precision,)


@dataclass(frozen=True)
class ModelHolder:
    """Where an FSDP-wrapped model lives after setup: read by the late-activation check only."""

    module: str
    class_name: str
    attributes: tuple[str, ...]


MODEL_HOLDERS: dict[Kind, ModelHolder] = {
    "trainer": ModelHolder("strategies.fsdp", "FSDPStrategy", ("_model",)),
    "fabric": ModelHolder("wrappers", "_FabricModule", ("_forward_module",)),
}
