"""How long a dataset of many shards takes to open (and to serve its first batch), and the memory the open
adds, for npy, LMDB and token datasets, against the floor any open that checks its files pays (parse the
manifest, one stat a file), and, with ``--against REF``, the fastdata of an older commit opening the same
folders in the same run. Every rank and every resume opens the dataset: at 10^6 shards the open is paid by
every process of the job.

The folders hold real shards in the formats' own layouts (hard links of a few real files, so that 10^6
shards take seconds and no disk); each open runs in a fresh process, fastdata and torch imported before
the clock starts. "RSS MB" is the memory the open and a first batch add to the process (what every rank
keeps), "peak MB" the most it held above where it started (what every rank needs at once at a job's
start), "pickled MB" the dataset as a spawned or forkserver DataLoader worker receives it, "version s" the
dataset's version (`manifest_sha256`, the digest of its manifest a loader's first ``state_dict`` names).

``--remote``: the npy dataset streamed from a loopback S3 server (moto, started here; the manifest and the
first shards uploaded) through the node cache with a ``cache_limit`` of ``--cache-shards`` shards, as every
rank opens it; "read shards/s" is a FastLoader's first ``--reads`` shards in order (or as many as ``--seconds``
allow), each fetched into the cache as the loader's plan says and evicted behind it: what the cache costs a
shard at that many shards.

    python benchmarks/bench_open.py [--shards 100000] [--formats npy,lmdb,tokens] [--against REF[,REF...]]
    python benchmarks/bench_open.py --remote [--shards 1000000] [--reads 2000] [--against REF[,REF...]]
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Union

import numpy as np

REPO = Path(__file__).resolve().parents[1]
ROWS = 4  # samples a shard of make_npy
LINKS = 60_000  # hard links a file may have on ext4 is 65,000: a fresh copy after this many

CHILD = r"""
import gc, json, os, pickle, sys, time
import numpy as np, torch
from fastdata.datasets.images import FastDataset
from fastdata.datasets.tokens import TokenDataset


def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak():  # the most memory the process has held (VmHWM)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


kind, path = sys.argv[1], sys.argv[2]
before = rss()
t0 = time.perf_counter()
if kind == "remote":  # streamed through the node cache with a limit: the first shards read in order
    from fastdata.loading.loader import FastLoader
    limit, reads, per, seconds = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[7])
    ds = FastDataset(path, cache_dir=sys.argv[6], cache_limit=limit)
    opened = time.perf_counter()
    n, sent, version, seen = len(ds), 0, 0.0, 0
    for x, y in FastLoader(ds, batch_size=10 * per, shuffle=False, num_threads=2):
        if seen == 0:
            first = time.perf_counter()
        seen += len(y)
        if seen >= reads * per or time.perf_counter() - first > seconds:
            break
    read = time.perf_counter() - first
    print(json.dumps({"open": opened - t0, "first": first - opened, "rss_mb": (rss() - before) / 1e6, "n": n,
                      "peak_mb": (peak() - before) / 1e6, "shards_per_s": (seen / per - 10) / read}))
    sys.exit(0)
if kind == "floor":  # what any open that checks its files pays: the manifest parsed, one stat a file
    m = json.loads(open(os.path.join(path, "manifest.json"), "rb").read())
    for f in m["files"]:
        os.stat(os.path.join(path, f["path"]))
    opened, n = time.perf_counter(), len(m["files"])
    first, sent, version = opened, 0, 0.0
