"""``manifest.json``: what a dataset folder holds, how it was made, and the checksum of every file.

The manifest is written last (atomically), so a folder without one is an unfinished run. Readers call
`load_manifest`, which refuses unknown formats and versions before anything else is read.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from .._io import HASH_NAME, plain_relative, write_json_atomic
from .._version import __version__
from ..errors import FormatError, VersionError, is_whole
from .rows import Rows, column, compact_rows, has_columns, int_column, is_rows, suspect_paths
from .rows_json import ROWS, EachKey, canonical_pieces, loads_with_rows
from .schema import fields_of

MANIFEST_NAME = "manifest.json"
PARTIAL_DIR = ".fastdata-partial"  # journal and parts of an unfinished preprocess run
IMAGES_NPY = "fastdata.images.npy"
IMAGES_LMDB = "fastdata.images.lmdb"
TOKENS = "fastdata.tokens"  # the on-disk format name, not a module: never rename it
# format name -> highest version this fastdata reads; bump the version when a reader would misread old files.
# LMDB 2: shards, LMDB 3: sample fields (lmdb_store.py), LMDB 4: keys per shard and shards of uneven sizes;
# npy 2: sample fields beyond (image, label) (formats/schema.py), npy 3: shards of uneven sizes (formats/base.py)
FORMAT_VERSIONS: dict[str, int] = {IMAGES_NPY: 3, IMAGES_LMDB: 4, TOKENS: 2}
UNEVEN_SHARDS = {IMAGES_NPY: 3, IMAGES_LMDB: 4}  # the version from which shards may hold fewer than shard_size


def fastdata_version() -> str:
    return __version__


def new_manifest(fmt: str, version: Optional[int] = None, **fields: Any) -> dict[str, Any]:
    """A manifest of ``fmt`` at ``version`` (default: the newest; a writer names an older one when its
    output needs nothing newer, so older readers still read it)."""
    return {"format": fmt, "format_version": version or FORMAT_VERSIONS[fmt], "fastdata_version": fastdata_version(),
            **fields}


def manifest_digest(manifest: dict[str, Any]) -> str:
    """The sha256 of a manifest's content (its canonical JSON): the dataset version a loader's state names,
    the same whichever copy (a folder, a URL, a node cache) it was read from."""
    digest = hashlib.sha256()
    for piece in canonical_pieces(manifest):  # (its `Rows` a few thousand at a time: NOTE [compact manifest])
        digest.update(piece.encode())
    return digest.hexdigest()


def write_manifest(root: Path, manifest: dict[str, Any]) -> None:
    write_json_atomic(Path(root) / MANIFEST_NAME, manifest)


def load_manifest(root: Path | str, formats: Optional[tuple[str, ...]] = None) -> dict[str, Any]:
    """Read and validate a dataset folder's ``manifest.json``.

    Unknown formats and versions are refused before anything else is read.

    Args:
        root: The dataset folder.
        formats: The format names accepted, such as ``("fastdata.images.npy",)`` (default None: any known one).

    Returns:
        The manifest as a dict: format and version, counts, shapes, dtypes, the files with their sizes and
        checksums, the preprocessing parameters and source.

    Raises:
        FormatError: ``root`` is not a folder, has no manifest (an unfinished run says so), or the manifest is
            not valid JSON, not a fastdata manifest, of an unknown format, not one of ``formats``, or damaged.
        VersionError: The manifest was written by a format version this fastdata cannot read.

    Examples:
        >>> m = load_manifest("data/train")
        >>> m["format"], m["num_samples"]
        ('fastdata.images.npy', 1281167)
    """
    return check_manifest(_parsed(Path(root)), root, formats, where=str(Path(root) / MANIFEST_NAME))


def load_columns(root: Path | str, formats: Optional[tuple[str, ...]] = None) -> dict[str, Any]:
    """`load_manifest` for a reader that keeps the manifest: its long lists held as `Rows` before they are
    checked, so that the checks read whole columns (NOTE [compact manifest])."""
    return check_manifest(_parsed(Path(root), True), root, formats, where=str(Path(root) / MANIFEST_NAME),
                          columns=True)


def parse_manifest(text: str, columns: bool = False) -> Any:
    """A manifest's JSON text parsed; ``columns``: its long lists compacted while they are parsed, as
    `compact` leaves them (NOTE [compact manifest] rule 4), for a reader that keeps it.

    Raises:
        json.JSONDecodeError: ``text`` is not JSON.
    """
    try:
        if not columns:
            return json.loads(text)
        manifest = loads_with_rows(text, _LONG_LISTS)
    except RecursionError:  # (nested deeper than the parser's stack: never a manifest fastdata wrote)
        raise json.JSONDecodeError("nested too deeply", text, 0) from None
    splits = manifest.get("splits") if isinstance(manifest, dict) and manifest.get("format") != TOKENS else None
    if isinstance(splits, dict) and any(isinstance(s, dict) and isinstance(s.get("shards"), Rows)
                                        for s in splits.values()):
        manifest["splits"] = json.loads(text)["splits"]  # (only a token manifest's are compacted: `compact`)
    return manifest


_LONG_LISTS = {"files": ROWS, "shards": ROWS, "lmdb_shards": ROWS, "splits": EachKey({"shards": ROWS})}


def _parsed(root: Path, columns: bool = False) -> Any:
    """The JSON of ``root``'s manifest, unchecked."""
    path = root / MANIFEST_NAME
    if not root.is_dir():
        raise FormatError(f"{root} is not a folder: pass a dataset folder made by `fastdata preprocess`")
    if not path.is_file():
        hint = " (an unfinished run: rerun the same `fastdata preprocess` to resume)" if (
            root / PARTIAL_DIR).exists() else ""
        raise FormatError(f"{root} has no {MANIFEST_NAME}: it is not a fastdata dataset{hint}")
    try:
        return parse_manifest(path.read_text(encoding="utf-8"), columns)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FormatError(f"{path} is not valid JSON ({exc}): the manifest is damaged") from exc


