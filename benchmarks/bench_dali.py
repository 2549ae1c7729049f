"""Decoding the same JPEG LMDB three ways, in the same run: DALI, FastDataset's CPU path, DataLoader + Pillow.

Rows: DALILoader (nvJPEG on the GPU with device "mixed" when CUDA is there, DALI's CPU decoder otherwise),
FastLoader over FastDataset's LMDB CPU-decode path (Pillow with draft, all cores as threads), and a torch
DataLoader + Pillow over the original JPEG files (all cores as worker processes). Evaluation transforms
(shorter side to --size, centre crop), batch 64. On a GPU also training crops (random-resized-crop + flip:
DALI's own in nvJPEG's decode, FastDataset's at decode time on the CPU): images/s with no model, then
ResNet-50 (bf16, channels_last, batch --train-batch) fed by each through the Trainer, with the Trainer's own
data stall % over one iteration's steps after its first interval (the first interval, with the loader's
start, is given apart as seconds waited), beside the same model on synthetic data already on the GPU (the
ceiling); then GPU memory and host RSS over --memory-iters DALILoader batches (DALI's users report growth).
The DataLoader + Pillow recipe's stall is bench_gpu.py's. Also what DALILoader's feed costs the thread that
runs it (LMDB reads, JPEG headers, crop draws), ms a training batch, beside the same feed with the records
copied out of LMDB; and DALILoader's first batch after ``iter()``, new and after an abandoned iteration. On a
GPU the training rows are also given with every JPEG sent to the hardware JPEG decoder
(``hw_decoder_load=1``; DALI's default sends 65%, and decodes the rest with CUDA kernels beside the model),
with ``pipe.run`` on the training thread (``run_ahead=False``; a loader thread is the default on a GPU)
and with DALI's outputs synchronised with the host too (``stream_outputs=False``); ``--dali-threads``
repeats the DALI rows for several CPU thread counts, ``--feeds`` keeps some rows only. Also the training
crops with no model at each fixed ``hw_decoder_load`` of ``--hw-loads`` and with ``"auto"`` (after its
trial), same data, same run: auto's images/s over the best fixed load's (``--feeds dali_auto`` for these
rows alone, with auto's memory over --memory-iters batches). Then a short
profile of each DALI-fed run: host time in ``pipe.run`` (or the training thread's wait for the loader
thread), kernel time on the model's stream and on DALI's, CUDA calls that wait for the device.

    python benchmarks/bench_dali.py [--images 1024] [--size 224] [--device auto] [--json out.json]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any, Iterator

import torch

import fastdata
from fastdata.cli.synthetic import make_image_folder
from fastdata.datasets.images import FastDataset
from fastdata.distributed import resolve_device
from fastdata.gpu.prefetch import CUDAPrefetcher
from fastdata.loading.loader import FastLoader
from fastdata.preprocess.images import ImagePreprocessConfig, preprocess_images
from fastdata.train.models import create_model

sys.path.insert(0, str(Path(__file__).parent))
from bench_loader import PillowFolder, rate  # noqa: E402  (shared baseline and timing)


def main() -> None:
    from fastdata.dali import DALILoader

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=1024)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--train-batch", type=int, default=256)
    ap.add_argument("--train-seconds", type=float, default=20.0, help="seconds of the synthetic-data ceiling")
    ap.add_argument("--train-steps", type=int, default=60, help="measured Trainer steps per feed")
    ap.add_argument("--memory-iters", type=int, default=1000)
    ap.add_argument("--profile-steps", type=int, default=12, help="profiled ResNet-50 steps per DALI feed: where "
                    "its steps wait (0: none)")
    ap.add_argument("--dali-threads", default="4", help="DALI's CPU threads in the training rows, comma-separated: "
                    "every DALI training row for each (the first as the main rows); 4 is DALILoader's default")
    ap.add_argument("--feeds", default="", help="only these training rows, comma-separated (dali, dali_hw, dali_here, "
                    "dali_host_sync, fastdata, dali_auto: the --hw-loads rows); all where empty")
    ap.add_argument("--hw-loads", default="0,0.5,0.65,0.9,1", help="the fixed hw_decoder_load rows beside "
                    "hw_decoder_load='auto' (training crops, no model), comma-separated")
    ap.add_argument("--hw-rounds", type=int, default=1, help="rounds of the --hw-loads rows, each row's best kept")
    ap.add_argument("--no-eval", action="store_true", help="skip the evaluation-transform rows (training rows only)")
    ap.add_argument("--json", type=Path, help="write every number here too")
    ap.add_argument("--smoke", action="store_true", help="the training rows on the CPU too: checks the script")
    args = ap.parse_args()
    if 0 < args.memory_iters < 100:  # memory is compared after 100 batches and at the end
        ap.error("--memory-iters must be 0 (no memory rows) or at least 100")
    try:
        args.hw_loads = [float(v) for v in args.hw_loads.split(",")]
    except ValueError:
        ap.error(f"--hw-loads takes numbers in [0, 1], comma-separated, got {args.hw_loads!r}")
    if args.hw_rounds < 1:
        ap.error(f"--hw-rounds must be at least 1, got {args.hw_rounds}")
    device = resolve_device(args.device).type
    scratch = Path(tempfile.mkdtemp(prefix="fastdata-bench-dali-"))
    try:
        files = make_image_folder(scratch / "jpeg", num_classes=8, per_class=args.images // 8,
                                  sizes=((500, 375), (375, 500)))
        preprocess_images(ImagePreprocessConfig(src=scratch / "jpeg", out=scratch / "lmdb", size=256, format="lmdb",
                                                progress=False))
        cores = os.cpu_count() or 1
        print(f"fastdata {fastdata.__version__}, torch {torch.__version__}, {cores} cores, device {device}, "
              f"{len(files)} JPEGs 500x375 stored at shorter side 256, output {args.size}px, batch 64")
        # first, with no other loader's threads about: the feed is timed on this thread alone
        feed, copied = feed_ms(DALILoader(scratch / "lmdb", args.train_batch, size=args.size, train=True,
                                          device=device))
        print(f"DALILoader's feed on the training step's thread, batch {args.train_batch}: {feed:.2f} ms a batch; "
              f"with the records copied out of LMDB {copied:.2f} ms ({copied / feed:.2f}x)")
        out = {"device": torch.cuda.get_device_name() if device == "cuda" else device,
               "dali": __import__("nvidia.dali", fromlist=["__version__"]).__version__, "torch": torch.__version__,
               "cores": cores, "dali_feed_ms_per_batch": feed,
               "dali_feed_ms_per_batch_copied": copied}
        if not args.no_eval:
            out["eval_images_per_s"] = eval_rates(scratch, files, args, device, cores)
        if device == "cuda" or args.smoke:
            out.update(training_rates(scratch, files, args, device))
            out["dali_stall_pct_resnet50_224"] = out.get(f"dali_stall_pct_resnet50_{args.size}")
        if args.json:
            args.json.write_text(json.dumps(out, indent=1))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def eval_rates(scratch: Path, files: list[Path], args: argparse.Namespace, device: str, cores: int) -> dict[str, float]:
    """Evaluation transforms, batch 64: DALI, FastDataset's CPU decode and DataLoader + Pillow, images/s."""
    from fastdata.dali import DALILoader

    dali = DALILoader(scratch / "lmdb", 64, size=args.size, train=False, device=device, num_threads=cores)
    native = FastLoader(FastDataset(scratch / "lmdb", size=args.size), 64, num_threads=cores)
    labels = [0] * len(files)
    plain = lambda: torch.utils.data.DataLoader(PillowFolder(files, labels, args.size), 64,  # noqa: E731
                                                 shuffle=True, num_workers=cores)
    rows = {f"DALI ({'mixed GPU' if device == 'cuda' else 'CPU'} decode)": rate(lambda: dali, args.seconds),
            f"FastDataset LMDB CPU decode, {cores} threads": rate(lambda: native, args.seconds),
            f"DataLoader + Pillow over the JPEG files, {cores} workers": rate(plain, args.seconds)}
    with every_loader_thread_on_all_cores():  # NOTE [intra-op threads per loader thread], as before it
        rows[f"  the same FastDataset, each thread with torch's {torch.get_num_threads()} intra-op threads"] = rate(
            lambda: native, args.seconds)
    for name, r in rows.items():
        print(f"{name:<70} {r:>8,.0f} images/s")
    base = list(rows.values())[2]
    print(f"vs DataLoader + Pillow: DALI {list(rows.values())[0] / base:.2f}x, FastDataset CPU decode "
          f"{list(rows.values())[1] / base:.2f}x")
    return rows


