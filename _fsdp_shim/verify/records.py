"""What verify and its probes hand each other (``--json`` prints the fields in this order), and which installed
Trainer namespaces the seed model trains. Standard library only: ``cli.py`` imports it in bare environments."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PROBE_TIMEOUT = 1800  # seconds one probe (reading Lightning, or one training run) may take (--timeout)
PACKAGES = {"lightning": "lightning.pytorch", "pytorch_lightning": "pytorch_lightning"}  # --package: namespace
CHOICES = (*PACKAGES, "all")
UNITS = {  # the seed model's FSDP units, reported on their own
    "pretrained": "model loaded in float32 (from_pretrained)",
    "model": "seed model, built in configure_model",
    "block": "causal block, built in configure_model",
}
SEED_CHECKPOINTED = "CausalBlock"  # the seed's checkpointed class, named as --activation-checkpointing's are


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
    auto_wrap: list[str] = field(default_factory=list)  # --model's FSDP units, as the user's auto_wrap_policy
    package: str | None = None  # the seed model's namespaces: None, every one but pip's standalone; or CHOICES


@dataclass(frozen=True)
class ProbeRequest:
    mode: str  # "gate", or "measure": train ``namespace`` (None: the user's model's)
    out: str  # a path prefix
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
    unit_param_bytes: dict[str, int] = field(default_factory=dict)  # the seed's UNITS
    peak_memory_bytes: int = 0
    peak_memory_kind: str = ""
    losses: list[float | None] = field(default_factory=list)
    param_hashes: dict[str, str] = field(default_factory=dict)  # SHA-256 of this rank's shards, by name
    checkpointed: int = 0  # modules of the checkpointed classes (or their checkpoint wrappers)
    lightning: str = ""
    namespace: str = ""
    fixes: dict[str, dict[str, Any]] = field(default_factory=dict)  # the shim's FixStatus.as_dict(), per fix
    error: str | None = None


@dataclass(frozen=True)
class Skipped:
    namespace: str  # installed, not checked (--json's "skipped")
    version: str
    reason: str


def select(package: str | None, installed: dict[str, str]) -> tuple[list[str], list[Skipped]]:
    """The namespaces to check, in ``installed``'s order (namespace: version), and every other one with why: pip
    brings the standalone along with ``lightning`` 2.1+, so next to it that one is checked only when named."""
    chosen, why = list(installed), ""
    if package in PACKAGES:
        if PACKAGES[package] not in installed:
            raise ValueError(f"--package {package}: {package} is not installed in this interpreter")
        chosen, why = [PACKAGES[package]], f"not checked (--package {package}; --package all checks every one)"
    elif package is None and all(namespace in installed for namespace in PACKAGES.values()):
        chosen = [namespace for namespace in installed if namespace != PACKAGES["pytorch_lightning"]]
        why = (
            "not checked: installed next to lightning (pip brings it along with lightning 2.1 and later, whether "
            "or not your code imports it), so verify checks lightning, the package of `import lightning`. If your "
            "code imports pytorch_lightning: --package pytorch_lightning (--package all checks both)"
        )
    return chosen, [Skipped(ns, version, why) for ns, version in installed.items() if ns not in chosen]
