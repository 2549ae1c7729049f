"""WebDataset tar shards as a preprocess source (NOTE [tar source] in fastdata/preprocess/tars.py): real tars
written with tarfile, JPEG/PNG members made with Pillow, through ``fastdata preprocess images``."""
from __future__ import annotations

import contextlib
import http.server
import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import pytest
from conftest import fresh_fs as _fresh_fs, index_colour, recording_run, sample_ids
from PIL import Image

from fastdata.cli.main import main
from fastdata.datasets.images import FastDataset
from fastdata.errors import SourceError
from fastdata.preprocess.tars import expand_braces

PER_TAR = 6


def tree_bytes(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _image(i: int, fmt: str) -> bytes:
    """A flat picture of sample ``i``'s colour (conftest.index_colour), 40 x 30, as ``fmt`` bytes."""
    buf = io.BytesIO()
    Image.new("RGB", (40, 30), index_colour(i)).save(buf, fmt, **({"quality": 95} if fmt == "JPEG" else {}))
    return buf.getvalue()


def write_tar(path: Path, members: list[tuple[str, bytes]]) -> None:
    with tarfile.open(path, "w") as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))


def sample_members(i: int, meta: bool = True) -> list[tuple[str, bytes]]:
    """Sample ``i`` as img2dataset writes it: the image (JPEG or PNG), its class, caption and JSON."""
    key = f"{i:09d}"
    ext, fmt = ("jpg", "JPEG") if i % 2 else ("png", "PNG")
    out = [(f"{key}.{ext}", _image(i, fmt)), (f"{key}.cls", str(i % 3).encode())]
    if meta:
        out += [(f"{key}.txt", f"caption {i}".encode()),
                (f"{key}.json", json.dumps({"key": key, "url": f"http://x/{i}", "status": "success",
                                            "score": i / 10, "emb": [i, 2 * i], "error_message": None}).encode())]
    return out


def make_tars(root: Path, count: int = 3, meta: bool = True) -> Path:
    """``count`` tars of PER_TAR samples, sample ``i`` in tar ``i // PER_TAR``; written last-first, so only
    sorting puts them in order."""
    root.mkdir(parents=True)
    for t in reversed(range(count)):
        write_tar(root / f"{t:05d}.tar", [m for i in range(t * PER_TAR, (t + 1) * PER_TAR)
                                          for m in sample_members(i, meta)])
    return root


def preprocess(src, out: Path, *extra: str) -> int:
    return main(["preprocess", "images", str(src), str(out), "--size", "8", "--shard-size", "4", "--quiet", *extra])


def test_expand_braces():
    assert expand_braces("s3://b/{00008..00011}.tar") == [f"s3://b/{i:05d}.tar" for i in range(8, 12)]
    assert expand_braces("a/{x,y}-{0..1}.tar") == ["a/x-0.tar", "a/x-1.tar", "a/y-0.tar", "a/y-1.tar"]
    assert expand_braces("plain.tar") == ["plain.tar"]


def test_a_tar_folder_gives_labels_captions_and_vectors_in_tar_then_member_order(tmp_path):
    src = make_tars(tmp_path / "src")
    assert preprocess(src, tmp_path / "w1", "--workers", "1") == 0
    assert preprocess(src, tmp_path / "w2", "--workers", "2") == 0
    assert tree_bytes(tmp_path / "w1") == tree_bytes(tmp_path / "w2")  # byte-identical for any worker count
    ds = FastDataset(tmp_path / "w1")
    n = 3 * PER_TAR
    b = ds.get_batch(np.arange(n))
    assert sample_ids(b["image"]).tolist() == list(range(n))  # sorted tars, then member order
    assert b["label"].tolist() == [i % 3 for i in range(n)]
    for i in range(n):
        lo, hi = b["caption_offsets"][i:i + 2].tolist()
        assert bytes(b["caption"][lo:hi].numpy().astype(np.uint8)).decode() == f"caption {i}"
    assert np.allclose(b["score"].numpy(), [i / 10 for i in range(n)])
    assert b["emb"].numpy().tolist() == [[i, 2 * i] for i in range(n)]
    manifest = json.loads((tmp_path / "w1" / "manifest.json").read_text())
    assert {f["name"]: f["kind"] for f in manifest["fields"]} == {
        "image": "image", "label": "label", "caption": "tokens", "score": "vector", "emb": "vector"}  # no url/key
    assert manifest["source"]["kind"] == "webdataset" and manifest["skipped"] == []


