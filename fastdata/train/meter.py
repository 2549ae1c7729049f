"""What the training loop measures: per log interval, loss and accuracy sums kept on the device (no sync per
step) and the data stall, the time a step waited for its batch (CUDA events on a GPU); ``--profile``'s
operator table and trace."""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("fastdata.train")  # the Trainer's reports: stdout under `fastdata train`


class Meter:
    """Per-interval sums kept on the device (no sync per step) and data-wait timing.

    On a GPU the wait is measured with CUDA events on the current stream: from the end of the previous
    step's work to the point where the batch is usable, which includes the device idling while the host
    waits for the loader. On the CPU it is wall time around ``next()``.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.reset()

    def reset(self) -> None:
        z = lambda: torch.zeros((), device=self.device, dtype=torch.float64)  # noqa: E731
        self.loss_sum, self.correct, self.count = z(), z(), z()
        self.samples = 0  # a host count (shapes are known on the host): no sync
        self.t0 = time.perf_counter()
        self._steps = 0
        self.waited = 0.0
        self.events: list[tuple[Any, Any]] = []
        if self.cuda:
            self.first = torch.cuda.Event(enable_timing=True)
            self.first.record()

    def wait_begin(self) -> None:
        if self.cuda:
            self._e0 = torch.cuda.Event(enable_timing=True)
            self._e0.record()
        else:
            self._t = time.perf_counter()

    def wait_end(self) -> None:
        if self.cuda:
            e1 = torch.cuda.Event(enable_timing=True)
            e1.record()
            self.events.append((self._e0, e1))
        else:
            self.waited += time.perf_counter() - self._t

    def add(self, loss: torch.Tensor, out: torch.Tensor, y: Any) -> None:
        self._steps += 1
        if isinstance(y, dict):  # sample fields: one loss per sample; accuracy on a class label, if any
            n = len(y["image"])
            self.samples += n
            self.loss_sum += loss.double() * n
            if "label" in y and out.ndim == 2:
                self.correct += (out.argmax(-1) == y["label"]).sum()
            elif "mask" in y and out.ndim == 4:  # pixel accuracy, as a fraction of each sample
                self.correct += (out.argmax(1) == y["mask"]).double().mean((1, 2)).sum()
            self.count += n
            return
        self.samples += y.shape[0] if y.ndim else 1
        n = y.numel()
        self.loss_sum += loss.double() * n
        if out.ndim == y.ndim + 1:
            self.correct += (out.argmax(-1) == y).sum()
        self.count += n

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def has_data(self) -> bool:
        return self._steps > 0

    def wait_and_total(self) -> tuple[float, float]:
        """(seconds waiting for data, seconds in this interval); on a GPU, syncs on the last event once."""
        total = self.elapsed()
        if self.cuda and self.events:
            self.events[-1][1].synchronize()
            self.waited = sum(a.elapsed_time(b) for a, b in self.events) / 1000
            total = self.first.elapsed_time(self.events[-1][1]) / 1000 or total
        return self.waited, total


class StepProfiler:
    """``--profile N``: ``torch.profiler`` over the run's first N steps, then the ten costliest operators,
    a Chrome trace in ``out`` and the share of that time the loop waited for data (written by rank 0)."""

    def __init__(self, steps: int, device: torch.device, out: Path, main: bool, waited: float) -> None:
        acts = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        self.steps, self.device, self.out, self.main = steps, device, out, main
        self.prof: Any = torch.profiler.profile(activities=acts)
        self.prof.__enter__()
        self.done = False
        self.profiled = 0  # steps since the start: a resumed run starts past step N
        self.waited0, self.t0 = waited, time.perf_counter()

    def step(self, step: int, waited: float) -> None:
        """One optimizer step done (``step``: the run's count, kept for callers); stops after ``steps`` of them."""
        if not self.done:
            self.prof.step()
            self.profiled += 1
            if self.profiled >= self.steps:
                self.stop(waited)

    def stop(self, waited: float) -> None:
        if self.done:
            return
        self.prof.__exit__(None, None, None)
        self.done = True
        wall = time.perf_counter() - self.t0
        if self.main:
            trace = self.out / "trace.json"
            trace.parent.mkdir(parents=True, exist_ok=True)
            self.prof.export_chrome_trace(str(trace))
            key = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
            log.info("%s", self.prof.key_averages().table(sort_by=key, row_limit=10))
            log.info("profiled %d steps: trace in %s; waiting for data %.1f%% of the time", self.profiled, trace,
                     100 * (waited - self.waited0) / max(wall, 1e-9))
