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
    path = str(indexed_datasets["lmdb"] / "images-00000.lmdb")
    procs = [subprocess.Popen([sys.executable, str(script), path], stderr=subprocess.PIPE, text=True)
             for _ in range(24)]
    failures = [p.communicate(timeout=120)[1] for p in procs if p.wait(timeout=120) != 0]
    assert not failures, failures[0][-2000:]


FORK = textwrap.dedent('''
    import multiprocessing as mp, sys
    from fastdata.formats.lmdb_store import LmdbReader

    def child(path, out):
        try:
            out.put(bytes(LmdbReader(path).get_many([1])[0]))
        except Exception as exc:
            out.put(repr(exc))

    path = sys.argv[1]
    reader = LmdbReader(path)
    with reader.views([0, 1]) as held:  # a read transaction open when the process forks
        ctx = mp.get_context("fork")
        out = ctx.Queue()
        worker = ctx.Process(target=child, args=(path, out))
        worker.start()
        got = out.get(timeout=60)
        worker.join()
        sys.exit(0 if got == bytes(held[1]) else f"the forked child read {got!r:.300}")
''')


def test_a_forked_child_reads_a_store_its_parent_holds_a_transaction_on(indexed_datasets, tmp_path):
    # A DataLoader worker forked while a loader thread (or DALILoader's planned batch) holds a read
    # transaction inherits it; the child must still open the store (py-lmdb refuses a second open of the
    # same files while the inherited environment lives, so the child closes what it inherited).
    script = tmp_path / "fork.py"
    script.write_text(FORK)
    path = str(indexed_datasets["lmdb"] / "images-00000.lmdb")
    done = subprocess.run([sys.executable, str(script), path], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (done.stdout + done.stderr)[-2000:]


def _jpeg(arr, **kw) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "JPEG", quality=90, **kw)
    return buf.getvalue()


def _record(w: int = 341, h: int = 256) -> bytes:
    import numpy as np

    from fastdata.cli.synthetic import synthetic_image

    return _jpeg(synthetic_image(np.random.default_rng(3), 1, 4, w, h))


def _psnr(a, b) -> float:
    import numpy as np

    mse = ((a.astype(float) - b.astype(float)) ** 2).mean()
    return 10 * np.log10(255 ** 2 / max(mse, 1e-12))


def _fast(data):
    import simplejpeg

    return simplejpeg.decode_jpeg(data, "RGB", fastdct=True, fastupsample=True)


def test_a_record_at_its_stored_size_is_the_fast_decode_cut_and_pillow_agrees(monkeypatch):
    import io

    import numpy as np
    from PIL import Image

    from fastdata.imaging import turbojpeg as turbo
    from fastdata.imaging.decode_batch import decode_jpeg

    data = _record()
    left = (341 - 256) // 2
    out = decode_jpeg(data, 256)
    assert np.array_equal(out, _fast(data)[:, left:left + 256])  # a cut: no resampling
    accurate = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))[:, left:left + 256]
    assert 38 < _psnr(out, accurate) < 80  # the fast IDCT differs from Pillow's accurate one, slightly
    monkeypatch.setitem(sys.modules, "simplejpeg", None)  # without libjpeg-turbo: Pillow, the same box
    monkeypatch.setattr(turbo, "library", lambda: None)
    assert np.array_equal(decode_jpeg(data, 256), accurate)


def test_the_eval_crop_fraction_cuts_the_centre_224_of_a_256_record_without_resampling():
    import numpy as np
    from PIL import Image

    from fastdata.imaging import decode_batch as jpeg_read

    data = _record()
    assert jpeg_read.center_box(256, 341, 224 / 256) == (16, 58, 224, 224)
    assert np.array_equal(jpeg_read.decode_jpeg(data, 224, fraction=224 / 256), _fast(data)[16:240, 58:282])
    # the whole short side at 224: a full decode, resized (7/8 DCT scaling is slower: see NOTE [jpeg read path])
    out = jpeg_read.decode_jpeg(data, 224)
    lanczos = Image.fromarray(np.ascontiguousarray(_fast(data)[:, 42:298])).resize((224, 224), Image.LANCZOS)
    assert _psnr(out, np.asarray(lanczos)) > 38  # the cheap filter against Lanczos on the same pixels


