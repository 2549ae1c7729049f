"""Decoding the same JPEG LMDB three ways, in the same run: DALI, FastDataset's CPU path, DataLoader + Pillow.

Rows: DALILoader (nvJPEG on the GPU with device "mixed" when CUDA is there, DALI's CPU decoder otherwise),
FastLoader over FastDataset's LMDB CPU-decode path (Pillow with draft, all cores as threads), and a torch
DataLoader + Pillow over the original JPEG files (all cores as worker processes). Evaluation transforms
(shorter side to --size, centre crop), batch 64. On a GPU also ResNet-50 training images/s (bf16,
channels_last, batch --train-batch) fed by each in training mode (random-resized-crop + flip: DALI's own,
the CUDAPrefetcher's GPU transforms over FastDataset's decode; the plain DataLoader keeps its per-sample
Pillow centre crop, the cheapest recipe), beside the same model on synthetic data already on the GPU (the
ceiling).

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
from fastdata.timing import ModelStep, full_pipeline, timed_rate
from fastdata.dataset import FastDataset
from fastdata.gpu_transforms import Compose, RandomHorizontalFlip, RandomResizedCrop
from fastdata.loader import FastLoader
from fastdata.prefetch import CUDAPrefetcher
from fastdata.preprocess.images import ImagePreprocessConfig, preprocess_images
from fastdata.synthetic import make_image_folder
from fastdata.distributed import resolve_device

sys.path.insert(0, str(Path(__file__).parent))
from bench_loader import PillowFolder, rate  # noqa: E402  (shared baseline and timing)


def main() -> None:
    from fastdata.dali import DALILoader

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=1024)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--train-batch", type=int, default=256)
    ap.add_argument("--train-seconds", type=float, default=20.0)
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
        if device == "cuda":
            training_rates(scratch, files, args)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def training_rates(scratch: Path, files: list[Path], args: argparse.Namespace, device: str = "cuda") -> None:
    """ResNet-50 training images/s fed by each loader in training mode, against synthetic data on ``device``."""
    from fastdata.dali import DALILoader

    torch.backends.cudnn.benchmark = True
    b, size, cores = args.train_batch, args.size, os.cpu_count() or 1
    net = ModelStep("resnet50", 8, torch.device(device))
    x = torch.randn(b, 3, size, size, device=device).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 8, (b,), device=device)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # the model autocasts to bf16 on CUDA only
    aug = Compose([RandomResizedCrop(size), RandomHorizontalFlip()])
    labels = [i // (len(files) // 8) for i in range(len(files))]
    feeds = {
        "DALI (nvJPEG mixed decode, crops in the decoder)": DALILoader(
            scratch / "lmdb", b, size=size, train=True, dtype=dtype, num_threads=cores, device=device),
        f"FastDataset LMDB CPU decode + CUDAPrefetcher ({cores} threads)": CUDAPrefetcher(
            FastLoader(FastDataset(scratch / "lmdb", size=256), b, num_threads=cores), device,
            dtype=dtype, transforms=aug),
        f"DataLoader + Pillow + pin_memory ({cores} workers)": CUDAPrefetcher(
            torch.utils.data.DataLoader(PillowFolder(files, labels, size), b, shuffle=True, num_workers=cores,
                                        pin_memory=device == "cuda", persistent_workers=True), device,
            dtype=dtype),
    }
    ceiling = timed_rate(lambda: (net.step(x, y), b)[1], args.train_seconds)
    gpu = torch.cuda.get_device_name() if device == "cuda" else device
    print(f"ResNet-50@{size}, batch {b}, {'bf16' if device == 'cuda' else 'fp32'}, channels_last, {gpu}:")
    print(f"  {'synthetic data on the GPU (ceiling)':<58} {ceiling:>8,.0f} images/s")
    for name, feed in feeds.items():
        r, wait = full_pipeline(feed, net, args.train_seconds)
        print(f"  {name:<58} {r:>8,.0f} images/s  {r / ceiling:>6.1%} of the ceiling, waiting {wait:.0f}% of the time")


if __name__ == "__main__":
    main()
