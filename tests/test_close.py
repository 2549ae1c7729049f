"""Datasets release what they hold: close(), the context manager, and a dropped dataset (threads, file
descriptors, maps, the node cache's prefetch threads and pins, LMDB environments)."""
from __future__ import annotations

import gc
import os
import threading
from pathlib import Path

import numpy as np
import pytest

from fastdata import ConfigError, FastDataset, FastLoader, TokenDataset

pytestmark = pytest.mark.faults


class _Held:
    """This process's threads and open descriptors. One holds no more than another when it has no thread the
    other had not and no more descriptors: threads and sockets of earlier tests (tqdm's monitor, a test
    server's keep-alive connections) may end meanwhile, but nothing the code under test made may stay."""

    def __init__(self) -> None:
        gc.collect()
        self.threads = set(threading.enumerate())
        self.fds = len(os.listdir("/proc/self/fd"))

    def __le__(self, other: "_Held") -> bool:
        return self.threads <= other.threads and self.fds <= other.fds

    def __repr__(self) -> str:
        return f"{sorted(t.name for t in self.threads)}, {self.fds} descriptors"


def _held() -> _Held:
    return _Held()


def _epoch(ds) -> list[np.ndarray]:
    return [x.numpy().copy() for x, _ in FastLoader(ds, 16, num_threads=2)]


@pytest.mark.parametrize("fmt, storage", [("npy", "mmap"), ("npy", "ram"), ("lmdb", "mmap")])
def test_fifty_dropped_datasets_leave_threads_and_descriptors_flat(indexed_datasets, fmt, storage):
    path = indexed_datasets[fmt]
    want = _epoch(FastDataset(path, storage=storage))
    before = _held()
    for _ in range(50):
        ds = FastDataset(path, storage=storage)
        assert all(np.array_equal(a, b) for a, b in zip(_epoch(ds), want))
        del ds
    assert _held() <= before


def test_close_releases_and_refuses_later_reads_but_earlier_batches_stay(indexed_datasets):
    with FastDataset(indexed_datasets["lmdb"]) as ds:
        x, y = ds.get_batch([3, 1])
        kept = x.clone()
    assert ds.lmdb_reader is None
    with pytest.raises(ConfigError, match="was closed"):
        ds.get_batch([0])
    assert np.array_equal(x, kept) and y.tolist() == [0, 1]
    ds.close()  # a second close does nothing


@pytest.mark.filterwarnings("ignore:cache_limit=.*a plain shuffle")  # a small cache on purpose
def test_a_dropped_streamed_dataset_stops_its_cache_threads(s3, indexed_datasets, tmp_path):  # noqa: F811
    from fastdata.storage.push import push

    url = s3("close-streamed") + "/npy"
    push(indexed_datasets["npy"], url)
    cache = {"cache_dir": tmp_path / "cache", "cache_limit": 4000}  # a few shards: prefetch and eviction run
    want = _epoch(FastDataset(url, **cache))
    before = _held()
    for _ in range(10):
        ds = FastDataset(url, **cache)
        assert all(np.array_equal(a, b) for a, b in zip(_epoch(ds), want))
        del ds
    assert _held() <= before
    ds = FastDataset(url, **cache)
    _epoch(ds)
    ds.close()
    assert _held() <= before
    assert not any(t.name.startswith("fastdata-prefetch") and t.is_alive() for t in threading.enumerate())


def test_token_dataset_close_and_drop(tmp_path):
    from fastdata.cli.main import main

    (tmp_path / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 200)
    assert main(["preprocess", "text", str(tmp_path / "a.txt"), str(tmp_path / "tok"), "--tokenizer", "bytes",
                 "--quiet"]) == 0
    from fastdata.datasets import window_copy

    window_copy.kernel(wait=True)  # the compiled copy's one compile thread (once a process) is over first
    before = _held()
    for _ in range(20):
        ds = TokenDataset(tmp_path / "tok", "train", 16)
        assert len(list(FastLoader(ds, 8, num_threads=2))) > 0
        del ds
    assert _held() <= before
    with TokenDataset(tmp_path / "tok", "train", 16) as ds:
        ds.get_batch([0])
    with pytest.raises(ConfigError, match="was closed"):
        ds.get_batch([0])

    # a read that passed get_batch's check when another thread closed the dataset says "closed" too (before:
    # IndexError on the shard list, or TypeError on the flat windows)
    import json
    lines = "".join(json.dumps({"text": f"document {i} " * 40}) + "\n" for i in range(200))
    (tmp_path / "d.jsonl").write_text(lines)
    assert main(["preprocess", "text", str(tmp_path / "d.jsonl"), str(tmp_path / "many"), "--shard-tokens", "2000",
                 "--val-fraction", "0", "--quiet"]) == 0
    for folder in ("many", "tok"):  # several shards, and one
        ds = TokenDataset(tmp_path / folder, "train", 16)
        assert folder == "tok" or len(ds.manifest["splits"]["train"]["shards"]) > 3
        starts = ds.starts(np.arange(0, len(ds), 7, dtype=np.int64))
        dst = np.empty((len(starts), 17), dtype=ds.np_dtype)
        ds._gather(starts, dst)
        ds.close()
        with pytest.raises(ConfigError, match="was closed"):
            ds._gather(starts, dst)


