"""The shards of a remote dataset fetched into the node cache as the loader will need them, within a size bound.

NOTE [shard cache]: a reader names the shards each of its coming batches reads (:meth:`ShardCache.plan`, an
iterator over the epoch order FastLoader knows in advance, running on into the next epoch). A scheduler
thread downloads them in order of first need, with at most ``in_flight`` bytes and ``requests`` objects
under way, so downloads overlap training and the first batch waits only for its own shards; between
downloads it learns more of the plan, a chunk of batches at a time, as runs of batches per shard (a
windowed order over 10^9 samples is a few runs per shard, not a read per sample). ``acquire`` (every
``get_batch``) waits for the shards of one batch, fetching at once any that no prefetch covered, and
pins them; ``release`` unpins them.

With ``limit`` (bytes of this dataset's files in the cache), room is made by evicting the cached shard
whose next use is farthest away (never used again first; the next epoch's reads count, so the shards
it starts with stay): Belady's rule over the known order. A prefetch of shard ``s`` never evicts a shard
read before ``s`` (do no harm). Within a lookahead of a quarter of the limit (the bytes cached or arriving
that are read before ``s``) it evicts the shard needed last from now, so the link stays busy; beyond it,
only what the reader would evict when ``s`` is due, so a small cache never trades downloads for
lookahead; otherwise it waits. When nothing can go, a batch's own shard is fetched anyway (a warning says
the limit is too small for the shards in use). Shards in use are never evicted, across processes too: a
process holds a shared ``flock`` on a shard's pin file while it has the shard mapped, and an eviction
needs that lock exclusively (the pin is
not the download lock, so a reader holding pins never waits on a download that waits on it). Every rank
on a node shares the cache folder and downloads each shard once (the per-file locks of
:meth:`RemoteDataset.fetch`); the limit is kept up to the bytes other processes have in flight.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
import warnings
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, Union

import numpy as np

from . import evict
from .plan import Plan
from .remote import RemoteDataset, download_bar

IN_FLIGHT = 512 << 20
REQUESTS = 8
class ShardCache:
    """Shards ``names`` of ``remote`` in its cache folder, fetched ahead of a plan and evicted by next use
    (see NOTE [shard cache]); a shard may be several files read together (``("images-0.npy",
    "labels-0.npy")``), fetched and evicted as one and opened with the first one's path. ``opener(shard,
    path)`` makes what readers use (a memory map), kept while cached; ``closer(shard, path)`` lets go of it
    before the shard may be evicted (an LMDB environment)."""

    def __init__(self, remote: RemoteDataset, names: Sequence[Union[str, Sequence[str]]],
                 opener: Callable[[int, Path], Any], *,
                 limit: Optional[int] = None, in_flight: int = IN_FLIGHT, requests: int = REQUESTS,
                 progress: bool = True, closer: Optional[Callable[[int, Path], None]] = None) -> None:
        self.remote, self.opener, self.closer = remote, opener, closer
        self.groups = [(n,) if isinstance(n, str) else tuple(n) for n in names]  # the files read together
        self.names = [g[0] for g in self.groups]
        self.sizes = np.array([sum(int(remote.entry(n)["bytes"]) for n in g) for g in self.groups], dtype=np.int64)
        self.limit, self.in_flight, self.requests = limit, in_flight, max(1, requests)
        self._start()
        # a bar (rank 0) over the bytes not cached yet
        self.progress = download_bar(remote, int(self.sizes[~self._have].sum())) if progress else None

    def _start(self) -> None:
        self._pid = os.getpid()
        self._cond = threading.Condition()
        self._objs = np.full(len(self.names), None, dtype=object)  # what opener made, per shard
        self._is_open = np.zeros(len(self.names), dtype=bool)
        self._locks: dict[int, Any] = {}  # shard -> lock file held shared while opened (with a limit)
        self._pins = np.zeros(len(self.names), dtype=np.int64)
        self._have = self.cached()  # which shards are local, as far as this process knows
        self._scanned = time.monotonic()
        if self.limit is None:  # a warm cache opens as a local folder does: every shard mapped up front
            for s in np.flatnonzero(self._have).tolist():
                self._objs[s] = self.opener(s, self.remote.dir / self.names[s])
                self._is_open[s] = True
        self._flying: dict[int, Future] = {}  # prefetches under way (download only)
        self._loading: dict[int, Future] = {}  # shards being fetched and opened for a batch (one per shard)
        self._reserved: set[int] = set()  # shards being downloaded by this process, counted against the limit
        self._plans: list[tuple[object, Plan]] = []
        self._tallies: deque[dict[str, Any]] = deque(maxlen=16)  # the newest plans' tallies (report())
        self._pool = ThreadPoolExecutor(self.requests * 2, thread_name_prefix="fastdata-fetch")
        self._side = ThreadPoolExecutor(self.requests * 2, thread_name_prefix="fastdata-fetch-side")
        self._warned = False
        self._stalled: Optional[int] = None  # plan position at which a prefetch found no room
        self._closed = False
        self._thread: Optional[threading.Thread] = None

    def _check_pid(self) -> None:
        if os.getpid() != self._pid:  # a forked worker: threads and pins stayed with the parent
            self._start()

    # -- plans ------------------------------------------------------------------------------------------
    def plan(self, reads: Iterable[np.ndarray], now: Optional[int] = None) -> object:
        """Register the coming reads: the shards of each coming batch, in ``acquire`` order (an iterator,
        learnt as the scheduler goes: it may run on into the next epoch, whose reads start after the
        first ``now`` batches); a token for :meth:`end_plan`. The newest plan drives prefetching."""
        self._check_pid()
        token, plan = object(), Plan(iter(reads), len(self.names), now)
        plan.learn(self._cond)  # the first chunk now: evictions before the scheduler runs must see it
        with self._cond:
            self._plans.append((token, plan))
            self._tallies.append(plan.tally)
            if self._thread is None:
                self._thread = threading.Thread(target=self._schedule, name="fastdata-prefetch", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        return token

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
        :meth:`release`). The common case, all open, is a few array operations whatever the shard count."""
        self._check_pid()
        shards = np.asarray(shards, dtype=np.int64)
        with self._cond:
            self._pins[shards] += 1
            plan, at = self._active(), -1
            if plan is not None:
                at = plan.pos  # this batch (loader threads acquire in batch order)
                plan.pos += 1
                if plan.cursor < len(plan.shard) or not plan.complete:  # the scheduler may have work again
                    self._cond.notify_all()
        try:
            while True:
                with self._cond:  # one loader per shard in this process, whichever thread asks
                    missing = shards[~self._is_open[shards]].tolist()
                    if not missing:
                        return self._objs
                    waits = []
                    for s in missing:
                        if s not in self._loading:
                            self._loading[s] = self._pool.submit(self._load, s, plan, at)
                        waits.append(self._loading[s])
                for fut in waits:
                    fut.result()
        except BaseException:
            self.release(shards)
            raise

    def release(self, shards: np.ndarray) -> None:
        """Unpin one batch's shards; with a limit, shards not needed soon are closed (so they may be evicted)."""
        shards = np.asarray(shards, dtype=np.int64)
        with self._cond:
            self._pins[shards] -= 1
            if self.limit is not None:
                plan = self._active()
                for s in shards[self._pins[shards] == 0].tolist():
                    if plan is None or plan.next_use(s) - plan.pos > 2 * self.requests:
                        self._close(s)
                self._cond.notify_all()

    def _load(self, s: int, plan: Optional[Plan], at: int) -> None:
        try:
            self._ensure(s, plan, at)
        finally:
            with self._cond:
                self._loading.pop(s, None)

    def _ensure(self, s: int, plan: Optional[Plan], at: int) -> None:
        """Shard ``s`` local, verified and opened in this process (downloaded at most once per node), for
        batch ``at`` of ``plan``."""
        path = self.remote.dir / self.names[s]
        while not self._is_open[s]:
            if not self._present(s):
                self._make_room(s, True)
                try:
                    self._fetch_group(s, plan, at)
                    self._have[s] = True  # before its reservation goes: counted against the limit throughout
                finally:
                    self._unreserve(s)
            with self._cond:
                if self._is_open[s]:
                    return
                lock = None
                if self.limit is not None:  # pin the file against other processes' evictions, then re-check
                    lock = open(self._pin_path(s), "a+b")
                    fcntl.flock(lock, fcntl.LOCK_SH)
                if not self._present(s):  # evicted by another process in between: fetch again
                    self._have[s] = False
                    if lock is not None:
                        lock.close()
                    continue
                self._objs[s] = self.opener(s, path)
                self._is_open[s] = True
                if lock is not None:
                    self._locks[s] = lock

    def _close(self, s: int) -> None:
        if self._is_open[s] and self.closer is not None:
            self.closer(s, self.remote.dir / self.names[s])
        self._objs[s] = None
        self._is_open[s] = False
        lock = self._locks.pop(s, None)
        if lock is not None:
            lock.close()

    # -- room -------------------------------------------------------------------------------------------
    def cached(self) -> np.ndarray:
        """Which shards are in the cache folder now (any process may have fetched or evicted them)."""
        return np.array([self._present(s) for s in range(len(self.groups))], dtype=bool)

    def _present(self, s: int) -> bool:
        return all((self.remote.dir / n).is_file() for n in self.groups[s])

    def _fetch_group(self, s: int, plan: Optional[Plan], at: int) -> None:
        """Every file of shard ``s``, the companions (labels) fetched beside the first, not after it; a
        download (not a wait for another's) is counted in ``plan`` for batch ``at``."""
        first, *rest = self.groups[s]
        side = [self._side.submit(self.remote.fetch, self.remote.entry(n), self.progress) for n in rest]
        try:
            got = self.remote.get(self.remote.entry(first), self.progress)
        finally:
            for fut in side:
                fut.result()
        if got and plan is not None:
            with self._cond:
                plan.count(s, at)

    def _make_room(self, s: int, demand: bool) -> bool:
        """Evict until shard ``s`` fits under the limit, the shard needed last first (Belady). A prefetch
        within a lookahead of a quarter of the limit (:func:`evict.near`) evicts only shards needed after ``s``
        (do no harm); beyond it, only what the reader would evict when ``s`` is due (so it never costs a
        download that waiting would not). Otherwise it gets False."""
        if self.limit is None:
            return True
        with self._cond:
            now = time.monotonic()
            if now - self._scanned > 1.0:  # other processes fetch and evict too: look at the disk once a second
                self._have, self._scanned = self.cached(), now  # (a stat per shard: not per decision at 20,000)
            present = self._have.copy()
            present[list(self._reserved)] = True  # downloads under way take their room now
            present[s] = False
            used = int(self.sizes[present].sum())
            free = self.limit - used - int(self.sizes[s])
            if free < 0:
                plan = self._active()
                near = not demand and plan is not None and evict.near(plan, s, self.sizes, present, self.limit)
                if not demand and plan is not None and not near:
                    busy = self._pins > 0
                    busy[list(self._reserved)] = True
                    if not evict.reader_would_evict(plan, s, self.sizes, present, busy, -free):
                        return False  # the shard the reader would evict when s is due is still in use: wait
                present[list(self._reserved)] = False
                candidates = np.flatnonzero(present & (self._pins == 0))
                if plan is None:
                    order = np.arange(len(candidates))
                else:
                    order, nxt = evict.farthest_first(plan, candidates)
                    if near and not evict.harmless(plan, s, self.sizes[candidates[order]], nxt[order], -free):
                        return False  # do no harm: evict only shards needed after s, the farthest first
                for c in candidates[order].tolist():
                    if free >= 0:
                        break
                    self._close(c)
                    if self._evict(c):
                        free += int(self.sizes[c])
            if free >= 0 or demand:
                self._reserved.add(s)
            if free >= 0:
                return True
            if demand and not self._warned:
                self._warned = True
                warnings.warn(f"cache_limit={self.limit} bytes cannot hold the shards in use: fetching beyond it; "
                              "raise cache_limit to at least a few batches' shards", ResourceWarning, stacklevel=2)
            return demand

    def _unreserve(self, s: int) -> None:
        with self._cond:
            self._reserved.discard(s)

    def _pin_path(self, s: int) -> Path:
        """The file readers hold shared while they use shard ``s`` (not the download lock: a reader never
        waits for a download while it holds a pin)."""
        return self.remote.dir / ".locks" / (self.names[s].replace("/", "%") + ".pin")

    def _evict(self, c: int) -> bool:
        lock = open(self._pin_path(c), "a+b")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            return False  # another process reads or fetches it
        try:
            for name in self.groups[c]:
                (self.remote.dir / name).unlink(missing_ok=True)
            self._have[c] = False
            return True
        finally:
            lock.close()

    # -- prefetching ------------------------------------------------------------------------------------
    def _schedule(self) -> None:
        """Fetch the active plan's shards in order of first need, within the in-flight bounds; room is made
        here, one shard at a time in that order, so prefetches never evict each other out of order. With
        nothing to fetch now, learn more of the plan (how far ahead eviction can see)."""
        while True:
            learn: Optional[Plan] = None
            with self._cond:
                s = self._next_candidate()
                while s is None and not self._closed:
                    plan = self._active()
                    if plan is not None and not plan.complete:
                        learn = plan
                        break
                    self._cond.wait(0.5)
                    s = self._next_candidate()
                if self._closed:
                    return
                if learn is None:
                    plan = self._active()
                    assert s is not None and plan is not None  # (a candidate comes from the active plan)
                    at = int(plan.batch[plan.cursor])  # the batch it is fetched for (its run's first)
                    if not self._make_room(s, False):  # everything cached is needed before s: wait for the reader
                        self._stalled = plan.pos
                        continue
                    self._flying[s] = self._pool.submit(self._prefetch, s, plan, at)
                    continue
            learn.learn(self._cond)

    def _next_candidate(self) -> Optional[int]:
        """The next shard of the active plan, in order of need, that is not local yet (``_have`` is this
        process's view, checked against the disk for the few it does not know: other processes fetch too);
        the plan's ``cursor`` is left at its run."""
        plan = self._active()
        if plan is None or len(self._flying) >= self.requests or self._stalled == plan.pos:
            return None
        flying_bytes = sum(int(self.sizes[f]) for f in self._flying)
        plan.cursor = max(plan.cursor, int(np.searchsorted(plan.batch, plan.pos - 1)))  # batches read are past
        while plan.cursor < len(plan.shard):
            window = plan.shard[plan.cursor:plan.cursor + 4096]
            for h in np.flatnonzero(~self._have[window]):
                s = int(window[h])
                if s in self._flying:
                    continue
                if self._present(s):
                    self._have[s] = True
                    continue
                plan.cursor += int(h)
                if self._flying and flying_bytes + self.sizes[s] > self.in_flight:
                    return None
                if self.limit is not None and self.sizes[s] > self.limit:
                    return None
                return s
            plan.cursor += len(window)
        return None

    def _prefetch(self, s: int, plan: Plan, at: int) -> None:
        try:
            self._fetch_group(s, plan, at)
            self._have[s] = True
        except Exception:  # noqa: BLE001 - a failed prefetch is retried by the batch that needs it, which reports
            pass
        finally:
            self._unreserve(s)
            with self._cond:
                self._flying.pop(s, None)
                self._cond.notify_all()

    def close(self) -> None:
        """Stop prefetching (downloads under way finish) and close every opened shard."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            for s in np.flatnonzero(self._is_open).tolist():
                self._close(s)
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._side.shutdown(wait=True, cancel_futures=True)
