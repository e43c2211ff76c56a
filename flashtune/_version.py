"""The version of flashtune: the one source (pyproject.toml reads it from here)."""

__version__ = "0.1.0"
