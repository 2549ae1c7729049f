"""Find the images to preprocess: an ImageFolder tree or a CSV list of ``path,label`` rows (and, through
records.py, samples with more fields: JSONL/CSV records, segmentation pairs, COCO, Parquet), on this
machine's disk or at an fsspec URL (read where it lives: url_reads.py, NOTE [url source]).

NOTE [class ids]:
1. Integer class labels keep their ids, so the classes are "0".."max id": the manifest names (and counts)
   every one of them, used or not.
2. So an id must be below ``max(65536, 2 x the source's samples)`` (`id_limit`): past that most of the list
   is unused, and one stray id (a ``.cls`` of 10^10) would build a list of 10^10 names. A larger id is
   refused, named: number the classes 0..K-1, or give them as names (numbered in sorted order).
3. Only ASCII digits make an id ("3"; not "²", which ``str.isdigit`` accepts and ``int`` refuses).
4. A file of an indexed source (a tar, a Parquet file) is checked with the whole source, by its merged
   schema (index_schema.Merge), never against its own sample count.
5. A sample's class given as text (a CSV cell, a ``.cls``) is an id when every one is digits and a name when
   none is; a mix is refused, named (as names, "10" would sort before "2": every id moved, silently). The
   tags of a ``labels`` cell are names when any one is not digits ("cat 2024").
"""
from __future__ import annotations

import csv
import hashlib
import json
import logging
import os
import posixpath
import stat
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional, Sequence, Union
from urllib.parse import unquote

import numpy as np

from .._io import scrub
from ..errors import SourceError
from ..storage.object_store import is_url
from .url_reads import UrlBlobs, open_text, parent, url_listing, url_path

log = logging.getLogger(__name__)

# torchvision's IMG_EXTENSIONS plus .gif and .jfif; matched case-insensitively.
IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".jfif", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp",
                              ".gif"})


@dataclass(frozen=True)
class Source:
    """The ordered list of input images. ``paths`` are relative to ``root``; sample order is list order."""

    kind: str  # "folder" or "csv" (or a kind of records.py or tars.py)
    location: Union[Path, str]  # the folder, or the CSV file (a str for a URL)
    root: Path  # the folder paths are relative to (a URL source: "."; its blobs know the URL)
    paths: list[str]
    labels: list[int]
    classes: list[str]
    # Samples with fields (NOTE [fields] in fastdata/formats/schema.py): field name -> kind, and per field one raw value per
    # sample (a mask path, a list of boxes, ids, numbers, a caption); empty for (image, class) sources.
    kinds: dict[str, str] = field(default_factory=dict)
    extras: dict[str, list[Any]] = field(default_factory=dict)
    has_label: bool = True
    blobs: Optional[Any] = None  # reads sample i's bytes: Parquet rows, tar members, objects at a URL

    def shuffled(self, seed: int) -> "Source":
        """The same samples in the order ``numpy.random.default_rng(seed).permutation(n)`` (sample ``i`` is
        the source's ``perm[i]``), so that shards hold every class and a small ``shuffle_window`` mixes
        batches as a full shuffle does (Parquet refuses it before: NOTE [parquet source] rule 5)."""
        perm = np.random.default_rng(seed).permutation(len(self.paths)).tolist()
        return replace(self, paths=[self.paths[i] for i in perm], labels=[self.labels[i] for i in perm],
                       extras={k: [v[i] for i in perm] for k, v in self.extras.items()},
                       blobs=None if self.blobs is None else self.blobs.permuted(perm))  # tars: read by offset

    @property
    def num_samples(self) -> int:
        """Samples in the source, bad ones included."""
        return len(self.paths)

    def piece(self, a: int, b: int) -> "Source":
        """Samples ``[a, b)`` only: what the workers decoding them need (`load` gives it back)."""
        return replace(self, paths=self.paths[a:b], labels=self.labels[a:b],
                       extras={k: v[a:b] for k, v in self.extras.items()},
                       blobs=None if self.blobs is None else self.blobs.chunk(a, b))

    def load(self) -> "Source":
        """The piece's samples: a listed source's piece holds them already (a tar source's reads them)."""
        return self

    def vector_shape(self, name: str) -> tuple[int, ...]:
        """A ``vector`` field's shape: ``(n,)`` for lists of n numbers, ``()`` for one number."""
        first = self.extras[name][0]
        return (len(first),) if isinstance(first, list) else ()

    @property
    def where(self) -> str:
        """The source as the manifest names it (`where_of`)."""
        return where_of(self.location)

    def fingerprint(self) -> str:
        """Hash of the file list, labels and classes: a resumed run must see the same source."""
        h = hashlib.sha256()
        parts = [self.where, "\0".join(self.classes), "\0".join(self.paths),
                 ",".join(map(str, self.labels))]
        if self.kinds:  # (image, class) sources keep their fingerprint, so their runs resume as before
            parts.append(json.dumps([self.kinds, self.extras, self.has_label], sort_keys=True))
        for part in parts:
            h.update(part.encode("utf-8", "surrogateescape") + b"\1")
        return h.hexdigest()


