"""``fsdp-shim verify`` (docs/verify.md), never imported by ``import fsdp_shim``: ``command`` in its own process,
``probe`` (run by its path), ``measure`` and ``cpu_guards`` in its probes."""
