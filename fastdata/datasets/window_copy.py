"""Token windows copied into one batch by one compiled call, without the GIL: a Mixture's of token sources,
and one TokenDataset's (NOTE [window gather] rule 5 in tokens.py).

NOTE [compiled window copy]:
1. Why: a batch of 512 windows of 2 KB costs its fixed per-call work more than its bytes. A Mixture of
   three token sources made one `get_batch` a handful of numpy steps plus three ``index_select`` calls,
   each handing the GIL back and forth with the loader's other threads: about 0.7x one dataset's tokens/s
   on 2 cores (benchmarks/history/mixture.md). Here one numba call checks every served index, counts each
   source's rows and copies each window with one memcpy (a window across a shard boundary in pieces),
   with the GIL released for the whole batch.
2. Optional and out of the way: used where numba is installed, compiled once a process on a thread of its
   own the first time a token dataset or mixture asks (numba's on-disk cache makes later processes quick),
   so no batch waits for a compiler; until then, without numba, or with ``FASTDATA_NOGIL=0``, `WindowGather`
   serves the same bytes. The loop itself is fastdata/datasets/window_kernel.py.
3. What it reads: each source's table of memory segments (`TokenDataset._copy_table`: the base address of
   each shard, or of the one flat array, and the token offset where each begins). The table holds the
   arrays, and a call holds the tables, so no segment is unmapped while it is copied from; a dataset opened
   again (unpickled) has a new table. Streamed sources and ``random_windows`` have no table and keep
   `WindowGather`.
4. Checked, not trusted: an index naming a source or window that does not exist stops the copy and the
   caller's own path raises the error it always raised.
"""
from __future__ import annotations

import logging
import os
import threading
import weakref
from typing import Any, Callable, Optional, Sequence

import numpy as np

log = logging.getLogger(__name__)
ENV = "FASTDATA_NOGIL"  # "0": no compiled loops (the JPEG loop's switch too, fastdata/imaging/turbojpeg_loop.py)

_state: dict[str, Any] = {"kernel": None, "started": False}
_lock = threading.Lock()
_done = threading.Event()


def _compile() -> None:
    """Import (compiling, or loading numba's cache) and check the kernel; without numba, or where it fails,
    the numpy/torch gather stays."""
    try:
        from . import window_kernel
    except ImportError:  # no numba
        _done.set()
        return
    except Exception as exc:  # numba's own failures: say so once
        log.warning("compiled window copy unavailable (%s: %s); token windows use the numpy/torch gather",
                    type(exc).__name__, exc)
        _done.set()
        return
    try:
        run = window_kernel.copy_windows
        for dtype in (np.uint16, np.uint32):  # a probe of each signature: a window across two segments
            a, b = np.arange(3, dtype=dtype), np.arange(3, 8, dtype=dtype)
            probe = np.zeros((1, 4), dtype=dtype)
            ones = np.ones(1, dtype=np.int64)
            run(np.zeros(1, dtype=np.int64), ones * 2, ones, np.array([0, 2], dtype=np.int64),
                np.array([a.ctypes.data, b.ctypes.data], dtype=np.uint64), np.array([0, 3, 8], dtype=np.int64), probe,
                np.zeros(1, dtype=np.int64))
            if probe[0].tolist() != [0, 1, 2, 3]:
                raise AssertionError(f"it copied {probe[0].tolist()} for [0, 1, 2, 3]")
        _state["kernel"] = run
    except Exception as exc:
        log.warning("compiled window copy unavailable (%s: %s); token windows use the numpy/torch gather",
                    type(exc).__name__, exc)
    finally:
        _done.set()


def kernel(wait: bool = False) -> Optional[Callable[..., int]]:
    """The compiled copy, or None while it compiles (started here on a thread, once a process) or where
    numba is missing (NOTE [compiled window copy] 2). ``wait`` blocks until the compile is over (tests)."""
    got = _state["kernel"]
    if got is not None or _done.is_set() or os.environ.get(ENV) == "0":  # (compiled, failed, or off)
        return got
    with _lock:
        if not _state["started"]:
            _state["started"] = True
            threading.Thread(target=_compile, name="fastdata-window-copy-compile", daemon=True).start()
    if wait:
        _done.wait()
    return _state["kernel"]


