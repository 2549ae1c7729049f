"""fastdata bench: stage report, bottleneck diagnosis of user loaders, autotune, JSON, bad input."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from typing import Callable

import pytest

from fastdata.cli.main import main
from fastdata.datasets.images import FastDataset
from fastdata.errors import ConfigError
from fastdata.loading.loader import FastLoader

LOADERS = textwrap.dedent('''
    import time, torch

    class Slow:
        def __iter__(self):
            while True:
                time.sleep(0.05)   # 50 ms to make every batch
                yield torch.zeros(8, 3, 16, 16), torch.zeros(8, dtype=torch.long)

    def slow():
        return Slow()

    def fast():
        return [(torch.zeros(8, 3, 16, 16), torch.zeros(8, dtype=torch.long))] * 1000

    def broken():
        raise ValueError("no such bucket")

    def not_iterable():
        return 42

    class SlowImages(torch.utils.data.Dataset):
        def __len__(self):
            return 100_000

        def __getitem__(self, i):
            time.sleep(0.1)   # 100 ms a sample: 3.2 s a batch of 32 per worker, 1.6 s with 2 (the model step
            # takes 0.2-0.7 s on 2 busy cores: the loader stays the bottleneck however loaded the machine)
            return torch.zeros(3, 96, 96), i % 10

    def small_dataloader():
        return torch.utils.data.DataLoader(SlowImages(), batch_size=32, num_workers=2)

    def token_batches():
        return [(torch.zeros(4, 128, dtype=torch.long), torch.zeros(4, 128, dtype=torch.long))] * 100

    def one_shot():   # a generator: iterated again, it hands back itself, used up
        return (torch.zeros(8, 3, 16, 16) for _ in range(3))

    def one_shot_tokens():
        return (torch.zeros(4, 128, dtype=torch.long) for _ in range(40))
''')


@pytest.fixture
def user_loaders(tmp_path, monkeypatch):
    (tmp_path / "myloaders.py").write_text(LOADERS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_report_names_a_bottleneck_and_json_has_every_stage(indexed_datasets, tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", str(indexed_datasets["npy"]), "--model", "resnet18", "--batch-size", "16", "--device",
                 "cpu", "--seconds", "6", "--quiet", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "bound by: " in text and "advice: " in text and "data stall" in text
    report = json.loads(out.read_text())
    assert set(report["stages"]) >= {"storage read (page cache)", "batch gather", "FastLoader",
                                     "model step, synthetic data on the device (ceiling)", "full pipeline"}
    assert all(s["images_per_s"] > 0 for s in report["stages"].values())
    assert report["machine"]["cores"] and report["machine"]["torch"] and report["machine"]["date"]
    assert report["bound_by"]


def test_slow_loader_is_diagnosed_with_the_true_wait_share(user_loaders, capsys):
    from fastdata.cli.bench import diagnose_loader

    r = diagnose_loader("myloaders:slow", model="cnn-small", batch_size=8, image_size=16, device="cpu", seconds=3)
    truth = 50 / (50 + r["work_ms"])  # the loader sleeps 50 ms a batch
    assert r["bottleneck"] and abs(r["wait_share"] - truth) < 0.1 and 45 < r["wait_ms"] < 80
    assert "the loader is the bottleneck" in r["verdict"]


def test_fast_loader_with_slow_consumer_is_not_the_bottleneck(user_loaders):
    from fastdata.cli.bench import diagnose_loader

    r = diagnose_loader("myloaders:fast", model="resnet18", batch_size=8, image_size=64, device="cpu", seconds=3)
    assert not r["bottleneck"] and r["wait_share"] < 0.05 and "keeps up" in r["verdict"]


def test_a_small_dataloader_on_the_cpu_is_diagnosed_quickly_with_its_own_batches(user_loaders):
    # Defaults only, as a new user types it: the model step takes the loader's (32, 3, 96, 96) batches on
    # cnn-small, not 256 x 224 x 224 on ResNet-50 (minutes and ~19 GB on this machine before the fix).
    code = ("import resource, sys; from fastdata.cli.main import main; "
            "rc = main(['bench', '--loader', 'myloaders:small_dataloader', '--device', 'cpu']); "
            "print('MAXRSS', max(resource.getrusage(w).ru_maxrss for w in "
            "(resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))); sys.exit(rc)")
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=user_loaders, timeout=120)
    wall = time.perf_counter() - t0
    assert r.returncode == 0, r.stderr[-2000:]
    peak_kib = int(r.stdout.split("MAXRSS")[1].split()[0])
    assert wall < 60 and peak_kib < 4 * 2**20, (wall, peak_kib)
    assert "cnn-small on (32, 3, 96, 96)" in r.stdout
    assert "from the first batch (32, 3, 96, 96) torch.float32" in r.stdout
    assert "the loader is the bottleneck" in r.stdout, r.stdout


def test_batches_that_are_not_images_are_timed_without_a_model_step(user_loaders):
    from fastdata.cli.bench import diagnose_loader

    r = diagnose_loader("myloaders:token_batches", device="cpu", seconds=1)
    assert r["model"] is None and "not images" in r["model_skipped"] and r["batch_shape"] == [4, 128]
    assert "takes" in r["verdict"] and r["steps"] > 10


def test_a_loader_that_runs_out_is_said_so_not_spun_on_until_the_budget(user_loaders, capsys):
    from fastdata.cli.bench import diagnose_loader

    # (before: it spun on the used-up generator for the whole --seconds, then judged it from 2 steps)
    assert main(["bench", "--loader", "myloaders:one_shot", "--seconds", "10", "--device", "cpu"]) == 1
    assert capsys.readouterr().err == (
        "fastdata: error: --loader myloaders:one_shot ran out after 3 batches and yields nothing when iterated again "
        "(a generator is used up after one pass): too few steps to measure; return a loader that can be iterated "
        "again, e.g. a DataLoader\n")
    r = diagnose_loader("myloaders:one_shot_tokens", device="cpu", seconds=60)  # enough steps: timed, and said
    assert (r["steps"], r["ran_out"]) == (39, 40)
    assert r["verdict"].endswith("(over 39 steps: the loader ran out after 40 batches and cannot be iterated again)")


@pytest.mark.parametrize("spec, needle", [("myloaders:broken", "raised ValueError: no such bucket"),
                                          ("myloaders:not_iterable", "not iterable"),
                                          ("nosuchmodule:f", "cannot import 'nosuchmodule'"),
                                          ("myloaders", "module:factory")])
def test_bad_loader_factories_are_one_line_errors(user_loaders, spec, needle):
    r = subprocess.run([sys.executable, "-m", "fastdata", "bench", "--loader", spec, "--seconds", "1", "--device",
                        "cpu"], capture_output=True, text=True, timeout=120, cwd=user_loaders)
    assert r.returncode == 1 and "Traceback" not in r.stderr and needle in r.stderr, r.stderr


def test_a_loader_whose_images_the_model_cannot_take_is_refused_before_timing(user_loaders):
    from fastdata.cli.bench import diagnose_loader

    with pytest.raises(ConfigError, match="cnn-small needs images of at least 16x16, and this run feeds it 8x8"):
        diagnose_loader("myloaders:fast", model="cnn-small", image_size=8, device="cpu", seconds=2)
    with pytest.raises(ConfigError, match="model='gpt-tiny'"):
        diagnose_loader("myloaders:fast", model="gpt-tiny", device="cpu", seconds=2)


def test_missing_dataset_is_a_clear_error(tmp_path):
    r = subprocess.run([sys.executable, "-m", "fastdata", "bench", str(tmp_path / "nope"), "--device", "cpu"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr and "not a folder" in r.stderr


@pytest.mark.parametrize("extra, needle", [(["--batch-size", "0"], "batch_size=0"),
                                           (["--seconds", "-1"], "seconds=-1.0"),
                                           (["--autotune", "--batch-size", "-2"], "batch_size=-2"),
                                           (["--device", "nosuch"], "device='nosuch' is not a device"),
                                           (["--json", "/no/such/folder/x.json"], "/no/such/folder does not exist"),
                                           # these two failed after measuring (gpt-tiny has no num_classes; 8x8
                                           # images pool down to nothing in cnn-small)
                                           (["--model", "gpt-tiny", "--seconds", "2"], "model='gpt-tiny'"),
                                           (["--model", "cnn-small", "--seconds", "2"],
                                            "cnn-small needs images of at least 16x16")])
def test_bad_settings_are_refused_before_anything_is_measured(indexed_datasets, capsys, extra, needle):
    t0 = time.monotonic()
    assert main(["bench", str(indexed_datasets["npy"]), "--device", "cpu", "--quiet", *extra]) == 1
    err = capsys.readouterr().err
    assert needle in err and "stage" not in err  # before: after the first stages, seconds each
    assert time.monotonic() - t0 < 5


def test_autotune_writes_a_config_fastloader_and_train_accept(indexed_datasets, tmp_path):
    cfg = tmp_path / "best.json"
    assert main(["bench", str(indexed_datasets["npy"]), "--autotune", "--batch-size", "16", "--seconds", "4",
                 "--quiet", "--json", str(cfg)]) == 0
    best = json.loads(cfg.read_text())
    assert best["images_per_s"] >= best["default_images_per_s"] > 0  # the default was measured too
    assert best["storage"] in ("mmap", "ram") and len(best["tried"]) >= 6
    loader = FastLoader.from_config(FastDataset(indexed_datasets["npy"], storage=best["storage"]), 16, cfg)
    assert loader.num_threads == best["loader"]["num_threads"] and loader.prefetch == best["loader"]["prefetch"]
    assert sum(len(x) for x, _ in loader) == 100
    assert main(["train", str(indexed_datasets["npy"]), "--config", str(cfg), "--model", "resnet18",
                 "--batch-size", "16", "--max-steps", "2", "--device", "cpu", "--quiet"]) == 0
    (tmp_path / "bad.json").write_text('{"loader": {"threads": 3}, "storage": "ram"}')
    from fastdata.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown loader settings"):
        FastLoader.from_config(FastDataset(indexed_datasets["npy"]), 16, tmp_path / "bad.json")


def test_plot_needs_matplotlib_or_draws(indexed_datasets, tmp_path, capsys):
    args = ["bench", str(indexed_datasets["npy"]), "--model", "resnet18", "--batch-size", "16", "--device", "cpu",
            "--seconds", "3", "--quiet", "--plot", str(tmp_path / "stages.png")]
    try:
        import matplotlib

        assert matplotlib.__version__
    except ImportError:
        assert main(args) == 1
        assert "pip install matplotlib" in capsys.readouterr().err
    else:
        assert main(args) == 0 and (tmp_path / "stages.png").stat().st_size > 1000


def test_advice_names_partial_jpeg_decoding_only_for_a_jpeg_store_without_it(indexed_datasets, monkeypatch):
    import torch

    from fastdata.cli.bench import advice
    from fastdata.imaging import turbojpeg as turbo

    stage = {"images_per_s": 1e9, "gb_per_s": 1.0}
    report = {"stages": {name: stage for name in ("storage read (page cache)", "batch gather", "FastLoader")},
              "ceiling_images_per_s": 1.0, "samples": 100, "sample_shape": [3, 8, 8], "data_stall_pct": 0.0,
              "machine": {"memory_bytes": 0}}
    lmdb, npy = FastDataset(indexed_datasets["lmdb"], size=32), FastDataset(indexed_datasets["npy"])
    monkeypatch.setattr(turbo, "library", lambda: None)
    tips = advice(report, lmdb, torch.device("cpu"))
    assert any("fastdata[jpeg]" in t for t in tips)
    assert not any("fastdata[jpeg]" in t for t in advice(report, npy, torch.device("cpu")))
    monkeypatch.setattr(turbo, "library", lambda: object())
    assert not any("fastdata[jpeg]" in t for t in advice(report, lmdb, torch.device("cpu")))


@pytest.mark.parametrize("threads, more", [(4, False), (2, True)])
def test_decode_bound_advice_asks_for_more_threads_only_while_cores_are_idle(monkeypatch, threads, more):
    import os

    import torch

    from fastdata.cli.bench import advice

    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    stage = {"images_per_s": 1e9, "gb_per_s": 1.0}
    report = {"stages": {name: stage for name in ("storage read (page cache)", "batch gather", "FastLoader")},
              "ceiling_images_per_s": 1.0, "samples": 100, "sample_shape": [3, 8, 8], "data_stall_pct": 0.0,
              "machine": {"memory_bytes": 0}, "bottleneck": "decode", "num_threads": threads}
    tip = ("JPEG decoding bounds the pipeline: " + "more loader threads (num_threads, up to 4), " * more
           + "records stored smaller (`fastdata preprocess --size`), or decoding on the GPU (fastdata.dali.DALILoader)")
    assert advice(report, object(), torch.device("cpu")) == [tip]  # (4 threads on 4 cores: "more threads", before)


# -- the verdict: decode-, loader-, model-bound, in steady state ----------------------------------------------
BATCH = 16


@pytest.fixture(scope="module")
def epochs(tmp_path_factory):
    """``{"long": npy, "tiny": npy, "lmdb": lmdb}`` of 40x40 JPEGs stored at 32 px: "long" has 512 samples (32
    batches of 16 an epoch), "tiny" 8 (one batch of 8 an epoch: every step would follow an epoch start)."""
    from fastdata.cli.synthetic import make_image_folder

    base = tmp_path_factory.mktemp("epochs")
    out = {}
    for name, per_class, fmt in (("long", 128, "npy"), ("tiny", 2, "npy"), ("lmdb", 16, "lmdb")):
        make_image_folder(base / f"{name}-jpeg", num_classes=4, per_class=per_class, sizes=((40, 40),))
        out[name] = base / name
        assert main(["preprocess", "images", str(base / f"{name}-jpeg"), str(out[name]), "--size", "32", "--format",
                     fmt, "--workers", "1", "--quiet"]) == 0
    return out


def step_times(model: str, batch: int, side: int = 32) -> list[float]:
    """5 training steps of ``model`` on the CPU (this machine, now), sorted: the yardstick the slowed stages
    below are sized against, so that each verdict holds by a wide margin however busy the cores are."""
    import torch

    from fastdata.cli.timing import ModelStep

    net = ModelStep(model, 4, torch.device("cpu"))
    x, y = torch.randn(batch, 3, side, side).contiguous(memory_format=net.fmt), torch.randint(0, 4, (batch,))
    net.step(x, y)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        net.step(x, y)
        times.append(time.perf_counter() - t)
    return sorted(times)


def bench_json(data, tmp_path, capsys, *extra: str, batch: int = BATCH, threads: int = 2) -> tuple[dict, str]:
    out = tmp_path / f"{data.name}.json"
    assert main(["bench", str(data), "--device", "cpu", "--batch-size", str(batch), "--threads", str(threads),
                 "--quiet", "--json", str(out), *extra]) == 0
    return json.loads(out.read_text()), capsys.readouterr().out


def slow(monkeypatch, cls, name: str, seconds_each: Callable[[tuple], float]) -> None:
    """Make ``cls.name`` sleep ``seconds_each(args)`` first: a disk or a decoder that slow, without taking the
    cores the model step needs (a sleep yields them), so the stage's rate is what the sleep makes it."""
    real = getattr(cls, name)

    def slowed(self, *args, **kwargs):
        time.sleep(seconds_each(args))
        return real(self, *args, **kwargs)
    monkeypatch.setattr(cls, name, slowed)


