"""Finding the input images: ImageFolder order and labels, CSV lists, and their errors."""
from __future__ import annotations

import io
import json
import logging
import os
import re
import threading

import numpy as np
import pytest
from conftest import AWKWARD_BAD, AWKWARD_GOOD
from PIL import Image

from fastdata.cli.main import main
from fastdata.errors import SourceError
from fastdata.preprocess.records import discover_any, jsonl_records
from fastdata.preprocess.sources import class_ids, discover, inside
from fastdata.preprocess.url_reads import UrlReader, open_text, store_call


def _png(path, colour=(200, 10, 10)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (40, 30), colour).save(path, "PNG")


def _preprocess(src, out, *extra: str) -> int:
    return main(["preprocess", "images", str(src), str(out), "--size", "8", "--quiet", "--workers", "1", *extra])


def test_image_folder_order_labels_and_filters(awkward_folder):
    src = discover(awkward_folder)
    assert src.classes == ["a_modes", "b_exif", "ñandú"]  # hidden class folder ignored, Unicode kept
    assert src.paths == sorted(AWKWARD_GOOD + AWKWARD_BAD)  # .txt and hidden files are not listed
    assert src.labels == [{"a": 0, "b": 1, "ñ": 2}[p[0]] for p in src.paths]


def test_csv_list_with_names_and_relative_paths(tmp_path, photo_folder):
    (tmp_path / "list.csv").write_text("path,label\nphotos/class_1/img_0000.jpg,dog\n"
                                       "photos/class_0/img_0001.jpg,cat\n\nphotos/notes.txt,cat\n")
    src = discover(tmp_path / "list.csv")
    assert src.kind == "csv" and src.classes == ["cat", "dog"]
    assert src.paths == ["photos/class_1/img_0000.jpg", "photos/class_0/img_0001.jpg"] and src.labels == [1, 0]


def test_csv_integer_labels_keep_their_ids(tmp_path, photo_folder):
    (tmp_path / "l.csv").write_text("photos/class_1/img_0000.jpg,3\nphotos/class_0/img_0001.jpg,0\n")
    src = discover(tmp_path / "l.csv")
    assert src.labels == [3, 0] and src.classes == ["0", "1", "2", "3"]


@pytest.mark.parametrize("kind", ["list", "records", "jsonl"])
def test_ids_and_names_mixed_in_one_source_are_refused_naming_a_sample_of_each(tmp_path, photo_folder, kind):
    # "unknown" among 0..10 made every label a name, sorted: 2 stored as 3, 10 as 2, and nothing said (a mix of
    # JSON ids and names, or of .cls files, was refused already)
    labels = [*map(str, range(11)), "unknown"]
    image = "photos/class_0/img_0000.jpg"
    if kind == "list":
        (tmp_path / "s.csv").write_text("".join(f"{image},{v}\n" for v in labels))
    elif kind == "records":
        (tmp_path / "s.csv").write_text("image,label\n" + "".join(f"{image},{v}\n" for v in labels))
    else:
        (tmp_path / "s.jsonl").write_text("".join(json.dumps({"image": image, "label": v}) + "\n" for v in labels))
    with pytest.raises(SourceError, match=r"class labels mix ids and names: '0' \(the label of .*\) is an id, "
                                          r"'unknown' \(the label of .*\) a name") as err:
        discover_any(tmp_path / ("s.jsonl" if kind == "jsonl" else "s.csv"))
    assert "record 12" in str(err.value) or kind == "list"
    (tmp_path / "t.csv").write_text("image,labels\n" + f"{image},cat 2024\n{image},7\n")  # tags may mix
    assert discover_any(tmp_path / "t.csv").classes == ["2024", "7", "cat"]


