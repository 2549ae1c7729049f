"""``fastdata preprocess ... SRC s3://bucket/prefix``: a dataset written straight to a store (NOTE [output at a
URL] in fastdata/preprocess/store_out.py), against a real S3 API (moto) on loopback."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import fresh_fs

from fastdata.cli.main import main
from fastdata.datasets.images import FastDataset
from fastdata.preprocess import store_out

pytestmark = pytest.mark.remote


def tree_bytes(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def store_bytes(s3, bucket: str, prefix: str) -> dict[str, bytes]:
    """Every object under ``prefix`` in ``bucket``, by its name below the prefix."""
    out = {}
    for page in s3.client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        for obj in page.get("Contents", []):
            body = s3.client.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
            out[obj["Key"][len(prefix) + 1:]] = body
    return out


def preprocess(src, out, *extra: str) -> int:
    return main(["preprocess", "images", str(src), str(out), "--size", "16", "--shard-size", "4", "--quiet", *extra])


@pytest.fixture
def puts(monkeypatch) -> list[str]:
    """The names this process puts into a store."""
    names: list[str] = []
    real = store_out.StoreOut.put

    def counted(self, local, name):
        names.append(name)
        return real(self, local, name)
    monkeypatch.setattr(store_out.StoreOut, "put", counted)
    return names


@pytest.mark.parametrize("fmt", ["npy", "lmdb"])
def test_a_dataset_written_to_a_url_is_the_local_runs_bytes_and_loads(s3, awkward_folder, tmp_path, fmt, puts):
    fresh_fs()
    url = s3(f"out-{fmt}")
    assert preprocess(awkward_folder, tmp_path / "local", "--format", fmt) == 0
    assert preprocess(awkward_folder, f"{url}/ds", "--format", fmt, "--workers", "2") == 0
    got = store_bytes(s3, f"out-{fmt}", "ds")
    assert got == tree_bytes(tmp_path / "local")  # the manifest last, no journal objects left
    assert puts[-1] == "manifest.json" and len(puts) == len(set(puts)) and set(got) <= set(puts)  # once each
    transient = {f"labels-0000{k}.npy" for k in range(4)} if fmt == "lmdb" else set()  # (lmdb: labels.npy's parts)
    assert set(puts) - set(got) == transient
    local, remote = FastDataset(tmp_path / "local"), FastDataset(f"{url}/ds", cache_dir=tmp_path / "cache")
    idx = np.arange(len(local))
    a, b = local.get_batch(idx), remote.get_batch(idx)
    assert len(local) == 11 and all(np.array_equal(x.numpy(), y.numpy()) for x, y in zip(a, b))  # (images, labels)
    puts.clear()
    assert preprocess(awkward_folder, f"{url}/ds", "--format", fmt) == 0 and puts == []  # complete: nothing to do


def test_a_run_at_a_url_stopped_by_on_error_fail_is_taken_over_by_skip(s3, tmp_path, puts):
    """The error's advice (rerun with --on-error skip) was refused at a URL too: it takes the stopped run
    over, the shards it journaled kept, not put again."""
    from fastdata.cli.synthetic import make_image_folder

    make_image_folder(tmp_path / "src", num_classes=2, per_class=16, sizes=((40, 32),))
    (tmp_path / "src" / "z").mkdir()
    (tmp_path / "src" / "z" / "bad.png").write_bytes(b"")  # the last sample, past two tasks of 16 files
    fresh_fs()
    url = s3("fail-then-skip")
    assert preprocess(tmp_path / "src", f"{url}/ds", "--on-error", "fail", "--workers", "1") == 1
    # (the units journaled before the failure stopped the run: those whose upload had ended by then)
    journaled = [int(n[-13:-5]) for n in store_bytes(s3, "fail-then-skip", "ds")
                 if n.startswith(".fastdata-partial/unit-")]
    assert "manifest.json" not in puts
    puts.clear()
    assert preprocess(tmp_path / "src", f"{url}/ds", "--workers", "1") == 0  # (refused before)
    assert not {f"images-{k:05d}.npy" for k in journaled} & set(puts)  # kept where the first run put them
    assert preprocess(tmp_path / "src", tmp_path / "local", "--workers", "1") == 0
    assert store_bytes(s3, "fail-then-skip", "ds") == tree_bytes(tmp_path / "local")


def test_a_file_url_is_written_and_read_as_any_store(awkward_folder, tmp_path):
    """docs/object-storage.md names file:// among the URLs that work; as OUT it failed before any work (its
    probe put into a folder fsspec's local file system did not make)."""
    pytest.importorskip("fsspec")
    assert preprocess(awkward_folder, tmp_path / "local") == 0
    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "new" / "ds", tmp_path / "empty"):
        assert preprocess(awkward_folder, f"file://{out}") == 0
        assert tree_bytes(out) == tree_bytes(tmp_path / "local")
        remote = FastDataset(f"file://{out}", cache_dir=tmp_path / "cache" / out.name)
        assert np.array_equal(remote.get_batch([3, 7])[0].numpy(), FastDataset(out).get_batch([3, 7])[0].numpy())
    victim = tmp_path / "precious.txt"  # links planted at names a store writes: never written through
    victim.write_text("not fastdata's file")
    (tmp_path / "planted").mkdir()
    (tmp_path / "planted" / "images-00000.npy").symlink_to(victim)
    (tmp_path / "theirs").mkdir()  # (OUT at a file:// URL is a folder: its journal never follows a link either)
    (tmp_path / "theirs" / "run.json").write_text("their run")
    (tmp_path / "planted" / ".fastdata-partial").symlink_to(tmp_path / "theirs")
    (tmp_path / "pushed" / "ds").mkdir(parents=True)
    (tmp_path / "pushed" / "ds" / "labels-00000.npy").symlink_to(victim)
    assert preprocess(awkward_folder, f"file://{tmp_path / 'planted'}") == 0
    assert tree_bytes(tmp_path / "planted") == tree_bytes(tmp_path / "local")
    assert not (tmp_path / "planted" / "images-00000.npy").is_symlink()
    assert main(["push", str(tmp_path / "local"), f"file://{tmp_path / 'pushed' / 'ds'}"]) == 0
    assert victim.read_text() == "not fastdata's file"
    assert [p.name for p in (tmp_path / "theirs").iterdir()] == ["run.json"]
    assert (tmp_path / "theirs" / "run.json").read_text() == "their run"
    pushed = tree_bytes(tmp_path / "pushed" / "ds")
    assert {k: v for k, v in pushed.items() if not k.startswith(".fastdata-push/")} == tree_bytes(tmp_path / "local")


