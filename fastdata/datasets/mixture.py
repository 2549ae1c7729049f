"""Mixture: several datasets served as one, each by its weight (NOTE [mixture]).

NOTE [mixture]: the rules a `Mixture` served by FastLoader keeps (the order itself lives in
fastdata/loading/mixing.py, the schedule in fastdata/loading/schedule.py):

1. One global stream of positions, the same for every world size, served a step of ``world * batch_size``
   positions at a time; rank ``r`` serves the ``r``-th block of ``batch_size`` positions of each step, so
   every rank's batch holds each source's share (with ``mix="batch"`` a position is a batch: position ``r``
   of each step). Every position before a step's end is served when every rank has served its batch.
2. Which source a position takes is a function of ``(seed, epoch, position)`` and the weights: a
   low-discrepancy schedule (NOTE [mixture schedule]), so every window of 10,000 positions holds each
   source's share within a few samples, not only on average.
3. Each source walks its own order (its own ``shuffle``, ``shuffle_window`` and a seed drawn from the
   mixture's seed and the source's name) with its own cursor ``(epoch, position)``: the ``j``-th draw of a
   source is sample ``order(j // N)[j % N]``. So every source is served exactly once per source epoch,
   across all ranks, whatever the weights did meanwhile; a source that runs out starts its next epoch.
4. A mixture epoch ends after ``epoch_size`` draws (default: the sources' total; ``mix="batch"``: rounded up to
   whole batches), or with ``stop="first"`` when the first source finishes the source epoch it was in when the
   mixture's epoch began, ``stop="all"`` when every source (of positive weight) has. It is served in whole steps
   of ``world * batch_size`` positions (rounded up; down with ``drop_last``, whatever ``pad`` says; exactly with
   ``pad=False`` alone): the extra positions are the stream's next draws, never repeats, and the next epoch
   starts where this one stopped. An epoch of ``stop="first"`` or ``"all"`` that ``drop_last`` would round down
   to no step (a source's rest after the epoch before, sources smaller than a step) is never empty: a source
   whose rest its first step takes runs on to the end of its next epoch. ``stop=None`` with ``drop_last`` refuses
   an ``epoch_size`` under one step.
5. ``mix="batch"``: the schedule deals whole batches instead of samples (a position is one batch of
   ``batch_size`` consecutive draws of one source); batches say their source (``(x, y, source)``, or a
   ``"source"`` entry), ``source`` being each row's number in `Mixture.names`.
6. The state (loader.state_dict()) holds the position, each source's cursor and the weights; loaded into
   the same mixture it continues the same stream at any world size. New weights (``set_weights`` after
   loading, or a Mixture made with other weights) apply from the resumed position on: the cursors carry
   over, so no source repeats or skips a sample within its epoch. The same sources in another order carry
   over too, but the schedule deals by source index: the interleaving from there on is another one.
"""
from __future__ import annotations

import hashlib
import math
import numbers
import threading
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np
import torch

from ..errors import ConfigError, is_whole
from ..formats.schema import OFFSETS
from ..storage.opening import parse_size
from .tokens import TokenDataset, WindowGather
from .window_copy import WindowCopy

SHIFT = 56  # a served index is (source << SHIFT) | sample: sorted, a batch groups its rows by source
MASK = (1 << SHIFT) - 1
MIXES, STOPS = ("sample", "batch"), (None, "first", "all")

Sources = Union[Mapping[str, Any], Sequence[Any]]
PerSource = Union[Any, Mapping[str, Any]]


def _per_source(value: PerSource, names: list[str], arg: str, default: Any) -> list[Any]:
    """``value`` for every source: one value, a sequence in source order (as `weights` takes), or a mapping by
    name, whose unknown names are refused and whose missing ones keep ``default``."""
    if isinstance(value, Mapping):
        by_name = {str(k): v for k, v in value.items()}  # (a list's sources are named "0", "1", ...)
        unknown = sorted(set(by_name) - set(names))
        if unknown:
            raise ConfigError(f"{arg} names source {unknown[0]!r}, which is not in the mixture (sources: {names})")
        return [by_name.get(n, default) for n in names]
    if isinstance(value, (Sequence, np.ndarray)) and not isinstance(value, (str, bytes)):
        if len(value) != len(names):
            raise ConfigError(f"{arg} has {len(value)} values for {len(names)} sources {names}: give one value, "
                              f"one per source in their order, or {{name: value}}")
        return list(value)
    return [value] * len(names)


