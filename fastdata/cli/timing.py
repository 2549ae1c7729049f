"""Timing helpers shared by ``fastdata bench`` and the scripts in ``benchmarks/``: a rate over a time box,
the machine's description, one training step of a reference model on data already on the device, and a
whole pipeline timed with its data wait. Synchronisation happens at the boundaries of a measurement only.
"""
from __future__ import annotations

import os
import platform
import sys
import time
from typing import Any, Callable, Iterable, Optional

import numpy as np
import torch

from .._version import __version__

# Bytes of activations a training step keeps per input pixel (fp32, forward + what backward needs): peak RSS
# growth / (batch x H x W) on the CPU, torch 2.13, 64-128 px: cnn-small 670-700, resnet18 640-840, resnet50
# 1,900-2,500; rounded up ~1.4x. Used to split a step into chunks that fit a memory budget.
ACTIVATION_BYTES_PER_PIXEL = {"cnn-small": 1000, "resnet18": 1200, "resnet50": 3500}
CPU_STEP_BUDGET = 1 << 30  # a synthetic model step on the CPU keeps at most ~1 GiB of activations


def sync() -> None:
    """Wait for queued GPU work: at benchmark boundaries only, never in the training hot path."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_rate(step: Callable[[], int], seconds: float, warmup: int = 1) -> float:
    """Items per second of ``step()`` (which returns how many items it handled), for ``seconds``."""
    for _ in range(warmup):
        step()
    sync()  # the warm-up's queued GPU work is not billed to the timed steps
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        n += step()
    sync()
    return n / (time.perf_counter() - t0)


def machine() -> dict[str, Any]:
    """Cores, memory, platform, GPU and versions: what a benchmark figure was measured on."""
    mem = None
    try:
        with open("/proc/meminfo") as f:
            mem = int(next(line for line in f if line.startswith("MemTotal")).split()[1]) * 1024
    except (OSError, StopIteration):
        pass
    return {"cores": os.cpu_count(), "memory_bytes": mem, "platform": platform.platform(),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "python": sys.version.split()[0], "torch": torch.__version__, "numpy": np.__version__,
            "fastdata": __version__, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


class ModelStep:
    """One SGD step of ``name`` on a batch already on the device (autocast bf16 on CUDA).

    ``max_chunk`` splits a large batch into chunks whose gradients accumulate: the same work per
    sample with bounded memory (see `step_chunk`)."""

    def __init__(self, name: str, num_classes: int, device: torch.device, channels_last: bool = True,
                 max_chunk: Optional[int] = None) -> None:
        from ..train.models import create_model, is_convnet

        self.name, self.device, self.max_chunk = name, device, max_chunk
        self.model = create_model(name, num_classes=num_classes).to(device)
        self.fmt = torch.channels_last if channels_last and is_convnet(self.model) else torch.contiguous_format
        self.model = self.model.to(memory_format=self.fmt)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3, momentum=0.9)
        self.amp = device.type == "cuda" and torch.cuda.is_bf16_supported()

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        chunk = min(self.max_chunk or len(x), len(x))
        for i in range(0, len(x), chunk):
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.amp):
                loss = torch.nn.functional.cross_entropy(self.model(x[i:i + chunk]), y[i:i + chunk])
            if chunk < len(x):  # the chunks' mean losses, weighted by size, sum to the whole batch's mean
                loss = loss * (min(chunk, len(x) - i) / len(x))
            loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def step_chunk(model: str, batch: int, height: int, width: int, device: torch.device) -> int:
    """The most samples of ``height`` x ``width`` one chunk of a model step may hold on ``device``: a CPU
    step keeps at most `CPU_STEP_BUDGET` of activations, a GPU step half the free memory."""
    per_pixel = ACTIVATION_BYTES_PER_PIXEL.get(model, max(ACTIVATION_BYTES_PER_PIXEL.values()))
    per_sample = max(per_pixel * height * width, 1)
    budget = torch.cuda.mem_get_info(device)[0] // 2 if device.type == "cuda" else CPU_STEP_BUDGET
    return max(1, min(batch, budget // per_sample))


def full_pipeline(batches: Iterable[Any], net: ModelStep, seconds: float) -> tuple[float, float]:
    """Images/s of ``net`` fed by ``batches`` for ``seconds``, and the % of the time spent waiting for them."""
    waited, n, t0 = 0.0, 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        it = iter(batches)
        while True:
            t = time.perf_counter()
            batch = next(it, None)
            waited += time.perf_counter() - t
            if batch is None:
                break
            net.step(batch[0], batch[1])
            n += len(batch[0])
            if time.perf_counter() - t0 >= seconds:
                break
    sync()
    total = time.perf_counter() - t0
    return n / total, 100 * waited / total
