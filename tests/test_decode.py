"""Decoding: every Pillow mode becomes the RGB a person would see; resize modes; draft keeps quality."""
from __future__ import annotations

import numpy as np
import pytest
from conftest import quadrants, save_with_orientation, write_png_rgb16
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


def _damaged(kind):
    """Bytes Pillow rejects with an exception outside its usual OSError/SyntaxError/ValueError (found by fuzzing)."""
    import io

    buf = io.BytesIO()
    img = Image.fromarray(np.random.default_rng(0).integers(0, 255, (24, 20, 3), np.uint8))
    if kind == "OverflowError":  # a TIFF whose StripOffsets entry claims type LONG8 (16), not LONG (4)
        img.save(buf, "TIFF")
        d = bytearray(buf.getvalue())
        ifd = int.from_bytes(d[4:8], "little")
        entries = [ifd + 2 + 12 * k for k in range(int.from_bytes(d[ifd:ifd + 2], "little"))]
        (e,) = [e for e in entries if int.from_bytes(d[e:e + 2], "little") == 273]
        d[e + 2] = 16
    else:  # NotImplementedError: a DDS with unknown pixel-format flags
        img.convert("RGBA").save(buf, "DDS")
        d = bytearray(buf.getvalue())
        assert d[:4] == b"DDS "
        d[80] = 18  # DDS_PIXELFORMAT.dwFlags
    return bytes(d)


@pytest.mark.parametrize("kind", ["OverflowError", "NotImplementedError"])
def test_damage_pillow_reports_with_any_exception_type_is_a_decode_error(tmp_path, kind):
    (tmp_path / "bad.jpg").write_bytes(_damaged(kind))  # Pillow opens by content, not by name
    with pytest.raises(ImageDecodeError, match=f"^{kind}: "):
        decode.load_array(tmp_path / "bad.jpg", 16, "center-crop")
    with pytest.raises(ImageDecodeError, match=f"^{kind}: "):
        decode.load_jpeg(tmp_path / "bad.jpg", 16, 90)
    # the loader's fallback for a damaged LMDB record (Pillow, after libjpeg-turbo refused it) names its position
    with pytest.raises(ImageDecodeError, match=f"^{kind}: ") as info:
        jpeg_read.decode_jpeg(_damaged(kind), 16)
    assert info.value.position == 0


def test_on_error_skip_survives_damage_pillow_reports_with_any_exception_type(tmp_path, capsys):
    """An OverflowError (TIFF) or NotImplementedError (DDS) escaped the workers and ended the run with a
    traceback and no manifest."""
    import json

    from fastdata.cli.main import main

    src = tmp_path / "src" / "cat"
    src.mkdir(parents=True)
    for i in range(4):
        Image.new("RGB", (40, 40), (i * 40, 0, 0)).save(src / f"{i}.png")
    (src / "1bad.tif").write_bytes(_damaged("OverflowError"))
    (src / "2bad.jpg").write_bytes(_damaged("NotImplementedError"))
    out = tmp_path / "out"
    assert main(["preprocess", "images", str(tmp_path / "src"), str(out), "--size", "16", "--workers", "1",
                 "--quiet"]) == 0
    assert "Traceback" not in capsys.readouterr().err
    m = json.loads((out / "manifest.json").read_text())
    assert m["num_samples"] == 4
    assert {s["path"]: s["reason"].split(":")[0] for s in m["skipped"]} == {
        "cat/1bad.tif": "OverflowError", "cat/2bad.jpg": "NotImplementedError"}


def _keyed_png(path, img, key):
    img.save(path, transparency=key)
    assert "transparency" in Image.open(path).info  # the file really holds a tRNS colour key


