"""The documents of ``fastdata preprocess text``: which files a source holds, how they are cut into pieces (one
task each: NOTE [text pieces] in text.py), and each part's documents in order.

A ``.txt`` file is one document. A JSON Lines file (``.jsonl``, and ``.json.gz`` / ``.json.zst``: C4's and
Dolma's naming) is one a line, in ``--field``; a ``.parquet`` file one a row, in the column ``--field``.
Text and JSON Lines may be gzipped or zstd-compressed; every file is streamed, locally or through ranged
reads at a URL (NOTE [url source] in fastdata/preprocess/url_reads.py), never held whole. An unusable document
or file is yielded with the reason, for the run's ``--on-error`` policy. A UTF-8 byte order mark opening a file
is dropped.
"""
from __future__ import annotations

import codecs
import contextlib
import gzip
import io
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Union

from .._io import scrub
from ..errors import MissingDependencyError, SourceError
from ..storage.object_store import filesystem, is_url, object_version
from .url_reads import open_binary, store_call, url_listing

# C4 and Dolma name their JSON Lines files .json.gz, so compressed .json is JSON Lines too; plain .json is not
# a source: Hugging Face repos keep dataset_info.json and the like beside the data.
_JSON_LINES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".json.gz", ".json.zst")
TEXT_SUFFIXES = (".txt", ".txt.gz", ".txt.zst", *_JSON_LINES, ".parquet")
# compressed bytes decompressed at a time: the most, then sized so that one step gives about _ZSTD_STEP bytes at
# the ratio the last step had (web text: ~4x, so the most); a degenerate file (one byte repeated: ~30,000x)
# gets small feeds, and the first feed is small, so no step holds more than ~16 MB
_ZSTD_FEED = 1 << 16
_ZSTD_FIRST = 512
_ZSTD_STEP = 4 << 20
_SURROGATE = re.compile("[\ud800-\udfff]")
_PARQUET_BATCH = 4096  # rows a Parquet read hands over at a time: a row group can hold hundreds of MB of text
# a UTF-8 byte order mark (Windows editors, some exports) opens a file, never a document: dropped at byte 0 only,
# so a file's parts (NOTE [text pieces] 3) drop it once, from the part that reads the file's first line
_BOM = codecs.BOM_UTF8


@dataclass(frozen=True)
class TextFile:
    """One input file: where it is (a path or a URL, as text), its name relative to the source, its size, and a
    stamp that changes with its contents (the mtime in ns; at a URL the store's ETag or mtime). Slotted, the
    path as a string: ~400 bytes a file, where a Path and a __dict__ took ~720 (2.6 GB more for OpenWebText's
    8 million files)."""

    __slots__ = ("where", "rel", "size", "stamp")
    where: str
    rel: str
    size: int
    stamp: str

    def __reduce__(self) -> tuple[Any, tuple[str, str, int, str]]:  # (frozen and slotted: rebuilt, not set)
        return TextFile, (self.where, self.rel, self.size, self.stamp)


def text_files(src: Union[Path, str]) -> list[TextFile]:
    """The source's text files in order: ``src`` itself, or the folder's files sorted by path (hidden ones
    skipped), local or at a URL (listed once)."""
    if is_url(src):
        return _url_text_files(str(src))
    src = Path(src)
    if not src.exists():
        raise SourceError(f"source {src} does not exist: pass a .txt/.jsonl file (optionally .gz or .zst), a "
                          ".json.gz/.json.zst file, a .parquet file or a folder of them")
    if src.is_file():
        if not src.name.endswith(TEXT_SUFFIXES):
            raise SourceError(f"source {src} is not one of {TEXT_SUFFIXES}")
        paths, root = [src], src.parent
    else:
        paths, root = sorted(p for p in src.rglob("*") if p.is_file() and p.name.endswith(TEXT_SUFFIXES)
                             and not any(part.startswith(".") for part in p.relative_to(src).parts)), src
    if not paths:
        raise SourceError(f"source folder {src} holds no {', '.join(TEXT_SUFFIXES)} files")
    return [TextFile(str(p), p.relative_to(root).as_posix(), st.st_size, str(st.st_mtime_ns))
            for p, st in ((p, p.stat()) for p in paths)]


