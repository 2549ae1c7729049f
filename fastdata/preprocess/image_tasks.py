"""What a worker runs for ``fastdata preprocess images``: decode and resize one chunk of the source (a process
of the local pool), or one whole unit, decoded, written and published (a Ray task: NOTE [ray byte-identity] in
fastdata/preprocess/ray_pool.py). Nothing here imports torch."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np

from ..errors import ImageDecodeError
from ..formats import image_shards, lmdb_store
from ..formats.base import LABEL_DTYPE
from ..formats.schema import Field
from ..imaging import decode_file as decode
from . import parallel, store_out
from .fields import RecordDecoder, mask_readers, open_source, row_values

MAX_SIDE = "max-side"  # lmdb: the longer side at most S, aspect kept, never upscaled (FFCV's max_resolution)


@dataclass(frozen=True)
class Plan:
    """How a run decodes and writes, for the parent and for Ray tasks (picklable)."""

    format: str
    size: int
    shard_size: int
    fields: tuple[Field, ...]  # every field of the samples; empty for (image, class) sources
    has_label: bool
    resize: str
    filter: str
    quality: int
    mask_dtype: str
    tokenizer: str
    compiled: bool = False  # resize with the compiled Lanczos where it checks out (NOTE [exact lanczos])

    @property
    def row_bytes(self) -> int:
        return self.size * self.size * 3

    def writer(self, folder: Path, first: int) -> Any:
        extra = [f for f in self.fields if f.kind not in ("image", "label")]
        if self.format == "npy":
            return image_shards.NpyShardWriter(folder, self.size, self.shard_size, first, fields=extra,
                                               labels=self.has_label)
        return lmdb_store.LmdbShardWriter(folder, self.shard_size, first, fields=extra, labels=self.has_label)

    def tasks(self, piece: Any, first: int, chunks: list[tuple[int, int]]) -> Iterator[tuple]:
        """The worker tasks of ``chunks`` (source positions) of ``piece`` (a `Source` of the positions from
        ``first`` on); a task pickles its own rows only."""
        for a, b in chunks:
            i, j = a - first, b - first
            blobs = piece.blobs.chunk(i, j) if piece.blobs is not None else None
            if self.fields:
                spec = (piece.kinds, len(piece.classes), self.mask_dtype, self.tokenizer, piece.has_label)
                yield (str(piece.root), piece.paths[i:j], a, self.format, self.size, self.resize, self.filter,
                       {k: v[i:j] for k, v in piece.extras.items()}, piece.labels[i:j], spec, blobs, self.quality)
            else:  # the rows' labels too: a row missing when listed has none of the classes (NOTE [refused records])
                unlisted = len(piece.classes) if self.has_label and piece.classes else None
                yield (str(piece.root), piece.paths[i:j], a, self.format, self.size, self.resize, self.quality,
                       self.filter, blobs, None if unlisted is None else (piece.labels[i:j], unlisted))

    def feed(self, writer: Any, result: tuple, view: Optional[memoryview], labels: np.ndarray, first: int,
             end: int) -> tuple[list[dict[str, Any]], list[tuple[int, str]]]:
        """One chunk's decoded result into ``writer`` (``labels``: the source's, from position ``first``);
        returns the units completed and the chunk's failures."""
        ok_src, payload, failures = result
        values = None
        if self.fields:
            payload, values = payload
        if payload is None:  # the npy pixels are in the shared slot (JPEG bytes come as a list)
            payload = np.frombuffer(view, np.uint8, len(ok_src) * self.row_bytes).reshape(
                len(ok_src), self.size, self.size, 3)
        if values is not None:
            payload = image_shards.Rows(payload, stack_fields(values, list(self.fields)))
        src = np.asarray(ok_src, dtype=np.int64)
        units = writer.append(payload, np.asarray(labels, LABEL_DTYPE)[src - first], src, end)
        return units, failures



