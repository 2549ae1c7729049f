"""``fastdata bench``: where does a training pipeline wait? Measure each stage alone, then together.

Stages (each time-boxed): storage read (files from the page cache), batch gather (FastDataset.get_batch, one
thread: JPEG decoding for an LMDB store), the FastLoader, host-to-device copies (pinned and pageable, CUDA
only), GPU transforms (normalise + flip), the model step on synthetic data already on the device (the
ceiling) and the full pipeline. The loader and the full pipeline are timed in steady state: their epochs
serve the dataset many times over and epoch starts are left out (`fastdata.cli.timing.steady_pipeline`), so
a small dataset's epoch starts do not sway the verdict. The report names the bounding stage (`verdict`) and
gives advice computed from the figures. ``--loader module:factory`` times a user's own loader against the
same model step; ``--autotune`` searches loader settings for this machine.
"""
from __future__ import annotations

import importlib
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

from ..errors import ConfigError, FastdataError, require
from ..imaging import turbojpeg as turbo
from ..train.models import image_models
from .timing import (ModelStep, PlainCopies, Repeat, machine, read_rate, steady_pipeline, step_chunk, sync,
                     timed_rate)


def _check(batch_size: Optional[int], seconds: float) -> None:
    """Refuse a bad batch size or time budget before anything is measured (a stage takes seconds)."""
    require(batch_size is None or (isinstance(batch_size, int) and batch_size > 0), "batch_size", batch_size,
            "a positive integer")
    require(isinstance(seconds, (int, float)) and seconds >= 0, "seconds", seconds, "a number of seconds >= 0")


def _check_fits(model: str, height: int, width: int) -> None:
    """Refuse, before anything is measured, images smaller than ``model`` takes (as `fastdata train` does):
    else its first step fails once the stages' budget is spent."""
    from ..train.assemble import image_model

    with torch.device("meta"):  # (built without memory or work: only its size limit is read)
        image_model(model, 2, min(height, width))


MIN_STEPS = 10  # --loader: fewer timed steps from a loader that ran out give no verdict (a mean of noise)
LOADER, PINNED, PAGEABLE = "FastLoader", "host-to-device copy (pinned)", "host-to-device copy (pageable)"
CEILING, FULL = "model step, synthetic data on the device (ceiling)", "full pipeline"


