"""``fastdata demo``: build a small JPEG dataset, preprocess, verify, load it, train on it, report speed.

Nothing is downloaded. The loading step compares FastLoader (whole-batch reads from the uint8 shards)
with a torch DataLoader doing what a plain pipeline does per sample today (Pillow: open, decode, resize,
crop) over the same files. Then a small CNN trains on 80% of the images through the whole pipeline
(FastLoader -> CUDAPrefetcher -> Trainer) and is scored on the 20% held out.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from ..formats.integrity import verify
from ..imaging.decode_file import load_array
from ..preprocess.images import ImagePreprocessConfig, preprocess_images
from .synthetic import make_image_folder


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


def run_demo(out: Path, *, num_classes: int = 4, per_class: int = 100, size: int = 64, batch_size: int = 64,
             seed: int = 0) -> dict[str, float]:
    """Run the demo in ``out`` (created; reused when it already holds the images); returns the figures."""
    t_start = time.perf_counter()
    out = Path(out)
    src, data = out / "jpeg", out / "dataset"
    n = num_classes * per_class
    if len(list(src.rglob("*.jpg"))) != n:
        print(f"writing {n} JPEG files ({num_classes} classes, 500x375 and 375x500) to {src}")
        make_image_folder(src, num_classes=num_classes, per_class=per_class, sizes=((500, 375), (375, 500)),
                          seed=seed)
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