def test_dct_scaling_is_used_only_at_half_or_less_and_keeps_the_geometry():
    import io

    import numpy as np

    from fastdata.imaging import decode_batch as jpeg_read, decode_file as decode

    assert jpeg_read.dct_denominator(256, 341, 224) == 1  # 7/8 would fit but is slower than a full decode
    assert jpeg_read.dct_denominator(450, 450, 224) == 2 and jpeg_read.dct_denominator(450, 600, 100) == 4
    assert jpeg_read.dct_denominator(900, 900, 100) == 8 and jpeg_read.dct_denominator(100, 900, 100) == 1
    data = _record(600, 450)
    assert jpeg_read.turbo_decode(data, 4).shape == (113, 150, 3)  # libjpeg rounds scaled sizes up
    halves = np.zeros((450, 600, 3), np.uint8)
    halves[:, 300:] = (0, 0, 255)  # left black, right blue: the centre square's halves stay halves
    sharp = _jpeg(halves)
    for size in (100, 160, 300, 500):  # 1/4 + resize, 1/2 + resize, full + resize, an upscale
        out = jpeg_read.decode_jpeg(data, size)
        assert out.shape == (size, size, 3) and out.dtype.name == "uint8" and out.flags.c_contiguous
        # PSNR against the old Pillow draft + Lanczos path on noisy synthetic content (RESULTS.md has the table)
        assert _psnr(out, decode.load_array(io.BytesIO(data), size, "center-crop")) > 20, size
        h = jpeg_read.decode_jpeg(sharp, size).astype(int)
        q = size // 8
        assert h[:, : 3 * q].max() < 40 and (h[:, -3 * q:, 2] > 215).all() and h[:, -3 * q:, :2].max() < 40


def test_a_box_is_resized_with_antialiased_bilinear_and_mirrored():
    import numpy as np
    import torch
    import torch.nn.functional as F

    from fastdata.imaging.decode_batch import decode_jpeg

    data = _record()
    box = (10, 20, 200, 150)  # top, left, height, width in stored pixels
    crop = torch.from_numpy(_fast(data)[10:210, 20:170]).permute(2, 0, 1)[None]
    ref = F.interpolate(crop, size=(96, 96), mode="bilinear", antialias=True)[0].permute(1, 2, 0).numpy()
    assert np.array_equal(decode_jpeg(data, 96, box=box), ref)  # box < 2x the output: a full decode
    assert np.array_equal(decode_jpeg(data, 96, box=box, flip=True), ref[:, ::-1])
    rng = np.random.default_rng(0)  # mirrored before the resize: exactly the resized box mirrored, any geometry
    for _ in range(40):
        h, w = int(rng.integers(20, 256)), int(rng.integers(20, 341))
        b, size = (int(rng.integers(0, 257 - h)), int(rng.integers(0, 342 - w)), h, w), int(rng.integers(16, 300))
        assert np.array_equal(decode_jpeg(data, size, box=b, flip=True), decode_jpeg(data, size, box=b)[:, ::-1])
    small = F.interpolate(crop, size=(64, 64), mode="bilinear", antialias=True)[0].permute(1, 2, 0).numpy()
    assert _psnr(decode_jpeg(data, 64, box=box), small) > 30  # box >= 2x: decoded at 1/2, the same picture
    exact = (5, 7, 64, 64)  # a box of the output size: a cut, mirrored when asked
    assert np.array_equal(decode_jpeg(data, 64, box=exact, flip=True), _fast(data)[5:69, 7:71][:, ::-1])
    quadrant = np.zeros((256, 340, 3), np.uint8)
    quadrant[128:, 170:] = 255  # only the bottom-right quarter is white
    white = decode_jpeg(_jpeg(quadrant), 32, box=(140, 190, 100, 120))
    black = decode_jpeg(_jpeg(quadrant), 32, box=(0, 0, 110, 160))
    assert white.min() > 235 and black.max() < 20  # boxes land where they were drawn, in stored pixels


