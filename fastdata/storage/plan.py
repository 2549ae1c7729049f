"""What the coming batches of a loader pass read, per shard: the plan ShardCache prefetches and evicts by
(NOTE [shard cache] in fastdata/storage/cache.py), learnt a chunk at a time up to a horizon, so that its
memory is bounded by the horizon, not by the epoch: two epochs of 10^9 samples under a plain shuffle cost
the runs of a few cache capacities, not a read per sample."""
from __future__ import annotations

from typing import Any, Iterator, Optional

import numpy as np

NEVER = np.iinfo(np.int64).max  # the next use of a shard no batch reads again
HORIZON_CACHES = 4  # a plan learns runs ahead of the reader until they would fill the cache this many times...
HORIZON_RUNS = 1 << 20  # ...and at most this many (32 MiB of runs: a cache of 262,144 shards or more)
RUN_BYTES = 4 * 8  # a learnt run: its first and last batch by shard, its first batch and shard by batch (int64)
SHARD_BYTES = 8 + 8 + 1  # per shard: where its runs start, its next use, whether it was fetched this epoch
# What a learn holds beside those while it merges a chunk, at its peak: per run, the kept mask (1), the kept
# runs' shard, first and last batch (24), their merged order (8), a merged array being gathered and its
# source (16), the new batch-order arrays (16); per shard, the last run's end and the new offsets (24); per
# read of the chunk, the reads, their batches, their keys sorted and the chunk's runs (64).
LEARN_RUN_BYTES, LEARN_SHARD_BYTES, LEARN_READ_BYTES = 65, 24, 64


