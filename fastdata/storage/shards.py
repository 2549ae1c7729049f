"""The bytes of one array stored as ``.npy`` shards, opened in a storage mode: the one place that reads
shard files into memory maps, one contiguous RAM copy, the node's ``/dev/shm`` copy or GPU memory.

FastDataset (image shards) and TokenDataset (token streams) both open their data here, so every mode
checks files the same way (sizes on every open, sha256 when asked or when the bytes are read anyway;
see NOTE [file check] in fastdata/formats/integrity.py) and hands back the same `OpenedShards`.
"""
from __future__ import annotations

import errno
import io
import logging
import mmap
import os
import threading
import warnings
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Collection, Iterator, Optional, Sequence, Union

import numpy as np
import torch

from .. import _limits
from .._io import HASH_WORKERS, contained_sizes, contained_stat, map_threads, new_hash, plain_relative, safe_join
from ..errors import ConfigError, FormatError, OutputError
from ..formats.base import body_offsets, npy_header
from ..formats.integrity import damaged_error, file_error, file_problem, require_intact
from ..formats.rows import column, int_column, rows_by, unzipped
from . import shm
from .cache_folders import cache_advice

STORAGE = ("mmap", "ram", "shm", "cuda")
Indices = Union[Sequence[int], np.ndarray, torch.Tensor, slice]
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardSet:
    """One array of rows of ``row_shape`` / ``dtype`` split over ``.npy`` files: ``files`` lists
    ``(manifest path, rows)`` in order. ``key`` names the array among several in one dataset (shm)."""

    root: Path
    manifest: dict[str, Any]
    files: Sequence[tuple[str, int]]  # (a view of the manifest's shards: NOTE [compact manifest])
    row_shape: tuple[int, ...]
    dtype: np.dtype
    key: str = ""

    @property
    def rows(self) -> int:
        return sum(unzipped(self.files)[1])

    def names(self) -> list[str]:
        """The shards' manifest paths, in order."""
        return unzipped(self.files)[0]

    def bodies(self) -> list[tuple[str, int]]:
        """``(file, header length)`` of every shard: where its raw rows start."""
        return [(rel, len(npy_header((n, *self.row_shape), self.dtype))) for rel, n in self.files]


@dataclass
class OpenedShards:
    """What `open_shards` gives: per-shard memory maps (``mmap``), or one contiguous host array
    (``ram``, ``shm``), or one device tensor (``cuda``)."""

    maps: Sequence[np.ndarray] = field(default_factory=list)  # a list, or ShardMaps when too many to keep open
    flat: Optional[np.ndarray] = None
    device: Optional[torch.Tensor] = None


def open_shards(shards: ShardSet, storage: str, *, verify: bool, device: Union[str, torch.device] = "cpu",
                shm_dir: Optional[Union[str, Path]] = None) -> OpenedShards:
    """Open ``shards`` as ``storage`` (see `STORAGE`); ``verify`` hashes every shard against the manifest
    (while reading it for ``ram``/``cuda``: one pass). Sizes are always checked first."""
    if storage not in STORAGE:
        raise ConfigError(f"storage must be one of {STORAGE}, got storage={storage!r}")
    check_sizes(shards.root, shards.manifest, shards.names())
    shape = (shards.rows, *shards.row_shape)
    if storage == "mmap" and verify:  # (shm: the copy is hashed while it is made, a found one before use)
        verify_hashes(shards.root, shards.manifest, shards.names())
    if storage == "mmap":
        if not _limits.room_for_maps(len(shards.files)):
            return OpenedShards(maps=ShardMaps(shards, *_limits.bounded_maps()))
        return OpenedShards(maps=[map_npy(shards.root, rel, (n, *shards.row_shape), shards.dtype)
                                  for rel, n in shards.files])
    if storage == "shm":
        bodies = shards.bodies()
        rows_fill(shards.root, rows_by(shards.manifest["files"], (rel for rel, _ in bodies)), bodies, shape,
                  shards.dtype)  # (the copy's header says `shape`)
        header = npy_header(shape, shards.dtype)
        path = shm.ensure_copy(shards.root, shards.manifest, bodies, header, shm_dir, key=shards.key,
                               verify=verify)
        arr = load_npy(path, "r")
        if arr.shape != shape or arr.dtype != shards.dtype:
            raise FormatError(f"{path} holds {arr.shape} {arr.dtype}, expected {shape} {shards.dtype}: remove it with "
                              "`fastdata shm remove` and retry")
        return OpenedShards(flat=arr)
    flat = load_bodies(shards.root, shards.manifest, shards.bodies(), shape, shards.dtype, verify, storage)
    if storage == "cuda":
        return OpenedShards(device=torch.from_numpy(flat).to(device))  # the host copy is freed on return
    return OpenedShards(flat=flat)


