"""WebDataset tars listed by tasks, so that the driver of a run holds a count per tar, not a row per sample.

NOTE [tar index]:
1. Listing a tar means streaming it whole, so at 10^9 samples the listing is work for the cluster, not for
   the driver. One task per tar (a worker of the local pool, or a Ray task) streams it (NOTE [tar source]
   in fastdata/preprocess/tars.py) and writes its index into OUT's partial area: each sample's name, its
   image's offset and size or why it is a bad record, and its metadata record. The tar's summary (counts,
   JSON keys, field kinds and lengths, class values) is written after it: a summary means a whole index.
2. The driver keeps the tars' sample counts and merges the summaries into the source's schema
   (tar_schema.py): the numeric JSON keys that every sample has, one kind and length per field, one class
   list. Its memory grows with the tars and the classes, never with the samples.
3. Shard k still holds source positions ``[k * S, (k + 1) * S)``. The tars covering them are found from
   the counts, and whoever decodes the shard (the parent of the local pool, or the Ray task itself) loads
   only their indexes (a process keeps the last few it parsed: a tar spans several shards). The schema is
   written to the area once and a task names it by its sha256, so no task carries the class list. The
   output is byte-identical to listing every tar up front.
4. The run's fingerprint is the tars' names, sizes and versions (etag or mtime) from one listing, so a
   rerun resumes without streaming a finished tar again. A tar rewritten with the same size and version
   is not noticed.
5. ``--shuffle`` needs every sample's place, so the driver then loads every index (memory per sample, as a
   folder source's listing): at 10^9 samples shuffle at load time (``shuffle_window``) instead.
6. A summary records its index's sha256, checked on every load. An index missing, damaged or tampered with
   is listed again from its tar by whoever needs it (an index is a function of its tar alone); a tar whose
   new listing differs has changed under the run: refused, with ``--overwrite`` to start again.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import posixpath
import uuid
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Union

import numpy as np

from .._io import HASH_NAME, new_hash, scrub, write_bytes_atomic
from ..errors import SourceError
from ..formats.manifest import PARTIAL_DIR
from ..storage.remote import filesystem, is_url
from .records import from_records
from .sources import Source, where_of
from .store_out import StoreOut
from .tar_schema import Merge, Schema, summarize
from .tars import IMAGE_EXTS, TarBlobs, Where, members, record

log = logging.getLogger(__name__)

INDEX_DIR = "tar-index"
SCHEMA_NAME = f"{INDEX_DIR}/schema.json"
_CACHED = 4  # parsed indexes a process keeps: a tar spans about ten units of the default size
_indexes: "OrderedDict[str, dict[str, list[Any]]]" = OrderedDict()  # by sha256
_schemas: dict[str, Schema] = {}  # by sha256


def index_name(t: int, what: str) -> str:
    """Where tar ``t``'s ``"index"`` or ``"summary"`` lives in the area."""
    return f"{INDEX_DIR}/{t:08d}.{what}.json"


def _digest(data: bytes) -> str:
    """The checksum every written file gets (`fastdata._io.HashingWriter`'s)."""
    h = new_hash()
    h.update(data)
    return h.hexdigest()


class Area:
    """Where the indexes live: OUT's local partial folder, or the partial prefix of a `StoreOut`. Picklable."""

    def __init__(self, at: Union[Path, StoreOut]) -> None:
        self.at = at

    def write(self, name: str, obj: Any) -> str:
        """Write ``obj`` as compact JSON under ``name``; returns the bytes' sha256."""
        data = json.dumps(obj, separators=(",", ":")).encode()
        if isinstance(self.at, StoreOut):
            self.at.put_bytes(f"{PARTIAL_DIR}/{name}", data)
            return _digest(data)
        # a temporary of this writer's own: tasks listing one damaged tar again may race to its name
        (self.at / INDEX_DIR).mkdir(exist_ok=True)
        mine = self.at / f"{name}.{uuid.uuid4().hex}"
        written = write_bytes_atomic(mine, data)  # hashed as it is written
        os.replace(mine, self.at / name)
        return written[HASH_NAME]

    def read(self, name: str, sha256: Optional[str] = None) -> Any:
        """The object under ``name``; None when it is missing, damaged or (``sha256`` given) not those bytes."""
        if isinstance(self.at, StoreOut):
            data = self.at.read_bytes(f"{PARTIAL_DIR}/{name}")
        else:
            try:
                data = (self.at / name).read_bytes()
            except FileNotFoundError:
                data = None
        if data is None or (sha256 is not None and _digest(data) != sha256):
            return None
        try:
            return json.loads(data)
        except ValueError:
            return None

    def summaries(self) -> set[str]:
        """The names of the summaries written so far (one listing)."""
        if isinstance(self.at, StoreOut):
            prefix = f"{PARTIAL_DIR}/"
            return {n[len(prefix):] for n in self.at.listing() if n.startswith(prefix + INDEX_DIR + "/")
                    and n.endswith(".summary.json")}
        folder = self.at / INDEX_DIR
        return {f"{INDEX_DIR}/{p.name}" for p in folder.glob("*.summary.json")} if folder.is_dir() else set()