def test_a_brace_pattern_and_a_single_tar(tmp_path):
    src = make_tars(tmp_path / "src")
    assert preprocess(src / "{00000..00001}.tar", tmp_path / "two") == 0
    assert sample_ids(FastDataset(tmp_path / "two").get_batch(np.arange(2 * PER_TAR))["image"]).tolist() == list(
        range(2 * PER_TAR))
    assert preprocess(src / "00002.tar", tmp_path / "one") == 0
    assert sample_ids(FastDataset(tmp_path / "one").get_batch(np.arange(PER_TAR))["image"]).tolist() == list(
        range(2 * PER_TAR, 3 * PER_TAR))
    r = subprocess.run([sys.executable, "-m", "fastdata", "preprocess", "images", str(src / "{00000..00004}.tar"),
                        str(tmp_path / "missing"), "--quiet"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "2 of the 5 tars do not exist" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("fmt", ["npy", "lmdb"])
def test_image_and_class_tars_make_a_plain_dataset_shuffled_as_asked(tmp_path, fmt):
    src = make_tars(tmp_path / "src", meta=False)
    n = 3 * PER_TAR
    assert preprocess(src, tmp_path / "plain", "--format", fmt, "--quality", "95") == 0
    assert preprocess(src, tmp_path / "w1", "--format", fmt, "--quality", "95", "--shuffle", "5", "--workers", "1") == 0
    assert preprocess(src, tmp_path / "w2", "--format", fmt, "--quality", "95", "--shuffle", "5", "--workers", "2") == 0
    assert tree_bytes(tmp_path / "w1") == tree_bytes(tmp_path / "w2")
    assert "fields" not in json.loads((tmp_path / "plain" / "manifest.json").read_text())  # (image, label): version 1
    plain, shuffled = FastDataset(tmp_path / "plain"), FastDataset(tmp_path / "w1")
    perm = np.random.default_rng(5).permutation(n)  # sample i is the source's perm[i] (Source.shuffled)
    assert plain.targets.tolist() == [i % 3 for i in range(n)]
    assert shuffled.targets.tolist() == [int(p) % 3 for p in perm]
    ids = sample_ids(np.stack([shuffled[i][0].numpy() for i in range(n)]))
    assert ids.tolist() == perm.tolist()


def test_max_side_lmdb_from_tars_and_refused_with_fields(tmp_path, capsys):
    from fastdata.formats.lmdb_store import open_lmdb
    from fastdata.formats.manifest import load_manifest

    plain, captioned = make_tars(tmp_path / "plain", count=1, meta=False), make_tars(tmp_path / "meta", count=1)
    assert preprocess(plain, tmp_path / "out", "--format", "lmdb", "--resize", "max-side") == 0
    records = open_lmdb(tmp_path / "out", load_manifest(tmp_path / "out")).get_many(range(PER_TAR))
    assert {Image.open(io.BytesIO(r)).size for r in records} == {(8, 6)}  # 40 x 30, the longer side at 8
    assert preprocess(captioned, tmp_path / "refused", "--format", "lmdb", "--resize", "max-side") == 1
    assert "need the square geometry" in capsys.readouterr().err
    # refused after indexing (the first sample has no field, a later one a caption): no journal is left
    # behind, so the same OUT takes the right arguments at once
    late = _named_tars(tmp_path / "late", [[1, 2], [3, 4]], [{}, {"caption": "a dog"}])
    assert preprocess(late, tmp_path / "late-out", "--format", "lmdb", "--resize", "max-side") == 1
    assert "need the square geometry" in capsys.readouterr().err
    assert preprocess(late, tmp_path / "late-out", "--format", "lmdb") == 0


def _cut_in(tar: Path, member: str, fraction: float) -> None:
    """Truncate ``tar`` inside ``member``'s data, as a download cut short leaves it."""
    with tarfile.open(tar) as tf:
        m = tf.getmember(member)
    tar.write_bytes(tar.read_bytes()[:m.offset_data + int(m.size * fraction)])


def test_a_tar_cut_short_mid_member_is_a_listed_bad_record_or_fails_with_on_error_fail(tmp_path):
    src = make_tars(tmp_path / "src", count=2)
    _cut_in(src / "00000.tar", f"{3:09d}.jpg", 0.5)  # sample 3's image is cut; 4 and 5 are gone with it
    assert preprocess(src, tmp_path / "out", "--workers", "2") == 0
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["num_samples"] == 3 + PER_TAR
    assert [s["path"] for s in manifest["skipped"]] == [f"00000.tar/{3:09d}.jpg"]
    assert "cut short" in manifest["skipped"][0]["reason"]
    ids = sample_ids(FastDataset(tmp_path / "out").get_batch(np.arange(3 + PER_TAR))["image"])
    assert ids.tolist() == [0, 1, 2, *range(PER_TAR, 2 * PER_TAR)]
    r = subprocess.run([sys.executable, "-m", "fastdata", "preprocess", "images", str(src), str(tmp_path / "fail"),
                        "--on-error", "fail", "--quiet"], capture_output=True, text=True, timeout=120)
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("fastdata: error:")]
    assert r.returncode == 1 and len(errors) == 1 and "cut short" in errors[0] and "Traceback" not in r.stderr


def test_a_tar_cut_short_mid_header_lists_the_sample_it_cuts(tmp_path):
    src = make_tars(tmp_path / "src", count=1)
    with tarfile.open(src / "00000.tar") as tf:
        m = tf.getmember(f"{2:09d}.txt")
    data = (src / "00000.tar").read_bytes()
    (src / "00000.tar").write_bytes(data[:m.offset + 200])  # inside sample 2's caption header
    assert preprocess(src, tmp_path / "out") == 0
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["num_samples"] == 2 and [s["path"] for s in manifest["skipped"]] == [f"00000.tar/{2:09d}.png"]


def test_an_unwritable_output_is_refused_before_the_source_is_read(tmp_path):
    r = subprocess.run([sys.executable, "-m", "fastdata", "preprocess", "images", str(tmp_path / "no-such-source"),
                        "/sys/fastdata-test-out", "--quiet"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert "cannot write the output folder /sys/fastdata-test-out" in r.stderr  # not the source's error


@pytest.mark.remote
def test_tars_at_a_url_give_the_local_runs_samples(s3, tmp_path):
    _fresh_fs()  # no s3fs instance cached by another module's tests, bound to their server's endpoint
    src = make_tars(tmp_path / "src")
    url = s3("wds")
    for p in sorted(src.iterdir()):
        s3.client.put_object(Bucket="wds", Key=f"laion/{p.name}", Body=p.read_bytes())
    assert preprocess(src, tmp_path / "local") == 0
    local = tree_bytes(tmp_path / "local")
    for i, source in enumerate([f"{url}/laion/{{00000..00002}}.tar", f"{url}/laion/"]):
        assert preprocess(source, tmp_path / f"remote{i}", "--workers", "2") == 0
        got = tree_bytes(tmp_path / f"remote{i}")
        assert {k: v for k, v in got.items() if k != "manifest.json"} == {
            k: v for k, v in local.items() if k != "manifest.json"}
        assert json.loads(got["manifest.json"])["source"]["path"] == source
    r = subprocess.run([sys.executable, "-m", "fastdata", "preprocess", "images", "s3://no-such-bucket/x/",
                        str(tmp_path / "denied"), "--quiet"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "s3://no-such-bucket" in r.stderr, r.stderr



def _named_tars(root: Path, classes: list[list[object]], extra: list[dict]) -> Path:
    """One tar per entry of ``classes`` (sample i's class), each sample's JSON holding ``extra[t]``."""
    root.mkdir(parents=True)
    i = 0
    for t, names in enumerate(classes):
        members = []
        for name in names:
            key = f"{i:09d}"
            members += [(f"{key}.jpg", _image(i, "JPEG")),
                        (f"{key}.json", json.dumps({"label": name, **extra[t]}).encode())]
            i += 1
        write_tar(root / f"{t:05d}.tar", members)
    return root


def test_tars_indexed_apart_share_one_class_list_and_the_keys_every_sample_has(tmp_path, capsys):
    # each tar is listed by its own task: classes, kinds and kept keys are merged across tars (NOTE [tar index])
    # "HEIGHT": numeric (not a field name) in tars 0 and 2, null in tar 1: dropped, as one listing would
    src = _named_tars(tmp_path / "src", [["dog", "dog", "emu"], ["cat", "emu"], ["ant"]],
                      [{"w": 1.0, "only0": 2.0, "HEIGHT": 30}, {"w": 2.0, "HEIGHT": None}, {"w": 3.0, "HEIGHT": 3}])
    assert preprocess(src, tmp_path / "w1", "--shard-size", "2", "--workers", "1") == 0
    assert preprocess(src, tmp_path / "w2", "--shard-size", "2", "--workers", "2") == 0
    assert tree_bytes(tmp_path / "w1") == tree_bytes(tmp_path / "w2")
    manifest = json.loads((tmp_path / "w1" / "manifest.json").read_text())
    assert manifest["classes"] == ["ant", "cat", "dog", "emu"]
    assert {f["name"] for f in manifest["fields"]} == {"image", "label", "w"}  # "only0": not in every sample
    b = FastDataset(tmp_path / "w1").get_batch(np.arange(6))
    assert b["label"].tolist() == [2, 2, 3, 1, 3, 0]
    assert b["w"].tolist() == [1.0, 1.0, 1.0, 2.0, 2.0, 3.0]
    assert sample_ids(b["image"]).tolist() == list(range(6))
    mixed = _named_tars(tmp_path / "mixed", [[1, 2], ["cat"]], [{}, {}])
    assert preprocess(mixed, tmp_path / "refused") == 1
    assert "mix ids and names" in capsys.readouterr().err


def test_a_rerun_reads_the_tar_indexes_and_a_piece_carries_only_its_tars(tmp_path):
    import pickle

    from fastdata.preprocess.tar_index import TarSource
    from fastdata.preprocess.tars import tar_files

    src = make_tars(tmp_path / "src", count=3)
    source = TarSource.of(src, tar_files(src))
    area = source.area(tmp_path)
    ran: list[int] = []
    run = recording_run(ran)
    first = source.index(area, run)
    assert ran == [0, 1, 2] and first.starts.tolist() == [0, PER_TAR, 2 * PER_TAR, 3 * PER_TAR]
    again = source.index(area, run)  # a resumed run: every summary is there, no tar is streamed again
    assert ran == [0, 1, 2] and again.starts.tolist() == first.starts.tolist() and again.schema == first.schema
    piece = again.piece(PER_TAR - 1, PER_TAR + 2)  # crosses from tar 0 into tar 1
    assert piece.tars == [str(src / "00000.tar"), str(src / "00001.tar")]
    loaded = pickle.loads(pickle.dumps(piece)).load()
    assert loaded.paths == [f"0000{t}.tar/{i:09d}.{'jpg' if i % 2 else 'png'}" for t, i in
                            [(0, PER_TAR - 1), (1, PER_TAR), (1, PER_TAR + 1)]]
    assert loaded.labels == [(PER_TAR - 1) % 3, PER_TAR % 3, (PER_TAR + 1) % 3]
    assert loaded.extras["caption"] == [f"caption {i}" for i in range(PER_TAR - 1, PER_TAR + 2)]
    # the piece's size depends on its own tars, not on the source's
    assert len(pickle.dumps(again.piece(0, 2))) == len(pickle.dumps(again.piece(PER_TAR, PER_TAR + 2)))


def test_a_damaged_or_missing_tar_index_is_listed_again_from_its_tar(tmp_path, caplog):
    from fastdata.preprocess import tar_index
    from fastdata.preprocess.tar_index import TarSource, index_name
    from fastdata.preprocess.tars import tar_files

    src = make_tars(tmp_path / "src", count=2)
    source = TarSource.of(src, tar_files(src))
    area = source.area(tmp_path)
    indexed = source.index(area, lambda fn, tasks: map(fn, tasks))
    want = indexed.piece(0, 2 * PER_TAR).load()
    index0, summary1 = tmp_path / index_name(0, "index"), tmp_path / index_name(1, "summary")
    index0.write_bytes(index0.read_bytes().replace(b"caption 1", b"caption 9"))  # tampered: valid JSON
    summary1.write_bytes(b"{")  # a summary cut short
    tar_index._indexes.clear()  # as in a new process: the indexes this one parsed are kept
    again = source.index(area, lambda fn, tasks: map(fn, tasks))  # tar 1 listed again for its summary
    got = again.piece(0, 2 * PER_TAR).load()  # tar 0's index fails its sha256: listed again
    assert (got.paths, got.labels, got.extras) == (want.paths, want.labels, want.extras)
    assert b"caption 1" in index0.read_bytes() and "listing the tar again" in caplog.text
    tar0 = src / "00000.tar"
    tar0.write_bytes(tar0.read_bytes().replace(b"caption 2", b"caption 8"))  # the tar changed under the run
    index0.unlink()
    tar_index._indexes.clear()
    with pytest.raises(SourceError, match="changed since this run listed it"):
        again.piece(0, 2).load()


class _RangeHandler(http.server.SimpleHTTPRequestHandler):
    """Files with HTTP Range reads and no folder listings, as a CDN or the Hugging Face Hub serves tars."""

    def log_message(self, *args):
        pass

    def send_head(self):
        import os
        import re

        path = self.translate_path(self.path)
        if not os.path.isfile(path):
            self.send_error(404)
            return None
        n = os.path.getsize(path)
        m = re.match(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        a, b = (int(m.group(1)), min(int(m.group(2) or n - 1), n - 1)) if m else (0, n - 1)
        self.send_response(206 if m else 200)
        if m:
            self.send_header("Content-Range", f"bytes {a}-{b}/{n}")
        self.send_header("Content-Length", str(b - a + 1))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        with open(path, "rb") as f:  # the range only: a tar of 100 MB is read in many ranges
            f.seek(a)
            return io.BytesIO(f.read(b - a + 1))


def test_a_brace_pattern_over_http_without_folder_listings(tmp_path):
    import functools
    import threading

    src = make_tars(tmp_path / "src")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_RangeHandler, directory=str(src)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/{{00000..00002}}.tar"
        assert preprocess(src, tmp_path / "local") == 0
        assert preprocess(url, tmp_path / "http", "--workers", "2") == 0
    finally:
        server.shutdown()
    local, served = tree_bytes(tmp_path / "local"), tree_bytes(tmp_path / "http")
    assert {k: v for k, v in served.items() if k != "manifest.json"} == {
        k: v for k, v in local.items() if k != "manifest.json"}


# -- hostile metadata: a bad record (skipped, listed) or one clear line naming the sample, never a crash ----------
def test_metadata_no_parser_float_or_text_holds_is_a_listed_bad_record(tmp_path, capsys):
    big = "1" + "0" * 400  # an integer past a float's range (1.8e308)
    metas = [b'{"score": 1}',
             b'{"score": 2, "deep": ' + b"[" * 200_000 + b"]" * 200_000 + b"}",  # RecursionError stopped the run
             b'{"score": ' + big.encode() + b"}",  # OverflowError at listing
             b'{"score": 4, "boxes": [[1, 1, ' + big.encode() + b', 5]], "box_labels": [0]}',  # in the worker
             b'{"score": 5, "caption": "bad \\ud800"}',  # a lone surrogate: UnicodeEncodeError in the tokenizer
             b'{"score": 6, "n": ' + b"7" * 5000 + b"}",  # past Python's 4300 digits
             b'{"score": 7}']
    src = tmp_path / "src"
    src.mkdir()
    write_tar(src / "00000.tar", [m for i, meta in enumerate(metas) for m in (
        (f"{i:03d}.png", _image(i, "PNG")), (f"{i:03d}.cls", str(i % 2).encode()), (f"{i:03d}.json", meta))])
    assert preprocess(src, tmp_path / "w1", "--workers", "1", "--tokenizer", "bytes") == 0
    assert preprocess(src, tmp_path / "w2", "--workers", "2", "--tokenizer", "bytes") == 0
    assert tree_bytes(tmp_path / "w1") == tree_bytes(tmp_path / "w2")
    manifest = json.loads((tmp_path / "w1" / "manifest.json").read_text())
    reasons = {s["path"]: s["reason"] for s in manifest["skipped"]}
    assert manifest["num_samples"] == 2 and sorted(reasons) == [f"00000.tar/{i:03d}.png" for i in range(1, 6)]
    assert "sample 001 has bad metadata (ValueError: .json nests deeper" in reasons["00000.tar/001.png"]
    assert "'score' is <an integer of 401 digits>, past a float's range" in reasons["00000.tar/002.png"]
    assert "are not [[x1, y1, x2, y2], ...]" in reasons["00000.tar/003.png"]
    assert "the caption holds a lone surrogate '\\ud800'" in reasons["00000.tar/004.png"]
    assert "sample 005 has bad metadata (ValueError: Exceeds the limit (4300 digits)" in reasons["00000.tar/005.png"]
    assert FastDataset(tmp_path / "w1").get_batch(np.arange(2))["score"].tolist() == [1.0, 7.0]
    capsys.readouterr()
    assert preprocess(src, tmp_path / "fail", "--on-error", "fail", "--tokenizer", "bytes") == 1
    assert "00000.tar/001.png" in capsys.readouterr().err


def _cls_tars(root: Path, labels: list[bytes]) -> Path:
    root.mkdir(parents=True)
    write_tar(root / "00000.tar", [m for i, cls in enumerate(labels) for m in (
        (f"{i:03d}.png", _image(i, "PNG")), (f"{i:03d}.cls", cls))])
    return root


@pytest.mark.parametrize("odd", [b"", b"1.0", b"-1", b" x", "\u00b2".encode()], ids=["empty", "1.0", "-1", "x", "sup2"])
def test_an_odd_cls_among_ids_is_named_with_its_sample(tmp_path, capsys, odd):
    # "²": str.isdigit() says True and int() refuses it; the others stopped the run naming the first label, "0"
    src = _cls_tars(tmp_path / "src", [b"0", odd, b"1"])
    assert preprocess(src, tmp_path / "out") == 1
    err = capsys.readouterr().err
    assert f"class labels mix ids and names: {odd.decode().strip()!r} is the label of 00000.tar/001.png" in err, err
    assert "but 0, the label of 00000.tar/000.png (record 1), is an id" in err


def test_cls_ids_far_past_the_samples_are_refused_and_a_bom_is_no_part_of_one(tmp_path, capsys):
    # one .cls of 10^10 built a list of 10^10 class names (MemoryError); 3,000,000 a 53 MB manifest
    for big in (b"3000000", b"10000000000"):
        capsys.readouterr()
        assert preprocess(_cls_tars(tmp_path / big.decode(), [b"0", big]), tmp_path / f"o-{big.decode()}") == 1
        err = capsys.readouterr().err
        assert f"00000.tar: class id {big.decode()} is too large for 2 samples" in err and "below 65536" in err, err
    assert preprocess(_cls_tars(tmp_path / "bom", [b"0", "\ufeff2".encode()]), tmp_path / "o-bom") == 0
    assert FastDataset(tmp_path / "o-bom").targets.tolist() == [0, 2]


# -- members a listing reads, steps over, or refuses (NOTE [tar source] rule 5) ------------------------------------
class _Zeros(io.RawIOBase):
    """``n`` zero bytes as a stream: a big member goes into a tar without this process holding it."""

    def __init__(self, n: int) -> None:
        self.left = n

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        k = min(len(b), self.left)
        b[:k] = bytes(k)
        self.left -= k
        return k


_LISTING = """
import json, sys, tracemalloc
import fsspec.implementations.http  # imported before: only what the listing allocates is counted
from fastdata.preprocess.tars import members
tracemalloc.start()
got = [[key, sorted(group), reason] for key, group, reason in members(sys.argv[1], "big.tar")]
print(json.dumps({"peak": tracemalloc.get_traced_memory()[1], "samples": got}))
"""


@pytest.mark.parametrize("where", ["local", "http"])
def test_a_listing_steps_over_members_it_does_not_use_and_refuses_huge_metadata(tmp_path, where):
    # an 80 MB .bin beside an image was read whole (160 MiB allocated at the peak), and so was a huge .json
    big, src = 80 << 20, tmp_path / "src"
    src.mkdir()
    with tarfile.open(src / "big.tar", "w") as tf:
        for i in range(4):
            for name, data in [(f"{i:03d}.png", _image(i, "PNG")), (f"{i:03d}.cls", str(i % 3).encode())]:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
            if i in (1, 2):  # sample 1: a member the schema does not use; sample 2: a .json past 16 MiB
                info = tarfile.TarInfo(f"{i:03d}.bin" if i == 1 else f"{i:03d}.json")
                info.size = big if i == 1 else (17 << 20)
                tf.addfile(info, io.BufferedReader(_Zeros(info.size)))
    url = str(src / "big.tar")
    if where == "http":
        import functools
        import threading

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                                 functools.partial(_RangeHandler, directory=str(src)))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{server.server_address[1]}/big.tar"
    try:
        r = subprocess.run([sys.executable, "-c", _LISTING, url], capture_output=True, text=True, timeout=300)
    finally:
        if where == "http":
            server.shutdown()
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    limit = (8 if where == "local" else 40) << 20  # http: fsspec's cache of 5 MiB blocks, ~30 MiB at any tar size
    assert out["peak"] < limit, f"listing allocated {out['peak'] >> 20} MiB at its peak"  # 160 MiB and more before
    assert [s[:2] for s in out["samples"]] == [["000", ["cls", "png"]], ["001", ["bin", "cls", "png"]],
                                               ["002", ["cls", "json", "png"]], ["003", ["cls", "png"]]]
    assert [s[2] for s in out["samples"]] == [None, None, "big.tar: sample 002's .json is 17825792 bytes, past the "
                                              "16 MiB a metadata member may hold: repack the tar without it", None]
    if where == "local":
        assert preprocess(src, tmp_path / "out") == 0
        manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
        assert [s["path"] for s in manifest["skipped"]] == ["big.tar/002.png"]
        images, labels = FastDataset(tmp_path / "out").get_batch(np.arange(3))  # (image, label): no fields
        assert sample_ids(images).tolist() == [0, 1, 3] and labels.tolist() == [0, 1, 0]


def test_a_sparse_image_member_is_a_bad_record_and_the_samples_after_it_are_kept(tmp_path):
    # its bytes in the archive are the file less its holes: read by offset, they decoded to other pixels
    import shutil

    if shutil.which("tar") is None:
        pytest.skip("needs GNU tar to write a sparse member (tar -S)")
    files, src = tmp_path / "files", tmp_path / "src"
    files.mkdir()
    src.mkdir()
    buf = io.BytesIO()
    Image.new("RGB", (256, 256)).save(buf, "BMP")  # 192 KB of zero pixels after a 54-byte header
    with open(files / "001.bmp", "wb") as f:  # written with a hole, as a sparse file on disk
        f.write(buf.getvalue()[:54])
        f.truncate(len(buf.getvalue()))
    for i in (0, 2):
        (files / f"{i:03d}.png").write_bytes(_image(i, "PNG"))
    for i in range(3):
        (files / f"{i:03d}.cls").write_text(str(i % 3))
    names = ["000.png", "000.cls", "001.bmp", "001.cls", "002.png", "002.cls"]
    r = subprocess.run(["tar", "-S", "--format=gnu", "-cf", str(src / "00000.tar"), "-C", str(files), *names],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"this tar cannot write sparse members: {r.stderr.strip()}")
    with tarfile.open(src / "00000.tar") as tf:
        if not tf.getmember("001.bmp").issparse():
            pytest.skip(f"{tmp_path}'s file system keeps no holes: tar -S stored the file whole")
        assert tf.extractfile("001.bmp").read() == buf.getvalue()  # the tar itself is sound
    assert preprocess(src, tmp_path / "out") == 0
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["skipped"] == [{"path": "00000.tar/001.bmp", "reason": "00000.tar: sample 001's .bmp is stored "
                                    "sparse (tar -S): repack the tar without -S"}]
    images, labels = FastDataset(tmp_path / "out").get_batch(np.arange(2))
    assert sample_ids(images).tolist() == [0, 2] and labels.tolist() == [0, 2]


def test_a_hard_link_member_takes_its_targets_bytes_and_one_to_no_earlier_member_is_a_bad_record(tmp_path):
    # tar stores a file's second name as a link (cp -l, rdfind -makehardlinks): its samples were dropped as
    # having "no image member"
    import os

    files, src = tmp_path / "files", tmp_path / "src"
    files.mkdir()
    src.mkdir()
    (files / "000.png").write_bytes(_image(0, "PNG"))
    (files / "000.cls").write_text("0")
    os.link(files / "000.png", files / "001.png")  # the same picture under two names
    os.link(files / "000.cls", files / "002.cls")  # and the same class
    (files / "001.cls").write_text("1")
    (files / "002.png").write_bytes(_image(2, "PNG"))
    (files / "003.cls").write_text("1")
    with tarfile.open(src / "00000.tar", "w") as tf:  # tarfile, like tar, stores a file's later names as links
        for name in ["000.png", "000.cls", "001.png", "001.cls", "002.png", "002.cls"]:
            tf.add(files / name, arcname=name)
        link = tarfile.TarInfo("003.png")  # a link to a member of another tar
        link.type, link.linkname = tarfile.LNKTYPE, "elsewhere/000.png"
        tf.addfile(link)
        tf.add(files / "003.cls", arcname="003.cls")
    with tarfile.open(src / "00000.tar") as tf:
        assert [m.name for m in tf if m.islnk()] == ["001.png", "002.cls", "003.png"]
    assert preprocess(src, tmp_path / "out") == 0
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["skipped"] == [{"path": "00000.tar/003.png", "reason": "00000.tar: sample 003's .png is a hard "
                                    "link to 'elsewhere/000.png', which is no image member before it in this tar: "
                                    "repack the tar with tar --hard-dereference"}]
    images, labels = FastDataset(tmp_path / "out").get_batch(np.arange(3))
    assert sample_ids(images).tolist() == [0, 0, 2] and labels.tolist() == [0, 1, 0]


def test_a_member_name_a_sample_repeats_is_a_bad_record_never_a_merged_sample(tmp_path):
    # `tar -r` appending a re-downloaded sample: its image and caption were paired with the first one's class,
    # the first sample lost, nothing listed
    src = tmp_path / "src"
    src.mkdir()
    first, again = sample_members(1), [m for m in sample_members(3) if not m[0].endswith(".cls")]
    again = [(f"{1:09d}" + name[9:], data) for name, data in again]  # sample 3's image and caption, named 1
    write_tar(src / "00000.tar", [*sample_members(0), *first, *again, *sample_members(2)])
    assert preprocess(src, tmp_path / "out") == 0
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["num_samples"] == 2 and [s["path"] for s in manifest["skipped"]] == [f"00000.tar/{1:09d}.jpg"]
    assert "has two .jpg members" in manifest["skipped"][0]["reason"]
    batch = FastDataset(tmp_path / "out").get_batch(np.arange(2))
    assert sample_ids(batch["image"]).tolist() == [0, 2] and batch["label"].tolist() == [0, 2]


def test_a_sample_appended_again_after_others_is_a_bad_record_wherever_it_appears(tmp_path):
    # `tar -r` appends at the end: the key came back after sample 2 and both were kept, two samples of one
    # key with two classes (sample 3's picture under sample 1's name); which one is sample 1 is unknown
    src = tmp_path / "src"
    src.mkdir()
    again = [(f"{1:09d}" + name[9:], data) for name, data in sample_members(3)]
    write_tar(src / "00000.tar", [*sample_members(0), *sample_members(1), *sample_members(2), *again])
    assert preprocess(src, tmp_path / "out") == 0
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["num_samples"] == 2
    assert [s["path"] for s in manifest["skipped"]] == [f"00000.tar/{1:09d}.jpg"] * 2
    assert all("appears 2 times, apart" in s["reason"] for s in manifest["skipped"])
    batch = FastDataset(tmp_path / "out").get_batch(np.arange(2))
    assert sample_ids(batch["image"]).tolist() == [0, 2] and batch["label"].tolist() == [0, 2]
    assert preprocess(src, tmp_path / "fail", "--on-error", "fail") != 0


def test_hidden_files_in_a_tar_folder_are_not_tars(tmp_path):
    # macOS leaves ._NAME files beside each file it copies to SMB or exFAT: "cannot read ._00000.tar"
    src = make_tars(tmp_path / "src", count=2)
    (src / "._00000.tar").write_bytes(b"\x00\x05\x16\x07 AppleDouble" + bytes(100))
    (src / ".00001.tar").mkdir()
    assert preprocess(src, tmp_path / "out") == 0
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["num_samples"] == 2 * PER_TAR


@contextlib.contextmanager
def served(folder: Path, handler: Optional[type] = None) -> Iterator[str]:
    """``folder``'s files over loopback HTTP with Range reads and no listings (``handler``, default
    `_RangeHandler`); yields the base URL."""
    import functools
    import threading

    handler = functools.partial(handler or _RangeHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


def _raw_member(name: str, data: bytes, size: Optional[int] = None) -> bytes:
    """One member's header and padded data, as tar writes them; ``size`` is what the header claims."""
    info = tarfile.TarInfo(name)
    info.size = len(data) if size is None else size  # (GNU format: a size past 8 GiB or below 0 in base-256)
    return info.tobuf(format=tarfile.GNU_FORMAT) + data + bytes(-len(data) % tarfile.BLOCKSIZE)


_CLAIMS = """
import json, sys
from fastdata.preprocess.tars import members
print(json.dumps([[[key, sorted(group), reason] for key, group, reason in members(u, "x.tar")] for u in sys.argv[1:]]))
"""


@pytest.mark.parametrize("where", ["local", "http"])
def test_a_member_claiming_bytes_the_tar_does_not_hold_cuts_it_short(tmp_path, where):
    # a size field of 2^62 (base-256) kept tarfile's stream mode stepping past the end for ever (the run hung at
    # 100% CPU), and a negative one stopped the run ("seeking backwards"): the sample it cuts is a bad record
    src = tmp_path / "src"
    src.mkdir()
    cases = [(ext, size) for ext in ("png", "cls", "bin") for size in (1 << 62, -1024)]
    for t, (ext, size) in enumerate(cases):
        (src / f"{t:05d}.tar").write_bytes(
            _raw_member("000.png", _image(0, "PNG")) + _raw_member("000.cls", b"0")
            + _raw_member(f"001.{ext}", b"", size) + bytes(1024)
            + _raw_member("002.png", _image(2, "PNG")) + _raw_member("002.cls", b"1") + bytes(1024))
    names = [f"{t:05d}.tar" for t in range(len(cases))]
    with contextlib.ExitStack() as stack:
        base = stack.enter_context(served(src)) if where == "http" else str(src)
        r = subprocess.run([sys.executable, "-c", _CLAIMS, *[f"{base}/{n}" for n in names]], capture_output=True,
                           text=True, timeout=60)  # (before: no end)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == [
        [["000", ["cls", "png"], None],
         ["001", [ext], f"x.tar is cut short in sample 001 (ReadError: a member claims {size} bytes, which the "
                        "archive does not hold)"]] for ext, size in cases]
    if where == "local":
        assert preprocess(src, tmp_path / "out") == 0
        manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
        assert manifest["num_samples"] == len(cases)
        assert [s["path"] for s in manifest["skipped"]] == [f"{n}/001.{'png' if ext == 'png' else 'jpg'}"
                                                            for n, (ext, _) in zip(names, cases)]


def test_a_json_caption_of_numbers_is_a_bad_record_naming_it(tmp_path, capsys):
    # the caption key fell between the rules: kept whatever its value (the text field's key), typed a vector by
    # records.py, then missing from the vectors' lengths: a KeyError traceback
    for caption, shown in ((3, "3"), ([101, 2023, 102], "[101, 2023, 102]")):
        only = tmp_path / f"only-{shown}"  # every sample's caption numbers: one line, no traceback
        only.mkdir()
        write_tar(only / "00000.tar", [m for i in range(2) for m in (
            (f"{i:03d}.png", _image(i, "PNG")), (f"{i:03d}.json", json.dumps({"caption": caption}).encode()))])
        capsys.readouterr()
        assert preprocess(only, tmp_path / f"none-{shown}") == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"'caption' holds {shown}: a caption is text" in err, err
        src = tmp_path / f"src-{shown}"  # among text captions: that sample is listed, the others kept
        src.mkdir()
        metas = [{"caption": "a dog"}, {"caption": caption}, {"caption": caption}, {"caption": "an emu"}]
        write_tar(src / "00000.tar", [m for i, meta in enumerate(metas) for m in (
            (f"{i:03d}.png", _image(i, "PNG")), (f"{i:03d}.json", json.dumps(meta).encode()),
            *([(f"{i:03d}.txt", b"a cat")] if i == 2 else []))])  # a .txt is the caption: the JSON one unused
        assert preprocess(src, tmp_path / f"out-{shown}") == 0
        manifest = json.loads((tmp_path / f"out-{shown}" / "manifest.json").read_text())
        assert manifest["skipped"] == [{"path": "00000.tar/001.png", "reason": "00000.tar: sample 001 has bad "
                                        f"metadata (ValueError: 'caption' holds {shown}: a caption is text (a .txt "
                                        "member, or a JSON string); store numbers under another key)"}]
        b = FastDataset(tmp_path / f"out-{shown}").get_batch(np.arange(3))
        offsets = b["caption_offsets"].tolist()
        assert [bytes(b["caption"][lo:hi].numpy().astype(np.uint8)).decode() for lo, hi in
                zip(offsets, offsets[1:])] == ["a dog", "a cat", "an emu"]
        assert sample_ids(b["image"]).tolist() == [0, 2, 3]


def test_a_folder_of_tars_beside_class_folders_of_images_is_refused_naming_both(tmp_path, capsys):
    # the archive kept beside the folder extracted from it: the folder's labelled images were dropped, unsaid
    src = make_tars(tmp_path / "train", count=1)
    (src / "logs").mkdir()
    (src / "logs" / "stats.json").write_text("{}")  # no image under it: still a folder of tars
    assert preprocess(src, tmp_path / "tars") == 0
    assert json.loads((tmp_path / "tars" / "manifest.json").read_text())["num_samples"] == PER_TAR
    for c in ("cat", "dog"):
        (src / c / "deeper").mkdir(parents=True)
        (src / c / "deeper" / "0.png").write_bytes(_image(0, "PNG"))
    assert preprocess(src, tmp_path / "out") == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"source {src} holds .tar files (00000.tar) and class folders of images (cat/): " \
        f"pass the tars alone (one .tar, or a brace pattern such as {src}/{{00000..00009}}.tar), or move the .tar " \
        "files out of the image folder" in err, err
    assert preprocess(src / "{00000..00000}.tar", tmp_path / "braced") == 0  # the tars alone, as it says
    assert tree_bytes(tmp_path / "braced").keys() == tree_bytes(tmp_path / "tars").keys()
    (src / "00000.tar").rename(tmp_path / "00000.tar")
    assert preprocess(src, tmp_path / "images") == 0  # the image folder alone
    manifest = json.loads((tmp_path / "images" / "manifest.json").read_text())
    assert manifest["num_samples"] == 2 and manifest["classes"] == ["cat", "dog", "logs"]


def _captions(b: dict) -> list[str]:
    offsets = b["caption_offsets"].tolist()
    return [bytes(b["caption"][lo:hi].numpy().astype(np.uint8)).decode() for lo, hi in zip(offsets, offsets[1:])]


def test_a_json_caption_of_several_texts_is_a_bad_record_and_a_null_one_no_caption(tmp_path):
    # COCO-style captions (a list of texts) were dropped without a word: the sample kept with no caption
    metas = [{"caption": "a dog"}, {"caption": ["a cat", "a cat on a mat"]}, {"caption": ["x", "y"]},
             {"caption": None}, {"key": "004"}]
    src = tmp_path / "src"
    src.mkdir()
    write_tar(src / "00000.tar", [m for i, meta in enumerate(metas) for m in (
        (f"{i:03d}.png", _image(i, "PNG")), (f"{i:03d}.json", json.dumps(meta).encode()),
        *([(f"{i:03d}.txt", b"a cow")] if i == 2 else []))])  # a .txt is the caption: the JSON list unused
    assert preprocess(src, tmp_path / "out") == 0
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["skipped"] == [{"path": "00000.tar/001.png", "reason": "00000.tar: sample 001 has bad metadata "
                                    "(ValueError: 'caption' holds 2 texts ['a cat', 'a cat on a mat']: a caption is "
                                    "one text: keep one as 'caption' and store the others under another key, or give "
                                    "the caption as a .txt member)"}]
    b = FastDataset(tmp_path / "out").get_batch(np.arange(4))
    assert _captions(b) == ["a dog", "a cow", "", ""]  # null: no caption, as a sample without the key
    assert sample_ids(b["image"]).tolist() == [0, 2, 3, 4]


def test_a_sample_refused_for_its_json_lists_no_class_but_a_nan_only_where_its_key_is_stored(tmp_path):
    # a sample refused for an inverted box still put its .cls name into the class list. A NaN refuses its
    # sample only where its key is stored (in every sample a number): its class stays listed (NOTE [refused
    # records] rule 4), and a key another sample gives as null (img2dataset's pwatermark) refuses nothing
    metas = [{"score": 1.0, "pwatermark": 0.5}, {"score": float("nan"), "pwatermark": float("nan")},
             {"score": 2.0, "boxes": [[9, 1, 5, 5]], "box_labels": ["inv"], "pwatermark": None},
             {"score": 3.0, "boxes": [[10, 5, 30, 25]], "box_labels": ["emu"], "pwatermark": float("nan")},
             {"score": 4.0, "pwatermark": float("inf")}]
    src = tmp_path / "src"
    src.mkdir()
    names = ["cat", "nan", "box", "dog", "cat"]
    write_tar(src / "00000.tar", [m for i, meta in enumerate(metas) for m in (
        (f"{i:03d}.png", _image(i, "PNG")), (f"{i:03d}.cls", names[i].encode()),
        (f"{i:03d}.json", json.dumps(meta).encode()))])
    assert preprocess(src, tmp_path / "out", "--workers", "1") == 0
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["classes"] == ["cat", "dog", "emu", "nan"]
    assert [(s["path"], s["reason"]) for s in manifest["skipped"]] == [
        ("00000.tar/001.png", "score holds nan: a float field needs finite numbers (float32: at most 3.4e38 in "
                              "size)"),
        ("00000.tar/002.png", "box [9.0, 1.0, 5.0, 5.0] has x2 < x1 or y2 < y1: boxes are corners [x1, y1, x2, y2] "
                              "(an [x, y, w, h] box is [x, y, x + w, y + h])")]
    b = FastDataset(tmp_path / "out").get_batch(np.arange(3))
    assert b["label"].tolist() == [0, 1, 0] and b["box_labels"].tolist() == [2]
    assert b["score"].tolist() == [1.0, 3.0, 4.0] and "pwatermark" not in b
