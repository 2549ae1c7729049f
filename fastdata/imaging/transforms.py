"""Batched image transforms for any device: one random draw per sample, no Python loop over samples.

Images are NCHW tensors (the channels_last view of a uint8 NHWC batch is fine), in pixel units: uint8,
or float in 0..255. Geometric transforms come first; `Normalize` ends a pipeline and gives
``(x / 255 - mean) / std`` as one multiply (casting uint8) and one add, bit-equal on CPU and GPU. Every
random transform draws its parameters for the whole batch from the ``generator`` it is called with
(CUDAPrefetcher seeds one per batch from ``(seed, epoch, position, rank)``, so a resumed run draws the
same augmentations), then applies them with batched tensor operations. ``params`` and ``apply`` are
separate so tests can check the math against a per-sample reference with the very same draws.

NOTE [spatial fields]: every transform also takes a dict batch of sample fields (NOTE [fields] in
formats/schema.py) with ``"image"`` as NCHW, and moves every spatial field with the image, from the same draw:
each ``(B, H, W)`` tensor is a mask, cropped, flipped and resampled by nearest neighbour (a class id is
never interpolated; RandomCrop pads it with 0); ``"boxes"`` (float xyxy pixels, with ``"box_labels"``
and ``"boxes_offsets"``) go through the same per-sample affine map, are clipped to the output and dropped
(with their class ids) when no area is left. Other fields pass through; Normalize touches only the image.
Dropping boxes needs their count on the host: for box batches on a GPU that is one wait on the stream
running the transforms (CUDAPrefetcher's side stream), not on the model's.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from .draws import TRIES, Draws, check_scale_ratio, rrc_boxes, uniform

Rng = Union[None, torch.Generator, Draws]  # where draws come from: see draws.uniform

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
Size = Union[int, tuple[int, int]]


def _pair(size: Size, name: str) -> tuple[int, int]:
    hw = (size, size) if isinstance(size, int) else tuple(size)
    if len(hw) != 2 or not all(isinstance(v, int) and v > 0 for v in hw):
        raise ConfigError(f"{name} must be a positive int or (height, width), got {name}={size!r}")
    return hw  # type: ignore[return-value]


Batch = Union[torch.Tensor, dict[str, torch.Tensor]]


def masks_of(batch: dict[str, torch.Tensor]) -> list[str]:
    """The keys of a dict batch's masks: ``(B, H, W)`` tensors with the image's batch and size (fields that are
    no tensor, such as a list of paths, pass through)."""
    image = batch["image"]
    shape = (image.shape[0], *image.shape[-2:])
    return [k for k, v in batch.items()
            if k != "image" and isinstance(v, torch.Tensor) and v.ndim == 3 and v.shape == shape]


def move_boxes(batch: dict[str, torch.Tensor], scale: tuple[torch.Tensor, torch.Tensor],
               shift: tuple[torch.Tensor, torch.Tensor], size: tuple[int, int]) -> None:
    """Map ``batch["boxes"]`` by ``x * scale + shift`` per sample and axis (``(B,)`` each; a negative scale
    mirrors), clip to ``size`` (height, width), and drop the boxes left empty with their class ids."""
    if "boxes" not in batch:
        return
    boxes, offsets = batch["boxes"], batch["boxes_offsets"]
    owner = torch.searchsorted(offsets[1:], torch.arange(len(boxes), device=boxes.device), right=True)
    out = torch.empty_like(boxes)
    for axis, (lo, hi) in enumerate(((0, 2), (1, 3))):
        a = boxes[:, lo] * scale[axis][owner] + shift[axis][owner]
        b = boxes[:, hi] * scale[axis][owner] + shift[axis][owner]
        limit = float(size[1 - axis])
        out[:, lo], out[:, hi] = torch.minimum(a, b).clamp(0, limit), torch.maximum(a, b).clamp(0, limit)
    keep = (out[:, 2] > out[:, 0]) & (out[:, 3] > out[:, 1])
    counts = torch.zeros(len(offsets) - 1, dtype=torch.int64, device=boxes.device).index_add_(0, owner, keep.long())
    batch["boxes"], batch["box_labels"] = out[keep], batch["box_labels"][keep]
    batch["boxes_offsets"] = torch.cat([offsets[:1] * 0, counts.cumsum(0)])


class Transform:
    """A batched transform: ``t(x, generator)`` -> transformed batch; ``x`` is an NCHW image tensor, or a dict
    of sample fields whose spatial fields move with the image (NOTE [spatial fields])."""

    def __call__(self, x: Batch, generator: Rng = None) -> Batch:
        raise NotImplementedError

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({args})"


class Compose(Transform):
    """Apply several transforms in order, all drawing from the same generator.

    On an image tensor, a crop followed by `RandomHorizontalFlip` runs as one step, with the same draws
    and pixels (NOTE [flip folded into the crop]).
    A dict batch of sample fields goes through each transform in turn.

    Args:
        transforms: The transforms, applied first to last.

    Examples:
        >>> train = Compose([RandomResizedCrop(224), RandomHorizontalFlip()])
        >>> out = train(images_nchw, generator)  # (B, 3, 224, 224) float, pixel units
    """

    def __init__(self, transforms: Sequence[Transform]) -> None:
        self.transforms = list(transforms)

    def __call__(self, x: Batch, generator: Rng = None) -> Batch:
        ts, i = self.transforms, 0
        while i < len(ts):
            t, after = ts[i], ts[i + 1] if i + 1 < len(ts) else None
            if isinstance(t, Crop) and isinstance(after, RandomHorizontalFlip) and isinstance(x, torch.Tensor):
                x, i = crop_and_flip(t, after.p, x, generator), i + 2
            else:
                x, i = t(x, generator), i + 1
        return x


# NOTE [flip folded into the crop]: Compose([RandomResizedCrop or RandomCrop, RandomHorizontalFlip]) on an
# image tensor draws both transforms' numbers in one call (a Draws stream gives the same numbers for one
# call of n + m as for calls of n and m) and mirrors inside the crop: RandomResizedCrop negates the x scale
# of each flipped sample's sampling grid, RandomCrop reverses its column indices. The output is bit-equal to
# the two steps (the grid's base coordinates are symmetric, so a negated scale lands on exactly the mirrored
# points; tests/test_gpu_transforms.py holds it on each device), and it skips the flip's passes over the
# whole batch (a mirrored copy and a select) and one draw's ~18 small kernels: a batch's transforms are
# launched from the training loop's thread, where each kernel costs host time.
class Crop(Transform):
    """A random crop whose draws are ``draws`` uniforms per sample and which can mirror what it crops."""

    draws: int

    def params_from(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """The crop's parameters from ``u``, ``(B, draws)`` uniforms."""
        raise NotImplementedError

    def apply(self, x: torch.Tensor, params: torch.Tensor, flip: Optional[torch.Tensor] = None) -> torch.Tensor:
        raise NotImplementedError


