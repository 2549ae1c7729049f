"""An image dataset's bytes opened for reading, in one storage mode: ``.npy`` shards memory-mapped, one
contiguous copy in RAM or /dev/shm, one tensor on the GPU, an LMDB reader, or shards streamed from object
storage through the node cache (NOTE [shard cache] in fastdata/storage/cache.py); the sample fields' files
with them. `FastDataset` keeps only the batching on top of this."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import torch

from .. import _limits
from ..formats.lmdb_store import LmdbReader, open_lmdb
from ..formats.manifest import IMAGES_LMDB
from ..formats.rows import column, pairs
from ..formats.schema import Field
from .cache import ShardCache
from .fields import FieldStore
from .opening import OpenedPath
from .shards import ShardMaps, ShardSet, check_sizes, map_npy, open_shards, verify_hashes
from .streamed import Labels, shard_groups


@dataclass
class OpenedImages:
    """Where an image dataset's bytes live once opened; exactly one of ``maps`` (non-empty), ``flat``,
    ``device``, ``reader`` or ``cache`` holds the images (``cache`` beside ``reader`` for a streamed LMDB,
    beside bounded ``maps`` for streamed npy shards more than may stay mapped)."""

    maps: Sequence[np.ndarray] = field(default_factory=list)  # mmap: a map per shard (ShardMaps: bounded)
    flat: Optional[np.ndarray] = None  # ram/shm: one (N, S, S, 3) array
    device: Optional[torch.Tensor] = None  # cuda: the whole dataset on the device...
    device_labels: Optional[torch.Tensor] = None  # ...and its labels
    reader: Optional[LmdbReader] = None  # LMDB: JPEG records
    cache: Optional[ShardCache] = None  # streamed: shards fetched as the coming batches need them
    fields: Optional[FieldStore] = None  # the sample fields' files (datasets with fields)


def image_files(manifest: dict[str, Any], fields: Optional[list[Field]], is_lmdb: bool) -> set[str]:
    """The files opened (and checked) by `open_images`: image shards and the extra fields' files."""
    names = set() if is_lmdb else set(column(manifest["shards"], "images"))
    shards = len(manifest["lmdb_shards" if is_lmdb else "shards"]) if fields is not None else 0
    for f in fields or []:
        if f.kind not in ("image", "label"):
            names.update(n for k in range(shards) for n in f.files(k))
    return names


def check_other_files(root: Path, manifest: dict[str, Any], fields: Optional[list[Field]], is_lmdb: bool,
                      verify: bool, cached: bool = False, remote: bool = False) -> None:
    """Size (and with ``verify`` hash) every file that `open_images` does not open itself (labels, LMDB
    stores, offsets), refusing a missing one by name; of a ``remote`` dataset only those present (its cache
    fetches the others). ``cached``: the node cache fetches the shards' files (labels, LMDB stores too) and
    checks them as they arrive, fetching again one of another size (NOTE [shard cache] 20): not checked here."""
    if cached and not verify:  # (the files fetched at opening were sized as they came: `RemoteDataset.get`)
        return
    opened = image_files(manifest, fields, is_lmdb)
    if cached:
        opened.update(shard_groups(manifest, False).flat()[0])
    others = check_sizes(root, manifest, skip=opened, present_only=remote)
    if verify:
        verify_hashes(root, manifest, others)


def open_images(opened: OpenedPath, fields: Optional[list[Field]], storage: str, labels: Labels, *,
                sample_shape: tuple[int, ...], verify: bool, streams: bool, labels_at_open: bool,
                device: torch.device, shm_dir: Optional[Path]) -> OpenedImages:
    """The bytes of an opened dataset in ``storage`` mode (``streams``: npy shards through the node cache;
    a URL's LMDB shards always stream); ``labels`` are held while their streamed shards are open."""
    root, manifest = opened.root, opened.manifest
    out = OpenedImages()
    if manifest["format"] == IMAGES_LMDB:
        out.reader = open_lmdb(root, manifest)
        if opened.remote is not None and "lmdb_shards" in manifest:
            _stream(out, opened, fields, storage, labels, labels_at_open, None, verify)
        elif fields is not None:
            out.fields = FieldStore(root, manifest, fields, storage, verify=verify)
        return out
    images = ShardSet(root, manifest, pairs(manifest["shards"], "images", "samples"), sample_shape, np.dtype(np.uint8))
    if streams:
        _stream(out, opened, fields, storage, labels, labels_at_open, images, verify)
        return out
    shards = open_shards(images, storage, verify=verify, device=device, shm_dir=shm_dir)
    out.maps, out.flat, out.device = shards.maps, shards.flat, shards.device
    if fields is not None:
        out.fields = FieldStore(root, manifest, fields, storage, verify=verify, device=device, shm_dir=shm_dir)
    if out.device is not None and labels.has_labels:
        out.device_labels = torch.from_numpy(labels.array.copy()).to(device)
    return out


def _stream(out: OpenedImages, opened: OpenedPath, fields: Optional[list[Field]], storage: str, labels: Labels,
            labels_at_open: bool, images: Optional[ShardSet], verify: bool) -> None:
    """Shards fetched from object storage as batches need them (NOTE [shard cache]), each with its group's
    files: checked, labels read in (unless all came at opening), fields opened, then its images mapped
    (npy) or its LMDB store handed to the reader (``images`` None); all let go of when the shard closes."""
    root, manifest = opened.root, opened.manifest
    groups = shard_groups(manifest, labels_at_open)
    maps_a_shard = (images is not None) + sum(f.kind not in ("image", "label") for f in fields or [])
    bounded = not _limits.room_for_maps(len(groups) * maps_a_shard)  # (NOTE [open files] 2)
    if bounded and images is not None:
        out.maps = ShardMaps(images, *_limits.bounded_maps())  # mapped as batches read them, not as they arrive
    store = None
    if fields is not None:
        store = out.fields = FieldStore(root, manifest, fields, storage, verify=verify, streamed=True,
                                        bounded=bounded)

    def opener(s: int, path: Path) -> Any:
        if verify:
            verify_hashes(root, manifest, list(groups[s]))
        labels.arrived(s)
        try:
            if store is not None:
                store.open_shard(s)
            if images is None or out.maps:
                return path
            return map_npy(root, images.files[s][0], (images.files[s][1], *images.row_shape), images.dtype)
        except BaseException:
            labels.left(s)  # (not open: fetched again, and read in again, by the next batch that needs it)
            raise

    def closer(s: int, path: Path) -> None:
        labels.left(s)
        if images is None:
            out.reader.release(path)  # type: ignore[union-attr]
        elif out.maps:
            out.maps.drop(s)  # type: ignore[attr-defined]
        if store is not None:
            store.close_shard(s)
    out.cache = ShardCache(opened.remote, groups, opener, limit=opened.limit, closer=closer,
                           eager=not (bounded or images is None))  # (mapped as read: nothing to open up front)
