"""``python -m fsdp_shim``: the same as the ``fsdp-shim`` command."""

import sys

from _fsdp_shim.cli import main

sys.exit(main())
