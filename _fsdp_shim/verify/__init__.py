"""``fsdp-shim verify`` (docs/verify.md), never imported by ``import fsdp_shim``. Its own process: ``command``,
``report``; its probes': ``probe``, ``measure``, ``cpu_guards``; both: ``records``."""
