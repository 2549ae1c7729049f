"""fastdata bench: stage report, bottleneck diagnosis of user loaders, autotune, JSON, bad input."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import pytest

from fastdata.cli.main import main
from fastdata.datasets.images import FastDataset
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


@pytest.mark.parametrize("spec, needle", [("myloaders:broken", "raised ValueError: no such bucket"),
                                          ("myloaders:not_iterable", "not iterable"),
                                          ("nosuchmodule:f", "cannot import 'nosuchmodule'"),
                                          ("myloaders", "module:factory")])
def test_bad_loader_factories_are_one_line_errors(user_loaders, spec, needle):
    r = subprocess.run([sys.executable, "-m", "fastdata", "bench", "--loader", spec, "--seconds", "1", "--device",
                        "cpu"], capture_output=True, text=True, timeout=120, cwd=user_loaders)
    assert r.returncode == 1 and "Traceback" not in r.stderr and needle in r.stderr, r.stderr


def test_missing_dataset_is_a_clear_error(tmp_path):
    r = subprocess.run([sys.executable, "-m", "fastdata", "bench", str(tmp_path / "nope"), "--device", "cpu"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr and "not a folder" in r.stderr


@pytest.mark.parametrize("extra, needle", [(["--batch-size", "0"], "batch_size=0"),
                                           (["--seconds", "-1"], "seconds=-1.0"),
                                           (["--autotune", "--batch-size", "-2"], "batch_size=-2")])
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
