"""DALILoader: JPEGs from a fastdata LMDB decoded by NVIDIA DALI (nvJPEG on the GPU with device "mixed").

Import it explicitly (``from fastdata.dali import DALILoader``): fastdata never imports DALI by itself.
The JPEG bytes enter the pipeline through ``fn.external_source`` in the order of fastdata's own
`DistributedBatchSampler`, so DALI serves the same batches as FastLoader (same
``(seed, epoch)`` order, each batch's samples ascending, exactly once per epoch across ranks, equal batch
counts, mid-epoch resume); DALI's own reader sharding is not used. Batches come out as CUDAPrefetcher's
do: ``(B, 3, size, size)`` channels_last, normalised with ``mean``/``std`` in 0-1 units, int64 labels.
Training: random-resized-crop (area 8-100%, aspect 3/4-4/3) and a random flip; evaluation: shorter side
to ``size``, centre crop. The crop boxes and flips are drawn on the host from ``(seed, epoch, batch
position, rank)`` with the same rule as `RandomResizedCrop` (each image's
size read from its JPEG header) and fed to DALI, which decodes only the box (``decoders.image_slice``):
a resumed run draws exactly the crops of the uninterrupted one, which DALI's own random operators
(seeded once per pipeline) cannot do.

The pipeline runs with DALI's default (asynchronous, pipelined) executor: DALI pulls each batch's bytes
and crop boxes from `DALILoader._next_batch` ``prefetch`` batches ahead of the consumer, so LMDB
reads, header parsing and decoding overlap the training step. The sampler advances only when a batch is
handed out, so ``state_dict()`` never counts the batches DALI holds ahead.

NOTE [DALI outputs on the stream]: ``pipe.run()`` without a stream synchronises the host with the batch's
GPU work (DALI's documented default). With DALI's default executor (``exec_dynamic``) ``run`` takes a
stream instead, which waits for the batch on the device while the host goes on; older DALIs keep the
host-synchronous call. The streamed and host-synchronous calls stall alike in measurements so far: over a
short run, the wait at an iteration's start (a pipeline rebuilt, see `DALILoader._drain`) dominates,
so judge them by bench_dali's steady-state rows (benchmarks/RESULTS.md).
"""
from __future__ import annotations

import inspect
from collections import deque
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import numpy as np
import torch

from ..datasets.images import FastDataset
from ..datasets.splits import DatasetView
from ..distributed import check_cuda
from ..errors import ConfigError, ImageDecodeError, MissingDependencyError
from ..imaging.decode_batch import check_sizes, decode_jpeg, jpeg_size, looks_like_jpeg, size_faults
from ..imaging.draws import draw_resized_crops
from ..imaging.transforms import IMAGENET_MEAN, IMAGENET_STD
from ..loading.run_ahead import RunAhead
from ..loading.sampler import DistributedBatchSampler, SamplerBacked
from ..storage.opening import OpenedPath
from .dali_tune import HwLoadTrial, release_unused_memory, valid_load

INSTALL_HINT = ("NVIDIA DALI is not installed: pip install 'fastdata[dali]' (the nvidia-dali-cuda120 wheel; "
                "nvidia-dali-cuda110 for CUDA 11, nvidia-dali-cuda130 for CUDA 13)")


def _dali() -> Any:
    try:
        import nvidia.dali as dali
        import nvidia.dali.fn  # noqa: F401
        import nvidia.dali.types  # noqa: F401
    except ImportError as exc:
        raise MissingDependencyError(INSTALL_HINT) from exc
    return dali