def where_of(location: Union[Path, str]) -> str:
    """A source's location as the manifest names it: a local path resolved, a URL as given (without secrets)."""
    return scrub(location) if isinstance(location, str) else str(Path(location).resolve())


def is_image_name(name: str) -> bool:
    return not name.startswith(".") and os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS


def holds_image(folder: Path) -> bool:
    """Whether an image file lies anywhere under ``folder`` (the walk stops at the first)."""
    return any(is_image_name(f) for _, _, files in os.walk(folder) for f in files)


def discover(src: Path | str) -> Source:
    """An ImageFolder tree when ``src`` is a folder, a ``path,label`` list when it is a ``.csv`` file; local
    or at a URL (NOTE [url source])."""
    if is_url(src):
        try:
            source = _from_csv(str(src)) if url_path(src).lower().endswith(".csv") else url_folder(str(src))
        except SourceError as exc:  # a list's messages name its file and line: its URL, scrubbed
            raise SourceError(scrub(str(exc))) from None
        if not source.paths:
            raise SourceError(f"source {scrub(str(src))} holds no image files (extensions: "
                              f"{', '.join(sorted(IMAGE_EXTENSIONS))})")
        return source
    src = Path(src)
    if not src.exists():
        raise SourceError(f"source {src} does not exist: pass an image folder (one sub-folder per class) or a "
                          ".csv list")
    if src.is_dir():
        source = _from_folder(src)
    elif src.suffix.lower() == ".csv":
        source = _from_csv(src)
    else:
        raise SourceError(f"source {src} is a file but not a .csv list: pass an image folder or a path,label .csv")
    if not source.paths:
        tables = sorted(p.name for p in src.iterdir() if p.is_dir() and listed(p.name, ".parquet")) \
            if src.is_dir() else []
        hint = f": {src / tables[0]} is a Parquet table folder (as Spark writes one): pass it as the " \
               "source" if tables else ""
        raise SourceError(f"source {src} holds no image files (extensions: "
                          f"{', '.join(sorted(IMAGE_EXTENSIONS))}){hint}")
    return source


MIN_ID_LIMIT = 1 << 16  # class ids below this are always accepted (NOTE [class ids] rule 2)


def id_limit(samples: int) -> int:
    """Integer class ids must be below this for a source of ``samples`` samples (NOTE [class ids] rule 2)."""
    return max(MIN_ID_LIMIT, 2 * samples)


def shown(value: Any, width: int = 40) -> str:
    """``repr(value)`` cut to about ``width`` characters: a message may echo a 4000-digit number."""
    big = isinstance(value, int) and abs(value) >= 10 ** width
    text = f"<an integer of {len(str(abs(value)))} digits>" if big else repr(value)
    return text if len(text) <= width else text[:width] + "..."


def fits_float(value: Any) -> bool:
    """Whether a float field's value (a number or a list of them) is within a float's range: JSON and ``int``
    read an integer of any number of digits, ``float`` refuses one past 1.8e308."""
    try:
        [float(x) for x in value] if isinstance(value, list) else float(value)
    except OverflowError:
        return False
    return True


