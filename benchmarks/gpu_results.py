"""Merge what `scripts/gpu_checks.sh` wrote on the GPU machine into one committed record (issue 15).

    python benchmarks/gpu_results.py OUT --tests A.xml B.xml --gpu bench_gpu.json [more.json] --dali bench_dali.json \
        [--dali-memory bench_dali.json] [--driver 580.159.04] [--note "..."]

Writes OUT (``benchmarks/results/gpu-YYYY-MM-DD.json``): the acceptance keys first (device, cuda_tests,
h2d_ratio, the stalls, cuda_gather_ratio, dali_images_per_s, dali_stall_pct_resnet50_224; issue 40's
lmdb_stall_pct_resnet50_224, lmdb_scaling_1_to_16, mixture_stall_pct_resnet50_224,
remote_warm_stall_pct_resnet50_224, dali_auto_vs_best and the figures beside them), each repeated figure with
``<key>_runs`` (every run; the key holds their median) and ``<key>_range`` ([least, most]); then the training
thread's profiles, then every run's own JSON under ``raw``. A key no input JSON has is left out (a run of some
parts only), so the first round's JSONs merge as before.
"""
from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

# issue 40's figures (bench_gpu.py and gpu_parts.py; bench_dali.py's dali_auto_vs_best), after the first round's
NEW_GPU = ("trainer_stall_pct_resnet50_224", "trainer_stall_pct_resnet18_112",
           "stall_pct_resnet50_224_whole", "stall_pct_resnet18_112_whole",  # the first round's method
           "stall_pct_resnet50_224_run_ahead", "stall_pct_resnet18_112_run_ahead", "lmdb_images_per_s",
           "lmdb_stall_pct_resnet50_224", "lmdb_scaling_1_to_16", "lmdb_processes_images_per_s",
           "lmdb_scaling_cpu_per_image_growth", "lmdb_scaling_busy_share", "physical_cores",
           "mixture_stall_pct_resnet50_224", "remote_warm_stall_pct_resnet50_224", "remote_warm_images_per_s",
           "remote_warm_whole_stall_pct_resnet50_224", "remote_warm_whole_images_per_s",
           "remote_cold_stall_pct_resnet50_224", "remote_cold_images_per_s", "stall_method")
PROFILED = ("rows_resnet18_112", "rows_resnet50_224", "lmdb_row", "mixture_row")  # rows with training-thread profiles


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


def with_runs(record: dict[str, Any], sources: list[dict[str, Any]]) -> dict[str, Any]:
    """``record`` with ``<key>_runs`` and ``<key>_range`` after each key that a source repeated (the last source
    with ``<key>_runs`` wins, as for the keys themselves)."""
    out: dict[str, Any] = {}
    for key, value in record.items():
        out[key] = value
        runs = next((src[f"{key}_runs"] for src in reversed(sources) if f"{key}_runs" in src), None)
        if runs:
            out[f"{key}_runs"], out[f"{key}_range"] = runs, [min(runs), max(runs)]
    return out


def profiles(gpu: dict[str, Any]) -> dict[str, Any]:
    """The training thread's profile of each profiled row, by ``<row set>/<row name>``."""
    found = {}
    for key in PROFILED:
        rows = gpu.get(key) or {}
        if "profile" in rows:  # a part's single row (lmdb_row, mixture_row)
            found[key] = rows["profile"]
        for name, row in rows.items():
            if isinstance(row, dict) and "profile" in row:
                found[f"{key}/{name}"] = row["profile"]
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--tests", type=Path, nargs="+", required=True)
    ap.add_argument("--gpu", type=Path, nargs="+", required=True,
                    help="bench_gpu JSONs of one machine (runs of --parts subsets), merged in order")
    ap.add_argument("--dali", type=Path, help="bench_dali.py's JSON (its keys are left out without it)")
    ap.add_argument("--dali-memory", type=Path, help="a bench_dali JSON with the memory rows, if --dali has none")
    ap.add_argument("--driver", default=None)
    ap.add_argument("--note", default=None)
    args = ap.parse_args()
    runs = [json.loads(path.read_text()) for path in args.gpu]
    gpu: dict[str, Any] = {k: v for run in runs for k, v in run.items()}  # a later run's keys win
    dali = json.loads(args.dali.read_text()) if args.dali else {}
    memory = json.loads(args.dali_memory.read_text()) if args.dali_memory else dali
    tests = test_counts(args.tests)
    first = ("h2d_ratio", "stall_pct_resnet50_224", "stall_pct_resnet18_112", "stall_pct_resnet50_224_no_cuda_graphs",
             "stall_pct_resnet18_112_no_cuda_graphs", "dataloader_stall_pct_resnet50_224",
             "dataloader_stall_pct_resnet18_112", "cuda_gather_ratio")
    record = {
        "device": gpu["device"], "driver": args.driver, "torch": gpu["machine"]["torch"], "cuda": gpu["cuda"],
        "dali": dali.get("dali"), "cores": gpu["machine"]["cores"], "date": gpu["machine"]["date"],
        "cuda_tests": {k: tests[k] for k in ("passed", "failed", "skipped")},
        **{k: gpu[k] for k in first if k in gpu},
        **({"cifar_h2d_copies_per_step": gpu["cifar"]["h2d_per_step"]} if "cifar" in gpu else {}),
        **{k: dali[k] for k in ("dali_images_per_s", "dali_stall_pct_resnet50_224") if dali.get(k) is not None},
        **{f"{feed}_{k}": dali[f"{feed}_{k}"] for feed in ("dali_hw", "dali_here", "dali_host_sync")
           for k in ("images_per_s", "stall_pct_resnet50_224") if f"{feed}_{k}" in dali},
        **{k: dali[k] for k in (*(f"{feed}_start_wait_s" for feed in ("dali", "dali_hw", "dali_here",
                                                                         "dali_host_sync")),
                                "dali_first_batch_ms", "dali_first_batch_again_ms") if k in dali},
        **{k: gpu[k] for k in NEW_GPU if k in gpu},
        **({"dali_auto_vs_best": dali["dali_auto_vs_best"]} if "dali_auto_vs_best" in dali else {}),
        "memory_prefetcher": gpu.get("memory_prefetcher"), "memory_dali": memory.get("dali_memory"),
    }
    record = with_runs(record, [*runs, dali])
    record.update({
        "training_thread_profiles": profiles(gpu) or None,
        "note": args.note,
        "raw": {"tests": tests["tests"], "bench_gpu": runs if len(runs) > 1 else runs[0], "bench_dali": dali,
                **({"bench_dali_memory": memory} if args.dali_memory else {})},
    })
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print({k: v for k, v in record.items() if k != "raw"})


if __name__ == "__main__":
    main()
