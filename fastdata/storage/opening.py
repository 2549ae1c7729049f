"""A dataset path opened for reading: a local folder as it is, or a URL's node-cache folder with what is not
streamed downloaded; the cache bound parsed; what every streamed dataset offers (NOTE [shard cache] in
cache.py runs the streaming itself)."""
from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

from ..errors import ConfigError
from .remote import RemoteDataset, is_url, scrub

if TYPE_CHECKING:
    from .cache import ShardCache

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50}


def parse_size(value: Union[int, float, str, None], name: str = "cache_limit") -> Optional[int]:
    """Bytes from ``10**9``, ``"200GB"``, ``"1.5 TiB"`` (``None`` stays ``None``: no bound)."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value) if isinstance(value, str) else None
    if m is None or m.group(2).lower() not in _UNITS or float(m.group(1)) <= 0:
        raise ConfigError(f"{name} must be a positive number of bytes or a size such as '200GB' or '1.5TiB', "
                          f"got {name}={value!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def open_remote(path: Union[str, Path], storage_options: Optional[dict[str, Any]],
                cache_dir: Optional[Union[str, Path]], cache_limit: Union[int, str, None],
                streamed: Callable[[dict[str, Any]], frozenset[str]]
                ) -> tuple[Path, Optional[RemoteDataset], Optional[int]]:
    """``(local folder, remote or None, limit in bytes)`` for a dataset ``path``: a URL's cache folder with
    every file but ``streamed(manifest)`` downloaded (those come with the batches), else the path itself.
    A dataset that streams nothing must fit under ``cache_limit`` whole."""
    limit = parse_size(cache_limit)
    if not is_url(str(path)):  # a local folder is read in place
        if storage_options is not None or cache_dir is not None or cache_limit is not None:
            raise ConfigError(f"storage_options, cache_dir and cache_limit apply to URLs (s3://..., gs://...); "
                              f"{path} is a local path")
        return Path(path), None, None
    remote = RemoteDataset(str(path), storage_options=storage_options, cache_dir=cache_dir)
    stream = streamed(remote.manifest)
    need = sum(int(f["bytes"]) for f in remote.manifest["files"] if f["path"] not in stream)
    if limit is not None and not stream and need > limit:
        raise ConfigError(f"reading {scrub(remote.url)} this way needs all of it ({need} bytes) in the cache, more "
                          f"than cache_limit={limit}: raise the limit, or stream it (npy images or tokens with "
                          "storage='mmap')")
    return remote.prepare(stream), remote, limit


class StreamedReads:
    """What every dataset streamed through a :class:`ShardCache` (``_cache``; None when local) offers;
    ``plan_reads(batches, now)`` stays the dataset's own (it maps samples to shards)."""

    _cache: Optional["ShardCache"]

    def end_reads(self, token: Optional[object]) -> None:
        """The loader pass that planned ``token`` is over (its prefetching stops)."""
        if self._cache is not None and token is not None:
            self._cache.end_plan(token)

    def download_report(self) -> list[dict[str, Optional[int]]]:
        """Downloads per loader pass, oldest first (:meth:`ShardCache.report`); empty when not streamed."""
        return self._cache.report() if self._cache is not None else []
