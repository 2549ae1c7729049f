"""``fastdata preprocess images``: an image folder or CSV list -> uint8 .npy shards or a JPEG LMDB.

Decoding runs in worker processes over chunks of files; results are written in source order, so the
output is byte-identical for any worker count. Completed units (shards / LMDB parts) are journaled, so a
killed run resumes; the manifest is written last.
"""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

from ..imaging import decode_file as decode
from .._io import fsync_dir, write_bytes_atomic
from ..errors import ConfigError, ImageDecodeError, require
from ..formats import image_shards, lmdb_store
from ..formats.base import LABEL_DTYPE, npy_bytes
from ..formats.manifest import IMAGES_LMDB, IMAGES_NPY, MANIFEST_NAME, new_manifest, write_manifest
from ..formats.schema import Field
from ..formats.tokenizer import cached_tokenizer, token_dtype
from . import journal
from . import parallel
from .fields import RecordDecoder, open_source
from .records import discover_any
from .sources import Source

log = logging.getLogger(__name__)

FORMATS = ("npy", "lmdb")
ON_ERROR = ("skip", "fail")
_MAX_CHUNK = 16  # files per worker task: ~3 MB of 256px pixels; small chunks keep the tail short
_CHUNK_BYTES = 8 << 20  # and at most this many bytes of pixels (one shared slot), but at least one image
@dataclass(frozen=True)
class ImagePreprocessConfig:
    """Everything ``fastdata preprocess images`` takes; validated on construction."""

    src: Path
    out: Path
    size: int = 256
    resize: str = "center-crop"
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

    def __post_init__(self) -> None:
        object.__setattr__(self, "src", Path(self.src))
        object.__setattr__(self, "out", Path(self.out))
        require(isinstance(self.size, int) and 8 <= self.size <= 8192, "size", self.size, "an integer in 8..8192")
        require(self.resize in decode.RESIZE_MODES, "resize", self.resize, f"one of {decode.RESIZE_MODES}")
        require(self.format in FORMATS, "format", self.format, f"one of {FORMATS}")
        require(self.workers is None or (isinstance(self.workers, int) and self.workers >= 1), "workers",
               self.workers, "a positive integer")
        require(isinstance(self.shard_size, int) and self.shard_size >= 1, "shard_size", self.shard_size,
               "a positive integer")
        require(self.on_error in ON_ERROR, "on_error", self.on_error, f"one of {ON_ERROR}")
        require(isinstance(self.quality, int) and 1 <= self.quality <= 100, "quality", self.quality, "1..100")
        require(self.filter in decode.FILTERS, "filter", self.filter, f"one of {tuple(decode.FILTERS)}")
        require(self.mask_dtype in ("uint8", "uint16"), "mask_dtype", self.mask_dtype, "'uint8' or 'uint16'")
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
        if self.filter != "lanczos":  # named only when not the default: older runs keep their fingerprint
            params["filter"] = self.filter
        for key, default in (("mask_dtype", "uint8"), ("tokenizer", "bytes"), ("shuffle_seed", None)):
            if getattr(self, key) != default:
                params[key] = getattr(self, key)
        return params


def preprocess_images(config: ImagePreprocessConfig) -> dict[str, Any]:
    """Run (or resume) preprocessing; returns the manifest. Reruns with the same arguments are no-ops."""
    source = discover_any(config.src, config.coco)
    src, out = source.location.resolve(), config.out.resolve()
    if source.kind == "folder" and (out == src or src in out.parents):  # its folder would become a class
        raise ConfigError(f"the output folder {config.out} is inside the source folder {config.src}: the next "
                          "run would read it as a class of its own (and renumber the others); choose an output "
                          "folder outside it")
    if config.shuffle_seed is not None:
        source = source.shuffled(config.shuffle_seed)
    params = config.output_params()
    if source.kinds and config.format == "lmdb":  # images stored square, so the other fields share their geometry
        params["resize"] = config.resize
    fingerprint = hashlib.sha256(json.dumps([params, source.fingerprint()], sort_keys=True).encode()).hexdigest()
    out = config.out
    with journal.exclusive(out):  # NOTE [one writer] in fastdata/preprocess/journal.py
        done = journal.prepare_output(out, fingerprint, config.overwrite)
        if done is not None:
            log.info("%s is already complete with these arguments", out)
            return done
        jr, partial = journal.resume(out, fingerprint)
        if jr.units:
            log.info("resuming after %d complete units (%d samples)", len(jr.units), jr.num_samples)
        _run(config, source, jr, partial)
        return _finish(config, source, jr, partial, params, fingerprint)


def _chunks(start: int, stop: int, workers: int, max_files: int) -> list[tuple[int, int]]:
    size = max(1, min(max_files, -(-(stop - start) // (workers * 8))))
    return [(a, min(a + size, stop)) for a in range(start, stop, size)]


def _run(config: ImagePreprocessConfig, source: Source, jr: journal.Journal, partial: Path) -> None:
    from ..progress import progress_bar

    workers = config.workers or parallel.default_workers()
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
                  config.filter) for a, b in chunks]
    # npy pixels come back through shared memory (one slot per task in flight), JPEG bytes through the pipe
    slot_bytes = max_files * row_bytes if config.format == "npy" else 0
    bar = progress_bar(total=total, initial=start, desc="preprocess", unit="img", enabled=config.progress)
    try:
        for (ok_src, payload, failures), view in parallel.ordered_map(_work_fields if fields else _work, tasks,
                                                                      workers, slot_bytes):
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
    root, paths, first, fmt, size, resize, quality, filter_name = task
    resample = decode.FILTERS[filter_name]
    ok: list[int] = []
    failures: list[tuple[int, str]] = []
    shared = parallel.slot(slot)
    samples: Any = []
    if fmt == "npy":
        samples = _pixel_rows(shared, len(paths), size)
    for j, rel in enumerate(paths):
        path = Path(root) / rel
        try:
            if fmt == "npy":
                samples[len(ok)] = decode.load_array(path, size, resize, resample)
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
        source={"kind": source.kind, "path": str(source.location.resolve()), "num_files": len(source.paths)},
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
