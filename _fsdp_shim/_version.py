"""fsdp-shim's version: what every build and every source tree says (a release sets it, CONTRIBUTING.md)."""

__version__ = "0.3.0.dev0"
