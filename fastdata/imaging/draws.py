"""The augmentation draws every backend shares: one seed per batch, random-resized-crop boxes, flips.

NOTE [crop draws]: the rules every backend's random crops and flips follow.

1. A batch's draws come from ``batch_seed(seed, epoch, position, rank)``, so a resumed run draws the same crops
   and each rank its own.
2. For a batch of ``n`` samples (rows in the order served), the draws are ``u = rand(n, 10, 4)`` for the boxes,
   then ``rand(n) < p`` for the flips, from one `Draws` stream.
3. That is exactly what ``Compose([RandomResizedCrop, RandomHorizontalFlip])`` draws in CUDAPrefetcher, on any
   device.
4. ``Draws`` hashes (seed, counter) with integer arithmetic, so the numbers are the same on the CPU and on a GPU
   (torch's CUDA generator is another algorithm than its CPU one: seeded alike, they differ).
5. Drawing them on a GPU copies nothing from the host.
6. The LMDB reader's decode-time crops (``FastDataset(crop="random")``) and the DALI backend call
   `draw_resized_crops` with each image's own size, so they agree with one another.
7. They agree with the batched transform up to the image each box is drawn on: the whole stored image, not a
   centre square.
"""
from __future__ import annotations

import functools
import math
from typing import Optional, Union

import numpy as np
import torch

from ..errors import ConfigError

TRIES = 10  # torchvision's number of area/aspect tries before the centre-crop fallback
SCALE = (0.08, 1.0)  # torchvision's RandomResizedCrop defaults
RATIO = (3 / 4, 4 / 3)


def check_scale_ratio(scale: tuple[float, float], ratio: tuple[float, float]) -> None:
    """Refuse random-resized-crop parameters torchvision would refuse (one rule for every backend)."""
    for name, pair in (("scale", scale), ("ratio", ratio)):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise ConfigError(f"{name} must be a (min, max) pair, got {name}={pair!r}")
    if not (0 < scale[0] <= scale[1] <= 1):
        raise ConfigError(f"scale must satisfy 0 < min <= max <= 1, got scale={scale!r}")
    if not (0 < ratio[0] <= ratio[1]):
        raise ConfigError(f"ratio must satisfy 0 < min <= max, got ratio={ratio!r}")


# splitmix64's constants as int64 (torch has no uint64 arithmetic): its multiplications wrap mod 2**64 alike
# on every device, and each right shift is masked to the logical shift splitmix64 means
GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
MIX2 = 0x94D049BB133111EB - (1 << 64)


class Draws:
    """Uniform floats in ``[0, 1)`` that depend on ``seed`` and on how many were drawn before, nothing else:
    the same numbers on every device (splitmix64 of a counter in int64 arithmetic, exact everywhere; see
    NOTE [crop draws]). Transforms take it where they take a ``torch.Generator``."""

    def __init__(self, seed: int) -> None:
        self.seed: Optional[int] = seed
        key = seed & ((1 << 64) - 1)
        self.key: Union[int, torch.Tensor] = key - (1 << 64) if key >= 1 << 63 else key
        self.used = 0

    @classmethod
    def keyed(cls, key: torch.Tensor, used: int = 0) -> "Draws":
        """A stream whose key is read from ``key`` (a 0-d int64 tensor, the value of another stream's ``key``)
        when its numbers are computed: a CUDA graph captured with it draws each replay's numbers from the key
        filled in before that replay (NOTE [graphed convert] in fastdata/gpu/cuda_graphs.py)."""
        draws = cls(0)
        draws.seed, draws.key, draws.used = None, key, used
        return draws

    def rand(self, *shape: int, device: Union[str, torch.device, None] = None) -> torch.Tensor:
        """``torch.rand(*shape)`` from this stream, on ``device`` (computed there: nothing crosses; 17 small
        kernels whatever the shape)."""
        n = math.prod(shape)
        z = torch.arange(self.used, self.used + n, dtype=torch.int64, device=device)
        self.used += n
        z = z.mul_(GOLDEN).add_(self.key)
        z = (z ^ ((z >> 30) & ((1 << 34) - 1))).mul_(MIX1)
        z = (z ^ ((z >> 27) & ((1 << 37) - 1))).mul_(MIX2)
        z = z ^ ((z >> 31) & ((1 << 33) - 1))
        return ((z >> 40) & 0xFFFFFF).to(torch.float32).mul_(2.0 ** -24).view(shape)  # 24 bits: exact in fp32


def uniform(shape: tuple[int, ...], generator: Union[None, torch.Generator, Draws],
            device: Union[str, torch.device, None]) -> torch.Tensor:
    """``torch.rand(shape)`` from ``generator``: a `Draws` stream, a ``torch.Generator`` or torch's
    global generator (None)."""
    if isinstance(generator, Draws):
        return generator.rand(*shape, device=device)
    return torch.rand(shape, generator=generator, device=device)


def batch_seed(seed: int, epoch: int, position: int, rank: int) -> int:
    """The seed of one batch's augmentation draws (see NOTE [crop draws])."""
    return int(np.random.SeedSequence([seed, epoch, position, rank]).generate_state(1)[0])


