"""The package version, in one place below everything that reports it."""

__version__ = "0.2.0"