def bench_pipeline(data: Path, *, model: str = "resnet50", batch_size: int = 256, device: str = "auto",
                   seconds: float = 120.0, progress: bool = True, storage: str = "mmap",
                   num_threads: Optional[int] = None, pageable: bool = False) -> dict[str, Any]:
    """Measure every stage of the native pipeline on ``data``, each in steady state; returns the report (see
    `render`).

    Args:
        data: A fastdata image dataset folder.
        model: A model of `fastdata.train.models.MODELS` whose training step consumes the batches, or
            ``"none"``: the data pipeline alone, to the device.
        batch_size: Samples per batch.
        device: ``"auto"``, ``"cuda"`` or ``"cpu"``.
        seconds: The time budget, shared by the stages.
        progress: Show a progress bar.
        storage: The dataset's storage (``"mmap"``, ``"ram"``, ``"shm"``).
        num_threads: FastLoader's threads (default: its own, ``min(4, cores)``).
        pageable: Batches stay in pageable memory and are copied with a blocking ``.to(device)``, as in a
            loop without pinned buffers or CUDAPrefetcher (default: FastLoader's pinned buffers, CUDAPrefetcher).

    Raises:
        ConfigError: A bad setting, found before anything is measured.
    """
    from ..datasets.images import FastDataset
    from ..distributed import check_cuda, resolve_device
    from ..gpu.prefetch import CUDAPrefetcher
    from ..imaging.transforms import RandomHorizontalFlip
    from ..loading.loader import FastLoader
    from ..progress import progress_bar

    _check(batch_size, seconds)
    require(model == "none" or model in image_models(), "model", model, f"one of {image_models()} or 'none'")
    require(storage in ("mmap", "ram", "shm"), "storage", storage, "'mmap', 'ram' or 'shm'")
    require(num_threads is None or (isinstance(num_threads, int) and num_threads > 0), "num_threads", num_threads,
            "a positive integer")
    dev = resolve_device(device)
    check_cuda(dev, "use --device cpu")
    ds = FastDataset(data, storage=storage)
    if model != "none":
        _check_fits(model, *ds.sample_shape[:2])
    pinned = dev.type == "cuda" and not pageable
    sample_bytes = int(np.prod(ds.sample_shape))
    n_stages = 5 + 2 * (dev.type == "cuda") + (model != "none")  # the record() calls below, the full pipeline too
    if dev.type == "cuda":
        torch.backends.cudnn.benchmark = True  # as the Trainer sets it: the ceiling is the model's training speed
    box = max(0.5, seconds / (n_stages + 1))  # the full pipeline runs for two boxes
    bar = progress_bar(total=n_stages, desc="bench", unit="stage", enabled=progress)
    stages: dict[str, dict[str, Any]] = {}
    rng = np.random.default_rng(0)
    b = min(batch_size, len(ds))
    steady: list[dict[str, float]] = []  # the loader's and the full pipeline's runs: their epoch starts

    def record(name: str, img_s: float, note: str = "") -> None:
        stages[name] = {"images_per_s": img_s, "gb_per_s": img_s * sample_bytes / 1e9, "note": note}
        bar.update(1)

    def loader() -> Any:  # over `Repeat`: steady state, whatever the dataset's epoch (see steady_pipeline)
        return FastLoader(Repeat(ds), b, num_threads=num_threads, pin_memory=pinned)

    record("storage read (page cache)", read_rate(ds, box))
    record("batch gather", timed_rate(lambda: len(ds.get_batch(np.sort(rng.integers(0, len(ds), b)))[0]), box),
           "JPEG decode, 1 thread" if ds.is_lmdb else "1 thread")
    alone = loader()
    threads = alone.num_threads
    steady.append(steady_pipeline(alone, box, skip=threads))
    record(LOADER, steady[-1]["images_per_s"], f"{threads} thread{'s' * (threads > 1)}"
           + (", JPEG decode" if ds.is_lmdb else "") + ("" if pinned or dev.type != "cuda" else ", pageable buffers"))
    x_host = torch.randint(0, 256, (b, *ds.sample_shape), dtype=torch.uint8)
    if dev.type == "cuda":
        pin = x_host.pin_memory()
        record(PINNED, timed_rate(lambda: len(pin.to(dev, non_blocking=True)), box), "" if pinned else "not used")
        record(PAGEABLE, timed_rate(lambda: len(x_host.to(dev)), box), "not used" if pinned else "")
    x_dev = x_host.to(dev)
    convert = CUDAPrefetcher([], device=dev, transforms=RandomHorizontalFlip())
    transforms = "GPU transforms (normalise + flip)" if dev.type == "cuda" else "transforms (normalise + flip, CPU)"
    record(transforms, timed_rate(lambda: len(convert.convert(x_dev)), box))
    net = ceiling = None
    if model != "none":
        net = ModelStep(model, len(ds.classes), dev)
        xs, ys = convert.convert(x_dev), torch.randint(0, len(ds.classes), (b,), device=dev)
        ceiling = timed_rate(lambda: (net.step(xs, ys), b)[1], box)
        record(CEILING, ceiling)
    batches = (CUDAPrefetcher(loader(), device=dev, transforms=RandomHorizontalFlip()) if pinned or dev.type != "cuda"
               else PlainCopies(loader(), dev, convert.convert))
    steady.append(steady_pipeline(batches, box * 2, None if net is None else lambda batch: net.step(*batch[:2]),
                                  skip=threads if net is None else 1))
    stall = steady[-1]["stall_pct"]
    record(FULL, steady[-1]["images_per_s"], f"data stall {stall:.1f}%" if net is not None else
           "no model: batches drawn to the device")
    bar.close()
    settings = {"dataset": str(data), "samples": len(ds), "sample_shape": list(ds.sample_shape), "model": model,
                "batch_size": b, "device": str(dev), "storage": storage, "num_threads": threads, "pinned": pinned,
                "decodes": bool(ds.is_lmdb),
                "pipeline_stages": [LOADER, *([PINNED if pinned else PAGEABLE] if dev.type == "cuda" else []),
                                    transforms]}
    return _report(settings, stages, ceiling, steady, ds, dev)


