"""Segmentation samples (image + mask at 256) served by FastLoader vs the per-sample DataLoader a user writes
today, on the same data, one run (issue 20, item 7).

Rows (batch 64, uint8 256x256x3 images + uint8 256x256 masks): np.copyto of the same bytes (the ceiling);
FastLoader over mmap (warm page cache) and ram; a torchvision-style Dataset that opens the JPEG and the PNG
mask per sample, resizes the image (bilinear) and the mask (nearest) to 256 and stacks them, in a DataLoader
with 2 workers. Targets: FastLoader >= 50x the per-sample DataLoader, >= 0.5x memcpy of the bytes delivered.

    python benchmarks/bench_fields.py [--images 1024] [--seconds 3]
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from fastdata import FastDataset, FastLoader
from fastdata.cli.timing import machine, timed_rate
from fastdata.preprocess.images import ImagePreprocessConfig, preprocess_images

SIZE, BATCH = 256, 64


def make_pairs(root: Path, n: int) -> None:
    """``root/images/*.jpg`` (320x288 photos-like noise + shapes) and ``root/masks/*.png`` of the same stems."""
    rng = np.random.default_rng(0)
    (root / "images").mkdir(parents=True)
    (root / "masks").mkdir()
    base = rng.integers(0, 255, (288, 320, 3), dtype=np.uint8)
    for i in range(n):
        img = np.roll(base, i * 7, axis=1)
        mask = np.zeros((288, 320), np.uint8)
        y, x = int(rng.integers(0, 200)), int(rng.integers(0, 200))
        img[y:y + 80, x:x + 100] = (255, 0, 0)
        mask[y:y + 80, x:x + 100] = 1 + i % 20
        Image.fromarray(img).save(root / "images" / f"{i:05d}.jpg", quality=90)
        Image.fromarray(mask).save(root / "masks" / f"{i:05d}.png")


class PerSamplePairs(torch.utils.data.Dataset):
    """The usual segmentation Dataset: decode the JPEG and the PNG mask, resize both (bilinear / nearest)."""

    def __init__(self, root: Path) -> None:
        self.images = sorted((root / "images").glob("*.jpg"))
        self.root = root

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        img = Image.open(self.images[i]).convert("RGB").resize((SIZE, SIZE), Image.Resampling.BILINEAR)
        mask = Image.open(self.root / "masks" / (self.images[i].stem + ".png")).resize((SIZE, SIZE),
                                                                                      Image.Resampling.NEAREST)
        return {"image": torch.from_numpy(np.asarray(img).copy()), "mask": torch.from_numpy(np.asarray(mask).copy())}


def rate(make_iter, seconds: float) -> float:
    return timed_rate(lambda: sum(len(b["image"]) for b in make_iter()), seconds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=1024)
    ap.add_argument("--seconds", type=float, default=3.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        make_pairs(root / "src", args.images)
        preprocess_images(ImagePreprocessConfig(root / "src", root / "ds", size=SIZE, resize="squash",
                                                progress=False))
        sample_bytes = SIZE * SIZE * 4
        rows: dict[str, float] = {}
        src = np.ones((args.images, sample_bytes), np.uint8)
        dst = np.empty((BATCH, sample_bytes), np.uint8)

        def copies():
            for a in range(0, args.images - BATCH + 1, BATCH):
                np.copyto(dst, src[a:a + BATCH])
                yield {"image": dst}
        rows["memcpy (ceiling)"] = rate(copies, args.seconds)
        for storage in ("mmap", "ram"):
            loader = FastLoader(FastDataset(root / "ds", storage=storage), BATCH, pin_memory=False)
            rows[f"FastLoader ({storage})"] = rate(lambda: loader, args.seconds)
        plain = PerSamplePairs(root / "src")
        dl = torch.utils.data.DataLoader(plain, BATCH, shuffle=True, num_workers=2, persistent_workers=True)
        rows["DataLoader per-sample JPEG+PNG (2 workers)"] = rate(lambda: dl, args.seconds)
    mc, dl_rate = rows["memcpy (ceiling)"], rows["DataLoader per-sample JPEG+PNG (2 workers)"]
    print(f"{'loader':<46} {'samples/s':>10} {'GB/s':>7} {'x memcpy':>9} {'x DataLoader':>13}")
    for name, r in rows.items():
        print(f"{name:<46} {r:>10.0f} {r * sample_bytes / 1e9:>7.2f} {r / mc:>9.2f} {r / dl_rate:>13.1f}")
    print(json.dumps({"machine": machine(), "images": args.images, "rows": rows}))


if __name__ == "__main__":
    main()
