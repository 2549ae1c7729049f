"""Merge what `scripts/gpu_checks.sh` wrote on the GPU machine into one committed record (issue 15).

    python benchmarks/gpu_results.py OUT --tests A.xml B.xml --gpu bench_gpu.json [more.json] --dali bench_dali.json \
        [--dali-memory bench_dali.json] [--driver 580.159.04] [--note "..."]

Writes OUT (``benchmarks/results/gpu-YYYY-MM-DD.json``): the acceptance keys first (device, cuda_tests,
h2d_ratio, the stalls, cuda_gather_ratio, dali_images_per_s, dali_stall_pct_resnet50_224), then every run's
own JSON under ``raw``.
"""
from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any


def test_counts(paths: list[Path]) -> dict[str, Any]:
    """passed / failed / skipped over junit XML files (a test in several files counts once, its last)."""
    outcome: dict[str, str] = {}
    for path in paths:
        for case in ET.parse(path).getroot().iter("testcase"):
            name = f"{case.get('classname')}::{case.get('name')}"
            kinds = {child.tag for child in case}
            outcome[name] = ("failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds
                             else "passed")
    counts = {k: sum(v == k for v in outcome.values()) for k in ("passed", "failed", "skipped")}
    return {**counts, "tests": sorted(outcome)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--tests", type=Path, nargs="+", required=True)
    ap.add_argument("--gpu", type=Path, nargs="+", required=True,
                    help="bench_gpu JSONs of one machine (runs of --parts subsets), merged in order")
    ap.add_argument("--dali", type=Path, required=True)
    ap.add_argument("--dali-memory", type=Path, help="a bench_dali JSON with the memory rows, if --dali has none")
    ap.add_argument("--driver", default=None)
    ap.add_argument("--note", default=None)
    args = ap.parse_args()
    runs = [json.loads(path.read_text()) for path in args.gpu]
    gpu: dict[str, Any] = {k: v for run in runs for k, v in run.items()}  # a later run's keys win
    dali = json.loads(args.dali.read_text())
    memory = json.loads(args.dali_memory.read_text()) if args.dali_memory else dali
    tests = test_counts(args.tests)
    record = {
        "device": gpu["device"], "driver": args.driver, "torch": gpu["machine"]["torch"], "cuda": gpu["cuda"],
        "dali": dali["dali"], "cores": gpu["machine"]["cores"], "date": gpu["machine"]["date"],
        "cuda_tests": {k: tests[k] for k in ("passed", "failed", "skipped")},
        "h2d_ratio": gpu["h2d_ratio"],
        "stall_pct_resnet50_224": gpu["stall_pct_resnet50_224"],
        "stall_pct_resnet18_112": gpu["stall_pct_resnet18_112"],
        **{k: gpu[k] for k in ("stall_pct_resnet50_224_no_cuda_graphs", "stall_pct_resnet18_112_no_cuda_graphs")
           if k in gpu},
        "dataloader_stall_pct_resnet50_224": gpu["dataloader_stall_pct_resnet50_224"],
        "dataloader_stall_pct_resnet18_112": gpu["dataloader_stall_pct_resnet18_112"],
        "cuda_gather_ratio": gpu["cuda_gather_ratio"],
        "cifar_h2d_copies_per_step": gpu["cifar"]["h2d_per_step"],
        "dali_images_per_s": dali["dali_images_per_s"],
        "dali_stall_pct_resnet50_224": dali["dali_stall_pct_resnet50_224"],
        **{f"{feed}_{k}": dali[f"{feed}_{k}"] for feed in ("dali_hw", "dali_here", "dali_host_sync")
           for k in ("images_per_s", "stall_pct_resnet50_224") if f"{feed}_{k}" in dali},
        **{k: dali[k] for k in (*(f"{feed}_start_wait_s" for feed in ("dali", "dali_hw", "dali_here",
                                                                         "dali_host_sync")),
                                "dali_first_batch_ms", "dali_first_batch_again_ms") if k in dali},
        "memory_prefetcher": gpu["memory_prefetcher"], "memory_dali": memory.get("dali_memory"),
        "note": args.note,
        "raw": {"tests": tests["tests"], "bench_gpu": runs if len(runs) > 1 else runs[0], "bench_dali": dali,
                **({"bench_dali_memory": memory} if args.dali_memory else {})},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print({k: v for k, v in record.items() if k != "raw"})


if __name__ == "__main__":
    main()
