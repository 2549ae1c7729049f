"""The extra fields of a dataset with sample fields (NOTE [fields] in schema.py), opened in a storage mode and
gathered a batch at a time: one vectorised read per field, never a loop over samples.

A fixed-size field is gathered like the images (NOTE [gather] in dataset.py). A variable one keeps its
per-shard offsets in RAM as one global ``int64`` array (8 bytes a sample: 16 GB at 2e9 samples, the
size of the sampler's old per-epoch permutation, so very large sets should prefer fixed-size fields);
a batch's values are found with one ``np.repeat`` over the batch's ``(start, length)`` pairs and read
with one take, into a buffer of exactly the batch's total length.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional, Union

import numpy as np
import torch

from ._io import safe_join
from .errors import FormatError
from .schema import OFFSETS, Field, offsets_file
from .storage.shards import OpenedShards, ShardSet, open_shards, take_rows, verify_hashes

# ``out(key, shape, dtype)`` -> a CPU tensor of exactly that shape to fill (FastLoader's ring slot)
Alloc = Callable[[str, tuple[int, ...], torch.dtype], torch.Tensor]


def torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.zeros(0, dtype.newbyteorder("="))).dtype


def empty(key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


class _Opened:
    """One field's rows as :func:`open_shards` gave them, with where each shard's rows start."""

    def __init__(self, opened: OpenedShards, bases: np.ndarray) -> None:
        self.maps, self.flat, self.device, self.bases = opened.maps, opened.flat, opened.device, bases

    def take(self, rows: np.ndarray, dst: np.ndarray) -> None:
        if self.flat is not None:
            np.take(self.flat, rows, axis=0, out=dst, mode="clip")
            return
        shard = np.searchsorted(self.bases, rows, side="right") - 1
        take_rows(self.maps, shard, rows - self.bases[shard], dst)


class FieldStore:
    """The fields of ``manifest`` other than ``image`` and ``label``, opened as ``storage``."""

    def __init__(self, root: Path, manifest: dict[str, Any], fields: list[Field], storage: str, *, verify: bool,
                 device: Union[str, torch.device] = "cpu", shm_dir: Optional[Union[str, Path]] = None) -> None:
        self.fields = [f for f in fields if f.kind not in ("image", "label")]
        self.device = torch.device(device) if storage == "cuda" else torch.device("cpu")
        shards = manifest["shards"]
        counts = np.array([int(s["samples"]) for s in shards], dtype=np.int64)
        self.offsets: dict[str, np.ndarray] = {}  # variable field -> global offsets (N + 1)
        self._open: dict[str, _Opened] = {}
        for f in self.fields:
            if f.variable and f.offsets_of == f.name:
                self.offsets[f.name] = self._load_offsets(root, manifest, f, counts, verify)
        for f in self.fields:
            if f.variable:
                off = self.offsets[f.offsets_of]
                rows = np.diff(off[np.r_[0, np.cumsum(counts)]])  # values per shard
            else:
                rows = counts
            files = [(f.files(k)[0], int(n)) for k, n in enumerate(rows)]
            opened = open_shards(ShardSet(root, manifest, files, f.shape, f.np_dtype, key=f.name), storage,
                                 verify=verify, device=device, shm_dir=shm_dir)
            self._open[f.name] = _Opened(opened, np.r_[0, np.cumsum(rows)[:-1]].astype(np.int64))

    @staticmethod
    def _load_offsets(root: Path, manifest: dict[str, Any], f: Field, counts: np.ndarray, verify: bool) -> np.ndarray:
        names = [offsets_file(f.name, k) for k in range(len(counts))]
        if verify:
            verify_hashes(root, manifest, names)
        parts, base = [np.zeros(1, np.int64)], 0
        for name, n in zip(names, counts):
            off = np.load(safe_join(root, name), allow_pickle=False)
            if off.shape != (n + 1,) or off.dtype != np.int64 or off[0] != 0 or (np.diff(off) < 0).any():
                raise FormatError(f"{root / name}: offsets of shape {off.shape} {off.dtype}, expected ({n + 1},) "
                                  "int64 rising from 0: the dataset is damaged; re-run `fastdata preprocess`")
            parts.append(off[1:] + base)
            base += int(off[-1])
        return np.concatenate(parts)

    def gather(self, idx: np.ndarray, out: Optional[Alloc] = None) -> dict[str, torch.Tensor]:
        """The batch ``idx`` (checked, non-negative) of every field: fixed fields ``(B, *shape)``, variable
        ones as values plus ``name_offsets`` (``B + 1``)."""
        alloc = out or empty
        batch: dict[str, torch.Tensor] = {}
        spans: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for name, off in self.offsets.items():
            starts, lens = off[idx], off[idx + 1] - off[idx]
            local = np.zeros(len(idx) + 1, np.int64)
            np.cumsum(lens, out=local[1:])
            rows = np.repeat(starts - local[:-1], lens) + np.arange(local[-1], dtype=np.int64)
            spans[name] = (rows, local)
            o = alloc(name + OFFSETS, (len(idx) + 1,), torch.int64)
            o.numpy()[:] = local
            batch[name + OFFSETS] = o.to(self.device) if self.device.type != "cpu" else o
        for f in self.fields:
            rows = spans[f.offsets_of][0] if f.variable else idx
            batch[f.name] = self._take(f, rows, alloc)
        return batch

    def _take(self, f: Field, rows: np.ndarray, alloc: Alloc) -> torch.Tensor:
        opened = self._open[f.name]
        if opened.device is not None:  # storage="cuda": one index_select on the device
            return torch.index_select(opened.device, 0, torch.from_numpy(rows).to(opened.device.device))
        t = alloc(f.name, (len(rows), *f.shape), torch_dtype(f.np_dtype))
        opened.take(rows, t.numpy())
        return t