def test_a_jpeg_store_whose_decoding_cannot_feed_the_model_is_named_decode_bound(epochs, tmp_path, capsys,
                                                                                monkeypatch):
    from fastdata.imaging.decode_batch import BatchDecoder

    # A batch takes 16 typical model steps to decode, on each of 2 threads: decoding bounds the pipeline 8x
    # over. Small batches: a stage is timed over at least 2 of them (at most 1 s each: a step of ~5 ms takes
    # 60 ms only while the cores are swamped).
    per_image = min(16 * step_times("cnn-small", 4)[2] / 4, 0.25)
    slow(monkeypatch, BatchDecoder, "decode", lambda args: per_image * len(args[0]))
    report, text = bench_json(epochs["lmdb"], tmp_path, capsys, "--model", "cnn-small", "--seconds", "3", batch=4)
    assert report["bottleneck"] == "decode" and report["bound_stage"] == "FastLoader", text
    assert "JPEG decoding in FastLoader's 2 threads" in text and "[decode-bound]" in text
    assert report["stages"]["FastLoader"]["images_per_s"] < report["ceiling_images_per_s"]
    assert any("JPEG decoding bounds the pipeline" in t for t in report["advice"])


def test_a_model_slower_than_its_data_is_named_model_bound(epochs, tmp_path, capsys):
    # resnet18 trains on ~10-100 images/s on 2 busy cores; the loader gathers 32 px images at ~10^5 a second
    report, text = bench_json(epochs["long"], tmp_path, capsys, "--model", "resnet18", "--seconds", "3")
    assert report["bottleneck"] == "model" and "model compute (the data pipeline keeps up)" in text, text
    assert "[model-bound]" in text and report["stages"]["FastLoader"]["images_per_s"] > report["ceiling_images_per_s"]