def test_gray_and_cmyk_records_decode_to_rgb_with_the_same_geometry():
    import io

    import numpy as np
    from PIL import Image

    from fastdata.imaging.decode_batch import decode_jpeg

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
    from fastdata.errors import ImageDecodeError
    from fastdata.imaging.decode_batch import decode_jpeg

    data = _record()
    bad = data[: len(data) // 3] if damage == "cut" else bytes(32) + data[32:]
    with pytest.raises(ImageDecodeError):
        decode_jpeg(bad, 224)


def test_decoding_into_a_batch_row_gives_the_same_pixels():
    import numpy as np

    from fastdata.imaging.decode_batch import decode_jpeg

    data = _record()
    for size in (224, 100):  # a resize of the full decode, and of a 1/2-scale square
        batch = np.full((3, size, size, 3), 7, np.uint8)
        assert decode_jpeg(data, size, out=batch[1]).base is batch  # the row itself, no copy of its own
        assert np.array_equal(batch[1], decode_jpeg(data, size))
        assert (batch[0] == 7).all() and (batch[2] == 7).all()  # the other rows untouched


@pytest.fixture(scope="module")
def photo_lmdb(tmp_path_factory):
    """30 photo-like JPEGs (landscape, portrait, square) stored at shorter side 80 in an LMDB."""
    from fastdata.cli.main import main
    from fastdata.cli.synthetic import make_image_folder

    base = tmp_path_factory.mktemp("photo-lmdb")
    make_image_folder(base / "src", num_classes=3, per_class=10, sizes=((120, 90), (90, 120), (100, 100)))
    assert main(["preprocess", "images", str(base / "src"), str(base / "lmdb"), "--size", "80", "--format", "lmdb",
                 "--workers", "1", "--quiet"]) == 0
    return base / "lmdb"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_decode_time_crops_draw_exactly_what_the_batched_gpu_transform_draws(device):
    import numpy as np
    import torch

    from fastdata.imaging.draws import Draws, batch_seed, draw_resized_crops
    from fastdata.imaging.transforms import RandomHorizontalFlip, RandomResizedCrop

    key = (5, 2, 64, 1)
    boxes, flips = draw_resized_crops(key, np.array([[80, 107]] * 16))
    draws = Draws(batch_seed(*key))  # what CUDAPrefetcher hands Compose([RRC, flip]) for this batch
    x = torch.zeros(16, 3, 80, 107, dtype=torch.uint8, device=device)
    gpu_boxes = RandomResizedCrop(32).params(x, draws)
    gpu_flips = RandomHorizontalFlip().params(x, draws)
    assert gpu_boxes.device.type == device
    assert np.array_equal(boxes, gpu_boxes.long().cpu().numpy()) and np.array_equal(flips, gpu_flips.cpu().numpy())
    assert 0 < flips.sum() < 16 and len({tuple(b) for b in boxes.tolist()}) == 16


def _served(loader, epochs=1):
    out = []
    for _ in range(epochs):
        out += [(x.clone(), y.clone()) for x, y in loader]
    return out


def test_fastloader_random_crops_are_the_drawn_boxes_decoded(photo_lmdb):
    import numpy as np

    from fastdata.datasets.images import FastDataset
    from fastdata.formats.lmdb_store import open_lmdb
    from fastdata.imaging.decode_batch import decode_jpeg, jpeg_size
    from fastdata.imaging.draws import draw_resized_crops
    from fastdata.loading.loader import FastLoader

    ds = FastDataset(photo_lmdb, size=48, crop="random")
    assert ds.sample_shape == (48, 48, 3) and ds.random_crops
    loader = FastLoader(ds, 8, seed=3, num_threads=2, rank=1, world_size=2)
    reader = open_lmdb(photo_lmdb, ds.manifest)
    order = loader.sampler.rank_indices()
    for k, (x, y) in enumerate(_served(loader)):
        idx = np.sort(order[k * 8:(k + 1) * 8])
        blobs = reader.get_many(idx)
        boxes, flips = draw_resized_crops((3, 0, k * 8 * 2, 1), np.array([jpeg_size(b) for b in blobs]))
        want = np.stack([decode_jpeg(b, 48, box=tuple(bx), flip=f) for b, bx, f in zip(blobs, boxes.tolist(), flips)])
        assert np.array_equal(x.numpy(), want), k
        assert np.array_equal(y.numpy(), ds.targets[idx])


def test_random_crops_survive_resume_and_thread_counts_and_change_with_the_epoch(photo_lmdb):
    import torch

    from fastdata.datasets.images import FastDataset
    from fastdata.loading.loader import FastLoader

    ds = FastDataset(photo_lmdb, size=40, crop="random")
    whole = _served(FastLoader(ds, 4, seed=1, num_threads=1), epochs=2)
    first = FastLoader(ds, 4, seed=1, num_threads=3)
    it = iter(first)
    head = [tuple(t.clone() for t in next(it)) for _ in range(3)]
    state = first.state_dict()
    resumed = FastLoader(ds, 4, seed=1, num_threads=2)
    resumed.load_state_dict(state)
    rest = _served(resumed, epochs=2)[: len(whole) - 3]
    for (a, ya), (b, yb) in zip(whole, head + rest):
        assert torch.equal(a, b) and torch.equal(ya, yb)
    n = len(whole) // 2
    assert not torch.equal(torch.cat([x for x, _ in whole[:n]]), torch.cat([x for x, _ in whole[n:]]))


def test_random_crop_boxes_cover_the_whole_stored_image_not_its_centre_square():
    import numpy as np

    from fastdata.imaging.draws import draw_resized_crops

    boxes, _ = draw_resized_crops((0, 0, 0, 0), np.array([[80, 107]] * 4000))
    top, left, h, w = boxes.T
    assert (top >= 0).all() and (left >= 0).all() and (top + h <= 80).all() and (left + w <= 107).all()
    square = ((107 - 80) // 2, (107 - 80) // 2 + 80)
    assert (left < square[0]).mean() > 0.05 and (left + w > square[1]).mean() > 0.05


def test_random_crops_without_fastloader_and_their_misuse(photo_lmdb, indexed_datasets):
    import torch

    from fastdata.datasets.images import FastDataset
    from fastdata.errors import ConfigError

    ds = FastDataset(photo_lmdb, size=32, crop="random")
    torch.manual_seed(0)
    a = ds[3][0].clone()
    torch.manual_seed(0)
    assert torch.equal(a, ds[3][0]) and a.shape == (32, 32, 3)  # torch's generator, seeded as usual
    batch = next(iter(torch.utils.data.DataLoader(ds, batch_size=5)))
    assert batch[0].shape == (5, 32, 32, 3)
    with pytest.raises(ConfigError, match="GPU"):
        FastDataset(indexed_datasets["npy"], crop="random")
    with pytest.raises(ConfigError, match="crop"):
        FastDataset(photo_lmdb, crop="centre")
    with pytest.raises(ConfigError, match="crop_fraction"):
        FastDataset(photo_lmdb, crop_fraction=1.5)


def test_a_version_1_lmdb_dataset_one_store_still_loads(indexed_datasets, tmp_path):
    """Datasets made before LMDB shards (format version 1: one images.lmdb) give the same batches."""
    import hashlib
    import json

    import lmdb
    import torch

    from fastdata.datasets.images import FastDataset
    from fastdata.formats.lmdb_store import open_lmdb
    from fastdata.loading.loader import FastLoader

    v2 = indexed_datasets["lmdb"]
    manifest = json.loads((v2 / "manifest.json").read_text())
    old = tmp_path / "v1"
    old.mkdir()
    (old / "labels.npy").write_bytes((v2 / "labels.npy").read_bytes())
    records = open_lmdb(v2, manifest).get_many(range(manifest["num_samples"]))
    env = lmdb.open(str(old / "images.lmdb"), subdir=False, map_size=64 << 20, lock=False)
    with env.begin(write=True) as txn:
        for i, blob in enumerate(records):
            txn.put(b"%012d" % i, blob)
    env.close()
    files = [{"path": n, "bytes": (old / n).stat().st_size,
              "sha256": hashlib.sha256((old / n).read_bytes()).hexdigest()} for n in ("images.lmdb", "labels.npy")]
    for k in ("lmdb_shards", "shard_size"):
        manifest.pop(k)
    manifest.update(format_version=1, lmdb="images.lmdb", files=files)
    (old / "manifest.json").write_text(json.dumps(manifest))
    got = [x.clone() for x, _ in FastLoader(FastDataset(old, size=8), 16, seed=1, num_threads=2)]
    want = [x.clone() for x, _ in FastLoader(FastDataset(v2, size=8), 16, seed=1, num_threads=2)]
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))


