"""Train/validation splits of a dataset: a deterministic random split of its indices, served as views
that FastLoader reads like the dataset itself (batches, shards for ``shuffle_window``, streamed reads)."""
from __future__ import annotations

import functools
import hashlib
from typing import Any, Iterable, Optional

import numpy as np
import torch

from ..errors import ConfigError
from ..storage.shards import Indices
from .images import FastDataset


class DatasetView:
    """Some samples of a dataset (a train/validation split), served by FastLoader like the dataset itself."""

    def __init__(self, base: FastDataset, indices: np.ndarray, key: Optional[dict[str, Any]] = None) -> None:
        self.base = base
        self.indices = np.asarray(indices, dtype=np.int64)
        self._key = key  # what `split` made it from; else its indices' digest, made when first asked for
        self.sample_shape, self.sample_dtype, self.device = base.sample_shape, base.sample_dtype, base.device
        self.fields = getattr(base, "fields", None)  # dict batches when the base has sample fields

    def __len__(self) -> int:
        return len(self.indices)

    @property
    def manifest_sha256(self) -> Optional[str]:
        return getattr(self.base, "manifest_sha256", None)

    @property
    def state_key(self) -> dict[str, Any]:
        """Which samples of the base a position means, as a loader's state names it: a state saved on another
        split would repeat some samples and skip others (and train on the first split's validation set)."""
        if self._key is None:
            self._key = {"indices_sha256": hashlib.sha256(np.ascontiguousarray(self.indices).tobytes()).hexdigest()}
        base = getattr(self.base, "state_key", None)
        return {**self._key, "of": base} if base is not None else dict(self._key)

    @property
    def classes(self) -> list[str]:
        return self.base.classes

    @property
    def random_crops(self) -> bool:
        return getattr(self.base, "random_crops", False)

    def get_batch(self, indices: Indices, out: Optional[torch.Tensor] = None,
                  draw: Optional[tuple[int, int, int, int]] = None) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(indices, torch.Tensor):
            indices = indices.cpu().numpy()
        return self.base.get_batch(self.indices[np.asarray(indices, dtype=np.int64)], out, draw)

    def sample_shards(self) -> Optional[np.ndarray]:
        shards = self.base.sample_shards()
        return None if shards is None else shards[self.indices]

    def shard_bounds(self) -> Optional[np.ndarray]:
        """Where each shard of the base begins among the view's sorted indices, then ``len(self)``: the view's
        samples of a shard are consecutive, so ``shuffle_window`` needs no number per sample (a split of 2x10^9
        samples: 32 GB a rank as `sample_shards`). The bounds `group_by_shard` makes of `sample_shards` (its
        shards up to the last one the view has a sample of): the same order. None for unsorted indices."""
        bounds = self.base.shard_bounds() if hasattr(self.base, "shard_bounds") else None
        if bounds is None or not self._sorted:
            return None
        at = np.searchsorted(self.indices, bounds).astype(np.int64)
        return at[:int(np.searchsorted(at, len(self.indices))) + 1]

    @functools.cached_property
    def _sorted(self) -> bool:
        idx, piece = self.indices, 1 << 20  # (compared in pieces: no copy of them all)
        ends = ((i, min(i + piece, len(idx) - 1)) for i in range(0, len(idx) - 1, piece))
        return all(bool(np.all(idx[i + 1:e + 1] >= idx[i:e])) for i, e in ends)

    def plan_reads(self, batches: Iterable[np.ndarray], now: Optional[int] = None) -> Optional[object]:
        plan = getattr(self.base, "plan_reads", None)
        return plan((self.indices[np.asarray(b, dtype=np.int64)] for b in batches), now) if plan else None

    def end_reads(self, token: Optional[object]) -> None:
        if token is not None:
            self.base.end_reads(token)

    def download_report(self) -> list[dict[str, Optional[int]]]:
        return self.base.download_report()

    def __getitem__(self, i: int) -> tuple[torch.Tensor, Any]:
        return self.base[int(self.indices[i])]


def split_indices(n: int, val_fraction: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A deterministic random split of ``range(n)`` by ``seed``: sorted ``(train, val)`` index arrays."""
    if not 0 < val_fraction < 1:
        raise ConfigError(f"val_fraction must be in (0, 1), got val_fraction={val_fraction!r}")
    n_val = max(1, round(n * val_fraction))
    if n_val >= n:
        raise ConfigError(f"val_fraction={val_fraction!r} of {n} samples leaves {n - n_val} for training: use a "
                          "smaller --val-fraction, or a validation dataset of its own (--val)")
    # `permutation(n)`'s order, shuffled in place in the smallest dtype that holds n (the same swaps), each
    # part sorted in place: 12 bytes a sample at the peak where 16 were (a split of 2x10^9 samples)
    perm = np.arange(n, dtype=np.int32 if n < 1 << 31 else np.int64)
    np.random.default_rng((seed, 0x5E1)).shuffle(perm)
    train, val = perm[n_val:].astype(np.int64), perm[:n_val].astype(np.int64)
    del perm
    train.sort()
    val.sort()
    return train, val


def split(ds: FastDataset, val_fraction: float, seed: int = 0) -> tuple[DatasetView, DatasetView]:
    """``(train, val)`` views of ``ds`` (see `split_indices`)."""
    train, val = split_indices(len(ds), val_fraction, seed)
    key = {"val_fraction": float(val_fraction), "seed": int(seed)}
    return DatasetView(ds, train, {"split": "train", **key}), DatasetView(ds, val, {"split": "val", **key})
