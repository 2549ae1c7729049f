"""The JPEG (LMDB) read path: libjpeg-turbo decoding with DCT scaling, Pillow as the fallback, and a
thread-safe first open of the store."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

RACE = textwrap.dedent('''
    import sys, threading
    from fastdata.formats.lmdb_store import LmdbReader

    path, threads = sys.argv[1], 8
    gate, errors = threading.Barrier(threads), []

    def first_read():
        gate.wait()  # every thread reaches the store's first open at the same moment
        try:
            assert len(LmdbReader(path).get_many([0])[0]) > 100
        except Exception as exc:
            errors.append(repr(exc))

    pool = [threading.Thread(target=first_read) for _ in range(threads)]
    [t.start() for t in pool]
    [t.join() for t in pool]
    sys.exit("; ".join(errors) or 0)
''')


def test_threads_opening_a_new_lmdb_at_once_all_read_it(indexed_datasets, tmp_path):
    # Before the lock, two threads could both miss the per-process cache and open the environment twice:
    # "lmdb.Error: The environment ... is already open in this process" (3 of 20 processes in one setup).
    script = tmp_path / "race.py"
    script.write_text(RACE)
    path = str(indexed_datasets["lmdb"] / "images.lmdb")
    procs = [subprocess.Popen([sys.executable, str(script), path], stderr=subprocess.PIPE, text=True)
             for _ in range(24)]
    failures = [p.communicate(timeout=120)[1] for p in procs if p.wait(timeout=120) != 0]
    assert not failures, failures[0][-2000:]


def _jpeg(arr, **kw) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "JPEG", quality=90, **kw)
    return buf.getvalue()


def _record(w: int = 341, h: int = 256) -> bytes:
    import numpy as np

    from fastdata.synthetic import synthetic_image

    return _jpeg(synthetic_image(np.random.default_rng(3), 1, 4, w, h))


def _psnr(a, b) -> float:
    import numpy as np

    mse = ((a.astype(float) - b.astype(float)) ** 2).mean()
    return 10 * np.log10(255 ** 2 / max(mse, 1e-12))


def test_a_record_at_its_stored_size_is_pillows_pixels_cut(monkeypatch):
    import io

    import numpy as np
    from PIL import Image

    from fastdata.decode import decode_jpeg

    data = _record()
    full = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    left = (341 - 256) // 2
    assert np.array_equal(decode_jpeg(data, 256), full[:, left:left + 256])
    monkeypatch.setitem(sys.modules, "simplejpeg", None)  # without simplejpeg: Pillow, the same pixels
    assert np.array_equal(decode_jpeg(data, 256), full[:, left:left + 256])


def test_a_256_record_served_at_224_is_decoded_at_seven_eighths_and_cut():
    import numpy as np
    import simplejpeg

    from fastdata import decode

    data = _record()
    scaled = simplejpeg.decode_jpeg(data, min_height=224)
    assert scaled.shape[:2] == (224, 299)  # libjpeg's 7/8 scale: the short side lands on 224 exactly
    out = decode.decode_jpeg(data, 224)
    assert np.array_equal(out, scaled[:, (299 - 224) // 2:][:, :224])  # cut, no resampling
    lanczos = decode.load_array(__import__("io").BytesIO(data), 224, "center-crop")  # the old path
    assert _psnr(out, lanczos) > 33


def test_other_scales_resize_the_scaled_square_with_the_right_geometry():
    import io

    import numpy as np

    from fastdata import decode

    data = _record(600, 450)
    halves = np.zeros((450, 600, 3), np.uint8)
    halves[:, 300:] = (0, 0, 255)  # left black, right blue: the centre square's halves stay halves
    sharp = _jpeg(halves)
    for size in (100, 160, 300, 500):  # 1/4 + resize, 3/8 + resize, 6/8 + resize, an upscale
        out = decode.decode_jpeg(data, size)
        assert out.shape == (size, size, 3) and out.dtype.name == "uint8" and out.flags.c_contiguous
        # PSNR against the old Pillow draft + Lanczos path on noisy synthetic content (RESULTS.md has the table)
        assert _psnr(out, decode.load_array(io.BytesIO(data), size, "center-crop")) > 20, size
        h = decode.decode_jpeg(sharp, size).astype(int)
        q = size // 8
        assert h[:, : 3 * q].max() < 40 and (h[:, -3 * q:, 2] > 215).all() and h[:, -3 * q:, :2].max() < 40


def test_gray_and_cmyk_records_decode_to_rgb_with_the_same_geometry():
    import io

    import numpy as np
    from PIL import Image

    from fastdata.decode import decode_jpeg

    gray = np.zeros((80, 120), np.uint8)
    gray[:, 60:] = 200
    out = decode_jpeg(_jpeg(gray), 80)  # libjpeg-turbo expands gray to RGB
    assert out.shape == (80, 80, 3) and (out[..., 0] == out[..., 2]).all()
    assert out[:, :15].max() < 20 and out[:, -15:].min() > 180
    rgb = np.zeros((80, 120, 3), np.uint8)
    rgb[:, 60:] = (0, 0, 255)
    buf = io.BytesIO()
    Image.fromarray(rgb).convert("CMYK").save(buf, "JPEG", quality=95)  # simplejpeg refuses CMYK: Pillow reads it
    out = decode_jpeg(buf.getvalue(), 80)
    assert out.shape == (80, 80, 3) and out[:, :15].max() < 30 and (out[:, -15:, 2] > 220).all()


@pytest.mark.parametrize("damage", ["cut", "zeros"])
def test_a_damaged_record_is_an_image_decode_error(damage):
    from fastdata.decode import decode_jpeg
    from fastdata.errors import ImageDecodeError

    data = _record()
    bad = data[: len(data) // 3] if damage == "cut" else bytes(32) + data[32:]
    with pytest.raises(ImageDecodeError):
        decode_jpeg(bad, 224)


def test_decoding_into_a_batch_row_gives_the_same_pixels():
    import numpy as np

    from fastdata.decode import decode_jpeg

    data = _record()
    for size in (224, 100):  # a cut at 7/8 scale, and a resize of a 1/2-scale square
        batch = np.full((3, size, size, 3), 7, np.uint8)
        assert decode_jpeg(data, size, out=batch[1]).base is batch  # the row itself, no copy of its own
        assert np.array_equal(batch[1], decode_jpeg(data, size))
        assert (batch[0] == 7).all() and (batch[2] == 7).all()  # the other rows untouched
