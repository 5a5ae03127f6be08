"""``fsdp-shim verify`` (docs/verify.md); its command line's choices are here, so parsing it loads none of verify."""

PROBE_TIMEOUT = 1800  # seconds one probe (one shim state's process and the ranks it starts) may take (--timeout)
PACKAGES = {"lightning": "lightning.pytorch", "pytorch_lightning": "pytorch_lightning"}  # --package: namespace