def crop_and_flip(crop: Crop, p: float, x: torch.Tensor, generator: Rng) -> torch.Tensor:
    """``RandomHorizontalFlip(p)(crop(x))`` in one step, the same draws and pixels (NOTE [flip folded into the
    crop])."""
    b, k = x.shape[0], crop.draws
    if isinstance(generator, Draws):
        u = generator.rand(b * (k + 1), device=x.device)
        own, flip_u = u[:b * k].view(b, k), u[b * k:]
    else:
        own, flip_u = uniform((b, k), generator, x.device), uniform((b,), generator, x.device)
    return crop.apply(x, crop.params_from(x, own), flip=flip_u < p)


def _mirrored(masks: torch.Tensor) -> torch.Tensor:
    """``(N, H, W)`` masks mirrored left to right; uint16 ones through int16 (the same bits: torch's CPU flip
    has no uint16 kernel)."""
    if masks.dtype == torch.uint16:
        return masks.view(torch.int16).flip(2).view(torch.uint16)
    return masks.flip(2)


class RandomHorizontalFlip(Transform):
    """Mirror each sample left-right with probability ``p``.

    Masks and boxes of a dict batch are mirrored with the image (NOTE [spatial fields]).

    Args:
        p: The probability that a sample is mirrored, in [0, 1] (default 0.5).

    Raises:
        ConfigError: ``p`` is outside [0, 1].
    """

    def __init__(self, p: float = 0.5) -> None:
        if not 0.0 <= p <= 1.0:
            raise ConfigError(f"p must be in [0, 1], got p={p!r}")
        self.p = p

    def params(self, x: torch.Tensor, generator: Rng) -> torch.Tensor:
        """``(B,)`` bool: which samples are mirrored."""
        return uniform((x.shape[0],), generator, x.device) < self.p

    def apply(self, x: torch.Tensor, flip: torch.Tensor) -> torch.Tensor:
        """NCHW images mirrored where ``flip``."""
        return torch.where(flip.view(-1, 1, 1, 1), x.flip(3), x)

    def apply_fields(self, batch: dict[str, torch.Tensor], flip: torch.Tensor) -> dict[str, torch.Tensor]:
        """A dict batch with its image, masks and boxes mirrored where ``flip``."""
        out = dict(batch)
        out["image"] = self.apply(batch["image"], flip)
        for k in masks_of(batch):
            out[k] = torch.where(flip.view(-1, 1, 1), _mirrored(batch[k]), batch[k])
        size = tuple(batch["image"].shape[-2:])
        one = torch.ones(len(flip), device=flip.device)
        move_boxes(out, (torch.where(flip, -one, one), one), (flip.float() * size[1], one * 0), size)
        return out

    def __call__(self, x: Batch, generator: Rng = None) -> Batch:
        if isinstance(x, dict):
            return self.apply_fields(x, self.params(x["image"], generator))
        return self.apply(x, self.params(x, generator))


