"""What ``fsdp-shim verify`` was asked to do, declared once.

``cli.py`` parses the command line into :class:`Options`; verify passes them, with what one probe
is to do, to the probe process as JSON (:class:`ProbeRequest`), so the probe reads the same typed
fields instead of declaring the options a second time. Standard library only: ``cli.py`` imports
this module while it builds its parser, and install runs in bare environments.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

PROBE_TIMEOUT = 1800
"""Seconds one probe (reading Lightning, or one training run) may take before verify stops it (--timeout)."""


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
    """The folder ``--model`` and ``--datamodule`` are imported from (default: the current folder)."""


@dataclass(frozen=True)
class ProbeRequest:
    """One probe process's task: ``gate`` (read the installed Lightning) or ``measure`` (train once
    and write one result per rank), where it writes its results (``out``, a path prefix for
    ``measure``), the namespace to train (``None``: the user's model's own) and verify's options."""

    mode: str
    out: str
    options: Options
    namespace: str | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ProbeRequest:
        data = json.loads(text)
        return cls(**{**data, "options": Options(**data["options"])})
