"""This process's limits on open files and on memory mappings, and how many shards a dataset may keep open
under them: the accounting that npy shard maps (storage/shards.py) and LMDB environments
(formats/lmdb_store.py) share, since both hold one descriptor and one mapping per open shard."""
from __future__ import annotations

import logging
import os
import threading
import weakref
from pathlib import Path
from typing import Optional, Protocol

log = logging.getLogger(__name__)

# NOTE [open files]: each memory map keeps a descriptor open (CPython's mmap duplicates the file's; an LMDB
# environment holds its file open and mapped), so an ImageNet-sized dataset (1,252 shards at the default
# shard size) passes the common soft limit of 1,024.
# 1. Before opening more shards than fit, the soft RLIMIT_NOFILE is raised towards the hard limit, said once
#    in the log (loader workers, forked or spawned, inherit the raised limit).
# 2. Where the hard limit is too low, a dataset opens its shards as batches read them and keeps at most half
#    the descriptors left open (npy: `ShardMaps`; LMDB: a bounded `LmdbReader`), least recently used let go
#    first; a shard a batch is still reading is never let go (LMDB: rule 6 keeps such shards within bound).
# 3. FD_HEADROOM descriptors stay free for everything else: sockets, pipes, worker queues, lock files.
# 4. Each open shard is also one of the process's memory mappings, which Linux caps at vm.max_map_count
#    (65,530 by default; a system setting: a process cannot raise it for itself): a token split of FineWeb's
#    size (15 T tokens, ~230,000 shards of 64 Mi) passes it. Beyond what fits, with MAP_HEADROOM left for the
#    allocator, libraries and CUDA, the dataset opens shards as batches read (rule 2), at most half the
#    mappings left.
# 5. The bounds of several datasets in one process add up: a new one is sized by what the live ones may still
#    open (`register_bounded`): a bounded dataset up to its bound, an LMDB reader that opens its stores as
#    read every store it has not opened yet.
# 6. A bounded LMDB reader's read blocks share its bound: a block takes room for the stores it reads beside
#    what the blocks in flight hold (`Holds.room`); one over more stores than there is room for reads copies,
#    that many stores at a time (at least one), each group's transactions ended before the next (a batch over
#    1,300 stores under a hard limit of 1,024 failed with "Too many open files" before 2026-11-27).
FD_HEADROOM = 256
MAP_HEADROOM = 8192


class Bounded(Protocol):
    """A dataset that opens its shards as it reads them: ``promised()`` more may still be opened."""

    def promised(self) -> int: ...


def _promised() -> int:
    return sum(max(0, b.promised()) for b in list(_BOUNDED))


class _Descriptors:
    """This process's count of live shard maps and the soft limit last seen."""

    def __init__(self) -> None:
        self.lock = threading.RLock()  # (re-entrant: the collector may run a map's finalizer while it is held)
        self.live = 0
        self.soft = limits()[0]
        self.said = False

    def unmapped(self) -> None:
        with self.lock:
            self.live -= 1


def limits() -> tuple[int, int]:
    """The soft and hard limits on open files (a large number for unlimited or a system without them)."""
    try:
        import resource
    except ImportError:  # (not a POSIX system: no limit to manage)
        return 1 << 30, 1 << 30
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    top = 1 << 30
    return (top if soft == resource.RLIM_INFINITY else soft), (top if hard == resource.RLIM_INFINITY else hard)


def open_descriptors() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return FDS.live + 64  # (no /proc: an estimate)


FDS = _Descriptors()


_MAX_MAP_COUNT = "/proc/sys/vm/max_map_count"


def max_map_count() -> Optional[int]:
    try:
        return int(Path(_MAX_MAP_COUNT).read_text())
    except (OSError, ValueError):  # (no /proc: no such limit to respect)
        return None


def maps_left() -> int:
    """Memory mappings this process may still make: vm.max_map_count less those it holds (NOTE [open files] 4);
    a large number where /proc does not say."""
    limit = max_map_count()
    try:
        with open("/proc/self/maps", "rb") as f:
            held = sum(1 for _ in f)
    except OSError:
        return 1 << 30
    return 1 << 30 if limit is None else limit - held


def room_for_maps(count: int) -> bool:
    """Whether ``count`` more open shards fit under this process's limits on open files and on memory
    mappings, raising its soft limit on open files towards the hard one when they do not (NOTE [open files]);
    False when even the hard limit is too low, or the mappings would pass vm.max_map_count."""
    fits = room_for_descriptors(count)  # (first: a bounded dataset is sized by the raised limit)
    return fits and count + MAP_HEADROOM + _promised() <= maps_left()


def room_for_descriptors(count: int) -> bool:
    """Whether ``count`` more open shards fit under the limit on open files, its soft limit raised towards the
    hard one first when they do not."""
    with FDS.lock:
        soft, hard = limits()
        need = open_descriptors() + count + FD_HEADROOM + _promised()
        if need > soft and hard > soft:
            import resource

            new = min(hard, max(need, 2 * soft))
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            except (ValueError, OSError):  # (above the kernel's nr_open, say): keep the limit there is
                new = soft
            if new > soft and not FDS.said:
                log.warning("raised this process's limit on open files (RLIMIT_NOFILE) from %d to %d: each "
                            "open shard holds one open file (%d more to open)", soft, new, count)
                FDS.said = True
            soft = new
        FDS.soft = soft
        return need <= soft


_BOUNDED: "weakref.WeakSet[Bounded]" = weakref.WeakSet()  # the live bounded datasets: what they may still open


def bounded_maps() -> tuple[int, str]:
    """How many shards a new bounded dataset keeps open: half the descriptors and mappings left once the live
    ones' unused room is set aside (their bounds are promises), at least 16; and the limit that binds."""
    promised = _promised()
    fds = limits()[0] - open_descriptors() - FD_HEADROOM - promised
    maps = maps_left() - MAP_HEADROOM - promised
    why = "memory mappings (raise vm.max_map_count)" if maps < fds else \
        "open files (raise the hard limit, `ulimit -Hn`)"
    return max(16, min(fds, maps) // 2), why


def register_bounded(dataset: Bounded, shards: Optional[int] = None, where: object = None, why: str = "",
                     bound: Optional[int] = None) -> None:
    """Count what ``dataset`` may still open among the live ones (rule 5) and, given its ``shards``, say that it
    keeps at most ``bound`` open (once: a loader worker that unpickles it only counts it)."""
    _BOUNDED.add(dataset)
    if shards is not None:
        log.warning("%d shards in %s are more than this process's %s allows to keep open: at most %d are",
                    shards, where, why, bound)