def map_npy(root: Path, rel: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Memory-map one ``.npy`` shard, refusing one whose shape or dtype is not the manifest's (NOTE [open
    files]: the map holds a descriptor while it lives).

    Raises:
        FormatError: the file's shape or dtype is not the manifest's. OutputError: no descriptor is left.
    """
    fds = _limits.FDS
    if fds.live + _limits.FD_HEADROOM >= fds.soft:  # cheap test first: most processes never get near the limit
        _limits.room_for_descriptors(1)
    try:
        arr = _npy_map(safe_join(root, rel))
    except ValueError as exc:  # (a header numpy cannot parse, or fewer bytes than it says)
        raise FormatError(f"{root / rel} is not a whole .npy file ({exc}): the dataset is damaged; re-run "
                          "`fastdata preprocess`") from exc
    except OSError as exc:
        if exc.errno == errno.ENOMEM:
            raise OutputError(f"cannot map {root / rel}: this process holds as many memory mappings as "
                              f"vm.max_map_count allows ({_limits.max_map_count()}): raise it (`sysctl -w "
                              "vm.max_map_count=...`) or close other datasets") from exc
        if exc.errno != errno.EMFILE:
            raise
        soft, hard = _limits.limits()
        raise OutputError(f"cannot map {root / rel}: this process has {soft} open files, its limit (hard limit "
                          f"{hard}): raise it (`ulimit -n`) or close other datasets") from exc
    if arr.shape != shape or arr.dtype != dtype:
        raise FormatError(f"{root / rel} holds {arr.shape} {arr.dtype}, the manifest says {shape} {dtype}: "
                          "the dataset is damaged; re-run `fastdata preprocess`")
    with fds.lock:
        fds.live += 1
    weakref.finalize(arr, fds.unmapped)
    return arr


# numpy parses an .npy header with ast.literal_eval, and CPython 3.11's compiler is not safe to enter from two
# threads at once ("SystemError: AST constructor recursion depth mismatch": two loader threads mapping one
# labels file together, in CI): the .npy files read from loader and cache threads are parsed under one lock.
_PARSE = threading.Lock()


def load_npy(path: Path, mmap_mode: Optional[str] = None) -> np.ndarray:
    """``np.load(path, mmap_mode)`` (never unpickling), safe to call from several threads at once."""
    with _PARSE:
        return np.load(path, mmap_mode=mmap_mode, allow_pickle=False)


_HEADERS: dict[bytes, tuple[tuple[int, ...], bool, np.dtype]] = {}  # an npy header's bytes -> (shape, fortran, dtype)


def _npy_map(path: Path) -> np.ndarray:
    """The ``.npy`` file at ``path`` memory-mapped read-only, as np.load(mmap_mode="r") gives it, with each
    distinct header parsed once (a dataset's shards share a few: np.load parses every file's, 3x the cost of
    the map itself, seconds at 10^5 shards)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        head = os.pread(fd, 12, 0)
        if len(head) < 12 or head[:6] != b"\x93NUMPY" or head[6] not in (1, 2):
            return load_npy(path, "r")  # (numpy's own reader says what is wrong)
        end = (10 + int.from_bytes(head[8:10], "little") if head[6] == 1 else
               12 + int.from_bytes(head[8:12], "little"))
        header = os.pread(fd, end, 0)
        parsed = _HEADERS.get(header)
        if parsed is None:
            f = io.BytesIO(header)
            major, _ = np.lib.format.read_magic(f)
            read = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
            with _PARSE:
                parsed = read(f)
            if len(_HEADERS) > 4096:  # (uneven shards differ in their row counts: a few hundred headers)
                _HEADERS.clear()
            _HEADERS[header] = parsed
        shape, fortran, dtype = parsed
        if fortran or dtype.hasobject or not np.prod(shape):
            return load_npy(path, "r")  # (never written by fastdata)
        mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)  # (holds a duplicate of the descriptor)
    finally:
        os.close(fd)
    return np.frombuffer(mm, dtype, int(np.prod(shape)), end).reshape(shape)


