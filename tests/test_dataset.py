"""FastDataset: values in every storage mode, batch gathers, torch DataLoader drop-in, damaged shards."""
from __future__ import annotations

import json
import pickle
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import INDEXED_N, INDEXED_SIZE, corrupt_lmdb_copy, sample_ids

from fastdata.datasets.images import FastDataset
from fastdata.errors import ChecksumError, ConfigError, FormatError, ImageDecodeError
from fastdata.storage import shm

MODES = ["mmap", "ram", "shm", "cuda"]


def open_ds(path, storage, tmp_path, **kw) -> FastDataset:
    if storage == "shm":
        kw.setdefault("shm_dir", tmp_path / "shm")
        (tmp_path / "shm").mkdir(exist_ok=True)
    if storage == "cuda":
        kw.setdefault("device", "cpu")  # the same index_select code path; the GPU run uses device="cuda"
    return FastDataset(path, storage=storage, **kw)


@pytest.mark.parametrize("storage", MODES)
def test_values_match_the_npy_files(indexed_datasets, tmp_path, storage):
    root = indexed_datasets["npy"]
    ds = open_ds(root, storage, tmp_path)
    ref = np.concatenate([np.load(p) for p in sorted(root.glob("images-*.npy"))])
    labels = np.concatenate([np.load(p) for p in sorted(root.glob("labels-*.npy"))])
    assert len(ds) == INDEXED_N and ds.classes == ["0", "1", "2"] and ds.targets.tolist() == labels.tolist()
    x, y = ds[37]
    assert x.shape == (INDEXED_SIZE, INDEXED_SIZE, 3) and x.dtype == torch.uint8 and y.dtype == torch.int64
    assert np.array_equal(x.numpy(), ref[37]) and int(y) == 37 % 3
    idx = np.array([99, 3, 40, 17, 16, 15, 3, -1])  # across shards, unsorted, repeated, negative
    xb, yb = ds.get_batch(idx)
    assert xb.shape == (8, INDEXED_SIZE, INDEXED_SIZE, 3) and yb.dtype == torch.int64
    assert np.array_equal(xb.numpy(), ref[idx]) and yb.tolist() == labels[idx].tolist()
    assert sample_ids(xb).tolist() == [99, 3, 40, 17, 16, 15, 3, 99]
    sorted_idx = np.arange(10, 60, 3)  # sorted: the one-copy path, one take per shard into its slice
    assert np.array_equal(ds.get_batch(sorted_idx)[0].numpy(), ref[sorted_idx])
    assert np.array_equal(ds[[5, 6]][0].numpy(), ref[[5, 6]]) and np.array_equal(ds[2:5][0].numpy(), ref[2:5])
    assert np.array_equal(ds.get_batch(torch.tensor([8, 1]))[0].numpy(), ref[[8, 1]])


@pytest.mark.parametrize("storage", ["mmap", "ram", "shm"])
def test_get_batch_into_a_given_buffer(indexed_datasets, tmp_path, storage):
    ds = open_ds(indexed_datasets["npy"], storage, tmp_path)
    buf = torch.zeros((10, INDEXED_SIZE, INDEXED_SIZE, 3), dtype=torch.uint8)
    x, y = ds.get_batch([4, 90, 33], out=buf)
    assert x.data_ptr() == buf.data_ptr() and sample_ids(buf[:3]).tolist() == [4, 90, 33]
    with pytest.raises(ConfigError, match="out must be"):
        ds.get_batch(list(range(11)), out=buf)


