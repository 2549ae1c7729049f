"""The sample order every fastdata backend serves: fixed by ``(seed, epoch)``, split across DDP ranks,
resumable mid-epoch, even with another world size.

NOTE [epoch plan]: an epoch is the permutation ``perm`` of ``range(N)`` drawn from ``(seed, epoch)``.
A resumed epoch starts at a global position ``start``: the samples still due are ``rest = perm[start:]``.
Without ``drop_last``, ``rest`` is padded with its own first samples up to a multiple of the world size
(at most ``world - 1`` repeats, as ``DistributedSampler`` does); with ``drop_last`` it is cut to a
multiple of ``world * batch_size`` (nothing repeats, every batch is full); with ``pad=False`` (for
evaluation) it is neither, so every sample is served exactly once and ranks may serve one sample, and
so one batch, fewer. Rank ``r`` takes
``rest[r::world]``, so after every rank has served ``k`` samples the served set is exactly the prefix
``rest[:k * world]``: the position to resume from is ``start + k * world``, whatever the new world size.

NOTE [windowed shuffle]: with ``shuffle_window=K`` and each sample's shard (``shards``), ``perm`` is drawn
in two steps from ``(seed, epoch)``: the shards in a random order, then the samples of each window of K
consecutive shards of that order in a random order among themselves. A stretch of the epoch then reads
at most K shards (the first batch needs at most K; a node cache of K shards never thrashes), at the cost
of batches mixing only within a window (``benchmarks/bench_shuffle.py`` measures how much). Everything
above holds for any permutation, so exactly-once, equal batch counts and resume at another world size
are unchanged; a window covering every shard gives exactly the plain permutation.
"""
from __future__ import annotations

from typing import Any, Iterator, Optional

import numpy as np

from .distributed import dist_rank_world
from .errors import ConfigError