def test_record_views_are_the_records_read_without_a_copy_across_shards(indexed_datasets):
    import json

    from fastdata.formats.lmdb_store import open_lmdb
    from fastdata.imaging.decode_batch import looks_like_jpeg

    root = indexed_datasets["lmdb"]
    reader = open_lmdb(root, json.loads((root / "manifest.json").read_text()))
    assert len(reader.paths) > 2  # the rows below come from several stores
    idx = [99, 3, 40, 3, 17, 64]  # any order, repeats allowed
    copies = reader.get_many(idx)
    with reader.views(idx) as views:
        assert all(isinstance(v, memoryview) for v in views)  # pages of the memory map, not copies
        assert [bytes(v) for v in views] == copies
        assert all(looks_like_jpeg(v) for v in views)
    assert all(isinstance(c, bytes) for c in copies)


def test_the_end_marker_screen_reads_any_buffer_and_allows_zero_padding():
    from fastdata.imaging.decode_batch import looks_like_jpeg

    data = b"\xff\xd8" + bytes(range(256)) * 4 + b"\xff\xd9"
    for pad in (0, 10, 100):  # padding past the 64 bytes looked at first
        for buf in (data + bytes(pad), memoryview(data + bytes(pad)), bytearray(data + bytes(pad))):
            assert looks_like_jpeg(buf)
    for bad in (data[:-2], data[:-1] + bytes(100), b"\xff\xd9" + data[2:], bytes(8), b"\xff\xd8"):
        assert not looks_like_jpeg(memoryview(bad)) and not looks_like_jpeg(bad)