def _lmdb_samples(data: Union[str, Path, OpenedPath, FastDataset, DatasetView]
                  ) -> tuple[FastDataset, Optional[DatasetView]]:
    """The local LMDB dataset under ``data`` and the samples of it to serve (None: all), its manifest read
    once: a folder or an opened path is opened here, a dataset or a view of one is used as it is."""
    if getattr(data, "is_mixture", False):  # (before DALI is imported: the answer does not depend on it)
        raise ConfigError(f"DALILoader does not serve mixtures, got {data!r}: serve it with FastLoader(mixture, "
                          "batch_size) and CUDAPrefetcher(loader), which augments on the GPU (docs/mixtures.md)")
    view = None
    if isinstance(data, DatasetView):
        data, view = data.base, data
    if not isinstance(data, FastDataset):
        data = FastDataset(data)
    if not data.is_lmdb or data.lmdb_reader is None:
        raise ConfigError(f"DALILoader reads JPEG LMDB datasets; {data.root} is {data.manifest['format']}: "
                          "preprocess with --format lmdb, or read it with FastDataset and FastLoader")
    if data._remote is not None:  # noqa: SLF001 - the dataset this package opened or was handed
        raise ConfigError(f"DALILoader reads a local LMDB folder, and {data.root} came from object storage: read "
                          "it with FastDataset and FastLoader (they stream it through the node cache)")
    return data, view


def _damaged(sizes: np.ndarray, bounds: tuple[Optional[int], Optional[int]]) -> dict[int, str]:
    """The positions in a batch of the records whose frame header (``sizes``: ``(n, 2)`` heights and widths, ``0,
    0`` where there is none) claims a size no record of the dataset can have, with why: the manifest's
    ``bounds`` (max_short_side, max_side), as FastDataset refuses them (NOTE [damaged records] 2). One
    vectorised check a batch; `check_sizes` words each record found."""
    found: dict[int, str] = {}
    for j in np.flatnonzero(size_faults(sizes, *bounds)).tolist():
        try:
            check_sizes(sizes[j:j + 1], *bounds)
        except ImageDecodeError as exc:
            found[j] = str(exc)
    return found


def _stream_outputs(pipe: Any) -> bool:
    """Whether ``pipe.run`` can hand its outputs to a CUDA stream instead of the host: DALI's default executor
    since DALI 1.4x (``exec_dynamic``), whose ``run`` takes the stream."""
    return bool(getattr(pipe, "exec_dynamic", False)) and "cuda_stream" in inspect.signature(pipe.run).parameters