def _unit_objects(s3, bucket: str, prefix: str) -> list[str]:
    listing = s3.client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/.fastdata-partial/unit-")
    return [o["Key"] for o in listing.get("Contents", [])]


@pytest.mark.faults
def test_a_killed_run_to_a_url_resumes_without_putting_finished_shards_again(s3, tmp_path, puts):
    from fastdata.cli.synthetic import make_image_folder

    fresh_fs()
    src = tmp_path / "src"
    make_image_folder(src, num_classes=2, per_class=40, sizes=((640, 480), (480, 640)))
    url = s3("killed")
    args = ["--size", "32", "--shard-size", "8", "--workers", "1", "--quiet"]
    assert main(["preprocess", "images", str(src), str(tmp_path / "local"), *args]) == 0
    proc = subprocess.Popen([sys.executable, "-m", "fastdata", "preprocess", "images", str(src), f"{url}/ds", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while proc.poll() is None and len(_unit_objects(s3, "killed", "ds")) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done = len(_unit_objects(s3, "killed", "ds"))
    assert 3 <= done < 10 and "ds/manifest.json" not in store_bytes(s3, "killed", "ds")
    assert main(["preprocess", "images", str(src), f"{url}/ds", *args]) == 0
    shards = sorted(n for n in puts if n.startswith("images-"))
    assert shards[0] == f"images-{done:05d}.npy" and len(shards) == 10 - done  # finished shards not put again
    assert store_bytes(s3, "killed", "ds") == tree_bytes(tmp_path / "local")


def test_other_arguments_are_refused_unless_overwrite_and_an_unwritable_url_before_any_work(s3, awkward_folder,
                                                                                           tmp_path, capsys):
    fresh_fs()
    url = s3("args")
    assert preprocess(awkward_folder, f"{url}/ds") == 0
    capsys.readouterr()
    assert preprocess(awkward_folder, f"{url}/ds", "--size", "24") == 1
    assert "already holds a dataset made from another source" in capsys.readouterr().err
    assert preprocess(awkward_folder, f"{url}/ds", "--size", "24", "--overwrite") == 0
    assert json.loads(store_bytes(s3, "args", "ds")["manifest.json"])["sample_shape"] == [24, 24, 3]
    s3.client.put_object(Bucket="args", Key="other/notes.txt", Body=b"mine")
    assert preprocess(awkward_folder, f"{url}/other") == 1
    assert "is not empty and is not a fastdata dataset" in capsys.readouterr().err
    r = subprocess.run([sys.executable, "-m", "fastdata", "preprocess", "images", str(tmp_path / "no-such-source"),
                        "s3://no-such-bucket/ds", "--quiet"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "s3://no-such-bucket" in r.stderr, r.stderr
    assert "no-such-source" not in r.stderr  # refused before the source is read


def test_token_shards_written_to_a_url_are_the_local_runs_bytes_and_resume_from_the_store(s3, tmp_path, puts):
    from test_text import make_docs, write_jsonl

    from fastdata.datasets.tokens import TokenDataset
    from fastdata.preprocess.text import TextPreprocessConfig, preprocess_text

    fresh_fs()
    url = s3("text-out")
    src = write_jsonl(tmp_path / "d.jsonl", make_docs(300, seed=4))

    def run(out, **kw) -> dict:
        return preprocess_text(TextPreprocessConfig(src=src, out=out, shard_tokens=4000, val_fraction=0.1,
                                                    progress=False, **kw))
    run(tmp_path / "local")
    real, calls = store_out.StoreJournal.add, []

    def dies_after_three(self, unit, skipped, partial):  # the run killed once three units are journaled
        if len(calls) == 3:
            raise KeyboardInterrupt
        calls.append(unit["index"])
        return real(self, unit, skipped, partial)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(store_out.StoreJournal, "add", dies_after_three)
        with pytest.raises(KeyboardInterrupt):
            run(f"{url}/ds")
    assert "manifest.json" not in store_bytes(s3, "text-out", "ds")
    before = len(puts)
    m = run(f"{url}/ds")
    shards = [n for n in puts[before:] if n.startswith(("train-0", "val-0"))]
    assert len(m["splits"]["train"]["shards"]) > 4 and shards  # the pieces after the three journaled, only:
    assert not any(n.split("-")[1] in ("00000", "00001", "00002") for n in shards), shards
    assert store_bytes(s3, "text-out", "ds") == tree_bytes(tmp_path / "local")
    local = TokenDataset(tmp_path / "local", "train", seq_len=64)
    remote = TokenDataset(f"{url}/ds", "train", seq_len=64, cache_dir=tmp_path / "cache")
    idx = np.arange(len(local))
    assert len(local) == len(remote) and np.array_equal(local.get_batch(idx)[0].numpy(), remote.get_batch(idx)[0].numpy())
    cached = [p.name for p in (tmp_path / "cache").rglob("*.npy")]
    assert any(n.startswith("train-") for n in cached) and not any("-docs-" in n for n in cached)  # never read


def test_staging_folders_of_processes_gone_are_removed_by_the_next_task(tmp_path, monkeypatch):
    """A Ray worker killed mid-task leaves its staging folder in its node's temporary folder: the next task
    there removes it, and never a live process's."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = tmp_path / f"fastdata-stage-{gone.pid}-abc"
    live = tmp_path / f"fastdata-stage-{os.getpid()}-def"
    other = tmp_path / "fastdata-stage-notes"
    for d in (dead, live, other):
        d.mkdir()
        (d / "images-00000.npy").write_bytes(b"x")
    stage = store_out.task_stage(store_out.StoreOut("s3://bucket/ds"))
    assert stage.parent == tmp_path and stage.name.startswith(f"fastdata-stage-{os.getpid()}-")
    assert not dead.exists() and live.exists() and other.exists()
    store_out.drop_stage(stage)
    assert not stage.exists()


def test_overwrite_keeps_the_old_dataset_until_the_new_arguments_hold_for_every_tar(s3, awkward_folder, tmp_path,
                                                                                    capsys):
    from test_wds_source import _named_tars

    fresh_fs()
    url = f"{s3('keep-old')}/ds"
    assert preprocess(awkward_folder, url, "--format", "lmdb") == 0
    old = store_bytes(s3, "keep-old", "ds")
    # the first tar's samples have no field, the second's a caption: --resize max-side is refused only once
    # every tar is indexed, and the dataset --overwrite would replace must still be whole then
    src = _named_tars(tmp_path / "tars", [[1, 2], [3, 4]], [{}, {"caption": "a dog"}])
    assert preprocess(src, url, "--format", "lmdb", "--resize", "max-side", "--overwrite") == 1
    assert "need the square geometry" in capsys.readouterr().err
    assert store_bytes(s3, "keep-old", "ds") == old  # the refused run's journal (its tar indexes) is gone too
    assert preprocess(src, url, "--format", "lmdb", "--overwrite") == 0  # and a right one replaces it
    assert len(FastDataset(url, cache_dir=tmp_path / "cache")) == 4


def test_a_store_journal_of_many_units_resumes_to_its_first_gap_and_finishes_in_one_pass(tmp_path):
    """A resume at a URL read its units' objects one round trip at a time (10^6 units: hours), its prepare
    and finish compared every listed name with lists (10^6 objects: hours more). Units up to the first gap
    are taken, the ones after it deleted; the transient files are one set."""
    from fastdata.formats.manifest import MANIFEST_NAME, PARTIAL_DIR

    class Counted(list):
        passes = 0

        def __iter__(self):
            type(self).passes += 1
            return super().__iter__()

    folder, n, gap = tmp_path / "out", 1500, 1200
    url = f"file://{folder}"
    first = store_out.StoreOut(url, retry_seconds=0)
    assert first.prepare("fp", overwrite=False) is None
    jr = first.resume("fp")
    run_skipped: list = []
    for k in range(n):
        name = f"images-{k:05d}.npy"
        (folder / name).write_bytes(b"abcd")
        run_skipped.append({"index": 2 * k, "path": f"{k}.jpg", "reason": "bad"})
        jr.add({"index": k, "source_end": 2 * k + 2, "samples": 1, "files": [{"path": name, "bytes": 4}]},
               run_skipped, None)
    (folder / PARTIAL_DIR / store_out.unit_name(gap)).unlink()  # (a unit lost: the ones after it are redone)
    again = store_out.StoreOut(url, retry_seconds=0)
    assert again.prepare("fp", overwrite=False) is None
    resumed = again.resume("fp")
    assert resumed.units == jr.units[:gap] and resumed.skipped == run_skipped[:gap]
    units = sorted(p.name for p in (folder / PARTIAL_DIR).iterdir() if p.name.startswith("unit-"))
    assert units == [store_out.unit_name(k) for k in range(gap)]  # (later ones deleted)
    staging = tmp_path / "staging"
    staging.mkdir()
    (staging / MANIFEST_NAME).write_text(json.dumps({"fingerprint": "fp"}))
    transient = Counted(f"images-{k:05d}.npy" for k in range(0, n, 2))
    Counted.passes = 0
    again.finish(staging, [], transient)
    assert Counted.passes == 1
    assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()) == sorted(
        [MANIFEST_NAME, *(f"images-{k:05d}.npy" for k in range(1, n, 2))])  # (no journal object left)
