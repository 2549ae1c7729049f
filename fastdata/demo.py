"""``fastdata demo``: build a small JPEG dataset locally, preprocess it, verify it, read it back, report speed.

Nothing is downloaded. The read-back compares whole-batch reads from the uint8 shards with what a
plain pipeline does per sample today (Pillow: open, decode, resize, crop) over the same files.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from ._io import safe_join
from .manifest import verify
from .preprocess.decode import load_array
from .preprocess.images import ImagePreprocessConfig, preprocess_images
from .synthetic import make_image_folder


def run_demo(out: Path, *, num_classes: int = 4, per_class: int = 100, size: int = 64, batch_size: int = 64,
             seed: int = 0) -> dict[str, float]:
    """Run the demo in ``out`` (created; reused when it already holds the images); returns the figures."""
    t_start = time.perf_counter()
    out = Path(out)
    src, data = out / "jpeg", out / "dataset"
    n = num_classes * per_class
    if len(list(src.rglob("*.jpg"))) != n:
        print(f"writing {n} JPEG files ({num_classes} classes, 500x375 and 375x500) to {src}")
        make_image_folder(src, num_classes=num_classes, per_class=per_class, sizes=((500, 375), (375, 500)),
                          seed=seed)
    t = time.perf_counter()
    manifest = preprocess_images(ImagePreprocessConfig(src=src, out=data, size=size, overwrite=True))
    t_pre = time.perf_counter() - t
    print(f"preprocessed {manifest['num_samples']} images to {size}x{size} uint8 shards in {t_pre:.2f} s "
          f"({manifest['num_samples'] / t_pre:.0f} images/s)")
    problems = verify(data)
    print("verify: " + ("OK, every file matches its checksum" if not problems else "; ".join(problems)))

    files = sorted(src.rglob("*.jpg"))
    images = np.concatenate([np.load(safe_join(data, s["images"]), allow_pickle=False) for s in manifest["shards"]])
    order = np.random.default_rng(seed).permutation(n)
    batches = [np.sort(order[i:i + batch_size]) for i in range(0, n, batch_size)]
    t = time.perf_counter()
    for _ in range(5):  # five epochs of whole-batch gathers from the shards, loaded into RAM
        for b in batches:
            np.take(images, b, axis=0)
    fast = 5 * n / (time.perf_counter() - t)
    t = time.perf_counter()
    for b in batches:  # one epoch of per-sample decoding, as a plain Dataset.__getitem__ does
        np.stack([load_array(files[i], size, "center-crop") for i in b])
    slow = n / (time.perf_counter() - t)
    print(f"read back in batches of {batch_size}: uint8 shards {fast:,.0f} images/s vs Pillow decode {slow:,.0f} images/s ({fast / slow:,.0f}x)")
    total = time.perf_counter() - t_start
    print(f"total time {total:.1f} s")
    return {"preprocess_img_s": manifest["num_samples"] / t_pre, "shards_img_s": fast, "pillow_img_s": slow,
            "speedup": fast / slow, "total_s": total}
