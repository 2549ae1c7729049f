"""The bytes of one array stored as ``.npy`` shards, opened in a storage mode: the one place that reads
shard files into memory maps, one contiguous RAM copy, the node's ``/dev/shm`` copy or GPU memory.

FastDataset (image shards) and TokenDataset (token streams) both open their data here, so every mode
checks files the same way (sizes on every open, sha256 when asked or when the bytes are read anyway;
see NOTE [file check] in fastdata/formats/manifest.py) and hands back the same `OpenedShards`.
"""
from __future__ import annotations

import errno
import logging
import os
import threading
import warnings
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, Union

import numpy as np
import torch

from .._io import new_hash, safe_join
from ..errors import ConfigError, FormatError, OutputError
from ..formats.base import npy_header
from ..formats.manifest import damaged_error, file_problem, require_intact
from . import shm

STORAGE = ("mmap", "ram", "shm", "cuda")
Indices = Union[Sequence[int], np.ndarray, torch.Tensor, slice]
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardSet:
    """One array of rows of ``row_shape`` / ``dtype`` split over ``.npy`` files: ``files`` lists
    ``(manifest path, rows)`` in order. ``key`` names the array among several in one dataset (shm)."""

    root: Path
    manifest: dict[str, Any]
    files: list[tuple[str, int]]
    row_shape: tuple[int, ...]
    dtype: np.dtype
    key: str = ""

    @property
    def rows(self) -> int:
        return sum(n for _, n in self.files)

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
    check_sizes(shards.root, shards.manifest, [rel for rel, _ in shards.files])
    shape = (shards.rows, *shards.row_shape)
    if storage == "mmap" and verify:  # (shm: the copy is hashed while it is made, a found one before use)
        verify_hashes(shards.root, shards.manifest, [rel for rel, _ in shards.files])
    if storage == "mmap":
        if not room_for_maps(len(shards.files)):
            return OpenedShards(maps=ShardMaps(shards, *_bounded_maps()))
        return OpenedShards(maps=[map_npy(shards.root, rel, (n, *shards.row_shape), shards.dtype)
                                  for rel, n in shards.files])
    if storage == "shm":
        header = npy_header(shape, shards.dtype)
        path = shm.ensure_copy(shards.root, shards.manifest, shards.bodies(), header, shm_dir, key=shards.key,
                               verify=verify)
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
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
    if _FDS.live + _FD_HEADROOM >= _FDS.soft:  # cheap test first: most processes never get near the limit
        _room_for_descriptors(1)
    try:
        arr = np.load(safe_join(root, rel), mmap_mode="r", allow_pickle=False)
    except OSError as exc:
        if exc.errno == errno.ENOMEM:
            raise OutputError(f"cannot map {root / rel}: this process holds as many memory mappings as "
                              f"vm.max_map_count allows ({_max_map_count()}): raise it (`sysctl -w "
                              "vm.max_map_count=...`) or close other datasets") from exc
        if exc.errno != errno.EMFILE:
            raise
        soft, hard = _limits()
        raise OutputError(f"cannot map {root / rel}: this process has {soft} open files, its limit (hard limit "
                          f"{hard}): raise it (`ulimit -n`) or close other datasets") from exc
    if arr.shape != shape or arr.dtype != dtype:
        raise FormatError(f"{root / rel} holds {arr.shape} {arr.dtype}, the manifest says {shape} {dtype}: "
                          "the dataset is damaged; re-run `fastdata preprocess`")
    with _FDS.lock:
        _FDS.live += 1
    weakref.finalize(arr, _FDS.unmapped)
    return arr


# NOTE [open files]: each memory map keeps a descriptor open (CPython's mmap duplicates the file's), so an
# ImageNet-sized dataset (1,252 shards at the default shard size) passes the common soft limit of 1,024.
# 1. Before mapping more shards than fit, the soft RLIMIT_NOFILE is raised towards the hard limit, said once
#    in the log (loader workers, forked or spawned, inherit the raised limit).
# 2. Where the hard limit is too low, an mmap dataset maps its shards as batches read them and keeps at most
#    half the descriptors left open (`ShardMaps`, least recently used unmapped first).
# 3. _FD_HEADROOM descriptors stay free for everything else: sockets, pipes, worker queues, lock files.
# 4. Each map is also one of the process's memory mappings, which Linux caps at vm.max_map_count (65,530 by
#    default; a system setting: a process cannot raise it for itself): a token split of FineWeb's size
#    (15 T tokens, ~230,000 shards of 64 Mi) passes it. Beyond what fits, with _MAP_HEADROOM left for the
#    allocator, libraries and CUDA, the dataset maps as batches read (rule 2), at most half the mappings left.
_FD_HEADROOM = 256
_MAP_HEADROOM = 8192


class _Descriptors:
    """This process's count of live shard maps and the soft limit last seen."""

    def __init__(self) -> None:
        self.lock = threading.RLock()  # (re-entrant: the collector may run a map's finalizer while it is held)
        self.live = 0
        self.soft = _limits()[0]
        self.said = False

    def unmapped(self) -> None:
        with self.lock:
            self.live -= 1


def _limits() -> tuple[int, int]:
    try:
        import resource
    except ImportError:  # (not a POSIX system: no limit to manage)
        return 1 << 30, 1 << 30
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    top = 1 << 30
    return (top if soft == resource.RLIM_INFINITY else soft), (top if hard == resource.RLIM_INFINITY else hard)


def _open_descriptors() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return _FDS.live + 64  # (no /proc: an estimate)


_FDS = _Descriptors()


_MAX_MAP_COUNT = "/proc/sys/vm/max_map_count"


