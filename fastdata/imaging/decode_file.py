"""Turn one image file into the upright RGB pixels a person would see, resized once, with high quality
(preprocessing's decoder; the loader's, of LMDB records into batch rows, is imaging/decode_batch.py).

Large JPEGs are decoded at reduced scale (libjpeg's DCT scaling, 2-8x fewer pixels to decode, through
simplejpeg or ``Image.draft``) and resized with ``reducing_gap`` (``Image.reduce`` first), so a 4000 px
photo costs little more than a 500 px one. Everything here is deterministic, so outputs are byte-identical across runs.

NOTE [fast bicubic]: the ``"fast-bicubic"`` filter resizes whole RGB images with torch's uint8 kernel
(``F.interpolate(mode="bicubic", antialias=True)``) instead of Pillow's:
  1. The same kernel as Pillow's bicubic (Keys, a = -0.5, its support widened by the downscale: antialiased),
     within 2 levels of it; 50-51 dB PSNR against Lanczos on 500x375 photos to 256 px, where FFCV's OpenCV
     INTER_AREA gives 43.7-44.2 dB; 6-10x less time than Pillow's Lanczos (benchmarks/bench_preprocess.py).
  2. Deterministic: the same bytes from torch's AVX512, AVX2 and plain C kernels (``ATEN_CPU_CAPABILITY``) and
     for any thread count, as tested; a torch upgrade may change them (the filter is named in the fingerprint).
  3. Whole images only, downscaled less than ``2 * REDUCING_GAP``: a centre crop's fractional box, and larger
     reductions (Pillow reduces by an integer factor first), go through Pillow's bicubic, the same kernel.
  4. One intra-op thread in worker processes: a second thread costs more than it gains at these sizes, and
     the workers already fill the cores (as torch's DataLoader workers do).
"""
from __future__ import annotations

import io
import math
import multiprocessing
import os
import stat
from pathlib import Path
from typing import BinaryIO, Optional, Union

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from ..errors import ImageDecodeError
from . import lanczos

RESIZE_MODES = ("center-crop", "squash", "pad")
BACKGROUND = (255, 255, 255)  # transparent pixels are composited on white, as a viewer shows them
PAD_VALUE = (0, 0, 0)  # "pad" letterboxes with black
RESAMPLE = Image.Resampling.LANCZOS
FAST_BICUBIC = 256  # not a Pillow filter: whole images resized by torch (NOTE [fast bicubic])
FILTERS = {"lanczos": Image.Resampling.LANCZOS, "bicubic": Image.Resampling.BICUBIC,
           "bilinear": Image.Resampling.BILINEAR, "fast-bicubic": FAST_BICUBIC}  # `fastdata preprocess --filter`
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
    if mode == "max-side":  # LMDB: longer side at most `size`, never upscaled
        return min(1.0, size / max(w, h))
    raise ValueError(f"unknown resize mode {mode!r}")


def open_rgb(path: Path | str | BinaryIO, size: int, mode: str) -> Image.Image:
    """Decode ``path`` to an upright RGB image, at the smallest scale still >= what ``mode`` needs
    (see `open_rgb_sized`)."""
    return open_rgb_sized(path, size, mode)[0]


def open_rgb_sized(path: Path | str | BinaryIO, size: int,
                   mode: str) -> tuple[Image.Image, tuple[int, int], tuple[bool, bool]]:
    """`open_rgb`, the upright image's full ``(width, height)`` (the decoded image may be smaller: masks and
    boxes, given at full size, are mapped by fractions of it; see preprocess/fields.py), and whether its x
    and y axes run against the stored image's (an EXIF turn or mirror: a reduced-scale decode's padded
    last pixel is then first).

    Plain RGB JPEGs (no EXIF rotation) are decoded by libjpeg-turbo through simplejpeg at the scale Pillow's
    ``draft`` would pick: the same library and settings, so the same pixels, in less time.
    Everything else goes through Pillow."""
    pixels, full, orientation = _decode(path, size, mode)
    return _image(pixels), full, (orientation in (2, 3, 6, 7), orientation in (3, 4, 7, 8))


def _image(pixels: Union[Image.Image, np.ndarray]) -> Image.Image:
    return Image.fromarray(pixels, "RGB") if isinstance(pixels, np.ndarray) else pixels


