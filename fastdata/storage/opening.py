"""A dataset path opened for reading: a local folder as it is, or a URL's node-cache folder with what is not
streamed downloaded; the cache bound parsed; what every streamed dataset offers (NOTE [shard cache] in
cache.py runs the streaming itself)."""
from __future__ import annotations

import math
import numbers
import re
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import numpy as np

from .._io import scrub
from ..distributed import broadcast_bytes, group_size, is_main_rank
from ..errors import ConfigError, FastdataError, FormatError
from ..formats.manifest import MANIFEST_NAME, check_manifest, load_columns
from ..formats.rows import column, int_column
from .object_store import RETRY_SECONDS, is_url
from .remote import RemoteDataset
from .streamed import unread_files

if TYPE_CHECKING:
    from .cache import ShardCache
    from .cache_locks import ShardPins

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50}


def parse_size(value: Union[int, float, str, None], name: str = "cache_limit") -> Optional[int]:
    """Bytes from ``10**9``, ``"200GB"``, ``"1.5 TiB"`` (``None`` stays ``None``: no bound).

    Raises:
        ConfigError: ``value`` is not a size, not finite, or under one byte (``0.5``, ``"0.4b"``).
    """
    if value is None:
        return None
    size: Optional[float] = None
    if isinstance(value, numbers.Real) and not isinstance(value, bool):  # (numpy's too)
        size = value
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value) if isinstance(value, str) else None
    if m is not None and m.group(2).lower() in _UNITS:
        size = float(m.group(1)) * _UNITS[m.group(2).lower()]
    finite = size is not None and (isinstance(size, int) or math.isfinite(size))  # (int(inf) overflows)
    if not finite or size < 1:  # (0.5 bytes would be 0)
        raise ConfigError(f"{name} must be a finite number of bytes, at least 1, or a size such as '200GB' or "
                          f"'1.5TiB', got {name}={value!r}")
    return int(size)


@dataclass(frozen=True)
class OpenedPath:
    """A dataset path opened for reading, its manifest read once: pass it instead of the path to a second
    reader of the same dataset in this run (a train and an eval reader, DALILoader) so that neither reads
    nor fetches the manifest again.

    Attributes:
        root: the local folder (a URL's node-cache folder).
        manifest: the checked manifest.
        remote: the `RemoteDataset` a URL was opened through; None for a local folder.
        limit: the cache bound in bytes (``cache_limit``); None for no bound or a local folder.
    """

    root: Path
    manifest: dict[str, Any]
    remote: Optional[RemoteDataset] = None
    limit: Optional[int] = None


def open_path(path: Union[str, Path, OpenedPath], formats: tuple[str, ...], *,
              storage_options: Optional[dict[str, Any]] = None, cache_dir: Optional[Union[str, Path]] = None,
              cache_limit: Union[int, str, None] = None,
              streamed: Callable[[dict[str, Any]], frozenset[str]] = lambda m: frozenset(),
              retry_seconds: float = RETRY_SECONDS) -> OpenedPath:
    """A dataset folder or URL opened: its manifest read and checked once (one of ``formats``), a URL's files
    but ``streamed(manifest)`` downloaded into the node cache (those come with the batches), the cache bound
    parsed; a URL's reads are retried over ``retry_seconds`` (NOTE [retry budget] in object_store.py). An
    `OpenedPath` is checked against ``formats`` and returned as it is.

    Raises:
        ConfigError: URL options given for a local folder or an opened path; a dataset that streams nothing
            and does not fit under ``cache_limit``.
        FormatError: no manifest, a damaged one, or a format not in ``formats``.
    """
    if isinstance(path, OpenedPath):
        if storage_options is not None or cache_dir is not None or cache_limit is not None:
            raise ConfigError("storage_options, cache_dir and cache_limit were given when the dataset was opened; "
                              "pass them there, not again with the opened dataset")
        check_manifest(path.manifest, path.root, formats, where=str(path.root / MANIFEST_NAME), columns=True)
        return path
    limit = parse_size(cache_limit)
    if not is_url(str(path)):  # a local folder is read in place
        if storage_options is not None or cache_dir is not None or cache_limit is not None:
            raise ConfigError(f"storage_options, cache_dir and cache_limit apply to URLs (s3://..., gs://...); "
                              f"{path} is a local path")
        return OpenedPath(Path(path), load_columns(path, formats))
    remote = _job_remote(str(path), storage_options=storage_options, cache_dir=cache_dir,
                         retry_seconds=retry_seconds)
    manifest = check_manifest(remote.manifest, remote.dir, formats, where=f"{scrub(remote.url)}/{MANIFEST_NAME}",
                              columns=True)  # (the remote's own, in place)
    stream, unread = streamed(manifest), unread_files(manifest)
    need = 0
    if limit is not None and not stream:  # (only then: the sum walks every file)
        files = manifest["files"]
        kept = np.fromiter((p not in unread for p in column(files, "path")), bool, len(files))
        need = int(int_column(files, "bytes")[kept].sum())
    if limit is not None and not stream and need > limit:
        raise ConfigError(f"reading {scrub(remote.url)} this way needs all of it ({need} bytes) in the cache, more "
                          f"than cache_limit={limit}: raise the limit, or stream it (npy images or tokens with "
                          "storage='mmap')")
    # a reader of every file holds the folder until it is closed: a job with a limit sharing it would evict them
    return OpenedPath(remote.prepare(stream | unread, hold=not stream), manifest, remote, limit)