def _report(settings: dict[str, Any], stages: dict[str, dict[str, Any]], ceiling: Optional[float],
            steady: list[dict[str, float]], ds: Any, dev: torch.device) -> dict[str, Any]:
    """`bench_pipeline`'s report: its settings, the stages, the epoch starts left out, the verdict, advice."""
    starts = sum(r["epoch_starts"] for r in steady)
    report = {**settings, "stages": stages, "ceiling_images_per_s": ceiling, "data_stall_pct": steady[-1]["stall_pct"],
              "epoch_starts_excluded": starts,
              "epoch_start_s": sum(r["epoch_start_s"] * r["epoch_starts"] for r in steady) / starts,
              "machine": machine()}
    for s in stages.values():
        s["share_of_ceiling"] = s["images_per_s"] / ceiling if ceiling else None
    report["bottleneck"], report["bound_stage"], report["bound_by"] = verdict(report)
    report["advice"] = advice(report, ds, dev)
    return report


def verdict(report: dict[str, Any]) -> tuple[str, str, str]:
    """What bounds the full pipeline: ``(kind, stage, words)``, kind one of ``decode`` (JPEG decoding in the
    loader), ``loader`` (its gather), ``h2d``, ``transforms``, ``model`` or ``latency``.

    The stages the pipeline runs concurrently (the loader, its host-to-device copy, the transforms) are
    compared, each measured alone in steady state, with the model step's ceiling: the slowest, when it
    cannot feed the model, bounds the pipeline. Otherwise the model does, unless the full pipeline still
    waits for data (steady state too: epoch starts are left out of every figure)."""
    st, ceiling = report["stages"], report["ceiling_images_per_s"]
    full, stall = st[FULL]["images_per_s"], report["data_stall_pct"]
    rates = {k: st[k]["images_per_s"] for k in report["pipeline_stages"]}
    slowest = min(rates, key=rates.get)
    rate = f"{rates[slowest]:,.0f} images/s" + (f" for a model that takes {ceiling:,.0f}" if ceiling else "")
    if ceiling is not None and rates[slowest] >= ceiling:
        if full >= 0.9 * ceiling or stall <= 10:
            return "model", CEILING, "model compute (the data pipeline keeps up)"
        return "latency", FULL, ("data latency: every stage alone outpaces the model, but batches arrive late "
                                 "(raise the loader's prefetch or threads)")
    if slowest == LOADER:
        if report["decodes"]:
            return "decode", slowest, f"JPEG decoding in FastLoader's {report['num_threads']} threads ({rate})"
        return "loader", slowest, f"FastLoader's {report['num_threads']} threads gathering batches ({rate})"
    if slowest in (PINNED, PAGEABLE):
        return "h2d", slowest, f"{slowest}: {st[slowest]['gb_per_s']:.1f} GB/s ({rate})"
    return "transforms", slowest, f"{slowest} ({rate})"


