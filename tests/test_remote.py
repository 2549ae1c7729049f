"""Datasets at a URL: a real S3 API (moto's server on 127.0.0.1, started here), `fastdata push`, and the
verified node-local cache."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from fastdata.errors import ConfigError

pytestmark = pytest.mark.remote


def _epoch(loader) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(x.numpy().copy(), y.numpy().copy()) for x, y in loader]


def _same(a, b) -> bool:
    return len(a) == len(b) and all(np.array_equal(p, q) for u, v in zip(a, b) for p, q in zip(u, v))


def _downloads(ds, proxy) -> list[dict]:
    """The dataset's downloads per loader pass, once they agree with the GETs the server answered (a
    prefetch for the next epoch may still be under way when an epoch ends; it is counted when it ends)."""
    deadline = time.monotonic() + 10
    while True:
        report = ds.download_report()
        gets = sum(v for k, v in proxy.gets.items() if "images-" in k)
        if sum(r["downloads"] + r["ahead"] for r in report) == gets or time.monotonic() > deadline:
            assert sum(r["downloads"] + r["ahead"] for r in report) == gets, (report, sorted(proxy.gets.items()))
            return report
        time.sleep(0.05)


def test_push_then_read_gives_the_local_batches_and_the_cache_is_reused(s3, indexed_datasets, tmp_path):
    from fastdata.datasets.images import FastDataset
    from fastdata.storage.push import push

    url = s3("push-read") + "/sets/npy"
    counts = push(indexed_datasets["npy"], url, workers=3)
    assert counts == {"uploaded": 15, "skipped": 0}  # 7 image shards, 7 label files, labels.npy
    assert push(indexed_datasets["npy"], url)["skipped"] == 15  # a rerun uploads nothing
    local = FastDataset(indexed_datasets["npy"])
    remote = FastDataset(url, cache_dir=tmp_path / "cache")
    assert len(remote) == len(local) and remote.root.is_relative_to(tmp_path / "cache")
    idx = np.arange(len(local))[::-1]
    for a, b in zip(local.get_batch(idx), remote.get_batch(idx)):
        assert np.array_equal(a.numpy(), b.numpy())
    stamps = {p: p.stat().st_mtime_ns for p in remote.root.glob("*.npy")}
    again = FastDataset(url, cache_dir=tmp_path / "cache")  # the next job: no download, the same files
    assert again.root == remote.root and {p: p.stat().st_mtime_ns for p in again.root.glob("*.npy")} == stamps
    assert not list(remote.root.rglob("*.part-*"))
    # The manifest's text is let go once the node cache holds it (0.3 GB at 10^6 shards in every rank and
    # spawned worker): a spawned worker receives its columns, and the text is read back checked when needed.
    import pickle

    from fastdata.errors import FormatError
    from fastdata.formats.rows import Rows

    raw = (indexed_datasets["npy"] / "manifest.json").read_bytes()
    assert raw not in pickle.dumps(remote) and isinstance(pickle.loads(pickle.dumps(remote)).manifest["files"], Rows)
    assert remote._remote.manifest_bytes() == raw
    (remote.root / "manifest.json").write_bytes(raw.replace(b'"shard_size": 16', b'"shard_size": 17'))
    with pytest.raises(FormatError, match="changed since this dataset was opened"):
        remote._remote.manifest_bytes()


def _pushed_tokens(tmp_path: Path, url: str) -> Path:
    """A token dataset of 40 documents in shards of 1,000 tokens (several shards), made at tmp_path/tok and
    pushed to ``url``; its local folder."""
    from fastdata.cli.main import main
    from fastdata.storage.push import push

    text = tmp_path / "t.jsonl"
    text.write_text("".join(json.dumps({"text": f"document {i}: " + "hello remote world, " * 20}) + "\n"
                            for i in range(40)))
    assert main(["preprocess", "text", str(text), str(tmp_path / "tok"), "--tokenizer", "bytes", "--quiet",
                 "--shard-tokens", "1000"]) == 0
    push(tmp_path / "tok", url)
    return tmp_path / "tok"


def test_lmdb_and_token_datasets_stream_too(s3, indexed_datasets, tmp_path):
    from fastdata.datasets.images import FastDataset
    from fastdata.datasets.tokens import TokenDataset
    from fastdata.loading.loader import FastLoader
    from fastdata.storage.push import push

    url = s3("other-formats")
    push(indexed_datasets["lmdb"], url + "/lmdb")
    a = FastDataset(indexed_datasets["lmdb"], crop="random")
    b = FastDataset(url + "/lmdb", cache_dir=tmp_path / "c", crop="random", cache_limit=3 * 2**20)
    assert not list(b.root.glob("*.lmdb"))  # LMDB shards stream as the batches need them
    assert b.get_batch([0, 5, 99])[1].tolist() == a.get_batch([0, 5, 99])[1].tolist()  # two stores fetched
    assert sorted(p.name for p in b.root.glob("*.lmdb")) == ["images-00000.lmdb", "images-00006.lmdb"]
    for epoch in range(2):  # decode-time random crops drawn from (seed, epoch, position): the same batches
        want, got = FastLoader(a, 16, seed=4, num_threads=2), FastLoader(b, 16, seed=4, num_threads=2)
        want.set_epoch(epoch), got.set_epoch(epoch)
        assert _same(_epoch(got), _epoch(want))
    store = (indexed_datasets["lmdb"] / "images-00000.lmdb").stat().st_size
    small = FastDataset(url + "/lmdb", cache_dir=tmp_path / "c3", cache_limit=2 * store)  # in order: evicts
    for epoch in range(2):
        want = FastLoader(FastDataset(indexed_datasets["lmdb"]), 16, shuffle=False, num_threads=1, prefetch=0)
        got = FastLoader(small, 16, shuffle=False, num_threads=1, prefetch=0)
        assert _same(_epoch(got), _epoch(want))
    assert len(list(small.root.glob("*.lmdb"))) <= 2
    _pushed_tokens(tmp_path, url + "/tok")
    streamed = TokenDataset(url + "/tok", seq_len=16, cache_dir=tmp_path / "c", random_windows=True)
    shards = [sh["path"] for sh in streamed.manifest["splits"]["train"]["shards"]]
    assert not any((streamed.root / n).exists() for n in shards)  # they come with the batches that read them
    local = TokenDataset(tmp_path / "tok", seq_len=16, random_windows=True)
    assert len(local._shards) >= 4  # several shards, windows straddling their boundaries
    assert len(streamed._shard_offsets) == len(local._shard_offsets)
    for epoch in range(2):
        want, got = FastLoader(local, 8, seed=3, num_threads=2), FastLoader(streamed, 8, seed=3, num_threads=2)
        want.set_epoch(epoch), got.set_epoch(epoch)
        assert _same(_epoch(got), _epoch(want))
    with pytest.raises(ConfigError, match="cache_limit"):  # a private RAM copy needs all of it: it must fit
        TokenDataset(url + "/tok", seq_len=16, cache_dir=tmp_path / "c2", cache_limit=1000, storage="ram")


def test_a_corrupted_object_is_never_used_and_the_error_names_it(s3, indexed_datasets, tmp_path):
    from fastdata.datasets.images import FastDataset
    from fastdata.errors import FormatError
    from fastdata.storage.push import push
    from fastdata.storage.remote import RemoteDataset

    url = s3("corrupt") + "/ds"
    push(indexed_datasets["npy"], url)
    key = "ds/images-00002.npy"
    body = bytearray(s3.client.get_object(Bucket="corrupt", Key=key)["Body"].read())
    body[-1] ^= 0xFF  # same size, one flipped byte
    s3.client.put_object(Bucket="corrupt", Key=key, Body=bytes(body))
    remote = RemoteDataset(url, cache_dir=tmp_path / "cache")  # the same wrong bytes twice: not retried further
    with pytest.raises(FormatError, match=r"images-00002\.npy.*after 2 tries.*sha256"):
        remote.local()
    assert not (remote.dir / "images-00002.npy").exists() and not list(remote.dir.rglob("*.part-*"))
    with pytest.raises(FormatError, match="images-00002.npy"):  # the incomplete cache is not read as a dataset
        FastDataset(remote.dir)
    push(indexed_datasets["npy"], url)  # the marker still matches, the size too: push cannot see a flip ...
    s3.client.delete_object(Bucket="corrupt", Key=".fastdata-push/images-00002.npy.sha256".join(["ds/", ""]))
    assert push(indexed_datasets["npy"], url)["uploaded"] == 1  # ... without its marker it uploads again
    assert RemoteDataset(url, cache_dir=tmp_path / "cache").local() == remote.dir


@pytest.mark.parametrize("storage", ["ram", "mmap"])
def test_an_object_deleted_from_the_store_is_named_in_every_storage_mode(s3, indexed_datasets, tmp_path, storage,
                                                                         capsys):
    """Only the streamed mmap path wrapped a missing object: storage="ram", `fastdata cache fetch` and token
    datasets raised a raw FileNotFoundError, whose text printed an http URL's password."""
    from fastdata.datasets.images import FastDataset
    from fastdata.errors import FormatError
    from fastdata.storage.push import push

    url = s3(f"gone-{storage}") + "/ds"
    push(indexed_datasets["npy"], url)
    s3.client.delete_object(Bucket=f"gone-{storage}", Key="ds/images-00001.npy")
    with pytest.raises(FormatError, match=r"cannot fetch s3://gone-\w+/ds/images-00001\.npy: FileNotFoundError: "
                                          r".*check that the dataset is intact in the store \(`fastdata verify URL`\)"):
        ds = FastDataset(url, cache_dir=tmp_path / "c", storage=storage)
        ds.get_batch(np.arange(len(ds)))
    if storage == "ram":
        from fastdata.cli.main import main

        capsys.readouterr()
        assert main(["cache", "fetch", url, "--dir", str(tmp_path / "c2"), "--quiet"]) == 1
        err = capsys.readouterr().err
        assert "Traceback" not in err and "cannot fetch" in err and "images-00001.npy" in err, err


