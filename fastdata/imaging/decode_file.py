"""Turn one image file into the upright RGB pixels a person would see, resized once, with high quality
(preprocessing's decoder; the loader's, of LMDB records into batch rows, is imaging/decode_batch.py).

Large JPEGs are decoded at reduced scale (libjpeg's DCT scaling, 2-8x fewer pixels to decode, through
simplejpeg or ``Image.draft``) and resized with ``reducing_gap`` (``Image.reduce`` first), so a 4000 px
photo costs little more than a 500 px one. Everything here is deterministic, so outputs are byte-identical across runs.
"""
from __future__ import annotations

import io
import math
from pathlib import Path
from typing import BinaryIO, Union

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from ..errors import ImageDecodeError

RESIZE_MODES = ("center-crop", "squash", "pad")
BACKGROUND = (255, 255, 255)  # transparent pixels are composited on white, as a viewer shows them
PAD_VALUE = (0, 0, 0)  # "pad" letterboxes with black
RESAMPLE = Image.Resampling.LANCZOS
FILTERS = {"lanczos": Image.Resampling.LANCZOS, "bicubic": Image.Resampling.BICUBIC,
           "bilinear": Image.Resampling.BILINEAR}  # `fastdata preprocess --filter`
REDUCING_GAP = 3.0  # Pillow: results indistinguishable from a full resample at 3.0


def _scale(w: int, h: int, size: int, mode: str) -> float:
    """Factor the whole image is scaled by before cropping/padding (>= 1 means no reduction)."""
    if mode == "center-crop":
        return size / min(w, h)
    if mode == "squash":
        return max(size / w, size / h)
    if mode == "pad":
        return size / max(w, h)
    if mode == "shorter-side":  # LMDB: shorter side at most `size`, never upscaled
        return min(1.0, size / min(w, h))
    raise ValueError(f"unknown resize mode {mode!r}")


def open_rgb(path: Path | str | BinaryIO, size: int, mode: str) -> Image.Image:
    """Decode ``path`` to an upright RGB image, at the smallest scale still >= what ``mode`` needs
    (see `open_rgb_sized`)."""
    return open_rgb_sized(path, size, mode)[0]


def open_rgb_sized(path: Path | str | BinaryIO, size: int, mode: str) -> tuple[Image.Image, tuple[int, int]]:
    """`open_rgb`, and the upright image's full ``(width, height)`` (the decoded image may be smaller:
    masks and boxes, given at full size, are mapped by fractions of it; see preprocess/fields.py).

    Plain RGB JPEGs (no EXIF rotation) are decoded by libjpeg-turbo through simplejpeg at the scale Pillow's
    ``draft`` would pick: the same library and settings, so the same pixels, in less time.
    Everything else goes through Pillow."""
    try:
        data = path.read() if hasattr(path, "read") else Path(path).read_bytes()  # type: ignore[union-attr]
        try:
            img = Image.open(io.BytesIO(data))
        except UnidentifiedImageError:  # name the file, not the in-memory buffer (messages stay reproducible)
            raise ImageDecodeError(f"UnidentifiedImageError: cannot identify image file {str(path)!r}") from None
        w, h = img.size
        full = (h, w) if _exif_orientation(img) in (5, 6, 7, 8) else (w, h)  # those orientations turn 90 degrees
        s = _scale(w, h, size, mode)
        need = (max(1, math.ceil(w * s)), max(1, math.ceil(h * s)))
        if img.format == "JPEG":
            fast = _turbo_rgb(data, img, need if s < 1 else None)
            if fast is not None:
                return fast, full
            if s < 1:
                img.draft(img.mode, need)
        img.load()
        img = _upright(img)
        return to_rgb(img), full
    except ImageDecodeError:
        raise
    except (OSError, SyntaxError, ValueError, TypeError, Image.DecompressionBombError, EOFError) as exc:
        # Pillow reports damage through many types: truncated data (OSError), bad headers (SyntaxError)...
        raise ImageDecodeError(f"{type(exc).__name__}: {exc}") from exc