def test_tiny_epochs_give_the_verdict_of_long_ones(epochs, tmp_path, capsys, monkeypatch):
    # Each batch takes half a typical model step to read, on each of 16 threads: the loader outpaces the model
    # 32x in steady state, and one thread alone 2x. Before, a dataset of one batch an epoch paid an epoch start
    # (the first batch read from nothing) before every step: a ~33% "data stall" and the verdict "data
    # latency"; its long-epoch twin said "model compute". (resnet18: its step dwarfs the CPU transforms, which
    # the step waits for too.)
    from fastdata.datasets.images import FastDataset

    read = step_times("resnet18", 8)[2] / 2
    slow(monkeypatch, FastDataset, "get_batch", lambda args: read)
    verdicts, texts = {}, []
    for name in ("tiny", "long"):
        report, text = bench_json(epochs[name], tmp_path, capsys, "--model", "resnet18", "--seconds", "3",
                                  batch=8, threads=16)
        verdicts[name] = report["bottleneck"], report["bound_by"]
        texts.append(text)
        assert report["epoch_starts_excluded"] >= 2 and "epoch starts excluded" in text
    expected = ("model", "model compute (the data pipeline keeps up)")
    assert verdicts["tiny"] == verdicts["long"] == expected, f"read {read:.3f} s\n" + "\n".join(texts)


