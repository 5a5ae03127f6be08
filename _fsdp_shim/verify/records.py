"""What verify and its probes hand each other (``--json`` prints the fields in this order). Standard library
only: ``cli.py`` imports it in bare environments too."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PROBE_TIMEOUT = 1800  # seconds one probe (reading Lightning, or one training run) may take (--timeout)


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
    package: str | None = None  # the seed model's namespaces (verify/selection.py): None, every one the user uses


@dataclass(frozen=True)
class ProbeRequest:
    """``gate`` or ``measure`` (train ``namespace``, ``None``: the user's model's; ``out``: a path prefix)."""

    mode: str
    out: str
    options: Options
    namespace: str | None = None
    checkpointing: bool = False


@dataclass(frozen=True)
class RankResult:
    """One rank's figures from one run; a checkpointed run that raised has ``error``, ``checkpointed``, ``fixes``."""

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