def _turbo_rgb(data: bytes, img: Image.Image, need: tuple[int, int] | None) -> Image.Image | None:
    """A YCbCr JPEG without EXIF rotation, decoded at Pillow's draft scale for ``need``; None to let Pillow."""
    try:
        import simplejpeg
    except ImportError:
        return None
    if img.mode != "RGB" or _exif_orientation(img) != 1:
        return None
    w, h = img.size
    d = 1
    if need is not None:  # Pillow's rule: the largest of 1/8, 1/4, 1/2 keeping both sides >= ``need``
        fit = min(w // need[0], h // need[1])
        d = next((k for k in (8, 4, 2) if fit >= k), 1)
    try:
        arr = simplejpeg.decode_jpeg(data, "RGB", min_height=-(-h // d), min_width=-(-w // d))
    except (ValueError, OSError):  # damaged: Pillow decodes it or names the damage
        return None
    return Image.fromarray(arr, "RGB")


_ORIENTATION = 0x0112  # EXIF tag


def _exif_orientation(img: Image.Image) -> int:
    try:
        return int(img.getexif().get(_ORIENTATION, 1))
    except Exception:  # noqa: BLE001 - a damaged EXIF block reads as no rotation (as _upright keeps it)
        return 1


def _upright(img: Image.Image) -> Image.Image:
    try:
        ImageOps.exif_transpose(img, in_place=True)  # in place: the copying form copies every pixel once more
        return img
    except Exception:  # noqa: BLE001 - a damaged EXIF block must not cost the pixels; keep them as stored
        return img


def to_rgb(img: Image.Image) -> Image.Image:
    """Any Pillow mode -> 8-bit RGB: alpha composited on `BACKGROUND`, 16-bit scaled (not clipped)."""
    mode = img.mode
    if mode == "RGB":
        return img
    if mode.startswith("I;16") or mode in ("I", "F"):
        return Image.fromarray(_to_uint8(np.asarray(img), mode), "L").convert("RGB")
    has_alpha = mode in ("RGBA", "LA", "PA", "RGBa", "La") or (mode == "P" and "transparency" in img.info)
    if has_alpha:
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, BACKGROUND + (255,))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return img.convert("RGB")


def _to_uint8(arr: np.ndarray, mode: str) -> np.ndarray:
    if mode == "F":
        top = 1.0 if float(np.nanmax(arr, initial=0.0)) <= 1.0 else 255.0
        return np.clip(np.nan_to_num(arr) * (255.0 / top) + 0.5, 0, 255).astype(np.uint8)
    # 16-bit samples keep their high byte (x >> 8), as Pillow itself does for 48-bit RGB PNGs.
    wide = arr.astype(np.int64)
    if mode == "I" and wide.max(initial=0) > 65535:  # a true 32-bit image: scale its range down
        wide = wide * 65535 // int(wide.max())
    return (np.clip(wide, 0, 65535) >> 8).astype(np.uint8)


def resize(img: Image.Image, size: int, mode: str, resample: int = RESAMPLE) -> Image.Image:
    """Resize an RGB image to ``size``x``size`` by ``mode`` (see `RESIZE_MODES`) with ``resample``."""
    w, h = img.size
    if mode == "center-crop":
        m = min(w, h)
        if m == size:  # no scaling (a source already at the size): cut, do not resample
            left, top = (w - m) // 2, (h - m) // 2  # an odd margin leaves the extra column/row on the right
            return img.crop((left, top, left + m, top + m))
        box = ((w - m) / 2, (h - m) / 2, (w + m) / 2, (h + m) / 2)  # resample only the pixels we keep
        return img.resize((size, size), resample, box=box, reducing_gap=REDUCING_GAP)
    if mode == "squash":
        return img.resize((size, size), resample, reducing_gap=REDUCING_GAP)
    if mode == "pad":
        s = size / max(w, h)
        nw, nh = min(size, max(1, round(w * s))), min(size, max(1, round(h * s)))
        canvas = Image.new("RGB", (size, size), PAD_VALUE)
        canvas.paste(img.resize((nw, nh), resample, reducing_gap=REDUCING_GAP), ((size - nw) // 2, (size - nh) // 2))
        return canvas
    raise ValueError(f"unknown resize mode {mode!r}; expected one of {RESIZE_MODES}")


def load_array(path: Path | str | BinaryIO, size: int, mode: str, resample: int = RESAMPLE) -> np.ndarray:
    """``path`` -> ``(size, size, 3)`` uint8 HWC, the npy-shard sample."""
    return np.asarray(resize(open_rgb(path, size, mode), size, mode, resample))


def load_jpeg(path: Path | str, size: int, quality: int, resample: int = RESAMPLE) -> bytes:
    """``path`` -> baseline RGB JPEG bytes with the shorter side at most ``size`` (aspect kept), the LMDB record."""
    img = open_rgb(path, size, "shorter-side")
    w, h = img.size
    if min(w, h) > size:
        s = size / min(w, h)
        img = img.resize((max(size, round(w * s)), max(size, round(h * s))), resample, reducing_gap=REDUCING_GAP)
    return encode_jpeg(img, quality)


def encode_jpeg(img: Union[Image.Image, np.ndarray], quality: int) -> bytes:
    """Baseline JPEG bytes of an RGB image (or uint8 HWC array) at ``quality``: an LMDB record."""
    if isinstance(img, np.ndarray):
        img = Image.fromarray(img, "RGB")
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=quality)
    return buf.getvalue()


FULL_SIZE = 1 << 30  # a "shorter-side" size no image reaches: Pillow decodes at full scale
