"""Which cached shards may go to make room, decided from a `Plan` of the coming reads alone (no
files, no locks): the rules of NOTE [shard cache] in fastdata/storage/cache.py, which applies them to the disk."""
from __future__ import annotations

import numpy as np

from .plan import Plan


def farthest_first(plan: Plan, candidates: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(order, next uses)`` of ``candidates``: positions into them, the shard needed last first (never
    again before all), ties in shard order (Belady's rule over the known order)."""
    nxt = plan.next_uses(candidates)
    return np.argsort(-nxt, kind="stable"), nxt


def harmless(plan: Plan, s: int, sizes: np.ndarray, next_uses: np.ndarray, short: int) -> bool:
    """Whether evicting shards of ``sizes`` and ``next_uses`` (free now, in `farthest_first` order) frees
    ``short`` bytes using only shards needed after ``s``: a prefetch of ``s`` does no harm."""
    room = np.cumsum(sizes)
    k = int(np.searchsorted(room, short)) + 1
    return len(room) > 0 and room[-1] >= short and bool((next_uses[:k] > plan.next_use(s)).all())


def near(plan: Plan, s: int, sizes: np.ndarray, present: np.ndarray, limit: int) -> bool:
    """Whether the bytes cached or arriving (``present``) that are read before ``s`` (a prefetch's lookahead),
    with ``s``, stay within a quarter of ``limit``: then a prefetch of ``s`` may evict any shard needed
    after it."""
    cached = np.flatnonzero(present)
    ahead = int(sizes[cached[plan.next_uses(cached) < plan.next_use(s)]].sum())
    return ahead + int(sizes[s]) <= limit // 4


def reader_would_evict(plan: Plan, s: int, sizes: np.ndarray, present: np.ndarray, busy: np.ndarray,
                       short: int) -> bool:
    """Whether fetching ``s`` now evicts what the reader would evict when ``s`` is due: the cached shards
    (``present``: in use or arriving included) ranked by their next use from then on, the first ``short``
    bytes of them not ``busy`` (pinned or arriving) now and not read before ``s``."""
    due = plan.next_use(s)
    cached = np.flatnonzero(present)
    nxt = plan.next_uses(cached)
    then = nxt.copy()  # next use from when s is due
    for k in np.flatnonzero(nxt < due).tolist():
        then[k] = plan.next_use(int(cached[k]), due)
    by_then = np.argsort(-then, kind="stable")
    room = np.cumsum(sizes[cached[by_then]])
    victims = by_then[:int(np.searchsorted(room, short)) + 1]
    if len(victims) == 0 or room[-1] < short:
        return False
    return bool(not busy[cached[victims]].any() and (nxt[victims] > due).all())
