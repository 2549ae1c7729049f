"""Decoding the same JPEG LMDB three ways, in the same run: DALI, FastDataset's CPU path, DataLoader + Pillow.

Rows: DALILoader (nvJPEG on the GPU with device "mixed" when CUDA is there, DALI's CPU decoder otherwise),
FastLoader over FastDataset's LMDB CPU-decode path (Pillow with draft, all cores as threads), and a torch
DataLoader + Pillow over the original JPEG files (all cores as worker processes). Evaluation transforms
(shorter side to --size, centre crop), batch 64. GPU-only row (training rate of ResNet-50 fed by each) is
left to a GPU machine.

    python benchmarks/bench_dali.py [--images 1024] [--size 224] [--device auto]
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

import fastdata
from fastdata.dataset import FastDataset
from fastdata.loader import FastLoader
from fastdata.preprocess.images import ImagePreprocessConfig, preprocess_images
from fastdata.synthetic import make_image_folder
from fastdata.train import resolve_device

sys.path.insert(0, str(Path(__file__).parent))
from bench_loader import PillowFolder, rate  # noqa: E402  (shared baseline and timing)


def main() -> None:
    from fastdata.dali import DALILoader

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=1024)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()
    device = resolve_device(args.device).type
    scratch = Path(tempfile.mkdtemp(prefix="fastdata-bench-dali-"))
    try:
        files = make_image_folder(scratch / "jpeg", num_classes=8, per_class=args.images // 8,
                                  sizes=((500, 375), (375, 500)))
        preprocess_images(ImagePreprocessConfig(src=scratch / "jpeg", out=scratch / "lmdb", size=256, format="lmdb",
                                                progress=False))
        cores = os.cpu_count() or 1
        print(f"fastdata {fastdata.__version__}, torch {torch.__version__}, {cores} cores, device {device}, "
              f"{len(files)} JPEGs 500x375 stored at shorter side 256, output {args.size}px, batch 64")
        dali = DALILoader(scratch / "lmdb", 64, size=args.size, train=False, device=device, num_threads=cores)
        native = FastLoader(FastDataset(scratch / "lmdb", size=args.size), 64, num_threads=cores)
        labels = [0] * len(files)
        plain = lambda: torch.utils.data.DataLoader(PillowFolder(files, labels, args.size), 64,  # noqa: E731
                                                     shuffle=True, num_workers=cores)
        rows = {f"DALI ({'mixed GPU' if device == 'cuda' else 'CPU'} decode)": rate(lambda: dali, args.seconds),
                f"FastDataset LMDB CPU decode, {cores} threads": rate(lambda: native, args.seconds),
                f"DataLoader + Pillow over the JPEG files, {cores} workers": rate(plain, args.seconds)}
        for name, r in rows.items():
            print(f"{name:<55} {r:>8,.0f} images/s")
        base = list(rows.values())[2]
        print(f"vs DataLoader + Pillow: DALI {list(rows.values())[0] / base:.2f}x, FastDataset CPU decode "
              f"{list(rows.values())[1] / base:.2f}x")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