def test_a_colour_key_is_composited_on_white_like_alpha(tmp_path):
    """PNG tRNS on L, RGB and 16-bit grey: the keyed pixels are transparent, so white (docs/preprocess.md)."""
    grey = np.full((8, 8), 128, np.uint8)
    grey[:, :4] = 0
    _keyed_png(tmp_path / "l.png", Image.fromarray(grey), 0)
    rgb = np.full((8, 8, 3), 128, np.uint8)
    rgb[:, :4] = (10, 20, 30)
    _keyed_png(tmp_path / "rgb.png", Image.fromarray(rgb), (10, 20, 30))
    wide = np.full((8, 8), 40000, np.uint16)
    wide[:, :4] = 0x8001  # the key; 0x80xx values scale to 128 too, so it must be matched before scaling
    wide[:, 6:] = 0x8002
    _keyed_png(tmp_path / "i16.png", Image.fromarray(wide), 0x8001)
    for name, right in [("l.png", 128), ("rgb.png", 128), ("i16.png", 40000 >> 8)]:
        out = px(tmp_path / name, 8, "squash")
        assert (out[:, :4] == 255).all(), name  # the keyed half: white
        assert (out[:, 4:6] == right).all(), name  # the rest: opaque, as stored
    assert (px(tmp_path / "i16.png", 8, "squash")[:, 6:] == 0x80).all()  # near the key, not it: opaque grey
    # a 48-bit key: Pillow loads 8 bits a channel, where a black key would match every near-black pixel
    dark = np.zeros((8, 8, 3), np.uint16)
    dark[:, 4:] = (200, 100, 50)  # (0, 0, 0) in 8 bits, yet not the key
    write_png_rgb16(tmp_path / "rgb48.png", dark, key=(0, 0, 0))
    assert (px(tmp_path / "rgb48.png", 8, "squash") == 0).all()  # opaque black, never white


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


def _photo(path, w, h, seed=2):
    from fastdata.cli.synthetic import synthetic_image

    Image.fromarray(synthetic_image(np.random.default_rng(seed), 1, 4, w, h)).save(path, quality=90)
    return path


def _psnr(a, b):
    mse = ((np.asarray(a, float) - np.asarray(b, float)) ** 2).mean()
    return 10 * np.log10(255 ** 2 / mse) if mse else 99.0


@pytest.mark.parametrize("fit, size, want", [("shorter-side", 100, (133, 100)), ("max-side", 128, (128, 96))])
def test_fast_bicubic_record_geometry_and_quality_against_lanczos(tmp_path, fit, size, want):
    import io

    path = _photo(tmp_path / "p.jpg", 400, 300)
    full = decode.open_rgb(path, decode.FULL_SIZE, "shorter-side")
    lanczos = full.resize(want, Image.Resampling.LANCZOS)
    records = {name: Image.open(io.BytesIO(decode.load_jpeg(path, size, 95, decode.FILTERS[name], fit=fit)))
               for name in ("lanczos", "fast-bicubic")}
    assert {r.size for r in records.values()} == {want}
    assert 38 < _psnr(records["fast-bicubic"], records["lanczos"]) < 99  # both resampled the same draft decode
    pixels = decode.resample_image(full, want, decode.FAST_BICUBIC)
    assert pixels.size == want and _psnr(pixels, lanczos) > 45  # the filter alone (FFCV's INTER_AREA: ~44 dB)
    pillow = np.asarray(full.resize(want, Image.Resampling.BICUBIC), int)
    assert np.abs(np.asarray(pixels, int) - pillow).max() <= 2  # Pillow's bicubic kernel, to the rounding


def test_max_side_record_is_never_upscaled_and_turns_upright(tmp_path):
    import io

    _halves(60, 40).save(tmp_path / "small.png")
    for name in decode.FILTERS:
        blob = decode.load_jpeg(tmp_path / "small.png", 100, 90, decode.FILTERS[name], fit="max-side")
        assert Image.open(io.BytesIO(blob)).size == (60, 40), name
    save_with_orientation(tmp_path / "r.jpg", quadrants(120, 80), 6)  # stored 80x120, shown 120x80
    blob = decode.load_jpeg(tmp_path / "r.jpg", 60, 90, decode.FAST_BICUBIC, fit="max-side")
    assert Image.open(io.BytesIO(blob)).size == (60, 40)
    with pytest.raises(ValueError, match="fit"):
        decode.load_jpeg(tmp_path / "r.jpg", 60, 90, fit="longer")