def _before_fork() -> None:
    """A fork waits out a compile under way: a child forked meanwhile would inherit numba's import locks held
    by a thread it does not have, and hang at its first import of numba (the Lanczos kernel's too)."""
    if _state["started"]:
        _done.wait(timeout=120)


os.register_at_fork(before=_before_fork)


class Segments:
    """A token source's memory as the copy reads it (NOTE [compiled window copy] 3): its arrays (held while
    the table lives), their base addresses, and the token where each begins, then the source's length.

    Args:
        arrays: The source's token arrays in order (its shards, or its one flat array).
        offsets: ``len(arrays) + 1`` token offsets.
    """

    __slots__ = ("arrays", "addresses", "offsets", "__weakref__")

    def __init__(self, arrays: Sequence[np.ndarray], offsets: np.ndarray) -> None:
        self.arrays = list(arrays)
        self.addresses = np.array([a.ctypes.data for a in self.arrays], dtype=np.uint64)
        self.offsets = np.asarray(offsets, dtype=np.int64)


class WindowCopy:
    """The compiled copy for one set of token sources (a Mixture's, or one dataset alone), once each has its
    `Segments`.

    Args:
        sources: Token datasets of one window length and dtype, each with ``seq_len``, ``_copy_table`` (a
            `Segments`, or None), ``stride`` and ``random_windows``.
    """

    def __init__(self, sources: Sequence[Any]) -> None:
        self.sources = list(sources)
        self.sizes = np.array([len(ds) for ds in self.sources], dtype=np.int64)
        self.strides = np.array([ds.stride for ds in self.sources], dtype=np.int64)
        self.length = int(self.sources[0].seq_len) + 1  # a window's tokens: what `sizes` bounds
        # streamed sources (no table) and random windows keep WindowGather
        self.usable = not any(ds.random_windows or ds._copy_table is None for ds in self.sources)
        self._layout: Optional[tuple[list[Any], np.ndarray, np.ndarray, np.ndarray]] = None

    def ready(self) -> bool:
        """Whether the copy can serve now (starting the compile the first time it is asked)."""
        return self.usable and (_state["kernel"] is not None or kernel() is not None)

    def _lay_out(self, tables: list[Segments]) -> tuple[list[Any], np.ndarray, np.ndarray, np.ndarray]:
        """The sources' tables as the kernel reads them, with weak references that tell when one changed (a
        source closed, or opened again) without holding its memory."""
        first = np.zeros(len(tables) + 1, dtype=np.int64)
        np.cumsum([len(t.addresses) for t in tables], out=first[1:])
        return ([weakref.ref(t) for t in tables], first, np.concatenate([t.addresses for t in tables]),
                np.concatenate([t.offsets for t in tables]))

    def __call__(self, codes: np.ndarray, dst: np.ndarray) -> Optional[np.ndarray]:
        """Row ``r`` of ``dst`` gets the window ``codes[r]`` names; returns each source's row count, or None
        where the copy cannot serve (not compiled yet, a source without a table, a bad index: the caller's
        own path serves, or raises)."""
        run = _state["kernel"] if self.usable else None
        if run is None or dst.ndim != 2 or dst.shape[1] != self.length or len(dst) < len(codes):
            return None  # (a wider or shorter dst would be written, or read, past its end)
        tables = [ds._copy_table for ds in self.sources]  # held for the call: their arrays stay mapped
        layout = self._layout
        if layout is None or any(t is None or ref() is not t for ref, t in zip(layout[0], tables)):
            if any(t is None for t in tables):
                return None
            layout = self._layout = self._lay_out(tables)
        counts = np.zeros(len(tables), dtype=np.int64)
        if not (codes.flags.c_contiguous and codes.flags.writeable):  # (the one layout it was compiled for)
            codes = codes.copy()
        try:
            if run(codes, self.sizes, self.strides, layout[1], layout[2], layout[3], dst, counts) >= 0:
                return None
        except TypeError:  # a dtype or layout it was not compiled for
            return None
        return counts
