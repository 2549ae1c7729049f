"""Parquet files as Hugging Face ``datasets`` writes them, as a preprocess source: one sample per row, the image
column's encoded bytes as the image, every other column a field (records.py's rules).

NOTE [parquet source]:
1. A Parquet file is its own index: its footer gives the rows of each row group, and its columns but the
   image are small. One task per file (NOTE [indexed source] in indexed.py) reads those columns and writes
   the file's summary; no index is written beside it.
2. Every column is a field as a key of a JSONL record is (records.py): a value that cannot be stored, a
   column whose kind or length differs between files, or a float column with a null is an error naming the
   file and row. Every file has the same image column (a struct with ``bytes``, Hugging Face's Image
   feature, or binary). A ``ClassLabel``'s names, from the ``huggingface`` schema metadata, name the ids.
3. A piece reads its files' footers afresh and the other columns of the row groups holding its rows; its
   workers read the image column a row group at a time (`ParquetBlobs`; a process keeps the last few
   footers). A file whose row count is not its summary's has changed under the run: refused, with
   ``--overwrite`` to start again.
4. A sample is named ``FILE.parquet#ROW``, its row in its file, in messages and the manifest's skipped list.
5. ``--shuffle`` is refused: each sample would read its row group again. Shuffle the rows when writing the
   files, or at load time (``shuffle_window``).
"""
from __future__ import annotations

import os
import posixpath
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

from .._io import scrub
from ..errors import ImageDecodeError, MissingDependencyError, SourceError
from ..storage.remote import is_url
from .index_schema import summarize_records
from .indexed import FileSource, Indexed, Piece, label_of, load_schema, schema_extras
from .records import from_records
from .sources import Source, UrlReader, url_listing

Where = Union[Path, str]
_CACHED = 4  # footers a process keeps parsed
_footers: "OrderedDict[str, Any]" = OrderedDict()  # file -> ParquetFile
_owner = os.getpid()  # a forked worker opens its own files (and its own filesystem, for a URL)


def require_pyarrow() -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise MissingDependencyError("Parquet sources need pyarrow: pip install 'fastdata[parquet]'") from exc
    return pq


def parquet_files(src: Where) -> list[str]:
    """The ``.parquet`` file ``src``, or the ones at the top of the folder ``src`` (local or a URL), sorted."""
    if isinstance(src, str) and is_url(src):
        if src.lower().endswith(".parquet"):
            return [src]
        base = src.rstrip("/")
        return [f"{base}/{n}" for n in sorted(url_listing(src)) if "/" not in n and n.endswith(".parquet")]
    src = Path(src)
    return [str(src)] if src.is_file() else sorted(str(p) for p in src.iterdir() if p.suffix == ".parquet")


def is_parquet(src: Path) -> bool:
    """A local ``.parquet`` file, or a folder holding some."""
    return src.suffix.lower() == ".parquet" or (src.is_dir() and any(p.suffix == ".parquet" for p in src.iterdir()))


def _open(path: str, fresh: bool = False) -> Any:
    """``pyarrow.parquet.ParquetFile`` on a local file, or on a URL through ranged reads (its footer, then the
    column chunks each read asks for: never the whole file); the last few kept open, unless ``fresh``.

    Raises:
        SourceError: It is not a readable Parquet file.
    """
    global _owner
    if _owner != os.getpid():
        _owner = os.getpid()
        _footers.clear()
    if path in _footers and not fresh:
        _footers.move_to_end(path)
        return _footers[path]
    pq = require_pyarrow()
    try:
        pf = pq.ParquetFile(UrlReader(path) if is_url(path) else path)
    except SourceError:
        raise
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for a damaged file
        raise SourceError(f"{label_of(path)} is not a readable Parquet file ({type(exc).__name__}: "
                          f"{scrub(str(exc))})") from exc
    _footers[path] = pf
    _footers.move_to_end(path)
    while len(_footers) > _CACHED:
        _footers.popitem(last=False)
    return pf