def test_bad_indices_and_arguments(indexed_datasets):
    ds = FastDataset(indexed_datasets["npy"])
    with pytest.raises(IndexError, match="out of range"):
        ds.get_batch([0, INDEXED_N])
    with pytest.raises(IndexError):
        ds[-INDEXED_N - 1]
    with pytest.raises(ConfigError, match="storage must be one of"):
        FastDataset(indexed_datasets["npy"], storage="disk")
    with pytest.raises(ConfigError, match="size=32 only applies to LMDB"):
        FastDataset(indexed_datasets["npy"], size=32)
    with pytest.raises(ConfigError, match="needs an npy dataset"):
        FastDataset(indexed_datasets["lmdb"], storage="ram")
    for kind in ("npy", "lmdb"):  # (ignored before: the crops were center ones, or the pixels fixed)
        with pytest.raises(ConfigError, match=r"scale=\(0\.5, 1\.0\) and ratio=.* not crop='center'"):
            FastDataset(indexed_datasets[kind], scale=(0.5, 1.0))
    assert FastDataset(indexed_datasets["lmdb"], crop="random", scale=(0.5, 1.0)).random_crops
    for size in (-3, 0, 2.5, True):  # (-3 failed at the first batch, 0 meant the stored size, 2.5 was 2)
        with pytest.raises(ConfigError, match=rf"size must be a positive whole number of pixels.*size={size!r}"):
            FastDataset(indexed_datasets["lmdb"], size=size)
    with pytest.raises(ConfigError, match=r"crop_fraction=0.5 sizes the centre square of crop='center'"):
        FastDataset(indexed_datasets["lmdb"], crop="random", crop_fraction=0.5)  # (ignored before)
    with pytest.raises(ConfigError, match=r"scale must be a \(min, max\) pair, got scale=\(0.1,\)"):
        FastDataset(indexed_datasets["lmdb"], crop="random", scale=(0.1,))  # (an IndexError before)
    with pytest.raises(FormatError, match="not a fastdata dataset"):
        FastDataset(indexed_datasets["npy"].parent / "src")
    assert not ds.streamed and ds.cache_limit is None
    with pytest.raises(ConfigError, match="reads local files: it has no cache to limit"):
        ds.set_cache_limit(1 << 20)


def test_lmdb_decodes_on_the_cpu(indexed_datasets):
    ds = FastDataset(indexed_datasets["lmdb"])
    assert ds.sample_shape == (INDEXED_SIZE, INDEXED_SIZE, 3) and len(ds) == INDEXED_N
    xb, yb = ds.get_batch([0, 51, 99])
    assert sample_ids(xb).tolist() == [0, 51, 99] and yb.tolist() == [0, 0, 0]
    assert np.abs(xb[:, :, :, 2].numpy().astype(int) - 9).max() <= 4  # JPEG: within a few units on flat colour
    small = FastDataset(indexed_datasets["lmdb"], size=4)
    assert small[3][0].shape == (4, 4, 3)


@pytest.mark.parametrize("huffman", [False, True])  # not a JPEG / a whole JPEG that does not decode
def test_lmdb_record_that_does_not_decode_is_a_clear_error(indexed_datasets, tmp_path, huffman):
    ds = FastDataset(corrupt_lmdb_copy(indexed_datasets["lmdb"], tmp_path / "lm", 7, huffman=huffman))
    assert sample_ids(ds.get_batch([6, 8])[0]).tolist() == [6, 8]
    with pytest.raises(ImageDecodeError, match="sample 7 is not a decodable JPEG.*fastdata verify"):
        ds.get_batch([6, 7])


@pytest.mark.parametrize("where", ["key", "meta"])
def test_an_lmdb_store_damaged_in_place_is_a_clear_error(indexed_datasets, tmp_path, where):
    # one flipped bit at the same size (the open's size check passes): a TypeError from the decoder (a key gone)
    # or py-lmdb's own MDB_PAGE_NOTFOUND, naming nothing
    import shutil

    ds = Path(shutil.copytree(indexed_datasets["lmdb"], tmp_path / "lm"))
    store = ds / "images-00000.lmdb"
    data = bytearray(store.read_bytes())
    at = data.find(b"000000000007") + 11 if where == "key" else 4096 + 130  # a key's last digit; the meta page
    data[at] ^= 0x5A if where == "key" else 0x10
    store.write_bytes(bytes(data))
    with pytest.raises(FormatError, match=r"images-00000\.lmdb .*the store is damaged; run `fastdata verify`"):
        FastDataset(ds).get_batch(np.arange(16))


