"""Datasets in object storage: fastdata streaming from a real S3 API (moto's server on 127.0.0.1, started
here in its own process) beside the same dataset on local disk and the server's own bandwidth, in one run.

Rows (images/s over one epoch, batches of --batch, --threads loader threads):
- server: every image and label shard fetched by 8 parallel GETs (s3fs), nothing else: the server's rate;
- GET + sha256 + write: the same GETs, each body hashed and written to a file: the least a verified cache
  does, the cold-cache limit on this machine (the server shares its cores);
- local disk: FastLoader over the dataset folder (a new job's first epoch, page cache warm);
- fastdata cold: ``FastDataset("s3://...")`` with an empty cache: shards streamed as batches need them;
- fastdata warm: a new job's first epoch (new FastDataset, same cache folder): nothing downloaded;
- time to first batch, cold, for the whole dataset and for a quarter of it, in order and shuffled;
- LitData (``StreamingDataset``) and Mosaic streaming (``StreamingDataset``) reading the same images from the
  same server in objects of the same size as fastdata's shards, when installed (see ../shared/PEERS.md);
  skipped with a message otherwise.
fastdata's rows are interleaved over --rounds rounds, best kept (this machine's timings are noisy).

The dataset is synthetic npy shards (incompressible pixels, --size square images) written straight into
fastdata's format, --gigabytes in all, --shard-images per shard.

    python benchmarks/bench_remote.py [--gigabytes 1] [--size 64] [--shard-images 256] [--batch 256] [--rounds 3]
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import importlib
import importlib.machinery
import importlib.util
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

import numpy as np

import fastdata
from fastdata._io import write_bytes_atomic
from fastdata.datasets.images import FastDataset
from fastdata.formats.base import npy_bytes
from fastdata.formats.manifest import new_manifest, write_manifest
from fastdata.loading.loader import FastLoader
from fastdata.storage.push import push


def make_dataset(out: Path, images: int, size: int, shard: int, classes: int = 10) -> Path:
    """An npy dataset of ``images`` random ``size``-square images written straight into fastdata's format."""
    out.mkdir(parents=True)
    rng = np.random.default_rng(0)
    base = rng.integers(0, 256, (shard, size, size, 3), dtype=np.uint8)
    files, shards = [], []
    for k, first in enumerate(range(0, images, shard)):
        n = min(shard, images - first)
        pixels = base[:n] ^ np.uint8(k % 251)  # a different, still incompressible body per shard
        labels = (np.arange(first, first + n) % classes).astype(np.int64)
        for name, arr in ((f"images-{k:05d}.npy", pixels), (f"labels-{k:05d}.npy", labels)):
            files.append(write_bytes_atomic(out / name, npy_bytes(arr)))
        shards.append({"images": f"images-{k:05d}.npy", "labels": f"labels-{k:05d}.npy", "samples": n})
    counts = np.bincount(np.arange(images) % classes, minlength=classes).tolist()
    every = (np.arange(images) % classes).astype(np.int64)  # every label in one file too, as preprocess writes
    files.append(write_bytes_atomic(out / "labels.npy", npy_bytes(every)))
    manifest = new_manifest("fastdata.images.npy", num_samples=images, shard_size=shard, sample_shape=[size, size, 3],
                            dtype="|u1", label_dtype="<i8", layout="NHWC", classes=[str(c) for c in range(classes)],
                            class_counts=counts, shards=shards, files=files, skipped=[], all_labels="labels.npy",
                            params={"size": size, "shard_size": shard, "format": "npy"},
                            source={"kind": "synthetic", "path": "bench_remote", "num_files": images})
    write_manifest(out, manifest)
    return out


