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
    """Some samples of a dataset (a train/validation split), served by FastLoader like the dataset itself.

    Args:
        base: The dataset the samples come from.
        indices: The base's indices of the samples, in the view's order.
        key: What the view was made from, for a loader's state (else a digest of the samples, made when asked).
        excluded: Instead of ``indices``: every sample of the base but these, in the base's order. The view
            holds only the excluded set (a train split of 2x10^9 samples holds its validation set's 8 bytes a
            sample, not 16 GB of its own indices).

    Raises:
        ConfigError: If both or neither of ``indices`` and ``excluded`` are given.
    """

    def __init__(self, base: FastDataset, indices: Optional[np.ndarray] = None, key: Optional[dict[str, Any]] = None,
                 *, excluded: Optional[np.ndarray] = None) -> None:
        if (indices is None) == (excluded is None):
            raise ConfigError("DatasetView takes either indices= (the samples it serves) or excluded= (the samples "
                              "it leaves out), not both or neither")
        self.base = base
        self._indices = None if indices is None else np.asarray(indices, dtype=np.int64)
        self._excluded = self._gaps = None
        if excluded is not None:
            given = np.asarray(excluded)
            if given.size and given.dtype.kind not in "iu":  # (floats and bools would be cast silently)
                raise ConfigError(f"excluded= takes sample indices (integers), got {given.dtype} values")
            self._excluded = np.unique(given.astype(np.int64))
            if len(self._excluded) and not 0 <= self._excluded[0] <= self._excluded[-1] < len(base):
                raise ConfigError(f"excluded= names samples {self._excluded[0]}..{self._excluded[-1]}, outside the "
                                  f"dataset's 0..{len(base) - 1}: pass indices of this dataset")
            # the view's i-th sample is base sample i + (excluded samples at or before it): `_gaps[k]` is how
            # many of the view's samples come before the k-th excluded one
            self._gaps = self._excluded - np.arange(len(self._excluded), dtype=np.int64)
        self._key = key  # what `split` made it from; else its indices' digest, made when first asked for
        self.sample_shape, self.sample_dtype, self.device = base.sample_shape, base.sample_dtype, base.device
        self.fields = getattr(base, "fields", None)  # dict batches when the base has sample fields

    def __len__(self) -> int:
        return len(self.base) - len(self._excluded) if self._indices is None else len(self._indices)

    @property
    def indices(self) -> np.ndarray:
        """The base's indices of the view's samples, in its order (made afresh for a view by ``excluded``)."""
        return self._indices if self._indices is not None else self.rows(np.arange(len(self), dtype=np.int64))

    def rows(self, positions: Indices) -> np.ndarray:
        """The base's indices of the samples at ``positions`` of the view (int64, in the same order)."""
        if isinstance(positions, torch.Tensor):
            positions = positions.cpu().numpy()
        at = np.asarray(positions, dtype=np.int64)
        if self._indices is not None:
            return self._indices[at]
        if at.size and not -len(self) <= int(at.min()) <= int(at.max()) < len(self):
            raise IndexError(f"a position of {at.min()}..{at.max()} in a view of {len(self)} samples")
        at = np.where(at < 0, at + len(self), at)
        return at + np.searchsorted(self._gaps, at, side="right")

    @property
    def manifest_sha256(self) -> Optional[str]:
        return getattr(self.base, "manifest_sha256", None)

    @property
    def state_key(self) -> dict[str, Any]:
        """Which samples of the base a position means, as a loader's state names it: a state saved on another
        split would repeat some samples and skip others (and train on the first split's validation set)."""
        if self._key is None:
            if self._indices is not None:
                digest = hashlib.sha256(np.ascontiguousarray(self._indices).tobytes()).hexdigest()
                self._key = {"indices_sha256": digest}
            else:
                digest = hashlib.sha256(np.ascontiguousarray(self._excluded).tobytes()).hexdigest()
                self._key = {"excluded_sha256": digest, "of_samples": len(self.base)}
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
        return self.base.get_batch(self.rows(indices), out, draw)

    def sample_shards(self) -> Optional[np.ndarray]:
        shards = self.base.sample_shards()
        if shards is None:
            return None
        return shards[self._indices] if self._indices is not None else np.delete(shards, self._excluded)

    def shard_bounds(self) -> Optional[np.ndarray]:
        """Where each shard of the base begins among the view's sorted indices, then ``len(self)``: the view's
        samples of a shard are consecutive, so ``shuffle_window`` needs no number per sample (a split of 2x10^9
        samples: 32 GB a rank as `sample_shards`). The bounds `group_by_shard` makes of `sample_shards` (its
        shards up to the last one the view has a sample of): the same order. None for unsorted indices."""
        bounds = self.base.shard_bounds() if hasattr(self.base, "shard_bounds") else None
        if bounds is None or not self._sorted:
            return None
        bounds = np.asarray(bounds, dtype=np.int64)
        if self._indices is not None:
            at = np.searchsorted(self._indices, bounds).astype(np.int64)
        else:  # the view's samples before base sample b: b less the excluded ones before it
            at = bounds - np.searchsorted(self._excluded, bounds)
        return at[:int(np.searchsorted(at, len(self))) + 1]

    @functools.cached_property
    def _sorted(self) -> bool:
        if self._indices is None:
            return True  # (the base's order, less some samples)
        idx, piece = self.indices, 1 << 20  # (compared in pieces: no copy of them all)
        ends = ((i, min(i + piece, len(idx) - 1)) for i in range(0, len(idx) - 1, piece))
        return all(bool(np.all(idx[i + 1:e + 1] >= idx[i:e])) for i, e in ends)

    def plan_reads(self, batches: Iterable[np.ndarray], now: Optional[int] = None) -> Optional[object]:
        plan = getattr(self.base, "plan_reads", None)
        return plan((self.rows(b) for b in batches), now) if plan else None

    def end_reads(self, token: Optional[object]) -> None:
        if token is not None:
            self.base.end_reads(token)

    def download_report(self) -> list[dict[str, Optional[int]]]:
        return self.base.download_report()

    @property
    def streamed(self) -> bool:
        """Whether the base reads through a node cache (a Mixture plans its downloads and shares its budget)."""
        return getattr(self.base, "streamed", False)

    @property
    def cache_limit(self) -> Optional[int]:
        return getattr(self.base, "cache_limit", None)

    def set_cache_limit(self, limit: Any) -> None:
        """The base's node cache limit (`FastDataset.set_cache_limit`): views of one base share its cache."""
        self.base.set_cache_limit(limit)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, Any]:
        return self.base[int(self.rows(np.array([i]))[0])]