class CenterCrop(Transform):
    """Crop the centre of every image to ``size``, offsets rounded as torchvision does.

    Masks and boxes of a dict batch are cropped with the image (NOTE [spatial fields]).
    The result is a view of the input: no pixels are copied.

    Args:
        size: The output's side, or ``(height, width)``.

    Raises:
        ConfigError: ``size`` is not a positive int or pair, or (on call) is larger than the images.
    """

    def __init__(self, size: Size) -> None:
        self.size = _pair(size, "size")

    def __call__(self, x: Batch, generator: Rng = None) -> Batch:
        image = x["image"] if isinstance(x, dict) else x
        (h, w), (H, W) = self.size, image.shape[-2:]
        if h > H or w > W:
            raise ConfigError(f"CenterCrop size {self.size} is larger than the images ({H}, {W})")
        top, left = int(round((H - h) / 2.0)), int(round((W - w) / 2.0))
        if not isinstance(x, dict):
            return x[:, :, top:top + h, left:left + w]
        out = dict(x)
        out["image"] = image[:, :, top:top + h, left:left + w]
        for k in masks_of(x):
            out[k] = x[k][:, top:top + h, left:left + w]
        one = torch.ones(image.shape[0], device=image.device)
        move_boxes(out, (one, one), (one * -left, one * -top), (h, w))
        return out