def _stats(tars: list[str]) -> list[tuple[int, str]]:
    """Each tar's size and version (an object's etag, a file's mtime): from one listing per folder, or one
    request per tar where a folder cannot be listed (an HTTP server)."""
    if not tars or not is_url(tars[0]):
        return [(s.st_size, str(s.st_mtime_ns)) for s in map(os.stat, tars)]
    fs, _ = filesystem(tars[0])
    paths = [filesystem(t)[1] for t in tars]
    found: dict[str, dict[str, Any]] = {}
    for folder in sorted({posixpath.dirname(p) for p in paths}):
        try:
            found.update({e["name"]: e for e in fs.ls(folder, detail=True)})
        except Exception:  # noqa: BLE001 - no listing here: asked one tar at a time below
            pass
    with ThreadPoolExecutor(16) as ex:
        infos = list(ex.map(lambda p: found.get(p) or fs.info(p), paths))
    out = []
    for e in infos:
        version = e.get("ETag") or e.get("etag") or e.get("LastModified") or e.get("mtime") or ""
        out.append((int(e.get("size") or 0), str(version)))
    return out


@dataclass(frozen=True)
class TarSource:
    """WebDataset tars before their indexes exist: the tars and their listing (NOTE [tar index])."""

    location: Union[Path, str]
    root: Path
    tars: list[str]
    stats: list[tuple[int, str]]
    kind: str = "webdataset"

    @classmethod
    def of(cls, src: Union[str, Path], tars: list[str]) -> "TarSource":
        """The tars behind ``src`` (`tars.tar_files`) with their sizes and versions.

        Raises:
            SourceError: The tars cannot be listed (one line, secrets scrubbed).
        """
        try:
            stats = _stats(tars)
        except Exception as exc:  # noqa: BLE001 - each backend raises its own types for a refused listing
            raise SourceError(f"cannot list {scrub(str(src))}: {type(exc).__name__}: {scrub(str(exc))}") from exc
        location: Union[str, Path] = str(src) if is_url(str(src)) else Path(src)
        root = Path(".") if is_url(str(src)) else Path(tars[0]).parent.resolve()
        return cls(location, root, tars, stats)

    @property
    def where(self) -> str:
        """The source as the manifest names it."""
        return where_of(self.location)

    def fingerprint(self) -> str:
        """What a resumed run must see again: the tars' names, sizes and versions (rule 4)."""
        return hashlib.sha256(json.dumps([self.where, [_label(t) for t in self.tars], self.stats]).encode()
                              ).hexdigest()

    def first_has_fields(self) -> bool:
        """Whether the first sample of the first tar has a record field besides its label (a caption, a
        number): read from the tar's head only, to refuse arguments that need none before listing every tar."""
        for _, group, reason in members(self.tars[0], _label(self.tars[0])):
            try:
                return reason is None and bool(set(record(group)[1]) - {"label"})
            except (ValueError, UnicodeDecodeError):
                return False
        return False

    def index(self, area: Area, run: Callable[[Callable[..., Any], Iterable[Any]], Iterable[Any]]) -> "IndexedTars":
        """Index the tars not indexed yet (``run(fn, tasks)``: the run's ordered map) and merge every summary.

        Raises:
            SourceError: A tar cannot be read, holds no samples, or its records disagree with another's.
        """
        have = area.summaries()
        todo = [(t, tar, area) for t, tar in enumerate(self.tars) if index_name(t, "summary") not in have]
        fresh = iter(run(index_task, todo))
        listed = {t for t, _, _ in todo}
        with ThreadPoolExecutor(16) as ex:  # a store answers each small read in a round trip: 64 at a time
            ahead: deque[tuple[int, Any]] = deque()
            later = (t for t in range(len(self.tars)) if t not in listed)

            def summary(t: int) -> dict[str, Any]:
                if t in listed:
                    return next(fresh)
                while len(ahead) < 64 and (u := next(later, None)) is not None:
                    ahead.append((u, ex.submit(area.read, index_name(u, "summary"))))
                u, got = ahead.popleft()
                assert u == t
                s = got.result()  # a damaged summary: that tar is listed again, here
                return s if s is not None and "index_sha256" in s else index_task((t, self.tars[t], area))
            return IndexedTars.merge(self, map(summary, range(len(self.tars))), area)


