"""What the samples of an indexed source share (NOTE [indexed source] rule 2 in indexed.py): each file's
summary, their merge into one `Schema`, and a record read through it.

Two rules decide which record keys become fields:

- WebDataset tars (one JSON a sample, written by many tools): as one listing of every record would, a JSON key
  is stored where it holds a number (or a list of numbers) in every sample; each field has one kind and one
  length; the class values of every sample make one class list. A tar's summary reports its keys' problems
  rather than raising them: a key another tar makes non-numeric is dropped, and its problem never matters.
- Parquet (typed columns, ``strict``): records.py's rules for every column, as for a JSONL file: each column
  is a field, a column that cannot be stored or disagrees between files is an error, and a float field needs
  a value in every row.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from ..errors import SourceError
from ..formats.schema import valid_name
from .records import CLASS_KEYS, from_records, kind_of, split_labels
from .sources import class_ids, id_classes

log = logging.getLogger(__name__)

FIXED = ("label", "labels", "boxes", "box_labels", "caption")  # record keys kept whatever their values


def _numeric(v: Any) -> bool:
    return not isinstance(v, (str, bool)) and v is not None


def summarize(label: str, index: dict[str, list[Any]]) -> dict[str, Any]:
    """What the driver needs of one tar's samples (``index``: tar_index's listing): counts, the keys numeric
    in every sample and the problems of those it could not store, kinds in first-seen order, vector lengths,
    class values."""
    keys, recs = index["paths"], index["records"]
    rows = [(f"{label}: sample {k.split('/', 1)[-1]}", r) for k, r in zip(keys, recs) if r is not None]
    seen = sorted({k for _, r in rows for k in r if k not in FIXED})
    numeric = [k for k in seen if all(_numeric(r.get(k)) for _, r in rows)]
    problems = {k: p for k in numeric if (p := _problem(label, k, [r[k] for _, r in rows]))}
    local = keep_keys(rows, set(numeric) - set(problems))
    refused: set[int] = set()
    part = from_records(iter(local), label, Path("."), "webdataset",
                        paths=[k for k, r in zip(keys, recs) if r is not None], refused=refused)
    return {"samples": len(keys), "seen": seen, "numeric": numeric, "problems": problems,
            **_found(part, local, refused)}


def summarize_records(label: str, rows: list[tuple[str, dict[str, Any]]], root: Any, kind: str) -> dict[str, Any]:
    """What the driver needs of one file's rows under records.py's rules (``strict``: Parquet): every key
    with a value is a field, and a problem in the file's own rows is raised here, naming the row.

    Raises:
        SourceError: A row's value cannot be stored, or the file's rows disagree (records.py's messages).
    """
    refused: set[int] = set()
    part = from_records(iter(rows), label, root, kind, paths=[w for w, _ in rows], refused=refused)
    seen = sorted({k for _, r in rows for k in r})
    return {"samples": len(rows), "seen": seen, "numeric": seen, "problems": {}, **_found(part, rows, refused)}


def _found(part: Any, rows: list[tuple[str, dict[str, Any]]], refused: set[int]) -> dict[str, Any]:
    """A summary's fields, kinds, vector lengths and class values, from its good rows as records.py read them
    (the class values of those their workers refuse left out: NOTE [refused records] in fields.py)."""
    values = [v for i, (_, r) in enumerate(rows) if i not in refused for v in class_values(r)]
    ids = all(isinstance(v, int) and not isinstance(v, bool) for v in values)
    return {"good": len(rows), "kinds": [[k, v] for k, v in part.kinds.items()], "has_label": part.has_label,
            "vectors": {k: (len(c[0]) if isinstance(c[0], list) else -1) for k, c in part.extras.items()
                        if part.kinds.get(k) == "vector" and c},
            "classes": {} if not values else {"ids": max(values)} if ids else {"names": sorted(set(map(str, values)))}}


def _problem(label: str, key: str, values: list[Any]) -> Optional[str]:
    """Why ``key`` (numeric in every sample of a tar) cannot be stored, as records.py would say; None if it can."""
    if not valid_name(key) or any(kind_of(key, v) is None for v in values):
        return (f"{label}: cannot store {key!r}: use a lower-case name and a number or a list of numbers in "
                "every sample")
    shapes = {len(v) if isinstance(v, list) else -1 for v in values}
    if len(shapes) > 1:
        return f"{label}: {key!r} has lists of different lengths {sorted(shapes)}: a float field has one length"
    return None


def keep_keys(rows: list[tuple[str, dict[str, Any]]], keep: set[str]) -> list[tuple[str, dict[str, Any]]]:
    return [(w, {k: v for k, v in r.items() if k in FIXED or k in keep}) for w, r in rows]


def class_values(rec: dict[str, Any]) -> list[Any]:
    """A record's class ids or names, as records.py reads them (a ``labels`` string is split)."""
    out: list[Any] = []
    for key in CLASS_KEYS:
        v = rec.get(key)
        if isinstance(v, str) and key == "labels":
            v = split_labels(v)
        if v is not None:
            out += v if isinstance(v, list) else [v]
    return out


@dataclass(frozen=True)
class Schema:
    """The merged summaries: what every piece of the source shares."""

    keep: frozenset[str]
    kinds: dict[str, str]
    vectors: dict[str, int]
    has_label: bool
    classes: list[str]
    ids: Optional[dict[str, int]]  # class name -> id; None: the records give ids
    common: dict[str, Any] = field(default_factory=dict)  # what every file agrees on (Parquet: the image column)

    def class_id(self, v: Any) -> Any:
        """A class value (or a list of them) as the source's id."""
        if isinstance(v, list):
            return [self.class_id(x) for x in v]
        return v if self.ids is None else self.ids[str(v)]

    def record(self, rec: dict[str, Any]) -> dict[str, Any]:
        """A record with the source's keys only (`records.from_records` gives its classes the source's ids
        with ``schema=``, but for a record its worker refuses: their names may be in no class list)."""
        return {k: v for k, v in rec.items() if k in FIXED or k in self.keep}

    def to_json(self) -> dict[str, Any]:
        return {"keep": sorted(self.keep), "kinds": [[k, v] for k, v in self.kinds.items()], "vectors": self.vectors,
                "has_label": self.has_label, "classes": self.classes, "ids": self.ids, "common": self.common}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> "Schema":
        return cls(frozenset(obj["keep"]), {k: v for k, v in obj["kinds"]}, obj["vectors"], obj["has_label"],
                   obj["classes"], obj["ids"], obj.get("common", {}))


class Merge:
    """The files' summaries merged in file order, one at a time: memory for keys and classes, not files.

    Args:
        strict: records.py's rules (Parquet): every key seen is kept, and a float field missing from a whole
            file is an error; else the tars' (a key is kept where every sample has it numeric).
    """

    def __init__(self, strict: bool = False) -> None:
        self.strict = strict
        self.counts: list[int] = []
        self.digests: list[str] = []  # each file's: its tar index's sha256, or its Parquet footer's identity
        self.keep: Optional[set[str]] = None  # the keys kept so far
        self.seen: set[str] = set()
        self.lacking: dict[str, str] = {}  # strict: a key -> a file with rows but without it
        self.with_rows: Optional[str] = None  # the first file with rows
        self.kinds: dict[str, str] = {}  # first-seen order, as one listing of every record gives it
        self.vectors: dict[str, int] = {}
        self.clash: dict[str, str] = {}  # a key's first problem: an error only if the key is kept
        self.first: dict[str, str] = {}
        self.labelled: dict[bool, str] = {}  # has 'label' -> a file that says so
        self.ids = -1
        self.ids_in = ""  # the file with the largest id
        self.names: set[str] = set()
        self.modes: dict[str, str] = {}  # "ids" | "names" -> the first file that gives them
        self.class_names: Optional[list[str]] = None  # a Hugging Face ClassLabel's, from the first file with them
        self.common: dict[str, tuple[Any, str]] = {}  # key -> (value, the first file that gave it)

    def add(self, label: str, s: dict[str, Any], digest: str) -> None:
        """File ``label``'s summary (``digest``: its index's sha256, or its footer's identity), after every
        file before it.

        Raises:
            SourceError: The file disagrees with an earlier one on what every file must share (the image
                column of Parquet files); strict: on any field (raised at once, not after every file).
        """
        self.counts.append(s["samples"])
        self.digests.append(digest)
        for key, value in s.get("common", {}).items():
            if self.common.setdefault(key, (value, label))[0] != value:
                raise SourceError(f"{label}: {key}: {value!r}, but {self.common[key][1]}: {self.common[key][0]!r}: "
                                  "give every file the same")
        if self.class_names is None and s.get("class_names"):
            self.class_names = s["class_names"]
        if not s["good"]:
            return
        seen = set(s["seen"])
        if self.strict:
            for key in (self.seen - seen) | ((seen - self.seen) if self.with_rows else set()):
                self.lacking.setdefault(key, label if key in self.seen else self.with_rows or label)
            self.with_rows = self.with_rows or label
            self.keep = (self.keep or set()) | seen
        else:
            self.keep = set(s["numeric"]) if self.keep is None else self.keep & set(s["numeric"])
        self.seen.update(seen)
        for key, problem in s["problems"].items():
            self.clash.setdefault(key, problem)
        for key, kind in s["kinds"]:
            self.first.setdefault(key, label)
            if self.kinds.setdefault(key, kind) != kind:
                self.clash.setdefault(key, f"{label}: {key!r} holds {kind} there and {self.kinds[key]} in "
                                           f"{self.first[key]}")
        for key, n in s["vectors"].items():
            if self.vectors.setdefault(key, n) != n:
                self.clash.setdefault(key, f"{label}: {key!r} has lists of length {n} there and "
                                           f"{self.vectors[key]} in {self.first[key]}: a float field has one "
                                           "length for every record")
        self.labelled.setdefault(s["has_label"], label)
        for mode, value in s["classes"].items():
            self.modes.setdefault(mode, label)
            if mode == "ids" and value > self.ids:
                self.ids, self.ids_in = value, label
            elif mode == "names":
                self.names.update(value)
        if self.strict:  # every key is kept: a disagreement is final now, hours before the last file's summary
            self._check(frozenset(self.keep or ()))

    def _check(self, keep: frozenset[str]) -> dict[str, str]:
        """The kept fields' kinds, once every check of `schema` passes.

        Raises:
            SourceError: As `schema`.
        """
        kinds = {k: v for k, v in self.kinds.items() if k in keep or k in FIXED}
        clash = next((self.clash[k] for k in [*kinds, *sorted(keep)] if k in self.clash), None)
        if clash:
            raise SourceError(clash)
        lacking = next((k for k, kind in kinds.items() if kind == "vector" and k in self.lacking), None)
        if lacking:
            raise SourceError(f"{self.lacking[lacking]}: {lacking!r} is missing from its records; a float field "
                              "needs a value in every record")
        if len(self.labelled) > 1:
            raise SourceError(f"{self.labelled[False]}: its samples have no 'label' while other files' have "
                              f"({self.labelled[True]}): give every sample one")
        if len(self.modes) > 1:
            raise SourceError(f"class labels mix ids and names across the files: {self.modes['ids']} gives ids, "
                              f"{self.modes['names']} names: use one or the other")
        return kinds

    def schema(self) -> Schema:
        """The merged schema.

        Raises:
            SourceError: A stored key's values disagree between files (or cannot be stored), some files'
                samples have labels and others' not, class labels mix ids and names, or (strict) a float
                field is missing from a file.
        """
        keep = frozenset(self.keep or ())
        if self.seen - keep:
            log.info("JSON keys not numeric in every sample, not stored: %s", sorted(self.seen - keep))
        kinds = self._check(keep)
        if ("boxes" in kinds) != ("box_labels" in kinds):
            raise SourceError("records give 'boxes' and 'box_labels' together (one class per box)")
        samples = sum(self.counts)
        named = bool(self.class_names) and len(self.class_names) > self.ids  # (a ClassLabel names every id)
        classes = ([str(i) for i in range(self.ids + 1)] if named else id_classes(self.ids, samples, self.ids_in)
                   ) if self.ids >= 0 else []
        ids: Optional[dict[str, int]] = None
        if set(self.modes) == {"names"}:
            names = sorted(self.names)
            classes, numbers = class_ids(names, samples, "the class names")
            ids = dict(zip(names, numbers))
        elif self.class_names and True in self.labelled and len(self.class_names) >= len(classes):
            classes = list(self.class_names)  # Hugging Face ClassLabel: ids keep their names
        return Schema(keep, kinds, {k: v for k, v in self.vectors.items() if k in keep},
                      True in self.labelled, classes, ids, {k: v for k, (v, _) in self.common.items()})