else:
    ds = TokenDataset(path, seq_len=255) if kind == "tokens" else FastDataset(path)
    opened = time.perf_counter()
    n = len(ds)
    ds.get_batch(np.array([0, n // 2, n - 1]))
    first = time.perf_counter()
    sent = len(pickle.dumps(ds, protocol=pickle.HIGHEST_PROTOCOL))  # what a spawned DataLoader worker receives
    t1 = time.perf_counter()
    ds.manifest_sha256
    version = time.perf_counter() - t1
gc.collect()
print(json.dumps({"open": opened - t0, "first": first - opened, "rss_mb": (rss() - before) / 1e6, "n": n,
                  "peak_mb": (peak() - before) / 1e6, "sent_mb": sent / 1e6, "version": version}))
"""


class Linker:
    """Hard links of one file under many names, a fresh copy every LINKS links."""

    def __init__(self, data: bytes, spare: Path) -> None:
        self.data, self.spare, self.count = data, spare, 0
        self.entry = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}

    def put(self, path: Path) -> dict:
        if self.count % LINKS == 0:
            self.source = self.spare / f"{hashlib.sha256(self.data).hexdigest()[:16]}-{self.count // LINKS}"
            self.source.write_bytes(self.data)
        self.count += 1
        os.link(self.source, path)
        return {"path": path.name, **self.entry}


def put(root: Path, name: str, data: bytes) -> dict:
    (root / name).write_bytes(data)
    return {"path": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def make_npy(root: Path, n: int, spare: Path) -> None:
    from fastdata.formats.base import npy_bytes
    from fastdata.formats.image_shards import images_name, labels_name
    from fastdata.formats.manifest import IMAGES_NPY, new_manifest, write_manifest

    rows = ROWS
    images = Linker(npy_bytes(np.full((rows, 8, 8, 3), 7, np.uint8)), spare)
    labels = Linker(npy_bytes(np.zeros(rows, "<i8")), spare)
    files, shards = [], []
    for k in range(n):
        files += [images.put(root / images_name(k)), labels.put(root / labels_name(k))]
        shards.append({"images": images_name(k), "labels": labels_name(k), "samples": rows})
    files.append(put(root, "labels.npy", npy_bytes(np.zeros(rows * n, "<i8"))))
    write_manifest(root, new_manifest(IMAGES_NPY, num_samples=rows * n, classes=["a"], class_counts=[rows * n],
                                      sample_shape=[8, 8, 3], dtype="|u1", label_dtype="<i8", layout="NHWC",
                                      shard_size=rows, shards=shards, files=files, all_labels="labels.npy"))


def make_lmdb(root: Path, n: int, spare: Path) -> None:
    from PIL import Image

    from fastdata.formats.base import npy_bytes
    from fastdata.formats.lmdb_store import build_shard, shard_name
    from fastdata.formats.manifest import IMAGES_LMDB, new_manifest, write_manifest

    jpeg = io.BytesIO()
    Image.new("RGB", (8, 8), (90, 120, 150)).save(jpeg, "JPEG", quality=90)
    build_shard(spare / "one.lmdb", [jpeg.getvalue()])
    data = (spare / "one.lmdb").read_bytes()
    store = Linker(data, spare)  # (py-lmdb opens a file once a process: the stores read are copies, not links)
    files = [put(root, shard_name(k), data) if k in (0, n // 2, n - 1) else store.put(root / shard_name(k))
             for k in range(n)]
    files.append(put(root, "labels.npy", npy_bytes(np.zeros(n, "<i8"))))
    write_manifest(root, new_manifest(IMAGES_LMDB, num_samples=n, classes=["a"], class_counts=[n], encoding="jpeg",
                                      key_format="%012d", label_dtype="<i8", labels="labels.npy", shard_size=1,
                                      lmdb_shards=[{"path": shard_name(k), "samples": 1} for k in range(n)],
                                      max_short_side=8, files=files))


def make_tokens(root: Path, n: int, spare: Path) -> None:
    from fastdata.formats.base import npy_bytes
    from fastdata.formats.manifest import TOKENS, new_manifest, write_manifest
    from fastdata.formats.tokenizer import load_tokenizer

    size = 1024
    tokens = Linker(npy_bytes((np.arange(size) % 251).astype("<u2")), spare)
    docs = Linker(npy_bytes(np.array([0, size], "<i8")), spare)
    files, shards = [], []
    for k in range(n):
        name, offsets = f"train-{k // 1000:05d}-{k % 1000:06d}.npy", f"train-docs-{k // 1000:05d}-{k % 1000:06d}.npy"
        files += [tokens.put(root / name), docs.put(root / offsets)]
        shards.append({"path": name, "tokens": size, "documents": 1, "docs": offsets})
    write_manifest(root, new_manifest(TOKENS, tokenizer=load_tokenizer("bytes").describe(), dtype="<u2",
                                      splits={"train": {"tokens": n * size, "documents": n, "shards": shards},
                                              "val": {"tokens": 0, "documents": 0, "shards": []}},
                                      files=files, params={}, fingerprint="bench", source={}, bytes_per_token=1.0,
                                      skipped_count=0, skipped=[]))


MAKERS = {"npy": make_npy, "lmdb": make_lmdb, "tokens": make_tokens}


def measure(kind: str, path: Union[Path, str], code_root: Path, *extra: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(code_root))
    r = subprocess.run([sys.executable, "-c", CHILD, kind, str(path), *extra], capture_output=True, text=True,
                       env=env, cwd=tempfile.gettempdir())
    if r.returncode != 0:
        raise SystemExit(f"{kind} at {code_root} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def older(ref: str, into: Path) -> Path:
    """The fastdata of commit ``ref``, unpacked (no git state changes)."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", ref, "fastdata"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def upload_first(root: Path, shards: int) -> str:
    """A loopback S3 server (moto) holding ``root``'s manifest and labels and its first ``shards`` npy shards
    (enough for what the remote child reads: the loader fetches no further); its URL. The endpoint goes into
    this process's environment, which the children inherit."""
    import logging
    from concurrent.futures import ThreadPoolExecutor

    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    endpoint = f"http://127.0.0.1:{server._server.server_port}"
    os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                      AWS_DEFAULT_REGION="us-east-1")
    client = boto3.client("s3", endpoint_url=endpoint)
    client.create_bucket(Bucket="bench")
    from fastdata.formats.image_shards import images_name, labels_name

    names = [n for k in range(shards) for n in (images_name(k), labels_name(k))] + ["labels.npy"]
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda n: client.put_object(Bucket="bench", Key=f"ds/{n}", Body=(root / n).read_bytes()),
                      names))
    client.put_object(Bucket="bench", Key="ds/manifest.json", Body=(root / "manifest.json").read_bytes())
    return "s3://bench/ds"


