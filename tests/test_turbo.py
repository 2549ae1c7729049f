"""Partial JPEG decoding (NOTE [partial decode] in fastdata/imaging/turbojpeg.py): only the box is decoded, and its
pixels are exactly those cut from the whole fast decode, so the decoder never changes a batch."""
from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest
import simplejpeg
import torch
from PIL import Image

from fastdata.cli.synthetic import synthetic_image
from fastdata.imaging import decode_batch as jpeg_read, turbojpeg as turbo, turbojpeg_loop as turbo_loop

needs_library = pytest.mark.skipif(turbo.library() is None, reason="libturbojpeg 3 missing: pip install turbojpeg")


def _jpeg(arr: np.ndarray, **kw) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "JPEG", quality=90, **kw)
    return buf.getvalue()


def _photo(w: int, h: int, seed: int = 3) -> np.ndarray:
    return synthetic_image(np.random.default_rng(seed), 1, 4, w, h)


def _whole(data: bytes, d: int) -> np.ndarray:
    h, w, _, _ = simplejpeg.decode_jpeg_header(data)
    return simplejpeg.decode_jpeg(data, "RGB", fastdct=True, fastupsample=True,
                                  min_height=-(-h // d), min_width=-(-w // d))


RECORDS = {
    "420": _jpeg(_photo(341, 256)),
    "444": _jpeg(_photo(333, 250, 4), subsampling=0),
    "422": _jpeg(_photo(257, 301, 5), subsampling=1),
    "progressive": _jpeg(_photo(300, 227, 6), progressive=True),
    "gray": _jpeg(_photo(190, 263, 7)[..., 1]),
    "large": _jpeg(_photo(1001, 777, 8)),
}


@needs_library
@pytest.mark.parametrize("kind", sorted(RECORDS))
def test_a_decoded_box_is_the_same_box_cut_from_the_whole_decode(kind):
    data, rng = RECORDS[kind], np.random.default_rng(0)
    for d in (1, 2, 4, 8):
        whole = _whole(data, d)
        H, W = whole.shape[:2]
        boxes = [(0, 0, H, W), (H - 1, W - 1, 1, 1), (1, 3, H - 1, W - 3)]
        for _ in range(25):  # odd edges, any scaled iMCU offset, thin and wide boxes
            top, left = int(rng.integers(0, H)), int(rng.integers(0, W))
            boxes.append((top, left, int(rng.integers(1, H - top + 1)), int(rng.integers(1, W - left + 1))))
        for top, left, h, w in boxes:
            got = turbo.decode_region(data, d, (top, left, h, w))
            assert got is not None and got.shape == (h, w, 3), (kind, d, top, left, h, w, got is None)
            ref = whole[top:top + h, left:left + w]
            assert np.array_equal(got, ref), (kind, d, top, left, h, w, np.abs(got.astype(int) - ref).max())


@needs_library
def test_random_boxes_across_records_and_scales_interleaved_stay_exact():
    # one decompressor going from record to record and scale to scale, as a loader thread does: with the
    # box's top inside an iMCU row, libjpeg-turbo 3.0 gave a wrong row (and could crash) about once in 2,000
    rng = np.random.default_rng(0)
    kinds = sorted(RECORDS)
    wholes = {(k, d): _whole(RECORDS[k], d) for k in kinds for d in (1, 2, 4, 8)}
    for _ in range(4000):
        kind, d = kinds[rng.integers(len(kinds))], int(rng.choice([1, 2, 4, 8]))
        whole = wholes[kind, d]
        H, W = whole.shape[:2]
        top, left = int(rng.integers(0, H)), int(rng.integers(0, W))
        h, w = int(rng.integers(1, H - top + 1)), int(rng.integers(1, W - left + 1))
        got = turbo.decode_region(RECORDS[kind], d, (top, left, h, w))
        assert got is not None and np.array_equal(got, whole[top:top + h, left:left + w]), (kind, d, top, left, h, w)


@needs_library
def test_records_it_cannot_read_give_none_and_decode_jpeg_still_serves_or_reports_them():
    data = RECORDS["420"]
    cut = data[: len(data) // 2]
    assert turbo.decode_region(cut, 1, (200, 0, 10, 10)) is None  # the box lies past the cut: a warning
    assert turbo.decode_region(cut, 1, (0, 0, 10, 10)) is not None  # above it: never read, so unseen...
    with pytest.raises(jpeg_read.ImageDecodeError):  # ...which is why decode_jpeg screens for the end marker
        jpeg_read.decode_jpeg(cut, 8, box=(0, 0, 10, 10))
    assert turbo.decode_region(bytes(64) + data[64:], 1, (0, 0, 10, 10)) is None
    assert turbo.decode_region(data, 1, (200, 0, 100, 10)) is None  # the box leaves the image
    for view in (bytearray(data), memoryview(data)):  # any buffer, as simplejpeg takes
        assert np.array_equal(turbo.decode_region(view, 2, (3, 5, 20, 30)), _whole(data, 2)[3:23, 5:35])
        assert np.array_equal(jpeg_read.decode_jpeg(view, 100), jpeg_read.decode_jpeg(data, 100))
    buf = io.BytesIO()
    Image.fromarray(_photo(120, 80)).convert("CMYK").save(buf, "JPEG", quality=95)
    assert turbo.decode_region(buf.getvalue(), 1, (0, 0, 10, 10)) is None  # CMYK: Pillow converts it
    assert jpeg_read.decode_jpeg(buf.getvalue(), 64).shape == (64, 64, 3)


@needs_library
def test_a_record_with_a_bad_huffman_table_does_not_break_the_next_ones():
    data = RECORDS["420"]
    i = data.index(b"\xff\xc4")  # the first Huffman table, overwritten
    bad = data[:i + 4] + b"\xff" * 36 + data[i + 40:]
    assert turbo.decode_region(bad, 1, (0, 0, 10, 10)) is None
    for d in (1, 2):  # the thread's decompressor is replaced: later records decode as before
        assert np.array_equal(turbo.decode_region(data, d, (0, 0, 10, 10)), _whole(data, d)[:10, :10])


LOOPS = ["python", pytest.param("compiled", marks=pytest.mark.skipif(
    turbo_loop.loop() is None, reason="numba missing (pip install numba) or FASTDATA_NOGIL=0"))]


@pytest.fixture(params=LOOPS)
def batch_loop(request, monkeypatch):
    """decode_batch's loop over records: Python (turbo.decode_regions) or compiled (NOTE [nogil loop])."""
    monkeypatch.setenv(turbo_loop.ENV, "1" if request.param == "compiled" else "0")
    return request.param


def _cases(rng: np.random.Generator) -> list[tuple]:
    """(record, size, box, flip, fraction): centre squares, and random boxes as the training crop draws
    them, mirrored half the time."""
    cases = [(data, size, None, False, frac) for data in RECORDS.values() for size in (64, 112, 224)
             for frac in (1.0, 0.875)]
    for data in RECORDS.values():
        H, W = jpeg_read.jpeg_size(data)
        for _ in range(10):
            h, w = int(rng.integers(8, H + 1)), int(rng.integers(8, W + 1))
            box = (int(rng.integers(0, H - h + 1)), int(rng.integers(0, W - w + 1)), h, w)
            cases.append((data, int(rng.choice([32, 100, 224])), box, bool(rng.integers(2)), 1.0))
    return cases


@needs_library
def test_decode_jpeg_gives_the_same_rows_with_and_without_partial_decoding(monkeypatch, batch_loop):
    cases = _cases(np.random.default_rng(1))
    whole = []
    real = jpeg_read._decode_whole

    def counted(*a, **k):
        whole.append(a[2:4])
        return real(*a, **k)

    monkeypatch.setattr(jpeg_read, "_decode_whole", counted)
    partial = [jpeg_read.decode_jpeg(d, s, box=b, flip=f, fraction=fr) for d, s, b, f, fr in cases]
    assert whole == []  # every record's box was decoded by the partial decoder
    monkeypatch.setattr(turbo, "library", lambda: None)
    for (d, s, b, f, fr), got in zip(cases, partial):
        assert np.array_equal(got, jpeg_read.decode_jpeg(d, s, box=b, flip=f, fraction=fr)), (s, b, f, fr)


def _counting(monkeypatch, compiled) -> list[int]:
    """Serve decode_batch the compiled loop through a wrapper; returns the record each call started at."""
    calls = []

    def run(*a):
        calls.append(a[10])
        return compiled.run(*a)

    monkeypatch.setattr(turbo_loop, "loop", lambda: SimpleNamespace(run=run, functions=compiled.functions))
    return calls


@needs_library
@pytest.mark.parametrize("size", [224, 100])
def test_the_compiled_loop_fills_a_batch_with_the_bytes_of_the_python_loop(monkeypatch, size):
    # one batch mixing every kind of record, boxes of the output size (copied, mirrored or not) and boxes
    # to resize (more than the arena's slots), a record TurboJPEG refuses mid-batch (its handle replaced; the
    # whole-image way then refuses it too, after every other box is in) and a CMYK one the plan leaves out
    # (decoded the whole-image way), run compiled and as plain Python
    compiled = turbo_loop.loop()
    if compiled is None:
        pytest.skip("numba missing (pip install numba) or FASTDATA_NOGIL=0")
    data = RECORDS["420"]
    i = data.index(b"\xff\xda") + 500
    bad = data[:i] + b"\xff\xd3" + data[i + 2:]  # a stray restart marker: TurboJPEG warns (Pillow decoded it)
    buf = io.BytesIO()
    Image.fromarray(_photo(300, 260)).convert("CMYK").save(buf, "JPEG", quality=95)
    rng = np.random.default_rng(size)
    blobs, boxes = [], []
    for j in range(48):
        kind = sorted(RECORDS)[j % len(RECORDS)]
        blob = bad if j == 17 else buf.getvalue() if j == 11 else RECORDS[kind]  # (CMYK: decoded before 17)
        H, W = jpeg_read.jpeg_size(blob)
        side = size if j % 2 else int(rng.integers(8, min(H, W) + 1))  # half copied, half resized
        side = min(side, H, W)
        blobs.append(memoryview(blob) if j % 4 < 2 else blob)
        boxes.append((int(rng.integers(0, H - side + 1)), int(rng.integers(0, W - side + 1)), side, side))
    flips = rng.integers(0, 2, len(blobs)).astype(bool)
    out = {}
    for name in ("python", "compiled", "uncompiled"):
        if name == "compiled":
            calls = _counting(monkeypatch, compiled)
        elif name == "uncompiled":
            monkeypatch.setattr(turbo_loop, "loop", lambda: SimpleNamespace(run=turbo_loop._run,
                                                                            functions=compiled.functions))
        x = torch.zeros((len(blobs), size, size, 3), dtype=torch.uint8)
        monkeypatch.setenv(turbo_loop.ENV, "0" if name == "python" else "1")
        with pytest.raises(jpeg_read.ImageDecodeError, match="libjpeg-turbo: Corrupt JPEG data") as err:
            jpeg_read.decode_batch(blobs, size, x, boxes=np.array(boxes), flips=flips)
        assert err.value.position == 17
        out[name] = x
    assert torch.equal(out["compiled"], out["python"]) and torch.equal(out["uncompiled"], out["python"])
    assert out["python"][11].float().std() > 5 and (out["python"][18:].flatten(1).float().std(1) > 5).all()
    assert sum(b[2] != size for b in boxes[:17]) > turbo_loop.ARENA_SLOTS  # so the arena fills before 17
    assert len(calls) > 2 and calls[0] == 0  # handed back at a full arena (and at the refusal)
    assert 17 + 1 in calls  # the loop went on after the refused record with a fresh handle


@needs_library
def test_a_batch_of_centre_crops_is_one_call_of_the_compiled_loop(monkeypatch):
    # the point of NOTE [nogil loop]: a batch whose boxes need no resize releases the GIL once
    compiled = turbo_loop.loop()
    if compiled is None:
        pytest.skip("numba missing (pip install numba) or FASTDATA_NOGIL=0")
    calls = _counting(monkeypatch, compiled)
    blobs = [RECORDS["420"], _jpeg(_photo(256, 300, 9)), _jpeg(_photo(400, 256, 10), subsampling=0),
             _jpeg(_photo(256, 256, 11)[..., 0])] * 16  # short side 256: centre boxes of 224, no resize
    x = torch.empty((len(blobs), 224, 224, 3), dtype=torch.uint8)
    jpeg_read.decode_batch(blobs, 224, x, fraction=0.875)
    assert calls == [0]
    monkeypatch.setattr(turbo_loop, "loop", lambda: None)  # the Python loop, for reference
    y = torch.empty_like(x)
    jpeg_read.decode_batch(blobs, 224, y, fraction=0.875)
    assert torch.equal(x, y)


@needs_library
def test_threads_decode_with_handles_of_their_own():
    data, d = RECORDS["large"], 2
    whole = _whole(data, d)
    boxes = [(t, l, 100, 150) for t in range(0, 280, 7) for l in range(0, 340, 11)]

    def one(box, scratch):
        t, l, h, w = box
        return np.array_equal(turbo.decode_region(data, d, box, scratch=scratch), whole[t:t + h, l:l + w])

    with ThreadPoolExecutor(8) as pool:  # each thread's scratch buffer too is its own
        assert all(pool.map(one, boxes * 3, [False, True, True] * len(boxes)))


@needs_library
def test_scratch_decodes_reuse_one_buffer_per_thread_and_grow_for_larger_boxes():
    data, whole = RECORDS["large"], _whole(RECORDS["large"], 1)
    first = turbo.decode_region(data, 1, (0, 0, 16, 16), scratch=True)
    kept = first.copy()
    assert np.array_equal(kept, whole[:16, :16])
    second = turbo.decode_region(data, 1, (32, 48, 16, 16), scratch=True)
    assert np.array_equal(second, whole[32:48, 48:64])
    assert np.shares_memory(first, second) and not np.array_equal(first, kept)  # the first view was reused
    big = turbo.decode_region(data, 1, (0, 0) + whole.shape[:2], scratch=True)  # larger than the first buffer
    assert np.array_equal(big, whole)
    assert not np.shares_memory(turbo.decode_region(data, 1, (0, 0, 16, 16)), big)  # without scratch: fresh


def test_the_environment_variable_turns_partial_decoding_off_or_names_the_library(tmp_path):
    code = "from fastdata.imaging import turbojpeg as turbo; print(turbo.library() is None)"
    env = dict(os.environ, FASTDATA_TURBOJPEG="0")
    off = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert off.stdout.strip() == "True"
    env[turbo.ENV] = str(tmp_path / "libnothing.so")  # a path that is not a library: no partial decoding
    bad = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert bad.stdout.strip() == "True"
    if turbo.library() is not None:
        env[turbo.ENV] = turbo.library().path
        named = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert named.stdout.strip() == "False"


@needs_library
def test_a_loop_numba_cannot_compile_leaves_the_python_loop_in_place(monkeypatch):
    pytest.importorskip("numba")

    def uncompilable(*args):  # nopython mode has no object(): a TypingError at compile time
        return object()

    warned = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warned.append(record.getMessage())  # type: ignore[method-assign]
    monkeypatch.setattr(turbo_loop, "_run", uncompilable)
    turbo_loop._compiled.cache_clear()
    turbo_loop.log.addHandler(handler)
    try:
        assert turbo_loop.loop() is None
        assert any("could not compile the JPEG decode loop" in m for m in warned)
        x = torch.empty((1, 64, 64, 3), dtype=torch.uint8)
        jpeg_read.decode_batch([RECORDS["420"]], 64, x)  # served by the Python loop
        assert torch.equal(x[0], torch.from_numpy(jpeg_read.decode_jpeg(RECORDS["420"], 64)))
    finally:
        turbo_loop.log.removeHandler(handler)
        turbo_loop._compiled.cache_clear()


def test_a_record_simplejpeg_cannot_read_the_header_of_falls_back_to_pillow():
    # 4:4:1 subsampling (libjpeg-turbo 3's TJSAMP_441): simplejpeg's header raises KeyError(6), which escaped the
    # whole-image decode (every record without libturbojpeg 3, any record the partial decoder refuses)
    import ctypes

    lib = turbo.library()
    if lib is None:
        pytest.skip("needs libturbojpeg 3 (the jpeg extra) to write a 4:4:1 JPEG")
    tj = ctypes.CDLL(lib.path)
    tj.tj3Init.restype, tj.tj3Init.argtypes = ctypes.c_void_p, [ctypes.c_int]
    tj.tj3Set.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    tj.tj3Compress8.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t)]
    tj.tj3Free.argtypes, tj.tj3Destroy.argtypes = [ctypes.c_void_p], [ctypes.c_void_p]
    pixels = np.ascontiguousarray(_photo(160, 120))
    handle = tj.tj3Init(0)  # (TJINIT_COMPRESS)
    tj.tj3Set(handle, 3, 95)  # TJPARAM_QUALITY
    tj.tj3Set(handle, 4, 6)  # TJPARAM_SUBSAMP: TJSAMP_441
    buf, size = ctypes.c_void_p(), ctypes.c_size_t(0)
    assert tj.tj3Compress8(handle, pixels.ctypes.data, 160, 160 * 3, 120, 0, ctypes.byref(buf), ctypes.byref(size)) == 0
    record = ctypes.string_at(buf, size.value)
    tj.tj3Free(buf)
    tj.tj3Destroy(handle)
    with pytest.raises(KeyError):
        simplejpeg.decode_jpeg_header(record)  # (what this test is about; else it tests nothing)
    assert jpeg_read.turbo_decode(record) is None  # (Pillow's turn)
    got = jpeg_read.decode_jpeg(record, 32)
    want = jpeg_read.decode_jpeg(_jpeg(pixels), 32)  # (the same picture, subsampled as Pillow does)
    assert got.shape == (32, 32, 3) and np.abs(got.astype(int) - want.astype(int)).mean() < 4  # (2.1; other: ~50)


def test_turbo_decode_names_damage_and_leaves_pillow_only_what_it_cannot_give_as_rgb():
    # It returned None for any record simplejpeg refused, and Pillow then decoded damage loosely (NOTE [damaged
    # records]): now None only for a whole CMYK record (read at 1/8 scale first) or a header it cannot describe
    data = RECORDS["420"]
    cut = data[: len(data) // 2] + b"\xff\xd9"  # whole by its markers
    with pytest.raises(jpeg_read.ImageDecodeError, match="libjpeg-turbo: Corrupt JPEG data: premature end"):
        jpeg_read.turbo_decode(cut, 2)
    i = data.index(b"\xff\xdb")
    with pytest.raises(jpeg_read.ImageDecodeError, match="2 extraneous bytes before marker 0xdb"):
        jpeg_read.turbo_decode(data[:i] + b"\x00\x00" + data[i:])  # (Pillow decodes it)
    buf = io.BytesIO()
    Image.fromarray(_photo(120, 80)).convert("CMYK").save(buf, "JPEG", quality=95)
    cmyk = buf.getvalue()
    assert jpeg_read.turbo_decode(cmyk) is None  # whole: Pillow converts it
    with pytest.raises(jpeg_read.ImageDecodeError, match="premature end"):
        jpeg_read.turbo_decode(cmyk[: len(cmyk) // 2] + b"\xff\xd9")
    assert np.array_equal(jpeg_read.turbo_decode(data, 2), _whole(data, 2))


def test_a_damaged_record_in_a_batch_is_refused_at_its_position_by_either_loop(batch_loop):
    good, half = RECORDS["420"], RECORDS["444"][: len(RECORDS["444"]) // 2]
    x = torch.zeros((3, 64, 64, 3), dtype=torch.uint8)
    above_the_cut = np.array([[0, 0, 200, 200], [0, 0, 40, 40], [10, 10, 100, 100]])
    # cut with an end marker: the partial decoder meets the cut (the centre square reaches it) and refuses it;
    # cut without one: screened out by the end marker, decoded whole, even for a box above the cut
    for bad, boxes in ((half + b"\xff\xd9", None), (half, None), (half, above_the_cut)):
        with pytest.raises(jpeg_read.ImageDecodeError, match="libjpeg-turbo: .*[Pp]remature end") as err:
            jpeg_read.decode_batch([good, bad, good], 64, x, boxes=boxes)
        assert err.value.position == 1
