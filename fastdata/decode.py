"""Turn one image file into the upright RGB pixels a person would see, resized once, with high quality;
and decode an LMDB record into a batch row (NOTE [jpeg read path]).

Large JPEGs are decoded at reduced scale (libjpeg's DCT scaling, 2-8x fewer pixels to decode, through
simplejpeg or ``Image.draft``) and resized with ``reducing_gap`` (``Image.reduce`` first), so a 4000 px photo costs little more
than a 500 px one. Everything here is deterministic, so outputs are byte-identical across runs.
"""
from __future__ import annotations

import io
import math
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Union

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from . import turbo
from .errors import ImageDecodeError

if TYPE_CHECKING:
    import torch

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
    (see :func:`open_rgb_sized`)."""
    return open_rgb_sized(path, size, mode)[0]


def open_rgb_sized(path: Path | str | BinaryIO, size: int, mode: str) -> tuple[Image.Image, tuple[int, int]]:
    """:func:`open_rgb`, and the upright image's full ``(width, height)`` (the decoded image may be smaller:
    masks and boxes, given at full size, are mapped by fractions of it; see preprocess/fields.py).

    Plain RGB JPEGs (no EXIF rotation) are decoded by libjpeg-turbo through simplejpeg at the scale Pillow's
    ``draft`` would pick: the same library and settings, so the same pixels, in about 0.75x the time.
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
        ImageOps.exif_transpose(img, in_place=True)  # in place: the copying form costs ~0.9 ms per 500x375 image
        return img
    except Exception:  # noqa: BLE001 - a damaged EXIF block must not cost the pixels; keep them as stored
        return img


def to_rgb(img: Image.Image) -> Image.Image:
    """Any Pillow mode -> 8-bit RGB: alpha composited on :data:`BACKGROUND`, 16-bit scaled (not clipped)."""
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
    """Resize an RGB image to ``size``x``size`` by ``mode`` (see :data:`RESIZE_MODES`) with ``resample``."""
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


# NOTE [jpeg read path]: an LMDB record is decoded by libjpeg-turbo (simplejpeg: no compiler, releases the
# GIL) with its fast integer IDCT and plain chroma upsampling (as FFCV decodes: 41 dB PSNR against the
# accurate mode, 14% less time), then its box (the centre square, or a random-resized-crop box: decided
# before decoding) is cut or resized straight into the batch row. Only libjpeg's 1/2, 1/4 and 1/8 scales
# are used, when the box is at least twice the output: measured on a 341x256 record they cost 0.52/0.50/
# 0.43 ms against 0.56 ms for a full decode, while 7/8, 6/8 and 5/8 cost 0.90/0.79/0.71 ms (their scaled
# IDCTs have no SIMD), more than a full decode plus a resize. The resize is torch's antialiased bilinear on
# uint8, written into the row (0.15 ms for 240x300 -> 224; Pillow's bilinear takes 0.78 ms). Where
# libturbojpeg 3 is at hand only the box is decoded (NOTE [partial decode] in turbo.py: the same pixels,
# 0.7-0.8x the time). Whatever libjpeg-turbo cannot read (CMYK, damaged data) is decoded by Pillow and
# goes through the same box.
# Two loader threads share one GIL, so the Python around the two long GIL-free calls (the decode, the
# resize) is kept short and holds the GIL throughout: records are read as views of the LMDB's memory map
# (copying 30 KB into bytes took ~10 us under the GIL), the box lands in a per-thread scratch buffer, the
# TurboJPEG calls of a microsecond keep the GIL (PyDLL), and torch is called once to view the pixels and
# once to resize. Each GIL release lets the other thread in, and getting it back can mean sleeping until
# that thread releases it: on 2 vCPUs, 0.8 such sleeps a record before, 0.45 after (voluntary context
# switches from getrusage around a 2-thread FastLoader, a one-off diagnostic, not a benchmark).
FAST_DECODE = {"fastdct": True, "fastupsample": True}
DCT_DENOMINATORS = (8, 4, 2)  # libjpeg scales 1/8, 1/4, 1/2: faster than a full decode (see the NOTE)
Box = tuple[int, int, int, int]  # top, left, height, width in stored pixels
FULL_SIZE = 1 << 30  # a "shorter-side" size no image reaches: Pillow decodes at full scale


