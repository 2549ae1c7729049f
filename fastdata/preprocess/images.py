"""``fastdata preprocess images``: an image folder or CSV list -> uint8 .npy shards or a JPEG LMDB.

Decoding runs in worker processes over chunks of files; results are written in source order, so the
output is byte-identical for any worker count. Completed units (shards / LMDB parts) are journaled, so a
killed run resumes; the manifest is written last.
"""
from __future__ import annotations

import functools
import hashlib
import itertools
import json
import logging
import tempfile
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

import numpy as np

from .._io import scrub
from ..errors import ConfigError, ImageDecodeError, require
from ..formats.base import LABEL_DTYPE
from ..imaging import decode_file as decode
from ..storage.object_store import is_url, output_location
from . import journal, parallel, ray_pool, store_out
from .discover import discover_source
from .image_manifest import Listed, finish, sample_fields
from .image_tasks import MAX_SIDE, Plan, chunk_size, chunks, named, unit_task, work, work_fields
from .sources import Source
from .indexed import Area, FileSource

log = logging.getLogger(__name__)

FORMATS = ("npy", "lmdb")
RESIZE_MODES = (*decode.RESIZE_MODES, MAX_SIDE)
ON_ERROR = ("skip", "fail")
# NOTE [exact lanczos] in fastdata/imaging/lanczos.py: numba's import and the kernel's load cost ~0.35 s
# (~1.8 s the first time it compiles, cached on disk after), repaid from about 500 images at 2 workers
_PREPARE_FROM = 1024
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
            (default), ``"squash"`` or ``"pad"`` (letterboxed with black); LMDB without fields stores each
            image at its aspect, so it refuses the last two.
            LMDB only: ``"max-side"`` keeps the aspect with the longer side at most ``size``, never upscaled
            (FFCV's ``max_resolution``).
        format: ``"npy"`` (uint8 shards, no decoding while training) or ``"lmdb"`` (re-encoded JPEGs, decoded
            while training) (default ``"npy"``).
        workers: Decoding processes (default None: every core this process may use).
        shard_size: Samples per shard (default 1024).
        on_error: ``"skip"`` leaves an undecodable file out and names it in the manifest; ``"fail"`` stops
            (default ``"skip"``).
        quality: LMDB only: the JPEG quality of the stored records, 1..100 (default 90).
        filter: The resize filter: ``"lanczos"`` (default), or the cheaper ``"bicubic"``, ``"bilinear"`` or
            ``"fast-bicubic"`` (Pillow's bicubic kernel run by torch, 2-3x cheaper than Lanczos; its bytes may
            change with the torch version: NOTE [fast bicubic] in fastdata/imaging/decode_file.py)
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
            NOTE [ray byte-identity] in fastdata/preprocess/ray_pool.py); with Ray, ``workers`` is per node of the
            smallest size (`RayPool.open`).
        ray_address: The Ray cluster's ``HOST:PORT`` (default None: the one on this machine, or a new local one).

    Raises:
        ConfigError: A field is out of range; the message names the field and echoes the value.
    """

    src: Union[Path, str]  # a path, or a URL of WebDataset tars
    out: Union[Path, str]  # a folder, or a URL (NOTE [output at a URL] in fastdata/preprocess/store_out.py)
    size: int = 256
    resize: str = "center-crop"  # lmdb: max-side keeps the aspect (longer side <= size); else shorter side <= size
    format: str = "npy"
    workers: Optional[int] = None  # None: every core this process may use
    shard_size: int = 1024
    on_error: str = "skip"
    quality: int = 90
    filter: str = "lanczos"  # resize filter: Lanczos (default), or bicubic/bilinear/fast-bicubic, cheaper (RESULTS.md)
    overwrite: bool = False
    progress: bool = True
    coco: Optional[Path] = None  # COCO instances.json over the image folder SRC (detection)
    mask_dtype: str = "uint8"  # masks: uint8, or uint16 for more than 256 class/instance ids
    tokenizer: str = "bytes"  # for text fields (captions), as `fastdata preprocess text --tokenizer`
    shuffle_seed: Optional[int] = None  # store the samples in a random order from this seed (Source.shuffled)
    engine: str = "local"  # or "ray": the same bytes (NOTE [ray byte-identity] in fastdata/preprocess/ray_pool.py)
    ray_address: Optional[str] = None  # HOST:PORT; None: the cluster on this machine, or a new local one

    def __post_init__(self) -> None:
        for name in ("src", "out"):  # (an unset shell variable: Path("") is the current folder)
            require(str(getattr(self, name)).strip() != "", name, getattr(self, name), "a path or URL")
        object.__setattr__(self, "src", self.src if is_url(self.src) else Path(self.src))  # tars at a URL
        object.__setattr__(self, "out", output_location(self.out))  # a URL: NOTE [output at a URL]
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
        if self.filter == "fast-bicubic":  # torch's kernel: another torch may give other bytes, so a run is
            import torch  # never resumed across an upgrade (NOTE [fast bicubic])

            params["torch"] = torch.__version__
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
    store = store_out.StoreOut(config.out) if isinstance(config.out, str) else None  # NOTE [output at a URL]
    if store is not None:
        store.check_writable()
    else:
        journal.check_writable(config.out)  # before the source is listed
    source = discover_source(config.src, config.coco)
    if store is None and source.kind == "folder":
        src, out = Path(source.location).resolve(), config.out.resolve()
        if out == src or src in out.parents:  # its folder would become a class
            raise ConfigError(f"the output folder {config.out} is inside the source folder {config.src}: the next "
                              "run would read it as a class of its own (and renumber the others); choose an "
                              "output folder outside it")
    params = config.output_params()
    if isinstance(source, FileSource):  # fields are known once the files are summarised: the geometry counts now
        source.refuse(shuffle=config.shuffle_seed is not None)
        fields = source.first_fields() if config.resize == MAX_SIDE else None
        if fields:  # refused before hours of indexing
            raise ConfigError(_MAX_SIDE_FIELDS.format(src=config.src, fields=fields))
        hashed = {**params, "resize": config.resize}
    else:
        source = _ready(config, source)
        params = hashed = _params(config, source)
    fingerprint = _fingerprint(hashed, source)
    # a run stopped by --on-error fail finished its units without a skip: a skip run takes them over
    continues = (_fingerprint({**hashed, "on_error": "fail"}, source),) if config.on_error == "skip" else ()
    if store is not None:
        done = store.prepare(fingerprint, config.overwrite, continues)
        if done is not None:
            log.info("%s is already complete with these arguments", scrub(config.out))
            return done
        jr = store.resume(fingerprint, continues)
        pool = _pool(config, source, store)
        if isinstance(source, FileSource):
            source, params = _indexed(config, source, source.area(store), pool, store.abandon)
        store.drop_old()  # the arguments hold for this source: --overwrite's old dataset goes now
        jr = _aligned(jr, config.shard_size, source.num_samples)
        with tempfile.TemporaryDirectory(prefix="fastdata-out-") as staging:
            _run(config, source, jr, Path(staging), store, pool)
            return finish(config, source, jr, Path(staging), params, fingerprint, store)
    # NOTE [one writer] and NOTE [overwrite] in fastdata/preprocess/journal.py
    with journal.output(config.out, fingerprint, config.overwrite, continues) as target:
        if target.done is not None:
            log.info("%s is already complete with these arguments", config.out)
            return target.done
        config = replace(config, out=target.folder)  # OUT, or the new dataset's folder beside it
        jr, partial = journal.resume(config.out, fingerprint, continues)
        pool = _pool(config, source, config.out)
        if isinstance(source, FileSource):
            source, params = _indexed(config, source, source.area(partial), pool,
                                      functools.partial(journal.remove_partial, config.out))
        kept = len(jr.units)
        if len(_aligned(jr, config.shard_size, source.num_samples).units) < kept:
            jr.save(partial)
        if jr.units:
            log.info("resuming after %d complete units (%d samples)", len(jr.units), jr.num_samples)
        _run(config, source, jr, partial, config.out, pool)
        return finish(config, source, jr, config.out, params, fingerprint, None)


def _ready(config: ImagePreprocessConfig, source: Union[Source, FileSource], area: Optional[Area] = None,
           pool: Optional[ray_pool.RayPool] = None) -> Listed:
    """The source as the run reads it: tars and Parquet files summarised (NOTE [indexed source]), checked
    against the arguments, shuffled as asked."""
    if isinstance(source, FileSource):
        assert area is not None
        source = source.index(area, functools.partial(_index_run, config, pool, source.noun))
    if config.resize == MAX_SIDE and source.kinds:
        raise ConfigError(_MAX_SIDE_FIELDS.format(src=config.src, fields=", ".join(source.kinds)))
    if config.format == "lmdb" and config.resize in ("squash", "pad") and not source.kinds:
        raise ConfigError(_LMDB_SQUARE.format(resize=config.resize, src=config.src))
    return source if config.shuffle_seed is None else source.shuffled(config.shuffle_seed)


def _indexed(config: ImagePreprocessConfig, source: FileSource, area: Area,
             pool: Optional[ray_pool.RayPool], abandon: Callable[[], None]) -> tuple[Listed, dict[str, Any]]:
    """`_ready` for tars and Parquet, once the run's journal exists, and the manifest's params; ``abandon``
    drops that journal when the arguments are refused (no rerun of them could finish it)."""
    try:
        ready = _ready(config, source, area, pool)
    except ConfigError:
        abandon()
        raise
    return ready, _params(config, ready)


def _workers(config: ImagePreprocessConfig, pool: Optional[ray_pool.RayPool]) -> int:
    return pool.workers if pool else config.workers or parallel.default_workers()


def _index_run(config: ImagePreprocessConfig, pool: Optional[ray_pool.RayPool], noun: str, fn: Any,
               tasks: list[tuple]) -> Iterator[Any]:
    """The files' summary tasks on the run's pool, in order, with a progress bar of files summarised."""
    from ..progress import progress_bar

    run = pool.ordered_map if pool else parallel.ordered_map
    shown = config.progress and bool(tasks)
    with progress_bar(total=len(tasks), desc=f"index {noun}s", unit=noun, enabled=shown) as bar:
        for result, _ in run(fn, tasks, _workers(config, pool), 0):
            bar.update(1)
            yield result


_MAX_SIDE_FIELDS = (f"--resize {MAX_SIDE} stores each image at its own aspect, but {{src}} has fields ({{fields}}) "
                    "that need the square geometry: use --resize center-crop, squash or pad")


_LMDB_SQUARE = ("--resize {resize} makes S x S samples, and {src} has no fields, so --format lmdb stores each image "
                "at its own aspect (shorter side S, or longer side S with --resize max-side), cropped when read: "
                "--resize {resize} would change nothing; use --format npy for its squares, or drop --resize")


def _params(config: ImagePreprocessConfig, source: Listed) -> dict[str, Any]:
    """The parameters the manifest records (and the fingerprint hashes, but for tars: see the caller)."""
    params = config.output_params()
    if source.kinds and config.format == "lmdb":  # images stored square, so the fields share their geometry
        params["resize"] = config.resize
    return params


def _fingerprint(params: dict[str, Any], source: Union[Source, FileSource]) -> str:
    return hashlib.sha256(json.dumps([params, source.fingerprint()], sort_keys=True).encode()).hexdigest()


def _pool(config: ImagePreprocessConfig, source: Union[Source, FileSource], out: Any) -> Optional[ray_pool.RayPool]:
    """The Ray pool of a ``--ray`` run (None: the local pool), told the local folders its tasks need."""
    if config.engine != "ray":
        return None
    needs = [] if is_url(str(source.location)) else [str(source.root)]
    needs += [] if isinstance(out, store_out.StoreOut) else [str(out)]
    return ray_pool.RayPool.open(config.ray_address, config.workers, needs)


def _aligned(jr: journal.Journal, size: int, total: int) -> journal.Journal:
    """``jr`` without its units from the first that does not cover source positions ``[k * size, (k + 1) *
    size)`` (a journal of a fastdata that cut units by count: its units are redone)."""
    for n, unit in enumerate(jr.units):
        if unit["index"] != n or unit["source_end"] != min((n + 1) * size, total):
            jr.truncate(n)
            break
    return jr


def _run(config: ImagePreprocessConfig, source: Listed, jr: journal.Journal, partial: Path, out: Any,
         pool: Optional[ray_pool.RayPool]) -> None:
    """Decode the source after the journaled units and write the rest: chunks through the local pool into
    one writer here, or one Ray task per unit that writes and publishes its shard itself (NOTE [ray
    byte-identity]). ``out``: a local folder, or a `StoreOut` (files staged here, then put). Each unit's
    samples are loaded where they are decoded (`Source.piece`; NOTE [indexed source] rule 3)."""
    from ..progress import progress_bar

    workers = _workers(config, pool)
    if config.filter == "fast-bicubic":  # torch resizes (NOTE [fast bicubic]): imported once, forked workers share it
        import torch  # noqa: F401
    fields = sample_fields(config, source)
    plan = Plan(config.format, config.size, config.shard_size, tuple(fields), source.has_label, config.resize,
                config.filter, config.quality, config.mask_dtype, config.tokenizer,
                compiled=source.num_samples - jr.source_end >= _PREPARE_FROM)
    max_files = max(1, min(_MAX_CHUNK, _CHUNK_BYTES // plan.row_bytes)) if config.format == "npy" else _MAX_CHUNK
    start, total, size = jr.source_end, source.num_samples, config.shard_size
    skipped = list(jr.skipped)
    bar = progress_bar(total=total, initial=start, desc="preprocess", unit="img", enabled=config.progress)

    def shards_done() -> str:
        return f"shards {len(jr.units)}/{len(jr.units) + -(-(total - jr.source_end) // size)}"
    bar.set_postfix_str(shards_done(), refresh=False)

    def failed(failures: list[tuple[int, str, str]]) -> None:
        for idx, reason, path in failures:
            if config.on_error == "fail":
                raise ImageDecodeError(f"cannot decode {_named(source, path)}: {reason} (rerun with --on-error skip "
                                       "to leave such files out: it keeps the shards made so far)")
            skipped.append({"index": idx, "path": path, "reason": reason})

    def record(unit: dict[str, Any]) -> None:
        jr.add(unit, skipped, partial)
        bar.set_postfix_str(shards_done())

    units = ((k, a, min(a + size, total)) for k, a in zip(itertools.count(len(jr.units)), range(start, total, size)))
    if pool is not None:
        tasks = ((plan, k, a, b, source.piece(a, b), max_files, out) for k, a, b in units)
        try:
            for unit, failures in pool.ordered_map(unit_task, tasks):
                failed(failures)
                record(unit)
                bar.update(unit["source_end"] - bar.n)
            jr.skipped = skipped
        finally:
            bar.close()
        return
    per = chunk_size(total - start, workers, max_files)
    if plan.compiled:  # forked workers inherit the compiled kernel (NOTE [exact lanczos])
        decode.prepare(config.filter)
    held: deque[tuple[int, int, Source, np.ndarray]] = deque()  # each task's chunk and its unit, in task order

    def tasks() -> Iterator[tuple]:
        for _, u, e in units:
            piece = source.piece(u, e).load()
            labels = np.asarray(piece.labels, LABEL_DTYPE)
            for a, b in chunks(u, e, per):
                held.append((u, b, piece, labels))
                yield from plan.tasks(piece, u, [(a, b)])

    staged = isinstance(out, store_out.StoreOut)  # files written here, then put (NOTE [output at a URL])
    stage = store_out.task_stage(out) if staged else Path(out)
    writer = plan.writer(stage, len(jr.units))
    if staged:  # each unit put on the commit thread, overlapping the next unit's decoding
        writer.on_commit = lambda files: store_out.publish(stage, files, out)
    # npy pixels come back through shared memory (one slot per task in flight), JPEG bytes through the pipe
    slot_bytes = max_files * plan.row_bytes if config.format == "npy" else 0
    fn = work_fields if fields else work
    handled = start  # the source position up to which every failure is in `skipped`
    done: list[dict[str, Any]] = []  # complete units not yet journaled
    try:
        for result, view in parallel.ordered_map(fn, tasks(), workers, slot_bytes):
            u, b, piece, labels = held.popleft()
            done, failures = plan.feed(writer, result, view, labels, u, b)
            failed(named(failures, piece, u))
            handled = b
            while done:
                record(done.pop(0))
            bar.update(b - bar.n)
        done = writer.finish(total)
        while done:
            record(done.pop(0))
        jr.skipped = skipped
    except BaseException:
        # the error says the shards made so far are kept: those the commit thread was writing too, up to the
        # failures handled (a unit past them would be kept without its skipped files listed)
        try:
            for unit in itertools.takewhile(lambda d: d["source_end"] <= handled, [*done, *writer.settle()]):
                record(unit)
        except Exception:  # noqa: BLE001 - (they are made again by the rerun; the run's own error is the one to say)
            log.debug("units left for the rerun to make again", exc_info=True)
        finally:  # (a second Ctrl-C while settling still removes the unit in progress)
            writer.abort()
        raise
    finally:
        bar.close()
        if staged:
            store_out.drop_stage(stage)


def _named(source: Listed, path: str) -> str:
    """A sample's file as a message names it (a URL source's without secrets)."""
    return f"{source.where}/{path}" if is_url(str(source.location)) else str(source.root / path)
