"""The training loop with real processes: DDP equivalence, accumulation, kill + resume, stops, checkpoints."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import disk_of, torchrun, torchrun_cmd

from fastdata.cli.main import main
from fastdata.datasets.images import FastDataset
from fastdata.errors import ConfigError
from fastdata.gpu.prefetch import CUDAPrefetcher
from fastdata.loading.loader import FastLoader
from fastdata.train.config import TrainConfig, parse_duration
from fastdata.train.models import create_model
from fastdata.train.trainer import Trainer

WORKER = Path(__file__).parent / "dist_train_worker.py"


def worker(tmp_path: Path, data: Path, nproc: int, batch: int, accum: int, steps: int = 5, *checkpoint: str,
           name: str = "") -> dict:
    """The worker's rank-0 weights; ``checkpoint``: its checkpoint folder [and "resume"]; ``name``: its files'."""
    out = tmp_path / (name or f"w{nproc}-b{batch}-a{accum}-s{steps}.pt")
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}  # a crash in a rank prints every thread's Python stack
    r = torchrun(nproc, str(WORKER), str(data), str(out), str(batch), str(accum), str(steps), *checkpoint, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    if name:
        (tmp_path / f"{name}.stderr").write_text(r.stderr)
    return torch.load(out, weights_only=True)


@pytest.mark.distributed
@pytest.mark.slow
def test_two_ranks_at_half_batch_equal_one_rank_at_full_batch(indexed_datasets, tmp_path):
    one = worker(tmp_path, indexed_datasets["npy"], 1, 16, 1)
    two = worker(tmp_path, indexed_datasets["npy"], 2, 8, 1)
    start = worker(tmp_path, indexed_datasets["npy"], 1, 16, 1, steps=1)
    for k in one:
        assert torch.allclose(one[k], two[k], atol=1e-6), k
    assert not torch.allclose(one["1.weight"], start["1.weight"])  # the runs really moved the weights
    val = {name: [json.loads((tmp_path / f"{name}.pt.val{r}.json").read_text()) for r in range(n)]
           for name, n in (("w1-b16-a1-s5", 1), ("w2-b8-a1-s5", 2))}
    assert val["w2-b8-a1-s5"][0] == val["w2-b8-a1-s5"][1]  # reduced across ranks: both ranks report the same
    assert val["w2-b8-a1-s5"][0]["val_loss"] == pytest.approx(val["w1-b16-a1-s5"][0]["val_loss"], abs=1e-6)
    worker(tmp_path, indexed_datasets["npy"], 3, 5, 1, steps=1)  # 100 val samples on 3 ranks: 34, 33, 33
    three = [json.loads((tmp_path / f"w3-b5-a1-s1.pt.val{r}.json").read_text())["initial"] for r in range(3)]
    assert three[0] == three[1] == three[2]
    for key in ("val_loss", "val_accuracy"):  # exactly once per sample: no padded repeats in the metrics
        assert three[0][key] == pytest.approx(val["w1-b16-a1-s5"][0]["initial"][key], abs=1e-6)


@pytest.mark.distributed
@pytest.mark.slow
def test_epochs_that_end_mid_accumulation_keep_two_ranks_equal_to_one_big_batch(indexed_datasets, tmp_path):
    """5 epochs of 100 samples: 7 steps each, the last of 4 samples. Two ranks at batch 2 with accum 4 end an
    epoch after 1 of 4 micro-batches, whose backward ran under no_sync(): that step used each rank's own
    gradients and the replicas drifted apart; now it is averaged over ranks, as one batch of those samples."""
    one = worker(tmp_path, indexed_datasets["npy"], 1, 16, 1, steps=100)
    two = worker(tmp_path, indexed_datasets["npy"], 2, 2, 4, steps=100)
    for k in one:
        assert torch.allclose(one[k], two[k], atol=1e-5), k


@pytest.mark.distributed
@pytest.mark.slow
def test_each_rank_resumes_its_own_random_state_and_another_world_size_rank_0s(indexed_datasets, tmp_path):
    """Ranks seeded apart (a dropout mask of their own each): every rank resumed rank 0's random state, so the
    resumed run's masks, and weights, drifted from a run never stopped (0.11 on a Linear's weights)."""
    data, ck = indexed_datasets["npy"], str(tmp_path / "ck")

    def draws(name: str, ranks: int) -> list[list[float]]:
        return [json.loads((tmp_path / f"{name}.pt.val{r}.json").read_text())["draws"] for r in range(ranks)]

    straight = worker(tmp_path, data, 2, 8, 1, 6, str(tmp_path / "ck-straight"), name="straight.pt")
    worker(tmp_path, data, 2, 8, 1, 3, ck, name="cut.pt")
    saved = torch.load(Path(ck) / "checkpoint.pt", weights_only=True)
    resumed = worker(tmp_path, data, 2, 8, 1, 6, ck, "resume", name="resumed.pt")
    assert draws("resumed", 2) == draws("straight", 2) and draws("straight", 2)[0] != draws("straight", 2)[1]
    for k in straight:
        assert torch.equal(straight[k], resumed[k]), k
    assert len(saved["rng_ranks"]) == 2 and torch.equal(saved["rng"]["torch"], saved["rng_ranks"][0]["torch"])
    assert not torch.equal(saved["rng_ranks"][0]["torch"], saved["rng_ranks"][1]["torch"])
    assert "holds the random states" not in (tmp_path / "resumed.pt.stderr").read_text()
    worker(tmp_path, data, 1, 16, 1, 8, ck, "resume", name="alone.pt")  # another world size: rank 0's, said once
    said = (tmp_path / "alone.pt.stderr").read_text()
    assert said.count("holds the random states of 2 rank(s), this run has 1: every rank resumes rank 0's") == 1, said


@pytest.mark.slow
def test_accumulation_equals_one_big_step(indexed_datasets, tmp_path):
    big = worker(tmp_path, indexed_datasets["npy"], 1, 16, 1)
    accumulated = worker(tmp_path, indexed_datasets["npy"], 1, 4, 4)
    for k in big:
        assert torch.allclose(big[k], accumulated[k], atol=1e-6), k


@pytest.fixture(scope="module")
def small_images(tmp_path_factory) -> Path:
    from fastdata.cli.synthetic import make_image_folder

    base = tmp_path_factory.mktemp("train")
    make_image_folder(base / "src", num_classes=3, per_class=16, sizes=((48, 40),))
    assert main(["preprocess", "images", str(base / "src"), str(base / "ds"), "--size", "32", "--workers", "1",
                 "--quiet"]) == 0
    return base / "ds"


def train_args(data: Path, *extra: str) -> list[str]:
    return ["train", str(data), "--model", "cnn-small", "--batch-size", "8", "--lr", "0.05", "--device", "cpu",
            "--quiet", *extra]


def load_ckpt(folder: Path) -> dict:
    return torch.load(folder / "checkpoint.pt", weights_only=True)  # no pickled code: loads weights-only


@pytest.mark.distributed
@pytest.mark.slow
def test_fastdata_train_under_torchrun(small_images, tmp_path):
    """The command the README gives for DDP: both ranks train and leave cleanly; rank 0 alone logs and saves."""
    log, ck = tmp_path / "log.jsonl", tmp_path / "ck"
    args = train_args(small_images, "--max-steps", "4", "--epochs", "10", "--val-fraction", "0.25",
                      "--checkpoint", str(ck), "--log-file", str(log))
    r = torchrun(2, "-m", "fastdata", *args, env={**os.environ, "PYTHONFAULTHANDLER": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    events = [json.loads(line) for line in log.read_text().splitlines()]
    ends = [e for e in events if e.get("event") == "end"]
    assert len(ends) == 1 and ends[0]["reason"] == "max_steps" and ends[0]["step"] == 4  # one writer: rank 0
    assert load_ckpt(ck)["step"] == 4 and load_ckpt(ck)["epoch"] == 1  # 36 train images, 18 a rank: 3 steps an epoch




@pytest.mark.remote
def test_checkpoint_uploads_to_a_url_go_on_while_training_does(s3, proxy, small_images):
    """NOTE [checkpoint generations] rule 5: while the save of step 2 is held mid-upload, training goes on to
    the next save, which waits for it; fit() returns once the last upload is in the store."""
    import io

    t, run, raised = _fit_with_its_first_upload_held(s3("uploads") + "/run", proxy, small_images)
    try:
        deadline = time.monotonic() + 60
        while t.step < 4 and time.monotonic() < deadline and run.is_alive():
            time.sleep(0.01)
        assert t.step == 4, (t.step, raised)  # trained on past the save of step 2 while its upload was held
        time.sleep(0.3)
        assert t.step == 4  # the save of step 4 waits for the upload before it: one at a time
    finally:
        proxy.unstall.set()
    run.join(120)
    assert not run.is_alive() and raised == []

    def saved(key: str) -> dict:
        data = s3.client.get_object(Bucket="uploads", Key=key)["Body"].read()
        return torch.load(io.BytesIO(data), weights_only=True)
    assert saved("run/checkpoint.pt")["step"] == 6 and saved("run/checkpoint.prev.pt")["step"] == 4
    keys = sorted(o["Key"] for o in s3.client.list_objects_v2(Bucket="uploads")["Contents"])
    assert keys == ["run/checkpoint.prev.pt", "run/checkpoint.pt"]  # no upload left behind


@pytest.mark.remote
def test_a_run_that_fails_still_lands_the_checkpoint_on_its_way(s3, proxy, small_images):
    """An error (or Ctrl-C) while the save of step 2 uploads: fit() waits for the upload before it raises, so
    the store holds what the run saved, as a folder would (the upload thread would die with the process)."""
    import io

    calls = []

    def loss(out, y):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("a NaN check, say")
        return torch.nn.functional.cross_entropy(out, y)
    t, run, raised = _fit_with_its_first_upload_held(s3("fails") + "/run", proxy, small_images, loss)
    try:
        deadline = time.monotonic() + 60
        while len(calls) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        run.join(1.0)
        assert run.is_alive()  # the error is raised once the upload on its way has landed
    finally:
        proxy.unstall.set()
    run.join(120)
    assert [type(e) for e in raised] == [RuntimeError] and t.step == 2
    data = s3.client.get_object(Bucket="fails", Key="run/checkpoint.pt")["Body"].read()
    assert torch.load(io.BytesIO(data), weights_only=True)["step"] == 2


def test_a_checkpoint_folder_given_as_a_path_saves_and_resumes(small_images, tmp_path):
    """TrainConfig(checkpoint_dir=Path(...)): kept as a string, so the checkpoint holds no pickled class."""
    loader = CUDAPrefetcher(FastLoader(FastDataset(small_images), 8), device="cpu")
    cfg = TrainConfig(max_steps=2, checkpoint_dir=tmp_path / "ck", progress=False, device="cpu")
    assert cfg.checkpoint_dir == str(tmp_path / "ck")
    Trainer(create_model("cnn-small", num_classes=3), loader, config=cfg).fit()
    resumed = Trainer(create_model("cnn-small", num_classes=3), loader, config=TrainConfig(
        max_steps=3, checkpoint_dir=tmp_path / "ck", resume=True, progress=False, device="cpu"))
    resumed.fit()
    assert resumed.step == 3 and load_ckpt(tmp_path / "ck")["config"]["checkpoint_dir"] == str(tmp_path / "ck")


def _fit_with_its_first_upload_held(url: str, proxy, data: Path, loss_fn=None):
    """A Trainer saving every 2 of 6 steps to ``url``, fitting on a thread of its own, once the upload of its
    first save is held at the fault proxy; ``(trainer, thread, what fit raised)``."""
    import threading

    loader = CUDAPrefetcher(FastLoader(FastDataset(data), 8), device="cpu")
    t = Trainer(create_model("cnn-small", num_classes=3), loader, loss_fn=loss_fn, config=TrainConfig(
        max_steps=6, checkpoint_every=2, checkpoint_dir=url, progress=False, device="cpu"))
    proxy.inject("stall", r"/run/checkpoint\.pt\.uploading$")
    raised: list = []
    run = threading.Thread(target=_catch, args=(t.fit, raised))
    run.start()
    if not proxy.stalled.wait(60):
        proxy.unstall.set()
        run.join(60)
        raise AssertionError(f"no upload was held: {raised}")
    return t, run, raised


def _catch(fn, raised: list) -> None:
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - the test thread reports it
        raised.append(exc)

@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.remote
def test_torchrun_ranks_checkpoint_to_a_url_and_resume_from_it_at_another_world_size(s3, small_images, tmp_path):
    """Two ranks save to the store; three ranks with nothing local (another machine) resume from it: rank 0
    reads the store and the others get its bytes, so every rank goes on from the same step."""
    import io

    url = s3("ddp-ck") + "/run"
    log = tmp_path / "log.jsonl"
    common = ["--epochs", "10", "--val-fraction", "0.25", "--checkpoint", url, "--log-file", str(log), "--log-every",
              "1"]
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, "PYTHONFAULTHANDLER": "1", "TMPDIR": str(tmp_path / "tmp")}
    r = torchrun(2, "-m", "fastdata", *train_args(small_images, "--max-steps", "4", *common), env=env)
    assert r.returncode == 0, r.stderr[-3000:]

    def saved() -> dict:
        data = s3.client.get_object(Bucket="ddp-ck", Key="run/checkpoint.pt")["Body"].read()
        return torch.load(io.BytesIO(data), weights_only=True)
    assert saved()["step"] == 4 and saved()["epoch"] == 1  # 36 train images, 18 a rank: 3 steps an epoch
    r = torchrun(3, "-m", "fastdata", *train_args(small_images, "--max-steps", "6", *common, "--resume"), env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    events = [json.loads(line) for line in log.read_text().splitlines()]
    ends = [k for k, e in enumerate(events) if e.get("event") == "end"]
    assert [(events[k]["reason"], events[k]["step"]) for k in ends] == [("max_steps", 4), ("max_steps", 6)]
    steps = [[e["step"] for e in part if "loss" in e] for part in (events[:ends[0]], events[ends[0] + 1:ends[1]])]
    assert steps == [[1, 2, 3, 4], [5, 6]], steps  # the second run went on from the store's step 4
    assert saved()["step"] == 6
    assert list((tmp_path / "tmp").glob("fastdata-checkpoint-*")) == []  # every spooled save removed


@pytest.mark.distributed
@pytest.mark.slow
def test_a_save_rank_0_cannot_make_stops_every_rank_at_once_with_its_reason(small_images, tmp_path):
    """A full disk at rank 0's save under torchrun: the other rank stops too, saying why, instead of waiting in
    a barrier for a rank that had raised until the launcher killed it."""
    ck = tmp_path / "ck"
    assert main(train_args(small_images, "--max-steps", "1", "--checkpoint", str(ck))) == 0
    limit = (ck / "checkpoint.pt").stat().st_size // 2  # the next checkpoint, as big, cannot be written
    args = train_args(small_images, "--max-steps", "4", "--epochs", "10", "--checkpoint", str(ck), "--resume")
    began = time.monotonic()
    r = torchrun(2, "-m", "fastdata", *args, preexec_fn=disk_of(limit), timeout=120)
    assert r.returncode != 0
    assert "fastdata: error: no space left while writing" in r.stderr, r.stderr[-3000:]
    assert "fastdata: error: rank 0 could not save the checkpoint: no space left while writing" in r.stderr, \
        r.stderr[-3000:]
    assert time.monotonic() - began < 60  # (torchrun waits 30 s for a worker it has to stop)

@pytest.mark.slow
def test_killed_run_resumes_to_the_same_weights(small_images, tmp_path):
    common = ["--epochs", "100", "--max-steps", "40", "--checkpoint-every", "2", "--augment", "crop-flip",
              "--model", "resnet18"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    assert main(train_args(small_images, *common, "--checkpoint", str(ref))) == 0
    proc = subprocess.Popen([sys.executable, "-m", "fastdata", *train_args(small_images, *common, "--checkpoint",
                                                                           str(run))],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    step, deadline = 0, time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            step = load_ckpt(run)["step"]
        except Exception:  # noqa: BLE001 - not written yet
            step = 0
        if step >= 8:
            break
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = load_ckpt(run)["step"]
    assert 8 <= killed_at < 40, "the run finished before it could be killed"
    assert load_ckpt(run)["loader"]["position"] > 0 or killed_at % 6 == 0  # mid-epoch (6 steps an epoch)
    assert main(train_args(small_images, *common, "--checkpoint", str(run), "--resume")) == 0
    a, b = load_ckpt(ref), load_ckpt(run)
    assert a["step"] == b["step"] == 40
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k


def test_stops_at_max_steps_and_checkpoint_is_complete(small_images, tmp_path):
    assert main(train_args(small_images, "--max-steps", "7", "--epochs", "50", "--checkpoint", str(tmp_path))) == 0
    ck = load_ckpt(tmp_path)
    assert ck["step"] == 7 and ck["epoch"] == 1  # 6 steps an epoch (48 images / 8)
    assert set(ck) >= {"model", "optimizer", "scheduler", "scaler", "loader", "rng", "epoch", "step", "config"}
    assert ck["loader"]["position"] == 8 and ck["loader"]["epoch"] == 1


def test_a_run_stopped_after_an_epochs_last_step_resumes_into_the_next_epoch(small_images, tmp_path):
    """The checkpoint of a stop after the epoch's last batch (before its iteration ended) holds that epoch with
    nothing left; the resumed run used to serve the finished epoch again."""
    common = ["--epochs", "50", "--schedule", "constant", "--augment", "crop-flip"]
    run, ref = tmp_path / "run", tmp_path / "ref"
    assert main(train_args(small_images, *common, "--max-steps", "6", "--checkpoint", str(run))) == 0
    assert load_ckpt(run)["epoch"] == 0 and load_ckpt(run)["loader"]["position"] == 48  # 6 steps an epoch
    assert main(train_args(small_images, *common, "--max-steps", "9", "--checkpoint", str(run), "--resume")) == 0
    assert main(train_args(small_images, *common, "--max-steps", "9", "--checkpoint", str(ref))) == 0
    a, b = load_ckpt(ref), load_ckpt(run)
    assert (b["epoch"], b["step"], b["loader"]["position"]) == (a["epoch"], a["step"], a["loader"]["position"]) \
        == (1, 9, 24)
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k


def test_stops_at_max_time(small_images, tmp_path):
    t = time.monotonic()
    log = tmp_path / "log.jsonl"
    assert main(train_args(small_images, "--max-time", "1.5", "--epochs", "100000", "--checkpoint", str(tmp_path),
                           "--log-file", str(log))) == 0
    assert time.monotonic() - t < 30
    end = json.loads(log.read_text().splitlines()[-1])
    assert end["reason"] == "max_time" and 1.5 <= end["time_s"] < 10 and load_ckpt(tmp_path)["step"] == end["step"]


def test_early_stopping_on_validation_loss(small_images, tmp_path):
    log = tmp_path / "log.jsonl"
    assert main(train_args(small_images, "--val-fraction", "0.25", "--epochs", "20", "--early-stop-patience", "2",
                           "--early-stop-min-delta", "1e9", "--log-file", str(log))) == 0
    events = [json.loads(line) for line in log.read_text().splitlines()]
    vals = [e for e in events if e["event"] == "val"]
    assert len(vals) == 3 and events[-1]["reason"] == "early_stop" and events[-1]["epoch"] == 3


class Linear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(3 * 32 * 32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.float().flatten(1) / 255)


def test_a_periodic_checkpoint_holds_its_steps_validation(small_images, tmp_path):
    """checkpoint_every was saved before the same step's validation: the checkpoint of step 2 held no best
    loss, and a run resumed from it trained 2 steps more than the uninterrupted one before early stopping."""
    val_loss = {2: 1.0, 4: 2.0, 6: 3.0}  # by step: only step 2's is an improvement
    ds = FastDataset(small_images)

    def run(max_steps, resume: bool) -> Trainer:
        def loss_fn(out, y):
            if trainer.model.training:
                return torch.nn.functional.cross_entropy(out, y)
            return out.sum() * 0 + val_loss[trainer.step]

        cfg = TrainConfig(epochs=1, device="cpu", progress=False, val_every=0, val_every_steps=2,
                          early_stop_patience=1, checkpoint_every=2, checkpoint_dir=str(tmp_path / "ck"),
                          resume=resume, max_steps=max_steps)
        model = Linear()
        trainer = Trainer(model, FastLoader(ds, 4, seed=0), FastLoader(ds, 8, shuffle=False, pad=False),
                          loss_fn=loss_fn, config=cfg)
        trainer.fit()
        return trainer

    run(2, False)  # (as a preemption right after step 2's checkpoint)
    ck = load_ckpt(tmp_path / "ck")
    assert (ck["step"], ck["best"], ck["bad_evals"]) == (2, 1.0, 0)
    resumed = run(None, True)
    assert (resumed.step, resumed.history[-1]["reason"]) == (4, "early_stop")


def _val_steps(trainer: Trainer) -> list[int]:
    return [r["step"] for r in trainer.history if r["event"] == "val"]


class Killed(Exception):
    """The process dying (``kill -9`` after the grace period, an OOM kill): no checkpoint is saved."""


def _owing_run(ds, checkpoints: Path, val_loss: dict[int, float], signum: int = signal.SIGTERM,
               signal_in_step: int = 0, dies_in_step: int = 0, **kwargs) -> Trainer:
    """One epoch of ``ds`` validated every 2 steps with patience 1 (validation losses ``val_loss`` by step),
    checkpointed to ``checkpoints``: ``signum`` sent while step ``signal_in_step`` runs (the preemption
    notice), or the process dying (`Killed`) in step ``dies_in_step``."""
    def loss_fn(out, y):
        if trainer.model.training:
            if trainer.step + 1 == signal_in_step:
                os.kill(os.getpid(), signum)
            if trainer.step + 1 == dies_in_step:
                raise Killed
            return torch.nn.functional.cross_entropy(out, y)
        return out.sum() * 0 + val_loss[trainer.step]

    torch.manual_seed(0)
    cfg = TrainConfig(epochs=1, device="cpu", progress=False, val_every=0, val_every_steps=2, early_stop_patience=1,
                      checkpoint_dir=str(checkpoints), **kwargs)
    trainer = Trainer(Linear(), FastLoader(ds, 4, seed=0), FastLoader(ds, 8, shuffle=False, pad=False),
                      loss_fn=loss_fn, config=cfg)
    with pytest.raises(Killed) if dies_in_step else contextlib.nullcontext():
        trainer.fit()
    return trainer


def test_a_stop_owes_its_steps_validation_and_the_resumed_run_makes_it_first(small_images, tmp_path):
    """SIGTERM during step 2 with val_every_steps=2: the stop saved before step 2's validation, and the resumed
    run went on from step 3, so that validation was never made and early stopping fired at step 6, not 4."""
    val_loss = {2: 1.0, 4: 2.0, 6: 3.0, 8: 4.0}  # by step: only step 2's is an improvement
    ds = FastDataset(small_images)

    def run(folder: str, **kwargs) -> Trainer:
        return _owing_run(ds, tmp_path / folder, val_loss, **kwargs)

    ref = run("ref")
    assert (_val_steps(ref), ref.history[-1]["reason"], ref.step) == ([2, 4], "early_stop", 4)
    cut = run("cut", signal_in_step=2)
    assert (_val_steps(cut), cut.history[-1]["reason"], cut.step) == ([], "signal SIGTERM", 2)
    saved = load_ckpt(tmp_path / "cut")
    resumed = run("cut", resume=True)
    assert (_val_steps(resumed), resumed.history[-1]["reason"], resumed.step) == ([2, 4], "early_stop", 4)
    assert saved["val_due"] is True
    for k, v in ref.model.state_dict().items():
        assert torch.equal(v, resumed.model.state_dict()[k]), k

    # a signal during the last step (--max-steps 2): the ended run makes that step's validation, as a run never
    # stopped did there, once; a larger --max-steps then goes on to stop early at step 4
    run("last", signal_in_step=2, max_steps=2)
    ended = run("last", resume=True, max_steps=2)
    assert (_val_steps(ended), ended.history[-1]["reason"]) == ([2], "max_steps")
    assert load_ckpt(tmp_path / "last")["val_due"] is False  # (saved: made once)
    assert _val_steps(run("last", resume=True, max_steps=2)) == []
    more = run("last", resume=True)
    assert (_val_steps(more), more.history[-1]["reason"], more.step) == ([4], "early_stop", 4)


def test_a_stop_at_an_epochs_partial_last_step_owes_the_epochs_validation(small_images, tmp_path):
    """48 images at batch 4 and accum 5: 12 micro-batches an epoch, so its last step (3) is a partial one. A
    SIGTERM during it saved the step past the epoch's end, before the epoch's validation, which the resumed run
    never made; nor did a run resumed with a larger --max-steps after --max-steps 3 ended there."""
    ds = FastDataset(small_images)

    def run(folder: str, signal_in_micro: int = 0, **kwargs) -> Trainer:
        micros = [0]

        def loss_fn(out, y):
            if trainer.model.training:
                micros[0] += 1
                if micros[0] == signal_in_micro:
                    os.kill(os.getpid(), signal.SIGTERM)
                return torch.nn.functional.cross_entropy(out, y)
            return out.sum() * 0 + 1.0

        torch.manual_seed(0)
        cfg = TrainConfig(epochs=2, accum=5, schedule="constant", device="cpu", progress=False,
                          checkpoint_dir=str(tmp_path / folder), **kwargs)
        trainer = Trainer(Linear(), FastLoader(ds, 4, seed=0), FastLoader(ds, 8, shuffle=False, pad=False),
                          loss_fn=loss_fn, config=cfg)
        trainer.fit()
        return trainer

    def vals(t: Trainer) -> list[tuple[int, int]]:
        return [(r["epoch"], r["step"]) for r in t.history if r["event"] == "val"]

    ref = run("ref")
    assert vals(ref) == [(1, 3), (2, 6)]
    cut = run("cut", signal_in_micro=12)
    assert (vals(cut), cut.history[-1]["reason"]) == ([], "signal SIGTERM")
    ck = load_ckpt(tmp_path / "cut")
    short = run("short", max_steps=3)
    assert (vals(short), short.history[-1]["reason"]) == ([], "max_steps")
    assert vals(run("short", resume=True, max_steps=3)) == []  # ended: as the run with --max-steps 3 did
    for folder in ("cut", "short"):
        resumed = run(folder, resume=True)
        assert (vals(resumed), resumed.history[-1]["reason"]) == ([(1, 3), (2, 6)], "epochs"), folder
        for k, v in ref.model.state_dict().items():
            assert torch.equal(v, resumed.model.state_dict()[k]), (folder, k)
    assert (ck["epoch"], ck["step"], ck["val_due"]) == (1, 3, True)


def test_the_owed_validation_is_saved_at_once_and_a_second_preemption_does_not_repeat_it(small_images, tmp_path):
    """SIGUSR1 during step 2 (val_every_steps=2) owed step 2's validation; the resumed run made it, then died in
    step 3, before its next checkpoint: that checkpoint still said owed, and the next resume made step 2's
    validation again (its result, the best loss, was lost meanwhile)."""
    val_loss = {2: 1.0, 4: 2.0, 6: 3.0}  # by step: only step 2's is an improvement
    ds = FastDataset(small_images)

    def run(folder: str, **kwargs) -> Trainer:
        return _owing_run(ds, tmp_path / folder, val_loss, signal.SIGUSR1, **kwargs)

    ref = run("ref")
    cut = run("cut", signal_in_step=2)
    assert (_val_steps(cut), cut.history[-1]["reason"], load_ckpt(tmp_path / "cut")["val_due"]) == (
        [], "signal SIGUSR1", True)
    died = run("cut", dies_in_step=3, resume=True)
    assert _val_steps(died) == [2]
    ck = load_ckpt(tmp_path / "cut")
    assert (ck["step"], ck["val_due"], ck["val_step"], ck["best"], ck["bad_evals"]) == (2, False, 2, 1.0, 0)
    again = run("cut", resume=True)
    assert (_val_steps(again), again.history[-1]["reason"], again.step) == ([4], "early_stop", 4)
    for k, v in ref.model.state_dict().items():
        assert torch.equal(v, again.model.state_dict()[k]), k


def test_bf16_autocast_on_cpu_and_metrics_log(small_images, tmp_path):
    log = tmp_path / "log.jsonl"
    assert main(train_args(small_images, "--amp", "bf16", "--epochs", "2", "--log-every", "2",
                           "--log-file", str(log))) == 0
    train = [json.loads(line) for line in log.read_text().splitlines() if '"train"' in line]
    assert train and all(0 < r["loss"] < 10 and 0 <= r["data_stall_pct"] <= 100 for r in train)
    assert {"samples_per_s", "lr", "accuracy", "step"} <= set(train[0]) and "tokens_per_s" not in train[0]


def test_learning_rate_schedules_and_weight_decay_groups():
    from fastdata.train.config import lr_lambda, param_groups

    cos = lr_lambda(TrainConfig(warmup_steps=10), 110)
    assert cos(0) == pytest.approx(0.1) and cos(9) == pytest.approx(1.0) and cos(60) == pytest.approx(0.5)
    assert cos(110) == pytest.approx(0.0, abs=1e-9)
    one = lr_lambda(TrainConfig(schedule="onecycle"), 100)
    assert one(0) < 0.1 and one(30) == pytest.approx(1.0) and one(100) == pytest.approx(0.0, abs=1e-9)
    groups = param_groups(create_model("cnn-small", num_classes=3), 0.1)
    assert all(p.ndim > 1 for p in groups[0]["params"]) and all(p.ndim <= 1 for p in groups[1]["params"])
    assert groups[1]["weight_decay"] == 0.0
    assert parse_duration("00:12:00:00") == 12 * 3600 and parse_duration("1:30") == 90


def test_label_smoothing_and_sync_bn_on_cpu(small_images):
    import torch.nn.functional as F

    loader = CUDAPrefetcher(FastLoader(FastDataset(small_images), 8), device="cpu")
    t = Trainer(create_model("cnn-small", num_classes=3), loader,
                config=TrainConfig(label_smoothing=0.2, progress=False, device="cpu"))
    out, y = torch.randn(5, 3), torch.tensor([0, 1, 2, 1, 0])
    assert t.loss_fn(out, y) == pytest.approx(float(F.cross_entropy(out, y, label_smoothing=0.2)))
    assert t.loss_fn(out, y) != pytest.approx(float(F.cross_entropy(out, y)))
    with pytest.raises(ConfigError, match="SyncBatchNorm has no CPU kernel"):
        Trainer(create_model("cnn-small", num_classes=3), loader,
                config=TrainConfig(sync_bn=True, progress=False, device="cpu"))


def test_clipping_and_accumulation_in_python(small_images):
    torch.manual_seed(0)
    loader = CUDAPrefetcher(FastLoader(FastDataset(small_images), 8), device="cpu")
    t = Trainer(create_model("cnn-small", num_classes=3), loader,
                config=TrainConfig(max_steps=3, accum=2, clip=0.5, progress=False, device="cpu"))
    t.fit()
    assert t.step == 3 and all(p.grad is None for p in t.model.parameters())  # zero_grad(set_to_none=True)


def _a_file(t: Path) -> str:
    (t / "f").write_text("x")
    return str(t / "f")


BAD_TRAIN_ARGS = {  # name: (flags after the dataset's, a function of tmp_path giving them, what the error says)
    "missing dataset": (lambda t: None, "not a folder"),
    "unknown model": (lambda t: ["--model", "vgg99"], "unknown model 'vgg99'"),
    "fp16 on the CPU": (lambda t: ["--amp", "fp16"], "--amp fp16 needs a CUDA device"),
    # these two failed at the first save, an epoch in, with a NotADirectoryError traceback
    "checkpoint folder is a file": (lambda t: ["--checkpoint", _a_file(t)], "is a file: give --checkpoint a folder"),
    "checkpoint folder under a file": (lambda t: ["--checkpoint", _a_file(t) + "/sub"],
                                       "cannot create checkpoint folder"),
    "negative checkpoint_every": (lambda t: ["--checkpoint-every", "-1"], "checkpoint_every must be 0 or a positive"),
    "negative warm-up": (lambda t: ["--warmup-steps", "-3"], "warmup_steps must be 0 or a positive"),  # lr < 0
    # an unset "$CKPT" in a job script: before, no checkpoints at all, silently
    "empty checkpoint": (lambda t: ["--checkpoint", ""], "checkpoint_dir must be a folder or a URL"),
    "checkpoint at an HTTP URL": (lambda t: ["--checkpoint", "https://host/run"], "an HTTP server cannot hold"),
    "checkpoint URL with a pattern": (lambda t: ["--checkpoint", "s3://bucket/lr*0.1"], "patterns to fsspec"),
    # these two were ignored without a word: no --val or --val-fraction, so nothing to validate on
    "validation steps without validation data": (lambda t: ["--val-every-steps", "2"],
                                                 "--val-every-steps 2 (val_every_steps) needs validation data"),
    "early stopping without validation data": (lambda t: ["--early-stop-patience", "3"],
                                               "--early-stop-patience 3 (early_stop_patience) needs validation data"),
}


@pytest.mark.parametrize("case", BAD_TRAIN_ARGS)
def test_bad_input_is_one_clear_line_before_training(small_images, tmp_path, case):
    flags, needle = BAD_TRAIN_ARGS[case]
    extra = flags(tmp_path)
    args = ["train", "/nonexistent/data"] if extra is None else train_args(small_images, "--epochs", "100000", *extra)
    r = subprocess.run([sys.executable, "-m", "fastdata", *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr and needle in r.stderr, r.stderr


def test_images_too_small_for_the_model_are_refused_before_training(indexed_datasets, capsys):
    args = ["train", str(indexed_datasets["npy"]), "--device", "cpu", "--max-steps", "1", "--quiet"]
    assert main([*args, "--model", "cnn-small"]) == 1  # 8x8 images pool down to nothing in four 2x2 max-pools
    err = capsys.readouterr().err
    assert "cnn-small needs images of at least 16x16" in err and "8x8" in err, err
    assert main([*args, "--model", "resnet18", "--batch-size", "8"]) == 0  # its padded convs take any size


def test_loaders_made_for_another_number_of_ranks_are_refused_and_torchrun_without_a_group_warns(
        small_images, monkeypatch):
    """A loader made before init_distributed under torchrun was dealt to 1 rank: every rank trained on the
    whole epoch, silently. The Trainer refuses a loader dealt to other ranks than its run has."""
    from fastdata.loading.sampler import DistributedBatchSampler

    ds = FastDataset(small_images)
    cfg = TrainConfig(epochs=1, device="cpu", progress=False)
    from fastdata.train.trainer import check_ranks

    mine = [FastLoader(ds, 8, rank=r, world_size=2) for r in (0, 1)]
    check_ranks(mine[0], FastLoader(ds, 8, rank=0, world_size=1, pad=False), 2)  # each rank the whole val set
    check_ranks(mine[1], FastLoader(ds, 8, rank=1, world_size=2, pad=False), 2)
    with pytest.raises(ConfigError, match=r"training loader deals its data to 1 rank\(s\), this run has 2"):
        check_ranks(FastLoader(ds, 8, rank=0, world_size=1), None, 2)  # (made before init_distributed)
    for train, val in ((FastLoader(ds, 8, rank=1, world_size=2), None),
                       (FastLoader(ds, 8), FastLoader(ds, 8, rank=0, world_size=2, pad=False)),
                       (torch.utils.data.DataLoader(ds, batch_sampler=DistributedBatchSampler(48, 8, rank=0,
                                                                                           world_size=4)), None)):
        with pytest.raises(ConfigError, match=r"loader deals its data to [24] rank\(s\), this run has 1"):
            Trainer(Linear(), train, val, config=cfg)
    monkeypatch.setenv("WORLD_SIZE", "4")  # (torchrun's, without a process group joined)
    with pytest.warns(UserWarning, match="torchrun started 4 processes but none has joined a process group") as w:
        FastLoader(ds, 8)
    assert w[0].filename == __file__  # (the user's line, not fastdata's)


def test_a_training_loader_without_batches_is_refused(small_images):
    """drop_last with a batch larger than the data: before, every epoch ended at once and fit() 'finished'."""
    loader = FastLoader(FastDataset(small_images), 64, drop_last=True)
    assert len(loader) == 0
    with pytest.raises(ConfigError, match="serves no batch"):
        Trainer(create_model("cnn-small", num_classes=3), loader, config=TrainConfig(device="cpu", epochs=2))


def test_a_loader_without_len_trains_for_max_steps_and_is_refused_without_them(small_images, tmp_path):
    """A DataLoader of an IterableDataset (a WebDataset-style stream) has no len(): max_steps gives the run its
    length; before, Trainer failed with TypeError whatever the settings."""
    from torch.utils.data import DataLoader, IterableDataset

    ds = FastDataset(small_images)

    class Stream(IterableDataset):
        def __iter__(self):
            for i in range(len(ds)):
                x, y = ds[i]
                yield x.permute(2, 0, 1).float() / 255, y

    loader = DataLoader(Stream(), batch_size=8)
    with pytest.raises(ConfigError, match="no len"):
        Trainer(create_model("cnn-small", num_classes=3), loader, config=TrainConfig(device="cpu", progress=False))
    t = Trainer(create_model("cnn-small", num_classes=3), loader,
                config=TrainConfig(device="cpu", max_steps=9, progress=False, checkpoint_dir=str(tmp_path)))
    history = t.fit()
    assert t.step == 9 and t.epoch == 1 and history[-1]["reason"] == "max_steps"  # 6 batches an epoch
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("fastdata.train").addHandler(handler)
    try:
        t = Trainer(create_model("cnn-small", num_classes=3), loader,  # its data starts over: said, not silent
                    config=TrainConfig(device="cpu", max_steps=11, progress=False, checkpoint_dir=str(tmp_path),
                                       resume=True))
    finally:
        logging.getLogger("fastdata.train").removeHandler(handler)
    assert t.step == 9 and any("the resumed run reads its data from the start" in m for m in said), said


def test_checkpoint_from_another_model_is_refused(small_images, tmp_path):
    assert main(train_args(small_images, "--max-steps", "1", "--checkpoint", str(tmp_path))) == 0
    r = subprocess.run([sys.executable, "-m", "fastdata", *train_args(small_images, "--model", "resnet18",
                                                                      "--checkpoint", str(tmp_path), "--resume")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "holds a SmallCNN, not a ResNet" in r.stderr and "Traceback" not in r.stderr


def test_a_checkpoint_is_never_overwritten_by_a_run_that_does_not_resume_it(small_images, tmp_path):
    assert main(train_args(small_images, "--max-steps", "2", "--checkpoint", str(tmp_path))) == 0
    before = (tmp_path / "checkpoint.pt").read_bytes()
    r = subprocess.run([sys.executable, "-m", "fastdata", *train_args(small_images, "--max-steps", "3",
                                                                      "--checkpoint", str(tmp_path))],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "pass --resume" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert (tmp_path / "checkpoint.pt").read_bytes() == before  # before: overwritten by a run from step 0
    assert main(train_args(small_images, "--max-steps", "3", "--checkpoint", str(tmp_path), "--resume")) == 0
    assert load_ckpt(tmp_path)["step"] == 3



@pytest.mark.remote
def test_a_run_checkpointed_to_a_url_resumes_elsewhere_to_the_same_weights(s3, small_images, tmp_path, capsys):
    """--checkpoint s3://...: a run stopped mid-epoch goes on from the store with nothing of its own left (a
    preempted job on another machine) to the weights of a run never stopped; the store holds the generations;
    a run without --resume refuses to overwrite them; a bucket that does not exist is refused before training."""
    import io

    common = ["--epochs", "50", "--schedule", "constant", "--augment", "crop-flip", "--checkpoint-every", "2"]
    url = s3("runs") + "/r1"
    assert main(train_args(small_images, *common, "--max-steps", "5", "--checkpoint", url)) == 0
    keys = sorted(o["Key"] for o in s3.client.list_objects_v2(Bucket="runs")["Contents"])
    assert keys == ["r1/checkpoint.prev.pt", "r1/checkpoint.pt"]

    def at(key: str) -> dict:
        return torch.load(io.BytesIO(s3.client.get_object(Bucket="runs", Key=key)["Body"].read()), weights_only=True)
    assert at("r1/checkpoint.pt")["step"] == 5 and at("r1/checkpoint.prev.pt")["step"] == 4
    assert at("r1/checkpoint.pt")["loader"]["position"] == 40  # mid-epoch: 6 steps of 8 an epoch
    capsys.readouterr()
    assert main(train_args(small_images, *common, "--max-steps", "9", "--checkpoint", url)) == 1
    err = capsys.readouterr().err
    assert "s3://runs/r1/checkpoint.pt holds another run's checkpoint" in err and "--resume" in err, err
    assert at("r1/checkpoint.pt")["step"] == 5
    log = tmp_path / "log.jsonl"
    assert main(train_args(small_images, *common, "--max-steps", "9", "--checkpoint", url, "--resume", "--log-file",
                           str(log), "--log-every", "1")) == 0
    steps = [json.loads(line)["step"] for line in log.read_text().splitlines() if '"loss"' in line]
    assert steps == [6, 7, 8, 9], steps  # went on from the store's step 5
    assert main(train_args(small_images, *common, "--max-steps", "9", "--checkpoint", str(tmp_path / "ref"))) == 0
    a, b = load_ckpt(tmp_path / "ref"), at("r1/checkpoint.pt")
    assert a["step"] == b["step"] == 9 and a["loader"]["position"] == b["loader"]["position"]
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    capsys.readouterr()
    assert main(train_args(small_images, "--max-steps", "1", "--retry-seconds", "0", "--checkpoint",
                           "s3://no-such-bucket/run")) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "s3://no-such-bucket/run" in err and "bucket exists" in err, err
    secret = "memory://user:hunter2@store/run"  # fsspec's in-process store: a password in the URL is never said
    assert main(train_args(small_images, "--max-steps", "1", "--checkpoint", secret)) == 0
    assert main(train_args(small_images, "--max-steps", "2", "--checkpoint", secret)) == 1
    err = capsys.readouterr().err
    assert "memory://user:***@store/run/checkpoint.pt holds another run's checkpoint" in err and "hunter2" not in err
    import fsspec

    fs, key = fsspec.core.url_to_fs(secret + "/checkpoint.pt")
    kept = fs.cat_file(key)
    assert torch.load(io.BytesIO(kept), weights_only=True)["config"]["checkpoint_dir"] == "memory://user:***@store/run"
    assert b"hunter2" not in kept

@pytest.mark.slow
def test_ctrl_c_says_how_to_continue(small_images, tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "fastdata", *train_args(small_images, "--epochs", "100000",
                                                                            "--checkpoint", str(tmp_path))],
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (tmp_path / "checkpoint.pt").exists() and time.monotonic() < deadline:  # an epoch is done
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 130 and "Traceback" not in err
    assert f"rerun with --resume to continue from the last checkpoint in {tmp_path}" in err, err  # not "the same"
    assert main(train_args(small_images, "--max-steps", "1", "--epochs", "100000", "--checkpoint", str(tmp_path),
                           "--resume")) == 0  # (the step count is past 1: it stops at once, from the checkpoint)
    assert load_ckpt(tmp_path)["epoch"] >= 1


def _started_and_logging(args: list[str], log: Path, records: int = 4, torchrun: int = 0) -> subprocess.Popen:
    """``fastdata train`` (under torchrun with that many ranks) started and past its first few log records."""
    launch = torchrun_cmd(torchrun) if torchrun else [sys.executable]
    proc = subprocess.Popen([*launch, "-m", "fastdata", *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        if log.exists() and log.read_text().count('"event": "train"') >= records:
            return proc
        time.sleep(0.02)
    proc.kill()
    raise AssertionError(f"no training logged: {proc.communicate()[1][-3000:]}")


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_a_preempted_run_saves_where_it_stopped_and_resumes_to_the_same_weights(small_images, tmp_path, sig):
    """NOTE [stop signals]: SIGTERM (Kubernetes, kill) or SIGUSR1 (SLURM) ends the run after its step with a
    checkpoint of that step; --resume then reaches the weights of a run never stopped."""
    common = ["--epochs", "100000", "--schedule", "constant", "--augment", "crop-flip", "--log-every", "1"]
    log, run, ref = tmp_path / "log.jsonl", tmp_path / "run", tmp_path / "ref"
    bare = _started_and_logging(train_args(small_images, *common, "--log-file", str(tmp_path / "bare.jsonl")),
                                tmp_path / "bare.jsonl")
    bare.send_signal(sig)  # without a checkpoint folder there is nothing to save: the signal ends it as always
    assert bare.wait(timeout=60) == -sig
    proc = _started_and_logging(train_args(small_images, *common, "--checkpoint", str(run), "--log-file", str(log)),
                                log)
    proc.send_signal(sig)
    err = proc.communicate(timeout=120)[1]
    end = json.loads(log.read_text().splitlines()[-1])
    assert proc.returncode == 128 + sig and "Traceback" not in err, err
    assert end["event"] == "end" and end["reason"] == f"signal {sig.name}"
    stopped = load_ckpt(run)
    assert stopped["step"] == end["step"] and stopped["epoch"] == end["epoch"]  # saved where it stopped
    assert f"stopped by {sig.name} at step {end['step']}, checkpoint saved in {run}: rerun with --resume" in err
    until = ["--max-steps", str(end["step"] + 5)]
    assert main(train_args(small_images, *common, *until, "--checkpoint", str(run), "--resume")) == 0
    assert main(train_args(small_images, *common, *until, "--checkpoint", str(ref))) == 0
    a, b = load_ckpt(ref), load_ckpt(run)
    assert a["step"] == b["step"] == end["step"] + 5
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k


@pytest.mark.distributed
@pytest.mark.slow
def test_sigterm_to_torchrun_stops_every_rank_after_the_same_step_with_a_checkpoint(small_images, tmp_path):
    """torchrun forwards SIGTERM to its ranks: they agree on the step at a log interval (NOTE [stop signals]),
    rank 0 saves it, and every process ends (a rank that went on would wait forever in its collective)."""
    log, ck = tmp_path / "log.jsonl", tmp_path / "ck"
    proc = _started_and_logging(train_args(small_images, "--epochs", "100000", "--log-every", "3", "--checkpoint",
                                           str(ck), "--log-file", str(log)), log, records=3, torchrun=2)
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=60)[1]  # within torchrun's 30 s grace, or it kills the ranks
    end = json.loads(log.read_text().splitlines()[-1])
    assert end["event"] == "end" and end["reason"] == "signal SIGTERM", err[-3000:]
    assert end["step"] % 3 == 0 or load_ckpt(ck)["loader"]["position"] == 0  # a log interval, or an epoch's end
    assert load_ckpt(ck)["step"] == end["step"]
    assert "stopped by SIGTERM" in err and "Traceback" not in err.split("stopped by SIGTERM")[0], err[-3000:]


SKEWED_RANKS = """
import json, sys, time
import torch
from fastdata import CUDAPrefetcher, FastDataset, FastLoader
from fastdata.distributed import init_distributed, shutdown_distributed
from fastdata.train.models import create_model
from fastdata.train.trainer import Trainer
from fastdata.train.config import TrainConfig

