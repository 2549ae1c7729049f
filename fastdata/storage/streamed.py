"""Which files of a dataset in object storage are streamed (fetched as batches need them, NOTE [shard cache]
in cache.py) rather than downloaded when it opens, which of them travel together as one shard's group, and
an image dataset's labels, read at opening or held while their streamed shards are open."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, Union

import numpy as np

from .._io import safe_join
from ..errors import FormatError
from ..formats.manifest import IMAGES_LMDB, IMAGES_NPY, ShardIndex
from ..formats.rows import column, column_view, int_column, lookup, present
from ..formats.schema import Field, fields_of
from .shards import load_npy, take_rows

ALL_LABELS_AT_OPEN = 64 << 20  # a streamed dataset reads all_labels at opening up to this size (8M samples)


def labels_at_open(manifest: dict[str, Any]) -> bool:
    """Whether a streamed npy dataset reads every label from ``all_labels`` when it opens (one request, when
    the file is small) instead of each shard's labels file with the shard. One pass over the files list:
    call it once per opening and pass the answer on."""
    name = manifest.get("all_labels")
    if not name:
        return False
    entry = lookup(manifest["files"])(name)
    return entry is not None and int(entry["bytes"]) <= ALL_LABELS_AT_OPEN


class FileGroups(Sequence[tuple[str, ...]]):
    """Each shard's files, read together (the first names the shard): columns of names, a value a shard (None:
    that shard has no such file), each group made as a tuple when asked. Views of the manifest's `Rows`, so a
    million shards keep no tuple or name a shard (~200 MB a rank at 10^6 shards of two files)."""

    __slots__ = ("_cols", "_n")

    def __init__(self, cols: Sequence[Sequence[Optional[str]]], n: int) -> None:
        self._cols, self._n = list(cols), n

    @classmethod
    def of(cls, names: Sequence[Union[str, Sequence[str]]]) -> "FileGroups":
        """Groups given one name a shard or a sequence of names a shard (itself when it is one)."""
        if isinstance(names, FileGroups):
            return names
        groups = [(n,) if isinstance(n, str) else tuple(n) for n in names]
        width = max(map(len, groups), default=0)
        return cls([[g[j] if j < len(g) else None for g in groups] for j in range(width)], len(groups))

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, s: Any) -> Any:
        if isinstance(s, slice):
            return [self[k] for k in range(*s.indices(self._n))]
        return tuple(n for n in (c[s] for c in self._cols) if n is not None)

    def __iter__(self) -> Iterator[tuple[str, ...]]:
        for group in zip(*self._cols):
            yield tuple(n for n in group if n is not None)

    def first(self, s: int) -> str:
        """Shard ``s``'s first file, which names it."""
        return self._cols[0][s]

    def present(self, names: Iterable[str]) -> np.ndarray:
        """Which groups have every file among ``names`` (a listing of the cache: as long as what it holds). A
        small listing's names are looked up in the columns' sorted index (a million shards' cache looks at its
        disk every few seconds, so a look costs what the cache holds, not what the dataset names); one over an
        eighth of the shards is matched in one pass over each column (what a look at the whole dataset costs
        anyway)."""
        names = list(names)
        ok = np.ones(self._n, dtype=bool)
        few = len(names) * 8 < self._n  # (a cache holding most shards: one pass over a column costs less)
        listed: Optional[set[str]] = None
        for c in self._cols:
            if hasattr(c, "rows_among") and (few or isinstance(c, _FieldFiles)):  # (a shard's own file: one row)
                hit = np.zeros(self._n, dtype=bool)
                hit[c.rows_among(names)] = True
            else:  # (also a list: a manifest whose rows could not be columns, groups given by hand)
                listed = set(names) if listed is None else listed
                hit = np.fromiter((v is None or v in listed for v in c), dtype=bool, count=self._n)
            ok &= hit
        return ok

    def flat(self) -> tuple[list[str], np.ndarray]:
        """Every shard's files in order, and where each shard's first is among them (made for the call)."""
        cols = [list(c) for c in self._cols]
        widths = np.zeros(self._n, dtype=np.int64)
        for c in cols:
            widths += np.fromiter((n is not None for n in c), dtype=bool, count=self._n)
        starts = np.zeros(self._n, dtype=np.int64)
        np.cumsum(widths[:-1], out=starts[1:])
        return [n for group in zip(*cols) for n in group if n is not None], starts


