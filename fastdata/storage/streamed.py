"""Which files of a dataset in object storage are streamed (fetched as batches need them, NOTE [shard cache]
in cache.py) rather than downloaded when it opens, and which of them travel together as one shard's group."""
from __future__ import annotations

from typing import Any

from ..manifest import IMAGES_NPY
from ..schema import fields_of

ALL_LABELS_AT_OPEN = 64 << 20  # a streamed dataset reads all_labels at opening up to this size (8M samples)


def labels_at_open(manifest: dict[str, Any]) -> bool:
    """Whether a streamed npy dataset reads every label from ``all_labels`` when it opens (one request, when
    the file is small) instead of each shard's labels file with the shard. One pass over the files list:
    call it once per opening and pass the answer on."""
    name = manifest.get("all_labels")
    if not name:
        return False
    size = next((int(f["bytes"]) for f in manifest["files"] if f.get("path") == name), None)
    return size is not None and size <= ALL_LABELS_AT_OPEN


def shard_groups(manifest: dict[str, Any], at_open: bool) -> list[tuple[str, ...]]:
    """Each shard's files, read together: its images first (npy rows or an LMDB store), its labels (npy, unless
    they are all read at opening: ``at_open``, from :func:`labels_at_open`), each other field's rows."""
    fields = [f for f in fields_of(manifest) or [] if f.kind not in ("image", "label")]
    if "lmdb_shards" in manifest:
        return [(s["path"], *(f.files(k)[0] for f in fields)) for k, s in enumerate(manifest["lmdb_shards"])]
    return [(s["images"], *([s["labels"]] if "labels" in s and not at_open else []), *(f.files(k)[0] for f in fields))
            for k, s in enumerate(manifest.get("shards", []))]


def image_streamed(manifest: dict[str, Any], storage: str) -> frozenset[str]:
    """The files of a remote image dataset fetched as batches need them: npy image shards (with their labels,
    unless ``all_labels`` is read at opening, and their other fields' files; variable fields' offsets are read
    up front) and LMDB shards (format version 2), read memory-mapped."""
    if storage != "mmap":
        return frozenset()
    if manifest.get("format") == IMAGES_NPY:  # each shard's other files come with it
        at_open = labels_at_open(manifest)
        names = {f for group in shard_groups(manifest, at_open) for f in group}
        names |= {s["labels"] for s in manifest.get("shards", []) if "labels" in s}  # (unread with all_labels)
        if "all_labels" in manifest and not at_open:
            names.add(manifest["all_labels"])
        return frozenset(names)
    if "lmdb_shards" in manifest:
        return frozenset(f for group in shard_groups(manifest, False) for f in group)
    return frozenset()


def token_streamed(manifest: dict[str, Any], storage: str) -> frozenset[str]:
    """The files of a remote token dataset fetched as batches need them: every split's shards, memory-mapped."""
    if storage != "mmap":
        return frozenset()
    return frozenset(sh["path"] for split in manifest.get("splits", {}).values() for sh in split.get("shards", []))
