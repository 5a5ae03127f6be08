"""One rank's figures from one training run: what the probe measures and what the verdict judges.

The probe writes one :class:`RankResult` per rank as ``<out>.rank<N>.json``; verify reads them back
with :meth:`RankResult.from_json`. ``--json`` prints them as ``dataclasses.asdict`` gives them, so the
field order here is the order of the keys there.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass


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