def test_an_lmdb_dataset_remade_while_the_old_one_is_open_is_read_from_its_new_files(indexed_datasets, tmp_path):
    """An LMDB environment was kept per path: a dataset opened after `preprocess --overwrite` (the old one still
    open in the process: a notebook, a long job) read the old stores' images beside the new labels."""
    import gc

    from fastdata.cli.main import main

    src, out = indexed_datasets["npy"].parent / "src" / "list.csv", tmp_path / "ds"
    args = ["preprocess", "images", str(src), str(out), "--format", "lmdb", "--size", "16", "--shard-size", "30",
            "--quiet"]
    assert main(args) == 0
    old = FastDataset(out)
    every = np.arange(len(old))
    before = old.get_batch(every)[0]
    assert main([*args, "--overwrite", "--shuffle", "5"]) == 0  # the same files by name, other samples in them
    images, labels = FastDataset(out).get_batch(every)
    assert not torch.equal(images, before)  # (the old stores' images, before)
    del old
    gc.collect()
    fresh = FastDataset(out).get_batch(every)  # (no environment of the old files left in the process)
    assert torch.equal(images, fresh[0]) and torch.equal(labels, fresh[1])


@pytest.mark.parametrize("fmt, context", [("npy", None), ("lmdb", None),
                                          pytest.param("npy", "spawn", marks=pytest.mark.slow),
                                          pytest.param("lmdb", "spawn", marks=pytest.mark.slow)])
def test_torch_dataloader_drop_in_with_workers(indexed_datasets, fmt, context):
    """Forked workers inherit the dataset; spawned ones (macOS, Windows, CUDA users) get it pickled: its
    settings, not its pixels, and open the files themselves."""
    ds = FastDataset(indexed_datasets[fmt], storage="ram" if fmt == "npy" and context else "mmap")
    loader = torch.utils.data.DataLoader(ds, batch_size=16, shuffle=True, num_workers=2,
                                         multiprocessing_context=context)
    seen, labels = [], []
    for x, y in loader:
        assert x.dtype == torch.uint8 and x.shape[1:] == (INDEXED_SIZE, INDEXED_SIZE, 3)
        seen += sample_ids(x).tolist()
        labels += y.tolist()
    assert sorted(seen) == list(range(INDEXED_N)) and labels == [i % 3 for i in seen]


def test_dataloader_with_batch_sampler_and_no_auto_batching(indexed_datasets):
    ds = FastDataset(indexed_datasets["npy"])
    sampler = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(ds), batch_size=30, drop_last=False)
    batches = list(torch.utils.data.DataLoader(ds, sampler=sampler, batch_size=None))
    assert [len(b[0]) for b in batches] == [30, 30, 30, 10]
    assert sample_ids(torch.cat([b[0] for b in batches])).tolist() == list(range(INDEXED_N))


@pytest.mark.parametrize("storage", ["mmap", "ram"])
def test_pickles_without_its_pixels(indexed_datasets, storage):
    ds = FastDataset(indexed_datasets["npy"], storage=storage)
    blob = pickle.dumps(ds)
    assert len(blob) < 20_000  # configuration only; the receiver maps or loads the data itself
    assert sample_ids(pickle.loads(blob).get_batch([7, 70])[0]).tolist() == [7, 70]


@pytest.mark.parametrize("storage", MODES)
def test_truncated_shard_is_refused(npy_copy, tmp_path, storage):
    f = npy_copy / "images-00002.npy"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(ChecksumError, match=r"images-00002\.npy has .* truncated"):
        open_ds(npy_copy, storage, tmp_path)


