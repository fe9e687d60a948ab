"""The one place hicache's version is written (pyproject reads it, both CLIs print it)."""

__version__ = "0.1.0"
