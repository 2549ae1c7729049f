"""A batch's JPEG boxes decoded in one call that holds no GIL: the loop over records compiled by numba
(optional), calling libturbojpeg 3's C entry points (NOTE [nogil loop]). Without numba, or where the
calling convention is not one this module knows, `fastdata.imaging.decode_batch.decode_batch` keeps
its Python loop.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform
import sys
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np

from . import turbojpeg as turbo

log = logging.getLogger(__name__)

# NOTE [nogil loop]: turbojpeg.decode_regions decodes a batch record by record from Python. Each record
# releases the GIL for its decode and retakes it, then again for its copy or resize into the batch row;
# with two loader threads a retake can find the GIL held by the other thread and sleep, so two threads
# scale worse than two processes (benchmarks/RESULTS.md). FFCV compiles its whole loop with numba and
# releases the GIL once a batch. Here, where numba is installed, the same TurboJPEG calls (header, scale,
# cropping region, decode) and the copy of each box that is already the output size into its row run in one compiled
# function that releases the GIL once a batch. A box that needs a resize (or a mirror) is decoded into a
# per-thread arena, up to ARENA_SLOTS at a time, and resized by torch as before (one GIL hand-off a record
# instead of two). The pixels are the same bytes (the same library calls; tests compare the two loops).
# Two threads then scale closer to two processes, with far fewer GIL sleeps (benchmarks/RESULTS.md).
# tj3SetScalingFactor and tj3SetCroppingRegion take small structs of ints by value, which numba cannot
# pass: they are declared here as taking the structs' 64-bit words (two ints packed little-endian in
# one integer), which is how the x86-64 System V and AArch64 conventions pass such structs (in integer
# registers). So the loop runs only there (Linux, macOS); Windows' x64 convention passes a 16-byte
# struct by reference, and it keeps the Python loop. FASTDATA_NOGIL=0 turns the loop off. The compiled
# code is cached beside this file (or in numba's user cache): compiled once, then loaded in each new process
# (plus numba's import) at the first LMDB batch, a fraction of a second.
ENV = "FASTDATA_NOGIL"
ARENA_SLOTS = 8  # boxes decoded for a resize before the loop hands them back to Python
DONE, REFUSED, FULL = 0, 1, 2  # how a call of the loop ended


def _run(header: Any, scaling: Any, cropping: Any, decompress: Any, memmove: Any, handle: int, scale: int,
         addresses: np.ndarray, sizes: np.ndarray, plan: np.ndarray, start: int, out: np.ndarray,
         flips: np.ndarray, done: np.ndarray, arena: np.ndarray, slots: np.ndarray) -> tuple[int, int, int, int]:
    """The loop numba compiles (plain Python without it; tests run both). From record ``start`` on, decode
    each planned record's region (``plan``: turbo.aligned_regions rows, denominator 0 to skip) into
    ``arena``; a box of the output size, not to be mirrored (``flips``), is copied into its row of ``out``
    ``(n, size, size, 3)`` and marked in ``done``; any other box stays in the arena and its ``(record,
    offset)`` goes into ``slots``. Returns ``(next record, DONE | REFUSED | FULL, scale now set on the
    handle, slots filled)``: REFUSED at the record TurboJPEG refused (the handle may be broken), FULL at
    the record that did not fit the arena."""
    n, size = plan.shape[0], out.shape[1]
    row = size * 3
    base, capacity = arena.ctypes.data, arena.shape[0]
    used, k = 0, 0
    for j in range(start, n):
        d = int(plan[j, 0])  # int(): plain ints for ctypes when run uncompiled (a no-op once compiled)
        if d == 0:
            continue
        x0, y0, width, height = int(plan[j, 1]), int(plan[j, 2]), int(plan[j, 3]), int(plan[j, 4])
        top, left, src, length = int(plan[j, 5]), int(plan[j, 6]), int(addresses[j]), int(sizes[j])
        need = width * height * 3
        cut = height - top == size and width - left == size and not flips[j]  # mirrors: torch's flip (a
        # byte loop here is slower)
        if used + need > capacity or (not cut and k == slots.shape[0]):
            return j, FULL, scale, k
        if header(handle, src, length) != 0:
            return j, REFUSED, scale, k
        if d != scale:  # an earlier image's region could refuse the new scale: uncropped first
            if cropping(handle, 0, 0) != 0 or scaling(handle, 1 | (d << 32)) != 0:
                return j, REFUSED, scale, k
            scale = d
        if (cropping(handle, x0 | (y0 << 32), width | (height << 32)) != 0
                or decompress(handle, src, length, base + used, width * 3, 0) != 0):
            return j, REFUSED, scale, k
        if not cut:
            slots[k, 0], slots[k, 1] = j, used
            used += need
            k += 1
            continue
        target, first = out.ctypes.data + j * size * row, base + used + (top * width + left) * 3
        for r in range(size):
            memmove(target + r * row, first + r * width * 3, row)
        done[j] = True
    return n, DONE, scale, k


class _Loop:
    """The compiled loop with the C functions it calls (kept here: ctypes objects own the prototypes)."""

    def __init__(self, lib: turbo._Lib, run: Callable[..., tuple[int, int, int, int]]) -> None:
        vp, i64, ci = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int

        def entry(name: str, *types: Any) -> Any:  # the bound function's address, under numba's prototype
            return ctypes.CFUNCTYPE(ci, vp, *types)(ctypes.cast(getattr(lib, name), vp).value)

        self.run = run
        self.functions = (entry("tj3DecompressHeader", vp, ctypes.c_size_t),
                          entry("tj3SetScalingFactor", i64),  # tjscalingfactor {num, denom}: one 64-bit word
                          entry("tj3SetCroppingRegion", i64, i64),  # tjregion {x, y, w, h}: two words
                          entry("tj3Decompress8", vp, ctypes.c_size_t, vp, ci, ci),
                          ctypes.memmove)  # a CFUNCTYPE object itself: numba calls it like the others


def structs_in_registers() -> bool:
    """Whether this platform passes TurboJPEG's small structs as the 64-bit words NOTE [nogil loop] uses."""
    return (sys.platform != "win32" and sys.byteorder == "little"
            and platform.machine().lower() in ("x86_64", "amd64", "aarch64", "arm64"))