@pytest.mark.parametrize("link", ["file", "folder"])
def test_a_list_row_through_a_link_is_resolved_and_one_leaving_the_folder_refused(tmp_path, photo_folder, link,
                                                                                  monkeypatch):
    # each row's folder is resolved once for the whole list (a realpath per row: minutes at 14M rows); links
    # are still followed as a realpath would, a link out of the list's folder refused by name
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.mkdir()
    _png(outside / "o.png")
    (tmp_path / "l").mkdir()
    if link == "file":
        os.symlink(photo_folder / "class_0" / "img_0001.jpg", tmp_path / "l" / "in.jpg")
        os.symlink(outside / "o.png", tmp_path / "l" / "out.png")
    else:
        os.symlink(photo_folder / "class_0", tmp_path / "l" / "in")
        os.symlink(outside, tmp_path / "l" / "out")
    inner, outer = ("l/in.jpg", "l/out.png") if link == "file" else ("l/in/img_0001.jpg", "l/out/o.png")
    rows = "".join(f"photos/class_1/img_000{i % 3}.jpg,{i % 2}\n" for i in range(50))
    (tmp_path / "ok.csv").write_text(rows + f"{inner},0\n")
    realpaths = []
    real = os.path.realpath
    monkeypatch.setattr(os.path, "realpath", lambda *a, **k: realpaths.append(a[0]) or real(*a, **k))
    assert discover(tmp_path / "ok.csv").paths[-1] == "photos/class_0/img_0001.jpg"
    assert len(realpaths) <= 5, realpaths  # (a folder each, the link itself: not one a row)
    monkeypatch.undo()
    (tmp_path / "bad.csv").write_text(rows + f"{inner},0\n{outer},1\n")
    with pytest.raises(SourceError, match=rf"bad\.csv:52: '{re.escape(outer)}' is outside the list's folder"):
        discover(tmp_path / "bad.csv")


@pytest.mark.parametrize("row, needle", [
    ("../outside.jpg,1", "outside the list's folder"),
    ("/etc/passwd.jpg,1", "outside the list's folder"),
    ("only_one_column.jpg", "expected 'path,label'"),
    ("a.jpg,1,extra", "expected 'path,label'"),
    ("a.jpg,", "expected 'path,label'"),
])
def test_csv_bad_rows_name_the_line(tmp_path, row, needle):
    (tmp_path / "l.csv").write_text("ok.jpg,0\n" + row + "\n")
    with pytest.raises(SourceError, match=needle) as err:
        discover(tmp_path / "l.csv")
    assert "l.csv:2" in str(err.value)


def test_empty_and_missing_sources(tmp_path):
    with pytest.raises(SourceError, match="does not exist"):
        discover(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SourceError, match="no class sub-folders"):
        discover(tmp_path / "empty")
    (tmp_path / "empty" / "cls").mkdir()
    (tmp_path / "empty" / "cls" / "readme.md").write_text("x")
    with pytest.raises(SourceError, match="no image files"):
        discover(tmp_path / "empty")
    (tmp_path / "x.txt").write_text("x")
    with pytest.raises(SourceError, match="not a .csv"):
        discover(tmp_path / "x.txt")


# -- the same sources at a URL (NOTE [url source]; object storage itself: tests/test_url_sources.py) -----------
def test_a_csv_list_and_a_folder_at_a_file_url_are_the_local_sources(tmp_path, photo_folder):
    pytest.importorskip("fsspec")
    (tmp_path / "list.csv").write_text("path,label\n./photos/class_1/img_0000.jpg,dog\n"
                                       "photos//class_0/img_0001.jpg,cat\n")
    for local, base in ((tmp_path / "list.csv", tmp_path), (photo_folder, photo_folder)):
        src, url = discover(local), local.as_uri()
        got = discover(url)
        assert (got.kind, got.paths, got.labels, got.classes) == (src.kind, src.paths, src.labels, src.classes)
        assert got.where == url and src.where == str(local.resolve())  # the manifest names the URL as given
        assert got.blobs.chunk(1, 2).read(0) == (base / src.paths[1]).read_bytes()


