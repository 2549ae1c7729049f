"""The extra fields of a dataset with sample fields (NOTE [fields] in fastdata/formats/schema.py), opened in a storage mode and
gathered a batch at a time: one vectorised read per field, never a loop over samples.

``split_fields`` and ``collate_fields`` turn a batch dict into per-sample dicts and back (``ds[i]``,
``DataLoader(ds, collate_fn=ds.collate)``).

A fixed-size field is gathered like the images (NOTE [gather] in fastdata/datasets/images.py). A variable one keeps its
per-shard offsets in RAM as one global ``int64`` array (8 bytes a sample: 16 GB at 2e9 samples, the
size of the sampler's old per-epoch permutation, so very large sets should prefer fixed-size fields);
a batch's values are found with one ``np.repeat`` over the batch's ``(start, length)`` pairs and read
with one take, into a buffer of exactly the batch's total length.

Streamed from object storage (``streamed=True``), the offsets are read up front (small) and each shard's
field files are mapped when the dataset's shard cache brings the shard in (`FieldStore.open_shard`,
from the cache's opener, so they arrive, are checked and are evicted with the images of that shard); past
the limits on open files (``bounded=True``), each field's files are mapped as batches read them
(`ShardMaps`, NOTE [open files] 2 in fastdata/_limits.py), let go of when the cache closes the shard.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
import torch

from .. import _limits
from .._io import safe_join
from ..errors import FormatError
from ..formats.rows import column
from ..formats.schema import OFFSETS, Field, offsets_file
from .shards import (OpenedShards, ShardMaps, ShardSet, check_sizes, load_npy, map_npy, open_shards, take_rows,
                     verify_hashes)

# ``out(key, shape, dtype)`` -> a CPU tensor of exactly that shape to fill (FastLoader's ring slot)
Alloc = Callable[[str, tuple[int, ...], torch.dtype], torch.Tensor]


def torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.zeros(0, dtype.newbyteorder("="))).dtype


def empty(key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


class _Opened:
    """One field's rows as `open_shards` gave them, with where each shard's rows start."""

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
                 device: Union[str, torch.device] = "cpu", shm_dir: Optional[Union[str, Path]] = None,
                 streamed: bool = False, bounded: bool = False) -> None:
        self.root = root
        self.fields = [f for f in fields if f.kind not in ("image", "label")]
        self.device = torch.device(device) if storage == "cuda" else torch.device("cpu")
        shards = manifest["shards"] if "shards" in manifest else manifest["lmdb_shards"]  # (npy or LMDB images)
        counts = np.array(column(shards, "samples"), dtype=np.int64)
        self.offsets: dict[str, np.ndarray] = {}  # variable field -> global offsets (N + 1)
        self._open: dict[str, _Opened] = {}
        self._rows: dict[str, np.ndarray] = {}  # field -> rows per shard
        for f in self.fields:
            if f.variable and f.offsets_of == f.name:
                self.offsets[f.name] = self._load_offsets(root, manifest, f, counts, verify)
        for f in self.fields:
            if f.variable:
                off = self.offsets[f.offsets_of]
                rows = np.diff(off[np.r_[0, np.cumsum(counts)]])  # values per shard
            else:
                rows = counts
            self._rows[f.name] = rows
            if streamed and not bounded:  # mapped shard by shard as they arrive (open_shard)
                opened = OpenedShards(maps=[None] * len(rows))  # type: ignore[list-item]
            else:
                files = [(f.files(k)[0], int(n)) for k, n in enumerate(rows)]
                shards = ShardSet(root, manifest, files, f.shape, f.np_dtype, key=f.name)
                opened = (OpenedShards(maps=ShardMaps(shards, *_limits.bounded_maps())) if streamed  # (as read)
                          else open_shards(shards, storage, verify=verify, device=device, shm_dir=shm_dir))
            self._open[f.name] = _Opened(opened, np.r_[0, np.cumsum(rows)[:-1]].astype(np.int64))

    def open_shard(self, k: int) -> None:
        """Map shard ``k``'s field files (streamed: the shard has just arrived in the cache; bounded, they are
        mapped as batches read them)."""
        for f in self.fields:
            maps = self._open[f.name].maps
            if not isinstance(maps, ShardMaps):
                maps[k] = map_npy(self.root, f.files(k)[0], (int(self._rows[f.name][k]), *f.shape), f.np_dtype)

    def close_shard(self, k: int) -> None:
        """Let go of shard ``k``'s maps (streamed: before the cache may evict it)."""
        for opened in self._open.values():
            if isinstance(opened.maps, ShardMaps):
                opened.maps.drop(k)
            else:
                opened.maps[k] = None  # type: ignore[call-overload]

    @staticmethod
    def _load_offsets(root: Path, manifest: dict[str, Any], f: Field, counts: np.ndarray, verify: bool) -> np.ndarray:
        names = [offsets_file(f.name, k) for k in range(len(counts))]
        if verify:
            verify_hashes(root, manifest, names)
        else:  # (a missing or cut file named, not numpy's error; one stat a file)
            check_sizes(root, manifest, names)
        parts, base = [np.zeros(1, np.int64)], 0
        for name, n in zip(names, counts):
            off = load_npy(safe_join(root, name))
            if off.shape != (n + 1,) or off.dtype != np.int64 or off[0] != 0 or (np.diff(off) < 0).any():
                raise FormatError(f"{root / name}: offsets of shape {off.shape} {off.dtype}, expected ({n + 1},) "
                                  "int64 rising from 0: the dataset is damaged; re-run `fastdata preprocess`")
            parts.append(off[1:] + base)
            base += int(off[-1])
        return np.concatenate(parts)

    def gather(self, idx: np.ndarray, out: Optional[Alloc] = None, idx_on_device: Optional[torch.Tensor] = None
               ) -> dict[str, torch.Tensor]:
        """The batch ``idx`` (checked, non-negative) of every field: fixed fields ``(B, *shape)``, variable
        ones as values plus ``name_offsets`` (``B + 1``). ``storage="cuda"``: ``idx_on_device`` is ``idx`` already
        copied there (the caller's), so the fixed fields share one copy."""
        alloc = out or empty
        on_device = {id(idx): idx_on_device} if idx_on_device is not None else {}
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
            opened = self._open[f.name]
            if opened.device is not None:  # storage="cuda": one index_select on the device
                if id(rows) not in on_device:  # each row array crosses once (boxes and box_labels share one)
                    on_device[id(rows)] = torch.from_numpy(rows).to(opened.device.device)
                batch[f.name] = torch.index_select(opened.device, 0, on_device[id(rows)])
            else:
                batch[f.name] = alloc(f.name, (len(rows), *f.shape), torch_dtype(f.np_dtype))
                opened.take(rows, batch[f.name].numpy())
        return batch


