"""CUDAPrefetcher's per-batch launches on a thread of its own (``CUDAPrefetcher(run_ahead=True)``).

NOTE [prefetch thread]: what moves off the training thread, and what stays.

1. On a GPU a fast model's step is host-bound: every microsecond the training thread spends launching a
   batch's copies and conversion is one its model does not queue (benchmarks/history/gpu.md: ResNet-18@112
   waits about 3% of its steps with graphed conversions, most of it such host time).
2. With ``run_ahead`` the consumer's thread still takes each batch from the loader, records its position
   and seeds its draws (the exactly-once bookkeeping of NOTE [prefetch] 11 stays where ``state_dict`` reads
   it), then hands a `Job` to this thread. Here the batch is pinned, copied, converted (from a CUDA graph
   where it can be) and its events recorded, on the prefetcher's side stream.
3. The consumer then only waits for the job (a threading event, which releases the GIL), makes its stream
   wait on the job's event (no host sync) and calls ``record_stream``. The side thread's Python runs while
   the training thread has let go of the GIL: in ``backward()``, in a wait, or at the interpreter's switch.
4. Jobs run in the order they were submitted, so batches come out in the loader's order; an error raised
   by a job is raised to the consumer at that batch's turn.
5. A loader's buffer is released once its job ran and its copy event completed (NOTE [prefetch] 8).
6. `close` ends the thread; on an early close the jobs not begun are skipped (they launched nothing), and
   the consumer then releases every buffer.
7. Graph captures stay on the training thread (NOTE [graphed convert] 13): a capture marks torch's default
   CUDA generator as capturing for the whole process, and the model's dropout would fail beside it.
8. A source without ``iter_batches`` may reuse a batch's memory at the next ``next()``: the consumer pins
   (on the CPU: clones) such a batch before handing it over, as the inline path pins it before launching.
9. On the CPU the same thread runs the synchronous conversion: the tests exercise the ordering, the
   release of buffers and the early close without a GPU.
10. A script may end with an iteration still open (a ``max_steps`` loop over ``iter(prefetcher)``). The
    thread is a daemon, so the interpreter does not wait for it, but one still inside a torch op when the
    interpreter takes the GIL away is unwound through C++ frames: ``std::terminate``, exit status 134. So
    an exit hook (``weakref.finalize``, run before that) cancels it and waits for it, as `close` does, for
    at most `EXIT_WAIT` seconds (a thread stuck for longer would otherwise hang the exit).
"""
from __future__ import annotations

import queue
import threading
import weakref
from typing import Any, Callable, Optional

import torch

from ..loading.run_ahead import EXIT_WAIT


class Job:
    """One batch on its way: what the consumer gives the side thread, and what the thread gives back."""

    __slots__ = ("batch", "release", "draws", "after", "out", "copied", "done", "host", "error", "ready")

    def __init__(self, batch: Any, release: Optional[Callable[[], None]], draws: Any, threaded: bool) -> None:
        self.batch, self.release, self.draws = batch, release, draws
        self.after: Optional[torch.cuda.Event] = None  # the batch's own GPU tensors are written once this fires
        self.out: Any = None  # the converted batch
        self.copied: Optional[torch.cuda.Event] = None  # the host buffers are read once this fires
        self.done: Optional[torch.cuda.Event] = None  # the batch is ready once this fires
        self.host: list[torch.Tensor] = []  # host tensors the copies read (pinned copies kept alive)
        self.error: Optional[BaseException] = None
        self.ready = threading.Event() if threaded else None  # set once the job ran (or failed)

    def wait(self) -> None:
        """Return once the job ran (at once for a job run on the consumer's thread)."""
        if self.ready is not None:
            self.ready.wait()

    def launched(self) -> bool:
        """Whether the job ran, without waiting."""
        return self.ready is None or self.ready.is_set()


class SideThread:
    """Run ``launch(job)`` for each submitted `Job`, in order, on a thread of its own (NOTE [prefetch thread])."""

    def __init__(self, launch: Callable[[Job], None], device: torch.device) -> None:
        self.launch = launch
        # read here, on the consumer's thread: a new thread starts on device 0, and set_device needs an index
        self.index: Optional[int] = (device.index if device.index is not None else torch.cuda.current_device()) \
            if device.type == "cuda" else None
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.cancelled = threading.Event()
        self.thread = threading.Thread(target=self._work, name="fastdata-prefetch", daemon=True)
        self.thread.start()
        self._stop_at_exit = weakref.finalize(self, _stop, self.jobs, self.cancelled, self.thread, EXIT_WAIT)

    def submit(self, job: Job) -> None:
        self.jobs.put(job)

    def _work(self) -> None:
        failed: Optional[BaseException] = None
        try:
            if self.index is not None:
                torch.cuda.set_device(self.index)
        except BaseException as exc:  # noqa: BLE001  (every job then raises it: none waits forever)
            failed = exc
        while True:
            job = self.jobs.get()
            if job is None:
                return
            try:
                if failed is not None:
                    raise failed
                if not self.cancelled.is_set():
                    self.launch(job)
            except BaseException as exc:  # noqa: BLE001  (raised to the consumer at this batch's turn)
                job.error = exc
            finally:
                job.ready.set()

    def close(self, cancel: bool = False) -> None:
        """End the thread once it ran what was submitted (with ``cancel``: the jobs not begun are marked
        ready without running, so they launched nothing), and wait for it."""
        if cancel:
            self.cancelled.set()
        self.jobs.put(None)
        self.thread.join()
        self._stop_at_exit.detach()


def _stop(jobs: queue.SimpleQueue, cancelled: threading.Event, thread: threading.Thread, wait: float) -> None:
    """At exit (NOTE [prefetch thread] 10): skip the jobs not begun, end the thread and wait for it."""
    cancelled.set()
    jobs.put(None)
    thread.join(wait)
