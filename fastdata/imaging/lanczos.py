"""Pillow's Lanczos resize, compiled by numba to the same bytes, for the preprocess writer.

NOTE [exact lanczos]: Pillow's Lanczos is 65-70% of the LMDB writer's CPU (500x375 photos); where numba is
installed, `prepare` compiles the same arithmetic as loops that vectorise (fastdata/imaging/decode_file.py
uses them through `ready` and `resize`):
  1. The same bytes: Pillow's coefficients (its double-precision filter, normalised to 22-bit fixed point),
     its int32 sums and clipping, its intermediate rounding to uint8 and its order of the two passes
     (Pillow 13: vertical first when the height loses more than twice the pixels the width loses).
  2. Checked, not assumed: `prepare` compares the kernel with this process's Pillow on probe images (both
     pass orders) and keeps Pillow where any byte differs (another Pillow may order or round otherwise).
  3. Only where it was prepared before the workers fork (they inherit the compiled code): a worker never
     imports numba itself (0.3 s a process). Whole RGB arrays downscaled less than ``2 * reducing_gap`` only.
  4. 2.2 ms against Pillow's 3.4 ms a 500x375 photo to 341x256 (one core, CPU time).
"""
from __future__ import annotations

import functools
import logging
import math
from typing import Any, Optional

import numpy as np
from PIL import Image

log = logging.getLogger(__name__)

_PRECISION = 22  # Pillow's PRECISION_BITS for 8-bit images (32 - 8 - 2)
_lanczos: Optional[tuple[Any, Any]] = None  # numba's (coefficients, pass) once `prepare` checked them
_PROBES = (((375, 500), (341, 256)), ((500, 375), (256, 341)), ((700, 200), (150, 180)), ((100, 100), (75, 50)),
           ((100, 100), (76, 50)), ((300, 400), (399, 300)), ((300, 400), (400, 299)), ((37, 1000), (200, 8)))


def ready() -> bool:
    """Whether `prepare` compiled and checked the kernel in this process (or in its parent, before a fork)."""
    return _lanczos is not None


def prepare(reducing_gap: float) -> bool:
    """Compile the kernel in this process and check it against this Pillow's Lanczos with ``reducing_gap``
    (NOTE [exact lanczos] rule 2), once; without numba, or where any byte differs, Pillow's resize stays.

    Args:
        reducing_gap: The gap the caller passes Pillow's ``resize``.

    Returns:
        Whether `resize` may be used.
    """
    global _lanczos
    if _lanczos is not None:
        return True
    try:
        import numba
    except ImportError:
        return False
    try:
        try:
            jit = numba.njit(nogil=True, cache=True)
            _lanczos = (jit(_lanczos_coeffs), jit(_lanczos_pass))
        except RuntimeError:  # no writable cache location: compiled in this process only
            _lanczos = (numba.njit(nogil=True)(_lanczos_coeffs), numba.njit(nogil=True)(_lanczos_pass))
        rng = np.random.default_rng(0)
        for (h, w), wh in _PROBES:
            pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
            want = np.asarray(Image.fromarray(pixels, "RGB").resize(wh, Image.Resampling.LANCZOS,
                                                                   reducing_gap=reducing_gap))
            if not np.array_equal(resize(pixels, wh), want):
                log.debug("the compiled Lanczos differs from this Pillow at %s -> %s: resizing with Pillow", (w, h), wh)
                _lanczos = None
                return False
    except Exception as exc:  # noqa: BLE001 - numba's errors share no base class: keep Pillow's resize
        log.warning("numba could not compile the Lanczos kernel (%s: %s); resizing with Pillow",
                    type(exc).__name__, exc)
        _lanczos = None
        return False
    return True


