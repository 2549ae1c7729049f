"""Samples with fields (issue 20): masks, boxes, ids, vectors and captions from every source, stored,
served and moved with the image by every geometric transform."""
from __future__ import annotations

import csv
import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fastdata import (CenterCrop, Compose, CUDAPrefetcher, FastDataset, FastLoader, RandomCrop, RandomHorizontalFlip,
                      RandomResizedCrop)
from fastdata.errors import FormatError, ImageDecodeError, SourceError
from fastdata.formats.manifest import MANIFEST_NAME, load_manifest
from fastdata.preprocess.images import ImagePreprocessConfig, preprocess_images

BLUE, RED, GREEN = (0, 0, 255), (255, 0, 0), (0, 255, 0)


def scene(rng: np.random.Generator, w: int, h: int) -> tuple[np.ndarray, np.ndarray, list, list]:
    """A blue picture with a red and a green rectangle; its mask (1 red, 2 green), boxes and classes."""
    img = np.empty((h, w, 3), np.uint8)
    img[...] = BLUE
    mask = np.zeros((h, w), np.uint8)
    boxes, classes = [], []
    for cls, colour in ((0, RED), (1, GREEN)):
        bw, bh = int(rng.integers(w // 5, w // 2)), int(rng.integers(h // 5, h // 2))
        x0, y0 = int(rng.integers(0, w - bw)), int(rng.integers(0, h - bh))
        img[y0:y0 + bh, x0:x0 + bw] = colour
        mask[y0:y0 + bh, x0:x0 + bw] = cls + 1
        boxes.append([x0, y0, x0 + bw, y0 + bh])
        classes.append(cls)
    mask[img[..., 2] == 255] = 0  # the later rectangle covers the earlier: the mask says what is seen
    for cls, colour in ((0, RED), (1, GREEN)):
        mask[(img == colour).all(-1)] = cls + 1
    return img, mask, boxes, classes


def colour_class(img: np.ndarray) -> np.ndarray:
    """1 where a pixel is mostly red, 2 mostly green, 0 mostly blue (HWC, any scale)."""
    return np.argmax(np.stack([img[..., 2], img[..., 0], img[..., 1]], -1), -1)


def make_scenes(root: Path, n: int, sizes=((120, 90), (90, 130), (64, 64), (200, 150)), jpeg_big: bool = True):
    """``root/images`` + ``root/masks`` and the records (JSON-able) describing them."""
    rng = np.random.default_rng(7)
    (root / "images").mkdir(parents=True)
    (root / "masks").mkdir()
    records = []
    for i in range(n):
        w, h = sizes[i % len(sizes)]
        big = jpeg_big and i == n - 1  # a large JPEG: decoded at 1/8 scale (DCT scaling) before the resize
        if big:
            w, h = 1000, 760
        img, mask, boxes, classes = scene(rng, w, h)
        name = f"{i:03d}.jpg" if big else f"{i:03d}.png"
        Image.fromarray(img).save(root / "images" / name, quality=95) if big else Image.fromarray(img).save(
            root / "images" / name)
        Image.fromarray(mask).save(root / "masks" / f"{i:03d}.png")
        records.append({"image": f"images/{name}", "mask": f"masks/{i:03d}.png", "boxes": boxes,
                        "box_labels": ["red", "green"], "label": ["red", "green"][i % 2],
                        "labels": ["red", "green", "red"][:i % 4],
                        "score": [float(i), 0.5 * i], "caption": f"scene {i}" * (i % 3)})
    return records


def preprocess(src, out, **kw):
    kw.setdefault("progress", False)
    kw.setdefault("workers", 1)
    return preprocess_images(ImagePreprocessConfig(src, out, **kw))


# -- sources and round trips ------------------------------------------------------------------------------
def test_an_exact_size_segmentation_pair_round_trips_bit_exactly_and_16_bit_masks_flip(tmp_path):
    rng = np.random.default_rng(0)
    (tmp_path / "src" / "images").mkdir(parents=True)
    (tmp_path / "src" / "masks").mkdir()
    want = []
    for i in range(7):
        img, mask, _, _ = scene(rng, 48, 48)
        mask = mask.astype(np.int64) * 1000  # 16-bit ids
        Image.fromarray(img).save(tmp_path / "src" / "images" / f"s{i}.png")
        Image.fromarray(mask.astype(np.uint16)).save(tmp_path / "src" / "masks" / f"s{i}.png")
        want.append((img, mask))
    m = preprocess(tmp_path / "src", tmp_path / "out", size=48, shard_size=3, mask_dtype="uint16", workers=2)
    assert m["format_version"] == 2 and [f["name"] for f in m["fields"]] == ["image", "mask"]
    ds = FastDataset(tmp_path / "out", storage="ram")
    assert not ds.has_labels
    b = ds.get_batch(range(7))
    assert set(b) == {"image", "mask"} and b["mask"].dtype == torch.uint16
    for i, (img, mask) in enumerate(want):
        assert np.array_equal(b["image"][i].numpy(), img)
        assert np.array_equal(b["mask"][i].numpy().astype(np.int64), mask)
    with pytest.raises(Exception, match="no 'label' field"):
        ds.targets
    # the flip mirrors 16-bit masks too (torch's CPU flip has no uint16 kernel: it raised)
    b = ds.get_batch(range(7))
    flipped = RandomHorizontalFlip(p=1.0)({**b, "image": b["image"].permute(0, 3, 1, 2)})  # (NCHW, as on a device)
    assert flipped["mask"].dtype == torch.uint16
    for i, (img, mask) in enumerate(want):
        assert np.array_equal(flipped["mask"][i].numpy().astype(np.int64), mask[:, ::-1])


@pytest.mark.parametrize("shuffle", [None, 3])
def test_jsonl_records_round_trip_every_field(tmp_path, shuffle):
    records = make_scenes(tmp_path, 6, sizes=((64, 64),), jpeg_big=False)
    with open(tmp_path / "recs.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    m = preprocess(tmp_path / "recs.jsonl", tmp_path / "out", size=64, shard_size=4, shuffle_seed=shuffle)
    if shuffle is not None:  # every field travels with its image: sample i is record perm[i]
        records = [records[j] for j in np.random.default_rng(shuffle).permutation(6)]
    assert m["classes"] == ["green", "red"]  # class names sorted: green 0, red 1
    ids = {"green": 0, "red": 1}
    # every class id counts, of label, labels and box_labels (those of the last two were counted as 0)
    every = [n for r in records for n in [r["label"], *r["labels"], *r["box_labels"]]]
    assert m["class_counts"] == [every.count("green"), every.count("red")]
    ds = FastDataset(tmp_path / "out")
    b = ds.get_batch(np.arange(6))
    off = b["boxes_offsets"].numpy()
    for i, r in enumerate(records):
        assert b["boxes"][off[i]:off[i + 1]].tolist() == r["boxes"]  # identity geometry: exact
        assert b["box_labels"][off[i]:off[i + 1]].tolist() == [1, 0]  # red -> 1, green -> 0
        lo, hi = b["labels_offsets"][i:i + 2].tolist()
        assert b["labels"][lo:hi].tolist() == [ids[n] for n in r["labels"]]
        lo, hi = b["caption_offsets"][i:i + 2].tolist()
        assert bytes(b["caption"][lo:hi].numpy().astype(np.uint8)) == r["caption"].encode()
        assert b["score"][i].tolist() == r["score"]
        assert int(b["label"][i]) == ids[r["label"]]
        img = np.asarray(Image.open(tmp_path / r["image"]))
        assert np.array_equal(b["image"][i].numpy(), img)
        assert np.array_equal(b["mask"][i].numpy(), np.asarray(Image.open(tmp_path / r["mask"])))


def test_csv_records_and_a_path_label_csv_are_told_apart(tmp_path):
    records = make_scenes(tmp_path, 4, sizes=((64, 64),), jpeg_big=False)
    with open(tmp_path / "recs.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["image", "mask", "label", "labels", "weight"])
        for i, r in enumerate(records):
            w.writerow([r["image"], r["mask"], f"c{i % 2}", " ".join(f"c{j}" for j in range(i)), 0.25 * i])
    m = preprocess(tmp_path / "recs.csv", tmp_path / "out", size=64)
    kinds = {f["name"]: f["kind"] for f in m["fields"]}
    assert kinds == {"image": "image", "label": "label", "mask": "mask", "labels": "labels", "weight": "vector"}
    b = FastDataset(tmp_path / "out").get_batch([0, 1, 2, 3])
    assert b["label"].tolist() == [0, 1, 0, 1] and b["weight"].tolist() == [0.0, 0.25, 0.5, 0.75]
    assert b["labels_offsets"].tolist() == [0, 0, 1, 3, 6]
    assert b["labels"].tolist() == [0, 0, 1, 0, 1, 2]
    with open(tmp_path / "plain.csv", "w") as f:  # path,label: today's (image, class) dataset, version 1
        f.write("".join(f"{r['image']},c{i % 2}\n" for i, r in enumerate(records)))
    m = preprocess(tmp_path / "plain.csv", tmp_path / "plain", size=32)
    assert m["format_version"] == 1 and "fields" not in m
    x, y = FastDataset(tmp_path / "plain")[0:2]
    assert x.shape == (2, 32, 32, 3) and y.tolist() == [0, 1]


def test_a_csv_gives_boxes_and_types_each_column_as_a_whole(tmp_path):
    """CSV boxes never parsed (every record refused); one caption spelling a number ("1984") made the whole
    file fail (that record's caption a vector); an id label beside id labels was refused as ids mixed with
    names."""
    records = make_scenes(tmp_path, 4, sizes=((64, 64),), jpeg_big=False)
    with open(tmp_path / "recs.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["image", "boxes", "box_labels", "caption", "label", "labels"])
        for i, r in enumerate(records):
            w.writerow([r["image"], json.dumps(r["boxes"]), json.dumps([2, 1]), ["a dog", "1984"][i % 2],
                        i % 3, " ".join(str(j) for j in range(i))])
    m = preprocess(tmp_path / "recs.csv", tmp_path / "out", size=64, tokenizer="bytes")
    kinds = {f["name"]: f["kind"] for f in m["fields"]}
    assert kinds == {"image": "image", "boxes": "boxes", "box_labels": "box_labels", "caption": "tokens",
                     "label": "label", "labels": "labels"}, kinds
    assert not m["skipped"] and m["classes"] == ["0", "1", "2"]  # (ids keep their ids)
    b = FastDataset(tmp_path / "out").get_batch([0, 1, 2, 3])
    assert b["boxes"].tolist() == [[float(v) for v in box] for r in records for box in r["boxes"]]
    assert b["label"].tolist() == [0, 1, 2, 0] and b["labels"].tolist() == [0, 0, 1, 0, 1, 2]
    assert b["box_labels"].tolist() == [2, 1] * 4
    assert bytes(b["caption"][b["caption_offsets"][1]:b["caption_offsets"][2]].tolist()) == b"1984"
    with open(tmp_path / "tags.csv", "w", newline="") as f:  # a numeric tag among words: names, as in JSONL
        w = csv.writer(f)
        w.writerow(["image", "labels"])
        for i, r in enumerate(records):
            w.writerow([r["image"], ["cat 3", "dog"][i % 2]])
    m = preprocess(tmp_path / "tags.csv", tmp_path / "tags", size=64)
    assert m["classes"] == ["3", "cat", "dog"] and not m["skipped"]


def coco_json(records, path: Path, extra_ann=()):
    images = [{"id": 10 + i, "file_name": r["image"], "width": 0, "height": 0} for i, r in enumerate(records)]
    anns = [{"id": k, "image_id": 10 + i, "bbox": [b[0], b[1], b[2] - b[0], b[3] - b[1]], "category_id": 7 if c else 3,
             "iscrowd": 0} for k, (i, r) in enumerate((i, r) for i, r in enumerate(records) for _ in (0,))
            for b, c in zip(r["boxes"], [0, 1])]
    anns = [dict(a, id=n) for n, a in enumerate(anns)] + list(extra_ann)
    path.write_text(json.dumps({"images": images, "annotations": anns,
                                "categories": [{"id": 7, "name": "green"}, {"id": 3, "name": "red"}]}))


def test_coco_detection_boxes_follow_the_resize(tmp_path):
    records = make_scenes(tmp_path, 5)
    coco_json(records, tmp_path / "instances.json", extra_ann=[
        {"id": 99, "image_id": 10, "bbox": [1, 1, 5, 5], "category_id": 3, "iscrowd": 1}])  # crowd: left out
    for mode in ("center-crop", "squash", "pad"):
        m = preprocess(tmp_path, tmp_path / mode, size=64, coco=tmp_path / "instances.json", resize=mode)
        assert m["classes"] == ["red", "green"]  # category ids 3, 7 -> 0, 1
        ds = FastDataset(tmp_path / mode)
        b = ds.get_batch(np.arange(len(ds)))
        off = b["boxes_offsets"].numpy()
        for i in range(len(ds)):
            img = b["image"][i].numpy()
            cls = colour_class(img.astype(np.int64))
            boxes, labels = b["boxes"][off[i]:off[i + 1]].numpy(), b["box_labels"][off[i]:off[i + 1]].numpy()
            assert len(boxes) >= 1 and set(labels) <= {0, 1}
            for box, c in zip(boxes, labels):
                assert_inside(cls == c + 1, box)


def assert_inside(pixels: np.ndarray, box: np.ndarray, slack: float = 1.0) -> None:
    """Every pixel of ``pixels`` (HW bool) lies inside ``box`` (xyxy edges), give or take ``slack``."""
    ys, xs = np.nonzero(pixels)
    if len(xs) == 0:
        return
    x1, y1, x2, y2 = box
    assert xs.min() >= x1 - slack and xs.max() + 1 <= x2 + slack, (xs.min(), xs.max(), box)
    assert ys.min() >= y1 - slack and ys.max() + 1 <= y2 + slack, (ys.min(), ys.max(), box)


@pytest.mark.parametrize("mode", ["center-crop", "squash", "pad"])
def test_masks_keep_the_image_geometry_through_preprocessing(tmp_path, mode):
    make_scenes(tmp_path / "src", 8)  # includes a 1000x760 JPEG decoded at 1/8 scale
    preprocess(tmp_path / "src", tmp_path / "out", size=72, resize=mode, workers=2)
    b = FastDataset(tmp_path / "out").get_batch(np.arange(8))
    # (the black letterbox of "pad" is 0 in the mask and argmax 0, "blue", in the colour test)
    agree = (colour_class(b["image"].numpy().astype(np.int64)) == b["mask"].numpy())
    assert agree.mean() >= 0.99, agree.mean(axis=(1, 2))


@pytest.mark.parametrize("mode, w, h, size, edges", [("center-crop", 1032, 768, 96, (504, 384)),
                                                      ("squash", 1025, 1025, 128, (1000, 1000)),
                                                      ("pad", 129, 96, 64, (129, 96))])
def test_masks_and_boxes_stay_on_a_jpeg_decoded_at_a_reduced_scale(tmp_path, mode, w, h, size, edges):
    """A JPEG decoded at 1/2-1/8 (DCT scaling) has ceil(w / d) pixels covering d times that many source
    pixels; its masks and boxes were mapped from the full size: half a pixel off (center-crop, cut at the
    decoded integer offset), 0.86 px (squash), a letterbox row labelled (pad). Now as a PNG's are, also
    for JPEGs stored turned or mirrored (EXIF 2-8: the padded pixel comes first along a reversed axis),
    along x and y."""
    ex, ey = edges
    img = np.zeros((h, w, 3), np.uint8)  # white above and left of two edges (pad: all white)
    img[:ey, :ex] = 255
    mask = (img[..., 0] > 0).astype(np.uint8)
    Image.fromarray(img).save(tmp_path / "a.jpg", quality=100, subsampling=0)
    T = Image.Transpose  # what a viewer undoes for each orientation (exif_transpose's inverse)
    stored = {2: T.FLIP_LEFT_RIGHT, 3: T.ROTATE_180, 4: T.FLIP_TOP_BOTTOM, 5: T.TRANSPOSE, 6: T.ROTATE_90,
              7: T.TRANSVERSE, 8: T.ROTATE_270}
    for orientation, turn in stored.items():
        exif = Image.Exif()
        exif[0x0112] = orientation
        Image.fromarray(img).transpose(turn).save(tmp_path / f"o{orientation}.jpg", quality=100, subsampling=0,
                                                  exif=exif)
    Image.fromarray(img).save(tmp_path / "a.png")
    Image.fromarray(mask).save(tmp_path / "m.png")
    names = ("a.jpg", *(f"o{o}.jpg" for o in stored), "a.png")
    recs = [{"image": n, "mask": "m.png", "boxes": [[0, 0, ex, ey]], "box_labels": [0]} for n in names]
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    preprocess(tmp_path / "r.jsonl", tmp_path / "out", size=size, resize=mode)
    b = FastDataset(tmp_path / "out").get_batch(list(range(len(names))))
    for i, name in enumerate(names):
        picture, labelled = b["image"][i].numpy()[..., 0].astype(float) / 255, b["mask"][i].numpy() == 1
        if mode == "pad":  # the picture's rows are the mask's and the box's
            rows = np.flatnonzero(picture[:, size // 2] > 0.5)
            assert np.array_equal(rows, np.flatnonzero(labelled[:, size // 2])), name
            assert b["boxes"][i].tolist()[1::2] == [float(rows[0]), float(rows[-1] + 1)], name
            continue
        box = b["boxes"][i].tolist()
        for line, edge in ((picture[10], box[2]), (picture[:, 10], box[3])):  # (x along a row, y down a column)
            assert abs(line.sum() - edge) < 0.2, (name, box, line.sum())
        for got, line in ((labelled[10], picture[10]), (labelled[:, 10], picture[:, 10])):
            clear = (line > 0.75) | (line < 0.25)  # (a pixel the edge halves may go either way)
            assert np.array_equal(got[clear], line[clear] > 0.5), name


def test_a_hugging_face_style_parquet_file_is_read_by_row_group(tmp_path):
    pa = pytest.importorskip("pyarrow")  # the test extra installs it; the core never needs it
    import pyarrow.parquet as pq
    records = make_scenes(tmp_path, 9, sizes=((64, 64),), jpeg_big=False)
    table = pa.table({
        "image": [{"bytes": (tmp_path / r["image"]).read_bytes(), "path": r["image"]} for r in records],
        "label": [i % 3 for i in range(9)],
        "text": [f"caption {i}" for i in range(9)]})
    meta = {b"huggingface": json.dumps({"info": {"features": {"label": {"_type": "ClassLabel",
                                                                       "names": ["cat", "dog", "eel"]}}}}).encode()}
    pq.write_table(table.replace_schema_metadata(meta), tmp_path / "train.parquet", row_group_size=4)
    m = preprocess(tmp_path / "train.parquet", tmp_path / "out", size=64, shard_size=5, workers=2)
    assert m["classes"] == ["cat", "dog", "eel"] and m["num_samples"] == 9
    b = FastDataset(tmp_path / "out").get_batch(np.arange(9))
    assert b["label"].tolist() == [i % 3 for i in range(9)]
    for i, r in enumerate(records):
        assert np.array_equal(b["image"][i].numpy(), np.asarray(Image.open(tmp_path / r["image"])))
        lo, hi = b["text_offsets"][i:i + 2].tolist()
        assert bytes(b["text"][lo:hi].numpy().astype(np.uint8)).decode() == f"caption {i}"
    with pytest.raises(SourceError, match="shuffle the rows when writing"):  # a row group a sample: refused
        preprocess(tmp_path / "train.parquet", tmp_path / "shuffled", size=64, shuffle_seed=1)
    assert not (tmp_path / "shuffled").exists()


# -- bad records ------------------------------------------------------------------------------------------
def test_bad_records_are_skipped_or_fail_with_the_record_named(tmp_path):
    records = make_scenes(tmp_path, 6, sizes=((64, 64),), jpeg_big=False)
    records[1]["mask"] = "masks/none.png"  # missing file
    Image.fromarray(np.zeros((10, 10), np.uint8)).save(tmp_path / "masks" / "small.png")
    records[2]["mask"] = "masks/small.png"  # another size
    records[3]["boxes"] = [[0, 0, 500, 20], [1, 1, 2, 2]]  # outside the image
    records[4]["box_labels"] = ["red"]  # one class for two boxes
    with open(tmp_path / "recs.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    m = preprocess(tmp_path / "recs.jsonl", tmp_path / "out", size=64)
    assert m["num_samples"] == 2
    reasons = {s["path"]: s["reason"] for s in m["skipped"]}
    assert set(reasons) == {r["image"] for r in records[1:5]}
    assert "none.png" in reasons[records[1]["image"]]
    assert "10x10" in reasons[records[2]["image"]] and "64x64" in reasons[records[2]["image"]]
    assert "outside" in reasons[records[3]["image"]]
    assert "box_labels" in reasons[records[4]["image"]]
    with pytest.raises(ImageDecodeError, match="images/001.png"):
        preprocess(tmp_path / "recs.jsonl", tmp_path / "out2", size=64, on_error="fail")


def test_a_mask_pillow_refuses_with_any_exception_type_is_a_bad_record(tmp_path):
    """A mask PNG claiming 100000 x 100000 pixels (a decompression bomb) ended the run with a traceback."""
    import struct
    import zlib

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    (tmp_path / "src" / "images").mkdir(parents=True)
    (tmp_path / "src" / "masks").mkdir()
    for i in range(3):
        Image.new("RGB", (40, 30), (i * 50, 0, 0)).save(tmp_path / "src" / "images" / f"{i}.png")
        Image.new("L", (40, 30), i).save(tmp_path / "src" / "masks" / f"{i}.png")
    (tmp_path / "src" / "masks" / "1.png").write_bytes(
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 100000, 100000, 8, 0, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(b"\0" * 100)) + chunk(b"IEND", b""))
    m = preprocess(tmp_path / "src", tmp_path / "out", size=16)
    assert m["num_samples"] == 2 and [s["path"] for s in m["skipped"]] == ["images/1.png"]
    assert m["skipped"][0]["reason"].startswith("mask masks/1.png: DecompressionBombError: ")


def test_a_big_endian_16_bit_mask_tiff_gives_the_same_ids_as_a_little_endian_one(tmp_path):
    """ImageJ/Fiji save 16-bit TIFFs big-endian (Pillow's I;16B); they were refused as not 16-bit."""
    ids = (np.arange(40 * 40).reshape(40, 40) % 300).astype(np.uint16)  # 300 ids: past 8 bits
    for order in ("LE", "BE"):
        src = tmp_path / order
        (src / "images").mkdir(parents=True)
        (src / "masks").mkdir()
        Image.new("RGB", (40, 40), (60, 0, 0)).save(src / "images" / "0.png")
        big = Image.frombytes("I;16B", (40, 40), ids.astype(">u2").tobytes())
        mask = Image.fromarray(ids) if order == "LE" else big
        mask.save(src / "masks" / "0.tif")
        assert Image.open(src / "masks" / "0.tif").mode == {"LE": "I;16", "BE": "I;16B"}[order]
        m = preprocess(src, tmp_path / f"out_{order}", size=40, mask_dtype="uint16")  # the stored size: a cut
        assert m["num_samples"] == 1 and m["skipped"] == [], m["skipped"]
        got = FastDataset(tmp_path / f"out_{order}", storage="ram").get_batch([0])["mask"][0].numpy()
        assert np.array_equal(got.astype(np.int64), ids), order


def test_an_unknown_coco_category_is_a_bad_record(tmp_path):
    records = make_scenes(tmp_path, 3, jpeg_big=False)
    coco_json(records, tmp_path / "instances.json", extra_ann=[
        {"id": 99, "image_id": 11, "bbox": [1, 1, 5, 5], "category_id": 12345, "iscrowd": 0}])
    m = preprocess(tmp_path, tmp_path / "out", size=32, coco=tmp_path / "instances.json")
    assert m["num_samples"] == 2 and "unknown class" in m["skipped"][0]["reason"]


def test_a_box_of_no_area_drops_only_itself_and_its_class(tmp_path):
    """A zero-width COCO box (a sliver: bbox w 0) refused its whole image with every good box on it."""
    for i in range(4):
        Image.new("RGB", (40, 40), (60 * i, 0, 0)).save(tmp_path / f"{i}.png")
    anns = [([5, 5, 10, 10], 1, 0), ([20, 20, 0.0, 4], 2, 0),  # no width: dropped, the image kept
            ([1, 1, 3, 3], 2, 1), ([39.5, 40, 0, 0], 1, 1),  # on the edge, no area: dropped, the image kept
            ([5, 5, 10, 10], 1, 2), ([500, 5, 0, 4], 2, 2),  # no area but outside the image: a bad record
            ([5, 5, 10, 10], 1, 3), ([30, 12, -8, 3], 2, 3)]  # inverted: a bad record, never silently dropped
    (tmp_path / "inst.json").write_text(json.dumps({
        "images": [{"id": i, "file_name": f"{i}.png"} for i in range(4)],
        "categories": [{"id": 1, "name": "a"}, {"id": 2, "name": "b"}],
        "annotations": [{"id": k, "image_id": im, "bbox": bbox, "category_id": c}
                        for k, (bbox, c, im) in enumerate(anns)]}))
    m = preprocess(tmp_path, tmp_path / "out", size=40, coco=tmp_path / "inst.json")
    assert m["num_samples"] == 2
    assert [(s["path"], s["reason"]) for s in m["skipped"]] == [
        ("2.png", "box [500.0, 5.0, 500.0, 9.0] is outside the 40x40 image (xyxy pixels)"),
        ("3.png", "box [30.0, 12.0, 22.0, 15.0] has x2 < x1 or y2 < y1: boxes are corners [x1, y1, x2, y2] (an "
                  "[x, y, w, h] box is [x, y, x + w, y + h])")]
    b = FastDataset(tmp_path / "out").get_batch([0, 1])
    assert b["boxes"].tolist() == [[5, 5, 15, 15], [1, 1, 4, 4]] and b["boxes_offsets"].tolist() == [0, 1, 2]
    assert b["box_labels"].tolist() == [0, 1] and m["class_counts"] == [1, 1]
    (tmp_path / "r.jsonl").write_text(json.dumps({"image": "0.png", "boxes": [[1, 1, 5, 5], [float("nan"), 1, 5, 5]],
                                                  "box_labels": [0, 1]}) + "\n" + '{"image": "1.png"}\n')
    m = preprocess(tmp_path / "r.jsonl", tmp_path / "nan", size=40)  # not finite: still a bad record
    assert m["skipped"] == [{"path": "0.png", "reason": "box [nan, 1.0, 5.0, 5.0] is not finite (xyxy pixels)"}]


@pytest.mark.parametrize("first, second", [("cat dog", ["cat"]), (["cat", "dog"], "cat;dog"), ("0 3", [1])])
def test_labels_as_text_and_as_a_list_in_one_source_are_each_read_by_their_type(tmp_path, first, second):
    """Text in one record and a list in another: a TypeError traceback, or a made-up class 'cat dog'."""
    for i in range(2):
        Image.new("RGB", (20, 20), (90 * i, 0, 0)).save(tmp_path / f"{i}.png")
    (tmp_path / "r.jsonl").write_text("".join(json.dumps({"image": f"{i}.png", "labels": v}) + "\n"
                                              for i, v in enumerate([first, second])))
    m = preprocess(tmp_path / "r.jsonl", tmp_path / "out", size=20)
    b = FastDataset(tmp_path / "out").get_batch([0, 1])
    if first == "0 3":  # tags all spelling ids stay ids beside a list of ids
        assert m["classes"] == ["0", "1", "2", "3"] and b["labels"].tolist() == [0, 3, 1]
    else:
        assert m["classes"] == ["cat", "dog"]
        assert b["labels"].tolist() == ([0, 1, 0] if first == "cat dog" else [0, 1, 0, 1])
    # the same records in a WebDataset tar: read by the same rules
    with tarfile.open(tmp_path / "t.tar", "w") as tf:
        for i, v in enumerate([first, second]):
            for name, data in ((f"{i:04d}.png", (tmp_path / f"{i}.png").read_bytes()),
                               (f"{i:04d}.json", json.dumps({"labels": v}).encode())):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    tm = preprocess(tmp_path / "t.tar", tmp_path / "tar", size=20)
    assert FastDataset(tmp_path / "tar").get_batch([0, 1])["labels"].tolist() == b["labels"].tolist()
    assert tm["classes"] == m["classes"]


def test_a_float_field_that_is_not_finite_is_a_bad_record_naming_it(tmp_path):
    """NaN, inf and a number past float32 (1e39: inf once stored) were stored silently, in JSONL and CSV
    (where a "nan" cell even made the column a caption of byte tokens)."""
    for i in range(4):
        Image.new("RGB", (20, 20), (60 * i, 0, 0)).save(tmp_path / f"{i}.png")
    scores = [[0.5, 1.0], [float("nan"), 1.0], [float("inf"), 2.0], [1e39, 3.0]]
    (tmp_path / "r.jsonl").write_text("".join(json.dumps({"image": f"{i}.png", "score": s}) + "\n"
                                              for i, s in enumerate(scores)))  # json writes NaN and Infinity
    m = preprocess(tmp_path / "r.jsonl", tmp_path / "out", size=20)
    assert m["num_samples"] == 1 and FastDataset(tmp_path / "out").get_batch([0])["score"].tolist() == [[0.5, 1.0]]
    assert [(s["path"], s["reason"].split(":")[0]) for s in m["skipped"]] == [
        ("1.png", "score holds [nan, 1.0]"), ("2.png", "score holds [inf, 2.0]"), ("3.png", "score holds [1e+39, 3.0]")]
    assert m["skipped"][0]["reason"].endswith("a float field needs finite numbers (float32: at most 3.4e38 in size)")
    with pytest.raises(ImageDecodeError, match=r"1.png.*score holds \[nan, 1.0\]"):
        preprocess(tmp_path / "r.jsonl", tmp_path / "fail", size=20, on_error="fail")
    # in a CSV, a "nan" or "inf" cell is a number (the column stays a float field) and its record a bad one;
    # an empty cell is a missing value, refused for the whole file as a JSON record without the key
    (tmp_path / "r.csv").write_text("image,score\n0.png,0.5\n1.png,nan\n2.png,-inf\n3.png,2.5\n")
    m = preprocess(tmp_path / "r.csv", tmp_path / "csv", size=20)
    assert {f["name"]: f["kind"] for f in m["fields"]}["score"] == "vector"
    assert FastDataset(tmp_path / "csv").get_batch([0, 1])["score"].tolist() == [0.5, 2.5]
    assert [(s["path"], s["reason"].split(":")[0]) for s in m["skipped"]] == [
        ("1.png", "score holds nan"), ("2.png", "score holds -inf")]
    (tmp_path / "e.csv").write_text("image,score\n0.png,0.5\n1.png,\n")
    with pytest.raises(SourceError, match="'score' is missing from some records"):
        preprocess(tmp_path / "e.csv", tmp_path / "empty", size=20)


def test_boxes_that_are_not_lists_of_four_numbers_are_bad_records_listing_no_class(tmp_path):
    """Text, bools and a polygon's 8 numbers were cast into boxes (the 8 numbers split into 2 boxes), and the
    class names of a record refused for its boxes stayed in the class list."""
    for i in range(6):
        Image.new("RGB", (40, 40), (40 * i, 0, 0)).save(tmp_path / f"{i}.png")
    recs = [{"boxes": [[1, 2, 30, 31]], "box_labels": ["cat"]},
            {"boxes": [["1", "2", "30", "31"]], "box_labels": ["text"]},
            {"boxes": [[True, 2, 30, 31]], "box_labels": ["bool"]},
            {"boxes": [[1, 2, 10, 11, 12, 13, 30, 31]], "box_labels": ["poly", "gon"]},
            {"boxes": [1, 2, 30, 31], "box_labels": ["flat"]},
            {"boxes": [[1, 2, 30, 31]], "box_labels": ["two", "labels"]}]
    (tmp_path / "r.jsonl").write_text("".join(json.dumps({"image": f"{i}.png", **r}) + "\n"
                                              for i, r in enumerate(recs)))
    m = preprocess(tmp_path / "r.jsonl", tmp_path / "out", size=40)
    assert m["num_samples"] == 1 and m["classes"] == ["cat"]
    reasons = [s["reason"] for s in m["skipped"]]
    assert [s["path"] for s in m["skipped"]] == ["1.png", "2.png", "3.png", "4.png", "5.png"]
    assert all(r.endswith("are not [[x1, y1, x2, y2], ...] of numbers a float holds") for r in reasons[:3]), reasons
    assert reasons[3].endswith("of numbers a float holds (a single box too is a list in the list)")
    assert reasons[4].startswith("1 box but 2 box_labels ['two', 'labels']: give one class per box")
    assert FastDataset(tmp_path / "out").get_batch([0])["boxes"].tolist() == [[1, 2, 30, 31]]


def test_a_bare_csv_box_labels_cell_is_one_box_class(tmp_path):
    """A bare id after a JSON list of ids was refused as ids mixed with names; "cat dog" for two boxes was
    refused but left a class 'cat dog'."""
    for i in range(3):
        Image.new("RGB", (30, 30), (60 * i, 0, 0)).save(tmp_path / f"{i}.png")
    (tmp_path / "ids.csv").write_text('image,boxes,box_labels\n0.png,"[[1,1,5,5],[6,6,9,9]]","[0,1]"\n'
                                      '1.png,"[[1,1,5,5]]",2\n2.png,,\n')
    m = preprocess(tmp_path / "ids.csv", tmp_path / "ids", size=30)
    assert m["classes"] == ["0", "1", "2"] and not m["skipped"]
    assert FastDataset(tmp_path / "ids").get_batch([0, 1, 2])["box_labels"].tolist() == [0, 1, 2]
    (tmp_path / "names.csv").write_text('image,boxes,box_labels\n0.png,"[[1,1,5,5],[6,6,9,9]]",cat dog\n'
                                        '1.png,"[[1,1,5,5]]",traffic light\n2.png,"[[2,2,8,8]]",cat\n')
    m = preprocess(tmp_path / "names.csv", tmp_path / "names", size=30)
    assert m["classes"] == ["cat", "traffic light"]  # one name a cell, spaces and all (COCO's names have them)
    assert [(s["path"], s["reason"]) for s in m["skipped"]] == [
        ("0.png", "2 boxes but 1 box_labels ['cat dog']: give one class per box (in a CSV, a JSON list: "
                  '["cat", "dog"])')]
    assert FastDataset(tmp_path / "names").get_batch([0, 1])["box_labels"].tolist() == [1, 0]


def test_a_record_refused_for_any_reason_lists_no_class(tmp_path):
    """Only a record refused for its box labels left its classes out: the label of a record with a missing
    image or mask, a NaN float, an inverted box or a lone surrogate still named a class (a class of no
    sample, which a classifier's head then learnt to never predict)."""
    (tmp_path / "masks").mkdir()
    for i in range(7):
        Image.new("RGB", (20, 20), (30 * i, 0, 0)).save(tmp_path / f"{i}.png")
        Image.new("L", (20, 20), 1).save(tmp_path / "masks" / f"{i}.png")
    (tmp_path / "masks" / "4.png").unlink()
    good = {"score": 1.0, "boxes": [[1, 1, 5, 5]], "box_labels": ["bird"], "caption": "ok"}
    recs = [{"label": "cat"},
            {"image": "gone.png", "label": "ghost", "box_labels": ["ghost_box"]},  # no such image file
            {"label": "nan", "labels": ["nan_tag"], "score": float("nan")},
            {"label": "inverted", "boxes": [[9, 1, 5, 5]], "box_labels": ["inverted_box"]},
            {"label": "unmasked", "labels": ["unmasked_tag"]},  # its mask file is missing
            {"label": "surrogate", "box_labels": ["surrogate_box"], "caption": "x\udc80y"},
            {"label": "dog", "labels": ["dog_tag"], "box_labels": ["fish"]}]
    (tmp_path / "r.jsonl").write_text("".join(json.dumps({"image": f"{i}.png", "mask": f"masks/{i}.png",
                                                          **good, **r}) + "\n" for i, r in enumerate(recs)))
    m = preprocess(tmp_path / "r.jsonl", tmp_path / "out", size=20)
    assert m["classes"] == ["bird", "cat", "dog", "dog_tag", "fish"]
    reasons = {s["path"]: s["reason"] for s in m["skipped"]}
    assert list(reasons) == ["gone.png", "2.png", "3.png", "4.png", "5.png"] and "gone.png" in reasons["gone.png"]
    assert reasons["2.png"].startswith("score holds nan: a float field needs finite numbers")
    assert reasons["3.png"].startswith("box [9.0, 1.0, 5.0, 5.0] has x2 < x1 or y2 < y1")
    assert reasons["4.png"].startswith("mask masks/4.png") and "FileNotFoundError" in reasons["4.png"]
    assert reasons["5.png"].startswith("the caption holds a lone surrogate '\\udc80' at character 1")
    b = FastDataset(tmp_path / "out").get_batch([0, 1])
    assert b["label"].tolist() == [1, 2] and b["box_labels"].tolist() == [0, 4] and b["labels"].tolist() == [3]
    # ids: the classes run to the largest id a kept record names; a path,label list's missing file names none
    (tmp_path / "ids.jsonl").write_text('{"image": "0.png", "label": 1, "score": 1}\n{"image": "2.png", "label": 9, '
                                        '"score": NaN}\n{"image": "3.png", "label": 0, "score": 2}\n')
    assert preprocess(tmp_path / "ids.jsonl", tmp_path / "ids", size=20)["classes"] == ["0", "1"]
    (tmp_path / "list.csv").write_text("0.png,cat\ngone.png,ghost\n1.png,dog\nnotes.txt,memo\n")
    m = preprocess(tmp_path / "list.csv", tmp_path / "list", size=20)
    assert m["classes"] == ["cat", "dog"] and [s["path"] for s in m["skipped"]] == ["gone.png"]
    assert FastDataset(tmp_path / "list").get_batch([0, 1])[1].tolist() == [0, 1]
    (tmp_path / "list_ids.csv").write_text("0.png,0\ngone.png,7\n1.png,1\n")
    assert preprocess(tmp_path / "list_ids.csv", tmp_path / "list_ids", size=20)["classes"] == ["0", "1"]


def test_a_list_of_texts_in_records_is_one_line_saying_a_text_field_holds_one(tmp_path):
    """COCO-style captions (five an image) were refused as any value that cannot be stored, without saying
    what a list of texts is or what to do; a null caption is a missing one."""
    for i in range(3):
        Image.new("RGB", (20, 20), (60 * i, 0, 0)).save(tmp_path / f"{i}.png")
    (tmp_path / "r.jsonl").write_text('{"image": "0.png", "caption": "a dog"}\n{"image": "1.png", "caption": null}\n'
                                      '{"image": "2.png", "caption": ["a cat", "a cat on a mat"]}\n')
    with pytest.raises(SourceError) as err:
        preprocess(tmp_path / "r.jsonl", tmp_path / "out", size=20)
    assert str(err.value) == (f"{tmp_path / 'r.jsonl'}:3: 'caption' holds 2 texts ['a cat', 'a cat on a mat']: a text "
                              "field holds one text (a caption): keep one as 'caption' and store the others under "
                              "keys of their own, one text each, or leave them out")
    (tmp_path / "r.jsonl").write_text('{"image": "0.png", "caption": "a dog"}\n{"image": "1.png", "caption": null}\n'
                                      '{"image": "2.png"}\n')
    assert preprocess(tmp_path / "r.jsonl", tmp_path / "ok", size=20)["num_samples"] == 3
    b = FastDataset(tmp_path / "ok").get_batch([0, 1, 2])
    assert b["caption_offsets"].tolist() == [0, 5, 5, 5]  # null and missing: the same empty caption


def test_malformed_sources_name_file_and_line(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"image": "x.png"}\n[1, 2]\n')
    with pytest.raises(SourceError, match=r"a.jsonl:2"):
        preprocess(tmp_path / "a.jsonl", tmp_path / "o1")
    (tmp_path / "b.jsonl").write_text('{"image": "../../etc/passwd"}\n')
    with pytest.raises(SourceError, match="outside"):
        preprocess(tmp_path / "b.jsonl", tmp_path / "o2")
    (tmp_path / "c.jsonl").write_text('{"image": "x.png", "v": [1, 2]}\n{"image": "y.png", "v": [1]}\n')
    with pytest.raises(SourceError, match="different lengths"):
        preprocess(tmp_path / "c.jsonl", tmp_path / "o3")


def test_an_unknown_field_kind_is_refused_clearly(tmp_path):
    make_scenes(tmp_path / "src", 2, jpeg_big=False)
    preprocess(tmp_path / "src", tmp_path / "out", size=32)
    path = tmp_path / "out" / MANIFEST_NAME
    m = json.loads(path.read_text())
    m["fields"][1]["kind"] = "pointcloud"
    path.write_text(json.dumps(m))
    with pytest.raises(FormatError, match="unknown kind 'pointcloud'.*upgrade fastdata"):
        load_manifest(tmp_path / "out")


def test_an_lmdb_with_fields_stores_jpeg_images_beside_the_same_fields(tmp_path):
    from fastdata.dali import DALILoader
    from fastdata.errors import ConfigError
    records = make_scenes(tmp_path, 10)  # the last one a large JPEG (decoded at 1/8 scale)
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    preprocess(tmp_path / "r.jsonl", tmp_path / "npy", size=64, shard_size=4)
    m = preprocess(tmp_path / "r.jsonl", tmp_path / "lm", size=64, shard_size=4, format="lmdb", quality=95, workers=2)
    preprocess(tmp_path / "r.jsonl", tmp_path / "lm1", size=64, shard_size=4, format="lmdb", quality=95)

    def tree(folder: Path) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}
    assert tree(tmp_path / "lm") == tree(tmp_path / "lm1")  # byte-identical for any worker count
    npy_m = load_manifest(tmp_path / "npy")
    assert m["format"] == "fastdata.images.lmdb" and m["format_version"] == 4 and m["fields"] == npy_m["fields"]
    assert m["params"]["resize"] == "center-crop" and len(m["lmdb_shards"]) == 3
    npy, lm = FastDataset(tmp_path / "npy"), FastDataset(tmp_path / "lm")
    a, b = npy.get_batch(np.arange(10)), lm.get_batch(np.arange(10))
    assert a.keys() == b.keys()
    for k in a:  # every field but the pixels: the npy dataset's exactly (the same square geometry)
        if k != "image":
            assert b[k].dtype == a[k].dtype and torch.equal(a[k], b[k]), k
    assert b["image"].shape == a["image"].shape == (10, 64, 64, 3)
    assert (b["image"].float() - a["image"].float()).abs().mean() < 6  # JPEG at quality 95
    assert (colour_class(b["image"].numpy()) == b["mask"].numpy()).mean() > 0.97  # (chroma subsampling at edges)
    seen = np.concatenate([x["score"][:, 0].numpy() for x in FastLoader(lm, 3, seed=1, pin_memory=False)])
    assert sorted(seen.astype(int).tolist()) == list(range(10))  # exactly once
    with pytest.raises(ConfigError, match="sample fields"):
        FastDataset(tmp_path / "lm", crop="random")
    with pytest.raises(ConfigError, match="sample fields"):
        FastDataset(tmp_path / "lm", size=48)
    with pytest.raises(ConfigError, match="sample fields"):
        DALILoader(tmp_path / "lm", 4)
    seg = preprocess(tmp_path, tmp_path / "seg", size=32, format="lmdb")  # images/ + masks/: no class label
    assert "labels" not in seg and not (tmp_path / "seg" / "labels.npy").exists()
    s = FastDataset(tmp_path / "seg")
    assert not s.has_labels and set(s.get_batch([0, 9])) == {"image", "mask"}


# -- serving ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def indexed_fields(tmp_path_factory) -> Path:
    """30 samples whose fields all encode the sample's index, so any batch can be checked against it."""
    root = tmp_path_factory.mktemp("idx")
    (root / "img").mkdir()
    recs = []
    for i in range(30):
        Image.fromarray(np.full((16, 16, 3), i, np.uint8)).save(root / "img" / f"{i}.png")
        Image.fromarray(np.full((16, 16), i, np.uint8)).save(root / "img" / f"{i}m.png")
        recs.append({"image": f"img/{i}.png", "mask": f"img/{i}m.png", "index": float(i), "label": i % 5,
                     "labels": [i] * (i % 4), "boxes": [[0, 0, 1 + i % 15, 16]] * (i % 3), "box_labels": [i] * (i % 3)})
    (root / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    preprocess(root / "r.jsonl", root / "ds", size=16, shard_size=7)
    return root / "ds"


def check_batch(b: dict) -> np.ndarray:
    """The sample ids of a batch, after checking that every field belongs to the same sample."""
    ids = b["index"].numpy().astype(np.int64)
    assert (b["image"].numpy() == ids[:, None, None, None]).all()
    assert (b["mask"].numpy() == ids[:, None, None]).all()
    assert (b["label"].numpy() == ids % 5).all()
    for key, per in (("labels", lambda i: [i] * (i % 4)), ("box_labels", lambda i: [i] * (i % 3))):
        off = b[("boxes" if key == "box_labels" else key) + "_offsets"].numpy()
        assert [b[key][off[j]:off[j + 1]].tolist() for j in range(len(ids))] == [per(int(i)) for i in ids]
    off = b["boxes_offsets"].numpy()
    for j, i in enumerate(ids):
        assert b["boxes"][off[j]:off[j + 1]].tolist() == [[0, 0, 1 + i % 15, 16]] * (i % 3)
    return ids


@pytest.mark.parametrize("storage", ["mmap", "ram", "shm"])
def test_fastloader_serves_every_field_exactly_once_and_resumes(indexed_fields, storage, tmp_path):
    ds = FastDataset(indexed_fields, storage=storage, shm_dir=tmp_path)
    loader = FastLoader(ds, batch_size=4, seed=3, num_threads=2, pin_memory=False)
    seen = np.concatenate([check_batch(b) for b in loader])
    assert sorted(seen.tolist()) == list(range(30))
    it = iter(loader)
    first = [check_batch(next(it)) for _ in range(3)]
    state = loader.state_dict()
    loader2 = FastLoader(FastDataset(indexed_fields, storage=storage, shm_dir=tmp_path), batch_size=4, seed=3,
                         num_threads=2, pin_memory=False)
    loader2.load_state_dict(state)
    rest = [check_batch(b) for b in loader2]
    assert sorted(np.concatenate(first + rest).tolist()) == sorted(seen.tolist())


def test_ring_buffers_grow_for_variable_fields_and_are_reused(indexed_fields):
    loader = FastLoader(FastDataset(indexed_fields), batch_size=5, num_threads=1, prefetch=0, shuffle=False,
                        pin_memory=False)
    ptrs = [b["image"].data_ptr() for b in loader]
    assert len(set(ptrs)) == 1  # one slot: the image buffer is reused for every batch
    assert [check_batch(b).tolist() for b in loader] == [list(range(k, k + 5)) for k in range(0, 30, 5)]


def test_dataloader_and_per_sample_access_agree_with_get_batch(indexed_fields):
    ds = FastDataset(indexed_fields)
    dl = torch.utils.data.DataLoader(ds, batch_size=6, collate_fn=ds.collate, num_workers=2)
    got = [check_batch(b) for b in dl]
    assert np.concatenate(got).tolist() == list(range(30))
    s = ds[7]
    assert int(s["index"]) == 7 and s["labels"].tolist() == [7, 7, 7] and s["mask"].shape == (16, 16)


# -- transforms move every spatial field together -----------------------------------------------------------
@pytest.fixture(scope="module")
def scenes_ds(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("scenes")
    records = make_scenes(root, 24, sizes=((96, 96),), jpeg_big=False)
    (root / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    preprocess(root / "r.jsonl", root / "ds", size=96)
    return root / "ds"


def transformed(ds_path: Path, transforms, device: str, seed: int = 0) -> list[dict]:
    loader = FastLoader(FastDataset(ds_path), batch_size=8, seed=seed, pin_memory=device == "cuda")
    pf = CUDAPrefetcher(loader, device, transforms=transforms, normalize=False, seed=seed)
    return [{k: v.cpu() for k, v in b.items()} for b in pf]


def check_geometry(batches: list[dict]) -> None:
    agree, boxes_seen = [], 0
    for b in batches:
        img = b["image"].permute(0, 2, 3, 1).float().numpy()  # 0..1 NHWC
        cls = colour_class(img)
        agree.append(cls == b["mask"].numpy())
        off = b["boxes_offsets"].numpy()
        assert off[-1] == len(b["boxes"]) == len(b["box_labels"])
        for i in range(len(img)):
            boxes, labels = b["boxes"][off[i]:off[i + 1]].numpy(), b["box_labels"][off[i]:off[i + 1]].numpy()
            assert ((boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])).all()
            assert (boxes >= 0).all() and (boxes[:, [0, 2]] <= img.shape[2]).all()
            for c in (0, 1):  # a colour present in the output has its box there, and stays inside it
                colour = cls[i] == (2 if c == 0 else 1)  # class ids: green 0, red 1; mask 1 red, 2 green
                here = boxes[labels == c]
                if colour.sum() > 4:
                    assert len(here) == 1, (i, c, labels)
                    assert_inside(colour, here[0], slack=1.5)
            boxes_seen += len(boxes)
    assert np.concatenate([a.ravel() for a in agree]).mean() >= 0.99
    assert boxes_seen > 0


PIPELINES = {
    "rrc+flip": lambda: Compose([RandomResizedCrop(64, scale=(0.2, 1.0)), RandomHorizontalFlip()]),
    "pad-crop+flip": lambda: Compose([RandomCrop(80, padding=8), RandomHorizontalFlip()]),
    "center": lambda: CenterCrop(56),
}


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_transforms_move_masks_and_boxes_with_the_image_on_cpu(scenes_ds, name):
    check_geometry(transformed(scenes_ds, PIPELINES[name](), "cpu"))


@pytest.mark.cuda
@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_transforms_move_masks_and_boxes_with_the_image_on_cuda(scenes_ds, name):
    gpu = transformed(scenes_ds, PIPELINES[name](), "cuda")
    check_geometry(gpu)
    cpu = transformed(scenes_ds, PIPELINES[name](), "cpu")
    for g, c in zip(gpu, cpu):  # same draws: identical masks and box counts, images within rounding
        assert torch.equal(g["boxes_offsets"], c["boxes_offsets"])
        assert (g["mask"] == c["mask"]).float().mean() > 0.999
        assert torch.allclose(g["image"].float(), c["image"].float(), atol=1e-3)


@pytest.fixture(scope="module")
def scenes_lmdb(scenes_ds) -> Path:
    """The scenes as an LMDB of JPEGs with the same fields."""
    preprocess(scenes_ds.parent / "r.jsonl", scenes_ds.parent / "lmdb", size=96, format="lmdb", quality=95)
    return scenes_ds.parent / "lmdb"


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_transforms_move_an_lmdbs_fields_exactly_as_an_npy_datasets(scenes_ds, scenes_lmdb, name):
    npy = transformed(scenes_ds, PIPELINES[name](), "cpu")
    lm = transformed(scenes_lmdb, PIPELINES[name](), "cpu")
    assert len(npy) == len(lm) == 3
    for a, b in zip(npy, lm):  # the same draws: every field but the pixels identical, the pixels close
        assert a.keys() == b.keys()
        for k in a:
            if k != "image":
                assert torch.equal(a[k], b[k]), k
        assert (a["image"] - b["image"]).abs().mean() < 0.03
        cls = colour_class(b["image"].permute(0, 2, 3, 1).numpy())
        assert (cls == b["mask"].numpy()).mean() > 0.97


def test_a_dict_batch_draws_exactly_what_an_image_batch_draws(scenes_ds):
    b = FastDataset(scenes_ds).get_batch(np.arange(8))
    image = b["image"].permute(0, 3, 1, 2)
    t = Compose([RandomResizedCrop(48), RandomHorizontalFlip(), RandomCrop(40, padding=4)])
    alone = t(image, torch.Generator().manual_seed(5))
    moved = t({**b, "image": image}, torch.Generator().manual_seed(5))
    assert torch.equal(alone, moved["image"])


def test_boxes_that_leave_the_crop_are_dropped_with_their_class_ids():
    image = torch.zeros(2, 3, 20, 20, dtype=torch.uint8)
    batch = {"image": image, "boxes": torch.tensor([[0., 0, 4, 4], [10, 10, 20, 20], [2, 2, 18, 18]]),
             "box_labels": torch.tensor([5, 6, 7]), "boxes_offsets": torch.tensor([0, 2, 3])}
    out = CenterCrop(10)(batch)  # keeps pixels 5..15 of each axis
    assert out["boxes_offsets"].tolist() == [0, 1, 2]
    assert out["box_labels"].tolist() == [6, 7]
    assert out["boxes"].tolist() == [[5, 5, 10, 10], [0, 0, 10, 10]]
    flipped = RandomHorizontalFlip(p=1.0)(batch)
    assert flipped["boxes"].tolist() == [[16, 0, 20, 4], [0, 10, 10, 20], [2, 2, 18, 18]]


def test_the_cli_detects_the_source_and_inspect_lists_the_fields(tmp_path, capsys):
    from fastdata.cli.main import main
    records = make_scenes(tmp_path, 3, jpeg_big=False)
    coco_json(records, tmp_path / "instances.json")
    assert main(["preprocess", "images", str(tmp_path), str(tmp_path / "det"), "--size", "32", "--coco",
                 str(tmp_path / "instances.json"), "--workers", "1"]) == 0  # (--quiet: no summary, nothing skipped)
    assert "fields: image (image), boxes (boxes), box_labels (box_labels)" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path / "det")]) == 0
    out = capsys.readouterr().out
    assert "field:     boxes: boxes <f4 (4,)" in out and "version 2" in out
    assert main(["verify", str(tmp_path / "det")]) == 0


# -- training on fields -----------------------------------------------------------------------------------
def test_the_trainer_learns_segmentation_from_a_dict_dataset(scenes_ds):
    from fastdata import TrainConfig, Trainer
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 1), torch.nn.ReLU(), torch.nn.Conv2d(8, 3, 1))
    ds = FastDataset(scenes_ds)
    loader = CUDAPrefetcher(FastLoader(ds, batch_size=8, pin_memory=False), "cpu",
                            transforms=Compose([RandomResizedCrop(48), RandomHorizontalFlip()]))
    val = CUDAPrefetcher(FastLoader(ds, batch_size=8, shuffle=False, pin_memory=False), "cpu")
    cfg = TrainConfig(epochs=6, lr=0.05, optimizer="adamw", weight_decay=0.0, progress=False, device="cpu", val_every=0)
    seen = []

    def loss_fn(out, batch):  # a user loss sees the whole dict
        seen.append(sorted(batch))
        return torch.nn.functional.cross_entropy(out, batch["mask"])
    before = Trainer(model, loader, val, config=cfg, loss_fn=loss_fn).evaluate()
    t = Trainer(model, loader, val, config=cfg, loss_fn=loss_fn)
    t.fit()
    after = t.evaluate()
    assert "mask" in seen[0] and "boxes" in seen[0]
    assert after["val_accuracy"] > 0.97 > before["val_accuracy"], (before, after)  # pixel accuracy
    default = Trainer(model, loader, val, config=cfg).evaluate()  # the default loss: per-pixel cross-entropy
    assert default["val_loss"] == pytest.approx(after["val_loss"], rel=1e-4)


def test_a_split_of_a_dataset_with_fields_serves_dicts(indexed_fields):
    from fastdata.datasets.splits import split
    train, val = split(FastDataset(indexed_fields), 0.2, seed=1)
    got = np.concatenate([check_batch(b) for b in FastLoader(train, 4, pin_memory=False)] +
                         [check_batch(b) for b in FastLoader(val, 4, pin_memory=False)])
    assert sorted(got.tolist()) == list(range(30))


@pytest.mark.cuda
def test_cuda_storage_gathers_every_field_on_the_device(indexed_fields):
    host = FastDataset(indexed_fields).get_batch([3, 4, 11, 29])
    dev = FastDataset(indexed_fields, storage="cuda").get_batch([3, 4, 11, 29])
    assert set(dev) == set(host)
    for k in host:
        assert dev[k].device.type == "cuda" and torch.equal(dev[k].cpu(), host[k]), k
    loader = FastLoader(FastDataset(indexed_fields, storage="cuda"), 4, seed=2)
    seen = np.concatenate([check_batch({k: v.cpu() for k, v in b.items()}) for b in loader])
    assert sorted(seen.tolist()) == list(range(30))


def test_fastdata_train_uses_the_label_field_and_refuses_a_dataset_without_one(indexed_fields, tmp_path, capsys):
    from fastdata.cli.main import main
    assert main(["train", str(indexed_fields), "--epochs", "1", "--batch-size", "8", "--model", "cnn-small",
                 "--device", "cpu", "--quiet"]) == 0
    make_scenes(tmp_path / "seg", 2, jpeg_big=False)
    preprocess(tmp_path / "seg", tmp_path / "segds", size=32)
    assert main(["train", str(tmp_path / "segds"), "--epochs", "1", "--device", "cpu"]) != 0
    assert "no 'label' field (image, mask)" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["npy", "lmdb"])
def test_records_with_fields_resume_after_kill_9_and_are_byte_identical_for_any_worker_count(tmp_path, fmt):
    import subprocess
    import sys

    from conftest import kill_when_journaled

    from fastdata.cli.main import main
    records = make_scenes(tmp_path, 60, sizes=((120, 90), (90, 130)), jpeg_big=False)
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    args = ["--size", "48", "--shard-size", "6", "--quiet", "--format", fmt]

    def tree(folder: Path) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}
    assert main(["preprocess", "images", str(tmp_path / "r.jsonl"), str(tmp_path / "w1"), *args, "--workers", "1"]) == 0
    assert main(["preprocess", "images", str(tmp_path / "r.jsonl"), str(tmp_path / "w2"), *args, "--workers", "2"]) == 0
    assert tree(tmp_path / "w1") == tree(tmp_path / "w2")
    out = tmp_path / "killed"
    kill_when_journaled([sys.executable, "-m", "fastdata", "preprocess", "images", str(tmp_path / "r.jsonl"), str(out),
                         *args, "--workers", "1"], out, 3)
    assert main(["preprocess", "images", str(tmp_path / "r.jsonl"), str(out), *args, "--workers", "1"]) == 0
    assert tree(out) == tree(tmp_path / "w1")
    assert subprocess.run([sys.executable, "-m", "fastdata", "verify", str(out)]).returncode == 0


def test_a_missing_offsets_file_is_named_at_opening(indexed_fields, tmp_path):
    # numpy's FileNotFoundError at the first batch before
    import shutil

    ds = Path(shutil.copytree(indexed_fields, tmp_path / "ds"))
    (ds / "field.labels.offsets-00001.npy").unlink()
    with pytest.raises(FormatError, match=r"field\.labels\.offsets-00001\.npy is missing: the dataset is incomplete"):
        FastDataset(ds).get_batch([0])
