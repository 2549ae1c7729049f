"""Preprocess sources at a URL (NOTE [url source] in fastdata/preprocess/url_reads.py): an image folder, records
with masks, a segmentation pair, Parquet and text, on the loopback moto S3 server (and ``file://``), each
byte-identical to the run over the same files on local disk."""
from __future__ import annotations

import contextlib
import csv
import gzip
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import fresh_fs, upload as upload_folder
from PIL import Image
from test_fields import coco_json, make_scenes

from fastdata.cli.main import main
from fastdata.errors import SourceError
from fastdata.preprocess import url_reads
from fastdata.preprocess.sources import discover
from fastdata.preprocess.discover import discover_source
from fastdata.preprocess.text import TextPreprocessConfig, preprocess_text
from fastdata.storage.object_store import Retry

pytestmark = pytest.mark.remote


def upload(s3, bucket: str, root: Path, prefix: str) -> str:
    """Every file under ``root`` to ``s3://bucket/prefix/...``; returns that folder's URL."""
    url = f"{s3(bucket)}/{prefix}"
    upload_folder(root, url)
    return url


def preprocess(src, out: Path, *extra: str) -> dict:
    assert main(["preprocess", "images", str(src), str(out), "--size", "16", "--shard-size", "4", "--quiet",
                 *extra]) == 0
    return json.loads((out / "manifest.json").read_text())


def assert_same_output(local: dict, remote: dict, url: str) -> None:
    """The same files with the same sha256s, the same samples and skipped records; the URL as the source."""
    digests = lambda m: {f["path"]: (f["bytes"], f["sha256"]) for f in m["files"]}  # noqa: E731
    assert digests(remote) == digests(local) and len(local["files"]) > 1
    assert remote["num_samples"] == local["num_samples"]
    assert [s["path"] for s in remote.get("skipped", [])] == [s["path"] for s in local.get("skipped", [])]
    assert remote["source"]["path"] == url and remote["source"]["kind"] == local["source"]["kind"]


@pytest.fixture(autouse=True)
def _no_stale_client():
    fresh_fs()  # no s3fs instance cached by another module's tests, bound to their server's endpoint


def test_a_folder_at_a_url_lists_the_classes_paths_and_order_of_the_local_folder(awkward_folder, s3, tmp_path):
    (awkward_folder / "a_modes" / "deeper" / "z").mkdir(parents=True)  # os.walk: a folder's files first
    Image.new("RGB", (8, 8)).save(awkward_folder / "a_modes" / "deeper" / "z" / "0.png")
    Image.new("RGB", (8, 8)).save(awkward_folder / "a_modes" / "deeper" / "b.png")
    Image.new("RGB", (8, 8)).save(awkward_folder / "a_modes" / "zz.png")
    (awkward_folder / "top.png").write_bytes(b"")  # not in a class folder: not a sample
    local = discover(awkward_folder)
    for url in (upload(s3, "folder", awkward_folder, "train"), awkward_folder.as_uri()):
        got = discover(url)
        assert (got.classes, got.paths, got.labels) == (local.classes, local.paths, local.labels)
        assert got.where == url and got.blobs.read(0) == (awkward_folder / local.paths[0]).read_bytes()


@pytest.mark.parametrize("fmt", ["npy", "lmdb"])
def test_an_image_folder_at_a_url_gives_the_local_runs_bytes_and_bad_records(awkward_folder, s3, tmp_path, fmt):
    url = upload(s3, f"photos-{fmt}", awkward_folder, "raw/train")
    extra = ("--format", fmt, "--workers", "2", "--shuffle", "5")
    local = preprocess(awkward_folder, tmp_path / "local", *extra)
    assert len(local["skipped"]) == 3  # empty, garbage, truncated: listed the same from the store
    assert_same_output(local, preprocess(url, tmp_path / "remote", *extra), url)


