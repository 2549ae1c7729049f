"""bench_gpu.py's parts of GPU issue 40: LMDB CPU decode into ResNet-50, its thread scaling, a 3-source Mixture, a
dataset streamed from a loopback S3 server; and the training thread's profile that every stall row gives.

Each part repeats its headline figures ``--runs`` times: the median under the key, every run in ``<key>_runs``.
Stalls are the Trainer's own ``data_stall_pct`` over the steps after the first ``warm`` of one iteration (the
first interval, with the loader's start, is given apart as ``start_wait_s``; bench_gpu.train_steady).
"""
from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from bench_gpu import ceiling, fit, in_shm, replicated, resident_batches, steady_row, train_steady
from bench_remote import moto_server
from fastdata.datasets.images import FastDataset
from fastdata.datasets.mixture import Mixture
from fastdata.gpu.prefetch import CUDAPrefetcher
from fastdata.imaging.transforms import Compose, RandomHorizontalFlip, RandomResizedCrop
from fastdata.loading.loader import FastLoader
from fastdata.preprocess.images import ImagePreprocessConfig, preprocess_images
from fastdata.train.models import create_model
from gpu_profile import show_profile

CROP, STORED = 224, 256  # ResNet-50's crop, and the stored side of every dataset here
SCALING_THREADS = (1, 2, 4, 8, 16)


def put_runs(out: dict[str, Any], key: str, values: list[float]) -> None:
    """``out[key]`` = the median of ``values``, ``out[key + "_runs"]`` = every run's value."""
    out[key], out[f"{key}_runs"] = statistics.median(values), list(values)


def spread(values: list[float]) -> str:
    """``median (min-max, n runs)`` for a printed line."""
    med = statistics.median(values)
    return f"{med:,.2f}" if len(values) == 1 else f"{med:,.2f} ({min(values):,.2f}-{max(values):,.2f}, {len(values)} runs)"


