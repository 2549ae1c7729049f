"""The sample order every fastdata backend serves: fixed by ``(seed, epoch)``, split across DDP ranks,
resumable mid-epoch, even with another world size.

NOTE [epoch plan]: an epoch is the permutation ``perm`` of ``range(N)`` drawn from ``(seed, epoch)``.
A resumed epoch starts at a global position ``start``: the samples still due are ``rest = perm[start:]``.
Without ``drop_last``, ``rest`` is padded with the epoch's last ``P`` samples, in order, up to a multiple of
the world size (``P`` < world: as many repeats as ``DistributedSampler``; each lands ``P`` positions after
its sample, so on another rank). They are ``rest``'s own while it holds that many, so nothing is served twice
across a resume, and at the same world size they do not depend on ``start`` (a multiple of the world): an
epoch resumed so serves exactly what the uninterrupted one would. With ``drop_last`` it is cut to a
multiple of ``world * batch_size`` (nothing repeats, every batch is full); with ``pad=False`` (for
evaluation) it is neither, so every sample is served exactly once and ranks may serve one sample, and so
one batch, fewer. Rank ``r`` takes ``rest[r::world]``, so after every rank has served ``k`` samples the served
set is exactly the prefix ``rest[:k * world]``: the position to resume from is ``start + k * world``, whatever
the new world size.

NOTE [windowed shuffle]: with ``shuffle_window=K`` and the samples each shard holds, ``perm`` is drawn
in two steps from ``(seed, epoch)``: the shards in a random order, then the samples of each window of K
consecutive shards of that order in a random order among themselves. A stretch of the epoch then reads
at most K shards (the first batch needs at most K; a node cache of K shards never thrashes), at the cost
of batches mixing only within a window (``benchmarks/bench_shuffle.py`` measures how much). Everything
above holds for any permutation, so exactly-once, equal batch counts and resume at another world size
are unchanged; a window covering every shard gives exactly the plain permutation. Such an order is
computed a window at a time (NOTE [streamed order] in fastdata/loading/order.py): the sampler streams a rank's batches
and never holds the epoch, so 2·10^9 samples cost what one window costs. On several nodes the windows
are dealt to nodes, so that a node reads (and its cache fetches) only its own share of the shards.
"""
from __future__ import annotations

import os
import threading
import weakref
from typing import Any, Iterator, Optional

import numpy as np

from ..distributed import dist_rank_world
from ..errors import ConfigError, is_whole
from .order import EpochOrder, group_by_shard, windowed