def test_a_half_pushed_or_hostile_dataset_is_refused(s3, indexed_datasets, tmp_path):
    from fastdata.datasets.images import FastDataset
    from fastdata.errors import FormatError

    url = s3("hostile")
    with pytest.raises(FormatError, match="no manifest.json.*push"):
        FastDataset(url + "/nothing-yet", cache_dir=tmp_path / "c")
    manifest = json.loads((indexed_datasets["npy"] / "manifest.json").read_text())
    manifest["files"][0]["path"] = "../other/secrets.npy"
    s3.client.put_object(Bucket="hostile", Key="evil/manifest.json", Body=json.dumps(manifest).encode())
    with pytest.raises(FormatError, match="outside its prefix"):
        FastDataset(url + "/evil", cache_dir=tmp_path / "c")


def test_a_push_of_another_version_that_stops_midway_leaves_no_manifest_to_read(s3, indexed_datasets, tmp_path):
    """A push over another version kept the old manifest until its own went up: one that stopped midway left it
    beside new objects, so the URL passed for complete (inspect said so) and every job failed at its first
    replaced shard with a checksum error."""
    import shutil

    import torch

    from fastdata.datasets.images import FastDataset
    from fastdata.errors import FastdataError, FormatError
    from fastdata.storage.push import push

    url = s3("repush") + "/ds"
    push(indexed_datasets["npy"], url)
    v2 = tmp_path / "v2"
    shutil.copytree(indexed_datasets["lmdb"], v2)
    last = [e["path"] for e in json.loads((v2 / "manifest.json").read_text())["files"] if ".lmdb" in e["path"]][-1]
    data = bytearray((v2 / last).read_bytes())
    (v2 / last).write_bytes(bytes(data[:-1]) + bytes([data[-1] ^ 1]))  # damaged here: the push stops at it
    with pytest.raises(FastdataError, match=last):
        push(v2, url, workers=1)
    assert s3.client.list_objects_v2(Bucket="repush", Prefix="ds/manifest.json")["KeyCount"] == 0
    with pytest.raises(FormatError, match="no manifest.json.*push` has not finished"):
        FastDataset(url, cache_dir=tmp_path / "c")
    (v2 / last).write_bytes(bytes(data))
    assert push(v2, url, workers=1)["skipped"] > 0  # (the objects up before the stop stay)
    local, remote = FastDataset(v2), FastDataset(url, cache_dir=tmp_path / "c")
    assert torch.equal(remote.get_batch(range(len(local)))[0], local.get_batch(range(len(local)))[0])
    assert push(v2, url)["uploaded"] == 0  # a rerun of the same version keeps its manifest


def test_a_manifests_names_are_checked_at_once_as_one_at_a_time():
    """`check_object_names` (one regex over every name joined) refuses exactly what `object_path` refuses,
    naming the first bad name in order, over random names of separators, dots, backslashes and newlines."""
    import random

    from fastdata.errors import FormatError
    from fastdata.storage.object_store import check_object_names, object_path

    def plain(name):
        try:
            object_path("root", name)
            return True
        except FormatError:
            return False
    rng, parts = random.Random(5), ["a", "b", ".", "..", "/", "\\", ":", "//", "\n", "é", "...", ""]
    for _ in range(5000):
        names = ["".join(rng.choice(parts) for _ in range(rng.randint(0, 5))) for _ in range(rng.randint(1, 6))]
        if rng.random() < 0.5:
            names = [n for n in names if plain(n)] or ["x"]
        first = next((n for n in names if not plain(n)), None)
        if first is None:
            check_object_names(names)
        else:
            with pytest.raises(FormatError, match="not a plain relative path") as err:
                check_object_names(names)
            assert repr(first) in str(err.value)
    with pytest.raises(FormatError):
        check_object_names(["a", 7])