info = init_distributed("cpu")
torch.manual_seed(0)
loader = CUDAPrefetcher(FastLoader(FastDataset(sys.argv[1]), 4), device="cpu")
cfg = TrainConfig(epochs=100000, max_time=1.5, log_every=5, device="cpu", progress=False)
trainer = Trainer(create_model("cnn-small", num_classes=3), loader, config=cfg)
if info.rank == 1:
    time.sleep(0.5)  # this rank's clock starts later: alone, it reaches max_time ~0.5 s of steps after rank 0
history = trainer.fit()
with open(f"{sys.argv[2]}.{info.rank}", "w") as f:
    json.dump({"rank": info.rank, "step": trainer.step, "reason": history[-1]["reason"]}, f)
shutdown_distributed()
"""


@pytest.mark.distributed
@pytest.mark.slow
def test_ranks_whose_clocks_differ_stop_for_max_time_after_the_same_step(small_images, tmp_path):
    """NOTE [agreed stops]: each rank checked max_time on its own clock, so a rank that began fit() later went
    on for another step while the others stopped, and the run hung in that step's all-reduce."""
    script = tmp_path / "skewed.py"
    script.write_text(SKEWED_RANKS)
    r = torchrun(2, str(script), str(small_images), str(tmp_path / "end"), timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    ends = [json.loads((tmp_path / f"end.{rank}").read_text()) for rank in (0, 1)]
    assert [e["rank"] for e in ends] == [0, 1] and ends[0]["step"] == ends[1]["step"] > 0, ends
    assert ends[0]["reason"] == ends[1]["reason"] == "max_time"
    assert ends[0]["step"] % 5 == 0 or ends[0]["step"] % 6 == 0, ends  # at a log interval or an epoch's end


RANK_LOCAL_FOLDERS = """
import sys
import torch
from fastdata import CUDAPrefetcher, FastDataset, FastLoader
from fastdata.distributed import init_distributed, shutdown_distributed
from fastdata.train.models import create_model
from fastdata.train.trainer import Trainer
from fastdata.train.config import TrainConfig

data, base, steps, resume = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "resume"
info = init_distributed("cpu")
torch.manual_seed(0)
loader = CUDAPrefetcher(FastLoader(FastDataset(data), 4), device="cpu")
cfg = TrainConfig(epochs=100, max_steps=steps, schedule="constant", lr=0.05, device="cpu", progress=False,
                  checkpoint_dir=f"{base}/node{info.rank}", resume=resume)  # each rank a node with its own disk
trainer = Trainer(create_model("cnn-small", num_classes=3), loader, config=cfg)
trainer.fit()
if info.rank == 1:
    torch.save({"step": trainer.step, "model": trainer.model.state_dict()}, f"{base}/rank1.pt")
shutdown_distributed()
"""


@pytest.mark.distributed
@pytest.mark.slow
def test_ranks_resume_from_rank_0s_checkpoint_when_their_own_disks_hold_none(small_images, tmp_path):
    """Rank 0 alone writes checkpoints: with node-local folders the other ranks' are empty, and they started
    from step 0 while rank 0 resumed (then hung, or trained apart). They now all resume from rank 0's."""
    script = tmp_path / "local.py"
    script.write_text(RANK_LOCAL_FOLDERS)

    def run(base: Path, steps: int, resume: str) -> dict:
        r = torchrun(2, str(script), str(small_images), str(base), str(steps), resume, timeout=120)
        assert r.returncode == 0, r.stderr[-3000:]
        return torch.load(base / "rank1.pt", weights_only=True)

    run(tmp_path / "a", 4, "fresh")
    assert (tmp_path / "a" / "node0" / "checkpoint.pt").is_file()
    assert not (tmp_path / "a" / "node1" / "checkpoint.pt").exists()
    resumed = run(tmp_path / "a", 7, "resume")
    straight = run(tmp_path / "b", 7, "fresh")
    assert resumed["step"] == straight["step"] == 7
    for k, v in straight["model"].items():
        if "running" not in k:  # (BN statistics are each rank's own under DDP)
            assert torch.equal(v, resumed["model"][k]), k


@pytest.mark.slow
def test_a_full_disk_keeps_the_last_checkpoint_and_says_so_in_one_line(small_images, tmp_path):
    assert main(train_args(small_images, "--max-steps", "2", "--checkpoint", str(tmp_path))) == 0
    before = (tmp_path / "checkpoint.pt").read_bytes()
    limit = len(before) // 2  # the next checkpoint, as big, cannot be written

    r = subprocess.run([sys.executable, "-m", "fastdata", *train_args(small_images, "--max-steps", "4", "--checkpoint",
                                                                      str(tmp_path), "--resume")],
                       capture_output=True, text=True, timeout=120, preexec_fn=disk_of(limit))
    err = r.stderr.strip()
    assert r.returncode == 1 and "Traceback" not in err and len(err.splitlines()) == 1, err
    assert "no space left while writing" in err and "checkpoint.pt" in err and "previous checkpoint is intact" in err
    assert (tmp_path / "checkpoint.pt").read_bytes() == before and not list(tmp_path.glob("*.tmp"))
    assert load_ckpt(tmp_path)["step"] == 2
    assert main(train_args(small_images, "--max-steps", "4", "--checkpoint", str(tmp_path), "--resume")) == 0
    assert load_ckpt(tmp_path)["step"] == 4  # room again: the run goes on from the kept checkpoint
    log = tmp_path / "log.jsonl"  # the metrics log on a full disk: one line too

    r = subprocess.run([sys.executable, "-m", "fastdata", *train_args(small_images, "--max-steps", "8", "--log-every",
                                                                      "1", "--log-file", str(log))],
                       capture_output=True, text=True, timeout=120,
                       preexec_fn=disk_of(1_000))  # a few log records fit, not eight
    err = r.stderr.strip()
    assert r.returncode == 1 and "Traceback" not in err and len(err.splitlines()) == 1, err
    assert "no space left while writing" in err and "log.jsonl" in err and "--resume" in err, err


@pytest.mark.cuda
def test_fp16_gradscaler_channels_last_and_stall_on_gpu(small_images, tmp_path):
    log = tmp_path / "log.jsonl"
    assert main(["train", str(small_images), "--model", "resnet18", "--batch-size", "8", "--amp", "fp16",
                 "--epochs", "2", "--log-every", "2", "--log-file", str(log), "--device", "cuda", "--quiet"]) == 0
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert all(0 <= r["data_stall_pct"] <= 100 for r in records if r["event"] == "train")
    model = create_model("resnet18", num_classes=3)
    loader = CUDAPrefetcher(FastLoader(FastDataset(small_images), 8), device="cuda")
    t = Trainer(model, loader, config=TrainConfig(max_steps=2, amp="fp16", progress=False, device="cuda"))
    t.fit()
    assert next(t.model.parameters()).is_cuda
    assert t.model.stem[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert t.scaler.is_enabled() and t.scaler.get_scale() > 0


def test_a_callers_group_of_one_process_gets_ddp_and_trains_as_without(small_images):
    import socket

    import torch.distributed as dist

    def run() -> Trainer:
        torch.manual_seed(0)
        loader = CUDAPrefetcher(FastLoader(FastDataset(small_images), 8, seed=1), device="cpu")
        t = Trainer(create_model("cnn-small", num_classes=3), loader,
                    config=TrainConfig(max_steps=3, lr=0.05, device="cpu", progress=False))
        t.fit()
        return t

    alone = run()
    __import__("importlib").import_module("torch._dynamo")  # before the group, as init_distributed does
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        grouped = run()
        assert alone.ddp is None and isinstance(grouped.ddp, torch.nn.parallel.DistributedDataParallel)
        a, b = alone.model.state_dict(), grouped.model.state_dict()
        assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)  # DDP of one: the same training
        grouped.close()
    finally:
        dist.destroy_process_group()


def gpu_run(data: Path, ckpt: Path, max_steps: int, resume: bool = False) -> Trainer:
    """ResNet-18 on the GPU: bf16, accumulation, clipping, crops + flips on the GPU, checkpoints every 2 steps."""
    from fastdata.imaging.transforms import Compose, RandomHorizontalFlip, RandomResizedCrop

    torch.manual_seed(0)
    loader = CUDAPrefetcher(FastLoader(FastDataset(data), 8, seed=3), device="cuda", dtype=torch.bfloat16,
                            transforms=Compose([RandomResizedCrop(32), RandomHorizontalFlip()]))
    cfg = TrainConfig(max_steps=max_steps, epochs=10, amp="bf16", accum=2, clip=1.0, lr=0.05, device="cuda",
                      schedule="constant",
                      checkpoint_dir=str(ckpt), checkpoint_every=2, resume=resume, cudnn_benchmark=False,
                      progress=False, val_every=0)
    t = Trainer(create_model("resnet18", num_classes=3), loader, config=cfg)
    t.fit()
    return t


@pytest.mark.cuda
@pytest.mark.parametrize("cut", [4, 3])  # 6 batches an epoch, 2 a step: mid-epoch; after the epoch's last step
def test_gpu_bf16_accumulation_clipping_checkpoint_and_resume_to_the_same_weights(small_images, tmp_path, cut):
    """At 3, the prefetcher's look-ahead had ended the loader's epoch: the state said epoch 1 from its start,
    and the resumed run trained epoch 0 again."""
    torch.use_deterministic_algorithms(True, warn_only=True)  # the same kernels in both runs
    try:
        whole = gpu_run(small_images, tmp_path / "whole", 7)
        gpu_run(small_images, tmp_path / "cut", cut)
        state = load_ckpt(tmp_path / "cut")
        epoch, position = (0, 48) if cut == 3 else (1, 16)
        assert (state["step"], state["epoch"], state["loader"]["epoch"], state["loader"]["position"]) == \
            (cut, epoch, epoch, position)
        resumed = gpu_run(small_images, tmp_path / "cut", 7, resume=True)
    finally:
        torch.use_deterministic_algorithms(False)
    assert whole.step == resumed.step == 7 and next(whole.model.parameters()).dtype == torch.float32
    a, b = whole.model.state_dict(), resumed.model.state_dict()
    diffs = {k: float((a[k].double() - b[k].double()).abs().max()) for k in a}
    assert all(torch.equal(a[k], b[k]) for k in a), {k: d for k, d in diffs.items() if d}
    untrained = create_model("resnet18", num_classes=3).state_dict()
    assert not torch.equal(untrained["fc.weight"], a["fc.weight"].cpu())


@pytest.mark.cuda
def test_gpu_compile_and_sync_bn_in_a_one_process_group(small_images, monkeypatch):
    import socket

    import torch.distributed as dist

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    try:
        loader = CUDAPrefetcher(FastLoader(FastDataset(small_images), 8), device="cuda", dtype=torch.bfloat16)
        model = create_model("resnet18", num_classes=3)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        t = Trainer(model, loader, config=TrainConfig(max_steps=4, amp="bf16", compile=True, sync_bn=True,
                                                      lr=0.05, device="cuda", progress=False, log_every=2))
        history = t.fit()
        norms = [m for m in t.model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
        assert norms and all(isinstance(m, torch.nn.SyncBatchNorm) for m in norms)
        assert isinstance(t.ddp, torch.nn.parallel.DistributedDataParallel)
        assert isinstance(t.forward, torch._dynamo.eval_frame.OptimizedModule)
        assert t.step == 4 and all(r["loss"] == r["loss"] for r in history if "loss" in r)  # no NaN
        after = t.model.state_dict()
        assert all(torch.isfinite(v.float()).all() for v in after.values())
        assert not torch.equal(before["fc.weight"], after["fc.weight"].cpu())
        assert float(norms[0].running_mean.abs().sum()) > 0  # the SyncBatchNorm kernels ran and kept stats
        t.close()
    finally:
        dist.destroy_process_group()


def test_profile_writes_a_trace_and_reports_the_data_wait(small_images, tmp_path, capsys):
    assert main(["train", str(small_images), "--model", "cnn-small", "--batch-size", "8", "--device", "cpu",
                 "--max-steps", "4", "--profile", "3", "--checkpoint", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert (tmp_path / "trace.json").stat().st_size > 1000
    assert "aten::" in out and "profiled 3 steps" in out and "waiting for data" in out


@pytest.mark.slow
@pytest.mark.skipif(not any(map(__import__("shutil").which, ("c++", "g++", "clang++"))),
                    reason="torch.compile on the CPU needs a C++ compiler")
def test_compile_trains_to_the_same_weights():
    data = [(torch.randint(0, 256, (8, 4, 4, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(i)),
             torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])) for i in range(4)]

    def run(compile: bool) -> dict:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(48, 16), torch.nn.ReLU(),
                                    torch.nn.Linear(16, 3))
        cfg = TrainConfig(epochs=1, lr=0.1, device="cpu", progress=False, compile=compile, schedule="constant")
        Trainer(model, CUDAPrefetcher(data, device="cpu"), None, config=cfg).fit()
        return model.state_dict()  # the Trainer saves and steps the module beneath the compiled wrapper

    eager, compiled = run(False), run(True)
    assert all(torch.allclose(eager[k], compiled[k], atol=1e-5) for k in eager)
    torch.manual_seed(0)
    untouched = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(48, 16)).state_dict()
    assert not torch.allclose(untouched["1.weight"], compiled["1.weight"])  # training moved the weights


def test_every_train_flag_defaults_to_the_train_config_default():
    import dataclasses

    from fastdata.cli.main import build_parser

    args = vars(build_parser().parse_args(["train", "data"]))
    renamed = {"profile_steps": "profile", "checkpoint_dir": "checkpoint", "log_file": "log_file"}
    checked = 0
    for f in dataclasses.fields(TrainConfig):
        name = renamed.get(f.name, f.name)
        if name in args and f.default is not dataclasses.MISSING and args[name] is not None:
            assert args[name] == f.default, f"--{name.replace('_', '-')}: CLI {args[name]!r}, TrainConfig {f.default!r}"
            checked += 1
    assert checked >= 15 and args["epochs"] is None and TrainConfig().num_epochs == 1


def test_max_steps_without_epochs_trains_past_the_first_epoch(small_images):
    loader = CUDAPrefetcher(FastLoader(FastDataset(small_images), 8), device="cpu")
    steps = TrainConfig(max_steps=2 * len(loader) + 1, progress=False, device="cpu")
    t = Trainer(create_model("cnn-small", num_classes=3), loader, config=steps)
    assert t.fit()[-1]["reason"] == "max_steps" and t.step == 2 * len(loader) + 1 and t.epoch == 2
    bounded = Trainer(create_model("cnn-small", num_classes=3), loader,
                      config=TrainConfig(epochs=1, max_steps=2 * len(loader) + 1, progress=False, device="cpu"))
    assert bounded.fit()[-1]["reason"] == "epochs" and bounded.step == len(loader)
    # the schedule spans the run, which its one epoch ends first: annealed to 0 (was over max_steps: not annealed)
    assert bounded.total_steps == len(loader) and bounded.scheduler.get_last_lr()[0] == pytest.approx(0, abs=1e-12)


def test_ctrl_c_says_resume_only_when_a_checkpoint_exists(tmp_path):
    import argparse

    from fastdata.cli.main import _after_interrupt
    from fastdata.train import checkpoint

    args = argparse.Namespace(command="train", checkpoint=tmp_path / "ck")
    assert "no checkpoint was saved" in _after_interrupt(args)  # interrupted before the first save
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / checkpoint.CHECKPOINT_NAME).write_bytes(b"x")
    assert "rerun with --resume" in _after_interrupt(args)
    assert "nothing to resume" in _after_interrupt(argparse.Namespace(command="train", checkpoint=None))


