"""Sample fields: what one sample of an image dataset holds beyond ``(image, label)``, and how each is stored.

NOTE [fields]: a sample is a set of named fields, declared once at preprocess time and listed in the
manifest's ``fields`` (npy format version 2; a version-1 dataset is ``image`` + ``label``). Kinds:

- ``image``: uint8 ``(S, S, 3)`` HWC, in ``images-K.npy`` as in version 1.
- ``label``: one int64 class id per sample, in ``labels-K.npy`` as in version 1.
- ``mask``: uint8 or uint16 ``(S, S)`` with the image's geometry (a class or instance id per pixel).
- ``vector``: float32 of a fixed ``shape`` (``()`` for a scalar target).
- ``labels``, ``tokens``, ``boxes``, ``box_labels``: a variable number of values per sample (class ids,
  caption token ids, float32 xyxy pixel boxes and their int64 class ids).

A fixed-size field ``F`` is one ``(n, *shape)`` npy file per shard, ``field.F-K.npy``. A variable one is
its values concatenated, ``field.F-K.npy`` ``(m, *shape)``, plus ``field.F.offsets-K.npy``: ``n + 1``
int64 offsets into that shard's values (``box_labels`` shares the offsets of ``boxes``). So a batch is
one vectorised read per field, and ``np.load`` reads every file without fastdata. In a batch, a variable
field ``F`` comes as ``batch[F]`` (the batch's values, concatenated) and ``batch[F + "_offsets"]``
(int64, ``B + 1``); ``boxes`` and ``box_labels`` share ``boxes_offsets``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from ..errors import FormatError

# kind -> (allowed dtypes, variable length, moves with the image's geometry)
KINDS: dict[str, tuple[tuple[str, ...], bool, bool]] = {
    "image": (("|u1",), False, True),
    "label": (("<i8",), False, False),
    "mask": (("|u1", "<u2"), False, True),
    "vector": (("<f4",), False, False),
    "labels": (("<i8",), True, False),
    "tokens": (("<u2", "<u4"), True, False),
    "boxes": (("<f4",), True, True),
    "box_labels": (("<i8",), True, False),
}
_NAMED = ("image", "label", "boxes", "box_labels")  # kinds whose field has the kind's name (at most one each)
_NAME = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
OFFSETS = "_offsets"  # batch key suffix of a variable field's offsets


@dataclass(frozen=True)
class Field:
    """One named field: its ``kind`` (see NOTE [fields]), numpy ``dtype`` string and per-sample (fixed) or
    per-value (variable) ``shape``."""

    name: str
    kind: str
    dtype: str
    shape: tuple[int, ...] = ()

    @property
    def variable(self) -> bool:
        return KINDS[self.kind][1]

    @property
    def spatial(self) -> bool:
        return KINDS[self.kind][2]

    @property
    def offsets_of(self) -> str:
        """The field whose offsets this one uses (itself, or ``boxes`` for ``box_labels``)."""
        return "boxes" if self.kind == "box_labels" else self.name

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(self.dtype)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "dtype": self.dtype, "shape": list(self.shape)}

    def files(self, k: int) -> list[str]:
        """Shard ``k``'s files of this field (not ``image`` or ``label``: they keep their version-1 files, the
        shard entry's ``images`` and ``labels``)."""
        assert self.kind not in ("image", "label"), self.kind
        own = [f"field.{self.name}-{k:05d}.npy"]
        return own + [offsets_file(self.name, k)] if self.variable and self.offsets_of == self.name else own


def valid_name(name: str) -> bool:
    """A field name: lower-case letters, digits and _, not ending in the offsets suffix."""
    return bool(_NAME.match(name)) and not name.endswith(OFFSETS)


def offsets_file(name: str, k: int) -> str:
    return f"field.{name}.offsets-{k:05d}.npy"


def check_fields(fields: list[Field], where: str) -> list[Field]:
    """Refuse a field list a reader would misread: unknown kinds, bad dtypes or names, duplicates."""
    names = set()
    for f in fields:
        if f.kind not in KINDS:
            raise FormatError(f"{where}: field {f.name!r} has unknown kind {f.kind!r}; this fastdata knows "
                              f"{sorted(KINDS)}: upgrade fastdata")
        if not valid_name(f.name) or f.name in names:
            raise FormatError(f"{where}: bad or repeated field name {f.name!r} (lower-case letters, digits, _)")
        if f.dtype not in KINDS[f.kind][0] or any(not isinstance(d, int) or d < 1 for d in f.shape):
            raise FormatError(f"{where}: field {f.name!r} ({f.kind}) has dtype {f.dtype} shape {f.shape}, expected "
                              f"one of {KINDS[f.kind][0]}: the manifest is damaged")
        names.add(f.name)
    kinds = [f.kind for f in fields]
    if kinds.count("image") != 1 or any((f.kind in _NAMED or f.name in _NAMED) and f.name != f.kind for f in fields):
        raise FormatError(f"{where}: a dataset has one field 'image', and fields of kinds {_NAMED} are named so")
    if ("box_labels" in kinds) != ("boxes" in kinds):
        raise FormatError(f"{where}: boxes come as fields named 'boxes' and 'box_labels', together")
    return fields


def fields_of(manifest: dict[str, Any], where: str = "manifest") -> Optional[list[Field]]:
    """The manifest's fields, checked; None for a version-1 (image + label) dataset."""
    raw = manifest.get("fields")
    if raw is None:
        return None
    try:
        fields = [Field(r["name"], r["kind"], r["dtype"], tuple(r.get("shape", ()))) for r in raw]
    except (TypeError, KeyError) as exc:
        raise FormatError(f"{where}: 'fields' is malformed ({exc!r}): the manifest is damaged") from exc
    return check_fields(fields, where)


def batch_keys(fields: list[Field]) -> list[str]:
    """The keys of a batch dict, in order: each field, then each variable field's offsets."""
    keys = [f.name for f in fields]
    return keys + [f.name + OFFSETS for f in fields if f.variable and f.offsets_of == f.name]