def chunk_size(n: int, workers: int, max_files: int) -> int:
    """Files per task for ``n`` files: about 8 tasks per worker, at most ``max_files``."""
    return max(1, min(max_files, -(-n // (workers * 8))))


def chunks(a: int, b: int, per: int) -> list[tuple[int, int]]:
    """``[a, b)`` (one unit's positions) in tasks of ``per`` files: a chunk feeds one unit (formats/base.py)."""
    return [(x, min(x + per, b)) for x in range(a, b, per)]


def named(failures: list[tuple[int, str]], piece: Any, first: int) -> list[tuple[int, str, str]]:
    """Failures with their samples' paths, which the driver of a large source does not hold."""
    return [(i, reason, piece.paths[i - first]) for i, reason in failures]


def unit_task(task: tuple, slot: Optional[int] = None) -> tuple[dict[str, Any], list[tuple[int, str, str]]]:
    """A Ray task: load one unit's samples (source positions ``[a, b)``), decode them, write its shard in a
    staging folder of its own and publish it to OUT (NOTE [ray byte-identity] rule 3). Returns its journal
    record and failures."""
    plan, k, a, b, piece, max_files, out = task
    if plan.compiled:  # a Ray worker process compiles (or loads) the exact Lanczos once: NOTE [exact lanczos]
        decode.prepare(plan.filter)
    piece = piece.load()  # tars' and Parquet's: their records read here (NOTE [indexed source] rule 3)
    labels = np.asarray(piece.labels, LABEL_DTYPE)
    stage = store_out.task_stage(out)
    writer = plan.writer(stage, k)
    fn = work_fields if plan.fields else work
    units: list[dict[str, Any]] = []
    failures: list[tuple[int, str, str]] = []
    try:
        parts = chunks(a, b, chunk_size(b - a, 1, max_files))
        for t, (_, end) in zip(plan.tasks(piece, a, parts), parts):
            done, bad = plan.feed(writer, fn(t), None, labels, a, end)
            units += done
            failures += named(bad, piece, a)
        units += writer.finish(b)
        assert len(units) == 1 and units[0]["index"] == k, units
        store_out.publish(stage, units[0]["files"], out)
    except BaseException:
        writer.abort()
        raise
    finally:
        store_out.drop_stage(stage)
    return units[0], failures


def stack_fields(values: dict[str, list[Any]], fields: list[Field]) -> dict[str, Any]:
    """A chunk's field values as the writer takes them: fixed-size fields stacked, variable ones as lists."""
    out: dict[str, Any] = {}
    for f in fields:
        if f.name in values:
            v = values[f.name]
            out[f.name] = v if f.variable else (np.stack(v) if v else np.zeros((0, *f.shape), f.np_dtype))
    return out



def work_fields(task: tuple, slot: Optional[int] = None) -> tuple[list[int], Any, list[tuple[int, str]]]:
    """Worker: decode one chunk of records with fields (NOTE [record geometry] in fastdata/preprocess/fields.py). Returns
    (source indices decoded, (pixels, None when in the shared slot, or an LMDB's JPEG bytes; {field:
    per-sample values}), failures)."""
    root, paths, first, fmt, size, resize, filter_name, values, labels, spec, blobs, quality = task
    kinds, num_classes, mask_dtype, tokenizer, has_label = spec
    dec = RecordDecoder(root, size, resize, decode.FILTERS[filter_name], kinds, num_classes, mask_dtype, tokenizer)
    shared = parallel.slot(slot)
    pixels = pixel_rows(shared, len(paths), size)
    ok: list[int] = []
    failures: list[tuple[int, str]] = []
    out: dict[str, list[Any]] = {}
    readers = mask_readers(kinds, values)
    for j, rel in enumerate(paths):
        try:
            row = row_values(values, j, readers, blobs)
            got = dec.decode(open_source(Path(root), rel, blobs, j), row, labels[j] if has_label else None,
                             pixels[len(ok)])
        except (ImageDecodeError, OSError) as exc:
            failures.append((first + j, reason_of(exc)))
            continue
        for k, v in got.items():
            out.setdefault(k, []).append(v)
        ok.append(first + j)
    if fmt == "lmdb":  # the record is the decoded square image, encoded once (the same bytes for any chunking)
        return ok, ([decode.encode_jpeg(p, quality) for p in pixels[:len(ok)]], out), failures
    return ok, (pixels[:len(ok)] if shared is None else None, out), failures


def pixel_rows(shared: Optional[memoryview], n: int, size: int) -> np.ndarray:
    """``(n, size, size, 3)`` uint8 rows for a task's pixels: in its shared slot when it has one."""
    shape = (n, size, size, 3)
    return np.empty(shape, np.uint8) if shared is None else np.frombuffer(
        shared, np.uint8, int(np.prod(shape))).reshape(shape)


def reason_of(exc: Exception) -> str:
    """Why a file was skipped: a decode error as it says, a file that vanished or cannot be read (the same
    policy as a bad image) by its OS error."""
    if isinstance(exc, OSError):
        return f"{type(exc).__name__}: {exc.strerror or exc}"
    return str(exc)



def work(task: tuple, slot: Optional[int] = None) -> tuple[list[int], Any, list[tuple[int, str]]]:
    """Worker: decode one chunk. Returns (source indices decoded, their samples, [(index, reason)] failed).

    npy pixels go into the shared slot when there is one (the samples returned are then ``None``).
    """
    root, paths, first, fmt, size, resize, quality, filter_name, blobs, classed = task
    resample = decode.FILTERS[filter_name]
    ok: list[int] = []
    failures: list[tuple[int, str]] = []
    shared = parallel.slot(slot)
    samples: Any = []
    if fmt == "npy":
        samples = pixel_rows(shared, len(paths), size)
    for j, rel in enumerate(paths):
        try:
            path = open_source(Path(root), rel, blobs, j)
            if fmt == "npy":
                samples[len(ok)] = decode.load_array(path, size, resize, resample)
            elif resize == MAX_SIDE:
                samples.append(decode.load_jpeg(path, size, quality, resample, fit=MAX_SIDE))
            else:
                samples.append(decode.load_jpeg(path, size, quality, resample))
        except (ImageDecodeError, OSError) as exc:
            failures.append((first + j, reason_of(exc)))
            continue
        if classed is not None and classed[0][j] >= classed[1]:  # read now, but no file when listed: no class
            if fmt != "npy":
                samples.pop()  # (an npy row is written over by the next)
            failures.append((first + j, "it was no file when the source was listed, so it has no class: re-run "
                                        "`fastdata preprocess` to list it"))
            continue
        ok.append(first + j)
    if fmt == "npy":
        samples = samples[:len(ok)] if shared is None else None
    return ok, samples, failures
