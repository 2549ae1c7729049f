"""The compiled loop of `fastdata.datasets.window_copy` (NOTE [compiled window copy]); imports numba, so
only `window_copy` imports it, on its compile thread. Compiled eagerly for its two signatures (uint16 and
uint32 tokens) and cached beside this file, or in numba's user cache: no call compiles anything."""
from __future__ import annotations

from typing import Any

import numba
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_I64 = types.Array(types.int64, 1, "C")
SIGNATURES = [types.intp(_I64, _I64, _I64, _I64, types.Array(types.uint64, 1, "C"), _I64,
                         types.Array(token, 2, "C"), _I64) for token in (types.uint16, types.uint32)]


@intrinsic
def _memcpy(typingctx: Any, dst: Any, src: Any, nbytes: Any) -> Any:
    """``memcpy(dst, src, nbytes)`` on addresses: LLVM's own intrinsic, so the loop is cacheable."""
    sig = types.void(types.uintp, types.uintp, types.intp)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        d, s, n = args
        cgutils.raw_memcpy(builder, builder.inttoptr(d, cgutils.voidptr_t), builder.inttoptr(s, cgutils.voidptr_t),
                           n, 1)
        return context.get_dummy_value()
    return sig, codegen


def _copy_windows(codes: Any, sizes: Any, strides: Any, first: Any, addresses: Any, offsets: Any, dst: Any,
                  counts: Any) -> int:
    """Row ``r`` of ``dst`` gets window ``codes[r] & (2**56 - 1)`` of source ``codes[r] >> 56``; each source's
    rows are counted into ``counts``. Source ``k``'s segments are ``first[k] .. first[k + 1] - 1`` (their base
    addresses in ``addresses``); segment ``s`` of source ``k`` starts at token ``offsets[s + k]``, and
    ``offsets[first[k + 1] + k]`` is the source's length. Returns -1, or the first row whose index names no
    source or window (nothing is copied for it or after it)."""
    item = dst.itemsize
    length = dst.shape[1]
    base = dst.ctypes.data
    if dst.shape[0] < len(codes):  # (the caller checks; a row past the end would be written to)
        return 0
    for r in range(len(codes)):
        c = codes[r]
        if c < 0:
            return r
        k = c >> 56
        i = c & 0xFFFFFFFFFFFFFF
        if k >= len(sizes) or i >= sizes[k]:
            return r
        t = i * strides[k]  # the window's first token in its source; it ends inside the source (i < sizes[k])
        lo, hi = first[k], first[k + 1] - 1
        while hi - lo > 1:  # the last segment starting at or before t (so never an empty one)
            mid = (lo + hi) // 2
            if offsets[mid + k] <= t:
                lo = mid
            else:
                hi = mid
        s = hi if offsets[hi + k] <= t else lo
        at, left = base + r * length * item, length
        while left > 0:  # a window across segment boundaries: its pieces in turn
            n = min(left, offsets[s + k + 1] - t)
            _memcpy(at, addresses[s] + (t - offsets[s + k]) * item, n * item)
            at += n * item
            t += n
            left -= n
            s += 1
        counts[k] += 1
    return -1


try:
    copy_windows = numba.njit(SIGNATURES, nogil=True, cache=True)(_copy_windows)
except RuntimeError:  # no writable cache location: compiled in this process only
    copy_windows = numba.njit(SIGNATURES, nogil=True)(_copy_windows)
copy_windows.disable_compile()  # a call of another signature raises TypeError: the caller falls back