def test_every_file_is_checked_by_its_size_at_opening(npy_copy):
    # one stat a file, beside the folder's descriptor (`contained_sizes`): each problem named at the open
    shard, labels = npy_copy / "images-00001.npy", npy_copy / "labels.npy"
    data = shard.read_bytes()
    shard.unlink()
    with pytest.raises(FormatError, match=r"images-00001\.npy is missing"):
        FastDataset(npy_copy)
    shard.mkdir()  # a folder where the shard should be
    with pytest.raises(FormatError, match=r"images-00001\.npy is missing"):
        FastDataset(npy_copy)
    shard.rmdir()
    shard.write_bytes(data)
    labels.write_bytes(labels.read_bytes() + b"\0")  # a file the shards do not list: its size all the same
    with pytest.raises(ChecksumError, match=r"labels\.npy has \d+ bytes but the manifest says"):
        FastDataset(npy_copy)


@pytest.mark.parametrize("kind, name", [("npy", "labels.npy"), ("lmdb", "labels.npy"), ("lmdb", "images-00001.lmdb")])
def test_a_missing_labels_file_or_lmdb_store_is_named_at_opening(indexed_datasets, tmp_path, kind, name):
    # only present files were sized: numpy's FileNotFoundError at the open, lmdb.Error at the first batch
    import shutil

    ds = Path(shutil.copytree(indexed_datasets[kind], tmp_path / "ds"))
    shutil.rmtree(ds / name) if (ds / name).is_dir() else (ds / name).unlink()
    with pytest.raises(FormatError, match=rf"{re.escape(name)} is missing: the dataset is incomplete"):
        FastDataset(ds)


def test_a_labels_file_of_other_values_at_the_same_size_is_refused_at_opening(npy_copy):
    labels = npy_copy / "labels.npy"  # the one file every label is in, memory-mapped: checked when mapped
    n = len(np.load(labels))
    np.save(labels, np.zeros(n, dtype="<f8"))  # same size, float labels
    with pytest.raises(FormatError, match="labels have shape .* float64"):
        FastDataset(npy_copy)


@pytest.mark.parametrize("storage, kw", [("ram", {}), ("cuda", {}), ("shm", {}), ("mmap", {"verify": True})])
def test_tampered_shard_is_refused(npy_copy, tmp_path, storage, kw):
    f = npy_copy / "images-00003.npy"
    data = bytearray(f.read_bytes())
    data[-5] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match=r"images-00003\.npy does not match its checksum"):
        open_ds(npy_copy, storage, tmp_path, **kw)
    if storage == "shm":
        assert shm.list_copies(tmp_path / "shm") == [] and not list((tmp_path / "shm").glob("*.tmp*"))


@pytest.mark.parametrize("name", ["x" * 300 + ".npy", "loop/images-00001.npy"])
def test_a_manifest_path_no_file_can_have_is_a_format_error(npy_copy, name):
    """A name past the file system's 255 bytes, or one through a loop of links, was a raw OSError (ENAMETOOLONG,
    ELOOP) at opening and in `fastdata verify`."""
    from fastdata.errors import FormatError
    from fastdata.formats.integrity import verify

    (npy_copy / "loop").symlink_to("loop")
    m = json.loads((npy_copy / "manifest.json").read_text())
    for f in m["files"]:
        if f["path"] == "images-00001.npy":
            f["path"] = name
    m["shards"][1]["images"] = name
    (npy_copy / "manifest.json").write_text(json.dumps(m))
    for call in (lambda: FastDataset(npy_copy), lambda: verify(npy_copy)):
        with pytest.raises(FormatError, match="which this file system cannot open"):
            call()


def test_shm_one_copy_shared_by_two_processes(indexed_datasets, tmp_path):
    d = tmp_path / "shm"
    d.mkdir()
    code = ("import sys, os; from fastdata.datasets.images import FastDataset; "
            "ds = FastDataset(sys.argv[1], storage='shm', shm_dir=sys.argv[2]); "
            "x, _ = ds.get_batch([5, 77]); print(ds._flat.filename, *x[:, 0, 0, :2].flatten().tolist())")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(indexed_datasets["npy"]), str(d)],
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outs[0] == outs[1] and outs[0][1:] == ["0", "125", "175", "175"]  # same file; index_colour(5), (77)
    copies = shm.list_copies(d)
    assert len(copies) == 1 and copies[0]["bytes"] == 128 + INDEXED_N * INDEXED_SIZE * INDEXED_SIZE * 3
    assert len(list(d.glob("*.npy"))) == 1
    assert shm.remove_copies([], d) == [copies[0]["id"]] and shm.list_copies(d) == []


