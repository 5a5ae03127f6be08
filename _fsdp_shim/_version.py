"""The version, in a module of its own: everything the package imports can read it without importing
the package itself (whose ``__init__`` activates the shim), and the build reads it without running code."""

__version__ = "0.2.0"
