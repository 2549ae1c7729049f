"""Finding the input images: ImageFolder order and labels, CSV lists, and their errors."""
from __future__ import annotations

import pytest
from conftest import AWKWARD_BAD, AWKWARD_GOOD

from fastdata.errors import SourceError
from fastdata.preprocess.sources import UrlReader, discover, inside, open_text, store_call


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
                                     ("/etc/x.png", None), ("s3://other/x.png", None), ("a/../../x.png", None)])
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