def _decode(path: Path | str | BinaryIO, size: int,
            mode: str) -> tuple[Union[Image.Image, np.ndarray], tuple[int, int], int]:
    """`open_rgb_sized`, where libjpeg-turbo's pixels stay the uint8 HWC array it wrote (one copy fewer);
    the EXIF orientation last."""
    try:
        data = path.read() if hasattr(path, "read") else read_image_file(path)  # type: ignore[union-attr,arg-type]
        try:
            img = Image.open(io.BytesIO(data))
        except UnidentifiedImageError:  # name the file, not the in-memory buffer (messages stay reproducible)
            raise ImageDecodeError(f"UnidentifiedImageError: cannot identify image file {str(path)!r}") from None
        if img.mode == "RGB" and any(";16" in str(t[3]) for t in img.tile):  # (before a PNG's getexif loads it)
            # a 48-bit image's colour key is in 16-bit values, and Pillow loads 8 bits a channel: a black key
            # would match every near-black pixel, so the key is not applied (the image stays opaque)
            img.info.pop("transparency", None)
        w, h = img.size
        orientation = _exif_orientation(img)
        full = (h, w) if orientation in (5, 6, 7, 8) else (w, h)  # those orientations turn 90 degrees
        s = _scale(w, h, size, mode)
        need = (max(1, math.ceil(w * s)), max(1, math.ceil(h * s)))
        if img.format == "JPEG":
            fast = _turbo_rgb(data, img, need if s < 1 else None)
            if fast is not None:
                return fast, full, orientation
            if s < 1:
                img.draft(img.mode, need)
        img.load()
        img = _upright(img)
        return to_rgb(img), full, orientation
    except (ImageDecodeError, MemoryError):  # MemoryError: the machine's trouble, not the file's
        raise
    except Exception as exc:  # noqa: BLE001 - Pillow reports damage through many types: truncated data
        # (OSError), bad headers (SyntaxError), a TIFF's damaged offsets (OverflowError), a DDS's unknown pixel
        # format (NotImplementedError); any of them must skip the file, not end the run
        raise ImageDecodeError(f"{type(exc).__name__}: {exc}") from exc


