"""FastLoader vs the ceiling (memcpy) and vs the DataLoaders a user has today, on the same data, one run.

Rows (224x224 uint8, batch 256): np.copyto of the same bytes (the ceiling); FastLoader over mmap (warm
page cache), ram and shm; torch DataLoader over the same FastDataset with per-sample __getitem__ (0 and
2 workers); torch DataLoader + Pillow decoding the original JPEGs (all cores, pin_memory when CUDA).
Then the memory 2 processes reading the whole dataset add to the machine, storage="shm" vs "ram".
Targets (issue 4): FastLoader(ram) >= 0.8x memcpy, >= 50x the Pillow DataLoader, >= 5x the per-sample
DataLoader over the same shards; 2 ranks on shm use about one copy.

    python benchmarks/bench_loader.py [--images 2048] [--seconds 3]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image

import fastdata
from fastdata import FastDataset, FastLoader
from fastdata.cli.synthetic import make_image_folder
from fastdata.cli.timing import timed_rate
from fastdata.preprocess.images import ImagePreprocessConfig, preprocess_images

SIZE, BATCH = 224, 256


class PerSample(torch.utils.data.Dataset):
    """The same FastDataset seen one sample at a time (no __getitems__): what a plain Dataset does."""

    def __init__(self, ds: FastDataset) -> None:
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int):
        return self.ds[i]


class PillowFolder(torch.utils.data.Dataset):
    """The usual recipe: open the JPEG, convert, resize the shorter side, centre-crop, to a uint8 tensor."""

    def __init__(self, files: list[Path], labels: list[int], size: int = SIZE) -> None:
        self.files, self.labels, self.size = files, labels, size

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int):
        img = Image.open(self.files[i]).convert("RGB")
        w, h = img.size
        n = self.size
        s = n / min(w, h)
        img = img.resize((max(n, round(w * s)), max(n, round(h * s))), Image.Resampling.BILINEAR)
        left, top = (img.width - n) // 2, (img.height - n) // 2
        return torch.from_numpy(np.asarray(img.crop((left, top, left + n, top + n))).copy()), self.labels[i]


def rate(make_iter, seconds: float, warmup: int = 1) -> float:
    """Images per second over whole passes of ``make_iter()``, for at least ``seconds`` (after warm-up;
    queued GPU work, such as DALI's, finishes inside the timed region)."""
    return timed_rate(lambda: sum(len(x) for x, _ in make_iter()), seconds, warmup)


def memcpy_rate(ds: FastDataset, seconds: float) -> float:
    src = np.empty((len(ds), SIZE, SIZE, 3), np.uint8)
    src[:] = 1
    dst = np.empty((BATCH, SIZE, SIZE, 3), np.uint8)

    def batches():
        for a in range(0, len(src) - BATCH + 1, BATCH):
            np.copyto(dst, src[a:a + BATCH])
            yield dst, None
    return rate(batches, seconds)


MEM_CODE = """
import sys
from fastdata import FastDataset, FastLoader
def anon():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("RssAnon:")) * 1024
base = anon()
ds = FastDataset(sys.argv[1], storage=sys.argv[2], shm_dir=sys.argv[3] if sys.argv[2] == "shm" else None)
for _ in FastLoader(ds, 256, num_threads=1, prefetch=0, pin_memory=False):  # one batch buffer
    pass
print(anon() - base, flush=True)  # private memory that opening and reading the dataset added
sys.stdin.read()  # stay alive until both have reported
"""


def node_memory_of_two(path: Path, storage: str, shm_dir: Path) -> int:
    """Memory 2 processes reading the whole dataset add to the machine: their private (anonymous)
    growth plus, for shm, the one copy in /dev/shm that both map."""
    procs = [subprocess.Popen([sys.executable, "-c", MEM_CODE, str(path), storage, str(shm_dir)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    private = [int(p.stdout.readline()) for p in procs]
    for p in procs:
        p.stdin.close()
        p.wait()
    shared = sum(f.stat().st_size for f in shm_dir.glob("fastdata-*.npy")) if storage == "shm" else 0
    return sum(private) + shared


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=2048)
    ap.add_argument("--seconds", type=float, default=3.0, help="measuring time per row")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="fastdata-bench-loader-"))
    shm_dir = Path(tempfile.mkdtemp(prefix="fastdata-bench-shm-", dir="/dev/shm"))
    try:
        files = make_image_folder(scratch / "jpeg", num_classes=8, per_class=args.images // 8,
                                  sizes=((500, 375), (375, 500)))
        labels = [i // (args.images // 8) for i in range(len(files))]
        preprocess_images(ImagePreprocessConfig(src=scratch / "jpeg", out=scratch / "ds", size=SIZE, progress=False))
        cores = os.cpu_count() or 1
        pin = torch.cuda.is_available()
        print(f"fastdata {fastdata.__version__}, torch {torch.__version__}, numpy {np.__version__}, {cores} cores, "
              f"{platform.machine()}, {len(files)} images {SIZE}x{SIZE}, batch {BATCH}, pinned={pin}")
        ds = {m: FastDataset(scratch / "ds", storage=m, shm_dir=shm_dir if m == "shm" else None)
              for m in ("mmap", "ram", "shm")}
        threads = min(4, cores)
        rows = {"memcpy (np.copyto, ceiling)": memcpy_rate(ds["ram"], args.seconds)}
        for m in ("mmap", "ram", "shm"):  # one loader per row, as in training: its ring is allocated once
            loader = FastLoader(ds[m], BATCH, num_threads=threads)
            rows[f"FastLoader {m}"] = rate(lambda loader=loader: loader, args.seconds)
        for w in (0, 2):
            rows[f"DataLoader per-sample, {w} workers"] = rate(lambda w=w: torch.utils.data.DataLoader(
                PerSample(ds["mmap"]), BATCH, shuffle=True, num_workers=w, pin_memory=pin), args.seconds)
        rows[f"DataLoader + Pillow JPEG, {cores} workers"] = rate(lambda: torch.utils.data.DataLoader(
            PillowFolder(files, labels), BATCH, shuffle=True, num_workers=cores, pin_memory=pin,
            persistent_workers=False), args.seconds, warmup=0)
        mb = SIZE * SIZE * 3 / 1e9
        ceiling = rows["memcpy (np.copyto, ceiling)"]
        print(f"{'row':<40} {'images/s':>10} {'GB/s':>7} {'x memcpy':>9}")
        for name, r in rows.items():
            print(f"{name:<40} {r:>10,.0f} {r * mb:>7.2f} {r / ceiling:>9.2f}")
        fast = rows["FastLoader ram"]
        pillow = rows[f"DataLoader + Pillow JPEG, {cores} workers"]
        per_sample = max(rows["DataLoader per-sample, 0 workers"], rows["DataLoader per-sample, 2 workers"])
        print(f"FastLoader(ram): {fast / ceiling:.2f}x memcpy (target >= 0.8), {fast / pillow:,.0f}x the Pillow "
              f"DataLoader (target >= 50), {fast / per_sample:.1f}x the best per-sample DataLoader (target >= 5)")
        dataset_bytes = len(files) * SIZE * SIZE * 3
        ds.clear()  # unmap this process's views: PSS splits shared pages among every process that maps them
        gc.collect()
        mem = {m: node_memory_of_two(scratch / "ds", m, shm_dir) for m in ("shm", "ram")}
        ring = BATCH * SIZE * SIZE * 3  # each measuring process holds one batch buffer of its own
        copies = {m: (v - 2 * ring) / dataset_bytes for m, v in mem.items()}
        print(f"memory 2 processes reading the whole {dataset_bytes / 2**20:,.0f} MiB dataset add to the machine "
              f"(private growth + the shm copy, less their two {ring / 2**20:.1f} MiB batch buffers): "
              f"shm {copies['shm']:.2f} copies, ram {copies['ram']:.2f} copies "
              f"(raw: shm {mem['shm'] / 2**20:,.0f} MiB, ram {mem['ram'] / 2**20:,.0f} MiB)")
        if args.json:
            report = {"rows": rows, "node_memory": mem, "dataset_bytes": dataset_bytes}
            args.json.write_text(json.dumps(report, indent=2))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(shm_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