def test_shm_copy_is_reused_and_named_after_the_data(indexed_datasets, npy_copy, tmp_path):
    d = tmp_path / "shm"
    d.mkdir()
    a = FastDataset(indexed_datasets["npy"], storage="shm", shm_dir=d)
    b = FastDataset(npy_copy, storage="shm", shm_dir=d)  # same bytes elsewhere: the same copy
    assert a._flat.filename == b._flat.filename and len(shm.list_copies(d)) == 1


def test_shm_full_disk_is_a_clear_error(indexed_datasets, tmp_path):
    d = tmp_path / "shm"
    d.mkdir()
    code = ("import resource, signal, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (5000, 5000)); "
            "signal.signal(signal.SIGXFSZ, signal.SIG_IGN); from fastdata.datasets.images import FastDataset; "
            "from fastdata.errors import FastdataError\n"
            "try: FastDataset(sys.argv[1], storage='shm', shm_dir=sys.argv[2])\n"
            "except FastdataError as e: print(e)")
    r = subprocess.run([sys.executable, "-c", code, str(indexed_datasets["npy"]), str(d)], capture_output=True,
                       text=True, timeout=120)
    assert "no space left" in r.stdout and r.returncode == 0, r.stdout + r.stderr
    assert "fastdata shm remove" in r.stdout and "resumes" not in r.stdout  # (said "rerun ... resumes")
    assert list(d.glob("*.npy*")) == []  # nothing half-written that looks finished


def test_shm_cli_lists_and_removes(indexed_datasets, tmp_path, capsys):
    from fastdata.cli.main import main

    d = tmp_path / "shm"
    d.mkdir()
    FastDataset(indexed_datasets["npy"], storage="shm", shm_dir=d)
    assert main(["shm", "list", "--dir", str(d)]) == 0
    out = capsys.readouterr()
    cid = out.out.split()[0]
    assert str(indexed_datasets["npy"]) in out.out and "1 copy" in out.err
    assert main(["shm", "remove", "nope", "--dir", str(d)]) == 1
    assert main(["shm", "remove", "--dir", str(d)]) == 2
    assert main(["shm", "remove", cid, "--dir", str(d)]) == 0 and list(d.iterdir()) == []


def test_public_api():
    import fastdata

    assert fastdata.__all__ == sorted(fastdata.__all__)
    for name in fastdata.__all__:
        assert getattr(fastdata, name) is not None
    assert fastdata.FastDataset is FastDataset


def test_a_validation_split_is_disjoint_deterministic_and_leaves_samples_to_train():
    from fastdata.datasets.splits import split_indices
    from fastdata.errors import ConfigError

    train, val = split_indices(1000, 0.1, seed=3)
    assert len(val) == 100 and len(train) == 900
    assert np.array_equal(np.sort(np.concatenate([train, val])), np.arange(1000))  # every sample, once
    assert all(np.array_equal(a, b) for a, b in zip((train, val), split_indices(1000, 0.1, seed=3)))
    assert not np.array_equal(val, split_indices(1000, 0.1, seed=4)[1])
    assert len(split_indices(12, 0.01)[1]) == 1  # at least one validation sample
    with pytest.raises(ConfigError, match=r"val_fraction=0.99 of 12 samples leaves 0 for training"):
        split_indices(12, 0.99)  # before: "num_samples must be a positive integer, got num_samples=0"
    with pytest.raises(ConfigError, match="leaves 0 for training"):
        split_indices(1, 0.5)


