"""GPU feeding, one run: every number of the GPU acceptance (issue 15) that needs no DALI, with its limit.

1. H2D: a pinned ``non_blocking`` copy of one batch's bytes (the physical limit, measured here) against
   FastLoader + CUDAPrefetcher with no model (uint8 batches in, normalised bf16 on the GPU out).
2. Data stall, the Trainer's own ``data_stall_pct`` (CUDA events): ResNet-50@224 (batch 256) and
   ResNet-18@112 (batch 512), bf16, channels_last, fed by (a) an ``npy`` dataset in ``shm`` through
   FastLoader + CUDAPrefetcher with random-resized-crop + flip on the GPU (replayed from a CUDA graph, and
   launched op by op beside it) and (b) the plain recipe: torch DataLoader + Pillow (decode, resize,
   centre crop, float tensor, normalise per sample) on every core, ``.to(device)`` in the loop; beside
   the same model on synthetic data already on the GPU (the ceiling).
3. ``storage="cuda"``: the batch gather against a GPU-to-GPU copy of the same bytes (both counted read +
   written), and a CIFAR-10-sized epoch (50k x 32x32) with the host-to-device copies and host syncs per step
   counted (torch profiler, ``torch.cuda.set_sync_debug_mode``).
4. Memory: ``max_memory_allocated`` and host RSS over 1,000 CUDAPrefetcher iterations.
5. Issue 40's parts (benchmarks/gpu_parts.py): ``lmdb`` (FastDataset's LMDB CPU decode with decode-time crops,
   alone and into ResNet-50@224), ``scaling`` (that decode alone at 1-16 threads, with what stops it),
   ``mixture`` (3 sources into ResNet-50@224), ``remote`` (a loopback moto S3 server through the node cache,
   cold and warm epochs into ResNet-50@224).
Stalls are steady state: the Trainer's ``data_stall_pct`` over the steps after the first ``--steps / 5`` of one
iteration (the first interval, with the loader's start, given apart as ``start_wait_s``); each headline stall row
also gets a short profile of the training thread (host ms a step by operator, ``--profile-steps``).
``--runs N`` repeats every headline figure: the median under its key, each run in ``<key>_runs``.
Needs a CUDA GPU; on a CPU-only machine it says so and exits (``--smoke`` runs every path on the CPU, small).

    python benchmarks/bench_gpu.py [--images 1024] [--seconds 10] [--runs 3] [--parts ...] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

from fastdata.cli.synthetic import make_image_folder
from fastdata.cli.timing import ModelStep, machine, sync, timed_rate
from fastdata.datasets.images import FastDataset
from fastdata.errors import FastdataError
from fastdata.gpu.prefetch import CUDAPrefetcher
from fastdata.imaging.transforms import Compose, Normalize, RandomHorizontalFlip, RandomResizedCrop
from fastdata.loading.loader import FastLoader
from fastdata.preprocess.images import ImagePreprocessConfig, preprocess_images
from fastdata.train.config import TrainConfig
from fastdata.train.models import create_model
from fastdata.train.trainer import Trainer

sys.path.insert(0, str(Path(__file__).parent))
from bench_train import PlainFolder  # noqa: E402  (the plain recipe: Pillow, float tensors, normalise)

EAGER = "fastdata as above, eager conversion (cuda_graphs=False)"  # NOTE [graphed convert]
# (model, stored side, crop, batch, stall target %)
RUNS = (("resnet18", 128, 112, 512, 1.0), ("resnet50", 256, 224, 256, 0.5))  # (issue 40's targets)
FAST = "fastdata: npy in shm + CUDAPrefetcher (crop + flip on the GPU)"
RESIDENT = "Trainer on batches already on the GPU (the loop's own ceiling)"
AHEAD = "fastdata as above, launches on a side thread (run_ahead=True)"  # NOTE [prefetch thread]
NEW_PARTS = ("lmdb", "scaling", "mixture", "remote")  # benchmarks/gpu_parts.py
PARTS = ("h2d", "stalls", "gather", "cifar", "memory", *NEW_PARTS)


def replicated(files: list[Path], root: Path, repeat: int) -> list[Path]:
    """``repeat`` hard links to each of ``files`` (``.../class_k/name``) in an ImageFolder tree at ``root``."""
    out = []
    for f in files:
        folder = root / f.parent.name
        folder.mkdir(parents=True, exist_ok=True)
        for r in range(repeat):
            link = folder / f"{f.stem}_{r}{f.suffix}"
            os.link(f, link)
            out.append(link)
    return out


def drop_shm_copies(scratch: Path) -> None:
    """Remove the /dev/shm copies of this run's datasets (copies outlive a job on purpose; these are in RAM
    and their datasets are gone with ``scratch``)."""
    from fastdata.storage.shm import list_copies, remove_copies

    ours = [c["id"] for c in list_copies() if str(c.get("dataset", "")).startswith(str(scratch.resolve()))]
    if ours:  # (an empty list would remove every copy)
        remove_copies(ours)


def in_shm(root: Path) -> FastDataset:
    """``root`` with ``storage="shm"`` (one copy per node), or in RAM where /dev/shm cannot hold it (said)."""
    try:
        return FastDataset(root, storage="shm")
    except (FastdataError, OSError) as e:
        print(f"  storage='shm' failed here ({e}); using storage='ram'")
        return FastDataset(root, storage="ram")


def device_seconds(fn: Callable[[], Any], iters: int) -> float:
    """Seconds per call of ``fn`` on the GPU (CUDA events around ``iters`` calls after one warm-up)."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def h2d(nbytes: int, seconds: float) -> dict[str, float]:
    """GB/s of copying ``nbytes`` host -> device, pinned (non_blocking) and pageable."""
    host = torch.empty(nbytes, dtype=torch.uint8)
    pinned = host.pin_memory()
    dev = torch.empty_like(host, device="cuda")
    out = {}
    for name, src in (("pinned", pinned), ("pageable", host)):
        rate = timed_rate(lambda src=src: (dev.copy_(src, non_blocking=True), 1)[1], seconds / 2)
        out[name] = rate * nbytes / 1e9
    return out