@pytest.mark.parametrize("rel, ok", [("./a//b.png", "a/b.png"), ("a/../c.png", "c.png"), ("../x.png", None),
                                     ("/etc/x.png", None), ("s3://other/x.png", None), ("a/../../x.png", None),
                                     ("%2e%2e/x.png", None), ("a/%2E%2e/%2e./x.png", None), ("%2e%2e%2fx.png", None),
                                     ("%2fetc/x.png", None), ("100%25.png", "100%25.png")])
def test_paths_in_records_at_a_url_stay_inside_its_folder(rel, ok):
    if ok is not None:
        assert inside("s3://b/data", rel, "recs.jsonl:1", "the folder") == ok
    else:
        with pytest.raises(SourceError, match=r"recs.jsonl:1: .* is outside the folder s3://b/data"):
            inside("s3://b/data", rel, "recs.jsonl:1", "the folder")


def test_a_url_reader_seeks_and_reads_ranges_and_names_a_missing_object(tmp_path):
    pytest.importorskip("fsspec")
    data = bytes(range(256)) * 40
    (tmp_path / "blob").write_bytes(data)
    r = UrlReader((tmp_path / "blob").as_uri())
    assert r.size == len(data) and r.seek(-10, 2) == len(data) - 10 and r.read(100) == data[-10:]
    r.seek(5)
    assert r.read(7) == data[5:12] and r.tell() == 12 and r.read(0) == b""
    with open_text((tmp_path / "blob").as_uri()) as f:  # buffered: one ranged read per block
        assert f.buffer.raw.size == len(data)
    with pytest.raises(SourceError, match="does not exist"):
        UrlReader((tmp_path / "nope").as_uri())


def test_a_refused_read_is_one_source_error_line_without_secrets():
    url = "https://user:hunter2@store.example/data/recs.jsonl?X-Amz-Signature=hunter3"

    def denied():
        raise PermissionError(f"403 Forbidden: {url}")
    with pytest.raises(SourceError, match="access denied") as err:
        store_call(url, denied)
    assert "hunter" not in str(err.value) and "store.example" in str(err.value) and "\n" not in str(err.value)


# -- hostile inputs: each is a clear error, a skipped file or a counted bad record, never a hang or a crash ------
def test_a_superscript_label_is_a_class_name_not_an_id(tmp_path):
    # "²".isdigit() is True but int("²") refuses it: only ASCII digits make an id (NOTE [class ids] rule 3)
    assert class_ids(["1", "\u00b2", "1"]) == (["1", "\u00b2"], [0, 1, 0])
    _png(tmp_path / "a.png")
    (tmp_path / "list.csv").write_text("path,label\na.png,1\na.png,\u00b2\n", encoding="utf-8")
    with pytest.raises(SourceError, match="'1' .* is an id, '\u00b2' .* a name"):  # (NOTE [class ids] rule 5)
        discover(tmp_path / "list.csv")
    (tmp_path / "r.jsonl").write_text('{"image": "a.png", "label": "x"}\n{"image": "a.png", "label": "\u00b2"}\n',
                                      encoding="utf-8")
    assert _preprocess(tmp_path / "r.jsonl", tmp_path / "out") == 0
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["classes"] == ["x", "\u00b2"]


def test_class_ids_far_past_the_samples_are_refused_naming_the_id(tmp_path):
    # one stray id of 10^10 built a list of 10^10 class names; 3,000,000 a 53 MB manifest for 2 samples
    _png(tmp_path / "a.png")
    assert class_ids(["0", "65535"], 2)[0][-1] == "65535"  # under 65536: always accepted
    assert len(class_ids(["0", "99999"], 50_000)[0]) == 100_000  # under twice the samples
    (tmp_path / "list.csv").write_text("a.png,0\na.png,10000000000\n")
    with pytest.raises(SourceError, match=r"list.csv: class id 10000000000 is too large for 2 samples: .*below 65536.*"
                                          r"number the classes 0..K-1, or give them as names"):
        discover(tmp_path / "list.csv")
    (tmp_path / "r.jsonl").write_text('{"image": "a.png", "labels": [0]}\n{"image": "a.png", "labels": [1, 3000000]}\n')
    with pytest.raises(SourceError, match=r"r.jsonl, the labels of a.png \(record 2\): class id 3000000 is too large"):
        jsonl_records(tmp_path / "r.jsonl")