def test_a_header_claiming_a_huge_image_is_refused_before_anything_is_decoded():
    import struct

    import numpy as np
    import pytest

    from fastdata.errors import ImageDecodeError
    from fastdata.imaging.decode_batch import decode_jpeg, jpeg_header

    data = bytearray(_record())
    sof = data.index(b"\xff\xc0")
    data[sof + 5:sof + 9] = struct.pack(">HH", 60000, 60000)  # a damaged frame header: 3.6 gigapixels
    assert jpeg_header(bytes(data))[:2] == (60000, 60000)
    for box in (None, (0, 0, 300, 300), (0, 0, 60000, 60000)):  # centre crop, a small box, the whole image
        with pytest.raises(ImageDecodeError, match="exceeds limit|decompression bomb"):
            decode_jpeg(bytes(data), 224, box=box)
    assert np.array_equal(decode_jpeg(_record(), 224), decode_jpeg(_record(), 224))  # the handle still works


def _damaged(kind: str) -> bytes:
    """A record damaged past its frame header, as a writer's bug or a disk may leave it (NOTE [damaged records])."""
    import io
    import struct

    from PIL import Image

    data = _record(300, 200)
    if kind == "cut_then_end_marker":  # whole by its markers: the end-marker screen passes it
        return data[: len(data) // 2] + b"\xff\xd9"
    if kind == "progressive_cut_then_end_marker":
        prog = _jpeg(_photo_array(300, 200), progressive=True)
        return prog[:3000] + b"\xff\xd9"
    if kind == "size_field_smaller":  # the frame header says 150 x 100: the data runs past its last block
        sof = data.index(b"\xff\xc0")
        return data[:sof + 5] + struct.pack(">HH", 100, 150) + data[sof + 9:]
    if kind == "cmyk_cut_then_end_marker":
        buf = io.BytesIO()
        Image.fromarray(_photo_array(300, 200)).convert("CMYK").save(buf, "JPEG", quality=90)
        return buf.getvalue()[: len(buf.getvalue()) // 2] + b"\xff\xd9"
    raise ValueError(kind)


def _photo_array(w: int, h: int):
    import numpy as np

    from fastdata.cli.synthetic import synthetic_image

    return synthetic_image(np.random.default_rng(3), 1, 4, w, h)


@pytest.mark.parametrize("partial", [True, False], ids=["partial_decoder", "whole_image"])
@pytest.mark.parametrize("kind, needle", [
    ("cut_then_end_marker", "premature end of data segment"),
    ("progressive_cut_then_end_marker", "premature end of data segment"),
    ("size_field_smaller", "extraneous bytes before marker 0xd9"),
    ("cmyk_cut_then_end_marker", "premature end of data segment")])
def test_a_record_damaged_past_its_header_is_refused_not_decoded_loosely_by_pillow(monkeypatch, kind, needle, partial):
    # Pillow decoded them without a word: grey below the cut, garbled after out-of-place bytes
    from fastdata.errors import ImageDecodeError
    from fastdata.imaging import turbojpeg as turbo
    from fastdata.imaging.decode_batch import decode_jpeg

    if not partial:
        monkeypatch.setattr(turbo, "library", lambda: None)
    for size in (32, 224):  # at a libjpeg scale of 1/4, and unscaled
        with pytest.raises(ImageDecodeError, match=f"libjpeg-turbo: Corrupt JPEG data: .*{needle}"):
            decode_jpeg(_damaged(kind), size)


def test_a_header_over_twice_pillows_limit_is_refused_before_decoding_and_one_under_it_is_read(monkeypatch):
    # Over twice the limit Pillow refuses, and so does preprocessing: such a header is damaged, refused before
    # anything is decoded. Between the limit and twice it Pillow only warns, so preprocessing writes such
    # records, and they are read (a damaged header there is refused by the manifest's bounds, or by the strict
    # decode). (The limit is lowered here so the test stays cheap.)
    import struct
    import warnings

    from PIL import Image

    from fastdata.errors import ImageDecodeError
    from fastdata.imaging.decode_batch import decode_jpeg

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100_000)
    data = bytearray(_jpeg(_photo_array(80, 60)))
    sof = data.index(b"\xff\xc0")
    data[sof + 5:sof + 9] = struct.pack(">HH", 500, 500)  # 250,000 pixels: 2.5 times the limit
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no DecompressionBombWarning either: nothing reaches Pillow)
        for box in (None, (0, 0, 50, 50)):
            with pytest.raises(ImageDecodeError, match=r"500 x 500 pixels, 250000 pixels: it exceeds limit of 200000 "
                                                       r"pixels \(twice PIL\.Image\.MAX_IMAGE_PIXELS"):
                decode_jpeg(bytes(data), 64, box=box)
    # 160,000 pixels, 1.6 times the limit: Pillow only warns, so preprocessing writes such a record (a long
    # panorama at a large --size), and the reader takes it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert decode_jpeg(_jpeg(_photo_array(400, 400)), 64).shape == (64, 64, 3)


