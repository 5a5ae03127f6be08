"""Entry scripts for the child processes ``fsdp-shim`` starts, and nothing else.

A child runs one of these files by its path (``python /…/_fsdp_shim/children/verify_probe.py …``),
never with ``-c`` or ``-m``: those put the current folder first on ``sys.path``, so a ``yaml.py`` or a
``packaging.py`` the user keeps there would run in the child. A script's own folder goes there
instead, which is why this folder holds only these scripts, under names no real module has; each
script takes its folder off ``sys.path`` before it imports anything else, then imports and calls
real, linted functions of the package.

Importing this package does nothing; the scripts do their work only when run as ``__main__``.
"""
