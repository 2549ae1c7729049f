"""Datasets at a URL: a real S3 API (moto's server on 127.0.0.1, started here), `fastdata push`, and the
verified node-local cache."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.remote


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on loopback; yields a function making a fresh bucket and returning its URL."""
    pytest.importorskip("s3fs")
    moto_server = pytest.importorskip("moto.server")
    import boto3

    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    endpoint = f"http://127.0.0.1:{server._server.server_port}"
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    client = boto3.client("s3", endpoint_url=endpoint)
    made = []

    def bucket(name: str) -> str:
        client.create_bucket(Bucket=name)
        made.append(name)
        return f"s3://{name}"
    bucket.client = client
    try:
        yield bucket
    finally:
        server.stop()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _fresh_fs():
    import fsspec

    fsspec.filesystem("s3").clear_instance_cache()


def test_push_then_read_gives_the_local_batches_and_the_cache_is_reused(s3, indexed_datasets, tmp_path):
    from fastdata.dataset import FastDataset
    from fastdata.storage.remote import push

    url = s3("push-read") + "/sets/npy"
    counts = push(indexed_datasets["npy"], url, workers=3)
    assert counts == {"uploaded": 14, "skipped": 0}  # 7 image shards + 7 label files
    assert push(indexed_datasets["npy"], url)["skipped"] == 14  # a rerun uploads nothing
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


def test_lmdb_and_token_datasets_stream_too(s3, indexed_datasets, tmp_path):
    from fastdata.cli import main
    from fastdata.dataset import FastDataset
    from fastdata.storage.remote import push
    from fastdata.token_dataset import TokenDataset

    url = s3("other-formats")
    push(indexed_datasets["lmdb"], url + "/lmdb")
    a, b = FastDataset(indexed_datasets["lmdb"]), FastDataset(url + "/lmdb", cache_dir=tmp_path / "c")
    assert np.array_equal(a.get_batch([0, 5, 99])[0].numpy(), b.get_batch([0, 5, 99])[0].numpy())
    text = tmp_path / "t.txt"
    text.write_text("hello remote world, " * 400)
    assert main(["preprocess", "text", str(text), str(tmp_path / "tok"), "--tokenizer", "bytes", "--quiet"]) == 0
    push(tmp_path / "tok", url + "/tok")
    x, _ = TokenDataset(url + "/tok", seq_len=16, cache_dir=tmp_path / "c").get_batch([0, 1])
    y, _ = TokenDataset(tmp_path / "tok", seq_len=16).get_batch([0, 1])
    assert np.array_equal(x.numpy(), y.numpy())


def test_a_corrupted_object_is_never_used_and_the_error_names_it(s3, indexed_datasets, tmp_path):
    from fastdata.errors import FormatError
    from fastdata.storage.remote import RemoteDataset, push

    url = s3("corrupt") + "/ds"
    push(indexed_datasets["npy"], url)
    key = "ds/images-00002.npy"
    body = bytearray(s3.client.get_object(Bucket="corrupt", Key=key)["Body"].read())
    body[-1] ^= 0xFF  # same size, one flipped byte
    s3.client.put_object(Bucket="corrupt", Key=key, Body=bytes(body))
    remote = RemoteDataset(url, cache_dir=tmp_path / "cache", tries=2, backoff=0)
    with pytest.raises(FormatError, match=r"images-00002\.npy.*after 2 tries.*sha256"):
        remote.local()
    assert not (remote.dir / "images-00002.npy").exists() and not list(remote.dir.rglob("*.part-*"))
    assert not (remote.dir / "manifest.json").exists()  # an incomplete cache is not a dataset
    push(indexed_datasets["npy"], url)  # the marker still matches, the size too: push cannot see a flip ...
    s3.client.delete_object(Bucket="corrupt", Key=".fastdata-push/images-00002.npy.sha256".join(["ds/", ""]))
    assert push(indexed_datasets["npy"], url)["uploaded"] == 1  # ... without its marker it uploads again
    assert RemoteDataset(url, cache_dir=tmp_path / "cache").local() == remote.dir


def test_a_half_pushed_or_hostile_dataset_is_refused(s3, indexed_datasets, tmp_path):
    from fastdata.dataset import FastDataset
    from fastdata.errors import FormatError

    url = s3("hostile")
    with pytest.raises(FormatError, match="no manifest.json.*push"):
        FastDataset(url + "/nothing-yet", cache_dir=tmp_path / "c")
    manifest = json.loads((indexed_datasets["npy"] / "manifest.json").read_text())
    manifest["files"][0]["path"] = "../other/secrets.npy"
    s3.client.put_object(Bucket="hostile", Key="evil/manifest.json", Body=json.dumps(manifest).encode())
    with pytest.raises(FormatError, match="outside its prefix"):
        FastDataset(url + "/evil", cache_dir=tmp_path / "c")


def test_ranks_on_a_node_share_one_cache_and_a_dead_downloaders_leftovers_go(s3, indexed_datasets, tmp_path):
    from fastdata.storage.remote import RemoteDataset, push

    url = s3("shared") + "/ds"
    push(indexed_datasets["npy"], url)
    cache = tmp_path / "cache"
    remote = RemoteDataset(url, cache_dir=cache)
    remote.dir.mkdir(parents=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    leftover = remote.dir / f"images-00000.npy.part-{int(dead.stdout)}-abcd"
    leftover.write_bytes(b"half a download")
    script = ("import sys; from fastdata.dataset import FastDataset; "
              "ds = FastDataset(sys.argv[1], cache_dir=sys.argv[2]); print(int(ds.get_batch(range(100))[1].sum()))")
    procs = [subprocess.Popen([sys.executable, "-c", script, url, str(cache)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-800:] for _, e in outs]
    assert len({o for o, _ in outs}) == 1  # every process read the same labels
    assert not leftover.exists() and [p.name for p in cache.iterdir()] == [remote.id]


def test_cli_push_and_verify_a_url(s3, indexed_datasets, tmp_path, capsys, monkeypatch):
    from fastdata.cli import main

    monkeypatch.setenv("FASTDATA_CACHE", str(tmp_path / "cache"))
    url = s3("cli-bucket") + "/x"
    assert main(["push", str(indexed_datasets["npy"]), url, "--workers", "2", "--quiet"]) == 0
    assert "14 object(s) uploaded" in capsys.readouterr().out
    assert main(["verify", url, "--quiet"]) == 0
    assert "OK, 14 files intact" in capsys.readouterr().out


def test_urls_need_the_remote_extra_and_local_paths_refuse_remote_options(monkeypatch, indexed_datasets):
    from fastdata.dataset import FastDataset
    from fastdata.errors import ConfigError, MissingDependencyError
    from fastdata.storage.remote import is_url, scrub

    assert is_url("s3://b/p") and is_url("file:///tmp/x") and not is_url("/tmp/x") and not is_url("C:/x")
    assert scrub("https://h/p?X-Amz-Signature=abc123&X-Amz-Credential=AKIA/x") == \
        "https://h/p?X-Amz-Signature=***&X-Amz-Credential=***"
    monkeypatch.setitem(sys.modules, "fsspec", None)
    with pytest.raises(MissingDependencyError, match=r"fastdata\[remote\]"):
        FastDataset("s3://bucket/data")
    with pytest.raises(ConfigError, match="URLs"):
        FastDataset(indexed_datasets["npy"], cache_dir="/tmp/nowhere")