def _with_record(src, dst, sample: int, edit):
    """A copy of the LMDB dataset ``src`` whose record ``sample`` is ``edit(record)``, its store rebuilt and its
    manifest entry updated: a record damaged before its checksum was taken (`fastdata verify` passes it)."""
    import json
    import shutil
    from pathlib import Path

    from fastdata.formats.lmdb_store import build_shard, open_lmdb

    root = Path(shutil.copytree(src, dst))
    m = json.loads((root / "manifest.json").read_text())
    reader = open_lmdb(root, m)
    s = reader.paths.index(str(reader.path_of(sample)))
    first, end = (int(v) for v in reader.index.starts[s:s + 2])
    blobs = reader.get_many(range(first, end))
    reader.close()
    blobs[sample - first] = edit(blobs[sample - first])
    entry = build_shard(Path(reader.paths[s]), blobs)
    for f in m["files"]:
        if f["path"] == entry["path"]:
            f.update(entry)
    (root / "manifest.json").write_text(json.dumps(m))
    return root


def _claiming(h: int, w: int):
    """An edit giving a record's frame header the size ``h`` x ``w`` (its data unchanged)."""
    import struct

    def edit(blob: bytes) -> bytes:
        sof = blob.index(b"\xff\xc0")
        return blob[:sof + 5] + struct.pack(">HH", h, w) + blob[sof + 9:]
    return edit


