"""Generate real image files locally (nothing is downloaded): for the demo, benchmarks and tests.

Each class has its own colour tint and stripe orientation on top of a smooth random background, so a
small CNN can tell classes apart, and JPEGs of these compress about as photos do (not as flat colour).
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
from PIL import Image

from .._io import disk_error


def synthetic_image(rng: np.random.Generator, label: int, num_classes: int, width: int, height: int) -> np.ndarray:
    """One ``(height, width, 3)`` uint8 image of class ``label``."""
    # Smooth background: coarse noise upsampled (Pillow's bicubic) plus fine grain.
    coarse = rng.integers(0, 256, (max(2, height // 32), max(2, width // 32), 3), dtype=np.uint8)
    base = np.asarray(Image.fromarray(coarse).resize((width, height), Image.Resampling.BICUBIC), np.float32)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    angle = np.pi * label / num_classes
    period = 6.0 + 2.0 * (label % 3) + min(width, height) / 40
    stripes = np.sin((xx * np.cos(angle) + yy * np.sin(angle)) * (2 * np.pi / period))
    tint = np.array([np.cos(angle), np.cos(angle + 2.1), np.cos(angle + 4.2)], np.float32) * 60
    img = 0.5 * base + 60 * stripes[..., None] + tint + 64 + rng.normal(0, 8, (height, width, 3)).astype(np.float32)
    return np.clip(img, 0, 255).astype(np.uint8)


def make_image_folder(root: Path | str, *, num_classes: int = 4, per_class: int = 25,
                      sizes: Sequence[tuple[int, int]] = ((500, 375), (375, 500), (640, 480)), ext: str = ".jpg",
                      quality: int = 90, seed: int = 0) -> list[Path]:
    """Write an ImageFolder tree ``root/class_k/img_nnnn.ext``; returns the files in sample order.

    Raises:
        OutputError: A folder or file cannot be written (a file where a folder should be, a full disk).
    """
    root = Path(root)
    rng = np.random.default_rng(seed)
    files = []
    try:
        for c in range(num_classes):
            folder = root / f"class_{c}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                w, h = sizes[(c * per_class + i) % len(sizes)]
                path = folder / f"img_{i:04d}{ext}"
                kwargs = {"quality": quality} if ext.lower() in (".jpg", ".jpeg") else {}
                Image.fromarray(synthetic_image(rng, c, num_classes, w, h)).save(path, **kwargs)
                files.append(path)
    except OSError as exc:  # (one line, not a NotADirectoryError traceback: a file where a folder should be)
        raise disk_error(exc, root) from exc
    return files
