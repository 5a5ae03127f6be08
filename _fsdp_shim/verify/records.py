"""Everything verify and its probe processes hand each other, declared once: the options (filled by
``cli.py``), one probe's task (:class:`ProbeRequest`, as JSON on its command line) and its findings
(:class:`GateResult`, one :class:`RankResult` per rank, as JSON files), so both sides read the same
typed fields; ``--json`` prints them in the order declared here. Standard library only: ``cli.py``
imports this module to build its parser, also in bare environments.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

PROBE_TIMEOUT = 1800
"""Seconds one probe (reading Lightning, or one training run) may take before verify stops it (--timeout)."""


def to_json(record: Any) -> str:
    return json.dumps(asdict(record))


@dataclass(frozen=True)
class Options:
    precision: str = "bf16-true"
    devices: int = 1
    steps: int = 3
    measure: bool = False
    as_json: bool = False
    model: str | None = None
    init_args: dict[str, Any] = field(default_factory=dict)
    datamodule: str | None = None
    timeout: float = PROBE_TIMEOUT
    model_path: str | None = None
    activation_checkpointing: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ProbeRequest:
    """``gate`` (read the installed Lightning) or ``measure`` (train ``namespace``, ``None`` for the
    user's model's own, once; ``out`` is then a path prefix for one result per rank)."""

    mode: str
    out: str
    options: Options
    namespace: str | None = None
    checkpointing: bool = False

    @classmethod
    def read(cls, text: str) -> ProbeRequest:
        data = json.loads(text)
        return cls(**{**data, "options": Options(**data["options"])})


@dataclass(frozen=True)
class NamespaceGate:
    """An installed Trainer namespace: its release and the shim's ``FixStatus`` per fix, or why it
    does not import (``distributions.import_failure``)."""

    version: str = ""
    fixes: dict[str, dict[str, Any]] = field(default_factory=dict)
    import_failure: list[str | None] | None = None


@dataclass(frozen=True)
class GateResult:
    namespaces: dict[str, NamespaceGate] = field(default_factory=dict)
    """Every installed Trainer namespace, in the order of ``TRAINER_NAMESPACES``."""
    model_namespaces: list[str] = field(default_factory=list)
    """With ``--model``: the namespace the model's class belongs to, or those imported with it."""

    def importable(self, namespace: str) -> bool:
        return self.namespaces[namespace].import_failure is None

    @classmethod
    def read(cls, text: str) -> GateResult:
        data = json.loads(text)
        return cls({name: NamespaceGate(**info) for name, info in data["namespaces"].items()}, data["model_namespaces"])


@dataclass(frozen=True)
class RankResult:
    """One rank's figures from one training run; a checkpointed run that raised has only ``error``
    (``Type: message``), ``checkpointed`` and ``fixes``."""

    rank: int
    device: str = ""
    module_dtype: str = ""
    flat_param_dtypes: list[str] = field(default_factory=list)
    param_bytes: int = 0
    grad_bytes: int = 0
    optimizer_state_bytes: int = 0
    unit_param_bytes: dict[str, int] = field(default_factory=dict)
    """Flat-parameter bytes of the FSDP units reported on their own (the seed's two models)."""
    peak_memory_bytes: int = 0
    peak_memory_kind: str = ""
    losses: list[float | None] = field(default_factory=list)
    param_hashes: dict[str, str] = field(default_factory=dict)
    """SHA-256 of this rank's shard of every parameter after training, by name."""
    checkpointed: int = 0
    """Modules of the ``--activation-checkpointing`` classes (those checkpointed, in a checkpointed run)."""
    lightning: str = ""
    namespace: str = ""
    fixes: dict[str, dict[str, Any]] = field(default_factory=dict)
    """The shim's ``FixStatus`` in this run, per fix."""
    error: str | None = None