@pytest.mark.parametrize("line, needle", [
    ('{"image": "a.png", "label": ' + "1" * 5000 + "}", "a number of over 4300 digits"),
    ('{"image": "a.png", "n": ' + "[" * 200_000 + "]" * 200_000 + "}", "JSON nested deeper than a JSON parser"),
], ids=["5000-digits", "200000-deep"])
def test_hostile_json_in_records_is_an_error_naming_the_line(tmp_path, line, needle):
    (tmp_path / "r.jsonl").write_text('{"image": "a.png"}\n' + line + "\n")
    with pytest.raises(SourceError, match=f"r.jsonl:2: {needle}"):
        jsonl_records(tmp_path / "r.jsonl")


def test_a_number_past_a_float_in_records_names_its_record(tmp_path):
    _png(tmp_path / "a.png")
    _png(tmp_path / "b.png")
    (tmp_path / "r.jsonl").write_text('{"image": "a.png", "score": [1, 1]}\n{"image": "b.png", "score": [2, 1'
                                      + "0" * 400 + "]}\n")
    with pytest.raises(SourceError, match=r"r.jsonl: 'score' of record 2 \(b.png\) is \[2, 10+.*too large for a float"):
        jsonl_records(tmp_path / "r.jsonl")
    (tmp_path / "r.csv").write_text("image,score\na.png,1\nb.png,1" + "0" * 400 + "\n")  # a CSV cell: an int too
    assert _preprocess(tmp_path / "r.csv", tmp_path / "out") == 1


def test_boxes_and_captions_no_float_or_text_holds_are_bad_records(tmp_path, capsys):
    for i in range(3):
        _png(tmp_path / f"{i}.png", (40 * i, 0, 0))
    recs = [{"image": "0.png", "caption": "ok", "boxes": [[1, 1, 5, 5]], "box_labels": [0]},
            {"image": "1.png", "caption": "x\udc80y", "boxes": [[1, 1, 5, 5]], "box_labels": [0]},
            {"image": "2.png", "caption": "ok", "boxes": [[1, 1, 10 ** 400, 5]], "box_labels": [1]}]
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))  # "\udc80": a lone surrogate
    assert _preprocess(tmp_path / "r.jsonl", tmp_path / "out", "--tokenizer", "bytes") == 0
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["num_samples"] == 1 and [s["path"] for s in manifest["skipped"]] == ["1.png", "2.png"]
    assert "lone surrogate '\\udc80' at character 1" in manifest["skipped"][0]["reason"]
    assert "are not [[x1, y1, x2, y2], ...]" in manifest["skipped"][1]["reason"]
    capsys.readouterr()
    assert _preprocess(tmp_path / "r.jsonl", tmp_path / "fail", "--tokenizer", "bytes", "--on-error", "fail") == 1
    assert "1.png: the caption holds a lone surrogate" in capsys.readouterr().err


def _in_thread(fn, timeout: float):
    """``fn()``'s result, or a failure after ``timeout`` seconds (a FIFO read blocks: the test must not hang)."""
    out: list = []

    def run() -> None:
        try:
            out.append((True, fn()))
        except BaseException as exc:  # noqa: BLE001 - raised again in the test's thread
            out.append((False, exc))
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert out, f"still running after {timeout} s"
    ok, value = out[0]
    if not ok:
        raise value
    return value


def _socket_file(path) -> None:
    """A Unix socket bound at ``path``: a name like an image that no read can open."""
    import socket

    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.close()


