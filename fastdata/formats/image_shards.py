"""uint8 image shards: ``images-00000.npy`` ``(n, S, S, 3)`` HWC and ``labels-00000.npy`` ``(n,)`` int64.

Every label is also in one ``labels.npy`` (the manifest's ``all_labels``; 8 bytes a sample): a dataset
streamed from object storage reads it at opening when it is small, instead of one request per shard for
its labels file. Datasets without it still load (their readers use the shards' label files).

Plain ``.npy`` so ``np.load(f, mmap_mode="r")`` works without fastdata. Sample ``i`` is row
``i % shard_size`` of shard ``i // shard_size``: O(1) random access. HWC means a batch moved to the GPU
and permuted to NCHW is already ``channels_last``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np

from .._io import HashingWriter, iter_blocks, write_bytes_atomic
from .base import UnitWriter, npy_bytes, npy_header
from .schema import Field, offsets_file

IMAGE_DTYPE = np.dtype("|u1")
ALL_LABELS_NAME = "labels.npy"


def images_name(k: int) -> str:
    return f"images-{k:05d}.npy"


def labels_name(k: int) -> str:
    return f"labels-{k:05d}.npy"


class Rows:
    """A run of samples with fields (NOTE [fields] in fastdata/formats/schema.py): ``images`` ``(n, S, S, 3)`` and, per extra
    field, an ``(n, *shape)`` array (fixed size) or a list of ``n`` arrays (variable length)."""

    def __init__(self, images: np.ndarray, fields: dict[str, Any]) -> None:
        self.images, self.fields = images, fields

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, sl: slice) -> "Rows":
        return Rows(self.images[sl], {k: v[sl] for k, v in self.fields.items()})


class FieldParts:
    """The extra fields' values of the unit being written (any unit writer with fields), and their files
    when it is sealed: fixed fields stacked, variable ones concatenated with offsets (NOTE [fields])."""

    def __init__(self, out: Path, fields: Sequence[Field]) -> None:
        self.out, self.fields = Path(out), list(fields)
        self._parts: dict[str, list[Any]] = {f.name: [] for f in self.fields}

    def add(self, values: dict[str, Any]) -> None:
        for name, part in values.items():
            self._parts[name].append(part)

    def clear(self) -> None:
        self._parts = {f.name: [] for f in self.fields}

    def arrays(self, k: int, rows: int) -> list[tuple[Path, np.ndarray]]:
        """Unit ``k``'s field files (``rows`` samples) as ``(path, array)``; the parts are taken."""
        out = []
        for fld in self.fields:
            parts, self._parts[fld.name] = self._parts[fld.name], []
            if not fld.variable:
                arr = np.concatenate(parts) if parts else np.zeros((0, *fld.shape), fld.np_dtype)
                out.append((self.out / fld.files(k)[0], arr.astype(fld.np_dtype, copy=False)))
                continue
            values = [np.asarray(v, fld.np_dtype).reshape(-1, *fld.shape) for part in parts for v in part]
            assert len(values) == rows
            flat = np.concatenate(values) if values else np.zeros((0, *fld.shape), fld.np_dtype)
            out.append((self.out / fld.files(k)[0], flat))
            if fld.offsets_of == fld.name:
                offsets = np.zeros(rows + 1, np.dtype("<i8"))
                np.cumsum([len(v) for v in values], out=offsets[1:])
                out.append((self.out / offsets_file(fld.name, k), offsets))
        return out


class NpyShardWriter(UnitWriter):
    """Streams rows into ``images-K.npy.tmp`` (hashing as it writes) and renames when the shard is full.

    The header is written for a full shard; the one short final shard is rewritten with its true count.
    With ``fields`` (the extra fields of a version-2 dataset; samples come as `Rows`), each shard
    also gets their files, and ``labels-K.npy`` only when ``labels`` is true.
    """

    def __init__(self, out: Path, size: int, shard_size: int, first_shard: int = 0, *,
                 fields: Optional[Sequence[Field]] = None, labels: bool = True) -> None:
        super().__init__(shard_size, first_shard)
        self.out = Path(out)
        self.sample_shape = (size, size, 3)
        self._file: HashingWriter | None = None
        self.fields = FieldParts(self.out, fields or [])
        self._with_labels = labels

    def _open_unit(self) -> None:
        self._file = HashingWriter(self.out / images_name(self.index))
        self._file.write(npy_header((self.unit_size, *self.sample_shape), IMAGE_DTYPE))

    def _write(self, samples: Any) -> None:
        if isinstance(samples, Rows):
            self.fields.add(samples.fields)
            samples = samples.images
        assert self._file is not None and samples.shape[1:] == self.sample_shape and samples.dtype == IMAGE_DTYPE
        self._file.write(np.ascontiguousarray(samples))

    def _seal(self, labels: np.ndarray) -> Callable[[], list[dict[str, Any]]]:
        assert self._file is not None
        f, self._file = self._file, None
        rows, k = self.rows, self.index
        extra = [(self.out / labels_name(k), labels)] if self._with_labels else []
        extra += self.fields.arrays(k, rows)

        def commit() -> list[dict[str, Any]]:
            g = self._rewrite_short(f, rows) if rows < self.unit_size else f
            return [g.commit()] + [write_bytes_atomic(path, npy_bytes(arr)) for path, arr in extra]
        return commit

    def _rewrite_short(self, full: HashingWriter, rows: int) -> HashingWriter:
        full._f.close()
        body = full.tmp.with_name(full.tmp.name + ".body")
        full.tmp.replace(body)
        short = HashingWriter(full.path)
        try:
            short.write(npy_header((rows, *self.sample_shape), IMAGE_DTYPE))
            skip = len(npy_header((self.unit_size, *self.sample_shape), IMAGE_DTYPE))
            for block in iter_blocks(body, skip):
                short.write(block)
        finally:
            body.unlink(missing_ok=True)
        return short

    def _abort_unit(self) -> None:
        self.fields.clear()
        if self._file is not None:
            self._file.abort()
            self._file = None