def epoch_rate(ds: Any, batch: int, threads: int, shuffle: bool = True) -> tuple[float, float]:
    """(images/s over one whole epoch, seconds to the first batch)."""
    loader = FastLoader(ds, batch, shuffle=shuffle, seed=0, num_threads=threads, pin_memory=False)
    t0 = time.perf_counter()
    first, n = None, 0
    for x, _ in loader:
        if first is None:
            first = time.perf_counter() - t0
        n += len(x)
    return n / (time.perf_counter() - t0), first or 0.0


def server_rate(url: str, sizes: dict[str, int], requests: int = 8) -> float:
    """Bytes/s of fetching the objects ``sizes`` names under ``url`` with ``requests`` parallel GETs and nothing
    else (ranged GETs of the known size, as fastdata makes: one request per object)."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(url)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(requests) as pool:
        total = sum(pool.map(lambda n: len(fs.cat_file(f"{root}/{n}", start=0, end=sizes[n])), sizes))
    return total / (time.perf_counter() - t0)


def verified_rate(url: str, sizes: dict[str, int], scratch: Path, requests: int = 8) -> float:
    """Bytes/s of the least a verified cache does: GET each object, sha256 it, write it to a file."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(url)
    out = scratch / "verified"
    out.mkdir()

    def one(name: str) -> int:
        data = fs.cat_file(f"{root}/{name}", start=0, end=sizes[name])
        hashlib.sha256(data).hexdigest()
        (out / name).write_bytes(data)
        return len(data)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(requests) as pool:
        total = sum(pool.map(one, sizes))
    took = time.perf_counter() - t0
    shutil.rmtree(out)
    return total / took


def first_batch(url: str, cache: Path, batch: int, threads: int, shuffle: bool) -> float:
    """Seconds from opening the URL with an empty cache to the first batch (opening included)."""
    shutil.rmtree(cache, ignore_errors=True)
    t0 = time.perf_counter()
    ds = FastDataset(url, cache_dir=cache)
    loader = FastLoader(ds, batch, shuffle=shuffle, seed=0, num_threads=threads, pin_memory=False)
    it = iter(loader)
    next(it)
    took = time.perf_counter() - t0
    it.close()
    ds._cache.close()
    return took


_OPEN: dict[str, FastDataset] = {}


def _lit_sample(path: str, i: int) -> dict[str, Any]:
    """One sample as LitData's optimize() wants it (module level: its workers are spawned)."""
    if path not in _OPEN:
        _OPEN[path] = FastDataset(path)
    x, y = _OPEN[path][i]
    return {"image": x.numpy(), "label": int(y)}


def prepare_litdata(local: Path, url: str, scratch: Path) -> bool:
    """The same images optimized into LitData's chunks (objects the size of our shards) and uploaded to
    ``url``; False (with a message) when LitData is not installed."""
    try:
        import litdata
    except ImportError:
        print("LitData: not installed (pip install litdata, see ../shared/PEERS.md): skipped")
        return False
    import fsspec

    out = scratch / "litdata"
    litdata.optimize(fn=functools.partial(_lit_sample, str(local)), inputs=list(range(len(FastDataset(local)))),
                     output_dir=str(out), chunk_bytes=(local / "images-00000.npy").stat().st_size, num_workers=2,
                     mode="overwrite")
    fs, root = fsspec.core.url_to_fs(url)
    fs.put(str(out) + "/", root, recursive=True)
    from litdata.streaming import downloader

    # LitData's obstore client refuses plain http (the loopback server is http): allow it, nothing else changes
    if isinstance(getattr(downloader, "_OBSTORE_CLIENT_OPTIONS", None), dict):
        downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = "true"
    return True


def litdata_row(bucket_url: str, cache: Path, batch: int, threads: int) -> float:
    """Images/s of LitData's StreamingDataset over the same images (``prepare_litdata`` put them under
    ``bucket_url/litdata``), one cold epoch into ``cache``."""
    import litdata

    stream = litdata.StreamingDataset(bucket_url + "/litdata", cache_dir=str(cache), shuffle=True)
    loader = litdata.StreamingDataLoader(stream, batch_size=batch, num_workers=threads,
                                         multiprocessing_context="fork")  # workers inherit the http allowance
    t0, n = time.perf_counter(), 0
    for b in loader:
        n += len(b["label"])
    return n / (time.perf_counter() - t0)