def horizon(limit: Optional[int], sizes: np.ndarray) -> int:
    """How many runs a plan learns ahead of the reader for a cache of ``limit`` bytes (None: no limit) over
    shards of ``sizes`` bytes: `HORIZON_CACHES` times the shards the cache holds (every shard without a
    limit), at most `HORIZON_RUNS`. Beyond it a shard is "not before the horizon", which eviction
    treats as farthest."""
    if limit is None:
        holds = len(sizes)
    else:
        holds = int(limit // max(1, int(sizes.mean()))) if len(sizes) else 0
    return max(1, min(HORIZON_RUNS, HORIZON_CACHES * holds))


class Plan:
    """Which shards the coming batches read, learnt from ``reads`` (one array of shard numbers per batch, in
    order) a chunk at a time while fewer than ``horizon`` runs lie ahead of the reader (None: all of them).
    For each shard the runs ``[lo, hi]`` of consecutive batches that read it (one array, by shard), and
    every run's first batch in batch order (``batch``/``shard``: what the scheduler prefetches, in order of
    need, from ``cursor``). Runs the reader is past are dropped as more are learnt, so a plan holds at most
    about ``horizon`` plus one chunk of runs. Batches beyond what is learnt yet are a horizon: a shard not
    seen before it is "not before the horizon", not "never"."""

    CHUNK = 1 << 18  # reads learnt at a time

    def __init__(self, reads: Iterator[np.ndarray], shards: int, now: Optional[int] = None,
                 horizon: Optional[int] = None) -> None:
        self._reads, self.shards, self.horizon = reads, shards, horizon
        self.now = NEVER if now is None else now  # batches of the current epoch; the next one's follow
        # downloads made for this plan (see ShardCache.report): for the current epoch's batches, of those
        # the shards fetched again within it, and ahead for the next epoch
        self.tally = {"batches": self.now if now is not None else None, "downloads": 0, "repeats": 0, "ahead": 0}
        self._got = np.zeros(shards, dtype=bool)  # shards downloaded for the current epoch
        self._off = np.zeros(shards + 1, dtype=np.int64)  # shard s's runs are _lo/_hi[_off[s]:_off[s + 1]]
        self._lo = np.zeros(0, dtype=np.int64)
        self._hi = np.zeros(0, dtype=np.int64)
        self.batch = np.zeros(0, dtype=np.int64)  # runs' first batches, ascending...
        self.shard = np.zeros(0, dtype=np.int64)  # ...and their shards
        self.known = 0  # batches learnt
        self.complete = False  # every batch learnt
        self._first: Optional[np.ndarray] = None  # the batch each shard is first read at in the first chunk, sorted
        self.pos = 0  # batches acquired so far
        self.cursor = 0  # runs before it are scheduled or past
        self._next = np.full(shards, -1, dtype=np.int64)  # next use per shard, valid while >= pos

    @property
    def nbytes(self) -> int:
        """Bytes of the plan's arrays (its memory, but for the few Python objects around them)."""
        return sum(a.nbytes for a in (self._got, self._off, self._lo, self._hi, self.batch, self.shard, self._next))

    def runs_ahead(self) -> int:
        """Learnt runs that start at or after the reader's position."""
        return len(self.batch) - int(np.searchsorted(self.batch, self.pos))

    def wants_more(self) -> bool:
        """Whether there is more to learn and fewer than ``horizon`` runs ahead of the reader."""
        return not self.complete and (self.horizon is None or self.runs_ahead() < self.horizon)

    def learn(self, lock: Any) -> bool:
        """Learn the next chunk of batches and drop the runs the reader is past, working outside ``lock``
        and publishing under it (readers see the plan before or after the chunk, never half of it); False
        when there was nothing left. Called by one thread at a time: the one that moves ``cursor``."""
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
        pos, cut = self.pos, self.cursor  # (pos only grows meanwhile: runs past it stay past)
        keep = self._hi >= pos
        old_shard = np.repeat(np.arange(self.shards), np.diff(self._off))[keep]
        lo, hi = self._lo[keep], self._hi[keep]
        batch, shard = self.batch[cut:], self.shard[cut:]
        touched = np.zeros(0, dtype=np.int64)
        if needs:
            new_lo, new_hi, new_shard = self._runs(needs, owners, b0, known)
            heads = np.flatnonzero(np.r_[True, new_shard[1:] != new_shard[:-1]])
            if b0 == 0:
                self._first = np.sort(new_lo[heads])
            # a shard's first run in this chunk may carry on its last run of the last chunk
            last = np.full(self.shards, -2, dtype=np.int64)
            ends = np.flatnonzero(np.r_[old_shard[1:] != old_shard[:-1], True]) if len(old_shard) else old_shard
            last[old_shard[ends]] = hi[ends]
            carry = heads[last[new_shard[heads]] + 1 == new_lo[heads]]
            if len(carry):
                at = np.searchsorted(old_shard, new_shard[carry], side="right") - 1  # their last old runs
                hi[at] = new_hi[carry]
            fresh = np.ones(len(new_lo), dtype=bool)
            fresh[carry] = False
            by_shard = np.argsort(np.r_[old_shard, new_shard[fresh]], kind="stable")  # old runs first per shard
            lo, hi = np.r_[lo, new_lo[fresh]][by_shard], np.r_[hi, new_hi[fresh]][by_shard]
            old_shard = np.r_[old_shard, new_shard[fresh]][by_shard]
            by_batch = np.argsort(new_lo[fresh], kind="stable")
            batch, shard = np.r_[batch, new_lo[fresh][by_batch]], np.r_[shard, new_shard[fresh][by_batch]]
            touched = np.unique(new_shard)
        off = np.searchsorted(old_shard, np.arange(self.shards + 1))
        with lock:
            self._off, self._lo, self._hi = off, lo, hi
            self.batch, self.shard, self.known, self.complete = batch, shard, known, complete
            self.cursor -= cut
            self._next[self._next >= b0] = -1  # the horizon moved: those answers are out of date
            self._next[touched] = -1  # (and these may be read sooner than known before)
        return bool(needs)

    def scattered(self, holds: int) -> bool:
        """Whether the first batches read more shards than a cache holding ``holds`` shards can keep: a plain
        shuffle's do. While an order that reads shard by shard (in sequence, or a shuffle window) reads a
        cache's worth of samples (``holds`` shards' worth, at this epoch's reads per shard), it touches about
        that many shards, plus its window; a plain shuffle touches nearly every shard. Judged on the first
        chunk learnt (False when it cannot tell)."""
        if self._first is None or self.now == NEVER or not 0 < holds < self.shards:
            return False
        m = min(self.known, max(1, -(-holds * self.now // self.shards)))  # batches reading a cache's worth
        worth = m * self.shards / self.now  # shards' worth of samples those batches read
        return int(np.searchsorted(self._first, m)) > max(1.5 * worth, worth + holds / 2)

    @staticmethod
    def _runs(needs: list[np.ndarray], owners: list[np.ndarray], b0: int,
              known: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The runs ``(lo, hi, shard)`` of consecutive batches ``b0..known-1`` reading each shard, by shard then
        batch."""
        span = known - b0
        key = np.unique(np.concatenate(needs) * span + (np.concatenate(owners) - b0))  # by shard, then batch
        key_shard, key_batch = key // span, key % span + b0
        new = np.flatnonzero(np.r_[True, (key_shard[1:] != key_shard[:-1]) | (key_batch[1:] != key_batch[:-1] + 1)])
        return key_batch[new], key_batch[np.r_[new[1:], len(key)] - 1], key_shard[new]

    def next_use(self, shard: int, after: Optional[int] = None) -> int:
        """The first batch at or after ``pos`` (or ``after``, never before ``pos``) that reads ``shard``:
        ``NEVER`` when no batch does, the horizon when none learnt yet does."""
        at = self.pos if after is None else after
        a, b = int(self._off[shard]), int(self._off[shard + 1])
        i = a + int(np.searchsorted(self._hi[a:b], at))
        if i < b:
            return max(int(self._lo[i]), at)
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
        """`next_use` of many shards, recomputing only those used (or learnt) since last asked."""
        stale = shards[self._next[shards] < self.pos]
        for s in stale.tolist():
            self._next[s] = self.next_use(s)
        return self._next[shards]
