"""The end of ``fastdata preprocess images``: the fields a run's samples get, ``labels.npy`` and the
manifest, written last (in OUT, or staged and put into the store), and the report the CLI prints."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Union

import numpy as np

from .._io import HashingWriter, fsync_dir
from ..errors import ImageDecodeError
from ..formats import image_shards, lmdb_store
from ..formats.base import LABEL_DTYPE, npy_header
from ..formats.manifest import IMAGES_LMDB, IMAGES_NPY, MANIFEST_NAME, new_manifest, write_manifest
from ..formats.schema import Field, check_fields
from ..formats.tokenizer import cached_tokenizer, token_dtype
from . import journal, store_out
from .image_tasks import MAX_SIDE
from .sources import Source
from .indexed import Indexed

Listed = Union[Source, Indexed]
# ``config`` below: the run's `fastdata.preprocess.images.ImagePreprocessConfig` (not imported: it imports this)


def sample_fields(config: Any, source: Listed) -> list[Field]:
    """The fields a source's samples get (NOTE [fields] in fastdata/formats/schema.py); empty for (image, class)
    sources. Images alone (no label, no other field) are a dataset of one field: written as (image, class),
    they had no labels to read and could not be opened."""
    if not source.kinds and source.has_label:
        return []
    s = config.size
    fields = [Field("image", "image", image_shards.IMAGE_DTYPE.str, (s, s, 3))]
    if source.has_label:
        fields.append(Field("label", "label", LABEL_DTYPE.str))
    for name, kind in source.kinds.items():
        if kind == "mask":
            fields.append(Field(name, kind, np.dtype(config.mask_dtype).newbyteorder("<").str, (s, s)))
        elif kind == "vector":
            fields.append(Field(name, kind, "<f4", source.vector_shape(name)))
        elif kind == "tokens":
            fields.append(Field(name, kind, token_dtype(cached_tokenizer(config.tokenizer).vocab_size).str))
        elif kind == "boxes":
            fields.append(Field("boxes", "boxes", "<f4", (4,)))
        else:  # labels, box_labels
            fields.append(Field(name, kind, LABEL_DTYPE.str))
    return check_fields(fields, f"the fields of {source.where}")  # refused before a shard is written


def finish(config: Any, source: Listed, jr: journal.Journal, folder: Path,
            params: dict[str, Any], fingerprint: str, store: Optional[store_out.StoreOut]) -> dict[str, Any]:
    """Write ``labels.npy`` and the manifest last: in OUT, or (``store``) staged in ``folder`` and put."""
    n = jr.num_samples
    if n == 0:
        first = jr.skipped[0] if jr.skipped else {"path": "?", "reason": "?"}
        raise ImageDecodeError(f"none of the {source.num_samples} images in {source.where} could be decoded "
                               f"(first: {first['path']}: {first['reason']})")
    fields = sample_fields(config, source)
    # an LMDB shard's labels-K.npy only carries its labels to labels.npy: dropped once the manifest exists,
    # so that opening a streamed LMDB dataset fetches one labels file, not one per shard
    transient = {image_shards.labels_name(u["index"]) for u in jr.units} if config.format == "lmdb" else set()
    files = [f for u in jr.units for f in u["files"] if f["path"] not in transient]
    counts = [u["samples"] for u in jr.units]
    uneven = any(c != config.shard_size for c in counts[:-1]) or counts[-1] == 0
    if config.format == "npy":
        fmt, extra = IMAGES_NPY, {
            "sample_shape": [config.size, config.size, 3], "dtype": image_shards.IMAGE_DTYPE.str, "layout": "NHWC",
            "shard_size": config.shard_size,
            "shards": [{"images": image_shards.images_name(u["index"]),
                        **({"labels": image_shards.labels_name(u["index"])} if source.has_label else {}),
                        "samples": u["samples"]} for u in jr.units]}  # other fields' files: Field.files
        # (image, class) datasets of even shards stay version 1, which every fastdata reads; 2: fields;
        # 3: shards shortened by samples that did not decode (formats/base.py)
        version = 3 if uneven else 2 if fields else 1
    else:
        fmt, extra = IMAGES_LMDB, {"lmdb_shards": [{"path": lmdb_store.shard_name(u["index"]), "samples": u["samples"]}
                                                   for u in jr.units], "shard_size": config.shard_size,
                                   "key_format": "%012d", "encoding": "jpeg", "max_short_side": config.size}
        if config.resize == MAX_SIDE:  # the short side is at most S too, so max_short_side stays true
            extra["max_side"] = config.size
        version = lmdb_store.LOCAL_KEYS_VERSION  # keys per shard (lmdb_store's docstring)
    if fields:
        extra["fields"] = [f.to_json() for f in fields]
        if "tokens" in source.kinds.values():
            extra["tokenizer"] = cached_tokenizer(config.tokenizer).describe()
    class_counts = np.zeros(len(source.classes), np.int64)
    if source.has_label:  # every label in one file too (image_shards' docstring), a unit's at a time
        out = HashingWriter(folder / image_shards.ALL_LABELS_NAME)
        out.write(npy_header((n,), LABEL_DTYPE))
        for u in jr.units:
            labels = _unit_file(folder, image_shards.labels_name(u["index"]), store)
            class_counts += np.bincount(labels, minlength=len(class_counts))[:len(class_counts)]
            out.write(labels)
        files.append(out.commit())
        extra["all_labels" if config.format == "npy" else "labels"] = image_shards.ALL_LABELS_NAME
    for f in fields:  # class ids of the other fields count too: a tag per sample, a box per object
        if f.kind in ("labels", "box_labels"):
            for u in jr.units:
                ids = _unit_file(folder, f.files(u["index"])[0], store)
                class_counts += np.bincount(ids, minlength=len(class_counts))[:len(class_counts)]
    class_counts = class_counts.tolist()
    manifest = new_manifest(
        fmt, version=version, num_samples=n, classes=source.classes, class_counts=class_counts,
        label_dtype=LABEL_DTYPE.str, files=files, params=params, fingerprint=fingerprint,
        source={"kind": source.kind, "path": source.where, "num_files": source.num_samples},
        skipped=[{"path": s["path"], "reason": s["reason"]} for s in jr.skipped], **extra)
    write_manifest(folder, manifest)
    if store is not None:
        store.finish(folder, [image_shards.ALL_LABELS_NAME] if source.has_label else [], sorted(transient))
        return manifest
    for name in transient:
        (folder / name).unlink(missing_ok=True)
    journal.remove_partial(folder)
    fsync_dir(folder)
    return manifest


def _unit_file(folder: Path, name: str, store: Optional[store_out.StoreOut]) -> np.ndarray:
    """A unit's labels (or class-id field) file: in ``folder``, or fetched from the store (a unit of an earlier
    run)."""
    if store is not None and not (folder / name).exists():
        store.get(name, folder / name)
    return np.load(folder / name, allow_pickle=False)


def summary(manifest: dict[str, Any], limit: int = 10) -> str:
    """The one-paragraph report the CLI prints on stderr (skipped files named)."""
    classes = f" in {len(manifest['classes'])} classes" if manifest["classes"] else ""  # (masks, vectors: none)
    lines = [f"{manifest['num_samples']} samples{classes} -> {manifest['format']}"]
    if "fields" in manifest:
        lines.append("fields: " + ", ".join(f"{f['name']} ({f['kind']})" for f in manifest["fields"]))
    skipped = manifest.get("skipped", [])
    if skipped:
        lines.append(f"skipped {len(skipped)} unreadable file(s) or bad record(s) (all listed in {MANIFEST_NAME}):")
        lines += [f"  {s['path']}: {s['reason']}" for s in skipped[:limit]]
        if len(skipped) > limit:
            lines.append(f"  ... and {len(skipped) - limit} more")
    return "\n".join(lines)
