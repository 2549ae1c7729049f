"""Data larger than the cache (issue 19, item 5): three epochs from a real S3 API through a node cache of
25 %, 50 % and 100 % of the dataset, for fastdata, LitData and Mosaic streaming, in one run.

The dataset, the server and the peers' formats are bench_remote.py's (moto in its own process, objects
the size of fastdata's shards). Every client reads through a loopback proxy (tests/s3_faults.py, no
faults injected, in a process of its own so that it shares no interpreter with any reader) that counts
the bytes of every GET, so downloads are measured the same way for all; ``--link-mbps`` paces it to a
node's network rate.
Per cache size and epoch: MB downloaded and images/s, and for fastdata the optimum for its order
(Belady over the three epochs' real batches, benchmarks/sim_cache.py) to compare its downloads with.
fastdata reads with ``shuffle_window=--window`` shards (the order made for small caches); the peers
read with their own default shuffles and their cache bounds (LitData ``max_cache_size``, Mosaic
``cache_limit``).

    /work/mvenv/bin/python benchmarks/bench_remote_cache.py [--gigabytes 1] [--window 8] [--epochs 3]
"""
from __future__ import annotations

import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

import fastdata
from fastdata.datasets.images import FastDataset
from fastdata.loading.loader import FastLoader
from fastdata.loading.sampler import DistributedBatchSampler
from fastdata.storage.push import push

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from bench_remote import (_mosaic_import, dataset_arguments, make_dataset, moto_server, prepare_litdata,  # noqa: E402
                          prepare_mosaic)
from s3_faults import ProxyProcess  # noqa: E402
from sim_cache import simulate  # noqa: E402


def epochs_through(proxy: ProxyProcess, make_loader: Callable[[], Iterable[Any]], epochs: int,
                   count: Callable[[Any], int], limit_s: float = float("inf")) -> list[tuple[float, float, int]]:
    """(MB downloaded, images/s, images) per epoch of the loader ``make_loader()`` iterated ``epochs`` times;
    after ``limit_s`` seconds in all it stops at the next batch, the epoch under way reported as far as it
    got (a peer that thrashes its cache would otherwise take hours)."""
    loader, out = make_loader(), []
    deadline = time.perf_counter() + limit_s
    for _ in range(epochs):
        before = proxy.bytes()
        t0, n = time.perf_counter(), 0
        it = iter(loader)
        for batch in it:
            n += count(batch)
            if time.perf_counter() > deadline:
                break
        took = time.perf_counter() - t0
        del it  # (a DataLoader's workers stop here when the epoch was cut short)
        out.append(((proxy.bytes() - before) / 1e6, n / took, n))
        if time.perf_counter() > deadline:
            break
    return out


