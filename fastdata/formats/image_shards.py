"""uint8 image shards: ``images-00000.npy`` ``(n, S, S, 3)`` HWC and ``labels-00000.npy`` ``(n,)`` int64.

Plain ``.npy`` so ``np.load(f, mmap_mode="r")`` works without fastdata. Sample ``i`` is row
``i % shard_size`` of shard ``i // shard_size``: O(1) random access. HWC means a batch moved to the GPU
and permuted to NCHW is already ``channels_last``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np

from .._io import HashingWriter, iter_blocks, write_bytes_atomic
from .base import UnitWriter, npy_bytes, npy_header

IMAGE_DTYPE = np.dtype("|u1")


def images_name(k: int) -> str:
    return f"images-{k:05d}.npy"


def labels_name(k: int) -> str:
    return f"labels-{k:05d}.npy"


class NpyShardWriter(UnitWriter):
    """Streams rows into ``images-K.npy.tmp`` (hashing as it writes) and renames when the shard is full.

    The header is written for a full shard; the one short final shard is rewritten with its true count.
    """

    def __init__(self, out: Path, size: int, shard_size: int, first_shard: int = 0) -> None:
        super().__init__(shard_size, first_shard)
        self.out = Path(out)
        self.sample_shape = (size, size, 3)
        self._file: HashingWriter | None = None

    def _open_unit(self) -> None:
        self._file = HashingWriter(self.out / images_name(self.index))
        self._file.write(npy_header((self.unit_size, *self.sample_shape), IMAGE_DTYPE))

    def _write(self, samples: Any) -> None:
        assert self._file is not None and samples.shape[1:] == self.sample_shape and samples.dtype == IMAGE_DTYPE
        self._file.write(np.ascontiguousarray(samples))

    def _seal(self, labels: np.ndarray) -> Callable[[], list[dict[str, Any]]]:
        assert self._file is not None
        f, self._file = self._file, None
        rows, labels_path = self.rows, self.out / labels_name(self.index)

        def commit() -> list[dict[str, Any]]:
            g = self._rewrite_short(f, rows) if rows < self.unit_size else f
            return [g.commit(), write_bytes_atomic(labels_path, npy_bytes(labels))]
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
        if self._file is not None:
            self._file.abort()
            self._file = None
