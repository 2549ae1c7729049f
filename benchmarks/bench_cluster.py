"""fastdata preprocess on Ray vs the local process pool, on the same photos, in the same run; and the driver's
cost per shard, measured by a planning-only dry run and projected to 10^9 samples / 10^6 shards.

Cases (issue 43 item 5; every Ray node is started here on 127.0.0.1 with ``ray.cluster_utils.Cluster``):
  1. Ray with N CPUs (one node) vs the local pool with N workers: images/s and their ratio (target >= 0.9x),
     and a check that both outputs are byte-identical.
  2. Ray on 1 node of 1 CPU vs 2 nodes of 1 CPU each: the speed-up (target >= 1.8x; on a machine with fewer
     free cores than nodes the nodes share them, so read this row only where each node has its own core).
  3. ``--plan-samples S``: the driver's work without any decoding: the source listing, the task plan, one
     journal entry per shard and the manifest, with its CPU time and peak memory; the journal is measured
     at two sizes because it is rewritten whole after every shard (its cost grows with the square of the
     shards), then everything is projected to 10^9 samples in 10^6 shards.

    python benchmarks/bench_cluster.py [--images 400] [--cpus 2] [--plan-samples 1000000] [--skip-ray]

Results and their conditions go to benchmarks/RESULTS.md.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import resource
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from fastdata.cli.synthetic import make_image_folder
from fastdata.formats import image_shards
from fastdata.formats.manifest import IMAGES_NPY, new_manifest, write_manifest
from fastdata.preprocess import images, journal
from fastdata.preprocess.images import ImagePreprocessConfig, preprocess_images
from fastdata.preprocess.sources import Source

TARGET_SAMPLES, TARGET_SHARDS = 10 ** 9, 10 ** 6
REPEATS = 2  # best of: the machine may be shared


def tree_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def timed_run(src: Path, out: Path, **kw: Any) -> float:
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


def cpu_now() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def measured(fn: Callable[[], Any]) -> tuple[Any, float]:
    t = cpu_now()
    out = fn()
    return out, cpu_now() - t


def synthetic_source(n: int) -> Source:
    """A listing of ``n`` samples as a folder source holds it (1,000 classes; no file exists)."""
    paths = [f"c{i % 1000:03d}/{i:010d}.jpg" for i in range(n)]
    return Source("folder", Path("/synthetic"), Path("/synthetic"), paths, [i % 1000 for i in range(n)],
                  [f"c{k:03d}" for k in range(1000)])


def unit_record(k: int, shard_size: int) -> dict[str, Any]:
    """A journal entry as NpyShardWriter makes it: images and labels files with sizes and sha256."""
    return {"index": k, "samples": shard_size, "source_end": (k + 1) * shard_size, "in_partial": False,
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


def plan_case(scratch: Path, samples: int, shard_size: int = 1024) -> dict[str, float]:
    """Case 3: the driver's own work for ``samples`` samples, no decoding."""
    shards = -(-samples // shard_size)
    base_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    source, listing_cpu = measured(lambda: synthetic_source(samples))

    def plan() -> int:
        chunks = images._chunks(0, samples, 64, images._MAX_CHUNK)  # 64 workers: the chunking of a cluster
        return len([(str(source.root), source.paths[a:b], a, "npy", 256, "center-crop", 90, "lanczos", None)
                    for a, b in chunks])

    tasks, plan_cpu = measured(plan)
    units = [unit_record(k, shard_size) for k in range(shards)]

    def manifest() -> int:
        m = new_manifest(IMAGES_NPY, version=1, num_samples=samples, classes=source.classes,
                         files=[f for u in units for f in u["files"]],
                         shards=[{"images": image_shards.images_name(u["index"]),
                                  "labels": image_shards.labels_name(u["index"]), "samples": u["samples"]}
                                 for u in units])
        write_manifest(scratch, m)
        return (scratch / "manifest.json").stat().st_size

    manifest_bytes, manifest_cpu = measured(manifest)
    small, large = max(2, min(shards, 1000) // 2), max(4, min(shards, 1000))
    j_small, j_large = journal_cpu(scratch, small, shard_size), journal_cpu(scratch, large, shard_size)
    # the journal's cost a + b * k per entry k (the whole file rewritten): fitted on two sizes
    b = max(0.0, (j_large / large - j_small / small) / ((large - small) / 2))
    a = max(0.0, j_small / small - b * small / 2)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base_mb  # the driver's growth
    per_sample = (listing_cpu + plan_cpu) / samples
    per_shard = manifest_cpu / shards
    return {"samples": samples, "shards": shards, "tasks": tasks, "listing_cpu_s": listing_cpu,
            "plan_cpu_s": plan_cpu, "manifest_cpu_s": manifest_cpu, "manifest_mb": manifest_bytes / 1e6,
            "driver_growth_mb": peak_mb, "journal_cpu_s_at": {small: j_small, large: j_large},
            "projected_plan_and_manifest_cpu_min": (per_sample * TARGET_SAMPLES + per_shard * TARGET_SHARDS) / 60,
            "projected_journal_cpu_h": (a * TARGET_SHARDS + b * TARGET_SHARDS ** 2 / 2) / 3600,
            "projected_listing_gb": peak_mb / 1e3 * TARGET_SAMPLES / samples}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=400)
    ap.add_argument("--cpus", type=int, default=2)
    ap.add_argument("--plan-samples", type=int, default=1_000_000)
    ap.add_argument("--skip-ray", action="store_true", help="only the planning dry run")
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
                      f"{r['ray_2x1'] / r['ray_1x1']:.2f}x (target >= 1.8x)")
        p = plan_case(scratch, args.plan_samples)
        print(json.dumps(p, indent=1))


if __name__ == "__main__":
    main()
