"""Parquet files as a preprocess source, summarised file by file (NOTE [parquet source] in
fastdata/preprocess/parquet.py): real Parquet files written with pyarrow, JPEG/PNG bytes made with Pillow."""
from __future__ import annotations

import io
import json
import pickle
import re
import tracemalloc
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
from conftest import index_colour, recording_run, sample_ids
from PIL import Image

from fastdata.cli.main import main
from fastdata.datasets.images import FastDataset
from fastdata.errors import SourceError

pa = pytest.importorskip("pyarrow")  # the test extra installs it; the core never needs it
pq = pytest.importorskip("pyarrow.parquet")

NAMES = {b"huggingface": json.dumps({"info": {"features": {"label": {"_type": "ClassLabel",
                                                                   "names": ["cat", "dog", "eel"]}}}}).encode()}


def _image(i: int) -> bytes:
    """A flat picture of sample ``i``'s colour (conftest.index_colour), 40 x 30: JPEG for odd ``i``, else PNG."""
    buf = io.BytesIO()
    fmt = "JPEG" if i % 2 else "PNG"
    Image.new("RGB", (40, 30), index_colour(i)).save(buf, fmt, **({"quality": 95} if fmt == "JPEG" else {}))
    return buf.getvalue()


def _columns(i: int) -> dict[str, Any]:
    return {"label": i % 3, "score": i / 10, "emb": [float(i), 2.0 * i], "caption": f"caption {i}"}


def write_parts(root: Path, sizes: list[int], columns: Callable[[int], dict[str, Any]] = _columns,
                image: str = "image", group: int = 3, meta: dict | None = NAMES, empty: tuple[int, ...] = ()) -> Path:
    """Files ``part-NN.parquet`` of ``sizes`` rows (sample ``i`` numbered across the files), Hugging Face's
    layout: an Image struct column and one column per field, ``group`` rows a row group; the samples in
    ``empty`` have no image bytes (bad records)."""
    root.mkdir(parents=True)
    first = 0
    for p, n in enumerate(sizes):
        ids = range(first, first + n)
        rows = [columns(i) for i in ids]
        data: dict[str, Any] = {image: pa.array([{"bytes": b"" if i in empty else _image(i), "path": None} for i in ids],
                                                pa.struct([("bytes", pa.binary()), ("path", pa.string())]))}
        for key in (rows[0] if rows else columns(0)):
            data[key] = [r.get(key) for r in rows]
        table = pa.table(data)
        pq.write_table(table.replace_schema_metadata(meta) if meta else table, root / f"part-{p:02d}.parquet",
                       row_group_size=group)
        first += n
    return root


def preprocess(src, out: Path, *extra: str) -> int:
    return main(["preprocess", "images", str(src), str(out), "--size", "8", "--shard-size", "4", "--quiet", *extra])