def rrc_boxes(height: Union[torch.Tensor, int], width: Union[torch.Tensor, int], u: torch.Tensor,
              scale: tuple[float, float], ratio: tuple[float, float]) -> torch.Tensor:
    """Random-resized-crop boxes for images of per-sample ``height`` x ``width`` (B,) from uniform draws
    ``u`` (B, tries, 4): (B, 4) float top, left, height, width in whole pixels. ``height`` and ``width``
    may be numbers when every image has that size (a batch tensor): the per-image constants, the fallback
    box among them, are then computed once on the host in the same float32 arithmetic, the same values
    with 16 fewer small kernels on ``u``'s device (each costs the training loop's thread a launch).

    torchvision's rule: the first try whose area ~ U(scale) and log-aspect ~ U(log ratio) fits, else the
    centre crop clamped to ``ratio``. Vectorised, with no host sync (fallbacks blended with ``where``).
    """
    one_size = not isinstance(height, torch.Tensor)
    if one_size:
        H, W, HW, fallback_box = _one_size(float(height), float(width), tuple(ratio))
    else:
        H, W = height.float()[:, None], width.float()[:, None]
        HW = H * W
    area = HW * (scale[0] + u[..., 0] * (scale[1] - scale[0]))
    lo, hi = math.log(ratio[0]), math.log(ratio[1])
    aspect = torch.exp(lo + u[..., 1] * (hi - lo))
    w = torch.round(torch.sqrt(area * aspect))
    h = torch.round(torch.sqrt(area / aspect))
    ok = (w > 0) & (w <= W) & (h > 0) & (h <= H)
    first = torch.argmax(ok.int(), dim=1)  # the first try that fits (0 when none does: see fallback)
    pick = lambda t: t.gather(1, first[:, None]).squeeze(1)  # noqa: E731
    h, w, uy, ux = pick(h), pick(w), pick(u[..., 2]), pick(u[..., 3])
    if not one_size:
        H, W = H[:, 0], W[:, 0]
        fallback_box = _fallback_box(H, W, ratio)
    top = torch.floor(uy * (H - h + 1))
    left = torch.floor(ux * (W - w + 1))
    fallback = ~ok.any(dim=1)
    box = [top, left, h, w]  # each a tensor of its own: filled in place
    for k, value in enumerate(fallback_box):
        if one_size:  # a number goes to the kernel as its argument (where() would make a tensor of it)
            box[k].masked_fill_(fallback, value)
        else:
            box[k] = torch.where(fallback, value, box[k])
    return torch.stack(box, dim=1)


@functools.lru_cache(maxsize=256)  # a run's batches share a few sizes: computed once each
def _one_size(height: float, width: float, ratio: tuple[float, float]
              ) -> tuple[float, float, float, tuple[float, ...]]:
    """`rrc_boxes`'s per-image constants for one image size, by the same float32 tensor arithmetic,
    as Python numbers (float32 values: a tensor op casts them back exactly): height, width, their product,
    the fallback box."""
    H, W = torch.tensor([height], dtype=torch.float32), torch.tensor([width], dtype=torch.float32)
    return float(H), float(W), float(H * W), tuple(float(v) for v in _fallback_box(H, W, ratio))


def _fallback_box(H: torch.Tensor, W: torch.Tensor, ratio: tuple[float, float]) -> tuple[torch.Tensor, ...]:
    """torchvision's fallback for images ``H`` x ``W`` (float32): the whole image, narrowed to the nearest
    allowed aspect ratio, centred. Top, left, height, width (the order of a box)."""
    in_ratio = W / H
    fw = torch.where(in_ratio > ratio[1], torch.round(H * ratio[1]), W)
    fh = torch.where(in_ratio < ratio[0], torch.round(W / ratio[0]), H)
    return torch.div(H - fh, 2, rounding_mode="floor"), torch.div(W - fw, 2, rounding_mode="floor"), fh, fw


def draw_resized_crops(key: tuple[int, int, int, int], sizes: np.ndarray, scale: tuple[float, float] = SCALE,
                       ratio: tuple[float, float] = RATIO, flip_p: float = 0.5) -> tuple[np.ndarray, np.ndarray]:
    """One batch's random-resized-crop boxes and flips from ``key = (seed, epoch, position, rank)``.

    ``sizes`` is ``(n, 2)`` image heights and widths (any value for rows that will be dropped: each row
    draws the same whatever the others are). Returns int64 ``(n, 4)`` top, left, height, width and bool
    ``(n,)`` flips, drawn as NOTE [crop draws] says.
    """
    draws = Draws(batch_seed(*key))
    n = len(sizes)
    u = draws.rand(n, TRIES, 4)
    flips = draws.rand(n) < flip_p
    hw = torch.as_tensor(np.asarray(sizes, dtype=np.float32).reshape(n, 2)).clamp_(min=1)
    boxes = rrc_boxes(hw[:, 0], hw[:, 1], u, scale, ratio)
    return boxes.to(torch.int64).numpy(), flips.numpy()
