"""``fastdata preprocess images``: an image folder or CSV list -> uint8 .npy shards or a JPEG LMDB.

Decoding runs in worker processes over chunks of files; results are written in source order, so the
output is byte-identical for any worker count. Completed units (shards / LMDB parts) are journaled, so a
killed run resumes; the manifest is written last.
"""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np

from .._io import fsync_dir, write_bytes_atomic
from ..errors import ConfigError, ImageDecodeError, require
from ..formats import image_shards, lmdb_store
from ..formats.base import LABEL_DTYPE, npy_bytes
from ..formats.manifest import IMAGES_LMDB, IMAGES_NPY, MANIFEST_NAME, new_manifest, write_manifest
from ..formats.schema import Field
from ..formats.tokenizer import cached_tokenizer, token_dtype
from ..imaging import decode_file as decode
from ..storage.remote import is_url
from . import journal, parallel, ray_pool
from .fields import RecordDecoder, open_source
from .sources import Source
from .tars import discover_source

log = logging.getLogger(__name__)

FORMATS = ("npy", "lmdb")
MAX_SIDE = "max-side"  # lmdb: the longer side at most S, aspect kept, never upscaled (FFCV's max_resolution)
RESIZE_MODES = (*decode.RESIZE_MODES, MAX_SIDE)
ON_ERROR = ("skip", "fail")
_MAX_CHUNK = 16  # files per worker task: ~3 MB of 256px pixels; small chunks keep the tail short
_CHUNK_BYTES = 8 << 20  # and at most this many bytes of pixels (one shared slot), but at least one image
@dataclass(frozen=True)
class ImagePreprocessConfig:
    """Everything ``fastdata preprocess images`` takes, as one frozen dataclass validated on construction.

    Args:
        src: The source: an image folder (one sub-folder per class), a ``path,label`` CSV, a ``.jsonl`` or
            ``.csv`` of records, Parquet, a segmentation pair (``images/`` + ``masks/``), the image folder
            of ``coco``, or WebDataset tars (a folder, one tar, or a brace pattern; local or a URL).
        out: The dataset folder to write.
        size: npy: the side of the square uint8 samples; LMDB: the largest short side of the stored JPEGs
            (the largest longer side with ``resize="max-side"``); 8..8192 (default 256).
        resize: How an image becomes a ``size`` square (npy, and LMDB with sample fields): ``"center-crop"``
            (default), ``"squash"`` or ``"pad"`` (letterboxed with black).
            LMDB only: ``"max-side"`` keeps the aspect with the longer side at most ``size``, never upscaled
            (FFCV's ``max_resolution``).
        format: ``"npy"`` (uint8 shards, no decoding while training) or ``"lmdb"`` (re-encoded JPEGs, decoded
            while training) (default ``"npy"``).
        workers: Decoding processes (default None: every core this process may use).
        shard_size: Samples per shard (default 1024).
        on_error: ``"skip"`` leaves an undecodable file out and names it in the manifest; ``"fail"`` stops
            (default ``"skip"``).
        quality: LMDB only: the JPEG quality of the stored records, 1..100 (default 90).
        filter: The resize filter: ``"lanczos"`` (default), or the cheaper ``"bicubic"`` or ``"bilinear"``
            (benchmarks/RESULTS.md).
        overwrite: Replace a dataset in ``out`` made from another source or with other parameters
            (default False).
        progress: Show a progress bar (default True).
        coco: A COCO ``instances.json`` over the image folder ``src``, for detection (default None).
        mask_dtype: The masks' dtype: ``"uint8"`` (default), or ``"uint16"`` for more than 256 class or instance
            ids.
        tokenizer: The tokenizer of text fields (captions), as ``fastdata preprocess text --tokenizer``
            (default ``"bytes"``).
        shuffle_seed: Store the samples in a random order drawn from this seed (default None: source order).
        engine: ``"local"`` (default: a process pool here) or ``"ray"`` (Ray tasks on a cluster; the same bytes,
            NOTE [ray byte-identity] in fastdata/preprocess/ray_pool.py); with Ray, ``workers`` is per node.
        ray_address: The Ray cluster's ``HOST:PORT`` (default None: the one on this machine, or a new local one).

    Raises:
        ConfigError: A field is out of range; the message names the field and echoes the value.
    """

    src: Union[Path, str]  # a path, or a URL of WebDataset tars
    out: Path
    size: int = 256
    resize: str = "center-crop"  # lmdb: max-side keeps the aspect (longer side <= size); else shorter side <= size
    format: str = "npy"
    workers: Optional[int] = None  # None: every core this process may use
    shard_size: int = 1024
    on_error: str = "skip"
    quality: int = 90
    filter: str = "lanczos"  # resize filter: Lanczos (default), or bicubic/bilinear, cheaper (RESULTS.md)
    overwrite: bool = False
    progress: bool = True
    coco: Optional[Path] = None  # COCO instances.json over the image folder SRC (detection)
    mask_dtype: str = "uint8"  # masks: uint8, or uint16 for more than 256 class/instance ids
    tokenizer: str = "bytes"  # for text fields (captions), as `fastdata preprocess text --tokenizer`
    shuffle_seed: Optional[int] = None  # store the samples in a random order from this seed (Source.shuffled)
    engine: str = "local"  # or "ray": the same bytes (NOTE [ray byte-identity] in fastdata/preprocess/ray_pool.py)
    ray_address: Optional[str] = None  # HOST:PORT; None: the cluster on this machine, or a new local one

    def __post_init__(self) -> None:
        object.__setattr__(self, "src", self.src if is_url(self.src) else Path(self.src))  # tars at a URL
        object.__setattr__(self, "out", Path(self.out))
        require(isinstance(self.size, int) and 8 <= self.size <= 8192, "size", self.size, "an integer in 8..8192")
        require(self.resize in RESIZE_MODES, "resize", self.resize, f"one of {RESIZE_MODES}")
        require(self.format in FORMATS, "format", self.format, f"one of {FORMATS}")
        require(self.resize != MAX_SIDE or self.format == "lmdb", "resize", self.resize,
                f"one of {decode.RESIZE_MODES} for the npy format (its samples are S x S; {MAX_SIDE!r} is for "
                "--format lmdb)")
        require(self.workers is None or (isinstance(self.workers, int) and self.workers >= 1), "workers",
               self.workers, "a positive integer")
        require(isinstance(self.shard_size, int) and self.shard_size >= 1, "shard_size", self.shard_size,
               "a positive integer")
        require(self.on_error in ON_ERROR, "on_error", self.on_error, f"one of {ON_ERROR}")
        require(isinstance(self.quality, int) and 1 <= self.quality <= 100, "quality", self.quality, "1..100")
        require(self.filter in decode.FILTERS, "filter", self.filter, f"one of {tuple(decode.FILTERS)}")
        require(self.mask_dtype in ("uint8", "uint16"), "mask_dtype", self.mask_dtype, "'uint8' or 'uint16'")
        require(self.engine in ray_pool.ENGINES, "engine", self.engine, f"one of {ray_pool.ENGINES}")
        require(self.shuffle_seed is None or (isinstance(self.shuffle_seed, int) and self.shuffle_seed >= 0),
                "shuffle_seed", self.shuffle_seed, "a non-negative integer")
        if self.coco is not None:
            object.__setattr__(self, "coco", Path(self.coco))

    def output_params(self) -> dict[str, Any]:
        """The parameters that shape the output bytes (not workers, progress or overwrite)."""
        params = {"size": self.size, "format": self.format, "shard_size": self.shard_size, "on_error": self.on_error}
        if self.format == "npy":
            params["resize"] = self.resize
        else:
            params["quality"] = self.quality
            if self.resize == MAX_SIDE:  # named only then: shorter-side stores keep their fingerprint
                params["resize"] = MAX_SIDE
        if self.filter != "lanczos":  # named only when not the default: older runs keep their fingerprint
            params["filter"] = self.filter
        for key, default in (("mask_dtype", "uint8"), ("tokenizer", "bytes"), ("shuffle_seed", None)):
            if getattr(self, key) != default:
                params[key] = getattr(self, key)
        return params