def _image_column(schema: Any) -> Optional[str]:
    """The column holding encoded images: a struct with ``bytes`` (Hugging Face's Image feature) or binary."""
    import pyarrow as pa
    for name in schema.names:
        t = schema.field(name).type
        if pa.types.is_struct(t) and t.get_field_index("bytes") >= 0:
            return name
    for name in schema.names:
        if pa.types.is_binary(schema.field(name).type) or pa.types.is_large_binary(schema.field(name).type):
            return name
    return None


def _class_names(schema: Any, column: str) -> Optional[list[str]]:
    """A ``ClassLabel`` column's names from the ``huggingface`` schema metadata, when there are some."""
    import json
    try:
        meta = json.loads((schema.metadata or {}).get(b"huggingface", b"{}"))
        names = meta["info"]["features"][column]["names"]
        return [str(n) for n in names] if isinstance(names, list) else None
    except (KeyError, TypeError, ValueError):
        return None


def _columns(path: str, fresh: bool = True) -> tuple[Any, str, list[str]]:
    """A file's ParquetFile (its footer read afresh, unless not ``fresh``), image column and other columns.

    Raises:
        SourceError: It is not a readable Parquet file, or has no image column.
    """
    pf = _open(path, fresh)
    column = _image_column(pf.schema_arrow)
    if column is None:
        raise SourceError(f"{label_of(path)}: no image column (a struct with 'bytes', as Hugging Face's Image "
                          "feature writes, or binary)")
    return pf, column, [n for n in pf.schema_arrow.names if n != column]


def _rows(pf: Any, path: str, g: int, others: list[str]) -> list[dict[str, Any]]:
    """Row group ``g``'s records (its columns but the image; nulls left out)."""
    try:
        table = pf.read_row_group(g, columns=others)
    except SourceError:
        raise
    except Exception as exc:  # noqa: BLE001 - a damaged column chunk, or a store refusing the read
        raise SourceError(f"cannot read row group {g} of {label_of(path)} ({type(exc).__name__}: "
                          f"{scrub(str(exc))})") from exc
    return [{k: v for k, v in rec.items() if v is not None} for rec in table.to_pylist()]


def summary_task(task: tuple, slot: Optional[int] = None) -> dict[str, Any]:
    """A worker: read one file's footer and its columns but the image, and write its summary (NOTE [parquet
    source] rule 1); returns it."""
    t, path, area, root = task
    pf, column, others = _columns(path)
    name = posixpath.basename(path.rstrip("/"))
    rows: list[tuple[str, dict[str, Any]]] = []
    for g in range(pf.num_row_groups):
        rows += [(f"{name}#{len(rows) + r}", rec) for r, rec in enumerate(_rows(pf, path, g, others))]
    summary = {**summarize_records(label_of(path), rows, root, "parquet"), "common": {"image column": column},
               "class_names": _class_names(pf.schema_arrow, "label")}
    area.write(area.name(t, "summary"), summary)
    return summary


class ParquetBlobs:
    """Reads sample ``i``'s encoded image bytes from Parquet files, a row group at a time (the last one read
    is kept, so a worker's chunk of consecutive rows reads its row group once). Picklable: workers reopen.

    Args:
        files: The files of the piece.
        column: The image column.
        where: Each sample's ``(file, row group, row in the group)``.
    """

    def __init__(self, files: list[str], column: str, where: list[tuple[int, int, int]]) -> None:
        self.files, self.column, self.where = files, column, where
        self._group: Optional[tuple[int, int, Any]] = None

    def __getstate__(self) -> dict[str, Any]:
        return {"files": self.files, "column": self.column, "where": self.where, "_group": None}

    def chunk(self, a: int, b: int) -> "ParquetBlobs":
        """Samples ``a..b`` only (numbered from 0): what one worker task needs, not every row's place."""
        return ParquetBlobs(self.files, self.column, self.where[a:b])

    def read(self, i: int) -> bytes:
        f, g, row = self.where[i]
        if self._group is None or self._group[:2] != (f, g):
            table = _open(self.files[f]).read_row_group(g, columns=[self.column])
            self._group = (f, g, table.column(0).to_pylist())
        value = self._group[2][row]
        data = value.get("bytes") if isinstance(value, dict) else value
        if not isinstance(data, (bytes, bytearray)) or not data:
            raise ImageDecodeError(f"row {row} of row group {g} has no image bytes in column {self.column!r}")
        return bytes(data)


