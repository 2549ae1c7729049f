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
from typing import Iterator

import numpy as np

log = logging.getLogger(__name__)

# NOTE [partial decode]: a crop of a JPEG needs part of the work of decoding it. libjpeg-turbo 3's
# tj3SetCroppingRegion never decodes the rows below the box, only entropy-decodes the rows above it (no
# IDCT, no upsampling, no colour conversion) and does the same for the columns left and right of it, to
# the iMCU (16 px for 4:2:0). Measured on this repo's 341x256 q90 records (26 KB) on one core: whole fast
# decode 0.36 ms, the centre 224 box 0.31 ms, a box of half the short side 0.23 ms; random-resized-crop
# boxes average about half the image. The pixels are bit-identical to cutting the same box out of the
# whole decode (same library, same fast IDCT and plain upsampling; tested against simplejpeg), so the
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
    ``(height, width, 3)`` uint8 view, decoded with the fast modes of NOTE [jpeg read path] in decode.py;
    None when libturbojpeg 3 is missing or the record is not a plain 8-bit RGB/YCbCr/grey JPEG, is damaged
    (warnings included) or the box does not fit: the caller then decodes the whole image as before.
    ``scratch``: decode into this thread's reusable buffer (no allocation, and memory the resize then reads
    from cache); the view is valid only until this thread's next ``scratch`` decode."""
    lib = library()
    if lib is None:
        return None
    state = _local.__dict__
    handle = state.get("handle")
    if handle is None:
        handle = state["handle"] = _Handle(lib)
    if isinstance(data, bytes):  # ctypes passes the bytes' own buffer
        out = _decode(lib, handle.ptr, data, len(data), denominator, box, state if scratch else None)
    else:  # any other buffer (an LMDB record's view of the page cache) by its address: no copy
        src = np.frombuffer(data, np.uint8)  # held while the decoder reads from it
        out = _decode(lib, handle.ptr, src.ctypes.data, src.nbytes, denominator, box, state if scratch else None)
    if out is None:  # after an error a handle can stay broken (a bad Huffman table fails every later header)
        log.debug("partial decode refused: %s", lib.tj3GetErrorStr(handle.ptr))
        del state["handle"]
    return out


def _buffer(state: dict | None, height: int, width: int) -> tuple[np.ndarray, int]:
    """A ``(height, width, 3)`` uint8 array and its address: fresh, or a view of the thread's scratch."""
    if state is None:
        out = np.empty((height, width, 3), np.uint8)
        return out, out.ctypes.data
    n = height * width * 3
    buf = state.get("scratch")
    if buf is None or buf.size < n:  # grown to the largest box seen; a 256-short-side record needs ~260 KB
        buf = state["scratch"] = np.empty(max(n, 1 << 18), np.uint8)
        state["scratch_ptr"] = buf.ctypes.data
    return buf[:n].reshape(height, width, 3), state["scratch_ptr"]


def _decode(lib: _Lib, h: int, data: bytes | int, size: int, denominator: int, box: tuple[int, int, int, int],
            scratch: dict | None) -> np.ndarray | None:
    if lib.tj3DecompressHeader(h, data, size) != 0:
        return None
    subsamp = lib.tj3Get(h, _SUBSAMP)
    if (lib.tj3Get(h, _COLORSPACE) not in _READABLE_COLORSPACES or lib.tj3Get(h, _PRECISION) != 8
            or not 0 <= subsamp < len(_MCU_WIDTH)):
        return None
    lib.tj3SetCroppingRegion(h, _UNCROPPED)  # an earlier image's region could refuse the new scale
    if lib.tj3SetScalingFactor(h, _Scale(1, denominator)) != 0:
        return None
    top, left, bh, bw = box
    # The region's left edge must sit on a scaled iMCU column; its top is put on a scaled iMCU row too:
    # libjpeg-turbo 3.0's jpeg_skip_scanlines with merged (fast) upsampling gave a wrong row, and could
    # crash, when it skipped to a row inside an iMCU (seen in 1 of ~2,000 random boxes).
    mcu_w, mcu_h = (-(-m[subsamp] // denominator) for m in (_MCU_WIDTH, _MCU_HEIGHT))
    x0, y0 = left - left % mcu_w, top - top % mcu_h
    width, height = bw + left - x0, bh + top - y0
    if lib.tj3SetCroppingRegion(h, _Region(x0, y0, width, height)) != 0:  # checks the box against the image
        return None
    out, address = _buffer(scratch, height, width)
    if lib.tj3Decompress8(h, data, size, address, width * 3, _RGB) != 0:
        return None
    return out[top - y0:, left - x0:]
