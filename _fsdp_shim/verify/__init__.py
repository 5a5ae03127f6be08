"""``fsdp-shim verify`` (docs/verify.md), never imported by ``import fsdp_shim``. Verify's process: ``command``,
``output``, ``verdict``; the probe's: ``probe``, ``measure``, ``seed``, ``cpu_guards``; both: ``records``."""