def crossing(ds: FastDataset, batch: int, threads: int) -> dict[str, float]:
    """Bandwidth of each host-to-device copy of a batch from FastLoader's pinned ring (under
    CUDAPrefetcher) against a plain pinned ``non_blocking`` copy of the same bytes; both timed on the
    device by the profiler, copy by copy (the end-to-end rate also holds the host gather)."""
    nbytes = batch * math.prod(ds.sample_shape)
    pinned = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dev = torch.empty_like(pinned, device="cuda")
    pf = CUDAPrefetcher(FastLoader(ds, batch, num_threads=threads), device="cuda", dtype=torch.bfloat16)
    sum(len(x) for x, _ in pf)  # warm-up: ring, streams

    def copy_seconds(run: Callable[[], None]) -> float:
        sync()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            run()
            sync()
        spans = sorted(e.time_range.elapsed_us() for e in prof.events() if "Memcpy HtoD" in e.name)
        big = [t for t in spans if t >= spans[-1] / 2]  # the image copies, not the labels'
        return big[len(big) // 2] / 1e6

    loader = copy_seconds(lambda: [len(x) for x, _ in pf])
    plain = copy_seconds(lambda: [dev.copy_(pinned, non_blocking=True) for _ in range(16)])
    return {"loader_copy_gbs": nbytes / loader / 1e9, "plain_copy_gbs": nbytes / plain / 1e9,
            "h2d_ratio": plain / loader}


def host_memcpy(nbytes: int, threads: int, seconds: float) -> float:
    """GB/s of ``threads`` host threads each copying ``nbytes`` buffers (numpy, GIL released): the host's
    own limit for gathering batches."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    pairs = [(np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)) for _ in range(threads)]
    with ThreadPoolExecutor(threads) as pool:
        def once() -> int:
            list(pool.map(lambda p: np.copyto(p[1], p[0]), pairs))
            return threads * nbytes
        return timed_rate(once, seconds) / 1e9


def epoch_start_ms(ds: FastDataset, batch: int, threads: int) -> float:
    """Milliseconds from ``iter()`` to an epoch's first batch ready on the GPU (median of 3 epochs after one
    warm-up): the pipeline fills again at every epoch start."""
    pf = CUDAPrefetcher(FastLoader(ds, batch, num_threads=threads), device="cuda", dtype=torch.bfloat16)
    times = []
    for _ in range(4):
        sync()
        t0 = time.perf_counter()
        it = iter(pf)
        next(it)
        sync()
        times.append(1e3 * (time.perf_counter() - t0))
        sum(1 for _ in it)
    return sorted(times[1:])[1]


def prefetch_rate(ds: FastDataset, batch: int, threads: int, seconds: float, device: str) -> float:
    """Images/s through FastLoader + CUDAPrefetcher (bf16 normalise on the device), no model."""
    pf = CUDAPrefetcher(FastLoader(ds, batch, num_threads=threads), device=device, dtype=torch.bfloat16)
    return timed_rate(lambda: sum(len(x) for x, _ in pf), seconds)


def fit(model: torch.nn.Module, loader: Any, steps: int, device: str, **config: Any) -> list[dict[str, Any]]:
    """The Trainer's history of ``steps`` steps (bf16 on CUDA, channels_last), the bench's settings, from an
    epoch's start (a loader run before keeps its place in the epoch it is in: a start would fall mid-run)."""
    if hasattr(loader, "set_epoch"):
        loader.set_epoch(1)
        loader.set_epoch(0)
    cfg = TrainConfig(max_steps=steps, amp="bf16", lr=0.01, schedule="constant", device=device,
                      progress=False, val_every=0, **config)
    trainer = Trainer(model, loader, config=cfg)
    history = trainer.fit()
    trainer.close()
    return history