def remote(args: argparse.Namespace, codes: dict[str, Path], tmp: Path) -> None:
    """The ``--remote`` table: each code opens the streamed npy dataset with a fresh cache folder and reads
    its first ``--reads`` shards in order."""
    root, spare = tmp / "npy", tmp / "npy-spare"
    root.mkdir()
    spare.mkdir()
    make_npy(root, args.shards, spare)
    size = sum((root / n).stat().st_size for n in ("images-00000.npy", "labels-00000.npy"))
    url = upload_first(root, min(args.shards, args.reads + 4 * args.cache_shards + 64))
    print(f"{'code':>10} {'open s':>8} {'first batch s':>14} {'read shards/s':>14} {'RSS MB':>8} {'peak MB':>8}")
    best = {}
    for name, code in codes.items():
        runs = []
        for k in range(args.rounds):
            cache = tmp / f"cache-{name}-{k}"
            runs.append(measure("remote", url, code, str(args.cache_shards * size), str(args.reads), str(ROWS),
                                str(cache), str(args.seconds)))
            subprocess.run(["rm", "-rf", str(cache)], check=True)
        best[name] = r = min(runs, key=lambda r: r["open"] + r["first"])
        print(f"{name:>10} {r['open']:>8.2f} {r['first']:>14.3f} {r['shards_per_s']:>14.0f} {r['rss_mb']:>8.0f} "
              f"{r['peak_mb']:>8.0f}",
              flush=True)
    for ref in codes:
        if ref != "this":
            old, new = best[ref], best["this"]
            print(f"this opens {old['open'] / new['open']:.2f}x faster than {ref} with a "
                  f"{old['peak_mb'] / new['peak_mb']:.2f}x lower peak, first batch "
                  f"{old['first'] / new['first']:.2f}x sooner, reads shards "
                  f"{new['shards_per_s'] / old['shards_per_s']:.2f}x as fast", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", type=int, default=100_000)
    ap.add_argument("--formats", default="npy,lmdb,tokens")
    ap.add_argument("--against", help="git refs (comma-separated) whose fastdata opens the same folders in the "
                    "same run")
    ap.add_argument("--rounds", type=int, default=2, help="opens of each folder by each code; the best is kept")
    ap.add_argument("--work", help="folder for the datasets (default: a temporary one, removed after)")
    ap.add_argument("--remote", action="store_true", help="the npy dataset streamed from a loopback S3 server "
                    "through a limited node cache (needs the test extra's moto)")
    ap.add_argument("--reads", type=int, default=2000, help="--remote: shards the loader reads")
    ap.add_argument("--cache-shards", type=int, default=100, help="--remote: shards the cache_limit holds")
    ap.add_argument("--seconds", type=float, default=120, help="--remote: reading stops after this long")
    args = ap.parse_args()
    import resource

    print(f"{args.shards:,} shards a dataset; limits on open files {resource.getrlimit(resource.RLIMIT_NOFILE)}, "
          f"vm.max_map_count {Path('/proc/sys/vm/max_map_count').read_text().strip()}")
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        tmp = Path(tmp)
        codes = {"this": REPO}
        refs = args.against.split(",") if args.against else []
        for ref in refs:
            codes[ref] = older(ref, Path(tempfile.mkdtemp(dir=tmp)))
        if args.remote:
            return remote(args, codes, tmp)
        print(f"{'format':>7} {'code':>10} {'open s':>8} {'first batch s':>14} {'RSS MB':>8} {'peak MB':>8} "
              f"{'pickled MB':>11} "
              f"{'version s':>10} {'floor s':>8} {'open/floor':>11}")
        for kind in args.formats.split(","):
            root, spare = tmp / kind, tmp / f"{kind}-spare"
            root.mkdir()
            spare.mkdir()
            MAKERS[kind](root, args.shards, spare)
            floor = min(measure("floor", root, REPO)["open"] for _ in range(args.rounds))
            best = {}
            for name, code in codes.items():
                runs = [measure(kind, root, code) for _ in range(args.rounds)]
                best[name] = min(runs, key=lambda r: r["open"])
                r = best[name]
                print(f"{kind:>7} {name:>10} {r['open']:>8.2f} {r['first']:>14.3f} {r['rss_mb']:>8.0f} "
                      f"{r['peak_mb']:>8.0f} {r['sent_mb']:>11.1f} {r['version']:>10.2f} {floor:>8.2f} {r['open'] / floor:>10.1f}x",
                      flush=True)
            for ref in refs:
                old, new = best[ref], best["this"]
                print(f"{kind:>7} this opens {old['open'] / new['open']:.2f}x faster than {ref}, in "
                      f"{old['rss_mb'] / new['rss_mb']:.1f}x less memory ({old['peak_mb'] / new['peak_mb']:.1f}x "
                      "less at the peak), pickled "
                      f"{old['sent_mb'] / max(new['sent_mb'], 1e-6):.1f}x smaller, its version made "
                      f"{old['version'] / max(new['version'], 1e-6):.1f}x faster", flush=True)
            subprocess.run(["rm", "-rf", str(root), str(spare)], check=True)


if __name__ == "__main__":
    main()
