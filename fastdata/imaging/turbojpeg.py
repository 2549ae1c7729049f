"""Decode only a box of a JPEG, at a libjpeg scale: libjpeg-turbo 3's TurboJPEG API through ctypes
(NOTE [partial decode]). Optional: without the library every caller falls back to a whole-image decode.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import importlib.metadata
import logging
import os
import threading
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

log = logging.getLogger(__name__)

# NOTE [partial decode]: a crop of a JPEG needs part of the work of decoding it. libjpeg-turbo 3's
# tj3SetCroppingRegion never decodes the rows below the box, only entropy-decodes the rows above it (no
# IDCT, no upsampling, no colour conversion) and does the same for the columns left and right of it, to
# the iMCU (16 px for 4:2:0). So a box costs less than the whole decode, the smaller the box the less
# (benchmarks/RESULTS.md); random-resized-crop boxes average about half the image. The pixels are
# bit-identical to cutting the same box out of the whole decode (same library, same fast IDCT and plain
# upsampling; tested against simplejpeg), so the
# choice of decoder never changes a batch. simplejpeg cannot crop and hides its copy of the library; the
# `turbojpeg` wheel ships libturbojpeg 3 as a shared library (its own Python module is not used), loaded
# here with ctypes: the decode runs without the GIL (CDLL), calls of a microsecond keep it (PyDLL). Order:
# FASTDATA_TURBOJPEG (a path, or "0" to turn partial decoding off), that wheel, the system's libturbojpeg
# if it is version 3. The region's top is put on an iMCU row: libjpeg-turbo 3.0's jpeg_skip_scanlines
# with merged upsampling got a row wrong (or crashed) when it stopped inside one (tests/test_turbo.py
# decodes 4,000 random boxes to hold this).
ENV = "FASTDATA_TURBOJPEG"
_DECOMPRESS = 1  # TJINIT_DECOMPRESS
_SUBSAMP, _PRECISION, _COLORSPACE, _FASTUPSAMPLE, _FASTDCT = 4, 7, 8, 9, 10  # TJPARAM_*
_RGB = 0  # TJPF_RGB
_READABLE_COLORSPACES = (0, 1, 2)  # TJCS_RGB, YCbCr, GRAY; CMYK/YCCK go to the fallback (Pillow converts them)
_MCU_WIDTH = (8, 16, 16, 8, 8, 32, 8)  # tjMCUWidth by TJSAMP_444, 422, 420, GRAY, 440, 411, 441
_MCU_HEIGHT = (8, 8, 16, 8, 16, 8, 32)  # tjMCUHeight, likewise


class _Region(ctypes.Structure):
    _fields_ = [("x", ctypes.c_int), ("y", ctypes.c_int), ("w", ctypes.c_int), ("h", ctypes.c_int)]


class _Scale(ctypes.Structure):
    _fields_ = [("num", ctypes.c_int), ("denom", ctypes.c_int)]


def _candidates() -> Iterator[str]:
    env = os.environ.get(ENV)
    if env is not None:
        if env not in ("", "0"):
            yield env
        return
    try:
        files = importlib.metadata.files("turbojpeg") or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for f in files:
        if Path(str(f)).name.startswith(("libturbojpeg", "turbojpeg.dll")):
            yield str(f.locate())
    system = ctypes.util.find_library("turbojpeg")
    if system:
        yield system


class _Lib:
    """libturbojpeg's functions: the decode through CDLL (runs without the GIL), the calls of a few
    microseconds through PyDLL (keep the GIL: releasing and retaking it costs more than they do, and hands
    the GIL to the other loader thread at every call; see NOTE [partial decode])."""

    def __init__(self, path: str, free: ctypes.CDLL, held: ctypes.PyDLL) -> None:
        self.path = path
        vp, buf, size = ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t  # buf: bytes or an address
        self.tj3Init, self.tj3Destroy, self.tj3Set, self.tj3Get = (held.tj3Init, held.tj3Destroy, held.tj3Set,
                                                                   held.tj3Get)
        self.tj3SetScalingFactor, self.tj3SetCroppingRegion = held.tj3SetScalingFactor, held.tj3SetCroppingRegion
        self.tj3GetErrorStr = held.tj3GetErrorStr
        self.tj3DecompressHeader, self.tj3Decompress8 = held.tj3DecompressHeader, free.tj3Decompress8
        self.tj3Init.restype, self.tj3Init.argtypes = vp, [ctypes.c_int]
        self.tj3Destroy.restype, self.tj3Destroy.argtypes = None, [vp]
        self.tj3Set.argtypes = [vp, ctypes.c_int, ctypes.c_int]
        self.tj3Get.argtypes = [vp, ctypes.c_int]
        self.tj3DecompressHeader.argtypes = [vp, buf, size]
        self.tj3SetScalingFactor.argtypes = [vp, _Scale]
        self.tj3SetCroppingRegion.argtypes = [vp, _Region]
        self.tj3Decompress8.argtypes = [vp, buf, size, vp, ctypes.c_int, ctypes.c_int]
        self.tj3GetErrorStr.restype, self.tj3GetErrorStr.argtypes = ctypes.c_char_p, [vp]


def _bind(path: str) -> _Lib | None:
    """The library at ``path`` with its argument types set, or None when it is not libturbojpeg >= 3."""
    try:
        free, held = ctypes.CDLL(path), ctypes.PyDLL(path)  # one library, two calling conventions
    except OSError:
        return None
    if not hasattr(free, "tj3SetCroppingRegion"):
        return None
    return _Lib(path, free, held)


@functools.lru_cache(maxsize=None)
def library() -> _Lib | None:
    """libturbojpeg 3, or None when there is none (see NOTE [partial decode] for where it is looked for)."""
    for path in _candidates():
        lib = _bind(path)
        if lib is not None:
            log.debug("partial JPEG decoding through %s", path)
            return lib
    return None


class _Handle:
    """One decompressor (TurboJPEG handles are not thread-safe: one per thread), fast modes set once."""

    def __init__(self, lib: _Lib) -> None:
        self.lib, self.ptr = lib, lib.tj3Init(_DECOMPRESS)
        self.scale = 1  # the scaling factor set on it (1/scale); TurboJPEG starts unscaled
        if not self.ptr:
            raise MemoryError("tj3Init failed")
        lib.tj3Set(self.ptr, _FASTDCT, 1)
        lib.tj3Set(self.ptr, _FASTUPSAMPLE, 1)

    def __del__(self) -> None:
        if getattr(self, "ptr", None):
            self.lib.tj3Destroy(self.ptr)


_local = threading.local()
_UNCROPPED = _Region(0, 0, 0, 0)


def decode_region(data: bytes, denominator: int, box: tuple[int, int, int, int], *, scratch: bool = False
                  ) -> np.ndarray | None:
    """The pixels of ``box`` (top, left, height, width in the image decoded at scale ``1/denominator``) as a
    ``(height, width, 3)`` uint8 view, decoded with the fast modes of NOTE [jpeg read path] in fastdata/imaging/decode_batch.py;
    None when libturbojpeg 3 is missing or the record is not a plain 8-bit RGB/YCbCr/grey JPEG, is damaged
    (warnings included) or the box does not fit: the caller then decodes the whole image as before.
    ``scratch``: decode into this thread's reusable buffer (no allocation, and memory the resize then reads
    from cache); the view is valid only until this thread's next ``scratch`` decode. The loader decodes
    whole batches with `decode_regions` instead, with each frame checked by the caller."""
    lib = library()
    if lib is None:
        return None
    state = _local.__dict__
    handle = _handle(lib, state)
    h = handle.ptr
    data, size = _address(data)
    if lib.tj3DecompressHeader(h, data, size) != 0:
        return _refused(lib, state)
    subsamp = lib.tj3Get(h, _SUBSAMP)
    if (lib.tj3Get(h, _COLORSPACE) not in _READABLE_COLORSPACES or lib.tj3Get(h, _PRECISION) != 8
            or not 0 <= subsamp < len(_MCU_WIDTH)):
        return None
    plan = aligned_regions(np.array(box), denominator, _MCU_HEIGHT[subsamp], _MCU_WIDTH[subsamp])[0].tolist()
    out, address = _buffer(state if scratch else None, plan[4], plan[3])
    if not _decompress(lib, handle, data, size, plan, address):
        return _refused(lib, state)
    return out[plan[5]:, plan[6]:]


def aligned_regions(boxes: np.ndarray, denominators: np.ndarray, mcu_heights: np.ndarray,
                    mcu_widths: np.ndarray) -> np.ndarray:
    """What TurboJPEG is asked to decode for each of ``boxes`` (``(n, 4)`` top, left, height, width in the
    image scaled by ``1/denominators``) of images whose iMCU is ``mcu_heights`` x ``mcu_widths`` at full
    scale: int64 ``(n, 7)`` rows ``(denominator, x0, y0, width, height, top, left)``, the region widened
    left and up to the scaled iMCU grid, and where the box starts inside it."""
    # The region's left edge must sit on a scaled iMCU column; its top is put on a scaled iMCU row too:
    # libjpeg-turbo 3.0's jpeg_skip_scanlines with merged (fast) upsampling gave a wrong row, and could
    # crash, when it skipped to a row inside an iMCU (seen in 1 of ~2,000 random boxes).
    top, left, bh, bw = np.asarray(boxes, dtype=np.int64).reshape(-1, 4).T
    d = np.asarray(denominators, dtype=np.int64)
    mh = np.maximum(1, -(-np.asarray(mcu_heights, dtype=np.int64) // d))
    mw = np.maximum(1, -(-np.asarray(mcu_widths, dtype=np.int64) // d))
    y0, x0 = top - top % mh, left - left % mw
    return np.stack(np.broadcast_arrays(d, x0, y0, bw + left - x0, bh + top - y0, top - y0, left - x0), axis=1)


def decode_regions(blobs: Sequence, plan: np.ndarray) -> Iterator[tuple[int, np.ndarray | None]]:
    """Decode a batch's boxes, one record at a time into this thread's scratch buffer: for each row ``j`` of
    ``plan`` (int, ``(n, 7)``: `aligned_regions`, a denominator of 0 to leave the record out)
    yield ``j`` and the box's ``(height, width, 3)`` pixels, valid until the next item is asked for, or None
    where TurboJPEG refused the record. The caller has checked each frame (8-bit, grey or 3 components,
    a subsampling TurboJPEG knows) and sized the plan: nothing is asked of the library but the decode,
    and the Python run per record under the GIL is a few calls long (NOTE [jpeg read path] in fastdata/imaging/decode_batch.py).
    Without libturbojpeg 3 it yields nothing: the caller decodes every record the whole-image way."""
    lib = library()
    rows = np.flatnonzero(plan[:, 0])
    if lib is None or not len(rows):
        return
    state = _local.__dict__
    need = plan[rows, 3] * plan[rows, 4] * 3
    _buffer(state, 1, int(need.max()) // 3)  # grown once for the batch's largest region
    scratch = state["scratch"]
    handle, address = _handle(lib, state), state["scratch_ptr"]
    for j, p in zip(rows.tolist(), plan[rows].tolist()):
        data, size = _address(blobs[j])
        if not _decompress(lib, handle, data, size, p, address):
            _refused(lib, state)
            handle = _handle(lib, state)
            yield j, None
            continue
        _, _, _, width, height, top, left = p
        yield j, scratch[:width * height * 3].reshape(height, width, 3)[top:, left:]


_SCALES = {d: _Scale(1, d) for d in (1, 2, 4, 8)}


def _decompress(lib: _Lib, handle: _Handle, data: bytes | int, size: int, plan: Sequence[int],
                address: int) -> bool:
    """Decode ``plan``'s region (a row of `aligned_regions`) of one record into ``address``; False
    when TurboJPEG refuses it. The scale is set only when it changes (a batch's records mostly share one):
    two calls fewer under the GIL a record."""
    d, x0, y0, width, height = plan[:5]
    h = handle.ptr
    if lib.tj3DecompressHeader(h, data, size):  # (the region below is checked against this header)
        return False
    if d != handle.scale:
        if (lib.tj3SetCroppingRegion(h, _UNCROPPED)  # an earlier image's region could refuse the scale
                or lib.tj3SetScalingFactor(h, _SCALES.get(d) or _Scale(1, d))):
            return False
        handle.scale = d
    return not (lib.tj3SetCroppingRegion(h, _Region(x0, y0, width, height))
                or lib.tj3Decompress8(h, data, size, address, width * 3, _RGB))


def _handle(lib: _Lib, state: dict) -> _Handle:
    handle = state.get("handle")
    if handle is None:
        handle = state["handle"] = _Handle(lib)
    return handle


def _refused(lib: _Lib, state: dict) -> None:
    """After an error a handle can stay broken (a bad Huffman table fails every later header): drop it."""
    log.debug("partial decode refused: %s", lib.tj3GetErrorStr(state["handle"].ptr))
    del state["handle"]


def _address(data: bytes | memoryview) -> tuple[bytes | int, int]:
    """What ctypes passes for ``data``: bytes as they are, any other buffer (an LMDB record's view of the
    page cache) by its address, no copy; and its length."""
    if isinstance(data, bytes):
        return data, len(data)
    src = np.frombuffer(data, np.uint8)  # the caller holds ``data`` while the decoder reads from it
    return src.ctypes.data, src.nbytes


def _buffer(state: dict | None, height: int, width: int) -> tuple[np.ndarray, int]:
    """A ``(height, width, 3)`` uint8 array and its address: fresh, or a view of the thread's scratch."""
    if state is None:
        out = np.empty((height, width, 3), np.uint8)
        return out, out.ctypes.data
    n = height * width * 3
    buf = state.get("scratch")
    if buf is None or buf.size < n:  # grown to the largest region seen; a 256-short-side record needs ~260 KB
        buf = state["scratch"] = np.empty(max(n, 1 << 18), np.uint8)
        state["scratch_ptr"] = buf.ctypes.data
    return buf[:n].reshape(height, width, 3), state["scratch_ptr"]