def train(model: torch.nn.Module, loader: Any, batch: int, steps: int, device: str) -> dict[str, float]:
    """``steps`` Trainer steps: images/s and the Trainer's data stall % (log_every: the default, as
    `fastdata train`)."""
    end = fit(model, loader, steps, device)[-1]
    return {"images_per_s": steps * batch / end["time_s"], "data_stall_pct": end["data_stall_pct"]}


def train_steady(model: torch.nn.Module, loader: Any, batch: int, warm: int, steps: int,
                 device: str) -> dict[str, float]:
    """One iteration of ``warm + steps`` Trainer steps (bf16 on CUDA, channels_last), logged every ``warm``
    steps: images/s and the Trainer's data stall % over the intervals after the first (steady state), and
    the seconds the first interval waited (the loader's start: a pipeline's build, its first batches)."""
    steps = max(warm, steps - steps % warm)
    logged = [r for r in fit(model, loader, warm + steps, device, log_every=warm) if r.get("event") == "train"]
    first, rest = logged[0], logged[1:]
    steps_in = [b["step"] - a["step"] for a, b in zip(logged, rest)]  # each later interval's steps
    seconds = [n * batch / r["samples_per_s"] for n, r in zip(steps_in, rest)]  # and its length
    first_s = first["step"] * batch / first["samples_per_s"]
    waited = sum(r["data_stall_pct"] / 100 * t for r, t in zip(rest, seconds))
    start_wait = first["data_stall_pct"] / 100 * first_s
    return {"images_per_s": sum(steps_in) * batch / sum(seconds),
            "data_stall_pct": 100 * waited / sum(seconds),
            "start_wait_s": start_wait,
            # the whole iteration, its start included: the first GPU round's method (comparable to its figures)
            "data_stall_pct_whole": 100 * (waited + start_wait) / (sum(seconds) + first_s)}


def steady_row(model: torch.nn.Module, loader: Any, batch: int, warm: int, steps: int, device: str, runs: int = 1,
               profile_steps: int = 0) -> dict[str, Any]:
    """A warm-up run (cudnn autotuning, the loader's threads), then ``runs`` runs of `train_steady`: their
    medians, each run's figures under ``<key>_runs``, and the training thread's profile (``profile_steps``)."""
    from gpu_profile import training_thread_profile

    fit(model, loader, warm, device)
    got = [train_steady(model, loader, batch, warm, steps, device) for _ in range(runs)]
    row: dict[str, Any] = {k: statistics.median(g[k] for g in got) for k in got[0]}
    row.update({f"{k}_runs": [g[k] for g in got] for k in ("images_per_s", "data_stall_pct", "data_stall_pct_whole")})
    if profile_steps > 0:
        row["profile"] = training_thread_profile(model, loader, profile_steps, device)
    return row