@dataclass(frozen=True)
class ParquetPiece(Piece):
    """Source positions ``[a, b)`` of summarised Parquet files: the files holding them, read by `load` where
    the piece is decoded (NOTE [parquet source] rule 3)."""

    def load(self) -> Source:
        """The piece as a `Source` of its samples only, as reading every file up front would give them.

        Raises:
            SourceError: A file cannot be read, or its row count changed since the run summarised it.
        """
        s = load_schema(self.area, self.schema_sha256)
        paths: list[str] = []
        where: list[tuple[int, int, int]] = []
        rows: list[tuple[str, dict[str, Any]]] = []
        for j, _, path, lo, hi in self.ranges():
            pf, column, others = _columns(path)
            if pf.metadata.num_rows != self.starts[j + 1] - self.starts[j] or column != s.common["image column"]:
                raise SourceError(f"{label_of(path)} changed since this run summarised it: rerun with --overwrite "
                                  "to start again from the files as they are now")
            name, first = posixpath.basename(path.rstrip("/")), 0
            for g in range(pf.num_row_groups):
                n = pf.metadata.row_group(g).num_rows
                if first < hi and first + n > lo:
                    recs = _rows(pf, path, g, others)
                    for r in range(max(lo, first) - first, min(hi, first + n) - first):
                        paths.append(f"{name}#{first + r}")
                        where.append((j, g, r))
                        rows.append((paths[-1], s.record(recs[r])))
                first += n
        part = from_records(iter(rows), self.location, self.root, "parquet", paths=paths)
        kinds, extras = schema_extras(s, part, len(paths))
        labels = part.labels if s.has_label else [0] * len(paths)
        return Source("parquet", self.location, self.root, paths, labels, s.classes, kinds, extras, s.has_label,
                      ParquetBlobs(self.files, s.common["image column"], where))


@dataclass(frozen=True)
class ParquetSource(FileSource):
    """Parquet files before their summaries exist (NOTE [parquet source])."""

    kind = "parquet"
    folder = "parquet-index"
    noun = "file"
    required = "common"
    summarise = staticmethod(summary_task)
    piece_type = ParquetPiece
    strict = True

    @classmethod
    def at(cls, src: Where) -> "ParquetSource":
        """The Parquet files at ``src`` (a file or a folder of them, local or a URL).

        Raises:
            SourceError: ``src`` holds no ``.parquet`` file, or they cannot be listed.
        """
        files = parquet_files(src)
        if not files:
            raise SourceError(f"{scrub(str(src))} holds no .parquet files")
        return cls.of(src, files)

    def first_has_fields(self) -> bool:
        """Whether the first file has a column besides its image and label: read from its footer only."""
        return bool(set(_columns(self.files[0], fresh=False)[2]) - {"label"})

    def refuse(self, shuffle: bool) -> None:
        """``--shuffle`` is refused (NOTE [parquet source] rule 5).

        Raises:
            SourceError: ``shuffle`` is asked for.
        """
        if not shuffle:
            return
        raise SourceError(f"--shuffle would read {scrub(str(self.location))}'s Parquet row groups once per sample: "
                          "shuffle the rows when writing the Parquet files, or keep their order and use a larger "
                          "shuffle_window")

    def shuffle(self, indexed: Indexed, seed: int) -> Any:
        self.refuse(True)
