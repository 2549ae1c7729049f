"""WebDataset tar shards as a preprocess source: a folder of ``*.tar`` files, one ``.tar``, or a brace pattern
(``shards/{00000..00009}.tar``), local or at an fsspec URL (``s3://bucket/laion/{00000..00999}.tar``).

NOTE [tar source]:
1. Samples are the tar members grouped by key, as img2dataset and WebDataset write them: ``dir/KEY.jpg``
   with ``dir/KEY.cls``, ``dir/KEY.txt``, ``dir/KEY.json`` (the key is the name up to the first dot of its
   last part; a sample's members are consecutive). The image is the first ``jpg|jpeg|png|webp|...`` member.
2. ``cls`` is the ``label`` (an id, or a class name), ``txt`` (or a JSON ``caption``) the ``caption`` text
   field, JSON keys holding a number or a list of numbers in every sample ``vector`` fields (the JSONL
   source's rules: preprocess/records.py); other JSON keys (urls, hashes, status) are not stored. A JSON
   ``caption`` that is not one text (token ids, a list of captions as COCO gives five) without a ``txt``
   makes its sample a bad record that says so; ``"caption": null`` is no caption, as a missing key. A JSON
   number a float field cannot hold (NaN, inf, past float32's 3.4e38) makes its sample a bad record only
   where its key is stored (every tar's samples hold a number there), in the worker: img2dataset's metadata
   holds NaN in keys (``pwatermark``) that other samples give as null (NOTE [refused records] rule 4 in
   fastdata/preprocess/fields.py).
3. The order is the tars' sorted names, then member order. Every tar is read once, streamed (``tarfile``
   mode ``r|``, nothing extracted to disk), by a task of its own that writes its index (NOTE [tar index] in
   fastdata/preprocess/tar_index.py); workers then read their samples' image bytes by offset, one ranged
   read per run of consecutive samples.
4. A tar cut short (mid-member or mid-header) makes the sample it cuts a bad record: skipped and listed in
   the manifest, or ``--on-error fail``; the samples before it are kept. So does a member name a sample
   repeats (``tar -r`` appending a sample again): never one sample of two samples' members. A key that comes
   again after other samples makes each of its samples a bad record: never two samples of one key.
5. Listing reads only the ``cls``, ``txt`` and ``json`` members, each up to 16 MiB (past it: a bad record);
   tarfile steps over the others, images included, so memory does not grow with a member's size. A sparse
   image (``tar -S``) is a bad record: its bytes in the archive are not the file's. A hard link (a second
   name of a file, as ``tar -cf`` stores files linked with ``cp -l``) takes the value of the member it
   names, which must come before it in the same tar; else its sample is a bad record naming the link.
"""
from __future__ import annotations

import itertools
import json
import logging
import os
import posixpath
import re
import stat
import tarfile
from pathlib import Path
from typing import Any, Iterator, Optional, Union

from .._io import scrub
from ..errors import ImageDecodeError, SourceError
from ..storage.object_store import filesystem, is_url
from .indexed import label_of
from .sources import IMAGE_EXTENSIONS, fits_float, holds_image, is_id, listed, shown
from .url_reads import UrlReader, open_binary, store_call, url_path

log = logging.getLogger(__name__)
IMAGE_EXTS = tuple(e.lstrip(".") for e in sorted(IMAGE_EXTENSIONS))
_BRACE = re.compile(r"\{([^{}]*)\}")
_GAP = 256 << 10  # samples this close after each other in a tar are read in one request (their .json/.cls between)
_SPAN = 64 << 20  # but no request longer than this
_META = ("cls", "json", "txt")  # the members record() reads: the only ones read whole
_META_MAX = 16 << 20  # a metadata member past this is a bad record (img2dataset writes ~1 KB of .json)
_KEEP = 32 << 20  # metadata bytes a listing keeps for hard links to them (img2dataset: ~1.5 KB a sample, 10^4 a tar)
_LONG_INT = re.compile(rb"\d{309}")  # a JSON integer this long is past a float's range (1.8e308)
Where = Union[tuple[int, int, int], str]  # (tar, offset, size) of a sample's image, or why it is a bad record


