"""FastDataset: preprocessed uint8 images served as whole batches from page cache, RAM, /dev/shm or GPU.

NOTE [gather]: a batch is one vectorised gather, never a Python loop over samples. ``ram``/``shm``/``cuda``
hold the dataset as one contiguous ``(N, S, S, 3)`` array, so a batch is one ``np.take`` (or one
``index_select`` on the device) straight into the output buffer. ``mmap`` keeps one memory map per
shard: indices are grouped by shard, one ``take`` per shard touched; when each shard's indices are
contiguous in the request (FastLoader sorts every batch, see loading/loader.py) each ``take`` writes straight
into its slice of the output. ``np.take`` releases the GIL, so loader threads gather in parallel.
Every take uses ``mode="clip"`` on indices already checked by ``_indices``: with the default
``mode="raise"`` numpy writes into a temporary and copies it to ``out``, several times slower
(benchmarks/RESULTS.md).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Sequence, Union

import numpy as np
import torch

from .._io import trim_heap
from ..distributed import check_cuda
from ..errors import ConfigError, ImageDecodeError, is_whole
from ..formats.lmdb_store import LmdbReader
from ..formats.manifest import IMAGES_LMDB, IMAGES_NPY, ShardIndex, manifest_digest, shard_starts
from ..formats.schema import Field, fields_of
from ..imaging.decode_batch import BatchDecoder
from ..imaging.draws import RATIO, SCALE
from ..storage.fields import Alloc, collate_fields, split_fields
from ..storage.images import check_other_files, open_images
from ..storage.object_store import RETRY_SECONDS
from ..storage.opening import OpenedPath, StreamedReads, open_path
from ..storage.shards import STORAGE, Indices, batch_rows, take_rows
from ..storage.streamed import Labels, image_streamed, labels_at_open


class FastDataset(StreamedReads, torch.utils.data.Dataset):
    """A dataset folder made by ``fastdata preprocess images``, as a map-style torch dataset.

    ``ds[i]`` is ``(uint8 HWC tensor, int64 label)``.
    ``ds[list]`` and `get_batch` gather a whole batch in one read (NOTE [gather]).
    A dataset with sample fields (masks, boxes, captions) gives a dict of fields instead.
    ``path`` may be an fsspec URL (``s3://bucket/prefix``, ...): its files are downloaded once per node into
    ``cache_dir`` and verified there (NOTE [remote cache]).
    With the default ``storage="mmap"`` a remote npy dataset streams: each image shard is fetched as the
    loader's coming batches need it, and the shard needed last is evicted first (NOTE [shard cache]).
    Other storages and LMDB datasets download every file first.

    An LMDB dataset decodes its JPEGs on the CPU, batch by batch.
    ``crop="center"`` (evaluation) keeps the centre square.
    ``crop="random"`` (training without a GPU) decodes a random-resized crop of the whole stored image and
    mirrors half of them.
    Those draws are made per batch from ``(seed, epoch, position, rank)`` when FastLoader serves the dataset
    (the same draws as the GPU ``RandomResizedCrop`` + ``RandomHorizontalFlip``; NOTE [crop draws]), and
    from torch's global generator otherwise.
    The box is decided before decoding (NOTE [jpeg read path]).

    Args:
        path: The dataset folder, an fsspec URL of one (``s3://``, ``gs://``, ``az://``, ``https://``), or an
            ``OpenedPath`` of either, whose manifest was read once for several readers.
        storage: Where the pixels live while training.
            ``"mmap"`` (default): memory-mapped shards; the page cache is shared by every process.
            ``"ram"``: one contiguous copy in this process.
            ``"shm"``: one copy per machine in /dev/shm, shared by every rank, worker and job.
            ``"cuda"``: the whole dataset on ``device``; batches are gathered there.
            LMDB datasets take ``"mmap"`` only.
        device: The GPU that holds the dataset when ``storage="cuda"`` (default ``"cuda"``); ignored otherwise.
        size: LMDB only: the side of the decoded square images (default: the stored short side).
        verify: Hash every file against the manifest while opening.
            Default (None): only where the bytes are read anyway (``storage="ram"`` or ``"cuda"``).
        shm_dir: The folder of the shared copy for ``storage="shm"`` (default: ``$FASTDATA_SHM_DIR``, else
            /dev/shm).
        crop: LMDB only: ``"center"`` (default) or ``"random"``.
        crop_fraction: LMDB only, ``crop="center"``: the centre square's side as a fraction of the short side,
            in (0, 1] (default 1.0). ``224/256`` is torchvision's ``Resize(256)`` + ``CenterCrop(224)``.
        scale: LMDB only, ``crop="random"``: the range of the crop's share of the image area, as
            torchvision's ``RandomResizedCrop`` (default ``(0.08, 1.0)``).
        ratio: LMDB only, ``crop="random"``: the range of the crop's aspect ratio, as torchvision
            (default ``(3/4, 4/3)``).
        storage_options: URLs only: options passed to fsspec (credentials, endpoint); default None.
        cache_dir: URLs only: the node-local cache folder (default: ``$FASTDATA_CACHE``, else
            ``$XDG_CACHE_HOME/fastdata``, else ``~/.cache/fastdata``).
        cache_limit: URLs only: the most bytes of this dataset kept in the cache, as a number or a size
            such as ``"200GB"`` (default None: no bound).
            A dataset that does not stream must fit under it whole.
        retry_seconds: URLs only: how long the store may fail (refused connections, timeouts, 5xx) before a
            read gives up with one line naming the object (default 120 s: an outage up to two minutes, at
            opening or mid-epoch, is ridden out). Retried with exponential backoff and jitter.

    Raises:
        ConfigError: An argument has a bad value, or does not apply to this dataset (``size`` or a crop on an
            npy dataset, ``storage`` other than ``"mmap"`` on an LMDB, URL options on a local path, a CUDA
            device where torch sees none).
        FormatError: The folder or URL is not a fastdata image dataset, or a file's size is not the
            manifest's, or the store stayed unreachable for ``retry_seconds``.
        VersionError: The manifest was written by a format version this fastdata cannot read.
        ChecksumError: A file's bytes do not match the manifest (with ``verify``, or as a remote file arrives).
        MissingDependencyError: ``path`` is a URL and fsspec (or its protocol's package) is not installed.
        OutputError: The cache folder cannot be written (DiskFullError when its disk is full).
        ImageDecodeError: Reading a batch met a JPEG record that does not decode (LMDB datasets).

    Examples:
        >>> ds = FastDataset("data/train", storage="shm")
        >>> images, labels = ds.get_batch([0, 5, 9])  # (3, S, S, 3) uint8, (3,) int64
        >>> loader = FastLoader(ds, batch_size=256, shuffle=True)
    """

    def __init__(self, path: Union[str, Path, OpenedPath], *, storage: str = "mmap",
                 device: Union[str, torch.device] = "cuda",
                 size: Optional[int] = None, verify: Optional[bool] = None,
                 shm_dir: Optional[Union[str, Path]] = None, crop: str = "center", crop_fraction: float = 1.0,
                 scale: tuple[float, float] = SCALE, ratio: tuple[float, float] = RATIO,
                 storage_options: Optional[dict[str, Any]] = None,
                 cache_dir: Optional[Union[str, Path]] = None,
                 cache_limit: Union[int, str, None] = None, retry_seconds: float = RETRY_SECONDS) -> None:
        if storage not in STORAGE:
            raise ConfigError(f"storage must be one of {STORAGE}, got storage={storage!r}")
        self._opened = open_path(path, (IMAGES_NPY, IMAGES_LMDB), storage_options=storage_options,
                                 cache_dir=cache_dir, cache_limit=cache_limit,
                                 streamed=lambda m: image_streamed(m, storage), retry_seconds=retry_seconds)
        self.root, self.manifest, self._remote = self._opened.root, self._opened.manifest, self._opened.remote
        self.fields: Optional[list[Field]] = fields_of(self.manifest)  # None: (image, label) samples
        self.storage = storage
        self.device = torch.device(device) if storage == "cuda" else torch.device("cpu")
        check_cuda(self.device, "pass storage='ram' or 'shm' (or device='cpu')")
        self._shm_dir = shm_dir
        self.is_lmdb = self.manifest["format"] == IMAGES_LMDB
        if self.is_lmdb and storage != "mmap":
            raise ConfigError(f"storage={storage!r} needs an npy dataset; {self.root} is an LMDB of JPEGs, read "
                              "(memory-mapped) and decoded per batch: use storage='mmap'")
        if size is not None and not self.is_lmdb:
            raise ConfigError(f"size={size!r} only applies to LMDB datasets; {self.root} holds "
                              f"{self.manifest['sample_shape']} samples already")
        if size is not None and (not is_whole(size) or size < 1):  # (0 meant the stored size; 2.5 was 2)
            raise ConfigError(f"size must be a positive whole number of pixels (or None: the stored short side), got "
                              f"size={size!r}")
        self.size = int(size or self.manifest.get("max_short_side", 0)) if self.is_lmdb else None
        if self.is_lmdb and self.fields is not None and (self.size != self.manifest["max_short_side"] or
                                                         crop != "center" or crop_fraction != 1.0):
            names = ", ".join(f.name for f in self.fields)
            raise ConfigError(f"{self.root} stores its images with sample fields ({names}): "
                              f"they are read whole at their stored {self.manifest['max_short_side']} pixels, so that "
                              "masks and boxes keep their geometry; crop and resize with fastdata.RandomResizedCrop / "
                              "CenterCrop (CPU or CUDAPrefetcher transforms), which move every field together")
        self._set_crop(crop, crop_fraction, scale, ratio)
        self._labels_at_open = labels_at_open(self.manifest)
        self._verify = verify if verify is not None else storage in ("ram", "cuda")
        # the image shards are checked (and hashed: ram/cuda while loading, one read) by open_images
        cached = self._remote is not None and (self.streams or self.is_lmdb and "lmdb_shards" in self.manifest)
        check_other_files(self.root, self.manifest, self.fields, self.is_lmdb, self._verify, cached,
                          remote=self._remote is not None)
        self._label_store = Labels(self.root, self.manifest, has_labels=self.has_labels, streams=self.streams,
                                   at_open=self._labels_at_open, mapped=self._remote is None)
        self._open(self._verify)
        trim_heap(len(self.manifest["files"]))

    def _set_crop(self, crop: str, fraction: float, scale: tuple[float, float], ratio: tuple[float, float]) -> None:
        bounds = (self.manifest.get("max_short_side"), self.manifest.get("max_side")) if self.is_lmdb else (None, None)
        # (checks them; the bounds refuse a record whose frame header claims more: NOTE [damaged records])
        decoder = BatchDecoder(self.size or 0, crop, float(fraction), tuple(scale), tuple(ratio), *bounds)
        if crop == "random" and fraction != 1.0:  # (else unused: the random box is its own fraction)
            raise ConfigError(f"crop_fraction={fraction!r} sizes the centre square of crop='center'; crop='random' "
                              "draws its box by scale and ratio: pass those instead")
        if crop != "random" and (tuple(scale), tuple(ratio)) != (tuple(SCALE), tuple(RATIO)):  # (else unused)
            raise ConfigError(f"scale={scale!r} and ratio={ratio!r} shape the random crops of crop='random' (LMDB "
                              f"datasets), not crop={crop!r}: pass crop='random', or crop on the GPU with "
                              "fastdata.RandomResizedCrop(scale=..., ratio=...) in CUDAPrefetcher(transforms=...)")
        if (crop != "center" or fraction != 1.0) and not self.is_lmdb:
            raise ConfigError(f"crop={crop!r}, crop_fraction={fraction!r} apply to LMDB datasets (decode-time crops); "
                              f"{self.root} holds fixed-size pixels: crop them on the GPU with "
                              "fastdata.RandomResizedCrop / CenterCrop in CUDAPrefetcher(transforms=...)")
        self._decoder: Optional[BatchDecoder] = decoder if self.is_lmdb else None

    @property
    def lmdb_reader(self) -> Optional[LmdbReader]:
        """An LMDB dataset's JPEG records, read without decoding (DALILoader decodes them on the GPU); None
        for an npy dataset."""
        return self._reader

    @property
    def random_crops(self) -> bool:
        """True when batches take a ``draw`` key (FastLoader passes ``(seed, epoch, position, rank)``)."""
        return self._decoder is not None and self._decoder.random

    # -- metadata -------------------------------------------------------------------------------------
    @functools.cached_property
    def manifest_sha256(self) -> str:
        """The dataset's version, as a loader's state names it (`manifest_digest`): made when first asked for,
        since it serialises the whole manifest (seconds at a million shards)."""
        return manifest_digest(self.manifest)

    def __len__(self) -> int:
        return int(self.manifest["num_samples"])

    @property
    def classes(self) -> list[str]:
        """The class names, in label order (like torchvision's ``ImageFolder.classes``)."""
        return list(self.manifest["classes"])

    @property
    def targets(self) -> np.ndarray:
        """Every sample's label (int64), like torchvision's ``ImageFolder.targets`` (a streamed dataset
        fetches its label files for this, not its images)."""
        if not self.has_labels:
            raise ConfigError(f"{self.root} has no 'label' field (its fields: {[f.name for f in self.fields or []]})")
        remote = self._remote
        return self._label_store.complete(lambda name: remote.fetch(remote.entry(name)))  # type: ignore[union-attr]

    def sample_shards(self) -> Optional[np.ndarray]:
        """The shard holding each sample (for ``shuffle_window``); None for a one-store LMDB (version 1)."""
        bounds = self.shard_bounds()
        return None if bounds is None else np.repeat(np.arange(len(bounds) - 1, dtype=np.int64), np.diff(bounds))

    def shard_bounds(self) -> Optional[np.ndarray]:
        """Each shard's first sample, then ``len(self)``: shards hold consecutive samples (for
        ``shuffle_window`` without a number per sample); None for a one-store LMDB (version 1)."""
        if self.is_lmdb and "lmdb_shards" not in self.manifest:
            return None
        return self._where.starts.copy()

    @functools.cached_property
    def _where(self) -> ShardIndex:
        """Which shard, and which row of it, holds each sample."""
        return ShardIndex(shard_starts(self.manifest))

    @property
    def sample_shape(self) -> tuple[int, ...]:
        """One image's shape, ``(S, S, 3)`` (HWC uint8)."""
        return (self.size, self.size, 3) if self.is_lmdb else tuple(self.manifest["sample_shape"])

    sample_dtype = torch.uint8

    def __repr__(self) -> str:
        return (f"FastDataset({str(self.root)!r}, storage={self.storage!r}, samples={len(self)}, "
                f"shape={self.sample_shape})")

    # -- opening (storage/images.py) -----------------------------------------------------------------
    @property
    def has_labels(self) -> bool:
        """False for a dataset with fields but no class label (segmentation, detection, captions)."""
        return self.fields is None or any(f.kind == "label" for f in self.fields)

    @property
    def streams(self) -> bool:
        """True when shards are fetched from object storage as batches need them (NOTE [shard cache])."""
        return self._remote is not None and self.storage == "mmap" and not self.is_lmdb

    def _open(self, verify: bool) -> None:
        opened = open_images(self._opened, self.fields, self.storage, self._label_store,
                             sample_shape=self.sample_shape, verify=verify, streams=self.streams,
                             labels_at_open=self._labels_at_open, device=self.device, shm_dir=self._shm_dir)
        self._shards, self._flat, self._dev = opened.maps, opened.flat, opened.device
        self._dev_labels, self._reader, self._cache, self._store = (opened.device_labels, opened.reader,
                                                                    opened.cache, opened.fields)
        self._hold(self._reader)

    def _keep_limit(self, limit: Optional[int]) -> None:
        self._opened = dataclasses.replace(self._opened, limit=limit)  # (a copy: another reader may share it)

    def _drop_storage(self) -> None:
        self._shards, self._flat, self._dev, self._dev_labels = [], None, None, None
        self._reader, self._cache, self._store = None, None, None
        self._label_store.release()

    # Pickling (DataLoader workers under spawn, multiprocessing): send the configuration, not the pixels;
    # the receiving process maps or loads the data itself. Forked workers inherit the maps and skip this.
    def __getstate__(self) -> dict[str, Any]:
        state = {k: v for k, v in self.__dict__.items() if k not in ("_shards", "_flat", "_dev", "_dev_labels",
                                                                      "_reader", "_cache", "_store", "_released")}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        # The sending process checked the files; a private RAM copy is hashed again while it is read (free:
        # the bytes pass through anyway), maps are not re-hashed in every worker.
        self._open(self._verify and self.storage in ("ram", "cuda"))

    # -- reading --------------------------------------------------------------------------------------
    def _indices(self, indices: Indices) -> np.ndarray:
        if isinstance(indices, slice):
            return np.arange(len(self), dtype=np.int64)[indices]
        if isinstance(indices, torch.Tensor):
            indices = indices.cpu().numpy()
        idx = np.asarray(indices)
        if idx.ndim != 1 or not (np.issubdtype(idx.dtype, np.integer) or idx.size == 0):
            raise IndexError(f"indices must be a 1-D sequence of integers, got shape {idx.shape} dtype {idx.dtype}")
        idx = idx.astype(np.int64, copy=False)
        n = len(self)
        if idx.size and (idx.min() < -n or idx.max() >= n):
            raise IndexError(f"index out of range for a dataset of {n} samples (got {idx.min()}..{idx.max()})")
        return np.where(idx < 0, idx + n, idx)

    def get_batch(self, indices: Indices, out: Optional[torch.Tensor] = None,
                  draw: Optional[tuple[int, int, int, int]] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather ``indices`` at once: ``(B, S, S, 3)`` uint8 and ``(B,)`` int64 (see NOTE [gather]).

        ``out`` (e.g. a pinned buffer of at least ``B`` rows) receives the images; the result is ``out[:B]``.
        ``draw`` = ``(seed, epoch, position, rank)`` seeds the batch's random crops (``crop="random"``).
        A dataset with sample fields returns a dict instead (see `_get_fields`).
        """
        self._check_open()
        if self.fields is not None:
            return self._get_fields(indices, out)  # type: ignore[return-value]
        if self._dev is not None:
            if isinstance(indices, torch.Tensor) and indices.device == self._dev.device:
                # already on the device (FastLoader's): checked by kind, not by value (a sync every step), so a
                # bool mask or float indices are refused; an index past the end fails in index_select
                if indices.ndim != 1 or indices.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
                    raise IndexError(f"indices must be a 1-D tensor of integers, got shape {tuple(indices.shape)} "
                                     f"dtype {indices.dtype}")
                idx_t = indices.long()  # (widened first: int16 indices + len would wrap)
                idx_t = torch.where(idx_t < 0, idx_t + len(self), idx_t)
            else:
                idx_t = torch.from_numpy(self._indices(indices)).to(self.device)
            x = torch.index_select(self._dev, 0, idx_t, out=out[: len(idx_t)] if out is not None else None)
            return x, self._dev_labels[idx_t]
        idx = self._indices(indices)
        buf = batch_rows(out, len(idx), torch.uint8, self.sample_shape) if out is not None else None
        with self._pinned(idx) as maps:  # (a streamed shard's labels are held while it is open)
            return self._host_images(idx, buf, draw, maps=maps), torch.from_numpy(self._label_store.take(idx,
                                                                                                        self._where))

    @contextlib.contextmanager
    def _pinned(self, idx: np.ndarray) -> Iterator[Optional[np.ndarray]]:
        """Streamed: the shards of ``idx`` fetched (or waited for) and pinned while the block reads them (the
        opened shards, indexed by shard); else nothing to hold (None)."""
        if self._cache is None:
            yield None
            return
        try:
            with self._cache.reading(np.unique(self._where.shard_of(idx))) as maps:
                yield maps
        except KeyError:  # a close on another thread let go of the batch's shards (their labels): say so
            self._check_open()
            raise

    def _host_images(self, idx: np.ndarray, buf: Optional[torch.Tensor],
                     draw: Optional[tuple[int, int, int, int]] = None, maps: Optional[Any] = None) -> torch.Tensor:
        """The images of ``idx`` gathered (or decoded) on the host into ``buf`` (a new tensor when None);
        ``maps``: a streamed batch's shards, pinned by the caller (`_pinned`)."""
        x = buf if buf is not None else torch.empty((len(idx), *self.sample_shape), dtype=torch.uint8)
        if self._reader is not None:
            self._decode_into(idx, x, draw)
        elif self._flat is not None:
            np.take(self._flat, idx, axis=0, out=x.numpy(), mode="clip")
        else:
            self._gather_shards(idx, x.numpy(), maps)
        return x

    def _get_fields(self, indices: Indices, out: Union[None, torch.Tensor, Alloc]) -> dict[str, torch.Tensor]:
        """A batch of a dataset with fields: ``{"image": (B, S, S, 3) uint8, "label": (B,) int64 (when there is
        one), each fixed field (B, ...), each variable field's values and "<name>_offsets" (B + 1)}``. ``out``
        is an image buffer as for (image, label) datasets, or ``out(key, shape, dtype)`` giving each buffer."""
        self._check_open()
        idx = self._indices(indices)
        b = len(idx)
        if isinstance(out, torch.Tensor):
            image_buf = batch_rows(out, b, torch.uint8, self.sample_shape)
            alloc: Optional[Alloc] = None
        else:
            alloc = out
            image_buf = out("image", (b, *self.sample_shape), torch.uint8) if out is not None else None
        batch: dict[str, torch.Tensor] = {}
        idx_t = None
        with self._pinned(idx) as maps:  # streamed: the batch's shards (every field's files) pinned while read
            if self._dev is not None:  # storage="cuda": gathered on the device
                idx_t = torch.from_numpy(idx).to(self.device)
                batch["image"] = torch.index_select(self._dev, 0, idx_t)
                if self._dev_labels is not None:
                    batch["label"] = self._dev_labels[idx_t]
            else:
                batch["image"] = self._host_images(idx, image_buf, maps=maps)
                if self.has_labels:
                    y = alloc("label", (b,), torch.int64) if alloc is not None else torch.empty(b, dtype=torch.int64)
                    self._label_store.take(idx, self._where, out=y.numpy())
                    batch["label"] = y
            assert self._store is not None
            batch.update(self._store.gather(idx, alloc, idx_t))
        return batch

    def collate(self, samples: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """``collate_fn`` for ``DataLoader(ds, batch_size=B, collate_fn=ds.collate)`` over a dataset with
        fields: the batch `get_batch` gives (fixed fields stacked, variable ones concatenated with
        offsets)."""
        return collate_fields(samples, self.fields or [])

    def _gather_shards(self, idx: np.ndarray, dst: np.ndarray, maps: Optional[Any] = None) -> None:
        if len(idx) == 0:
            return
        shard, rows = self._where.locate(idx)  # (streamed: the cache's maps, or bounded maps beside it)
        take_rows(self._shards if maps is None or len(self._shards) else maps, shard, rows, dst)

    def plan_reads(self, batches: Iterable[np.ndarray], now: Optional[int] = None) -> Optional[object]:
        """Tell a streamed dataset the coming batches (an iterator of index arrays, in order; after the first
        ``now`` it may run on into the next epoch), so their shards are fetched ahead of them and evicted by
        next use (FastLoader calls this); a token for `end_reads`."""
        if self._cache is None:
            return None
        where = self._where
        return self._cache.plan((where.shard_of(np.asarray(b, dtype=np.int64)) for b in batches), now)

    def _decode_into(self, idx: np.ndarray, x: torch.Tensor, draw: Optional[tuple[int, int, int, int]]) -> None:
        # JPEG decoding is per image by nature; libjpeg-turbo (and Pillow, its fallback) release the GIL, so
        # loader threads decode in parallel, each straight into its row of the batch. Streamed: the caller
        # holds the batch's stores (`_pinned`).
        assert self._reader is not None
        with self._reader.views(idx) as blobs:  # decoded from the page cache, no copy
            self._decode_views(idx, blobs, x, draw)

    def _decode_views(self, idx: np.ndarray, blobs: list[memoryview], x: torch.Tensor,
                      draw: Optional[tuple[int, int, int, int]]) -> None:
        assert self._reader is not None and self._decoder is not None
        try:
            self._decoder.decode(blobs, x, draw)
        except ImageDecodeError as exc:
            i = int(idx[getattr(exc, "position", 0)])
            raise ImageDecodeError(f"{self._reader.path_of(i)}: sample {i} is not a decodable JPEG ({exc}): "
                                   "run `fastdata verify` on the dataset") from exc

    def __getitem__(self, index: Union[int, Indices]) -> Any:
        if isinstance(index, (int, np.integer)) or (isinstance(index, torch.Tensor) and index.ndim == 0):
            if self.fields is not None:
                return split_fields(self._get_fields([int(index)], None), self.fields)[0]
            x, y = self.get_batch([int(index)])
            return x[0], y[0]
        return self.get_batch(index)

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """torch's batched-fetch hook: a list of samples, built from one `get_batch`."""
        if self.fields is not None:
            return split_fields(self._get_fields(indices, None), self.fields)
        x, y = self.get_batch(indices)
        return list(zip(x.unbind(0), y.unbind(0)))
