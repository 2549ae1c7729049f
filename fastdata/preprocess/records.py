"""Sources of samples with fields (NOTE [fields] in fastdata/formats/schema.py): JSONL/CSV records, a segmentation pair of
folders and a COCO detection JSON over an image folder (and, read by the same rules, Parquet files: parquet.py).

Each becomes a `Source` whose ``extras`` hold one raw value per sample
and field; the values are checked against the image (sizes, boxes, classes) by the decoding workers, so a
bad record follows ``--on-error`` with its file and record named, like an undecodable image.

Record keys (JSONL objects, CSV columns): ``image`` (a path relative to the file's folder; required),
``label`` (an id or a class name), ``labels`` (a list of ids or names; in CSV separated by spaces or
``;``), ``mask`` (a path), ``boxes`` (``[[x1, y1, x2, y2], ...]`` in the image's pixels) with
``box_labels`` (one id or name per box); any other key holding a number or a list of numbers is a float
``vector`` field, and one holding text is a ``tokens`` field (a caption, tokenised at preprocess time).
A record its worker refuses whatever its image shows, or whose image or mask file is missing, lists no
class (NOTE [refused records] in fastdata/preprocess/fields.py).
"""
from __future__ import annotations

import csv
import json
import os
import posixpath
import re
from pathlib import Path
from typing import Any, Iterator, Optional, Union

from ..errors import SourceError, is_whole
from ..formats.schema import valid_name
from .fields import refusals
from .sources import (Source, class_ids, discover, fits_float, id_classes, id_limit, is_id, is_image_name, locate,
                      mixed_ids, mixing_message, shown)
from .url_reads import UrlBlobs, open_text, parent

Where = Union[Path, str]  # a local path, or a URL (NOTE [url source] in fastdata/preprocess/url_reads.py)

CLASS_KEYS = ("label", "labels", "box_labels")  # keys whose values are class ids or names, one class list
_SPLIT = re.compile(r"[;\s]+")


def split_labels(text: str) -> list[str]:
    """A ``labels`` value given as text (CSV: ``"cat dog"`` or ``"cat;dog"``) as its class names."""
    return [t for t in _SPLIT.split(text) if t]


def _rel(root: Where, rel: Any, where: str, folders: Optional[dict[str, Path]] = None) -> tuple[str, bool]:
    """A record's path, relative to ``root`` and never outside it (``folders``: `locate`'s, for a source), and
    whether a worker can read it (`locate`)."""
    if not isinstance(rel, str) or not rel.strip():
        raise SourceError(f"{where}: expected a relative file path, got {rel!r}")
    return locate(root, rel.strip(), where, "the folder", folders)


def kind_of(key: str, value: Any) -> Optional[str]:
    """The field kind a record's ``key`` holding ``value`` makes; None if it cannot be stored."""
    if key in ("label", "labels", "mask", "boxes", "box_labels"):
        return key
    if isinstance(value, str):
        return "tokens"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return "vector"
    if isinstance(value, list) and value and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                 for v in value):
        return "vector"
    return None


