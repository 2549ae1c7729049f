"""Decode a batch of LMDB records straight into the rows of a batch: the box of each (the centre square, or a
random-resized crop decided before decoding) at the cheapest libjpeg scale, resized once (NOTE [jpeg read
path]). The loader's decode path; preprocessing's is in imaging/decode_file.py.
"""
from __future__ import annotations

import functools
import io
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import numpy as np
from PIL import Image, UnidentifiedImageError

from ..errors import ConfigError, ImageDecodeError
from . import turbojpeg as turbo, turbojpeg_loop as turbo_loop
from .decode_file import FULL_SIZE, open_rgb
from .draws import RATIO, SCALE, check_scale_ratio, draw_resized_crops

if TYPE_CHECKING:
    import torch

# NOTE [jpeg read path]: an LMDB record is decoded by libjpeg-turbo (simplejpeg: no compiler, releases the
# GIL) with its fast integer IDCT and plain chroma upsampling (as FFCV decodes: close to the accurate mode,
# in less time), then its box (the centre square, or a random-resized-crop box: decided before decoding) is
# cut or resized straight into the batch row. Only libjpeg's 1/2, 1/4 and 1/8 scales are used, when the box
# is at least twice the output: they cost less than a full decode, while 7/8, 6/8 and 5/8 cost more than a
# full decode plus a resize (their scaled IDCTs have no SIMD). The resize is torch's antialiased bilinear on
# uint8, written into the row (several times faster than Pillow's bilinear). Where libturbojpeg 3 is at hand
# only the box is decoded (NOTE [partial decode] in fastdata/imaging/turbojpeg.py: the same pixels, in less
# time). What libjpeg-turbo's API cannot give as RGB (CMYK) is decoded by Pillow and goes through the same
# box; damaged records are refused (NOTE [damaged records]). The figures behind these choices are in
# benchmarks/RESULTS.md.
# Two loader threads share one GIL, so the Python around the two long GIL-free calls (the decode, the
# resize) is kept short and holds the GIL throughout. A batch is planned at once: every frame header read,
# then the boxes, libjpeg scales and iMCU-aligned regions computed in numpy for the whole batch, so the
# loop over records only passes numbers to TurboJPEG (its calls of a microsecond keep the GIL: PyDLL) and
# torch (one call to view the pixels, one to resize). Records are read as views of the LMDB's memory map
# (a copy into bytes would run under the GIL) and each box lands in a per-thread scratch buffer.
# Each GIL release lets the other thread in, and getting it back can mean sleeping until that thread
# releases it: views, PyDLL and the batch plan each cut those sleeps. Where numba is installed the loop over
# records is compiled and releases the GIL once a batch (NOTE [nogil loop] in
# fastdata/imaging/turbojpeg_loop.py), which cuts them again.
#
# NOTE [damaged records]: what a record must be to be decoded. Pillow decodes damaged JPEGs loosely (a record
# cut short comes out grey below the cut; a frame header damaged to claim 13000 x 13000 pixels, as a flat grey
# tile after 2 GB and 4 s of work, with a warning at most), so a damaged record must never reach it: damage is
# an `ImageDecodeError` naming the sample, as DALILoader stops on a record it cannot decode (docs/gpu.md).
# 1. Its size is known before it is decoded: from its frame header (`jpeg_header`), read for the whole batch
#    at once, else (another format, or a JPEG with bytes out of place before that header) from its header as
#    libjpeg or Pillow read it (`_size_of`), whose random crop is then drawn for the decoded image. A record
#    of no size is refused; DALILoader's host check refuses every record without a JPEG frame header, and by
#    rule 2 every record whose header claims more than the manifest's bounds (`size_faults`, once a batch).
# 2. The size is one the dataset's records can have: the shorter side at most the manifest's max_short_side,
#    the longer side at most its max_side (--resize max-side), and at most twice PIL.Image.MAX_IMAGE_PIXELS
#    in any case, where Pillow (and so preprocessing) refuses an image (`check_sizes`): a damaged size field
#    costs nothing.
# 3. libjpeg-turbo reads it without a warning: the partial decoder and simplejpeg decode strictly, so data cut
#    short, bytes out of place or a bad Huffman code are errors, at any libjpeg scale.
# 4. Pillow decodes only what libjpeg-turbo's API cannot give as RGB: CMYK and YCCK records (converted as
#    preprocessing converts them), once libjpeg-turbo has read them whole at 1/8 scale without a warning, and
#    the rare header simplejpeg cannot describe (a subsampling it has no name for, such as 4:4:1).
# 5. The partial decoder reads a box's rows only: damage below the box is found when a box reaches it (records
#    cut short are sent the whole-image way by `looks_like_jpeg`). `fastdata verify` finds stores damaged after
#    they were written.
FAST_DECODE = {"fastdct": True, "fastupsample": True}
DCT_DENOMINATORS = (8, 4, 2)  # libjpeg scales 1/8, 1/4, 1/2: faster than a full decode (see the NOTE)
Box = tuple[int, int, int, int]  # top, left, height, width in stored pixels


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
_REGION_SOF = (0xC0, 0xC1, 0xC2)  # baseline, extended, progressive Huffman: what the batch plan decodes
# luma sampling factors (H << 4 | V, chroma 1x1) -> TurboJPEG's iMCU (height, width): 4:4:4, 4:2:2, 4:2:0,
# 4:4:0, 4:1:1, 4:4:1; a grey frame (one 1x1 component) is 8x8
_MCU = {0x11: (8, 8), 0x21: (8, 16), 0x22: (16, 16), 0x12: (16, 8), 0x41: (8, 32), 0x14: (32, 8)}


