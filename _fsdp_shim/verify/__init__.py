"""``fsdp-shim verify`` (docs/verify.md); nothing here is imported by ``import fsdp_shim``. Verify's own
process: ``command``, ``output``, ``verdict``; the probe's: ``probe``, ``measure``, ``seed``, ``cpu_guards``;
both: ``records``."""