class ShardMaps(Sequence[np.ndarray]):
    """``shards``' memory maps, each made when first read and at most ``bound`` kept open (least recently used
    let go first; a batch still reading one keeps it alive): an mmap dataset with more shards than the limit
    on open files allows (NOTE [open files] in fastdata/_limits.py)."""

    def __init__(self, shards: ShardSet, bound: int, why: str = "open files") -> None:
        self.shards, self.bound = shards, bound
        self._open: OrderedDict[int, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()
        _limits.register_bounded(self, len(shards.files), shards.root, why, bound)

    def promised(self) -> int:
        return self.bound - len(self._open)

    def drop(self, s: int) -> None:
        """Let go of shard ``s``'s map (streamed: before the node cache may evict its file, whose disk space a
        map would keep); a batch still reading it keeps its own reference, and a later read maps it again."""
        with self._lock:
            self._open.pop(s, None)

    def __len__(self) -> int:
        return len(self.shards.files)

    def __iter__(self) -> Iterator[np.ndarray]:
        return (self[s] for s in range(len(self)))

    def __getitem__(self, s: Any) -> Any:
        if not isinstance(s, (int, np.integer)):
            raise TypeError(f"ShardMaps takes one shard index, got {s!r}")
        s = int(s)
        with self._lock:
            arr = self._open.get(s)
            if arr is not None:
                self._open.move_to_end(s)
                return arr
        rel, n = self.shards.files[s]
        arr = map_npy(self.shards.root, rel, (n, *self.shards.row_shape), self.shards.dtype)
        with self._lock:
            arr = self._open.setdefault(s, arr)  # (another thread may have mapped it meanwhile)
            self._open.move_to_end(s)
            while len(self._open) > self.bound:
                self._open.popitem(last=False)
        return arr


def check_sizes(root: Path, manifest: dict[str, Any], paths: Optional[Collection[str]] = None, *,
                present_only: bool = False, skip: Collection[str] = ()) -> list[str]:
    """Refuse missing (unless ``present_only``) or truncated files among ``paths`` (default: every file but
    those in ``skip``): one stat each, cheap enough for every open of a million shards (`contained_sizes`;
    sizes compared as arrays). Returns the paths checked (those present, with ``present_only``), in the
    manifest's order."""
    files = manifest["files"]
    names = column(files, "path")  # (whole columns, no row built: NOTE [compact manifest])
    expected = int_column(files, "bytes")
    if paths is not None or skip:  # (sets: 20,000 shards must not cost 20,000^2 comparisons)
        listed = paths if paths is not None else skip
        listed = listed if isinstance(listed, (set, frozenset)) else set(listed)
        keep = np.fromiter(map(listed.__contains__, names), bool, len(names))
        keep = np.flatnonzero(keep if paths is not None else ~keep)
        names, expected = [names[i] for i in keep.tolist()], expected[keep]
        if paths is not None and len(names) < len(listed):  # (a shard the files do not list: nothing to check by)
            unlisted = sorted(listed - set(names))[0]
            plain_relative(root, unlisted)  # (a path that escapes, or holds a NUL: said as such first)
            raise FormatError(f"{root}: its manifest names {unlisted!r} as a shard, but its "
                              "files do not list it: the manifest is damaged; re-run `fastdata preprocess` (or "
                              "restore the dataset's own manifest.json)")
    # most may be absent (a streamed dataset's cache folder): a listing first, a stat for what it holds
    here = _listed(root) if present_only and len(names) > 1000 else None
    if here is not None:
        found = np.full(len(names), -1, dtype=np.int64)
        maybe = np.flatnonzero(np.fromiter(("/" in n or n in here for n in names), bool, len(names)))
        found[maybe] = contained_sizes(root, [names[i] for i in maybe.tolist()])
    else:
        found = contained_sizes(root, names)
    bad = found != expected
    if present_only:
        bad &= found != -1  # (absent; a folder where the file should be is still refused)
    for i in np.flatnonzero(bad)[:1].tolist():  # (the first problem in the manifest's order)
        if found[i] == -3:
            contained_stat(root, names[i])  # (raises: the path leaves the folder)
        raise file_error(root, {"path": names[i], "bytes": int(expected[i])}, "size" if found[i] >= 0 else "missing",
                         cache_advice(root))  # (a node cache's copy: not mended by a new preprocess)
    return [n for n, size in zip(names, found.tolist()) if size != -1] if present_only else names


def _listed(root: Path) -> Optional[set[str]]:
    """The names in folder ``root`` (none: it is missing), or None where it may be entered but not listed
    (``contained_sizes`` serves that one)."""
    try:
        return set(os.listdir(root))
    except (FileNotFoundError, NotADirectoryError):
        return set()
    except PermissionError:
        return None


def verify_hashes(root: Path, manifest: dict[str, Any], paths: Sequence[str]) -> None:
    """Re-hash ``paths`` against the manifest; the first mismatch raises ChecksumError."""
    entries = rows_by(manifest["files"], paths)
    for rel in paths:
        require_intact(root, entries[rel], advice=cache_advice(root))


def rows_fill(root: Path, entries: dict[str, dict[str, Any]], bodies: list[tuple[str, int]],
              shape: tuple[int, ...], dtype: np.dtype) -> list[int]:
    """Where each shard's rows begin in one array of ``shape`` (bytes), then its end: the shards' row bytes
    (their sizes, from their manifest ``entries``, less their headers) must be the bytes the manifest's row
    counts make.

    Raises:
        FormatError: They differ (a manifest whose counts are not its files').
    """
    need = int(np.prod(shape)) * dtype.itemsize
    offsets = body_offsets(entries, bodies)
    if offsets[-1] != need:
        raise FormatError(f"the shards of {root} hold {offsets[-1]} bytes of rows, the manifest's counts {need}: "
                          "the manifest is damaged; re-run `fastdata preprocess`")
    return offsets


def load_bodies(root: Path, manifest: dict[str, Any], bodies: list[tuple[str, int]], shape: tuple[int, ...],
                dtype: np.dtype, verify: bool, storage: str, workers: Optional[int] = None) -> np.ndarray:
    """One contiguous array from ``.npy`` shards given as ``(file, header length)``, in one read per file,
    hashing each file as it is read when ``verify``; ``workers`` files at once (default: the cores, at most 8:
    sha256 takes a core per file, and NVMe drives read faster with several reads in flight)."""
    entries = rows_by(manifest["files"], (rel for rel, _ in bodies))
    offsets = rows_fill(root, entries, bodies, shape, dtype)  # (before memory for a shape no file holds)
    need = int(offsets[-1])
    avail = _available_memory()
    if avail is not None and need > avail:
        warnings.warn(f"storage='{storage}' loads {need / 2**30:.1f} GiB but only {avail / 2**30:.1f} GiB "
                      "of memory is available: expect swapping or an OOM kill; storage='mmap' or 'shm' "
                      "avoid a private copy", ResourceWarning, stacklevel=4)
    flat = np.empty(shape, dtype)
    view = memoryview(flat.reshape(-1).view(np.uint8))

    def load(k: int) -> None:  # (sizes were checked: each file fills its own slice, in any order)
        rel, skip = bodies[k]
        start = offsets[k]
        with open(safe_join(root, rel), "rb") as f:
            head = f.read(skip)
            got = f.readinto(view[start:offsets[k + 1]])
        digest = None
        if verify:
            h = new_hash()
            h.update(head)
            h.update(view[start:start + got])
            digest = h.hexdigest()
        problem = file_problem(entries[rel], len(head) + got, digest)
        if problem is not None:  # (in a node cache, its copy: said so)
            raise damaged_error(root / rel, entries[rel], problem, len(head) + got, cache_advice(root))
    map_threads(load, range(len(bodies)), workers or HASH_WORKERS, "fastdata-load")
    return flat


def take_rows(maps: Sequence[np.ndarray], shard: np.ndarray, rows: np.ndarray, dst: np.ndarray) -> None:
    """``dst[j] = maps[shard[j]][rows[j]]``, one ``np.take`` per shard touched (NOTE [gather] in fastdata/datasets/images.py):
    straight into ``dst``'s slices when each shard's rows are one contiguous run (sorted batches), else a
    take per shard and one scatter. Rows must be in range (``mode="clip"`` skips numpy's temporary)."""
    if len(shard) == 0:
        return
    starts = np.flatnonzero(np.r_[True, shard[1:] != shard[:-1]])
    used = np.unique(shard)
    if len(starts) == len(used):
        for a, b in zip(starts, np.r_[starts[1:], len(shard)]):
            np.take(maps[shard[a]], rows[a:b], axis=0, out=dst[a:b], mode="clip")
        return
    for s in used:
        mask = shard == s
        dst[mask] = np.take(maps[s], rows[mask], axis=0, mode="clip")


def batch_rows(out: torch.Tensor, b: int, dtype: torch.dtype, sample_shape: Sequence[int]) -> torch.Tensor:
    """``out[:b]``, once ``out`` is checked to hold ``b`` samples: the caller's buffer for ``get_batch``
    (FastLoader passes its ring buffers for every batch, so only cheap attribute checks)."""
    if out.dtype != dtype or out.shape[1:] != tuple(sample_shape) or out.shape[0] < b or not out.is_contiguous() \
            or out.device.type != "cpu":
        raise ConfigError(f"out must be a contiguous CPU {dtype} tensor of shape (>={b}, "
                          f"{', '.join(map(str, sample_shape))}), got {tuple(out.shape)} {out.dtype} on {out.device}")
    return out if out.shape[0] == b else out[:b]


def _available_memory() -> Optional[int]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