def optimum_mb(n: int, batch: int, window: int, shard_images: int, group_bytes: int, limit: int,
               epochs: int) -> list[float]:
    """MB per epoch that Belady's rule, knowing all epochs, downloads for fastdata's order (one batch's
    shards read together, one batch at a time: the least any cache of that size can download)."""
    s = DistributedBatchSampler(n, batch, seed=0, rank=0, world_size=1, shuffle_window=window,
                                shard_bounds=np.r_[np.arange(0, n, shard_images), n])
    steps = []
    for e in range(epochs):
        s.set_epoch(e)
        steps.append([np.unique(b // shard_images) for b in s.batches()])
    downloads = simulate(steps, max(1, limit // group_bytes), "optimum")
    return [d * group_bytes / 1e6 for d in downloads]


def main() -> None:
    ap = dataset_arguments(__doc__)
    ap.add_argument("--window", type=int, default=8, help="fastdata's shuffle_window, in shards")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--fractions", type=float, nargs="*", default=[0.25, 0.5, 1.0])
    ap.add_argument("--peers", nargs="*", default=["litdata", "mosaic"], help="peers to run beside fastdata")
    ap.add_argument("--peer-seconds", type=float, default=600,
                    help="time limit of each peer row (its epochs stop there; the table says how far they got)")
    ap.add_argument("--link-mbps", type=float, default=0.0, help="pace every download to this MB/s (0: unpaced)")
    args = ap.parse_args()
    images = int(args.gigabytes * 1e9 // (args.size * args.size * 3))
    scratch = Path(tempfile.mkdtemp(prefix="bench_remote_cache-"))
    server, endpoint = moto_server()
    proxy = ProxyProcess(int(endpoint.rsplit(":", 1)[1]), args.link_mbps * 1e6)
    os.environ["AWS_ENDPOINT_URL"] = proxy.endpoint  # every client below reads through the counting proxy
    try:
        import boto3

        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
        full = make_dataset(scratch / "full", images, args.size, args.shard_images)
        files = sorted(full.glob("*-*.npy"))
        total = sum(p.stat().st_size for p in files)
        group = (full / "images-00000.npy").stat().st_size  # a shard's download (every label came at opening)
        push(full, "s3://bench/full", workers=8)
        lit = "litdata" in args.peers and prepare_litdata(full, "s3://bench/litdata", scratch)
        mosaic = "mosaic" in args.peers and prepare_mosaic(full, "s3://bench/mds", scratch)
        print(f"fastdata {fastdata.__version__}, numpy {np.__version__}, python {platform.python_version()}, "
              f"{os.cpu_count()} CPUs; {images:,} images of {args.size}x{args.size}x3 in {len(files) // 2} shards "
              f"of {args.shard_images}, {total / 1e6:,.0f} MB; batch {args.batch}, {args.threads} loader threads; "
              f"{args.epochs} epochs; fastdata shuffle_window={args.window}")
        print("\n| cache | reader | MB downloaded per epoch | images/s per epoch | "
              "MB over all epochs (scaled when stopped) | note |\n|---|---|---|---|---|---|")
        for frac in args.fractions:
            limit = int(frac * total)
            cache = scratch / f"fd{frac}"

            def show(name: str, per_epoch: list[tuple[float, float, int]], note: str) -> None:
                seen, run = sum(k for _, _, k in per_epoch), images * args.epochs  # images read, and in the run
                scaled = sum(mb for mb, _, _ in per_epoch) * run / max(seen, 1)  # MB per image read, times the run
                cut = "" if seen == run else f" (stopped at {args.peer_seconds:.0f} s: " \
                    f"{seen:,} of {run:,} images)"
                print(f"| {frac:.0%} ({limit / 1e6:,.0f} MB) | {name} | "
                      + " / ".join(f"{mb:,.0f}" for mb, _, _ in per_epoch) + " | "
                      + " / ".join(f"{rate:,.0f}" for _, rate, _ in per_epoch) + " | "
                      + f"{scaled:,.0f} | {note}{cut} |",
                      flush=True)

            def fd_loader() -> Iterable[Any]:
                ds = FastDataset("s3://bench/full", cache_dir=cache, cache_limit=limit)
                return FastLoader(ds, args.batch, seed=0, num_threads=args.threads, pin_memory=False,
                                  shuffle_window=args.window)
            got = epochs_through(proxy, fd_loader, args.epochs, lambda b: len(b[0]))
            best = optimum_mb(images, args.batch, args.window, args.shard_images, group, limit, args.epochs)
            show("fastdata", got, "optimum for its order: " + " / ".join(f"{m:,.0f}" for m in best)
                         + f" MB ({sum(g[0] for g in got) / max(sum(best), 1e-9):.2f}x)")
            if lit:
                import litdata

                def lit_loader() -> Iterable[Any]:
                    stream = litdata.StreamingDataset("s3://bench/litdata", cache_dir=str(scratch / f"lit{frac}"),
                                                      shuffle=True, max_cache_size=limit)
                    return litdata.StreamingDataLoader(stream, batch_size=args.batch, num_workers=args.threads,
                                                       multiprocessing_context="fork")
                try:
                    show("LitData", epochs_through(proxy, lit_loader, args.epochs, lambda b: len(b["label"]),
                                                   args.peer_seconds), "max_cache_size")
                except Exception as exc:  # noqa: BLE001 - a peer failing at a cache size is a result
                    print(f"LitData at {frac:.0%}: {type(exc).__name__}: {exc}")
            if mosaic:
                import torch

                streaming = _mosaic_import()

                def mosaic_loader() -> Iterable[Any]:
                    stream = streaming.StreamingDataset(remote="s3://bench/mds", local=str(scratch / f"mds{frac}"),
                                                        shuffle=True, batch_size=args.batch, cache_limit=limit)
                    return torch.utils.data.DataLoader(stream, batch_size=args.batch, num_workers=args.threads,
                                                       multiprocessing_context="fork")
                try:
                    show("Mosaic", epochs_through(proxy, mosaic_loader, args.epochs, lambda b: len(b["label"]),
                                                  args.peer_seconds), "cache_limit")
                except Exception as exc:  # noqa: BLE001
                    print(f"Mosaic at {frac:.0%}: {type(exc).__name__}: {exc}")
    finally:
        proxy.close()
        server.terminate()
        server.wait()
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
