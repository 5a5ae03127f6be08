"""Folder that ``fsdp-shim run`` puts on PYTHONPATH; it holds only the bootstrap ``sitecustomize``."""