def _mosaic_import() -> Any:
    """``streaming``, with the torchvision it imports at import time stubbed when torchvision is unusable
    (CPU torch here; its MDS reader and writer never use it, see ../shared/PEERS.md)."""
    import sys
    import types

    try:
        importlib.import_module("torchvision")  # a working one is used as is
    except Exception:  # noqa: BLE001 - absent, or a CUDA build against CPU torch
        names = ("torchvision", "torchvision.datasets", "torchvision.transforms", "torchvision.transforms.functional")
        for name in names:  # the names streaming/vision imports, as empty packages
            stub = types.ModuleType(name)
            stub.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
            stub.__path__ = []  # type: ignore[attr-defined]
            stub.VisionDataset = stub.CIFAR10 = object  # type: ignore[attr-defined]
            stub.to_tensor = None  # type: ignore[attr-defined]
            sys.modules[name] = stub
            if "." in name:
                parent, _, leaf = name.rpartition(".")
                setattr(sys.modules[parent], leaf, stub)
    import streaming

    return streaming


def prepare_mosaic(local: Path, url: str, scratch: Path) -> bool:
    """The same images written as Mosaic's MDS shards (the size of ours) and uploaded to ``url``, with
    Mosaic pointed at the endpoint in use; False (with a message) when Mosaic streaming is not installed."""
    if importlib.util.find_spec("streaming") is None:
        print("Mosaic streaming: not installed (pip install mosaicml-streaming, see ../shared/PEERS.md): skipped")
        return False
    import fsspec

    streaming = _mosaic_import()
    ds, out = FastDataset(local), scratch / "mds"
    size = ds.sample_shape[0]
    with streaming.MDSWriter(out=str(out), columns={"image": f"ndarray:uint8:{size},{size},3", "label": "int"},
                             size_limit=(local / "images-00000.npy").stat().st_size) as writer:  # ours' size
        for first in range(0, len(ds), 4096):
            x, y = ds.get_batch(np.arange(first, min(len(ds), first + 4096)))
            for img, lab in zip(x.numpy(), y.tolist()):
                writer.write({"image": img, "label": lab})
    fs, root = fsspec.core.url_to_fs(url)
    fs.put(str(out) + "/", root, recursive=True)
    os.environ["S3_ENDPOINT_URL"] = os.environ["AWS_ENDPOINT_URL"]  # where Mosaic looks for a custom endpoint
    return True


def mosaic_row(local: Path, bucket_url: str, scratch: Path, batch: int, threads: int) -> Optional[float]:
    """Mosaic streaming's StreamingDataset over the same images, written as MDS shards and uploaded."""
    if not prepare_mosaic(local, bucket_url + "/mds", scratch):
        return None
    import torch

    stream = _mosaic_import().StreamingDataset(remote=bucket_url + "/mds", local=str(scratch / "mdscache"),
                                               shuffle=True, batch_size=batch)
    loader = torch.utils.data.DataLoader(stream, batch_size=batch, num_workers=threads,
                                         multiprocessing_context="fork")  # workers inherit the torchvision stub
    t0, n = time.perf_counter(), 0
    for b in loader:
        n += len(b["label"])
    return n / (time.perf_counter() - t0)


