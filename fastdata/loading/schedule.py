"""Which source each position of a mixture takes: a deterministic, low-discrepancy schedule.

NOTE [mixture schedule]: a `Schedule` deals the positions ``n = 0, 1, 2, ...`` of a stretch of a
mixture's stream (a "segment": one mixture epoch, or its part after the weights changed) to its sources.

1. The weights are quantised to integers summing to ``Q = 2**20`` (largest remainders; a positive weight
   keeps at least 1), so every step below is exact integer arithmetic, the same on every machine.
2. The sources are the leaves of a balanced binary tree. An inner node deals the positions that reach it
   to its two subtrees as a Bresenham line of slope ``p / q`` (``p`` the left subtree's weight, ``q`` both
   subtrees'): its ``m``-th position goes left iff ``f(m + 1) > f(m)`` with ``f(m) = (m * p + r) // q``,
   and is then the ``f(m)``-th position of the left subtree, else the ``(m - f(m))``-th of the right one.
   The phase ``r`` in ``[0, q)`` is drawn from ``(seed, epoch, segment start, node)``: a function of the
   seed and the position, never of coin flips made along the way.
3. So how many of the first ``n`` positions a source takes is a closed form evaluated in O(depth)
   (`Schedule.count`), any position's source and its rank among that source's positions too
   (`Schedule.locate`, vectorised over a batch): the schedule jumps to any position at no cost and
   holds O(sources) numbers, whatever the stream's length.
4. Each node's left count is within 1 of ``m * p / q``, so a source's count among the first ``n``
   positions is within ``depth`` of ``n * weight`` and its count in ANY window of positions within
   ``2 * depth``: 3 sources (depth 2) stay within 4 samples of their weight in every window of 10,000,
   0.04 %; 16 sources within 8.
5. Dealing a rank's positions ``a + i * s`` (`Schedule.deal` of a range) divides less: at the root,
   ``f(a + i * s) = W + (P + i * s * p) // q`` with ``a * p + r = W * q + P`` worked out once, and its
   ``q = Q`` makes that a shift. With ``s = 1`` (one rank) no position is divided at all: the positions that
   go left have consecutive ranks there, and so do those that go right, so each node deals a run again,
   its count from its parent's in O(1), a source's ranks are one run (read as one slice of each source
   epoch's order), and only a source's places among the positions are made, one closed form per node.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import numpy as np

from ..errors import ConfigError

Q = 1 << 20  # weight resolution: (m % q) * p + r < 2**41, far from int64's limit


def quantise(weights: Sequence[float]) -> list[int]:
    """Integer weights summing to `Q` in the proportions of ``weights`` (non-negative, not all zero)."""
    w = np.asarray(weights, dtype=np.float64)
    if len(w) == 0 or not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise ConfigError(f"weights must be finite, non-negative and not all zero, got weights={list(weights)!r}")
    exact = w / w.sum() * Q
    ints = np.floor(exact).astype(np.int64)
    ints[(w > 0) & (ints == 0)] = 1  # a positive weight is never rounded away
    short = Q - int(ints.sum())
    order = np.argsort(-(exact - np.floor(exact)), kind="stable")
    for k in order[: max(0, short)]:
        ints[k] += 1
    for k in np.argsort(-ints, kind="stable")[: max(0, -short)]:  # only when the minimum-1 rule overshot
        ints[k] -= 1
    return [int(v) for v in ints]


class Schedule:
    """The positions of one segment dealt to ``len(weights)`` sources (NOTE [mixture schedule]).

    Args:
        weights: integer weights from `quantise`.
        key: what the phases are drawn from, e.g. ``(seed, epoch, start)`` (non-negative integers).
    """

    def __init__(self, weights: Sequence[int], key: Sequence[int]) -> None:
        self.weights = [int(w) for w in weights]
        self.total = sum(self.weights)
        self.depth = 0
        left: list[int] = []
        right: list[int] = []
        p: list[int] = []
        q: list[int] = []
        paths: list[list[tuple[int, bool]]] = [[] for _ in self.weights]

        def build(lo: int, hi: int, path: list[tuple[int, bool]]) -> int:
            """Node over leaves ``lo .. hi - 1``: an inner node's number, or ``~leaf``."""
            if hi - lo == 1:
                paths[lo] = path
                self.depth = max(self.depth, len(path))
                return ~lo
            node, mid = len(left), (lo + hi) // 2
            left.append(0)
            right.append(0)
            wl, wr = sum(self.weights[lo:mid]), sum(self.weights[mid:hi])
            p.append(wl if wl + wr else 0)
            q.append(wl + wr if wl + wr else 1)
            left[node] = build(lo, mid, path + [(node, True)])
            right[node] = build(mid, hi, path + [(node, False)])
            return node

        self.root = build(0, len(self.weights), [])
        self.left, self.right = np.array(left, dtype=np.int64), np.array(right, dtype=np.int64)
        self.p, self.q = np.array(p, dtype=np.int64), np.array(q, dtype=np.int64)
        rng = np.random.default_rng([int(k) for k in key] + [0x5C4ED])
        self.r = (rng.integers(0, 1 << 62, len(p)) % np.maximum(self.q, 1)).astype(np.int64) if p else \
            np.zeros(0, dtype=np.int64)
        self.paths = paths

    def locate(self, n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(source, rank)`` of each position ``n`` (int64 arrays): position ``n`` is the ``rank``-th
        (from 0) of its source's positions in this segment."""
        m = np.asarray(n, dtype=np.int64).copy()
        node = np.full(len(m), self.root, dtype=np.int64)
        for _ in range(self.depth):
            inner = np.flatnonzero(node >= 0)
            if not len(inner):
                break
            k = node[inner]
            p, q, r, mk = self.p[k], self.q[k], self.r[k], m[inner]
            whole, part = np.divmod(mk, q)
            carry, rem = np.divmod(part * p + r, q)
            f0 = whole * p + carry  # f(m): positions before this one that went left (f(0) = 0, as r < q)
            go_left = rem + p >= q  # f(m + 1) = f(m) + (rem + p) // q, and p <= q
            m[inner] = np.where(go_left, f0, mk - f0)
            node[inner] = np.where(go_left, self.left[k], self.right[k])
        return ~node, m

    def deal(self, n: Union[np.ndarray, range], *, runs: bool = False
             ) -> list[tuple[int, Optional[np.ndarray], Union[np.ndarray, range]]]:
        """`locate` grouped by source: ``(source, where, rank)`` for each source given some of the
        positions ``n``, ``where`` their places in ``n`` (ascending; None: all of them) and ``rank`` what
        `locate` gives them. The same integer arithmetic, walked node by node so that each node divides by
        one number and no position is looked up twice: several times faster per position than `locate`
        (the sampler deals 2**16 positions at a time). ``n`` may be a `range` (the sampler's: a rank's
        positions, ``step`` the world size), which is faster still (NOTE [mixture schedule] 5).

        Args:
            n: positions (int64), or a range of them.
            runs: give a source's ranks as a `range` where ``n`` is a range of step 1 (they are consecutive
                then), else always as an int64 array.
        """
        found: list[tuple[int, Optional[np.ndarray], Union[np.ndarray, range]]] = []
        if isinstance(n, range) and n.step == 1:
            return self._deal_run(n, runs)
        if isinstance(n, range) and (n.step < 1 or (len(n) + 1) * n.step >= 1 << 41):  # (_split's bound)
            n = np.arange(n.start, n.stop, n.step, dtype=np.int64)
        if isinstance(n, range):
            big = len(n) > 0 and n[-1] >= 1 << 41
        else:
            n = np.asarray(n, dtype=np.int64)
            big = len(n) > 0 and int(n.max()) >= 1 << 41  # ranks are no larger than positions
        todo: list[tuple[int, Optional[np.ndarray], Union[np.ndarray, range]]] = [(self.root, None, n)]
        while todo:
            node, where, m = todo.pop()
            if not len(m):
                continue
            if node < 0:
                if isinstance(m, range):  # (a source of all the weight: the root is its leaf)
                    m = np.arange(m.start, m.stop, m.step, dtype=np.int64)
                found.append((~node, where, m))
                continue
            left, right, m_left, m_right = self._split(node, m, big)
            todo.append((int(self.right[node]), right if where is None else where[right], m_right))
            todo.append((int(self.left[node]), left if where is None else where[left], m_left))
        found.sort(key=lambda g: g[0])
        return found

    def _split(self, node: int, m: Union[np.ndarray, range], big: bool
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Node ``node``'s positions ``m`` (an array, or a range of any step): the places in ``m`` of those
        that go left and of those that go right, and their ranks there: ``f(m)`` and ``m - f(m)``. ``big``:
        some ``m`` may reach 2**41, so ``m * p`` is split at ``q``. (Few temporaries, written in place: the
        sampler's are 2**16 long, and fresh pages cost more than the arithmetic.)"""
        p, q, r = int(self.p[node]), int(self.q[node]), int(self.r[node])
        shift = q.bit_length() - 1 if q & (q - 1) == 0 else -1  # q a power of two (the root's Q): shifts, masks
        if isinstance(m, range):  # m = a + i * s: f(m) = whole + (part + i * s * p) // q (NOTE 5 above)
            whole, part = divmod(m.start * p + r, q)
            t = np.arange(len(m), dtype=np.int64)
            t *= m.step * p
            t += part  # < (len(m) + 1) * s * q < 2**61 (deal's bound)
        elif big:  # f(m) = (m // q) * p + ((m % q) * p + r) // q, as locate computes it
            whole = m >> shift if shift >= 0 else m // q
            t = m & (q - 1) if shift >= 0 else m - whole * q
            t *= p
            t += r  # < 2**41
            whole *= p
        else:
            t = m * p
            t += r  # < 2**61
        f0 = t >> shift if shift >= 0 else t // q
        if shift >= 0:
            t &= q - 1
        else:
            t -= f0 * q
        go_left = t >= q - p  # f(m + 1) > f(m)
        del t
        left, right = np.flatnonzero(go_left), np.flatnonzero(~go_left)
        if big and not isinstance(m, range):
            f0 += whole
        m_left = f0[left]
        if isinstance(m, range):
            m_left += whole
            m_right = right * m.step
            m_right += m.start - whole
        else:
            m_right = m[right]
        m_right -= f0[right]
        return left, right, m_left, m_right

    def _deal_run(self, n: range, runs: bool) -> list[tuple[int, Optional[np.ndarray], Union[np.ndarray, range]]]:
        """`deal` of consecutive positions (NOTE [mixture schedule] 5): a node's run of ``count`` positions from
        ``m`` sends ``f(m + count) - f(m)`` left, so each node gets a run and its count from its parent in
        O(1); only a source's places in ``n`` are made per position, from its own ordinals ``j`` back up its
        path: the ``j``-th of a node's positions to go left is its ``((j + 1) * q - P - 1) // p``-th, the
        ``j``-th to go right its ``(j * q + P) // (q - p)``-th (``P = (m * p + r) % q``)."""
        found: list[tuple[int, Optional[np.ndarray], Union[np.ndarray, range]]] = []
        todo: list[tuple[int, int, int, tuple[tuple[int, int, int], ...]]] = [(self.root, n.start, len(n), ())]
        while todo:
            node, m, count, up = todo.pop()  # up: per node above, (q, add, divisor): j -> (j * q + add) // divisor
            if not count:
                continue
            if node < 0:
                where = None
                if up:
                    where = np.arange(count, dtype=np.int64)
                    for q, add, divisor in reversed(up):
                        where *= q
                        where += add
                        where //= divisor
                found.append((~node, where, range(m, m + count) if runs else
                              np.arange(m, m + count, dtype=np.int64)))
                continue
            p, q, r = int(self.p[node]), int(self.q[node]), int(self.r[node])
            whole, part = divmod(m * p + r, q)
            lefts = (count * p + part) // q
            todo.append((int(self.right[node]), m - whole, count - lefts, up + ((q, part, q - p),)))
            todo.append((int(self.left[node]), whole, lefts, up + ((q, q - part - 1, p),)))
        found.sort(key=lambda g: g[0])
        return found

    def count(self, source: int, n: int) -> int:
        """How many of the first ``n`` positions go to ``source``."""
        m = int(n)
        for node, went_left in self.paths[source]:
            p, q, r = int(self.p[node]), int(self.q[node]), int(self.r[node])
            lefts = (m * p + r) // q  # r < q: none before the first position
            m = lefts if went_left else m - lefts
        return m

    def positions_for(self, source: int, draws: int) -> int:
        """The fewest positions from the segment's start that give ``source`` ``draws`` (>= 1) positions."""
        if self.weights[source] == 0:
            raise ConfigError(f"source {source} has weight 0: it takes no position")
        lo, hi = draws, (draws + 2 * self.depth + 2) * self.total // self.weights[source] + 1
        while self.count(source, hi) < draws:  # never taken: the bound above holds (NOTE [mixture schedule] 4)
            hi *= 2
        while lo < hi:
            mid = (lo + hi) // 2
            if self.count(source, mid) >= draws:
                hi = mid
            else:
                lo = mid + 1
        return lo