def read_image_file(path: Path | str) -> bytes:
    """The bytes of the file at ``path`` (a link to one too): a regular file, or a FIFO (a stream a process
    writes, read to its end as before); a device (``/dev/zero`` never ends), a socket or a folder named like an
    image is refused."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode)):
            raise ImageDecodeError(f"{path} is not a file (a device, a socket or a folder): not an image")
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read()
    finally:
        os.close(fd)


def _turbo_rgb(data: bytes, img: Image.Image, need: tuple[int, int] | None) -> np.ndarray | None:
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
    return arr


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
    """Any Pillow mode -> 8-bit RGB: alpha (or a colour key) composited on `BACKGROUND`, 16-bit scaled (not
    clipped)."""
    mode = img.mode
    # a colour key (PNG tRNS on P, L or RGB) is transparency too: convert("RGBA") applies it
    has_alpha = mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in img.info
    if mode == "RGB" and not has_alpha:
        return img
    if mode.startswith("I;16") or mode in ("I", "F"):
        arr = np.asarray(img)
        grey = Image.fromarray(_to_uint8(arr, mode), "L")
        if not has_alpha:
            return grey.convert("RGB")
        # a 16-bit key is matched before scaling: 256 values share each 8-bit one
        alpha = np.where(arr == img.info["transparency"], 0, 255).astype(np.uint8)
        img = Image.merge("LA", (grey, Image.fromarray(alpha, "L")))
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
        return resample_image(img, (size, size), resample, box=box)
    if mode == "squash":
        return resample_image(img, (size, size), resample)
    if mode == "pad":
        s = size / max(w, h)
        nw, nh = min(size, max(1, round(w * s))), min(size, max(1, round(h * s)))
        canvas = Image.new("RGB", (size, size), PAD_VALUE)
        canvas.paste(resample_image(img, (nw, nh), resample), ((size - nw) // 2, (size - nh) // 2))
        return canvas
    raise ValueError(f"unknown resize mode {mode!r}; expected one of {RESIZE_MODES}")


def resample_image(img: Union[Image.Image, np.ndarray], wh: tuple[int, int], resample: int = RESAMPLE,
                   box: Optional[tuple[float, float, float, float]] = None) -> Image.Image:
    """``img`` (or its ``box``) resized to ``wh`` with ``resample``, one of `FILTERS`' values.

    Args:
        img: The image, or its uint8 HWC RGB pixels; `FAST_BICUBIC` resizes RGB ones with torch
            (NOTE [fast bicubic]).
        wh: The output ``(width, height)``.
        resample: A Pillow filter or `FAST_BICUBIC`.
        box: The source region ``(left, top, right, bottom)`` to resize, fractions allowed; None: all of it.

    Returns:
        The resized image (RGB where ``img`` is).
    """
    if resample == FAST_BICUBIC:
        h, w = img.shape[:2] if isinstance(img, np.ndarray) else img.size[::-1]
        rgb = isinstance(img, np.ndarray) or img.mode == "RGB"
        if box is None and rgb and max(w / wh[0], h / wh[1]) < 2 * REDUCING_GAP:
            return Image.fromarray(_torch_bicubic(img if isinstance(img, np.ndarray) else np.array(img), wh), "RGB")
        resample = Image.Resampling.BICUBIC  # the same kernel (NOTE [fast bicubic], rule 3)
    if resample == RESAMPLE and box is None and lanczos.ready() and isinstance(img, np.ndarray):
        h, w = img.shape[:2]
        if wh[0] <= w and wh[1] <= h and wh != (w, h) and max(w / wh[0], h / wh[1]) < 2 * REDUCING_GAP:
            return Image.fromarray(lanczos.resize(img, wh), "RGB")  # NOTE [exact lanczos] in lanczos.py
    return _image(img).resize(wh, resample, box=box, reducing_gap=REDUCING_GAP)


def prepare(filter_name: str) -> bool:
    """Compile the exact Lanczos kernel for ``filter_name`` in this process, so that workers forked afterwards
    resize with it (NOTE [exact lanczos] in fastdata/imaging/lanczos.py); a no-op for other filters, without
    numba, or where the kernel does not give this Pillow's bytes.

    Args:
        filter_name: A key of `FILTERS`.

    Returns:
        Whether Lanczos resizes of whole RGB arrays now run the compiled kernel.
    """
    return FILTERS.get(filter_name) == RESAMPLE and lanczos.prepare(REDUCING_GAP)


_threads_checked_in = 0  # the pid that did: a forked worker inherits the flag, not the check


def _torch_bicubic(pixels: np.ndarray, wh: tuple[int, int]) -> np.ndarray:
    """Pillow's antialiased bicubic of uint8 HWC ``pixels``, by torch's uint8 kernel, into a new HWC array."""
    import torch

    global _threads_checked_in
    if _threads_checked_in != os.getpid():  # NOTE [fast bicubic], rule 4: once per process
        _threads_checked_in = os.getpid()
        if multiprocessing.parent_process() is not None and torch.get_num_threads() > 1:
            torch.set_num_threads(1)
    out = np.empty((wh[1], wh[0], 3), np.uint8)
    x, y = (torch.from_numpy(a).permute(2, 0, 1).unsqueeze(0) for a in (pixels, out))  # channels-last views
    try:  # the op behind F.interpolate(antialias=True), writing the HWC output in place: 0.22 ms against
        # 0.57 ms for interpolate's NCHW result made contiguous HWC (500x375 -> 256x192, one thread)
        torch._C._nn._upsample_bicubic2d_aa(x, [wh[1], wh[0]], False, None, None, out=y)
    except (AttributeError, RuntimeError, TypeError):  # an older or newer torch without this overload
        y.copy_(torch.nn.functional.interpolate(x, size=(wh[1], wh[0]), mode="bicubic", antialias=True,
                                                align_corners=False))
    return out


def load_array(path: Path | str | BinaryIO, size: int, mode: str, resample: int = RESAMPLE) -> np.ndarray:
    """``path`` -> ``(size, size, 3)`` uint8 HWC, the npy-shard sample."""
    return np.asarray(resize(open_rgb(path, size, mode), size, mode, resample))


def load_jpeg(path: Path | str | BinaryIO, size: int, quality: int, resample: int = RESAMPLE, *,
              fit: str = "shorter-side") -> bytes:
    """``path`` -> an LMDB record: baseline RGB JPEG bytes, aspect kept, never upscaled.

    Args:
        path: The image file (or a binary file object).
        size: The cap on the side ``fit`` names, in pixels.
        quality: JPEG quality, 1..100.
        resample: A value of `FILTERS`.
        fit: ``"shorter-side"`` (the shorter side at most ``size``) or ``"max-side"`` (the longer side at most
            ``size``: FFCV's ``max_resolution``).

    Returns:
        The JPEG bytes.

    Raises:
        ImageDecodeError: ``path`` is not an image Pillow can decode.
    """
    if fit == "max-side":
        # the output size comes from the upright image's full size, so a JPEG decoded at a reduced DCT
        # scale gets the same geometry
        img, (w, h), _ = _decode(path, size, fit)
        if max(w, h) > size:
            s = size / max(w, h)
            img = resample_image(img, (max(1, round(w * s)), max(1, round(h * s))), resample)
        return encode_jpeg(img, quality)
    if fit != "shorter-side":
        raise ValueError(f"unknown fit {fit!r}; expected 'shorter-side' or 'max-side'")
    img = _decode(path, size, fit)[0]
    h, w = img.shape[:2] if isinstance(img, np.ndarray) else img.size[::-1]
    if min(w, h) > size:
        s = size / min(w, h)
        img = resample_image(img, (max(size, round(w * s)), max(size, round(h * s))), resample)
    return encode_jpeg(img, quality)


def encode_jpeg(img: Union[Image.Image, np.ndarray], quality: int) -> bytes:
    """Baseline JPEG bytes of an RGB image (or uint8 HWC array) at ``quality``: an LMDB record."""
    if isinstance(img, np.ndarray):
        img = Image.fromarray(img, "RGB")
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=quality)
    return buf.getvalue()


FULL_SIZE = 1 << 30  # a "shorter-side" size no image reaches: Pillow decodes at full scale
