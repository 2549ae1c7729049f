"""Sources made of many files (WebDataset tars, Parquet files) that tasks summarise file by file, so that the
driver of a run holds a count per file, never a row per sample.

NOTE [indexed source]:
1. One task per file (a worker of the local pool, or a Ray task) reads the file and writes its summary into
   OUT's partial area: its sample count and what the driver needs of its records (keys, field kinds and
   lengths, class values; index_schema.py). A tar's task first writes the tar's index beside it (NOTE [tar
   index] in tar_index.py); a Parquet file is its own index (NOTE [parquet source] in parquet.py).
2. The driver keeps each file's sample count and merges the summaries, in file order, into the source's
   schema. Its memory grows with the files and the classes, never with the samples.
3. Shard k still holds source positions ``[k * S, (k + 1) * S)``. The files covering them are found from the
   counts, and whoever decodes the shard (the parent of the local pool, or the Ray task itself) reads only
   their records. The schema is written to the area once and a piece names it by its sha256, so no task
   carries the class list. The output is byte-identical to listing every file up front.
4. The run's fingerprint is the files' names, sizes and versions (etag or mtime) from one listing, so a
   rerun resumes without reading a summarised file again. A file rewritten with the same size and version is
   not noticed by the fingerprint; a piece that finds another sample count in it refuses it.
5. A summary missing or damaged (not JSON, or without what its kind needs) is made again by whoever needs
   it: a summary is a function of its file alone.
"""
from __future__ import annotations

import hashlib
import json
import os
import posixpath
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterable, Optional, Union

import numpy as np

from .._io import HASH_NAME, map_threads, new_hash, scrub, write_bytes_atomic
from ..errors import SourceError
from ..formats.manifest import PARTIAL_DIR
from ..storage.object_store import filesystem, is_url, object_version
from .index_schema import Merge, Schema
from .sources import where_of
from .url_reads import store_call, url_path

_AHEAD = 64  # summaries read ahead on a rerun: a store answers each small read in a round trip
_schemas: dict[str, Schema] = {}  # by sha256: one per run, read once per process


def digest(data: bytes) -> str:
    """The checksum every written file gets (`fastdata._io.HashingWriter`'s)."""
    h = new_hash()
    h.update(data)
    return h.hexdigest()


class Area:
    """Where a run's summaries (and tars' indexes) live: OUT's local partial folder, or the partial prefix of a
    `StoreOut`, in the sub-folder ``folder``. Picklable.

    Args:
        at: The partial folder, or the run's `StoreOut`.
        folder: The sub-folder of this kind of source (``"tar-index"``, ``"parquet-index"``).
    """

    def __init__(self, at: Any, folder: str) -> None:
        self.at, self.folder = at, folder

    def name(self, t: int, what: str) -> str:
        """Where file ``t``'s ``what`` (``"summary"``, ``"index"``) lives in the area."""
        return f"{self.folder}/{t:08d}.{what}.json"

    @property
    def schema_name(self) -> str:
        """Where the run's merged schema lives in the area."""
        return f"{self.folder}/schema.json"

    def write(self, name: str, obj: Any) -> str:
        """Write ``obj`` as compact JSON under ``name``; returns the bytes' sha256."""
        data = json.dumps(obj, separators=(",", ":")).encode()
        if not isinstance(self.at, Path):  # a StoreOut
            self.at.put_bytes(f"{PARTIAL_DIR}/{name}", data)
            return digest(data)
        # a temporary of this writer's own: tasks redoing one damaged file may race to its name
        (self.at / self.folder).mkdir(exist_ok=True)
        mine = self.at / f"{name}.{uuid.uuid4().hex}"
        written = write_bytes_atomic(mine, data)  # hashed as it is written
        os.replace(mine, self.at / name)
        return written[HASH_NAME]

    def read(self, name: str, sha256: Optional[str] = None) -> Any:
        """The object under ``name``; None when it is missing, damaged or (``sha256`` given) not those bytes."""
        if not isinstance(self.at, Path):
            data = self.at.read_bytes(f"{PARTIAL_DIR}/{name}")
        else:
            try:
                data = (self.at / name).read_bytes()
            except FileNotFoundError:
                data = None
        if data is None or (sha256 is not None and digest(data) != sha256):
            return None
        try:
            return json.loads(data)
        except ValueError:
            return None

    def summaries(self) -> set[str]:
        """The names of the summaries written so far (one listing)."""
        if not isinstance(self.at, Path):
            prefix = f"{PARTIAL_DIR}/"
            return {n[len(prefix):] for n in self.at.listing() if n.startswith(f"{prefix}{self.folder}/")
                    and n.endswith(".summary.json")}
        folder = self.at / self.folder
        return {f"{self.folder}/{p.name}" for p in folder.glob("*.summary.json")} if folder.is_dir() else set()