def advice(report: dict[str, Any], ds: Any, dev: torch.device) -> list[str]:
    """Concrete suggestions computed from the measured figures."""
    st, tips = report["stages"], []
    # with no model, a stage is compared with what the full pipeline delivers
    ceiling = report["ceiling_images_per_s"] or st.get(FULL, {}).get("images_per_s", 0.0)
    dataset_bytes = report["samples"] * int(np.prod(report["sample_shape"]))
    gather, loader = st["batch gather"]["images_per_s"], st[LOADER]["images_per_s"]
    fits = dataset_bytes < 0.5 * (report["machine"]["memory_bytes"] or 0)
    cores = os.cpu_count() or 1
    if st["storage read (page cache)"]["images_per_s"] < ceiling and fits:
        tips.append(f"the dataset ({dataset_bytes / 2**30:.1f} GiB) fits in RAM: storage='shm' (one copy per machine) "
                    "or 'ram' avoids reading files while training")
    idle = (report.get("num_threads") or 0) < cores  # more threads only while cores are: N on N use every one
    if report.get("bottleneck") == "decode":
        threads = f"more loader threads (num_threads, up to {cores}), " if idle else ""
        tips.append(f"JPEG decoding bounds the pipeline: {threads}records stored smaller (`fastdata preprocess "
                    "--size`), or decoding on the GPU (fastdata.dali.DALILoader)")
    elif loader < ceiling and loader < 2 * gather and cores > 2 and idle:
        tips.append(f"FastLoader gives {loader:,.0f} images/s for a model that takes {ceiling:,.0f}: raise num_threads "
                    f"(up to {cores}) or run `fastdata bench --autotune`")
    if dev.type == "cuda":
        pin, page = st[PINNED]["gb_per_s"], st[PAGEABLE]["gb_per_s"]
        if not report.get("pinned", True):
            tips.append(f"batches are copied from pageable memory at {page:.1f} GB/s; pinned copies run at {pin:.1f} "
                        "GB/s: keep FastLoader's pinned buffers (pin_memory=True, its default on CUDA) and copy "
                        "with CUDAPrefetcher (non_blocking, on a side stream, one batch ahead)")
        elif pin > 1.5 * page:
            tips.append(f"pinned copies run at {pin:.1f} GB/s vs {page:.1f} GB/s pageable: keep pin_memory on "
                        "(FastLoader pins by default)")
        free = torch.cuda.mem_get_info()[0]
        if dataset_bytes < 0.25 * free:
            tips.append(f"the uint8 dataset ({dataset_bytes / 2**30:.1f} GiB) fits in GPU memory "
                        f"({free / 2**30:.0f} GiB free): storage='cuda' removes host work and copies entirely")
        if report.get("model", "none") != "none":
            tips.append("train with --amp bf16 and channels_last (the default for conv nets) to raise the ceiling")
    if getattr(ds, "is_lmdb", False) and turbo.library() is None:
        tips.append("each JPEG record is decoded whole: pip install 'fastdata[jpeg]' (libturbojpeg 3) decodes only "
                    "its crop box, the same pixels in 0.7-0.9x the time")
    if report["data_stall_pct"] > 10 and report.get("model") != "none" and report.get("bottleneck") != "model":
        tips.append(f"the model waited for data {report['data_stall_pct']:.0f}% of the time: a larger batch or more "
                    "loader threads trade memory for throughput")
    if report.get("bottleneck") == "transforms":
        tips.append("the transforms bound the pipeline: on a GPU, CUDAPrefetcher runs them there; fewer or cheaper "
                    "transforms, or a smaller stored size, also help" if dev.type != "cuda" else
                    "the GPU transforms bound the pipeline: fewer or cheaper transforms, or a smaller stored size")
    if not tips:
        tips.append("nothing to change: the data pipeline keeps up with the model")
    return tips


