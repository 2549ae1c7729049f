"""The installed fastdata version, in a module of its own so that any module can read it without
importing the package's ``__init__`` (which would be an import cycle)."""
from __future__ import annotations

try:
    from importlib.metadata import PackageNotFoundError, version

    __version__ = version("fastdata")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"