def from_records(rows: Iterator[tuple[str, dict[str, Any]]], location: Where, root: Where, kind: str,
                 paths: Optional[list[str]] = None, schema: Any = None, refused: Optional[set[int]] = None) -> Source:
    """A Source from ``(where, record)`` pairs (``where`` names the file and line for messages); ``paths``
    given (Parquet, tars: the images are in the rows) replace the records' ``image`` paths, and integer class
    ids are left to the merged schema (NOTE [class ids] rule 4 in sources.py: ``classes`` is then ``[]``). A
    URL ``root`` gives a Source that reads its images (and masks) there. A record its worker will refuse
    lists no class (NOTE [refused records] in fastdata/preprocess/fields.py).

    Args:
        schema: The merged `index_schema.Schema` of an indexed source's piece: its ``class_id`` gives the
            records' class ids (``classes`` is then ``[]``).
        refused: Filled with the positions of the records that list no class in a file's summary, where
            given: those refused for a float value are not (NOTE [refused records] rule 4).
    """
    given = paths is not None
    paths = list(paths) if given else []
    raw: dict[str, list[Any]] = {}
    kinds: dict[str, str] = {}
    folders: dict[str, Path] = {}  # (`locate`'s resolved folders, kept across the rows)
    unread: set[int] = set()  # records whose image or mask is no file a worker reads
    n = 0
    for where, rec in rows:
        if not given and "image" not in rec:
            raise SourceError(f"{where}: the record has no 'image' path (keys: {sorted(rec)})")
        if not given:
            path, found = _rel(root, rec["image"], where, folders)
            paths.append(path)
            if not found:
                unread.add(n)
        for key, value in rec.items():
            if key == "image" or value is None:
                continue
            k = kind_of(key, value)
            if key == "label" and isinstance(value, (list, tuple, dict)):
                raise SourceError(f"{where}: 'label' holds {shown(value)}: a sample's class is one id or name; "
                                  "give several classes as 'labels' (a list)")
            if k is None and isinstance(value, list) and value and all(isinstance(v, str) for v in value):
                raise SourceError(f"{where}: {key!r} holds {len(value)} texts {shown(value)}: a text field holds one "
                                  f"text (a caption): keep one as {key!r} and store the others under keys of their "
                                  "own, one text each, or leave them out")
            if k is None or not valid_name(key):
                raise SourceError(f"{where}: cannot store {key!r} = {value!r}: use a lower-case name and a number, "
                                  "a list of numbers, a class id/name, a path ('mask') or text")
            if kinds.setdefault(key, k) != k:
                raise SourceError(f"{where}: {key!r} holds {k} here and {kinds[key]} in earlier records")
            col = raw.get(key)
            if col is None:  # a key first seen here: None for the records before (built once, not per record)
                col = raw[key] = [None] * n
            col.append(value)
        n += 1
        for col in raw.values():
            if len(col) < n:
                col.append(None)
    if ("boxes" in kinds) != ("box_labels" in kinds):
        raise SourceError(f"{location}: records give 'boxes' and 'box_labels' together (one class per box)")
    extras: dict[str, list[Any]] = {}
    for key, col in raw.items():
        extras[key] = _column(key, kinds[key], col, location, root, paths, unread, schema is None)
    bad, boxed = refusals(kinds, extras)
    bad |= unread
    if refused is not None:  # (a float refuses only where its key is stored: NOTE [refused records] rule 4)
        refused.update(unread, refusals({k: v for k, v in kinds.items() if v != "vector"}, extras)[0])
    listed = {k: extras[k] for k in CLASS_KEYS if k in extras}  # (the refused records' values, as given)
    if schema is None:
        classes, extras = _classes(extras, location, None if given else n, paths, bad)
    else:
        classes, extras = [], _schema_ids(extras, schema, bad, location)
    if bad:
        extras = _refused_ids(extras, listed, bad, boxed, len(schema.classes if schema is not None else classes))
    has_label = "label" in extras
    labels = extras.pop("label") if has_label else [0] * n
    kinds.pop("label", None)
    if isinstance(root, str):  # the images are objects under the records' folder URL
        return Source(kind, location, Path("."), paths, labels, classes, kinds, extras, has_label,
                      None if given else UrlBlobs(root, paths))
    return Source(kind, location, root, paths, labels, classes, kinds, extras, has_label)


