"""``fsdp-shim verify`` (docs/verify.md), never imported by ``import fsdp_shim``: ``command`` in its own process,
``probe``, ``measure`` and ``cpu_guards`` in its probes', ``records`` in both."""
