"""Entry scripts for the child processes ``fsdp-shim`` starts, run by path, never with ``-c`` or ``-m``, which put
the current folder first on ``sys.path``, where a user's ``yaml.py`` would shadow real modules. The script's own
folder goes there instead: so this folder holds only these scripts, and each takes it off ``sys.path`` first."""
