"""The unit writer shared by every image format: an ordered stream of samples cut into units by source position.

A unit (an npy shard, an LMDB shard) is the grain of resumption and of parallel work: unit ``k`` holds the
samples of source positions ``[k * unit_size, (k + 1) * unit_size)`` that decoded, so its bytes depend on
its own samples only (a bad sample makes its unit one shorter, never shifts the next one). That is what
lets a Ray task write a whole shard by itself (NOTE [ray byte-identity] in fastdata/preprocess/ray_pool.py).
A unit is written under temporary names and renamed when complete, and the preprocess journal records it,
so a killed run redoes at most the units under way.
"""
from __future__ import annotations

import io
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional, Sequence

import numpy as np

LABEL_DTYPE = np.dtype("<i8")  # little-endian int64 labels, as recorded in the manifest


def body_offsets(files: dict[str, dict[str, Any]], bodies: Sequence[tuple[str, int]], start: int = 0) -> list[int]:
    """Where the rows of each ``.npy`` file of ``bodies`` (``(path, header length)``) begin when the files'
    rows are laid end to end from ``start`` (one RAM or shm copy), then where they end; sizes from the
    manifest's entries ``files``."""
    offsets = [start]
    for rel, skip in bodies:
        offsets.append(offsets[-1] + int(files[rel]["bytes"]) - skip)
    return offsets


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
    """Cuts appended samples into units by source position; subclasses write the units' files.

    ``append`` returns a record per unit whose files are complete: ``{"index", "samples", "source_end",
    "files"}``, where ``source_end`` is one past the unit's last source position (where a resume restarts).
    A unit closes once the caller has reached its end in the source (``end``), even if its last samples
    failed to decode; a unit whose samples all failed is written empty. A full unit is made durable
    (fsync, rename) on one helper thread while the next one is written, so the caller never waits on the
    disk's flush; records come back in unit order, from a later ``append`` or from ``finish``, which waits
    for them all.
    """

    def __init__(self, unit_size: int, first_unit: int = 0) -> None:
        self.unit_size = unit_size
        self.index = first_unit
        self.rows = 0
        self._open = False
        self._end = first_unit * unit_size  # how far into the source the caller has reached
        self._labels: list[np.ndarray] = []
        self._committer: Optional[ThreadPoolExecutor] = None
        self._pending: deque[tuple[dict[str, Any], Future]] = deque()
        self._broken = False  # a commit failed: the units after it are not the journal's next
        self._unsaid: list[dict[str, Any]] = []  # complete units a failed commit kept from its caller
        # called on the commit thread with a unit's files once they are durable (a store's put: it overlaps
        # the next unit's decoding instead of holding up the caller)
        self.on_commit: Optional[Callable[[list[dict[str, Any]]], None]] = None

    def append(self, samples: Sequence[Any], labels: np.ndarray, src: np.ndarray,
               end: Optional[int] = None) -> list[dict[str, Any]]:
        """Write ``samples`` (decoded from source positions ``src``, ascending); ``end``: the source position
        the caller has reached (default: one past ``src``'s last), which closes every unit that ends there."""
        src = np.asarray(src, dtype=np.int64)
        pos, n, size = 0, len(labels), self.unit_size
        while pos < n:
            unit = int(src[pos]) // size
            while self.index < unit:  # the units before it are done (empty when all their samples failed)
                self._close((self.index + 1) * size)
            take = int(np.searchsorted(src[pos:], (unit + 1) * size))
            if not self._open:
                self._open_unit()
                self._open = True
            self._write(samples[pos:pos + take])
            self._labels.append(np.asarray(labels[pos:pos + take], dtype=LABEL_DTYPE))
            self.rows += take
            pos += take
        self._end = max(self._end, int(src[-1]) + 1 if n else self._end, end if end is not None else 0)
        while self._end >= (self.index + 1) * size:
            self._close((self.index + 1) * size)
        return self._completed(wait=False)

    def finish(self, end: Optional[int] = None) -> list[dict[str, Any]]:
        """Close the last, shorter unit (if the source reached into it: ``end``, default as far as appended)
        and wait until every unit's files are complete."""
        self._end = max(self._end, end or 0)
        if self._end > self.index * self.unit_size:
            self._close(self._end)
        return self._completed(wait=True)

    def _close(self, source_end: int) -> None:
        if not self._open:
            self._open_unit()
        labels = np.concatenate(self._labels) if self._labels else np.zeros(0, LABEL_DTYPE)
        record = {"index": self.index, "samples": self.rows, "source_end": source_end}
        commit, then = self._seal(labels), self.on_commit
        if self._committer is None:
            self._committer = ThreadPoolExecutor(1, thread_name_prefix="fastdata-commit")
        self._pending.append((record, self._committer.submit(_committed, commit, then)))
        self.index += 1
        self.rows = 0
        self._open = False
        self._labels = []

    def _completed(self, wait: bool) -> list[dict[str, Any]]:
        done = []
        while self._pending and (wait or self._pending[0][1].done()):
            record, future = self._pending[0]
            try:
                record["files"] = future.result()  # a failed commit (a full disk) raises here, in the caller
            except BaseException:
                self._unsaid = done  # (the units before it are complete: `settle` says so)
                if future.done() and future.exception() is not None:  # the commit failed; else the wait was
                    # interrupted (a Ctrl-C): the commit goes on, and `settle` waits for it
                    self._pending.popleft()
                    self._broken = True
                raise
            self._pending.popleft()
            done.append(record)
        if wait:
            self._stop()
        return done

    def _stop(self) -> None:
        if self._committer is not None:
            self._committer.shutdown(wait=True)
            self._committer = None

    def settle(self) -> list[dict[str, Any]]:
        """On errors and interrupts, before `abort`: wait for the units handed to the commit thread and return
        those complete, in order up to the first that failed (none after a failed commit), so that the run
        keeps them instead of making them again."""
        done, self._unsaid = self._unsaid, []
        while self._pending and not self._broken:
            record, future = self._pending[0]
            if future.exception() is not None:  # (waits; its error is the rerun's to meet again)
                break
            self._pending.popleft()
            record["files"] = future.result()
            done.append(record)
        return done

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


def _committed(commit: Callable[[], list[dict[str, Any]]],
               then: Optional[Callable[[list[dict[str, Any]]], None]]) -> list[dict[str, Any]]:
    files = commit()
    if then is not None:
        then(files)
    return files