def test_a_device_or_a_socket_named_like_an_image_is_skipped_with_a_warning(tmp_path, caplog):
    """A link to /dev/zero named y.jpg was read without end (MemoryError). (A FIFO is read as a stream a
    process writes, as before: the Ray tests hold tasks on FIFOs.)"""
    _png(tmp_path / "src" / "a" / "ok.png")
    _socket_file(tmp_path / "src" / "a" / "x.jpg")
    os.symlink("/dev/zero", tmp_path / "src" / "a" / "y.jpg")  # a read of it never ends
    os.symlink(tmp_path / "nowhere.png", tmp_path / "src" / "a" / "z.png")  # dangling: a bad record, as before
    with caplog.at_level(logging.WARNING, "fastdata.preprocess.sources"):
        src = _in_thread(lambda: discover(tmp_path / "src"), 30)
    assert src.paths == ["a/ok.png", "a/z.png"]
    assert "skipped 2 image name(s) that are not files" in caplog.text and "a/x.jpg, a/y.jpg" in caplog.text
    assert _in_thread(lambda: _preprocess(tmp_path / "src", tmp_path / "out"), 120) == 0
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["num_samples"] == 1 and [s["path"] for s in manifest["skipped"]] == ["a/z.png"]


def test_a_socket_or_a_folder_named_in_a_list_or_as_a_mask_is_a_bad_record(tmp_path):
    """A list (CSV, JSON Lines) names its files itself, so no folder walk screens them: what is not a file
    (a socket, a folder; a link to /dev/zero is outside the list's folder) is a bad record that says so."""
    _png(tmp_path / "src" / "ok.png")
    _png(tmp_path / "src" / "two.png", (10, 200, 10))
    _socket_file(tmp_path / "src" / "fifo.png")
    (tmp_path / "src" / "sub.png").mkdir()
    (tmp_path / "src" / "list.csv").write_text("ok.png,0\nfifo.png,1\nsub.png,1\ntwo.png,1\n")  # (a link to
    assert _in_thread(lambda: _preprocess(tmp_path / "src" / "list.csv", tmp_path / "out"), 120) == 0  # /dev/zero:
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())  # refused as outside the list's folder)
    assert m["num_samples"] == 2 and [e["path"] for e in m["skipped"]] == ["fifo.png", "sub.png"], m["skipped"]
    assert "not an image" in m["skipped"][1]["reason"], m["skipped"]  # (the socket: its open's own error)
    (tmp_path / "src" / "masks").mkdir()
    Image.new("L", (40, 30), 1).save(tmp_path / "src" / "masks" / "m0.png")
    (tmp_path / "src" / "masks" / "m1.png").mkdir()
    (tmp_path / "src" / "r.jsonl").write_text('{"image": "ok.png", "mask": "masks/m0.png"}\n'
                                              '{"image": "two.png", "mask": "masks/m1.png"}\n')
    assert _in_thread(lambda: _preprocess(tmp_path / "src" / "r.jsonl", tmp_path / "out2"), 120) == 0
    m = json.loads((tmp_path / "out2" / "manifest.json").read_text())
    assert m["num_samples"] == 1 and "not a file" in m["skipped"][0]["reason"], m["skipped"]


def test_symlink_loops_in_a_class_folder_are_walked_once(tmp_path, caplog):
    """A folder link back into a folder above it (a loop) is not entered again, as `find -L` does (one listed
    x.png 41 times, two never ended); folders linked twice without a loop are listed each time, as os.walk
    listed them (a tree that oversamples through links keeps its samples)."""
    cat = tmp_path / "src" / "cat"
    _png(cat / "x.png")
    _png(cat / "real" / "y.png")
    os.symlink(".", cat / "loop")
    os.symlink(".", cat / "loop2")
    os.symlink("..", cat / "real" / "up")
    os.symlink(cat / "real", cat / "twice")  # no loop: a second way to real/
    os.symlink(tmp_path / "src" / "dog", cat / "zdog")  # another class's folder: listed here too, as before
    _png(tmp_path / "src" / "dog" / "d.png")
    with caplog.at_level(logging.WARNING, "fastdata.preprocess.sources"):
        src = _in_thread(lambda: discover(tmp_path / "src"), 30)
    assert src.paths == ["cat/x.png", "cat/real/y.png", "cat/twice/y.png", "cat/zdog/d.png", "dog/d.png"]
    assert src.labels == [0, 0, 0, 0, 1]
    assert "skipped 4 folder link(s) that lead back into a folder above them" in caplog.text
    assert "cat/loop, cat/loop2, cat/real/up, cat/twice/up" in caplog.text


