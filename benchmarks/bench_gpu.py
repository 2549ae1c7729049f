"""GPU feeding, one run: H2D bandwidth and training steps/s with each way of feeding the model.

1. Host-to-device copy of 256 MiB: pinned vs pageable (the physical limit), and the effective bandwidth
   of FastLoader + CUDAPrefetcher with no model (uint8 batches in, normalised bf16 on the GPU out).
2. ResNet-50 at 224 and ResNet-18 at 112 (fastdata.models, bf16 autocast, channels_last), training steps/s
   fed by (a) synthetic data already on the GPU (the ceiling), (b) FastLoader + CUDAPrefetcher
   (RandomResizedCrop + flip on the GPU), (c) storage="cuda" + GPU transforms, (d) torch DataLoader +
   Pillow (decode, resize, centre crop per sample) + pin_memory, all cores. Data stall = 1 - b/a.
Targets (issue 5, H100): stall <= 1% for ResNet-50@224, <= 5% for ResNet-18@112; prefetcher H2D >= 0.9x
pinned. Needs a CUDA GPU; on a CPU-only machine it says so and exits.

    python benchmarks/bench_gpu.py [--images 2048] [--batch-size 256] [--seconds 20]
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
from fastdata.timing import ModelStep, full_pipeline, machine, timed_rate
from fastdata.dataset import FastDataset
from fastdata.gpu_transforms import Compose, RandomHorizontalFlip, RandomResizedCrop
from fastdata.loader import FastLoader
from fastdata.prefetch import CUDAPrefetcher
from fastdata.preprocess.images import ImagePreprocessConfig, preprocess_images
from fastdata.synthetic import make_image_folder

sys.path.insert(0, str(Path(__file__).parent))
from bench_loader import PillowFolder  # noqa: E402  (the same per-sample recipe as the loader benchmark)


def h2d(seconds: float) -> dict[str, float]:
    host = torch.empty(256 << 20, dtype=torch.uint8)
    pinned = host.pin_memory()
    dev = torch.empty_like(host, device="cuda")
    out = {}
    for name, src in (("pinned", pinned), ("pageable", host)):
        rate = timed_rate(lambda src=src: (dev.copy_(src, non_blocking=True), 1)[1], seconds / 2)
        out[name] = rate * host.numel() / 1e9
    return out


def feed_rates(root: Path, files: list[Path], labels: list[int], model: str, crop: int, batch: int,
               seconds: float) -> dict[str, float]:
    ds = FastDataset(root, storage="ram")
    classes = len(ds.classes)
    net = ModelStep(model, classes, torch.device("cuda"))
    x = torch.randn(batch, 3, crop, crop, device="cuda").contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, classes, (batch,), device="cuda")
    aug = Compose([RandomResizedCrop(crop), RandomHorizontalFlip()])
    rates = {"(a) synthetic on the GPU (ceiling)": timed_rate(lambda: (net.step(x, y), batch)[1], seconds)}
    fed = CUDAPrefetcher(FastLoader(ds, batch), device="cuda", dtype=torch.bfloat16, transforms=aug)
    rates["(b) FastLoader + CUDAPrefetcher"] = full_pipeline(fed, net, seconds)[0]
    on_gpu = CUDAPrefetcher(FastLoader(FastDataset(root, storage="cuda", device="cuda"), batch), device="cuda",
                            dtype=torch.bfloat16, transforms=aug)
    rates['(c) storage="cuda" + GPU transforms'] = full_pipeline(on_gpu, net, seconds)[0]
    plain = torch.utils.data.DataLoader(PillowFolder(files, labels, size=crop), batch, shuffle=True,
                                        num_workers=os.cpu_count(), pin_memory=True, persistent_workers=True)
    baseline = CUDAPrefetcher(plain, device="cuda", dtype=torch.bfloat16)  # normalised on the GPU like (b)
    rates["(d) DataLoader + Pillow + pin_memory"] = full_pipeline(baseline, net, seconds)[0]
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--seconds", type=float, default=20.0)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: this benchmark measures GPU feeding and has nothing to measure here")
        return
    torch.backends.cudnn.benchmark = True
    m = machine()
    print(f"fastdata {fastdata.__version__}, torch {torch.__version__}, {m['gpu']}, {m['cores']} cores, {m['date']}")
    bw = h2d(args.seconds)
    print(f"H2D 256 MiB: pinned {bw['pinned']:.1f} GB/s, pageable {bw['pageable']:.1f} GB/s")
    scratch = Path(tempfile.mkdtemp(prefix="fastdata-bench-gpu-"))
    try:
        files = make_image_folder(scratch / "jpeg", num_classes=8, per_class=args.images // 8,
                                  sizes=((500, 375), (375, 500)))
        labels = [i // (args.images // 8) for i in range(len(files))]
        for side in (256, 128):
            preprocess_images(ImagePreprocessConfig(src=scratch / "jpeg", out=scratch / f"s{side}", size=side,
                                                    progress=False))
        ds = FastDataset(scratch / "s256", storage="ram")
        pf = CUDAPrefetcher(FastLoader(ds, args.batch_size), device="cuda", dtype=torch.bfloat16)
        rate = timed_rate(lambda: sum(len(x) for x, _ in pf), args.seconds)
        gbs = rate * 256 * 256 * 3 / 1e9
        print(f"CUDAPrefetcher (no model): {rate:,.0f} images/s = {gbs:.1f} GB/s of uint8, "
              f"{gbs / bw['pinned']:.2f}x pinned H2D (target >= 0.9)")
        for model, side, crop in (("resnet50", 256, 224), ("resnet18", 128, 112)):
            rates = feed_rates(scratch / f"s{side}", files, labels, model, crop, args.batch_size, args.seconds)
            ceiling = rates["(a) synthetic on the GPU (ceiling)"]
            print(f"{model}@{crop}, batch {args.batch_size}, bf16, channels_last:")
            for name, r in rates.items():
                print(f"  {name:<40} {r:>9,.0f} images/s  {r / ceiling:>6.1%} of the ceiling")
            stall = 1 - rates["(b) FastLoader + CUDAPrefetcher"] / ceiling
            print(f"  data stall (1 - b/a): {100 * stall:.1f}% (target <= {1 if model == 'resnet50' else 5}%)")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
