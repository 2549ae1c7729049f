"""``fastdata demo``: build a small JPEG dataset, preprocess, verify, load it, train on it, report speed.

Nothing is downloaded. The loading step compares FastLoader (whole-batch reads from the uint8 shards)
with a torch DataLoader doing what a plain pipeline does per sample today (Pillow: open, decode, resize,
crop) over the same files. Then a small CNN trains on 80% of the images through the whole pipeline
(FastLoader -> CUDAPrefetcher -> Trainer) and is scored on the 20% held out.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, Optional

from .._io import disk_error, make_folder, write_json_atomic
from ..errors import ConfigError
from ..formats.integrity import verify
from ..imaging.decode_file import load_array
from ..preprocess.images import ImagePreprocessConfig, preprocess_images
from .synthetic import make_image_folder

SIZES = ((500, 375), (375, 500))  # the demo's JPEGs, landscape and portrait
STAMP = "jpeg.json"  # in out: the settings the JPEGs in out/jpeg were made with, written once they all are
DEMO_FILE = re.compile(r"class_\d+/img_\d{4,}\.jpg")  # what make_image_folder writes, and nothing else


class _PillowFiles:
    """What a plain pipeline does per sample today: open the JPEG, decode, resize, crop."""

    def __init__(self, files: list[Path], size: int) -> None:
        self.files, self.size = files, size

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> Any:
        import torch

        pixels = load_array(self.files[i], self.size, "center-crop").copy()  # PIL arrays are read-only
        return torch.from_numpy(pixels), 0


def _loader_speeds(src: Path, data: Path, size: int, batch_size: int, seed: int) -> tuple[float, float]:
    """Images/s of FastLoader (3 epochs, after a warm-up) and of a DataLoader + Pillow (1 epoch)."""
    import torch

    from ..datasets.images import FastDataset
    from ..loading.loader import FastLoader

    loader = FastLoader(FastDataset(data, storage="ram"), batch_size, seed=seed)
    for _ in loader:
        pass
    t, n = time.perf_counter(), 0
    for _ in range(3):
        for x, _ in loader:
            n += len(x)
    fast = n / (time.perf_counter() - t)
    files = sorted(src.rglob("*.jpg"))
    plain = torch.utils.data.DataLoader(_PillowFiles(files, size), batch_size, shuffle=True,
                                        num_workers=min(4, os.cpu_count() or 1))
    t, n = time.perf_counter(), 0
    for x, _ in plain:
        n += len(x)
    return fast, n / (time.perf_counter() - t)


def _train(data: Path, seed: int) -> tuple[float, float]:
    """cnn-small on 80% of the demo set through the whole pipeline; (held-out accuracy, seconds)."""
    import torch

    from ..distributed import init_distributed
    from ..train.assemble import ImageRun, build
    from ..train.config import TrainConfig
    from ..train.trainer import Trainer

    device = init_distributed("auto").device  # CUDA when there is one
    torch.manual_seed(seed)
    model, train, val = build(ImageRun(data=data, model="cnn-small", batch_size=32, val_fraction=0.2,
                                            storage="ram", augment="flip", seed=seed), device)
    trainer = Trainer(model, train, val, config=TrainConfig(epochs=4, lr=0.05, val_every=4, log_every=10,
                                                            device=device.type, seed=seed, progress=False))
    t = time.perf_counter()
    trainer.fit()
    return trainer.evaluate()["val_accuracy"], time.perf_counter() - t


def _read_stamp(stamp: Path) -> Optional[Any]:
    try:
        return json.loads(stamp.read_text())
    except (OSError, ValueError):  # (none yet, or cut short: the images are made again)
        return None


def _demo_images(out: Path, num_classes: int, per_class: int, seed: int) -> Path:
    """The demo's JPEG folder ``out/jpeg``, written unless it holds exactly what this run would write.

    The demo owns that folder: one made with other settings, or cut short, is removed and made again (written
    over, it kept an earlier run's extra files: 20 per class, then 5, preprocessed 80 images, not 20).

    Raises:
        ConfigError: The folder holds files the demo does not write (it is removed only when it holds none).
        OutputError: ``out`` cannot be written (a file where the folder should be, no permission).
    """
    src, stamp = out / "jpeg", out / STAMP
    want = {"num_classes": num_classes, "per_class": per_class, "seed": seed, "sizes": [list(s) for s in SIZES]}
    names = {f"class_{c}/img_{i:04d}.jpg" for c in range(num_classes) for i in range(per_class)}
    have = {p.relative_to(src).as_posix() for p in src.rglob("*") if not p.is_dir()} if src.is_dir() else set()
    if have == names and _read_stamp(stamp) == want:
        return src
    strange = sorted(name for name in have if not DEMO_FILE.fullmatch(name))
    if strange:
        raise ConfigError(f"{src} holds files the demo does not write ({strange[0]}): give the demo a new folder "
                          "(fastdata demo --out DIR)")
    n = num_classes * per_class
    print(f"writing {n} JPEG files ({num_classes} classes, 500x375 and 375x500) to {src}")
    try:
        stamp.unlink(missing_ok=True)
        if src.is_symlink():
            src.unlink()  # (the link alone: never the files it points to)
        elif src.is_dir():
            shutil.rmtree(src)
    except OSError as exc:
        raise disk_error(exc, src) from exc
    make_image_folder(src, num_classes=num_classes, per_class=per_class, sizes=SIZES, seed=seed)
    write_json_atomic(stamp, want)  # last: a run cut short leaves no stamp, and the next one starts over
    return src


def run_demo(out: Path, *, num_classes: int = 4, per_class: int = 100, size: int = 64, batch_size: int = 64,
             seed: int = 0) -> dict[str, float]:
    """Run the demo in ``out`` (created; its JPEGs reused when they are what this run would write); returns
    the figures.

    Raises:
        ConfigError: ``out/jpeg`` holds files the demo does not write.
        OutputError: ``out`` is a file, or cannot be written.
    """
    t_start = time.perf_counter()
    out = Path(out)
    make_folder(out, "demo folder", f"demo folder {out} is a file: give the demo a folder to work in "
                "(fastdata demo --out DIR)")
    src = _demo_images(out, num_classes, per_class, seed)
    data = out / "dataset"
    t = time.perf_counter()
    manifest = preprocess_images(ImagePreprocessConfig(src=src, out=data, size=size, overwrite=True))
    t_pre = time.perf_counter() - t
    print(f"preprocessed {manifest['num_samples']} images to {size}x{size} uint8 shards in {t_pre:.2f} s "
          f"({manifest['num_samples'] / t_pre:.0f} images/s)")
    problems = verify(data)
    print("verify: " + ("OK, every file matches its checksum" if not problems else "; ".join(problems)))

    fast, slow = _loader_speeds(src, data, size, batch_size, seed)
    print(f"loader, batches of {batch_size}: FastLoader {fast:,.0f} images/s vs DataLoader + Pillow "
          f"{slow:,.0f} images/s over the same JPEGs ({fast / slow:,.0f}x)")
    accuracy, train_s = _train(data, seed)
    print(f"trained cnn-small on {manifest['num_samples'] * 4 // 5} images in {train_s:.1f} s: held-out "
          f"accuracy {100 * accuracy:.1f}%")
    total = time.perf_counter() - t_start
    print(f"total time {total:.1f} s")
    return {"preprocess_img_s": manifest["num_samples"] / t_pre, "fastloader_img_s": fast, "pillow_img_s": slow,
            "accuracy": accuracy,
            "speedup": fast / slow, "total_s": total}
