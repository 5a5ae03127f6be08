"""Code the tests run in fresh interpreters (see ``tests/child.py``). Importing a module here
imports neither Lightning nor fsdp_shim: each function does its imports itself, in its own order."""
