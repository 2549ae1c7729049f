"""The unit writer shared by every format: an ordered stream of samples cut into fixed-size units.

A unit (an npy shard, an LMDB part) is the grain of resumption: it is written under temporary names and
renamed when complete, and the preprocess journal records it, so a killed run redoes at most two units
(the one being written and the one being flushed).
"""
from __future__ import annotations

import io
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional, Sequence

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

    ``append`` returns a record per unit whose files are complete: ``{"index", "samples", "source_end",
    "files"}``, where ``source_end`` is one past the source index of the unit's last sample (where a resume
    restarts). A full unit is made durable (fsync, rename) on one helper thread while the next one is
    written, so the caller never waits on the disk's flush; records come back in unit order, from a
    later ``append`` or from ``finish``, which waits for them all.
    """

    def __init__(self, unit_size: int, first_unit: int = 0) -> None:
        self.unit_size = unit_size
        self.index = first_unit
        self.rows = 0
        self._labels: list[np.ndarray] = []
        self._last_src = -1
        self._committer: Optional[ThreadPoolExecutor] = None
        self._pending: deque[tuple[dict[str, Any], Future]] = deque()

    def append(self, samples: Sequence[Any], labels: np.ndarray, src: np.ndarray) -> list[dict[str, Any]]:
        pos, n = 0, len(labels)
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
                self._close()
        return self._completed(wait=False)

    def finish(self) -> list[dict[str, Any]]:
        """Close the last, partly filled unit (if any) and wait until every unit's files are complete."""
        if self.rows:
            self._close()
        return self._completed(wait=True)

    def _close(self) -> None:
        labels = np.concatenate(self._labels)
        record = {"index": self.index, "samples": self.rows, "source_end": self._last_src + 1}
        commit = self._seal(labels)
        if self._committer is None:
            self._committer = ThreadPoolExecutor(1, thread_name_prefix="fastdata-commit")
        self._pending.append((record, self._committer.submit(commit)))
        self.index += 1
        self.rows = 0
        self._labels = []

    def _completed(self, wait: bool) -> list[dict[str, Any]]:
        done = []
        while self._pending and (wait or self._pending[0][1].done()):
            record, future = self._pending.popleft()
            record["files"] = future.result()  # a failed commit (a full disk) raises here, in the caller
            done.append(record)
        if wait:
            self._stop()
        return done

    def _stop(self) -> None:
        if self._committer is not None:
            self._committer.shutdown(wait=True)
            self._committer = None

    def abort(self) -> None:
        """On errors and interrupts: let commits under way end (each leaves a complete unit or nothing), then
        remove the temporary files of the unit in progress."""
        for _, future in self._pending:
            future.exception()  # waits; its error, if any, is not this abort's
        self._pending.clear()
        self._stop()
        self._abort_unit()

    # subclass hooks
    def _open_unit(self) -> None:
        raise NotImplementedError

    def _write(self, samples: Sequence[Any]) -> None:
        raise NotImplementedError

    def _seal(self, labels: np.ndarray) -> Callable[[], list[dict[str, Any]]]:
        """Detach the full unit from the writer; return the work that makes its files durable and returns
        their manifest entries (it runs on the commit thread, so it must not read the writer's state)."""
        raise NotImplementedError

    def _abort_unit(self) -> None:
        """Remove the temporary files of the unit in progress."""