def _label(tar: str) -> str:
    return scrub(tar) if is_url(tar) else Path(tar).name


def index_task(task: tuple, slot: Optional[int] = None) -> dict[str, Any]:
    """A worker: stream one tar, write its index and then its summary (NOTE [tar index] rule 1); returns the
    summary, which names the index's sha256."""
    t, tar, area = task
    index = _listing(tar)
    digest = area.write(index_name(t, "index"), index)
    summary = {**summarize(_label(tar), index), "index_sha256": digest}
    area.write(index_name(t, "summary"), summary)
    return summary


def _listing(tar: str) -> dict[str, list[Any]]:
    """One tar's index: each sample's name, its image's ``[offset, size]`` or why it is a bad record, and its
    metadata record (None for a bad one)."""
    label, name = _label(tar), posixpath.basename(tar.rstrip("/"))
    keys: list[str] = []
    where: list[Any] = []
    recs: list[Optional[dict[str, Any]]] = []
    try:
        for key, group, reason in members(tar, label):
            image, rec = next((e for e in group if e in IMAGE_EXTS), None), {}
            if reason is None:
                try:
                    image, rec = record(group)
                except (ValueError, UnicodeDecodeError) as exc:
                    reason = f"{label}: sample {key} has bad metadata ({type(exc).__name__}: {exc})"
            if reason is None and image is None:
                reason = f"{label}: sample {key} has no image member (members: {sorted(group)})"
            keys.append(f"{name}/{key}.{image or 'jpg'}")
            where.append(list(group[image]) if reason is None else reason)
            recs.append(rec if reason is None else None)
    except SourceError:
        raise
    except Exception as exc:  # noqa: BLE001 - a store refusing the read: one line naming it
        raise SourceError(f"cannot read {label}: {type(exc).__name__}: {scrub(str(exc))}") from exc
    return {"paths": keys, "where": where, "records": recs}


def _index(area: Area, t: int, tar: str, digest: str, samples: int) -> dict[str, list[Any]]:
    """Tar ``t``'s index as its summary recorded it (the last few kept parsed: a tar spans several units);
    listed again (and rewritten) when it is missing or damaged, since an index is a function of its tar
    alone (NOTE [tar index] rule 6)."""
    index = _indexes.get(digest)
    if index is None:
        index = area.read(index_name(t, "index"), digest)
    if index is None:
        log.warning("the index of %s is missing or damaged: listing the tar again", _label(tar))
        index = _listing(tar)
        if area.write(index_name(t, "index"), index) != digest:
            raise SourceError(f"{_label(tar)} changed since this run listed it: rerun with --overwrite to start "
                              "again from the tars as they are now")
    if len(index["paths"]) != samples:
        raise SourceError(f"the summary of {_label(tar)} says {samples} samples, its index {len(index['paths'])}: "
                          "this unfinished run was damaged; rerun with --overwrite")
    _indexes[digest] = index
    _indexes.move_to_end(digest)
    while len(_indexes) > _CACHED:
        _indexes.popitem(last=False)
    return index


def _schema(area: Area, digest: str) -> Schema:
    """The run's schema, written by the driver once (a task carries its sha256, not its class list)."""
    if digest not in _schemas:
        obj = area.read(SCHEMA_NAME, digest)
        if obj is None:
            raise SourceError("this run's tar schema is missing or damaged: rerun the same command")
        _schemas[digest] = Schema.from_json(obj)
    return _schemas[digest]


