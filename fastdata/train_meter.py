"""What one log interval of the training loop measured: loss and accuracy sums kept on the device (no
sync per step) and the data stall, the time a step waited for its batch (CUDA events on a GPU)."""
from __future__ import annotations

import time
from typing import Any

import torch


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
