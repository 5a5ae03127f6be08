"""``python -m fsdp_shim``: the same as the ``fsdp-shim`` command."""

import sys

from fsdp_shim.cli import main

sys.exit(main())
