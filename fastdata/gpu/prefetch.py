"""CUDAPrefetcher: batches copied to the GPU on a side stream, converted and augmented there, one step ahead.

NOTE [prefetch]: the rules of a batch's way to the GPU.

1. Every batch goes through one side stream, created once per prefetcher (a new stream per epoch leaks).
2. Host tensors are pinned (FastLoader's ring buffers already are; others are pinned first) and copied with
   ``non_blocking=True``; views of one buffer, such as a token batch's x and y, cross once (`transfer.move`).
3. An event marks the end of the copies.
4. uint8 NHWC images become NCHW ``channels_last`` views: the permute of NHWC is channels_last, no copy.
5. The transforms run, then `Normalize` casts and normalises (a multiply that casts, then an add),
   replayed from a CUDA graph where it can be (NOTE [graphed convert]).
6. A second event marks the batch ready; the consumer's stream waits on it, with no host sync.
7. ``record_stream`` tells the caching allocator the outputs are used on the consumer's stream, so it never
   hands their memory to another tensor too early.
8. A FastLoader buffer is released only after its copy event completed: polled with ``query()``, and waited
   for with that one event's ``synchronize()`` only when the loader would otherwise run out of buffers.
9. ``depth`` batches are in flight while the model computes on the current one.
10. ``device="cpu"`` runs the same conversion synchronously.
11. An iteration closed early (a ``break``, an exception, ``max_steps``) rewinds the loader to the consumer's
    view: its look-ahead fetched batches the consumer never saw, and the loader counted them served. A later
    ``state_dict()`` or iteration then starts at the first unserved batch (after an epoch's last batch: in
    that epoch, with nothing left, as FastLoader's own break leaves it). One iteration is live at a time:
    ``iter()``, ``set_epoch`` and ``load_state_dict`` close the one under way first, so its rewind never
    lands on a newer position.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch

from ..distributed import check_cuda, dist_rank_world
from ..errors import ConfigError, is_whole
from ..imaging.draws import Draws, batch_seed
from ..imaging.transforms import IMAGENET_MEAN, IMAGENET_STD, Normalize, Rng, Transform
from ..loading.sampler import LiveIteration
from .cuda_graphs import GraphedConvert, capturable, enabled as cuda_graphs_enabled
from .side_thread import Job, SideThread
from .transfer import move, walk

Release = Optional[Callable[[], None]]


def _target(t: torch.Tensor) -> torch.Tensor:
    """Integer tensors (labels, masks, token ids, offsets) as int64, what losses and embeddings take."""
    return t.long() if not t.is_floating_point() and t.dtype != torch.bool else t


def is_image(t: torch.Tensor) -> bool:
    """Only 4-D uint8 tensors are images (NHWC); token batches and labels are not."""
    return t.dtype == torch.uint8 and t.ndim == 4


class CUDAPrefetcher(LiveIteration):
    """Yield the batches of any loader on ``device``, converted and augmented there, ``depth`` batches ahead.

    The data's way, for each batch (NOTE [prefetch]):

        loader batch (pinned host tensors) -> non_blocking copy on a side stream -> uint8 NHWC viewed as
            NCHW channels_last -> transforms -> Normalize (cast, normalise) -> the consumer's stream waits
            on an event (no host sync) -> the loader's buffer is released once its copy completed

    The loader may be a FastLoader, a DataLoader, a list or a generator.
    Images (4-D uint8 tensors) come out as normalised ``dtype`` NCHW channels_last; other integer tensors as int64.
    A dict batch has its spatial fields (masks, boxes) moved with the image.
    Random transforms draw from ``(seed, epoch, position, rank)``, so a resumed run draws the same numbers
    (NOTE [crop draws] in fastdata/imaging/draws.py).
    On a GPU, with ``cuda_graphs``, each image batch shape's conversion is replayed from a CUDA graph once seen
    twice: the same values for a few launches instead of about a hundred (NOTE [graphed convert] in
    fastdata/gpu/cuda_graphs.py).
    ``device="cpu"`` runs the same conversion synchronously.
    ``len()``, ``dataset``, ``sampler``, ``set_epoch`` and ``load_state_dict`` are the loader's.

    Args:
        loader: The iterable of batches: ``(x, y)`` tuples, dicts of fields, or nested tuples/lists of tensors.
        device: Where batches go (default ``"cuda"``).
        mean: Per-channel mean, in 0-1 units as torchvision's (default: ImageNet's).
        std: Per-channel standard deviation, in 0-1 units (default: ImageNet's).
        normalize: Give ``(x / 255 - mean) / std`` (default True); False gives ``x / 255``.
        dtype: The images' floating dtype on the device (default ``torch.float32``; ``torch.bfloat16`` halves
            the bytes).
        transforms: A transform (or `Compose` of them) run on the uint8 NCHW batch before Normalize
            (default None). It may be set again between epochs (progressive resizing): ``pf.transforms = ...``.
        depth: Batches in flight ahead of the one the model computes on, >= 1 (default 1).
        seed: The seed of the transforms' random draws (default 0).
        cuda_graphs: Replay the image conversion from CUDA graphs where its ops allow (default True;
            ``FASTDATA_CUDA_GRAPHS=0`` also turns it off).
        run_ahead: Launch each batch's copies and conversion from a thread of its own, so the training thread
            only waits for it (default False; NOTE [prefetch thread] in fastdata/gpu/side_thread.py). On the CPU
            the thread converts the batches ahead.

    Raises:
        ConfigError: ``device`` is CUDA where torch sees no GPU, ``depth`` or ``seed`` is not an integer (>= 1,
            >= 0), ``transforms`` is not callable, or ``mean`` / ``std`` / ``dtype`` are bad (both or neither,
            ``std`` > 0, a floating dtype).

    Examples:
        >>> loader = FastLoader(FastDataset("data/train"), batch_size=256)
        >>> gpu = CUDAPrefetcher(loader, "cuda", dtype=torch.bfloat16,
        ...                      transforms=Compose([RandomResizedCrop(176), RandomHorizontalFlip()]))
        >>> for images, labels in gpu:  # (256, 3, 176, 176) bfloat16 channels_last, (256,) int64
        ...     loss = loss_fn(model(images), labels)
    """

    def __init__(self, loader: Any, device: Union[str, torch.device] = "cuda", *,
                 mean: Optional[Sequence[float]] = IMAGENET_MEAN, std: Optional[Sequence[float]] = IMAGENET_STD,
                 normalize: bool = True, dtype: torch.dtype = torch.float32, transforms: Optional[Transform] = None,
                 depth: int = 1, seed: int = 0, cuda_graphs: bool = True, run_ahead: bool = False) -> None:
        self.loader = loader
        self.device = torch.device(device)
        check_cuda(self.device, "pass device='cpu' or install a CUDA build")
        if not isinstance(depth, int) or depth < 1:
            raise ConfigError(f"depth must be an integer >= 1, got depth={depth!r}")
        self.normalize = Normalize(mean if normalize else None, std if normalize else None, dtype,
                                   memory_format=torch.channels_last)
        if not is_whole(seed) or seed < 0:  # (numpy refused it at the first batch)
            raise ConfigError(f"seed must be an integer >= 0, got seed={seed!r}")
        self.depth, self.seed, self.run_ahead = depth, int(seed), bool(run_ahead)
        self._cuda_graphs = self.device.type == "cuda" and cuda_graphs and cuda_graphs_enabled()
        self.transforms = transforms
        self._stream: Optional[torch.cuda.Stream] = None
        self._epoch_counter = 0
        self._unserved: deque[tuple[int, int]] = deque()  # (epoch, position) of batches fetched, not yet yielded
        self._fetched_all: Optional[int] = None  # the epoch whose every batch is fetched, its iteration not over

    @property
    def transforms(self) -> Optional[Transform]:
        """The transforms run before Normalize; setting them (a new crop size) drops the graphs captured of the
        old ones, which would otherwise be replayed for every batch shape they saw."""
        return self._transforms

    @transforms.setter
    def transforms(self, transforms: Optional[Transform]) -> None:
        if isinstance(transforms, (list, tuple)):
            raise ConfigError(f"transforms must be one transform: wrap the list in Compose([...]), got {transforms!r}")
        if transforms is not None and not callable(transforms):
            raise ConfigError(f"transforms must be a fastdata transform (or Compose of them), got {transforms!r}")
        self._transforms = transforms
        graphed = self._cuda_graphs and capturable(transforms)
        # NOTE [graphed convert]; with run_ahead, captured on the training thread (its 13)
        self._graphed = GraphedConvert(self._image_float32, defer=self.run_ahead) if graphed else None

    # -- proxies --------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.loader)

    @property
    def dataset(self) -> Any:
        """The loader's dataset."""
        return self.loader.dataset

    @property
    def sampler(self) -> Any:
        """The loader's sampler."""
        return self.loader.sampler

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch: the loader's order, and the transforms' draws for a loader without a sampler."""
        self._close_active()  # a live iteration closed later would rewind the loader to its own epoch
        if hasattr(self.loader, "set_epoch"):
            self.loader.set_epoch(epoch)
        self._epoch_counter = epoch

    def state_dict(self) -> dict[str, Any]:
        """The loader's state as the consumer sees it: batches fetched ahead but not yet handed out
        (``depth`` of them on a GPU) are not counted, so a resume serves them again; also after a ``break``
        (NOTE [prefetch] 11). A Mixture's per-source cursors (``"sources"``) are left out of such a rewound
        state: they are the look-ahead's (its segments still resume exactly)."""
        state = dict(self.loader.state_dict())
        if self._unserved and "position" in state:
            state["epoch"], state["position"] = self._unserved[0]
            state.pop("sources", None)
        elif self._fetched_all is not None and "position" in state and "num_samples" in state:
            # every batch handed out, and the loader moved on to the next epoch when the look-ahead found none
            # left: the state stays in that epoch with nothing to serve, else the caller's set_epoch(epoch)
            # restarted it (the sampler keeps such a state, see its load_state_dict)
            state["epoch"], state["position"] = self._fetched_all, state["num_samples"]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the loader at a `state_dict`'s position; an iteration under way is closed first."""
        self._close_active()  # closed later, it would rewind the loader over this state
        self.loader.load_state_dict(state)

    # -- per-batch randomness -------------------------------------------------------------------------
    def _position(self) -> tuple[int, int]:
        """(epoch, global position) of the batch just fetched, from a FastLoader's sampler, or a DataLoader's
        fastdata batch sampler, when there is one."""
        s = getattr(self.loader, "sampler", None)
        if s is not None and hasattr(s, "batch_position"):
            return s.epoch, s.batch_position(s.served - 1)
        s = getattr(self.loader, "batch_sampler", None)
        if getattr(s, "pass_start", None) is not None:
            # counted from where the sampler's pass began: DataLoader workers take batches ahead, and may have
            # moved the sampler on to the next epoch already
            epoch, start, served = s.pass_start
            return epoch, start + s.batch_position(served + self._batch_in_epoch) - s.batch_position(0)
        return self._epoch_counter, self._batch_in_epoch

    def _seeded(self) -> Draws:
        """The draws for the batch just fetched, seeded from ``(seed, epoch, position, rank)``: the same
        draws after a resume and on every device, different ones on each rank (ranks serve different samples);
        NOTE [crop draws] in fastdata/imaging/draws.py."""
        epoch, pos = self._position()
        samplers = (getattr(self.loader, "sampler", None), getattr(self.loader, "batch_sampler", None))
        rank = next((s.rank for s in samplers if getattr(s, "rank", None) is not None), None)
        rank = dist_rank_world()[0] if rank is None else rank
        return Draws(batch_seed(self.seed, epoch, pos, rank))

    # -- conversion (the same math on every device) ---------------------------------------------------
    def _image_float32(self, x: torch.Tensor, generator: Rng) -> torch.Tensor:
        """A uint8 NHWC batch, transformed and normalised in float32 (NCHW, channels_last)."""
        x = x.permute(0, 3, 1, 2)  # NHWC -> NCHW view with channels_last strides
        if self.transforms is not None:
            x = self.transforms(x, generator)
        return self.normalize.float32(x)  # written channels_last by Normalize itself

    def _image(self, t: torch.Tensor, generator: Rng) -> torch.Tensor:
        """An image batch converted, replayed from a CUDA graph where it can be (NOTE [graphed convert])."""
        # draws from a Draws stream only (a torch.Generator, or torch's global one, is another matter in a graph)
        keyed = isinstance(generator, Draws) or (generator is None and self.transforms is None)
        if self._graphed is not None and t.is_cuda and keyed:
            return self.normalize.cast(self._graphed(t, generator), copy=True)  # never the graph's own buffer
        return self.normalize.cast(self._image_float32(t, generator))

    def convert(self, batch: Any, generator: Rng = None) -> Any:
        """Convert a batch already on ``device``: images -> normalised NCHW, integer tensors -> int64. A dict
        of sample fields has its spatial fields moved with the image (NOTE [spatial fields] in
        imaging/transforms.py) before the conversion."""
        if isinstance(batch, dict) and isinstance(batch.get("image"), torch.Tensor) and is_image(batch["image"]):
            fields = {**batch, "image": batch["image"].permute(0, 3, 1, 2)}
            if self.transforms is not None:
                fields = self.transforms(fields, generator)
            image = self.normalize(fields["image"])  # written channels_last by Normalize itself
            return {**walk({k: v for k, v in fields.items() if k != "image"}, _target), "image": image}

        return walk(batch, lambda t: self._image(t, generator) if is_image(t) else _target(t))

    # -- iteration ------------------------------------------------------------------------------------
    def _source(self) -> Iterator[tuple[Any, Release]]:
        manual = getattr(self.loader, "iter_batches", None)
        if manual is not None and (self.device.type == "cuda" or self.run_ahead):  # hold buffers until copied
            yield from manual()
        else:
            for batch in self.loader:
                yield batch, None

    def __iter__(self) -> Iterator[Any]:
        return self._track(self._iterate())  # NOTE [prefetch] 11: the old one's close rewinds before this reads

    def _iterate(self) -> Iterator[Any]:
        self._batch_in_epoch = 0
        ahead = self.device.type == "cuda" or self.run_ahead
        yield from self._iter_ahead() if ahead else self._iter_sync()
        self._epoch_counter += 1

    def _iter_sync(self) -> Iterator[Any]:
        try:
            for batch, _ in self._source():
                self._unserved.append(self._position())  # until converted: a failure rewinds to it
                gen = self._seeded() if self.transforms is not None else None
                self._batch_in_epoch += 1
                moved, _ = move(batch, self.device, pin=False)
                out = self.convert(moved, gen)
                self._unserved.popleft()
                yield out
        finally:
            view = self._rewind_state()  # NOTE [prefetch] 11
            self._unserved.clear()
            if view is not None:
                self.loader.load_state_dict(view)

    def _side_stream(self) -> torch.cuda.Stream:
        if self._stream is None:  # one stream for the prefetcher's lifetime (a new one per epoch leaks)
            self._stream = torch.cuda.Stream(device=self.device)
        return self._stream

    def _owned(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor the side thread can read after the loader moved on: pinned (the copy the inline path
        makes too) on a GPU, cloned on the CPU; pinned ones and device tensors as they are."""
        if t.device.type != "cpu":
            return t
        if self.device.type == "cuda":
            return t if t.is_pinned() else t.pin_memory()
        return t.clone()

    def _launch(self, job: Job, stream: Optional[torch.cuda.Stream]) -> None:
        """Copy a job's batch to the device and convert it there, on ``stream`` (None: on the CPU, at once)."""
        if stream is None:
            moved, job.host = move(job.batch, self.device, pin=False)
            job.out = self.convert(moved, job.draws)
            return
        if job.after is not None:  # made on the loader's stream (storage="cuda"): read it once it is written
            stream.wait_event(job.after)
        with torch.cuda.stream(stream):
            moved, job.host = move(job.batch, self.device, pin=True)
            job.copied = torch.cuda.Event()
            job.copied.record(stream)
            job.out = self.convert(moved, job.draws)
            job.done = torch.cuda.Event()
            job.done.record(stream)

    def _iter_ahead(self) -> Iterator[Any]:
        """``depth`` batches ahead, launched on the side stream here or from a side thread (NOTE [prefetch
        thread]); on the CPU (``run_ahead``) the side thread converts them at once."""
        stream = self._side_stream() if self.device.type == "cuda" else None
        source = self._source()
        side = SideThread(lambda job: self._launch(job, stream), self.device) if self.run_ahead else None
        ready: deque[Job] = deque()  # launched or submitted, not yet handed out
        held: deque[Job] = deque()  # host buffers maybe still being read, in the loader's order
        slots = getattr(self.loader, "slots", None)
        failed = False  # the loader raised: its error waits in `ready` for its turn

        def reclaim(force_one: bool = False) -> None:
            while held:
                job = held[0]
                if force_one:  # waits for this one job and its copy, not for the device
                    job.wait()
                    if job.copied is not None:
                        job.copied.synchronize()
                    elif job.error is not None and stream is not None:
                        stream.synchronize()  # a failed job may have left copies under way
                    force_one = False
                elif not job.launched() or (job.copied is not None and not job.copied.query()):
                    return
                held.popleft()
                if job.release is not None:
                    job.release()

        def enqueue() -> bool:
            nonlocal failed
            if failed:
                return False
            reclaim()
            if slots is not None and len(held) >= slots - 1:
                reclaim(force_one=True)  # the loader needs a buffer back to keep producing
            try:
                item = next(source, None)
            except Exception as exc:  # raised after the batches fetched before it, as a job's error is
                failed, job = True, Job(None, None, None, False)
                job.error = exc
                ready.append(job)
                return False
            if item is None:
                if self._unserved:  # (called before the batch it follows is handed out: that one is still here)
                    self._fetched_all = self._unserved[-1][0]
                return False
            batch, release = item
            if side is not None and release is None:  # valid until the next next(): the side thread reads it later
                batch = walk(batch, self._owned)
            self._unserved.append(self._position())
            job = Job(batch, release, self._seeded() if self.transforms is not None else None, side is not None)
            self._batch_in_epoch += 1
            if stream is not None:
                on_gpu: list[torch.Tensor] = []
                walk(batch, lambda t: on_gpu.append(t) if t.device.type == "cuda" else None)
                if on_gpu:  # storage="cuda": written on the loader's (this thread's) stream
                    job.after = torch.cuda.Event()
                    job.after.record(torch.cuda.current_stream(self.device))
                    for t in on_gpu:
                        t.record_stream(stream)
            held.append(job)
            ready.append(job)
            if side is None:
                try:
                    self._launch(job, stream)
                except Exception as exc:  # raised at its turn, after the batches before it (as the side thread's)
                    job.error = exc
            else:
                side.submit(job)
            return True

        finished = False
        try:
            for _ in range(self.depth):
                if not enqueue():
                    break
            while ready:
                job = ready.popleft()
                enqueue()  # the next batch's work starts before this one is waited for
                job.wait()
                if job.error is not None:
                    raise job.error
                if side is not None and self._graphed is not None and self._graphed.due:
                    for later in ready:  # the side thread idle: a capture beside it would be the only one
                        later.wait()
                    self._graphed.capture_due()  # here, between the model's steps (NOTE [graphed convert] 13)
                out, job.out = job.out, None
                if stream is not None:
                    current = torch.cuda.current_stream(self.device)
                    current.wait_event(job.done)
                    walk(out, lambda t: t.record_stream(current) if t.device.type == "cuda" else None)
                self._unserved.popleft()
                yield out
            finished = True
        finally:
            view = None if finished else self._rewind_state()
            self._unserved.clear()
            self._fetched_all = None
            if side is not None:
                side.close(cancel=True)  # jobs not begun launch nothing: their buffers go straight back
            while held:
                reclaim(force_one=True)
            if view is not None:  # NOTE [prefetch] 11
                self.loader.load_state_dict(view)

    def _rewind_state(self) -> Optional[dict[str, Any]]:
        """The consumer's view of an iteration closed early, where the loader's own differs and can be loaded."""
        if not (self._unserved or self._fetched_all is not None) or not hasattr(self.loader, "load_state_dict"):
            return None
        state = self.state_dict()
        return state if "position" in state else None
