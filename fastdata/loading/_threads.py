"""Torch's intra-op threads for one thread only: loader threads share the machine's cores, not each all of it.

NOTE [intra-op threads per loader thread]: torch's CPU ops parallelise with OpenMP, and a thread that
torch did not start (a FastLoader worker) takes torch's process-wide setting on its first parallel op: by
default every core. So 16 loader threads resizing decoded JPEGs (``decode_batch._resize_into``) each opened
a 16-thread OpenMP team on 16 cores. ``torch.set_num_threads`` cannot help: it also changes the setting
every later thread starts from (the training thread's own, if it has not run a parallel op yet). OpenMP's
``omp_set_num_threads`` sets the calling thread's own count, so each loader thread calls it, through the
OpenMP runtime torch itself loaded, after torch's lazy per-thread set-up (which would overwrite it).
bench_dali's evaluation rows give FastDataset's decode with and without the share in one run
(benchmarks/RESULTS.md); the case it is for is many loader threads on as many cores. (bench_jpeg sets
torch's threads to 1 for the whole process, so its rows do not show it.) Where the runtime cannot be found
(not Linux, not OpenMP) nothing changes.
"""
from __future__ import annotations

import ctypes
import functools
import sys
from typing import Any, Callable, Optional

import torch

_RUNTIMES = ("libgomp", "libiomp5", "libomp")  # GNU (torch's Linux wheels), Intel, LLVM


@functools.lru_cache(maxsize=1)
def _omp_set_num_threads() -> Optional[Callable[[int], Any]]:
    """``omp_set_num_threads`` of the OpenMP runtime loaded in this process, or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open("/proc/self/maps") as f:
            paths = sorted({line.split()[-1] for line in f if line.rstrip().endswith((".so", ".so.1", ".so.5"))
                            and "/" in line})
    except OSError:
        return None
    for path in paths:
        if not path.rsplit("/", 1)[-1].startswith(_RUNTIMES):
            continue
        try:
            fn = ctypes.CDLL(path).omp_set_num_threads  # already loaded: the same runtime torch uses
        except (OSError, AttributeError):
            continue
        fn.argtypes, fn.restype = [ctypes.c_int], None
        return fn
    return None


def limit_intraop_threads(n: int) -> bool:
    """Give torch's CPU ops on the calling thread ``n`` threads (>= 1), leaving every other thread's count
    and torch's process-wide setting as they are. Returns whether the thread now has ``n``."""
    fn = _omp_set_num_threads()
    if fn is None:
        return False
    torch.get_num_threads()  # torch's lazy per-thread set-up first: it would overwrite the count below
    fn(max(1, int(n)))
    return torch.get_num_threads() == max(1, int(n))