class DistributedBatchSampler:
    """Batches of sample indices for one rank; usable as a ``DataLoader(batch_sampler=...)``.

    Every rank yields the same number of batches (so DDP never hangs), except with ``pad=False``: then
    every sample is served exactly once, for evaluation loops that run no collective per batch (such as
    :meth:`fastdata.train.Trainer.evaluate`). ``state_dict()`` records how far
    the epoch got; ``load_state_dict()`` resumes at the next unseen sample (see NOTE [epoch plan]).
    """

    def __init__(self, num_samples: int, batch_size: int, *, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, pad: bool = True, rank: Optional[int] = None,
                 world_size: Optional[int] = None, shuffle_window: Optional[int] = None,
                 shards: Optional[np.ndarray] = None) -> None:
        if not isinstance(num_samples, int) or num_samples < 1:
            raise ConfigError(f"num_samples must be a positive integer, got num_samples={num_samples!r}")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"batch_size must be a positive integer, got batch_size={batch_size!r}")
        if not isinstance(seed, int):
            raise ConfigError(f"seed must be an integer, got seed={seed!r}")
        if shuffle_window is not None:
            if not isinstance(shuffle_window, int) or shuffle_window < 1:
                raise ConfigError(f"shuffle_window must be a positive number of shards, got "
                                  f"shuffle_window={shuffle_window!r}")
            if shards is None or len(shards) != num_samples:
                raise ConfigError("shuffle_window needs each sample's shard: the dataset must say where its samples are "
                                  "stored (FastDataset and TokenDataset do; an LMDB made before LMDB shards does not)")
        self.shuffle_window = shuffle_window
        self._shards = None if shards is None else np.asarray(shards, dtype=np.int64)
        self._n_shards = int(self._shards.max()) + 1 if self._shards is not None and len(self._shards) else 0
        self.num_samples, self.batch_size, self.shuffle, self.seed = num_samples, batch_size, shuffle, seed
        self.drop_last, self.pad = drop_last, pad
        self.rank, self.world_size = dist_rank_world(rank, world_size)
        self.epoch = 0
        self.start = 0  # global position this epoch (re)starts from
        self.served = 0  # batches handed out since `start` (kept up to date by the consumer, see advance())

    # -- the plan -------------------------------------------------------------------------------------
    def permutation(self, epoch: Optional[int] = None) -> np.ndarray:
        """The whole epoch's order (all ranks), int64."""
        epoch = self.epoch if epoch is None else epoch
        if not self.shuffle:
            return np.arange(self.num_samples, dtype=np.int64)
        rng = np.random.default_rng((self.seed, epoch))
        if self.shuffle_window is None or self._shards is None or self.shuffle_window >= self._n_shards:
            return rng.permutation(self.num_samples).astype(np.int64)
        # NOTE [windowed shuffle]: shards in a random order, then samples at random within each window
        order = np.empty(self._n_shards, dtype=np.int64)
        order[rng.permutation(len(order))] = np.arange(len(order))  # each shard's place in the shard order
        window = order[self._shards] // self.shuffle_window
        return np.lexsort((rng.random(self.num_samples), window)).astype(np.int64)


    def _rest(self) -> np.ndarray:
        rest = self.permutation()[self.start:]
        w = self.world_size
        if self.drop_last:
            return rest[: len(rest) // (w * self.batch_size) * (w * self.batch_size)]
        if len(rest) % w and self.pad:
            rest = np.concatenate([rest, np.resize(rest, w - len(rest) % w)])  # repeat the first ones
        return rest

    def rank_indices(self) -> np.ndarray:
        """This rank's samples for the rest of the epoch, in order."""
        return self._rest()[self.rank::self.world_size]

    def batches(self, mine: Optional[np.ndarray] = None) -> Iterator[np.ndarray]:
        """This rank's batches from the current position (int64 arrays; does not advance the state);
        ``mine`` is :meth:`rank_indices` when the caller has it already (one permutation per epoch)."""
        mine = self.rank_indices() if mine is None else mine
        first = self.served * self.batch_size
        for i in range(first, len(mine), self.batch_size):
            yield mine[i:i + self.batch_size]

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self.batches():
            self.advance()
            yield batch.tolist()
        self.end_epoch()

    def epoch_batches(self) -> int:
        """Batches this rank serves in a whole epoch (the same on every rank unless ``pad=False``)."""
        n, w, b = self.num_samples, self.world_size, self.batch_size
        if self.drop_last:
            return n // (w * b)
        mine = -(-n // w) if self.pad else len(range(self.rank, n, w))
        return -(-mine // b)

    def __len__(self) -> int:
        """Batches this rank serves in the rest of the current epoch."""
        return -(-len(self.rank_indices()) // self.batch_size) - self.served

    # -- progress and resumption ----------------------------------------------------------------------
    def advance(self, batches: int = 1) -> None:
        """Record that ``batches`` more batches were handed to the consumer."""
        self.served += batches

    def end_epoch(self) -> None:
        """The epoch was served in full: the next one starts from its beginning."""
        self.epoch += 1
        self.start = self.served = 0

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (as ``DistributedSampler.set_epoch``); a resumed position is kept for its epoch."""
        if epoch != self.epoch:
            self.epoch, self.start, self.served = epoch, 0, 0

    def batch_position(self, k: int) -> int:
        """Global position of this epoch's ``k``-th batch since ``start`` (the same on every rank): the key
        the augmentation draws are seeded with, so they survive a resume."""
        return self.start + k * self.batch_size * self.world_size

    def position(self) -> int:
        """Global position reached: every sample of ``perm[:position]`` has been served by some rank."""
        return min(self.num_samples, self.batch_position(self.served))

    def state_dict(self) -> dict[str, Any]:
        state = {"epoch": self.epoch, "position": self.position(), "seed": self.seed, "shuffle": self.shuffle,
                 "num_samples": self.num_samples}
        if self.shuffle_window is not None:  # (absent otherwise: states saved before windows still load)
            state["shuffle_window"] = self.shuffle_window
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("num_samples") != self.num_samples:
            raise ConfigError(f"the state is for {state.get('num_samples')} samples but this dataset has "
                              f"{self.num_samples}: it belongs to another dataset")
        if (state.get("seed") != self.seed or state.get("shuffle") != self.shuffle
                or state.get("shuffle_window") != self.shuffle_window):
            raise ConfigError(f"the state was saved with seed={state.get('seed')}, shuffle={state.get('shuffle')}, "
                              f"shuffle_window={state.get('shuffle_window')}; this sampler has seed={self.seed}, "
                              f"shuffle={self.shuffle}, shuffle_window={self.shuffle_window}: the order would differ")
        self.epoch, self.start, self.served = int(state["epoch"]), int(state["position"]), 0
        if self.start >= self.num_samples:  # saved at the very end of an epoch: the next one is due
            self.end_epoch()


class SamplerBacked:
    """For loaders whose order is a ``self.sampler`` (FastLoader, DALILoader): the torch-style proxies."""

    sampler: DistributedBatchSampler

    def __len__(self) -> int:
        """Batches this rank serves in a whole epoch."""
        return self.sampler.epoch_batches()

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """Where the epoch got to, counting only batches already handed to the consumer."""
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)
