"""fastdata preprocess on Ray vs the local process pool, on the same photos, in the same run; and the driver's
cost per shard, measured by a planning-only dry run and projected to 10^9 samples / 10^6 shards.

Cases (issue 43 item 5; every Ray node is started here on 127.0.0.1 with ``ray.cluster_utils.Cluster``):
  1. Ray with N CPUs (one node) vs the local pool with N workers: images/s and their ratio (target >= 0.9x),
     and a check that both outputs are byte-identical.
  2. Ray on 1 node of 1 CPU vs 2 nodes of 1 CPU each: the speed-up (target >= 1.8x; on a machine with fewer
     free cores than nodes the nodes share them, so read this row only where each node has its own core),
     beside the local pool's own 1 -> 2 workers on the same photos: what the cores give without Ray.
  3. The same photos as WebDataset tars (``KEY.jpg`` + ``KEY.cls``) read from a loopback S3 server (moto on
     127.0.0.1, its own process on the same cores) against the same tars on local disk: images/s and their
     ratio, N workers, and a check that both outputs are byte-identical.
  4. LitData ``optimize()`` on the same photo folder, the same N CPUs and the same output (JPEG quality 90, the
     shorter side 256 by Pillow's kernel of fastdata's default filter) against fastdata's LMDB writer: fastdata's
     images/s as a ratio of LitData's (target >= 1.2x); skipped with a message when litdata is missing.
  5. ``--plan-samples S``: the driver's work for WebDataset tars without any decoding: the tars' listing, the
     merge of their summaries, the tasks as Ray receives them, one journal entry per shard and the manifest,
     with its CPU time and peak memory; the journal is measured at two sizes to check that an entry costs
     the same at any size (entries are appended), then everything is projected to 10^9 samples in 10^6
     shards.

    python benchmarks/bench_cluster.py [--images 400] [--cpus 2] [--plan-samples 1000000] [--skip-ray]
                                       [--skip-sources] [--rounds 3]

Results and their conditions go to benchmarks/RESULTS.md.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.metadata
import importlib.util
import io
import json
import os
import pickle
import platform
import resource
import shutil
import statistics
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

from PIL import Image

from fastdata.cli.synthetic import make_image_folder
from fastdata.formats import image_shards
from fastdata.formats.manifest import IMAGES_NPY, new_manifest, write_manifest
from fastdata.preprocess import journal, tar_index
from fastdata.preprocess.image_tasks import Plan
from fastdata.preprocess.images import ImagePreprocessConfig, preprocess_images

TARGET_SAMPLES, TARGET_SHARDS = 10 ** 9, 10 ** 6
REPEATS = 2  # best of: the machine may be shared


def tree_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def timed_run(src: Union[Path, str], out: Path, **kw: Any) -> float:
    """Images per second of one preprocess (the output folder made afresh)."""
    shutil.rmtree(out, ignore_errors=True)
    t = time.perf_counter()
    m = preprocess_images(ImagePreprocessConfig(src=src, out=out, size=256, shard_size=64, progress=False, **kw))
    return m["num_samples"] / (time.perf_counter() - t)


def ray_cases(scratch: Path, n_images: int, cpus: int) -> dict[str, float]:
    """Cases 1 and 2 on one synthetic ImageNet-like folder (500x375 photos, S=256 center-crop)."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # every node and this driver on 127.0.0.1: before the import
    import ray
    from ray.cluster_utils import Cluster

    src = scratch / "src"
    make_image_folder(src, num_classes=4, per_class=max(1, n_images // 4), sizes=((500, 375), (375, 500)))
    warm = scratch / "warm"
    make_image_folder(warm, num_classes=2, per_class=4 * cpus, sizes=((64, 48),))
    res: dict[str, float] = {}
    timed_run(warm, scratch / "warm-out", workers=cpus)  # imports and the page cache, outside the timing
    res["local"] = max(timed_run(src, scratch / "local", workers=cpus) for _ in range(REPEATS))
    # the machine's own 1 -> 2 scaling, with no Ray: the ceiling of the 1 -> 2 node row on the same cores
    res["local_1"] = max(timed_run(src, scratch / "local-1", workers=1) for _ in range(REPEATS))
    res["local_2"] = res["local"] if cpus == 2 else max(timed_run(src, scratch / "local-2", workers=2)
                                                         for _ in range(REPEATS))
    for label, node_cpus in ((f"ray_{cpus}cpu", [cpus]), ("ray_1x1", [1]), ("ray_2x1", [1, 1])):
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": node_cpus[0], "include_dashboard": False})
        try:
            for c in node_cpus[1:]:
                cluster.add_node(num_cpus=c)
            cluster.wait_for_nodes()
            assert cluster.address.startswith("127.0.0.1:"), cluster.address
            ray.init(address=cluster.address, logging_level="ERROR")
            timed_run(warm, scratch / "warm-out", engine="ray")  # start the Ray workers outside the timing
            res[label] = max(timed_run(src, scratch / label, engine="ray") for _ in range(REPEATS))
            if label.endswith("cpu"):
                res["identical"] = float(tree_bytes(scratch / label) == tree_bytes(scratch / "local"))
        finally:
            ray.shutdown()
            cluster.shutdown()
    return res


def photo_tars(src: Path, dest: Path, per_tar: int = 100) -> None:
    """The photos of the folder ``src`` as WebDataset tars in ``dest``, in sample order: ``KEY.jpg`` and
    ``KEY.cls`` (the class index), as img2dataset writes them."""
    files = sorted(src.rglob("*.jpg"))
    classes = sorted({f.parent.name for f in files})
    dest.mkdir()
    for t in range(0, len(files), per_tar):
        with tarfile.open(dest / f"{t // per_tar:05d}.tar", "w") as tf:
            for i, f in enumerate(files[t:t + per_tar], start=t):
                tf.add(f, arcname=f"{i:09d}.jpg")
                cls = str(classes.index(f.parent.name)).encode()
                info = tarfile.TarInfo(f"{i:09d}.cls")
                info.size = len(cls)
                tf.addfile(info, io.BytesIO(cls))


_MOTO = """
import logging, sys
from moto.server import ThreadedMotoServer
logging.getLogger("werkzeug").setLevel(logging.WARNING)
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
server.start()
print("port", server._server.server_port, flush=True)
sys.stdin.read()  # until the benchmark closes the pipe
"""


@contextlib.contextmanager
def loopback_s3() -> Iterator[Any]:
    """A moto S3 server on 127.0.0.1, in a process of its own (as a store is: not sharing this process's
    GIL), as the endpoint of s3fs and boto3; yields a boto3 client."""
    import subprocess
    import sys

    import boto3
    import fsspec

    server = subprocess.Popen([sys.executable, "-c", _MOTO], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True)
    old: dict[str, Optional[str]] = {}
    try:
        line = ""
        while not line.startswith("port "):  # moto prints a line of its own first
            line = server.stdout.readline()
            if not line:
                raise RuntimeError("the moto server did not start: pip install 'moto[server]'")
        endpoint = f"http://127.0.0.1:{int(line.split()[1])}"
        env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
               "AWS_DEFAULT_REGION": "us-east-1"}
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        fsspec.filesystem("s3").clear_instance_cache()  # an s3fs client is cached per options, not per endpoint
        yield boto3.client("s3", endpoint_url=endpoint)
    finally:
        server.stdin.close()
        server.wait(timeout=30)
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def medians(contenders: dict[str, Callable[[], float]], rounds: int) -> dict[str, float]:
    """The median of what each contender returns over ``rounds`` rounds, each round running them in turn (a
    shared machine drifts between runs; alternating spreads the drift over all of them)."""
    runs: dict[str, list[float]] = {k: [] for k in contenders}
    for _ in range(rounds):
        for name, fn in contenders.items():
            runs[name].append(fn())
    return {k: statistics.median(v) for k, v in runs.items()}


def shard_bytes(folder: Path) -> dict[str, bytes]:
    return {k: v for k, v in tree_bytes(folder).items() if k != "manifest.json"}  # it names the source


def source_cases(scratch: Path, n_images: int, cpus: int, rounds: int,
                 flt: Optional[str] = None) -> dict[str, Optional[float]]:
    """Cases 3 and 4 on one synthetic ImageNet-like folder (500x375 photos, S=256)."""
    src, tars = scratch / "photos", scratch / "tars"
    make_image_folder(src, num_classes=4, per_class=max(1, n_images // 4), sizes=((500, 375), (375, 500)))
    photo_tars(src, tars)
    warm = scratch / "warm"
    make_image_folder(warm, num_classes=2, per_class=4 * cpus, sizes=((64, 48),))
    timed_run(warm, scratch / "warm-out", workers=cpus)  # imports and the page cache, outside the timing
    res: dict[str, Optional[float]] = {}
    with loopback_s3() as client:
        client.create_bucket(Bucket="bench")
        for t in sorted(tars.iterdir()):
            client.upload_file(str(t), "bench", f"wds/{t.name}")
        r = medians({"tars_local": lambda: timed_run(tars, scratch / "tars-local", workers=cpus),
                          "tars_s3": lambda: timed_run("s3://bench/wds", scratch / "tars-s3", workers=cpus)}, rounds)
        res.update(r)
        res["tars_identical"] = float(shard_bytes(scratch / "tars-local") == shard_bytes(scratch / "tars-s3"))
    res.update(litdata_case(scratch, src, cpus, rounds, flt))
    return res


LITDATA_SIZE, LITDATA_QUALITY = 256, 90


def litdata_sample(path: str, resample: int) -> dict[str, Any]:
    """What a LitData user writes for ``optimize()``: the photo read by Pillow, its shorter side resized to 256
    (never up), re-encoded as JPEG quality 90, with its class index (folders are ``class_K``)."""
    img = Image.open(path).convert("RGB")
    w, h = img.size
    s = LITDATA_SIZE / min(w, h)
    if s < 1:
        img = img.resize((max(LITDATA_SIZE, round(w * s)), max(LITDATA_SIZE, round(h * s))), resample)
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=LITDATA_QUALITY)
    return {"image": buf.getvalue(), "label": int(Path(path).parent.name.rsplit("_", 1)[1])}


def litdata_case(scratch: Path, src: Path, cpus: int, rounds: int,
                 flt: Optional[str] = None) -> dict[str, Optional[float]]:
    """Case 4: LitData's ``optimize()`` against fastdata's LMDB writer with filter ``flt`` (None: the default;
    LitData resizes with Pillow's kernel of that name, Pillow's bicubic for ``fast-bicubic``), both writing
    JPEG quality 90.
    Each runs on all the photos and on ``4 * cpus`` of them: images/s end to end, and the marginal rate (the
    photos beyond the small run over the seconds beyond it): LitData spawns workers that import anew, a
    fixed cost a large conversion spreads thin."""
    try:
        import litdata
    except ImportError as exc:
        print(f"LitData row skipped: litdata is not importable ({exc}); pip install litdata (../shared/PEERS.md)")
        return {}
    from fastdata.imaging.decode_file import FILTERS

    default = ImagePreprocessConfig(src=src, out=scratch / "unused").filter
    flt = flt or default
    resample = int(FILTERS[flt]) if flt != "fast-bicubic" else int(Image.Resampling.BICUBIC)
    files = sorted(src.rglob("*.jpg"))
    small = scratch / "photos-small"
    for f in files[:4 * cpus]:
        (small / f.parent.name).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, small / f.parent.name / f.name)

    def lit(folder: Path) -> float:
        out = scratch / "litdata"
        shutil.rmtree(out, ignore_errors=True)
        inputs = [str(f) for f in sorted(folder.rglob("*.jpg"))]
        t = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            litdata.optimize(fn=functools.partial(litdata_sample, resample=resample), inputs=inputs,
                             output_dir=str(out), chunk_bytes="64MB", num_workers=cpus, verbose=False)
        return time.perf_counter() - t

    def fd(folder: Path) -> float:
        out = scratch / "fd-lmdb"
        shutil.rmtree(out, ignore_errors=True)
        t = time.perf_counter()
        preprocess_images(ImagePreprocessConfig(src=folder, out=out, size=LITDATA_SIZE, format="lmdb", filter=flt,
                                                quality=LITDATA_QUALITY, workers=cpus, progress=False))
        return time.perf_counter() - t

    r = medians({"litdata": lambda: lit(src), "litdata_small": lambda: lit(small),
                 "fastdata_lmdb": lambda: fd(src), "fastdata_small": lambda: fd(small)}, rounds)
    n, n_small = len(files), 4 * cpus
    out = {k: n / r[k] for k in ("litdata", "fastdata_lmdb")}
    for k in ("litdata", "fastdata_lmdb"):
        out[f"{k}_marginal"] = (n - n_small) / max(1e-9, r[k] - r[f"{k.split('_')[0]}_small"])
    lit(src), fd(src)  # the outputs, whole, for their sizes
    out["litdata_bytes"] = float(sum(f.stat().st_size for f in (scratch / "litdata").rglob("*") if f.is_file()))
    out["fastdata_bytes"] = float(sum(f.stat().st_size for f in (scratch / "fd-lmdb").rglob("*") if f.is_file()))
    print(f"litdata {importlib.metadata.version('litdata')} optimize(): resize with Pillow's kernel of fastdata's "
          f"--filter {flt} (its default: {default})")
    return out


def cpu_now() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def measured(fn: Callable[[], Any]) -> tuple[Any, float]:
    t = cpu_now()
    out = fn()
    return out, cpu_now() - t


def synthetic_tars(samples: int, per_tar: int) -> tar_index.TarSource:
    """A listing of WebDataset tars of ``per_tar`` samples (names and stats as one store listing gives them;
    no tar exists): LAION's layout, img2dataset's default of 10,000 samples a tar."""
    n = -(-samples // per_tar)
    return tar_index.TarSource("s3://bucket/laion", Path("."), [f"s3://bucket/laion/{t:06d}.tar" for t in range(n)],
                               [(per_tar * 45_000, f'"{t:032x}"') for t in range(n)])


def tar_summary(samples: int) -> dict[str, Any]:
    """A tar's summary as `tar_index.index_task` returns it: captions, two numeric keys, no classes."""
    return {"samples": samples, "good": samples, "seen": ["height", "width"], "numeric": ["height", "width"],
            "kinds": [["caption", "tokens"], ["width", "vector"], ["height", "vector"]], "has_label": False,
            "vectors": {"width": -1, "height": -1}, "classes": {}, "problems": {}, "index_sha256": "0" * 64}


def unit_record(k: int, shard_size: int) -> dict[str, Any]:
    """A journal entry as NpyShardWriter makes it: images and labels files with sizes and sha256."""
    return {"index": k, "samples": shard_size, "source_end": (k + 1) * shard_size,
            "files": [{"path": image_shards.images_name(k), "bytes": shard_size * 196_736, "sha256": "0" * 64},
                      {"path": image_shards.labels_name(k), "bytes": 128 + 8 * shard_size, "sha256": "0" * 64}]}


def journal_cpu(scratch: Path, shards: int, shard_size: int) -> float:
    """CPU seconds of journaling ``shards`` units, one :meth:`journal.Journal.add` each (the real one)."""
    partial = scratch / f"journal-{shards}"
    partial.mkdir()
    jr = journal.Journal("0" * 64)
    _, cpu = measured(lambda: [jr.add(unit_record(k, shard_size), [], partial) for k in range(shards)])
    shutil.rmtree(partial)
    return cpu


def plan_case(scratch: Path, samples: int, shard_size: int = 1024, per_tar: int = 10_000) -> dict[str, float]:
    """Case 5: the driver's own work for ``samples`` samples in WebDataset tars, no decoding (NOTE [tar index]
    in fastdata/preprocess/tar_index.py): the tars' listing, the merge of their summaries, one task per unit
    as Ray receives it (pickled), one journal entry per unit, and the manifest."""
    shards = -(-samples // shard_size)
    base_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    source, listing_cpu = measured(lambda: synthetic_tars(samples, per_tar))
    # one at a time, as the tasks return them
    summaries = (tar_summary(min(per_tar, samples - t * per_tar)) for t in range(len(source.tars)))
    indexed, merge_cpu = measured(lambda: source.merge(summaries, source.area(scratch)))
    plan = Plan("npy", 256, shard_size, (), False, "center-crop", "lanczos", 90, "uint8", "bytes")

    def tasks() -> int:  # what `images._run` submits, serialised as Ray does (its pickler is cloudpickle's)
        return sum(len(pickle.dumps((plan, k, a, min(a + shard_size, samples),
                                     indexed.piece(a, min(a + shard_size, samples)), 16, scratch)))
                   for k, a in enumerate(range(0, samples, shard_size)))

    task_bytes, plan_cpu = measured(tasks)
    units = [unit_record(k, shard_size) for k in range(shards)]  # the journal's units, held by the driver

    def manifest() -> int:
        m = new_manifest(IMAGES_NPY, version=1, num_samples=samples, classes=[],
                         files=[f for u in units for f in u["files"]],
                         shards=[{"images": image_shards.images_name(u["index"]),
                                  "labels": image_shards.labels_name(u["index"]), "samples": u["samples"]}
                                 for u in units])
        write_manifest(scratch, m)
        return (scratch / "manifest.json").stat().st_size

    manifest_bytes, manifest_cpu = measured(manifest)
    small, large = max(2, min(shards, 1000) // 2), max(4, min(shards, 1000))
    j_small, j_large = journal_cpu(scratch, small, shard_size), journal_cpu(scratch, large, shard_size)
    per_entry = j_large / large  # the same at both sizes when an entry is appended in O(1) (printed: compare)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base_mb  # the driver's growth
    scale = TARGET_SAMPLES / samples  # tars and units both grow with the samples (fixed sizes of each)
    cpu = listing_cpu + merge_cpu + plan_cpu + manifest_cpu + per_entry * shards
    return {"samples": samples, "tars": len(source.tars), "shards": shards, "listing_cpu_s": listing_cpu,
            "merge_cpu_s": merge_cpu, "plan_cpu_s": plan_cpu, "task_bytes_mean": task_bytes / shards,
            "manifest_cpu_s": manifest_cpu, "manifest_mb": manifest_bytes / 1e6, "driver_growth_mb": peak_mb,
            "journal_ms_per_entry_at": {small: 1e3 * j_small / small, large: 1e3 * j_large / large},
            "projected_driver_cpu_min": cpu * scale / 60,
            "projected_driver_gb": peak_mb / 1e3 * scale}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=400)
    ap.add_argument("--cpus", type=int, default=2)
    ap.add_argument("--plan-samples", type=int, default=1_000_000)
    ap.add_argument("--skip-ray", action="store_true", help="no Ray rows")
    ap.add_argument("--skip-sources", action="store_true", help="no S3-vs-local-disk and LitData rows")
    ap.add_argument("--rounds", type=int, default=3, help="S3 and LitData rows: median of N rounds")
    ap.add_argument("--filter", help="LitData rows: fastdata's --filter (default: its default)")
    args = ap.parse_args()
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}")
    with tempfile.TemporaryDirectory(prefix="bench-cluster-") as tmp:
        scratch = Path(tmp)
        if not args.skip_ray:
            if importlib.util.find_spec("ray") is None:
                print("ray rows skipped: pip install 'fastdata[ray]'")
            else:
                r = ray_cases(scratch, args.images, args.cpus)
                print(f"ray {importlib.metadata.version('ray')}: local pool {args.cpus} workers {r['local']:.0f} img/s | "
                      f"Ray "
                      f"{args.cpus} CPUs {r[f'ray_{args.cpus}cpu']:.0f} img/s = "
                      f"{r[f'ray_{args.cpus}cpu'] / r['local']:.2f}x (target >= 0.9x), byte-identical: "
                      f"{bool(r['identical'])}")
                print(f"Ray 1 node x 1 CPU {r['ray_1x1']:.0f} img/s -> 2 nodes x 1 CPU {r['ray_2x1']:.0f} img/s = "
                      f"{r['ray_2x1'] / r['ray_1x1']:.2f}x (target >= 1.8x); the local pool 1 -> 2 workers on "
                      f"the same cores {r['local_2'] / r['local_1']:.2f}x (this machine's ceiling for the row), "
                      f"Ray's share of it {r['ray_2x1'] / r['ray_1x1'] / (r['local_2'] / r['local_1']):.2f}")
        if not args.skip_sources:
            r = source_cases(scratch / "sources", args.images, args.cpus, args.rounds, args.filter)
            print(f"WebDataset tars, {args.cpus} workers, median of {args.rounds} rounds: local disk "
                  f"{r['tars_local']:.0f} img/s | loopback S3 (moto, 127.0.0.1) {r['tars_s3']:.0f} img/s = "
                  f"{r['tars_s3'] / r['tars_local']:.2f}x local; the same shards: {bool(r['tars_identical'])}")
            if "litdata" in r:
                ratio, marginal = (r["fastdata_lmdb"] / r["litdata"],
                                   r["fastdata_lmdb_marginal"] / r["litdata_marginal"])
                print(f"same folder, {args.cpus} CPUs, JPEG q90 shorter side 256, median of {args.rounds} rounds: "
                      f"LitData optimize() {r['litdata']:.0f} img/s end to end, {r['litdata_marginal']:.0f} "
                      f"marginal ({r['litdata_bytes'] / 1e6:.1f} MB) | fastdata LMDB {r['fastdata_lmdb']:.0f} img/s, "
                      f"{r['fastdata_lmdb_marginal']:.0f} marginal ({r['fastdata_bytes'] / 1e6:.1f} MB) = "
                      f"{ratio:.2f}x end to end, {marginal:.2f}x marginal (target >= 1.2x: "
                      f"{'met' if min(ratio, marginal) >= 1.2 else 'NOT met'})")
        p = plan_case(scratch, args.plan_samples)
        print(json.dumps(p, indent=1))


if __name__ == "__main__":
    main()