def test_records_masks_and_boxes_at_a_url_give_the_local_runs_bytes(s3, tmp_path):
    root = tmp_path / "src"
    records = make_scenes(root, 7)
    records[2]["mask"] = "masks/none.png"  # missing, here and in the store: the same bad record
    with open(root / "recs.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    with open(root / "recs.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["image", "mask", "label", "weight"])
        w.writerows([r["image"], r["mask"], r["label"], 0.5 * i] for i, r in enumerate(records))
    url = upload(s3, "records", root, "seg")
    for name in ("recs.jsonl", "recs.csv"):
        local = preprocess(root / name, tmp_path / f"local-{name}", "--workers", "2")
        assert [s["path"] for s in local["skipped"]] == [records[2]["image"]]
        assert_same_output(local, preprocess(f"{url}/{name}", tmp_path / f"remote-{name}", "--workers", "2"),
                           f"{url}/{name}")
    coco_json(records, tmp_path / "instances.json")  # boxes over the image folder at the URL
    local = preprocess(root, tmp_path / "local-coco", "--coco", str(tmp_path / "instances.json"))
    assert local["source"]["kind"] == "coco" and local["num_samples"] == 7
    assert_same_output(local, preprocess(url, tmp_path / "remote-coco", "--coco", str(tmp_path / "instances.json")),
                       url)
    (root / "recs.jsonl").unlink()
    (root / "recs.csv").unlink()
    local = preprocess(root, tmp_path / "local-pair", "--workers", "2")  # images/ + masks/: a segmentation pair
    remote = preprocess(url, tmp_path / "remote-pair", "--workers", "2")
    assert local["source"]["kind"] == "segmentation" and local["num_samples"] == 7
    assert_same_output(local, remote, url)


def test_a_record_leaving_its_folder_at_a_url_is_refused_with_the_line(s3, tmp_path):
    url = s3("escape")
    s3.client.put_object(Bucket="escape", Key="a/recs.jsonl", Body=b'{"image": "x.png"}\n{"image": "../b/y.png"}\n')
    with pytest.raises(SourceError, match=r"recs.jsonl:2: '../b/y.png' is outside the folder"):
        discover_source(f"{url}/a/recs.jsonl")


def test_a_percent_encoded_dot_dot_in_a_record_at_a_url_is_refused_with_the_line(s3, tmp_path):
    # an http:// server decodes %2e%2e to .. after the check: /secret.png was served as a sample
    url = s3("escape-pct")
    for rel in ("%2e%2e/b/y.png", "x/%2E%2E/%2e%2e/y.png", "%2e%2e%2fy.png"):
        s3.client.put_object(Bucket="escape-pct", Key="a/recs.jsonl",
                             Body=f'{{"image": "x.png"}}\n{{"image": "{rel}"}}\n'.encode())
        with pytest.raises(SourceError, match=f"recs.jsonl:2: '{rel}' is outside the folder"):
            discover_source(f"{url}/a/recs.jsonl")


def test_a_folder_named_like_a_tar_at_a_url_is_no_tar(s3, tmp_path):
    from test_wds_source import make_tars

    src = make_tars(tmp_path / "src", count=2)
    url = s3("tar-folder")
    for p in sorted(src.iterdir()):
        s3.client.put_object(Bucket="tar-folder", Key=f"wds/{p.name}", Body=p.read_bytes())
    s3.client.put_object(Bucket="tar-folder", Key="wds/more.tar/notes.txt", Body=b"hi")  # a folder "more.tar/"
    local = preprocess(src, tmp_path / "local")
    for i, where in enumerate((f"{url}/wds", f"{url}/wds/")):  # "cannot read .../more.tar as a tar file"
        assert_same_output(local, preprocess(where, tmp_path / f"remote{i}"), where)