_MARKER = struct.Struct(">BBH").unpack_from  # 0xFF, marker, segment length
_FRAME = struct.Struct(">BHHB").unpack_from  # precision, height, width, component count


def jpeg_header(blob: bytes) -> tuple[int, int, int, int]:
    """``(height, width, mcu_height, mcu_width)`` from a JPEG's frame header, without decoding: ``(0, 0, 0,
    0)`` when there is none, the iMCU ``0, 0`` when the frame is not one the batch plan decodes by region
    (not 8-bit Huffman, not grey or 3 components of a subsampling TurboJPEG knows: the whole-image path
    reads those). Runs under the GIL once a record: kept to a few struct reads."""
    i, n = 2, len(blob)
    while i + 4 <= n:
        ff, marker, length = _MARKER(blob, i)
        if ff != 0xFF:
            return 0, 0, 0, 0
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in (0x01, 0xD8) or 0xD0 <= marker <= 0xD7:  # markers without a length
            i += 2
            continue
        if marker in _SOF and i + 9 <= n:
            if i + 10 > n:  # cut short after the size
                return int.from_bytes(blob[i + 5:i + 7], "big"), int.from_bytes(blob[i + 7:i + 9], "big"), 0, 0
            precision, h, w, count = _FRAME(blob, i + 4)
            comps = bytes(blob[i + 10:i + 10 + 3 * count])  # (id, sampling factors, table) per component
            mcu = None
            if marker in _REGION_SOF and precision == 8 and len(comps) == 3 * count:
                if count == 1:
                    mcu = (8, 8) if comps[1] == 0x11 else None
                elif count == 3 and comps[4] == comps[7] == 0x11:
                    mcu = _MCU.get(comps[1])
            return (h, w) + (mcu or (0, 0))
        if marker == 0xDA:  # start of scan before any frame header
            return 0, 0, 0, 0
        i += 2 + length
    return 0, 0, 0, 0


def jpeg_size(blob: bytes) -> tuple[int, int]:
    """``(height, width)`` from a JPEG's frame header, without decoding; ``(0, 0)`` when there is none."""
    return jpeg_header(blob)[:2]


