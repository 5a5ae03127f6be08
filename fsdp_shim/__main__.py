"""``python -m fsdp_shim``: the same as the ``fsdp-shim`` command."""

from _fsdp_shim.cli import main

raise SystemExit(main())
