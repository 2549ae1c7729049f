"""One epoch's sample order, computed piece by piece: any stretch of it costs the stretch, not the epoch.

NOTE [streamed order]: the order of an epoch is a permutation ``perm`` of ``range(N)`` fixed by
``(seed, epoch)`` (the sampler splits it across ranks, see NOTE [epoch plan] in fastdata/loading/sampler.py). Without a
window it is ``default_rng((seed, epoch)).permutation(N)``, made whole (``N`` int64s). With a window of K
shards it is never made whole, so an epoch over 2·10^9 samples costs what one window costs:

* the shards dealt to ``C`` streams (``C`` = nodes of the run's layout, 1 on one node) once for the run,
  from ``seed`` alone, so that a node reads the same share every epoch and its cache keeps it; each
  stream's shards in a new random order every epoch (from ``default_rng((seed, epoch))``);
* each stream cut into windows of K consecutive shards of its own, and each window's samples shuffled
  among themselves by ``default_rng((seed, epoch, c, w))``: window ``w`` of stream ``c`` is made only
  when a position inside it is asked for;
* the streams interleaved in blocks of ``L`` positions (``L`` ranks a node): position ``p`` belongs to
  node ``(p // L) % C`` and reads stream ``(p // L) % C`` as long as every stream has samples left; in the
  rest of the epoch (the "tail", as long as the streams' lengths differ: about a shard) each node's
  positions read its own stream's leftovers first, then a share of the longer streams' surplus.

Rank ``r`` takes positions ``r, r + world, ...`` (loading/sampler.py), so with ``world = C * L`` and torchrun's
node-major ranks every rank of node ``n`` reads stream ``n`` only: nodes never fetch each other's
shards except in the leftovers at the end of the epoch. The order depends on ``(seed, epoch, K, C, L)``
and never on the world size, so a run resumed on another number of ranks (or nodes, keeping the
recorded layout) still serves every sample exactly once; it only loses the node locality.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Optional

import numpy as np

from ..errors import ConfigError


def group_by_shard(shards: np.ndarray) -> tuple[np.ndarray, Optional[np.ndarray]]:
    """``(bounds, members)`` from each sample's shard: shard ``s`` holds samples ``members[bounds[s]:bounds[s +
    1]]``; ``members`` is None when shards hold consecutive samples (the usual case: nothing to store)."""
    shards = np.asarray(shards, dtype=np.int64)
    if len(shards) and shards.min() < 0:
        raise ConfigError("sample shards must be non-negative shard numbers")
    n_shards = int(shards.max()) + 1 if len(shards) else 0
    counts = np.bincount(shards, minlength=n_shards)
    bounds = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    if len(shards) < 2 or bool(np.all(shards[1:] >= shards[:-1])):
        return bounds, None
    return bounds, np.argsort(shards, kind="stable").astype(np.int64)


def windowed(shuffle: bool, window: Optional[int], bounds: Optional[np.ndarray]) -> bool:
    """Whether an order of these settings is made a window at a time (else a whole permutation, or none): a
    window narrower than the shards (``bounds``: their first samples, then the end)."""
    return bool(shuffle and window is not None and bounds is not None and window < len(bounds) - 1)


class EpochOrder:
    """``perm`` of one epoch (NOTE [streamed order]); `at` gives ``perm[positions]``.

    ``bounds`` (and ``members``, see `shard_bounds`) say which samples each shard holds; they are
    needed for a ``window`` (in shards). ``layout=(C, L)``: ``C`` nodes of ``L`` ranks (``(1, 1)``: one
    stream)."""

    def __init__(self, num_samples: int, seed: int, epoch: int, *, shuffle: bool = True,
                 window: Optional[int] = None, bounds: Optional[np.ndarray] = None,
                 members: Optional[np.ndarray] = None, layout: tuple[int, int] = (1, 1)) -> None:
        self.num_samples, self.seed, self.epoch, self.shuffle = num_samples, seed, epoch, shuffle
        self._full: Optional[np.ndarray] = None
        self._full_lock = threading.Lock()  # (a cache's planning thread reads the permutation too)
        self.layout = (1, 1)  # (streams, positions a block) in effect
        self.windowed = windowed(shuffle, window, bounds)
        if not self.windowed:
            return
        assert bounds is not None and window is not None
        self.window, self.bounds, self.members = window, np.asarray(bounds, dtype=np.int64), members
        n_shards = len(self.bounds) - 1
        streams = max(1, min(int(layout[0]), n_shards))
        self.streams, self.block = streams, int(layout[1]) if streams > 1 else 1
        self.layout = (self.streams, self.block)
        deal = np.random.default_rng((seed, 0xDEA1)).permutation(n_shards)  # the same every epoch
        counts = np.diff(self.bounds)
        pooled = self._pool(deal, counts, streams)
        dealt, rng = deal[~pooled], np.random.default_rng((seed, epoch))
        # streams 0..C-1 are the nodes', their shards in this epoch's order; stream C is the pool, read
        # shard by shard (windows of 1)
        self.stream_shards = [rng.permutation(dealt[c::streams]) for c in range(streams)] + [deal[pooled]]
        self.widths = [window] * streams + [1]
        self.cum = []  # per stream: where each of its windows starts, in the stream's own positions
        for shards, width in zip(self.stream_shards, self.widths):
            sizes = np.add.reduceat(counts[shards], np.arange(0, len(shards), width)) if len(shards) else []
            self.cum.append(np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64))
        lengths = np.array([cum[-1] for cum in self.cum[:streams]], dtype=np.int64)
        self.shared = int(lengths.min()) // self.block * self.block  # each stream's interleaved part
        self.interleaved = self.shared * streams
        self.tails = self._deal_tail(lengths - self.shared, int(self.cum[streams][-1]))
        self._windows: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()

    @staticmethod
    def _pool(shard_order: np.ndarray, counts: np.ndarray, streams: int) -> np.ndarray:
        """Which shards (by place in ``shard_order``) stay out of the nodes' streams so that those get as
        many samples each: the ``n % C`` left over, and the odd-sized ones (a dataset's short last shard)
        when they are few, topped up to keep the count dealt a multiple of C. The pool is read at the end,
        shard by shard, so a node reads one or two of its shards, never a piece of every other node's."""
        n = len(shard_order)
        pooled = np.zeros(n, dtype=bool)
        if streams == 1:
            return pooled
        odd = counts[shard_order] != counts.max()
        size = n % streams
        if 0 < odd.sum() <= streams:
            size += -(-(int(odd.sum()) - size) // streams) * streams if odd.sum() > size else 0
            if n - size >= streams:
                pooled |= odd
                even = np.flatnonzero(~odd)
                pooled[even[len(even) - (size - int(odd.sum())):]] = True
                return pooled
        pooled[n - n % streams:] = True
        return pooled

    def _deal_tail(self, extra: np.ndarray, pool: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Per node, the pieces its tail positions read, as ``(offsets, streams, first places)``: its own
        stream's leftovers, then shares of the surplus of streams with more left than their node reads,
        then of the pool."""
        c_, l_ = self.streams, self.block
        rounds, rem = divmod(int(extra.sum()) + pool, l_ * c_)
        cap = rounds * l_ + np.clip(rem - np.arange(c_) * l_, 0, l_)  # tail positions each node serves
        own = np.minimum(extra, cap)
        surplus = [[c, self.shared + int(own[c]), int(extra[c] - own[c])] for c in range(c_) if extra[c] > own[c]]
        surplus += [[c_, 0, pool]] if pool else []
        tails = []
        for n in range(c_):
            pieces = [(n, self.shared, int(own[n]))] if own[n] else []
            want = int(cap[n] - own[n])
            while want:  # the surplus in stream order, node after node: a node gets one or two foreign pieces
                c, first, left = surplus[0]
                take = min(want, left)
                pieces.append((c, first, take))
                want -= take
                surplus[0][1:] = [first + take, left - take]
                if left == take:
                    surplus.pop(0)
            sizes = np.array([0] + [p[2] for p in pieces], dtype=np.int64)
            tails.append((np.cumsum(sizes), np.array([p[0] for p in pieces], dtype=np.int64),
                          np.array([p[1] for p in pieces], dtype=np.int64)))
        return tails

    # -- the permutation ------------------------------------------------------------------------------
    def at(self, positions: np.ndarray) -> np.ndarray:
        """``perm[positions]`` (a new int64 array), making only the windows those positions fall in."""
        positions = np.asarray(positions, dtype=np.int64)
        if not self.shuffle:
            return positions.copy()
        if not self.windowed:
            return self._whole()[positions]
        stream, local = self.locate(positions)
        if self.streams == 1:
            return self._stream_at(0, local)
        out = np.empty(len(positions), dtype=np.int64)
        for c in np.unique(stream).tolist():
            sel = stream == c
            out[sel] = self._stream_at(c, local[sel])
        return out

    def span(self, lo: int, hi: int) -> np.ndarray:
        """``perm[lo:hi]`` (int64): `at` of a run of positions, a view where the permutation is made whole
        (read it, never write to it)."""
        if self.shuffle and not self.windowed:
            return self._whole()[lo:hi]
        return self.at(np.arange(lo, hi, dtype=np.int64))

    def __getstate__(self) -> dict[str, Any]:
        """A copy leaves out the permutation made whole (made again when read) and its lock."""
        return {**self.__dict__, "_full": None, "_full_lock": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._full_lock = threading.Lock()

    def _whole(self) -> np.ndarray:
        """The permutation made whole (no window), int64."""
        with self._full_lock:
            if self._full is None:
                self._full = np.random.default_rng((self.seed, self.epoch)).permutation(self.num_samples).astype(
                    np.int64, copy=False)
        return self._full

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(stream, place in that stream)`` of each position (windowed orders)."""
        p = np.asarray(positions, dtype=np.int64)
        if self.streams == 1:
            return np.zeros(len(p), dtype=np.int64), p
        inside = p < self.interleaved
        blocks = p // self.block
        stream = np.where(inside, blocks % self.streams, 0)
        local = np.where(inside, blocks // self.streams * self.block + p % self.block, 0)
        if not inside.all():  # the tail: node n's positions read the pieces dealt to it (_deal_tail)
            rest = np.flatnonzero(~inside)
            q = p[rest] - self.interleaved
            node = (q // self.block) % self.streams
            j = q // (self.block * self.streams) * self.block + q % self.block  # the node's j-th tail position
            for n in np.unique(node).tolist():
                sel = node == n
                offsets, streams, firsts = self.tails[n]
                k = np.searchsorted(offsets, j[sel], side="right") - 1
                stream[rest[sel]] = streams[k]
                local[rest[sel]] = firsts[k] + j[sel] - offsets[k]
        return stream, local

    def _stream_at(self, c: int, local: np.ndarray) -> np.ndarray:
        cum = self.cum[c]
        w = np.searchsorted(cum, local, side="right") - 1
        out = np.empty(len(local), dtype=np.int64)
        first, last = (int(w.min()), int(w.max())) if len(w) else (0, -1)
        if first == last:
            out[:] = self.window_samples(c, first)[local - cum[first]]
            return out
        for k in np.unique(w).tolist():
            sel = w == k
            out[sel] = self.window_samples(c, k)[local[sel] - cum[k]]
        return out

    def window_shards(self, c: int, w: int) -> np.ndarray:
        """The shards of window ``w`` of stream ``c`` (stream ``C``, the pool: one shard a window)."""
        width = self.widths[c]
        return self.stream_shards[c][w * width:(w + 1) * width]

    def window_samples(self, c: int, w: int) -> np.ndarray:
        """Window ``w`` of stream ``c`` in its shuffled order (the last few windows made are kept)."""
        key = (c, w)
        got = self._windows.get(key)
        if got is not None:
            self._windows.move_to_end(key)
            return got
        shards = self.window_shards(c, w)
        starts, ends = self.bounds[shards], self.bounds[shards + 1]
        if self.members is None:  # consecutive samples: ranges, nothing stored
            lengths = ends - starts
            offsets = np.repeat(starts - np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths)
            samples = np.arange(int(lengths.sum()), dtype=np.int64) + offsets
        else:
            samples = np.concatenate([self.members[a:b] for a, b in zip(starts.tolist(), ends.tolist())])
        got = np.random.default_rng((self.seed, self.epoch, c, w)).permutation(samples)
        self._windows[key] = got
        while len(self._windows) > 2:  # a rank reads one stream: its current window and the next
            self._windows.popitem(last=False)
        return got