@contextlib.contextmanager
def every_loader_thread_on_all_cores() -> Iterator[None]:
    """FastLoader's threads as before 2026-11-26: each with torch's process-wide intra-op thread count."""
    import fastdata.loading.loader as loader_module

    share = loader_module.limit_intraop_threads
    loader_module.limit_intraop_threads = lambda n: False
    try:
        yield
    finally:
        loader_module.limit_intraop_threads = share


def where_it_waits(model: torch.nn.Module, loader: Any, batch: int, steps: int, device: str) -> dict[str, float]:
    """A profiled run of ``steps`` more Trainer steps of ``model`` fed by ``loader`` (both warm: the row just
    measured): host ms a step inside DALILoader's ``pipe.run`` and its feed (``record_function`` names in
    fastdata/gpu/dali.py), and on the device the kernel ms a step on the stream that runs most (the model's) and
    on all others (DALI's), with how busy the model's stream was over the window (its gaps are what the data
    stall measures)."""
    from bench_gpu import train

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with tempfile.TemporaryDirectory() as tmp:
        with torch.profiler.profile(activities=activities) as prof:
            train(model, loader, batch, steps, device)
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    host = {name: sum(e["dur"] for e in events if e["name"] == name) / 1e3 / steps
            for name in ("fastdata.dali.run", "fastdata.dali.feed", "fastdata.run_ahead.wait")}
    syncs: dict[str, float] = {}  # CUDA runtime calls that wait for the device (any thread), ms a step
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and ("Synchronize" in e["name"] or e["name"] in (
                "cudaFree", "cudaMalloc", "cudaFreeHost", "cudaHostAlloc", "cuMemFree_v2", "cuMemAlloc_v2")):
            syncs[e["name"]] = syncs.get(e["name"], 0.0) + e["dur"] / 1e3 / steps
    spans: dict[Any, list[tuple[float, float]]] = {}
    for e in events:
        if e.get("cat") == "kernel":
            spans.setdefault(e.get("args", {}).get("stream"), []).append((e["ts"], e["ts"] + e["dur"]))
    total = {stream: sum(b - a for a, b in s) for stream, s in spans.items()}
    model_stream = max(total, key=total.get, default=None)
    busy, window, restart = 0.0, 1e-9, 0.0
    if model_stream is not None:
        merged: list[list[float]] = []
        for a, b in sorted(spans[model_stream]):
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        busy, window = sum(b - a for a, b in merged), merged[-1][1] - merged[0][0]
        gaps = [b[0] - a[1] for a, b in zip(merged, merged[1:])]
        restart = max(gaps, default=0.0)
        if restart > 100e3:  # the profiled run's first batch (DALI's batches in flight run out, the queue filled)
            window -= restart
        else:
            restart = 0.0
    return {"run_ms": host["fastdata.dali.run"], "feed_ms": host["fastdata.dali.feed"],
            "wait_ms": host["fastdata.run_ahead.wait"],
            "model_kernel_ms": total.get(model_stream, 0.0) / 1e3 / steps,
            "other_kernel_ms": sum(v for k, v in total.items() if k != model_stream) / 1e3 / steps,
            "model_busy_pct": 100 * busy / window if model_stream is not None else 0.0,
            "restart_ms": restart / 1e3 if model_stream is not None else 0.0, "sync_ms": syncs}