def file_stats(files: list[str]) -> list[tuple[int, str]]:
    """Each file's size and version (an object's etag, a file's mtime): from one listing per folder, or one
    request per file where a folder cannot be listed (an HTTP server) or its listing failed. The requests
    per file ride out an outage under the run's retry budget (NOTE [url source] rule 3); a listing is only
    a shortcut, tried once."""
    if not files or not is_url(files[0]):
        return [(s.st_size, str(s.st_mtime_ns)) for s in map(os.stat, files)]
    fs, _ = filesystem(files[0])
    paths = [filesystem(f)[1] for f in files]
    found: dict[str, dict[str, Any]] = {}
    for folder in sorted({posixpath.dirname(p) for p in paths}):
        try:
            found.update({e["name"]: e for e in fs.ls(folder, detail=True)})
        except Exception:  # noqa: BLE001 - no listing here: asked one file at a time below
            pass
    infos = map_threads(lambda pf: found.get(pf[0]) or store_call(pf[1], lambda: fs.info(pf[0])),
                        list(zip(paths, files)), 16, "fastdata-stat")
    return [(int(e.get("size") or 0), object_version(e)) for e in infos]


def label_of(path: str) -> str:
    """A file as messages name it: a URL without secrets, a local file by its name."""
    return scrub(path) if is_url(path) else Path(path).name


def name_of(path: str) -> str:
    """A file's name as its samples' paths (in the manifest) begin: a local file's name, a URL's last path
    part; never a URL's query (a SAS or CDN token, the same for every file) nor its user info."""
    return posixpath.basename(url_path(path).rstrip("/"))


def load_schema(area: Area, sha256: str) -> Schema:
    """The run's schema, written by the driver once (a piece carries its sha256, not its class list)."""
    if sha256 not in _schemas:
        obj = area.read(area.schema_name, sha256)
        if obj is None:
            raise SourceError("this run's source schema is missing or damaged: rerun the same command")
        _schemas[sha256] = Schema.from_json(obj)
    return _schemas[sha256]