class RandomCrop(Crop):
    """Pad every image, then crop it to ``size`` at a random offset per sample (CIFAR style).

    Masks of a dict batch are cropped at the same offset and padded with 0; boxes move with them
    (NOTE [spatial fields]).

    Args:
        size: The output's side, or ``(height, width)``.
        padding: Pixels added on every side before cropping, >= 0 (default 0).
        fill: The value of the padded pixels (default 0).

    Raises:
        ConfigError: ``size`` or ``padding`` is bad, or (on call) ``size`` is larger than the padded images.
    """

    draws = 2

    def __init__(self, size: Size, padding: int = 0, fill: float = 0) -> None:
        self.size = _pair(size, "size")
        if not isinstance(padding, int) or padding < 0:
            raise ConfigError(f"padding must be an integer >= 0, got padding={padding!r}")
        self.padding, self.fill = padding, fill

    def params(self, x: torch.Tensor, generator: Rng) -> torch.Tensor:
        """``(B, 2)`` int64 offsets (top, left) in the padded images, drawn from ``generator``."""
        return self.params_from(x, uniform((x.shape[0], 2), generator, x.device))

    def params_from(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """``(B, 2)`` int64 offsets (top, left) from ``u``, ``(B, 2)`` uniforms."""
        (h, w), (H, W), p = self.size, x.shape[-2:], self.padding
        if h > H + 2 * p or w > W + 2 * p:
            raise ConfigError(f"RandomCrop size {self.size} is larger than the padded images "
                              f"({H + 2 * p}, {W + 2 * p})")
        # (B, 2): top, left in the padded image; python numbers, so nothing crosses to the device
        return torch.stack((u[:, 0] * (H + 2 * p - h + 1), u[:, 1] * (W + 2 * p - w + 1)), dim=1).long()

    def apply(self, x: torch.Tensor, offsets: torch.Tensor, fill: Optional[float] = None,
              flip: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Crop NCHW images (or, with ``fill=0``, ``(B, H, W)`` masks) at ``offsets``, mirrored where ``flip``."""
        (h, w), p, b = self.size, self.padding, x.shape[0]
        plane = x.ndim == 3
        if plane:
            x = x.unsqueeze(1)
        if p:
            x = F.pad(x, (p, p, p, p), value=self.fill if fill is None else fill)
        rows = offsets[:, :1] + torch.arange(h, device=x.device)  # (B, h)
        across = torch.arange(w, device=x.device)
        if flip is not None:  # a mirrored crop reads its columns right to left
            across = torch.where(flip[:, None], across.flip(0), across)
        cols = offsets[:, 1:] + across  # (B, w)
        batch = torch.arange(b, device=x.device).view(-1, 1, 1)
        # Advanced indexing puts the indexed dims first: (B, h, w, C), i.e. NCHW with channels_last strides.
        out = x[batch, :, rows[:, :, None], cols[:, None, :]]
        return out[..., 0] if plane else out.permute(0, 3, 1, 2)

    def __call__(self, x: Batch, generator: Rng = None) -> Batch:
        if not isinstance(x, dict):
            return self.apply(x, self.params(x, generator))
        offsets = self.params(x["image"], generator)
        out = dict(x)
        out["image"] = self.apply(x["image"], offsets)
        for k in masks_of(x):
            out[k] = self.apply(x[k], offsets, fill=0)
        one = torch.ones(len(offsets), device=offsets.device)
        shift = (self.padding - offsets).float()
        move_boxes(out, (one, one), (shift[:, 1], shift[:, 0]), self.size)
        return out


class RandomResizedCrop(Crop):
    """Crop a random area/aspect box per sample and resize it to ``size`` (the ImageNet recipe).

    Boxes follow torchvision's rule: 10 tries of area ~ U(scale) and log-aspect ~ U(log ratio), else the
    centre crop clamped to ``ratio``.
    They are drawn for the whole batch at once (NOTE [crop draws] in fastdata/imaging/draws.py).
    All boxes are resampled in one ``grid_sample`` (bilinear, no antialiasing).
    The output is float in pixel units.
    Masks of a dict batch are resampled by nearest neighbour and boxes mapped with the image
    (NOTE [spatial fields]).

    Args:
        size: The output's side, or ``(height, width)``.
        scale: The range of the box's share of the image area, ``0 < min <= max <= 1`` (default
            ``(0.08, 1.0)``).
        ratio: The range of the box's aspect ratio (width / height), ``0 < min <= max`` (default ``(3/4, 4/3)``).

    Raises:
        ConfigError: ``size``, ``scale`` or ``ratio`` is out of range.
    """

    def __init__(self, size: Size, scale: tuple[float, float] = (0.08, 1.0),
                 ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> None:
        self.size = _pair(size, "size")
        check_scale_ratio(scale, ratio)
        self.scale, self.ratio = tuple(scale), tuple(ratio)

    draws = TRIES * 4

    def params(self, x: torch.Tensor, generator: Rng, tries: int = TRIES) -> torch.Tensor:
        """(B, 4) float boxes: top, left, height, width (whole pixels)."""
        return self.params_from(x, uniform((x.shape[0], tries * 4), generator, x.device))

    def params_from(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """``(B, 4)`` float boxes (top, left, height, width) from ``u``, ``(B, 40)`` uniforms (10 tries of 4)."""
        (H, W) = x.shape[-2:]
        tries = u.view(len(u), u.shape[1] // 4, 4)  # (not -1: ambiguous for an empty batch)
        return rrc_boxes(H, W, tries, self.scale, self.ratio)  # one size: host constants

    def _grid(self, x: torch.Tensor, boxes: torch.Tensor, flip: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``grid_sample``'s sampling points, (B, oh, ow, 2): each output pixel centre mapped into its box
        (``affine_grid`` of the box's scale and shift, align_corners=False), the x scale negated where
        ``flip``. Built here rather than by ``affine_grid``, whose base coordinates (a linspace) are not
        exactly symmetric for every width (31, say), so a negated scale would miss the mirrored points by
        an ulp; here they are (2j + 1 - n) / n, exactly symmetric. A multiply and an add, as separate
        kernels: the same bits on every device (no FMA)."""
        (oh, ow), (H, W) = self.size, x.shape[-2:]
        top, left, h, w = boxes.unbind(1)
        sx = w / W
        if flip is not None:
            sx = torch.where(flip, -sx, sx)
        cx, sy, cy = (2 * left + w) / W - 1, h / H, (2 * top + h) / H - 1
        xs, ys = self._base(ow, x.device), self._base(oh, x.device)
        gx = torch.mul(xs[None, None, :], sx[:, None, None]).add_(cx[:, None, None])  # (B, 1, ow)
        gy = torch.mul(ys[None, :, None], sy[:, None, None]).add_(cy[:, None, None])  # (B, oh, 1)
        return torch.stack(torch.broadcast_tensors(gx, gy), dim=-1)

    def _base(self, n: int, device: torch.device) -> torch.Tensor:
        """Pixel centres of an ``n``-pixel axis in [-1, 1]: (2j + 1 - n) / n, float32 (cached per device)."""
        cache = self.__dict__.setdefault("_bases", {})
        if (n, device) not in cache:
            cache[n, device] = (torch.arange(n, device=device, dtype=torch.float32) * 2 + (1 - n)) / n
        return cache[n, device]

    def apply(self, x: torch.Tensor, boxes: torch.Tensor, flip: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Resample each sample's box to ``size``, mirrored where ``flip``."""
        xf = x if x.is_floating_point() else x.float()
        grid = self._grid(x, boxes, flip)
        return F.grid_sample(xf, grid.to(xf.dtype), mode="bilinear", padding_mode="border", align_corners=False)

    def apply_fields(self, batch: dict[str, torch.Tensor], boxes: torch.Tensor) -> dict[str, torch.Tensor]:
        """A dict batch with its image resampled, its masks resampled by nearest neighbour and its boxes mapped."""
        out = dict(batch)
        out["image"] = self.apply(batch["image"], boxes)
        grid = self._grid(batch["image"], boxes)
        for k in masks_of(batch):  # the image's sampling points, nearest: ids exact below 2**24
            m = batch[k].unsqueeze(1).float()
            out[k] = F.grid_sample(m, grid, mode="nearest", padding_mode="border",
                                   align_corners=False)[:, 0].to(batch[k].dtype)
        top, left, h, w = boxes.float().unbind(1)
        sx, sy = self.size[1] / w, self.size[0] / h  # edge coordinates: x' = (x - left) * ow / w
        move_boxes(out, (sx, sy), (-left * sx, -top * sy), self.size)
        return out

    def __call__(self, x: Batch, generator: Rng = None) -> Batch:
        if isinstance(x, dict):
            return self.apply_fields(x, self.params(x["image"], generator))
        return self.apply(x, self.params(x, generator))


class Normalize(Transform):
    """Turn pixel units into ``(x / 255 - mean) / std``, cast to ``dtype``; it ends a pipeline.

    The math runs in float32 as a multiply and an add, two kernels, so every device gives the same bits.
    Only the image of a dict batch is touched.

    Args:
        mean: Per-channel mean in 0-1 units, torchvision's convention (default: ImageNet's).
            ``None`` (with ``std=None``) gives ``x / 255``.
        std: Per-channel standard deviation in 0-1 units, each > 0 (default: ImageNet's).
        dtype: The output's floating dtype (default ``torch.float32``).
        memory_format: The output's layout (e.g. ``torch.channels_last``), written by the multiply itself rather
            than by a copy afterwards (default None: the input's).

    Raises:
        ConfigError: Only one of ``mean`` and ``std`` is given, their lengths differ, ``std`` is not positive,
            ``dtype`` is not floating, or (on call) the images' channels differ from ``mean``'s.
    """

    def __init__(self, mean: Optional[Sequence[float]] = IMAGENET_MEAN, std: Optional[Sequence[float]] = IMAGENET_STD,
                 dtype: torch.dtype = torch.float32, memory_format: Optional[torch.memory_format] = None) -> None:
        if (mean is None) != (std is None):
            raise ConfigError(f"give both mean and std, or neither; got mean={mean!r}, std={std!r}")
        if std is not None and any(s <= 0 for s in std):
            raise ConfigError(f"std must be positive, got std={std!r}")
        if mean is not None and len(mean) != len(std):
            raise ConfigError(f"mean and std need one value per channel each, got {len(mean)} and {len(std)}: "
                              f"mean={mean!r}, std={std!r}")
        if not dtype.is_floating_point:
            raise ConfigError(f"dtype must be a floating type, got dtype={dtype}")
        self.mean, self.std, self.dtype, self.memory_format = mean, std, dtype, memory_format
        # per (device, channels): without mean and std, x / 255 fits images of any channel count
        self._cache: dict[tuple[torch.device, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def _coefficients(self, device: torch.device, channels: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.mean is not None and len(self.mean) != channels:
            raise ConfigError(f"mean/std have {len(self.mean)} channels, the images {channels}: give one value "
                              "per channel of the images")
        if (device, channels) not in self._cache:
            mean = torch.tensor(self.mean if self.mean is not None else [0.0] * channels, dtype=torch.float64)
            std = torch.tensor(self.std if self.std is not None else [1.0] * channels, dtype=torch.float64)
            scale, shift = 1.0 / (255.0 * std), -mean / std
            scale, shift = (t.float().view(1, -1, 1, 1).to(device) for t in (scale, shift))
            self._cache[device, channels] = (scale, shift)
        return self._cache[device, channels]

    def __call__(self, x: Batch, generator: Rng = None) -> Batch:
        if isinstance(x, dict):
            return {**x, "image": self(x["image"], generator)}
        return self.cast(self.float32(x))

    def cast(self, y: torch.Tensor, copy: bool = False) -> torch.Tensor:
        """`float32`'s result as ``dtype`` (the layout kept; with ``copy``, always a new tensor)."""
        return y.to(self.dtype, copy=copy)

    def float32(self, x: torch.Tensor) -> torch.Tensor:
        """The normalised image tensor in float32, before the cast to ``dtype``."""
        scale, shift = self._coefficients(x.device, x.shape[1])
        # A multiply, then an add, as two kernels: no device may fuse them into one FMA (CUDA's addcmul does,
        # the CPU's does not), so the GPU gives the CPU's bits. Same passes as float() + addcmul.
        if self.memory_format is None or x.ndim != 4 or x.is_contiguous(memory_format=self.memory_format):
            out = torch.mul(x, scale)
        else:  # the same products, written in the asked layout (a cast keeps it)
            out = torch.mul(x, scale, out=torch.empty_like(x, dtype=torch.float32, memory_format=self.memory_format))
        return out.add_(shift)
