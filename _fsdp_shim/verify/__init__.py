"""``fsdp-shim verify`` (docs/verify.md): never imported by ``import fsdp_shim``."""