@pytest.mark.parametrize("resize, claim, needle", [
    ("center-crop", (2000, 2000), "2000 x 2000 pixels, but the dataset stores images with the shorter side at most 80"),
    ("max-side", (60, 200), "60 x 200 pixels, but the dataset stores images with the longer side at most 80")])
def test_a_record_claiming_more_than_the_dataset_stores_is_refused_naming_the_sample(photo_lmdb, tmp_path, resize,
                                                                                    claim, needle):
    # Such a header was decoded by Pillow (libjpeg-turbo refused it) as a grey or garbled tile. The manifest
    # bounds every record: a shorter side of at most max_short_side, a longer one of at most max_side
    from fastdata.cli.main import main
    from fastdata.datasets.images import FastDataset
    from fastdata.errors import ImageDecodeError

    src = photo_lmdb
    if resize == "max-side":
        src = tmp_path / "max-side"
        assert main(["preprocess", "images", str(photo_lmdb.parent / "src"), str(src), "--size", "80", "--format",
                     "lmdb", "--resize", "max-side", "--workers", "1", "--quiet"]) == 0
    root = _with_record(src, tmp_path / "ds", 5, _claiming(*claim))
    assert main(["verify", str(root), "--quiet"]) == 0  # (its checksums were taken after the damage)
    for crop in ("center", "random"):
        with pytest.raises(ImageDecodeError, match=rf"sample 5 is not a decodable JPEG \(its header says {needle} "
                                                   rf"\(its manifest's max_(short_)?side\)"):
            FastDataset(root, size=32, crop=crop).get_batch(list(range(10)), draw=(1, 0, 0, 0))
    x, _ = FastDataset(root, size=32).get_batch([4, 6])  # the others still decode
    assert x.shape == (2, 32, 32, 3)