def dali_args(data: Path, *extra: str) -> list[str]:
    return ["train", str(data), "--backend", "dali", "--model", "resnet18", "--crop", "8", "--batch-size", "16",
            "--max-steps", "1", "--device", "cpu", "--quiet", *extra]


@pytest.mark.parametrize("flags, echoed", [
    (["--hw-decoder-load", "1.5"], "got 1.5"),
    (["--hw-decoder-load", "-0.1"], "got -0.1"),
    (["--hw-decoder-load", "nan"], "got nan"),
    (["--hw-decoder-load", "fastest"], "got 'fastest'"),
    (["--hw-decoder-load", "AUTO"], "got 'AUTO'"),  # the keyword is lower case, as DALILoader takes it
])
def test_a_bad_hw_decoder_load_is_one_line_naming_the_option(indexed_datasets, capsys, flags, echoed):
    assert main(dali_args(indexed_datasets["lmdb"], *flags)) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--hw-decoder-load must be a number in [0, 1]" in err and echoed in err, err


def test_hw_decoder_load_is_refused_without_the_dali_backend(indexed_datasets, capsys):
    from fastdata.train.assemble import ImageRun

    args = ["train", str(indexed_datasets["lmdb"]), "--hw-decoder-load", "0.5", "--device", "cpu", "--quiet"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "add --backend dali, or drop --hw-decoder-load 0.5 for --backend native" in err, err
    with pytest.raises(ConfigError, match="--hw-decoder-load"):
        ImageRun(data="d", hw_decoder_load=True)  # Python callers: a bool is not a share (nor is it the default)


@pytest.mark.dali
@pytest.mark.parametrize("flags, want", [([], None), (["--hw-decoder-load", "0.25"], 0.25),
                                         (["--hw-decoder-load", "1"], 1.0), (["--hw-decoder-load", "auto"], "auto")])
def test_fastdata_train_hands_hw_decoder_load_to_both_dali_loaders(indexed_datasets, monkeypatch, flags, want):
    from fastdata.train import assemble

    built = []
    real_build = assemble.build
    monkeypatch.setattr(assemble, "build", lambda *a, **kw: built.append(real_build(*a, **kw)) or built[-1])
    assert main(dali_args(indexed_datasets["lmdb"], "--val-fraction", "0.2", *flags)) == 0
    (_, train, val), = built
    assert type(train).__name__ == type(val).__name__ == "DALILoader"
    assert train.hw_decoder_load == val.hw_decoder_load == want  # no flag: DALILoader's own default (None)
    assert train.hw_decoder_load_chosen == (None if want == "auto" else want)  # "auto" on the CPU: DALI's default


def test_the_step_that_ends_an_epoch_mid_accumulation_is_a_step_as_any_other(small_images, tmp_path):
    """36 training images at batch 8 and --accum 4: each epoch steps after 4 micro-batches, then after its last
    one (a partial step). That step skipped the per-step work: --max-steps 2 trained 3 steps and --val-every-steps 2
    never validated; a checkpoint there resumes to the uninterrupted run's weights."""
    common = ["--accum", "4", "--epochs", "50", "--schedule", "constant", "--augment", "crop-flip", "--val-fraction",
              "0.25", "--val-every", "0", "--val-every-steps", "2"]
    cut, ref = tmp_path / "cut", tmp_path / "ref"
    assert main(train_args(small_images, *common, "--max-steps", "2", "--checkpoint", str(cut),
                           "--log-file", str(tmp_path / "cut.jsonl"))) == 0
    records = [json.loads(line) for line in (tmp_path / "cut.jsonl").read_text().splitlines()]
    assert [(r["event"], r["step"]) for r in records if r["event"] != "train"] == [("val", 2), ("end", 2)]
    assert load_ckpt(cut)["step"] == 2
    assert main(train_args(small_images, *common, "--max-steps", "5", "--checkpoint", str(cut), "--resume")) == 0
    assert main(train_args(small_images, *common, "--max-steps", "5", "--checkpoint", str(ref))) == 0
    a, b = load_ckpt(ref), load_ckpt(cut)
    assert (a["epoch"], a["step"]) == (b["epoch"], b["step"]) == (2, 5)
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k


def test_resuming_a_run_that_had_ended_trains_nothing_and_says_so(small_images, tmp_path, capsys):
    """A requeued job passes --resume every time (docs/training.md): a run that had reached --max-steps, or
    stopped early, trained one step or epoch more on each rerun."""
    steps = ["--epochs", "50", "--max-steps", "3", "--checkpoint", str(tmp_path / "steps")]
    early = ["--val-fraction", "0.25", "--epochs", "20", "--early-stop-patience", "2", "--early-stop-min-delta", "1e9",
             "--checkpoint", str(tmp_path / "early")]
    for args, reason in ((steps, "max_steps"), (early, "early_stop")):
        assert main(train_args(small_images, *args)) == 0
        before = load_ckpt(Path(args[-1]))
        log = tmp_path / f"{reason}.jsonl"
        capsys.readouterr()
        assert main(train_args(small_images, *args, "--resume", "--log-file", str(log))) == 0
        after = load_ckpt(Path(args[-1]))
        assert (after["step"], after["epoch"]) == (before["step"], before["epoch"]), reason
        assert [json.loads(line)["reason"] for line in log.read_text().splitlines()] == [reason]
        assert f"had already ended at step {before['step']}" in capsys.readouterr().out


def test_a_step_validated_is_not_validated_again_at_its_epochs_end(small_images):
    """--val-every-steps 3 over 6-step epochs validated step 6 twice (its own, then the epoch end's): the same
    weights, whose second loss counted as no improvement, so early stopping fired after one validation."""
    ds = FastDataset(small_images)

    def loss_fn(out, y):  # the validation loss falls at every validation: never a reason to stop
        if trainer.model.training:
            return torch.nn.functional.cross_entropy(out, y)
        return out.sum() * 0 + 100.0 - trainer.step

    cfg = TrainConfig(epochs=2, device="cpu", progress=False, val_every_steps=3, early_stop_patience=1)
    trainer = Trainer(Linear(), FastLoader(ds, 8, seed=0), FastLoader(ds, 8, shuffle=False, pad=False),
                      loss_fn=loss_fn, config=cfg)
    history = trainer.fit()
    assert [r["step"] for r in history if r["event"] == "val"] == [3, 6, 9, 12]
    assert history[-1]["reason"] == "epochs"


def test_profile_n_profiles_n_steps_from_where_the_run_starts(tmp_path):
    """--profile 2 stopped only at step == 2: a run resumed past it profiled every step to its end."""
    from fastdata.train.meter import StepProfiler

    profiler = StepProfiler(2, torch.device("cpu"), tmp_path, False, 0.0)
    profiler.step(41, 0.0)  # (a run resumed at step 40)
    assert not profiler.done
    profiler.step(42, 0.0)
    assert profiler.done and profiler.profiled == 2


def test_a_checkpoint_save_killed_mid_write_leaves_no_file_behind_on_the_next_run(tmp_path):
    """kill -9 while writing (a grace period that ran out mid-save) left a checkpoint-sized temporary file for
    good, one more per kill. The next run deletes those of this machine's dead writers, and no other."""
    from fastdata.train import checkpoint

    killed = ("import os, sys, torch\nfrom pathlib import Path\nfrom fastdata.train import checkpoint\n"
              "os.fsync = lambda fd: os._exit(9)  # killed once its bytes are written\n"
              "checkpoint.write(Path(sys.argv[1]) / 'checkpoint.pt', {'w': torch.zeros(1000)})\n")
    assert subprocess.run([sys.executable, "-c", killed, str(tmp_path)], timeout=120).returncode == 9
    (left,) = tmp_path.glob("checkpoint.pt.*.tmp")
    _, _, tag, writer, _ = left.name.split(".")  # checkpoint.pt.<machine>.<pid>-<hex>.tmp
    alive = tmp_path / f"checkpoint.pt.{tag}.{os.getpid()}-0123abcd.tmp"  # a live writer's (this process)
    elsewhere = tmp_path / f"checkpoint.pt.otherhost-1.{writer}.tmp"  # another machine's: its pid means nothing
    for f in (alive, elsewhere):
        f.write_bytes(b"x")
    checkpoint.prepare_folder(tmp_path)
    assert sorted(tmp_path.iterdir()) == sorted([alive, elsewhere])


@pytest.mark.parametrize("wrapped", [False, True])
def test_a_dataloaders_distributed_sampler_gets_each_epoch(wrapped):
    """set_epoch was called on the loader only: a DataLoader's DistributedSampler replayed one order each epoch."""
    seen: list[int] = []

    class Numbers(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 16

        def __getitem__(self, i: int):
            seen.append(i)
            return torch.randn(4), i % 2

    ds = Numbers()
    loader = torch.utils.data.DataLoader(ds, batch_size=4, sampler=torch.utils.data.DistributedSampler(
        ds, num_replicas=1, rank=0, seed=0))
    Trainer(torch.nn.Linear(4, 2), CUDAPrefetcher(loader, device="cpu") if wrapped else loader,
            config=TrainConfig(epochs=3, progress=False, device="cpu")).fit()
    orders = [seen[16 * e:16 * e + 16] for e in range(3)]
    assert sorted(orders[0]) == list(range(16)) and orders[0] != orders[1] != orders[2]


def test_resuming_with_another_optimizer_is_refused_in_one_line(small_images, tmp_path, capsys):
    ck = ["--max-steps", "1", "--checkpoint", str(tmp_path)]
    assert main(train_args(small_images, *ck)) == 0
    capsys.readouterr()
    assert main(train_args(small_images, *ck, "--resume", "--max-steps", "2", "--optimizer", "adamw")) == 1
    err = capsys.readouterr().err  # before: a KeyError traceback from inside AdamW's step
    assert "was trained with --optimizer sgd, this run asks for adamw: resume with --optimizer sgd" in err, err


def test_resuming_with_another_lr_weight_decay_or_momentum_is_refused_by_name(small_images, tmp_path, capsys):
    """The saved optimizer and scheduler states put the saved lr and weight decay back: a run resumed with --lr
    0.001 trained on at 0.1 while its checkpoint's config said 0.001."""
    ck = ["--max-steps", "1", "--checkpoint", str(tmp_path)]
    assert main(train_args(small_images, *ck)) == 0  # --lr 0.05, --weight-decay 0.0005 (the default)
    before = (tmp_path / "checkpoint.pt").read_bytes()
    capsys.readouterr()
    assert main(train_args(small_images, *ck, "--resume", "--max-steps", "2", "--lr", "0.001", "--weight-decay",
                           "0")) == 1
    assert capsys.readouterr().err == (  # each setting as flag and keyword, as every message names options
        f"fastdata: error: checkpoint {tmp_path / 'checkpoint.pt'} was trained with --lr 0.05 (lr=0.05) and "
        "--weight-decay 0.0005 (weight_decay=0.0005), this run asks for --lr 0.001 (lr=0.001) and --weight-decay 0.0 "
        "(weight_decay=0.0): a resumed run goes on with its saved optimizer state, which holds them; resume with the "
        "checkpoint's values, or train a new run with the new ones in another --checkpoint folder (checkpoint_dir)\n")
    assert (tmp_path / "checkpoint.pt").read_bytes() == before
    cfg = TrainConfig(lr=0.05, momentum=0.5, max_steps=2, checkpoint_dir=str(tmp_path), resume=True, device="cpu",
                      progress=False)  # (Python alone sets momentum)
    with pytest.raises(ConfigError) as e:
        Trainer(create_model("cnn-small", num_classes=3), FastLoader(FastDataset(small_images), 8), config=cfg)
    assert "was trained with momentum=0.9 (TrainConfig's: fastdata train has no flag for it), this run asks for " \
           "momentum=0.5: a resumed run goes on" in str(e.value) and "--momentum" not in str(e.value)
    with pytest.raises(ConfigError) as e:  # two settings, one with a flag: each named in its own form
        Trainer(create_model("cnn-small", num_classes=3), FastLoader(FastDataset(small_images), 8),
                config=dataclasses.replace(cfg, lr=0.2))
    assert "was trained with --lr 0.05 (lr=0.05) and momentum=0.9 (TrainConfig's: fastdata train has no flag for " \
           "it), this run asks for --lr 0.2 (lr=0.2) and momentum=0.5: " in str(e.value)
    assert main(train_args(small_images, *ck, "--resume", "--max-steps", "2")) == 0  # the same values resume
    assert load_ckpt(tmp_path)["step"] == 2


@pytest.fixture(scope="module")
def one_step_checkpoint(small_images, tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("one-step")
    assert main(train_args(small_images, "--max-steps", "1", "--checkpoint", str(folder))) == 0
    return load_ckpt(folder)


@pytest.mark.parametrize("change, said", [
    (lambda good: [1, 2, 3], "(it holds a list, not a dict)"),
    (lambda good: {"model": good["model"], "model_class": good["model_class"]}, "(missing 'optimizer')"),
    (lambda good: {k: v for k, v in good.items() if k != "rng"}, "(missing 'rng')"),
    (lambda good: {**good, "epoch": "1"}, "(its 'epoch' is '1', not a whole number >= 0)"),
    (lambda good: {**good, "step": -5}, "(its 'step' is -5, not a whole number >= 0)"),
    (lambda good: {**good, "bad_evals": 1.5}, "(its 'bad_evals' is 1.5, not a whole number >= 0)"),
    (lambda good: {**good, "rng_ranks": [good["rng"], {}]}, "(its 'rng_ranks' is a list, not a list of each "
                                                            "rank's random states)"),
], ids=["list", "weights only", "no rng", "epoch as text", "negative step", "bad_evals", "rng_ranks"])
def test_a_file_that_is_not_a_trainers_checkpoint_is_refused_by_its_first_bad_key(
        small_images, tmp_path, capsys, one_step_checkpoint, change, said):
    """Files that load weights-only but that no Trainer saved: tracebacks (AttributeError, KeyError, TypeError)
    on --resume, or a run that trained on from step -5."""
    torch.save(change(one_step_checkpoint), tmp_path / "checkpoint.pt")
    capsys.readouterr()
    assert main(train_args(small_images, "--max-steps", "2", "--checkpoint", str(tmp_path), "--resume")) == 1
    assert capsys.readouterr().err == (
        f"fastdata: error: checkpoint {tmp_path / 'checkpoint.pt'} is not a fastdata training checkpoint {said}: "
        "resume from a checkpoint that fastdata train (a Trainer) saved, or give --checkpoint another folder (or "
        "move this file away to start afresh)\n")


def test_a_checkpoint_saved_before_the_later_keys_still_resumes(small_images, tmp_path, one_step_checkpoint):
    old = {k: v for k, v in one_step_checkpoint.items() if k not in ("val_step", "val_due", "config", "rng_ranks")}
    torch.save(old, tmp_path / "checkpoint.pt")
    assert main(train_args(small_images, "--max-steps", "2", "--checkpoint", str(tmp_path), "--resume")) == 0
    assert load_ckpt(tmp_path)["step"] == 2


@pytest.mark.parametrize("flags, said", [
    (["--checkpoint-every", "1"], "--checkpoint-every 1 (checkpoint_every) needs a checkpoint folder, and this run "
                                  "has none: give --checkpoint DIR (checkpoint_dir), or drop it"),
    (["--early-stop-patience", "2", "--val-fraction", "0.25", "--val-every", "0"],
     "--early-stop-patience 2 (early_stop_patience) needs validations, and this run makes none: --val-every 0 "
     "(val_every) and --val-every-steps 0 (val_every_steps) never validate; give either a number the run reaches, "
     "or drop it"),
    (["--early-stop-patience", "2", "--val-fraction", "0.25", "--epochs", "2", "--val-every", "3"],
     "--early-stop-patience 2 (early_stop_patience) needs validations, and this run makes none: --val-every 3 "
     "(val_every) is more than the run's 2 epoch(s) and --val-every-steps 0 (val_every_steps) never validate; give "
     "either a number the run reaches, or drop it"),
    (["--warmup-steps", "5", "--schedule", "onecycle"], "--warmup-steps 5 (warmup_steps) does nothing with "
     "--schedule onecycle, which warms up over its first 30% of steps: drop it, or use --schedule cosine or "
     "constant"),
], ids=["checkpoint-every", "val-every 0", "val-every past the epochs", "onecycle warm-up"])
def test_options_that_would_do_nothing_are_refused_by_name(small_images, capsys, flags, said):
    """Each was accepted and did nothing (rc 0): no checkpoint written, no validation to stop early on (a quarter
    of the data held out for nothing), a warm-up the one-cycle schedule never reads."""
    assert main(train_args(small_images, "--max-steps", "1", *flags)) == 1
    assert capsys.readouterr().err == f"fastdata: error: {said}\n"
    with pytest.raises(ConfigError) as e:  # the same in Python
        TrainConfig(checkpoint_every=5)
    assert str(e.value).startswith("--checkpoint-every 5 (checkpoint_every) needs a checkpoint folder")
    for fine in (dict(checkpoint_every=5, checkpoint_dir="ck"), dict(val_every=0, val_every_steps=3,
                 early_stop_patience=2), dict(epochs=2, val_every=2, early_stop_patience=2),
                 dict(max_steps=10, val_every=3, early_stop_patience=2), dict(warmup_steps=5, schedule="constant")):
        TrainConfig(**fine)


@pytest.mark.parametrize("flags, first", [
    (["--max-steps", "3"], "at the end of epoch 1 (--val-every 1 (val_every)), which follows its last step, 5; give "
                           "--max-steps 6 or more"),
    (["--max-steps", "5"], "at the end of epoch 1 (--val-every 1 (val_every)), which follows its last step, 5; give "
                           "--max-steps 6 or more"),
    (["--max-steps", "3", "--val-every-steps", "4"], "at step 4 (--val-every-steps 4 (val_every_steps)); give "
                                                     "--max-steps 4 or more"),
], ids=["before the epoch's end", "at the epoch's last step", "before val-every-steps"])
def test_early_stopping_that_max_steps_ends_before_the_first_validation_is_refused(small_images, capsys, flags,
                                                                                    first):
    """36 training samples at batch 8: 5 steps an epoch. --max-steps 5 or less ended the run before the epoch's
    validation (a stop at --max-steps comes before its epoch's end), and early stopping did nothing (rc 0)."""
    args = ["--val-fraction", "0.25", "--early-stop-patience", "2", *flags]
    assert main(train_args(small_images, *args)) == 1
    steps = flags[1]
    assert capsys.readouterr().err == (
        f"fastdata: error: --early-stop-patience 2 (early_stop_patience) needs validations, and this run makes none: "
        f"--max-steps {steps} (max_steps) ends it before its first, {first}, validate sooner with --val-every-steps "
        "(val_every_steps), or drop it\n")
    cfg = TrainConfig(max_steps=2, val_every=0, val_every_steps=3, early_stop_patience=1, device="cpu",
                      progress=False)  # the same in Python, by the Trainer, which knows the epoch's steps
    ds = FastDataset(small_images)
    with pytest.raises(ConfigError, match=r"--max-steps 2 \(max_steps\) ends it before its first, at step 3 "):
        Trainer(Linear(), FastLoader(ds, 8), FastLoader(ds, 8, shuffle=False, pad=False), config=cfg)


def test_early_stopping_with_a_max_steps_past_the_first_validation_validates(small_images, tmp_path):
    log = tmp_path / "log.jsonl"
    assert main(train_args(small_images, "--val-fraction", "0.25", "--early-stop-patience", "2", "--max-steps", "6",
                           "--log-file", str(log))) == 0
    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "val"] == [5] and events[-1]["reason"] == "max_steps"


def test_validation_data_of_another_size_is_refused_before_training(small_images, tmp_path, capsys):
    """--val was checked for its classes only: 8x8 images failed an epoch in, 64x64 ones validated silently at
    another size than the model trained on."""
    small = tmp_path / "val16"
    assert main(["preprocess", "images", str(small_images.parent / "src"), str(small), "--size", "16", "--workers",
                 "1", "--quiet"]) == 0
    capsys.readouterr()
    assert main(train_args(small_images, "--val", str(small), "--epochs", "1")) == 1
    assert f"--val {small} holds 16x16x3 samples, {small_images} 32x32x3" in capsys.readouterr().err


def test_a_fastloaders_uint8_batches_that_the_model_cannot_take_say_how_to_convert_them(small_images):
    """docs/training.md's Trainer takes "any loader": a plain FastLoader's uint8 NHWC batches gave torch's "Input
    type (unsigned char) and bias type (float) should be the same"."""
    model = create_model("cnn-small", num_classes=3)
    t = Trainer(model, FastLoader(FastDataset(small_images), 8), config=TrainConfig(max_steps=1, device="cpu",
                                                                                   progress=False))
    with pytest.raises(ConfigError, match=r"uint8 images of shape \(8, 32, 32, 3\) \(NHWC\).* wrap the loader in "
                                          r"CUDAPrefetcher\(loader, device=...\)"):
        t.fit()


def test_image_flags_on_a_token_dataset_are_refused_by_name(tmp_path, capsys):
    """A token dataset validates on its own val split: --val, --val-fraction, --backend dali and --augment were
    ignored."""
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(40)))
    tokens = tmp_path / "tok"
    assert main(["preprocess", "text", str(src), str(tokens), "--val-fraction", "0.2", "--workers", "1",
                 "--quiet"]) == 0
    run = ["train", str(tokens), "--seq-len", "16", "--batch-size", "4", "--max-steps", "1", "--device", "cpu",
           "--quiet"]
    for flags in (["--val", str(tokens)], ["--val-fraction", "0.5"], ["--backend", "dali"],
                  ["--augment", "rrc-flip"]):
        capsys.readouterr()
        assert main([*run, *flags]) == 1, flags
        err = capsys.readouterr().err
        assert f"holds tokens: drop {flags[0]}" in err and "for image datasets only" in err, err
    assert main([*run, "--augment", "none"]) == 0  # (what a token run does: asked for, not refused)


