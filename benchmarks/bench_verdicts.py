"""Does `fastdata bench` name the right bottleneck? Three pipelines, each built to be bound by one stage, are
benched through `fastdata.cli.bench.bench_pipeline` (what ``fastdata bench DATA`` runs) and each verdict is
checked against the stage it was built for (issue #40, item 7):

- decode: an LMDB store of JPEG photos at 256 px, decoded by one FastLoader thread (~2,500 images/s on a
  2-vCPU VM, 400-2,500 a thread on the H200 host's 16, RESULTS.md) for cnn-small at 256 px (~10^4 images/s
  in bf16 on an H100, estimated from its ~0.15 GB of activation traffic an image):
  ``fastdata bench LMDB --model cnn-small --threads 1``;
- h2d: the same photos as uint8 npy at 256 px in RAM, gathered by 12 threads into pageable buffers and
  copied with a blocking ``.to(device)`` (~8 GB/s, against ~55 pinned: history/gpu.md), with no model:
  ``fastdata bench NPY --model none --pageable --storage ram --threads 12``. No model steps through
  196 KB images faster than ~40,000 a second, so copies that slow only bound a pipeline without one;
- model: the same npy, ResNet-50 (~3,100 images/s at 256 px): ``fastdata bench NPY --model resnet50``.

Every dataset holds ``--images`` samples (512: two batches of 256 an epoch), so epoch starts fall every
other step: before the steady-state fix, the model-bound pipeline was named "data latency" for them.

    python benchmarks/bench_verdicts.py [--seconds 16] [--images 512] [--device cuda] [--json FILE]

Prints each pipeline's command, its stage table and verdict, and ``expected X: got Y``; exits 1 when a verdict
is wrong. On a CPU (``--device cpu``, a dry run of the code path) the pageable-copy pipeline is skipped and
the verdicts are printed but not checked: they are the GPU's.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from fastdata.cli import bench
from fastdata.cli.main import main as cli
from fastdata.cli.synthetic import make_image_folder
from fastdata.cli.timing import machine

# name -> (dataset format, bench_pipeline settings, the verdict it is built for)
PIPELINES: dict[str, tuple[str, dict[str, Any], str]] = {
    "decode": ("lmdb", {"model": "cnn-small", "num_threads": 1}, "decode"),
    "h2d": ("npy", {"model": "none", "pageable": True, "storage": "ram", "num_threads": 12}, "h2d"),
    "model": ("npy", {"model": "resnet50"}, "model"),
}


def make_data(root: Path, images: int, workers: int) -> dict[str, Path]:
    """``{"lmdb": ..., "npy": ...}``: ``images`` synthetic photos (500x375 and the like) stored at 256 px."""
    t0 = time.perf_counter()
    make_image_folder(root / "jpeg", num_classes=8, per_class=max(1, images // 8))
    out = {}
    for fmt in ("lmdb", "npy"):
        out[fmt] = root / fmt
        assert cli(["preprocess", "images", str(root / "jpeg"), str(out[fmt]), "--size", "256", "--format", fmt,
                    "--workers", str(workers), "--quiet"]) == 0
    print(f"datasets: {images} photos at 256 px, lmdb and npy, in {time.perf_counter() - t0:.1f} s", flush=True)
    return out


def command(data: Path, settings: dict[str, Any], args: argparse.Namespace) -> str:
    """The ``fastdata bench`` command line that builds the same pipeline."""
    flags = {"model": "--model", "storage": "--storage", "num_threads": "--threads"}
    parts = [f"fastdata bench {data}", f"--batch-size {args.batch_size}", f"--seconds {args.seconds:g}",
             f"--device {args.device}"]
    parts += [f"{flags[k]} {v}" for k, v in settings.items() if k in flags]
    return " ".join(parts + (["--pageable"] if settings.get("pageable") else []))


def run(args: argparse.Namespace) -> int:
    on_gpu = torch.device(args.device).type == "cuda"
    with tempfile.TemporaryDirectory(prefix="bench-verdicts-") as tmp:
        data = make_data(Path(tmp), args.images, args.workers)
        results, wrong = {}, []
        for name, (fmt, settings, expected) in PIPELINES.items():
            if name not in args.pipelines or (settings.get("pageable") and not on_gpu):
                continue
            print(f"\n== {name}: {command(data[fmt], settings, args)}", flush=True)
            t0 = time.perf_counter()
            report = bench.bench_pipeline(data[fmt], batch_size=args.batch_size, device=args.device,
                                          seconds=args.seconds, progress=False, **settings)
            print(bench.render(report))
            ok = report["bottleneck"] == expected
            print(f"expected {expected}-bound: got {report['bottleneck']}-bound "
                  f"({'ok' if ok else 'WRONG'}; {time.perf_counter() - t0:.0f} s)", flush=True)
            results[name] = {"expected": expected, "got": report["bottleneck"], "ok": ok,
                             "wall_s": time.perf_counter() - t0, "report": report}
            if not ok:
                wrong.append(name)
    checked = on_gpu
    summary = ", ".join(f"{n} {'ok' if r['ok'] else 'WRONG'}" for n, r in results.items())
    print(f"\nverdicts ({'checked' if checked else 'not checked: no GPU'}): {summary}")
    if args.json:
        args.json.write_text(json.dumps({"pipelines": results, "checked": checked, "machine": machine()}, indent=2,
                                        default=str))
        print(f"figures written to {args.json}")
    return 1 if checked and wrong else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=16.0, help="each pipeline's `fastdata bench --seconds`")
    ap.add_argument("--images", type=int, default=512, help="samples in each dataset (default 512)")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--workers", type=int, default=8, help="preprocess workers")
    ap.add_argument("--pipelines", default=",".join(PIPELINES), help="a subset, e.g. decode,model")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    args.pipelines = [p for p in args.pipelines.split(",") if p]
    unknown = set(args.pipelines) - set(PIPELINES)
    if unknown:
        ap.error(f"unknown pipelines {sorted(unknown)}: choose from {sorted(PIPELINES)}")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