def expand_braces(pattern: str) -> list[str]:
    """``a/{00..02}.tar`` -> ``a/00.tar a/01.tar a/02.tar`` (zero-padded to the first bound's width); ``{x,y}``
    lists alternatives; several groups expand in turn."""
    m = _BRACE.search(pattern)
    if m is None:
        return [pattern]
    body = m.group(1)
    rng = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    if rng:
        lo, hi = int(rng.group(1)), int(rng.group(2))
        if hi < lo:
            raise SourceError(f"{scrub(pattern)}: the range {{{body}}} runs backwards")
        items = [str(i).zfill(len(rng.group(1))) for i in range(lo, hi + 1)]
    else:
        items = body.split(",")
    head, tail = pattern[:m.start()], pattern[m.end():]
    return [x for item in items for x in expand_braces(head + item + tail)]


def is_tar_source(src: Union[str, Path]) -> bool:
    """Whether ``src`` names WebDataset tars: a ``.tar`` (or a brace pattern of them), or a folder (local or
    a URL) holding ``*.tar`` files.

    Raises:
        SourceError: A local folder holds ``*.tar`` files and class folders of images (either source), or a
            folder at a URL cannot be listed within the retry budget.
    """
    text = str(src)
    if url_path(text).endswith(".tar"):  # (at a URL, its path: a presigned one's query follows it)
        return True
    if is_url(text):
        if url_path(text).lower().endswith((".jsonl", ".csv", ".parquet")):
            return False  # a records file: no listing needed to tell
        try:  # an outage is ridden out under the retry budget (NOTE [url source] rule 3)
            fs, root = filesystem(text)
            return bool(_url_tars(text, fs, root))
        except SourceError:  # down past the budget, or refused: said once, here
            raise
        except Exception:  # noqa: BLE001 - unreadable: tar_files() says so in one line
            return True
    p = Path(text)
    tars = sorted(c.name for c in p.iterdir() if listed(c.name, ".tar") and c.is_file()) if p.is_dir() else []
    if not tars:
        return False
    # tars never name files beside them (a Parquet file's mask paths do): class folders of images beside
    # them are an image folder too (the archive kept beside the folder extracted from it), and reading
    # either would drop the other without a word
    classes = sorted(c.name for c in p.iterdir() if c.is_dir() and not c.name.startswith("."))
    images = next((c for c in classes if holds_image(p / c)), None)
    if images is not None:
        raise SourceError(f"source {p} holds .tar files ({tars[0]}) and class folders of images ({images}/): pass "
                          f"the tars alone (one .tar, or a brace pattern such as {p / '{00000..00009}.tar'}), or move "
                          "the .tar files out of the image folder")
    return True


def tar_files(src: Union[str, Path]) -> list[str]:
    """The tars behind ``src``, sorted by name: local paths or URLs."""
    text = str(src)
    if _BRACE.search(text):
        names = expand_braces(text)
        if not is_url(text):
            missing = [n for n in names if not Path(n).is_file()]
            if missing:
                raise SourceError(f"{src}: {len(missing)} of the {len(names)} tars do not exist (first: {missing[0]})")
    elif is_url(text) and not url_path(text).endswith(".tar"):
        fs, root = filesystem(text)
        try:
            names = [fs.unstrip_protocol(p) for p in _url_tars(text, fs, root)]
        except SourceError:
            raise
        except Exception as exc:  # noqa: BLE001 - each backend raises its own types for a refused listing
            raise SourceError(f"cannot list {scrub(text)}: {type(exc).__name__}: {scrub(str(exc))}") from exc
    elif Path(text).is_dir():
        names = [str(p) for p in Path(text).iterdir() if listed(p.name, ".tar") and p.is_file()]
    else:
        names = [text]
    if not names:
        raise SourceError(f"{scrub(text)} holds no .tar files")
    return sorted(names)


def _url_tars(url: str, fs: Any, root: str) -> list[str]:
    """The ``*.tar`` objects of the folder ``url`` (fsspec paths); a folder named ``x.tar/`` is not one."""
    listing = store_call(url, lambda: fs.ls(root, detail=True), "list")
    return [e["name"] for e in listing
            if listed(posixpath.basename(e["name"]), ".tar") and e.get("type") != "directory"]