def check_manifest(manifest: Any, root: Path, formats: Optional[tuple[str, ...]] = None, *,
                   where: str, columns: bool = False) -> dict[str, Any]:
    """``manifest`` (already parsed, e.g. fetched from object storage) checked as `load_manifest`
    checks a file: a known format and version, one of ``formats``, paths inside ``root``, a sound layout.
    ``where`` names it in messages; ``columns`` compacts it first (`compact`, in place)."""
    if not isinstance(manifest, dict) or "format" not in manifest or "format_version" not in manifest:
        raise FormatError(f"{where} lacks 'format'/'format_version': not a fastdata manifest")
    fmt, version = manifest["format"], manifest["format_version"]
    if not isinstance(fmt, str) or fmt not in FORMAT_VERSIONS:
        raise FormatError(f"{where}: unknown format {fmt!r}; this fastdata reads {sorted(FORMAT_VERSIONS)}")
    if not isinstance(version, int) or version > FORMAT_VERSIONS[fmt] or version < 1:
        raise VersionError(
            f"{where}: {fmt} version {version!r} was written by fastdata {manifest.get('fastdata_version', '?')}; "
            f"this fastdata {fastdata_version()} reads up to version {FORMAT_VERSIONS[fmt]}: upgrade fastdata"
        )
    if formats is not None and fmt not in formats:
        raise FormatError(f"{where} holds {fmt}, but this reader needs one of {list(formats)}")
    if columns:
        compact(manifest)
    files = manifest.get("files")
    if not is_rows(files):
        raise FormatError(f"{where} has no 'files' list: the manifest is damaged")
    if not has_columns(files, ints=("bytes",), texts=("path", HASH_NAME)):
        bad = next((e for e in files if not has_columns([e], ints=("bytes",), texts=("path", HASH_NAME))), None)
        raise FormatError(f"{where} lists {bad!r} as a file, not a path, its size in bytes and its {HASH_NAME}: "
                          "the manifest is damaged")
    for path in suspect_paths(files):
        plain_relative(root, path)  # refuse paths that escape the folder before any use (NOTE [manifest paths])
    if (fmt == IMAGES_NPY and version >= 2) or (fmt == IMAGES_LMDB and version >= 3):
        fields_of(manifest, where)  # refuses unknown kinds, bad dtypes, a missing image field
    check_layout(manifest, where)
    return manifest


def compact(manifest: dict[str, Any]) -> dict[str, Any]:
    """``manifest`` with its files and shards held as `Rows` (NOTE [compact manifest]), changed in place: what a
    dataset keeps (a manifest returned by `load_manifest` stays plain JSON data). Anything else is left as it
    is, for the checks to refuse."""
    for key in ("files", "shards", "lmdb_shards"):
        if key in manifest:
            manifest[key] = compact_rows(manifest[key])
    splits = manifest.get("splits") if manifest.get("format") == TOKENS else None
    for split in splits.values() if isinstance(splits, dict) else ():
        if isinstance(split, dict) and "shards" in split:
            split["shards"] = compact_rows(split["shards"])
    return manifest


def _count(value: Any) -> bool:
    return is_whole(value) and value >= 0