def test_a_split_is_the_same_as_ever_and_its_windows_need_no_number_a_sample(indexed_datasets):
    """A split kept 24 bytes a sample in every rank (its indices, and each sample's shard for shuffle_window:
    48 GB at the peak for 2x10^9 samples). Its shard bounds are made from the base's, and give the order the
    per-sample shards gave; the split itself is the one a saved state names (permutation's order)."""
    from fastdata.datasets.splits import DatasetView, split, split_indices
    from fastdata.loading.loader import FastLoader
    from fastdata.loading.order import group_by_shard
    from fastdata.loading.sampler import DistributedBatchSampler

    n_val = round(1000 * 0.1)
    perm = np.random.default_rng((3, 0x5E1)).permutation(1000)  # (what every split was made of)
    train, val = split_indices(1000, 0.1, seed=3)
    assert np.array_equal(train, np.sort(perm[n_val:])) and np.array_equal(val, np.sort(perm[:n_val]))
    assert train.dtype == val.dtype == np.int64
    ds = FastDataset(indexed_datasets["npy"])
    shards = ds.sample_shards()
    for view in (*split(ds, 0.3, seed=1), DatasetView(ds, np.flatnonzero(shards < 3)),  # (the last shards: none)
                 DatasetView(ds, np.flatnonzero(shards != 1)), DatasetView(ds, np.arange(0))):
        assert np.array_equal(view.shard_bounds(), group_by_shard(view.sample_shards())[0])
        if len(view):  # the order the loader made of each sample's shard before
            before = DistributedBatchSampler(len(view), 4, seed=2, shuffle_window=2, shards=view.sample_shards())
            now = FastLoader(view, 4, seed=2, shuffle_window=2).sampler
            assert now.num_samples == len(view) and all(
                np.array_equal(a, b) for a, b in zip(now.batches(), before.batches(), strict=True))
    assert DatasetView(ds, np.arange(10)[::-1]).shard_bounds() is None  # (unsorted: each sample's shard)


def test_a_train_split_holds_its_validation_set_not_its_own_indices(indexed_datasets):
    """A split's train view held its own indices, 8 bytes a sample in every rank (16 GB at 2x10^9 samples).
    It now holds the validation set it leaves out, and serves what the indices served: the same rows, batches,
    shards, single samples (negative positions too) and read plans."""
    from fastdata.datasets.splits import DatasetView, split, split_indices

    ds = FastDataset(indexed_datasets["npy"])
    train, val = split(ds, 0.1, seed=4)
    want, want_val = split_indices(len(ds), 0.1, seed=4)
    held = sum(a.nbytes for a in vars(train).values() if isinstance(a, np.ndarray))
    assert held <= 2 * want_val.nbytes < want.nbytes  # (the excluded set and its gaps)
    assert np.array_equal(val.indices, want_val) and np.array_equal(train.indices, want) and len(train) == len(want)
    old = DatasetView(ds, want)
    at = np.array([0, 5, len(want) - 1, 17, -1, -len(want)])
    assert np.array_equal(train.rows(at), want[at]) and np.array_equal(train.rows(torch.from_numpy(at)), want[at])
    for a, b in zip(train.get_batch(at), old.get_batch(at), strict=True):
        assert torch.equal(a, b)
    assert np.array_equal(train.sample_shards(), old.sample_shards())
    assert np.array_equal(train.shard_bounds(), old.shard_bounds())
    assert torch.equal(train[-3][0], old[-3][0]) and train[-3][1] == old[-3][1]
    with pytest.raises(IndexError):
        train.rows(np.array([len(want)]))
    with pytest.raises(ConfigError, match="either indices= .* or excluded="):
        DatasetView(ds)
    with pytest.raises(ConfigError, match="takes sample indices \\(integers\\), got bool"):
        DatasetView(ds, excluded=np.zeros(len(ds), bool))
    with pytest.raises(ConfigError, match=f"names samples 3..{len(ds)}, outside the dataset's 0..{len(ds) - 1}"):
        DatasetView(ds, excluded=[3, len(ds)])

    class Huge:  # (a base of 2x10^9 samples, on paper: the view's arithmetic, never its samples)
        sample_shape, sample_dtype, device = (3, 8, 8), torch.uint8, torch.device("cpu")

        def __len__(self):
            return 2 * 10 ** 9

    out = np.array([0, 7, 10 ** 9, 2 * 10 ** 9 - 1])
    view = DatasetView(Huge(), excluded=out)
    assert len(view) == 2 * 10 ** 9 - 4
    assert view.rows(np.array([0, 6, 7, 10 ** 9 - 3, 10 ** 9 - 2, len(view) - 1])).tolist() == [
        1, 8, 9, 10 ** 9 - 1, 10 ** 9 + 1, 2 * 10 ** 9 - 2]
    assert sum(a.nbytes for a in vars(view).values() if isinstance(a, np.ndarray)) == 2 * out.nbytes


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message for a machine without a GPU")
def test_cuda_storage_without_a_gpu_says_what_to_pass_instead(indexed_datasets):
    with pytest.raises(ConfigError, match=r"torch sees no CUDA device: pass storage='ram' or 'shm'"):
        FastDataset(indexed_datasets["npy"], storage="cuda")  # before: AssertionError from inside torch
    assert FastDataset(indexed_datasets["npy"], storage="cuda", device="cpu").get_batch([3])[1].tolist() == [0]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_device_storage_checks_tensor_indices_as_the_host_storages_do(indexed_datasets, device):
    """storage="cuda" cast any tensor index with .long(): a bool mask of 2 samples served all 100 (samples
    0 and 1 over and over), and float indices were truncated; negative ones failed inside torch."""
    host = FastDataset(indexed_datasets["npy"])
    dev = FastDataset(indexed_datasets["npy"], storage="cuda", device=device)
    mask = torch.zeros(len(host), dtype=torch.bool)
    mask[[5, 60]] = True
    for idx in (mask, torch.tensor([60.9]), torch.tensor([[1, 2]])):
        for ds, where in ((host, "cpu"), (dev, device), (dev, "cpu")):
            with pytest.raises(IndexError, match="1-D"):
                ds.get_batch(idx.to(where))
    for dtype in (torch.int64, torch.int32, torch.int16):
        idx = torch.tensor([-1, 3, -100], dtype=dtype)
        want = host.get_batch(idx)
        for where in (device, "cpu"):
            got = dev.get_batch(idx.to(where))
            assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])
    with pytest.raises(IndexError, match="out of range"):  # (indices on the host: checked by value too)
        dev.get_batch(torch.tensor([len(host)]))