def _url_text_files(url: str) -> list[TextFile]:
    if url.endswith(TEXT_SUFFIXES):  # one file: its size and stamp from one metadata request
        fs, path = filesystem(url)
        try:
            info = store_call(url, lambda: fs.info(path))
        except FileNotFoundError:
            raise SourceError(f"source {scrub(url)} does not exist (no such object, or no such bucket): check the "
                              "URL") from None
        return [TextFile(url, url.rsplit("/", 1)[-1], int(info["size"]), object_version(info))]
    base = url.rstrip("/")
    found = sorted((rel.split("/"), info) for rel, info in url_listing(url).items()  # local order: by path parts
                   if info.get("type") != "directory" and rel.endswith(TEXT_SUFFIXES)
                   and not any(part.startswith(".") for part in rel.split("/")))
    if not found:
        raise SourceError(f"source folder {scrub(url)} holds no {', '.join(TEXT_SUFFIXES)} files")
    return [TextFile(f"{base}/{'/'.join(parts)}", "/".join(parts), int(info["size"]), object_version(info))
            for parts, info in found]


@contextlib.contextmanager
def _open(f: TextFile, block: Optional[int] = None) -> Iterator[Any]:
    with open_binary(f.where, f.size, block) as raw:  # a URL streams through ranged reads of ``block`` bytes
        if f.rel.endswith(".gz"):
            yield gzip.GzipFile(fileobj=raw, mode="rb")
        elif f.rel.endswith(".zst"):
            yield io.BufferedReader(_ZstdStream(raw, zstandard_module()))
        else:
            yield raw


def zstandard_module() -> Any:
    """The ``zstandard`` module, imported when a .zst file is read.

    Returns:
        The module.

    Raises:
        MissingDependencyError: zstandard is not installed.
    """
    try:
        import zstandard
    except ImportError as exc:
        raise MissingDependencyError(".zst text files need the zstandard package: pip install 'fastdata[text]'") \
            from exc
    return zstandard


