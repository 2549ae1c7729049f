"""The installed fastdata version, in a module of its own so that any module can read it without
importing the package's ``__init__`` (which would be an import cycle)."""
from __future__ import annotations

import re
from pathlib import Path


def _source_version() -> str:
    """The version pyproject.toml gives, for a source tree used without installing it (a copy sent to a
    GPU machine, a checkout on PYTHONPATH); ``0.0.0+unknown`` when there is none."""
    try:
        text = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    except OSError:
        return "0.0.0+unknown"
    found = re.search(r'^version\s*=\s*"([^"]+)"', text, re.MULTILINE)
    return f"{found.group(1)}+source" if found else "0.0.0+unknown"


try:
    from importlib.metadata import PackageNotFoundError, version

    __version__ = version("fastdata")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = _source_version()
