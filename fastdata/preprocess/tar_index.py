"""WebDataset tars indexed by tasks (NOTE [indexed source] in indexed.py), so that the driver of a run holds
a count per tar, not a row per sample.

NOTE [tar index]:
1. Listing a tar means streaming it whole, so at 10^9 samples the listing is work for the cluster, not for
   the driver. One task per tar streams it (NOTE [tar source] in fastdata/preprocess/tars.py) and writes its
   index into OUT's partial area: each sample's name, its image's offset and size or why it is a bad record,
   and its metadata record. The tar's summary (index_schema.py) is written after it, with the index's
   sha256: a summary means a whole index.
2. A piece loads the indexes of its own tars only (a process keeps the last few it parsed: a tar spans
   several shards).
3. ``--shuffle`` needs every sample's place, so the driver then loads every index (memory per sample, as a
   folder source's listing): at 10^9 samples shuffle at load time (``shuffle_window``) instead.
4. An index missing, damaged or tampered with (its sha256 is checked on every load) is listed again from its
   tar by whoever needs it (an index is a function of its tar alone); a tar whose new listing differs has
   changed under the run: refused, with ``--overwrite`` to start again.
"""
from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

from .._io import scrub
from ..errors import SourceError
from .index_schema import summarize
from .indexed import Area, FileSource, Piece, label_of, load_schema, name_of, schema_extras, with_bad
from .records import from_records
from .sources import Source
from .tars import IMAGE_EXTS, TarBlobs, Where, members, record

log = logging.getLogger(__name__)

INDEX_DIR = "tar-index"
_CACHED = 4  # parsed indexes a process keeps: a tar spans about ten units of the default size
_indexes: "OrderedDict[str, dict[str, list[Any]]]" = OrderedDict()  # by sha256

__all__ = ["Area", "TarPiece", "TarSource", "index_name", "index_task"]


def index_name(t: int, what: str) -> str:
    """Where tar ``t``'s ``"index"`` or ``"summary"`` lives in the area."""
    return f"{INDEX_DIR}/{t:08d}.{what}.json"  # `Area.name`


def index_task(task: tuple, slot: Optional[int] = None) -> dict[str, Any]:
    """A worker: stream one tar, write its index and then its summary (NOTE [tar index] rule 1); returns the
    summary, which names the index's sha256."""
    t, tar, area = task
    index = _listing(tar)
    digest = area.write(area.name(t, "index"), index)
    summary = {**summarize(label_of(tar), index), "index_sha256": digest}
    area.write(area.name(t, "summary"), summary)
    return summary


def _listing(tar: str) -> dict[str, list[Any]]:
    """One tar's index: each sample's name, its image's ``[offset, size]`` or why it is a bad record, and its
    metadata record (None for a bad one)."""
    label, name = label_of(tar), name_of(tar)
    keys: list[str] = []
    raw: list[str] = []  # (the samples' keys)
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
            raw.append(key)
            keys.append(f"{name}/{key}.{image or 'jpg'}")
            where.append(list(group[image]) if reason is None else reason)
            recs.append(rec if reason is None else None)
    except SourceError:
        raise
    except Exception as exc:  # noqa: BLE001 - a store refusing the read: one line naming it
        raise SourceError(f"cannot read {label}: {type(exc).__name__}: {scrub(str(exc))}") from exc
    # a key apart from itself (`tar -r` appending a sample again at the end): which is the sample is unknown,
    # so neither is kept (NOTE [tar source] rule 4)
    counts = Counter(raw)
    for i, key in enumerate(raw):
        if counts[key] > 1:
            where[i] = f"{label}: sample {key} appears {counts[key]} times, apart (a sample's members are " \
                       "consecutive): repack the tar with each sample once"
            recs[i] = None
    return {"paths": keys, "where": where, "records": recs}


def _index(area: Area, t: int, tar: str, digest: str, samples: int) -> dict[str, list[Any]]:
    """Tar ``t``'s index as its summary recorded it (the last few kept parsed: a tar spans several units);
    listed again (and rewritten) when it is missing or damaged, since an index is a function of its tar
    alone (NOTE [tar index] rule 4)."""
    index = _indexes.get(digest)
    if index is None:
        index = area.read(area.name(t, "index"), digest)
    if index is None:
        log.warning("the index of %s is missing or damaged: listing the tar again", label_of(tar))
        index = _listing(tar)
        if area.write(area.name(t, "index"), index) != digest:
            raise SourceError(f"{label_of(tar)} changed since this run listed it: rerun with --overwrite to start "
                              "again from the tars as they are now")
    if len(index["paths"]) != samples:
        raise SourceError(f"the summary of {label_of(tar)} says {samples} samples, its index "
                          f"{len(index['paths'])}: this unfinished run was damaged; rerun with --overwrite")
    _indexes[digest] = index
    _indexes.move_to_end(digest)
    while len(_indexes) > _CACHED:
        _indexes.popitem(last=False)
    return index


@dataclass(frozen=True)
class TarPiece(Piece):
    """Source positions ``[a, b)`` of indexed tars: the tars holding them, read by `load` where the piece is
    decoded."""

    @property
    def tars(self) -> list[str]:
        """The piece's tars, in order."""
        return self.files

    def load(self) -> Source:
        """The piece as a `Source` of its samples only, as listing every tar would give them."""
        s = load_schema(self.area, self.schema_sha256)
        paths: list[str] = []
        where: list[Where] = []
        rows: list[tuple[str, dict[str, Any]]] = []
        for j, t, tar, lo, hi in self.ranges():
            index = _index(self.area, t, tar, self.digests[j], self.starts[j + 1] - self.starts[j])
            label = label_of(tar)
            for name, at, rec in zip(index["paths"][lo:hi], index["where"][lo:hi], index["records"][lo:hi]):
                paths.append(name)
                where.append(at if isinstance(at, str) else (j, at[0], at[1]))
                if rec is not None:
                    rows.append((f"{label}: sample {name.split('/', 1)[-1]}", s.record(rec)))
        ok = [p for p, at in zip(paths, where) if not isinstance(at, str)]
        part = from_records(iter(rows), self.location, self.root, "webdataset", paths=ok, schema=s)
        kinds, extras = schema_extras(s, part, len(ok))
        labels, extras = with_bad(part.labels if s.has_label else [0] * len(ok), extras,
                                  [isinstance(w, str) for w in where])
        return Source("webdataset", self.location, self.root, paths, labels, s.classes, kinds, extras, s.has_label,
                      TarBlobs(self.files, where))


@dataclass(frozen=True)
class TarSource(FileSource):
    """WebDataset tars before their indexes exist: the tars and their listing (NOTE [tar index])."""

    kind = "webdataset"
    folder = INDEX_DIR
    noun = "tar"
    required = "index_sha256"
    summarize = staticmethod(index_task)
    piece_type = TarPiece

    @property
    def tars(self) -> list[str]:
        """The tars, in order."""
        return self.files

    def first_fields(self) -> Optional[str]:
        """Whether the first sample of the first tar has a record field besides its label (a caption, a
        number): read from the tar's head only, to refuse arguments that need none before listing every tar."""
        for _, group, reason in members(self.files[0], label_of(self.files[0])):
            try:
                fields = reason is None and bool(set(record(group)[1]) - {"label"})
            except (ValueError, UnicodeDecodeError):
                fields = False
            return "the tars' JSON or captions" if fields else None
        return None