class DALILoader(SamplerBacked):
    """Batches of a JPEG LMDB dataset decoded and augmented by NVIDIA DALI, in fastdata's own order.

    The data's way:

        DistributedBatchSampler -> sorted batch indices -> JPEG records read from the LMDB (views, no copy)
            -> crop boxes and flips drawn on the host -> fn.external_source -> DALI decodes only the box
            (nvJPEG with device "mixed") -> resize, crop, mirror, normalise -> (B, 3, size, size) channels_last

    DALI serves the same batches as FastLoader: the same ``(seed, epoch)`` order, each batch's samples
    ascending, exactly once per epoch across ranks, equal batch counts, mid-epoch resume.
    Batches come out as CUDAPrefetcher's do: normalised images, channels_last, and int64 labels.
    Training draws a random-resized crop (area 8-100%, aspect 3/4-4/3) and a random flip per image from
    ``(seed, epoch, batch position, rank)``, with the rule of `RandomResizedCrop`,
    so a resumed run draws exactly the crops of the uninterrupted one.
    Evaluation resizes the shorter side to ``size`` and crops the centre.
    DALI pulls each batch ``prefetch`` batches ahead of the consumer; the sampler advances only when a batch
    is handed out, so ``state_dict()`` never counts the batches DALI holds ahead.
    Import it explicitly (``from fastdata.dali import DALILoader``): fastdata never imports DALI by itself.

    Args:
        path: A local LMDB dataset: its folder, an ``OpenedPath`` of it, a FastDataset of it, or a
            ``DatasetView`` (some of its samples).
        batch_size: Images per batch.
        size: The side of the square output images (default 224).
        train: Random-resized crops and flips (default True); False: resize and centre crop.
        shuffle: Draw a new order every epoch (default None: ``train``).
        seed: The seed of the order and of the crops (default 0); every rank must pass the same one.
        drop_last: Cut the epoch to whole batches on every rank (default False).
        device: ``"cuda"`` (default: decoded on the GPU) or ``"cpu"`` (decoded by DALI on the CPU).
        mean: Per-channel mean in 0-1 units (default: ImageNet's).
        std: Per-channel standard deviation in 0-1 units (default: ImageNet's).
        dtype: ``torch.float32`` (default), ``torch.float16`` or ``torch.bfloat16``.
        num_threads: DALI's CPU threads (default: ``min(4, torch.get_num_threads())``).
        on_error: ``"fail"`` (default) raises on a record that does not decode, or whose frame header claims a
            size the dataset cannot hold (NOTE [damaged records] in fastdata/imaging/decode_batch.py: checked on
            the host, before DALI decodes it); ``"skip"`` leaves it out and lists it in `skipped`.
        pad: Repeat a few samples so every rank serves as many batches (default None: ``train``).
        rank: This process's rank (default: torch.distributed's when initialised, else 0).
        world_size: The number of ranks (default: torch.distributed's when initialised, else 1).
        prefetch: Batches DALI decodes ahead of the consumer, >= 1 (default 2).
        hw_decoder_load: The share of JPEGs given to the GPU's hardware JPEG decoder, in [0, 1] (default None:
            DALI's own default, 0.65), or ``"auto"``: 0.65, 0, 1, 0.9 and 0.5 each serve the first batches
            for half a second (and 12 batches at least), and the fastest is kept (NOTE [hw_decoder_load auto]
            in fastdata/gpu/dali_tune.py; on the CPU, DALI's default). `hw_decoder_load_chosen` tells which.
        stream_outputs: Hand ``pipe.run``'s outputs to the consumer's CUDA stream where DALI allows it, instead
            of a host-synchronous call (default True; NOTE [DALI outputs on the stream]).
        run_ahead: Run the pipeline and its feed on a loader thread (default None: on a GPU;
            NOTE [loader thread] in fastdata/loading/run_ahead.py).

    Raises:
        ConfigError: The dataset is not a local (image, class) JPEG LMDB, an argument is out of range, or
            ``device`` is CUDA where torch sees no GPU.
        MissingDependencyError: NVIDIA DALI is not installed (``pip install 'fastdata[dali]'``).
        FormatError: The folder is not a fastdata dataset (as for FastDataset).
        VersionError: The manifest was written by a format version this fastdata cannot read.
        ImageDecodeError: While iterating, a record does not decode and ``on_error="fail"`` (with ``"skip"``:
            DALI failed on a batch in which the host can decode every image).

    Examples:
        >>> from fastdata.dali import DALILoader
        >>> train = DALILoader("data/train-lmdb", 256, size=176, train=True, dtype=torch.bfloat16)
        >>> for images, labels in train:  # (256, 3, 176, 176) bfloat16 channels_last on the GPU, (256,) int64
        ...     ...
    """

    def __init__(self, path: Union[str, Path, OpenedPath, FastDataset, DatasetView], batch_size: int, *, size: int = 224, train: bool = True,
                 shuffle: Optional[bool] = None, seed: int = 0, drop_last: bool = False,
                 device: Union[str, torch.device] = "cuda", mean: Sequence[float] = IMAGENET_MEAN,
                 std: Sequence[float] = IMAGENET_STD, dtype: torch.dtype = torch.float32,
                 num_threads: Optional[int] = None,
                 on_error: str = "fail", pad: Optional[bool] = None, rank: Optional[int] = None,
                 world_size: Optional[int] = None, prefetch: int = 2,
                 hw_decoder_load: Union[float, str, None] = None, stream_outputs: bool = True,
                 run_ahead: Optional[bool] = None) -> None:
        base, self.view = _lmdb_samples(path)
        self.root, self.manifest = base.root, base.manifest
        self.manifest_sha256 = base.manifest_sha256
        # which samples a position means (a split's): a state saved on another split is refused, as FastLoader's
        self.state_key = None if self.view is None else self.view.state_key
        if base.fields is not None:
            names = ", ".join(f.name for f in base.fields)
            raise ConfigError(f"{self.root} has sample fields ({names}): DALILoader serves (image, class) LMDBs; "
                              "read it with FastDataset and FastLoader, whose transforms move every field with the "
                              "image")
        self._dali = _dali()
        if on_error not in ("skip", "fail"):
            raise ConfigError(f"on_error must be 'skip' or 'fail', got on_error={on_error!r}")
        if not isinstance(prefetch, int) or prefetch < 1:
            raise ConfigError(f"prefetch must be an integer >= 1, got prefetch={prefetch!r}")
        if not valid_load(hw_decoder_load):
            raise ConfigError("hw_decoder_load must be a share in [0, 1] (of the JPEGs for the GPU's hardware "
                              "decoder), None (DALI's default) or 'auto' (measured on the first batches), got "
                              f"hw_decoder_load={hw_decoder_load!r}")
        self.hw_decoder_load = hw_decoder_load
        self.stream_outputs = bool(stream_outputs)  # NOTE [DALI outputs on the stream]; False: host-synchronous
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ConfigError(f"dtype must be float32, float16 or bfloat16, got dtype={dtype}")
        self.device = torch.device(device)
        check_cuda(self.device, "pass device='cpu' (DALI decodes on the CPU)")
        if self.device.type == "cuda" and self.device.index is None:  # torch's current device, as .to("cuda")
            self.device = torch.device("cuda", torch.cuda.current_device())
        # NOTE [loader thread]: on a GPU, pipe.run and the feed run on a loader thread (fastdata/loading/run_ahead.py)
        self.run_ahead = self.device.type == "cuda" if run_ahead is None else bool(run_ahead)
        self.reader = base.lmdb_reader
        # the largest sides the dataset stores: a record whose frame header claims more is damaged
        self._bounds = (self.manifest.get("max_short_side"), self.manifest.get("max_side"))
        self.labels = base.targets
        n = len(self.labels) if self.view is None else len(self.view)
        self.batch_size, self.size, self.train, self.dtype, self.on_error = batch_size, size, train, dtype, on_error
        self.mean, self.std = tuple(mean), tuple(std)
        self.sampler = DistributedBatchSampler(n, batch_size, shuffle=train if shuffle is None else shuffle,
                                               seed=seed, drop_last=drop_last, pad=train if pad is None else pad,
                                               rank=rank, world_size=world_size)
        self.num_threads = num_threads or min(4, torch.get_num_threads())
        self.prefetch = prefetch
        self.seed = seed
        self._skipped: dict[int, None] = {}  # samples left out under on_error="skip", in the order found
        self._undecodable: set[int] = set()  # those among them that failed inside DALI: planned batches drop them
        self._pipe: Any = None
        # NOTE [hw_decoder_load auto]: the trial (on a GPU only), the load of _pipe, and a measured candidate's
        # reset pipeline kept while it is the best so far
        self.hw_decoder_load_trial: Optional[HwLoadTrial] = None
        if hw_decoder_load == "auto" and self.device.type == "cuda":  # ranks switch at the same output (rule 9)
            self.hw_decoder_load_trial = HwLoadTrial(self.device, lockstep=self.sampler.world_size > 1)
        self._load: Optional[float] = None  # DALI's default
        if hw_decoder_load not in (None, "auto"):
            self._load = float(hw_decoder_load)  # type: ignore[arg-type]
        self._kept: dict[float, Any] = {}
        self._on_stream = False  # the pipeline's outputs go to the consumer's stream (set by _build)
        self._feed: Optional[Iterator[Any]] = None  # this epoch's plan while an iteration is under way
        self.loader_thread_s = 0.0  # the loader thread's time producing batches, and their count (run_ahead)
        self.loader_thread_batches = 0
        self._fed: deque[tuple[int, np.ndarray]] = deque()  # (served count, rows) given to DALI, not yet out

    # -- proxies --------------------------------------------------------------------------------------
    @property
    def skipped(self) -> list[int]:
        """Samples left out under ``on_error="skip"`` (each once, in the order they were found)."""
        return list(self._skipped)

    @property
    def hw_decoder_load_chosen(self) -> Optional[float]:
        """The hardware decoder's share the pipeline uses: ``hw_decoder_load``, or the one ``"auto"`` chose
        (its measurements in ``hw_decoder_load_trial.seconds_per_batch``); None: DALI's default, or the
        trial not over yet."""
        trial = self.hw_decoder_load_trial
        return self._load if trial is None else trial.chosen

    @property
    def dataset(self) -> "DALILoader":
        """The loader itself (what torch-style code reads as ``loader.dataset``)."""
        return self

    @property
    def classes(self) -> list[str]:
        """The class names, in label order."""
        return list(self.manifest["classes"])

    # -- the pipeline ---------------------------------------------------------------------------------
    def _build(self) -> Any:
        dali = self._dali
        fn, types = dali.fn, dali.types
        gpu = self.device.type == "cuda"
        out_type = types.FLOAT16 if self.dtype == torch.float16 else types.FLOAT  # DALI has no bf16: cast after
        # Pipelined and asynchronous (DALI's default executor): while the consumer works on batch k, DALI
        # decodes batches k+1..k+prefetch, and pulls their bytes from _next_batch on this thread.
        pipe = dali.Pipeline(batch_size=self.batch_size, num_threads=self.num_threads,
                             device_id=self.device.index if gpu else None, seed=self.seed,
                             prefetch_queue_depth=self.prefetch)
        # hw_decoder_load: the share of a batch's JPEGs given to the hardware JPEG decoder of A100/H100-class GPUs
        # (DALI's default, 0.65, where None); the rest are decoded by CUDA kernels, on the SMs the model uses
        hw = {"hw_decoder_load": self._load} if gpu and self._load is not None else {}
        with pipe:
            decoder = "mixed" if gpu else "cpu"
            if self.train:  # boxes and flips drawn on the host (see _crops): exact on resume
                jpegs, anchor, shape, mirror = fn.external_source(
                    source=self._next_batch, num_outputs=4, batch=True,
                    dtype=[types.UINT8, types.INT32, types.INT32, types.INT32])
                images = fn.decoders.image_slice(jpegs, anchor, shape, device=decoder, output_type=types.RGB,
                                                 axis_names="WH", **hw)  # integer anchor/shape: absolute pixels
                images = fn.resize(images, resize_x=self.size, resize_y=self.size)
            else:
                (jpegs,) = fn.external_source(source=self._next_batch, num_outputs=1, batch=True,
                                              dtype=[types.UINT8])
                images = fn.decoders.image(jpegs, device=decoder, output_type=types.RGB, **hw)
                images = fn.resize(images, resize_shorter=self.size)
                mirror = 0
            out = fn.crop_mirror_normalize(images, crop=(self.size, self.size), mirror=mirror, dtype=out_type,
                                           mean=[255 * m for m in self.mean], std=[255 * s for s in self.std],
                                           output_layout="HWC")
            pipe.set_outputs(out)
        pipe.build()
        self._on_stream = gpu and self.stream_outputs and _stream_outputs(pipe)  # NOTE [DALI outputs on the stream]
        return pipe

    def _run(self, pipe: Any) -> tuple:
        """One ``pipe.run()``. On a GPU with DALI's default (dynamic) executor, the outputs are bound to the
        consumer's current stream, which waits for them on the device: without a stream DALI blocks the
        training thread until the batch is decoded, so the host cannot queue the next step ahead of the GPU
        (NOTE [DALI outputs on the stream])."""
        with torch.profiler.record_function("fastdata.dali.run"):  # named in profiles (bench_dali.py)
            if self._on_stream:
                return pipe.run(torch.cuda.current_stream(self.device))
            return pipe.run()

    def _to_torch(self, out: Any) -> torch.Tensor:
        if self.device.type == "cuda":
            from nvidia.dali.plugin.pytorch import feed_ndarray

            t = out.as_tensor()
            x = torch.empty(t.shape(), dtype=torch.float16 if self.dtype == torch.float16 else torch.float32,
                            device=self.device)
            feed_ndarray(t, x, cuda_stream=torch.cuda.current_stream(self.device))
        else:
            x = torch.from_numpy(np.asarray(out.as_array()))
            if self.run_ahead:  # DALI may reuse the buffer once the loader thread runs the next batch
                x = x.clone()
        x = x.permute(0, 3, 1, 2)  # NHWC -> NCHW view: channels_last, as CUDAPrefetcher yields
        return x.to(self.dtype) if x.dtype != self.dtype else x

    def _crops(self, sizes: Union[np.ndarray, list[tuple[int, int]]], good: np.ndarray,
               position: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Crop anchors (x, y), shapes (w, h) and flips (int32) for the good samples of one batch, drawn
        from ``(seed, epoch, position, rank)``: one draw per sample of the batch, skipped ones included,
        so skipping a record never shifts the others' crops."""
        s = self.sampler
        boxes, flips = draw_resized_crops((self.seed, s.epoch, position, s.rank), np.asarray(sizes).reshape(-1, 2))
        top, left, h, w = boxes[good].astype(np.int32).T
        return np.stack([left, top], 1), np.stack([w, h], 1), flips[good].astype(np.int32)

    def _plan(self) -> Iterator[tuple[int, int, np.ndarray, list[memoryview], np.ndarray, np.ndarray]]:
        """This epoch's batches from the sampler's position: (batches served once this one is handed out, its
        global position, rows, the JPEG records as views valid until the next batch is planned, their ``(n, 2)``
        sizes, good mask). Only reads; the sampler advances when a batch reaches the consumer."""
        s = self.sampler
        first = s.served
        for k, idx in enumerate(s.batches(), 1):
            idx = np.sort(idx)  # the same per-batch order as FastLoader
            rows = idx if self.view is None else self.view.rows(idx)
            # Views of the memory-mapped store, not copies (py-lmdb copies a record into bytes under the GIL,
            # on the thread that runs the training step, a cost bench_dali's profile shows): DALI copies
            # each batch when it is fed, within the call that pulled it, and the read transaction stays open
            # until the next batch is planned.
            with self.reader.views(rows) as blobs:
                sizes = np.array([jpeg_size(b) if b is not None and looks_like_jpeg(b) else (0, 0) for b in blobs],
                                 dtype=np.int64).reshape(-1, 2)
                damaged = _damaged(sizes, self._bounds)  # NOTE [damaged records]: refused before DALI decodes them
                good = sizes.all(1)
                good[list(damaged)] = False
                if not good.all():
                    self._refuse(rows, good, damaged)
                if self._undecodable:
                    good &= ~np.isin(rows, list(self._undecodable))
                yield first + k, s.batch_position(first + k - 1), rows, blobs, sizes, good

    def _next_batch(self) -> tuple:
        """DALI's source: the next batch with at least one good JPEG (raises StopIteration at the epoch's end)."""
        with torch.profiler.record_function("fastdata.dali.feed"):  # called by DALI inside pipe.run
            return self._next_good_batch()

    def _next_good_batch(self) -> tuple:
        assert self._feed is not None
        for served, position, rows, blobs, sizes, good in self._feed:
            if not good.any():
                continue
            self._fed.append((served, rows[good]))
            jpegs = [np.frombuffer(b, np.uint8) for b, g in zip(blobs, good) if g]
            if not self.train:
                return (jpegs,)
            return (jpegs, *self._crops(sizes, good, position))
        raise StopIteration

    def _rebuild(self) -> Any:
        """A new pipeline in place of the old one, whose buffers are freed before the new one is built (for
        the trial's current load, while ``"auto"`` measures)."""
        self._pipe = None
        if self.hw_decoder_load_trial is not None:
            return self._switch()
        self._pipe = self._build()
        return self._pipe

    def _switch(self) -> Any:
        """The pipeline of the trial's current load in place of `_pipe` (reset, or None): the old one kept if
        it is the best measured so far, the others dropped, then the new one taken from those kept or built.
        Once the trial is over, only the chosen pipeline is left (NOTE [hw_decoder_load auto] 4-5)."""
        trial = self.hw_decoder_load_trial
        assert trial is not None
        if self._pipe is not None:
            self._kept[self._load] = self._pipe  # type: ignore[index]
            self._pipe = None
        pick = trial.pick()
        self._kept = {load: pipe for load, pipe in self._kept.items() if load == pick}  # the rest freed here
        self._load = trial.load
        pipe = self._kept.pop(self._load, None)
        self._pipe = pipe if pipe is not None else self._build()
        if trial.done:
            self._settle()
        return self._pipe

    def _settle(self) -> None:
        """The trial is over: the candidates' pipelines other than `_pipe` go, and DALI's pools give back
        what they held for them."""
        self._kept.clear()
        release_unused_memory()

    def _drain(self) -> None:
        """Run out what an abandoned iteration left scheduled, then reset the pipeline for reuse: its source
        ends at once, DALI serves the batches it had already pulled (none reached the consumer, so the
        sampler never counted them) and raises StopIteration. A rebuild instead would make a restarted
        iteration's first batch wait for a whole new pipeline, on every ``break`` out of the loop; bench_dali's
        ``first_batch_ms`` measures both (benchmarks/RESULTS.md)."""
        pipe = self._pipe
        self._feed = iter(())
        try:
            for _ in range(self.prefetch + 2):  # at most `prefetch` batches are in flight
                self._run(pipe)
        except StopIteration:
            pipe.reset()
            self._feed = None
            return
        except RuntimeError:  # DALI failed on a batch being thrown away: a new pipeline
            pass
        self._rebuild()
        self._feed = None

    def _refuse(self, rows: np.ndarray, good: np.ndarray, damaged: dict[int, str]) -> None:
        """A planned batch's records DALI must not see (``~good``: not whole JPEGs, or ``damaged``, a position's
        frame header claiming a size the dataset cannot hold): `ImageDecodeError` naming a sample, as FastDataset
        raises, or (``on_error="skip"``) left out."""
        if self.on_error == "skip":
            self._skip(rows[~good].tolist())
            return
        unread = ~good
        unread[list(damaged)] = False
        if unread.any():
            raise ImageDecodeError(f"{self.reader.path}: samples {rows[unread].tolist()} are not whole JPEGs: run "
                                   "`fastdata verify`, or pass on_error='skip'")
        j = min(damaged)
        i = int(rows[j])
        raise ImageDecodeError(f"{self.reader.path_of(i)}: sample {i} is not a decodable JPEG ({damaged[j]}): run "
                               "`fastdata verify` on the dataset, or pass on_error='skip'")

    def _skip(self, rows: list[int]) -> None:
        """Record samples left out (once each: a batch may be planned again after a decode error)."""
        self._skipped.update(dict.fromkeys(rows))

    def _find_undecodable(self, rows: np.ndarray) -> list[int]:
        """The samples of a batch that DALI failed on which the host cannot decode either (Pillow)."""
        bad = []
        for row, blob in zip(rows.tolist(), self.reader.get_many(rows)):
            try:
                decode_jpeg(blob, self.size)
            except ImageDecodeError:
                bad.append(row)
        return bad

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self._track(self._epoch())  # an iteration still under way is closed first (its thread stopped)

    def _epoch(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self._pipe is None:  # first use, or the last pipeline raised
            self._rebuild()
        elif self._feed is not None:  # the last iteration was left unfinished
            self._drain()
        s = self.sampler

        def take(served: int) -> None:  # the batches served, all-skipped ones included
            s.advance(served - s.served)

        ahead = RunAhead(self._produce, self.device, on_take=take) if self.run_ahead else None
        try:
            for x, y, served in ahead if ahead is not None else self._produce(lambda: None):
                if ahead is None:
                    take(served)
                yield x, y
        except GeneratorExit:  # left unfinished: the next iteration runs out what DALI holds (_drain)
            raise
        except BaseException:  # a pipeline that raised is not reused
            self._pipe = None
            raise
        finally:
            if ahead is not None:
                ahead.close()
                self.loader_thread_s += ahead.busy_s
                self.loader_thread_batches += ahead.produced
        self._feed = None
        s.end_epoch()

    def _recover(self, exc: RuntimeError, caught_up: Callable[[], None]) -> Any:
        """After DALI failed on the oldest batch: raise ImageDecodeError, or (``on_error="skip"``) leave out
        what the host cannot decode either and return a new pipeline, with a new plan from the sampler's
        position once the consumer has caught up."""
        rows = self._fed[0][1] if self._fed else np.zeros(0, np.int64)
        bad = self._find_undecodable(rows) if self.on_error == "skip" else []
        if not bad:
            raise ImageDecodeError(
                f"{self.reader.path}: DALI could not decode a sample of {rows.tolist()[:8]}...: "
                f"{str(exc).splitlines()[0]}" + ("" if self.on_error == "skip" else
                                                  " (on_error='skip' leaves out what the host cannot "
                                                  "decode either)")) from exc
        self._skip(bad)  # leave them out and go on from this batch with a new pipeline
        self._undecodable.update(bad)
        caught_up()
        pipe = self._rebuild()
        self._feed, self._fed = self._plan(), deque()
        return pipe

    def _produce(self, caught_up: Callable[[], None]) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
        """This epoch's batches from the sampler's position as (images, labels, batches served once they are
        handed out), on whichever thread runs it. After a decode error, ``caught_up()`` waits until the
        consumer has taken every batch produced before it: the new plan starts at the sampler's position.
        While ``hw_decoder_load="auto"`` measures, a candidate whose window closed has its source ended and
        its batches in flight served before the next candidate's pipeline goes on with the plan
        (NOTE [hw_decoder_load auto] 4)."""
        trial = self.hw_decoder_load_trial
        if trial is not None and self._load != trial.load:  # measured, but left before the switch
            self._switch()
        pipe = self._pipe
        self._feed, self._fed = self._plan(), deque()
        window = trial.window() if trial is not None else None
        plan: Optional[Iterator[Any]] = None  # the plan, set aside while a measured pipeline runs out
        while True:
            try:
                (out,) = self._run(pipe)  # schedules the next batch, returns the oldest
            except StopIteration:
                if plan is None:
                    if window is not None:  # the epoch ended first: the window goes on in the next iteration
                        window.close()
                        if trial.done and trial.load == self._load:  # type: ignore[union-attr]
                            self._settle()  # chosen by that figure: the pipeline running
                    break
                pipe.reset()  # the measured candidate's batches all served: the next one goes on with the plan
                pipe = None
                pipe = self._switch()
                self._feed, plan = plan, None
                window = trial.window() if trial is not None else None
                continue
            except RuntimeError as exc:  # DALI failed on the oldest batch and cannot go on
                pipe = None  # this reference too: the old pipeline goes before the new one is built
                pipe = self._recover(exc, caught_up)
                plan = None
                if trial is not None and not (trial.lockstep and window is not None):  # the window cut short is
                    window = trial.window()  # dropped; in lockstep it counts on, so every rank switches together
                continue
            served, rows = self._fed.popleft()
            y = torch.from_numpy(self.labels[rows]).to(self.device, non_blocking=True)
            x = self._to_torch(out)
            if window is not None and window.tick():  # this candidate measured
                window = None
                if trial.load != self._load:  # type: ignore[union-attr]
                    plan, self._feed = self._feed, iter(())  # DALI's source ends: run out what it holds
                elif trial.done:  # type: ignore[union-attr]
                    self._settle()  # chosen: the pipeline running
            yield x, y, served
        pipe.reset()