def check_layout(manifest: dict[str, Any], where: str) -> None:
    """Refuse a manifest whose numbers cannot describe its files (an edited or damaged one). Readers map
    sample ``i`` to its shard by the shards' sample counts (`ShardIndex`) and a token window to its shard by
    the shards' token counts: a wrong count, shape or dtype would serve wrong rows, or fail deep inside a
    batch, instead of here with one line. So would the keys beside them that readers and ``inspect`` use:
    the labels file, an LMDB's stored sizes, the class counts, the skipped inputs."""
    def refuse(what: str) -> None:
        raise FormatError(f"{where}: {what}: the manifest is damaged; re-run `fastdata preprocess` (or restore "
                          "the dataset's own manifest.json)")

    fmt = manifest["format"]
    if not isinstance(manifest.get("skipped", []), list):
        refuse(f"'skipped' (the list of inputs left out) is {_brief(manifest['skipped'])}")
    if "skipped_count" in manifest and not _count(manifest["skipped_count"]):
        refuse(f"skipped_count is {_brief(manifest['skipped_count'])}, not a count")
    if fmt == TOKENS:
        if manifest.get("dtype") not in ("<u2", "<u4"):
            refuse(f"token dtype {manifest.get('dtype')!r} is not '<u2' or '<u4'")
        tok = manifest.get("tokenizer")
        named = isinstance(tok, dict) and all(isinstance(tok.get(k), str)
                                              for k in ("spec", "kind", "definition_sha256"))
        if not (named and _count(tok.get("vocab_size")) and _count(tok.get("eos_id"))
                and tok["eos_id"] < tok["vocab_size"]):
            refuse(f"its tokenizer {tok!r} is not a spec, kind, definition_sha256, vocab_size and an end-of-document "
                   "id below it")
        splits = manifest.get("splits")
        if not isinstance(splits, dict) or not splits:
            refuse("it has no 'splits'")
        for name, split in splits.items():
            shards = split.get("shards") if isinstance(split, dict) else None
            if not has_columns(shards, ints=("tokens",), texts=("path",)):
                refuse(f"split {name!r} has no list of shards with paths and token counts")
            tokens = sum(column(shards, "tokens"))
            if not _count(split.get("tokens")) or split["tokens"] != tokens:
                refuse(f"split {name!r} says {split.get('tokens')!r} tokens, its shards hold {tokens}")
            if manifest["format_version"] >= 2 and not (  # each shard's document offsets beside it
                    has_columns(shards, ints=("documents",), texts=("docs",))
                    and split.get("documents") == sum(column(shards, "documents"))):
                refuse(f"split {name!r} lacks its shards' document counts and offsets files")
        return
    n = manifest.get("num_samples")
    if not _count(n):
        refuse(f"num_samples is {n!r}")
    classes = manifest.get("classes")
    if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
        refuse("'classes' is not a list of names")
    counts = manifest.get("class_counts", [0] * len(classes))
    if not (isinstance(counts, list) and len(counts) == len(classes) and all(_count(c) for c in counts)):
        refuse(f"class_counts {_brief(counts)} is not a count for each of its {len(classes)} classes")
    _check_labels_file(manifest, where, refuse)
    if fmt == IMAGES_LMDB:
        for key, side in (("max_short_side", "shorter"), ("max_side", "longer")):  # (max_side: --resize max-side)
            value = manifest.get(key)
            if (key in manifest or key == "max_short_side") and not (_count(value) and value > 0):
                refuse(f"{key} (the stored images' largest {side} side, in pixels) is {_shown(manifest, key)}")
    if fmt == IMAGES_NPY:
        shape = manifest.get("sample_shape")
        if (not isinstance(shape, list) or len(shape) != 3 or not all(_count(d) and d > 0 for d in shape)
                or shape[2] != 3):
            refuse(f"sample_shape {shape!r} is not [height, width, 3]")
        if manifest.get("dtype") != "|u1":
            refuse(f"image dtype {manifest.get('dtype')!r} is not '|u1' (uint8)")
        key = "shards"
    elif "lmdb_shards" in manifest:
        key = "lmdb_shards"
    else:  # LMDB format version 1: one store
        if not isinstance(manifest.get("lmdb"), str):
            refuse("it names no LMDB store")
        return
    shards, size = manifest.get(key), manifest.get("shard_size")
    if not _count(size) or size < 1:
        refuse(f"shard_size is {size!r}")
    if not has_columns(shards, ints=("samples",)):
        refuse(f"'{key}' is not a list of shards with sample counts")
    counts = column(shards, "samples")
    if manifest["format_version"] >= UNEVEN_SHARDS[fmt]:  # shards shortened by bad samples: at most size each
        wrong = sum(counts) != n or any(c > size for c in counts)
    else:
        wrong = sum(counts) != n or any(c != size for c in counts[:-1]) or (counts and not 0 < counts[-1] <= size)
    if wrong:
        refuse(f"its {len(counts)} shards hold {counts[:3]}{'...' if len(counts) > 3 else ''} samples, not "
               f"{n} samples in shards of {size}")