def preprocess_images(config: ImagePreprocessConfig) -> dict[str, Any]:
    """Preprocess an image source into a dataset folder: uint8 .npy shards or a JPEG LMDB.

    The data's way:

        source (folder, CSV, records, Parquet, COCO, segmentation pair, tars) -> chunks -> worker processes
            decode and resize -> results written in source order into shards (or LMDB parts) -> each complete
            shard journaled -> manifest.json written last, by atomic rename

    The output is byte-identical for any worker count.
    A killed run resumes from its complete shards; a rerun with the same arguments returns at once.

    Args:
        config: What to read, what to write and how (`ImagePreprocessConfig`).

    Returns:
        The dataset's manifest, as written to ``config.out/manifest.json``.

    Raises:
        SourceError: The source is missing, empty or malformed.
        ConfigError: The output folder is inside the source folder.
        ImageDecodeError: An image does not decode and ``on_error="fail"``, or no image decodes at all.
        OutputError: The output folder cannot be written, holds something else, or holds a dataset made with
            other arguments and ``overwrite`` is off (DiskFullError when the disk fills up).
        MissingDependencyError: The source needs an optional package (Parquet: pyarrow; a URL: fsspec; a
            tokenizer's).

    Examples:
        >>> manifest = preprocess_images(ImagePreprocessConfig(src="raw/train", out="data/train", size=256))
        >>> manifest["num_samples"]
        1281167
    """
    journal.check_writable(config.out)  # before the source is listed (tars are read whole for that)
    source = discover_source(config.src, config.coco)
    src, out = Path(source.location).resolve(), config.out.resolve()
    if source.kind == "folder" and (out == src or src in out.parents):  # its folder would become a class
        raise ConfigError(f"the output folder {config.out} is inside the source folder {config.src}: the next "
                          "run would read it as a class of its own (and renumber the others); choose an output "
                          "folder outside it")
    if config.resize == MAX_SIDE and source.kinds:
        raise ConfigError(f"--resize {MAX_SIDE} stores each image at its own aspect, but {config.src} has fields "
                          f"({', '.join(source.kinds)}) that need the square geometry: use --resize center-crop, "
                          "squash or pad")
    if config.shuffle_seed is not None:
        source = source.shuffled(config.shuffle_seed)
    params = config.output_params()
    if source.kinds and config.format == "lmdb":  # images stored square, so the other fields share their geometry
        params["resize"] = config.resize
    fingerprint = hashlib.sha256(json.dumps([params, source.fingerprint()], sort_keys=True).encode()).hexdigest()
    # NOTE [one writer] and NOTE [overwrite] in fastdata/preprocess/journal.py
    with journal.output(config.out, fingerprint, config.overwrite) as target:
        if target.done is not None:
            log.info("%s is already complete with these arguments", config.out)
            return target.done
        config = replace(config, out=target.folder)  # OUT, or the new dataset's folder beside it
        jr, partial = journal.resume(config.out, fingerprint)
        if jr.units:
            log.info("resuming after %d complete units (%d samples)", len(jr.units), jr.num_samples)
        _run(config, source, jr, partial)
        return _finish(config, source, jr, partial, params, fingerprint)