class Setup:
    """What every part shares: the run's options, the scratch folder, the distinct JPEGs, the model and batch
    (``cnn-small`` and batch 16 under ``--smoke``), and the datasets built so far (each built once, on demand)."""

    def __init__(self, args: Any, scratch: Path, distinct: list[Path], device: str) -> None:
        self.args, self.scratch, self.distinct, self.device = args, scratch, distinct, device
        self.model, self.batch = ("cnn-small", 16) if args.smoke else ("resnet50", 256)
        self.warm = max(2, args.steps // 5)  # the Trainer's first interval, logged apart
        self.steps = args.steps
        self.cores = os.cpu_count() or 1
        self.threads = (1, 2) if args.smoke else SCALING_THREADS
        self._built: dict[str, Path] = {}

    def batches_needed(self) -> int:
        """Batches in an epoch long enough for one measured iteration (warm + steps) and the scaling window."""
        return max(self.warm + self.steps + 2, 6 * max(self.threads))

    def tree(self, name: str, images: int) -> list[Path]:
        """An ImageFolder of at least ``images`` hard links to the distinct JPEGs."""
        return replicated(self.distinct, self.scratch / name, max(1, -(-images // len(self.distinct))))

    def lmdb(self) -> Path:
        """A JPEG LMDB (shorter side 256) of an epoch of ``batches_needed`` batches."""
        if "lmdb" not in self._built:
            self.tree("jpeg-lmdb", self.batches_needed() * self.batch)
            out = self.scratch / "lmdb"
            preprocess_images(ImagePreprocessConfig(src=self.scratch / "jpeg-lmdb", out=out, size=STORED,
                                                    format="lmdb", progress=False))
            self._built["lmdb"] = out
        return self._built["lmdb"]

    def npy(self, name: str, images: int, shard_size: int = 1024) -> Path:
        """An npy dataset (256 x 256) of at least ``images`` samples."""
        if name not in self._built:
            self.tree(f"jpeg-{name}", images)
            preprocess_images(ImagePreprocessConfig(src=self.scratch / f"jpeg-{name}", out=self.scratch / name,
                                                    size=STORED, shard_size=shard_size, progress=False))
            self._built[name] = self.scratch / name
        return self._built[name]

    def resident_row(self) -> dict[str, float]:
        """The Trainer on batches already on the device (the loop's own ceiling) and a synthetic-data step."""
        batches = resident_batches(self.batch, CROP, 8, self.device, self.warm + self.steps + 2)
        model = create_model(self.model, num_classes=8)
        r = train_steady(model, batches, self.batch, self.warm, self.steps, self.device)
        r["synthetic_images_per_s"] = ceiling(self.model, 8, self.batch, CROP, self.device, self.args.seconds / 2)
        return r

    def stall_runs(self, name: str, make: Callable[[], Any]) -> dict[str, Any]:
        """``--runs`` steady-state Trainer runs of the model fed by one ``make()`` loader (a warm-up run first:
        cudnn autotuning, the loader's threads), then the training thread's profile (``--profile-steps``)."""
        row = steady_row(create_model(self.model, num_classes=8), make(), self.batch, self.warm, self.steps,
                         self.device, self.args.runs, self.args.profile_steps)
        print(f"  {name:<72} {row['images_per_s']:>8,.0f} images/s, data stall {spread(row['data_stall_pct_runs'])}%"
              f" (first {self.warm} steps waited {row['start_wait_s']:.2f} s)")
        show_profile(row.get("profile"))
        return row


# -- lmdb: CPU decode with decode-time crops into ResNet-50 ---------------------------------------------------
def decoded(root: Path, batch: int, threads: int) -> FastLoader:
    """FastLoader over the LMDB's decode-time training crops (random-resized crop + flip, 224 px)."""
    return FastLoader(FastDataset(root, size=CROP, crop="random"), batch, num_threads=threads)


def task_cpu() -> dict[int, float]:
    """CPU seconds of each live thread of this process (/proc/self/task; empty where there is none)."""
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return out
    for task in tasks:
        try:
            fields = Path(f"/proc/self/task/{task}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # (ended meanwhile)
            continue
        out[int(task)] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return out


def window_rate(loader: Iterable[Any], seconds: float, threads: int) -> tuple[float, dict[str, float]]:
    """Images/s of ``loader`` inside one epoch: counted after the first ``threads + 2`` batches (the pipeline
    full) until ``seconds`` pass or ``threads`` batches are left (an epoch's end idles threads). Also, over that
    window: the process's CPU ms an image, cores busy, voluntary context switches an image (a thread that slept:
    mostly GIL waits), and the share of the window each other thread that ran was busy (median, least)."""
    total = len(loader)  # type: ignore[arg-type]
    it = iter(loader)
    for _ in range(threads + 2):
        next(it)
    n, k = 0, threads + 2
    c0, r0, t0 = task_cpu(), resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for x, _ in it:
        n, k = n + len(x), k + 1
        if time.perf_counter() - t0 >= seconds or total - k <= threads:
            break
    wall, r1, c1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF), task_cpu()
    del it
    cpu = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
    me = threading.get_native_id()
    busy = sorted((c1[t] - c0[t]) / wall for t in c1 if t in c0 and t != me and c1[t] > c0[t]) or [0.0]
    return n / wall, {"cpu_ms_per_image": 1e3 * cpu / max(n, 1), "busy_cores": cpu / wall,
                      "sleeps_per_image": (r1.ru_nvcsw - r0.ru_nvcsw) / max(n, 1),
                      "thread_busy_median": statistics.median(busy), "thread_busy_min": busy[0],
                      "threads_seen": float(len(busy)), "images": n, "seconds": wall}


def lmdb_part(s: Setup) -> dict[str, Any]:
    """LMDB CPU decode (``--lmdb-threads`` loader threads, default every core) alone, then feeding ResNet-50@224
    through CUDAPrefetcher."""
    root, out, threads = s.lmdb(), {}, s.args.lmdb_threads or s.cores
    print(f"LMDB CPU decode, training crops at decode time ({threads} threads), batch {s.batch}, "
          f"{len(FastDataset(root)):,} records at shorter side {STORED}:")
    rates = [window_rate(decoded(root, s.batch, threads), s.args.seconds, threads)[0] for _ in range(s.args.runs)]
    put_runs(out, "lmdb_images_per_s", rates)
    print(f"  decode alone: {spread(rates)} images/s")
    res = s.resident_row()
    out["lmdb_ceiling"] = res
    print(f"  {s.model}@{CROP}: synthetic {res['synthetic_images_per_s']:,.0f} images/s; the Trainer on resident "
          f"batches {res['images_per_s']:,.0f} images/s, stall {res['data_stall_pct']:.2f}%")
    dtype = torch.bfloat16
    row = s.stall_runs("FastDataset LMDB CPU decode + CUDAPrefetcher",
                       lambda: CUDAPrefetcher(decoded(root, s.batch, threads), s.device, dtype=dtype))
    out["lmdb_row"], out["lmdb_threads"] = row, threads
    put_runs(out, "lmdb_stall_pct_resnet50_224", row["data_stall_pct_runs"])
    print("  target: stall <= 1%")
    return out


# -- scaling: the decode alone at 1 .. 16 threads -------------------------------------------------------------
def physical_cores() -> int:
    """Distinct (package, core) pairs in /proc/cpuinfo (0 where it does not say)."""
    try:
        pairs, phys = set(), None
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("physical id"):
                phys = line.split(":")[1].strip()
            elif line.startswith("core id"):
                pairs.add((phys, line.split(":")[1].strip()))
        return len(pairs)
    except OSError:
        return 0


PROCESS = """
import sys, time
import torch
from fastdata.datasets.images import FastDataset
from fastdata.loading.loader import FastLoader
path, batch, start, seconds, seed = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
torch.set_num_threads(1)  # as bench_jpeg.py's processes: no intra-op pool spinning beside the loader's thread
# one thread, no batch ahead: after the first batch taken past `start`, each arrival is one batch's decode
it = iter(FastLoader(FastDataset(path, size=%d, crop="random"), batch, num_threads=1, prefetch=0, seed=seed,
                     pin_memory=False))  # no CUDA context in each of the processes
next(it)
time.sleep(max(0.0, start - time.time()))
late = max(0.0, time.time() - start)
next(it)
first, n = time.time(), 0
for x, _ in it:
    n, last = n + len(x), time.time()
    if last >= start + seconds:
        break
print(n / (last - first), late)
""" % CROP


def processes_rate(root: Path, batch: int, processes: int, seconds: float) -> float:
    """Images/s of ``processes`` one-thread FastLoaders in processes of their own, run at the same time (each
    over its own window inside the common one): what the machine gives decoders that share no GIL."""
    start = time.time() + 12  # after every process has imported torch and decoded a first batch
    procs = [subprocess.Popen([sys.executable, "-c", PROCESS, str(root), str(batch), str(start), str(seconds), str(k)],
                              stdout=subprocess.PIPE, text=True) for k in range(processes)]
    got = [p.communicate()[0].split() for p in procs]
    got = [g for p, g in zip(procs, got) if p.returncode == 0 and len(g) == 2]
    if len(got) < processes:  # one that died costs its figure, not the scaling table measured before it
        print(f"  ({processes - len(got)} of the {processes} decode processes failed: their rate is left out)")
    if not got:
        return float("nan")
    late = max(float(g[1]) for g in got)
    if late > 0.5:
        print(f"  (the processes' window began up to {late:.1f} s late: not all decoded together)")
    return sum(float(g[0]) for g in got)


def scaling_part(s: Setup) -> dict[str, Any]:
    """FastDataset LMDB training crops (no model) at each thread count, ``--runs`` times; the CPU an image, busy
    cores and sleeps an image at each say what stops the scaling; once, as many one-thread processes as the top
    thread count (no shared GIL: the machine's own scaling, bench_jpeg.py's process row)."""
    root, out = s.lmdb(), {}
    top = max(s.threads)
    seconds = max(1.0, s.args.seconds / 3)
    rows: dict[int, list[tuple[float, dict[str, float]]]] = {t: [] for t in s.threads}
    for _ in range(s.args.runs):
        for t in s.threads:
            rows[t].append(window_rate(decoded(root, s.batch, t), seconds, t))
    phys = physical_cores()
    print(f"LMDB training-crop decode alone, batch {s.batch}, by loader threads ({s.cores} cores, {phys} physical):")
    table: dict[str, Any] = {}
    for t, got in rows.items():
        rates = [r for r, _ in got]
        c = {k: statistics.median(g[k] for _, g in got) for k in got[0][1]}
        table[str(t)] = {"images_per_s": statistics.median(rates), "images_per_s_runs": rates, **c}
        print(f"  {t:>2} threads: {spread(rates)} images/s, {c['cpu_ms_per_image']:.2f} CPU ms an image, "
              f"{c['busy_cores']:.1f} cores busy, each thread busy {c['thread_busy_median']:.0%} (least "
              f"{c['thread_busy_min']:.0%}, {c['threads_seen']:.0f} threads ran), {c['sleeps_per_image']:.2f} sleeps "
              f"an image")
    ratios = [rows[top][k][0] / rows[1][k][0] for k in range(s.args.runs)]
    key = f"lmdb_scaling_1_to_{top}"
    put_runs(out, key, ratios)
    if top != 16:  # (the smoke's threads): the key names 16
        out["lmdb_scaling_threads"] = list(s.threads)
    procs = processes_rate(root, s.batch, top, max(seconds, 3.0))
    one, many = table["1"], table[str(top)]
    out.update(lmdb_scaling=table, physical_cores=phys, lmdb_processes_images_per_s=procs)
    print(f"  1 -> {top} threads: {spread(ratios)}x (target >= 12x); {top} one-thread processes (no shared GIL): "
          f"{procs:,.0f} images/s = {procs / one['images_per_s']:.1f}x")
    cpu_growth = many["cpu_ms_per_image"] / one["cpu_ms_per_image"]
    busy = many["thread_busy_median"]
    out["lmdb_scaling_cpu_per_image_growth"], out["lmdb_scaling_busy_share"] = cpu_growth, busy
    print(f"  at {top} threads each image costs {cpu_growth:.2f}x the CPU time it costs at 1 (slower cores: SMT "
          f"siblings, clocks, memory), and the threads are {busy:.0%} busy (the rest waits: GIL, batch hand-offs)"
          + (f"; {top} threads share {phys} physical cores" if 0 < phys < top else ""))
    return out


# -- mixture: three sources through CUDAPrefetcher --------------------------------------------------------------
def mixture_part(s: Setup) -> dict[str, Any]:
    """A Mixture of three npy datasets in shm (weights 0.5 / 0.3 / 0.2), crop + flip on the GPU, into ResNet-50."""
    images = (s.warm + s.steps + 2) * s.batch  # an epoch longer than one measured iteration
    names, weights = ("a", "b", "c"), (0.5, 0.3, 0.2)
    sources = {n: in_shm(s.npy(f"mix-{n}", int(images * w) + s.batch)) for n, w in zip(names, weights)}
    aug = Compose([RandomResizedCrop(CROP), RandomHorizontalFlip()])
    threads = min(8, s.cores)

    def make() -> CUDAPrefetcher:
        mix = Mixture(sources, weights=dict(zip(names, weights)), seed=0)
        return CUDAPrefetcher(FastLoader(mix, s.batch, num_threads=threads, drop_last=True), device=s.device,
                              dtype=torch.bfloat16, transforms=aug)  # (a partial batch: a new shape to tune)

    print(f"3-source Mixture (npy in shm, weights {weights}, {sum(len(d) for d in sources.values()):,} samples) + "
          f"CUDAPrefetcher (crop + flip on the GPU), {s.model}@{CROP}, batch {s.batch}:")
    out: dict[str, Any] = {}
    row = s.stall_runs(f"Mixture, {threads} loader threads", make)
    out["mixture_row"] = row
    put_runs(out, "mixture_stall_pct_resnet50_224", row["data_stall_pct_runs"])
    print("  target: stall <= 1%")
    return out


# -- remote: a loopback S3 server, through the node cache --------------------------------------------------------
SHARD, WINDOW = 256, 4  # 50 MB shards, read in shuffled windows of 4 (the order made for streaming)


def remote_part(s: Setup) -> dict[str, Any]:
    """An npy dataset pushed to a loopback moto S3 server, read streamed through the node cache: per run a fresh
    cache, one cold epoch then one warm epoch into ResNet-50 (crop + flip on the GPU); images/s and the Trainer's
    stall of each (the whole epoch: its start is part of what streaming costs). Shards of 256 images, read in
    shuffled windows of 4 shards (``shuffle_window``: a whole-dataset shuffle needs every shard for its first
    batches)."""
    import boto3
    import fsspec

    from fastdata.progress import set_quiet
    from fastdata.storage.push import push

    set_quiet()  # no download bars between the rows
    images = (s.args.remote_steps + 1) * s.batch
    local = s.npy("remote-src", images, shard_size=SHARD)
    server, endpoint = moto_server()  # in a process of its own: in this one it would share our GIL
    out: dict[str, Any] = {}
    try:
        fsspec.filesystem("s3").clear_instance_cache()  # a client of another endpoint would be reused
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
        t0 = time.perf_counter()
        push(local, "s3://bench/ds", workers=8)
        mb = sum(p.stat().st_size for p in local.glob("*.npy")) / 1e6
        print(f"remote: {len(FastDataset(local)):,} images ({mb:,.0f} MB) pushed to moto on loopback in "
              f"{time.perf_counter() - t0:.1f} s; {s.model}@{CROP}, batch {s.batch}, crop + flip on the GPU, "
              f"a fresh node cache each run:")
        aug = Compose([RandomResizedCrop(CROP), RandomHorizontalFlip()])
        threads = min(8, s.cores)
        model = create_model(s.model, num_classes=8)
        fit(model, resident_batches(s.batch, CROP, 8, s.device, 3), 3, s.device)  # cudnn autotuning
        got: dict[str, list[dict[str, float]]] = {"cold": [], "warm": [], "warm_steady": []}
        for r in range(s.args.runs):
            ds = FastDataset("s3://bench/ds", cache_dir=s.scratch / f"cache{r}", cache_limit=int(2 * mb * 1e6))
            loader = CUDAPrefetcher(FastLoader(ds, s.batch, num_threads=threads, drop_last=True,
                                               shuffle_window=WINDOW), device=s.device,
                                    dtype=torch.bfloat16, transforms=aug)
            for kind in ("cold", "warm"):
                steps = len(loader)
                end = fit(model, loader, steps, s.device, log_every=steps)[-1]
                got[kind].append({"images_per_s": steps * s.batch / end["time_s"],
                                  "data_stall_pct": end["data_stall_pct"]})
            # the warm epoch again, its start left out (a short epoch's start alone is about 1% of it)
            warm = max(2, len(loader) // 6)
            got["warm_steady"].append(train_steady(model, loader, s.batch, warm, len(loader) - 2 * warm, s.device))
            del loader, ds
        # the headline warm stall is steady state, as the other stalls; the whole warm epoch's is kept beside it
        keys = {"cold": "remote_cold", "warm": "remote_warm_whole", "warm_steady": "remote_warm"}
        for kind, runs in got.items():
            rates = [g["images_per_s"] for g in runs]
            stalls = [g["data_stall_pct"] for g in runs]
            put_runs(out, f"{keys[kind]}_images_per_s", rates)
            put_runs(out, f"{keys[kind]}_stall_pct_resnet50_224", stalls)
            print(f"  {kind.replace('_', ', ')} epoch: {spread(rates)} images/s, data stall {spread(stalls)}%")
        out["remote_images"], out["remote_mb"] = len(FastDataset(local)), mb
        print("  target: warm stall <= 1%")
    finally:
        server.terminate()
        server.wait()
    return out


PARTS = {"lmdb": lmdb_part, "scaling": scaling_part, "mixture": mixture_part, "remote": remote_part}
