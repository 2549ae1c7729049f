"""Errors raised by fastdata.

Every error a user can cause is a `FastdataError`; the CLI prints its message on one line
and exits non-zero, so messages say what went wrong, where, and what to do about it.
"""
from __future__ import annotations

import numbers


class FastdataError(Exception):
    """Base class of every error fastdata raises on purpose.

    Its message says what went wrong, where (the file, URL or argument), and what to do about it.
    The ``fastdata`` command prints it on one line and exits non-zero, without a traceback.

    Examples:
        >>> try:
        ...     ds = FastDataset("data/train")
        ... except FastdataError as exc:
        ...     sys.exit(f"error: {exc}")
    """


class SourceError(FastdataError):
    """The preprocessing source (image folder, CSV list, records, text files) is missing, empty or malformed."""


class TextInputError(SourceError):
    """A text document is unreadable (bad UTF-8, a JSON line without the field) and ``on_error="fail"``."""


class ImageDecodeError(FastdataError):
    """One input image could not be decoded (truncated, empty, not an image...).

    Preprocessing raises it with ``on_error="fail"``; reading an LMDB dataset raises it for a damaged record.
    """


class OutputError(FastdataError):
    """The output folder cannot be written, or holds something we must not overwrite."""


class DiskFullError(OutputError):
    """The disk filled up while writing; nothing that looks finished was left behind.

    A subclass of `OutputError`; a rerun after freeing space resumes.
    """


class FormatError(FastdataError):
    """A dataset folder or one of its files is not what its manifest says."""


class VersionError(FormatError):
    """A manifest was written by a format version this fastdata cannot read; upgrading fastdata reads it."""


class ChecksumError(FormatError):
    """A file's bytes do not match the checksum recorded in the manifest.

    ``fastdata verify`` lists every damaged file of a dataset.
    """


class MissingDependencyError(FastdataError):
    """An optional dependency is not installed; the message names the pip extra."""


class ConfigError(FastdataError, ValueError):
    """An argument has a bad value; the message names the argument and echoes the value.

    It is also a ``ValueError``, so code that catches ``ValueError`` keeps working.
    """


def require(ok: bool, name: str, value: object, expected: str) -> None:
    """Raise ``ConfigError("NAME must be EXPECTED, got NAME=VALUE")`` unless ``ok``: the config checks' one form."""
    if not ok:
        raise ConfigError(f"{name} must be {expected}, got {name}={value!r}")


def is_whole(value: object) -> bool:
    """An integer (a numpy one too), not a bool: what a count, a position or a size must be."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