def fs_calls(fn) -> int:
    """How many file-system calls (stat, lstat, open, listdir, scandir, readlink) ``fn()`` makes on this
    thread, counted by a profile hook: a count, not a timing, so it holds on any machine."""
    names = {"stat", "lstat", "open", "listdir", "scandir", "readlink"}
    count = 0

    def hook(frame, event, arg) -> None:
        nonlocal count
        if event == "c_call" and getattr(arg, "__name__", "") in names:
            count += 1
    sys.setprofile(hook)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count


@pytest.mark.parametrize("kind, most", [("npy", 4), ("lmdb", 1), ("tokens", 3)])
def test_opening_makes_a_few_file_system_calls_a_shard(tmp_path, kind, most):
    """Every rank opens the dataset at each start and resume: at 10^6 shards each call a shard is 10^6 calls
    (a round trip each on a network file system). The code before resolved every manifest path, several
    times: 68 calls a shard (npy), 30 (LMDB), 46 (tokens); now the size checks' stats (npy: the shard's and its
    labels file's) and the map's stat and open (LMDB: stores are opened when read). benchmarks/bench_open.py
    times it at 10^5 and 10^6 shards."""
    from test_faults_local import many_lmdb_stores, many_shards
    from test_text_pieces import many_token_shards

    from fastdata.datasets.tokens import TokenDataset

    def made(n: int):
        root = tmp_path / f"{kind}-{n}"
        if kind == "tokens":
            many_token_shards(root, n, 100)
            return lambda: TokenDataset(root, seq_len=50)
        (many_shards if kind == "npy" else many_lmdb_stores)(root, n)
        return lambda: FastDataset(root)
    small, large = made(200), made(400)
    assert (fs_calls(large) - fs_calls(small)) / 200 <= most
