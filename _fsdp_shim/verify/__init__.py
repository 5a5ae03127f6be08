"""``fsdp-shim verify`` (docs/verify.md): never imported by ``import fsdp_shim``. What the command line offers is here,
so that parsing it (``fsdp-shim run`` on every rank too) loads none of verify."""

PROBE_TIMEOUT = 1800  # seconds one probe (one shim state's process and the ranks it starts) may take (--timeout)
PACKAGES = {"lightning": "lightning.pytorch", "pytorch_lightning": "pytorch_lightning"}  # --package: namespace
