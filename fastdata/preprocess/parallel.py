"""Ordered parallel map over processes with a bounded window, that fails loudly if a worker dies.

Results come back in task order (so output bytes never depend on the worker count) while at most
``2 * workers`` tasks are in flight (so memory stays bounded when the writer is slower than decoding).
``ProcessPoolExecutor`` is used rather than ``multiprocessing.Pool`` because a killed worker raises
``BrokenProcessPool`` there instead of hanging the run forever.

Large results can skip the pipe: with ``slot_bytes > 0``, each task gets a slot of memory shared with the
parent (anonymous ``MAP_SHARED``, inherited by forked workers, so it needs no ``/dev/shm`` space) and
writes its array there instead of returning it. Pickling a chunk of pixels, sending it through a pipe and
unpickling it costs the parent time for every image, which capped a many-core run at the rate one parent
can unpickle.
"""
from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import gc
import mmap
import multiprocessing as mp
import os
import signal
import sys
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable, Iterable, Iterator, Optional

from ..errors import FastdataError

_WINDOW = 2  # tasks in flight per worker
_slots: Optional["_Slots"] = None  # the slots of the running map, in the parent and (inherited) in its workers


class _Slots:
    """``count`` slots of ``size`` bytes in one anonymous shared mapping."""

    def __init__(self, count: int, size: int) -> None:
        self.count, self.size = count, size
        self.map = mmap.mmap(-1, count * size)  # anonymous mappings are MAP_SHARED: forked children share it

    def view(self, k: int) -> memoryview:
        return memoryview(self.map)[k * self.size:(k + 1) * self.size]


def default_workers() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def _start_method() -> str:
    # fork where it exists, as torch's DataLoader does: workers start at once instead of importing anew, a user's
    # script needs no `if __name__ == "__main__"` guard, and workers inherit the shared slots.
    # Workers run only Pillow/numpy code.
    return "fork" if "fork" in mp.get_all_start_methods() else "spawn"


def _init_worker(slots: Optional[_Slots], parent: int) -> None:
    global _slots
    _slots = slots
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is handled once, by the parent
    try:  # a worker that crashes says where (every thread's stack, on stderr) before the run stops
        faulthandler.enable(file=sys.__stderr__, all_threads=True)
    except (AttributeError, ValueError, OSError, RuntimeError):  # no usable stderr (a service, a test's capture)
        pass
    _die_with(parent)


@contextlib.contextmanager
def _forking(first: bool) -> Iterator[None]:
    """Around the first submit, which forks every worker: this process's garbage is collected here first,
    and what is left is frozen, so a worker's collector never finalises objects of this process.

    NOTE [fork and finalisers]: a forked worker inherits every object of the parent, among them reference
    cycles not collected yet (a loader with threads, a DALI pipeline). Collected in the worker (by whichever
    of its threads allocates), a finaliser that joins its threads would join the parent's, which do not
    exist there. In CI a worker thread crashed in pthread_join twice, at the same test, after the whole
    suite had run in that process; this is the likeliest cause found (not reproduced in a smaller run).
    Collecting first leaves no such cycle; freezing keeps objects that become garbage only in the worker
    out of its collections. The parent unfreezes once the workers exist (they are all forked by the first
    submit). Workers also print every thread's stack if they crash (faulthandler)."""
    if not first:
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _die_with(parent: int) -> None:
    """End this worker when the run that started it ends, ``kill -9`` included: left alone, a worker of a
    killed run waits on its task queue forever, holding a copy of the run's memory (Linux; elsewhere a
    worker lives on until its queue breaks). Linux sends the signal when the thread that started the worker
    ends: the pool lives within one `ordered_map` iteration, driven by one thread."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            return
    if os.getppid() != parent:  # the run died before the line above
        os._exit(1)


def slot(k: Optional[int]) -> Optional[memoryview]:
    """In a task of `ordered_map` with ``slot_bytes``: the writable shared slot ``k`` it was given
    (``None`` when the workers cannot share memory with the parent, e.g. under ``spawn``)."""
    return None if k is None or _slots is None else _slots.view(k)


def ordered_map(fn: Callable[..., Any], tasks: Iterable[Any], workers: int,
                slot_bytes: Optional[int] = None) -> Iterator[Any]:
    """``map(fn, tasks)`` over ``workers`` processes (in-process when ``workers == 1``), in order.

    With ``slot_bytes`` given, ``fn(task, k)`` is called instead, where `slot` (k) is a shared slot of
    that many bytes (``None`` when ``slot_bytes`` is 0 or memory cannot be shared: then ``fn`` returns its
    data), and the map yields ``(result, view)``: ``view`` is what the task wrote, valid until the next
    result is asked for (``None`` without a slot).
    """
    shared = bool(slot_bytes) and (workers == 1 or _start_method() == "fork")
    slots = _Slots(_WINDOW * workers + 1, slot_bytes) if shared else None

    def call(i: int, t: Any) -> tuple:
        return (t,) if slot_bytes is None else (t, i % slots.count if slots else None)

    def result(i: int, r: Any) -> Any:
        return r if slot_bytes is None else (r, slots.view(i % slots.count) if slots else None)

    if workers == 1:
        global _slots
        _slots = slots
        try:
            for i, t in enumerate(tasks):
                yield result(i, fn(*call(i, t)))
        finally:
            _slots = None
        return
    with ProcessPoolExecutor(workers, mp_context=mp.get_context(_start_method()), initializer=_init_worker,
                             initargs=(slots, os.getpid())) as pool:  # None unless forked workers can share them
        it = enumerate(tasks)
        pending: deque[tuple[int, Any]] = deque()
        try:
            # When result i is yielded, tasks up to i + window are submitted and none beyond: slot i % count
            # (count = window + 1) is not handed to another task before the consumer asks for result i + 1.
            for _, (i, t) in zip(range(_WINDOW * workers), it):
                with _forking(not pending):
                    pending.append((i, pool.submit(fn, *call(i, t))))
            while pending:
                i, future = pending.popleft()
                r = future.result()
                for j, t in it:
                    pending.append((j, pool.submit(fn, *call(j, t))))
                    break
                yield result(i, r)
        except BrokenProcessPool as exc:  # from result() or from submit(), whichever notices first
            raise FastdataError("a preprocessing worker died (killed, or out of memory?): "
                                "rerun the same command to resume, perhaps with fewer --workers") from exc
        finally:
            for _, f in pending:
                f.cancel()