def _check_labels_file(manifest: dict[str, Any], where: str, refuse: Callable[[str], None]) -> None:
    """The file holding every label (an LMDB's ``labels``, an npy dataset's ``all_labels``) is one the manifest
    lists, so that it is sized and checked like the others: an LMDB with class labels must name one; an npy
    dataset made before ``all_labels`` reads each shard's labels file instead."""
    key = "labels" if manifest["format"] == IMAGES_LMDB else "all_labels"
    fields = fields_of(manifest, where)
    if key not in manifest and not (key == "labels" and (fields is None or any(f.kind == "label" for f in fields))):
        return
    name, files = manifest.get(key), manifest["files"]
    if not isinstance(name, str):
        refuse(f"'{key}' (the file of every sample's label) is {_shown(manifest, key)}")
    if (files.find("path", name) is None) if isinstance(files, Rows) else all(e["path"] != name for e in files):
        refuse(f"'{key}' names {name!r} as the file of every sample's label, but its files do not list it")


def _brief(value: Any) -> str:
    """``value`` as a message shows it: its repr, cut short."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _shown(manifest: dict[str, Any], key: str) -> str:
    """``manifest[key]`` as a message shows it, or "missing"."""
    return _brief(manifest[key]) if key in manifest else "missing"


def shard_starts(manifest: dict[str, Any]) -> np.ndarray:
    """Each image shard's first sample, then the number of samples (int64; a one-store LMDB: ``[0, n]``)."""
    shards = manifest.get("shards", manifest.get("lmdb_shards"))
    if shards is None:
        return np.array([0, int(manifest["num_samples"])], dtype=np.int64)
    starts = np.zeros(len(shards) + 1, dtype=np.int64)
    np.cumsum(int_column(shards, "samples"), out=starts[1:])  # (no list of a million ints)
    return starts


class ShardIndex:
    """Sample ``i``'s shard and row from the shards' first samples (`shard_starts`): ``i // shard_size`` when
    every shard but the last is full (every dataset written before format versions npy 3 / LMDB 4, and
    most after), else a binary search (shards shortened by samples that did not decode)."""

    def __init__(self, starts: np.ndarray) -> None:
        self.starts = np.asarray(starts, dtype=np.int64)
        counts = np.diff(self.starts)
        self.size = int(counts[0]) if len(counts) else 1
        self.uniform = self.size > 0 and bool((counts[:-1] == self.size).all()) and bool((counts <= self.size).all())

    def shard_of(self, idx: np.ndarray) -> np.ndarray:
        if self.uniform:
            return idx // self.size
        return np.searchsorted(self.starts, idx, side="right") - 1

    def locate(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(shard, row)`` of each sample index in ``idx`` (int64 arrays)."""
        shard = self.shard_of(idx)
        return shard, idx - self.starts[shard]


def total_bytes(manifest: dict[str, Any]) -> int:
    return sum(column(manifest["files"], "bytes"))


def describe(root: Path | str) -> dict[str, Any]:
    """Summarise a dataset folder, as ``fastdata inspect`` shows it.

    Args:
        root: The dataset folder.

    Returns:
        A JSON-ready dict: format and versions, sample count, counts per class, sample shape and dtype, fields,
        splits and tokenizer (token datasets), file count, total bytes, skipped inputs, preprocessing
        parameters and source, and the folder's path.

    Raises:
        FormatError: ``root`` is not a dataset folder, or its manifest is damaged.
        VersionError: The manifest was written by a format version this fastdata cannot read.
    """
    root = Path(root)
    m = load_manifest(root)
    out = {k: m.get(k) for k in ("format", "format_version", "fastdata_version", "num_samples", "params", "source")}
    if "classes" in m:
        out["classes"] = dict(zip(m["classes"], m.get("class_counts", [])))
    if m["format"] == TOKENS:
        out["tokenizer"] = m["tokenizer"]
        out["dtype"] = m["dtype"]
        out["splits"] = {k: {"tokens": v["tokens"], "documents": v.get("documents"), "shards": len(v["shards"])}
                         for k, v in m["splits"].items()}
        out["bytes_per_token"] = m.get("bytes_per_token")
        out["skipped"] = m.get("skipped_count", 0)
    if "fields" in m:
        out["fields"] = {f["name"]: f"{f['kind']} {f['dtype']} {tuple(f['shape'])}" for f in m["fields"]}
    for k in ("sample_shape", "dtype", "layout", "label_dtype", "shard_size", "max_short_side", "encoding"):
        if k in m:
            out[k] = m[k]
    out["files"] = len(m["files"])
    out["bytes"] = total_bytes(m)
    out.setdefault("skipped", len(m.get("skipped", [])))
    out["path"] = str(root)
    return out