@dataclass(frozen=True)
class FileSource:
    """A source of many files before their summaries exist (NOTE [indexed source]); each kind says how a file
    is summarised (``summarise``: a module-level function, so that it pickles) and loaded (`Indexed.piece`)."""

    location: Union[Path, str]
    root: Path
    files: list[str]
    stats: list[tuple[int, str]]

    kind: ClassVar[str]
    folder: ClassVar[str]  # the area's sub-folder
    noun: ClassVar[str]  # what the progress bar counts
    required: ClassVar[str]  # the digest every complete summary of this kind has: its index's, or its footer's
    summarize: ClassVar[Callable[..., dict[str, Any]]]  # (t, file, area) -> the file's summary
    piece_type: ClassVar[type]  # a `Piece` with the kind's ``load()``
    strict: ClassVar[bool] = False  # records.py's rules for every key (Parquet), or the tars' (index_schema.py)

    @classmethod
    def of(cls, src: Union[str, Path], files: list[str]) -> "FileSource":
        """The files behind ``src`` with their sizes and versions.

        Raises:
            SourceError: The files cannot be listed (one line, secrets scrubbed).
        """
        try:
            stats = file_stats(files)
        except SourceError:  # the store down past the retry budget, or refusing: its own line
            raise
        except Exception as exc:  # noqa: BLE001 - each backend raises its own types for a refused listing
            raise SourceError(f"cannot list {scrub(str(src))}: {type(exc).__name__}: {scrub(str(exc))}") from exc
        location: Union[str, Path] = str(src) if is_url(str(src)) else Path(src)
        root = Path(".") if is_url(str(src)) else Path(files[0]).parent.resolve()
        return cls(location, root, files, stats)

    @property
    def where(self) -> str:
        """The source as the manifest names it."""
        return where_of(self.location)

    def fingerprint(self) -> str:
        """What a resumed run must see again: the files' names, sizes and versions (rule 4)."""
        return hashlib.sha256(json.dumps([self.where, [label_of(f) for f in self.files], self.stats]).encode()
                              ).hexdigest()

    def area(self, at: Any) -> Area:
        """This kind's area in OUT's partial folder or store prefix ``at``."""
        return Area(at, self.folder)

    def index(self, area: Area, run: Callable[[Callable[..., Any], Iterable[Any]], Iterable[Any]]) -> "Indexed":
        """Summarise the files not summarised yet (``run(fn, tasks)``: the run's ordered map) and merge every
        summary.

        Raises:
            SourceError: A file cannot be read, holds no samples, or its records disagree with another's.
        """
        have = area.summaries()
        todo = [(t, f, area) for t, f in enumerate(self.files) if area.name(t, "summary") not in have]
        fresh = iter(run(type(self).summarize, todo))
        listed = {t for t, *_ in todo}
        with ThreadPoolExecutor(16) as ex:
            ahead: deque[tuple[int, Any]] = deque()
            later = (t for t in range(len(self.files)) if t not in listed)

            def summary(t: int) -> dict[str, Any]:
                if t in listed:
                    return next(fresh)
                while len(ahead) < _AHEAD and (u := next(later, None)) is not None:
                    ahead.append((u, ex.submit(area.read, area.name(u, "summary"))))
                u, got = ahead.popleft()
                assert u == t
                s = got.result()  # a damaged summary: that file is summarised again, here
                ok = isinstance(s, dict) and self.required in s
                return s if ok else type(self).summarize((t, self.files[t], area))
            return self.merge(map(summary, range(len(self.files))), area)

    def merge(self, summaries: Iterable[dict[str, Any]], area: Area) -> "Indexed":
        """The source from its files' summaries, in file order (consumed one at a time)."""
        merged = Merge(strict=self.strict)
        for f, summary in zip(self.files, summaries):
            merged.add(label_of(f), summary, summary[self.required])
        starts = np.zeros(len(merged.counts) + 1, np.int64)
        np.cumsum(merged.counts, out=starts[1:])
        if starts[-1] == 0:
            raise SourceError(f"{scrub(str(self.location))} holds no samples")
        schema = merged.schema()
        sha256 = area.write(area.schema_name, schema.to_json())
        _schemas[sha256] = schema
        return Indexed(self, starts, schema, area, merged.digests, sha256)

    def first_fields(self) -> Optional[str]:
        """The fields the first file's first records give, as a message names them (None: none), read from
        the file's head, to refuse arguments that need none before summarising every file."""
        raise NotImplementedError

    def refuse(self, shuffle: bool) -> None:
        """Raise for arguments this kind cannot serve, before any file is read (tars serve every one)."""

    def shuffle(self, indexed: "Indexed", seed: int) -> Any:
        """``indexed`` in `Source.shuffled`'s order: every sample loaded (memory per sample, as a listed
        source): at 10^9 samples, shuffle at load time (``shuffle_window``) instead."""
        return indexed.piece(0, indexed.num_samples).load().shuffled(seed)