def _chunks(start: int, stop: int, workers: int, max_files: int) -> list[tuple[int, int]]:
    size = max(1, min(max_files, -(-(stop - start) // (workers * 8))))
    return [(a, min(a + size, stop)) for a in range(start, stop, size)]


def _run(config: ImagePreprocessConfig, source: Source, jr: journal.Journal, partial: Path) -> None:
    from ..progress import progress_bar

    needs = None if is_url(source.location) else source.root  # every Ray node must see a local source
    pool = ray_pool.RayPool.open(config.ray_address, config.workers, needs) if config.engine == "ray" else None
    workers = pool.workers if pool else config.workers or parallel.default_workers()
    row_bytes = config.size * config.size * 3
    max_files = max(1, min(_MAX_CHUNK, _CHUNK_BYTES // row_bytes)) if config.format == "npy" else _MAX_CHUNK
    fields = sample_fields(config, source)
    if fields:
        extra = [f for f in fields if f.kind not in ("image", "label")]
        if config.format == "npy":
            writer: Any = image_shards.NpyShardWriter(config.out, config.size, config.shard_size, len(jr.units),
                                                      fields=extra, labels=source.has_label)
        else:  # JPEG records in LMDB parts, the other fields as npy files in OUT beside them
            writer = lmdb_store.JpegPartWriter(partial, config.shard_size, len(jr.units), fields=extra,
                                               fields_dir=config.out)
    elif config.format == "npy":
        writer = image_shards.NpyShardWriter(config.out, config.size, config.shard_size, len(jr.units))
    else:
        writer = lmdb_store.JpegPartWriter(partial, config.shard_size, len(jr.units))
    start, total = jr.source_end, len(source.paths)
    skipped = list(jr.skipped)
    chunks = _chunks(start, total, workers, max_files)
    if fields:
        spec = (source.kinds, len(source.classes), config.mask_dtype, config.tokenizer, source.has_label)
        tasks = [(str(source.root), source.paths[a:b], a, config.format, config.size, config.resize, config.filter,
                  {k: v[a:b] for k, v in source.extras.items()}, source.labels[a:b], spec,
                  source.blobs.chunk(a, b) if source.blobs is not None else None,  # a task pickles its rows only
                  config.quality) for a, b in chunks]
    else:
        tasks = [(str(source.root), source.paths[a:b], a, config.format, config.size, config.resize, config.quality,
                  config.filter, source.blobs.chunk(a, b) if source.blobs is not None else None) for a, b in chunks]
    # npy pixels come back through shared memory (one slot per task in flight), JPEG bytes through the pipe
    slot_bytes = max_files * row_bytes if config.format == "npy" else 0
    bar = progress_bar(total=total, initial=start, desc="preprocess", unit="img", enabled=config.progress)
    try:
        work = _work_fields if fields else _work
        for (ok_src, payload, failures), view in (pool or parallel).ordered_map(work, tasks, workers, slot_bytes):
            values = None
            if fields:
                payload, values = payload
            if payload is None:  # the npy pixels are in the shared slot (JPEG bytes come as a list)
                payload = np.frombuffer(view, np.uint8, len(ok_src) * row_bytes).reshape(
                    len(ok_src), config.size, config.size, 3)
            if values is not None:
                payload = image_shards.Rows(payload, _stack(values, fields))
            for idx, reason in failures:
                if config.on_error == "fail":
                    raise ImageDecodeError(f"cannot decode {source.root / source.paths[idx]}: {reason} "
                                           "(use --on-error skip to leave such files out)")
                skipped.append({"index": idx, "path": source.paths[idx], "reason": reason})
            labels = np.asarray([source.labels[i] for i in ok_src], dtype=LABEL_DTYPE)
            for unit in writer.append(payload, labels, np.asarray(ok_src)):
                jr.add(_tag(unit, config.format), skipped, partial)
            bar.update(len(ok_src) + len(failures))
        for unit in writer.finish():
            jr.add(_tag(unit, config.format), skipped, partial)
        jr.skipped = skipped
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.close()


def sample_fields(config: ImagePreprocessConfig, source: Source) -> list[Field]:
    """The fields a source's samples get (NOTE [fields] in fastdata/formats/schema.py); empty for (image, class) sources."""
    if not source.kinds:
        return []
    s = config.size
    fields = [Field("image", "image", image_shards.IMAGE_DTYPE.str, (s, s, 3))]
    if source.has_label:
        fields.append(Field("label", "label", LABEL_DTYPE.str))
    for name, kind in source.kinds.items():
        if kind == "mask":
            fields.append(Field(name, kind, np.dtype(config.mask_dtype).newbyteorder("<").str, (s, s)))
        elif kind == "vector":
            first = source.extras[name][0]
            fields.append(Field(name, kind, "<f4", (len(first),) if isinstance(first, list) else ()))
        elif kind == "tokens":
            fields.append(Field(name, kind, token_dtype(cached_tokenizer(config.tokenizer).vocab_size).str))
        elif kind == "boxes":
            fields.append(Field("boxes", "boxes", "<f4", (4,)))
        else:  # labels, box_labels
            fields.append(Field(name, kind, LABEL_DTYPE.str))
    return fields


def _stack(values: dict[str, list[Any]], fields: list[Field]) -> dict[str, Any]:
    """A chunk's field values as the writer takes them: fixed-size fields stacked, variable ones as lists."""
    out: dict[str, Any] = {}
    for f in fields:
        if f.name in values:
            v = values[f.name]
            out[f.name] = v if f.variable else (np.stack(v) if v else np.zeros((0, *f.shape), f.np_dtype))
    return out


def _work_fields(task: tuple, slot: Optional[int] = None) -> tuple[list[int], Any, list[tuple[int, str]]]:
    """Worker: decode one chunk of records with fields (NOTE [record geometry] in fastdata/preprocess/fields.py). Returns
    (source indices decoded, (pixels, None when in the shared slot, or an LMDB's JPEG bytes; {field:
    per-sample values}), failures)."""
    root, paths, first, fmt, size, resize, filter_name, values, labels, spec, blobs, quality = task
    kinds, num_classes, mask_dtype, tokenizer, has_label = spec
    dec = RecordDecoder(root, size, resize, decode.FILTERS[filter_name], kinds, num_classes, mask_dtype, tokenizer)
    shared = parallel.slot(slot)
    pixels = _pixel_rows(shared, len(paths), size)
    ok: list[int] = []
    failures: list[tuple[int, str]] = []
    out: dict[str, list[Any]] = {}
    for j, rel in enumerate(paths):
        try:
            got = dec.decode(open_source(Path(root), rel, blobs, j), {k: v[j] for k, v in values.items()},
                             labels[j] if has_label else None, pixels[len(ok)])
        except (ImageDecodeError, OSError) as exc:
            failures.append((first + j, _reason(exc)))
            continue
        for k, v in got.items():
            out.setdefault(k, []).append(v)
        ok.append(first + j)
    if fmt == "lmdb":  # the record is the decoded square image, encoded once (the same bytes for any chunking)
        return ok, ([decode.encode_jpeg(p, quality) for p in pixels[:len(ok)]], out), failures
    return ok, (pixels[:len(ok)] if shared is None else None, out), failures


def _pixel_rows(shared: Optional[memoryview], n: int, size: int) -> np.ndarray:
    """``(n, size, size, 3)`` uint8 rows for a task's pixels: in its shared slot when it has one."""
    shape = (n, size, size, 3)
    return np.empty(shape, np.uint8) if shared is None else np.frombuffer(
        shared, np.uint8, int(np.prod(shape))).reshape(shape)


def max_side_jpeg(src: Any, size: int, quality: int, resample: int) -> bytes:
    """``src`` -> the LMDB record of ``--resize max-side``: JPEG bytes with the longer side at most ``size``,
    aspect kept, never upscaled (FFCV's ``max_resolution``). The output size comes from the upright image's
    full size, so a JPEG decoded at a reduced DCT scale gets the same geometry."""
    img, (w, h) = decode.open_rgb_sized(src, size, "pad")  # pad's scale is size / longer side: the same draft
    if max(w, h) > size:
        s = size / max(w, h)
        img = img.resize((max(1, round(w * s)), max(1, round(h * s))), resample, reducing_gap=decode.REDUCING_GAP)
    return decode.encode_jpeg(img, quality)


def _reason(exc: Exception) -> str:
    """Why a file was skipped: a decode error as it says, a file that vanished or cannot be read (the same
    policy as a bad image) by its OS error."""
    if isinstance(exc, OSError):
        return f"{type(exc).__name__}: {exc.strerror or exc}"
    return str(exc)


def _tag(unit: dict[str, Any], fmt: str) -> dict[str, Any]:
    unit["in_partial"] = fmt == "lmdb"  # LMDB parts live in the partial folder, npy shards in OUT itself
    return unit


def _work(task: tuple, slot: Optional[int] = None) -> tuple[list[int], Any, list[tuple[int, str]]]:
    """Worker: decode one chunk. Returns (source indices decoded, their samples, [(index, reason)] failed).

    npy pixels go into the shared slot when there is one (the samples returned are then ``None``).
    """
    root, paths, first, fmt, size, resize, quality, filter_name, blobs = task
    resample = decode.FILTERS[filter_name]
    ok: list[int] = []
    failures: list[tuple[int, str]] = []
    shared = parallel.slot(slot)
    samples: Any = []
    if fmt == "npy":
        samples = _pixel_rows(shared, len(paths), size)
    for j, rel in enumerate(paths):
        try:
            path = open_source(Path(root), rel, blobs, j)
            if fmt == "npy":
                samples[len(ok)] = decode.load_array(path, size, resize, resample)
            elif resize == MAX_SIDE:
                samples.append(max_side_jpeg(path, size, quality, resample))
            else:
                samples.append(decode.load_jpeg(path, size, quality, resample))
        except (ImageDecodeError, OSError) as exc:
            failures.append((first + j, _reason(exc)))
            continue
        ok.append(first + j)
    if fmt == "npy":
        samples = samples[:len(ok)] if shared is None else None
    return ok, samples, failures


def _finish(config: ImagePreprocessConfig, source: Source, jr: journal.Journal, partial: Path,
            params: dict[str, Any], fingerprint: str) -> dict[str, Any]:
    out = config.out
    n = jr.num_samples
    if n == 0:
        first = jr.skipped[0] if jr.skipped else {"path": "?", "reason": "?"}
        raise ImageDecodeError(f"none of the {len(source.paths)} images in {source.location} could be decoded "
                               f"(first: {first['path']}: {first['reason']})")
    fields = sample_fields(config, source)
    version = None
    if config.format == "npy":
        files = [f for u in jr.units for f in u["files"]]
        labels = [np.load(out / image_shards.labels_name(u["index"]), allow_pickle=False) for u in jr.units
                  if source.has_label]
        fmt, extra = IMAGES_NPY, {
            "sample_shape": [config.size, config.size, 3], "dtype": image_shards.IMAGE_DTYPE.str, "layout": "NHWC",
            "shard_size": config.shard_size,
            "shards": [{"images": image_shards.images_name(u["index"]),
                        **({"labels": image_shards.labels_name(u["index"])} if source.has_label else {}),
                        "samples": u["samples"]} for u in jr.units]}  # other fields' files: Field.files
        version = 1  # (image, class) datasets stay version 1, which every fastdata reads
        if fields:  # format version 2 (NOTE [fields] in fastdata/formats/schema.py)
            version = 2
    else:
        files = lmdb_store.build(out, partial, len(jr.units), labels=source.has_label)
        files += [f for u in jr.units for f in u["files"] if f.get("partial") is False]  # the other fields' files
        files = [{k: v for k, v in f.items() if k != "partial"} for f in files]
        labels = [np.load(out / lmdb_store.LABELS_NAME, allow_pickle=False)] if source.has_label else []
        fmt, extra = IMAGES_LMDB, {"lmdb_shards": [{"path": lmdb_store.shard_name(u["index"]), "samples": u["samples"]}
                                                   for u in jr.units], "shard_size": config.shard_size,
                                   "key_format": "%012d", "encoding": "jpeg", "max_short_side": config.size}
        if config.resize == MAX_SIDE:  # the short side is at most S too, so max_short_side stays true
            extra["max_side"] = config.size
        if source.has_label:
            extra["labels"] = lmdb_store.LABELS_NAME
        version = 3 if fields else 2  # version 3: square records with fields (lmdb_store's docstring)
    if fields:
        extra["fields"] = [f.to_json() for f in fields]
        if "tokens" in source.kinds.values():
            extra["tokenizer"] = cached_tokenizer(config.tokenizer).describe()
    all_labels = np.concatenate(labels) if labels else np.zeros(0, LABEL_DTYPE)
    if config.format == "npy" and source.has_label:  # every label in one file too (image_shards' docstring)
        files.append(write_bytes_atomic(out / image_shards.ALL_LABELS_NAME, npy_bytes(all_labels)))
        extra["all_labels"] = image_shards.ALL_LABELS_NAME
    counts = np.bincount(all_labels, minlength=len(source.classes)).tolist()
    manifest = new_manifest(
        fmt, version=version, num_samples=n, classes=source.classes, class_counts=counts, label_dtype=LABEL_DTYPE.str,
        files=files, params=params, fingerprint=fingerprint,
        source={"kind": source.kind, "path": source.where, "num_files": len(source.paths)},
        skipped=[{"path": s["path"], "reason": s["reason"]} for s in jr.skipped], **extra)
    write_manifest(out, manifest)
    journal.remove_partial(out)
    fsync_dir(out)
    return manifest


def summary(manifest: dict[str, Any], limit: int = 10) -> str:
    """The one-paragraph report the CLI prints on stderr (skipped files named)."""
    lines = [f"{manifest['num_samples']} samples in {len(manifest['classes'])} classes -> {manifest['format']}"]
    if "fields" in manifest:
        lines.append("fields: " + ", ".join(f"{f['name']} ({f['kind']})" for f in manifest["fields"]))
    skipped = manifest.get("skipped", [])
    if skipped:
        lines.append(f"skipped {len(skipped)} unreadable file(s) or bad record(s) (all listed in {MANIFEST_NAME}):")
        lines += [f"  {s['path']}: {s['reason']}" for s in skipped[:limit]]
        if len(skipped) > limit:
            lines.append(f"  ... and {len(skipped) - limit} more")
    return "\n".join(lines)