def _split(name: str) -> tuple[str, str]:
    """``dir/KEY.seg.png`` -> ``("dir/KEY", "seg.png")``."""
    folder, base = posixpath.split(name)
    stem, _, ext = base.partition(".")
    return posixpath.join(folder, stem), ext.lower()


def members(tar: str, label: str) -> Iterator[tuple[str, dict[str, Any], Optional[str]]]:
    """Yield ``(key, group, reason or None)`` per sample of one tar, streamed (NOTE [tar source] rule 5).

    Args:
        tar: A local path or a URL.
        label: How messages name the tar.

    Yields:
        The sample's key; its members by extension: ``(offset, size)`` for an image, the bytes of a ``cls``,
        ``txt`` or ``json``, None for any other; and why the sample is a bad record, or None. A cut-short
        tar ends with its cut sample and the reason.

    Raises:
        SourceError: The tar cannot be opened, or its first member is not a tar header.
    """
    key, group, twice = None, {}, None
    try:
        f = open_binary(tar)  # (at a URL, ranged reads under the retry budget: NOTE [url source] rule 3)
    except SourceError:
        raise
    except Exception as exc:  # noqa: BLE001 - each backend raises its own types for a refused read
        raise SourceError(f"cannot read {label}: {type(exc).__name__}: {scrub(str(exc))}") from exc
    seen, kept = _Seen(f), _Kept()
    try:
        with f, tarfile.open(fileobj=seen, mode="r|") as t:
            for m in t:
                if not (m.isfile() or m.islnk()) or posixpath.basename(m.name).startswith("."):
                    seen.within(m, t.offset)
                    continue
                k, ext = _split(m.name)
                if k != key and key is not None:
                    yield key, group, twice or _flaw(group)
                    group, twice = {}, None
                if k == key and ext in group and twice is None:  # (`tar -r` appended a sample again): not merged
                    twice = f"{label}: sample {key} has two .{ext} members (a sample's members are named once)"
                key = k
                group[ext] = None  # named even if its data is cut short: the listing names the cut member
                seen.within(m, t.offset)
                group[ext] = value = kept.value(m, ext, t)
                if isinstance(value, str):
                    group[ext] = f"{label}: sample {key}'s .{ext} {value}"
            # tarfile ends quietly at a header cut short or missing: only a zero block is the archive's end
            if seen.block(t.offset) != bytes(tarfile.BLOCKSIZE):
                raise tarfile.ReadError("the archive ends without its end-of-archive block")
    except (tarfile.ReadError, EOFError) as exc:  # the tar's own damage (a read error stops the run instead)
        if key is None and not group:
            raise SourceError(f"cannot read {label} as a tar file ({type(exc).__name__}: {scrub(str(exc))}): "
                              "pass WebDataset .tar shards") from exc
        yield key, group, f"{label} is cut short in sample {key} ({type(exc).__name__}: {scrub(str(exc))})"
        return
    if key is not None:
        yield key, group, twice or _flaw(group)


def _flaw(group: dict[str, Any]) -> Optional[str]:
    """Why a sample's own members make it a bad record (its first image, or a metadata member), or None."""
    image = next((e for e in group if e in IMAGE_EXTS), None)
    return next((group[e] for e in (image, *_META) if isinstance(group.get(e), str)), None)