def id_classes(top: int, samples: Optional[int], where: str) -> list[str]:
    """The classes ``"0".."top"`` of integer ids up to ``top``; ``[]`` where ``samples`` is None (a file of an
    indexed source: its merged schema checks and names them, NOTE [class ids] rule 4).

    Raises:
        SourceError: ``top`` is not below `id_limit` (``where`` says where it is).
    """
    if samples is None:
        return []
    if top >= id_limit(samples):
        raise SourceError(f"{where}: class id {shown(top)} is too large for {samples} samples: classes run from 0 "
                          f"to the largest id, so an id must be below {id_limit(samples)} (the larger of 65536 and "
                          "twice the samples); number the classes 0..K-1, or give them as names")
    return [str(i) for i in range(top + 1)]


def is_id(name: str) -> bool:
    """Whether a class name is an id: ASCII digits only (NOTE [class ids] rule 3)."""
    return name.isascii() and name.isdigit()


def listed(name: str, suffix: str) -> bool:
    """Whether a folder's entry ``name`` is one of its ``suffix`` files (tars, Parquet files): hidden files
    (macOS's ``._x.tar`` beside each file it copies to SMB or exFAT) are not."""
    return name.endswith(suffix) and not name.startswith(".")


def mixed_ids(labels: Sequence[Any]) -> Optional[tuple[int, int]]:
    """Where class labels given as text mix ids and names (NOTE [class ids] rule 5): the index of the first id
    and of the first name, or None."""
    first_id = next((i for i, v in enumerate(labels) if isinstance(v, str) and is_id(v)), None)
    first_name = next((i for i, v in enumerate(labels) if isinstance(v, str) and not is_id(v)), None)
    return None if first_id is None or first_name is None else (first_id, first_name)


def mixing_message(where: str, an_id: str, name: str) -> str:
    """The refusal of rule 5, ``an_id`` and ``name`` saying which samples hold the two kinds."""
    return (f"{where}: class labels mix ids and names: {an_id} is an id, {name} a name: give every label as an "
            "integer id >= 0, or every one as a name (names are numbered in sorted order, '10' before '2')")


def class_ids(names: list[str], samples: Optional[int] = None, where: str = "the source"
              ) -> tuple[list[str], list[int]]:
    """``(classes, id of each name)``: integer names keep their ids (classes are "0".."max", so ids and names
    agree; checked against ``samples``: `id_classes`); other names are numbered in sorted order.

    Raises:
        SourceError: An integer name is too large an id for ``samples`` samples (NOTE [class ids]).
    """
    if names and all(is_id(n) for n in names):
        ids = [int(n) for n in names]
        return id_classes(max(ids), samples, where), ids
    classes = sorted(set(names))
    index = {c: i for i, c in enumerate(classes)}
    return classes, [index[n] for n in names]


_FOLDERS_KEPT = 1 << 16  # resolved folders `inside` keeps for a source (ImageNet-21k's list: 21,841)


def inside(root: Union[Path, str], rel: str, where: str, folder: str,
           folders: Optional[dict[str, Path]] = None) -> str:
    """``rel`` as a POSIX path relative to ``root`` (a folder, or a folder's URL), links resolved; refuses
    absolute paths, URLs and ``..`` that leave it (at a URL also ``%2e%2e``: a web server decodes it to
    ``..``). ``folders``: a source's resolved folders, kept across its rows (a realpath walks every part of a
    path: 14M rows of a list were minutes; a folder is resolved once, and a row's own name resolved only
    where it is a link)."""
    return locate(root, rel, where, folder, folders)[0]