def record_headers(blobs: Sequence[bytes]) -> np.ndarray:
    """int64 ``(n, 4)``: `jpeg_header` of each record, the iMCU zeroed where `looks_like_jpeg`
    fails (a record cut short could still fill a box above the cut, whose rows below are never read: such
    records go the whole-image way, which reports them)."""
    out = np.zeros((len(blobs), 4), dtype=np.int64)
    for j, blob in enumerate(blobs):
        out[j] = jpeg_header(blob) if looks_like_jpeg(blob) else jpeg_header(blob)[:2] + (0, 0)
    return out


def center_boxes(heights: np.ndarray, widths: np.ndarray, fraction: float = 1.0) -> np.ndarray:
    """int64 ``(n, 4)``: the centre square of each image, its side ``fraction`` of the short side
    (torchvision's ``Resize(256)`` + ``CenterCrop(224)`` is ``fraction=224/256``); an odd margin leaves the
    extra pixel right/bottom."""
    h, w = np.asarray(heights, dtype=np.int64), np.asarray(widths, dtype=np.int64)
    short = np.minimum(h, w)
    side = np.maximum(1, np.minimum(short, np.rint(short * fraction).astype(np.int64)))  # rint: round() halves
    return np.stack([(h - side) // 2, (w - side) // 2, side, side], axis=1)


def center_box(height: int, width: int, fraction: float = 1.0) -> Box:
    """`center_boxes` of one image."""
    return tuple(center_boxes(np.array([height]), np.array([width]), fraction)[0].tolist())  # type: ignore


def dct_denominators(box_h: np.ndarray, box_w: np.ndarray, size: int) -> np.ndarray:
    """The largest libjpeg reduction (8, 4, 2, else 1) keeping each ``box_h`` x ``box_w`` box >= ``size``."""
    bh, bw = np.asarray(box_h), np.asarray(box_w)
    return np.select([(bh >= size * d) & (bw >= size * d) for d in DCT_DENOMINATORS], DCT_DENOMINATORS, 1)


def dct_denominator(box_h: int, box_w: int, size: int) -> int:
    """`dct_denominators` of one box."""
    return int(dct_denominators(box_h, box_w, size))


def turbo_decode(data: bytes, denominator: int = 1) -> np.ndarray | None:
    """RGB pixels at libjpeg scale ``1/denominator`` (the fast modes of NOTE [jpeg read path]); None where
    libjpeg-turbo's API does not give them (simplejpeg not installed, a header it cannot describe, a CMYK or
    YCCK record it has read without a warning): the caller asks Pillow (NOTE [damaged records] 4).

    Raises:
        ImageDecodeError: libjpeg-turbo found the record damaged (a warning included: data cut short, bytes
            out of place), which Pillow would have decoded as grey or garbled pixels.
    """
    try:
        import simplejpeg
    except ImportError:
        return None
    try:  # leniently: finding damage is the strict decode's job, which names it
        h, w, colorspace, _ = simplejpeg.decode_jpeg_header(data, strict=False)
    except (ValueError, OSError, KeyError):  # (a KeyError: simplejpeg's header of 4:4:1 subsampling)
        return None
    try:
        if colorspace in ("CMYK", "YCCK"):  # Pillow converts them as preprocessing does, once read whole here:
            simplejpeg.decode_jpeg(data, "CMYK", min_height=1, min_width=1, **FAST_DECODE)  # (at 1/8: every byte)
            return None
        if colorspace not in ("Gray", "YCbCr", "RGB"):
            return None
        if denominator == 1:
            return simplejpeg.decode_jpeg(data, "RGB", **FAST_DECODE)
        return simplejpeg.decode_jpeg(data, "RGB", min_height=-(-h // denominator), min_width=-(-w // denominator),
                                      **FAST_DECODE)
    except (ValueError, OSError) as exc:
        raise ImageDecodeError(f"libjpeg-turbo: {exc}") from None


def decode_jpeg(data: bytes, size: int, out: np.ndarray | None = None, *, box: Box | None = None,
                flip: bool = False, fraction: float = 1.0) -> np.ndarray:
    """LMDB record -> ``(size, size, 3)`` uint8: ``box`` (stored pixels; default the centre square of side
    ``fraction``) cut or resized to ``size``, mirrored when ``flip``, written into ``out`` when given.
    `decode_batch` of one record; errors as `ImageDecodeError`."""
    import torch

    if out is None:
        out = np.empty((size, size, 3), np.uint8)
    decode_batch([data], size, torch.from_numpy(out)[None], boxes=None if box is None else np.array([box]),
                 flips=[flip], fraction=fraction)
    return out


def decode_batch(blobs: Sequence[bytes], size: int, x: "torch.Tensor", *, heads: Optional[np.ndarray] = None,
                 boxes: Optional[np.ndarray] = None, flips: Optional[Sequence[bool]] = None,
                 fraction: float = 1.0, max_short_side: Optional[int] = None, max_side: Optional[int] = None,
                 redraw: Optional[Callable[[int, tuple[int, int]], Box]] = None) -> None:
    """Decode ``blobs`` (LMDB records, any buffers) into ``x``, ``(n, size, size, 3)`` uint8: each record's
    box (``boxes``, ``(n, 4)`` stored pixels; default the centre square of side ``fraction``) cut or resized
    to ``size``, mirrored where ``flips``. ``heads``: `record_headers` of ``blobs`` when the caller
    has them. ``max_short_side``, ``max_side``: the largest sides the dataset stores (its manifest's), which
    a record's header may not exceed. ``redraw(j, (height, width))``: record ``j``'s random box drawn for that
    size, for a record whose frame header ``heads`` has no size of (NOTE [damaged records] 1). A record that
    cannot be decoded, or is damaged (NOTE [damaged records]), raises `ImageDecodeError` with ``position`` set
    to its index in ``blobs``. See NOTE [jpeg read path]."""
    n = len(blobs)
    heads = record_headers(blobs) if heads is None else heads
    check_sizes(heads, max_short_side, max_side)
    plan_boxes = center_boxes(heads[:, 0], heads[:, 1], fraction) if boxes is None else np.asarray(boxes)
    flip = [False] * n if flips is None else np.asarray(flips, dtype=bool).reshape(n).tolist()
    pixels = x.numpy()  # the batch's rows as HWC arrays (no per-row tensor views: a cut needs none)
    plan = region_plan(heads, plan_boxes, size)
    compiled = turbo_loop.loop() if pixels.flags.c_contiguous else None
    done = np.zeros(n, dtype=bool)
    # compiled: one GIL release a batch, boxes of the output size copied there and marked done; it yields the
    # boxes left to resize or mirror (NOTE [nogil loop]). Else the Python loop yields every box, None where
    # TurboJPEG refused the record.
    regions = (turbo.decode_regions(blobs, plan) if compiled is None else
               turbo_loop.decode_into(compiled, blobs, plan, pixels, np.array(flip, dtype=bool), done))
    for j, src in regions:
        if src is not None:
            _place(src, pixels[j], flip[j])
            done[j] = True
    for j in np.flatnonzero(~done).tolist():  # what the partial decoder did not take, record by record
        try:
            _decode_whole(blobs[j], size, pixels[j], None if boxes is None else tuple(plan_boxes[j].tolist()),
                          flip[j], fraction, tuple(heads[j, :2].tolist()), (max_short_side, max_side),
                          None if redraw is None else functools.partial(redraw, j))
        except ImageDecodeError as exc:
            exc.position = j  # type: ignore[attr-defined]
            raise


def size_faults(heads: np.ndarray, max_short_side: Optional[int] = None, max_side: Optional[int] = None
                ) -> np.ndarray:
    """Which records' headers (``heads``: `record_headers`, or ``(n, 2)`` heights and widths) give a size no
    record of the dataset can have (NOTE [damaged records] 2), as a bool mask; `check_sizes` says why."""
    h, w = heads[:, 0], heads[:, 1]
    shorter, longer = np.minimum(h, w), np.maximum(h, w)
    # twice Pillow's limit: where Pillow refuses; preprocessing (Pillow) keeps an image up to it with a warning,
    # so a valid record of a long panorama stored at a large --size can pass the limit itself
    limit = _pixel_limit()
    bad = (shorter == 0) & (longer > 0)
    if limit is not None:
        bad |= h * w > limit
    if max_short_side is not None:
        bad |= shorter > max_short_side
    if max_side is not None:
        bad |= longer > max_side
    return bad


def _pixel_limit() -> Optional[int]:
    return None if Image.MAX_IMAGE_PIXELS is None else 2 * Image.MAX_IMAGE_PIXELS


def check_sizes(heads: np.ndarray, max_short_side: Optional[int] = None, max_side: Optional[int] = None) -> None:
    """Refuse the first record whose header (``heads``: `record_headers`) gives a size no record of the dataset
    can have (`size_faults`): `ImageDecodeError` with ``position`` set. Rows of no size at all (``0, 0``: no
    frame header the parser reads) are left to the decode, which sizes them (`_size_of`)."""
    bad = size_faults(heads, max_short_side, max_side)
    if not bad.any():
        return
    h, w = heads[:, 0], heads[:, 1]
    shorter, longer = np.minimum(h, w), np.maximum(h, w)
    limit = _pixel_limit()
    j = int(np.flatnonzero(bad)[0])
    claim = f"its header says {h[j]} x {w[j]} pixels"
    if shorter[j] == 0:
        why = f"{claim}: the header is damaged (or the height comes later, in a DNL marker, which libjpeg cannot read)"
    elif max_short_side is not None and shorter[j] > max_short_side:
        why = (f"{claim}, but the dataset stores images with the shorter side at most {max_short_side} (its "
               "manifest's max_short_side): the header is damaged, or the record was not written for this dataset")
    elif max_side is not None and longer[j] > max_side:
        why = (f"{claim}, but the dataset stores images with the longer side at most {max_side} (its manifest's "
               "max_side): the header is damaged, or the record was not written for this dataset")
    else:
        why = (f"{claim}, {h[j] * w[j]} pixels: it exceeds limit of {limit} pixels (twice PIL.Image."
               "MAX_IMAGE_PIXELS, against decompression bombs, where preprocessing refuses an image too): the header "
               "is damaged, or the image is real and that limit too low")
    exc = ImageDecodeError(why)
    exc.position = j  # type: ignore[attr-defined]
    raise exc


@dataclass(frozen=True)
class BatchDecoder:
    """How an LMDB dataset decodes a batch of records to ``size`` x ``size``: the centre square of side
    ``fraction`` of the short side (``crop="center"``), or a random-resized crop (``scale``, ``ratio`` as
    torchvision) of the whole stored image mirrored half the time (``crop="random"``), drawn from a batch's
    ``(seed, epoch, position, rank)`` key (NOTE [crop draws] in fastdata/imaging/draws.py) before anything is decoded.
    ``max_short_side``, ``max_side``: the manifest's bounds on the stored images, which refuse a record whose
    frame header claims more (NOTE [damaged records] 2); None: no bound."""

    size: int
    crop: str = "center"
    fraction: float = 1.0
    scale: tuple[float, float] = SCALE
    ratio: tuple[float, float] = RATIO
    max_short_side: Optional[int] = None
    max_side: Optional[int] = None

    def __post_init__(self) -> None:
        if self.crop not in ("center", "random"):
            raise ConfigError(f"crop must be 'center' or 'random', got crop={self.crop!r}")
        if not 0 < self.fraction <= 1:
            raise ConfigError(f"crop_fraction must be in (0, 1], got crop_fraction={self.fraction!r}")
        check_scale_ratio(self.scale, self.ratio)

    @property
    def random(self) -> bool:
        return self.crop == "random"

    def decode(self, blobs: Sequence[bytes], x: "torch.Tensor", draw: Optional[tuple[int, int, int, int]]) -> None:
        """Decode ``blobs`` into ``x`` (`decode_batch`), random boxes drawn from ``draw``; without one
        (``ds[i]``, a DataLoader), from torch's global generator (seeded per worker by DataLoader)."""
        heads = record_headers(blobs)  # each frame header read once, here (a damaged one fails at decode)
        boxes = flips = redraw = None
        if self.random:
            import torch

            key = draw if draw is not None else (int(torch.randint(0, 2**62, ()).item()), 0, 0, 0)
            boxes, flips = draw_resized_crops(key, heads[:, :2], self.scale, self.ratio)
            redraw = functools.partial(self._redraw, key, heads[:, :2])
        decode_batch(blobs, self.size, x, heads=heads, boxes=boxes, flips=flips, fraction=self.fraction,
                     max_short_side=self.max_short_side, max_side=self.max_side, redraw=redraw)

    def _redraw(self, key: tuple[int, int, int, int], sizes: np.ndarray, j: int, hw: tuple[int, int]) -> Box:
        """Row ``j``'s random box for an image of ``hw``, a size known once it is decoded (NOTE [damaged records]
        1): drawn as `decode` drew the batch's, each row drawing the same whatever the others' sizes."""
        sizes = sizes.copy()
        sizes[j] = hw
        return tuple(draw_resized_crops(key, sizes, self.scale, self.ratio)[0][j].tolist())  # type: ignore


def region_plan(heads: np.ndarray, boxes: np.ndarray, size: int) -> np.ndarray:
    """`turbo.aligned_regions` for each record's box at its libjpeg scale; denominator 0 for the
    records the partial decoder must not take (no usable frame header, see `record_headers`)."""
    H, W, mcu_h, mcu_w = heads.T
    d = dct_denominators(boxes[:, 2], boxes[:, 3], size)
    scaled = _scaled_boxes(boxes, heads[:, :2], -(-heads[:, :2] // d[:, None]))  # libjpeg: ceil(side / d)
    plan = turbo.aligned_regions(scaled, d, mcu_h, mcu_w)
    plan[(mcu_h == 0) | (H == 0) | (W == 0), 0] = 0
    return plan


def _decode_whole(data: bytes, size: int, out: np.ndarray, box: Box | None, flip: bool, fraction: float,
                  hw: tuple[int, int], bounds: tuple[Optional[int], Optional[int]] = (None, None),
                  redraw: Optional[Callable[[tuple[int, int]], Box]] = None) -> None:
    """One record the partial decoder did not take: the whole image decoded by libjpeg-turbo at the box's
    libjpeg scale, else by Pillow (CMYK: NOTE [damaged records] 4), and the same box placed into ``out``.
    ``hw``: its frame header's size, checked (`check_sizes`); ``(0, 0)``: none, so it is sized by its header
    first and checked against ``bounds`` (max_short_side, max_side), and its box (``redraw`` for a random one)
    taken from the decoded image."""
    sized = hw != (0, 0)
    if sized:
        box = center_box(*hw, fraction) if box is None else box
    else:
        check_sizes(np.array([[*_size_of(data), 0, 0]]), *bounds)  # (before anything is decoded)
    arr = turbo_decode(data, dct_denominator(box[2], box[3], size) if box is not None and sized else 1)
    if arr is None:
        arr = np.array(open_rgb(io.BytesIO(data), FULL_SIZE, "shorter-side"))  # writable: torch reads it
    if not sized:
        hw = arr.shape[:2]
        box = redraw(hw) if redraw is not None else center_box(*hw, fraction) if box is None else box
    _place(_cut(arr, box, hw), out, flip)


def _size_of(data: bytes) -> tuple[int, int]:
    """``(height, width)`` of a record whose JPEG frame header `jpeg_header` cannot read (another format, or a
    JPEG with bytes out of place before that header), from its header as libjpeg reads it (leniently: the strict
    decode names what is out of place), else as Pillow reads it."""
    try:
        import simplejpeg

        h, w = simplejpeg.decode_jpeg_header(data, strict=False)[:2]
        return int(h), int(w)
    except (ImportError, ValueError, OSError, KeyError):
        pass
    try:
        with Image.open(io.BytesIO(data)) as img:
            return img.size[1], img.size[0]
    except UnidentifiedImageError:
        raise ImageDecodeError("not an image: no JPEG frame header, nor another format Pillow reads") from None
    except Exception as exc:  # noqa: BLE001 - Pillow reports damage through many types (see decode_file._decode)
        raise ImageDecodeError(f"{type(exc).__name__}: {exc}") from exc


def _place(src: np.ndarray, out: np.ndarray, flip: bool) -> None:
    """``src`` (h, w, 3), the box's decoded pixels, into ``out``, one batch row's (size, size, 3) array:
    resized unless it is already the size (a cut), mirrored when ``flip``."""
    if src.shape == out.shape and not flip:  # a box of the output size: a cut, no resampling. numpy copies it
        # with less Python around it than torch's view + copy_, but it mirrors far slower than torch
        np.copyto(out, src)
        return
    import torch

    x = torch.from_numpy(src.transpose(2, 0, 1)[None])
    row = torch.from_numpy(out.transpose(2, 0, 1)[None])  # the (1, 3, size, size) view the resize writes
    if src.shape != out.shape:
        # mirrored before the resize, one torch call fewer: the same pixels (the antialiased bilinear's
        # weights are symmetric; tests/test_jpeg.py holds it)
        _resize_into(x.flip(3) if flip else x, row)
    else:
        row.copy_(x.flip(3))


def _cut(arr: np.ndarray, box: Box, stored: tuple[int, int]) -> np.ndarray:
    """The view of ``box`` (stored pixels) in ``arr``, the whole image decoded at any scale."""
    top, left, h, w = _scaled_boxes(np.array([box]), np.array([stored]), np.array([arr.shape[:2]]))[0].tolist()
    return arr[top:top + h, left:left + w]


def _scaled_boxes(boxes: np.ndarray, stored: np.ndarray, decoded: np.ndarray) -> np.ndarray:
    """``boxes`` (``(n, 4)`` stored pixels) -> whole pixels of the decoded (possibly DCT-scaled) images,
    ``stored`` and ``decoded`` ``(n, 2)`` heights and widths; kept inside the decoded image."""
    boxes = np.asarray(boxes, dtype=np.int64)
    same = np.all(stored == decoded, axis=1)
    f = decoded / np.maximum(stored, 1)  # (fy, fx)
    tl = np.where(same[:, None], boxes[:, :2], np.rint(boxes[:, :2] * f))  # rint: Python's round() halves
    hw = np.where(same[:, None], boxes[:, 2:], np.maximum(1, np.rint(boxes[:, 2:] * f)))
    tl = np.clip(tl, 0, np.maximum(decoded - 1, 0)).astype(np.int64)
    return np.concatenate([tl, np.minimum(hw.astype(np.int64), decoded - tl)], axis=1)


def _resize_into(x: "torch.Tensor", row: "torch.Tensor") -> None:
    """Antialiased bilinear resize of ``x`` (1, 3, h, w) into ``row`` (1, 3, size, size), both views of HWC
    uint8 memory, with no intermediate copy."""
    import torch

    try:  # the op behind F.interpolate(antialias=True), with out=: it writes the row in place (its direct
        # binding runs without the GIL and costs less a call than torch.ops, which matters at 2 threads)
        torch._C._nn._upsample_bilinear2d_aa(x, list(row.shape[2:]), False, None, None, out=row)
    except (AttributeError, RuntimeError, TypeError):  # an older or newer torch without this overload
        row.copy_(torch.nn.functional.interpolate(x, size=row.shape[2:], mode="bilinear", antialias=True,
                                                  align_corners=False))