class _FieldFiles(Sequence[str]):
    """Each shard's file of an extra field (its name follows from the shard's number)."""

    __slots__ = ("_field", "_n")

    def __init__(self, field: Field, n: int) -> None:
        self._field, self._n = field, n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, k: Any) -> Any:
        at = range(self._n)[k]  # (IndexError past the end; a range for a slice)
        return [self[j] for j in at] if isinstance(at, range) else self._field.files(at)[0]

    def rows_among(self, values: Sequence[str]) -> np.ndarray:
        """The shards whose file is one of ``values``: one search of them joined, not a look at each."""
        head = self._field.files(0)[0].rsplit("-", 1)[0] + "-"  # "field.NAME-"
        numbers = re.findall(rf"^{re.escape(head)}(\d+)\.npy$", "\n".join(values), re.M)
        ks = [(int(d), d) for d in numbers]  # (k's file is head + f"{k:05d}.npy": Field.files)
        return np.array([k for k, d in ks if k < self._n and d == f"{k:05d}"], dtype=np.int64)


def shard_groups(manifest: dict[str, Any], at_open: bool) -> FileGroups:
    """Each shard's files, read together: its images first (npy rows or an LMDB store), its labels (npy, unless
    they are all read at opening: ``at_open``, from `labels_at_open`), each other field's rows."""
    fields = [f for f in fields_of(manifest) or [] if f.kind not in ("image", "label")]
    if "lmdb_shards" in manifest:
        first = column_view(manifest["lmdb_shards"], "path")
    else:
        shards = manifest.get("shards", [])
        first = column_view(shards, "images")
        if not at_open:  # (a shard without a labels file has None there)
            labels = column_view(shards, "labels", None)
            return FileGroups([first, labels, *(_FieldFiles(f, len(first)) for f in fields)], len(first))
    return FileGroups([first, *(_FieldFiles(f, len(first)) for f in fields)], len(first))


def image_streamed(manifest: dict[str, Any], storage: str) -> frozenset[str]:
    """The files of a remote image dataset fetched as batches need them: npy image shards (with their labels,
    unless ``all_labels`` is read at opening, and their other fields' files; variable fields' offsets are read
    up front) and LMDB shards (format version 2), read memory-mapped."""
    if storage != "mmap":
        return frozenset()
    if manifest.get("format") == IMAGES_NPY:  # each shard's other files come with it
        at_open = labels_at_open(manifest)
        names = set(shard_groups(manifest, at_open).flat()[0])
        names.update(present(manifest.get("shards", []), "labels"))  # (unread with all_labels)
        if "all_labels" in manifest and not at_open:
            names.add(manifest["all_labels"])
        return frozenset(names)
    if "lmdb_shards" in manifest:
        return frozenset(shard_groups(manifest, False).flat()[0])
    return frozenset()


def token_streamed(manifest: dict[str, Any], storage: str) -> frozenset[str]:
    """The files of a remote token dataset fetched as batches need them: every split's shards, memory-mapped."""
    if storage != "mmap":
        return frozenset()
    splits = manifest.get("splits", {}).values()
    return frozenset(p for split in splits for p in column(split.get("shards", []), "path"))


def unread_files(manifest: dict[str, Any]) -> frozenset[str]:
    """The files of a dataset no reader reads, never fetched from a URL: a token dataset's per-shard document
    offsets (format 2), there for users of the token streams."""
    splits = manifest.get("splits", {}).values()
    return frozenset(p for split in splits for p in present(split.get("shards", []), "docs"))


def streamed_files(manifest: dict[str, Any], storage: str) -> frozenset[str]:
    """The files of a remote dataset of any format fetched as batches need them (the others come at opening)."""
    return image_streamed(manifest, storage) | token_streamed(manifest, storage)


