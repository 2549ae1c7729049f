"""RunAhead: a loader's producing loop on a thread of its own, its batches handed over through a short queue.

NOTE [loader thread]: DALILoader's ``pipe.run`` and the feed it calls (LMDB reads, JPEG headers, crop
draws) cost the thread that calls them milliseconds a batch (bench_dali's profile), time the training thread
needs to queue the model's kernels ahead of the GPU. So on a GPU the loop runs here, on a side stream,
``depth`` batches ahead; each batch carries an event that the consumer's stream waits for (on the device: no
host sync), and ``record_stream`` keeps the caching allocator from reusing a batch's memory before the
consumer's kernels are done with it. It serves DALI's training crops several times faster than ``pipe.run``
on the consuming thread (benchmarks/RESULTS.md).

Exactly-once bookkeeping stays with the consumer: each item carries a tag (DALILoader's count of batches
served once it is handed out), given to ``on_take`` on the consumer's thread as the item is handed out
(DALILoader advances its sampler there). A producer that must restart from the sampler's position (after
a decode error) calls ``caught_up()`` first, which returns once ``on_take`` has run for every item it
produced before.

The thread is a daemon, and an exit hook stops it (as NOTE [prefetch thread] 10 in fastdata/gpu/side_thread.py
says why): a script that ends with an iteration still open would otherwise be killed by ``std::terminate``.
"""
from __future__ import annotations

import contextlib
import queue
import threading
import time
import weakref
from typing import Any, Callable, Iterator, Optional

import torch

EXIT_WAIT = 30.0  # seconds an exit waits for a look-ahead thread (NOTE [prefetch thread] 10)
Item = tuple[torch.Tensor, torch.Tensor, Any]  # (x, y, tag)
Produce = Callable[[Callable[[], None]], Iterator[Item]]  # produce(caught_up)


class RunAhead:
    """Iterate ``produce(caught_up)`` on a thread, ``depth`` items ahead; yields its ``(x, y, tag)`` items
    on the consumer's thread, usable on its current stream, after ``on_take(tag)``. `close` stops the
    thread (the consumer left the loop, or the producer ended); errors raised by the producer are raised to
    the consumer."""

    _END = object()

    def __init__(self, produce: Produce, device: torch.device, depth: int = 2,
                 on_take: Callable[[Any], None] = lambda tag: None) -> None:
        self.produce, self.on_take = produce, on_take
        self.device = device
        self.cuda = device.type == "cuda"
        # read here, on the consumer's thread: a new thread starts on device 0, and set_device needs an index
        self.index: Optional[int] = (device.index if device.index is not None else torch.cuda.current_device()) \
            if self.cuda else None
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.stop = threading.Event()
        self.taken = threading.Condition()
        self.produced = self.handed = 0
        self.busy_s = 0.0  # seconds the thread spent producing (not waiting on the queue): diagnostics
        self.thread = threading.Thread(target=self._work, name="fastdata-run-ahead", daemon=True)
        self.thread.start()
        self._stop_at_exit = weakref.finalize(self, _stop, self.stop, self.taken, self.queue, self.thread, EXIT_WAIT)

    def _caught_up(self) -> None:
        with self.taken:
            self.taken.wait_for(lambda: self.handed >= self.produced or self.stop.is_set())

    def _put(self, item: Any) -> bool:
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _work(self) -> None:
        try:
            stream = None
            if self.cuda:
                torch.cuda.set_device(self.index)
                stream = torch.cuda.Stream(self.index)
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                items = self.produce(self._caught_up)
                while True:
                    start = time.perf_counter()
                    try:
                        x, y, tag = next(items)
                    except StopIteration:
                        break
                    self.busy_s += time.perf_counter() - start
                    done = None
                    if stream is not None:
                        done = torch.cuda.Event()
                        done.record(stream)
                    self.produced += 1
                    if not self._put((x, y, tag, done)):
                        return
            self._put(self._END)
        except BaseException as exc:  # handed to the consumer, who raises it
            self._put(exc)

    def __iter__(self) -> Iterator[Item]:
        while True:
            with torch.profiler.record_function("fastdata.run_ahead.wait"):  # the consumer waiting (bench_dali.py)
                item = self.queue.get()
            if item is self._END:
                return
            if isinstance(item, BaseException):
                raise item
            x, y, tag, done = item
            if done is not None:
                current = torch.cuda.current_stream(self.device)
                current.wait_event(done)  # on the device: the host goes on
                x.record_stream(current)
                y.record_stream(current)
            self.on_take(tag)  # before caught_up() can return: a restart sees the consumer's bookkeeping
            with self.taken:
                self.handed += 1
                self.taken.notify_all()
            yield x, y, tag

    def close(self) -> None:
        """Stop the thread and wait for it; what it had queued is dropped."""
        if self._stop_at_exit.detach() is not None:
            _stop(self.stop, self.taken, self.queue, self.thread, None)


def _stop(stop: threading.Event, taken: threading.Condition, items: queue.Queue, thread: threading.Thread,
          wait: Optional[float]) -> None:
    """`RunAhead.close`, also run at exit for at most ``wait`` seconds (it names none of the RunAhead: the exit
    hook must not keep it alive)."""
    stop.set()
    with taken:
        taken.notify_all()
    until = None if wait is None else time.monotonic() + wait
    while thread.is_alive() and (until is None or time.monotonic() < until):
        try:
            items.get(timeout=0.05)
        except queue.Empty:
            pass