def _signature(ds: Any) -> tuple[Any, ...]:
    """What two sources of one mixture must agree on: shape, dtype, fields, targets, tokenizer, device."""
    fields = getattr(ds, "fields", None)
    tok = getattr(ds, "manifest", {}).get("tokenizer") if hasattr(ds, "manifest") else None
    return (tuple(ds.sample_shape), ds.sample_dtype,
            None if fields is None else tuple(fields),
            "tokens" if hasattr(ds, "vocab_size") else "images",  # (a split's view mixes with a dataset)
            None if tok is None else tok.get("definition_sha256"),
            str(getattr(ds, "device", "cpu")))


def _describe(ds: Any) -> str:
    fields = getattr(ds, "fields", None)
    names = "" if fields is None else f", fields {[f.name for f in fields]}"
    return f"{type(ds).__name__} of {tuple(ds.sample_shape)} {ds.sample_dtype} samples{names}"


class Mixture:
    """Several datasets as one, each sampled by its weight, for `FastLoader` (NOTE [mixture]).

    Examples:
        >>> web, books = FastDataset("data/web"), FastDataset("data/books")
        >>> mix = Mixture({"web": web, "books": books}, weights={"web": 0.7, "books": 0.3}, seed=0)
        >>> loader = FastLoader(mix, batch_size=256)

    Args:
        sources: ``{name: dataset}``, or a list (named ``"0"``, ``"1"``, ...). Datasets that FastLoader
            serves (FastDataset, TokenDataset, local or streamed), agreeing on sample shape, dtype and fields.
        weights: ``{name: weight}`` or a list, non-negative and not all zero (normalised); default equal.
        seed: fixes the schedule and every source's order.
        mix: ``"sample"`` (a batch mixes sources) or ``"batch"`` (each batch from one source, which the batch
            says: ``(x, y, source)`` or a ``"source"`` entry).
        stop: None (a mixture epoch is ``epoch_size`` samples), ``"first"`` or ``"all"`` (NOTE [mixture] 4).
        epoch_size: samples a mixture epoch takes with ``stop=None`` (default: the sources' total; with
            ``mix="batch"``, rounded up to whole batches).
        shuffle: each source's order shuffled: one bool, a list of bools in source order, or ``{name: bool}``
            (a source it does not name is shuffled).
        shuffle_window: windows of shards for a source's order (NOTE [windowed shuffle]): one value, a list in
            source order, or ``{name: shards}`` (a source it does not name: None, no windows).
        allow_new_sources: accept a resumed state without some of these sources (they start at their epoch 0);
            ``fastdata train --allow-new-sources``.
        cache_limit: one node cache budget (bytes, or a size such as ``"200GB"``) for the streamed sources,
            split among them by weight (`cache_shares`) and split again when the weights change; it replaces
            their own ``cache_limit``. Default None: each keeps the limit it was opened with.

    Raises:
        ConfigError: an empty source, sources that disagree (the two are named), bad weights or options.
    """

    is_mixture = True  # FastLoader serves it through a MixtureSampler (fastdata/loading/mixing.py)

    def __init__(self, sources: Sources, weights: Union[Mapping[str, float], Sequence[float], None] = None, *,
                 seed: int = 0, mix: str = "sample", stop: Optional[str] = None, epoch_size: Optional[int] = None,
                 shuffle: PerSource = True, shuffle_window: PerSource = None,
                 allow_new_sources: bool = False, cache_limit: Union[int, str, None] = None) -> None:
        if isinstance(sources, Mapping):
            self.names, self.sources = [str(n) for n in sources], list(sources.values())
        else:
            self.sources = list(sources)
            self.names = [str(k) for k in range(len(self.sources))]
        if not self.sources or len(self.sources) >= 1 << (63 - SHIFT):
            raise ConfigError(f"sources must hold 1 to {(1 << (63 - SHIFT)) - 1} datasets, got {len(self.sources)}")
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise ConfigError(f"seed must be a non-negative integer, got seed={seed!r}")
        if mix not in MIXES:
            raise ConfigError(f"mix must be one of {MIXES}, got mix={mix!r}")
        if stop not in STOPS:
            raise ConfigError(f"stop must be one of {STOPS}, got stop={stop!r}")
        self.seed, self.mix, self.stop, self.allow_new_sources = seed, mix, stop, bool(allow_new_sources)
        self._check_sources()
        self.sizes = [len(ds) for ds in self.sources]
        if epoch_size is not None and (stop is not None or not isinstance(epoch_size, int) or
                                       isinstance(epoch_size, bool) or epoch_size < 1):
            raise ConfigError(f"epoch_size must be a positive integer, and only with stop=None; got "
                              f"epoch_size={epoch_size!r}, stop={stop!r}")
        self.epoch_size = epoch_size or sum(self.sizes)
        self.epoch_size_given = epoch_size  # (a state records this: the default follows the set of sources)
        self.shuffle = _per_source(shuffle, self.names, "shuffle", True)
        for name, value in zip(self.names, self.shuffle):
            if not isinstance(value, (bool, np.bool_)):  # (bool("no") would shuffle, bool(None) would not)
                raise ConfigError(f"shuffle of source {name!r} must be True or False, got {value!r}")
        self.shuffle = [bool(value) for value in self.shuffle]
        self.shuffle_window = _per_source(shuffle_window, self.names, "shuffle_window", None)
        for name, w in zip(self.names, self.shuffle_window):
            if w is not None and (not is_whole(w) or w < 1):
                raise ConfigError(f"shuffle_window of source {name!r} must be a positive number of shards, got {w!r}")
        self.shuffle_window = [None if w is None else int(w) for w in self.shuffle_window]  # (a state is JSON)
        self._weights = self._check_weights(weights)
        self.cache_limit = parse_size(cache_limit)
        self._split_cache()
        self._counts = [0] * len(self.sources)  # samples gathered since interval_report()
        self._edges = np.arange(len(self.sources) + 1)  # get_batch's: where each source's rows begin
        # token sources (all of one class, _check_sources saw to it) gather into the batch (NOTE [mixture gather])
        self._windows = all(isinstance(ds, TokenDataset) for ds in self.sources)
        self._np_dtype = torch.empty(0, dtype=self.sample_dtype).numpy().dtype if self._windows else None
        self._has_fields = self.fields is not None
        self._shape = tuple(self.sample_shape)
        self._gatherers()

    def _gatherers(self) -> None:
        """What a process makes for itself: the counters' lock and the token sources' gathers."""
        self._count_lock = threading.Lock()
        self._gather_windows = WindowGather(self.sources) if self._windows else None
        self._copy = WindowCopy(self.sources) if self._windows else None

    def __getstate__(self) -> dict[str, Any]:
        """Picklable (a copy, another process): the sources pickle themselves; the lock and the gathers,
        which hold addresses of this process's maps, are made anew on the other side."""
        return {k: v for k, v in self.__dict__.items() if k not in ("_count_lock", "_gather_windows", "_copy")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._gatherers()

    def _check_sources(self) -> None:
        if len(set(self.names)) != len(self.names) or any(not n for n in self.names):
            raise ConfigError(f"source names must be distinct and non-empty, got {self.names}")
        for name, ds in zip(self.names, self.sources):
            for attr in ("get_batch", "sample_shape", "sample_dtype", "__len__"):
                if not hasattr(ds, attr):
                    raise ConfigError(f"source {name!r} must be a dataset FastLoader serves (FastDataset, "
                                      f"TokenDataset), got {type(ds).__name__} without {attr!r}")
            if len(ds) == 0:
                raise ConfigError(f"source {name!r} is empty ({ds!r}): drop it or give it samples")
            if getattr(ds, "device", torch.device("cpu")).type != "cpu":
                raise ConfigError(f"source {name!r} keeps its samples on {ds.device}: a Mixture gathers its "
                                  "sources on the host; open it with storage='mmap', 'ram' or 'shm'")
        first = _signature(self.sources[0])
        for name, ds in zip(self.names[1:], self.sources[1:]):
            if _signature(ds) != first:
                raise ConfigError(f"sources {self.names[0]!r} and {name!r} differ: {self.names[0]!r} is a "
                                  f"{_describe(self.sources[0])}, {name!r} a {_describe(ds)} (or another tokenizer)"
                                  ": a mixture's sources must give the same kind of sample")
        fields = [getattr(f, "name", f) for f in getattr(self.sources[0], "fields", None) or ()]
        if "source" in fields:  # (a dict batch's "source" entry is each row's source: NOTE [mixture])
            raise ConfigError(f"source {self.names[0]!r} has a field named 'source', which a mixture's batches use "
                              "for each row's source: preprocess it with the field under another name")
        labels = [getattr(ds, "classes", None) for ds in self.sources]
        for name, theirs in zip(self.names[1:], labels[1:]):
            if labels[0] is not None and theirs is not None and list(theirs) != list(labels[0]):
                raise ConfigError(f"sources {self.names[0]!r} and {name!r} have different classes "
                                  f"({list(labels[0])[:3]}... vs {list(theirs)[:3]}...): label k would mean another "
                                  "class in each; a classifier needs one label space (preprocess them with the same "
                                  "class list)")

    def _check_weights(self, weights: Union[Mapping[str, float], Sequence[float], None]) -> list[float]:
        if weights is None:
            return [1.0 / len(self.names)] * len(self.names)
        if isinstance(weights, Mapping):
            by_name = {str(k): w for k, w in weights.items()}  # (a list's sources are named "0", "1", ...)
            unknown = sorted(set(by_name) - set(self.names))
            if unknown:
                raise ConfigError(f"weights name source {unknown[0]!r}, which is not in the mixture "
                                  f"(sources: {self.names})")
            missing = [n for n in self.names if n not in by_name]
            if missing:
                raise ConfigError(f"weights give no weight for source {missing[0]!r}: give every source one (0 "
                                  "to leave it out)")
            values = [by_name[n] for n in self.names]
        else:
            values = list(weights)
            if len(values) != len(self.names):
                raise ConfigError(f"weights has {len(values)} values for {len(self.names)} sources {self.names}")
        for name, w in zip(self.names, values):  # (numpy's numbers too)
            if not isinstance(w, numbers.Real) or isinstance(w, bool) or not math.isfinite(w) or w < 0:
                raise ConfigError(f"the weight of source {name!r} must be a finite number >= 0, got {w!r}")
        top = max(float(w) for w in values)
        if top <= 0:
            raise ConfigError(f"weights must not all be zero, got {dict(zip(self.names, values))}")
        scaled = [float(w) / top for w in values]  # (first: a sum of huge weights would overflow)
        total = sum(scaled)
        return [w / total for w in scaled]

    # -- weights --------------------------------------------------------------------------------------
    @property
    def weights(self) -> dict[str, float]:
        """The weights in effect, normalised to sum to 1."""
        return dict(zip(self.names, self._weights))

    def set_weights(self, weights: Union[Mapping[str, float], Sequence[float]]) -> None:
        """New weights from the next iteration of a loader over this mixture (``iter(loader)``, the next
        epoch) or from the position a ``load_state_dict`` resumes at; each source keeps its cursor, so none
        repeats or skips a sample (NOTE [mixture] 6). A loop already running keeps the weights it began with.

        With ``cache_limit``, the streamed sources' caches are split again by the new weights at once.

        Raises:
            ConfigError: bad weights (the source is named).
        """
        self._weights = self._check_weights(weights)
        self._split_cache()

    def _split_cache(self) -> None:
        """``cache_limit`` split among the streamed sources by the weights (equally when theirs are all 0)."""
        streamed = {n: w for n, ds, w in zip(self.names, self.sources, self._weights)
                    if getattr(ds, "streamed", False)}
        if self.cache_limit is None or not streamed:
            return
        if not sum(streamed.values()):
            streamed = dict.fromkeys(streamed, 1.0)
        for name, share in cache_shares(self.cache_limit, streamed).items():
            self.sources[self.names.index(name)].set_cache_limit(share)

    def cache_limits(self) -> dict[str, Optional[int]]:
        """Each streamed source's cache limit in bytes now (None: unbounded), by name."""
        return {n: ds.cache_limit for n, ds in zip(self.names, self.sources) if getattr(ds, "streamed", False)}

    def source_seed(self, k: int) -> int:
        """Source ``k``'s order seed, from the mixture's seed and the source's name (not its place)."""
        digest = hashlib.sha256(f"fastdata.mixture:{self.seed}:{self.names[k]}".encode()).digest()
        return int.from_bytes(digest[:8], "little") >> 2

    # -- what FastLoader reads ------------------------------------------------------------------------
    def __len__(self) -> int:
        """Positions of a mixture epoch with ``stop=None`` (with a stop, epochs end by the sources)."""
        return self.epoch_size

    @property
    def sample_shape(self) -> tuple[int, ...]:
        return tuple(self.sources[0].sample_shape)

    @property
    def sample_dtype(self) -> torch.dtype:
        return self.sources[0].sample_dtype

    @property
    def fields(self) -> Any:
        return getattr(self.sources[0], "fields", None)

    device = torch.device("cpu")

    @property
    def random_crops(self) -> bool:
        return any(getattr(ds, "random_crops", False) for ds in self.sources)

    def get_batch(self, indices: Any, out: Any = None, draw: Optional[tuple[int, int, int, int]] = None) -> Any:
        """Gather served indices (``(source << 56) | sample``, sorted) with one gather per source in the batch,
        each straight into its rows of one output batch (NOTE [mixture gather]).

        ``out``: FastLoader's ring slot (``(x, y)`` buffers, or the allocator of a dict slot), or None.
        Returns ``(x, y)``; ``(x, y, source)`` with ``mix="batch"``; a dict of fields plus ``"source"`` (each
        row's source number) for sources with fields. ``draw`` seeds decode-time random crops.

        Raises:
            IndexError: an index names a source or sample the mixture does not have.
        """
        # NOTE [mixture gather]: a batch of a few tens of kB (32 token windows) costs about what its fixed
        # per-call work costs, so this runs a handful of numpy calls per batch and per source: sorted codes
        # make each source's rows one run (its bounds by one searchsorted) with its samples in order (range
        # checked by its last), and token sources write into the batch's buffer by `WindowGather`.
        codes = indices if type(indices) is np.ndarray and indices.dtype == np.int64 else np.asarray(
            indices.cpu().numpy() if isinstance(indices, torch.Tensor) else indices, dtype=np.int64)
        if self._copy is not None and self._copy.ready():  # token sources: the batch in one compiled call
            batch = self._copied(codes, out)
            if batch is not None:
                return batch
        src = codes >> SHIFT
        b = len(codes)
        if b > 1 and (src[1:] < src[:-1]).any():  # unsorted: gather sorted, give back in this order
            order = np.argsort(codes, kind="stable")
            batch = self.get_batch(codes[order], None, draw)
            return _reorder(batch, np.argsort(order, kind="stable"))
        bounds = src.searchsorted(self._edges).tolist()  # (the method: a third of np.searchsorted's cost)
        if bounds[0] or bounds[-1] != b:  # sorted: a source below 0 or past the last leaves rows outside
            raise IndexError(f"mixture index names source {int(src[0] if bounds[0] else src[-1])}; there are "
                             f"{len(self.sources)}")
        idx = codes & MASK
        parts = [(k, a, c) for k, (a, c) in enumerate(zip(bounds, bounds[1:])) if c > a]
        for k, a, c in parts:
            if idx[c - 1] >= self.sizes[k]:
                raise IndexError(f"mixture index names sample {int(idx[c - 1])} of source {self.names[k]!r}, "
                                 f"which has {self.sizes[k]}")
        with self._count_lock:
            self._counts = [n + c - a for n, a, c in zip(self._counts, bounds, bounds[1:])]
        if self._has_fields:
            return self._dict_batch(parts, idx, out, torch.from_numpy(src), draw)
        x_buf, y_buf = out if isinstance(out, tuple) else (out, None)
        x = self._rows(x_buf, b)
        if self._windows:
            x, y = self._window_batch(parts, idx, x)
        else:
            y = torch.empty(b, dtype=torch.int64) if y_buf is None else y_buf if len(y_buf) == b else y_buf[:b]
            x, y = self._sample_batch(parts, idx, x, y, draw)
        return (x, y, torch.from_numpy(src)) if self.mix == "batch" else (x, y)

    def _copied(self, codes: np.ndarray, out: Any) -> Optional[tuple[torch.Tensor, ...]]:
        """Token sources: every window of the batch, in the order given, by one compiled call (NOTE [compiled
        window copy]); None where it cannot serve (the gather below then serves, or raises)."""
        x = self._rows(out[0] if isinstance(out, tuple) else out, len(codes))
        dst = x.numpy()
        if not self._fits(dst, len(codes)):
            return None  # (refused below, by name)
        counts = self._copy(codes, dst)
        if counts is None:
            return None
        with self._count_lock:
            self._counts = [n + c for n, c in zip(self._counts, counts.tolist())]
        if self.mix == "batch":
            return x[:, :-1], x[:, 1:], torch.from_numpy(codes >> SHIFT)
        return x[:, :-1], x[:, 1:]

    def _rows(self, x_buf: Optional[torch.Tensor], b: int) -> torch.Tensor:
        """The batch's sample buffer: ``x_buf``'s first ``b`` rows (a loader's ring slot), or a new one."""
        if x_buf is None:
            return torch.empty((b, *self.sample_shape), dtype=self.sample_dtype)
        return x_buf if len(x_buf) == b else x_buf[:b]

    def _fits(self, dst: np.ndarray, rows: int) -> bool:
        """Whether token windows can be written into ``dst``: contiguous, of the sources' dtype and window
        length, and ``rows`` rows at least."""
        return dst.dtype == self._np_dtype and dst.shape[1:] == self._shape and dst.flags.c_contiguous and \
            len(dst) >= rows

    def _window_batch(self, parts: list[tuple[int, int, int]], idx: np.ndarray, x: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Token sources: each source's windows into its rows of ``x``; the targets are ``x`` shifted by one."""
        dst = x.numpy()
        if not self._fits(dst, len(idx)):
            raise ConfigError(f"out must be a contiguous CPU {self.sample_dtype} tensor of shape (>={len(idx)}, "
                              f"{self._shape[0]}), got {tuple(x.shape)} {x.dtype}")
        self._gather_windows(parts, idx, dst)
        return x[:, :-1], x[:, 1:]

    def _sample_batch(self, parts: list[tuple[int, int, int]], idx: np.ndarray, x: torch.Tensor, y: torch.Tensor,
                      draw: Optional[tuple[int, int, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each source's ``get_batch`` into its rows of ``x`` (and its targets into ``y``)."""
        lo = x.data_ptr()
        hi = lo + x.numel() * x.element_size()
        windows = False  # sources whose targets are views of their samples (token windows)
        ys_np = y.numpy()
        for k, a, c in parts:
            rows = x[a:c]
            xs, ys = self._source_batch(k, idx[a:c], rows, draw)
            if xs.data_ptr() != rows.data_ptr():
                rows.copy_(xs)
            if lo <= ys.data_ptr() < hi:
                windows = True
            else:
                ys_np[a:c] = ys.numpy()
        return (x[:, :-1], x[:, 1:]) if windows else (x, y)

    def _source_batch(self, k: int, idx: np.ndarray, out: Any, draw: Optional[tuple[int, int, int, int]]) -> Any:
        ds = self.sources[k]
        if draw is not None and getattr(ds, "random_crops", False):  # each source's rows draw their own crops
            seed, epoch, position, rank = draw
            return ds.get_batch(idx, out=out, draw=(seed, epoch, position * len(self.sources) + k, rank))
        return ds.get_batch(idx, out=out)

    def _dict_batch(self, parts: list[tuple[int, int, int]], idx: np.ndarray, out: Any, source: torch.Tensor,
                    draw: Optional[tuple[int, int, int, int]]) -> dict[str, torch.Tensor]:
        """Each source's dict batch, joined key by key into the slot's buffers (variable fields' offsets
        shifted by the values before them)."""
        got = [self._source_batch(k, idx[a:c], None, draw) for k, a, c in parts]
        batch: dict[str, torch.Tensor] = {}
        for key in got[0]:
            pieces = [g[key] for g in got]
            if key.endswith(OFFSETS):
                shift, joined = 0, []
                for offsets in pieces:
                    joined.append(offsets[:-1] + shift)
                    shift += int(offsets[-1])
                pieces = joined + [torch.tensor([shift], dtype=pieces[0].dtype)]
            shape = (sum(len(p) for p in pieces), *pieces[0].shape[1:])
            dst = out(key, shape, pieces[0].dtype) if callable(out) else torch.empty(shape, dtype=pieces[0].dtype)
            torch.cat(pieces, out=dst)
            batch[key] = dst
        batch["source"] = source
        return batch

    def interval_report(self, seconds: float) -> dict[str, dict[str, float]]:
        """Per source, the samples gathered (in this process) since the last call: ``{name: {"samples_per_s",
        "share"}}``, for a training log's interval of ``seconds``. Counted as batches are gathered, a few ahead
        of training."""
        with self._count_lock:
            counts, self._counts = self._counts, [0] * len(self.sources)
        total = max(1, sum(counts))
        return {n: {"samples_per_s": c / max(seconds, 1e-9), "share": c / total} for n, c in zip(self.names, counts)}

    # -- streamed sources -----------------------------------------------------------------------------
    def plan_reads(self, coming: Any, now: Optional[int] = None) -> Optional[list[tuple[int, object]]]:
        """Tell each streamed source its coming reads: ``coming.of_source(k)`` gives source ``k``'s indices of
        every coming batch (empty where it has none), so each cache's plan follows the mixture's order."""
        tokens = []
        for k, ds in enumerate(self.sources):
            plan = getattr(ds, "plan_reads", None)
            if plan is not None and getattr(ds, "streamed", False):
                tokens.append((k, plan(coming.of_source(k), now)))
        return tokens or None

    def end_reads(self, tokens: Optional[list[tuple[int, object]]]) -> None:
        for k, token in tokens or []:
            self.sources[k].end_reads(token)

    def download_report(self) -> dict[str, list[dict[str, Optional[int]]]]:
        """Each streamed source's downloads per loader pass (``download_report()`` of the source), by name."""
        return {n: ds.download_report() for n, ds in zip(self.names, self.sources) if hasattr(ds, "download_report")}

    def __repr__(self) -> str:
        parts = ", ".join(f"{n}={w:.3g}" for n, w in self.weights.items())
        return f"Mixture({parts}, mix={self.mix!r}, stop={self.stop!r}, seed={self.seed})"


def _reorder(batch: Any, inverse: np.ndarray) -> Any:
    """A batch's rows put back in the caller's order (fixed-size rows only)."""
    def take(t: torch.Tensor) -> torch.Tensor:  # numpy's take: torch's indexing of uint16 rows is ~100x slower
        return torch.from_numpy(t.numpy().take(inverse, axis=0)) if t.device.type == "cpu" else t[
            torch.from_numpy(inverse).to(t.device)]
    if isinstance(batch, dict):
        if any(k.endswith(OFFSETS) for k in batch):
            raise ConfigError("a mixture batch with variable-length fields needs sorted indices")
        return {k: take(v) for k, v in batch.items()}
    return tuple(take(t) for t in batch)


def cache_shares(total: Union[int, str], weights: Union[Mapping[str, float], Sequence[float]]
                 ) -> dict[str, int]:
    """One node-cache budget split among streamed sources by weight: each source's ``cache_limit``.

    Example: ``FastDataset(url, cache_limit=cache_shares("200GB", {"web": 0.7, "books": 0.3})["web"])``.

    Args:
        total: The node's budget, in bytes or as a size such as ``"200GB"``.
        weights: ``{name: weight}``, or a list (as `Mixture` takes it: the sources named ``"0"``, ``"1"``...).

    Returns:
        ``{name: bytes}``.

    Raises:
        ConfigError: a bad size, or weights that are negative, NaN or all zero.
    """
    limit = parse_size(total)
    if limit is None:
        raise ConfigError("total must be a number of bytes or a size such as '200GB', got total=None")
    if not isinstance(weights, Mapping):
        weights = {str(k): w for k, w in enumerate(weights)}
    values = list(weights.values())
    if not values or any(not math.isfinite(w) or w < 0 for w in values) or sum(values) <= 0:
        raise ConfigError(f"weights must be finite, non-negative and not all zero, got {dict(weights)}")
    return {n: max(1, int(limit * w / sum(values))) for n, w in weights.items()}