class _ZstdStream(io.RawIOBase):
    """A .zst file's bytes, decompressed at most `_ZSTD_FEED` compressed bytes at a time as they are read. Frames one
    after another (pzstd's output, files joined with cat) are one stream, as ``zstd -d`` reads them. A file
    that ends inside a frame raises EOFError and damaged bytes OSError, as gzip does: zstandard's own
    readers end such a stream without an error, so each frame's end is checked here."""

    def __init__(self, raw: Any, zstd: Any) -> None:
        super().__init__()
        self._raw, self._new, self._error = raw, zstd.ZstdDecompressor().decompressobj, zstd.ZstdError
        self._frame = self._new()
        self._inside = False  # some of the current frame read, its end not yet
        self._out = memoryview(b"")
        self._feed = _ZSTD_FIRST
        self._damaged: Optional[OSError] = None

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        while not self._out:
            if self._damaged is not None:
                raise self._damaged
            data = self._raw.read(self._feed)
            if not data:
                if self._inside:
                    raise EOFError("Compressed file ended before the end-of-stream marker was reached")
                return 0
            self._out = memoryview(self._decompress(data))
            ratio = max(1, len(self._out) // len(data))
            self._feed = max(_ZSTD_FIRST, min(_ZSTD_FEED, _ZSTD_STEP // ratio))
        n = min(len(b), len(self._out))
        b[:n] = self._out[:n]
        self._out = self._out[n:]
        return n

    def _decompress(self, data: bytes) -> bytes:
        out = []
        try:
            while data:
                out.append(self._frame.decompress(data))
                self._inside, data = not self._frame.eof, b""
                if not self._inside:  # the frame ended: what follows it starts the next one
                    data, self._frame = self._frame.unused_data, self._new()
        except self._error as exc:
            if not any(out):
                raise OSError(str(exc)) from None
            self._damaged = OSError(str(exc))  # (raised at the next read: what came before it is read first)
        return b"".join(out)


# SPLITTABLE: files a piece may take a part of (a byte range of plain JSON Lines, a run of Parquet row groups)
SPLITTABLE = (".jsonl", ".parquet")
_PIECE_MIN = 16 << 20  # the least source bytes a piece holds when the source has more (NOTE [text pieces] 2)
_PIECES_AT_LEAST = 64  # pieces a large source is cut into at least, so that many workers share it
_PIECE_FILES = 1024  # files a piece holds at most: a task's description stays small (~150 KB)
_TOKEN_BYTES = 4  # source bytes per token of a piece at most, times the run's tokens per shard
_PART_BLOCK = 1 << 20  # the least bytes a ranged read of a part fetches at a URL
_SKIP_STEP = 1 << 20  # bytes read at a time while skipping to a part's first line


@dataclass(frozen=True)
class Part:
    """Part ``k`` of ``parts`` of one input file, the ``index``-th of the source (the whole file when ``parts``
    is 1): a byte range ``[k * size // parts, (k + 1) * size // parts)`` of plain JSON Lines (the lines that
    start in it), or a run of a Parquet file's row groups."""

    file: TextFile
    index: int
    k: int = 0
    parts: int = 1

    @property
    def span(self) -> tuple[int, int]:
        """The part's byte range ``[a, b)`` of its file."""
        return self.k * self.file.size // self.parts, (self.k + 1) * self.file.size // self.parts

    @property
    def nbytes(self) -> int:
        a, b = self.span
        return b - a


def piece_bytes(total: int, shard_tokens: int) -> int:
    """The most source bytes a piece holds: ``_TOKEN_BYTES * shard_tokens`` (about a shard of BPE tokens), or
    less for a source under 64 of those: a 64th of it, but at least 16 MiB (NOTE [text pieces] 2)."""
    return min(_TOKEN_BYTES * shard_tokens, max(_PIECE_MIN, -(-total // _PIECES_AT_LEAST)))


def plan_pieces(files: list[TextFile], shard_tokens: int) -> Iterator[list[Part]]:
    """The run's pieces, in source order: consecutive files up to `piece_bytes` (and `_PIECE_FILES` files) in
    one, a larger file alone, cut into parts of at most `piece_bytes` where it is plain JSON Lines or Parquet.
    A function of the files and ``shard_tokens`` only, so the output is the same for any workers; made as
    they are needed (a source of 200 TB has ~10^6 pieces).

    Args:
        files: The source's files, in order (`text_files`).
        shard_tokens: The run's tokens per shard.

    Returns:
        An iterator of pieces, each a list of `Part`.
    """
    target = piece_bytes(sum(f.size for f in files), shard_tokens)
    run: list[Part] = []
    held = 0
    for i, f in enumerate(files):
        if f.size > target:
            if run:
                yield run
                run, held = [], 0
            parts = -(-f.size // target) if f.rel.endswith(SPLITTABLE) else 1
            for k in range(parts):
                yield [Part(f, i, k, parts)]
            continue
        if run and (held + f.size > target or len(run) >= _PIECE_FILES):  # (a piece never passes the target)
            yield run
            run, held = [], 0
        run.append(Part(f, i))
        held += f.size
    if run:
        yield run


Doc = tuple[int, int, Optional[str], str]  # key, line, text (None if unusable), reason


class PartDocuments:
    """The documents of one `Part`, in order: ``(key, line, text, reason)``, ``text`` None and ``reason``
    saying why when a document is unusable. ``key`` names the document within its file whatever the pieces:
    a JSON Lines document's byte offset in the (decompressed) file, a Parquet row's index, 0 for a .txt
    file. ``line`` is a JSON Lines line's number counted from the part's first line (from the file's first
    for a whole file), a Parquet row's number from 1 in the file, 0 for a whole-file problem. After the
    iteration, ``lines`` is the part's line count (JSON Lines) and ``documents`` its document count."""

    def __init__(self, part: Part, field: str) -> None:
        self.part, self.field = part, field
        self.lines = self.documents = 0

    def __iter__(self) -> Iterator[Doc]:
        part, rel = self.part, self.part.file.rel
        # a part reads little past its end: at a URL, ranged reads of a 16th of it (at most the usual 8 MiB)
        block = None if part.parts == 1 else max(_PART_BLOCK, part.nbytes // 16)
        try:
            with _open(part.file, block) as f:
                if rel.endswith(".parquet"):
                    docs = _parquet(f, rel, self.field, part.k, part.parts)
                elif rel.endswith(_JSON_LINES):
                    docs = self._jsonl(f)
                else:
                    docs = iter([(0, 0, *_decode_text(f.read()))])
                for doc in docs:
                    self.documents += 1
                    yield doc
        except (OSError, EOFError, gzip.BadGzipFile) as exc:
            if part.k and not self.lines and not self.documents:  # (a file gone or unopenable: said by part 0 alone)
                return
            self.documents += 1
            yield 0, 0, None, f"unreadable ({exc})"
            return
        if not self.documents and part.parts == 1:
            yield 0, 0, None, "empty file"

    def _jsonl(self, f: Any) -> Iterator[Doc]:
        part = self.part
        a, b = part.span
        pos = 0
        if a:  # the lines that start in [a, b): the line under way at a belongs to the part before
            f.seek(a - 1)
            pos = a - 1
            while pos < b:  # (in steps: a line of hundreds of MB is never held to be skipped)
                step = f.readline(_SKIP_STEP)
                pos += len(step)
                if not step or step.endswith(b"\n"):
                    break
        if part.parts == 1:
            b = float("inf")  # (a compressed file's decompressed bytes run past its size)
        while pos < b:
            raw = f.readline()
            if not raw:
                break
            self.lines += 1
            key, pos = pos, pos + len(raw)
            if not key and raw.startswith(_BOM):  # (its key stays 0: train or val as without the mark)
                raw = raw[len(_BOM):]
            if raw.strip():
                yield (key, self.lines, *_json_document(raw, self.field))


def _json_document(raw: bytes, field: str) -> tuple[Optional[str], str]:
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, f"invalid UTF-8 at byte {exc.start}"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        return None, f"invalid JSON ({exc.msg})"
    except (ValueError, RecursionError) as exc:  # an integer of 5,000 digits, arrays nested 10^5 deep
        return None, f"JSON this reader refuses ({type(exc).__name__}: {str(exc)[:80]})"
    if not isinstance(obj, dict) or field not in obj:
        return None, f"missing field {field!r}"
    text = obj[field]
    if not isinstance(text, str):
        return None, f"field {field!r} is not a string"
    if not text:
        return None, "empty document"
    if "\\u" in line and _SURROGATE.search(text):  # (only a JSON escape makes one: UTF-8 cannot)
        return None, "a lone surrogate (\\ud800-\\udfff escape): not Unicode text"
    return text, ""


def _decode_text(data: bytes) -> tuple[Optional[str], str]:
    if data.startswith(_BOM):  # (a .txt file is read whole: its data starts at byte 0)
        data = data[len(_BOM):]
    if not data.strip():
        return None, "empty document"
    try:
        return data.decode("utf-8"), ""
    except UnicodeDecodeError as exc:
        return None, f"invalid UTF-8 at byte {exc.start}"


def _parquet(f: Any, rel: str, field: str, k: int, parts: int) -> Iterator[Doc]:
    """Part ``k`` of ``parts`` of a Parquet file's rows as documents (its share of the row groups), the column
    ``field`` streamed a batch of rows at a time. Whole-file problems (no such column, an unreadable footer,
    no rows) are said by part 0 alone."""
    from .parquet import require_pyarrow

    pq = require_pyarrow()
    try:
        pf = pq.ParquetFile(f)
    except ValueError as exc:  # pyarrow's ArrowInvalid: not a Parquet file (said once, by part 0)
        if k == 0:
            yield 0, 0, None, f"unreadable ({type(exc).__name__}: {exc})"
        return
    if field not in pf.schema_arrow.names:
        if k == 0:
            yield 0, 0, None, f"no column {field!r} (columns: {', '.join(pf.schema_arrow.names)})"
        return
    meta = pf.metadata
    groups = range(k * meta.num_row_groups // parts, (k + 1) * meta.num_row_groups // parts)
    start = sum(meta.row_group(g).num_rows for g in range(groups.start))
    for g in groups:  # (a row group at a time: a damaged one costs its own rows, never its neighbours')
        row = start
        try:
            for batch in pf.iter_batches(batch_size=_PARQUET_BATCH, columns=[field], row_groups=[g]):
                for value in batch.column(0).to_pylist():
                    row += 1
                    if value is None:
                        yield row - 1, row, None, f"missing field {field!r}"
                    elif not isinstance(value, str):
                        yield row - 1, row, None, f"field {field!r} is not a string"
                    elif not value:
                        yield row - 1, row, None, "empty document"
                    else:
                        yield row - 1, row, value, ""
        except (ValueError, OSError) as exc:  # a damaged page (pyarrow's ArrowInvalid, ArrowIOError)
            said = " ".join(str(exc).split())
            end = start + meta.row_group(g).num_rows
            lost = f"rows {row + 1} to {end} lost: {type(exc).__name__}: {said}"
            yield row, row + 1, None, f"unreadable row group {g} ({lost})"
        start += meta.row_group(g).num_rows
