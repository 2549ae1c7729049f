"""Decoding: every Pillow mode becomes the RGB a person would see; resize modes; draft keeps quality."""
from __future__ import annotations

import numpy as np
import pytest
from conftest import quadrants, save_with_orientation
from PIL import Image

from fastdata.errors import ImageDecodeError
from fastdata.imaging import decode_batch as jpeg_read, decode_file as decode


def px(path, size=16, mode="squash"):
    return decode.load_array(path, size, mode).astype(int)


def test_colour_modes_become_rgb(awkward_folder):
    d = awkward_folder / "a_modes"
    assert np.abs(px(d / "cmyk.jpg") - (255, 0, 0)).max() <= 3  # JPEG rounding
    assert (px(d / "gray.png") == 100).all()
    assert (px(d / "palette.png") == (10, 200, 30)).all()
    # 50%-opaque red over the white background: R stays 255, G and B are half way to white.
    assert (px(d / "rgba.png") == (255, 127, 127)).all()
    assert (px(d / "la.png") == 255).all()  # fully transparent -> background


def test_16bit_is_scaled_not_clipped(awkward_folder):
    d = awkward_folder / "a_modes"
    assert (px(d / "gray16.png") == 128).all()  # 32768 / 65535 of full scale, not clipped to 255
    assert (px(d / "rgb16.png") == (255, 128, 1)).all()


@pytest.mark.parametrize("name", ["rot6.jpg", "rot8.jpg", "upright.JPG"])
def test_exif_orientation_comes_out_upright(awkward_folder, name):
    out = decode.load_array(awkward_folder / "b_exif" / name, 40, "squash").astype(int)
    want = {(0, 0): (255, 0, 0), (0, 1): (0, 255, 0), (1, 0): (0, 0, 255), (1, 1): (255, 255, 255)}
    for (qy, qx), colour in want.items():
        block = out[qy * 20 + 5: qy * 20 + 15, qx * 20 + 5: qx * 20 + 15]
        assert np.abs(block.mean(axis=(0, 1)) - colour).max() < 12, (name, qy, qx, block.mean(axis=(0, 1)))


def test_stored_sideways_has_swapped_stored_size(tmp_path):
    save_with_orientation(tmp_path / "r.jpg", quadrants(60, 40), 6)
    assert Image.open(tmp_path / "r.jpg").size == (40, 60)  # the fixture really stores it sideways
    assert decode.open_rgb(tmp_path / "r.jpg", 1000, "squash").size == (60, 40)


@pytest.mark.parametrize("name", ["truncated.jpg", "empty.png", "garbage.webp"])
def test_bad_files_raise_decode_error(awkward_folder, name):
    with pytest.raises(ImageDecodeError):
        decode.load_array(awkward_folder / "ñandú" / name, 16, "center-crop")