def ceiling(model_name: str, classes: int, batch: int, crop: int, device: str, seconds: float) -> float:
    """Images/s of one training step of ``model_name`` on synthetic data already on ``device`` (the ceiling)."""
    net = ModelStep(model_name, classes, torch.device(device))
    x = torch.randn(batch, 3, crop, crop, device=device).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, classes, (batch,), device=device)
    return timed_rate(lambda: (net.step(x, y), batch)[1], seconds)


def resident_batches(batch: int, crop: int, classes: int, device: str, n: int) -> list[tuple[torch.Tensor, ...]]:
    """``n`` times one normalised bf16 channels_last batch already on ``device``: the Trainer's own ceiling."""
    x = torch.randint(0, 256, (batch, 3, crop, crop), device=device, dtype=torch.uint8)
    y = torch.randint(0, classes, (batch,), device=device)
    return [(Normalize(dtype=torch.bfloat16)(x).contiguous(memory_format=torch.channels_last), y)] * n


def stall_rows(root: Path, files: list[Path], labels: list[int], model_name: str, crop: int, batch: int,
               steps: int, device: str, seconds: float, runs: int = 1, profile_steps: int = 0,
               plain: bool = True) -> dict[str, dict[str, Any]]:
    """The ceiling, fastdata and the plain recipe for one model, each after a warm-up run of its own, in steady
    state (steady_row); the headline rows (fastdata's, with run_ahead, the Trainer on resident batches) ``runs``
    times (``*_runs``: each run; the row's figures: their medians) and profiled on the training thread."""
    classes = max(labels) + 1
    warm = max(2, steps // 5)
    cores = os.cpu_count() or 1
    rows = {"synthetic on the GPU (ceiling)": {"images_per_s": ceiling(model_name, classes, batch, crop, device,
                                                                        seconds)}}
    aug = Compose([RandomResizedCrop(crop), RandomHorizontalFlip()])
    ds = in_shm(root)

    def fastdata(threads: int = min(8, cores), cuda_graphs: bool = True, run_ahead: bool = False) -> CUDAPrefetcher:
        return CUDAPrefetcher(FastLoader(ds, batch, num_threads=threads), device=device, dtype=torch.bfloat16,
                              transforms=aug, cuda_graphs=cuda_graphs, run_ahead=run_ahead)

    feeds: dict[str, Callable[[], Any]] = {FAST: fastdata, AHEAD: lambda: fastdata(run_ahead=True),
                                           EAGER: lambda: fastdata(cuda_graphs=False)}
    if plain:
        feeds[f"DataLoader + Pillow + .to(device) ({cores} workers)"] = lambda: torch.utils.data.DataLoader(
            PlainFolder(files, labels, crop), batch, shuffle=True, num_workers=cores,
            pin_memory=device == "cuda", persistent_workers=True, drop_last=True)
    resident = resident_batches(batch, crop, classes, device, warm + steps + 2)
    feeds = {RESIDENT: lambda: resident, **feeds}
    if model_name in ("resnet18", "cnn-small"):  # the fastest model: how loader threads share the host with the loop
        for threads in (2, 4):
            feeds[f"fastdata as above, {threads} loader threads"] = lambda threads=threads: fastdata(threads)
    for name, make in feeds.items():
        try:  # a row that fails is reported; the rows after it still run
            loader = make()
            headline = name in (FAST, AHEAD, RESIDENT)
            rows[name] = steady_row(create_model(model_name, num_classes=classes), loader, batch, warm, steps, device,
                                    runs if headline else 1, profile_steps if headline else 0)
            graphed = getattr(loader, "_graphed", None)
            if graphed is not None:  # whether the rows with graphs really replayed them (NOTE [graphed convert])
                rows[name].update(cuda_graphs=len(graphed.graphs), cuda_graph_failed=graphed.failed)
            del loader
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            rows[name] = {"error": f"{type(exc).__name__}: {exc}"}
    return rows


def gather_ratio(root: Path, batch: int) -> dict[str, float]:
    """``storage="cuda"`` gather bandwidth against a GPU-to-GPU copy of the same bytes (read + written)."""
    ds = FastDataset(root, storage="cuda", device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    picks = [torch.randint(0, len(ds), (batch,), device="cuda", generator=g).sort().values for _ in range(16)]
    k = iter(range(10 ** 9))
    gather = device_seconds(lambda: ds.get_batch(picks[next(k) % 16]), 64)
    nbytes = batch * math.prod(ds.sample_shape)
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy = device_seconds(lambda: dst.copy_(src), 64)
    loader = FastLoader(ds, batch)
    loader_rate = timed_rate(lambda: sum(len(x) for x, _ in loader), 3)
    return {"gather_gbs": 2 * nbytes / gather / 1e9, "copy_gbs": 2 * nbytes / copy / 1e9,
            "cuda_gather_ratio": copy / gather,
            "loader_gbs": 2 * loader_rate * nbytes / batch / 1e9}


def cifar_epoch(root: Path, device: str) -> dict[str, float]:
    """One epoch of ResNet-18 over a CIFAR-sized ``storage="cuda"`` dataset, crops + flips on the GPU: host
    to device copies and host syncs per step, counted."""
    from fastdata.imaging.transforms import RandomCrop

    ds = FastDataset(root, storage="cuda", device=device)
    loader = CUDAPrefetcher(FastLoader(ds, 512), device=device, dtype=torch.bfloat16,
                            transforms=Compose([RandomCrop(32, padding=4), RandomHorizontalFlip()]))
    model = create_model("resnet18", num_classes=10)
    train(model, loader, 512, 10, device)  # warm-up
    steps = len(loader)
    cfg = TrainConfig(epochs=1, amp="bf16", lr=0.01, schedule="constant", device=device, progress=False,
                      log_every=steps, val_every=0)
    trainer = Trainer(model, loader, config=cfg)
    sync()
    with warnings.catch_warnings(record=True) as caught, torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CUDA if device == "cuda" else
                        torch.profiler.ProfilerActivity.CPU]) as prof:
        warnings.simplefilter("always")
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
        try:
            t0 = time.perf_counter()
            end = trainer.fit()[-1]
            sync()
            seconds = time.perf_counter() - t0
        finally:
            if device == "cuda":
                torch.cuda.set_sync_debug_mode("default")
    trainer.close()
    h2d_copies = sum(1 for e in prof.events() if "Memcpy HtoD" in e.name)
    syncs = sum(1 for w in caught if "synchroniz" in str(w.message).lower())
    return {"samples": len(ds), "steps": steps, "images_per_s": len(ds) / seconds,
            "data_stall_pct": end["data_stall_pct"], "h2d_copies": h2d_copies, "h2d_per_step": h2d_copies / steps,
            "host_syncs": syncs, "host_syncs_per_step": syncs / steps}