def test_autotuned_prefetch_and_pin_memory_reach_the_loaders(small_images, tmp_path, monkeypatch):
    """`fastdata train --config best.json` took the storage and threads of an autotune, not its prefetch depth or
    pinned buffers (docs/bench.md says train reads it)."""
    from fastdata.train import assemble

    built: list[tuple[int, bool]] = []

    class Spy(FastLoader):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            built.append((self.prefetch, kwargs.get("pin_memory")))

    monkeypatch.setattr(assemble, "FastLoader", Spy)
    best = tmp_path / "best.json"
    best.write_text(json.dumps({"storage": "ram", "loader": {"num_threads": 1, "prefetch": 5, "pin_memory": False}}))
    assert main(train_args(small_images, "--max-steps", "1", "--val-fraction", "0.25", "--config", str(best))) == 0
    pinned = False if torch.cuda.is_available() else None  # (without a GPU the loader pins nothing anyway)
    assert built == [(5, pinned), (5, pinned)]  # train and validation
    if not torch.cuda.is_available():  # a config tuned on a GPU machine, run on this one: no pinned buffers
        best.write_text(json.dumps({"storage": "ram", "loader": {"num_threads": 1, "prefetch": 5, "pin_memory": True}}))
        built.clear()
        assert main(train_args(small_images, "--max-steps", "1", "--config", str(best))) == 0 and built == [(5, None)]
        assert not FastLoader.from_config(FastDataset(small_images), 4, str(best)).pin_memory
        with pytest.raises(ConfigError, match="pin_memory=True pins host buffers for copies to a GPU"):
            FastLoader(FastDataset(small_images), 4, pin_memory=True)  # (torch's error came at the first batch)