class Labels:
    """An image dataset's int64 labels (``array``, one per sample; empty when it has no class label). Read
    when the dataset opens (the one file holding every label, memory-mapped when ``mapped``; a streamed
    dataset's ``all_labels`` when small enough: `labels_at_open`), or else taken from each streamed shard's
    labels file, which arrives with the shard: ``held`` has the labels of the shards open in this process
    (`arrived`), let go of with them (`left`). With a cache_limit that is memory in proportion to the cache,
    not to the dataset (10^9 samples were 8 GB a rank as one array); without one every shard stays open
    once it has arrived, its labels with it.

    `take` gives a batch's labels either way; `complete` every label (fetched without their images)."""

    def __init__(self, root: Path, manifest: dict[str, Any], *, has_labels: bool, streams: bool,
                 at_open: bool, mapped: bool = False) -> None:
        self.root, self.manifest, self.has_labels = root, manifest, has_labels
        n = int(manifest["num_samples"])
        self.held: Optional[dict[int, np.ndarray]] = None  # an open shard's labels, by shard (streamed)
        if not has_labels:
            self.array = np.zeros(0, dtype=np.int64)
            return
        if streams and not at_open:
            self.held = {}
            return
        one = manifest.get("labels" if manifest["format"] == IMAGES_LMDB else "all_labels")
        # Every label in one file: ``mapped`` (a local folder's), shared by the processes of a node, where a
        # million shards' labels files would be a million reads at each open. The map is made again where it
        # was let go of (`release`) or not sent (a spawned worker); a URL's file (fetched when the dataset
        # opened) is read, so that no descriptor outlives a dropped dataset's node cache.
        self._mapped = one if one and mapped else None
        if self._mapped is not None:
            self.__getattr__("array")  # (mapped and checked now: a damaged file is refused at opening)
        else:
            names = [one] if one else column(manifest["shards"], "labels")  # (npy made before all_labels)
            labels = _checked(np.concatenate([load_npy(safe_join(root, name)) for name in names]),
                              n, root / (one or ""))
            labels.setflags(write=False)
            self.array = labels

    def __getattr__(self, name: str) -> Any:
        if name != "array" or self.__dict__.get("_mapped") is None:
            raise AttributeError(name)
        labels = _checked(load_npy(safe_join(self.root, self._mapped), "r"),
                          int(self.manifest["num_samples"]), self.root / self._mapped)
        self.array = labels  # (the first access maps it; later ones find the attribute)
        return labels

    def release(self) -> None:
        """Let go of a mapped labels file (its descriptor and mapping); a later access maps it again."""
        if self.__dict__.get("_mapped") is not None:
            self.__dict__.pop("array", None)

    def __getstate__(self) -> dict[str, Any]:  # (spawned workers map the file themselves, not a copy of it)
        state = dict(self.__dict__)
        if state.get("_mapped") is not None:
            state.pop("array", None)
        if state.get("held") is not None:  # (the receiving process holds the shards it opens)
            state["held"] = {}
        return state

    def arrived(self, s: int) -> None:
        """Streamed shard ``s`` is open in this process: its labels, which came with it, are read in (until
        `complete` has read every label)."""
        if self.held is None or "array" in self.__dict__:
            return
        row = self.manifest["shards"][s]  # (a dict made from the columns: once)
        if "labels" in row:
            self.held[s] = self._read(safe_join(self.root, row["labels"]), int(row["samples"]))

    def left(self, s: int) -> None:
        """Streamed shard ``s`` is closed in this process (it may be evicted): its held labels go with it."""
        if self.held is not None:
            self.held.pop(s, None)

    def take(self, idx: np.ndarray, where: ShardIndex, out: Optional[np.ndarray] = None) -> np.ndarray:
        """The labels of samples ``idx`` (into ``out`` when given); held labels only while the caller holds
        the batch's shards open (pinned)."""
        out = np.empty(len(idx), dtype=np.int64) if out is None else out
        held = self.held  # (before the look at ``array``: `complete` may replace it meanwhile)
        if held is None or "array" in self.__dict__:
            return np.take(self.array, idx, out=out, mode="clip")
        shard, rows = where.locate(idx)
        take_rows(held, shard, rows, out)
        return out

    @staticmethod
    def _read(path: Path, samples: int) -> np.ndarray:
        """A shard's labels file, checked to hold its ``samples`` labels."""
        labels = _checked(load_npy(path), samples, path)
        labels.setflags(write=False)
        return labels

    def complete(self, fetch: Callable[[str], Path]) -> np.ndarray:
        """Every label, read-only: the shards' labels files not held fetched first (``fetch(name)`` gives a
        file's local path), without their images. Held labels become one array (what was asked for)."""
        if self.held is not None and "array" not in self.__dict__:
            held, shards = self.held, self.manifest["shards"]
            parts = []
            for s, (name, samples) in enumerate(zip(column(shards, "labels"), int_column(shards, "samples").tolist())):
                part = held.get(s)  # (a shard closing meanwhile: fetched as the others)
                parts.append(part if part is not None else self._read(fetch(name), samples))
            array = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
            array.setflags(write=False)
            self.array, self.held = array, {}
        view = self.array.view()
        view.setflags(write=False)
        return view


def _checked(labels: np.ndarray, n: int, where: Path) -> np.ndarray:
    """``labels`` if they are ``n`` int64 labels; else the dataset is damaged."""
    if labels.shape != (n,) or labels.dtype != np.int64:
        raise FormatError(f"{where}: labels have shape {labels.shape} and dtype {labels.dtype}, expected ({n},) "
                          "int64: the dataset is damaged")
    return labels