@functools.lru_cache(maxsize=4096)
def _coefficients(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Pillow's Lanczos weights from ``in_size`` to ``out_size`` samples: (int32 (out, ksize), (out, 2))."""
    ksize = int(math.ceil(3.0 * max(in_size / out_size, 1.0))) * 2 + 1
    kk, bounds = np.zeros((out_size, ksize), np.int32), np.zeros((out_size, 2), np.int64)
    _lanczos[0](in_size, out_size, kk, bounds)  # type: ignore[index]
    kk.flags.writeable = bounds.flags.writeable = False  # shared by every later call
    return kk, bounds


def _lanczos_coeffs(in_size: int, out_size: int, kk: np.ndarray, bounds: np.ndarray) -> None:
    """Pillow's ``precompute_coeffs`` and ``normalize_coeffs_8bpc`` for LANCZOS over the whole axis, the same
    double arithmetic in the same order: ``kk[i]`` the fixed-point weights of input ``bounds[i, 0]`` on,
    ``bounds[i, 1]`` of them (compiled by numba)."""
    scale = in_size / out_size
    filterscale = max(scale, 1.0)
    support = 3.0 * filterscale
    ss = 1.0 / filterscale
    w = np.zeros(kk.shape[1], np.float64)
    for xx in range(out_size):
        center = (xx + 0.5) * scale
        xmin = max(int(center - support + 0.5), 0)
        xmax = min(int(center + support + 0.5), in_size) - xmin
        ww = 0.0
        for x in range(xmax):
            t = ((x + xmin) - center + 0.5) * ss
            v = 0.0
            if -3.0 <= t < 3.0:  # sinc(t) * sinc(t / 3), as Pillow's lanczos_filter
                a = 1.0 if t == 0.0 else math.sin(t * math.pi) / (t * math.pi)
                u = t / 3
                v = a * (1.0 if u == 0.0 else math.sin(u * math.pi) / (u * math.pi))
            w[x] = v
            ww += v
        for x in range(xmax):
            k = w[x] / ww if ww != 0.0 else w[x]
            kk[xx, x] = int(-0.5 + k * (1 << _PRECISION)) if k < 0 else int(0.5 + k * (1 << _PRECISION))
        bounds[xx, 0] = xmin
        bounds[xx, 1] = xmax


def _lanczos_pass(src: np.ndarray, dst: np.ndarray, kk: np.ndarray, bounds: np.ndarray, first: int) -> None:
    """One pass of Pillow's 8-bit resample along the first axis of flattened rows: ``dst[i]`` = the rounded,
    clipped int32 sum of ``kk[i, t] * src[bounds[i, 0] - first + t]`` (compiled by numba; the loop over a
    row's values vectorises, where Pillow's runs pixel by pixel)."""
    n, m = dst.shape
    acc = np.empty(m, np.int32)
    for i in range(n):
        lo = bounds[i, 0] - first
        acc[:] = 1 << (_PRECISION - 1)
        for t in range(bounds[i, 1]):
            k = kk[i, t]
            row = src[lo + t]
            for j in range(m):
                acc[j] += row[j] * k
        for j in range(m):
            v = acc[j] >> _PRECISION
            dst[i, j] = 0 if v < 0 else (255 if v > 255 else v)


def resize(pixels: np.ndarray, wh: tuple[int, int]) -> np.ndarray:
    """Pillow's Lanczos of uint8 HWC RGB ``pixels`` to ``wh``, no larger on either side, by the compiled passes
    (NOTE [exact lanczos]); a pass along x runs on the transposed rows, so that both are row by row."""
    run = _lanczos[1]  # type: ignore[index]
    h, w = pixels.shape[:2]
    (W, H), c = wh, pixels.shape[2]
    kh, bh = _coefficients(w, W)
    kv, bv = _coefficients(h, H)

    def along_x(rows: np.ndarray, n: int) -> np.ndarray:  # (n, w, c) -> (n, W, c)
        out = np.empty((W, n * c), np.uint8)
        run(np.ascontiguousarray(rows.transpose(1, 0, 2)).reshape(w, n * c), out, kh, bh, 0)
        return np.ascontiguousarray(out.reshape(W, n, c).transpose(1, 0, 2))

    def along_y(rows: np.ndarray, first: int) -> np.ndarray:  # (rows, x, c) -> (H, x, c)
        x = rows.shape[1]
        out = np.empty((H, x * c), np.uint8)
        run(np.ascontiguousarray(rows).reshape(rows.shape[0], x * c), out, kv, bv, first)
        return out.reshape(H, x, c)

    if H == h:
        return along_x(pixels, h)
    if W != w and h - H > 2 * (w - W):  # Pillow 13 runs the vertical pass first here (probed by `prepare`)
        return along_x(along_y(pixels, 0), H)
    first, last = int(bv[0, 0]), int(bv[-1, 0] + bv[-1, 1])  # the rows the vertical pass reads
    rows = pixels[first:last]
    return along_y(along_x(rows, last - first) if W != w else rows, first)