def test_a_broken_pipe_ends_the_command_quietly(small_images):
    """`fastdata inspect DATA | head -1`: the reader leaves early, and a BrokenPipeError traceback followed."""
    p = subprocess.Popen([sys.executable, "-m", "fastdata", "inspect", str(small_images)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    p.stdout.close()  # (before the command writes: it imports for a second or more)
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 1 and "Traceback" not in err and "BrokenPipe" not in err, err


def test_a_token_model_on_images_is_refused_in_one_line(small_images, capsys):
    """--model gpt-tiny on images (one dataset or a --mix) raised a TypeError traceback from GPT's constructor."""
    from fastdata.train.models import image_models

    assert image_models() == ["cnn-small", "resnet18", "resnet50"]
    run = ["--model", "gpt-tiny", "--batch-size", "8", "--max-steps", "1", "--device", "cpu", "--quiet"]
    for data, named in (([str(small_images)], str(small_images)), (["--mix", f"a={small_images}:1"], "--mix a")):
        assert main(["train", *data, *run]) == 1
        assert capsys.readouterr().err == (f"fastdata: error: --model gpt-tiny reads tokens; {named} holds images: "
                                           "choose one of cnn-small, resnet18, resnet50\n")


def test_an_image_model_on_tokens_names_the_dataset_by_its_folder(tmp_path, capsys):
    """The message held the repr of the opened dataset: its whole manifest, 1,234 bytes on one line."""
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(40)))
    tokens = tmp_path / "tok"
    assert main(["preprocess", "text", str(src), str(tokens), "--workers", "1", "--quiet"]) == 0
    capsys.readouterr()
    assert main(["train", str(tokens), "--model", "cnn-small", "--max-steps", "1", "--device", "cpu", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err == f"fastdata: error: {tokens} holds tokens: train --model gpt-tiny, not 'cnn-small'\n", err


@pytest.mark.parametrize("flags, said", [
    (["--crop", "24"], "--crop sizes the crops of --augment rrc-flip or --backend dali: add one of them, or drop "
                       "--crop 24 for --augment flip"),
    (["--crop", "24", "--augment", "crop-flip"], "drop --crop 24 for --augment crop-flip"),
    (["--crop", "0", "--augment", "rrc-flip"], "--crop must be a positive integer (the crops' side in pixels), got 0"),
])
def test_a_crop_nothing_reads_is_refused_by_name(small_images, capsys, flags, said):
    """--crop was read by rrc-flip and DALI only, and ignored without a word elsewhere; --crop 0 fell back to 7/8
    of the stored side."""
    assert main(train_args(small_images, "--max-steps", "1", *flags)) == 1
    err = capsys.readouterr().err
    assert err.startswith("fastdata: error: ") and err.count("\n") == 1 and said in err, err


def test_a_crop_sizes_the_rrc_flip_batches(small_images):
    from fastdata.train.assemble import ImageRun, build

    model, train, val = build(ImageRun(data=small_images, model="cnn-small", batch_size=8, augment="rrc-flip",
                                       crop=24, val_fraction=0.25), torch.device("cpu"))
    assert next(iter(train))[0].shape == (8, 3, 24, 24) and next(iter(val))[0].shape == (8, 3, 24, 24)
    with pytest.raises(ConfigError, match=r"--crop must be a positive integer .* got 24\.0"):
        ImageRun(data=small_images, augment="rrc-flip", crop=24.0)


@pytest.mark.parametrize("kwargs, said", [  # each ran: 2.5 steps as 3, True as 1 epoch, inf made the weights nan
    ({"max_steps": 2.5}, "max_steps must be a positive integer or None, got max_steps=2.5"),
    ({"max_steps": True}, "max_steps must be a positive integer or None, got max_steps=True"),
    ({"epochs": True}, "epochs must be a positive integer or None, got epochs=True"),
    ({"log_every": 2.5}, "log_every must be a positive integer, got log_every=2.5"),
    ({"accum": True}, "accum must be a positive integer, got accum=True"),
    ({"warmup_steps": True}, "warmup_steps must be 0 or a positive integer, got warmup_steps=True"),
    ({"lr": float("inf")}, "lr must be a positive number, got lr=inf"),
    ({"lr": float("nan")}, "lr must be a positive number, got lr=nan"),
    ({"momentum": 2}, "momentum must be in [0, 1), got momentum=2"),
    ({"momentum": 1.0}, "momentum must be in [0, 1), got momentum=1.0"),
    ({"weight_decay": float("inf")}, "weight_decay must be 0 or more, got weight_decay=inf"),
    ({"early_stop_min_delta": float("inf")}, "early_stop_min_delta must be 0 or more, got early_stop_min_delta=inf"),
])
def test_train_config_refuses_counts_that_are_not_integers_and_rates_out_of_range(kwargs, said):
    with pytest.raises(ConfigError) as e:
        TrainConfig(**kwargs)
    assert str(e.value) == said


def test_train_config_takes_whole_floats_as_counts_and_any_momentum_for_adamw():
    # max_steps=1e4 and log_every=10.0 ran before the counts were checked; AdamW reads no momentum
    c = TrainConfig(max_steps=1e4, log_every=10.0, epochs=3.0, optimizer="adamw", momentum=1.0)
    assert (c.max_steps, c.log_every, c.epochs) == (10000, 10, 3) and type(c.max_steps) is int


def test_a_negative_field_of_a_duration_is_refused():
    for text in ("1:-30", "-5", "1:nan"):  # "1:-30" was 60 - 30 = 30 s
        with pytest.raises(ConfigError) as e:
            parse_duration(text)
        assert str(e.value) == f"max_time's fields must be 0 or more, as in DD:HH:MM:SS, got {text!r}"
    assert parse_duration("1:00:30") == 3630 and parse_duration("0:30") == 30


def test_resuming_with_val_fraction_added_or_dropped_names_the_split(small_images, tmp_path, capsys):
    """A checkpoint of the whole dataset resumed with --val-fraction (or the other way round) was "another
    dataset": the whole dataset's state has no split to compare, so the sample count answered first."""
    for first, then, said in (
            ([], ["--val-fraction", "0.25"], "the checkpoint's loader state is for all 48 samples of the dataset, and "
             "this run trains on the train split of --val-fraction 0.25 (36 samples): resume without --val-fraction, "
             "as the run started, or start the run over"),
            (["--val-fraction", "0.25"], [], "the checkpoint's loader state is for the train split of --val-fraction "
             "0.25 (36 samples), and this run trains on all 48 samples of the dataset: resume with --val-fraction "
             "0.25, as the run started, or start the run over")):
        ck = ["--checkpoint", str(tmp_path / f"ck{len(first)}")]
        assert main(train_args(small_images, "--max-steps", "1", *ck, *first)) == 0
        capsys.readouterr()
        assert main(train_args(small_images, "--max-steps", "2", *ck, "--resume", *then)) == 1
        assert capsys.readouterr().err == f"fastdata: error: {said}\n"