def split_indices(n: int, val_fraction: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A deterministic random split of ``range(n)`` by ``seed``: sorted ``(train, val)`` index arrays."""
    val = _val_indices(n, val_fraction, seed)
    return np.delete(np.arange(n, dtype=np.int64), val), val


def _val_indices(n: int, val_fraction: float, seed: int) -> np.ndarray:
    """The sorted validation samples of `split_indices`' split."""
    if not 0 < val_fraction < 1:
        raise ConfigError(f"val_fraction must be in (0, 1), got val_fraction={val_fraction!r}")
    n_val = max(1, round(n * val_fraction))
    if n_val >= n:
        raise ConfigError(f"val_fraction={val_fraction!r} of {n} samples leaves {n - n_val} for training: use a "
                          "smaller --val-fraction, or a validation dataset of its own (--val)")
    # `permutation(n)`'s order, shuffled in place in the smallest dtype that holds n (the same swaps): its
    # first n_val are the validation set (4 bytes a sample at the peak, for a split of 2x10^9 samples)
    perm = np.arange(n, dtype=np.int32 if n < 1 << 31 else np.int64)
    np.random.default_rng((seed, 0x5E1)).shuffle(perm)
    val = perm[:n_val].astype(np.int64)
    del perm
    val.sort()
    return val


def split(ds: FastDataset, val_fraction: float, seed: int = 0) -> tuple[DatasetView, DatasetView]:
    """``(train, val)`` views of ``ds`` (see `split_indices`); the train view holds only the validation set."""
    val = _val_indices(len(ds), val_fraction, seed)
    key = {"val_fraction": float(val_fraction), "seed": int(seed)}
    return DatasetView(ds, excluded=val, key={"split": "train", **key}), DatasetView(ds, val, {"split": "val", **key})
