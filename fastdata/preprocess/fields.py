"""Decode one record with fields (NOTE [fields] in fastdata/formats/schema.py): its image as today, its mask and boxes moved
by the same geometry, its ids, numbers and caption checked and converted. Runs in the worker processes.

NOTE [record geometry]: ``resize`` maps the upright image of ``W x H`` pixels to ``S x S`` by an axis-aligned
affine map, out = (x - left) * scale + pad, per axis (``center-crop``: the centre square, scaled;
``squash``: each axis scaled; ``pad``: scaled to fit, then centred on a black canvas). Masks and boxes are
given at the full size, while a large JPEG may be decoded at 1/2-1/8 scale first (DCT scaling): ``ceil(W /
d)`` pixels, the last one padded, so they cover ``d x`` that many source pixels, not ``W`` (the first one
padded, along an axis an EXIF turn or mirror reversed). The map is the one ``resize`` applies to the decoded
pixels (its integer cut, its rounding), expressed in full-size pixels through ``d``, so the three stay
aligned as a PNG of the same picture is. A mask is resampled by nearest
neighbour (a label is never interpolated; padding is 0); boxes are mapped, clipped to the picture and
dropped (with their class ids) when nothing of them is left. A given box of no area (``x2 == x1`` or
``y2 == y1``: COCO's slivers of width 0) is dropped the same way, box by box as torchvision's and
mmdetection's COCO readers do; a box that is not finite, is inverted (``x2 < x1``: often an ``[x, y, w,
h]`` box under the corners' key) or lies outside its image refuses the record.

NOTE [refused records]:
1. What a record alone holds can refuse it before its image is read: boxes that are not lists of four
   numbers, not one class per box, not finite or inverted; a float value past float32 (NaN, inf, 1e39); a
   text with a lone surrogate. `record_flaw` says why, in the worker; `refusals` finds the same records of
   a whole source, column by column, for the source.
2. A source lists no class of a record it knows its worker refuses: those records, a record whose image or
   mask file is missing where the source is listed (a path that is no file; at a URL only a read tells), and
   a record without a mask. So a class that only refused records name is not in the class list.
3. Such a record's class values become one past the last class (``len(classes)``), which the worker refuses
   as unknown should its file appear after the listing (never a wrong class); box classes of a record
   refused for its boxes stay as given, for the message. A record refused for what its image shows (it
   cannot be decoded, a box outside it) is only known once decoded: its classes stay listed.
4. In a tar or Parquet source, each file is summarised before the files' keys are merged, and only keys
   every file holds as numbers are stored: a record's float value past float32 refuses it only where its
   key is stored, so the summaries list its classes (`from_records`' ``refused`` leaves float refusals out)
   and its piece refuses it (rule 3). img2dataset's metadata holds NaN in keys that other samples give as
   null: those samples are kept.
"""
from __future__ import annotations

import io
from dataclasses import dataclass
from numbers import Real
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
from PIL import Image, UnidentifiedImageError

from .._io import scrub
from ..errors import ImageDecodeError
from ..formats.tokenizer import cached_tokenizer
from ..imaging import decode_file as decode
from ..storage.object_store import is_url
from .sources import shown
from .url_reads import UrlBlobs

BOX_SLACK = 1.0  # pixels a box may overhang its image (annotation tools round): clipped, not refused
_ROWS = 1 << 16  # records `refusals` converts at a time (a float field of 512 numbers: 128 MB of float32)


@dataclass(frozen=True)
class Geometry:
    """Per axis ``out = (x - left) * scale + pad``; the picture covers ``[pad, pad + extent)`` of the output."""

    left: tuple[float, float]  # x, y
    scale: tuple[float, float]
    pad: tuple[int, int]
    extent: tuple[int, int]