def test_a_percent_encoded_dot_dot_never_leaves_the_folder_at_an_http_url(tmp_path):
    import functools
    import http.server

    (tmp_path / "www" / "data").mkdir(parents=True)
    _png(tmp_path / "www" / "secret.png", (1, 2, 3))  # outside the records' folder
    _png(tmp_path / "www" / "data" / "a.png")
    (tmp_path / "www" / "data" / "r.jsonl").write_text('{"image": "a.png"}\n{"image": "%2e%2e/secret.png"}\n')
    asked: list[str] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            asked.append(self.path)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                             functools.partial(Handler, directory=str(tmp_path / "www")))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:  # the server decodes %2e%2e to .. and served /secret.png as a sample
        url = f"http://127.0.0.1:{server.server_address[1]}/data/r.jsonl"
        assert _preprocess(url, tmp_path / "out") == 1
    finally:
        server.shutdown()
    assert "/secret.png" not in asked and not (tmp_path / "out" / "manifest.json").exists()


def test_a_parquet_class_id_far_past_the_samples_is_refused_naming_the_file(tmp_path, capsys):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    def png(i: int) -> bytes:
        buf = io.BytesIO()
        Image.new("RGB", (40, 30), (40 * i, 0, 0)).save(buf, "PNG")
        return buf.getvalue()
    # a uint64 label of 2**63 + 5: each file's summary and then the merged schema built range(max id + 1)
    pq.write_table(pa.table({"image": pa.array([png(i) for i in range(3)], pa.binary()),
                             "label": pa.array([0, 1, 2 ** 63 + 5], pa.uint64())}), tmp_path / "a.parquet")
    assert _preprocess(tmp_path / "a.parquet", tmp_path / "out") == 1
    assert "a.parquet: class id 9223372036854775813 is too large for 3 samples" in capsys.readouterr().err


def test_a_listed_row_whose_file_appears_before_it_is_read_is_a_bad_record_not_a_sample_of_no_class(tmp_path):
    """A path,label row whose file is missing when the list is read names no class (its label is one past the
    last); should the file appear before a worker reads it, it was stored with that label, a class the
    dataset does not have (an index error at the model's loss)."""
    from fastdata.preprocess.image_tasks import Plan, work

    _png(tmp_path / "0.png")
    _png(tmp_path / "1.png", (10, 200, 10))
    (tmp_path / "list.csv").write_text("0.png,cat\nlate.png,ghost\n1.png,dog\n")
    source = discover(tmp_path / "list.csv")
    assert source.classes == ["cat", "dog"] and source.labels == [0, 2, 1]
    _png(tmp_path / "late.png", (10, 10, 200))  # (it appears)
    plan = Plan("npy", 8, 16, (), True, "center-crop", "lanczos", 90, "uint8", "bytes")
    ok, samples, failures = work(next(plan.tasks(source, 0, [(0, 3)])))
    assert ok == [0, 2] and len(samples) == 2
    assert failures == [(1, "it was no file when the source was listed, so it has no class: re-run `fastdata "
                            "preprocess` to list it")]
    unlabelled = Plan("npy", 8, 16, (), False, "center-crop", "lanczos", 90, "uint8", "bytes")
    every = work(next(unlabelled.tasks(source, 0, [(0, 3)])))[1]  # (no labels: the three rows)
    assert np.array_equal(samples, every[[0, 2]]) and not np.array_equal(every[1], every[2])
    jpeg = Plan("lmdb", 8, 16, (), True, "center-crop", "lanczos", 90, "uint8", "bytes")
    ok, blobs, failures = work(next(jpeg.tasks(source, 0, [(0, 3)])))
    assert ok == [0, 2] and len(blobs) == 2 and [f[0] for f in failures] == [1]
