"""Timing helpers shared by ``fastdata bench`` and the scripts in ``benchmarks/``: a rate over a time box,
the machine's description, one training step of a reference model on data already on the device, and a
whole pipeline timed with its data wait in steady state (epoch starts left out). Synchronisation happens at
the boundaries of a measurement only.
"""
from __future__ import annotations

import os
import platform
import sys
import time
from typing import Any, Callable, Iterable, Iterator, Optional

import numpy as np
import torch

from .._version import __version__
from ..errors import FastdataError

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


def read_rate(ds: Any, seconds: float) -> float:
    """Images/s of reading the dataset's image files (from the page cache, once warm) for ``seconds``:
    the bytes read, counted in images as the files hold them (raw or JPEG)."""
    files = [ds.root / f["path"] for f in ds.manifest["files"] if f["path"].startswith("images")]
    total = sum(p.stat().st_size for p in files)
    buf = bytearray(16 << 20)
    done, i, t0 = 0, 0, time.perf_counter()
    while (time.perf_counter() - t0 < seconds or not done) and total:
        with open(files[i % len(files)], "rb", buffering=0) as f:
            while (got := f.readinto(buf)) and time.perf_counter() - t0 < seconds:
                done += got
        i += 1
    return done / max(total, 1) * len(ds) / (time.perf_counter() - t0)


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


# An epoch of `Repeat` holds at least this many samples: one pass at 100,000 images/s outlasts a 10 s time box.
STEADY_SAMPLES = 1 << 20


class Repeat:
    """A dataset served ``times`` over as one epoch: sample ``i`` is the dataset's ``i % len(dataset)``.

    A loader over it runs in steady state for as long as a stage is timed: however small the dataset's
    own epochs are, no epoch start (threads started, an order drawn, the first batch gathered from
    nothing) falls inside the time box. Everything else is the dataset's (``__getattr__``).
    """

    plan_reads = None  # a streamed dataset fetches shards as batches read them: a plan would name indices past its end

    def __init__(self, dataset: Any, times: Optional[int] = None) -> None:
        self.dataset = dataset
        self.times = times or max(1, -(-STEADY_SAMPLES // max(len(dataset), 1)))

    def __len__(self) -> int:
        return len(self.dataset) * self.times

    def __getattr__(self, name: str) -> Any:
        if name == "dataset":  # not set yet (a copy being built): no endless recursion
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def get_batch(self, indices: Any, out: Any = None, **kwargs: Any) -> Any:
        idx = np.sort(np.asarray(indices, dtype=np.int64) % len(self.dataset))
        return self.dataset.get_batch(idx, out=out, **kwargs)


class PlainCopies:
    """``(x, y)`` batches copied to ``device`` with a blocking ``.to(device)`` from wherever the loader left
    them (pageable memory, for a loader that does not pin), then converted by ``convert``: the loop a
    training script without pinned buffers or CUDAPrefetcher runs."""

    def __init__(self, loader: Iterable[Any], device: torch.device, convert: Callable[[Any], Any]) -> None:
        self.loader, self.device, self.convert = loader, device, convert

    def __iter__(self) -> Iterator[Any]:
        for x, y in self.loader:
            yield self.convert((x.to(self.device), y.to(self.device)))


def steady_pipeline(batches: Iterable[Any], seconds: float, step: Optional[Callable[[Any], None]] = None,
                    skip: int = 1) -> dict[str, float]:
    """Run ``step`` on each batch of ``batches`` (or only draw them) for ``seconds``, epoch starts left out.

    An epoch start is not billed: ``iter()`` and the wait until its ``skip``-th batch arrives (threads
    started, an order drawn, the first batches gathered from nothing, caches warmed). With ``skip`` set
    to the loader's threads, that is the first wave of batches, gathered side by side, which arrive
    together and would make the rate look ``skip`` times higher over a short box. The end of an epoch (its
    threads joined) is not billed either. A training run on a real dataset pays these once an epoch; a
    small dataset's epochs would pay them every few steps and sway which stage looks slowest. Counted:
    the images stepped (with ``step``) or the images that arrived (without) while the clock ran.

    Returns:
        ``images_per_s`` and ``stall_pct`` (the share of the billed time spent waiting for a batch), both
        in steady state; ``epoch_starts``: how many were left out; ``epoch_start_s``: their mean length.
    """
    n, waited, billed, starts, start_s = 0, 0.0, 0.0, 0, 0.0
    t_end = time.perf_counter() + seconds
    deadline = t_end + max(10 * seconds, 10.0)  # a box overrun while waiting for a first counted batch
    while time.perf_counter() < t_end or (not n and time.perf_counter() < deadline):
        t_start = time.perf_counter()
        it = iter(batches)
        batch = next(it, None)
        for _ in range(skip - 1):  # the rest of the first wave: arrived with the first, or nearly
            if batch is None:
                break
            if step is not None:
                step(batch)
            batch = next(it, None)
        starts += 1
        start_s += time.perf_counter() - t_start
        if batch is None:
            if n or starts > 1:
                break  # epochs too short to time beyond their start: what was counted stands
            raise FastdataError(f"the loader yielded fewer than {skip} batches: is the dataset empty?")
        t0, end_s, counted, got = time.perf_counter(), 0.0, 0, 0
        while batch is not None:
            if step is not None:
                step(batch)
                counted, got = counted + len(batch[0]), got + 1
            t = time.perf_counter()
            if t >= t_end and (got >= skip or t >= deadline):  # at least a wave counted, as one was left out
                break
            batch = next(it, None)
            if batch is None:  # the end of the epoch (its threads joined) is not billed
                end_s = time.perf_counter() - t
            else:
                waited += time.perf_counter() - t
                if step is None:
                    counted, got = counted + len(batch[0]), got + 1
        sync()
        n += counted
        billed += max(time.perf_counter() - t0 - end_s, 1e-9)
    return {"images_per_s": n / max(billed, 1e-9), "stall_pct": 100 * waited / max(billed, 1e-9),
            "epoch_starts": starts, "epoch_start_s": start_s / max(starts, 1)}