@dataclass(frozen=True)
class Indexed:
    """A `FileSource` with its files summarised: counts and a schema, no sample held."""

    source: FileSource
    starts: np.ndarray  # file t holds source positions [starts[t], starts[t + 1])
    schema: Schema
    area: Area
    digests: list[str]  # each file's digest: its index's sha256 (tars), its footer's identity (Parquet)
    schema_sha256: str

    kind = property(lambda self: self.source.kind)
    location = property(lambda self: self.source.location)
    root = property(lambda self: self.source.root)
    where = property(lambda self: self.source.where)
    kinds = property(lambda self: self.schema.kinds)
    classes = property(lambda self: self.schema.classes)
    has_label = property(lambda self: self.schema.has_label)

    @property
    def num_samples(self) -> int:
        """Samples in every file, bad records included (they keep their positions)."""
        return int(self.starts[-1])

    def vector_shape(self, name: str) -> tuple[int, ...]:
        """A ``vector`` field's shape, as `Source.vector_shape`."""
        n = self.schema.vectors[name]
        return (n,) if n >= 0 else ()

    def span(self, a: int, b: int) -> dict[str, Any]:
        """What a piece of source positions ``[a, b)`` carries: its files' numbers in the run, names, first
        positions and digests, and where the run's area and schema are. Small: it grows with the piece."""
        lo = int(np.searchsorted(self.starts, a, side="right")) - 1
        hi = max(lo + 1, int(np.searchsorted(self.starts, b, side="left")))
        return dict(location=self.source.location, root=self.source.root, schema_sha256=self.schema_sha256,
                    area=self.area, a=a, b=b, ordinals=list(range(lo, hi)), files=self.source.files[lo:hi],
                    starts=self.starts[lo:hi + 1].tolist(), digests=self.digests[lo:hi])

    def piece(self, a: int, b: int) -> Any:
        """Source positions ``[a, b)``, to be loaded where they are decoded (``.load()``): only their files
        travel."""
        return self.source.piece_type(**self.span(a, b))

    def shuffled(self, seed: int) -> Any:
        """The source in `Source.shuffled`'s order, where its kind allows one."""
        return self.source.shuffle(self, seed)


@dataclass(frozen=True)
class Piece:
    """Source positions ``[a, b)`` of an `Indexed` source: the files holding them. Picklable and small."""

    location: Union[Path, str]
    root: Path
    schema_sha256: str  # the schema is read from the area: a piece does not carry the class list
    area: Area
    a: int
    b: int
    ordinals: list[int]
    files: list[str]
    starts: list[int]  # file j of the piece holds positions [starts[j], starts[j + 1])
    digests: list[str]

    def ranges(self) -> Iterable[tuple[int, int, str, int, int]]:
        """``(j, t, file, lo, hi)``: rows ``[lo, hi)`` of the piece's file ``j`` (the run's file ``t``)."""
        for j, (t, f) in enumerate(zip(self.ordinals, self.files)):
            first = self.starts[j]
            yield j, t, f, max(self.a, first) - first, min(self.b, self.starts[j + 1]) - first


def with_bad(labels: list[int], extras: dict[str, list[Any]], bad: list[bool]
             ) -> tuple[list[int], dict[str, list[Any]]]:
    """Labels and extras for every sample: the good ones' values, blanks where a bad record sits (its worker
    fails it before reading them)."""
    good = np.cumsum([not b for b in bad]) - 1  # sample i is good sample good[i]
    out_labels = [0 if b else labels[g] for b, g in zip(bad, good)]
    out = {k: [(_blank(col[0]) if col else None) if b else col[g] for b, g in zip(bad, good)]
           for k, col in extras.items()}
    return out_labels, out


def _blank(value: Any) -> Any:
    if isinstance(value, list):
        return [0.0] * len(value) if value and isinstance(value[0], float) else []
    return 0.0 if isinstance(value, float) else ""


def schema_extras(schema: Schema, part: Any, n: int) -> tuple[dict[str, str], dict[str, list[Any]]]:
    """The schema's fields (but ``label``) with the piece's values, blanks for a field its rows lack."""
    kinds = {k: v for k, v in schema.kinds.items() if k != "label"}
    extras = {k: part.extras.get(k, [[] if kind in ("labels", "boxes", "box_labels") else None] * n)
              for k, kind in kinds.items()}
    return kinds, extras