def test_a_state_names_its_dataset_version_and_another_version_is_refused(indexed_datasets, tmp_path):
    """A resume onto a dataset whose manifest changed (an overwrite, a new push) is refused by name, not
    served from positions that mean other samples now."""
    import json
    import shutil

    from fastdata.formats.manifest import MANIFEST_NAME

    loader = FastLoader(FastDataset(indexed_datasets["npy"]), 16, seed=3)
    it = iter(loader)
    next(it)
    state = json.loads(json.dumps(loader.state_dict()))
    other = Path(shutil.copytree(indexed_datasets["npy"], tmp_path / "other"))
    again = FastLoader(FastDataset(other), 16, seed=3)
    again.load_state_dict(state)  # a copy is the same version
    manifest = json.loads((other / MANIFEST_NAME).read_text())
    manifest["params"]["note"] = "made again"
    (other / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match="another version of .*other"):
        FastLoader(FastDataset(other), 16, seed=3).load_state_dict(state)
    assert set(state) >= {"dataset_sha256", "epoch", "position"}


def test_a_state_on_other_samples_of_the_same_data_is_refused(indexed_datasets, tmp_path):
    """A split or token windows other than the saved ones (same manifest, same length) loaded silently: the
    resumed epoch repeated samples, skipped others and trained on the first split's validation samples."""
    import json

    from fastdata.cli.main import main
    from fastdata.datasets.splits import split

    def state_after_one_batch(ds) -> dict:
        loader = FastLoader(ds, 8, seed=1)
        next(iter(loader))
        return json.loads(json.dumps(loader.state_dict()))  # (as a checkpoint keeps it)

    base = FastDataset(indexed_datasets["npy"])
    state = state_after_one_batch(split(base, 0.25, seed=0)[0])
    FastLoader(split(base, 0.25, seed=0)[0], 8, seed=1).load_state_dict(state)  # the same split: resumes
    for other in (split(base, 0.25, seed=1)[0], split(base, 0.75, seed=0)[1]):
        assert len(other) == len(split(base, 0.25, seed=0)[0])
        with pytest.raises(ConfigError, match="saved on other samples of the dataset"):
            FastLoader(other, 8, seed=1).load_state_dict(state)

    (tmp_path / "a.txt").write_text("".join(f"document {i} " * 40 + "\n\n" for i in range(40)) + "!")
    assert main(["preprocess", "text", str(tmp_path / "a.txt"), str(tmp_path / "tok"), "--tokenizer", "bytes",
                 "--quiet"]) == 0
    saved = dict(seq_len=16, random_windows=True, seed=5)
    state = state_after_one_batch(TokenDataset(tmp_path / "tok", "train", **saved))
    FastLoader(TokenDataset(tmp_path / "tok", "train", **saved), 8, seed=1).load_state_dict(state)
    for change in ({"seed": 6}, {"random_windows": False}, {"seq_len": 17, "stride": 16}):
        other = TokenDataset(tmp_path / "tok", "train", **{**saved, **change})
        assert len(other) == len(TokenDataset(tmp_path / "tok", "train", **saved))
        with pytest.raises(ConfigError, match="saved on other samples of the dataset"):
            FastLoader(other, 8, seed=1).load_state_dict(state)


@pytest.mark.parametrize("fmt", ["npy", "lmdb"])
def test_the_mapped_labels_file_is_let_go_by_close_and_mapped_anew_by_a_worker(indexed_datasets, fmt):
    import pickle

    path = indexed_datasets[fmt]
    labels_file = str(path / "labels.npy")

    def held() -> int:  # descriptors and mappings of the labels file in this process
        fds = sum(os.path.realpath(f"/proc/self/fd/{f}") == labels_file for f in os.listdir("/proc/self/fd"))
        return fds + Path("/proc/self/maps").read_text().count(labels_file)
    ds = FastDataset(path)
    want = ds.targets.copy()
    assert held() == 2  # one map of the one file every label is in (its descriptor and its mapping)
    sent = pickle.loads(pickle.dumps(ds._label_store))  # as a spawned worker receives it: the path, not a copy
    assert "array" not in sent.__dict__ and np.array_equal(sent.array, want)
    del sent
    ds.close()
    gc.collect()
    assert held() == 0
