"""The LMDB writer's fast paths give today's bytes: the compiled Lanczos kernel (NOTE [exact lanczos] in
fastdata/imaging/lanczos.py) against Pillow, and whole datasets written with and without it."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fastdata.imaging import decode_file as decode
from fastdata.imaging import lanczos
from fastdata.preprocess.images import ImagePreprocessConfig, preprocess_images

pytest.importorskip("numba", reason="the compiled Lanczos kernel needs numba (pip install 'fastdata[jpeg]')")


@pytest.fixture
def kernel(monkeypatch):
    """The kernel prepared in this process; the module's state restored afterwards."""
    monkeypatch.setattr(lanczos, "_lanczos", lanczos._lanczos)
    assert decode.prepare("lanczos"), "the kernel should match this Pillow on its probes"
    return lanczos._lanczos


def pillow(pixels: np.ndarray, wh: tuple[int, int]) -> np.ndarray:
    return np.asarray(Image.fromarray(pixels, "RGB").resize(wh, Image.Resampling.LANCZOS,
                                                           reducing_gap=decode.REDUCING_GAP))


def shapes(n: int, seed: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Random downscales below Pillow's reduce step, a fifth of them along one axis only; tall and wide."""
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < n:
        h, w = (int(v) for v in rng.integers(4, 700, 2))
        W, H = max(1, int(w / rng.uniform(1, 5.9))), max(1, int(h / rng.uniform(1, 5.9)))
        W, H = (w, H) if rng.random() < 0.1 else (W, h) if rng.random() < 0.1 else (W, H)
        if (W, H) != (w, h):
            out.append(((h, w), (W, H)))
    return out


def test_kernel_gives_pillows_lanczos_bytes(kernel):
    rng = np.random.default_rng(1)
    used = 0
    for i, ((h, w), wh) in enumerate(shapes(250, seed=2)):
        noise = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        smooth = np.clip(np.cumsum(rng.integers(-4, 5, (h, w, 3)), axis=1) + 128, 0, 255).astype(np.uint8)
        pixels = noise if i % 2 else smooth  # clipping at 0 and 255 (noise) and plain rounding (smooth)
        got = np.asarray(decode.resample_image(pixels, wh))
        assert np.array_equal(got, pillow(pixels, wh)), ((w, h), wh)
        used += 1
    assert used == 250
    # both of Pillow's pass orders, either side of where it switches (vertical first: h - H > 2 (w - W))
    pixels = rng.integers(0, 256, (100, 100, 3), dtype=np.uint8)
    for wh in [(75, 50), (76, 50), (99, 17), (17, 99), (100, 17), (17, 100)]:  # all below 6x (no reduce step)
        assert np.array_equal(lanczos.resize(pixels, wh), pillow(pixels, wh)), wh


def test_pillow_resizes_what_the_kernel_does_not_cover(kernel, monkeypatch):
    calls = []
    monkeypatch.setattr(lanczos, "resize", lambda p, wh: calls.append(wh))
    pixels = np.zeros((600, 800, 3), np.uint8)
    decode.resample_image(pixels, (100, 75))  # 8x: Pillow reduces first (reducing_gap)
    decode.resample_image(pixels, (900, 600))  # an upscale
    decode.resample_image(pixels, (400, 300), box=(0, 0, 800, 600))
    decode.resample_image(Image.fromarray(pixels), (400, 300))  # a Pillow image (EXIF-rotated, PNG, ...)
    decode.resample_image(pixels, (400, 300), Image.Resampling.BICUBIC)
    assert calls == []


def test_prepare_keeps_pillow_where_the_kernel_differs(monkeypatch):
    monkeypatch.setattr(lanczos, "_lanczos", None)
    monkeypatch.setattr(lanczos, "resize", lambda p, wh: np.zeros((wh[1], wh[0], 3), np.uint8))
    assert not decode.prepare("lanczos") and lanczos._lanczos is None
    assert not decode.prepare("bilinear") and lanczos._lanczos is None


def dataset_digest(out: Path) -> str:
    """Every file's name and bytes but the manifest (it records the fastdata version only)."""
    h = hashlib.sha256()
    for p in sorted(out.iterdir()):
        if p.is_file() and p.name != "manifest.json":
            h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()


@pytest.mark.parametrize("resize", ["center-crop", "max-side"])
def test_lmdb_dataset_bytes_same_with_the_kernel_in_forked_workers(photo_folder, tmp_path, monkeypatch, resize):
    def run(name: str, workers: int) -> str:
        preprocess_images(ImagePreprocessConfig(src=photo_folder, out=tmp_path / name, size=64, format="lmdb",
                                                workers=workers, resize=resize, shard_size=16, progress=False))
        return dataset_digest(tmp_path / name)

    monkeypatch.setattr(lanczos, "_lanczos", None)
    before = run("pillow", 2)
    assert decode.prepare("lanczos")
    real, used = lanczos.resize, tmp_path / "used-by"

    def counted(pixels: np.ndarray, wh: tuple[int, int]) -> np.ndarray:
        with open(used, "a") as f:  # a file, so that forked workers report too
            f.write(f"{os.getpid()}\n")
        return real(pixels, wh)

    monkeypatch.setattr(lanczos, "resize", counted)
    assert run("kernel-1", 1) == before
    assert set(used.read_text().split()) == {str(os.getpid())}  # the kernel ran here
    used.unlink()
    assert run("kernel-2", 2) == before
    assert str(os.getpid()) not in used.read_text().split()  # and in the forked workers, which inherited it