@functools.lru_cache(maxsize=None)
def _compiled(lib: turbo._Lib) -> Optional[_Loop]:
    if not structs_in_registers():
        return None
    try:
        import numba
    except ImportError:
        return None
    try:
        run = numba.njit(nogil=True, cache=True)(_run)
    except RuntimeError:  # no writable cache location: compiled in each process instead
        run = numba.njit(nogil=True)(_run)
    compiled = _Loop(lib, run)
    try:  # compiled now, for the argument types decode_into passes, on an empty batch: a numba that cannot
        # compile it leaves the Python loop in place instead of failing a batch
        none = np.zeros(0, np.int64)
        run(*compiled.functions, 0, 1, none, none, np.zeros((0, 7), np.int64), 0, np.zeros((0, 1, 1, 3), np.uint8),
            np.zeros(0, bool), np.zeros(0, bool), np.zeros(1, np.uint8), np.zeros((ARENA_SLOTS, 2), np.int64))
    except Exception as exc:  # numba's errors have no common base class worth naming here
        log.warning("numba %s could not compile the JPEG decode loop (%s: %s); decoding with the Python loop",
                    numba.__version__, type(exc).__name__, exc)
        return None
    log.debug("batch decode loop compiled by numba %s", numba.__version__)
    return compiled


def loop() -> Optional[_Loop]:
    """The compiled loop, or None: numba or libturbojpeg 3 missing, another calling convention, or
    ``FASTDATA_NOGIL=0``."""
    lib = turbo.library()
    return None if lib is None or os.environ.get(ENV) == "0" else _compiled(lib)


def addresses(blobs: Sequence[Any]) -> tuple[np.ndarray, np.ndarray]:
    """int64 addresses and lengths of ``blobs`` (bytes or any buffer: an LMDB record's view of the page
    cache), no copy; the caller holds ``blobs`` while the loop reads them."""
    out = np.empty((2, len(blobs)), np.int64)
    for j, blob in enumerate(blobs):
        if isinstance(blob, bytes):  # turbo._address passes bytes as they are; the loop needs their address
            out[0, j], out[1, j] = ctypes.cast(ctypes.c_char_p(blob), ctypes.c_void_p).value or 0, len(blob)
        else:
            out[0, j], out[1, j] = turbo._address(blob)
    return out[0], out[1]


def decode_into(compiled: _Loop, blobs: Sequence[Any], plan: np.ndarray, pixels: np.ndarray, flips: np.ndarray,
                done: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    """Decode ``blobs``' planned regions (turbo.aligned_regions rows, denominator 0 to skip) with the
    compiled loop: boxes of the output size go straight into their rows of ``pixels`` (``(n, size, size,
    3)`` C-contiguous uint8) and are marked in ``done``, unless ``flips`` mirrors them; yields ``(j,
    pixels of the box)`` for each box that needs a resize or a mirror, valid until the next item. Records
    TurboJPEG refused stay unmarked: the caller decodes them the whole-image way, as after
    turbo.decode_regions."""
    lib = turbo.library()
    planned = plan[:, 0] != 0
    if lib is None or not planned.any():
        return
    state = turbo._local.__dict__
    need = int((plan[planned, 3] * plan[planned, 4]).max()) * 3
    arena = state.get("arena")
    if arena is None or arena.size < ARENA_SLOTS * need:
        arena = state["arena"] = np.empty(ARENA_SLOTS * need, np.uint8)
    where, sizes = addresses(blobs)
    slots = np.empty((ARENA_SLOTS, 2), np.int64)
    plan = np.ascontiguousarray(plan, dtype=np.int64)
    j, n = 0, len(plan)
    while j < n:
        handle = turbo._handle(lib, state)
        j, status, handle.scale, k = compiled.run(*compiled.functions, handle.ptr, handle.scale, where, sizes,
                                                  plan, j, pixels, flips, done, arena, slots)
        for r, offset in slots[:k].tolist():
            _, _, _, width, height, top, left = plan[r].tolist()
            yield r, arena[offset:offset + width * height * 3].reshape(height, width, 3)[top:, left:]
        if status == REFUSED:
            turbo._refused(lib, state)
            j += 1