def render(report: dict[str, Any]) -> str:
    copies = ("pinned" if report.get("pinned") else "pageable") + " copies" if report["device"].startswith("cuda") \
        else "no device copies"
    lines = [f"{report['dataset']}: {report['samples']} samples {tuple(report['sample_shape'])}, "
             f"model {report['model']}, batch {report['batch_size']}, device {report['device']}, storage "
             f"{report.get('storage', 'mmap')}, {report.get('num_threads')} loader threads, {copies}",
             f"{'stage':<52} {'images/s':>11} {'GB/s':>7} {'x ceiling':>10}"]
    for name, s in report["stages"].items():
        share = "-" if s["share_of_ceiling"] is None else f"{s['share_of_ceiling']:.2f}x"
        lines.append(f"{name:<52} {s['images_per_s']:>11,.0f} {s['gb_per_s']:>7.2f} {share:>10}"
                     + (f"  {s['note']}" if s["note"] else ""))
    lines.append(f"data stall: {report['data_stall_pct']:.1f}%" if report["model"] != "none" else
                 "data stall: - (no model step)")
    lines.append(f"steady state: {report['epoch_starts_excluded']} epoch starts excluded (their first batches, "
                 f"{1000 * report['epoch_start_s']:.0f} ms on average; the loader's epochs serve the "
                 f"{report['samples']} samples many times over)")
    lines.append(f"bound by: {report['bound_by']} [{report['bottleneck']}-bound]")
    lines += [f"advice: {t}" for t in report["advice"]]
    return "\n".join(lines)


# -- the user's own loader --------------------------------------------------------------------------------
def load_factory(spec: str) -> Callable[[], Any]:
    if ":" not in spec:
        raise ConfigError(f"--loader must look like module:factory, got {spec!r}")
    mod_name, attr = spec.split(":", 1)
    sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(mod_name)
    except Exception as exc:  # noqa: BLE001 - whatever the user's module raises becomes one clear line
        raise FastdataError(f"cannot import {mod_name!r} for --loader {spec}: {type(exc).__name__}: {exc}") from exc
    finally:
        sys.path.pop(0)
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise FastdataError(f"--loader {spec}: {mod_name} has no callable {attr!r}")
    return factory


def first_tensor(batch: Any) -> Optional[torch.Tensor]:
    """The input of a batch: ``batch[0]`` of a tuple/list, ``batch["image"]`` (else the first tensor) of a
    dict, or the batch itself when it is a tensor."""
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, dict):
        if isinstance(batch.get("image"), torch.Tensor):
            return batch["image"]
        return next((v for v in batch.values() if isinstance(v, torch.Tensor)), None)
    if isinstance(batch, (tuple, list)) and batch:
        return first_tensor(batch[0])
    return None


def image_geometry(x: Optional[torch.Tensor]) -> Optional[tuple[int, int, int]]:
    """``(batch, height, width)`` of an image batch (NCHW or NHWC with 1 or 3 channels), else None."""
    if x is None or x.ndim != 4:
        return None
    if x.shape[1] in (1, 3):
        return x.shape[0], x.shape[2], x.shape[3]
    if x.shape[-1] in (1, 3):
        return x.shape[0], x.shape[1], x.shape[2]
    return None


