"""The shards of a remote dataset fetched into the node cache as the loader will need them, within a size bound.

NOTE [shard cache]: the rules of fetching and evicting a remote dataset's shards on a node.

1. A reader names the shards each of its coming batches reads (`ShardCache.plan`): an iterator over the
   epoch order FastLoader knows in advance, running on into the next epoch.
2. A scheduler thread downloads them in order of first need, with at most ``in_flight`` bytes and ``requests``
   objects under way, so downloads overlap training and the first batch waits only for its own shards.
3. Between downloads it learns more of the plan, a chunk of batches at a time, as runs of batches per shard (a
   windowed order over 10^9 samples is a few runs per shard, not a read per sample), while fewer than a
   horizon of runs (four cache capacities, at most 2^20) lie ahead of the reader; runs it is past are dropped,
   so the plan's memory does not grow with the epoch (storage/plan.py).
4. ``acquire`` (every ``get_batch``) pins the shards of one batch, makes room for those neither cached nor
   arriving and fetches them at once, and waits for those arriving (a prefetch of the same shard is waited
   for, never fetched twice); ``release`` unpins them.
5. With ``limit`` (bytes of this dataset's files in the cache), room is made by evicting the cached shard whose
   next use is farthest away: Belady's rule over the known order.
6. A shard never used again goes first; the next epoch's reads count, so the shards it starts with stay.
7. A prefetch of shard ``s`` never evicts a shard read before ``s`` (do no harm).
8. Within a lookahead of a quarter of the limit (the bytes cached or arriving that are read before ``s``), a
   prefetch evicts the shard needed last from now, so the link stays busy.
9. Beyond that lookahead it evicts only what the reader would evict when ``s`` is due, so a small cache never
   trades downloads for lookahead; otherwise it waits.
10. A batch never goes past the limit for room that prefetches under way hold: it waits for them to land (each
    within its retry budget; no prefetch starts meanwhile) and evicts them. Only when the shards pinned by the
    batches being read fill the limit is a batch's own shard fetched anyway, and a warning says the limit is
    too small for the shards in use.
11. Shards in use are never evicted, across processes too: a cache holds a shard pinned while it has it open
    (`ShardPins`: a shared lock on the shard's byte of one file per dataset, so a batch over 10,000 shards
    needs no descriptor per shard), and an eviction needs that byte exclusively. A cache without a limit
    pins a shard only while it opens it (the look at its files, then their maps): a map keeps the bytes of
    a file evicted since, so it holds no pin per shard of the dataset; one whose shards are mapped as read
    (bounded maps) pins a batch's shards while the batch is read, finding one evicted since it was opened
    and fetching it again (pins held for every open shard cost a lock each: 10^5 of them, minutes). (Pins
    until 2026-11-27 were a file per shard: a job of an older fastdata sharing a cache folder does not see
    these.) A reader of every file (storage "ram", "shm", "cuda"; an LMDB of version 1) pins no shard: it
    holds the folder whole from before its downloads until it is closed (`RemoteDataset.hold_whole`:
    `ShardPins.hold_all`), and no process evicts any of its files meanwhile. Every `ShardPins` also holds
    the folder as read while it lives, so the opening of another version of the dataset never removes a
    folder in use (`cache_locks.remove_other_versions`).
12. The pin is not the download lock, so a reader holding pins never waits on a download that waits on it.
13. Every rank on a node shares the cache folder and downloads each shard once (the per-file locks of
    `RemoteDataset.fetch`).
14. The limit is kept up to the bytes other processes have in flight. Other processes fetch and evict too:
    while a plan is read, the scheduler thread looks at the disk again (`cached`: a listing of the folders,
    each listed file looked up in the manifest's columns: as long as what the cache holds, not the
    dataset) outside the lock, at most once a second and a twentieth of the time
    (batches read without a plan look themselves; a new limit looks at once); what this process learnt
    meanwhile stands.
15. Counted against the limit: shards on disk, arriving (each download owns its shard's room until it ends,
    whoever waits for it) and pinned. A download ends in one locked step that gives its room back and
    records whether the file is there (another process may have evicted it).
16. The scheduler's place in the plan never passes a shard that is arriving, so one that does not land (or
    goes before it is read) is fetched again ahead of its batch.
17. An error in the prefetch thread (a download's, or its own) is raised in the consumer at its next batch.
18. Forked children keep neither pins nor download locks (NOTE [locks across fork] in fastdata/_io.py).
19. A plain shuffle over more shards than the cache holds reads nearly every shard every few batches: a
    warning (once) says to use a ``shuffle_window``.
20. The cache makes no links, so it never follows one: a file is cached only when it is a regular file of
    its manifest's size reached through no link (a link, or a file of another size, is fetched again over
    it); looks at the disk and evictions walk folders with O_NOFOLLOW, so a link planted in the cache
    never leads them outside it (`cache_folders._folder_fd`).
21. A shard whose cached bytes fail their sha256 when opened (``verify``) is damaged on this node, not in the
    store (a download checks the bytes as they come): its files are removed and fetched anew, once per shard
    and cache; failing again, or read by another process meanwhile, it is an error that says to remove the
    dataset from the cache (`fastdata cache remove ID`), not to push or preprocess it again.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import threading
import time
import warnings
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, Union

import numpy as np

from .._io import scrub, user_stacklevel
from ..errors import ChecksumError, ConfigError, FastdataError, is_whole
from ..formats.integrity import check_file, damaged_error
from . import evict
from .plan import Plan, horizon
from .cache_folders import cached_size, on_disk, remove_cached_file
from .cache_locks import ShardPins
from .remote import RemoteDataset, download_bar
from .streamed import FileGroups

IN_FLIGHT = 512 << 20
REQUESTS = 8
# At exit Python joins the download threads (a pool's) before atexit hooks and finalizers run, so a close from
# there came after the downloads' retries ran out (2 minutes during an outage): they are stopped first.
_LIVE: "weakref.WeakSet[ShardCache]" = weakref.WeakSet()


def _stop_all() -> None:
    for cache in list(_LIVE):
        cache._stop.set()


getattr(threading, "_register_atexit", atexit.register)(_stop_all)  # (before threads are joined, as futures' own)


class ShardCache:
    """Shards ``names`` of ``remote`` in its cache folder, fetched ahead of a plan and evicted by next use
    (see NOTE [shard cache]); a shard may be several files read together (``("images-0.npy",
    "labels-0.npy")``), fetched and evicted as one and opened with the first one's path. ``opener(shard,
    path)`` makes what readers use (a memory map), kept while cached; ``closer(shard, path)`` lets go of it
    before the shard may be evicted (an LMDB environment). ``eager``: without a limit, a warm cache's shards
    are opened up front (else each when first read, its files checked then: an opener that maps nothing)."""

    def __init__(self, remote: RemoteDataset, names: Sequence[Union[str, Sequence[str]]],
                 opener: Callable[[int, Path], Any], *,
                 limit: Optional[int] = None, in_flight: int = IN_FLIGHT, requests: int = REQUESTS,
                 progress: bool = True, closer: Optional[Callable[[int, Path], None]] = None,
                 eager: bool = True) -> None:
        self.remote, self.opener, self.closer, self.eager = remote, opener, closer, eager
        self.groups = FileGroups.of(names)  # the files read together (columns: no tuple a shard is kept)
        files, starts = self.groups.flat()
        self._folders = sorted(set(map(os.path.dirname, files)))  # (relative: "" the top)
        sizes = remote.sizes(files)
        self.sizes = np.add.reduceat(sizes, starts) if len(sizes) > len(self.groups) else sizes
        self.limit, self.in_flight, self.requests = limit, in_flight, max(1, requests)
        self.horizon = horizon(limit, self.sizes)  # runs a plan learns ahead of the reader
        self._start()
        # a bar (rank 0) over the bytes not cached yet
        self.progress = download_bar(remote, int(self.sizes[~self._have].sum())) if progress else None

    def _start(self) -> None:
        self._pid = os.getpid()
        self._cond = threading.Condition()
        self._objs = np.full(len(self.groups), None, dtype=object)  # what opener made, per shard
        self._is_open = np.zeros(len(self.groups), dtype=bool)
        if getattr(self, "_pinned", None) is not None:  # a forked child: the parent's pins stay the parent's
            self._pinned.close()
        self._pinned = ShardPins(self.remote.dir / ".locks")  # shards in use or being opened (NOTE 11)
        self._held = np.zeros(len(self.groups), dtype=bool)  # which of them this cache holds pinned
        self._damaged: set[int] = set()  # shards whose cached bytes failed their sha256 once, fetched anew (21)
        self._pins = np.zeros(len(self.groups), dtype=np.int64)
        self._since: Optional[list[int]] = None  # shards this process learnt about while a scan of the disk ran
        began = time.monotonic()
        self._have = self.cached()  # which shards are local, as far as this process knows
        self._scanned, self._scan_cost, self._scanning = time.monotonic(), time.monotonic() - began, False
        if self.limit is None and self.eager:  # a warm cache opens as a local folder does: every shard mapped up front
            for s in np.flatnonzero(self._have).tolist():
                self._pinned.pin(self.groups.first(s))  # (no eviction between its listing and its map: NOTE 11)
                self._held[s] = True
                try:
                    try:
                        self._objs[s] = self.opener(s, self.remote.dir / self.groups.first(s))
                    finally:
                        self._unpin(s)  # (its map holds the bytes now)
                except ChecksumError as exc:
                    self._drop_damaged(s, exc)  # (fetched anew when read)
                    continue
                except (FastdataError, FileNotFoundError):
                    if self._present(s):
                        raise
                    self._have[s] = False  # evicted since the listing, or of another size: fetched again when read
                    continue
                self._is_open[s] = True
        # the one download under way per shard in this process, demand or prefetch: it owns the shard's room
        # in the limit until it ends (_download), whoever waits for it
        self._fetching: dict[int, Future] = {}
        self._waiting = 0  # batches waiting for room: no prefetch starts meanwhile
        self._failed: Optional[BaseException] = None  # a prefetch's error, raised at the consumer's next batch
        self._plans: list[tuple[object, Plan]] = []
        self._tallies: deque[dict[str, Any]] = deque(maxlen=16)  # the newest plans' tallies (report())
        self._pool = ThreadPoolExecutor(self.requests * 2, thread_name_prefix="fastdata-fetch")
        self._side = ThreadPoolExecutor(self.requests * 2, thread_name_prefix="fastdata-fetch-side")
        self._warned = self._warned_order = False
        self._stalled: Optional[int] = None  # plan position at which a prefetch found no room
        self._closed = False
        self._stop = threading.Event()  # set by close: downloads under way give up at their next try or piece
        _LIVE.add(self)
        self._thread: Optional[threading.Thread] = None

    def _check_pid(self) -> None:
        if os.getpid() != self._pid:  # a forked worker: threads and pins stayed with the parent
            self._start()

    # -- plans ------------------------------------------------------------------------------------------
    def plan(self, reads: Iterable[np.ndarray], now: Optional[int] = None) -> object:
        """Register the coming reads: the shards of each coming batch, in ``acquire`` order (an iterator,
        learnt as the scheduler goes, up to `horizon` runs ahead of the reader: it may run on into the
        next epoch, whose reads start after the first ``now`` batches); a token for `end_plan`. The
        newest plan drives prefetching. Warns once when the reads are scattered over more shards than the
        cache holds (a plain shuffle: use a ``shuffle_window``)."""
        self._check_pid()
        token, plan = object(), Plan(iter(reads), len(self.groups), now, self.horizon)
        plan.learn(self._cond)  # the first chunk now: evictions before the scheduler runs must see it
        self._warn_scattered(plan)
        with self._cond:
            self._plans.append((token, plan))
            self._tallies.append(plan.tally)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._schedule, name="fastdata-prefetch", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        return token

    def _warn_scattered(self, plan: Plan) -> None:
        holds = 0 if self.limit is None else int(self.limit // max(1, int(self.sizes.mean())))
        if self._warned_order or not plan.scattered(holds):
            return
        self._warned_order = True
        warnings.warn(f"cache_limit={self.limit} bytes holds about {holds} of the {len(self.groups)} shards of "
                      f"{scrub(self.remote.url)}, and the loader's order reads every shard again every few "
                      "batches (a plain shuffle): most batches will download shards again. Give the loader a "
                      "shuffle_window (FastLoader(..., shuffle_window=W), `--shuffle-window W`): it reads W "
                      "shards at a time, each once an epoch", UserWarning, stacklevel=user_stacklevel())

    @contextlib.contextmanager
    def reading(self, shards: np.ndarray) -> Iterator[np.ndarray]:
        """The opened shards indexed by shard, the distinct ``shards`` of one batch pinned while the block runs."""
        opened = self.acquire(shards)
        try:
            yield opened
        finally:
            self.release(shards)

    def end_plan(self, token: object) -> None:
        with self._cond:
            self._plans = [(t, p) for t, p in self._plans if t is not token]
            self._cond.notify_all()

    def _active(self) -> Optional[Plan]:
        return self._plans[-1][1] if self._plans else None

    def report(self) -> list[dict[str, Optional[int]]]:
        """Downloads per plan (one per loader pass), oldest first, the last 16: ``batches`` of the epoch
        planned, ``downloads`` made for them, ``repeats`` among those (a shard fetched again within the
        epoch: the cache was too small for the order), and ``ahead`` (fetched for the next epoch's first
        batches). A download under way counts from when it ends."""
        with self._cond:
            return [dict(t) for t in self._tallies]

    # -- reading ----------------------------------------------------------------------------------------
    def acquire(self, shards: np.ndarray) -> np.ndarray:
        """Pin the distinct ``shards`` of one batch, fetching and opening them first where needed; the
        opened shards indexed by shard (an object array: entries of pinned shards stay valid until
        `release`). The common case, all open, is a few array operations whatever the shard count.

        Raises:
            FastdataError: A download of this batch's shards failed, or a prefetch failed since the last
                batch (its message names the object).
        """
        self._check_pid()
        shards = np.asarray(shards, dtype=np.int64)
        if not self._plans:  # no plan for the scheduler to look at the disk beside: a batch does
            self._rescan()
        with self._cond:
            if self._failed is not None:  # a prefetch's error: this is the consumer's next batch
                failed, self._failed = self._failed, None
                raise failed
            self._pins[shards] += 1
            plan, at = self._active(), -1
            if plan is not None:
                at = plan.pos  # this batch (loader threads acquire in batch order)
                plan.pos += 1
                if plan.cursor < len(plan.shard) or not plan.complete:  # the scheduler may have work again
                    self._cond.notify_all()
        try:
            while True:
                with self._cond:
                    missing = shards[~self._is_open[shards]].tolist()
                    if not missing and (self.limit is not None or self.eager or self._pin_open(shards)):
                        return self._objs
                    if not missing:
                        continue  # (one was evicted since it was opened: fetched again)
                    arriving = self._demand(missing, plan, at)
                for fut in arriving:  # a prefetch of the same shard included: waited for, never fetched twice
                    failed = fut.exception()
                    if failed is not None:
                        with self._cond:
                            if self._failed is failed:  # (reported here, not again at the next batch)
                                self._failed = None
                        raise failed
                with self._cond:
                    for s in missing:
                        self._open(s)
        except BaseException:
            self.release(shards)
            raise

    def release(self, shards: np.ndarray) -> None:
        """Unpin one batch's shards; with a limit, shards not needed soon are closed (so they may be evicted)."""
        shards = np.asarray(shards, dtype=np.int64)
        with self._cond:
            self._pins[shards] -= 1
            if self.limit is None and not self.eager:  # (NOTE 11: pinned while a batch reads them)
                for s in shards[(self._pins[shards] == 0) & self._held[shards]].tolist():
                    self._unpin(s)
            if self.limit is not None:
                plan = self._active()
                for s in shards[self._pins[shards] == 0].tolist():
                    self._stalled = None  # a prefetch that found no room may find it now
                    if plan is None or plan.next_use(s) - plan.pos > 2 * self.requests:
                        self._close(s)
                self._cond.notify_all()

    def _demand(self, missing: list[int], plan: Optional[Plan], at: int) -> list[Future]:
        """(Under the lock.) Start downloads of the batch's ``missing`` shards that are neither on disk nor
        arriving, once room is made for all of them: while prefetches under way hold the room, wait for them
        to land (each within its retry budget) and evict them, so as not to go past the limit. The downloads
        this batch waits for."""
        while True:
            need = [s for s in missing if s not in self._fetching and not self._present(s)]
            short = self._make_room(need, True) if need else 0
            if short <= 0 or not any(self._pins[f] == 0 for f in self._fetching):
                break
            self._waiting += 1
            try:
                self._cond.wait(1.0)
            finally:
                self._waiting -= 1
        if short > 0 and not self._warned:  # every other shard counted is pinned by batches being read
            self._warned = True
            warnings.warn(f"cache_limit={self.limit} bytes cannot hold the shards in use: fetching beyond it; "
                          "raise cache_limit to at least a few batches' shards", ResourceWarning,
                          stacklevel=user_stacklevel())
        for s in need:
            self._fetch(s, plan, at, prefetch=False)
        return [self._fetching[s] for s in missing if s in self._fetching]

    def _open(self, s: int) -> None:
        """(Under the lock.) Shard ``s`` opened in this process if it is on disk, its pin taken first (against
        other processes' evictions: kept while open with a limit, until it is open without one); else left
        closed, to be fetched again (its cached bytes damaged: removed first, once, NOTE 21)."""
        if self._is_open[s] or s in self._fetching:
            return
        self._pinned.pin(self.groups.first(s))
        self._held[s] = True
        try:
            if not self._present(s):  # evicted by another process since it arrived
                self._know(s, False)
                self._unpin(s)
                return
            self._objs[s] = self.opener(s, self.remote.dir / self.groups.first(s))
        except ChecksumError as exc:
            self._unpin(s)
            self._drop_damaged(s, exc)
            return
        except BaseException:
            self._unpin(s)
            raise
        self._is_open[s] = True
        self._know(s, True)
        if self.limit is None:  # its maps hold the bytes, evicted or not; mapped as read: pinned per batch (11)
            self._unpin(s)

    def _pin_open(self, shards: np.ndarray) -> bool:
        """(Under the lock; a cache without a limit whose shards are mapped as read.) Pin the batch's open
        ``shards`` while it reads them (NOTE 11); False when one was evicted since it was opened: it is closed,
        to be fetched again."""
        whole = True
        for s in np.unique(shards[~self._held[shards]]).tolist():
            self._pinned.pin(self.groups.first(s))
            self._held[s] = True
            if not self._present(s):
                self._know(s, False)
                self._close(s)
                whole = False
        return whole

    def _drop_damaged(self, s: int, exc: ChecksumError) -> None:
        """(Under the lock or before any thread, ``s`` not pinned here.) Shard ``s``'s cached bytes failed their
        sha256 (``exc``): damaged on this node, since a download checks them as they come; its files are
        removed so that it is fetched anew, once (NOTE 21).

        Raises:
            ChecksumError: It failed again after that, or another process reads it now; the message says to
                remove the dataset's cache folder, not to push or preprocess again.
        """
        self._know(s, False)
        if s not in self._damaged:
            self._damaged.add(s)
            with self._pinned.evicting(self.groups.first(s)) as free:
                if free:
                    for name in self.groups[s]:
                        remove_cached_file(self.remote.dir, name)
                    return
        for name in self.groups[s]:  # (the file at fault, named with the cache's advice)
            entry = self.remote.entry(name)
            if check_file(self.remote.dir, entry) == "hash":
                raise damaged_error(self.remote.dir / name, entry, "hash", advice=self.remote.damaged_advice) from None
        raise ChecksumError(f"the files of {self.remote.dir / self.groups.first(s)} failed their sha256 check when "
                            f"opened; {self.remote.damaged_advice}") from exc  # (mended meanwhile: still said)

    def _close(self, s: int) -> None:
        if self._is_open[s] and self.closer is not None:
            self.closer(s, self.remote.dir / self.groups.first(s))
        self._objs[s] = None
        self._is_open[s] = False
        self._unpin(s)

    def _unpin(self, s: int) -> None:
        if self._held[s]:
            self._pinned.unpin(self.groups.first(s))
            self._held[s] = False

    # -- downloads --------------------------------------------------------------------------------------
    def _fetch(self, s: int, plan: Optional[Plan], at: int, prefetch: bool) -> None:
        """(Under the lock, room made.) Start the download of shard ``s``, for batch ``at`` of ``plan``."""
        self._fetching[s] = self._pool.submit(self._download, s, plan, at, prefetch)

    def _download(self, s: int, plan: Optional[Plan], at: int, prefetch: bool) -> None:
        """Every file of shard ``s``, then one locked step: the download's room is given back and what is on
        disk recorded (checked: another process may have evicted it meanwhile); a prefetch's error is kept
        for the consumer's next batch."""
        got, failed = False, None
        try:
            got = self._fetch_group(s)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits for this download
            failed = exc
        with self._cond:
            del self._fetching[s]
            self._know(s, self._present(s))
            if got and plan is not None:
                plan.count(s, at)
            if failed is not None and prefetch and self._failed is None and not self._closed:
                self._failed = failed
            self._cond.notify_all()
        if failed is not None:
            raise failed

    def _fetch_group(self, s: int) -> bool:
        """Every file of shard ``s``, the companions (labels) fetched beside the first, not after it; whether
        the first was downloaded here (not a wait for another's download)."""
        first, *rest = self.groups[s]
        side = [self._side.submit(self._get, n) for n in rest]
        try:
            got = self._get(first)
        finally:
            errors = [f.exception() for f in side]
        for failed in errors:
            if failed is not None:
                raise failed
        return got

    def _get(self, name: str) -> bool:
        return self.remote.get(self.remote.entry(name), self.progress, stop=self._stop)

    def set_limit(self, limit: Optional[int]) -> None:
        """A new bound, in bytes, from now on (a Mixture re-splitting one node budget when its weights change):
        a lower one evicts shards not in use, the farthest next use first, down to it at once; a higher one is
        room for the prefetches. A cache opened without a limit takes the shard pins a limit needs (NOTE
        [shard cache] 11): its open shards not in use are closed (reopened, pinned, when read). None: no
        bound from now on; nothing is evicted, open shards stay open, and those mapped let go of their pins.

        Raises:
            ConfigError: ``limit`` is neither None nor a positive number of bytes.
        """
        if limit is not None and (not is_whole(limit) or limit < 1):
            raise ConfigError(f"a cache limit must be a positive number of bytes or None (no bound), got "
                              f"limit={limit!r}")
        self._check_pid()
        if limit is None:
            with self._cond:
                if self.limit is not None:  # (as if opened without one: NOTE 11)
                    for s in np.flatnonzero(self._is_open & self._held).tolist():
                        if self.eager or self._pins[s] == 0:
                            self._unpin(s)
                self.limit, self.horizon, self._stalled = None, horizon(None, self.sizes), None
                self._cond.notify_all()
            return
        self._rescan(now=True)  # (other processes' shards count against the new bound at once)
        with self._cond:
            if self.limit is None:  # shards opened without pins: pin the ones in use, close the others
                for s in np.flatnonzero(self._is_open).tolist():
                    if self._pins[s] > 0 and not self._held[s]:
                        self._pinned.pin(self.groups.first(s))
                        self._held[s] = True
                    elif self._pins[s] == 0:
                        self._close(s)
            self.limit = int(limit)
            self.horizon = horizon(self.limit, self.sizes)
            self._stalled = None  # a prefetch that found no room may find it now
            self._make_room([], True)
            self._cond.notify_all()

    # -- room -------------------------------------------------------------------------------------------
    def cached(self) -> np.ndarray:
        """Which shards are in the cache folder now (any process may have fetched or evicted them)."""
        return self.groups.present(on_disk(self.remote.dir, self._folders))

    def _rescan_due(self) -> bool:
        """(Under the lock.)"""
        due = time.monotonic() - self._scanned > max(1.0, 20 * self._scan_cost)
        return due and self.limit is not None and not self._scanning

    def _know(self, s: int, here: bool) -> None:
        """(Under the lock.) What this process learnt of shard ``s`` on disk (kept over a scan under way)."""
        self._have[s] = here
        if self._since is not None:
            self._since.append(s)

    def _rescan(self, now: bool = False) -> None:
        """Other processes fetch and evict too: look at the disk again (outside the lock, so no batch waits
        for it), at most once a second and for at most a twentieth of the time (``now``: whenever no look is
        under way); what this process learnt meanwhile stands."""
        with self._cond:
            if self._scanning or not (now or self._rescan_due()):
                return
            self._scanning, self._since = True, []
        began, have = time.monotonic(), None
        try:
            have = self.cached()
        finally:
            with self._cond:
                if have is not None:
                    learnt = np.array(self._since, dtype=np.int64)
                    have[learnt] = self._have[learnt]
                    self._have = have
                self._scanned, self._scan_cost = time.monotonic(), time.monotonic() - began
                self._scanning, self._since = False, None

    def _present(self, s: int) -> bool:
        """Shard ``s``'s files are in the cache, each of its manifest's size (another size: a damaged or
        planted file, fetched again over it) and neither a link nor reached through one (NOTE 20)."""
        names = list(self.groups[s])
        return all(cached_size(self.remote.dir, n) == int(b) for n, b in zip(names, self.remote.sizes(names)))

    def _make_room(self, need: list[int], demand: bool) -> int:
        """(Under the lock.) Evict until the shards ``need`` fit under the limit, the shard needed last first
        (Belady); the bytes still short (0: they fit). Counted: shards on disk, arriving (each download's
        room is its own until it ends) or pinned (a batch's shard not on disk yet). A prefetch (one shard)
        within a lookahead of a quarter of the limit (`evict.near`) evicts only shards needed after it
        (do no harm); beyond it, only what the reader would evict when it is due (so it never costs a
        download that waiting would not); otherwise it stays short."""
        if self.limit is None:
            return 0
        busy = self._pins > 0
        busy[list(self._fetching)] = True
        counted = self._have | busy
        counted[need] = False
        short = int(self.sizes[counted].sum()) + int(self.sizes[need].sum()) - self.limit
        if short <= 0:
            return 0
        plan = self._active()
        near = not demand and plan is not None and evict.near(plan, need[0], self.sizes, counted, self.limit)
        if not demand and plan is not None and not near:
            if not evict.reader_would_evict(plan, need[0], self.sizes, counted, busy, short):
                return short  # the shard the reader would evict when it is due is still in use: wait
        candidates = np.flatnonzero(counted & ~busy)
        if plan is None:
            order = np.arange(len(candidates))
        else:
            order, nxt = evict.farthest_first(plan, candidates)
            if near and not evict.harmless(plan, need[0], self.sizes[candidates[order]], nxt[order], short):
                return short  # do no harm: evict only shards needed after it, the farthest first
        for c in candidates[order].tolist():
            if short <= 0:
                break
            self._close(c)
            if self._evict(c):
                short -= int(self.sizes[c])
        return max(0, short)

    def _evict(self, c: int) -> bool:
        """(Under the lock, ``c`` closed here.) Delete shard ``c``'s files unless a reader holds it (this cache
        too: `ShardPins.evicting` refuses a shard its own object pins)."""
        with self._pinned.evicting(self.groups.first(c)) as free:
            if not free:
                return False  # another process reads it
            for name in self.groups[c]:
                remove_cached_file(self.remote.dir, name)  # (never through a link: NOTE 20)
            self._know(c, False)
            return True

    # -- prefetching ------------------------------------------------------------------------------------
    def _schedule(self) -> None:
        """The prefetch thread: `_prefetch_all`; an error that ends it is raised in the consumer at its
        next batch (never a silent end of prefetching)."""
        try:
            self._prefetch_all()
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            if hasattr(exc, "add_note"):  # (Python 3.11+; 3.10 raises it without the note)
                exc.add_note(f"(in the prefetch thread of {scrub(self.remote.url)})")
            with self._cond:
                self._failed = self._failed or exc
                self._cond.notify_all()

    def _prefetch_all(self) -> None:
        """Fetch the active plan's shards in order of first need, within the in-flight bounds; room is made
        here, one shard at a time in that order, so prefetches never evict each other out of order. With
        nothing to fetch now, learn more of the plan (how far ahead eviction can see), up to its horizon."""
        while True:
            if self._plans:  # (none: nobody reads, or batches come without a plan and look themselves)
                self._rescan()
            learn: Optional[Plan] = None
            with self._cond:
                found = self._next_candidate()
                while found is None and not self._closed:
                    plan = self._active()
                    if plan is not None and plan.wants_more():
                        learn = plan
                        break
                    if self._rescan_due() and self._plans:
                        break
                    self._cond.wait(0.5)
                    found = self._next_candidate()
                if self._closed:
                    return
                if found is None and learn is None:  # a look at the disk is due
                    continue
                if learn is None:
                    plan = self._active()
                    assert found is not None and plan is not None  # (a candidate comes from the active plan)
                    s, at = found
                    if self._make_room([s], False) > 0:  # everything cached is needed before s: wait for the reader
                        self._stalled = plan.pos
                        continue
                    self._fetch(s, plan, at, prefetch=True)
                    continue
            learn.learn(self._cond)

    def _next_candidate(self) -> Optional[tuple[int, int]]:
        """The next shard of the active plan, in order of need, that is neither local (``_have`` is this
        process's view, checked against the disk for the few it does not know: other processes fetch too)
        nor arriving, and the batch of its run; None while a batch waits for room. The plan's ``cursor``
        moves past the runs of local shards only, never past one arriving (should its download fail, or the
        shard go before it is read, the scheduler comes back to it)."""
        plan = self._active()
        if plan is None or self._waiting or len(self._fetching) >= self.requests or self._stalled == plan.pos:
            return None
        fetching_bytes = sum(int(self.sizes[f]) for f in self._fetching)
        plan.cursor = max(plan.cursor, int(np.searchsorted(plan.batch, plan.pos - 1)))  # batches read are past
        i, hold = plan.cursor, None
        while i < len(plan.shard):
            window = plan.shard[i:i + 4096]
            for h in np.flatnonzero(~self._have[window]).tolist():
                s = int(window[h])
                if s in self._fetching:
                    hold = i + h if hold is None else hold
                    continue
                if self._present(s):
                    self._know(s, True)
                    continue
                plan.cursor = i + h if hold is None else hold
                if self._fetching and fetching_bytes + self.sizes[s] > self.in_flight:
                    return None
                if self.limit is not None and self.sizes[s] > self.limit:
                    return None
                return s, int(plan.batch[i + h])
            i += len(window)
        plan.cursor = i if hold is None else hold
        return None

    def close(self) -> None:
        """Stop prefetching and close every opened shard. Downloads under way end at their next try or piece
        (during an outage at once, not after the retry budget: 2 minutes by default), their partial files
        removed; a batch waiting for one is told the dataset was closed."""
        self._stop.set()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            for s in np.flatnonzero(self._is_open).tolist():
                self._close(s)
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._side.shutdown(wait=True, cancel_futures=True)
        with self._cond:
            self._pinned.close()