class _Kept:
    """Reads one tar's members for its listing, and keeps their values for the hard links after them.

    A member's value is ``(offset, size)`` for an image, bytes for metadata, None for any other member, or
    why it cannot be used (a phrase that follows "sample KEY's .EXT"). Only metadata is read: tarfile steps
    over the rest of the stream, holding a record (10 KB) at a time.
    """

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}  # image and metadata members' values, by name
        self.held = 0  # bytes of metadata in self.values

    def value(self, m: tarfile.TarInfo, ext: str, t: tarfile.TarFile) -> Any:
        """Member ``m``'s value, read from ``t`` if it is metadata, or its hard link target's."""
        if ext not in IMAGE_EXTS and ext not in _META:
            return None
        value = self._link(m, ext) if m.islnk() else self._read(m, ext, t)
        name = posixpath.normpath(m.name)
        if isinstance(value, bytes) and self.held + len(value) > _KEEP:
            self.values[name] = f"is past the first {_KEEP >> 20} MiB of metadata a listing keeps for hard " \
                                "links: repack the tar with tar --hard-dereference"
        else:
            self.held += len(value) if isinstance(value, bytes) else 0
            self.values[name] = value
        return value

    def _read(self, m: tarfile.TarInfo, ext: str, t: tarfile.TarFile) -> Any:
        """A file member's value: an image is read later by offset (TarBlobs), metadata here."""
        if ext in IMAGE_EXTS:
            if m.issparse():  # its bytes in the archive are the file less its holes: not the image TarBlobs reads
                return "is stored sparse (tar -S): repack the tar without -S"
            return m.offset_data, m.size
        if m.size > _META_MAX:
            return f"is {m.size} bytes, past the {_META_MAX >> 20} MiB a metadata member may hold: repack the tar " \
                   "without it"
        data = t.extractfile(m).read()
        if len(data) != m.size:
            raise tarfile.ReadError("unexpected end of data")
        return data

    def _link(self, m: tarfile.TarInfo, ext: str) -> Any:
        """The value of the member a hard link names: one listed before it (tar stores a file's first name as
        the file, its later names as links to it)."""
        image = ext in IMAGE_EXTS
        value = self.values.get(posixpath.normpath(m.linkname))
        if isinstance(value, tuple if image else bytes):
            return value
        if isinstance(value, str):  # the target's own flaw
            return f"is a hard link to {m.linkname!r}, which {value}"
        return f"is a hard link to {m.linkname!r}, which is no {'image' if image else 'metadata'} member before " \
               "it in this tar: repack the tar with tar --hard-dereference"


class _Seen:
    """A stream reader that remembers how many bytes went by and the last of them: to see how a tar ends; and
    the stream's size, to refuse a member that runs past it."""

    def __init__(self, f: Any) -> None:
        self.f, self.n, self.prev, self.last = f, 0, b"", b""
        self.total = _size(f)

    def within(self, m: tarfile.TarInfo, end: int) -> None:
        """Raise ReadError where member ``m``'s data (up to ``end``, where tarfile reads the next header) is
        not in the stream: tarfile's stream mode steps over a member by reading 10 KB at a time to its end,
        so a size field of 2^62 (base-256) would keep it reading for ever after the stream ended, and a
        negative one would fail the whole tar (seeking backwards)."""
        if end < m.offset_data or self.total is not None and end > self.total:
            raise tarfile.ReadError(f"a member claims {m.size} bytes, which the archive does not hold")

    def read(self, size: int = -1) -> bytes:
        data = self.f.read(size)
        if data:  # the last two pieces read cover the last 512-byte block tarfile asked for
            self.n += len(data)
            self.prev, self.last = self.last, data
        return data

    def block(self, offset: int) -> bytes:
        """The bytes of the stream's 512-byte block at ``offset`` (fewer where it ended), if still held."""
        held = self.prev + self.last
        start = offset - (self.n - len(held))
        return held[start:start + tarfile.BLOCKSIZE] if start >= 0 else b""


def _size(f: Any) -> Optional[int]:
    """The size of a stream `open_binary` opened: a URL's from its listing or a metadata request, a regular
    file's from its inode; None for a pipe or a device (no end known before it ends)."""
    raw = getattr(f, "raw", f)
    if isinstance(raw, UrlReader):
        return raw.size
    info = os.fstat(f.fileno())
    return info.st_size if stat.S_ISREG(info.st_mode) else None


def record(group: dict[str, Any]) -> tuple[Optional[str], dict[str, Any]]:
    """A sample's image extension and its record (NOTE [tar source] rule 2); raises ValueError for bad metadata
    (not JSON, a number of over 4300 digits or past a float's range, nesting deeper than the parser's stack, a
    JSON caption that is not one text where no .txt gives the text)."""
    image = next((e for e in group if e in IMAGE_EXTS), None)
    rec: dict[str, Any] = {}
    if "json" in group:
        try:
            meta = json.loads(group["json"].decode("utf-8"))
        except RecursionError:
            raise ValueError(".json nests deeper than a JSON parser reads") from None
        if not isinstance(meta, dict):
            raise ValueError(f".json holds {type(meta).__name__}, not an object")
        for k, v in meta.items():
            numeric = isinstance(v, (int, float)) and not isinstance(v, bool) or (
                isinstance(v, list) and v and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v))
            if k == "caption" and v is not None and not isinstance(v, str) and "txt" not in group:
                raise ValueError(_not_one_text(v, numeric))  # (the key of the text field: never a vector)
            if k in ("label", "labels", "boxes", "box_labels") or (k == "caption" and isinstance(v, str)) or numeric:
                rec[k] = v
        if _LONG_INT.search(group["json"]):  # rare: only then look for a number no float field can hold
            _floats(rec)
    if "cls" in group:
        text = group["cls"].decode("utf-8-sig").strip()  # a BOM, as Windows editors write, is no part of the id
        rec["label"] = int(text) if is_id(text) else text
    if "txt" in group:
        rec["caption"] = group["txt"].decode("utf-8")
    return image, rec


