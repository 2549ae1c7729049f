"""Find the images to preprocess: an ImageFolder tree or a CSV list of ``path,label`` rows (and, through
records.py, samples with more fields: JSONL/CSV records, segmentation pairs, COCO, Parquet)."""
from __future__ import annotations

import csv
import hashlib
import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

import numpy as np

from .._io import scrub
from ..errors import SourceError

# torchvision's IMG_EXTENSIONS plus .gif and .jfif; matched case-insensitively.
IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".jfif", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp",
                              ".gif"})


@dataclass(frozen=True)
class Source:
    """The ordered list of input images. ``paths`` are relative to ``root``; sample order is list order."""

    kind: str  # "folder" or "csv" (or a kind of records.py or tars.py)
    location: Path  # the folder, or the CSV file (a str for a URL)
    root: Path  # the folder paths are relative to
    paths: list[str]
    labels: list[int]
    classes: list[str]
    # Samples with fields (NOTE [fields] in fastdata/formats/schema.py): field name -> kind, and per field one raw value per
    # sample (a mask path, a list of boxes, ids, numbers, a caption); empty for (image, class) sources.
    kinds: dict[str, str] = field(default_factory=dict)
    extras: dict[str, list[Any]] = field(default_factory=dict)
    has_label: bool = True
    blobs: Optional[Any] = None  # Parquet: reads sample i's encoded image bytes (paths are then row names)

    def shuffled(self, seed: int) -> "Source":
        """The same samples in the order ``numpy.random.default_rng(seed).permutation(n)`` (sample ``i`` is
        the source's ``perm[i]``), so that shards hold every class and a small ``shuffle_window`` mixes
        batches as a full shuffle does. Parquet rows are read a row group at a time: refused."""
        if self.blobs is not None and not hasattr(self.blobs, "permuted"):
            raise SourceError(f"--shuffle would read {self.location}'s Parquet row groups once per sample: shuffle "
                              "the rows when writing the Parquet files, or keep their order and use a larger "
                              "shuffle_window")
        perm = np.random.default_rng(seed).permutation(len(self.paths)).tolist()
        return replace(self, paths=[self.paths[i] for i in perm], labels=[self.labels[i] for i in perm],
                       extras={k: [v[i] for i in perm] for k, v in self.extras.items()},
                       blobs=None if self.blobs is None else self.blobs.permuted(perm))  # tars: read by offset

    @property
    def where(self) -> str:
        """The source as the manifest names it: a local path resolved, a URL as given (without secrets)."""
        if isinstance(self.location, str):
            return scrub(self.location)
        return str(self.location.resolve())

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


def is_image_name(name: str) -> bool:
    return not name.startswith(".") and os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS


def discover(src: Path | str) -> Source:
    """An ImageFolder tree when ``src`` is a folder, a ``path,label`` list when it is a ``.csv`` file."""
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
        raise SourceError(f"source {src} holds no image files (extensions: {', '.join(sorted(IMAGE_EXTENSIONS))})")
    return source


def class_ids(names: list[str]) -> tuple[list[str], list[int]]:
    """``(classes, id of each name)``: integer names keep their ids (classes are "0".."max", so ids and names
    agree); other names are numbered in sorted order."""
    if names and all(n.isdigit() for n in names):
        ids = [int(n) for n in names]
        return [str(i) for i in range(max(ids) + 1)], ids
    classes = sorted(set(names))
    index = {c: i for i, c in enumerate(classes)}
    return classes, [index[n] for n in names]


def inside(root: Path, rel: str, where: str, folder: str) -> str:
    """``rel`` as a POSIX path relative to ``root``; refuses absolute paths and ``..`` that leave it."""
    full = (root / rel).resolve()
    if Path(rel).is_absolute() or not full.is_relative_to(root):
        raise SourceError(f"{where}: {rel!r} is outside {folder} {root}; paths must be relative to it")
    return full.relative_to(root).as_posix()


def _from_folder(root: Path) -> Source:
    try:
        classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    except OSError as exc:
        raise SourceError(f"cannot list source folder {root}: {exc.strerror}") from exc
    if not classes:
        raise SourceError(f"source folder {root} has no class sub-folders: put each class's images in its own folder")
    paths, labels = [], []
    for label, name in enumerate(classes):
        for dirpath, dirnames, filenames in os.walk(root / name, followlinks=True):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            rel = Path(dirpath).relative_to(root)
            for fname in sorted(filenames):
                if is_image_name(fname):
                    paths.append((rel / fname).as_posix())
                    labels.append(label)
    return Source("folder", root, root, paths, labels, classes)


def _from_csv(path: Path) -> Source:
    root = path.parent.resolve()
    rows: list[tuple[str, str]] = []
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            for lineno, row in enumerate(csv.reader(f), start=1):
                if not row or all(not c.strip() for c in row):
                    continue
                if lineno == 1 and [c.strip().lower() for c in row] == ["path", "label"]:
                    continue
                if len(row) != 2 or not row[0].strip() or not row[1].strip():
                    raise SourceError(f"{path}:{lineno}: expected 'path,label', got {row!r}")
                rows.append((inside(root, row[0].strip(), f"{path}:{lineno}", "the list's folder"), row[1].strip()))
    except UnicodeDecodeError as exc:
        raise SourceError(f"{path} is not UTF-8 text ({exc.reason}): save the list as UTF-8 CSV") from exc
    except csv.Error as exc:
        raise SourceError(f"{path}: malformed CSV ({exc})") from exc
    except OSError as exc:
        raise SourceError(f"cannot read {path}: {exc.strerror}") from exc
    classes, ids = class_ids([label for _, label in rows])
    kept = [(p, i) for (p, _), i in zip(rows, ids) if is_image_name(os.path.basename(p))]
    return Source("csv", path, root, [p for p, _ in kept], [i for _, i in kept], classes)
