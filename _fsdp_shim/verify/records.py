"""What verify and its probe processes hand each other, declared once: the options (filled by ``cli.py``),
one probe's task (:class:`ProbeRequest`, JSON on its command line) and one :class:`RankResult` per rank
(a JSON file); ``--json`` prints the fields in the order declared here. Standard library only: ``cli.py``
imports it to build its parser, also in bare environments.
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
    user's model's own; ``out`` is then a path prefix for one result per rank)."""

    mode: str
    out: str
    options: Options
    namespace: str | None = None
    checkpointing: bool = False


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
    unit_param_bytes: dict[str, int] = field(default_factory=dict)  # FSDP units reported on their own (seed)
    peak_memory_bytes: int = 0
    peak_memory_kind: str = ""
    losses: list[float | None] = field(default_factory=list)
    param_hashes: dict[str, str] = field(default_factory=dict)  # SHA-256 of this rank's shards, by name
    checkpointed: int = 0  # modules of the --activation-checkpointing classes (or their checkpoint wrappers)
    lightning: str = ""
    namespace: str = ""
    fixes: dict[str, dict[str, Any]] = field(default_factory=dict)  # the shim's FixStatus in this run, per fix
    error: str | None = None
