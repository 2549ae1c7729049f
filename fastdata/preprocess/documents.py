"""The documents of ``fastdata preprocess text``: which files a source holds, and each file's documents in order.

A ``.txt`` file is one document. A JSON Lines file (``.jsonl``, and ``.json.gz`` / ``.json.zst``: C4's and
Dolma's naming) is one a line, in ``--field``; a ``.parquet`` file one a row, in the column ``--field``.
Text and JSON Lines may be gzipped or zstd-compressed; every file is streamed, locally or through ranged
reads at a URL (NOTE [url source] in fastdata/preprocess/sources.py), never held whole. An unusable document
or file is yielded with the reason, for the run's ``--on-error`` policy.
"""
from __future__ import annotations

import contextlib
import gzip
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Union

from .._io import scrub
from ..errors import MissingDependencyError, SourceError
from ..storage.remote import filesystem, is_url
from .sources import open_binary, store_call, url_listing

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
_PARQUET_BATCH = 4096  # rows a Parquet read hands over at a time: a row group can hold hundreds of MB of text


@dataclass(frozen=True)
class TextFile:
    """One input file: where it is (a path or a URL), its name relative to the source, its size, and a stamp
    that changes with its contents (the mtime in ns; at a URL the store's ETag or mtime)."""

    where: Union[Path, str]
    rel: str
    size: int
    stamp: str


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
    return [TextFile(p, p.relative_to(root).as_posix(), st.st_size, str(st.st_mtime_ns))
            for p, st in ((p, p.stat()) for p in paths)]


def _url_text_files(url: str) -> list[TextFile]:
    if url.endswith(TEXT_SUFFIXES):  # one file: its size and stamp from one metadata request
        fs, path = filesystem(url)
        try:
            info = store_call(url, lambda: fs.info(path))
        except FileNotFoundError:
            raise SourceError(f"source {scrub(url)} does not exist (no such object, or no such bucket): check the "
                              "URL") from None
        return [TextFile(url, url.rsplit("/", 1)[-1], int(info["size"]), _stamp(info))]
    base = url.rstrip("/")
    found = sorted((rel.split("/"), info) for rel, info in url_listing(url).items()  # local order: by path parts
                   if info.get("type") != "directory" and rel.endswith(TEXT_SUFFIXES)
                   and not any(part.startswith(".") for part in rel.split("/")))
    if not found:
        raise SourceError(f"source folder {scrub(url)} holds no {', '.join(TEXT_SUFFIXES)} files")
    return [TextFile(f"{base}/{'/'.join(parts)}", "/".join(parts), int(info["size"]), _stamp(info))
            for parts, info in found]


def _stamp(info: dict[str, Any]) -> str:
    """What changes when an object does: its ETag (S3, GCS, Azure), else its modification time."""
    return str(info.get("ETag") or info.get("etag") or info.get("mtime") or info.get("LastModified") or "")


@contextlib.contextmanager
def _open(f: TextFile) -> Iterator[Any]:
    with open_binary(f.where, f.size) as raw:  # a URL streams through ranged reads
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

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        while not self._out:
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
            raise OSError(str(exc)) from None
        return b"".join(out)


Doc = tuple[str, int, Optional[str], str, int]  # file, line, text (None if unusable), reason, raw bytes


def iter_documents(files: list[TextFile], field: str) -> Iterator[Doc]:
    """Yield ``(file, line, text, reason, nbytes)`` for every candidate document in order: ``text`` is None
    and ``reason`` says why when it is unusable. Line is 0 for whole-file (.txt) documents, a Parquet row's
    number from 1 for its rows."""
    for tf in files:
        rel = tf.rel
        try:
            with _open(tf) as f:
                if rel.endswith(".parquet"):
                    yield from _parquet(f, rel, field, tf.size)
                elif rel.endswith(_JSON_LINES):
                    yield from _jsonl(f, rel, field)
                else:
                    data = f.read()
                    yield (rel, 0, *_decode_text(data), len(data))
        except (OSError, EOFError, gzip.BadGzipFile) as exc:
            yield rel, 0, None, f"unreadable ({exc})", 0


def _decode_text(data: bytes) -> tuple[Optional[str], str]:
    if not data.strip():
        return None, "empty document"
    try:
        return data.decode("utf-8"), ""
    except UnicodeDecodeError as exc:
        return None, f"invalid UTF-8 at byte {exc.start}"


def _jsonl(f: Any, rel: str, field: str) -> Iterator[Doc]:
    seen = False
    for lineno, raw in enumerate(f, start=1):
        if not raw.strip():
            continue
        seen = True
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            yield rel, lineno, None, f"invalid UTF-8 at byte {exc.start}", len(raw)
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            yield rel, lineno, None, f"invalid JSON ({exc.msg})", len(raw)
            continue
        if not isinstance(obj, dict) or field not in obj:
            yield rel, lineno, None, f"missing field {field!r}", len(raw)
        elif not isinstance(obj[field], str):
            yield rel, lineno, None, f"field {field!r} is not a string", len(raw)
        elif not obj[field]:
            yield rel, lineno, None, "empty document", len(raw)
        else:
            yield rel, lineno, obj[field], "", len(raw)
    if not seen:
        yield rel, 0, None, "empty file", 0


def _parquet(f: Any, rel: str, field: str, size: int) -> Iterator[Doc]:
    """A Parquet file's rows as documents, the column ``field`` streamed a batch of rows at a time. Each row
    counts its share of the file's bytes, so the progress bar's total is the files' sizes as for text."""
    from .parquet import require_pyarrow

    pq = require_pyarrow()
    try:
        pf = pq.ParquetFile(f)
        if field not in pf.schema_arrow.names:
            yield rel, 0, None, f"no column {field!r} (columns: {', '.join(pf.schema_arrow.names)})", size
            return
        n, row = pf.metadata.num_rows, 0
        for batch in pf.iter_batches(batch_size=_PARQUET_BATCH, columns=[field]):
            for value in batch.column(0).to_pylist():
                share = size * (row + 1) // n - size * row // n
                row += 1
                if value is None:
                    yield rel, row, None, f"missing field {field!r}", share
                elif not isinstance(value, str):
                    yield rel, row, None, f"field {field!r} is not a string", share
                elif not value:
                    yield rel, row, None, "empty document", share
                else:
                    yield rel, row, value, "", share
    except ValueError as exc:  # pyarrow's ArrowInvalid: not a Parquet file, or a damaged page
        yield rel, 0, None, f"unreadable ({type(exc).__name__}: {exc})", 0
        return
    if not row:
        yield rel, 0, None, "empty file", size
