"""FastLoader: whole batches gathered by background threads into a ring of preallocated buffers.

NOTE [ring]: the loader owns ``num_threads + prefetch`` buffer slots (pinned when CUDA is available, so
host-to-device copies can be ``non_blocking``). A slot is refilled only after its consumer released it.
Plain iteration releases a batch when the next one is requested: **a yielded batch is valid until the
next** ``next()`` (keep it longer with ``copy=True`` or ``.clone()``). ``iter_manual()`` hands out
``(x, y, release)`` instead, for consumers such as CUDAPrefetcher that must hold a buffer until an
asynchronous copy from it completed.

A dataset with sample fields (NOTE [fields] in fastdata/formats/schema.py) gives dict batches; each slot then holds one
buffer per key, allocated at the first batch and grown (1.5x) when a variable-length field needs more,
so the ring stays pinned and no batch allocates. ``iter_manual()`` hands out ``(batch, release)`` there.

Every batch's indices are served in ascending order (a batch is a set of samples for SGD; sorted reads
are sequential in the page cache and let a multi-shard gather write each shard's rows in place).
"""
from __future__ import annotations

import inspect
import json
import os
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

import numpy as np
import torch

from ..errors import ConfigError, FastdataError
from ._threads import limit_intraop_threads
from .mixing import MixtureSampler
from .sampler import DistributedBatchSampler, SamplerBacked

Batch = tuple[torch.Tensor, torch.Tensor]
DEVICE_INDEX_CHUNK = 1 << 16  # samples whose indices cross to the device at once (storage="cuda")


def _noop() -> None:
    pass


