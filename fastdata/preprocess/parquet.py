"""Parquet files as Hugging Face ``datasets`` writes them, as a preprocess source: one sample per row, the image
column's encoded bytes as the image, every other column a field (records.py's rules).

NOTE [parquet source]:
1. A Parquet file is its own index: its footer gives the rows of each row group, and its columns but the
   image are small. One task per file (NOTE [indexed source] in indexed.py) reads those columns and writes
   the file's summary; no index is written beside it.
2. Every column is a field as a key of a JSONL record is (records.py): a value that cannot be stored, a
   column whose kind or length differs between files, or a float column with a null is an error naming the
   file and row. Image columns hold a struct with ``bytes`` (Hugging Face's Image feature) or binary: the
   one named ``image`` (else the first) is the image, and every other one is a mask field of its own name
   (a segmentation map, as ``scene_parse_150`` has), read by the workers with the image. Every file has
   the same image and mask columns. A ``ClassLabel``'s names (``huggingface`` schema metadata) name the ids.
3. A summary records its file's footer identity (a sha256 of the footer's row groups, column chunks and
   statistics). A piece reads its files' footers afresh and refuses one whose identity changed since its
   summary (the file changed under the run: ``--overwrite`` starts again); it reads the other columns of
   the row groups holding its rows (a process keeps the last one read: consecutive shards share it). Its
   workers read the image column a row group at a time (`ParquetBlobs`), from footers of the same identity.
   A row group is read whole, so a summary warns of row groups over `_BIG_GROUP` bytes of images.
4. A sample is named ``FILE.parquet#ROW``, its row in its file, in messages and the manifest's skipped list.
5. ``--shuffle`` is refused: each sample would read its row group again. Shuffle the rows when writing the
   files, or at load time (``shuffle_window``).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import posixpath
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from .._io import scrub
from ..errors import ImageDecodeError, MissingDependencyError, SourceError
from ..formats.schema import valid_name
from ..storage.object_store import is_url
from .index_schema import summarize_records
from .indexed import FileSource, Indexed, Piece, label_of, load_schema, name_of, schema_extras
from .records import from_records
from .sources import Source, holds_image, listed
from .url_reads import UrlReader, parent, url_listing, url_path

log = logging.getLogger(__name__)
RESERVED = ("image", "label", "labels", "boxes", "box_labels")  # fields of their own kinds (formats/schema.py)

Where = Union[Path, str]
_CACHED = 4  # footers a process keeps parsed
_BIG_GROUP = 256 << 20  # image bytes in one row group above which a summary warns (rule 3)
_footers: "OrderedDict[str, tuple[Any, str]]" = OrderedDict()  # file -> (ParquetFile, its identity)
_last_group: dict[str, Any] = {}  # the row group a piece read last: {"key": (file, identity, group), "table": ...}
_owner = os.getpid()  # a forked worker opens its own files (and its own filesystem, for a URL)


def require_pyarrow() -> Any:
    """``pyarrow.parquet``, or the error that names the extra.

    Raises:
        MissingDependencyError: pyarrow is not installed.
    """
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise MissingDependencyError("Parquet sources need pyarrow: pip install 'fastdata[parquet]'") from exc
    return pq


def parquet_files(src: Where) -> list[str]:
    """The ``.parquet`` file ``src``, or the ones at the top of the folder ``src`` (local or a URL), sorted.

    Raises:
        SourceError: ``src`` does not exist.
    """
    if isinstance(src, str) and is_url(src):
        if url_path(src).lower().endswith(".parquet"):  # (a presigned URL's query follows its path)
            return [src]
        base = src.rstrip("/")
        listing = url_listing(src)
        return [f"{base}/{n}" for n in sorted(listing) if "/" not in n and listed(n, ".parquet")
                and listing[n].get("type", "file") == "file"]
    src = Path(src)
    if not src.exists():
        raise SourceError(f"source {src} does not exist: pass a .parquet file or a folder of them")
    if src.is_file():
        return [str(src)]
    return sorted(str(p) for p in src.iterdir() if listed(p.name, ".parquet") and p.is_file())


def is_parquet(src: Path) -> bool:
    """A local ``.parquet`` file or folder (Spark writes a table as a folder ``x.parquet/``), or a folder
    holding ``.parquet`` files (a folder of images beside a subfolder ``x.parquet/`` is a folder of images).

    Raises:
        SourceError: The folder holds ``.parquet`` files and class folders of images (`images_beside`).
    """
    if src.suffix.lower() == ".parquet":
        return True
    files = sorted(p for p in src.iterdir() if listed(p.name, ".parquet") and p.is_file()) if src.is_dir() else []
    if files:
        classes = sorted(c.name for c in src.iterdir() if c.is_dir() and not c.name.startswith("."))
        images_beside(src, str(files[0]), next((c for c in classes if holds_image(src / c)), None))
    return bool(files)


def images_beside(src: Where, first: str, images: Optional[str]) -> None:
    """Refuse a folder holding Parquet files beside class folders of images: both are sources, and reading
    one would drop the other without a word; unless the files' string column ``mask`` names files beside
    them (NOTE [parquet source] rule 2), as those folders may be.

    Args:
        src: The folder (a path or a URL).
        first: Its first Parquet file.
        images: Its first class folder holding an image (None: there is none).

    Raises:
        SourceError: ``images`` is a folder and the files have no ``mask`` column of paths.
    """
    if images is None or _mask_paths(first):
        return
    name = posixpath.basename(url_path(first))
    raise SourceError(f"source {scrub(str(src))} holds .parquet files ({name}) and class folders of images "
                      f"({images}/): pass the Parquet files alone (a .parquet file, or a folder holding only them), "
                      "or move the .parquet files out of the image folder")


def _mask_paths(path: str) -> bool:
    """Whether a Parquet file has a string column ``mask`` (paths of files beside it), from its footer; False
    where it cannot be read (then it is no source of those folders either)."""
    try:
        import pyarrow as pa

        field = _open(path)[0].schema_arrow.field("mask")
    except Exception:  # noqa: BLE001 - no pyarrow, no such column, not a readable Parquet file
        return False
    return pa.types.is_string(field.type) or pa.types.is_large_string(field.type)



def _open(path: str, fresh: bool = False) -> tuple[Any, str]:
    """``(ParquetFile, footer identity)`` on a local file, or on a URL through ranged reads (its footer, then
    the column chunks each read asks for: never the whole file); the last few kept open, unless ``fresh``.

    Raises:
        SourceError: It is not a readable Parquet file.
    """
    global _owner
    if _owner != os.getpid():
        _owner = os.getpid()
        _footers.clear()
        _last_group.clear()
    if path in _footers and not fresh:
        _footers.move_to_end(path)
        return _footers[path]
    pq = require_pyarrow()
    try:
        pf = pq.ParquetFile(UrlReader(path) if is_url(path) else path)
        identity = hashlib.sha256(json.dumps(pf.metadata.to_dict(), sort_keys=True, default=str).encode()).hexdigest()
    except SourceError:
        raise
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for a damaged file
        raise SourceError(f"{label_of(path)} is not a readable Parquet file ({type(exc).__name__}: "
                          f"{scrub(str(exc))})") from exc
    _footers[path] = (pf, identity)
    _footers.move_to_end(path)
    while len(_footers) > _CACHED:
        _footers.popitem(last=False)
    return pf, identity


def _image_columns(schema: Any) -> tuple[Optional[str], list[str]]:
    """The column holding the encoded images, and the other image columns (masks): a struct with ``bytes``
    (Hugging Face's Image feature) or binary. The image is the column named ``image`` where there is one,
    else the first struct (then binary) column."""
    import pyarrow as pa

    types = {n: schema.field(n).type for n in schema.names}
    structs = [n for n, t in types.items() if pa.types.is_struct(t) and t.get_field_index("bytes") >= 0]
    found = structs + [n for n, t in types.items() if pa.types.is_binary(t) or pa.types.is_large_binary(t)]
    if not found:
        return None, []
    image = "image" if "image" in found else found[0]
    return image, [n for n in schema.names if n in found and n != image]


def _class_names(schema: Any, column: str) -> Optional[list[str]]:
    """A ``ClassLabel`` column's names from the ``huggingface`` schema metadata, when there are some."""
    try:
        meta = json.loads((schema.metadata or {}).get(b"huggingface", b"{}"))
        names = meta["info"]["features"][column]["names"]
        return [str(n) for n in names] if isinstance(names, list) else None
    except (KeyError, TypeError, ValueError):
        return None


def _columns(path: str, fresh: bool = True) -> tuple[Any, str, str, list[str], list[str]]:
    """A file's ParquetFile (its footer read afresh, unless not ``fresh``), footer identity, image column,
    mask columns (the other image columns: rule 2) and the other columns.

    Raises:
        SourceError: It is not a readable Parquet file, or has no image column.
    """
    pf, identity = _open(path, fresh)
    column, masks = _image_columns(pf.schema_arrow)
    if column is None:
        raise SourceError(f"{label_of(path)}: no image column (a struct with 'bytes', as Hugging Face's Image "
                          "feature writes, or binary)")
    bad = next((m for m in masks if not valid_name(m)), None)
    if bad:
        raise SourceError(f"{label_of(path)}: cannot store the image column {bad!r} as a mask: a field's name is "
                          "lower-case letters, digits and _")
    taken = next((m for m in masks if m in RESERVED), None)
    if taken:  # (segments/sidewalk-semantic's maps are an Image column 'label')
        raise SourceError(f"{label_of(path)}: the image column {taken!r} would be a mask field, but {taken!r} names "
                          "a class field: rename the column (to 'mask', say) when writing the files")
    return pf, identity, column, masks, [n for n in pf.schema_arrow.names if n != column and n not in masks]


def _rows(pf: Any, key: tuple[str, str, int], others: list[str], lo: int, hi: int) -> list[dict[str, Any]]:
    """Rows ``[lo, hi)`` of row group ``key[2]`` (its columns but the image; nulls left out); the group read
    last is kept, since consecutive shards share one."""
    path, _, g = key
    if _last_group.get("key") != key:
        try:
            _last_group.update(key=None, table=pf.read_row_group(g, columns=others))
        except SourceError:
            raise
        except Exception as exc:  # noqa: BLE001 - a damaged column chunk, or a store refusing the read
            raise SourceError(f"cannot read row group {g} of {label_of(path)} ({type(exc).__name__}: "
                              f"{scrub(str(exc))})") from exc
        _last_group["key"] = key
    rows = _last_group["table"].slice(lo, hi - lo).to_pylist()
    return [{k: v for k, v in rec.items() if v is not None} for rec in rows]


def _chunks(md: Any, g: int, columns: list[str]) -> list[Any]:
    """Row group ``g``'s column chunks of ``columns`` (top-level names: a struct's leaves each count)."""
    rg = md.row_group(g)
    return [ch for ch in map(rg.column, range(rg.num_columns)) if ch.path_in_schema.split(".")[0] in columns]


def _group_bytes(pf: Any, columns: list[str]) -> int:
    """The most compressed bytes of ``columns`` in one row group of ``pf``: what a worker reads for a row
    group's images and masks."""
    md = pf.metadata
    return max((sum(ch.total_compressed_size for ch in _chunks(md, g, columns)) for g in range(md.num_row_groups)),
               default=0)


def summary_task(task: tuple, slot: Optional[int] = None) -> dict[str, Any]:
    """A worker: read one file's footer and its columns but the image, and write its summary (NOTE [parquet
    source] rule 1).

    Args:
        task: ``(t, file, area)``: the file's number in the run, its path or URL, and the run's `Area`
            (its records' paths, masks, are relative to the file's folder).
        slot: Unused (the pool's shared-memory slot).

    Returns:
        The summary written.

    Raises:
        SourceError: The file is not Parquet, has no image column, or its rows break records.py's rules.
    """
    t, path, area = task
    pf, identity, column, masks, others = _columns(path)
    name = name_of(path)
    if _group_bytes(pf, [column, *masks]) > _BIG_GROUP:
        log.warning("%s has row groups of over %d MB of images: each shard's task reads a whole row group; write "
                    "smaller ones (Hugging Face writes 100 rows)", label_of(path), _BIG_GROUP >> 20)
    rows: list[tuple[str, dict[str, Any]]] = []
    for g in range(pf.num_row_groups):
        n = pf.metadata.row_group(g).num_rows
        rows += [(f"{name}#{len(rows) + r}", rec) for r, rec in enumerate(_rows(pf, (path, identity, g), others, 0, n))]
    summary = summarize_records(label_of(path), rows, parent(path), "parquet")  # mask paths: beside the file
    summary["seen"] = summary["numeric"] = sorted(summary["seen"] + masks)
    summary["kinds"] += [[m, "mask"] for m in masks]  # after the other columns' fields, in the file's order
    summary.update(common={"image column": column, "mask columns": masks}, identity=identity,
                   class_names=_class_names(pf.schema_arrow, "label"))
    area.write(area.name(t, "summary"), summary)
    return summary


class ParquetBlobs:
    """Reads sample ``i``'s encoded image bytes from Parquet files, a row group at a time (the last one read
    is kept, so a worker's chunk of consecutive rows reads its row group once). Picklable: workers reopen.

    Args:
        files: The files of the piece.
        identities: Each file's footer identity when its piece was loaded (rule 3).
        column: The image column.
        where: Each sample's ``(file, row group, row in the group)``.
        field_columns: Image columns read with the image as fields (masks: `read_fields`).
    """

    def __init__(self, files: list[str], identities: list[str], column: str, where: list[tuple[int, int, int]],
                 field_columns: Sequence[str] = ()) -> None:
        self.files, self.identities, self.column, self.where = files, identities, column, where
        self.field_columns = list(field_columns)
        self._group: Optional[tuple[int, int, dict[str, list[Any]]]] = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_group": None}

    def chunk(self, a: int, b: int) -> "ParquetBlobs":
        """Samples ``a..b`` only (numbered from 0): what one worker task needs, not every row's place."""
        return ParquetBlobs(self.files, self.identities, self.column, self.where[a:b], self.field_columns)

    def _row(self, i: int) -> tuple[dict[str, list[Any]], int]:
        """Sample ``i``'s row group, its image columns as lists, and its row in it."""
        f, g, row = self.where[i]
        if self._group is None or self._group[:2] != (f, g):
            pf, identity = _open(self.files[f])
            if identity != self.identities[f]:  # a footer this process read before the file changed
                pf, identity = _open(self.files[f], fresh=True)
            if identity != self.identities[f]:
                raise _changed(self.files[f])
            columns = [self.column, *self.field_columns]
            table = pf.read_row_group(g, columns=columns)
            self._group = (f, g, {c: table.column(c).to_pylist() for c in columns})
        return self._group[2], row

    def read(self, i: int) -> bytes:
        """Sample ``i``'s image bytes.

        Raises:
            ImageDecodeError: The row has no image bytes (a bad record).
            SourceError: The file changed since its piece was loaded, or cannot be read.
        """
        group, row = self._row(i)
        data = _bytes(group[self.column][row])
        if not data:
            raise ImageDecodeError(f"row {row} of row group {self.where[i][1]} has no image bytes in column "
                                   f"{self.column!r}")
        return data

    def read_fields(self, i: int) -> dict[str, Optional[bytes]]:
        """Sample ``i``'s mask columns' bytes (None where its row has none), from the row group `read` reads.

        Raises:
            SourceError: The file changed since its piece was loaded, or cannot be read.
        """
        group, row = self._row(i)
        return {c: _bytes(group[c][row]) or None for c in self.field_columns}


def _bytes(value: Any) -> bytes:
    """An image cell's encoded bytes: Hugging Face's ``{"bytes": ..., "path": ...}`` or plain binary."""
    data = value.get("bytes") if isinstance(value, dict) else value
    return bytes(data) if isinstance(data, (bytes, bytearray)) else b""


def _changed(path: str) -> SourceError:
    return SourceError(f"{label_of(path)} changed since this run summarised it: rerun with --overwrite to start "
                       "again from the files as they are now")


@dataclass(frozen=True)
class ParquetPiece(Piece):
    """Source positions ``[a, b)`` of summarised Parquet files: the files holding them, read by `load` where
    the piece is decoded (NOTE [parquet source] rule 3). ``digests`` are the files' footer identities."""

    def load(self) -> Source:
        """The piece as a `Source` of its samples only, as reading every file up front would give them.

        Raises:
            SourceError: A file cannot be read, or changed since the run summarised it.
        """
        s = load_schema(self.area, self.schema_sha256)
        paths: list[str] = []
        where: list[tuple[int, int, int]] = []
        rows: list[tuple[str, dict[str, Any]]] = []
        for j, _, path, lo, hi in self.ranges():
            pf, identity, _, _, others = _columns(path)
            if identity != self.digests[j]:
                raise _changed(path)
            name, first = name_of(path), 0
            for g in range(pf.num_row_groups):
                n = pf.metadata.row_group(g).num_rows
                if first < hi and first + n > lo:
                    a, b = max(lo, first) - first, min(hi, first + n) - first
                    for r, rec in zip(range(a, b), _rows(pf, (path, identity, g), others, a, b)):
                        paths.append(f"{name}#{first + r}")
                        where.append((j, g, r))
                        rows.append((paths[-1], s.record(rec)))
                first += n
        part = from_records(iter(rows), self.location, parent(self.files[0]), "parquet", paths=paths, schema=s)
        kinds, extras = schema_extras(s, part, len(paths))  # a mask column's values: read with the image
        labels = part.labels if s.has_label else [0] * len(paths)
        return Source("parquet", self.location, self.root, paths, labels, s.classes, kinds, extras, s.has_label,
                      ParquetBlobs(self.files, self.digests, s.common["image column"], where,
                                   s.common.get("mask columns", [])))


@dataclass(frozen=True)
class ParquetSource(FileSource):
    """Parquet files before their summaries exist (NOTE [parquet source])."""

    kind = "parquet"
    folder = "parquet-index"
    noun = "file"
    required = "identity"
    summarize = staticmethod(summary_task)
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

    def first_fields(self) -> Optional[str]:
        """The first file's columns that are fields (not the image or label, not null in every row), as a
        message names them: read from its footer only; None when there are none."""
        import pyarrow as pa

        pf, _, _, masks, others = _columns(self.files[0], fresh=False)
        md = pf.metadata
        names = list(masks)
        for name in others:
            if pa.types.is_null(pf.schema_arrow.field(name).type):  # no value in any row
                continue
            stats = [ch.statistics for g in range(md.num_row_groups) for ch in _chunks(md, g, [name])]
            all_null = bool(stats) and all(st is not None and st.has_null_count and st.null_count == st.num_values
                                           for st in stats)
            if name != "label" and not all_null:
                names.append(name)
        return f"the columns {', '.join(names)}" if names else None

    def refuse(self, shuffle: bool) -> None:
        """``--shuffle`` is refused (NOTE [parquet source] rule 5).

        Raises:
            SourceError: ``shuffle`` is asked for.
        """
        if shuffle:
            raise SourceError(f"--shuffle would read {scrub(str(self.location))}'s Parquet row groups once per "
                              "sample: shuffle the rows when writing the Parquet files, or keep their order and use "
                              "a larger shuffle_window")

    def shuffle(self, indexed: Indexed, seed: int) -> Any:
        """Refused (`refuse`): never reached by a run, which refuses ``--shuffle`` first.

        Raises:
            SourceError: Always.
        """
        self.refuse(True)