def _column(key: str, kind: str, col: list[Any], location: Where, root: Where, paths: list[str],
            unread: set[int], tag_ids: bool = True) -> list[Any]:
    """One field's values, checked for what the source alone can tell; None stays where a record lacks it.
    Masks at a URL become full URLs (the worker reads them: fastdata/preprocess/fields.py); a mask that is no
    file a worker reads adds its record to ``unread``; ``tag_ids``: text ``labels`` of digits only become ids."""
    if kind == "mask":
        full = (lambda rel: posixpath.join(root, rel)) if isinstance(root, str) else (lambda rel: rel)
        folders: dict[str, Path] = {}
        out = []
        for i, v in enumerate(col):
            if v is None:
                out.append(None)
                continue
            rel, found = _rel(root, v, f"{location}: {key}", folders)
            out.append(full(rel))
            if not found:
                unread.add(i)
        return out
    if kind == "vector":
        shapes = {(len(v) if isinstance(v, list) else -1) for v in col if v is not None}
        if len(shapes) > 1:
            raise SourceError(f"{location}: {key!r} has lists of different lengths {sorted(shapes)}: a float field "
                              "has one length for every record")
        if any(v is None for v in col):
            raise SourceError(f"{location}: {key!r} is missing from some records (record {col.index(None)}); "
                              "a float field needs a value in every record")
        try:
            return [[float(x) for x in v] if isinstance(v, list) else float(v) for v in col]
        except OverflowError:  # an integer past float's 1.8e308: JSON and int() read any number of digits
            i, v = next((i, v) for i, v in enumerate(col) if not fits_float(v))
            raise SourceError(f"{location}: {key!r} of record {i + 1} ({paths[i]}) is {shown(v)}, too large for a "
                              "float field (at most 1.8e308): fix or drop that record") from None
    if kind == "labels":  # each value by its own type: text (CSV: "cat dog", "0 3") or a list (JSON may mix them)
        text = [isinstance(v, str) for v in col]
        col = [split_labels(v) if t else v for v, t in zip(col, text)]
        # ids when every tag is one (in a piece of an indexed source its schema says: "007" is its own class)
        if tag_ids and any(text) and all(is_id(x) for v, t in zip(col, text) if t for x in v):
            col = [[int(x) for x in v] if t else v for v, t in zip(col, text)]
    if kind == "box_labels":  # one bare id or name: one box's class
        return [[] if v is None else v if isinstance(v, list) else [v] for v in col]
    if kind in ("labels", "boxes"):
        return [[] if v is None else v for v in col]
    if kind == "label" and any(v is None for v in col):
        raise SourceError(f"{location}: 'label' is missing from record {col.index(None)}; give every record one")
    return col


def _classes(extras: dict[str, list[Any]], location: Where, samples: Optional[int], paths: list[str],
             unlisted: Optional[set[int]] = None) -> tuple[list[str], dict[str, list[Any]]]:
    """One class list for label/labels/box_labels: integer ids keep their ids (below `id_limit` of ``samples``;
    None: a file of an indexed source, NOTE [class ids] in sources.py), names are sorted. The records in
    ``unlisted`` list none: their values come back None (`_refused_ids` replaces them)."""
    if unlisted:
        extras = {k: [None if i in unlisted else v for i, v in enumerate(col)] if k in CLASS_KEYS else col
                  for k, col in extras.items()}
    names = [v for key in CLASS_KEYS if key in extras for rec in extras[key] if rec is not None
             for v in (rec if isinstance(rec, list) else [rec])]
    if not names:
        return [], extras
    if all(is_whole(v) for v in names):
        low, top = min(names), max(names)
        if low < 0:
            raise SourceError(f"{location}: class ids must be >= 0, got {low} (the {_sample_of(extras, low, paths)}; "
                              "Hugging Face writes -1 in an unlabelled split: drop its label column, or preprocess a "
                              "labelled split)")
        if samples is not None and top >= id_limit(samples):
            location = f"{location}, the {_sample_of(extras, top, paths)}"
        return id_classes(top, samples, str(location)), extras
    at = next((i for i, v in enumerate(names) if not (is_whole(v) or isinstance(v, str))), None)
    if at is not None:  # (a float: pandas makes an int column with a gap one)
        odd = names[at]
        raise SourceError(f"{location}: {shown(odd)} ({type(odd).__name__}) is the {_sample_of(extras, odd, paths)}: "
                          "class labels are integer ids >= 0 or names; convert that column (or JSON key)")
    if not all(isinstance(v, str) for v in names):
        ids = is_whole(names[0])  # the first value says which kind the others should be
        bad = next(v for v in names if (not is_whole(v) if ids else not isinstance(v, str)))
        raise SourceError(f"{location}: class labels mix ids and names: {shown(bad)} is the "
                          f"{_sample_of(extras, bad, paths)}, but {shown(names[0])}, the "
                          f"{_sample_of(extras, names[0], paths)}, is {'an id' if ids else 'a name'}: give every "
                          "label as an integer id >= 0, or every one as a name")
    single = [*extras.get("label", ()), *(v for rec in extras.get("box_labels", ()) if rec is not None for v in rec)]
    mixed = mixed_ids(single)  # (the tags of `labels` may mix: "cat 2024")
    if mixed is not None:
        an_id, name = (f"{single[i]!r} (the {_sample_of(extras, single[i], paths)})" for i in mixed)
        raise SourceError(mixing_message(str(location), an_id, name))
    classes, numbers = class_ids(names, samples, str(location))
    ids = dict(zip(names, numbers))
    out = dict(extras)
    for key in CLASS_KEYS:
        if key in extras:
            out[key] = [None if rec is None else [ids[v] for v in rec] if isinstance(rec, list) else ids[rec]
                        for rec in extras[key]]
    return classes, out


