"""Hashing a whole dataset several files at once, against one file at a time: ``fastdata verify`` (and
``sha256sum`` over the same files, what a user would run by hand), and loading it into RAM with its
checksums checked (``storage="ram"``, ``verify=True``: what ``ram`` and ``cuda`` do at every open), and
making the node's ``/dev/shm`` copy (hashed as it is copied, once a node). The dataset is in the page cache:
the speed of sha256 and of copying on this machine's cores, the disk taken out.

    python benchmarks/bench_verify.py [--gigabytes 1] [--shard-mb 32] [--rounds 3]
"""
from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from fastdata.formats.base import npy_bytes, npy_header
from fastdata.formats.image_shards import images_name, labels_name
from fastdata.formats.manifest import IMAGES_NPY, load_manifest, new_manifest, write_manifest
from fastdata.formats.integrity import verify
from fastdata.storage import shm
from fastdata.storage.shards import ShardSet, load_bodies

SIDE = 224


def make(root: Path, gigabytes: float, shard_mb: int) -> list[Path]:
    """An npy dataset of random 224x224 images in shards of about ``shard_mb`` MB."""
    rows = max(1, shard_mb * 10**6 // (SIDE * SIDE * 3))
    count = max(1, int(gigabytes * 1000 // shard_mb))
    rng = np.random.default_rng(0)
    files, shards = [], []
    for k in range(count):
        for name, arr in ((images_name(k), rng.integers(0, 256, (rows, SIDE, SIDE, 3), np.uint8)),
                          (labels_name(k), np.zeros(rows, "<i8"))):
            data = npy_bytes(arr)
            (root / name).write_bytes(data)
            files.append({"path": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
        shards.append({"images": images_name(k), "labels": labels_name(k), "samples": rows})
    write_manifest(root, new_manifest(IMAGES_NPY, num_samples=rows * count, classes=["a"],
                                      class_counts=[rows * count], sample_shape=[SIDE, SIDE, 3], dtype="|u1",
                                      label_dtype="<i8", layout="NHWC", shard_size=rows, shards=shards,
                                      files=files))
    return [root / f["path"] for f in files]


def best(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gigabytes", type=float, default=1.0)
    ap.add_argument("--shard-mb", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    cores = min(8, os.cpu_count() or 1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        paths = make(root, args.gigabytes, args.shard_mb)
        total = sum(p.stat().st_size for p in paths)
        verify(root, workers=cores)  # everything in the page cache before the clock starts
        print(f"{len(paths)} files, {total / 1e9:.2f} GB in the page cache; {os.cpu_count()} cores; best of "
              f"{args.rounds}")
        rows = {
            "sha256sum, one file at a time": lambda: subprocess.run(["sha256sum", *map(str, paths)], check=True,
                                                                    capture_output=True),
            "fastdata verify --workers 1": lambda: verify(root, workers=1),
            f"fastdata verify (default: {cores} workers)": lambda: verify(root),
        }
        got = {name: best(fn, args.rounds) for name, fn in rows.items()}
        base, one = got["sha256sum, one file at a time"], got["fastdata verify --workers 1"]
        for name, seconds in got.items():
            print(f"{name:>40}: {seconds:6.2f} s  {total / seconds / 1e9:5.2f} GB/s  {base / seconds:4.2f}x sha256sum  "
                  f"{one / seconds:4.2f}x one worker")
        m = load_manifest(root)
        images = ShardSet(root, m, [(s["images"], s["samples"]) for s in m["shards"]], (SIDE, SIDE, 3),
                          np.dtype(np.uint8))
        shape, size = (images.rows, SIDE, SIDE, 3), sum(f["bytes"] for f in m["files"] if "images" in f["path"])

        def load(workers: int) -> None:
            load_bodies(root, m, images.bodies(), shape, images.dtype, True, "ram", workers=workers)
        one = best(lambda: load(1), args.rounds)
        many = best(lambda: load(cores), args.rounds)
        rows = [("ram load + sha256, 1 file at a time", one), (f"ram load + sha256, {cores} files at once", many)]

        def copy(workers: int) -> None:
            shm.COPY_WORKERS = workers
            with tempfile.TemporaryDirectory(dir=shm.shm_dir()) as where:
                shm.ensure_copy(root, m, images.bodies(), npy_header(shape, images.dtype), Path(where),
                                key="images", verify=False)
        one_copy = best(lambda: copy(1), args.rounds)
        rows += [("shm copy + sha256, 1 file at a time", one_copy),
                 (f"shm copy + sha256, {cores} files at once", best(lambda: copy(cores), args.rounds))]
        for name, seconds in rows:
            base = one if name.startswith("ram") else one_copy
            print(f"{name:>40}: {seconds:6.2f} s  {size / seconds / 1e9:5.2f} GB/s  "
                  f"{base / seconds:4.2f}x one at a time")


if __name__ == "__main__":
    main()
