"""Assemble an image training run from a few options: dataset, split, loaders, GPU transforms, model.

Used by ``fastdata train``, ``fastdata demo`` and the benchmarks, so they all train the same way:
FastDataset -> FastLoader (DDP-aware) -> CUDAPrefetcher (normalise + augment on the device) -> model.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch

from ..datasets.images import FastDataset
from ..datasets.splits import split
from ..errors import ConfigError
from ..imaging.transforms import CenterCrop, Compose, RandomCrop, RandomHorizontalFlip, RandomResizedCrop, Transform
from ..loading.loader import FastLoader
from ..formats.manifest import load_manifest
from .models import create_model
from ..gpu.prefetch import CUDAPrefetcher
from ..storage.remote import RemoteDataset, is_url

AUGMENT = ("none", "flip", "crop-flip", "rrc-flip")


@dataclass(frozen=True)
class ImageRun:
    """Options of an image-classification run (batch size is per process, as under torchrun)."""

    data: Union[str, Path]  # a folder, or a URL streamed through the node cache
    model: str = "resnet18"
    batch_size: int = 256
    val: Union[str, Path, None] = None
    val_fraction: float = 0.0
    storage: str = "mmap"
    threads: Optional[int] = None
    augment: str = "flip"
    crop: Optional[int] = None  # rrc-flip: output side (default 7/8 of the stored side)
    seed: int = 0
    backend: str = "native"  # "dali": decode an LMDB dataset's JPEGs with NVIDIA DALI
    shuffle_window: Optional[int] = None  # shuffle within windows of this many shards (FastLoader)
    cache_dir: Optional[str] = None  # URL datasets: the node cache folder...
    cache_limit: Union[int, str, None] = None  # ...and the bytes it may hold

    def __post_init__(self) -> None:
        if self.augment not in AUGMENT:
            raise ConfigError(f"augment must be one of {AUGMENT}, got augment={self.augment!r}")
        if self.val is not None and self.val_fraction:
            raise ConfigError("give --val DATA or --val-fraction, not both")
        if self.backend not in ("native", "dali"):
            raise ConfigError(f"backend must be 'native' or 'dali', got backend={self.backend!r}")
        if self.backend == "dali" and (is_url(self.data) or is_url(self.val or "")):
            raise ConfigError("--backend dali reads a local LMDB folder: use the native backend for a URL (it "
                              "streams the LMDB through the node cache), or download it first (`fastdata verify URL`)")
        if self.backend == "dali" and self.shuffle_window is not None:
            raise ConfigError("--shuffle-window applies to the native backend (DALI shuffles in its own reader)")


def manifest_of(path: Union[str, Path], cache_dir: Optional[str] = None) -> dict[str, Any]:
    """The manifest of a dataset folder or URL (a URL's only: nothing else is downloaded)."""
    if is_url(path):
        return RemoteDataset(str(path), cache_dir=cache_dir).manifest
    return load_manifest(path)


def crop_side(p: ImageRun, side: int) -> int:
    """The side of the crops taken from ``side`` px images: ``--crop``, else 7/8 of the side (224 of 256)."""
    return p.crop or side * 7 // 8


def transforms(p: ImageRun, side: int) -> tuple[Optional[Transform], Optional[Transform]]:
    """(train, eval) GPU transforms for ``p.augment`` on ``side`` x ``side`` images."""
    if p.augment == "none":
        return None, None
    if p.augment == "flip":
        return RandomHorizontalFlip(), None
    if p.augment == "crop-flip":  # CIFAR style: pad 1/8, random crop back, flip
        return Compose([RandomCrop(side, padding=max(1, side // 8)), RandomHorizontalFlip()]), None
    crop = crop_side(p, side)
    return Compose([RandomResizedCrop(crop), RandomHorizontalFlip()]), CenterCrop(crop)


def build(p: ImageRun, device: torch.device) -> tuple[torch.nn.Module, CUDAPrefetcher, Optional[CUDAPrefetcher]]:
    """Model, train loader and validation loader (None without --val / --val-fraction), on ``device``."""
    if p.backend == "dali":
        return build_dali(p, device)
    cache = {"cache_dir": p.cache_dir, "cache_limit": p.cache_limit}
    ds = FastDataset(p.data, storage=p.storage, device=device, **cache)
    if not ds.has_labels:
        fields = ", ".join(f.name for f in ds.fields or [])
        raise ConfigError(f"{p.data} has no 'label' field ({fields}): `fastdata train` trains classifiers; train a "
                          "model of your own with Trainer(model, loader, config=..., loss_fn=lambda out, batch: ...) "
                          "in Python (README: Samples with fields)")
    train_ds: Any = ds
    val_ds: Any = None
    if p.val is not None:
        val_ds = FastDataset(p.val, storage=p.storage, device=device, **cache)
        if val_ds.classes != ds.classes:
            raise ConfigError(f"--val {p.val} has classes {val_ds.classes[:5]}..., not those of {p.data}")
    elif p.val_fraction:
        train_ds, val_ds = split(ds, p.val_fraction, p.seed)
    side = ds.sample_shape[0]
    train_tf, eval_tf = transforms(p, side)
    seen = crop_side(p, side) if p.augment == "rrc-flip" else side
    model = image_model(p.model, len(ds.classes), seen)
    train, val = loaders(train_ds, val_ds, p.batch_size, p.seed, p.threads, device, train_tf, eval_tf,
                         p.shuffle_window)
    return model, train, val


def image_model(name: str, num_classes: int, side: int) -> torch.nn.Module:
    """``create_model(name)`` for ``side`` x ``side`` inputs; refuses a side the model cannot take, before
    any data is read (a raw "Output size is too small" from the first forward tells the user nothing)."""
    model = create_model(name, num_classes=num_classes)
    need = getattr(model, "min_input_size", 1)
    if side < need:
        raise ConfigError(f"model {name} needs images of at least {need}x{need}, and this run feeds it "
                          f"{side}x{side}: preprocess with a larger --size, or choose another --model")
    return model


def loaders(train_ds: Any, val_ds: Any, batch_size: int, seed: int, threads: Optional[int], device: torch.device,
            train_tf: Optional[Transform] = None,
            eval_tf: Optional[Transform] = None,
            shuffle_window: Optional[int] = None) -> tuple[CUDAPrefetcher, Optional[CUDAPrefetcher]]:
    """The prefetched train loader (shuffled, within windows of ``shuffle_window`` shards if given; padded for
    DDP) and validation loader (in order, ``pad=False``: every sample once across ranks; None without
    ``val_ds``)."""
    train = CUDAPrefetcher(FastLoader(train_ds, batch_size, shuffle=True, seed=seed, num_threads=threads,
                                      shuffle_window=shuffle_window),
                           device=device, transforms=train_tf, seed=seed)
    val = None
    if val_ds is not None:
        val = CUDAPrefetcher(FastLoader(val_ds, batch_size, shuffle=False, pad=False, num_threads=threads),
                             device=device, transforms=eval_tf)
    return train, val


def build_lm(data: Union[str, Path], model: Optional[str], batch_size: int, seq_len: int, storage: str,
             threads: Optional[int], seed: int, device: torch.device, shuffle_window: Optional[int] = None,
             cache_dir: Optional[str] = None, cache_limit: Union[int, str, None] = None
             ) -> tuple[torch.nn.Module, CUDAPrefetcher, Optional[CUDAPrefetcher]]:
    """A language-model run on a token folder or URL: gpt-tiny over train windows, validated on the val split."""
    from ..datasets.tokens import TokenDataset

    if (model or "gpt-tiny") != "gpt-tiny":
        raise ConfigError(f"{data} holds tokens: train --model gpt-tiny, not {model!r}")
    cache = {"cache_dir": cache_dir, "cache_limit": cache_limit}
    train_ds = TokenDataset(data, "train", seq_len, storage=storage, **cache)
    val_ds = None
    if train_ds.manifest["splits"]["val"]["tokens"] >= seq_len + 1:
        val_ds = TokenDataset(data, "val", seq_len, storage=storage, **cache)
    train, val = loaders(train_ds, val_ds, batch_size, seed, threads, device, shuffle_window=shuffle_window)
    return create_model("gpt-tiny", vocab_size=train_ds.vocab_size, seq_len=seq_len), train, val


def build_dali(p: ImageRun, device: torch.device) -> tuple[torch.nn.Module, Any, Any]:
    """The same run with an LMDB dataset decoded by DALI (GPU decode on CUDA): augmentation happens in DALI."""
    from ..gpu.dali import DALILoader
    from ..datasets.splits import split_indices
    from ..formats.manifest import IMAGES_LMDB

    m = load_manifest(p.data)
    if m["format"] != IMAGES_LMDB:
        raise ConfigError(f"--backend dali reads JPEG LMDB datasets; {p.data} is {m['format']}: preprocess with "
                          "--format lmdb, or use the native backend")
    size = crop_side(p, m["max_short_side"])
    model = image_model(p.model, len(m["classes"]), size)
    train_idx = val_idx = None
    if p.val_fraction:
        train_idx, val_idx = split_indices(m["num_samples"], p.val_fraction, p.seed)
    train = DALILoader(p.data, p.batch_size, size=size, train=True, seed=p.seed, device=device, indices=train_idx)
    val = None
    if p.val is not None or val_idx is not None:
        val = DALILoader(p.val or p.data, p.batch_size, size=size, train=False, device=device, indices=val_idx)
    return model, train, val