def diagnose_loader(spec: str, *, model: Optional[str] = None, batch_size: Optional[int] = None,
                    image_size: Optional[int] = None, num_classes: int = 10, device: str = "auto",
                    seconds: float = 30.0, max_steps: int = 10_000) -> dict[str, Any]:
    """Time how long each step waits for the user's loader against a model step on synthetic data of the
    loader's own batch shape (from its first batch; ``batch_size`` / ``image_size`` override): is the
    loader the bottleneck, and by how much?

    The model defaults to ``resnet50`` on a GPU and ``cnn-small`` on the CPU, and its step is split into
    chunks that fit the device (`fastdata.cli.timing.step_chunk`): a CPU machine gets a verdict in
    seconds, not a 19 GB ResNet-50 step. Batches that are not images are timed without a model step,
    and the report says why. A loader that cannot be iterated again (a generator) is timed over the batches
    it gives, and refused when they are fewer than `MIN_STEPS`.
    """
    from ..distributed import check_cuda, resolve_device

    _check(batch_size, seconds)
    require(image_size is None or (isinstance(image_size, int) and image_size > 0), "image_size", image_size,
            "a positive integer")
    dev = resolve_device(device)
    check_cuda(dev, "use --device cpu")
    name = model or ("resnet50" if dev.type == "cuda" else "cnn-small")
    require(name in image_models(), "model", name, f"one of {image_models()}")
    factory = load_factory(spec)
    try:
        loader = factory()
        iterable = hasattr(loader, "__iter__") or hasattr(loader, "__getitem__")
        it = iter(loader) if iterable else None
    except Exception as exc:  # noqa: BLE001
        raise FastdataError(f"--loader {spec} raised {type(exc).__name__}: {exc}") from exc
    if it is None:
        raise FastdataError(f"--loader {spec} returned {type(loader).__name__}, which is not iterable: return a "
                            "DataLoader or any iterable of batches")
    t_first = time.perf_counter()
    first = _next_batch(it, spec)
    if first is None:
        raise FastdataError(f"--loader {spec} yielded no batch")
    first_s = time.perf_counter() - t_first  # worker start-up and the first batch: reported, not averaged
    x0 = first_tensor(first)
    geometry = image_geometry(x0)
    net = x = y = None
    skipped = None
    if geometry is None and (batch_size is None or image_size is None):
        skipped = (f"batches of {tuple(x0.shape) if x0 is not None else type(first).__name__} are not images "
                   "(N, C, H, W) or (N, H, W, C): only the wait for data is timed")
    else:
        b = batch_size or geometry[0]
        h, w = (image_size, image_size) if image_size else geometry[1:]
        _check_fits(name, h, w)
        net = ModelStep(name, num_classes, dev, max_chunk=step_chunk(name, b, h, w, dev))
        x = torch.randn(b, 3, h, w, device=dev).contiguous(memory_format=net.fmt)
        y = torch.randint(0, num_classes, (b,), device=dev)
        net.step(x, y)  # warm-up outside the timed region
        sync()
    waits, works, t_end = [], [], time.perf_counter() + seconds
    restarted, ran_out = False, None  # ran_out: the batches a one-shot loader gave before it was used up
    while time.perf_counter() < t_end and len(waits) < max_steps:
        t = time.perf_counter()
        batch = _next_batch(it, spec)  # the batch itself is not needed: only how long it took to come
        if batch is None:
            if restarted:  # iterated again, it gave nothing: a generator hands back itself, used up (else a busy spin)
                ran_out = len(waits) + 1  # (+ the first batch, timed apart)
                break
            it, restarted = iter(loader), True
            continue
        restarted = False
        t1 = time.perf_counter()
        if net is not None:
            net.step(x, y)
            sync()
        waits.append(t1 - t)
        works.append(time.perf_counter() - t1)
    if ran_out is not None and len(waits) < MIN_STEPS:
        raise FastdataError(f"--loader {spec} ran out after {ran_out} batch{'es' * (ran_out != 1)} and yields nothing "
                            "when iterated again (a generator is used up after one pass): too few steps to measure; "
                            "return a loader that can be iterated again, e.g. a DataLoader")
    if not waits:
        raise FastdataError(f"--loader {spec} yielded no batch in {seconds:.0f} s")
    wait, work = float(np.mean(waits)), float(np.mean(works))
    share = wait / (wait + work) if net is not None else 1.0
    if net is None:
        verdict = f"each batch takes {1000 * wait:.1f} ms to come from the loader ({skipped})"
    elif share > 0.1:
        verdict = (f"the loader is the bottleneck: each step waits {1000 * wait:.0f} ms for data, "
                   f"{100 * share:.0f}% of the step")
    else:
        verdict = f"the loader keeps up: each step waits {1000 * wait:.1f} ms for data, {100 * share:.0f}% of the step"
    if ran_out is not None:
        verdict += (f" (over {len(waits)} steps: the loader ran out after {ran_out} batches and cannot be iterated "
                    "again)")
    return {"loader": spec, "steps": len(waits), "wait_ms": 1000 * wait, "work_ms": 1000 * work, "wait_share": share,
            "bottleneck": share > 0.1, "verdict": verdict, "model": name if net is not None else None,
            "model_skipped": skipped, "batch_shape": list(x0.shape) if x0 is not None else None,
            "batch_dtype": str(x0.dtype) if x0 is not None else None,
            "model_input_shape": list(x.shape) if x is not None else None,
            "model_chunk": net.max_chunk if net is not None else None, "first_batch_s": first_s, "ran_out": ran_out,
            "batch_size": x.shape[0] if x is not None else (x0.shape[0] if x0 is not None and x0.ndim else None),
            "device": str(dev), "machine": machine()}


