"""Train/validation splits of a dataset: a deterministic random split of its indices, served as views
that FastLoader reads like the dataset itself (batches, shards for ``shuffle_window``, streamed reads)."""
from __future__ import annotations

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
    perm = np.random.default_rng((seed, 0x5E1)).permutation(n)
    return np.sort(perm[n_val:]), np.sort(perm[:n_val])


def split(ds: FastDataset, val_fraction: float, seed: int = 0) -> tuple[DatasetView, DatasetView]:
    """``(train, val)`` views of ``ds`` (see `split_indices`)."""
    train, val = split_indices(len(ds), val_fraction, seed)
    key = {"val_fraction": float(val_fraction), "seed": int(seed)}
    return DatasetView(ds, train, {"split": "train", **key}), DatasetView(ds, val, {"split": "val", **key})