def locate(root: Union[Path, str], rel: str, where: str, folder: str,
           folders: Optional[dict[str, Path]] = None) -> tuple[str, bool]:
    """`inside`'s path, and whether it names a file a worker reads: a regular file or a FIFO, links followed
    (not a missing file, a folder or a socket: a bad record, which lists no class; NOTE [refused records] in
    fastdata/preprocess/fields.py). At a URL it is True: only a read tells. The one ``lstat`` that looks for
    a link tells, at no cost."""
    if isinstance(root, str):
        norm = posixpath.normpath(rel)
        plain = posixpath.normpath(unquote(rel))  # what an http:// server resolves, after our check
        if is_url(rel) or any(p == ".." or p.startswith(("../", "/")) for p in (norm, plain)):
            raise SourceError(f"{where}: {rel!r} is outside {folder} {scrub(root)}; paths must be relative to it")
        return norm, True
    head, name = os.path.split(rel)
    if folders is None or name in ("", ".", ".."):
        full = (root / rel).resolve()
        info = _stat(full, os.stat)
    else:
        base = folders.get(head)
        if base is None:
            if len(folders) >= _FOLDERS_KEPT:
                folders.clear()
            base = folders[head] = (root / head).resolve()
        full = base / name
        info = _stat(full, os.lstat)
        if info is not None and stat.S_ISLNK(info.st_mode):  # the file itself a link, resolved as realpath would
            full = full.resolve()
            info = _stat(full, os.stat)
    if Path(rel).is_absolute() or not full.is_relative_to(root):
        raise SourceError(f"{where}: {rel!r} is outside {folder} {root}; paths must be relative to it")
    readable = info is not None and (stat.S_ISREG(info.st_mode) or stat.S_ISFIFO(info.st_mode))
    return full.relative_to(root).as_posix(), readable


def _stat(path: Path, how: Any) -> Optional[os.stat_result]:
    try:
        return how(path)
    except (OSError, ValueError):  # (ValueError: a NUL in the name)
        return None


def _from_folder(root: Path) -> Source:
    try:
        classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    except OSError as exc:
        raise SourceError(f"cannot list source folder {root}: {exc.strerror}") from exc
    if not classes:
        raise SourceError(f"source folder {root} has no class sub-folders: put each class's images in its own folder")
    paths, labels = [], []
    odd: list[str] = []  # image names that are devices (/dev/zero: a read never ends) or sockets
    loops: list[str] = []  # folder links back into a folder above them: walked, a loop would never end
    for label, name in enumerate(classes):
        found = _walk(root, name, odd, loops)
        paths += found
        labels += [label] * len(found)
    if odd:
        log.warning("skipped %d image name(s) that are not files (a device, a socket): %s",
                    len(odd), ", ".join(odd[:5]) + (" ..." if len(odd) > 5 else ""))
    if loops:
        log.warning("skipped %d folder link(s) that lead back into a folder above them (a loop): %s",
                    len(loops), ", ".join(loops[:5]) + (" ..." if len(loops) > 5 else ""))
    return Source("folder", root, root, paths, labels, classes)


def _walk(root: Path, name: str, odd: list[str], loops: list[str]) -> list[str]:
    """The image files under class folder ``root/name``, relative to ``root``, in ``os.walk(followlinks=True)``'s
    order (a folder's files sorted, then its sorted sub-folders); links are followed as os.walk does, but a
    folder that is one of its own ancestors (by ``(st_dev, st_ino)``: a loop, which os.walk followed until the
    path grew too long) is not entered again (named in ``loops``, as ``find -L`` does), and only files are
    kept (regular files and FIFOs: `_regular`; devices and sockets named in ``odd``)."""
    out: list[str] = []
    try:
        st = os.stat(root / name)
    except OSError:
        return out
    stack: list[tuple[str, tuple[int, int], frozenset[tuple[int, int]]]] = [(name, (st.st_dev, st.st_ino),
                                                                             frozenset())]
    while stack:
        rel, key, above = stack.pop()
        if key in above:
            loops.append(rel)
            continue
        path = above | {key}
        try:
            entries = sorted(os.scandir(root / rel), key=lambda e: e.name)
        except OSError:  # unreadable: os.walk's default, as before
            continue
        subs = []
        for e in entries:
            try:
                is_dir = e.is_dir()
            except OSError:
                is_dir = False
            if is_dir:
                if not e.name.startswith("."):
                    subs.append(e)
            elif is_image_name(e.name):
                (out if _regular(e) else odd).append(f"{rel}/{e.name}")
        for e in reversed(subs):  # a stack: the first sub-folder is walked next
            try:
                st = e.stat()
            except OSError:
                continue
            stack.append((f"{rel}/{e.name}", (st.st_dev, st.st_ino), path))
    return out


