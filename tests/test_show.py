"""``fastdata show``: the PNG grid's pixels hold the samples, their boxes, masks and class names."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import fresh_fs as _fresh_fs
from PIL import Image

from fastdata.cli import show
from fastdata.cli.main import main
from fastdata.datasets.images import FastDataset

GREY = (128, 128, 128)
BOX = (10, 12, 40, 50)  # xyxy pixels of each 64 x 64 image


def _detection(tmp_path: Path) -> Path:
    """Four flat grey 64 x 64 images, each with one box (class "dog") and a class label ("cat"/"eel")."""
    src = tmp_path / "src"
    src.mkdir()
    lines = []
    for i in range(4):
        Image.new("RGB", (64, 64), GREY).save(src / f"{i}.png")
        lines.append(json.dumps({"image": f"{i}.png", "label": ["cat", "eel"][i % 2], "boxes": [list(BOX)],
                                 "box_labels": ["dog"], "caption": f"picture {i}"}))
    (src / "records.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "ds"
    assert main(["preprocess", "images", str(src / "records.jsonl"), str(out), "--size", "64", "--quiet"]) == 0
    return out


def test_a_grid_draws_each_box_in_its_colour_inside_the_box_and_prints_the_class_names(tmp_path):
    data = _detection(tmp_path)
    png = tmp_path / "grid.png"
    assert main(["show", str(data), "-n", "4", "-o", str(png)]) == 0
    grid = np.asarray(Image.open(png).convert("RGB"))
    expected, cells = show.render(FastDataset(data), 4)
    assert np.array_equal(grid, np.asarray(expected))  # the file is the grid
    scale = cells[0].scale
    cell = 64 * scale
    assert scale >= 2 and grid.shape == (2 * (cell + show.LINE * show.TEXT_LINES + 4), 2 * cell + 4, 3)
    x1, y1, x2, y2 = (v * scale for v in BOX)
    for c in cells:
        tile = grid[c.y:c.y + cell, c.x:c.x + cell]
        mid = (y1 + y2) // 2
        assert tuple(tile[mid, x1]) == show.BOX_COLOURS[0]  # the box's left edge, in the first box colour
        assert tuple(tile[mid, x2 - 1]) == show.BOX_COLOURS[0]  # and its right edge
        assert tuple(tile[mid, (x1 + x2) // 2]) == GREY  # its inside is the picture
        assert tuple(tile[cell - 2, cell - 2]) == GREY  # outside it too
        box_colour = np.all(tile == show.BOX_COLOURS[0], axis=-1)
        ys, xs = np.nonzero(box_colour)
        assert xs.min() >= x1 and xs.max() < x2 and ys.min() >= y1 and ys.max() < y2  # nothing outside the box
    strips = [grid[c.y + cell:c.y + cell + show.LINE * show.TEXT_LINES, c.x:c.x + cell] for c in cells]
    assert all(np.any(np.all(s > 200, axis=-1)) for s in strips)  # light text was printed under each image
    assert not np.array_equal(strips[0], strips[1])  # "cat" and "eel" (and the index) differ


def test_masks_are_overlaid_in_their_id_colour(tmp_path):
    root = tmp_path / "seg"
    (root / "images").mkdir(parents=True)
    (root / "masks").mkdir()
    Image.new("RGB", (32, 32), (0, 0, 0)).save(root / "images" / "a.png")
    mask = np.zeros((32, 32), np.uint8)
    mask[:, 16:] = 2
    Image.fromarray(mask).save(root / "masks" / "a.png")
    assert main(["preprocess", "images", str(root), str(tmp_path / "ds"), "--size", "32", "--quiet"]) == 0
    grid, (c,) = show.render(FastDataset(tmp_path / "ds"), 1)
    px = np.asarray(grid)
    left, right = px[c.y + 10, c.x + 10], px[c.y + 10, c.x + 24 * c.scale]
    assert tuple(left) == (0, 0, 0)  # id 0: the picture as it is
    blended = np.rint(np.asarray(show.MASK_COLOURS[2]) * show.MASK_ALPHA).astype(int)  # over black
    assert np.abs(right.astype(int) - blended).max() <= 1


def test_bad_arguments_are_one_line_errors(tmp_path, capsys):
    data = _detection(tmp_path)
    assert main(["show", str(data), "-n", "0", "-o", str(tmp_path / "g.png")]) == 1
    assert main(["show", str(data), "-o", str(tmp_path / "g.jpg")]) == 1
    assert main(["show", str(tmp_path / "nothing"), "-o", str(tmp_path / "g.png")]) == 1
    assert main(["show", str(data), "-o", str(tmp_path / "no-such-folder" / "g.png")]) == 1  # (a traceback)
    with pytest.raises(SystemExit) as caught:  # (an unset variable: the current folder)
        main(["show", "", "-o", str(tmp_path / "g.png")])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert err.count("fastdata: error:") == 4 and "Traceback" not in err and not (tmp_path / "g.png").exists()
    assert "no-such-folder does not exist: make it" in err and "argument data: an empty path" in err


def test_the_count_printed_is_the_samples_drawn_not_n(tmp_path, capsys):
    data, png = _detection(tmp_path), tmp_path / "g.png"  # 4 samples
    capsys.readouterr()
    assert main(["show", str(data), "-n", "1000", "-o", str(png)]) == 0
    assert capsys.readouterr().out == f"{data}: 4 samples drawn in {png}\n"  # (said 1000)
    assert show.show(data, 3, png) == (png, 3)


def test_a_url_with_a_password_is_shown_without_it(tmp_path, capsys):
    """The success line printed the URL as given, its password included."""
    import functools
    import http.server
    import threading

    from test_wds_source import _RangeHandler

    data = _detection(tmp_path)
    handler = functools.partial(_RangeHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://alice:S3CRETPW@127.0.0.1:{server.server_address[1]}/{data.name}"
        assert main(["show", url, "-n", "4", "-o", str(tmp_path / "g.png"), "--cache-dir", str(tmp_path / "c")]) == 0
    finally:
        server.shutdown()
    said = capsys.readouterr()
    assert "S3CRETPW" not in said.out + said.err and "alice:***@" in said.out, said


@pytest.mark.remote
def test_a_dataset_at_a_url_draws_the_same_grid(s3, tmp_path):
    from fastdata.storage.push import push
    _fresh_fs()  # no s3fs instance cached by another module's tests, bound to their server's endpoint

    data = _detection(tmp_path)
    url = s3("show") + "/sets/det"
    push(data, url, workers=2)
    local, remote = tmp_path / "local.png", tmp_path / "remote.png"
    assert main(["show", str(data), "-n", "4", "-o", str(local)]) == 0
    assert main(["show", url, "-n", "4", "-o", str(remote), "--cache-dir", str(tmp_path / "cache")]) == 0
    assert np.array_equal(np.asarray(Image.open(local)), np.asarray(Image.open(remote)))