def geometry(w: int, h: int, size: int, mode: str, decoded: Optional[tuple[int, int]] = None,
             mirrored: tuple[bool, bool] = (False, False)) -> Geometry:
    """The map, in full-size pixels, that `fastdata.imaging.decode_file.resize` applies to a ``w x h`` image
    decoded at ``decoded`` (its width and height: DCT scaling, NOTE [record geometry]; default: full size),
    whose x and y axes run against the stored image's where ``mirrored`` (an EXIF turn: the decoded padded
    last pixel comes first)."""
    if decoded is not None and tuple(decoded) != (w, h):
        d = _denominator(w, h, *decoded)
        g = geometry(decoded[0], decoded[1], size, mode)  # what resize does to the decoded pixels
        over = [d[0] * decoded[0] - w if mirrored[0] else 0, d[1] * decoded[1] - h if mirrored[1] else 0]
        return Geometry((g.left[0] * d[0] - over[0], g.left[1] * d[1] - over[1]),
                        (g.scale[0] / d[0], g.scale[1] / d[1]), g.pad, g.extent)
    if mode == "center-crop":
        m = min(w, h)
        if m == size:  # resize() cuts without resampling, at integer offsets
            return Geometry(((w - m) // 2, (h - m) // 2), (1.0, 1.0), (0, 0), (size, size))
        return Geometry(((w - m) / 2, (h - m) / 2), (size / m, size / m), (0, 0), (size, size))
    if mode == "squash":
        return Geometry((0.0, 0.0), (size / w, size / h), (0, 0), (size, size))
    if mode == "pad":
        s = size / max(w, h)
        nw, nh = min(size, max(1, round(w * s))), min(size, max(1, round(h * s)))
        return Geometry((0.0, 0.0), (nw / w, nh / h), ((size - nw) // 2, (size - nh) // 2), (nw, nh))
    raise ValueError(f"unknown resize mode {mode!r}")


def _denominator(w: int, h: int, dw: int, dh: int) -> tuple[float, float]:
    """Full-size pixels per decoded pixel, per axis: libjpeg's scaled decode gives ``ceil(w / d)`` pixels
    (d = 2, 4, 8), its last one padded, so the decoded pixels cover ``d * dw`` source pixels, not ``w``."""
    for d in (2, 4, 8):
        if -(-w // d) == dw and -(-h // d) == dh:
            return float(d), float(d)
    return w / dw, h / dh  # (another decoder's scaling: its own ratio)


def resample_mask(mask: np.ndarray, g: Geometry, size: int) -> np.ndarray:
    """Nearest-neighbour ``mask`` (``H x W``) -> ``size x size`` under ``g``; outside the picture: 0."""
    out = np.zeros((size, size), mask.dtype)
    idx = []
    for axis in (0, 1):  # x (columns), then y (rows)
        centres = np.arange(size) + 0.5
        src = np.floor((centres - g.pad[axis]) / g.scale[axis] + g.left[axis]).astype(np.int64)
        inside = (centres >= g.pad[axis]) & (centres < g.pad[axis] + g.extent[axis])
        idx.append((np.clip(src, 0, mask.shape[1 - axis] - 1), inside))
    (cols, cin), (rows, rin) = idx
    out[np.ix_(rin, cin)] = mask[np.ix_(rows[rin], cols[cin])]
    return out


def map_boxes(boxes: np.ndarray, g: Geometry) -> tuple[np.ndarray, np.ndarray]:
    """Boxes (``k x 4`` xyxy, full-size pixels) -> output pixels, clipped to the picture; and which are kept
    (a positive width and height left)."""
    out = np.empty_like(boxes)
    for axis, cols in ((0, [0, 2]), (1, [1, 3])):
        lo, hi = g.pad[axis], g.pad[axis] + g.extent[axis]
        out[:, cols] = np.clip((boxes[:, cols] - g.left[axis]) * g.scale[axis] + g.pad[axis], lo, hi)
    keep = (out[:, 2] > out[:, 0]) & (out[:, 3] > out[:, 1])
    return out[keep], keep


# -- what the record alone refuses (NOTE [refused records]) --------------------------------------------------
def box_count(boxes: Any) -> Optional[int]:
    """How many boxes ``boxes`` holds when it is ``[[x1, y1, x2, y2], ...]`` of numbers; None otherwise (text,
    bools, a flat list, a polygon's 8 numbers: a bad record, never boxes of a guessed shape)."""
    if not isinstance(boxes, list):
        return None
    for b in boxes:
        if not (isinstance(b, list) and len(b) == 4
                and all(isinstance(x, Real) and not isinstance(x, bool) for x in b)):
            return None
    return len(boxes)


def box_flaw(boxes: Any, labels: list[Any]) -> Optional[str]:
    """Why a record's ``boxes`` with its ``box_labels`` refuse it whatever its image, or None."""
    count = box_count(boxes)
    try:
        arr = None if count is None else np.asarray(boxes, np.float64).reshape(-1, 4)
    except OverflowError:  # an integer past 1.8e308
        arr = None
    if arr is None or count is None:
        one = box_count([boxes]) == 1  # (four numbers: one box, not wrapped in its list)
        return (f"boxes {shown(boxes, 80)} are not [[x1, y1, x2, y2], ...] of numbers a float holds"
                + (" (a single box too is a list in the list)" if one else ""))
    if len(labels) != count:
        return (f"{count} box{'es' if count != 1 else ''} but {len(labels)} box_labels {shown(labels, 60)}: give one "
                "class per box (in a CSV, a JSON list: [\"cat\", \"dog\"])")
    bad = ~np.isfinite(arr).all(1)
    if bad.any():
        return f"box {arr[bad][0].tolist()} is not finite (xyxy pixels)"
    bad = (arr[:, 2] < arr[:, 0]) | (arr[:, 3] < arr[:, 1])  # (xywh boxes under the xyxy key, often)
    if bad.any():
        return (f"box {arr[bad][0].tolist()} has x2 < x1 or y2 < y1: boxes are corners [x1, y1, x2, y2] (an [x, y, "
                "w, h] box is [x, y, x + w, y + h])")
    return None


def unfinite(column: list[Any]) -> np.ndarray:
    """Which values of a float field (numbers, or lists of one length) float32 cannot hold: NaN, inf, past
    3.4e38 (one NaN target makes a whole run's loss NaN)."""
    with np.errstate(over="ignore", invalid="ignore"):  # past float32's 3.4e38 is inf: refused, not a warning
        arr = np.asarray(column, np.float32).reshape(len(column), -1)
    return ~np.isfinite(arr).all(1)


def vector_flaw(v: Any, name: str) -> Optional[str]:
    """Why a float field's value refuses its record, or None."""
    if not unfinite([v])[0]:
        return None
    return f"{name} holds {shown(v, 80)}: a float field needs finite numbers (float32: at most 3.4e38 in size)"


def text_flaw(text: Any) -> Optional[str]:
    """Why a text field's value (str, or None: empty) refuses its record, or None."""
    if not isinstance(text, str) or text.isascii():  # (isascii: a flag of the string, no scan)
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate: JSON's "\ud800" without its pair
        return (f"the caption holds a lone surrogate {text[exc.start]!r} at character {exc.start}, which is not text "
                "(a JSON \\u escape without its pair): fix or drop that record")
    return None


def record_flaw(kinds: dict[str, str], values: dict[str, Any]) -> Optional[str]:
    """Why one record is refused whatever its image shows (NOTE [refused records] rule 1), or None."""
    for name, kind in kinds.items():
        v = values.get(name)
        if kind == "boxes":
            flaw = box_flaw([] if v is None else v, values.get("box_labels") or [])
        elif kind == "vector":
            flaw = None if v is None else vector_flaw(v, name)
        elif kind == "tokens":
            flaw = text_flaw(v)
        else:
            continue
        if flaw:
            return flaw
    return None


def refusals(kinds: dict[str, str], extras: dict[str, list[Any]]) -> tuple[set[int], set[int]]:
    """The records of a source that `record_flaw` refuses or that have no mask, and those of them refused
    for their boxes (their box classes stay as given: NOTE [refused records] rule 3); column by column.

    Args:
        kinds: The source's field kinds.
        extras: Each field's values, one per record (as records.py stores them: None or [] where absent).
    """
    boxed: set[int] = set()
    bad: set[int] = set()
    for name, kind in kinds.items():
        col = extras[name]
        if kind == "boxes":
            labels = extras.get("box_labels") or [[]] * len(col)
            boxed = {i for i, (b, c) in enumerate(zip(col, labels)) if (b or c) and box_flaw(b, c)}
        elif kind == "vector":
            for a in range(0, len(col), _ROWS):
                bad.update((a + np.flatnonzero(unfinite(col[a:a + _ROWS]))).tolist())
        elif kind == "tokens":
            bad.update(i for i, v in enumerate(col) if text_flaw(v))
        elif kind == "mask":
            bad.update(i for i, v in enumerate(col) if v is None)
    return bad | boxed, boxed


class RecordDecoder:
    """Turns sample ``i`` of a source into its image row and field values (one per worker process)."""

    def __init__(self, root: str, size: int, resize: str, resample: int, kinds: dict[str, str],
                 num_classes: int, mask_dtype: str, tokenizer: str) -> None:
        self.root, self.size, self.mode, self.resample = Path(root), size, resize, resample
        self.kinds, self.num_classes, self.mask_dtype = kinds, num_classes, np.dtype(mask_dtype)
        self.tokenizer = tokenizer

    def decode(self, src: Any, values: dict[str, Any], label: Optional[int], out: np.ndarray) -> dict[str, Any]:
        """Write the image into ``out``; return the fields. Raises ImageDecodeError naming what is wrong: the
        image, then what the record alone refuses, then its masks, then its classes (a record its source
        refused has its classes one past the last: NOTE [refused records] rule 3)."""
        img, (w, h), mirrored = decode.open_rgb_sized(src, self.size, self.mode)
        out[...] = np.asarray(decode.resize(img, self.size, self.mode, self.resample))
        g = geometry(w, h, self.size, self.mode, img.size, mirrored)
        flaw = record_flaw(self.kinds, values)
        if flaw:
            raise ImageDecodeError(flaw)
        fields = {name: self._mask(values.get(name), w, h, g, name) for name, kind in self.kinds.items()
                  if kind == "mask"}
        if label is not None:
            self._ids([label], "label")
        for name, kind in self.kinds.items():
            v = values.get(name)
            if kind == "boxes":
                fields["boxes"], fields["box_labels"] = self._boxes(v, values.get("box_labels", []), w, h, g)
            elif kind == "labels":
                fields[name] = self._ids(v, name)
            elif kind == "vector":
                fields[name] = self._vector(v, name)
            elif kind == "tokens":
                fields[name] = self._tokens(v if v is not None else "")
        return fields

    def _ids(self, ids: list[int], name: str) -> np.ndarray:
        arr = np.asarray(ids, np.int64).reshape(-1)
        bad = arr[(arr < 0) | (arr >= self.num_classes)]
        if bad.size:
            raise ImageDecodeError(f"{name}: unknown class {int(bad[0])} (the dataset has {self.num_classes} classes)")
        return arr

    def _vector(self, v: Any, name: str) -> np.ndarray:
        return np.asarray(v, np.float32)  # (finite: `record_flaw` refused the rest)

    def _mask(self, rel: Union[str, "Blob", None], w: int, h: int, g: Geometry, name: str) -> np.ndarray:
        if rel is None:
            raise ImageDecodeError(f"no {name} for this image (masks/ has no file of the same stem, or its row has "
                                   "none)")
        if isinstance(rel, Blob):  # read already (`row_values`): an object at a URL, a Parquet column's bytes
            path: Any = rel
            rel = str(rel)
        else:
            path = self.root / rel
        try:
            with Image.open(path if isinstance(path, Blob) else io.BytesIO(decode.read_image_file(path))) as m:
                m.load()
                # I;16B: ImageJ/Fiji's TIFFs; np.asarray reads them as >u2, the same ids
                if m.mode not in ("L", "P", "I", "I;16", "I;16L", "I;16B", "I;16N", "1"):
                    raise ImageDecodeError(f"mask {rel} is {m.mode}: a mask is one channel of class ids "
                                           "(L, P or 16-bit)")
                arr = np.asarray(m)
        except UnidentifiedImageError:  # Pillow names an in-memory buffer by its address: the mask, not it
            raise ImageDecodeError(f"mask {rel}: UnidentifiedImageError: not an image Pillow can read") from None
        except (ImageDecodeError, MemoryError):  # MemoryError: the machine's trouble, not the mask's
            raise
        except Exception as exc:  # noqa: BLE001 - Pillow's damage comes in many types (a bomb: DecompressionBombError)
            raise ImageDecodeError(f"mask {rel}: {type(exc).__name__}: {exc}") from exc
        if arr.shape != (h, w):
            raise ImageDecodeError(f"mask {rel} is {arr.shape[1]}x{arr.shape[0]}, the image {w}x{h}: they must match")
        top = int(arr.max(initial=0))
        if top > np.iinfo(self.mask_dtype).max or int(arr.min(initial=0)) < 0:
            raise ImageDecodeError(f"mask {rel} holds values up to {top}: store it with --mask-dtype uint16")
        return resample_mask(arr.astype(self.mask_dtype), g, self.size)

    def _boxes(self, boxes: list[Any], labels: list[int], w: int, h: int, g: Geometry
               ) -> tuple[np.ndarray, np.ndarray]:
        # well-formed, one class a box, finite and not inverted: `record_flaw` refused the rest
        arr = np.asarray(boxes, np.float64).reshape(-1, 4)
        ids = self._ids(labels, "box_labels")
        bad = ((arr < -BOX_SLACK) | (arr > np.array([w, h, w, h]) + BOX_SLACK)).any(1)
        if bad.any():
            raise ImageDecodeError(f"box {arr[bad][0].tolist()} is outside the {w}x{h} image (xyxy pixels)")
        some = (arr[:, 2] > arr[:, 0]) & (arr[:, 3] > arr[:, 1])  # no area: dropped with its class, not the image
        arr, ids = arr[some], ids[some]
        np.clip(arr, 0, [w, h, w, h], out=arr)
        mapped, keep = map_boxes(arr, g)
        return mapped.astype(np.float32), ids[keep]

    def _tokens(self, text: Any) -> np.ndarray:
        if not isinstance(text, str):
            raise ImageDecodeError(f"expected text for a caption, got {text!r}")
        return cached_tokenizer(self.tokenizer).encode_batch([text])[0]  # (UTF-8: `record_flaw` refused the rest)


def mask_readers(kinds: dict[str, str], values: dict[str, list[Any]]) -> dict[str, UrlBlobs]:
    """A read-ahead reader for each mask field of a chunk whose masks are objects at URLs: they are requested
    ahead as the chunk's images are (NOTE [url source] in fastdata/preprocess/url_reads.py), not one round trip
    a sample after each image.

    Args:
        kinds: The source's field kinds.
        values: The chunk's field values (a mask field's: full URLs, or None).

    Returns:
        Mask field name -> its reader (None for a sample without a mask at a URL); fields of local masks
        have none.
    """
    readers = {}
    for name, kind in kinds.items():
        urls = [v if isinstance(v, str) and is_url(v) else None for v in values.get(name) or []]
        if kind == "mask" and any(urls):
            readers[name] = UrlBlobs("", urls)
    return readers


def row_values(values: dict[str, list[Any]], j: int, readers: dict[str, UrlBlobs], blobs: Any) -> dict[str, Any]:
    """Sample ``j``'s field values: the chunk's own, its masks' bytes where a reader fetched them, and the
    fields ``blobs`` reads with the image (a Parquet row's mask columns).

    Args:
        values: The chunk's field values.
        j: The sample's position in the chunk.
        readers: `mask_readers` of the chunk.
        blobs: The chunk's image reader (None for files on disk).

    Returns:
        Field name -> the sample's value.

    Raises:
        ImageDecodeError: A mask object is missing (a bad record).
        SourceError: The store is down past the retry budget.
    """
    row = {k: v[j] for k, v in values.items()}
    for name, reader in readers.items():
        if reader.names[j] is not None:
            row[name] = Blob(reader.read(j), scrub(reader.names[j]))
    if getattr(blobs, "field_columns", None):  # a Parquet row's mask columns: named by their column
        row.update({name: None if data is None else Blob(data, f"in column {name!r}")
                    for name, data in blobs.read_fields(j).items()})
    return row


def open_source(root: Path, rel: str, blobs: Any, index: int) -> Any:
    """What `RecordDecoder.decode` reads: a file path, or the sample's bytes from ``blobs`` (a Parquet row,
    a tar member, an object at a URL; ``index`` counts in ``blobs``: a task's chunk), named ``rel``."""
    if blobs is None:
        return root / rel
    return Blob(blobs.read(index), rel)


class Blob(io.BytesIO):
    """A sample's bytes that print as its source path: messages name the sample, not a buffer's address."""

    def __init__(self, data: bytes, name: str) -> None:
        super().__init__(data)
        self.name = name

    def __str__(self) -> str:
        return self.name
