"""One epoch of the same model on the same images: the plain PyTorch recipe vs fastdata, same run.

(a) what a user writes today: a Dataset that opens each JPEG with Pillow, resizes, crops, makes a float
tensor and normalises it; DataLoader(num_workers=all cores, pin_memory on CUDA); ``.to(device)`` per step.
(b) fastdata: the preprocessed uint8 shards -> FastLoader -> CUDAPrefetcher (normalise + flip on the device)
-> Trainer (the `fastdata train` loop). Same model (cnn-small), init, batch size, optimiser and lr.
(c) the limit: (b)'s Trainer and model for as many steps on one batch already on the device, so no data
work at all: the epoch time no loader can beat on this machine.
Prints the three epoch times, the speed-up of (b) over (a), each epoch against (c), and each data-stall %
(time waiting for the next batch / epoch time). Preprocessing is a one-off cost, reported on its own line.

Each row runs --rounds epochs, interleaved with the others, and keeps its fastest.

    python benchmarks/bench_train.py [--images 2048] [--size 64] [--batch-size 64] [--device auto] [--rounds 2]
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import fastdata
from fastdata.cli.synthetic import make_image_folder
from fastdata.distributed import init_distributed
from fastdata.preprocess.images import ImagePreprocessConfig, preprocess_images
from fastdata.train.assemble import ImageRun, build
from fastdata.train.config import TrainConfig
from fastdata.train.models import create_model
from fastdata.train.trainer import Trainer

sys.path.insert(0, str(Path(__file__).parent))
from bench_loader import PillowFolder  # noqa: E402  (the per-sample baseline every benchmark uses)

MEAN, STD = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1), torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)


class PlainFolder(PillowFolder):
    """bench_loader's Pillow recipe, then what the recipe does next: float tensor, random flip, normalise."""

    def __getitem__(self, i: int):
        img, label = super().__getitem__(i)
        x = img.permute(2, 0, 1).float() / 255
        if torch.rand(()) < 0.5:
            x = x.flip(-1)
        return (x - MEAN) / STD, label


def plain_epoch(files, labels, size, batch, device, lr, classes) -> tuple[float, float]:
    torch.manual_seed(0)
    model = create_model("cnn-small", num_classes=classes).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    loader = torch.utils.data.DataLoader(PlainFolder(files, labels, size), batch, shuffle=True,
                                         num_workers=os.cpu_count() or 1, pin_memory=device.type == "cuda")
    waited, t0 = 0.0, time.perf_counter()
    it = iter(loader)
    while True:
        t = time.perf_counter()
        batch_ = next(it, None)
        if batch_ is None:
            break
        x, y = batch_[0].to(device), batch_[1].to(device)
        waited += time.perf_counter() - t
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    total = time.perf_counter() - t0
    return total, 100 * waited / total


def trainer(model: torch.nn.Module, loader: Any, device: torch.device, lr: float) -> Trainer:
    return Trainer(model, loader, config=TrainConfig(epochs=1, lr=lr, momentum=0.9, weight_decay=0.0,
                                                     schedule="constant", device=device.type, progress=False,
                                                     log_every=10))


def model_alone_epoch(steps: int, size: int, batch: int, device: torch.device, lr: float,
                      classes: int) -> float:
    """(b)'s Trainer and model for ``steps`` steps on one normalised batch kept on the device: no data work."""
    torch.manual_seed(0)
    model = create_model("cnn-small", num_classes=classes)
    x = torch.randn(batch, 3, size, size, device=device)
    y = torch.randint(0, classes, (batch,), device=device)
    run = trainer(model, [(x, y)] * steps, device, lr)
    t0 = time.perf_counter()
    run.fit()
    return time.perf_counter() - t0


def fastdata_epoch(data: Path, batch: int, device: torch.device, lr: float) -> tuple[float, float]:
    torch.manual_seed(0)
    model, train, _ = build(ImageRun(data=data, model="cnn-small", batch_size=batch, storage="ram",
                                          augment="flip"), device)
    run = trainer(model, train, device, lr)
    t0 = time.perf_counter()
    history = run.fit()
    return time.perf_counter() - t0, history[-1]["data_stall_pct"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=2048)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--rounds", type=int, default=2, help="epochs of each row, interleaved; the fastest is kept")
    args = ap.parse_args()
    device = init_distributed(args.device).device
    scratch = Path(tempfile.mkdtemp(prefix="fastdata-bench-train-"))
    try:
        classes = 8
        files = make_image_folder(scratch / "jpeg", num_classes=classes, per_class=args.images // classes,
                                  sizes=((500, 375), (375, 500)))
        labels = [i // (args.images // classes) for i in range(len(files))]
        t = time.perf_counter()
        preprocess_images(ImagePreprocessConfig(src=scratch / "jpeg", out=scratch / "ds", size=args.size,
                                                progress=False))
        t_pre = time.perf_counter() - t
        gpu = torch.cuda.get_device_name() if device.type == "cuda" else "none"
        print(f"fastdata {fastdata.__version__}, torch {torch.__version__}, {os.cpu_count()} cores, GPU {gpu}, "
              f"device {device}, {len(files)} JPEGs 500x375 -> {args.size}px, cnn-small, batch {args.batch_size}")
        print(f"one-off preprocessing: {t_pre:.1f} s ({len(files) / t_pre:.0f} images/s)")
        steps = -(-len(files) // args.batch_size)  # both epochs keep their last, partial batch
        runs: dict[str, list[tuple[float, float]]] = {"a": [], "b": [], "c": []}
        for _ in range(args.rounds):  # interleaved, each row's fastest epoch kept: this VM's timings are noisy
            runs["a"].append(plain_epoch(files, labels, args.size, args.batch_size, device, 0.05, classes))
            runs["b"].append(fastdata_epoch(scratch / "ds", args.batch_size, device, 0.05))
            runs["c"].append((model_alone_epoch(steps, args.size, args.batch_size, device, 0.05, classes), 0.0))
        (a_time, a_stall), (b_time, b_stall), (c_time, _) = (min(runs[k]) for k in "abc")
        print(f"(a) DataLoader + Pillow + float tensors: epoch {a_time:.2f} s, data stall {a_stall:.1f}%")
        print(f"(b) fastdata (FastLoader + CUDAPrefetcher + Trainer): epoch {b_time:.2f} s, data stall {b_stall:.1f}%")
        print(f"(c) limit, the model alone on a batch kept on the device ({steps} steps): epoch {c_time:.2f} s; "
              f"(a) takes {a_time / c_time:.2f}x it, (b) {b_time / c_time:.2f}x")
        print(f"speed-up {a_time / b_time:.2f}x per epoch; including the one-off preprocessing "
              f"{a_time / (b_time + t_pre):.2f}x for one epoch, {5 * a_time / (5 * b_time + t_pre):.2f}x for five")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