def _max_map_count() -> Optional[int]:
    try:
        return int(Path(_MAX_MAP_COUNT).read_text())
    except (OSError, ValueError):  # (no /proc: no such limit to respect)
        return None


def _maps_left() -> int:
    """Memory mappings this process may still make: vm.max_map_count less those it holds (NOTE [open files] 4);
    a large number where /proc does not say."""
    limit = _max_map_count()
    try:
        with open("/proc/self/maps", "rb") as f:
            held = sum(1 for _ in f)
    except OSError:
        return 1 << 30
    return 1 << 30 if limit is None else limit - held


def room_for_maps(count: int) -> bool:
    """Whether ``count`` more shard maps fit under this process's limits on open files and on memory mappings,
    raising its soft limit on open files towards the hard one when they do not (NOTE [open files]); False
    when even the hard limit is too low, or the mappings would pass vm.max_map_count."""
    fits = _room_for_descriptors(count)  # (first: a bounded dataset is sized by the raised limit)
    return fits and count + _MAP_HEADROOM <= _maps_left()


def _room_for_descriptors(count: int) -> bool:
    """Whether ``count`` more maps fit under the limit on open files, its soft limit raised towards the hard
    one first when they do not."""
    with _FDS.lock:
        soft, hard = _limits()
        need = _open_descriptors() + count + _FD_HEADROOM
        if need > soft and hard > soft:
            import resource

            new = min(hard, max(need, 2 * soft))
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            except (ValueError, OSError):  # (above the kernel's nr_open, say): keep the limit there is
                new = soft
            if new > soft and not _FDS.said:
                log.warning("raised this process's limit on open files (RLIMIT_NOFILE) from %d to %d: each "
                            "memory-mapped shard holds one open file (%d more to map)", soft, new, count)
                _FDS.said = True
            soft = new
        _FDS.soft = soft
        return need <= soft


_BOUNDED: "weakref.WeakSet[ShardMaps]" = weakref.WeakSet()  # the live bounded datasets: what they may still map


def _bounded_maps() -> tuple[int, str]:
    """How many shard maps a new `ShardMaps` keeps open: half the descriptors and mappings left once the live
    ones' unused room is set aside (their bounds are promises), at least 16; and the limit that binds."""
    promised = sum(max(0, m.bound - len(m._open)) for m in list(_BOUNDED))
    fds = _limits()[0] - _open_descriptors() - _FD_HEADROOM - promised
    maps = _maps_left() - _MAP_HEADROOM - promised
    why = "memory mappings (raise vm.max_map_count)" if maps < fds else \
        "open files (raise the hard limit, `ulimit -Hn`)"
    return max(16, min(fds, maps) // 2), why


class ShardMaps(Sequence[np.ndarray]):
    """``shards``' memory maps, each made when first read and at most ``bound`` kept open (least recently used
    let go first; a batch still reading one keeps it alive): an mmap dataset with more shards than the limit
    on open files allows (NOTE [open files])."""

    def __init__(self, shards: ShardSet, bound: int, why: str = "open files") -> None:
        self.shards, self.bound = shards, bound
        self._open: OrderedDict[int, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()
        _BOUNDED.add(self)
        log.warning("%d shards in %s are more than this process's %s allows to keep mapped: at most %d are",
                    len(shards.files), shards.root, why, bound)

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


def check_sizes(root: Path, manifest: dict[str, Any], paths: Optional[Sequence[str]] = None) -> None:
    """Refuse missing or truncated files (sizes only: cheap enough for every open)."""
    wanted = None if paths is None else set(paths)  # a set: 20,000 shards must not cost 20,000^2 comparisons
    for f in manifest["files"]:
        if wanted is None or f["path"] in wanted:
            require_intact(root, f, hashed=False)


def verify_hashes(root: Path, manifest: dict[str, Any], paths: Sequence[str]) -> None:
    """Re-hash ``paths`` against the manifest; the first mismatch raises ChecksumError."""
    entries = {f["path"]: f for f in manifest["files"]}
    for rel in paths:
        require_intact(root, entries[rel])


def load_bodies(root: Path, manifest: dict[str, Any], bodies: list[tuple[str, int]], shape: tuple[int, ...],
                dtype: np.dtype, verify: bool, storage: str) -> np.ndarray:
    """One contiguous array from ``.npy`` shards given as ``(file, header length)``, in one read per file,
    hashing each file as it is read when ``verify``."""
    need = int(np.prod(shape)) * dtype.itemsize
    avail = _available_memory()
    if avail is not None and need > avail:
        warnings.warn(f"storage='{storage}' loads {need / 2**30:.1f} GiB but only {avail / 2**30:.1f} GiB "
                      "of memory is available: expect swapping or an OOM kill; storage='mmap' or 'shm' "
                      "avoid a private copy", ResourceWarning, stacklevel=4)
    flat = np.empty(shape, dtype)
    view, pos = memoryview(flat.reshape(-1).view(np.uint8)), 0
    entries = {f["path"]: f for f in manifest["files"]}
    for rel, skip in bodies:
        with open(safe_join(root, rel), "rb") as f:
            head = f.read(skip)
            n = os.fstat(f.fileno()).st_size - skip
            got = f.readinto(view[pos:pos + n])
            digest = None
            if verify:
                h = new_hash()
                h.update(head)
                h.update(view[pos:pos + got])
                digest = h.hexdigest()
            problem = file_problem(entries[rel], len(head) + got, digest)
            if problem is not None:
                raise damaged_error(root / rel, entries[rel], problem, len(head) + got)
            pos += n
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