def _halves(w, h):
    img = np.zeros((h, w, 3), np.uint8)
    img[:, : w // 2] = (200, 0, 0)
    img[:, w // 2:] = (0, 0, 200)
    return Image.fromarray(img)


def test_resize_modes(tmp_path):
    _halves(200, 100).save(tmp_path / "h.png")
    crop = decode.load_array(tmp_path / "h.png", 50, "center-crop")
    assert crop.shape == (50, 50, 3) and crop.dtype == np.uint8
    assert (crop[:, :20] == (200, 0, 0)).all() and (crop[:, 30:] == (0, 0, 200)).all()
    pad = decode.load_array(tmp_path / "h.png", 50, "pad")
    assert (pad[:12] == 0).all() and (pad[38:] == 0).all()  # 50x25 picture letterboxed in black
    assert (pad[14:36, :20] == (200, 0, 0)).all() and (pad[14:36, 30:] == (0, 0, 200)).all()
    squash = decode.load_array(tmp_path / "h.png", 50, "squash")
    assert (squash[:, :20] == (200, 0, 0)).all() and (squash[:, 30:] == (0, 0, 200)).all()


def test_center_crop_matches_plain_pillow_reference(tmp_path):
    rng = np.random.default_rng(1)
    Image.fromarray(rng.integers(0, 256, (48, 64, 3), np.uint8)).save(tmp_path / "n.png")
    ref = Image.open(tmp_path / "n.png").convert("RGB").crop((8, 0, 56, 48)).resize((32, 32), Image.Resampling.LANCZOS)
    out, ref = decode.load_array(tmp_path / "n.png", 32, "center-crop").astype(int), np.asarray(ref, int)
    # Interior equal to the bit; at the left/right edges fastdata's filter reads the real neighbours outside
    # the crop (resize with box=) where crop-then-resize repeats the edge, so those columns differ a little.
    assert np.array_equal(out[:, 4:-4], ref[:, 4:-4])
    assert np.abs(out - ref).mean() < 3



@pytest.mark.parametrize("w, h", [(64, 48), (65, 48), (48, 48), (48, 71)])
def test_center_crop_at_the_stored_size_is_an_exact_cut(tmp_path, w, h):
    """An image whose shorter side already is ``size`` (an LMDB record served at its stored size) is cut,
    not resampled: its pixels come out unchanged, the extra column/row of an odd margin on the right."""
    pixels = np.random.default_rng(w + h).integers(0, 256, (h, w, 3), np.uint8)
    Image.fromarray(pixels).save(tmp_path / "n.png")
    m = min(w, h)
    left, top = (w - m) // 2, (h - m) // 2
    assert np.array_equal(decode.load_array(tmp_path / "n.png", m, "center-crop"),
                          pixels[top:top + m, left:left + m])

def test_draft_decode_of_large_jpeg_is_close_to_full_decode(tmp_path):
    from fastdata.cli.synthetic import synthetic_image

    Image.fromarray(synthetic_image(np.random.default_rng(0), 1, 4, 2400, 1600)).save(tmp_path / "big.jpg", quality=92)
    fast = decode.load_array(tmp_path / "big.jpg", 256, "center-crop").astype(float)
    full = Image.open(tmp_path / "big.jpg").convert("RGB").crop((400, 0, 2000, 1600))
    ref = np.asarray(full.resize((256, 256), Image.Resampling.LANCZOS), float)
    assert np.abs(fast - ref).mean() < 2.0


def test_lmdb_record_keeps_aspect_and_caps_shorter_side(tmp_path):
    import io

    _halves(300, 200).save(tmp_path / "h.png")
    img = Image.open(io.BytesIO(decode.load_jpeg(tmp_path / "h.png", 100, 90)))
    assert img.format == "JPEG" and img.mode == "RGB" and img.size == (150, 100)
    _halves(60, 40).save(tmp_path / "small.png")
    assert Image.open(io.BytesIO(decode.load_jpeg(tmp_path / "small.png", 100, 90))).size == (60, 40)  # no upscale
    arr = jpeg_read.decode_jpeg(decode.load_jpeg(tmp_path / "h.png", 100, 90), 64)
    assert arr.shape == (64, 64, 3) and np.abs(arr[:, :20].astype(int) - (200, 0, 0)).max() < 20


def test_jpeg_size_reads_the_frame_header_without_decoding(tmp_path):
    import io

    from PIL import Image

    from fastdata.imaging.decode_batch import jpeg_size

    cases = [("RGB", (123, 45), {}), ("RGB", (45, 123), {"progressive": True}), ("L", (64, 7), {}),
             ("RGB", (300, 200), {"exif": Image.Exif(), "icc_profile": b"\0" * 3000})]
    for mode, size, kw in cases:
        buf = io.BytesIO()
        Image.new(mode, size, 90).save(buf, "JPEG", quality=90, **kw)
        blob = buf.getvalue()
        assert jpeg_size(blob) == (size[1], size[0]), (mode, size, kw)
        sof = max(blob.find(b"\xff\xc0"), blob.find(b"\xff\xc2"))
        assert jpeg_size(blob[:sof]) == (0, 0)  # cut before the frame header
    assert jpeg_size(b"\xff\xd8" + bytes(40)) == (0, 0) and jpeg_size(b"") == (0, 0)


@pytest.mark.parametrize("size", [(500, 375), (1600, 1200), (64, 48)])
def test_preprocessing_decodes_jpegs_with_libjpeg_turbo_to_pillows_exact_pixels(tmp_path, size, monkeypatch):
    import sys

    from fastdata.cli.synthetic import synthetic_image

    path = tmp_path / "p.jpg"
    Image.fromarray(np.asarray(synthetic_image(np.random.default_rng(1), 2, 4, *size))).save(path, quality=90)
    for target in (256, 100, 32):  # full scale, and Pillow's draft scales 1/2 .. 1/8 where they fit
        fast = decode.open_rgb(path, target, "center-crop")
        with monkeypatch.context() as m:
            m.setitem(sys.modules, "simplejpeg", None)
            slow = decode.open_rgb(path, target, "center-crop")
        assert fast.size == slow.size and np.array_equal(np.asarray(fast), np.asarray(slow)), (size, target)


def test_preprocess_filter_option_changes_only_the_resampling(photo_folder, tmp_path):
    from fastdata.cli.main import main
    from fastdata.formats.manifest import load_manifest

    for name in ("lanczos", "bilinear"):
        assert main(["preprocess", "images", str(photo_folder), str(tmp_path / name), "--size", "32", "--workers", "1",
                     "--quiet", "--filter", name]) == 0
    a, b = (np.load(tmp_path / n / "images-00000.npy") for n in ("lanczos", "bilinear"))
    mse = ((a.astype(float) - b.astype(float)) ** 2).mean()
    assert 0 < mse and 10 * np.log10(255 ** 2 / mse) > 25  # another filter: close, not equal
    assert load_manifest(tmp_path / "bilinear")["params"]["filter"] == "bilinear"
    assert "filter" not in load_manifest(tmp_path / "lanczos")["params"]  # the default keeps old fingerprints
    with pytest.raises(SystemExit):
        main(["preprocess", "images", str(photo_folder), str(tmp_path / "x"), "--filter", "nearest"])