def _regular(e: os.DirEntry) -> bool:
    """A regular file, a FIFO (a stream a process writes: read as a file, as before), or a name that is no
    file at all (a dangling link: a bad record when read, as before); not a device (``/dev/zero`` never ends)
    nor a socket."""
    try:
        return e.is_file() or not os.path.exists(e.path) or stat.S_ISFIFO(os.stat(e.path).st_mode)
    except OSError:
        return True


def _from_csv(path: Union[Path, str]) -> Source:
    root = parent(path)
    rows: list[tuple[str, str]] = []
    unread: set[int] = set()  # rows whose file is no file a worker reads: they list no class
    folders: dict[str, Path] = {}
    try:
        with open_text(path) as f:
            for lineno, row in enumerate(csv.reader(f), start=1):
                if not row or all(not c.strip() for c in row):
                    continue
                if lineno == 1 and [c.strip().lower() for c in row] == ["path", "label"]:
                    continue
                if len(row) != 2 or not row[0].strip() or not row[1].strip():
                    raise SourceError(f"{path}:{lineno}: expected 'path,label', got {row!r}")
                rel, found = locate(root, row[0].strip(), f"{path}:{lineno}", "the list's folder", folders)
                if is_image_name(os.path.basename(rel)):  # (other files are no samples)
                    if not found:
                        unread.add(len(rows))
                    rows.append((rel, row[1].strip()))
    except UnicodeDecodeError as exc:
        raise SourceError(f"{path} is not UTF-8 text ({exc.reason}): save the list as UTF-8 CSV") from exc
    except csv.Error as exc:
        raise SourceError(f"{path}: malformed CSV ({exc})") from exc
    except OSError as exc:
        raise SourceError(f"cannot read {path}: {exc.strerror}") from exc
    named = [label for i, (_, label) in enumerate(rows) if i not in unread]
    mixed = mixed_ids(named)
    if mixed is not None:
        good = [p for i, (p, _) in enumerate(rows) if i not in unread]
        an_id, name = (f"{named[i]!r} (the label of {good[i]})" for i in mixed)
        raise SourceError(mixing_message(str(path), an_id, name))
    classes, ids = class_ids(named, len(rows), str(path))
    # a row whose file is missing lists no class: its label is one past the last class (NOTE [refused records]
    # rule 3 in fastdata/preprocess/fields.py), out of range should its file appear before it is read
    it = iter(ids)
    labels = [len(classes) if i in unread else next(it) for i in range(len(rows))]
    paths = [p for p, _ in rows]
    if isinstance(root, str):
        return Source("csv", path, Path("."), paths, labels, classes, blobs=UrlBlobs(root, paths))
    return Source("csv", path, root, paths, labels, classes)


def url_folder(url: str, listing: Optional[dict[str, dict[str, Any]]] = None) -> Source:
    """An ImageFolder tree at ``url`` (``listing``: its `url_listing`, when made already): the classes,
    paths and order `discover` gives for a local copy of the same files (classes sorted; per class, each
    folder's files sorted before its sorted sub-folders)."""
    classes: set[str] = set()
    found: list[tuple[tuple[tuple[int, str], ...], str]] = []
    for rel, info in (url_listing(url) if listing is None else listing).items():
        parts = rel.split("/")
        if any(p.startswith(".") for p in parts[:-1]) or parts[0].startswith("."):
            continue
        if info.get("type") == "directory" or len(parts) > 1:
            classes.add(parts[0])
        if info.get("type") != "directory" and len(parts) > 1 and is_image_name(parts[-1]):
            # os.walk's order: a folder's files (sorted) come before its sub-folders (sorted)
            found.append((tuple((1, p) for p in parts[:-1]) + ((0, parts[-1]),), rel))
    if not classes:
        raise SourceError(f"source folder {scrub(url)} has no class sub-folders: put each class's images in its "
                          "own folder")
    order = sorted(classes)
    index = {c: i for i, c in enumerate(order)}
    found.sort()
    paths = [rel for _, rel in found]
    return Source("folder", url, Path("."), paths, [index[p.split("/", 1)[0]] for p in paths], order,
                  blobs=UrlBlobs(url.rstrip("/"), paths))