def link_rows(mbps: float, port: int, sizes: dict[str, int], scratch: Path, args: argparse.Namespace,
              has_lit: bool, per_image: int) -> dict[str, Optional[float]]:
    """The cold rows read through a link of ``mbps`` MB/s shared by all requests (tests/s3_faults.py's proxy
    in its own process in front of the server at ``port``): is the cold cache limited by the link?"""
    import fsspec

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from s3_faults import ProxyProcess

    link, before = ProxyProcess(port, mbps * 1e6), os.environ["AWS_ENDPOINT_URL"]
    os.environ["AWS_ENDPOINT_URL"] = link.endpoint
    fsspec.filesystem("s3").clear_instance_cache()  # (s3fs keeps instances; the endpoint is read at creation)
    try:
        bare = server_rate("s3://bench/full", sizes) / per_image
        cold = 0.0
        for r in range(args.rounds):
            cold = max(cold, epoch_rate(FastDataset("s3://bench/full", cache_dir=scratch / f"link{mbps}-{r}"),
                                        args.batch, args.threads)[0])
        lit = litdata_row("s3://bench", scratch / f"litlink{mbps}", args.batch, args.threads) if has_lit else None
    finally:
        link.close()
        os.environ["AWS_ENDPOINT_URL"] = before
        fsspec.filesystem("s3").clear_instance_cache()
    print(f"\nthrough a {mbps:,.0f} MB/s link ({mbps * 1e6 / per_image:,.0f} images/s):")
    print(f"  GETs alone (8 parallel)   {bare:>10,.0f}  {bare * per_image / 1e6 / mbps:.2f}x the link")
    print(f"  fastdata cold cache       {cold:>10,.0f}  {cold / bare:.2f}x GETs alone, "
          f"{cold * per_image / 1e6 / mbps:.2f}x the link")
    if lit is not None:
        print(f"  LitData cold              {lit:>10,.0f}  fastdata cold is {cold / lit:.2f}x")
    return {"link_mb_s": mbps, "get": bare, "cold": cold, "litdata": lit}


def moto_server() -> tuple[Any, str]:
    """moto's S3 server in its own process on 127.0.0.1 (in-process it would share our GIL), as the endpoint."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    for _ in range(200):
        if server.poll() is not None:  # it could not start (a missing package): say why, not a timeout later
            raise RuntimeError(f"moto's server exited ({server.returncode}): {server.stderr.read()[-2000:]}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
            break
        except OSError:
            time.sleep(0.05)
    threading.Thread(target=server.stderr.read, daemon=True).start()  # drained: a full pipe would stall it
    endpoint = f"http://127.0.0.1:{port}"
    os.environ.update({"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                       "AWS_DEFAULT_REGION": "us-east-1"})
    return server, endpoint


def dataset_arguments(doc: str) -> argparse.ArgumentParser:
    """The options every object-storage benchmark shares: the dataset's size and shape, batch, threads."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gigabytes", type=float, default=1.0)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--shard-images", type=int, default=256)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    return ap