@dataclass(frozen=True)
class IndexedTars:
    """WebDataset tars with their indexes in OUT's partial area: counts and a schema, no sample held."""

    source: TarSource
    starts: np.ndarray  # tar t holds source positions [starts[t], starts[t + 1])
    schema: Schema
    area: Area
    digests: list[str]  # each tar's index's sha256, as its summary recorded it
    schema_sha256: str

    @classmethod
    def merge(cls, source: TarSource, summaries: Iterable[dict[str, Any]], area: Area) -> "IndexedTars":
        """The source from its tars' summaries, in tar order (consumed one at a time)."""
        merged = Merge()
        for tar, summary in zip(source.tars, summaries):
            merged.add(_label(tar), summary)
        starts = np.zeros(len(merged.counts) + 1, np.int64)
        np.cumsum(merged.counts, out=starts[1:])
        if starts[-1] == 0:
            raise SourceError(f"{scrub(str(source.location))} holds no samples")
        schema = merged.schema()
        digest = area.write(SCHEMA_NAME, schema.to_json())
        _schemas[digest] = schema
        return cls(source, starts, schema, area, merged.digests, digest)

    kind = "webdataset"
    location = property(lambda self: self.source.location)
    root = property(lambda self: self.source.root)
    where = property(lambda self: self.source.where)
    kinds = property(lambda self: self.schema.kinds)
    classes = property(lambda self: self.schema.classes)
    has_label = property(lambda self: self.schema.has_label)

    @property
    def num_samples(self) -> int:
        """Samples in every tar, bad records included (they keep their positions)."""
        return int(self.starts[-1])

    def vector_shape(self, name: str) -> tuple[int, ...]:
        """A ``vector`` field's shape, as `Source.vector_shape`."""
        n = self.schema.vectors[name]
        return (n,) if n >= 0 else ()

    def piece(self, a: int, b: int) -> "TarPiece":
        """Source positions ``[a, b)``, to be loaded where they are decoded: only their tars travel."""
        lo = int(np.searchsorted(self.starts, a, side="right")) - 1
        hi = max(lo + 1, int(np.searchsorted(self.starts, b, side="left")))
        return TarPiece(self.source.location, self.source.root, self.schema_sha256, self.area, a, b,
                        list(range(lo, hi)), self.source.tars[lo:hi], self.starts[lo:hi + 1].tolist(),
                        self.digests[lo:hi])

    def shuffled(self, seed: int) -> Source:
        """Every sample loaded, in the order of `Source.shuffled` (NOTE [tar index] rule 5)."""
        return self.piece(0, self.num_samples).load().shuffled(seed)


@dataclass(frozen=True)
class TarPiece:
    """Source positions ``[a, b)`` of `IndexedTars`: the tars holding them (their numbers in the run, names
    and first positions), read by `load` where the piece is decoded. Picklable and small."""

    location: Union[Path, str]
    root: Path
    schema_sha256: str  # the schema is read from the area: a task does not carry the class list
    area: Area
    a: int
    b: int
    ordinals: list[int]
    tars: list[str]
    starts: list[int]  # tar j of the piece holds positions [starts[j], starts[j + 1])
    digests: list[str]

    def load(self) -> Source:
        """The piece as a `Source` of its samples only, as listing every tar would give them."""
        s = _schema(self.area, self.schema_sha256)
        paths: list[str] = []
        where: list[Where] = []
        rows: list[tuple[str, dict[str, Any]]] = []
        for j, (t, tar) in enumerate(zip(self.ordinals, self.tars)):
            lo, hi = max(self.a, self.starts[j]) - self.starts[j], min(self.b, self.starts[j + 1]) - self.starts[j]
            index = _index(self.area, t, tar, self.digests[j], self.starts[j + 1] - self.starts[j])
            label = _label(tar)
            for name, at, rec in zip(index["paths"][lo:hi], index["where"][lo:hi], index["records"][lo:hi]):
                paths.append(name)
                where.append(at if isinstance(at, str) else (j, at[0], at[1]))
                if rec is not None:
                    rows.append((f"{label}: sample {name.split('/', 1)[-1]}", s.record(rec)))
        ok = [p for p, at in zip(paths, where) if not isinstance(at, str)]
        part = from_records(iter(rows), self.location, self.root, "webdataset", paths=ok)
        kinds = {k: v for k, v in s.kinds.items() if k != "label"}
        extras = {k: part.extras.get(k, [[] if kind in ("labels", "boxes", "box_labels") else None] * len(ok))
                  for k, kind in kinds.items()}
        labels, extras = _with_bad(part.labels if s.has_label else [0] * len(ok), extras, where)
        return Source("webdataset", self.location, self.root, paths, labels, s.classes, kinds, extras, s.has_label,
                      TarBlobs(self.tars, where))


def _with_bad(labels: list[int], extras: dict[str, list[Any]], where: list[Where]
              ) -> tuple[list[int], dict[str, list[Any]]]:
    """Labels and extras for every sample: the good ones' values, blanks where a bad record sits (its worker
    fails it before reading them)."""
    good = np.cumsum([not isinstance(w, str) for w in where]) - 1  # sample i is good sample good[i]
    bad = [isinstance(w, str) for w in where]
    out_labels = [0 if b else labels[g] for b, g in zip(bad, good)]
    out = {k: [(_blank(col[0]) if col else None) if b else col[g] for b, g in zip(bad, good)]
           for k, col in extras.items()}
    return out_labels, out


def _blank(value: Any) -> Any:
    if isinstance(value, list):
        return [0.0] * len(value) if value and isinstance(value[0], float) else []
    return 0.0 if isinstance(value, float) else ""