def test_the_data_pipeline_alone_is_benched_with_model_none(epochs, tmp_path, capsys):
    report, text = bench_json(epochs["long"], tmp_path, capsys, "--model", "none", "--storage", "ram", "--seconds",
                              "1.5", "--pageable")
    assert report["ceiling_images_per_s"] is None and report["model"] == "none" and not report["pinned"]
    assert report["bottleneck"] in ("loader", "transforms") and "data stall: - (no model step)" in text
    assert "model step" not in " ".join(report["stages"]) and report["storage"] == "ram"


@pytest.mark.parametrize("rates, kind", [
    ({"FastLoader": 500, "pinned": 9e4, "pageable": 9e4, "transforms": 9e4}, "decode"),
    ({"FastLoader": 9e4, "pinned": 9e4, "pageable": 800, "transforms": 9e4}, "h2d"),
    ({"FastLoader": 9e4, "pinned": 9e4, "pageable": 9e4, "transforms": 700}, "transforms"),
    ({"FastLoader": 9e4, "pinned": 9e4, "pageable": 9e4, "transforms": 9e4}, "model"),
])
def test_the_verdict_names_the_slowest_stage_the_pipeline_runs(rates, kind):
    from fastdata.cli import bench

    # a GPU pipeline copying from pageable memory (the pinned copy is measured, but not in the pipeline)
    names = {"FastLoader": bench.LOADER, "pinned": bench.PINNED, "pageable": bench.PAGEABLE,
             "transforms": "GPU transforms (normalise + flip)"}
    stages = {names[k]: {"images_per_s": v, "gb_per_s": v * 2e-4} for k, v in rates.items()}
    stages[bench.FULL] = {"images_per_s": min(min(rates.values()), 1000.0)}
    report = {"stages": stages, "ceiling_images_per_s": 1000.0, "data_stall_pct": 0.0, "decodes": True,
              "num_threads": 4, "pipeline_stages": [bench.LOADER, bench.PAGEABLE, names["transforms"]]}
    assert bench.verdict(report)[0] == kind
    report["pipeline_stages"][1] = bench.PINNED  # the same figures, pinned copies: the pageable ones do not count
    assert bench.verdict(report)[0] == ("model" if kind == "h2d" else kind)