def test_ranks_on_a_node_share_one_cache_and_a_dead_downloaders_leftovers_go(s3, indexed_datasets, tmp_path):
    from fastdata.storage.push import push
    from fastdata.storage.remote import RemoteDataset

    url = s3("shared") + "/ds"
    push(indexed_datasets["npy"], url)
    cache = tmp_path / "cache"
    remote = RemoteDataset(url, cache_dir=cache)
    remote.dir.mkdir(parents=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    leftover = remote.dir / f"images-00000.npy.part-{int(dead.stdout)}-abcd"
    leftover.write_bytes(b"half a download")
    script = ("import sys; from fastdata.datasets.images import FastDataset; "
              "ds = FastDataset(sys.argv[1], cache_dir=sys.argv[2]); print(int(ds.get_batch(range(100))[1].sum()))")
    procs = [subprocess.Popen([sys.executable, "-c", script, url, str(cache)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-800:] for _, e in outs]
    assert len({o for o, _ in outs}) == 1  # every process read the same labels
    assert not leftover.exists() and [p.name for p in cache.iterdir()] == [remote.id]


def test_cli_push_and_verify_a_url(s3, indexed_datasets, tmp_path, capsys, monkeypatch):
    from fastdata.cli.main import main

    monkeypatch.setenv("FASTDATA_CACHE", str(tmp_path / "cache"))
    url = s3("cli-bucket") + "/x"
    assert main(["push", str(indexed_datasets["npy"]), url, "--workers", "2", "--quiet"]) == 0
    assert "15 object(s) uploaded" in capsys.readouterr().out
    assert main(["verify", url, "--quiet"]) == 0
    assert "OK, 15 files intact" in capsys.readouterr().out
    assert main(["cache", "fetch", url, "--quiet"]) == 0  # (verify reads the store, not into the cache)
    capsys.readouterr()
    assert main(["inspect", url, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["path"] == url and info["num_samples"] == 100 and info["files"] == 15
    assert main(["cache", "list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert len(listed) == 1 and "15/15 files" in listed[0] and listed[0].endswith(url)
    cid = listed[0].split()[0]
    assert main(["cache", "remove"]) == 2 and main(["cache", "remove", "nope"]) == 1
    capsys.readouterr()
    from fastdata.storage.cache_folders import default_cache_dir

    # the folder given before the id (argparse took no id before an option: "unrecognized arguments")
    assert main(["cache", "remove", "--dir", str(default_cache_dir()), cid]) == 0
    assert capsys.readouterr().out == f"removed {cid}\n"
    assert main(["cache", "list"]) == 0 and capsys.readouterr().out == ""


@pytest.mark.slow
def test_a_full_cache_disk_is_one_clear_line_not_retried_and_a_rerun_completes(s3, indexed_datasets, tmp_path,
                                                                              monkeypatch):
    from conftest import disk_of

    from fastdata.cli.main import main
    from fastdata.storage.push import push
    from fastdata.storage.remote import RemoteDataset

    url, cache = s3("fullcache") + "/ds", tmp_path / "cache"
    push(indexed_datasets["npy"], url)
    remote = RemoteDataset(url, cache_dir=cache)
    remote.prepare(frozenset(e["path"] for e in remote.manifest["files"]))  # the manifest only
    shard = max(e["bytes"] for e in remote.manifest["files"])
    assert 2_000 < shard  # image shards (3.2 kB) cannot be written; labels files (< 1 kB) can

    small_disk = disk_of(2_000)  # no file may grow past 2 kB
    monkeypatch.setenv("FASTDATA_CACHE", str(cache))
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "fastdata", "cache", "fetch", url, "--quiet"], capture_output=True,
                       text=True, preexec_fn=small_disk, timeout=300)
    err = r.stderr.strip()
    assert r.returncode == 1 and "Traceback" not in err and len(err.splitlines()) == 1, err
    assert "no space left while writing" in err and str(remote.dir) in err and "cache_limit" in err, err
    assert "tries" not in err and time.monotonic() - t0 < 60, err  # a full disk is not a network fault
    from fastdata.formats.integrity import check_file

    present = [e for e in remote.manifest["files"] if (remote.dir / e["path"]).exists()]
    assert all(check_file(remote.dir, e) is None for e in present)  # what has a final name is whole
    assert not any(e["bytes"] > 2_000 for e in present) and not list(remote.dir.rglob("*.part-*"))
    assert main(["cache", "fetch", url, "--quiet"]) == 0  # the disk has room again: the rerun completes
    monkeypatch.setenv("FASTDATA_CACHE", str(tmp_path / "empty"))  # full before even the manifest fits
    assert len(remote.manifest_bytes()) > 2_000
    r = subprocess.run([sys.executable, "-m", "fastdata", "cache", "fetch", url, "--quiet"], capture_output=True,
                       text=True, preexec_fn=small_disk, timeout=300)
    assert r.returncode == 1 and "manifest.json" in r.stderr and "cache_limit" in r.stderr, r.stderr


def test_push_to_a_file_url_makes_its_folders_and_reads_back_the_same_batches(indexed_datasets, tmp_path,
                                                                             capsys):
    pytest.importorskip("fsspec")
    from fastdata.cli.main import main
    from fastdata.datasets.images import FastDataset
    from fastdata.loading.loader import FastLoader

    url = (tmp_path / "share" / "datasets" / "x").as_uri()  # folders that do not exist yet (a shared mount)
    assert main(["push", str(indexed_datasets["npy"]), url, "--quiet"]) == 0  # before: FileNotFoundError
    assert "15 object(s) uploaded" in capsys.readouterr().out
    assert main(["push", str(indexed_datasets["npy"]), url, "--quiet"]) == 0
    assert "0 object(s) uploaded, 15 already there" in capsys.readouterr().out
    remote = FastDataset(url, cache_dir=tmp_path / "cache")
    local = FastDataset(indexed_datasets["npy"])
    assert _same(_epoch(FastLoader(remote, 16, shuffle=False)), _epoch(FastLoader(local, 16, shuffle=False)))


def test_urls_need_the_remote_extra_and_local_paths_refuse_remote_options(monkeypatch, indexed_datasets):
    from fastdata.datasets.images import FastDataset
    from fastdata.errors import ConfigError, MissingDependencyError
    from fastdata.storage.object_store import is_url
    from fastdata.storage.remote import scrub

    assert is_url("s3://b/p") and is_url("file:///tmp/x") and not is_url("/tmp/x") and not is_url("C:/x")
    assert scrub("https://h/p?X-Amz-Signature=abc123&X-Amz-Credential=AKIA/x") == \
        "https://h/p?X-Amz-Signature=***&X-Amz-Credential=***"
    monkeypatch.setitem(sys.modules, "fsspec", None)
    with pytest.raises(MissingDependencyError, match=r"fastdata\[remote\]"):
        FastDataset("s3://bucket/data")
    with pytest.raises(ConfigError, match="URLs"):
        FastDataset(indexed_datasets["npy"], cache_dir="/tmp/nowhere")


def _shards_present(ds) -> list[str]:
    return sorted(p.name for p in ds.root.glob("images-*.npy"))


def _without_all_labels(src, dst):
    """A copy of an npy dataset as made before ``labels.npy``: its readers use each shard's labels file."""
    import shutil

    shutil.copytree(src, dst)
    m = json.loads((dst / "manifest.json").read_text())
    del m["all_labels"]
    m["files"] = [f for f in m["files"] if f["path"] != "labels.npy"]
    (dst / "labels.npy").unlink()
    (dst / "manifest.json").write_text(json.dumps(m))
    return dst


@pytest.mark.parametrize("layout", ["all_labels", "per_shard"])
def test_a_streamed_dataset_fetches_each_shard_as_the_batches_need_it_once(s3, proxy, indexed_datasets, tmp_path,
                                                                          layout):
    from fastdata.datasets.images import FastDataset
    from fastdata.loading.loader import FastLoader
    from fastdata.storage.push import push

    data = indexed_datasets["npy"] if layout == "all_labels" else _without_all_labels(indexed_datasets["npy"],
                                                                                      tmp_path / "old")
    url = s3("stream" + str(len(layout))) + "/ds"
    push(data, url)
    proxy.clear()
    ds = FastDataset(url, cache_dir=tmp_path / "cache")
    # opening reads the manifest (and every label, in one file, when there is one): shards come with batches
    assert [p.name for p in ds.root.glob("*.npy")] == (["labels.npy"] if layout == "all_labels" else [])
    local = FastDataset(data)
    assert ds.get_batch([40])[1].tolist() == local.get_batch([40])[1].tolist()  # on demand: one shard
    assert _shards_present(ds) == ["images-00002.npy"]
    other = FastDataset(url, cache_dir=tmp_path / "other")
    assert np.array_equal(other.targets, local.targets) and _shards_present(other) == []  # labels only
    for epoch in range(2):
        want = FastLoader(local, 16, seed=5, num_threads=2)
        got = FastLoader(ds, 16, seed=5, num_threads=2)
        want.set_epoch(epoch), got.set_epoch(epoch)
        assert _same(_epoch(got), _epoch(want))
    shards = [k for k in proxy.gets if "images-" in k]
    assert len(shards) == 7 and all(proxy.gets[k] == 1 for k in shards)  # each shard downloaded once, then reused
    labels = sorted((k.rsplit("/", 1)[1], v) for k, v in proxy.gets.items() if "labels" in k)
    if layout == "all_labels":  # one request per dataset opened for every label
        assert labels == [("labels.npy", 2)], labels
    else:  # each shard's labels with it (once more for `other`'s targets)
        assert labels == [("labels-%05d.npy" % k, 2) for k in range(7)], labels
    assert not list(ds.root.rglob("*.part-*"))


def test_each_file_is_one_ranged_get_and_big_files_come_in_pieces(s3, proxy, indexed_datasets, tmp_path,
                                                                 monkeypatch):
    from fastdata.storage import remote as remote_mod
    from fastdata.storage.push import push
    from fastdata.storage.remote import RemoteDataset

    url = s3("ranged") + "/ds"
    push(indexed_datasets["npy"], url)
    proxy.clear()
    remote = RemoteDataset(url, cache_dir=tmp_path / "whole")
    files = remote.manifest["files"]
    remote.local()
    assert not [k for k in proxy.heads if "manifest" not in k]  # the manifest's sizes are used: no HEAD per file
    gets = {k.rsplit("/", 1)[1]: v for k, v in proxy.gets.items() if "manifest" not in k}
    assert gets == {f["path"]: 1 for f in files}
    for f in files:
        assert (remote.dir / f["path"]).read_bytes() == (indexed_datasets["npy"] / f["path"]).read_bytes()

    big = max(files, key=lambda f: f["bytes"])
    monkeypatch.setattr(remote_mod, "_WHOLE", 1000)
    monkeypatch.setattr(remote_mod, "_BLOCK", 1000)
    proxy.clear()
    pieces = RemoteDataset(url, cache_dir=tmp_path / "pieces", retry_seconds=1)
    pieces.prepare(frozenset(f["path"] for f in files))
    got = pieces.fetch(big)
    assert got.read_bytes() == (indexed_datasets["npy"] / big["path"]).read_bytes()
    assert sum(v for k, v in proxy.gets.items() if k.endswith(big["path"])) == -(-big["bytes"] // 1000)
    assert not [k for k in proxy.heads if "manifest" not in k]

    # a server that ignores Range answers the first piece with the whole object: used, once verified
    proxy.clear()
    proxy.inject("norange", r"\.npy", times=1000)
    (pieces.dir / big["path"]).unlink()
    assert pieces.fetch(big).read_bytes() == (indexed_datasets["npy"] / big["path"]).read_bytes()
    assert sum(v for k, v in proxy.gets.items() if k.endswith(big["path"])) == 1


def test_a_fault_on_one_piece_of_a_big_file_fetches_that_piece_again_not_the_file(s3, indexed_datasets, tmp_path,
                                                                                  monkeypatch):
    """A file in pieces (over 64 MB: pieces of 8 MB, scaled down here) whose store answers one GET in four with
    503 SlowDown: each failed piece is fetched again on its own (before, the whole file from byte 0, so it never
    arrived: 75% of the GETs answered, the budget spent on restarts). Only a whole body that fails its sha256 is
    fetched again from its first byte."""
    import itertools

    from conftest import fresh_fs
    from s3_faults import FaultProxy

    from fastdata.datasets.images import FastDataset
    from fastdata.storage import remote as remote_mod
    from fastdata.storage.push import push

    url = s3("pieces-503") + "/ds"
    push(indexed_datasets["npy"], url)
    count = itertools.count(1)

    class Throttled(FaultProxy):
        def _fault_for(self, method, path):
            if method == "GET" and "images-00000" in path and next(count) % 4 == 0:
                with self.lock:
                    self.faults["503"] += 1
                return "503"
            return super()._fault_for(method, path)
    proxy = Throttled(s3.port)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    fresh_fs()
    monkeypatch.setattr(remote_mod, "_WHOLE", 256)  # (64 MB and 8 MB, scaled down: a shard of 3,200 bytes)
    monkeypatch.setattr(remote_mod, "_BLOCK", 256)
    try:
        ds = FastDataset(url, cache_dir=tmp_path / "cache", retry_seconds=5)
        local = FastDataset(indexed_datasets["npy"])
        for a, b in zip(ds.get_batch(range(16)), local.get_batch(range(16))):
            assert np.array_equal(a.numpy(), b.numpy())
        pieces = -(-(indexed_datasets["npy"] / "images-00000.npy").stat().st_size // 256)
        answered = sum(v for k, v in proxy.gets.items() if k.endswith("images-00000.npy"))
        assert answered == pieces and proxy.faults["503"] == (pieces - 1) // 3, (answered, dict(proxy.faults))
        ds.close()
        # a piece whose bytes were flipped on the way: the whole body fails its sha256, and comes again whole
        proxy.clear()
        proxy.inject("corrupt", r"images-00001\.npy")
        ds = FastDataset(url, cache_dir=tmp_path / "cache2", retry_seconds=5)
        for a, b in zip(ds.get_batch(range(16, 32)), local.get_batch(range(16, 32))):
            assert np.array_equal(a.numpy(), b.numpy())
        assert sum(v for k, v in proxy.gets.items() if k.endswith("images-00001.npy")) == 2 * pieces
        ds.close()
    finally:
        proxy.close()
        fresh_fs()


def _size_now(path) -> int:
    """A cached file's size, 0 when the prefetcher evicted it since it was listed."""
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return 0


@pytest.mark.filterwarnings("ignore:cache_limit=.* holds about:UserWarning")  # the plain shuffle, on purpose
@pytest.mark.filterwarnings("error")  # (the mark above wins over this one)
def test_cache_limit_bounds_the_cache_and_evicts_the_shard_needed_last(s3, proxy, indexed_datasets, tmp_path):
    from fastdata.datasets.images import FastDataset
    from fastdata.loading.loader import FastLoader
    from fastdata.storage.push import push

    url = s3("limit") + "/ds"
    push(indexed_datasets["npy"], url)
    shard_bytes = sum((indexed_datasets["npy"] / f"{k}-00000.npy").stat().st_size for k in ("images", "labels"))
    local = FastDataset(indexed_datasets["npy"])
    for shuffle, batch, limit in ((False, 16, 3), (True, 4, 4)):  # room for one batch's shards and more
        proxy.clear()
        ds = FastDataset(url, cache_dir=tmp_path / f"cache{shuffle}", cache_limit=limit * shard_bytes)
        for epoch in range(2):
            want = FastLoader(local, batch, shuffle=shuffle, seed=1, num_threads=1, prefetch=0)
            got = FastLoader(ds, batch, shuffle=shuffle, seed=1, num_threads=1, prefetch=0)
            want.set_epoch(epoch), got.set_epoch(epoch)
            for (a, b), (c, d) in zip(got, want):
                assert np.array_equal(a.numpy(), c.numpy()) and np.array_equal(b.numpy(), d.numpy())
                sizes = sum(_size_now(p) for p in ds.root.glob("*-0*.npy"))
                assert sizes <= limit * shard_bytes, sizes
        ds._cache.close()  # prefetches for a next epoch under way end here: the counts below are final
        first, second = report = _downloads(ds, proxy)[-2:]
        assert first["batches"] == second["batches"] == got.sampler.epoch_batches(), report
        if not shuffle:  # in order, 7 shards, room for 3: 7 the first epoch, which keeps 0 and 1 for the second
            # (the next epoch's order is known); the second keeps 6 from the first: 4. 11 is Belady's optimum
            # over the two epochs (12 without the next epoch known); a prefetch racing a release may cost one more
            assert first["downloads"] == 7 and first["repeats"] == second["repeats"] == 0, report
            assert 4 <= first["ahead"] + second["downloads"] <= 5, report
        else:  # a shuffle reads most shards in every few batches: shards come back, never a wrong batch
            assert first["repeats"] > 0 and first["downloads"] + first["ahead"] + second["downloads"] > 14, report
    with pytest.raises(ConfigError, match="cache_limit"):
        FastDataset(url, cache_dir=tmp_path / "c3", cache_limit=shard_bytes, storage="ram")
    with pytest.raises(ConfigError, match="cache_limit must be"):
        FastDataset(url, cache_dir=tmp_path / "c3", cache_limit="lots")


def test_faults_are_survived_and_the_same_batches_delivered(s3, proxy, indexed_datasets, tmp_path):
    from fastdata.datasets.images import FastDataset
    from fastdata.loading.loader import FastLoader
    from fastdata.storage.push import push

    url = s3("faults") + "/ds"
    push(indexed_datasets["npy"], url)
    proxy.clear()
    proxy.inject("reset", r"images-00001")
    proxy.inject("truncate", r"images-00003")
    proxy.inject("corrupt", r"images-00004")
    proxy.inject("503", r"images-00005", times=2)
    proxy.inject("corrupt", r"/labels\.npy")  # every label, read at opening
    ds = FastDataset(url, cache_dir=tmp_path / "cache")
    proxy.down(1.0)  # the server disappears for a second just as the epoch starts
    got = _epoch(FastLoader(ds, 16, seed=2, num_threads=2))
    assert _same(got, _epoch(FastLoader(FastDataset(indexed_datasets["npy"]), 16, seed=2, num_threads=2)))
    assert proxy.faults == {"reset": 1, "truncate": 1, "corrupt": 2, "503": 2}
    assert not list(ds.root.rglob("*.part-*"))
    from fastdata.formats.integrity import verify
    problems = verify(ds.root)  # only verified bytes were ever given a final name (the shards' label files
    assert all(p.startswith("labels-") and p.endswith(": missing") for p in problems), problems  # are never read)


def test_after_the_retries_one_line_names_the_object_and_the_cause(s3, proxy, indexed_datasets, tmp_path):
    from fastdata.datasets.images import FastDataset
    from fastdata.errors import FormatError
    from fastdata.storage.push import push
    from fastdata.storage.remote import RemoteDataset

    url = s3("giveup") + "/ds"
    push(indexed_datasets["npy"], url)
    proxy.inject("truncate", r"images-00002", times=1000)
    remote = RemoteDataset(url, cache_dir=tmp_path / "cache", retry_seconds=1)
    remote.prepare(frozenset({"images-00002.npy"}))
    with pytest.raises(FormatError) as err:
        remote.fetch(remote.entry("images-00002.npy"))
    msg = str(err.value)
    assert "\n" not in msg and "images-00002.npy" in msg and " tries over " in msg and "testing" not in msg
    assert not (remote.dir / "images-00002.npy").exists() and not list(remote.dir.rglob("*.part-*"))
    proxy.clear()  # the store recovers: the same dataset object reads on
    ds = FastDataset(url, cache_dir=tmp_path / "cache")
    assert ds.get_batch([33])[1].tolist() == FastDataset(indexed_datasets["npy"]).get_batch([33])[1].tolist()


@pytest.mark.parametrize("change", ["shorter", "longer"])
def test_an_object_of_another_size_in_the_store_is_named_replaced_not_retried(s3, proxy, indexed_datasets, tmp_path,
                                                                               change):
    """An object replaced by a shorter one (a body that ends cleanly, short) was retried for the whole budget and
    blamed on the network; the store's own size tells it from a body cut on its way, which is still retried."""
    from fastdata.errors import ChecksumError
    from fastdata.storage.push import push
    from fastdata.storage.remote import RemoteDataset

    bucket = f"resized-{change}"
    url = s3(bucket) + "/ds"
    push(indexed_datasets["npy"], url)
    body = (indexed_datasets["npy"] / "images-00002.npy").read_bytes()
    s3.client.put_object(Bucket=bucket, Key="ds/images-00002.npy",
                         Body=body[:-100] if change == "shorter" else body + b"\0" * 100)
    proxy.clear()
    proxy.inject("norange", r"images-00002")  # the whole longer object comes back, whatever range was asked
    proxy.inject("truncate", r"images-00003")  # a body cut on its way: retried, the object is intact
    remote = RemoteDataset(url, cache_dir=tmp_path / "cache", retry_seconds=30)
    remote.prepare(frozenset({"images-00002.npy"}))
    assert (remote.dir / "images-00003.npy").stat().st_size == (indexed_datasets["npy"] / "images-00003.npy").stat(
    ).st_size and proxy.faults.get("truncate") == 1
    with pytest.raises(ChecksumError, match=r"images-00002\.npy: the store's object has \d+ bytes, not the "
                       r"manifest's \d+: it was replaced or damaged after `fastdata push`") as err:
        remote.fetch(remote.entry("images-00002.npy"))
    assert "\n" not in str(err.value) and "tries" not in str(err.value)
    assert not (remote.dir / "images-00002.npy").exists() and not list(remote.dir.rglob("*.part-*"))


def test_a_dataset_changed_under_a_running_job_is_refused_not_mixed(s3, indexed_datasets, tmp_path):
    from fastdata.datasets.images import FastDataset
    from fastdata.errors import FormatError
    from fastdata.storage.push import push

    url = s3("changed") + "/ds"
    push(indexed_datasets["npy"], url)
    ds = FastDataset(url, cache_dir=tmp_path / "cache")
    ds.get_batch([0])
    # a new version is pushed over it: one shard's bytes and the manifest change
    manifest = json.loads((indexed_datasets["npy"] / "manifest.json").read_text())
    arr = np.load(indexed_datasets["npy"] / "images-00003.npy")
    import hashlib
    import io
    buf = io.BytesIO()
    np.save(buf, 255 - arr)
    for f in manifest["files"]:
        if f["path"] == "images-00003.npy":
            f["sha256"] = hashlib.sha256(buf.getvalue()).hexdigest()
    s3.client.put_object(Bucket="changed", Key="ds/images-00003.npy", Body=buf.getvalue())
    s3.client.put_object(Bucket="changed", Key="ds/manifest.json", Body=json.dumps(manifest).encode())
    with pytest.raises(FormatError, match="changed while this job was reading it"):
        ds.get_batch([50])
    assert not (ds.root / "images-00003.npy").exists()
    fresh = FastDataset(url, cache_dir=tmp_path / "cache")  # a new job reads the new version, in its own folder
    assert fresh.root != ds.root and np.array_equal(fresh.get_batch([50])[0][0].numpy(), 255 - arr[2])


@pytest.mark.distributed
@pytest.mark.slow
def test_torchrun_ranks_share_one_cache_download_once_and_resume_at_another_world(s3, proxy, indexed_datasets,
                                                                                 tmp_path, monkeypatch):
    from collections import Counter

    from conftest import INDEXED_N
    from test_distributed import torchrun

    from fastdata.storage.push import push

    url = s3("ddp") + "/ds"
    push(indexed_datasets["npy"], url)
    proxy.clear()
    monkeypatch.setenv("FASTDATA_CACHE", str(tmp_path / "cache"))
    first = torchrun(2, tmp_path / "a", url, "8", "3")
    state = tmp_path / "state.json"
    state.write_text(json.dumps(first[0]["state"]))
    second = torchrun(3, tmp_path / "b", url, "8", "-1", str(state))
    assert len({r["batches"] for r in second}) == 1
    before = Counter(i for r in first for i in r["seen"])
    after = Counter(i for r in second for i in r["seen"])
    assert max(before.values()) == 1 and set(before) | set(after) == set(range(INDEXED_N))
    assert not set(before) & set(after)
    files = [k for k in proxy.gets if k.endswith(".npy")]
    assert sorted(k.rsplit("/", 1)[1] for k in files) == ["images-%05d.npy" % k for k in range(7)] + ["labels.npy"]
    assert all(proxy.gets[k] == 1 for k in files), proxy.gets  # one download per node (every label at opening)
    assert [p.name for p in (tmp_path / "cache").iterdir()] != []
    # one dataset version per job: rank 0 reads the manifest and hands its bytes to the others
    assert sum(n for k, n in proxy.gets.items() if k.endswith("manifest.json")) == 2, proxy.gets
    assert len({r["state"]["dataset_sha256"] for r in first + second}) == 1


def test_a_windowed_shuffle_streams_each_shard_once_an_epoch_through_a_small_cache(s3, proxy, indexed_datasets,
                                                                                tmp_path):
    from collections import Counter

    from fastdata.datasets.images import FastDataset
    from fastdata.loading.loader import FastLoader
    from fastdata.storage.push import push

    url = s3("window") + "/ds"
    push(indexed_datasets["npy"], url)
    group = sum((indexed_datasets["npy"] / f"{k}-00000.npy").stat().st_size for k in ("images", "labels"))
    local = FastDataset(indexed_datasets["npy"])
    proxy.clear()
    ds = FastDataset(url, cache_dir=tmp_path / "cache", cache_limit=4 * group)  # 4 of the 7 shards fit
    for epoch in range(2):
        # one batch in flight: it reads at most 4 shards (two windows' worth), which the cache holds; with
        # more batches in flight than the cache holds shards, a batch evicts a prefetched one (a re-download)
        want = FastLoader(local, 8, seed=6, shuffle_window=2, num_threads=1, prefetch=0)
        got = FastLoader(ds, 8, seed=6, shuffle_window=2, num_threads=1, prefetch=0)
        want.set_epoch(epoch), got.set_epoch(epoch)
        batches = _epoch(got)
        assert _same(batches, _epoch(want))
        ids = Counter(want.sampler.rank_indices().tolist())
        assert set(ids) == set(range(100)) and max(ids.values()) == 1
        first = want.sampler.rank_indices()[:8] // 16
        assert len(set(first.tolist())) <= 2  # the first batch needs at most the window's 2 shards
        report = _downloads(ds, proxy)
        assert len(report) == epoch + 1 and report[-1]["batches"] == len(batches), report
        # every shard at most once an epoch though the cache holds 4 of 7 (the second epoch reuses some;
        # what the first fetched ahead for it counts as the second's)
        assert report[-1]["repeats"] == 0, report
        if epoch == 0:
            assert report[0]["downloads"] == 7, report
        else:
            assert 0 < report[0]["ahead"] + report[1]["downloads"] < 7, report


@pytest.mark.parametrize("threads, limited", [(1, "opening"), (3, "opening"), (1, "later")])
def test_labels_that_come_with_streamed_shards_are_held_while_their_shard_is_open(s3, proxy, indexed_datasets,
                                                                               tmp_path, monkeypatch, threads,
                                                                               limited):
    """A labels.npy too big to read at opening (past 8M samples): each shard's labels come with it and are
    held only while the shard is open in this process, so with a cache_limit (given at opening, or later as a
    Mixture gives it) memory goes with the cache, not the dataset (10^9 samples were 8 GB of labels a rank).
    Every batch's labels are still right."""
    from fastdata.datasets.images import FastDataset
    from fastdata.loading.loader import FastLoader
    from fastdata.storage import streamed
    from fastdata.storage.push import push

    monkeypatch.setattr(streamed, "ALL_LABELS_AT_OPEN", 0)
    url = s3("held" + str(threads) + limited) + "/ds"
    push(indexed_datasets["npy"], url)
    group = sum((indexed_datasets["npy"] / f"{k}-00000.npy").stat().st_size for k in ("images", "labels"))
    local = FastDataset(indexed_datasets["npy"])
    if limited == "opening":
        ds = FastDataset(url, cache_dir=tmp_path / "cache", cache_limit=4 * group)  # 4 of the 7 shards fit
    else:
        ds = FastDataset(url, cache_dir=tmp_path / "cache")
        ds.set_cache_limit(4 * group)
    store = ds._label_store
    assert store.held == {} and "array" not in store.__dict__ and not list(ds.root.glob("*.npy"))
    most = 0
    for epoch in range(2):
        want = FastLoader(local, 8, seed=6, shuffle_window=2, num_threads=threads)
        got = FastLoader(ds, 8, seed=6, shuffle_window=2, num_threads=threads)
        want.set_epoch(epoch), got.set_epoch(epoch)
        batches = []
        for x, y in got:
            batches.append((x.numpy().copy(), y.numpy().copy()))
            with ds._cache._cond:  # (shards open and close under the cache's lock)
                held, opened = set(store.held), set(np.flatnonzero(ds._cache._is_open).tolist())
            assert held == opened, (held, opened)
            most = max(most, len(held))
        assert _same(batches, _epoch(want))
        assert np.array_equal(ds.get_batch([99, 0, 50])[1], local.get_batch([99, 0, 50])[1])
    assert most > 0 and "array" not in store.__dict__
    if threads == 1:  # the cache holds 4 shards (three threads may pin more at once: it then goes past its limit)
        assert most <= 4
    assert np.array_equal(ds.targets, local.targets)  # asked for: one array of every label, from then on
    assert store.held == {} and np.array_equal(ds.get_batch([3, 97])[1], local.get_batch([3, 97])[1])


def test_a_close_racing_a_streamed_read_says_closed_not_a_missing_shard(s3, indexed_datasets, tmp_path,
                                                                       monkeypatch):
    """A dataset closed on another thread while a batch is read lets go of the batch's shards, their held
    labels with them: the read failed with a bare KeyError (the shard's number); it says the dataset was
    closed, as any read after the close does."""
    from fastdata.datasets.images import FastDataset
    from fastdata.errors import ConfigError
    from fastdata.storage import streamed
    from fastdata.storage.push import push

    monkeypatch.setattr(streamed, "ALL_LABELS_AT_OPEN", 0)
    url = s3("racing") + "/ds"
    push(indexed_datasets["npy"], url)
    ds = FastDataset(url, cache_dir=tmp_path / "cache", cache_limit="1MB")
    assert ds.get_batch([1, 40])[1].tolist() == FastDataset(indexed_datasets["npy"]).get_batch([1, 40])[1].tolist()
    images = ds._host_images

    def closed_meanwhile(*args, **kw):  # (the close of another thread, between the images and the labels)
        x = images(*args, **kw)
        ds.close()
        return x
    monkeypatch.setattr(ds, "_host_images", closed_meanwhile)
    with pytest.raises(ConfigError, match="was closed: open the dataset again"):
        ds.get_batch([2, 70])


def test_a_cache_limit_set_after_opening_is_the_one_a_spawned_worker_opens_with(s3, indexed_datasets, tmp_path):
    """A spawned or forkserver DataLoader worker opens the dataset again from its pickled state: a limit set
    after opening (as a Mixture sets its sources') must be the one it opens with; it opened with none, so its
    cache kept every shard it read. Another reader of the same opened path keeps its own limit."""
    import pickle

    from fastdata.datasets.images import FastDataset
    from fastdata.datasets.tokens import TokenDataset
    from fastdata.storage.opening import open_path
    from fastdata.storage.push import push

    url = s3("later-limit")
    push(indexed_datasets["npy"], url + "/ds")
    _pushed_tokens(tmp_path, url + "/tok")
    opened = open_path(url + "/ds", ("fastdata.images.npy",), cache_dir=tmp_path / "c")
    datasets = [FastDataset(opened), TokenDataset(url + "/tok", seq_len=16, cache_dir=tmp_path / "c")]
    for ds in datasets:
        assert ds.cache_limit is None
        ds.set_cache_limit(123_456)
        worker = pickle.loads(pickle.dumps(ds))  # (as a spawned worker receives it, and opens it)
        assert worker.cache_limit == 123_456, type(ds).__name__
        worker.close()
    assert opened.limit is None and FastDataset(opened).cache_limit is None


def test_a_limit_set_later_is_parsed_as_at_opening_and_none_lifts_it(s3, indexed_datasets, tmp_path):
    """set_cache_limit(None), documented as unbounded, raised; "200GB" was refused though cache_limit takes it;
    cache_limit=0.5 or "0.4b" became 0 bytes, and inf an OverflowError traceback."""
    from fastdata.datasets.images import FastDataset
    from fastdata.storage.opening import parse_size
    from fastdata.storage.push import push

    for bad in (0.5, "0.4b", float("inf"), float("nan"), "inf GB", 0, -3, True, "lots"):
        with pytest.raises(ConfigError, match=r"cache_limit must be .*got cache_limit="):
            parse_size(bad)
    assert (parse_size(1), parse_size("1.5 kB"), parse_size(2.5e3), parse_size("1 KiB")) == (1, 1500, 2500, 1024)
    url = s3("limit-later") + "/ds"
    push(indexed_datasets["npy"], url)
    with pytest.raises(ConfigError, match=r"cache_limit=0\.5"):
        FastDataset(url, cache_dir=tmp_path / "c", cache_limit=0.5)
    local = FastDataset(indexed_datasets["npy"])
    every = np.arange(len(local))
    with FastDataset(url, cache_dir=tmp_path / "c", cache_limit=20_000) as ds:
        ds.get_batch(every[:40])
        ds.set_cache_limit("200GB")
        assert ds.cache_limit == 200 * 10**9
        with pytest.raises(ConfigError, match=r"limit=0\.5"):
            ds.set_cache_limit(0.5)
        ds.set_cache_limit(None)
        assert ds.cache_limit is None
        assert np.array_equal(ds.get_batch(every)[0].numpy(), local.get_batch(every)[0].numpy())
        assert not ds._cache._held.any()  # unbounded: its maps hold the bytes, no pin is kept
        ds.set_cache_limit(20_000)  # and bounded again: the shards not in use are evicted down to it
        assert ds.cache_limit == 20_000 and sum(f.stat().st_size for f in ds.root.glob("images-*.npy")) <= 20_000


def test_labels_held_with_their_shards_cost_the_shards_open_at_10_9_samples(tmp_path):
    """By arithmetic and allocation: 10^9 samples in 10^6 shards of 1,000, streamed with a cache_limit. The
    labels of 100 open shards cost their 800 kB and the shards' first samples (8 MB), not the 8 GB an array
    of every label was; a shard let go of takes its labels with it."""
    import tracemalloc

    from fastdata.formats.base import npy_bytes
    from fastdata.formats.manifest import IMAGES_NPY, ShardIndex
    from fastdata.formats.rows import compact_rows
    from fastdata.storage.streamed import Labels

    shards, per = 10 ** 6, 1000
    manifest = {"format": IMAGES_NPY, "num_samples": shards * per,
                "shards": compact_rows([{"images": f"images-{k:07d}.npy", "labels": f"labels-{k:07d}.npy",
                                         "samples": per} for k in range(shards)])}
    open_now = list(range(0, shards, shards // 100))
    for k in open_now:
        (tmp_path / f"labels-{k:07d}.npy").write_bytes(npy_bytes(np.arange(k, k + per, dtype=np.int64) % 997))
    tracemalloc.start()
    try:
        labels = Labels(tmp_path, manifest, has_labels=True, streams=True, at_open=False)
        for k in open_now:
            labels.arrived(k)
        traced = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert traced < 8 * (shards + 1) + len(open_now) * per * 8 + (2 << 20), traced  # (8.8 MB and change)
    where = ShardIndex(np.arange(shards + 1, dtype=np.int64) * per)
    idx = np.array([k * per + 999 for k in open_now[::-1]] + [open_now[3] * per + 5])
    want = np.array([(k + 999) % 997 for k in open_now[::-1]] + [(open_now[3] + 5) % 997])
    assert np.array_equal(labels.take(idx, where), want)
    for k in open_now[1:]:
        labels.left(k)
    assert list(labels.held) == [0]


def test_a_streamed_datasets_shard_groups_keep_no_object_a_shard_at_10_6_shards():
    """The cache's groups of files read together (images, labels, a field's rows) are views of the manifest's
    columns: 10^6 shards keep no tuple or name a shard (a list of tuples held ~200 MB in every rank), and
    every group, the flat list and where each group starts are what the manifest's rows say, for `Rows` and
    for a plain list of rows."""
    import tracemalloc

    from fastdata.formats.manifest import IMAGES_NPY
    from fastdata.formats.rows import compact_rows
    from fastdata.storage.streamed import FileGroups, shard_groups

    shards = 10 ** 6
    rows = [{"images": f"images-{k:07d}.npy", "labels": f"labels-{k:07d}.npy", "samples": 4} for k in range(shards)]
    manifest = {"format": IMAGES_NPY, "shards": compact_rows(rows),
                "fields": [{"name": "image", "kind": "image", "dtype": "|u1", "shape": [8, 8, 3]},
                           {"name": "label", "kind": "label", "dtype": "<i8"},
                           {"name": "depth", "kind": "mask", "dtype": "|u1", "shape": [8, 8]}]}
    tracemalloc.start()
    try:
        groups = shard_groups(manifest, at_open=False)
        kept = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert kept < 4096, kept
    assert len(groups) == shards and groups.first(12) == "images-0000012.npy"
    for k in (0, 1, 99_999, shards - 1, -1):
        n = k % shards
        assert groups[k] == (f"images-{n:07d}.npy", f"labels-{n:07d}.npy", f"field.depth-{n:05d}.npy")
    with pytest.raises(IndexError):
        groups[shards]
    files, starts = groups.flat()
    assert len(files) == 3 * shards and files[3 * 500_000 + 2] == "field.depth-500000.npy"
    assert np.array_equal(starts, np.arange(shards) * 3)
    listed = {f"images-{k:07d}.npy" for k in range(0, shards, 1000)}
    listed |= {f"labels-{k:07d}.npy" for k in range(0, shards, 500)}
    listed |= {f"field.depth-{k:05d}.npy" for k in range(0, shards, 2000)} | {"field.depth-1.npy", "other.npy"}
    tracemalloc.start()
    try:
        whole = groups.present(listed)  # (a look at the disk: no name made a shard)
        made = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert np.array_equal(np.flatnonzero(whole), np.arange(0, shards, 2000)) and made < 64 << 20, made
    assert shard_groups(manifest, at_open=True)[7] == ("images-0000007.npy", "field.depth-00007.npy")
    plain = dict(manifest, shards=rows[:5])  # (a manifest whose rows could not be columns)
    plain["shards"][2] = {"images": "images-odd.npy", "samples": 4}  # a shard without a labels file
    assert list(shard_groups(plain, at_open=False)) == [
        (f"images-{k:07d}.npy", f"labels-{k:07d}.npy", f"field.depth-{k:05d}.npy") if k != 2 else
        ("images-odd.npy", "field.depth-00002.npy") for k in range(5)]
    mixed = FileGroups.of(["a.npy", ("b.npy", "c.npy"), ["d.npy"]])
    assert list(mixed) == [("a.npy",), ("b.npy", "c.npy"), ("d.npy",)] and mixed[1:] == list(mixed)[1:]
    assert mixed.present({"a.npy", "b.npy", "d.npy"}).tolist() == [True, False, True]
    listed = {"images-odd.npy", "field.depth-00002.npy", "images-0000001.npy"}
    assert shard_groups(plain, at_open=False).present(listed).tolist() == [False, False, True, False, False]
    assert mixed.flat()[0] == ["a.npy", "b.npy", "c.npy", "d.npy"] and mixed.flat()[1].tolist() == [0, 1, 3]
    assert FileGroups.of(mixed) is mixed and len(FileGroups.of([])) == 0


def test_a_plan_learnt_in_chunks_knows_every_shards_next_use_and_run():
    """The cache's plan learns the reads a chunk of batches at a time (issue 19: a plan over 10^9 samples
    is never made whole); it must answer exactly as one learnt at once, and say "beyond the horizon", not
    "never", for a shard it has not seen yet."""
    import threading

    from fastdata.storage.plan import NEVER, Plan

    rng = np.random.default_rng(0)
    batches = [rng.integers(0, 20, size=int(rng.integers(1, 6))) for _ in range(300)]
    batches[100:140] = [np.array([19, 19])] * 40  # a long run of one shard, across chunk edges
    lock = threading.Lock()
    whole, chunked = Plan(iter(batches), 21), Plan(iter(batches), 21)
    chunked.CHUNK = 7
    assert whole.learn(lock) and whole.complete
    assert chunked.learn(lock) and not chunked.complete
    assert chunked.next_use(20) == chunked.known < 300  # shard 20 is never read: not known yet, though
    while chunked.learn(lock):
        pass
    assert chunked.complete and chunked.next_use(20) == NEVER
    for pos in range(0, 301, 7):
        whole.pos = chunked.pos = pos
        for s in range(21):
            want = next((b for b in range(pos, 300) if s in batches[b]), NEVER)
            assert whole.next_use(s) == chunked.next_use(s) == want
        assert np.array_equal(whole.next_uses(np.arange(21)), chunked.next_uses(np.arange(21)))
    starts = sorted((b, s) for s in range(21) for b in range(300)
                    if s in batches[b] and (b == 0 or s not in batches[b - 1]))
    assert sorted(zip(chunked.batch.tolist(), chunked.shard.tolist())) == starts  # one entry per run...
    assert np.all(np.diff(chunked.batch) >= 0)  # ...in order of need


def test_the_eviction_rules_on_a_known_plan():
    """NOTE [shard cache]'s rules, on a plan small enough to check by hand: batches read shards 0 1 2 0 3 1,
    shard 4 never; every shard 10 bytes; shard 3 (first needed at batch 4) is the prefetch in question."""
    import threading

    from fastdata.storage import evict
    from fastdata.storage.plan import Plan

    plan = Plan(iter([np.array([b]) for b in (0, 1, 2, 0, 3, 1)]), 5)
    while plan.learn(threading.Lock()):
        pass
    sizes, idle = np.full(5, 10, dtype=np.int64), np.zeros(5, dtype=bool)
    cand = np.array([0, 1, 2, 4])
    order, nxt = evict.farthest_first(plan, cand)
    assert cand[order].tolist() == [4, 2, 1, 0]  # never again, then by next use: Belady
    assert evict.harmless(plan, 3, sizes[cand[order]], nxt[order], 10)  # shard 4 alone: never read again
    assert not evict.harmless(plan, 3, sizes[cand[order]], nxt[order], 15)  # shard 2 too: read before 3
    assert not evict.harmless(plan, 3, sizes[cand[order]], nxt[order], 50)  # not enough room at all
    present = np.array([True, True, True, False, False])  # 30 bytes read before shard 3, plus its own 10
    assert evict.near(plan, 3, sizes, present, 160) and not evict.near(plan, 3, sizes, present, 159)
    # When 3 is due (batch 4), the reader would evict 4 (never again) before 1 (read at 5): fetch now.
    both = np.array([False, True, False, False, True])
    assert evict.reader_would_evict(plan, 3, sizes, both, idle, 10)
    assert not evict.reader_would_evict(plan, 3, sizes, both, np.isin(np.arange(5), [4]), 10)  # 4 is in use
    assert not evict.reader_would_evict(plan, 3, sizes, both, idle, 20)  # 1 too, which is read before 3
    # 0 and 2 are not read after batch 4, but both before it: evicting either now costs a download.
    assert not evict.reader_would_evict(plan, 3, sizes, present, idle, 10)


def test_fastdata_train_streams_a_url_with_a_shuffle_window_through_a_bounded_cache_and_resumes(
        s3, proxy, tmp_path, capsys):
    import torch
    from conftest import indexed_source

    from fastdata.cli.main import main
    from fastdata.storage.push import push

    data = tmp_path / "ds"  # 16x16 images (cnn-small's least), 7 shards of 16
    assert main(["preprocess", "images", str(indexed_source(tmp_path / "src", size=16)), str(data), "--size", "16",
                 "--shard-size", "16", "--workers", "1", "--quiet"]) == 0
    url = s3("train") + "/ds"
    push(data, url)
    group = sum((data / f"{k}-00000.npy").stat().st_size for k in ("images", "labels"))
    proxy.clear()
    common = ["--model", "cnn-small", "--batch-size", "8", "--device", "cpu", "--amp", "none", "--threads", "1",
              "--shuffle-window", "2", "--cache-dir", str(tmp_path / "cache"), "--cache-limit", str(6 * group),
              "--checkpoint", str(tmp_path / "ckpt"), "--epochs", "2", "--quiet"]
    capsys.readouterr()
    assert main(["train", url, "--max-steps", "5", *common]) == 0  # stopped mid-epoch...
    assert "download" not in capsys.readouterr().err  # --quiet: the downloads' bar too
    state = torch.load(tmp_path / "ckpt" / "checkpoint.pt", map_location="cpu", weights_only=True)
    assert state["step"] == 5 and state["loader"]["shuffle_window"] == 2 and state["loader"]["position"] == 40
    log = tmp_path / "log.jsonl"
    assert main(["train", url, "--resume", "--log-file", str(log), *common]) == 0  # ...and resumed from there
    steps = [json.loads(line) for line in log.read_text().splitlines()]
    state = torch.load(tmp_path / "ckpt" / "checkpoint.pt", map_location="cpu", weights_only=True)
    assert state["step"] == 2 * 13 and state["epoch"] == 2, (state["step"], state["epoch"])
    assert steps and all(np.isfinite(s["loss"]) for s in steps if "loss" in s)
    cached = sum(_size_now(p) for p in (tmp_path / "cache").rglob("*-0*.npy"))
    assert 0 < cached <= 6 * group  # the cache stayed within --cache-limit (6 of the 7 shards)
    assert sum(v for k, v in proxy.gets.items() if "images-" in k) >= 7  # every shard came through the cache
    capsys.readouterr()
    assert main(["train", str(data), "--cache-limit", "1GB", "--device", "cpu", "--quiet"]) != 0
    assert "cache_dir and cache_limit apply to URLs" in capsys.readouterr().err


@pytest.mark.parametrize("fmt", ["npy", "lmdb", "npy-labels-with-shards"])
def test_a_dataset_with_fields_streams_every_fields_files_with_their_shard(s3, proxy, tmp_path, fmt, monkeypatch):
    """Masks, boxes (variable length), labels and images (npy rows or an LMDB store of JPEGs) of a shard arrive,
    are pinned and are evicted together: the same dict batches as the local copy, through a cache that holds 3
    of the 5 shards. "labels-with-shards": labels.npy too big to read at opening (as past 8M samples), so
    each shard's labels file comes with it."""
    import torch
    from test_fields import make_scenes

    from fastdata.datasets.images import FastDataset
    from fastdata.loading.loader import FastLoader
    from fastdata.preprocess.images import ImagePreprocessConfig, preprocess_images
    from fastdata.storage import streamed
    from fastdata.storage.push import push

    fmt, with_shards = fmt.split("-")[0], fmt.endswith("with-shards")
    if with_shards:
        monkeypatch.setattr(streamed, "ALL_LABELS_AT_OPEN", 0)

    records = make_scenes(tmp_path / "src", 18, sizes=((64, 48), (40, 64)), jpeg_big=False)
    with open(tmp_path / "src" / "recs.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps({k: r[k] for k in ("image", "mask", "boxes", "box_labels", "label")}) + "\n")
    data = tmp_path / "ds"
    preprocess_images(ImagePreprocessConfig(tmp_path / "src" / "recs.jsonl", data, size=32, shard_size=4, workers=1,
                                            progress=False, format=fmt))
    url = s3("fields" + fmt) + "/ds"
    push(data, url)
    local = FastDataset(data)
    files = json.loads((data / "manifest.json").read_text())["files"]
    per_shard = max(sum(f["bytes"] for f in files if f["path"].endswith((f"-{k:05d}.npy", f"-{k:05d}.lmdb"))
                        and ".offsets-" not in f["path"]) for k in range(5))
    proxy.clear()
    proxy.inject("corrupt", r"field\.mask-00002")  # a field file's faults are survived like an image shard's
    proxy.inject("503", r"field\.boxes-00001", times=2)
    ds = FastDataset(url, cache_dir=tmp_path / "cache", cache_limit=3 * per_shard)
    assert not [k for k in proxy.gets if "-0000" in k and ".offsets-" not in k]  # opening fetched no shard
    for epoch in range(2):
        want = FastLoader(local, 4, seed=3, shuffle_window=1, num_threads=2)
        got = FastLoader(ds, 4, seed=3, shuffle_window=1, num_threads=2)
        want.set_epoch(epoch), got.set_epoch(epoch)
        a, b = [{k: v.clone() for k, v in x.items()} for x in got], [{k: v.clone() for k, v in x.items()} for x in want]
        assert len(a) == len(b) == 5 and all(
            x.keys() == y.keys() and all(x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]) for k in x)
            for x, y in zip(a, b))
        assert {"image", "mask", "boxes", "boxes_offsets", "box_labels", "label"} <= a[0].keys()
    ds._cache.close()  # prefetches under way end here: the counts below are final
    report = _downloads(ds, proxy)
    assert report[0]["downloads"] == 5 and report[0]["repeats"] == 0, report  # a shard's files: one download
    assert proxy.faults == {"corrupt": 1, "503": 2} and not list(ds.root.rglob("*.part-*"))
    with_its_shard = ("images", "field.mask", "field.boxes", "field.box_labels")
    if with_shards:  # no labels.npy; labels held with their shard, never one array of every label
        assert sum(v for k, v in proxy.gets.items() if k.endswith("/labels.npy")) == 0
        assert "array" not in ds._label_store.__dict__ and ds._label_store.held == {}  # (all closed)
        with_its_shard += ("labels",)
    else:
        assert sum(v for k, v in proxy.gets.items() if "/labels-" in k) == 0  # every label came in labels.npy
        assert sum(v for k, v in proxy.gets.items() if k.endswith("/labels.npy")) == 1  # at opening
    for name in with_its_shard:  # each fetched with its shard
        retried = name == "field.mask"  # (the corrupted body was answered, then fetched again)
        assert sum(v for k, v in proxy.gets.items() if f"/{name}-" in k) == sum(
            r["downloads"] + r["ahead"] for r in report) + retried, (name, sorted(proxy.gets.items()))
    cached = sum(_size_now(p) for p in (tmp_path / "cache").rglob("*-0*") if ".offsets-" not in p.name
                 and p.suffix in (".npy", ".lmdb"))
    assert cached <= 3 * per_shard


@pytest.mark.parametrize("change", ["cut-at-a-piece", "cut-mid-piece", "replaced-longer"])
def test_an_object_changed_since_its_manifest_fails_at_once_not_after_the_budget(s3, proxy, indexed_datasets,
                                                                                 tmp_path, monkeypatch, change):
    """A file read in pieces (over 64 MB: pieces of 8 MB, scaled down to 256 bytes) whose object was overwritten
    with a shorter one: the piece past its new end was refused (416 InvalidRange) and retried for the whole
    budget (2 minutes by default), then blamed on the network; one replaced by a longer one was downloaded
    twice. One look at the object's size (a HEAD) now names it at once, and says what to do."""
    from fastdata.errors import ChecksumError
    from fastdata.storage import remote as remote_mod
    from fastdata.storage.push import push
    from fastdata.storage.remote import RemoteDataset

    bucket = f"changed-{change}"
    url = s3(bucket) + "/ds"
    push(indexed_datasets["npy"], url)
    body = (indexed_datasets["npy"] / "images-00002.npy").read_bytes()
    new = {"cut-at-a-piece": body[:768], "cut-mid-piece": body[:1000],
           "replaced-longer": bytes(255 - b for b in body) + bytes(100)}[change]
    s3.client.put_object(Bucket=bucket, Key="ds/images-00002.npy", Body=new)
    monkeypatch.setattr(remote_mod, "_WHOLE", 256)
    monkeypatch.setattr(remote_mod, "_BLOCK", 256)
    remote = RemoteDataset(url, cache_dir=tmp_path / "cache", retry_seconds=20)
    remote.prepare(frozenset({"images-00002.npy"}))
    proxy.clear()
    began = time.monotonic()
    with pytest.raises(ChecksumError) as err:
        remote.fetch(remote.entry("images-00002.npy"))
    assert time.monotonic() - began < 5  # (before: 20 s, the whole budget, for a cut object)
    msg = str(err.value)
    assert f"images-00002.npy: the store's object has {len(new)} bytes, not the manifest's {len(body)}" in msg, msg
    assert "changed since the manifest was written" in msg and "another writer" in msg and "`fastdata push`" in msg
    assert "`fastdata preprocess`" in msg and "tries" not in msg and "\n" not in msg, msg
    pieces = -(-len(body) // 256)
    gets = sum(v for k, v in proxy.gets.items() if k.endswith("images-00002.npy"))
    assert gets == {"cut-at-a-piece": 3, "cut-mid-piece": 4, "replaced-longer": pieces}[change]  # once, not twice
    assert sum(v for k, v in proxy.heads.items() if k.endswith("images-00002.npy")) == 1
    assert not (remote.dir / "images-00002.npy").exists() and not list(remote.dir.rglob("*.part-*"))


def test_a_file_fetched_again_from_its_first_byte_counts_its_bytes_once(s3, proxy, indexed_datasets, tmp_path,
                                                                        monkeypatch):
    """A file in pieces (over 64 MB: pieces of 8 MB, scaled down) whose body failed its sha256 (a piece flipped on
    the way: a ranged answer carries no checksum the client checks) is fetched again from byte 0: the progress
    callback (the download bar) was given its bytes twice, so the bar reached its end with files still to come.
    The failed try takes back what it counted: the total is the file's size, and never passes it."""
    from fastdata.storage import remote as remote_mod
    from fastdata.storage.push import push
    from fastdata.storage.remote import RemoteDataset

    url = s3("count-once") + "/ds"
    push(indexed_datasets["npy"], url)
    monkeypatch.setattr(remote_mod, "_WHOLE", 256)
    monkeypatch.setattr(remote_mod, "_BLOCK", 256)
    remote = RemoteDataset(url, cache_dir=tmp_path / "cache", retry_seconds=10)
    remote.prepare(frozenset(f["path"] for f in remote.manifest["files"]))
    size = (indexed_datasets["npy"] / "images-00001.npy").stat().st_size
    proxy.clear()
    proxy.inject("corrupt", r"images-00001\.npy")
    counted: list[int] = []
    path = remote.fetch(remote.entry("images-00001.npy"), counted.append)
    assert path.read_bytes() == (indexed_datasets["npy"] / "images-00001.npy").read_bytes()
    assert proxy.faults == {"corrupt": 1}
    assert sum(counted) == size and max(np.cumsum(counted)) == size, counted  # (before: 2 x size)
    assert sum(v for k, v in proxy.gets.items() if k.endswith("images-00001.npy")) == 2 * -(-size // 256)


def _other_version(s3, bucket: str, raw: bytes, k: int) -> None:
    """Push another version of ``bucket``'s dataset: its manifest with other bytes (spaces), the same files."""
    s3.client.put_object(Bucket=bucket, Key="ds/manifest.json", Body=raw.replace(b"{", b"{" + b" " * k, 1))


@pytest.mark.parametrize("kind", ["ofd", "flock"])
def test_a_dataset_pushed_again_leaves_no_old_version_in_the_cache_once_no_reader_holds_it(
        s3, indexed_datasets, tmp_path, monkeypatch, kind):
    """Each push of a new version gave the node cache a new folder and left the old ones, outside every
    cache_limit (each bounds its own version): the cache grew with every push. Opening a version now removes the
    folders of the URL's other versions that no reader holds; one a live reader holds (a streamed reader, a
    reader of every file) stays until it is closed. ``flock``: where the system has no OFD locks."""
    import fcntl

    from fastdata.datasets.images import FastDataset
    from fastdata.storage.push import push

    if kind == "flock":
        monkeypatch.delattr(fcntl, "F_OFD_GETLK")
    url = s3(f"versions-{kind}") + "/ds"
    push(indexed_datasets["npy"], url)
    raw = (indexed_datasets["npy"] / "manifest.json").read_bytes()
    cache = tmp_path / "cache"
    local = FastDataset(indexed_datasets["npy"])

    def folders() -> set[str]:
        return {p.name for p in cache.iterdir()}
    streamed = FastDataset(url, cache_dir=cache, cache_limit=4 * 3200)  # version 0, read in shards
    streamed.get_batch([0, 40])
    _other_version(s3, f"versions-{kind}", raw, 1)
    whole = FastDataset(url, cache_dir=cache, storage="ram")  # version 1, every file read at opening
    assert folders() == {streamed.root.name, whole.root.name}  # version 0 is in use: it stays
    assert np.array_equal(streamed.get_batch([70])[0].numpy(), local.get_batch([70])[0].numpy())  # (fetched)
    streamed.close()
    _other_version(s3, f"versions-{kind}", raw, 2)
    newest = FastDataset(url, cache_dir=cache)  # version 2: version 0 goes, version 1 (in use) stays
    assert folders() == {whole.root.name, newest.root.name}
    for ds in (whole, newest):
        assert np.array_equal(ds.get_batch([5, 99])[0].numpy(), local.get_batch([5, 99])[0].numpy())
    whole.close()
    again = FastDataset(url, cache_dir=cache)  # version 2 opened again: version 1 goes now
    assert folders() == {newest.root.name} and again.root == newest.root
    assert np.array_equal(again.get_batch([1, 97])[0].numpy(), local.get_batch([1, 97])[0].numpy())
    assert not [p for p in tmp_path.rglob("*") if ".removing-" in p.name]


def test_a_folder_removed_while_an_opening_waits_for_it_is_made_again(s3, indexed_datasets, tmp_path):
    """An opening that comes while another version's opening removes its folder (no reader held it) waits for
    the removal, finds the folder gone, and makes it again: it never reads from a folder being deleted. A
    removal cut short (the folder renamed away, not deleted: a killed process) is finished by the next opening."""
    import threading

    from fastdata.storage.cache_locks import ShardPins
    from fastdata.storage.push import push
    from fastdata.storage.remote import RemoteDataset

    url = s3("removed-meanwhile") + "/ds"
    push(indexed_datasets["npy"], url)
    first = RemoteDataset(url, cache_dir=tmp_path / "cache")
    folder = first.prepare()
    first.release()
    claim = ShardPins(folder / ".locks", reader=False)  # a removal under way: every reader kept off
    assert claim.claim()
    opening = RemoteDataset(url, cache_dir=tmp_path / "cache")
    done: dict = {}
    t = threading.Thread(target=lambda: done.setdefault("dir", opening.prepare()))
    t.start()
    t.join(0.5)
    assert t.is_alive()  # waiting for the removal to end
    os.rename(folder, tmp_path / "cache" / ".removing-x")  # (then killed: never deleted)
    claim.close()
    t.join(30)
    assert not t.is_alive() and done["dir"] == folder and (folder / "manifest.json").read_bytes() == (
        indexed_datasets["npy"] / "manifest.json").read_bytes()
    assert all((folder / f["path"]).is_file() for f in opening.manifest["files"])
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [folder.name]  # (.removing-x went)
    again = RemoteDataset(url, cache_dir=tmp_path / "cache")  # the same version: its folder stays
    again.prepare()
    assert folder.is_dir() and not claim.claim()  # (held by both openings)
    claim.close()
    opening.release()
    again.release()
