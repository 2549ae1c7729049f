"""Read a source where it lives: a local file, or an object at an fsspec URL streamed through ranged reads
under the process's retry budget; a sample's object read a few ahead of the one decoded.

NOTE [url source]:
1. A URL SRC (``s3://``, ``gs://``, ``file://``, anything fsspec knows) is read where it lives, never copied
   whole to disk: the driver lists a folder once (``find``) and streams a records or text file through
   ranged reads (`UrlReader`); each worker reads its samples' objects itself (`UrlBlobs`), a few ahead of
   the one it decodes, masks as images (`fields.mask_readers`).
2. A folder at a URL gives the classes, paths and order a local folder of the same files gives; records'
   paths are relative to the records file's folder URL and may not leave it (masks become full URLs, which
   the worker reads the same way). The output is byte-identical to the local run's.
3. Every request goes through the process's own fsspec filesystem (fsspec keeps one per process and set of
   options) under one retry budget per process (NOTE [retry budget] in fastdata/storage/object_store.py). A
   source that is missing or refused is one SourceError line, its URL scrubbed of secrets.
4. A sample whose object is missing is a bad record, as a missing local file is; a store still failing
   when the budget is spent stops the run (a rerun resumes).
"""
from __future__ import annotations

import io
import os
import posixpath
import urllib.parse
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Optional, TextIO, Union

from .._io import scrub
from ..errors import FormatError, ImageDecodeError, SourceError
from ..storage.object_store import Retry, filesystem, is_url

_RETRY = Retry()  # one budget per process, shared by its threads (a worker's read-ahead)
_READ_BLOCK = 8 << 20  # bytes per ranged request of a streamed records or text file
_AHEAD = 16  # objects a worker requests ahead of the one it decodes (one request at a time waits out latency)
_POOL: Optional[tuple[int, ThreadPoolExecutor]] = None  # (pid, threads): see _readers


def parent(location: Union[Path, str]) -> Union[Path, str]:
    """The folder a records file's paths are relative to: a resolved path, or the file's folder URL (without
    the file's query, a presigned URL's token for that file)."""
    if isinstance(location, str) and is_url(location):
        return location.split("?", 1)[0].rsplit("/", 1)[0]
    return Path(location).parent.resolve()


def url_path(location: Union[Path, str]) -> str:
    """What a source's suffix is read from: a URL's path, without its query (a presigned or SAS URL,
    ``.../x.tar?sig=...``, is a ``.tar``; the query stays in the URL read), or a local path as given."""
    text = str(location)
    return urllib.parse.urlsplit(text, allow_fragments=False).path if is_url(text) else text


def store_call(url: str, fn: Callable[[], Any], doing: str = "read") -> Any:
    """``fn()`` under the process's retry budget; a refusal or an outage longer than the budget is one
    SourceError (FileNotFoundError passes: a missing object means something else to each caller)."""
    try:
        return _RETRY(url, fn, doing)
    except FormatError as exc:  # the budget's own message: scrubbed, with what to do
        raise SourceError(str(exc)) from None


def _missing(url: str, what: str) -> SourceError:
    return SourceError(f"source {scrub(url)} does not exist (no such {what}, or no such bucket): check the URL")


class UrlReader(io.RawIOBase):
    """A seekable binary stream on one object at ``url``: each read is one ranged request under the retry
    budget (a records or text file streams through it, buffered; pyarrow reads a Parquet footer and its
    row groups' column chunks through it).

    Args:
        url: The object's fsspec URL.
        size: Its size in bytes, when a listing gave it (else one metadata request asks).

    Raises:
        SourceError: The object does not exist or cannot be read.
    """

    def __init__(self, url: str, size: Optional[int] = None) -> None:
        super().__init__()
        self.url, self.pos = url, 0
        self.fs, self.path = filesystem(url)
        try:
            self.size = size if size is not None else int(store_call(url, lambda: self.fs.size(self.path)))
        except FileNotFoundError:
            raise _missing(url, "object") from None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, b: Any) -> int:
        start, end = self.pos, min(self.size, self.pos + len(b))
        if end <= start:
            return 0
        try:
            data = store_call(self.url, lambda: self.fs.cat_file(self.path, start=start, end=end))
        except FileNotFoundError:
            raise SourceError(f"{scrub(self.url)} vanished while it was read: rerun when it is back") from None
        b[:len(data)] = data
        self.pos += len(data)
        return len(data)