def _schema_ids(extras: dict[str, list[Any]], schema: Any, bad: set[int], location: Where) -> dict[str, list[Any]]:
    """A piece's class values as the merged schema's ids (``schema.class_id``), the records in ``bad`` left
    as they are (`_refused_ids` replaces them).

    Raises:
        SourceError: A value is not in the schema: its file changed since the run summarised it.
    """
    out = dict(extras)
    for key in CLASS_KEYS:
        if key in extras:
            try:
                out[key] = [v if i in bad else schema.class_id(v) for i, v in enumerate(extras[key])]
            except KeyError as exc:
                raise SourceError(f"{location}: class {exc.args[0]!r} is not in this run's class list: its files "
                                  "changed since the run listed them; rerun with --overwrite") from None
    return out


def _refused_ids(extras: dict[str, list[Any]], listed: dict[str, list[Any]], bad: set[int], boxed: set[int],
                 top: int) -> dict[str, list[Any]]:
    """The class values of the records in ``bad`` (``listed``: as given) as ``top``, one past the last class,
    which the worker refuses should such a record be read after all (its file appeared since), one a value;
    the box classes of those refused for their boxes stay as given, for their message (NOTE [refused
    records] rule 3)."""
    out = dict(extras)
    for key, given in listed.items():
        col = list(extras[key])
        for i in bad:
            v = given[i]
            col[i] = v if key == "box_labels" and i in boxed else [top] * len(v) if isinstance(v, list) else top
        out[key] = col
    return out


def _sample_of(extras: dict[str, list[Any]], value: Any, paths: list[str]) -> str:
    """Which sample holds the class value ``value``: ``"label of PATH (record N)"``, for a message (only ever on
    the error path: a scan of every record)."""
    for key in CLASS_KEYS:
        for i, rec in enumerate(extras.get(key, ())):
            if any(type(v) is type(value) and v == value for v in (rec if isinstance(rec, list) else [rec])):
                return f"{key} of " + (f"{paths[i]} (record {i + 1})" if i < len(paths) else f"record {i + 1}")
    return "?"


