"""What the coming batches of a loader pass read, per shard: the plan ShardCache prefetches and evicts by
(NOTE [shard cache] in fastdata/storage/cache.py), learnt a chunk at a time so that two epochs of 10^9 samples cost their
runs of batches per shard, not a read per sample."""
from __future__ import annotations

from typing import Any, Iterator, Optional

import numpy as np

NEVER = np.iinfo(np.int64).max  # the next use of a shard no batch reads again


class Plan:
    """Which shards the coming batches read, learnt from ``reads`` (one array of shard numbers per batch, in
    order) a chunk at a time, so a plan over two epochs of 10^9 samples costs its runs, not its reads:
    for each shard the runs ``[lo, hi]`` of consecutive batches that read it, and every run's first batch
    in batch order (what the scheduler prefetches, in order of need). Batches beyond what is learnt yet
    are a horizon: a shard not seen before it is "not before the horizon", not "never"."""

    CHUNK = 1 << 18  # reads learnt at a time

    def __init__(self, reads: Iterator[np.ndarray], shards: int, now: Optional[int] = None) -> None:
        self._reads, self.shards = reads, shards
        self.now = NEVER if now is None else now  # batches of the current epoch; the next one's follow
        # downloads made for this plan (see ShardCache.report): for the current epoch's batches, of those
        # the shards fetched again within it, and ahead for the next epoch
        self.tally = {"batches": self.now if now is not None else None, "downloads": 0, "repeats": 0, "ahead": 0}
        self._got = np.zeros(shards, dtype=bool)  # shards downloaded for the current epoch
        self._lo = [np.zeros(0, dtype=np.int64) for _ in range(shards)]
        self._hi = [np.zeros(0, dtype=np.int64) for _ in range(shards)]
        self.batch = np.zeros(0, dtype=np.int64)  # runs' first batches, ascending...
        self.shard = np.zeros(0, dtype=np.int64)  # ...and their shards
        self.known = 0  # batches learnt
        self.complete = False  # every batch learnt
        self.pos = 0  # batches acquired so far
        self.cursor = 0  # runs before it are scheduled or past
        self._next = np.full(shards, -1, dtype=np.int64)  # next use per shard, valid while >= pos

    def learn(self, lock: Any) -> bool:
        """Learn the next chunk of batches, working outside ``lock`` and publishing under it (readers see
        the plan before or after the chunk, never half of it); False when there was nothing left."""
        if self.complete:
            return False
        needs, owners, b0 = [], [], self.known
        known, taken, complete = b0, 0, False
        for got in self._reads:
            got = np.asarray(got, dtype=np.int64)
            needs.append(got)
            owners.append(np.full(len(got), known, dtype=np.int64))
            known += 1
            taken += len(got)
            if taken >= self.CHUNK:
                break
        else:
            complete = True
        los, his = {}, {}
        batch, shard = self.batch, self.shard
        if needs:
            span = known - b0
            key = np.unique(np.concatenate(needs) * span + (np.concatenate(owners) - b0))  # by shard, then batch
            key_shard, key_batch = key // span, key % span + b0
            new = np.flatnonzero(np.r_[True, (key_shard[1:] != key_shard[:-1]) | (key_batch[1:] != key_batch[:-1] + 1)])
            lo, hi, run_shard = key_batch[new], key_batch[np.r_[new[1:], len(key)] - 1], key_shard[new]
            fresh = np.ones(len(new), dtype=bool)
            edges = np.flatnonzero(np.r_[True, run_shard[1:] != run_shard[:-1]])
            for i, j in zip(edges.tolist(), np.r_[edges[1:], len(new)].tolist()):
                s = int(run_shard[i])
                old_lo, old_hi = self._lo[s], self._hi[s]
                if len(old_hi) and old_hi[-1] + 1 == lo[i]:  # a run carried over from the last chunk
                    fresh[i] = False
                    old_hi = np.r_[old_hi[:-1], hi[i]]
                    i += 1
                los[s], his[s] = np.r_[old_lo, lo[i:j]], np.r_[old_hi, hi[i:j]]
            by_batch = np.argsort(lo[fresh], kind="stable")
            batch, shard = np.r_[batch, lo[fresh][by_batch]], np.r_[shard, run_shard[fresh][by_batch]]
        with lock:
            for s in los:
                self._lo[s], self._hi[s] = los[s], his[s]
            self.batch, self.shard, self.known, self.complete = batch, shard, known, complete
            self._next[self._next >= b0] = -1  # the horizon moved: those answers are out of date
            self._next[list(los)] = -1  # (and these may be read sooner than known before)
        return bool(needs)

    def next_use(self, shard: int, after: Optional[int] = None) -> int:
        """The first batch at or after ``pos`` (or ``after``) that reads ``shard``: ``NEVER`` when no batch
        does, the horizon when none learnt yet does."""
        at = self.pos if after is None else after
        lo, hi = self._lo[shard], self._hi[shard]
        i = int(np.searchsorted(hi, at))
        if i < len(hi):
            return max(int(lo[i]), at)
        return NEVER if self.complete else self.known

    def count(self, shard: int, batch: int) -> None:
        """A download of ``shard`` made for ``batch`` (call under the cache's lock)."""
        if batch >= self.now:
            self.tally["ahead"] += 1
            return
        self.tally["downloads"] += 1
        self.tally["repeats"] += int(self._got[shard])
        self._got[shard] = True

    def next_uses(self, shards: np.ndarray) -> np.ndarray:
        """:meth:`next_use` of many shards, recomputing only those used (or learnt) since last asked."""
        stale = shards[self._next[shards] < self.pos]
        for s in stale.tolist():
            self._next[s] = self.next_use(s)
        return self._next[shards]