def test_parquet_at_a_url_is_read_by_row_group_and_gives_the_local_bytes(s3, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    root = tmp_path / "src"
    records = make_scenes(root / "img", 10, sizes=((40, 30), (30, 40)))
    for part, rows in enumerate((records[:6], records[6:])):
        table = pa.table({"image": [{"bytes": (root / "img" / r["image"]).read_bytes()} for r in rows],
                          "label": [i % 3 for i in range(len(rows))], "caption": [f"c{i}" for i in range(len(rows))],
                          "mask": [f"img/{r['mask']}" for r in rows]})  # paths beside the files: objects at a URL
        pq.write_table(table, root / f"part-{part}.parquet", row_group_size=4)
    url = upload(s3, "parquet", root, "hf")
    local = preprocess(root, tmp_path / "local", "--workers", "2")
    assert local["source"]["kind"] == "parquet" and local["num_samples"] == 10
    assert [f["name"] for f in local["fields"]] == ["image", "label", "caption", "mask"]
    assert_same_output(local, preprocess(url, tmp_path / "remote", "--workers", "2"), url)
    one = preprocess(root / "part-1.parquet", tmp_path / "local1")
    assert_same_output(one, preprocess(f"{url}/part-1.parquet", tmp_path / "remote1"), f"{url}/part-1.parquet")
    # OUT at a URL too: the files' summaries live under the run's partial prefix until the manifest is put
    from test_store_out import store_bytes
    assert main(["preprocess", "images", url, f"{s3('parquet-out')}/ds", "--size", "16", "--shard-size", "4",
                 "--quiet", "--workers", "2"]) == 0
    got = store_bytes(s3, "parquet-out", "ds")
    assert not [k for k in got if k.startswith(".fastdata-partial")]
    assert_same_output(local, json.loads(got["manifest.json"]), url)


def test_store_faults_mid_read_are_retried_and_change_no_byte(photo_folder, s3, proxy, tmp_path):
    url = upload(s3, "flaky", photo_folder, "p")
    local = preprocess(photo_folder, tmp_path / "local", "--workers", "2")
    for kind in ("503", "reset", "truncate"):
        proxy.inject(kind, r"class_1/img_000[0-4]", times=2)
    assert_same_output(local, preprocess(url, tmp_path / "remote", "--workers", "2"), url)
    assert sum(proxy.faults.values()) == 6


def write_text_tree(root: Path) -> None:
    for d in ("a", "b/c", ".hidden"):
        (root / d).mkdir(parents=True)
    rows = lambda k: "".join(json.dumps({"text": f"doc {k} {i} ünï"}) + "\n" for i in range(40))  # noqa: E731
    (root / "a" / "x.jsonl").write_text(rows(0) + "not json\n" + rows(1))
    (root / "a-b.txt").write_text("one document " * 50)  # after a/x.jsonl by path parts, before it as a string
    (root / "b" / "c" / "d.jsonl.gz").write_bytes(gzip.compress(rows(2).encode(), mtime=0))
    (root / "b" / "e.txt").write_text("")  # empty: skipped, listed
    (root / ".hidden" / "x.txt").write_text("never read")
    (root / "b" / "notes.md").write_text("not a text source")
    try:  # Parquet rows stream through ranged reads as the other files do
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        return
    pq.write_table(pa.table({"text": [f"row {i} ünï" if i != 3 else None for i in range(30)]}), root / "b" / "f.parquet",
                   row_group_size=8)


def test_text_at_a_url_gives_the_local_runs_bytes(s3, tmp_path):
    root = tmp_path / "corpus"
    write_text_tree(root)
    url = upload(s3, "text", root, "owt")

    def run(src, out: str) -> dict:
        return preprocess_text(TextPreprocessConfig(src=src, out=tmp_path / out, shard_tokens=2000, val_fraction=0.2,
                                                    progress=False, workers=2))
    local, remote = run(root, "local"), run(url, "remote")
    assert {f["path"]: f["sha256"] for f in remote["files"]} == {f["path"]: f["sha256"] for f in local["files"]}
    parquet = importlib.util.find_spec("pyarrow") is not None
    assert remote["skipped"] == local["skipped"] and len(local["skipped"]) == 2 + parquet
    assert remote["source"] == {**local["source"], "path": url} and local["source"]["files"] == 4 + parquet
    one = run(root / "b" / "c" / "d.jsonl.gz", "local1")
    got = run(f"{url}/b/c/d.jsonl.gz", "remote1")
    assert {f["sha256"] for f in got["files"]} == {f["sha256"] for f in one["files"]}


def test_an_unreadable_url_is_one_line_without_secrets(s3, tmp_path, monkeypatch):
    for src in ("s3://no-such-bucket/recs.jsonl", "s3://no-such-bucket/train/"):
        r = subprocess.run([sys.executable, "-m", "fastdata", "preprocess", "images", src, str(tmp_path / "o"),
                            "--quiet"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 1 and r.stderr.count("\n") == 1 and "s3://no-such-bucket" in r.stderr, r.stderr
    monkeypatch.setattr(url_reads, "_RETRY", Retry(0))  # nothing listens on port 9: refused at once
    for src in ("https://user:hunter2@127.0.0.1:9/recs.jsonl?sig=hunter3", "https://user:hunter2@127.0.0.1:9/x/"):
        with pytest.raises(SourceError) as err:
            discover_source(src)
        assert "hunter" not in str(err.value) and "127.0.0.1:9" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(SourceError, match="s3://empty/nothing/"):  # an empty prefix: nothing to read
        discover_source(f"{s3('empty')}/nothing/")


def test_a_chunks_masks_at_a_url_are_requested_ahead_of_their_images(s3, proxy, tmp_path):
    # one round trip per mask after each image would leave a worker waiting on the store's latency
    import time

    from fastdata.preprocess.fields import mask_readers, row_values

    url = s3("masks-ahead")
    for i in range(6):
        s3.client.put_object(Bucket="masks-ahead", Key=f"m/{i}.png", Body=f"mask {i}".encode())
    values = {"mask": [f"{url}/m/{i}.png" if i != 3 else None for i in range(6)]}
    readers = mask_readers({"mask": "mask"}, values)
    first = row_values(values, 0, readers, None)["mask"]
    assert first.read() == b"mask 0" and str(first) == f"{url}/m/0.png"
    deadline = time.monotonic() + 30
    while sum(proxy.gets.values()) < 5 and time.monotonic() < deadline:
        time.sleep(0.01)  # the requests ahead finish on the reader's threads
    assert sorted(k.rsplit("/", 1)[-1] for k in proxy.gets) == ["0.png", "1.png", "2.png", "4.png", "5.png"]
    assert row_values(values, 3, readers, None)["mask"] is None  # no mask: the decoder names it, nothing read
    assert [row_values(values, j, readers, None)["mask"].read() for j in (4, 5)] == [b"mask 4", b"mask 5"]
    assert sum(proxy.gets.values()) == 5  # each object once


def test_parquet_and_zst_at_a_url_ride_out_faults_and_an_outage_to_the_local_bytes(s3, proxy, tmp_path):
    # ranged reads of Parquet footers, row groups (images and an Image column of masks), a .jsonl.zst stream and a
    # plain .jsonl cut into byte ranges, through resets, truncated bodies, SlowDown and a store gone for a while:
    # the local run's bytes
    pa = pytest.importorskip("pyarrow")
    zstandard = pytest.importorskip("zstandard")
    import pyarrow.parquet as pq

    from fastdata.preprocess.text import TextPreprocessConfig, preprocess_text

    root = tmp_path / "src"
    records = make_scenes(root / "img", 8, sizes=((40, 30), (30, 40)))
    cell = lambda p: {"bytes": (root / "img" / p).read_bytes(), "path": None}  # noqa: E731
    for part, rows in enumerate((records[:5], records[5:])):
        pq.write_table(pa.table({"image": [cell(r["image"]) for r in rows], "annotation": [cell(r["mask"]) for r in rows],
                                 "label": [i % 2 for i in range(len(rows))]}), root / f"part-{part}.parquet",
                       row_group_size=2)
    (root / "img").rename(tmp_path / "img")  # only the Parquet files go to the store
    text = tmp_path / "text"
    text.mkdir()
    docs = "".join(json.dumps({"text": f"document {i} " * 50}) + "\n" for i in range(400)).encode()
    (text / "d.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(docs))
    (text / "e.jsonl").write_bytes(docs)  # plain: cut into ~28 byte ranges, each task seeking to its own
    url, text_url = upload(s3, "pq-faults", root, "hf"), upload(s3, "zst-faults", text, "corpus")
    local = preprocess(root, tmp_path / "local", "--workers", "2", "--resize", "center-crop")
    text_args = {"progress": False, "val_fraction": 0.1, "shard_tokens": 2000, "workers": 2}
    local_text = preprocess_text(TextPreprocessConfig(src=text, out=tmp_path / "local-text", **text_args))
    assert local_text["params"]["piece_bytes"] == 8000
    for kind in ("503", "reset", "truncate"):
        proxy.inject(kind, r"part-[01]\.parquet|d\.jsonl\.zst|e\.jsonl", times=3)
    proxy.refuse(2)  # the store gone as the runs begin: listings, footers and the first reads wait it out
    remote = preprocess(url, tmp_path / "remote", "--workers", "2", "--resize", "center-crop")
    assert_same_output(local, remote, url)
    assert [f["name"] for f in remote["fields"]] == ["image", "label", "annotation"]
    got = preprocess_text(TextPreprocessConfig(src=text_url, out=tmp_path / "remote-text", **text_args))
    assert {f["path"]: f["sha256"] for f in got["files"]} == {f["path"]: f["sha256"] for f in local_text["files"]}
    assert sum(proxy.faults.values()) >= 9


def test_tars_at_a_url_are_listed_through_faults_to_the_local_bytes(s3, proxy, tmp_path):
    # each tar is streamed once for its listing: a plain fsspec stream outside the retry budget stopped the
    # run at one SlowDown, reset or cut body (one of ~41,000 streams of a LAION-sized source)
    from test_wds_source import make_tars

    src = make_tars(tmp_path / "src", count=2)
    url = upload(s3, "tar-faults", src, "wds")
    local = preprocess(src, tmp_path / "local")
    for kind in ("503", "reset", "truncate"):
        proxy.inject(kind, r"/wds/0000[01]\.tar$", times=2)
    remote = preprocess(url, tmp_path / "remote", "--workers", "2")
    assert_same_output(local, remote, url)
    assert sum(proxy.faults.values()) == 6


def test_a_token_in_a_tar_urls_query_or_user_info_reaches_no_sample_name_message_or_file(tmp_path, capsys):
    # an Azure SAS / CDN token, the same for every tar: each sample's path (manifest and stderr) held it whole,
    # and a tar shorter than its index named its URL unscrubbed
    from test_wds_source import _image, served, write_tar

    from fastdata.errors import ImageDecodeError
    from fastdata.preprocess.tars import TarBlobs

    src = tmp_path / "src"
    src.mkdir()
    for t in range(2):
        write_tar(src / f"{t:05d}.tar", [m for s in range(3) for m in (
            (f"{t}{s:04d}.png", b"junk" if (t, s) == (1, 1) else _image(s, "PNG")), (f"{t}{s:04d}.cls", b"0"))])
    (src / "short.tar").write_bytes(bytes(2048))
    sas = "sv=2022-11-02&sp=rl&se=2030-01-01&sig=TOPSECRET%3D"
    with served(src) as base:
        assert main(["preprocess", "images", f"{base}/{{00000..00001}}.tar?{sas}", str(tmp_path / "out"), "--size",
                     "8", "--quiet"]) == 0
        errors = []
        for url in (f"{base}/short.tar?sig=TOPSECRET", base.replace("://", "://user:TOPSECRET@") + "/short.tar"):
            with pytest.raises(ImageDecodeError) as err:
                TarBlobs([url], [(0, 1024, 4096)]).read(0)
            errors.append(str(err.value))
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["skipped"] == [{"path": "00001.tar/10001.png", "reason": "UnidentifiedImageError: cannot "
                                    "identify image file '00001.tar/10001.png'"}]
    stderr = capsys.readouterr().err
    assert "00001.tar/10001.png" in stderr and "TOPSECRET" not in stderr, stderr
    assert not [p for p in (tmp_path / "out").rglob("*") if p.is_file() and b"TOPSECRET" in p.read_bytes()]
    assert errors == [f"{base}/short.tar?sig=*** ends inside this sample's image (it changed since it was listed?)",
                      base.replace("://", "://user:***@") + "/short.tar ends inside this sample's image (it changed "
                      "since it was listed?)"]


def _presigned(folder: Path, token: str) -> contextlib.AbstractContextManager[str]:
    """``folder``'s files over loopback HTTP with Range reads, each answered only where its request carries
    ``sig=token`` (a presigned or SAS URL's query), as a store answers them; yields the base URL."""
    import urllib.parse

    from test_wds_source import _RangeHandler, served

    class Presigned(_RangeHandler):
        def send_head(self):
            if f"sig={token}" not in urllib.parse.urlsplit(self.path).query.split("&"):
                self.send_error(403)
                return None
            return super().send_head()

    return served(folder, Presigned)


def test_a_presigned_tar_or_parquet_url_is_read_by_its_path_and_its_query_kept_out_of_the_output(tmp_path, capsys):
    # `x.tar?sig=...` was taken for a folder by its suffix (a brace pattern of them worked): "has no class
    # sub-folders", the single file never read
    from test_parquet_source import write_parts
    from test_wds_source import _image, write_tar

    root = tmp_path / "src"
    (root / "wds").mkdir(parents=True)
    write_tar(root / "wds" / "00000.tar", [m for i in range(5) for m in (
        (f"{i:04d}.png", b"junk" if i == 2 else _image(i, "PNG")), (f"{i:04d}.cls", str(i % 2).encode()))])
    write_parts(root / "hf", [5], empty=(2,))
    token = "sv=2022-11-02&sp=r&sig=TOPSECRET"
    with _presigned(root, "TOPSECRET") as base:
        for rel, bad in (("wds/00000.tar", "00000.tar/0002.png"), ("hf/part-00.parquet", "part-00.parquet#2")):
            local = preprocess(root / rel, tmp_path / "local" / rel.split("/")[0])
            remote = preprocess(f"{base}/{rel}?{token}", tmp_path / "remote" / rel.split("/")[0])
            digests = lambda m: {f["path"]: f["sha256"] for f in m["files"]}  # noqa: E731
            assert digests(remote) == digests(local) and remote["num_samples"] == local["num_samples"] == 4
            assert [s["path"] for s in remote["skipped"]] == [s["path"] for s in local["skipped"]] == [bad]
            assert remote["source"]["path"] == f"{base}/{rel}?sv=2022-11-02&sp=r&sig=***"
    assert not [p for p in (tmp_path / "remote").rglob("*") if p.is_file() and b"TOPSECRET" in p.read_bytes()]
    assert "TOPSECRET" not in capsys.readouterr().err


def test_parquet_files_beside_class_folders_of_images_at_a_url_are_refused_as_on_disk(s3, tmp_path):
    from test_parquet_source import _image, write_parts

    root = write_parts(tmp_path / "src", [2], meta=None)
    (root / "cat").mkdir()
    (root / "cat" / "0.png").write_bytes(_image(0))
    url = upload(s3, "parquet-beside", root, "mixed")
    for src in (root, url):
        with pytest.raises(SourceError) as err:
            discover_source(src)
        assert str(err.value) == f"source {src} holds .parquet files (part-00.parquet) and class folders of images " \
            "(cat/): pass the Parquet files alone (a .parquet file, or a folder holding only them), or move the " \
            ".parquet files out of the image folder"