def split_fields(batch: dict[str, torch.Tensor], fields: list[Field]) -> list[dict[str, torch.Tensor]]:
    """A batch dict -> one dict per sample (a variable field's sample is its values; no offsets)."""
    n = len(batch["image"])
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(n)]
    names = ["label"] if "label" in batch else []
    for f in fields:
        if f.kind in ("image", "label"):
            continue
        if f.variable:
            bounds = batch[f.offsets_of + OFFSETS].tolist()
            for i in range(n):
                out[i][f.name] = batch[f.name][bounds[i]:bounds[i + 1]]
        else:
            names.append(f.name)
    for key in ["image"] + names:
        for i, v in enumerate(batch[key].unbind(0)):
            out[i][key] = v
    return out


def collate_fields(samples: Sequence[dict[str, torch.Tensor]], fields: list[Field]) -> dict[str, torch.Tensor]:
    """Per-sample dicts -> the batch dict `FastDataset.get_batch` gives."""
    batch = {"image": torch.stack([s["image"] for s in samples])}
    for f in fields:
        if f.kind == "image":
            continue
        values = [s[f.name] for s in samples]
        if not f.variable:
            batch[f.name] = torch.stack(values)
            continue
        batch[f.name] = torch.cat(values)
        if f.offsets_of == f.name:
            batch[f.name + OFFSETS] = torch.tensor([0] + [len(v) for v in values], dtype=torch.int64).cumsum(0)
    return batch