def first_batch_ms(make: Any, device: str) -> tuple[float, float]:
    """Ms from ``iter()`` to the first batch on the device: of a new loader (DALI builds its pipeline), then
    of the same loader iterated again after an iteration left after 5 batches (its pipeline reused:
    DALILoader._drain)."""
    def first(loader: Any) -> tuple[float, Any]:
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        sync()
        start = time.perf_counter()
        it = iter(loader)
        next(it)
        sync()
        return 1e3 * (time.perf_counter() - start), it

    loader = make()
    new, it = first(loader)
    for _ in range(4):
        next(it)
    del it  # left unfinished
    again, it = first(loader)
    return new, again


def feed_ms(loader: Any, epochs: int = 5) -> tuple[float, float]:
    """Median ms of ``loader._next_batch`` (what DALI calls on the thread that runs ``pipe.run()``: LMDB
    reads, JPEG headers, crop draws) over ``epochs`` epochs, then the same with each batch's records copied
    into ``bytes`` (``reader.get_many``) instead of viewed in the memory map. Reaches into the loader on
    purpose: the feed is timed without DALI's decode around it."""
    def median() -> float:
        times = []
        for _ in range(epochs):
            loader._feed, loader._fed = loader._plan(), deque()
            while True:
                start = time.perf_counter()
                try:
                    loader._next_batch()
                except StopIteration:
                    break
                times.append(time.perf_counter() - start)
        times.sort()
        return 1e3 * times[len(times) // 2]
    median()  # warm: page cache, first imports
    viewed = median()
    reader = loader.reader
    reader.views = lambda rows: contextlib.nullcontext(reader.get_many(rows))  # type: ignore[method-assign]
    try:
        return viewed, median()
    finally:
        del reader.views


def training_rates(scratch: Path, files: list[Path], args: argparse.Namespace, device: str = "cuda") -> dict[str, Any]:
    """Training crops at ``--size``: images/s of DALI and of FastDataset's decode-time crops with no model,
    then ResNet-50 (bf16, channels_last, batch ``--train-batch``) fed by each through the Trainer (its own
    ``data_stall_pct``), beside the same model on synthetic data on ``device`` (the ceiling); then GPU memory
    and host RSS over ``--memory-iters`` DALI batches."""
    from bench_gpu import ceiling as model_ceiling, memory_flat, replicated, train_steady

    from fastdata.dali import DALILoader

    torch.backends.cudnn.benchmark = True
    b, size, cores = args.train_batch, args.size, os.cpu_count() or 1
    # an epoch longer than the measured steps (links to the same JPEGs): steady state, as real epochs
    warm = max(2, args.train_steps // 5)  # steps logged apart: the Trainer's first interval
    steps = args.train_steps + warm + args.profile_steps + 2  # warm-up, rows, profile
    repeat = max(1, -(-steps * b // len(files)))
    replicated(files, scratch / "train-jpeg", repeat)
    preprocess_images(ImagePreprocessConfig(src=scratch / "train-jpeg", out=scratch / "train", size=256,
                                            format="lmdb", progress=False))
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # the model autocasts to bf16 on CUDA only

    threads = [int(t) for t in args.dali_threads.split(",")]

    def dali(t: int, **kw: Any) -> Any:
        return lambda: DALILoader(scratch / "train", b, size=size, train=True, dtype=dtype, num_threads=t,
                                  device=device, **kw)

    kind = "nvJPEG mixed decode, crops in the decoder" if device == "cuda" else "CPU"
    wanted = set(args.feeds.split(",")) if args.feeds else None
    feeds: dict[str, Any] = {}
    names: dict[str, str] = {}

    def add(key: str, row: str, make: Any, name: str) -> None:  # row: the --feeds name of this key's row
        if wanted is None or row in wanted:
            feeds[key], names[key] = make, name

    for i, t in enumerate(threads):  # the first thread count gives the main rows' keys; the others a suffix
        sfx = "" if i == 0 else f"_t{t}"
        add(f"dali{sfx}", "dali", dali(t), f"DALI ({kind}, {t} CPU threads)")
        if device == "cuda":
            add(f"dali_hw{sfx}", "dali_hw", dali(t, hw_decoder_load=1.0),
                f"DALI as above, {t} CPU threads, every JPEG to the hardware decoder")
    if device == "cuda":
        add("dali_here", "dali_here", dali(threads[0], run_ahead=False),
            f"DALI ({threads[0]} CPU threads), pipe.run on the training thread (run_ahead=False)")
        add("dali_host_sync", "dali_host_sync", dali(threads[0], run_ahead=False, stream_outputs=False),
            f"DALI ({threads[0]} CPU threads), as above, outputs synchronised with the host (stream_outputs=False)")
    add("fastdata", "fastdata", lambda: CUDAPrefetcher(FastLoader(FastDataset(scratch / "train", size=size,
                                                                              crop="random"), b, num_threads=cores),
                                                       device, dtype=dtype),
        f"FastDataset LMDB CPU decode, crops at decode time ({cores} threads)")
    out: dict[str, Any] = {}
    gpu = torch.cuda.get_device_name() if device == "cuda" else device
    print(f"training crops at {size}, batch {b}, no model, {gpu}:")
    for key, make in feeds.items():
        r = rate(lambda it=make(): it, args.seconds)
        out[f"{key}_images_per_s"] = r
        print(f"  {names[key]:<80} {r:>8,.0f} images/s")
    if wanted is None or "dali_auto" in wanted:
        out.update(hw_load_rates(lambda load: dali(threads[0], hw_decoder_load=load)(), args, device))
    if not feeds:  # the hw_decoder_load rows alone
        return out
    ceiling = model_ceiling("resnet50", 8, b, size, device, args.train_seconds)
    out["ceiling_resnet50_images_per_s"] = ceiling
    print(f"ResNet-50@{size}, batch {b}, bf16 autocast, channels_last, {gpu} (data stall: the Trainer's own, over "
          f"the {args.train_steps - args.train_steps % warm} steps after the first {warm} of one iteration):")
    print(f"  {'synthetic data on the GPU (ceiling)':<80} {ceiling:>8,.0f} images/s")
    profiled = []
    for key, make in feeds.items():
        model, loader = create_model("resnet50", num_classes=8), make()
        # the first `warm` steps (cudnn, DALI's pipeline build) apart; the stall of the steps after them
        r = train_steady(model, loader, b, warm, args.train_steps, device)
        out[f"{key}_train_images_per_s"] = r["images_per_s"]
        out[f"{key}_stall_pct_resnet50_{size}"] = r["data_stall_pct"]
        out[f"{key}_start_wait_s"] = r["start_wait_s"]
        thread = ""
        if getattr(loader, "loader_thread_batches", 0):  # DALILoader with run_ahead: its thread's own time
            out[f"{key}_loader_thread_ms"] = ms = 1e3 * loader.loader_thread_s / loader.loader_thread_batches
            thread = f"; its loader thread {ms:.1f} ms a batch"
        print(f"  {names[key]:<80} {r['images_per_s']:>8,.0f} images/s  {r['images_per_s'] / ceiling:>6.1%} of the "
              f"ceiling, data stall {r['data_stall_pct']:.1f}% (first {warm} steps waited {r['start_wait_s']:.2f} s"
              f"{thread})")
        if args.profile_steps > 0 and key.startswith("dali"):  # the same model and loader, a few steps more
            out[f"{key}_profile"] = where_it_waits(model, loader, b, args.profile_steps, device)
            profiled.append(key)
    if "dali" in feeds:
        new, again = first_batch_ms(feeds["dali"], device)
        out["dali_first_batch_ms"], out["dali_first_batch_again_ms"] = new, again
        print(f"DALILoader's first batch after iter(): {new:,.0f} ms new (its pipeline built), {again:,.0f} ms "
              "when iterated again after an iteration left unfinished (the pipeline run out and reused)")
    if profiled:
        print(f"where the DALI-fed steps wait ({args.profile_steps} profiled steps each, after each row's own; the "
              f"profiler's own cost inflates host times):")
        for key in profiled:
            w = out[f"{key}_profile"]
            host = (f"host in pipe.run {w['run_ms']:.1f} ms a step (the feed {w['feed_ms']:.1f} ms of it)"
                    if w["run_ms"] > 0 else "pipe.run on the loader thread (the profiler sees the training "
                    f"thread only), the training thread waiting for it {w['wait_ms']:.1f} ms a step")
            print(f"  {names[key]}:\n    {host}; the model's stream busy {w['model_busy_pct']:.0f}% of the "
                  f"window (less a {w['restart_ms']:.0f} ms wait for the restarted iteration's first batch), its "
                  f"kernels {w['model_kernel_ms']:.1f} ms a step; kernels on other streams "
                  f"{w['other_kernel_ms']:.1f} ms a step")
            waits = ", ".join(f"{k} {v:.1f}" for k, v in sorted(w["sync_ms"].items(), key=lambda kv: -kv[1])
                              if v >= 0.05)
            print(f"    calls that wait for the device, ms a step (all threads): {waits or 'none over 0.05 ms'}")
    if args.memory_iters <= 0 or "dali" not in feeds:
        return out
    out["dali_memory"] = memory_flat(feeds["dali"](), args.memory_iters, device)
    print_memory("DALILoader", out["dali_memory"])
    return out


def print_memory(name: str, mem: dict[str, float]) -> None:
    """One line of `memory_flat`'s figures."""
    print(f"{mem['iterations']:,} {name} batches: GPU memory in use {mem['gpu_used_100'] / 2**20:,.0f} -> "
          f"{mem['gpu_used_end'] / 2**20:,.0f} MiB (device-wide: DALI allocates outside torch), torch max allocated "
          f"{mem['gpu_max_allocated_100'] / 2**20:,.0f} -> {mem['gpu_max_allocated_end'] / 2**20:,.0f} MiB, "
          f"host RSS {mem['rss_100'] / 2**20:,.0f} -> {mem['rss_end'] / 2**20:,.0f} MiB")


def hw_load_rates(make: Any, args: argparse.Namespace, device: str) -> dict[str, Any]:
    """Training crops, no model, images/s of ``make(load)`` (a DALILoader) at each fixed load of ``--hw-loads``
    and with ``"auto"``, whose epochs first run until its trial is over (NOTE [hw_decoder_load auto]): its
    figure is that of the load it chose, against the best fixed one of the same run. Each row is the best
    of ``--hw-rounds`` rounds, every other one in reverse order (drift spread over the rows). Then auto's
    memory over ``--memory-iters`` batches (the trial's pipelines dropped)."""
    from bench_gpu import memory_flat

    loaders = {load: make(load) for load in [*args.hw_loads, "auto"]}
    auto = loaders["auto"]
    trial = auto.hw_decoder_load_trial  # None on the CPU: DALI's default, nothing measured
    start, served, images = time.perf_counter(), 0, 0
    for _ in range(100):  # whole epochs: the trial (a few seconds) may span several short ones
        if trial is None or trial.done:
            break
        for x, _ in auto:
            served, images = served + 1, images + len(x)
    trial_s = time.perf_counter() - start
    rates: dict[Any, float] = {}
    for i in range(args.hw_rounds):
        for load in list(loaders)[::-1 if i % 2 else 1]:
            rates[load] = max(rates.get(load, 0.0), rate(lambda it=loaders[load]: it, args.seconds))
    r = rates.pop("auto")
    for load, v in rates.items():
        print(f"  {f'DALI, hw_decoder_load={load:g}':<80} {v:>8,.0f} images/s")
    best = max(rates, key=rates.get)
    ratio, chosen = r / rates[best], auto.hw_decoder_load_chosen
    figures = {} if trial is None else {f"{k:g}": v for k, v in trial.seconds_per_batch.items()}
    measured = ", ".join(f"{k} {1e3 * v:.1f}" for k, v in figures.items()) or "none (no trial on the CPU)"
    print(f"  {'DALI, hw_decoder_load=auto, after its trial':<80} {r:>8,.0f} images/s  chose {chosen}; "
          f"{ratio:.3f}x the best fixed load ({best:g}; rows: best of {args.hw_rounds} rounds)")
    print(f"    the trial's ms a batch by load: {measured}; the epochs that held it: {trial_s:.1f} s, {served} "
          f"batches, {images / max(trial_s, 1e-9):,.0f} images/s (pipelines built and switched)")
    out: dict[str, Any] = {
        "dali_hw_load_images_per_s": {f"{k:g}": v for k, v in rates.items()}, "dali_auto_images_per_s": r,
        "dali_auto_chosen": chosen, "dali_auto_best_fixed": best, "dali_auto_vs_best": ratio,
        "dali_auto_trial_s_per_batch": figures, "dali_auto_trial_epochs_s": trial_s,
        "dali_auto_trial_epochs_batches": served, "dali_auto_trial_epochs_images_per_s": images / max(trial_s, 1e-9)}
    del loaders  # the fixed loads' pipelines go before the memory row
    if args.memory_iters > 0:
        out["dali_auto_memory"] = memory_flat(auto, args.memory_iters, device)
        print_memory("DALILoader (hw_decoder_load=auto)", out["dali_auto_memory"])
    return out

if __name__ == "__main__":
    main()
