"""Finding the input images: ImageFolder order and labels, CSV lists, and their errors."""
from __future__ import annotations

import pytest
from conftest import AWKWARD_BAD, AWKWARD_GOOD

from fastdata.errors import SourceError
from fastdata.preprocess.sources import discover


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