def test_fast_bicubic_falls_back_to_pillows_bicubic_for_a_crop_box_and_large_reductions(tmp_path):
    path = _photo(tmp_path / "p.png", 200, 150)
    for mode in ("center-crop", "squash"):  # center-crop resamples a fractional box: Pillow's bicubic, same kernel
        same = np.array_equal(decode.load_array(path, 64, mode, decode.FAST_BICUBIC),
                              decode.load_array(path, 64, mode, Image.Resampling.BICUBIC))
        assert same == (mode == "center-crop"), mode  # squash goes through torch: within rounding, not equal
    small = decode.resample_image(Image.open(path).convert("RGB"), (20, 15), decode.FAST_BICUBIC)  # 10x: reduce first
    ref = Image.open(path).convert("RGB").resize((20, 15), Image.Resampling.BICUBIC, reducing_gap=decode.REDUCING_GAP)
    assert np.array_equal(np.asarray(small), np.asarray(ref))


_FAST_BYTES = """
import hashlib, sys, torch
from fastdata.imaging import decode_file as decode
torch.set_num_threads(int(sys.argv[2]))
h = hashlib.sha256()
for size, fit in ((100, "max-side"), (100, "shorter-side"), (37, "max-side")):
    h.update(decode.load_jpeg(sys.argv[1], size, 90, decode.FAST_BICUBIC, fit=fit))
print(h.hexdigest(), torch.backends.cpu.get_cpu_capability())
"""


def test_fast_bicubic_bytes_are_the_same_for_every_cpu_kernel_and_thread_count(tmp_path):
    """NOTE [fast bicubic], rule 2: torch's SIMD kernels and its plain C one write the same bytes."""
    import os
    import subprocess
    import sys

    path = _photo(tmp_path / "p.jpg", 500, 375)
    runs = {}
    for capability, threads in (("default", 1), ("avx2", 2), ("", 1)):
        env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
        if capability:
            env["ATEN_CPU_CAPABILITY"] = capability
        out = subprocess.run([sys.executable, "-c", _FAST_BYTES, str(path), str(threads)], env=env, check=True,
                             capture_output=True, text=True).stdout.split()
        runs[(capability, threads)] = out
    assert runs[("default", 1)][1] == "DEFAULT"  # the plain C kernel really ran
    assert len({digest for digest, _ in runs.values()}) == 1, runs


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_fast_bicubic_uses_one_torch_thread_in_a_worker_process(tmp_path, method):
    import multiprocessing as mp

    import torch

    path = _photo(tmp_path / "p.jpg", 200, 150)
    threads = torch.get_num_threads()
    decode.load_jpeg(path, 64, 90, decode.FAST_BICUBIC)  # before the fork: the worker must check again
    assert torch.get_num_threads() == threads  # the main process keeps its setting
    with mp.get_context(method).Pool(1) as pool:
        assert pool.apply(_threads_after_fast_bicubic, (str(path),)) == 1


def _threads_after_fast_bicubic(path):
    import torch

    torch.set_num_threads(2)
    decode.load_jpeg(path, 64, 90, decode.FAST_BICUBIC)
    return torch.get_num_threads()


def test_preprocess_fast_bicubic_lmdb_is_identical_for_1_and_2_workers(photo_folder, tmp_path):
    import io

    import lmdb
    import torch

    from fastdata.cli.main import main
    from fastdata.formats.manifest import load_manifest

    stores = []
    for w in (1, 2):  # 2: forked workers, each resizing with torch on one thread
        out = tmp_path / f"w{w}"
        assert main(["preprocess", "images", str(photo_folder), str(out), "--format", "lmdb", "--size", "64",
                     "--workers", str(w), "--quiet", "--filter", "fast-bicubic"]) == 0
        params = load_manifest(out)["params"]  # the kernel is torch's: its version is in the fingerprint
        assert params["filter"] == "fast-bicubic" and params["torch"] == torch.__version__
        env = lmdb.open(str(out / "images-00000.lmdb"), subdir=False, readonly=True, lock=False)
        with env.begin() as txn:
            stores.append([v for _, v in txn.cursor()])
        env.close()
    assert stores[0] == stores[1] and len(stores[0]) == 42
    assert {Image.open(io.BytesIO(v)).size for v in stores[0]} == {(85, 64), (64, 85), (64, 64)}