class DistributedBatchSampler:
    """Batches of sample indices for one rank; usable as a ``DataLoader(batch_sampler=...)``.

    The order is a permutation fixed by ``(seed, epoch)``, dealt to the ranks (NOTE [epoch plan]).
    Every rank yields the same number of batches, so DDP never hangs, except with ``pad=False``.
    With ``pad=False`` every sample is served exactly once, for evaluation loops that run no collective per
    batch (such as `fastdata.train.trainer.Trainer.evaluate`).
    ``state_dict()`` records how far the epoch got; ``load_state_dict()`` resumes at the next unseen sample,
    even with another world size.
    The epoch is computed a chunk of batches at a time, never held whole.

    Args:
        num_samples: The dataset's length, >= 1.
        batch_size: Samples per batch, >= 1.
        shuffle: Draw a new order every epoch (default True); False serves samples in stored order.
        seed: The seed of the order (default 0); every rank must pass the same one.
        drop_last: Cut the epoch to whole batches on every rank (default False).
        pad: Repeat at most ``world_size - 1`` samples so every rank serves as many (default True).
        rank: This process's rank (default: torch.distributed's when initialised, else 0).
        world_size: The number of ranks (default: torch.distributed's when initialised, else 1).
        shuffle_window: Shuffle shards, then samples within windows of this many shards (default None);
            NOTE [windowed shuffle].
        shards: With ``shuffle_window``: each sample's shard (``num_samples`` entries).
        shard_bounds: With ``shuffle_window``: each shard's first sample, then ``num_samples`` (shards of
            consecutive samples; takes precedence over ``shards``).
        node_size: Ranks per node, for dealing windows to nodes (default: world / torchrun's ``GROUP_WORLD_SIZE``,
            else ``LOCAL_WORLD_SIZE``).

    Raises:
        ConfigError: An argument (or ``$GROUP_WORLD_SIZE``) is out of range, or ``shuffle_window`` comes without
            ``shards`` or ``shard_bounds``. ``load_state_dict`` raises it for a state of another dataset or order.

    Examples:
        >>> sampler = DistributedBatchSampler(len(ds), 256, seed=0)
        >>> loader = torch.utils.data.DataLoader(ds, batch_sampler=sampler, num_workers=8)
        >>> sampler.set_epoch(epoch)
        >>> for k, batch in enumerate(loader, 1):
        ...     state = sampler.state_dict(batches=k)  # (the workers took batches ahead of k)
    """

    def __init__(self, num_samples: int, batch_size: int, *, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, pad: bool = True, rank: Optional[int] = None,
                 world_size: Optional[int] = None, shuffle_window: Optional[int] = None,
                 shards: Optional[np.ndarray] = None, shard_bounds: Optional[np.ndarray] = None,
                 node_size: Optional[int] = None) -> None:
        if not isinstance(num_samples, int) or num_samples < 1:
            raise ConfigError(f"num_samples must be a positive integer, got num_samples={num_samples!r}")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"batch_size must be a positive integer, got batch_size={batch_size!r}")
        if not is_whole(seed) or seed < 0:
            raise ConfigError(f"seed must be an integer >= 0, got seed={seed!r}")
        bounds = members = None
        if shuffle_window is not None:
            if not isinstance(shuffle_window, int) or shuffle_window < 1:
                raise ConfigError(f"shuffle_window must be a positive number of shards, got "
                                  f"shuffle_window={shuffle_window!r}")
            if shard_bounds is not None:  # shards of consecutive samples, by their first sample
                bounds = np.asarray(shard_bounds, dtype=np.int64)
                if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != num_samples or np.any(np.diff(bounds) < 0):
                    raise ConfigError(f"shard_bounds must rise from 0 to num_samples={num_samples}")
            elif shards is not None and len(shards) == num_samples:
                bounds, members = group_by_shard(shards)
            else:
                raise ConfigError("shuffle_window needs each sample's shard: the dataset must say where its "
                                  "samples are stored (FastDataset and TokenDataset do; an LMDB made before LMDB "
                                  "shards does not)")
        self.shuffle_window = shuffle_window
        self._bounds, self._members = bounds, members
        self._n_shards = len(bounds) - 1 if bounds is not None else 0
        self.num_samples, self.batch_size, self.shuffle, self.seed = num_samples, batch_size, shuffle, int(seed)
        self.drop_last, self.pad = drop_last, pad
        self.rank, self.world_size = dist_rank_world(rank, world_size)
        self.layout = self._layout(node_size)
        self._resumed: Optional[tuple[int, tuple[int, int]]] = None  # (epoch, layout) of a loaded state
        self._orders: dict[tuple[int, tuple[int, int]], EpochOrder] = {}
        self._orders_lock = threading.Lock()  # (a cache's planning thread asks for orders too)
        self.epoch = 0
        self.start = 0  # global position this epoch (re)starts from
        self.served = 0  # batches handed out since `start` (kept up to date by the consumer, see advance())
        self._pass: Optional[tuple[int, int, int]] = None  # (epoch, start, served) where the last __iter__ began
        self._pass_out = 0  # batches that pass has handed out

    def _layout(self, node_size: Optional[int]) -> tuple[int, int]:
        """``(nodes, ranks a node)`` for dealing windows to nodes, unless given: torchrun's ``GROUP_WORLD_SIZE``
        nodes of ``world / nodes`` ranks, else ``LOCAL_WORLD_SIZE`` ranks a node. Every rank must reach the same
        layout, or ranks draw different orders: nodes of different sizes (torchrun allows them) each see
        their own ``LOCAL_WORLD_SIZE``, while the node count and the world size are the same everywhere (such
        nodes then read each other's shards; every sample is still served once)."""
        if self.shuffle_window is None:
            return (1, 1)
        groups = os.environ.get("GROUP_WORLD_SIZE") if node_size is None else None
        if groups is not None:  # torchrun's node count, the same on every rank (LOCAL_WORLD_SIZE may not be)
            if not groups.isdigit() or int(groups) < 1:
                raise ConfigError(f"GROUP_WORLD_SIZE={groups!r} is not a number of nodes: unset it, or pass "
                                  "node_size")
            node_size = self.world_size // int(groups) if self.world_size % int(groups) == 0 else self.world_size
        elif node_size is None:
            node_size = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
        if not isinstance(node_size, int) or node_size < 1:
            raise ConfigError(f"node_size must be a positive number of ranks, got node_size={node_size!r}")
        nodes = self.world_size // node_size
        return (nodes, node_size) if nodes > 1 and nodes * node_size == self.world_size else (1, 1)

    def __getstate__(self) -> dict[str, Any]:
        """A copy (pickle, deepcopy) leaves out the orders made, a cache, and their lock."""
        return {**self.__dict__, "_orders": {}, "_orders_lock": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._orders_lock = threading.Lock()

    # -- the plan -------------------------------------------------------------------------------------
    def order(self, epoch: Optional[int] = None) -> EpochOrder:
        """Epoch ``epoch``'s order (NOTE [streamed order] in fastdata/loading/order.py), computed as it is read."""
        epoch = self.epoch if epoch is None else epoch
        key = (epoch, self._layout_of(epoch))
        with self._orders_lock:
            got = self._orders.get(key)
            if got is None:
                # an epoch before the sampler's is done with: without a window its order holds 8 bytes a sample
                for done in [k for k in self._orders if k[0] < self.epoch]:
                    del self._orders[done]
                while len(self._orders) >= 2:  # this epoch's and the next one's
                    self._orders.pop(next(iter(self._orders)))
                got = self._orders[key] = self._new_order(epoch)
        return got

    def _layout_of(self, epoch: int) -> tuple[int, int]:
        return self._resumed[1] if self._resumed is not None and self._resumed[0] == epoch else self.layout

    def _new_order(self, epoch: int) -> EpochOrder:
        return EpochOrder(self.num_samples, self.seed, epoch, shuffle=self.shuffle, window=self.shuffle_window,
                          bounds=self._bounds, members=self._members, layout=self._layout_of(epoch))

    def permutation(self, epoch: Optional[int] = None) -> np.ndarray:
        """The whole epoch's order (all ranks), int64 (made whole: for small datasets and tests)."""
        return self.order(epoch).at(np.arange(self.num_samples, dtype=np.int64))

    def _due(self, start: int) -> int:
        """How many positions the ranks serve from ``start`` on: ``rest`` padded or cut (NOTE [epoch plan])."""
        left, w, b = self.num_samples - start, self.world_size, self.batch_size
        if self.drop_last:
            return left // (w * b) * (w * b)
        return -(-left // w) * w if self.pad else left

    def _rank_count(self, start: int) -> int:
        """How many of those positions this rank serves."""
        return len(range(self.rank, self._due(start), self.world_size))

    def _positions(self, start: int, i0: int, i1: int) -> np.ndarray:
        """Positions in ``perm`` of this rank's samples ``i0 .. i1 - 1`` of the epoch resumed at ``start``
        (padding repeats the epoch's last samples, in order: NOTE [epoch plan])."""
        p = start + np.arange(i0, i1, dtype=np.int64) * self.world_size + self.rank
        n = self.num_samples
        pads = start + self._due(start) - n  # (fewer than the world: a pad lands on another rank than its sample)
        return np.where(p < n, p, (p - pads) % n)

    def _stream(self, epoch: int, start: int, served: int, order: Optional[EpochOrder] = None
                ) -> Iterator[np.ndarray]:
        """This rank's batches of ``epoch`` resumed at ``start``, from batch ``served`` on, computed a chunk
        of batches at a time (never the whole epoch)."""
        order, b = order or self.order(epoch), self.batch_size
        count = self._rank_count(start)
        step = b * max(1, (1 << 16) // b)
        for c0 in range(served * b, count, step):
            chunk = order.at(self._positions(start, c0, min(count, c0 + step)))
            for i in range(0, len(chunk), b):
                yield chunk[i:i + b]

    def rank_indices(self) -> np.ndarray:
        """This rank's samples for the rest of the epoch, in order (made whole: prefer `batches`)."""
        count = self._rank_count(self.start)
        return self.order().at(self._positions(self.start, 0, count))

    def batches(self, mine: Optional[np.ndarray] = None) -> Iterator[np.ndarray]:
        """This rank's batches from the current position (int64 arrays; does not advance the state),
        streamed; ``mine`` is `rank_indices` when the caller has it already."""
        if mine is None:
            yield from self._stream(self.epoch, self.start, self.served)
            return
        for i in range(self.served * self.batch_size, len(mine), self.batch_size):
            yield mine[i:i + self.batch_size]

    def coming_batches(self) -> Iterator[np.ndarray]:
        """`batches`, then the next epoch's from its start: the reads a cache can plan for (the
        next epoch's order is known already). Another thread may run it."""
        epoch, start, served = self.epoch, self.start, self.served
        yield from self._stream(epoch, start, served, self._shared_order(epoch))
        yield from self._stream(epoch + 1, 0, 0, self._shared_order(epoch + 1))

    def _shared_order(self, epoch: int) -> EpochOrder:
        """Epoch ``epoch``'s order for another thread: the sampler's own where it is a whole permutation (read
        only; a copy would be 8 bytes a sample more), a new one where it makes windows as it is read."""
        if windowed(self.shuffle, self.shuffle_window, self._bounds):
            return self._new_order(epoch)
        return self.order(epoch)

    def __iter__(self) -> Iterator[list[int]]:
        # (a DataLoader with worker processes takes batches ahead of its consumer: `state_dict(batches=k)`
        # counts from where this pass began)
        self._pass, self._pass_out = (self.epoch, self.start, self.served), 0
        for batch in self.batches():
            self.advance()
            self._pass_out += 1
            yield batch.tolist()
        self.end_epoch()

    @property
    def pass_start(self) -> Optional[tuple[int, int, int]]:
        """``(epoch, start, served)`` where the last pass over the sampler (``iter``, a DataLoader's) began, or
        None: a consumer that counts the batches it received maps its count to a position from there."""
        return self._pass

    def epoch_batches(self) -> int:
        """Batches this rank serves in a whole epoch (the same on every rank unless ``pad=False``)."""
        n, w, b = self.num_samples, self.world_size, self.batch_size
        if self.drop_last:
            return n // (w * b)
        mine = -(-n // w) if self.pad else len(range(self.rank, n, w))
        return -(-mine // b)

    def __len__(self) -> int:
        """Batches this rank serves in the rest of the current epoch."""
        count = self._rank_count(self.start)
        return -(-count // self.batch_size) - self.served

    # -- progress and resumption ----------------------------------------------------------------------
    def advance(self, batches: int = 1) -> None:
        """Record that ``batches`` more batches were handed to the consumer."""
        self.served += batches

    def end_epoch(self) -> None:
        """The epoch was served in full: the next one starts from its beginning."""
        self.epoch += 1
        self.start = self.served = 0

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (as ``DistributedSampler.set_epoch``); a resumed position is kept for its epoch.

        Raises:
            ConfigError: ``epoch`` is not an integer >= 0.
        """
        if not is_whole(epoch) or epoch < 0:
            raise ConfigError(f"set_epoch takes an epoch number >= 0, got {epoch!r}")
        epoch = int(epoch)
        if epoch != self.epoch:
            self.epoch, self.start, self.served = epoch, 0, 0
        if self._pass is not None and self._pass[0] != epoch:  # (a pass over another epoch: done with)
            self._pass = None

    def batch_position(self, k: int) -> int:
        """Global position of this epoch's ``k``-th batch since ``start`` (the same on every rank): the key
        the augmentation draws are seeded with, so they survive a resume."""
        return self.start + k * self.batch_size * self.world_size

    def position(self) -> int:
        """Global position reached: every sample of ``perm[:position]`` has been served by some rank."""
        return min(self.num_samples, self.batch_position(self.served))

    def state_dict(self, batches: Optional[int] = None) -> dict[str, Any]:
        """Where the epoch got to: a JSON-ready dict of the epoch, the global position and the order's settings.

        Args:
            batches: The batches your loop has received in its current pass over the sampler (the ``for``
                over a DataLoader). Needed where the sampler runs ahead of you: a DataLoader with worker
                processes takes ``prefetch_factor x num_workers`` batches early, and the sampler counts what it
                handed out. Default: every batch handed out (exact when nothing takes them early: FastLoader,
                a DataLoader with ``num_workers=0``).

        Returns:
            ``{"epoch", "position", "seed", "shuffle", "num_samples"}``, and the shuffle window (with the nodes
            it is dealt to) when there is one.

        Raises:
            ConfigError: ``batches`` is more than this pass handed out, or not an integer >= 0.
        """
        epoch, position = self.epoch, self.position()
        if batches is not None:
            epoch, start, served = self._pass or (self.epoch, self.start, self.served)
            out = self._pass_out if self._pass else 0
            if not is_whole(batches) or not 0 <= batches <= out:
                raise ConfigError(f"state_dict(batches={batches!r}): this pass over the sampler (epoch {epoch}) "
                                  f"handed out {out} batches; pass how many of them your loop received")
            position = min(self.num_samples, start + (served + int(batches)) * self.batch_size * self.world_size)
        state = {"epoch": epoch, "position": position, "seed": self.seed, "shuffle": self.shuffle,
                 "num_samples": self.num_samples}
        if self.shuffle_window is not None:  # (absent otherwise: states saved before windows still load)
            state["shuffle_window"] = self.shuffle_window
            layout = self.order(epoch).layout
            if layout != (1, 1):  # windows dealt to nodes: the epoch's order depends on the layout
                state["nodes"] = list(layout)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the next sample no rank has served, whatever the world size was (NOTE [epoch plan]).

        Args:
            state: A `state_dict` of a sampler over the same dataset and order.

        Raises:
            ConfigError: The state belongs to another dataset, or to another seed, shuffle or shuffle window, or
                is damaged (an epoch or position that is not an integer >= 0).
        """
        if not isinstance(state, dict):
            raise ConfigError(f"a loader state is a dict (what state_dict() returns), got {type(state).__name__}")
        if "mixture" in state:
            raise ConfigError("the state is a Mixture's (it has a 'mixture' entry): load it into a loader over the "
                              "same Mixture, not over one dataset")
        if state.get("num_samples") != self.num_samples:
            raise ConfigError(f"the state is for {state.get('num_samples')} samples but this dataset has "
                              f"{self.num_samples}: it belongs to another dataset")
        if (state.get("seed") != self.seed or state.get("shuffle") != self.shuffle
                or state.get("shuffle_window") != self.shuffle_window):
            raise ConfigError(f"the state was saved with seed={state.get('seed')}, shuffle={state.get('shuffle')}, "
                              f"shuffle_window={state.get('shuffle_window')}; this sampler has seed={self.seed}, "
                              f"shuffle={self.shuffle}, shuffle_window={self.shuffle_window}: the order would differ")
        for key in ("epoch", "position"):  # (a negative position wrapped around the order: samples served twice)
            value = state.get(key)
            if not is_whole(value) or value < 0:
                raise ConfigError(f"the loader state is damaged: its {key} is {value!r}, not an integer >= 0; "
                                  "load the state the loader saved, unchanged")
        self.epoch, self.start, self.served = int(state["epoch"]), int(state["position"]), 0
        self._pass = None
        layout = state.get("nodes", [1, 1])
        if (not isinstance(layout, (list, tuple)) or len(layout) != 2
                or not all(is_whole(v) and v >= 1 for v in layout)):
            raise ConfigError(f"the loader state is damaged: its nodes are {layout!r}, not [nodes, ranks a node]; "
                              "load the state the loader saved, unchanged")
        self._resumed = (self.epoch, (int(layout[0]), int(layout[1]))) if self.shuffle_window is not None else None
        # Saved after an epoch's last batch but before its iteration ended: the state stays in that epoch, with
        # nothing left to serve. Moving on to the next epoch here made the caller's set_epoch(epoch) (the
        # Trainer's, a torch-style loop's) restart the finished epoch and serve it twice.
        self.start = min(self.start, self.num_samples)


class LiveIteration:
    """One live iteration at a time, for iterables whose buffers, pipelines, plans or look-ahead are shared
    (FastLoader, DALILoader, CUDAPrefetcher): a second live iterator would refill what the first still hands
    out, or serve an old position. A new iteration closes the one under way (`_track`)."""

    _active: Optional["weakref.ref[Any]"] = None  # the iteration under way, if any

    def _track(self, gen: Iterator[Any]) -> Iterator[Any]:
        """Make ``gen`` the iteration under way, closing the one before it."""
        self._close_active()
        self._active = weakref.ref(gen)
        return gen

    def _close_active(self) -> None:
        old = self._active() if self._active is not None else None
        if old is not None:
            old.close()
        self._active = None


class SamplerBacked(LiveIteration):
    """For loaders whose order is a ``self.sampler`` (FastLoader, DALILoader): the torch-style proxies, and
    one live iteration at a time (`LiveIteration`)."""

    sampler: DistributedBatchSampler

    def __len__(self) -> int:
        """Batches this rank serves in a whole epoch."""
        return self.sampler.epoch_batches()

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """Where the epoch got to, counting only batches already handed to the consumer, the version of the
        dataset it got there in (``dataset_sha256``: its manifest's digest) and which of its samples a position
        means (``dataset_key``: a split's, a token dataset's windows)."""
        state = self.sampler.state_dict()
        version = getattr(self.dataset, "manifest_sha256", None)
        key = getattr(self.dataset, "state_key", None)
        if version is not None:
            state["dataset_sha256"] = version
        if key is not None:
            state["dataset_key"] = key
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a `state_dict`'s position; an iteration under way is closed first.

        Raises:
            ConfigError: The state was saved on another version of the dataset (its manifest changed: a new
                ``fastdata preprocess --overwrite`` or ``push``), on other samples of it (another split,
                other token windows), or belongs to another order.
        """
        if not isinstance(state, dict):
            raise ConfigError(f"a loader state is a dict (what state_dict() returns), got {type(state).__name__}")
        saved, version = state.get("dataset_sha256"), getattr(self.dataset, "manifest_sha256", None)
        if saved is not None and version is not None and saved != version:
            where = getattr(getattr(self.dataset, "base", self.dataset), "root", "the dataset")
            raise ConfigError(f"the state was saved on another version of {where} (manifest sha256 {saved[:12]}..., "
                              f"this one {version[:12]}...): resume on the version the run started with, or "
                              "start the run over")
        saved, key = state.get("dataset_key"), getattr(self.dataset, "state_key", None)
        if saved is not None and key is not None and saved != key:  # (states saved before keys: unchecked)
            raise ConfigError(f"the state was saved on other samples of the dataset ({saved}; this loader reads "
                              f"{key}): its positions would repeat some samples and skip others; resume with the "
                              "split and windows the run started with, or start the run over")
        self._close_active()  # an iterator still running would serve the old position
        self.sampler.load_state_dict({k: v for k, v in state.items() if k not in ("dataset_sha256", "dataset_key")})