def main() -> None:
    ap = dataset_arguments(__doc__)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the fastdata rows (best kept)")
    ap.add_argument("--link-mbps", type=float, nargs="*", default=[],
                    help="also read through a loopback link paced to each of these MB/s (a node's network; the "
                         "pacing proxy runs in its own process): GETs alone, fastdata cold and LitData cold")
    args = ap.parse_args()
    per_image = args.size * args.size * 3
    images = int(args.gigabytes * 1e9 // per_image)
    scratch = Path(tempfile.mkdtemp(prefix="bench_remote-"))
    server, endpoint = moto_server()
    try:
        import boto3

        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
        full = make_dataset(scratch / "full", images, args.size, args.shard_images)
        quarter = make_dataset(scratch / "quarter", images // 4, args.size, args.shard_images)
        nbytes = sum(p.stat().st_size for p in full.glob("images-*.npy"))
        print(f"fastdata {fastdata.__version__}, numpy {np.__version__}, python {platform.python_version()}, "
              f"{os.cpu_count()} CPUs; {images:,} images of {args.size}x{args.size}x3 in "
              f"{len(list(full.glob('images-*.npy')))} shards, {nbytes / 1e9:.2f} GB; batch {args.batch}, "
              f"{args.threads} loader threads; moto server on {endpoint}")
        t0 = time.perf_counter()
        push(full, "s3://bench/full", workers=8)
        push(quarter, "s3://bench/quarter", workers=8)
        print(f"push: {(time.perf_counter() - t0):.1f} s for both")
        # the objects fastdata's reader fetches: the image shards, and every label in one file
        sizes = {p.name: p.stat().st_size for p in [*sorted(full.glob("images-*.npy")), full / "labels.npy"]}
        bare = server_rate("s3://bench/full", sizes)
        floor = verified_rate("s3://bench/full", sizes, scratch)
        epoch_rate(FastDataset(full), args.batch, args.threads)  # the page cache holds it, as it holds a fresh cache
        local = warm = cold = 0.0
        for r in range(args.rounds):  # interleaved, best of: this machine's timings are noisy
            cache = scratch / f"cache{r}"
            cold_ds = FastDataset("s3://bench/full", cache_dir=cache)
            rate, first = epoch_rate(cold_ds, args.batch, args.threads)
            if rate > cold:
                cold, cold_first, fetched = rate, first, dict(cold_ds._remote.fetched)
            local = max(local, epoch_rate(FastDataset(full), args.batch, args.threads)[0])  # a job's first epoch
            warm_ds = FastDataset("s3://bench/full", cache_dir=cache)  # the next job on the same node
            warm = max(warm, epoch_rate(warm_ds, args.batch, args.threads)[0])
            assert warm_ds._remote.fetched["files"] == 0
        server_img = bare / per_image
        rows: list[tuple[str, float, str]] = [
            ("server: 8 parallel GETs, nothing else", server_img, f"{bare / 1e6:,.0f} MB/s"),
            ("GET + sha256 + write, nothing else", floor / per_image, f"{floor / 1e6:,.0f} MB/s"),
            ("local disk (page cache)", local, ""),
            ("fastdata cold cache", cold, f"{cold / server_img:.2f}x the server, {cold * per_image / floor:.2f}x "
                                          f"GET+sha256+write; {fetched['bytes'] / 1e9:.2f} GB in "
                                          f"{fetched['files']} downloads; first batch {cold_first:.2f} s"),
            ("fastdata warm cache (next job)", warm, f"{warm / local:.2f}x local disk"),
        ]
        has_lit = prepare_litdata(full, "s3://bench/litdata", scratch)
        lit = litdata_row("s3://bench", scratch / "litcache", args.batch, args.threads) if has_lit else None
        if lit is not None:
            rows.append(("LitData StreamingDataset, cold", lit, f"fastdata cold is {cold / lit:.2f}x"))
        mosaic = mosaic_row(full, "s3://bench", scratch, args.batch, args.threads)
        if mosaic is not None:
            rows.append(("Mosaic StreamingDataset, cold", mosaic, f"fastdata cold is {cold / mosaic:.2f}x"))
        print(f"\n{'row':<40} {'images/s':>10}  ratio")
        for name, rate, note in rows:
            print(f"{name:<40} {rate:>10,.0f}  {note}")
        print("\ntime to first batch, cold cache (opening included):")
        for shuffle in (False, True):
            t_full = first_batch("s3://bench/full", scratch / "c1", args.batch, args.threads, shuffle)
            t_quarter = first_batch("s3://bench/quarter", scratch / "c2", args.batch, args.threads, shuffle)
            print(f"  shuffle={shuffle!s:<5}  full {t_full:.2f} s, quarter {t_quarter:.2f} s "
                  f"(full / quarter {t_full / t_quarter:.2f})")
        links = {}
        for mbps in args.link_mbps:
            links[mbps] = link_rows(mbps, int(endpoint.rsplit(":", 1)[1]), sizes, scratch, args, has_lit, per_image)
        print(json.dumps({"server_mb_s": bare / 1e6, "verified_mb_s": floor / 1e6, "local": local, "cold": cold,
                          "warm": warm, "litdata": lit, "links": links}))
    finally:
        server.terminate()
        server.wait()
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