@pytest.mark.parametrize("crop", ["random", "center"])
def test_a_record_whose_frame_header_cannot_be_read_is_sized_by_its_decode_not_served_as_one_pixel(photo_lmdb,
                                                                                                   tmp_path, crop):
    # The frame-header parser finds no size (0 x 0) in a record of another format, or in a JPEG with two stray
    # bytes before a DQT (libjpeg skips them with a warning; Pillow decoded the image). crop="random" drew its box
    # from that size, (0, 0, 1, 1): every crop was the image's top-left pixel scaled up. Now the box is drawn for
    # the decoded size, and the JPEG is refused as damaged (NOTE [damaged records])
    import io

    import numpy as np
    from PIL import Image

    from fastdata.datasets.images import FastDataset
    from fastdata.errors import ImageDecodeError
    from fastdata.imaging.decode_batch import _place, center_box, jpeg_size
    from fastdata.imaging.draws import draw_resized_crops

    def stray_bytes(blob: bytes) -> bytes:
        i = blob.index(b"\xff\xdb")
        return blob[:i] + b"\x00\x00" + blob[i:]
    png = io.BytesIO()
    Image.fromarray(_photo_array(107, 80)).save(png, "PNG")
    pixels = np.asarray(Image.open(io.BytesIO(png.getvalue())).convert("RGB"))
    root = _with_record(photo_lmdb, tmp_path / "ds", 0, stray_bytes)
    root = _with_record(root, tmp_path / "ds2", 1, lambda blob: png.getvalue())
    ds = FastDataset(root, size=48, crop=crop)
    assert [jpeg_size(b) for b in ds.lmdb_reader.get_many([0, 1, 2])][:2] == [(0, 0), (0, 0)]
    with pytest.raises(ImageDecodeError, match=r"sample 0 is not a decodable JPEG \(libjpeg-turbo: Corrupt JPEG data: "
                                               r"2 extraneous bytes before marker 0xdb\)"):
        ds.get_batch([0, 1], draw=(5, 0, 0, 0))
    x, _ = ds.get_batch([1, 2, 3], draw=(5, 0, 0, 0))
    if crop == "random":
        boxes, flips = draw_resized_crops((5, 0, 0, 0), np.array([[80, 107], [1, 1], [1, 1]]))  # (as if known)
        top, left, h, w = boxes[0].tolist()
    else:
        top, left, h, w = center_box(80, 107)
        flips = [False]
    want = np.empty((48, 48, 3), np.uint8)
    _place(np.ascontiguousarray(pixels[top:top + h, left:left + w]), want, bool(flips[0]))
    assert np.array_equal(x[0].numpy(), want)
    assert x[0].float().reshape(-1, 3).std(0).min() > 5  # (not one colour)
    with pytest.raises(ImageDecodeError, match="sample 0 .*not an image: no JPEG frame header, nor another format"):
        FastDataset(_with_record(root, tmp_path / "ds3", 0, lambda blob: b"\xff\xd8\xff\xd9"), size=48,
                    crop=crop).get_batch([0])


def test_odd_but_whole_records_still_decode_by_the_strict_rules(monkeypatch):
    # The strict rules refuse damage only: every kind of whole record below decodes as before (the parity with
    # the old decoder, byte for byte, was checked over 2,520 decodes when the rules came in)
    import io

    import numpy as np
    import simplejpeg
    from PIL import Image

    from fastdata.imaging import turbojpeg as turbo
    from fastdata.imaging.decode_batch import decode_jpeg

    photo = _photo_array(300, 200)
    exif = Image.Exif()
    exif[0x0112] = 6
    cmyk = io.BytesIO()
    Image.fromarray(photo).convert("CMYK").save(cmyk, "JPEG", quality=90, progressive=True)
    records = {
        "411": simplejpeg.encode_jpeg(photo, 90, "RGB", "411"), "440": simplejpeg.encode_jpeg(photo, 90, "RGB", "440"),
        "gray_progressive": _jpeg(photo[..., 0], progressive=True), "restart_markers": _jpeg(photo,
                                                                                           restart_marker_blocks=3),
        "exif": _jpeg(photo, exif=exif.tobytes()), "optimized": _jpeg(photo, optimize=True),
        "1x1": _jpeg(photo[:1, :1]), "cmyk_progressive": cmyk.getvalue(),
        "zero_padded": _jpeg(photo) + bytes(100), "bytes_after_the_end_marker": _jpeg(photo) + b"trailer" * 20}
    wants = {}
    for name, data in records.items():
        ref = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
        side = min(ref.shape[:2])
        top, left = (ref.shape[0] - side) // 2, (ref.shape[1] - side) // 2
        wants[name] = np.asarray(Image.fromarray(ref[top:top + side, left:left + side]).resize((48, 48),
                                                                                              Image.BILINEAR))
    partial = {name: decode_jpeg(data, 48) for name, data in records.items()}
    monkeypatch.setattr(turbo, "library", lambda: None)  # the whole-image way: strict simplejpeg, or Pillow (CMYK)
    for name, data in records.items():
        assert np.array_equal(decode_jpeg(data, 48), partial[name]), name
        assert _psnr(partial[name], wants[name]) > 20, name  # (the same picture: noisy content, other filters)