# -- the source kinds ---------------------------------------------------------------------------------------
def jsonl_records(path: Where) -> Source:
    def rows() -> Iterator[tuple[str, dict[str, Any]]]:
        for lineno, line in enumerate(_lines(path), start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise SourceError(f"{path}:{lineno}: not a JSON object ({exc.msg})") from exc
            except ValueError:  # Python reads no integer of over 4300 digits (CVE-2020-10735)
                raise SourceError(f"{path}:{lineno}: a number of over 4300 digits: fix or drop that line") from None
            except RecursionError:
                raise SourceError(f"{path}:{lineno}: JSON nested deeper than a JSON parser reads: fix or drop that "
                                  "line") from None
            if not isinstance(rec, dict):
                raise SourceError(f"{path}:{lineno}: expected a JSON object per line, got {type(rec).__name__}")
            yield f"{path}:{lineno}", rec
    return from_records(rows(), path, parent(path), "jsonl")


def is_record_csv(path: Where) -> bool:
    """A CSV whose header names an ``image`` column (a ``path,label`` list has no such header)."""
    try:
        with open_text(path) as f:
            header = next(csv.reader(f), [])
    except (OSError, UnicodeDecodeError, csv.Error):
        return False
    return "image" in [c.strip().lower() for c in header]


def csv_records(path: Where) -> Source:
    """The records of a CSV with an ``image`` column. A column is numbers only when every cell of it is one
    (read once before the records: a caption "1984" among text ones stays text); ``boxes`` cells are JSON
    (``[[x1, y1, x2, y2], ...]``), as ``box_labels`` cells starting with ``[`` (any other is one box's class)."""
    def cells() -> Iterator[tuple[int, dict[str, str]]]:
        try:
            with open_text(path) as f:
                for lineno, row in enumerate(csv.DictReader(f), start=2):
                    if None in row:
                        raise SourceError(f"{path}:{lineno}: more cells than header columns")
                    yield lineno, {k.strip().lower(): v.strip() for k, v in row.items()
                                   if v is not None and v.strip() != ""}
        except UnicodeDecodeError as exc:
            raise SourceError(f"{path} is not UTF-8 text ({exc.reason}): save it as UTF-8 CSV") from exc
        except csv.Error as exc:
            raise SourceError(f"{path}: malformed CSV ({exc})") from exc

    text: set[str] = set()  # columns with a cell that is not a number
    for _, row in cells():
        text.update(k for k, v in row.items() if k not in text and _number(v) is None)

    def rows() -> Iterator[tuple[str, dict[str, Any]]]:
        for lineno, row in cells():
            yield f"{path}:{lineno}", {k: _cell(k, v, k not in text) for k, v in row.items()}
    return from_records(rows(), path, parent(path), "csv-records")


def _number(text: str) -> Union[int, float, None]:
    """The number a CSV cell spells, or None. ``nan`` and ``inf`` (and ``1e999``) are numbers: a column of
    them stays a float field, whose worker refuses that record (a bad record, as JSON's ``NaN`` and a
    Parquet NaN are), where text would turn the column into a caption; an empty cell is a missing value."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return None


def _cell(key: str, text: str, numbers: bool) -> Any:
    """A CSV cell as JSON would give it: numbers for a column of numbers only, text otherwise (paths, names,
    captions); ``boxes`` (and ``box_labels`` as a list) parsed as JSON; a bare ``box_labels`` cell is one
    box's class (``3``: an id; ``traffic light``: one name, never split as ``labels`` are)."""
    if key == "boxes" or (key == "box_labels" and text.startswith("[")):
        try:
            return json.loads(text)
        except (ValueError, RecursionError):
            return text  # (boxes: refused with the record named; box_labels: one name, as a bare cell)
    if key == "box_labels":
        return [int(text) if is_id(text) else text]
    if key in ("image", "mask", "labels") or not numbers:
        return text
    return _number(text)


def segmentation_pair(root: Where, listing: Optional[dict[str, dict[str, Any]]] = None) -> Source:
    """``root/images/*`` with ``root/masks/*`` of the same stems (any image extension each); at a URL,
    ``listing`` is `url_listing` of ``root``."""
    def names(sub: str) -> list[str]:
        if listing is None:
            return sorted(os.listdir(Path(root) / sub))
        return sorted(n[len(sub) + 1:] for n, info in listing.items()
                      if n.startswith(sub + "/") and n.count("/") == 1 and info.get("type") != "directory")
    stems: dict[str, str] = {}
    for name in names("masks"):
        if is_image_name(name):
            stems.setdefault(os.path.splitext(name)[0], f"masks/{name}")
    paths = [f"images/{n}" for n in names("images") if is_image_name(n)]
    mask_of = [stems.get(os.path.splitext(p[len("images/"):])[0]) for p in paths]
    if isinstance(root, str):  # masks as full URLs, read by the worker (fastdata/preprocess/fields.py)
        base = root.rstrip("/")
        mask_of = [None if m is None else f"{base}/{m}" for m in mask_of]
        return Source("segmentation", root, Path("."), paths, [0] * len(paths), [], {"mask": "mask"},
                      {"mask": mask_of}, has_label=False, blobs=UrlBlobs(base, paths))
    return Source("segmentation", root, root.resolve(), paths, [0] * len(paths), [], {"mask": "mask"},
                  {"mask": mask_of}, has_label=False)


def coco(root: Where, annotations: Path) -> Source:
    """COCO ``instances.json`` over the image folder ``root`` (local or a URL): each image's non-crowd boxes
    (``bbox`` as x, y, w, h -> xyxy) with class ids numbered in the order of the category ids; images
    without boxes are kept (no boxes). A box of an unknown category fails its record at decode time
    (``--on-error``)."""
    try:
        data = json.loads(Path(annotations).read_text(encoding="utf-8"))
        images, anns, cats = data["images"], data.get("annotations", []), data["categories"]
        order = sorted(int(c["id"]) for c in cats)
        names = {int(c["id"]): str(c["name"]) for c in cats}
        index = {cid: i for i, cid in enumerate(order)}
        files = {int(im["id"]): str(im["file_name"]) for im in images}
    except (OSError, UnicodeDecodeError, KeyError, TypeError, ValueError, RecursionError) as exc:
        raise SourceError(f"{annotations} is not a COCO instances file ({type(exc).__name__}: {exc})") from exc
    boxes: dict[int, list[list[float]]] = {i: [] for i in files}
    labels: dict[int, list[int]] = {i: [] for i in files}
    for a in anns:
        try:
            if a.get("iscrowd", 0):
                continue  # crowd regions are not object boxes (torchvision's COCO recipe drops them too)
            x, y, w, h = (float(v) for v in a["bbox"])
            image_id = int(a["image_id"])
        except (KeyError, TypeError, ValueError) as exc:
            raise SourceError(f"{annotations}: annotation {a.get('id', '?')} is malformed ({exc!r})") from exc
        if image_id not in files:
            raise SourceError(f"{annotations}: annotation {a.get('id', '?')} names image {image_id}, not in 'images'")
        boxes[image_id].append([x, y, x + w, y + h])
        labels[image_id].append(index.get(int(a["category_id"]), -1))  # -1: unknown, refused by the worker
    ids = [i for i in files]  # the file's order
    base = root.rstrip("/") if isinstance(root, str) else root.resolve()
    folders: dict[str, Path] = {}
    paths = [_rel(base, files[i], f"{annotations}: image {i}", folders)[0] for i in ids]
    url = isinstance(base, str)  # then the location names the images' URL (the annotations are a local file)
    return Source("coco", root if url else Path(annotations), Path(".") if url else base, paths, [0] * len(ids),
                  [names[c] for c in order], {"boxes": "boxes", "box_labels": "box_labels"},
                  {"boxes": [boxes[i] for i in ids], "box_labels": [labels[i] for i in ids]}, has_label=False,
                  blobs=UrlBlobs(base, paths) if url else None)  # type: ignore[arg-type]


def _lines(path: Where) -> Iterator[str]:
    try:
        with open_text(path) as f:
            yield from f
    except UnicodeDecodeError as exc:
        raise SourceError(f"{path} is not UTF-8 text ({exc.reason})") from exc
    except OSError as exc:
        raise SourceError(f"cannot read {path}: {exc.strerror}") from exc


def discover_any(src: Where, coco_json: Optional[Path] = None) -> Source:
    """The source behind ``fastdata preprocess images SRC``: a segmentation pair (``images/`` + ``masks/``),
    a ``.jsonl``/``.csv`` of records, an image folder with ``coco_json``; else ImageFolder or a
    ``path,label`` CSV as always (WebDataset tars, Parquet, and every kind at a URL:
    `fastdata.preprocess.discover.discover_source`)."""
    src = Path(src)
    if coco_json is not None:
        if not src.is_dir():
            raise SourceError(f"--coco needs the image folder as SRC, got {src}")
        source = coco(src, Path(coco_json))
    elif src.is_dir() and (src / "images").is_dir() and (src / "masks").is_dir():
        source = segmentation_pair(src)
    elif src.suffix.lower() == ".jsonl" and src.is_file():
        source = jsonl_records(src)
    elif src.suffix.lower() == ".csv" and src.is_file() and is_record_csv(src):
        source = csv_records(src)
    else:
        return discover(src)
    if not source.paths:
        raise SourceError(f"source {src} holds no samples")
    return source

