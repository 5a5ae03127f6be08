"""What verify and its probes hand each other (``--json`` prints the fields in this order). Standard library only:
``cli.py`` imports it in bare environments."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PROBE_TIMEOUT = 1800  # seconds one step (reading Lightning, or one training run) may take (--timeout)
PACKAGES = {"lightning": "lightning.pytorch", "pytorch_lightning": "pytorch_lightning"}  # --package: namespace
CHOICES = tuple(PACKAGES)


@dataclass(frozen=True)
class Options:
    precision: str = "bf16-true"
    devices: int = 1
    steps: int = 3
    as_json: bool = False
    model: str | None = None
    init_args: dict[str, Any] = field(default_factory=dict)
    datamodule: str | None = None
    timeout: float = PROBE_TIMEOUT
    model_path: str | None = None
    activation_checkpointing: list[str] = field(default_factory=list)
    package: str | None = None  # the seed's Lightning (CHOICES); None: lightning where installed


@dataclass(frozen=True)
class ProbeRequest:
    out: str  # a path prefix: shim1, shim0 in verify's folder
    options: Options
    namespace: str | None = None  # None: the first probe, which reads Lightning (gate.json) and picks it
    runs: list[tuple[int, bool]] = field(default_factory=list)  # (number in the plan, checkpointed)


@dataclass(frozen=True)
class RankResult:
    """One rank's figures from one run; a checkpointed run that raised has ``error``, ``checkpointed``, ``fixes``."""

    rank: int
    module_dtype: str = ""
    flat_param_dtypes: list[str] = field(default_factory=list)
    param_bytes: int = 0
    grad_bytes: int = 0
    optimizer_state_bytes: int = 0
    losses: list[float | None] = field(default_factory=list)
    param_hashes: dict[str, str] = field(default_factory=dict)  # SHA-256 of this rank's shards, by name
    checkpointed: int = 0  # modules of the checkpointed classes (or their checkpoint wrappers)
    lightning: str = ""
    namespace: str = ""
    fixes: dict[str, dict[str, Any]] = field(default_factory=dict)  # the shim's FixStatus.as_dict(), per fix
    error: str | None = None