def memory_flat(loader: Any, iters: int, device: str) -> dict[str, float]:
    """Memory after 100 and after ``iters`` batches of ``loader`` (epochs repeated): torch's allocated bytes,
    torch's peak (over the first 100, then over the rest), the device's memory in use (allocations outside
    torch, such as DALI's, included) and host RSS."""
    page = os.sysconf("SC_PAGE_SIZE")
    cuda = device == "cuda"

    def mark() -> dict[str, int]:
        sync()
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * page
        free, total = torch.cuda.mem_get_info() if cuda else (0, 0)
        return {"gpu_allocated": torch.cuda.memory_allocated() if cuda else 0,
                "gpu_max_allocated": torch.cuda.max_memory_allocated() if cuda else 0,
                "gpu_used": total - free, "rss": rss}

    seen, marks = 0, {}
    if cuda:
        torch.cuda.reset_peak_memory_stats()  # the peak of these batches, not of what ran before
    while seen < iters:
        for _ in loader:
            seen += 1
            if seen in (100, iters):
                marks[seen] = mark()
                if seen == 100 and cuda:
                    torch.cuda.reset_peak_memory_stats()
            if seen >= iters:
                break
    out: dict[str, float] = {"iterations": iters}
    for k in marks[100]:
        out[f"{k}_100"], out[f"{k}_end"] = marks[100][k], marks[iters][k]
    out["rss_growth_mb"] = (out["rss_end"] - out["rss_100"]) / 2 ** 20
    out["gpu_used_growth_mb"] = (out["gpu_used_end"] - out["gpu_used_100"]) / 2 ** 20
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=1024, help="distinct JPEGs; each model's dataset links to "
                    "them as often as an epoch longer than the measured steps needs (epochs of real datasets "
                    "are thousands of steps: an epoch start is timed on its own)")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--steps", type=int, default=60, help="measured Trainer steps per row")
    ap.add_argument("--cifar", type=int, default=50_000, help="samples of the storage='cuda' epoch")
    ap.add_argument("--json", type=Path, help="write every number here too")
    ap.add_argument("--smoke", action="store_true", help="every path on the CPU, small: checks the script")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)} "
                    "(a short GPU lease measures what changed)")
    ap.add_argument("--runs", type=int, default=1, help="runs of each headline figure: the median under its key, "
                    "each run in <key>_runs")
    ap.add_argument("--profile-steps", type=int, default=8, help="profiled steps of the training thread per "
                    "headline stall row (0: none)")
    ap.add_argument("--no-plain", action="store_true", help="skip the DataLoader + Pillow stall rows (the slowest)")
    ap.add_argument("--remote-steps", type=int, default=32, help="batches in the remote part's epoch")
    ap.add_argument("--lmdb-threads", type=int, default=0, help="loader threads of the lmdb part (0: every core)")
    args = ap.parse_args()
    from gpu_profile import show_profile

    if args.runs < 1:
        ap.error("--runs must be at least 1")
    parts = set(args.parts.split(","))
    if not parts <= set(PARTS):
        ap.error(f"--parts takes {','.join(PARTS)}, not {','.join(sorted(parts - set(PARTS)))}")
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: this benchmark measures GPU feeding and has nothing to measure here")
        return
    torch.backends.cudnn.benchmark = True
    m = machine()
    out: dict[str, Any] = {"device": m["gpu"], "machine": m}
    out["cuda"] = torch.version.cuda
    out["runs"] = args.runs
    print(f"fastdata {m['fastdata']}, torch {m['torch']}, {m['gpu']}, {m['cores']} cores, {m['date']}")

    failed: list[str] = []  # parts and rows that raised (the run goes on; it exits 1)

    def save() -> None:  # after every part: a run cut short keeps what it measured
        if args.json:
            args.json.write_text(json.dumps(out, indent=1))

    scratch = Path(tempfile.mkdtemp(prefix="fastdata-bench-gpu-"))
    try:
        classes = 8
        distinct = make_image_folder(scratch / "distinct", num_classes=classes,
                                     per_class=max(1, args.images // classes), sizes=((500, 375), (375, 500)))
        trees: dict[int, list[Path]] = {}
        warm = max(2, args.steps // 5)
        sides = {256} if parts & {"h2d", "gather", "memory"} else set()
        sides |= {side for _, side, _, _, _ in RUNS} if "stalls" in parts else set()
        for _, side, _, batch, _ in RUNS if sides else ():  # an epoch longer than the measured steps: steady state
            if side not in sides:
                continue
            repeat = max(1, -(-(warm + args.steps + 2) * (16 if args.smoke else batch) // len(distinct)))
            trees[side] = replicated(distinct, scratch / f"jpeg{side}", repeat)
            preprocess_images(ImagePreprocessConfig(src=scratch / f"jpeg{side}", out=scratch / f"s{side}",
                                                    size=side, progress=False))
        batch0 = next(b for _, side, _, b, _ in RUNS if side == 256)  # ResNet-50's batches of the 256 px set
        if device == "cuda" and "h2d" in parts:
            bw = h2d(batch0 * 256 * 256 * 3, args.seconds)
            rows = {}
            ds = in_shm(scratch / "s256")
            for threads in (4, 8, 16):
                rows[threads] = prefetch_rate(ds, batch0, threads, args.seconds / 2, device) * 256 * 256 * 3 / 1e9
            best = max(rows, key=rows.get)
            crosses = [crossing(ds, batch0, best) for _ in range(args.runs)]
            cross = {k: statistics.median(c[k] for c in crosses) for k in crosses[0]}
            cross["h2d_ratio_runs"] = [c["h2d_ratio"] for c in crosses]
            out.update(h2d_pinned_gbs=bw["pinned"], h2d_pageable_gbs=bw["pageable"], prefetch_gbs_by_threads=rows,
                       prefetch_end_to_end_ratio=rows[best] / bw["pinned"], h2d_threads=best,
                       host_memcpy_gbs=host_memcpy(batch0 * 256 * 256 * 3, best, args.seconds / 2), **cross)
            print(f"H2D of one batch ({batch0} x 256x256x3 uint8): pinned {bw['pinned']:.1f} GB/s, pageable "
                  f"{bw['pageable']:.1f} GB/s")
            print(f"  FastLoader's batches cross at {cross['loader_copy_gbs']:.1f} GB/s, a plain pinned copy at "
                  f"{cross['plain_copy_gbs']:.1f} GB/s (each copy's own time, profiler): {cross['h2d_ratio']:.2f}x "
                  f"(target >= 0.9; runs {', '.join(f'{r:.3f}' for r in cross['h2d_ratio_runs'])})")
            for threads, gbs in rows.items():
                print(f"  FastLoader({threads} threads) + CUDAPrefetcher, no model, end to end: {gbs:.1f} GB/s = "
                      f"{gbs / bw['pinned']:.2f}x pinned")
            print(f"  host memcpy, {best} threads, {batch0}-image batches: {out['host_memcpy_gbs']:.1f} GB/s (the "
                  f"gather's own limit here)")
            out["epoch_start_ms"] = epoch_start_ms(ds, batch0, best)
            print(f"  an epoch's first batch on the GPU: {out['epoch_start_ms']:.1f} ms after iter()")
            save()
        for name0, side, crop, batch, target in RUNS if "stalls" in parts else ():
            model_name, batch = ("cnn-small", 16) if args.smoke else (name0, batch)
            key = f"{name0}_{crop}"
            files = trees[side]
            labels = [int(f.parent.name.split("_")[1]) for f in files]
            rows = stall_rows(scratch / f"s{side}", files, labels, model_name, crop, batch, args.steps, device,
                              args.seconds, args.runs, args.profile_steps, not args.no_plain)
            ceiling = rows["synthetic on the GPU (ceiling)"]["images_per_s"]
            print(f"{model_name}@{crop}, batch {batch}, bf16, channels_last (data stall: the Trainer's own):")
            for name, r in rows.items():
                if "error" in r:
                    print(f"  {name:<66} FAILED: {r['error']}")
                    continue
                stall = f"  data stall {r['data_stall_pct']:5.2f}%" if "data_stall_pct" in r else ""
                if "data_stall_pct_whole" in r:
                    stall += f" (with the start {r['data_stall_pct_whole']:.2f}%)"
                if len(r.get("data_stall_pct_runs", ())) > 1:
                    stall += f" (runs {', '.join(f'{v:.2f}' for v in r['data_stall_pct_runs'])})"
                if "cuda_graphs" in r:
                    stall += f"  ({r['cuda_graphs']} CUDA graphs{', capture failed' if r['cuda_graph_failed'] else ''})"
                print(f"  {name:<66} {r['images_per_s']:>9,.0f} images/s {r['images_per_s'] / ceiling:>6.1%}"
                      f" of the ceiling{stall}")
                show_profile(r.get("profile"))
            plain = next((name for name in rows if name.startswith("DataLoader")), None)
            for row, to, runs_too in ((FAST, f"stall_pct_{key}", True), (RESIDENT, f"trainer_stall_pct_{key}", True),
                                      (AHEAD, f"stall_pct_{key}_run_ahead", True),
                                      (EAGER, f"stall_pct_{key}_no_cuda_graphs", False),
                                      (plain, f"dataloader_stall_pct_{key}", False)):
                r = rows.get(row, {})
                if "error" in r:
                    failed.append(to)
                if "data_stall_pct" not in r:
                    continue
                out[to] = r["data_stall_pct"]
                if runs_too:
                    out[f"{to}_runs"] = r["data_stall_pct_runs"]
                if row == FAST:  # the first round's method
                    out[f"{to}_whole"], out[f"{to}_whole_runs"] = (r["data_stall_pct_whole"],
                                                                   r["data_stall_pct_whole_runs"])
            out[f"rows_{key}"] = rows
            out["stall_method"] = (f"steady state: the Trainer's data_stall_pct over {args.steps} steps after the "
                                   f"first {warm} of one iteration; *_whole: over the whole iteration, its start "
                                   "included (the first GPU round's method)")
            print(f"  target: fastdata's stall <= {target:g}% (the Trainer on resident batches: "
                  f"{rows[RESIDENT].get('data_stall_pct', float('nan')):.2f}%)")
            save()
        if device == "cuda" and "gather" in parts:
            g = gather_ratio(scratch / "s256", batch0)
            out.update(g)
            print(f'storage="cuda": gather {g["gather_gbs"]:.0f} GB/s (read + written), GPU copy {g["copy_gbs"]:.0f}'
                  f' GB/s: {g["cuda_gather_ratio"]:.2f}x (target >= 0.5); through FastLoader {g["loader_gbs"]:.0f}'
                  f' GB/s')
            save()
        if (device == "cuda" or args.smoke) and "cifar" in parts:
            n = args.cifar
            make_image_folder(scratch / "cifar-src", num_classes=10, per_class=n // 10, sizes=((32, 32),))
            preprocess_images(ImagePreprocessConfig(src=scratch / "cifar-src", out=scratch / "cifar", size=32,
                                                    progress=False))
            c = cifar_epoch(scratch / "cifar", device)
            out["cifar"] = c
            print(f'CIFAR-sized epoch ({c["samples"]:,} x 32x32, storage="cuda", ResNet-18, batch 512, crop + flip'
                  f' on the GPU): {c["images_per_s"]:,.0f} images/s, stall {c["data_stall_pct"]:.1f}%, '
                  f'{c["h2d_per_step"]:.3f} host-to-device copies and {c["host_syncs_per_step"]:.3f} host syncs a '
                  f'step ({c["h2d_copies"]} and {c["host_syncs"]} in {c["steps"]} steps)')
            save()
        if (device == "cuda" or args.smoke) and "memory" in parts:
            pf = CUDAPrefetcher(FastLoader(in_shm(scratch / "s256"), 16 if args.smoke else batch0), device=device,
                                dtype=torch.bfloat16,
                                transforms=Compose([RandomResizedCrop(224), RandomHorizontalFlip()]))
            mem = memory_flat(pf, 200 if args.smoke else 1000, device)
            out["memory_prefetcher"] = mem
            print(f"{mem['iterations']:,} CUDAPrefetcher batches: GPU max allocated "
                  f"{mem['gpu_max_allocated_100'] / 2**20:,.0f} MiB after 100, "
                  f"{mem['gpu_max_allocated_end'] / 2**20:,.0f} MiB over 100-{mem['iterations']:,}; host RSS "
                  f"{mem['rss_100'] / 2**20:,.0f} -> {mem['rss_end'] / 2**20:,.0f} MiB")
            save()
        if parts & set(NEW_PARTS):
            import gpu_parts

            setup = gpu_parts.Setup(args, scratch, distinct, device)
            for name in NEW_PARTS:
                if name in parts:
                    try:  # a part that fails is reported; the parts after it still run
                        out.update(gpu_parts.PARTS[name](setup))
                    except Exception as exc:  # noqa: BLE001
                        traceback.print_exc()
                        failed.append(name)
                        out.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"
                    save()
    finally:
        drop_shm_copies(scratch)
        shutil.rmtree(scratch, ignore_errors=True)
    if failed:
        print(f"failed: {', '.join(failed)}")
        sys.exit(1)


if __name__ == "__main__":
    main()
