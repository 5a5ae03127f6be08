"""Entry scripts for the child processes ``fsdp-shim`` starts, run by path, never with ``-c`` or ``-m``:
those put the current folder first on ``sys.path``, where a user's ``yaml.py`` or ``packaging.py`` would
shadow real modules. The script's own folder goes there instead, so this folder holds only these
scripts, under names no real module has; each takes its folder off ``sys.path`` first, then calls
linted functions of the package. Importing this package does nothing.
"""
