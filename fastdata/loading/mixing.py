"""The order FastLoader serves a Mixture in: one global schedule, each source on its own cursor, split by rank.

NOTE [mixture order]: the rules are NOTE [mixture] in fastdata/datasets/mixture.py; here is how they are kept.

1. A "segment" is a stretch of one mixture epoch with fixed weights: its epoch, the position it starts at,
   each source's cursor there (draws made so far, over all its epochs), the draws at which each source
   finishes the epoch it was in when the mixture epoch began (for ``stop``), and the weights. Position
   ``start + n`` takes the source and rank ``(k, m)`` the schedule gives ``n`` (NOTE [mixture schedule]),
   and so draw ``cursor[k] + m`` of source ``k`` (``m * batch_size`` onward with ``mix="batch"``).
2. A source's draw ``j`` is sample ``EpochOrder(N, seed_k, j // N).at(j % N)`` (NOTE [streamed order]):
   windows of shards are made as positions need them, so 2·10^9-sample sources cost what a window costs.
3. A new segment starts when the weights change (at the position reached) and at every mixture epoch (at
   position 0, with the cursors where the last epoch stopped). Nothing else is state: the state_dict holds
   the segment and the position, which are the same for every world size.
4. The state also holds the previous epoch's last segment, so that a consumer that reports an earlier
   ``(epoch, position)`` (CUDAPrefetcher's batches fetched but not handed out) still resumes exactly.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Union

import numpy as np

from ..datasets.mixture import SHIFT
from ..distributed import dist_rank_world
from ..errors import ConfigError, is_whole
from .mixture_state import END, check_state
from .order import EpochOrder, group_by_shard
from .sampler import DistributedBatchSampler
from .schedule import Schedule, quantise

log = logging.getLogger(__name__)


@dataclass
class Segment:
    """NOTE [mixture order] 1: ``start`` and ``length`` in positions (samples, or batches with mix="batch")."""

    epoch: int
    start: int
    cursors: np.ndarray  # int64, per source
    targets: np.ndarray  # int64, per source
    weights: list[int]  # quantised (the schedule's)
    schedule: Schedule
    shares: list[float]  # the weights as given, normalised
    length: int = 0  # the epoch's nominal end (a position), before rounding to whole steps

    def cursors_at(self, position: int, unit: int) -> np.ndarray:
        n = position - self.start
        return self.cursors + np.array([self.schedule.count(k, n) for k in range(len(self.cursors))],
                                       dtype=np.int64) * unit


class MixtureSampler:
    """Batches of a `Mixture` for one rank (NOTE [mixture order]); the
    interface of `DistributedBatchSampler` (state, resume, set_epoch).

    Args:
        mixture: the Mixture.
        batch_size: samples a batch.
        drop_last: round each epoch down to whole steps of ``world * batch_size`` instead of up.
        pad: False serves exactly each epoch's positions (ranks may get a batch fewer; for evaluation); with
            ``drop_last`` too, the epoch is cut to whole steps as with padding (every batch full).
        rank, world_size: default: torch.distributed's, else ``(0, 1)``.
        shuffle, seed, shuffle_window: FastLoader's; a mixture's own apply (these must be left as they are).
    """

    def __init__(self, mixture: Any, batch_size: int, *, drop_last: bool = False, pad: bool = True,
                 rank: Optional[int] = None, world_size: Optional[int] = None, shuffle: bool = True, seed: int = 0,
                 shuffle_window: Optional[int] = None) -> None:
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"batch_size must be a positive integer, got batch_size={batch_size!r}")
        if shuffle is not True or seed not in (0, mixture.seed) or shuffle_window is not None:
            raise ConfigError(f"a Mixture's order is set on the Mixture: pass seed, shuffle and shuffle_window to "
                              f"Mixture(...), not to the loader (got shuffle={shuffle!r}, seed={seed!r}, "
                              f"shuffle_window={shuffle_window!r})")
        self.mixture, self.batch_size, self.drop_last, self.pad = mixture, batch_size, drop_last, pad
        self.rank, self.world_size = dist_rank_world(rank, world_size)
        self.seed = mixture.seed
        self.unit = batch_size if mixture.mix == "batch" else 1  # draws a position takes
        self.per = batch_size // self.unit  # positions a rank's batch takes
        self.sizes = np.array(mixture.sizes, dtype=np.int64)
        self._shards = [self._shard_layout(ds, w) for ds, w in zip(mixture.sources, mixture.shuffle_window)]
        self._orders: list[dict[int, EpochOrder]] = [{} for _ in mixture.sources]
        self._seeds = [mixture.source_seed(k) for k in range(len(mixture.sources))]
        self._previous: Optional[Segment] = None  # the last epoch's last segment, and where it stopped
        self._quantised: Optional[tuple[tuple[float, ...], list[int]]] = None
        self._previous_end = 0
        self.seg = self._first_segment(0, np.zeros(len(self.sizes), dtype=np.int64))
        if mixture.stop is None and drop_last and self.seg.length < self.world_size * self.per:
            raise ConfigError(f"epoch_size={mixture.epoch_size} is less than one step of {self.world_size} ranks "
                              f"x batch_size={batch_size} and drop_last=True drops it: every epoch would be "
                              "empty; raise epoch_size or pass drop_last=False")
        self.start, self.served = 0, 0

    @staticmethod
    def _shard_layout(ds: Any, window: Optional[int]) -> tuple[Optional[np.ndarray], Optional[np.ndarray]]:
        if window is None:
            return None, None
        bounds = ds.shard_bounds() if hasattr(ds, "shard_bounds") else None
        if bounds is None and hasattr(ds, "sample_shards"):
            return group_by_shard(ds.sample_shards())
        if bounds is None:
            raise ConfigError(f"shuffle_window needs each sample's shard; {ds!r} does not say where its samples are")
        return np.asarray(bounds, dtype=np.int64), None

    @property
    def epoch(self) -> int:
        return self.seg.epoch

    # -- segments -------------------------------------------------------------------------------------
    def _quantise(self, shares: list[float]) -> list[int]:
        """`quantise`, remembered for the last weights: a loader pass asks twice (~0.2 ms each)."""
        key = tuple(shares)
        last = self._quantised  # (one attribute: a cache's planning thread may ask too)
        if last is None or last[0] != key:
            last = self._quantised = (key, quantise(shares))
        return list(last[1])

    def _segment(self, epoch: int, start: int, cursors: np.ndarray, targets: np.ndarray,
                 shares: list[float]) -> Segment:
        weights = self._quantise(shares)
        seg = Segment(epoch, start, cursors, targets, weights, Schedule(weights, (self.seed, epoch, start)),
                      list(shares))
        seg.length = self._length(seg)
        return seg

    def _first_segment(self, epoch: int, cursors: np.ndarray) -> Segment:
        """Epoch ``epoch`` from its start, the sources at ``cursors``, under the mixture's weights."""
        targets = (cursors // self.sizes + 1) * self.sizes  # the end of each source's current epoch
        seg = self._segment(epoch, 0, cursors, targets, self.mixture._weights)
        step = self.world_size * self.per
        if self.mixture.stop is not None and self.drop_last and 0 < seg.length < step:
            # Rounded down to no step, nothing would be served and nothing move: every epoch after it empty
            # too (a source's rest after an epoch rounded down, or sources smaller than a step). A source
            # whose rest the first step takes aims at the end of its epoch after the draws that step gives it.
            took = np.array([seg.schedule.count(k, step) * self.unit for k in range(len(targets))], dtype=np.int64)
            short = cursors + took >= targets
            targets[short] = ((cursors + took) // self.sizes + 1)[short] * self.sizes[short]
            seg = self._segment(epoch, 0, cursors, targets, self.mixture._weights)
        return seg

    def _length(self, seg: Segment) -> int:
        """The epoch's nominal end (NOTE [mixture] 4)."""
        if self.mixture.stop is None:
            return -(-self.mixture.epoch_size // self.unit)
        if self.mixture.stop == "first" and np.any(seg.cursors >= seg.targets):
            return seg.start  # (new weights in the epoch's last step, after a source ran out)
        ends = [seg.start + seg.schedule.positions_for(k, -(-int(seg.targets[k] - seg.cursors[k]) // self.unit))
                for k in range(len(self.sizes)) if seg.weights[k] > 0 and seg.targets[k] > seg.cursors[k]]
        if not ends:
            return seg.start
        return min(ends) if self.mixture.stop == "first" else max(ends)

    def _end(self, seg: Segment, start: int) -> int:
        """Where the epoch resumed at ``start`` stops: its rest in whole steps (NOTE [mixture] 4)."""
        rest, step = max(0, seg.length - start), self.world_size * self.per
        if self.drop_last:  # (with pad=False too: a single dataset's drop_last cuts to full batches either way)
            return start + rest // step * step
        return start + (-(-rest // step) * step if self.pad else rest)

    def _next(self, seg: Segment, start: int) -> Segment:
        """The next epoch's first segment, after this one served from ``start`` to its end."""
        return self._first_segment(seg.epoch + 1, seg.cursors_at(self._end(seg, start), self.unit))

    def _sync(self) -> None:
        """When the mixture's weights changed: a new segment from the position reached (NOTE [mixture order]
        3). Run where no iteration is live: at the start of one (`batches`) and at a resume."""
        self.seg, self.start, self.served = self._synced()

    def _synced(self) -> tuple[Segment, int, int]:
        """The segment, start and batches served that `_sync` makes now (the current ones while the weights
        are the segment's): what the next iteration serves, so ``len`` counts it too."""
        if self._quantise(self.mixture._weights) == self.seg.weights:
            return self.seg, self.start, self.served
        p = self.position()
        if p == 0 and self.seg.start == 0:  # the epoch's start: its first segment, under the new weights
            return self._first_segment(self.epoch, self.seg.cursors), p, 0  # (never empty: NOTE [mixture] 4)
        return self._segment(self.epoch, p, self.seg.cursors_at(p, self.unit), self.seg.targets,
                             self.mixture._weights), p, 0

    # -- the stream -----------------------------------------------------------------------------------
    def _order(self, k: int, epoch: int, cache: dict[int, EpochOrder]) -> EpochOrder:
        got = cache.get(epoch)
        if got is None:
            while len(cache) >= 2:
                cache.pop(next(iter(cache)))
            bounds, members = self._shards[k]
            got = cache[epoch] = EpochOrder(int(self.sizes[k]), self._seeds[k], epoch,
                                            shuffle=self.mixture.shuffle[k], window=self.mixture.shuffle_window[k],
                                            bounds=bounds, members=members)
        return got

    def codes(self, seg: Segment, positions: Union[np.ndarray, range],
              orders: Optional[list[dict[int, EpochOrder]]] = None, *, ascending: bool = False) -> np.ndarray:
        """The served indices (``(source << 56) | sample``) of ``positions`` of segment ``seg``, in order (a
        position gives ``unit`` of them). ``ascending``: the positions are, so each source's draws are too (a
        range of them, the sampler's, always is: it is dealt faster still, NOTE [mixture schedule] 5)."""
        orders = self._orders if orders is None else orders
        unit = self.unit
        out = np.empty(len(positions) * unit, dtype=np.int64)
        if isinstance(positions, range):
            n: Union[np.ndarray, range] = range(positions.start - seg.start, positions.stop - seg.start,
                                                positions.step)
            ascending = ascending or positions.step > 0
        else:
            n = positions - seg.start
        for k, sel, m in seg.schedule.deal(n, runs=ascending):
            if unit > 1 and sel is not None:  # mix="batch": a position is `unit` consecutive draws, in as many rows
                sel = (sel[:, None] * unit + np.arange(unit, dtype=np.int64)).ravel()
            rows = slice(None) if sel is None else sel
            if isinstance(m, range):  # consecutive ranks: consecutive draws
                self._run_codes(k, int(seg.cursors[k]) + m.start * unit, len(m) * unit, rows, out, orders[k])
                continue
            if unit == 1:
                draws = m
                draws += int(seg.cursors[k])  # (in place: deal's ranks are new arrays, n too)
            else:
                draws = int(seg.cursors[k]) + m * unit
                draws = (draws[:, None] + np.arange(unit, dtype=np.int64)).ravel()
            if ascending:
                self._ascending_codes(k, draws, rows, out, orders[k])
                continue
            epochs, places = np.divmod(draws, int(self.sizes[k]))
            first, last = int(epochs.min()), int(epochs.max())  # one or two, unless the source is small
            if first == last:
                out[rows] = self._order(k, first, orders[k]).at(places) | (k << SHIFT)
                continue
            row = np.arange(len(out))[rows]
            for e in range(first, last + 1):
                here = epochs == e
                out[row[here]] = self._order(k, e, orders[k]).at(places[here]) | (k << SHIFT)
        return out

    def _ascending_codes(self, k: int, draws: np.ndarray, sel: Any, out: np.ndarray, cache: dict[int, EpochOrder]
                         ) -> None:
        """`codes` for source ``k``'s ascending ``draws`` into ``out[sel]``: each source epoch's draws are one
        run, found by its bounds (a loader pass of 2**16 positions: no divmod, mask or row list per draw).
        ``draws`` is spent."""
        size = int(self.sizes[k])
        first, last = int(draws[0]) // size, int(draws[-1]) // size
        if first == last:
            draws -= first * size  # (the caller's to spend)
            got = self._order(k, first, cache).at(draws)
            if k:
                got |= k << SHIFT  # (at gives a new array)
            out[sel] = got
            return
        cuts = [0, *draws.searchsorted(np.arange(first + 1, last + 1, dtype=np.int64) * size).tolist(), len(draws)]
        rows = None if isinstance(sel, slice) else sel  # (a slice is every row: run a:c is rows a:c)
        for e, a, c in zip(range(first, last + 1), cuts, cuts[1:]):
            if c > a:
                out[slice(a, c) if rows is None else rows[a:c]] = \
                    self._order(k, e, cache).at(draws[a:c] - e * size) | (k << SHIFT)

    def _run_codes(self, k: int, draw: int, count: int, sel: Any, out: np.ndarray, cache: dict[int, EpochOrder]
                   ) -> None:
        """`codes` for source ``k``'s draws ``draw .. draw + count - 1`` into ``out[sel]`` (``sel`` the rows, in
        draw order: a slice of every row, or their places): a slice of each source epoch's order they reach,
        nothing per draw but the source's bits."""
        size, code = int(self.sizes[k]), k << SHIFT
        for e in range(draw // size, (draw + count - 1) // size + 1):
            lo, hi = max(draw, e * size), min(draw + count, (e + 1) * size)  # the draws in source epoch e
            samples = self._order(k, e, cache).span(lo - e * size, hi - e * size)  # (perhaps a view: read only)
            if isinstance(sel, slice):
                np.bitwise_or(samples, code, out=out[lo - draw:hi - draw])
            else:
                out[sel[lo - draw:hi - draw]] = samples | code if k else samples

    def _rank_count(self, seg: Segment, start: int) -> int:
        """The positions this rank serves of ``seg`` resumed at ``start``: its block of each step (NOTE [mixture]
        1), the last step's perhaps short or empty (``pad=False``)."""
        per, step = self.per, self.world_size * self.per
        steps, rest = divmod(self._end(seg, start) - start, step)
        return steps * per + min(per, max(0, rest - self.rank * per))

    def _stream(self, seg: Segment, start: int, served: int, orders: Optional[list[dict[int, EpochOrder]]] = None
                ) -> Iterator[np.ndarray]:
        """This rank's batches of ``seg`` resumed at ``start``, from batch ``served`` on, a chunk at a time: its
        ``c``-th position is the ``c % per``-th of its block in step ``c // per`` (NOTE [mixture] 1)."""
        count, per, world = self._rank_count(seg, start), self.per, self.world_size
        step = per * max(1, (1 << 16) // self.batch_size)
        for c0 in range(served * per, count, step):
            c1 = min(count, c0 + step)
            positions: Union[range, np.ndarray]
            if world == 1 or per == 1:  # (one rank, or a position a batch: every world-th position from rank's)
                positions = range(start + c0 * world + self.rank, start + c1 * world + self.rank, world)
            else:
                c = np.arange(c0, c1, dtype=np.int64)
                positions = start + (c // per) * (world * per) + self.rank * per + c % per
            chunk = self.codes(seg, positions, orders, ascending=True)
            for i in range(0, len(chunk), self.batch_size):
                yield chunk[i:i + self.batch_size]

    def batches(self) -> Iterator[np.ndarray]:
        """This rank's batches from the current position (int64 arrays; does not advance the state), under the
        mixture's weights of this moment."""
        self._sync()
        return self._stream(self.seg, self.start, self.served)

    def coming_batches(self) -> "Coming":
        """`batches`, then the next epoch's: the reads a streamed source's cache plans for."""
        return Coming(self, self.seg, self.start, self.served)

    __iter__ = DistributedBatchSampler.__iter__  # batches(), each advancing the state, then end_epoch()

    def epoch_batches(self) -> int:
        """Batches this rank serves in the current epoch from its start (under weights set since: the next
        iteration's)."""
        return self.epochs_batches(1)[0]

    def __len__(self) -> int:
        """Batches this rank serves in the rest of the current epoch (under weights set since)."""
        seg, start, served = self._synced()
        return -(-self._rank_count(seg, start) // self.per) - served

    def epochs_batches(self, epochs: int) -> list[int]:
        """Batches this rank serves in each of the next ``epochs`` epochs from the current one's start, under
        the weights of this moment: with ``stop``, an epoch ends when its sources do, so epochs differ (a
        learning-rate schedule over ``--epochs`` sums them; ``len`` is the current epoch's only)."""
        seg, counts = self._synced()[0], []
        for k in range(epochs):
            counts.append(-(-self._rank_count(seg, 0) // self.per))
            if k + 1 < epochs:  # (the epoch after the last one counted is not made)
                seg = self._next(seg, 0)
        return counts

    # -- progress and resumption ----------------------------------------------------------------------
    def advance(self, batches: int = 1) -> None:
        self.served += batches

    def end_epoch(self) -> None:
        """The epoch was served: the next starts where its sources stopped."""
        self._previous = self.seg
        self._previous_end = self._end(self.seg, self.start)
        self.seg = self._next(self.seg, self.start)
        self.start = self.served = 0

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch: the current one stays where it is; a later one follows the epochs between (their
        rest counted as served); an earlier one is replayed from epoch 0 under the current weights."""
        if not is_whole(epoch) or epoch < 0:
            raise ConfigError(f"set_epoch takes an epoch number >= 0, got {epoch!r}")
        if epoch < self.epoch:
            self.seg, self.start, self.served = self._first_segment(0, np.zeros_like(self.sizes)), 0, 0
            self._previous = None
        while self.epoch < epoch:
            self.end_epoch()

    def batch_position(self, k: int) -> int:
        """Position of this epoch's ``k``-th batch since ``start`` (the same on every rank)."""
        return self.start + k * self.per * self.world_size

    def position(self) -> int:
        """Position reached: every position before it has been served by some rank."""
        return min(self._end(self.seg, self.start), self.batch_position(self.served))

    def _record(self, seg: Segment, end: int) -> dict[str, Any]:
        names = self.mixture.names
        return {"epoch": seg.epoch, "start": seg.start, "end": end,
                "cursors": dict(zip(names, seg.cursors.tolist())), "targets": dict(zip(names, seg.targets.tolist())),
                "weights": dict(zip(names, seg.weights))}

    def state_dict(self) -> dict[str, Any]:
        """World-size independent (NOTE [mixture order] 3): ``position`` in the epoch (samples, or batches with
        mix="batch"), each source's ``{"epoch", "position"}`` there, the weights, and the segments.
        ``num_samples`` is past any epoch's end: a consumer that marks an epoch served in full by
        ``position = num_samples`` resumes at the epoch's end."""
        m, p = self.mixture, self.position()
        cursors = self.seg.cursors_at(p, self.unit)
        segments = [self._record(self.seg, self._end(self.seg, self.start))]
        if self._previous is not None:
            segments.insert(0, self._record(self._previous, self._previous_end))
        return {"mixture": {"sources": list(m.names), "sizes": [int(n) for n in m.sizes], "seed": m.seed,
                            "mix": m.mix, "stop": m.stop, "epoch_size": m.epoch_size_given,
                            "draws_a_position": self.unit, **self.orders_and_versions()},
                "epoch": self.epoch, "position": p, "num_samples": END,
                "sources": {n: {"epoch": int(c // s), "position": int(c % s)}
                            for n, c, s in zip(m.names, cursors.tolist(), self.sizes.tolist())},
                "weights": dict(zip(m.names, self.seg.shares)),
                "segments": segments}

    def orders_and_versions(self) -> dict[str, dict[str, Any]]:
        """Each source's order options, the version of its data (its manifest's digest, where it has one) and
        which of its samples a position means (a split's, token windows: `state_key`): a state resumed on other
        orders or other data would repeat and skip samples."""
        m = self.mixture
        versions = {n: getattr(ds, "manifest_sha256", None) for n, ds in zip(m.names, m.sources)}
        keys = {n: getattr(ds, "state_key", None) for n, ds in zip(m.names, m.sources)}  # (a split, token windows)
        return {"shuffle": dict(zip(m.names, m.shuffle)), "shuffle_window": dict(zip(m.names, m.shuffle_window)),
                "versions": {n: v for n, v in versions.items() if v is not None},
                "keys": {n: k for n, k in keys.items() if k is not None}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue a saved stream (at any world size); the mixture's weights, if they differ from the saved
        ones, apply from the saved position on (NOTE [mixture] 6).

        Raises:
            ConfigError: the state is from another mixture (other seed, sources, sizes, options, orders or
                versions of a source's data: named), or damaged.
        """
        check_state(self, state)
        epoch, position = int(state["epoch"]), int(state["position"])
        records = [r for r in state["segments"] if int(r["epoch"]) == epoch and int(r["start"]) <= position]
        if not records:
            raise ConfigError(f"the mixture state has no segment for epoch {epoch} at position {position}: "
                              "it was not saved by a MixtureSampler")
        rec, position = records[-1], min(position, int(records[-1]["end"]))
        saved_names = list(state["mixture"]["sources"])
        weights = [int(rec["weights"][n]) for n in saved_names]  # quantised: they give themselves back
        targets = self._by_name({n: int(rec["targets"][n]) for n in saved_names}, self.sizes)
        if saved_names == self.mixture.names:  # the saved segment itself: the same stream on
            seg = self._segment(epoch, int(rec["start"]), self._by_name(rec["cursors"], self.sizes * 0), targets,
                                weights)
            if self._quantise(self.mixture._weights) == seg.weights:
                seg.shares = list(self.mixture._weights)
            elif self.rank == 0:  # (a --resume without the :WEIGHTs gives equal ones: said, once, not silent)
                log.info("mixture weights %s (saved) -> %s from epoch %d, position %d",
                         _shares(saved_names, [w / sum(weights) for w in weights]),
                         _shares(self.mixture.names, self.mixture._weights), epoch, position)
            self.seg, self.start, self.served, self._previous = seg, position, 0, None
            self._sync()  # the mixture's own weights, when they are not the saved ones
            return
        if sorted(saved_names) == sorted(self.mixture.names) and self.rank == 0:  # (the schedule deals by index)
            log.info("mixture sources in another order than saved (%s, now %s): each source continues its own "
                     "order, exactly once, but the interleaving from position %d on is not the saved run's; keep "
                     "the order to resume it bit for bit", ", ".join(saved_names), ", ".join(self.mixture.names),
                     position)
        # other sources (allow_new_sources): each cursor at the position, by the saved schedule; a new segment
        saved = Schedule(weights, (self.seed, epoch, int(rec["start"])))
        at = {n: int(rec["cursors"][n]) + saved.count(i, position - int(rec["start"])) * self.unit
              for i, n in enumerate(saved_names)}
        self.seg = self._segment(epoch, position, self._by_name(at, self.sizes * 0), targets, self.mixture._weights)
        self.start, self.served, self._previous = position, 0, None

    def _by_name(self, values: dict[str, Any], default: np.ndarray) -> np.ndarray:
        """Per source of this mixture, ``values[name]``, or ``default``'s entry for a source not in them."""
        return np.array([int(values.get(n, d)) for n, d in zip(self.mixture.names, default.tolist())], dtype=np.int64)


def _shares(names: list[str], shares: Any) -> str:
    return "{" + ", ".join(f"{n}: {float(w):.3g}" for n, w in zip(names, shares)) + "}"


class Coming:
    """The coming batches of a sampler (this epoch's rest, then the next epoch's), computed apart from the
    sampler's own orders, so a cache's planning thread may run it; `of_source` gives one source's share."""

    def __init__(self, sampler: MixtureSampler, seg: Segment, start: int, served: int) -> None:
        self.sampler, self.seg, self.start, self.served = sampler, seg, start, served

    def __iter__(self) -> Iterator[np.ndarray]:
        s = self.sampler
        orders: list[dict[int, EpochOrder]] = [{} for _ in s.sizes]
        yield from s._stream(self.seg, self.start, self.served, orders)
        yield from s._stream(s._next(self.seg, self.start), 0, 0, orders)

    def of_source(self, k: int) -> Iterator[np.ndarray]:
        """Source ``k``'s sample indices of each coming batch (empty where a batch has none of it)."""
        for codes in self:
            yield np.sort(codes[(codes >> SHIFT) == k] & ((1 << SHIFT) - 1))