def test_repeat_serves_the_dataset_over_and_over_in_one_epoch_and_plain_copies_convert(epochs):
    import numpy as np
    import torch

    from fastdata.cli.timing import PlainCopies, Repeat, steady_pipeline
    from fastdata.gpu.prefetch import CUDAPrefetcher

    ds = FastDataset(epochs["tiny"])
    rep = Repeat(ds)
    assert len(rep) >= 1 << 20 and len(rep) % len(ds) == 0 and rep.sample_shape == ds.sample_shape
    x, y = rep.get_batch(np.array([3, len(ds) + 3, 5 * len(ds) + 1]))
    bx, by = ds.get_batch(np.array([1, 3, 3]))
    assert torch.equal(x, bx) and torch.equal(y, by)  # i % len(ds), sorted
    loader = FastLoader(rep, 4, num_threads=2)
    assert len(loader) == len(rep) // 4  # one epoch spans the dataset's 2^20 / 8 epochs
    convert = CUDAPrefetcher([], device="cpu")
    first = next(iter(PlainCopies(loader, torch.device("cpu"), convert.convert)))
    assert first[0].dtype == torch.float32 and first[0].shape == (4, 3, 32, 32) and first[1].dtype == torch.int64
    r = steady_pipeline(PlainCopies(loader, torch.device("cpu"), convert.convert), 0.5, skip=2)
    assert r["epoch_starts"] == 1 and r["images_per_s"] > 0 and 0 <= r["stall_pct"] <= 100