def tree_bytes(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_files_summarised_apart_give_every_row_in_file_order_for_any_worker_count(tmp_path):
    src = write_parts(tmp_path / "src", [5, 0, 7])  # an empty file between: shards cross both bounds
    assert preprocess(src, tmp_path / "w1", "--workers", "1") == 0
    assert preprocess(src, tmp_path / "w2", "--workers", "2") == 0
    assert tree_bytes(tmp_path / "w1") == tree_bytes(tmp_path / "w2")
    m = json.loads((tmp_path / "w1" / "manifest.json").read_text())
    assert m["source"]["kind"] == "parquet" and m["num_samples"] == 12 and m["classes"] == ["cat", "dog", "eel"]
    assert [f["name"] for f in m["fields"]] == ["image", "label", "score", "emb", "caption"]
    b = FastDataset(tmp_path / "w1").get_batch(np.arange(12))
    assert sample_ids(b["image"]).tolist() == list(range(12))
    assert b["label"].tolist() == [i % 3 for i in range(12)]
    assert np.allclose(b["score"].numpy(), np.arange(12) / 10)
    assert b["emb"].tolist() == [[float(i), 2.0 * i] for i in range(12)]
    offsets = b["caption_offsets"].tolist()
    assert [bytes(b["caption"][lo:hi].numpy().astype(np.uint8)).decode() for lo, hi in zip(offsets, offsets[1:])] == [
        f"caption {i}" for i in range(12)]


def test_a_rerun_reads_the_summaries_and_a_piece_carries_only_its_files(tmp_path):
    from fastdata.preprocess.parquet import ParquetSource

    src = write_parts(tmp_path / "src", [5, 7])
    source = ParquetSource.at(src)
    area = source.area(tmp_path)
    ran: list[int] = []
    run = recording_run(ran)
    first = source.index(area, run)
    assert ran == [0, 1] and first.starts.tolist() == [0, 5, 12]
    again = source.index(area, run)  # a resumed run: every summary is there, no file is read again
    assert ran == [0, 1] and again.schema == first.schema and again.classes == ["cat", "dog", "eel"]
    piece = again.piece(3, 7)  # crosses from file 0 into file 1, and row groups of 3 in each
    assert piece.files == [str(src / "part-00.parquet"), str(src / "part-01.parquet")]
    loaded = pickle.loads(pickle.dumps(piece)).load()
    assert loaded.paths == ["part-00.parquet#3", "part-00.parquet#4", "part-01.parquet#0", "part-01.parquet#1"]
    assert loaded.labels == [i % 3 for i in range(3, 7)]
    assert loaded.extras["emb"] == [[float(i), 2.0 * i] for i in range(3, 7)]
    assert [loaded.blobs.read(k) for k in range(4)] == [_image(i) for i in range(3, 7)]
    # the piece's size depends on its own files, not on the source's
    assert len(pickle.dumps(again.piece(0, 2))) == len(pickle.dumps(again.piece(8, 10)))


def test_a_damaged_summary_is_made_again_and_a_changed_file_is_refused(tmp_path):
    from fastdata.preprocess.parquet import ParquetSource

    src = write_parts(tmp_path / "src", [5, 7])
    source = ParquetSource.at(src)
    area = source.area(tmp_path)
    indexed = source.index(area, lambda fn, tasks: map(fn, tasks))
    want = indexed.piece(0, 12).load()
    summary = tmp_path / area.name(1, "summary")
    summary.write_bytes(b"{")  # cut short
    again = source.index(area, lambda fn, tasks: [])  # no task: file 1 is summarised again where it is needed
    got = again.piece(0, 12).load()
    assert (got.paths, got.labels, got.extras) == (want.paths, want.labels, want.extras)
    assert json.loads(summary.read_bytes())["samples"] == 7
    blobs = again.piece(0, 5).load().blobs  # handed to a worker before the file changes
    # the same rows, another class in one: the row counts agree, the footer's statistics do not
    write_parts(tmp_path / "changed", [5], lambda i: {**_columns(i), "label": 3 if i == 2 else i % 3})
    (src / "part-00.parquet").write_bytes((tmp_path / "changed" / "part-00.parquet").read_bytes())
    with pytest.raises(SourceError, match="part-00.parquet changed since this run summarised it"):
        again.piece(0, 2).load()
    with pytest.raises(SourceError, match="part-00.parquet changed since this run summarised it"):
        blobs.read(0)


def _files(tmp_path: Path, first: Callable[[int], dict], second: Callable[[int], dict], **kw: Any) -> Path:
    src = write_parts(tmp_path / "a", [4], first, **kw)
    write_parts(tmp_path / "b", [4], second, **kw)
    (tmp_path / "b" / "part-00.parquet").rename(src / "part-01.parquet")
    return src


@pytest.mark.parametrize("second, message", [
    (lambda i: {"label": 1, "emb": [1.0, 2.0, 3.0]}, "part-01.parquet: 'emb' has lists of length 3 there and 2 in "
                                                      "part-00.parquet"),
    (lambda i: {"label": 1, "emb": "text"}, "part-01.parquet: 'emb' holds tokens there and vector in part-00.parquet"),
    (lambda i: {"label": 1}, "part-01.parquet: 'emb' is missing from its records"),
    (lambda i: {"label": 1, "emb": None if i == 2 else [1.0, 2.0]}, r"part-01.parquet: 'emb' is missing from some "
                                                                    r"records \(record 2\)"),
    (lambda i: {"emb": [1.0, 2.0]}, "part-01.parquet: its samples have no 'label' while other files' have"),
    (lambda i: {"label": "dog", "emb": [1.0, 2.0]}, "class labels mix ids and names across the files"),
])
def test_files_that_disagree_are_refused_with_the_file_named(tmp_path, capsys, second, message):
    src = _files(tmp_path, lambda i: {"label": i % 3, "emb": [1.0, 2.0]}, second, meta=None)
    assert preprocess(src, tmp_path / "out") == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert re.search(message, err), err


def test_a_disagreement_stops_the_run_at_its_file_not_after_the_last(tmp_path):
    from fastdata.preprocess.parquet import ParquetSource

    src = write_parts(tmp_path / "src", [2, 2, 2, 2, 2], lambda i: {"label": i % 3, "emb": [1.0] * (2 + (i >= 4))})
    source = ParquetSource.at(src)
    ran: list[int] = []
    run = recording_run(ran)
    with pytest.raises(SourceError, match="part-02.parquet: 'emb' has lists of length 3 there and 2 in part-00"):
        source.index(source.area(tmp_path), run)
    assert ran == [0, 1, 2]  # files 3 and 4 are never read


def test_a_segmentation_pair_beside_a_parquet_file_stays_a_pair_as_at_a_url(tmp_path):
    from fastdata.preprocess.discover import discover_source

    root = write_parts(tmp_path / "src", [2])
    for sub, colour in (("images", (200, 10, 10)), ("masks", None)):
        (root / sub).mkdir()
        Image.new("RGB" if colour else "L", (8, 8), colour or 1).save(root / sub / "a.png")
    assert discover_source(root).kind == "segmentation"


def test_a_hugging_face_segmentation_file_gives_the_masks_a_folder_pair_gives(tmp_path):
    # scene_parse_150's layout: an Image column, an Image column of class maps, a scene class
    from test_fields import make_scenes

    records = make_scenes(tmp_path / "pair", 7, sizes=((120, 90), (90, 130), (64, 64)), jpeg_big=False)
    cell = lambda p: {"bytes": (tmp_path / "pair" / p).read_bytes(), "path": None}  # noqa: E731
    annotation = [cell(r["mask"]) for r in records]
    annotation[4] = None  # a row without its map: a bad record, named
    (tmp_path / "hf").mkdir()
    pq.write_table(pa.table({"image": [cell(r["image"]) for r in records], "annotation": annotation,
                             "scene_category": [i % 2 for i in range(7)]}), tmp_path / "hf" / "train.parquet",
                   row_group_size=3)
    args = ("--resize", "center-crop", "--workers", "2")
    assert preprocess(tmp_path / "pair", tmp_path / "from-pair", *args) == 0
    assert preprocess(tmp_path / "hf", tmp_path / "from-parquet", *args) == 0
    m = json.loads((tmp_path / "from-parquet" / "manifest.json").read_text())
    assert [(f["name"], f["kind"]) for f in m["fields"]] == [("image", "image"), ("scene_category", "vector"),
                                                            ("annotation", "mask")]
    assert [s["path"] for s in m["skipped"]] == ["train.parquet#4"] and "no annotation" in m["skipped"][0]["reason"]
    got = FastDataset(tmp_path / "from-parquet").get_batch(np.arange(6))
    want = FastDataset(tmp_path / "from-pair").get_batch(np.array([0, 1, 2, 3, 5, 6]))
    assert np.array_equal(got["image"].numpy(), want["image"].numpy())
    assert np.array_equal(got["annotation"].numpy(), want["mask"].numpy())
    assert got["annotation"].numpy().max() > 0


def test_a_mask_column_named_as_a_class_field_is_refused_and_a_bad_mask_named(tmp_path, capsys):
    # segments/sidewalk-semantic keeps its maps in an Image column 'label': it would clash with the class label
    cells = [{"bytes": _image(i), "path": None} for i in range(4)]
    (tmp_path / "sw").mkdir()
    pq.write_table(pa.table({"pixel_values": cells, "label": cells}), tmp_path / "sw" / "train.parquet")
    assert preprocess(tmp_path / "sw", tmp_path / "out") == 1
    assert "the image column 'label' would be a mask field" in capsys.readouterr().err
    assert not (tmp_path / "out" / "manifest.json").exists()
    # a map that is not an image: a bad record whose reason is the same on every run (no buffer address)
    gray = io.BytesIO()
    Image.new("L", (40, 30), 1).save(gray, "PNG")
    maps = [{"bytes": gray.getvalue(), "path": None}] * 4
    maps[2] = {"bytes": b"not a png", "path": None}
    (tmp_path / "seg").mkdir()
    pq.write_table(pa.table({"image": cells, "annotation": maps}), tmp_path / "seg" / "train.parquet")
    reasons = []
    for out in ("a", "b"):
        assert preprocess(tmp_path / "seg", tmp_path / out) == 0
        reasons.append(json.loads((tmp_path / out / "manifest.json").read_text())["skipped"])
    assert reasons[0] == reasons[1] == [{"path": "train.parquet#2", "reason": "mask in column 'annotation': "
                                         "UnidentifiedImageError: not an image Pillow can read"}]


def test_another_image_column_is_refused_and_a_row_without_bytes_is_a_bad_record(tmp_path, capsys):
    src = write_parts(tmp_path / "a", [4], meta=None)
    write_parts(tmp_path / "b", [4], image="img", meta=None)
    (tmp_path / "b" / "part-00.parquet").rename(src / "part-01.parquet")
    assert preprocess(src, tmp_path / "out") == 1
    assert "part-01.parquet: image column: 'img', but part-00.parquet: 'image'" in capsys.readouterr().err
    one = tmp_path / "one"
    one.mkdir()
    table = pa.table({"image": [_image(0), b"", _image(2)], "label": [0, 1, 2]})  # binary column, row 1 empty
    pq.write_table(table, one / "x.parquet")
    assert preprocess(one / "x.parquet", tmp_path / "skip", "--on-error", "skip") == 0
    m = json.loads((tmp_path / "skip" / "manifest.json").read_text())
    assert m["num_samples"] == 2 and [s["path"] for s in m["skipped"]] == ["x.parquet#1"]
    assert preprocess(one / "x.parquet", tmp_path / "fail", "--on-error", "fail") == 1
    assert "x.parquet#1" in capsys.readouterr().err


def test_a_class_label_naming_100000_classes_keeps_its_names_past_the_id_bound(tmp_path):
    """A landmarks-like split: a ClassLabel of 100,000 names, six rows labelled up to 99,999. The class-id
    bound (NOTE [class ids]) refused it, though every id is named."""
    names = [f"landmark_{i}" for i in range(100_000)]
    meta = {b"huggingface": json.dumps({"info": {"features": {"label": {"_type": "ClassLabel",
                                                                         "names": names}}}}).encode()}
    labels = [5, 70000, 99999, 12, 3, 80000]
    src = write_parts(tmp_path / "src", [6], columns=lambda i: {"label": labels[i]}, meta=meta)
    assert preprocess(src, tmp_path / "out", "--workers", "1") == 0
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert m["classes"] == names
    from fastdata.datasets.images import FastDataset

    assert FastDataset(tmp_path / "out").get_batch(np.arange(6))[1].tolist() == labels


def test_max_side_and_shuffle_are_refused_before_any_file_is_read(tmp_path, capsys):
    src = write_parts(tmp_path / "src", [4])
    assert preprocess(src, tmp_path / "out", "--shuffle", "1") == 1
    assert "shuffle the rows when writing" in capsys.readouterr().err and not (tmp_path / "out").exists()
    assert preprocess(src, tmp_path / "out", "--format", "lmdb", "--resize", "max-side") == 1
    err = capsys.readouterr().err
    assert "has fields (the columns score, emb, caption)" in err and not (tmp_path / "out").exists()
    # a label, and a column null in every row, are not fields: max-side is served
    plain = write_parts(tmp_path / "plain", [4], lambda i: {"label": i % 2, "note": None}, meta=None)
    assert preprocess(plain, tmp_path / "max-side", "--format", "lmdb", "--resize", "max-side") == 0
    assert preprocess(tmp_path / "missing.parquet", tmp_path / "none") == 1
    assert "missing.parquet does not exist" in capsys.readouterr().err


def test_a_token_in_a_parquet_urls_query_names_no_row(tmp_path):
    # an Azure SAS / CDN token in the query, the same for every file: each row's name (a skipped row in the
    # manifest, a row's message) held it whole
    from test_wds_source import served

    from fastdata.preprocess.parquet import ParquetSource

    write_parts(tmp_path / "good", [5], empty=(2,))
    write_parts(tmp_path / "bad", [2], lambda i: {**_columns(i), "label": [i, 1]})
    for area in ("a", "b"):
        (tmp_path / area).mkdir()
    with served(tmp_path) as base:
        urls = {k: f"{base}/{k}/part-00.parquet?sv=2022-11-02&sig=TOPSECRET%3D" for k in ("good", "bad")}
        good, bad = (ParquetSource.of(f"{base}/{k}", [urls[k]]) for k in ("good", "bad"))
        indexed = good.index(good.area(tmp_path / "a"), lambda fn, tasks: map(fn, tasks))
        assert indexed.piece(0, 5).load().paths == [f"part-00.parquet#{r}" for r in range(5)]
        with pytest.raises(SourceError) as err:
            bad.index(bad.area(tmp_path / "b"), lambda fn, tasks: map(fn, tasks))
    assert str(err.value).startswith("part-00.parquet#0: 'label' holds [0, 1]: ") and "TOPSECRET" not in str(err.value)


def test_the_driver_holds_a_count_per_file_at_a_billion_rows(tmp_path):
    # 10^9 rows in 10^5 files of 10^4 (a LAION-sized dataset in Hugging Face's layout), by simulation: the
    # driver merges one summary per file, and a shard's task carries its own files only
    from fastdata.preprocess.parquet import ParquetSource

    files, per = 100_000, 10_000
    source = ParquetSource("s3://bucket/laion", Path("."), [f"s3://bucket/laion/{t:06d}.parquet" for t in range(files)],
                           [(per * 45_000, f'"{t:032x}"') for t in range(files)])
    summary = {"samples": per, "good": per, "seen": ["caption", "height"], "numeric": ["caption", "height"],
               "problems": {}, "kinds": [["caption", "tokens"], ["height", "vector"]], "has_label": False,
               "vectors": {"height": -1}, "classes": {}, "common": {"image column": "jpg"}, "class_names": None,
               "identity": "0" * 64}
    tracemalloc.start()
    indexed = source.merge((summary for _ in range(files)), source.area(tmp_path))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert indexed.num_samples == 10 ** 9 and indexed.kinds == {"caption": "tokens", "height": "vector"}
    assert peak < 16e6, peak  # counts per file: ~3 MB here; a row per sample would be 10^11 bytes
    middle = indexed.piece(500_000_000 - 512, 500_000_000 + 512)  # crosses from file 49,999 into 50,000
    assert [f.rsplit("/", 1)[1] for f in middle.files] == ["049999.parquet", "050000.parquet"]
    sizes = [len(pickle.dumps(indexed.piece(a, a + 1024))) for a in (0, 10 ** 9 // 2, 10 ** 9 - 1024)]
    assert len(pickle.dumps(middle)) < 1_000 and max(sizes) - min(sizes) < 32, sizes  # the positions' digits


def test_a_run_killed_mid_way_resumes_from_its_summaries_to_the_same_bytes(tmp_path, monkeypatch):
    import sys

    from conftest import kill_when_journaled

    from fastdata.preprocess import parquet

    src = write_parts(tmp_path / "src", [100, 100, 100], group=7)  # 150 shards: killed after 3 on a busy machine too
    assert preprocess(src, tmp_path / "whole", "--workers", "2", "--shard-size", "2") == 0
    out = tmp_path / "killed"
    kill_when_journaled([sys.executable, "-m", "fastdata", "preprocess", "images", str(src), str(out), "--size", "8",
                         "--shard-size", "2", "--quiet", "--workers", "1"], out, 3)
    summarised: list[int] = []
    real = parquet.summary_task
    monkeypatch.setattr(parquet.ParquetSource, "summarize", staticmethod(
        lambda task, slot=None: summarised.append(task[0]) or real(task, slot)))
    (out / ".fastdata-partial" / "parquet-index" / "00000001.summary.json").unlink()  # as if killed before it
    assert preprocess(src, out, "--workers", "1", "--shard-size", "2") == 0
    assert summarised == [1]  # the others were written before the kill: no file is read for its summary again
    assert tree_bytes(out) == tree_bytes(tmp_path / "whole")


def test_hidden_files_in_a_parquet_folder_are_not_its_files(tmp_path):
    # macOS's ._NAME beside each copied file: "._a.parquet is not a readable Parquet file"
    src = write_parts(tmp_path / "src", [3], meta=None)
    (src / "._part-00.parquet").write_bytes(b"\x00\x05\x16\x07 AppleDouble" + bytes(100))
    (src / "nested.parquet").mkdir()  # (a Spark output folder is no file of this one)
    assert preprocess(src, tmp_path / "out") == 0
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["num_samples"] == 3


def test_a_spark_table_folder_inside_a_source_is_named_and_an_image_folder_stays_one(tmp_path, capsys):
    # a folder holding `x.parquet/` was taken for a Parquet folder: an image tree with such a subfolder
    # failed with "holds no .parquet files", and so did a folder holding a Spark table, without naming it
    src = tmp_path / "src"
    write_parts(src / "table.parquet", [3], meta=None)  # (Spark: part files in a folder named x.parquet)
    assert preprocess(src, tmp_path / "out") == 1
    err = capsys.readouterr().err
    assert f"{src / 'table.parquet'} is a Parquet table folder (as Spark writes one): pass it as the source" in err
    assert preprocess(src / "table.parquet", tmp_path / "out") == 0
    images = tmp_path / "images"
    for c in ("cat", "dog"):
        (images / c).mkdir(parents=True)
        (images / c / "0.png").write_bytes(_image(0))
    (images / "stray.parquet").mkdir()
    assert preprocess(images, tmp_path / "out2") == 0
    assert json.loads((tmp_path / "out2" / "manifest.json").read_text())["num_samples"] == 2


@pytest.mark.parametrize("label, message", [
    (lambda i: [i, 1], r"part-00\.parquet#0: 'label' holds \[0, 1\]: a sample's class is one id or name; give "
                       r"several classes as 'labels'"),
    (float, r"0\.0 \(float\) is the label of part-00\.parquet#0 \(record 1\): class labels are integer ids >= 0 "
            r"or names"),
], ids=["list", "float"])
def test_a_label_that_is_no_id_or_name_is_one_line_naming_its_record(tmp_path, capsys, label, message):
    # a list crashed the run with a numpy traceback; a float (pandas makes an int column with a gap one) was
    # said to be "a name" beside itself
    src = write_parts(tmp_path / "src", [3], lambda i: {"label": label(i)}, meta=None)
    assert preprocess(src, tmp_path / "out") == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and re.search(message, err), err


def test_a_parquet_file_beside_class_folders_of_images_is_refused_naming_both(tmp_path, capsys):
    # the Parquet file won and the labelled images beside it were dropped without a word (as tars beside them
    # are refused: tests/test_wds_source.py)
    src = write_parts(tmp_path / "src", [3], meta=None)
    for c in ("cat", "dog"):
        (src / c / "deeper").mkdir(parents=True)
        (src / c / "deeper" / "0.png").write_bytes(_image(0))
    assert preprocess(src, tmp_path / "out") == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"source {src} holds .parquet files (part-00.parquet) and class folders of " \
        "images (cat/): pass the Parquet files alone (a .parquet file, or a folder holding only them), or move the " \
        ".parquet files out of the image folder" in err, err
    assert preprocess(src / "part-00.parquet", tmp_path / "file") == 0  # the file alone, as it says
    (src / "part-00.parquet").rename(tmp_path / "part-00.parquet")
    assert preprocess(src, tmp_path / "images") == 0  # the image folder alone
    assert json.loads((tmp_path / "images" / "manifest.json").read_text())["classes"] == ["cat", "dog"]
    # a string column 'mask' names files beside the file: a folder of them is its masks, not an image folder
    masked = write_parts(tmp_path / "masked", [2], lambda i: {"mask": f"masks/{i}.png"}, meta=None)
    (masked / "masks").mkdir()
    for i in range(2):
        Image.new("L", (40, 30), i + 1).save(masked / "masks" / f"{i}.png")
    assert preprocess(masked, tmp_path / "masks") == 0
    manifest = json.loads((tmp_path / "masks" / "manifest.json").read_text())
    assert manifest["source"]["kind"] == "parquet" and "mask" in {f["name"] for f in manifest["fields"]}


def test_a_row_refused_for_a_nan_keeps_its_class_listed_and_a_list_of_texts_is_one_line(tmp_path, capsys):
    # a row with a NaN float is a bad record; its class stays listed, as files are summarised before their
    # columns are merged (NOTE [refused records] rule 4 in fastdata/preprocess/fields.py): never a wrong id
    src = write_parts(tmp_path / "src", [4], lambda i: {"label": ["cat", "ghost", "dog", "cat"][i],
                                                        "score": float("nan") if i == 1 else i / 2}, meta=None)
    assert preprocess(src, tmp_path / "out") == 0
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["classes"] == ["cat", "dog", "ghost"]
    assert [s["path"] for s in manifest["skipped"]] == ["part-00.parquet#1"]
    assert FastDataset(tmp_path / "out").get_batch(np.arange(3))["label"].tolist() == [0, 1, 0]
    # COCO-style captions, a list of texts a row: one line saying a text field holds one text
    captions = write_parts(tmp_path / "captions", [2], lambda i: {"caption": ["a cat", "a cat on a mat"]}, meta=None)
    capsys.readouterr()
    assert preprocess(captions, tmp_path / "none") == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "part-00.parquet#0: 'caption' holds 2 texts ['a cat', 'a cat on a mat']: a text " \
        "field holds one text (a caption): keep one as 'caption' and store the others under keys of their own" in err