class SlotBuffers:
    """One ring slot's buffers for dict batches: ``slot(key, shape, dtype)`` gives a (pinned) tensor of that
    shape, reusing the key's buffer while it is big enough (``get_batch(out=...)`` of a dataset with fields)."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self._buffers: dict[str, torch.Tensor] = {}

    def __call__(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = int(np.prod(shape))
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < n or buf.dtype != dtype:
            grown = n if buf is None or buf.dtype != dtype else max(n, buf.numel() * 3 // 2)
            buf = self._buffers[key] = torch.empty(grown, dtype=dtype, pin_memory=self.pin)
        return buf[:n].view(shape)


AUTOTUNED = {"num_threads", "prefetch", "pin_memory"}  # what `--autotune` writes, and `train --config` reads


def load_config(path: Union[Path, str]) -> dict[str, Any]:
    """Read an ``--autotune`` JSON (``{"storage", "loader": {...}, ...}``), refusing anything else."""
    try:
        cfg = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read loader config {path}: {exc}") from exc
    return check_config(cfg, str(path), storage=True)


def check_config(cfg: Any, where: str = "the config dict", storage: bool = False) -> dict[str, Any]:
    """Refuse anything but a loader config: a ``loader`` dict of FastLoader's keyword arguments, or (with
    ``storage``) an ``--autotune`` file: the dataset's ``storage`` and the loader settings it tunes, which
    ``fastdata train --config`` reads; returns ``cfg``.

    Args:
        cfg: The parsed config.
        where: Its name in the messages (the file's path).
        storage: Whether ``cfg`` is an ``--autotune`` file.

    Raises:
        ConfigError: ``cfg`` lacks a ``loader`` dict (or ``storage``), or has a loader setting FastLoader does not
            take.
    """
    if not isinstance(cfg, dict) or not isinstance(cfg.get("loader"), dict) or (storage and "storage" not in cfg):
        needs = "'storage' and 'loader'" if storage else "a 'loader' dict"
        raise ConfigError(f"{where} is not a `fastdata bench --autotune` config (needs {needs})")
    allowed = AUTOTUNED if storage else set(inspect.signature(FastLoader.__init__).parameters) - {
        "self", "dataset", "batch_size"}
    if set(cfg["loader"]) - allowed:
        raise ConfigError(f"{where}: unknown loader settings {sorted(set(cfg['loader']) - allowed)} (FastLoader "
                          f"takes {sorted(allowed)})")
    return cfg


class FastLoader(SamplerBacked):
    """Iterate a dataset in whole batches, gathered by background threads into a ring of reused buffers.

    The data's way:

        DistributedBatchSampler -> sorted batch indices -> num_threads threads: dataset.get_batch(idx, out=slot)
            -> num_threads + prefetch slots (pinned host buffers) -> the consumer (a training loop,
            CUDAPrefetcher) -> release: the slot is refilled

    The order is a `DistributedBatchSampler`'s: fixed by ``(seed, epoch)``, split across DDP ranks,
    resumable mid-epoch with ``state_dict()`` / ``load_state_dict()``.
    A yielded batch is valid until the next ``next()`` (NOTE [ring]); pass ``copy=True`` to keep batches longer.
    Batches are ``(x, y)`` tuples, or dicts of fields for a dataset with sample fields.
    A dataset on the GPU (``storage="cuda"``) is gathered there, with no threads and no host buffers.

    Args:
        dataset: Anything with ``get_batch(indices, out=)``, ``sample_shape``, ``sample_dtype`` and ``len()``
            (a FastDataset or TokenDataset).
        batch_size: Samples per batch.
        shuffle: Draw a new order every epoch (default True); False serves samples in stored order.
        seed: The seed of the order (default 0); every rank must pass the same one.
        drop_last: Cut the epoch to whole batches on every rank (default False: the last batch may be short).
        num_threads: Threads that gather batches (default: ``min(4, os.cpu_count())``).
        prefetch: Buffer slots beyond one per thread, filled ahead of the consumer (default 2).
        pin_memory: Allocate the slots in pinned memory (default: when CUDA is available).
        copy: Hand out clones instead of the slots themselves, valid forever (default False).
        pad: Repeat a few samples so every rank serves the same number of batches (default True, as DDP needs).
            ``pad=False`` serves every sample exactly once across ranks (for evaluation; ranks may get one batch
            fewer).
        rank: This process's rank (default: torch.distributed's when initialised, else 0).
        world_size: The number of ranks (default: torch.distributed's when initialised, else 1).
        shuffle_window: Shuffle shards, then samples within windows of this many shards (default None: one
            permutation of all samples).
            A stretch of the epoch then reads at most that many shards, for data streamed from object storage
            through a small cache (NOTE [windowed shuffle] in fastdata/loading/sampler.py).

    Raises:
        ConfigError: ``dataset`` lacks the methods above, an argument has a bad value, or ``shuffle_window`` is
            given for a dataset that cannot say where its samples are stored.
        FastdataError: While iterating with `iter_manual`, every slot is held by the consumer (a batch
            was never released).

    Examples:
        >>> ds = FastDataset("data/train", storage="shm")
        >>> loader = FastLoader(ds, batch_size=256, shuffle=True, seed=0)
        >>> for epoch in range(10):
        ...     loader.set_epoch(epoch)
        ...     for images, labels in loader:  # (256, S, S, 3) uint8, (256,) int64, pinned
        ...         ...
    """

    def __init__(self, dataset: Any, batch_size: int, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                 *, num_threads: Optional[int] = None, prefetch: int = 2, pin_memory: Optional[bool] = None,
                 copy: bool = False, pad: bool = True, rank: Optional[int] = None,
                 world_size: Optional[int] = None, shuffle_window: Optional[int] = None) -> None:
        for attr in ("get_batch", "sample_shape", "sample_dtype", "__len__"):
            if not hasattr(dataset, attr):
                raise ConfigError(f"dataset must provide get_batch(), sample_shape and sample_dtype (a FastDataset or "
                                  f"TokenDataset), got dataset={type(dataset).__name__} without {attr!r}")
        if num_threads is not None and (not isinstance(num_threads, int) or num_threads < 1):
            raise ConfigError(f"num_threads must be a positive integer, got num_threads={num_threads!r}")
        if not isinstance(prefetch, int) or prefetch < 0:
            raise ConfigError(f"prefetch must be an integer >= 0, got prefetch={prefetch!r}")
        self.dataset = dataset
        self.batch_size = batch_size
        shards = bounds = None
        if shuffle_window is not None:  # windows of shards (NOTE [windowed shuffle] in fastdata/loading/sampler.py)
            bounds = dataset.shard_bounds() if hasattr(dataset, "shard_bounds") else None
            if bounds is None and hasattr(dataset, "sample_shards"):
                shards = dataset.sample_shards()
        if getattr(dataset, "is_mixture", False):  # its own order: NOTE [mixture order] in loading/mixing.py
            self.sampler: Any = MixtureSampler(dataset, batch_size, drop_last=drop_last, pad=pad, rank=rank,
                                               world_size=world_size, shuffle=shuffle, seed=seed,
                                               shuffle_window=shuffle_window)
        else:
            self.sampler = DistributedBatchSampler(len(dataset), batch_size, shuffle=shuffle, seed=seed,
                                                   drop_last=drop_last, pad=pad, rank=rank, world_size=world_size,
                                                   shuffle_window=shuffle_window, shards=shards, shard_bounds=bounds)
        self.num_threads = num_threads or min(4, os.cpu_count() or 1)
        self.prefetch = prefetch
        if pin_memory and not torch.cuda.is_available():  # (torch's own error came at the first batch)
            raise ConfigError("pin_memory=True pins host buffers for copies to a GPU, and torch sees no CUDA "
                              "device here: pass pin_memory=False, or leave it None (pinned when CUDA is there)")
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.copy = copy
        self.on_device = getattr(dataset, "device", torch.device("cpu")).type != "cpu"
        self._ring: list[Batch] = []

    @classmethod
    def from_config(cls, dataset: Any, batch_size: int, config: Any, **kwargs: Any) -> "FastLoader":
        """A loader with the settings of a ``fastdata bench --autotune`` JSON file, or of a dict whose ``loader``
        holds FastLoader's keyword arguments; ``kwargs`` win. A file's ``storage`` is for the dataset: open it
        with ``FastDataset(path, storage=cfg["storage"])``.

        Raises:
            ConfigError: The file cannot be read or is not an ``--autotune`` one, or the dict has no ``loader``
                dict or names an argument FastLoader does not take.
        """
        # a dict is checked too: else an unknown key became a raw TypeError, no 'loader' a KeyError
        cfg = check_config(config) if isinstance(config, dict) else load_config(config)
        tuned = dict(cfg["loader"])
        if not torch.cuda.is_available():  # (tuned on a GPU machine: pinned memory is for copies to a GPU)
            tuned.pop("pin_memory", None)
        return cls(dataset, batch_size, **{**tuned, **kwargs})

    @property
    def slots(self) -> int:
        """The ring's buffer slots: ``num_threads + prefetch`` (NOTE [ring])."""
        return self.num_threads + self.prefetch

    # -- iteration ------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Batch]:
        if self.on_device:
            return self._track(self._iter_device())
        return self._iter_auto()

    @property
    def dict_batches(self) -> bool:
        """True when batches are dicts of fields (a dataset with sample fields), not ``(x, y)``."""
        return getattr(self.dataset, "fields", None) is not None

    def _iter_auto(self) -> Iterator[Any]:
        for batch, release in self.iter_batches():
            if self.copy:
                batch = {k: v.clone() for k, v in batch.items()} if isinstance(batch, dict) else tuple(
                    t.clone() for t in batch)
            yield batch
            release()

    def _iter_device(self) -> Iterator[Any]:
        # storage="cuda": the gather runs on the device (one index_select); no host buffers, no threads. The
        # order crosses to the device once per DEVICE_INDEX_CHUNK samples, so a step makes no host-to-device
        # copy and no sync; a dataset with sample fields gathers its variable fields by host index instead.
        # (its caller tracks it, as the host path: a new iteration closes this one, `LiveIteration`)
        on_host = self.dict_batches
        group: list[np.ndarray] = []
        queued = 0
        for idx in self.sampler.batches():
            group.append(np.sort(idx))
            queued += len(idx)
            if queued >= DEVICE_INDEX_CHUNK:
                yield from self._device_group(group, on_host)
                group, queued = [], 0
        yield from self._device_group(group, on_host)
        self.sampler.end_epoch()

    def _device_group(self, group: list[np.ndarray], on_host: bool) -> Iterator[Any]:
        """The batches of ``group`` (sorted host index arrays), their indices uploaded in one copy."""
        if not group:
            return
        flat = torch.from_numpy(np.concatenate(group))
        if not on_host:
            flat = flat.to(self.dataset.device, non_blocking=True)
        start = 0
        for idx in group:
            batch = self.dataset.get_batch(flat[start:start + len(idx)])
            start += len(idx)
            self.sampler.advance()
            yield batch

    def iter_batches(self) -> Iterator[tuple[Any, Callable[[], None]]]:
        """Yield ``(batch, release)``: the slot behind ``batch`` (an ``(x, y)`` tuple or a dict of fields) is
        refilled only after ``release()`` is called (NOTE [ring])."""
        self._close_active()
        if self.on_device:  # device batches are fresh tensors from index_select: nothing to hand back
            return ((batch, _noop) for batch in self._track(self._iter_device()))
        return self._track(self._produce())

    def iter_manual(self) -> Iterator[Any]:
        """Yield ``(x, y, release)`` (``(batch, release)`` for dict batches; ``(x, y, source, release)`` for a
        Mixture with ``mix="batch"``); the slot behind the batch is refilled only after ``release()`` is called."""
        if self.dict_batches:
            return self.iter_batches()
        return ((*batch, release) for batch, release in self.iter_batches())

    def _ensure_ring(self) -> list[Any]:
        if len(self._ring) != self.slots and self.dict_batches:
            self._ring = [SlotBuffers(self.pin_memory) for _ in range(self.slots)]
        elif len(self._ring) != self.slots:
            shape = (self.batch_size, *self.dataset.sample_shape)
            self._ring = [(torch.empty(shape, dtype=self.dataset.sample_dtype, pin_memory=self.pin_memory),
                           torch.empty(self.batch_size, dtype=torch.int64, pin_memory=self.pin_memory))
                          for _ in range(self.slots)]
        return self._ring

    def _fill(self, slot: int, idx: np.ndarray, position: int) -> Any:
        if getattr(self.dataset, "is_mixture", False):  # one get_batch per source into the slot's buffers
            s = self.sampler
            return self.dataset.get_batch(np.sort(idx), out=self._ring[slot], draw=(s.seed, s.epoch, position, s.rank))
        if self.dict_batches:
            return self.dataset.get_batch(np.sort(idx), out=self._ring[slot])
        x_buf, y_buf = self._ring[slot]
        n = len(idx)
        if getattr(self.dataset, "random_crops", False):  # decode-time crops, drawn as CUDAPrefetcher draws
            s = self.sampler
            x, y = self.dataset.get_batch(np.sort(idx), out=x_buf, draw=(s.seed, s.epoch, position, s.rank))
        else:
            x, y = self.dataset.get_batch(np.sort(idx), out=x_buf)
        if y.untyped_storage().data_ptr() == x_buf.untyped_storage().data_ptr():
            return x, y  # targets are a view of the sample buffer (token windows: y = window[:, 1:])
        y_buf[:n].copy_(y)
        return x, y_buf[:n]

    def _produce(self) -> Iterator[tuple[Any, Callable[[], None]]]:
        self._ensure_ring()
        batches = self.sampler.batches()  # streamed: never the whole epoch at once
        first, pulled = self.sampler.served, 0
        plan = getattr(self.dataset, "plan_reads", None)  # a streamed dataset fetches these batches' shards ahead
        reads = plan(self.sampler.coming_batches(), len(self.sampler)) if plan else None
        free: deque[int] = deque(range(self.slots))
        pending: deque[tuple[int, Future]] = deque()
        lock = threading.Lock()
        # NOTE [intra-op threads per loader thread]: the loader threads share torch's intra-op threads
        share = max(1, torch.get_num_threads() // self.num_threads)
        pool = ThreadPoolExecutor(self.num_threads, thread_name_prefix="fastdata-loader",
                                  initializer=limit_intraop_threads, initargs=(share,))
        exhausted = False

        def top_up() -> None:
            nonlocal exhausted, pulled
            while not exhausted:
                with lock:
                    if not free:
                        return
                    slot = free.popleft()
                idx = next(batches, None)
                if idx is None:
                    exhausted = True
                    with lock:
                        free.appendleft(slot)
                    return
                position = self.sampler.batch_position(first + pulled)
                pulled += 1
                pending.append((slot, pool.submit(self._fill, slot, idx, position)))

        def releaser(slot: int) -> Callable[[], None]:
            done = False

            def release() -> None:
                nonlocal done
                if not done:
                    done = True
                    with lock:
                        free.append(slot)
            return release

        try:
            top_up()
            while pending:
                slot, fut = pending.popleft()
                batch = fut.result()  # re-raises a worker's error here, in the consumer's thread
                self.sampler.advance()
                yield batch, releaser(slot)
                top_up()
                if not pending and not exhausted:
                    raise FastdataError(f"all {self.slots} FastLoader buffers are held by the consumer: call "
                                        "release() for each batch from iter_manual() once it is done with it")
            self.sampler.end_epoch()
        finally:
            for _, fut in pending:
                fut.cancel()
            pool.shutdown(wait=True)
            if reads is not None:
                self.dataset.end_reads(reads)

    def __repr__(self) -> str:
        return (f"FastLoader({self.dataset!r}, batch_size={self.batch_size}, threads={self.num_threads}, "
                f"slots={self.slots}, pinned={self.pin_memory}, rank={self.sampler.rank}/{self.sampler.world_size})")
