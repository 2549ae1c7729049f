"""What ``shuffle_window`` costs in shuffle quality, on ImageNet-1k's shape (1,281,167 samples, 1,000
classes, shards of 1,024), from the real sampler code (no data needed).

For each window K (shards shuffled, then samples within windows of K shards), batches of 256:
- classes: distinct classes in a batch, on average (a uniform shuffle sees ~227 of 1,000);
- TV: total-variation distance between a batch's label histogram and the dataset's (0 = perfect mix;
  a uniform shuffle's own sampling noise is the floor, printed in the last row);
- shards/batch: distinct shards a batch reads (what a streaming cache must hold);
for data stored in class order (what an ImageFolder gives) and stored in a random order.

    python benchmarks/bench_shuffle.py [--batches 200]
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from fastdata.loading.sampler import DistributedBatchSampler

N, CLASSES, SHARD, BATCH = 1_281_167, 1000, 1024, 256


def measure(labels: np.ndarray, shards: np.ndarray, window: int | None, batches: int) -> tuple[float, float, float]:
    s = DistributedBatchSampler(N, BATCH, seed=0, rank=0, world_size=1, shuffle_window=window, shards=shards)
    perm = s.permutation(0)
    prior = np.bincount(labels, minlength=CLASSES) / N
    picks = np.linspace(0, N // BATCH - 1, batches).astype(int)  # batches spread over the epoch
    classes, tv, touched = [], [], []
    for k in picks:
        idx = perm[k * BATCH:(k + 1) * BATCH]
        hist = np.bincount(labels[idx], minlength=CLASSES) / BATCH
        classes.append(np.count_nonzero(hist))
        tv.append(0.5 * np.abs(hist - prior).sum())
        touched.append(len(np.unique(shards[idx])))
    return float(np.mean(classes)), float(np.mean(tv)), float(np.mean(touched))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=200)
    args = ap.parse_args()
    sorted_labels = np.repeat(np.arange(CLASSES), -(-N // CLASSES))[:N]  # class after class
    random_labels = np.random.default_rng(1).permutation(sorted_labels)  # the same labels, stored shuffled
    shards = np.arange(N) // SHARD
    n_shards = int(shards[-1]) + 1
    print(f"{N:,} samples, {CLASSES} classes, {n_shards} shards of {SHARD}, batches of {BATCH}")
    print(f"{'window (shards)':>16} | {'stored in class order':^32} | {'stored shuffled':^32} | seconds")
    print(f"{'':>16} | {'classes':>9} {'TV':>8} {'shards/batch':>13} | {'classes':>9} {'TV':>8} {'shards/batch':>13} |")
    for window in (1, 4, 16, 64, 256, None):
        t0 = time.perf_counter()
        a = measure(sorted_labels, shards, window, args.batches)
        b = measure(random_labels, shards, window, args.batches)
        name = "all (plain)" if window is None else str(window)
        print(f"{name:>16} | {a[0]:>9.1f} {a[1]:>8.3f} {a[2]:>13.1f} | {b[0]:>9.1f} {b[1]:>8.3f} {b[2]:>13.1f} | "
              f"{(time.perf_counter() - t0) / 2:.2f}")


if __name__ == "__main__":
    main()