def _job_remote(url: str, **options: Any) -> RemoteDataset:
    """The remote dataset at ``url``, one version for the whole job: under a process group rank 0 reads the
    manifest and every other rank gets its bytes, so a push landing while the ranks open never splits
    them between two versions (every rank opens the dataset, as every rank builds its loader)."""
    if group_size() == 1:
        return RemoteDataset(url, **options)
    remote, error = None, None
    if is_main_rank():
        try:
            remote = RemoteDataset(url, **options)
        except FastdataError as exc:  # the others must not wait for bytes that never come
            error = exc
    raw = broadcast_bytes(remote.manifest_bytes() if remote is not None else None)
    if error is not None:
        raise error
    if raw is None:
        raise FormatError(f"rank 0 could not open {scrub(url)}: its error says why")
    return remote if remote is not None else RemoteDataset(url, manifest_bytes=raw, **options)


def _release(cache: Optional["ShardCache"], reader: Any, whole: Optional[ShardPins] = None) -> None:
    if cache is not None:
        cache.close()
    if reader is not None:
        reader.close()
    if whole is not None:
        whole.close()


class StreamedReads:
    """What every dataset opened through this layer offers: reads streamed through a `ShardCache`
    (``_cache``; None when local), and `close`. ``plan_reads(batches, now)`` stays the dataset's own
    (it maps samples to shards)."""

    _cache: Optional["ShardCache"]
    _remote: Optional[RemoteDataset]

    def _hold(self, reader: Any = None) -> None:
        """Called once opened: closing the dataset, or dropping it, stops the cache's threads, lets go of its
        pins (and of its own hold on the cache folder, where it reads every file: `RemoteDataset.hold_whole`)
        and closes ``reader`` (LMDB environments). The finalizer refers to them, never to the dataset, so a
        dropped dataset is collected."""
        remote = getattr(self, "_remote", None)
        whole = remote.hold_whole() if remote is not None else None
        self._released = weakref.finalize(self, _release, self._cache, reader, whole)

    def close(self) -> None:
        """Release what the dataset holds: prefetch threads, pinned shards, LMDB environments and memory maps
        (a copy in /dev/shm stays for the next reader). Batches read earlier stay valid; reading again
        raises. Calling it twice does nothing.

        Example:
            >>> with FastDataset("data/train") as ds:
            ...     x, y = ds.get_batch([0, 1])
        """
        self._closed = True  # first: a read racing the close is told "closed", not a missing shard
        released = getattr(self, "_released", None)
        if released is not None:
            released()
        self._drop_storage()

    def _drop_storage(self) -> None:
        """Forget the maps and arrays the dataset reads (each dataset knows its own)."""

    def _check_open(self) -> None:
        if getattr(self, "_closed", False):
            raise ConfigError(f"{self!r} was closed: open the dataset again to read it")

    def __enter__(self) -> "StreamedReads":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def end_reads(self, token: Optional[object]) -> None:
        """The loader pass that planned ``token`` is over (its prefetching stops)."""
        if self._cache is not None and token is not None:
            self._cache.end_plan(token)

    @property
    def streamed(self) -> bool:
        """Whether reads go through a node cache (a dataset at a URL)."""
        return self._cache is not None

    @property
    def cache_limit(self) -> Optional[int]:
        """The node cache's limit in bytes (None: unbounded, or not streamed)."""
        return self._cache.limit if self._cache is not None else None

    def set_cache_limit(self, limit: Union[int, str, None]) -> None:
        """Give the node cache a new limit, in bytes or as ``cache_limit`` takes it (``"200GB"``; None:
        unbounded); a lower one evicts at once the shards not in use, farthest next use first
        (`ShardCache.set_limit`).

        Raises:
            ConfigError: The dataset is not streamed (it has no cache), or ``limit`` is not a size.
        """
        if self._cache is None:
            raise ConfigError(f"{self!r} reads local files: it has no cache to limit")
        size = parse_size(limit, "limit")
        self._cache.set_limit(size)
        self._keep_limit(size)

    def _keep_limit(self, limit: Optional[int]) -> None:
        """Remember a limit given after opening for the dataset's next opening (a spawned or forkserver
        DataLoader worker opens it again from its pickled state)."""

    def download_report(self) -> list[dict[str, Optional[int]]]:
        """Downloads per loader pass, oldest first (`ShardCache.report`); empty when not streamed."""
        return self._cache.report() if self._cache is not None else []