def open_binary(location: Union[Path, str], size: Optional[int] = None, block: Optional[int] = None) -> Any:
    """A buffered binary stream on a local file or an object at a URL (streamed, `UrlReader`, in ranged reads
    of ``block`` bytes: default 8 MiB)."""
    if isinstance(location, str) and is_url(location):
        return io.BufferedReader(UrlReader(location, size), min(block or _READ_BLOCK, _READ_BLOCK))
    return open(location, "rb")


def open_text(location: Union[Path, str]) -> TextIO:
    """UTF-8 text (a BOM dropped, line ends as written: csv's rule) on a local file or a URL."""
    return io.TextIOWrapper(open_binary(location), encoding="utf-8-sig", newline="")


def url_listing(url: str) -> dict[str, dict[str, Any]]:
    """Every entry under the folder ``url``: its path relative to it -> fsspec's info (``type``, ``size``...).

    Raises:
        SourceError: ``url`` cannot be listed (missing bucket, access denied, the store down past the budget).
    """
    fs, root = filesystem(url)
    root = root.rstrip("/")
    fs.invalidate_cache(root)  # fsspec keeps listings per process: a rerun after an upload must see it
    try:
        found = store_call(url, lambda: fs.find(root, withdirs=True, detail=True), "list")
    except FileNotFoundError:
        raise _missing(url, "folder") from None
    except SourceError:
        raise
    except Exception as exc:  # noqa: BLE001 - fsspec backends raise their own types for a refused listing
        raise SourceError(f"cannot list {scrub(url)}: {type(exc).__name__}: {scrub(str(exc))}") from None
    cut = len(root) + 1
    return {p[cut:]: info for p, info in found.items() if p.startswith(root + "/") and len(p) > cut}


class UrlBlobs:
    """Reads sample ``i``'s bytes: the object ``base/names[i]``, one request under the retry budget, the
    next few requested ahead by threads (a store's latency, not its bandwidth, bounds one stream). A
    missing object is a bad record (ImageDecodeError); a store down past the budget stops the run
    (SourceError). Picklable: a task carries its chunk's names; each worker uses its own filesystem.

    Args:
        base: The folder URL the names are relative to ("" where they are whole URLs: a chunk's masks).
        names: Each sample's object, relative to ``base`` (None: nothing to read for that sample).
    """

    def __init__(self, base: str, names: list[str]) -> None:
        self.base, self.names = base, names
        self._ahead: dict[int, Future] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {"base": self.base, "names": self.names, "_ahead": {}}

    def chunk(self, a: int, b: int) -> "UrlBlobs":
        """Samples ``a..b`` only: what one worker task needs."""
        return UrlBlobs(self.base, self.names[a:b])

    def permuted(self, perm: list[int]) -> "UrlBlobs":
        """The same samples in the order ``perm`` (``--shuffle``): sample ``i`` is this one's ``perm[i]``."""
        return UrlBlobs(self.base, [self.names[i] for i in perm])

    def read(self, i: int) -> bytes:
        pool = _readers()
        for j in range(i, min(i + _AHEAD, len(self.names))):
            if j not in self._ahead and self.names[j] is not None:  # None: a sample with nothing to read
                self._ahead[j] = pool.submit(read_object, posixpath.join(self.base, self.names[j]))
        for j in [j for j in self._ahead if j < i]:  # skipped over (a caller that reads out of order)
            self._ahead.pop(j).cancel()
        try:
            return self._ahead.pop(i).result()
        except SourceError:  # the store is down past the budget: the run stops, so no more requests
            for f in self._ahead.values():
                f.cancel()
            raise


def _readers() -> ThreadPoolExecutor:
    """The process's read-ahead threads (a forked worker starts its own: threads do not survive a fork)."""
    global _POOL
    if _POOL is None or _POOL[0] != os.getpid():
        _POOL = (os.getpid(), ThreadPoolExecutor(_AHEAD, thread_name_prefix="fastdata-read"))
    return _POOL[1]


def read_object(url: str) -> bytes:
    """The whole object at ``url`` (an image, a mask), under the retry budget.

    Raises:
        ImageDecodeError: There is no such object (a bad record, as a missing local file is).
        SourceError: The store refuses, or is down past the retry budget.
    """
    fs, path = filesystem(url)
    try:
        return store_call(url, lambda: fs.cat_file(path))
    except FileNotFoundError:
        raise ImageDecodeError(f"FileNotFoundError: no such object {scrub(url)}") from None
