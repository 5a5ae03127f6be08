"""What the probes find, as the probe writes it and verify reads it back: one typed record per job.

* :class:`GateResult`: the gate probe's reading of the installed Lightning (``gate.json``), from which
  verify decides what it must train;
* :class:`RankResult`: one rank's figures from one training run (``<out>.rank<N>.json``), what the
  probe measures and what the verdict judges. ``--json`` prints them as ``dataclasses.asdict`` gives
  them, so the field order here is the order of the keys there.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class NamespaceGate:
    """One installed Trainer namespace as the gate probe found it: its release and whether the shim
    patched it, or why it does not import (``import_failure``, as ``lightning_install.import_failure``)."""

    version: str = ""
    affected: bool = False
    shim_patched: bool = False
    shim_reason: str = ""
    import_failure: list[str | None] | None = None


@dataclass(frozen=True)
class GateResult:
    namespaces: dict[str, NamespaceGate] = field(default_factory=dict)
    """Every installed Trainer namespace, in the order of ``TRAINER_NAMESPACES``."""
    model_namespaces: list[str] = field(default_factory=list)
    """With ``--model``: the namespace the model's class belongs to, or those imported with it."""

    def importable(self, namespace: str) -> bool:
        found = self.namespaces.get(namespace)
        return found is None or found.import_failure is None

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> GateResult:
        data = json.loads(text)
        namespaces = {name: NamespaceGate(**info) for name, info in data["namespaces"].items()}
        return cls(namespaces, data["model_namespaces"])


@dataclass(frozen=True)
class RankResult:
    rank: int
    device: str
    """``cuda`` or ``cpu``."""
    backend: str
    module_dtype: str
    """``str(LightningModule.dtype)`` after training, e.g. ``torch.bfloat16``."""
    flat_param_dtypes: list[str]
    """The sorted dtypes of FSDP's flat parameters."""
    param_bytes: int
    grad_bytes: int
    optimizer_state_bytes: int
    unit_param_bytes: dict[str, int]
    """Flat-parameter bytes of the FSDP units reported on their own (the seed's two models)."""
    peak_memory_bytes: int
    peak_memory_kind: str
    losses: list[float | None]
    lightning: str
    """The version of the namespace trained."""
    namespace: str
    shim_patched: bool
    shim_reason: str

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RankResult:
        return cls(**json.loads(text))