def looks_like_jpeg(blob: bytes) -> bool:
    """Cheap screen before a decoder sees a record: JPEG start and end markers present (catches truncation).
    Any buffer, as the decoders take, read without a copy of the whole record."""
    if len(blob) <= 4 or bytes(blob[:2]) != b"\xff\xd8":
        return False
    tail = bytes(blob[-64:]).rstrip(b"\x00")  # zero padding after the end marker is allowed
    if not tail:
        tail = bytes(blob).rstrip(b"\x00")
    return tail[-2:] == b"\xff\xd9"


_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}  # start-of-frame markers (not DHT, JPG, DAC)


def jpeg_size(blob: bytes) -> tuple[int, int]:
    """``(height, width)`` from a JPEG's frame header, without decoding; ``(0, 0)`` when there is none."""
    i, n = 2, len(blob)
    while i + 4 <= n:
        if blob[i] != 0xFF:
            return 0, 0
        marker = blob[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in (0x01, 0xD8) or 0xD0 <= marker <= 0xD7:  # markers without a length
            i += 2
            continue
        if marker in _SOF and i + 9 <= n:
            return int.from_bytes(blob[i + 5:i + 7], "big"), int.from_bytes(blob[i + 7:i + 9], "big")
        if marker == 0xDA:  # start of scan before any frame header
            return 0, 0
        i += 2 + int.from_bytes(blob[i + 2:i + 4], "big")
    return 0, 0


def center_box(height: int, width: int, fraction: float = 1.0) -> Box:
    """The centre square of an image, its side ``fraction`` of the short side (torchvision's ``Resize(256)``
    + ``CenterCrop(224)`` is ``fraction=224/256``); an odd margin leaves the extra pixel right/bottom."""
    side = max(1, min(height, width, round(min(height, width) * fraction)))
    return (height - side) // 2, (width - side) // 2, side, side


def dct_denominator(box_h: int, box_w: int, size: int) -> int:
    """The largest libjpeg reduction (8, 4, 2, else 1) that keeps a ``box_h`` x ``box_w`` box >= ``size``."""
    return next((d for d in DCT_DENOMINATORS if box_h >= size * d and box_w >= size * d), 1)


def turbo_decode(data: bytes, denominator: int = 1) -> np.ndarray | None:
    """RGB pixels at libjpeg scale ``1/denominator`` (the fast modes of NOTE [jpeg read path]); None when
    simplejpeg is not installed or cannot decode ``data`` (the caller falls back to Pillow)."""
    try:
        import simplejpeg
    except ImportError:
        return None
    try:
        h, w, colorspace, _ = simplejpeg.decode_jpeg_header(data)
        if colorspace not in ("Gray", "YCbCr", "RGB"):  # CMYK/YCCK: Pillow converts them as preprocessing does
            return None
        if denominator == 1:
            return simplejpeg.decode_jpeg(data, "RGB", **FAST_DECODE)
        return simplejpeg.decode_jpeg(data, "RGB", min_height=-(-h // denominator), min_width=-(-w // denominator),
                                      **FAST_DECODE)
    except (ValueError, OSError):  # damaged or unsupported data: let Pillow try, and report it if it cannot
        return None


def decode_jpeg(data: bytes, size: int, out: np.ndarray | None = None, *, box: Box | None = None,
                flip: bool = False, fraction: float = 1.0, hw: tuple[int, int] | None = None) -> np.ndarray:
    """LMDB record -> ``(size, size, 3)`` uint8: ``box`` (stored pixels; default the centre square of side
    ``fraction``) cut or resized to ``size``, mirrored when ``flip``, written into ``out`` when given (a row
    of the batch: no second copy). ``hw``: :func:`jpeg_size` of ``data`` when the caller has it already.
    See NOTE [jpeg read path]; errors as :class:`ImageDecodeError`."""
    if out is None:
        out = np.empty((size, size, 3), np.uint8)
    decode_into(data, size, _torch(out).permute(2, 0, 1)[None], box=box, flip=flip, fraction=fraction, hw=hw)
    return out


def decode_into(data: bytes, size: int, row: "torch.Tensor", *, box: Box | None = None, flip: bool = False,
                fraction: float = 1.0, hw: tuple[int, int] | None = None) -> None:
    """:func:`decode_jpeg` writing into ``row``, a ``(1, 3, size, size)`` uint8 view of an HWC row (a batch's
    rows are ``x.permute(0, 3, 1, 2).split(1)``, made once a batch): the loader's per-record path, which
    keeps the Python between the decoder and the resize (run under the GIL) short."""
    hw = jpeg_size(data) if hw is None else hw
    if box is None and hw != (0, 0):
        box = center_box(*hw, fraction)
    src = _decode_box(data, hw, box, size) if box is not None and hw != (0, 0) else None
    if src is None:  # simplejpeg missing or unable: Pillow decodes the whole image, the box is the same
        arr = np.array(open_rgb(io.BytesIO(data), FULL_SIZE, "shorter-side"))  # writable: torch reads it as a tensor
        hw = arr.shape[:2] if hw == (0, 0) else hw
        src = _cut(arr, center_box(*hw, fraction) if box is None else box, hw)
    # NCHW view of the decoded pixels made by numpy, then one torch call that keeps the GIL: each torch op
    # releases and retakes it, and at 2 threads every such handover of a few microseconds can wait on the
    # other thread's Python (NOTE [jpeg read path])
    x = _torch(src.transpose(2, 0, 1)[None])
    if src.shape[:2] != (size, size):
        _resize_into(x, row)
        if flip:  # torch mirrors 12x faster than a numpy ::-1 copy of 3-byte pixels
            row.copy_(row.flip(3))
    else:  # a box of the output size: a cut, no resampling
        row.copy_(x.flip(3) if flip else x)


def _decode_box(data: bytes, hw: tuple[int, int], box: Box, size: int) -> np.ndarray | None:
    """The pixels of ``box`` (stored pixels) at the libjpeg scale :func:`dct_denominator` picks: only the box
    decoded where libturbojpeg 3 is at hand (NOTE [partial decode] in turbo.py), else cut from the whole
    image; None when neither libjpeg-turbo path can decode the record. A partial decode lands in the
    thread's scratch buffer: use the pixels before this thread decodes again."""
    d = dct_denominator(box[2], box[3], size)
    scaled = (-(-hw[0] // d), -(-hw[1] // d))  # libjpeg's scaled size: ceil(side / d)
    # a record cut short could still fill a box above the cut (the rows below are never read): screen it
    src = None
    if looks_like_jpeg(data):
        src = turbo.decode_region(data, d, _scaled_box(box, hw, scaled), scratch=True)
    if src is not None:
        return src
    arr = turbo_decode(data, d)
    return None if arr is None else _cut(arr, box, hw)


def _cut(arr: np.ndarray, box: Box, stored: tuple[int, int]) -> np.ndarray:
    """The view of ``box`` (stored pixels) in ``arr``, the whole image decoded at any scale."""
    top, left, h, w = _scaled_box(box, stored, arr.shape[:2])
    return arr[top:top + h, left:left + w]


def _torch(a: np.ndarray) -> "torch.Tensor":
    import torch

    return torch.from_numpy(a)


def _scaled_box(box: Box, stored: tuple[int, int], decoded: tuple[int, int]) -> Box:
    """``box`` in stored pixels -> whole pixels of the decoded (possibly DCT-scaled) image, kept inside it."""
    (H, W), (h, w) = stored, decoded
    if (H, W) == (h, w):
        top, left, bh, bw = box
    else:
        fy, fx = h / H, w / W
        top, left = round(box[0] * fy), round(box[1] * fx)
        bh, bw = max(1, round(box[2] * fy)), max(1, round(box[3] * fx))
    top, left = min(max(0, top), h - 1), min(max(0, left), w - 1)
    return top, left, min(bh, h - top), min(bw, w - left)


def _resize_into(x: "torch.Tensor", row: "torch.Tensor") -> None:
    """Antialiased bilinear resize of ``x`` (1, 3, h, w) into ``row`` (1, 3, size, size), both views of HWC
    uint8 memory, with no intermediate copy."""
    import torch

    try:  # the op behind F.interpolate(antialias=True), with out=: it writes the row in place (its direct
        # binding: 2 us a call without the GIL against 4 us through torch.ops, which matters at 2 threads)
        torch._C._nn._upsample_bilinear2d_aa(x, list(row.shape[2:]), False, None, None, out=row)
    except (AttributeError, RuntimeError, TypeError):  # an older or newer torch without this overload
        row.copy_(torch.nn.functional.interpolate(x, size=row.shape[2:], mode="bilinear", antialias=True,
                                                  align_corners=False))
