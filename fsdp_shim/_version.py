"""The package version, kept apart so that start-up code can read it without importing anything."""

__version__ = "0.1.0"