def _next_batch(it: Any, spec: str) -> Any:
    """The next batch of the user's iterator (None at its end); its errors become one clear line."""
    try:
        return next(it)
    except StopIteration:
        return None
    except Exception as exc:  # noqa: BLE001
        raise FastdataError(f"--loader {spec} raised {type(exc).__name__} while iterating: {exc}") from exc


# -- autotune ---------------------------------------------------------------------------------------------
def autotune(data: Path, *, batch_size: int = 256, seconds: float = 60.0, progress: bool = True) -> dict[str, Any]:
    """Try loader threads, prefetch depth, storage mode and pinned buffers; return the fastest configuration
    (the default one is always among those measured, so the result is at least as fast in this run)."""
    from ..datasets.images import FastDataset
    from ..loading.loader import FastLoader
    from ..progress import progress_bar

    _check(batch_size, seconds)
    cores = os.cpu_count() or 1
    pins = [True, False] if torch.cuda.is_available() else [False]
    threads = sorted({1, 2, min(4, cores), cores})
    candidates = [{"storage": s, "num_threads": t, "prefetch": p, "pin_memory": pin}
                  for s in ("mmap", "ram") for t in threads for p in (1, 2, 4) for pin in pins]
    default = {"storage": "mmap", "num_threads": min(4, cores), "prefetch": 2, "pin_memory": pins[0]}
    if default not in candidates:
        candidates.append(default)
    box = max(0.2, seconds / len(candidates))
    bar = progress_bar(total=len(candidates), desc="autotune", unit="config", enabled=progress)
    datasets = {s: FastDataset(data, storage=s) for s in ("mmap", "ram")}
    results = []
    for c in candidates:
        loader = FastLoader(datasets[c["storage"]], min(batch_size, len(datasets["mmap"])),
                            num_threads=c["num_threads"], prefetch=c["prefetch"], pin_memory=c["pin_memory"])
        results.append({**c, "images_per_s": timed_rate(lambda: sum(len(x) for x, _ in loader), box)})
        bar.update(1)
    bar.close()
    best = max(results, key=lambda r: r["images_per_s"])
    default_rate = next(r["images_per_s"] for r in results if all(r[k] == v for k, v in default.items()))
    return {"loader": {k: best[k] for k in ("num_threads", "prefetch", "pin_memory")}, "storage": best["storage"],
            "batch_size": batch_size, "images_per_s": best["images_per_s"], "default": default,
            "default_images_per_s": default_rate, "tried": results, "dataset": str(data), "machine": machine()}


def plot(report: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise FastdataError("--plot needs matplotlib: pip install matplotlib") from exc
    names = list(report["stages"])
    rates = [report["stages"][n]["images_per_s"] for n in names]
    fig, ax = plt.subplots(figsize=(9, 0.5 * len(names) + 1.5))
    colours = ["tab:red" if n == report["bound_stage"] else "tab:blue" for n in names[::-1]]
    ax.barh(names[::-1], rates[::-1], color=colours)
    if report["ceiling_images_per_s"]:
        ax.axvline(report["ceiling_images_per_s"], color="k", linestyle="--", label="model ceiling")
    ax.set_xlabel("images/s")
    ax.set_title(f"fastdata bench: bound by {report['bound_by']}")
    if report["ceiling_images_per_s"]:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
