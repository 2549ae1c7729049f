"""The unit writer shared by every format: an ordered stream of samples cut into fixed-size units.

A unit (an npy shard, an LMDB part) is the grain of resumption: it is written under temporary names and
renamed when complete, and the preprocess journal records it, so a killed run redoes at most one unit.
"""
from __future__ import annotations

import io
from typing import Any, Sequence

import numpy as np

LABEL_DTYPE = np.dtype("<i8")  # little-endian int64 labels, as recorded in the manifest


def npy_header(shape: tuple[int, ...], dtype: np.dtype) -> bytes:
    """The ``.npy`` v1.0 header for a C-ordered array; ``np.load`` (and mmap) reads what follows it."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buf, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False, "shape": shape})
    return buf.getvalue()


def npy_bytes(arr: np.ndarray) -> bytes:
    arr = np.ascontiguousarray(arr)
    return npy_header(arr.shape, arr.dtype) + arr.tobytes()


class UnitWriter:
    """Cuts appended samples into units of ``unit_size``; subclasses write the units' files.

    ``append`` returns a record per unit it completed: ``{"index", "samples", "source_end", "files"}``,
    where ``source_end`` is one past the source index of the unit's last sample (where a resume restarts).
    """

    def __init__(self, unit_size: int, first_unit: int = 0) -> None:
        self.unit_size = unit_size
        self.index = first_unit
        self.rows = 0
        self._labels: list[np.ndarray] = []
        self._last_src = -1

    def append(self, samples: Sequence[Any], labels: np.ndarray, src: np.ndarray) -> list[dict[str, Any]]:
        done, pos, n = [], 0, len(labels)
        while pos < n:
            if self.rows == 0:
                self._open_unit()
            take = min(self.unit_size - self.rows, n - pos)
            self._write(samples[pos:pos + take])
            self._labels.append(np.asarray(labels[pos:pos + take], dtype=LABEL_DTYPE))
            self._last_src = int(src[pos + take - 1])
            self.rows += take
            pos += take
            if self.rows == self.unit_size:
                done.append(self._close())
        return done

    def finish(self) -> list[dict[str, Any]]:
        """Close the last, partly filled unit (if any)."""
        return [self._close()] if self.rows else []

    def _close(self) -> dict[str, Any]:
        labels = np.concatenate(self._labels)
        record = {"index": self.index, "samples": self.rows, "source_end": self._last_src + 1,
                  "files": self._commit(labels)}
        self.index += 1
        self.rows = 0
        self._labels = []
        return record

    def abort(self) -> None:
        """Remove the temporary files of the unit in progress (called on errors and interrupts)."""

    # subclass hooks
    def _open_unit(self) -> None:
        raise NotImplementedError

    def _write(self, samples: Sequence[Any]) -> None:
        raise NotImplementedError

    def _commit(self, labels: np.ndarray) -> list[dict[str, Any]]:
        raise NotImplementedError
