"""``fsdp-shim verify``: train the seed's model with the shim off and on, in fresh processes, and
show side by side what the shim changes. Nothing here is imported by ``import fsdp_shim``."""