def _not_one_text(v: Any, numeric: bool) -> str:
    """Why a JSON caption ``v`` (not text, not null) makes its sample a bad record, and what to do."""
    if numeric:
        return f"'caption' holds {shown(v)}: a caption is text (a .txt member, or a JSON string); store numbers " \
               "under another key"
    if isinstance(v, list) and v and all(isinstance(x, str) for x in v):  # COCO's five captions an image
        return f"'caption' holds {len(v)} texts {shown(v)}: a caption is one text: keep one as 'caption' and store " \
               "the others under another key, or give the caption as a .txt member"
    return f"'caption' holds {shown(v)}: a caption is one text (a .txt member, or a JSON string)"


def _floats(rec: dict[str, Any]) -> None:
    """Raise ValueError for a record's number (or list of them) past a float's range: a vector field's values."""
    for k, v in rec.items():
        if k not in ("label", "labels", "boxes", "box_labels", "caption") and not fits_float(v):
            raise ValueError(f"{k!r} is {shown(v)}, past a float's range (1.8e308)")


class TarBlobs:
    """Reads sample ``i``'s image bytes from its tar by offset (NOTE [tar source] rule 3); a bad record's
    read raises `ImageDecodeError` with its reason. Picklable: workers reopen the tars."""

    def __init__(self, tars: list[str], where: list[Where]) -> None:
        self.tars, self.where = tars, where
        self._buf: Optional[tuple[int, int, bytes]] = None  # (tar, offset, bytes) of the last ranged read

    def __getstate__(self) -> dict[str, Any]:
        return {"tars": self.tars, "where": self.where, "_buf": None}

    def chunk(self, a: int, b: int) -> "TarBlobs":
        """Samples ``a..b`` only: what one worker task needs."""
        return TarBlobs(self.tars, self.where[a:b])

    def permuted(self, perm: list[int]) -> "TarBlobs":
        """The same samples in the order ``perm`` (``--shuffle``): sample ``i`` is this one's ``perm[i]``."""
        return TarBlobs(self.tars, [self.where[i] for i in perm])

    def read(self, i: int) -> bytes:
        w = self.where[i]
        if isinstance(w, str):
            raise ImageDecodeError(w)
        t, off, size = w
        buf = self._buf
        if buf is None or buf[0] != t or off < buf[1] or off + size > buf[1] + len(buf[2]):
            end = off + size
            for nxt in itertools.islice(self.where, i + 1, None):
                if (isinstance(nxt, str) or nxt[0] != t or not 0 <= nxt[1] - end <= _GAP
                        or nxt[1] + nxt[2] - off > _SPAN):
                    break
                end = nxt[1] + nxt[2]
            buf = self._buf = (t, off, self._read(t, off, end))
        piece = buf[2][off - buf[1]:off - buf[1] + size]
        if len(piece) != size:
            raise ImageDecodeError(f"{label_of(self.tars[t])} ends inside this sample's image (it changed since it "
                                  "was listed?)")
        return piece

    def _read(self, t: int, start: int, end: int) -> bytes:
        tar = self.tars[t]
        if is_url(tar):
            fs, path = filesystem(tar)
            try:  # under the retry budget; the store's failure, not the sample's: stop, never skip
                return store_call(tar, lambda: fs.cat_file(path, start=start, end=end))
            except FileNotFoundError as exc:
                raise SourceError(f"cannot read {scrub(tar)}: it is gone since it was listed; rerun the same "
                                  "command to resume") from exc
        with open(tar, "rb") as f:
            f.seek(start)
            return f.read(end - start)
