"""Assemble an image training run from a few options: dataset, split, loaders, GPU transforms, model.

Used by ``fastdata train``, ``fastdata demo`` and the benchmarks, so they all train the same way:
FastDataset -> FastLoader (DDP-aware) -> CUDAPrefetcher (normalise + augment on the device) -> model.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch

from .._io import scrub
from ..datasets.images import FastDataset
from ..datasets.splits import split
from ..errors import ConfigError, is_whole
from ..formats.manifest import TOKENS
from ..gpu.dali_tune import valid_load
from ..gpu.prefetch import CUDAPrefetcher
from ..imaging.transforms import CenterCrop, Compose, RandomCrop, RandomHorizontalFlip, RandomResizedCrop, Transform
from ..loading.loader import FastLoader
from ..storage.object_store import RETRY_SECONDS, is_url
from ..storage.opening import OpenedPath, open_path
from ..storage.streamed import streamed_files
from .models import MODELS, create_model, image_models

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
    crop: Optional[int] = None  # rrc-flip or dali: output side (default 7/8 of the stored side)
    seed: int = 0
    backend: str = "native"  # "dali": decode an LMDB dataset's JPEGs with NVIDIA DALI
    shuffle_window: Optional[int] = None  # shuffle within windows of this many shards (FastLoader)
    cache_dir: Optional[str] = None  # URL datasets: the node cache folder...
    cache_limit: Union[int, str, None] = None  # ...and the bytes it may hold
    retry_seconds: float = RETRY_SECONDS  # URL datasets: how long the store may fail before a read gives up
    # dali: the share of JPEGs for the GPU's hardware decoder, in [0, 1], or "auto"; None: DALILoader's default
    hw_decoder_load: Union[float, str, None] = None
    prefetch: Optional[int] = None  # FastLoader's prefetch and pin_memory (`--config`'s autotuned); None: its own
    pin_memory: Optional[bool] = None

    def __post_init__(self) -> None:
        if self.augment not in AUGMENT:
            raise ConfigError(f"augment must be one of {AUGMENT}, got augment={self.augment!r}")
        if self.val is not None and self.val_fraction:
            raise ConfigError("give --val DATA or --val-fraction, not both")
        if self.backend not in ("native", "dali"):
            raise ConfigError(f"backend must be 'native' or 'dali', got backend={self.backend!r}")
        if self.backend == "dali" and (is_url(self.data) or is_url(self.val or "")):
            raise ConfigError("--backend dali reads a local LMDB folder: use the native backend for a URL (it "
                              "streams the LMDB through the node cache), or download it first (`fastdata cache "
                              "fetch URL`)")
        if self.backend == "dali" and self.shuffle_window is not None:
            raise ConfigError("--shuffle-window applies to the native backend (DALI shuffles in its own reader)")
        self._check_crop()
        self._check_hw_decoder_load()

    def _check_crop(self) -> None:
        """``--crop``: a side of at least 1 px (0 fell back to 7/8 of the stored side). Whether anything reads
        it is said where the data's kind is known (`_image_run`, `build_mix`)."""
        crop = self.crop
        if crop is not None and (not is_whole(crop) or crop < 1):
            raise ConfigError(f"--crop must be a positive integer (the crops' side in pixels), got {crop!r}")

    def _check_hw_decoder_load(self) -> None:
        """``--hw-decoder-load``: a share in [0, 1] or "auto", for the DALI backend only (the native one
        decodes no JPEG on the GPU); refused here, before any data is opened."""
        load = self.hw_decoder_load
        if load is None:
            return
        if self.backend != "dali":
            raise ConfigError(f"--hw-decoder-load splits DALI's JPEG decoding: add --backend dali, or drop "
                              f"--hw-decoder-load {load!r} for --backend {self.backend}")
        if not valid_load(load):
            raise ConfigError("--hw-decoder-load must be a number in [0, 1] (the share of JPEGs for the GPU's "
                              f"hardware decoder) or 'auto' (measured on the first batches), got {load!r}")


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


def build(p: ImageRun, device: torch.device, opened: Optional[OpenedPath] = None
          ) -> tuple[torch.nn.Module, Any, Optional[Any]]:
    """Model, train loader and validation loader (None without --val / --val-fraction), on ``device``.
    ``opened``: ``p.data`` already opened (its manifest read once per run). The samples are decided once,
    as datasets or views of one; only the loader differs by backend."""
    _check_image_model(scrub(str(p.data)), p.model)
    cache = {"cache_dir": p.cache_dir, "cache_limit": p.cache_limit, "retry_seconds": p.retry_seconds}
    ds = FastDataset(opened, storage=p.storage, device=device) if opened is not None else FastDataset(
        p.data, storage=p.storage, device=device, **cache)
    if not ds.has_labels:
        fields = ", ".join(f.name for f in ds.fields or [])
        raise ConfigError(f"{scrub(str(p.data))} has no 'label' field ({fields}): `fastdata train` trains "
                          "classifiers; train a model of your own with Trainer(model, loader, config=..., "
                          "loss_fn=lambda out, batch: ...) in Python (docs/fields.md)")
    train_ds: Any = ds
    val_ds: Any = None
    if p.val is not None:
        shape = ds.sample_shape if p.backend == "native" else None  # (DALI crops both to one size)
        val_ds = _val_dataset(p, device, ds.classes, scrub(str(p.data)), shape, **cache)
    elif p.val_fraction:
        train_ds, val_ds = split(ds, p.val_fraction, p.seed)
    side = ds.sample_shape[0]
    if p.backend == "dali":  # DALI decodes, crops and flips on the device
        from ..gpu.dali import DALILoader

        size = crop_side(p, side)
        hw = p.hw_decoder_load  # None: DALILoader's default
        train = DALILoader(train_ds, p.batch_size, size=size, train=True, seed=p.seed, device=device,
                           hw_decoder_load=hw)
        val = None if val_ds is None else DALILoader(val_ds, p.batch_size, size=size, train=False, device=device,
                                                     hw_decoder_load=hw)
        return image_model(p.model, len(ds.classes), size), train, val
    return _image_run(p, device, train_ds, val_ds, side, len(ds.classes), p.shuffle_window)


def _val_dataset(p: ImageRun, device: torch.device, classes: list[str], of: str,
                 shape: Optional[tuple[int, ...]] = None, **cache: Any) -> FastDataset:
    """``--val`` opened, refused unless it has the classes of the training data (``of`` names it) and, when
    given, its sample ``shape`` (else an epoch in, a model-size error, or validation at another resolution)."""
    val = FastDataset(p.val, storage=p.storage, device=device, **cache)
    if val.classes != classes:
        raise ConfigError(f"--val {scrub(str(p.val))} has classes {val.classes[:5]}..., not those of {of}")
    if shape is not None and tuple(val.sample_shape) != tuple(shape):
        size = lambda s: "x".join(map(str, s))  # noqa: E731
        raise ConfigError(f"--val {scrub(str(p.val))} holds {size(val.sample_shape)} samples, {of} "
                          f"{size(shape)}: the model would be validated at another size than it trains on; "
                          "preprocess the validation images with the same --size")
    return val


def _image_run(p: ImageRun, device: torch.device, train_ds: Any, val_ds: Any, side: int, num_classes: int,
               shuffle_window: Optional[int]) -> tuple[torch.nn.Module, CUDAPrefetcher, Optional[CUDAPrefetcher]]:
    """The model and prefetched loaders of an image run on ``side`` px samples, with ``p.augment``'s transforms."""
    if p.crop is not None and p.augment != "rrc-flip":  # (the other augmentations keep the stored side)
        raise ConfigError(f"--crop sizes the crops of --augment rrc-flip or --backend dali: add one of them, or "
                          f"drop --crop {p.crop} for --augment {p.augment}")
    train_tf, eval_tf = transforms(p, side)
    model = image_model(p.model, num_classes, crop_side(p, side) if p.augment == "rrc-flip" else side)
    train, val = loaders(train_ds, val_ds, p.batch_size, p.seed, p.threads, device, train_tf, eval_tf,
                         shuffle_window, prefetch=p.prefetch, pin_memory=p.pin_memory)
    return model, train, val


def _check_lm_model(what: str, model: Optional[str]) -> None:
    """Token runs train gpt-tiny: another ``--model`` is refused before any data is read."""
    if (model or "gpt-tiny") != "gpt-tiny":
        raise ConfigError(f"{what} holds tokens: train --model gpt-tiny, not {model!r}")


def _check_image_model(what: str, model: str) -> None:
    """Image runs train an image model: a token model is refused by name (else a TypeError from its
    constructor), before any data is read. An unknown name is left to `create_model`, which lists them all."""
    if model in MODELS and model not in image_models():
        raise ConfigError(f"--model {model} reads tokens; {what} holds images: choose one of "
                          f"{', '.join(image_models())}")


def image_model(name: str, num_classes: int, side: int) -> torch.nn.Module:
    """``create_model(name)`` for ``side`` x ``side`` inputs; refuses a side the model cannot take, before
    any data is read (a raw "Output size is too small" from the first forward tells the user nothing)."""
    _check_image_model("the data", name)
    model = create_model(name, num_classes=num_classes)
    need = getattr(model, "min_input_size", 1)
    if side < need:
        raise ConfigError(f"model {name} needs images of at least {need}x{need}, and this run feeds it "
                          f"{side}x{side}: preprocess with a larger --size, or choose another --model")
    return model


def loaders(train_ds: Any, val_ds: Any, batch_size: int, seed: int, threads: Optional[int], device: torch.device,
            train_tf: Optional[Transform] = None,
            eval_tf: Optional[Transform] = None,
            shuffle_window: Optional[int] = None, *, prefetch: Optional[int] = None,
            pin_memory: Optional[bool] = None) -> tuple[CUDAPrefetcher, Optional[CUDAPrefetcher]]:
    """The prefetched train loader (shuffled, within windows of ``shuffle_window`` shards if given; padded for
    DDP) and validation loader (in order, ``pad=False``: every sample once across ranks; None without
    ``val_ds``). ``prefetch`` and ``pin_memory`` go to both FastLoaders when given (an autotuned ``--config``)."""
    tuned = {k: v for k, v in (("prefetch", prefetch), ("pin_memory", pin_memory)) if v is not None}
    train = CUDAPrefetcher(FastLoader(train_ds, batch_size, shuffle=True, seed=seed, num_threads=threads,
                                      shuffle_window=shuffle_window, **tuned),
                           device=device, transforms=train_tf, seed=seed)
    val = None
    if val_ds is not None:
        val = CUDAPrefetcher(FastLoader(val_ds, batch_size, shuffle=False, pad=False, num_threads=threads, **tuned),
                             device=device, transforms=eval_tf)
    return train, val


def build_lm(data: Union[str, Path, OpenedPath], model: Optional[str], batch_size: int, seq_len: int, storage: str,
             threads: Optional[int], seed: int, device: torch.device, shuffle_window: Optional[int] = None,
             cache_dir: Optional[str] = None, cache_limit: Union[int, str, None] = None,
             retry_seconds: float = RETRY_SECONDS, **tuned: Any
             ) -> tuple[torch.nn.Module, CUDAPrefetcher, Optional[CUDAPrefetcher]]:
    """A language-model run on a token folder or URL: gpt-tiny over train windows, validated on the val split.
    ``tuned``: `loaders`' ``prefetch`` and ``pin_memory``."""
    from ..datasets.tokens import TokenDataset

    where = data if not isinstance(data, OpenedPath) else data.remote.url if data.remote else data.root
    _check_lm_model(scrub(str(where)), model)  # (an OpenedPath's repr is its whole manifest)
    if not isinstance(data, OpenedPath):  # the manifest read once, for both splits
        data = open_path(data, (TOKENS,), cache_dir=cache_dir, cache_limit=cache_limit,
                         streamed=lambda m: streamed_files(m, storage), retry_seconds=retry_seconds)
    train_ds = TokenDataset(data, "train", seq_len, storage=storage)
    val_ds = None
    if train_ds.manifest["splits"]["val"]["tokens"] >= seq_len + 1:
        val_ds = TokenDataset(data, "val", seq_len, storage=storage)
    train, val = loaders(train_ds, val_ds, batch_size, seed, threads, device, shuffle_window=shuffle_window, **tuned)
    return create_model("gpt-tiny", vocab_size=train_ds.vocab_size, seq_len=seq_len), train, val


def image_flags(crop: Optional[int], augment: str) -> list[str]:
    """``--crop`` and an image ``--augment`` where given: flags a token run would ignore, refused by name
    (``none`` and the default ``flip`` ask for nothing a token run does not do)."""
    given = (("--crop", crop is not None), (f"--augment {augment}", augment not in ("flip", "none")))
    return [flag for flag, on in given if on]


def build_mix(spec: Any, p: ImageRun, device: torch.device, seq_len: int, model: Optional[str] = None
              ) -> tuple[torch.nn.Module, CUDAPrefetcher, Optional[CUDAPrefetcher]]:
    """Model and loaders of a run on a Mixture (``fastdata train --mix``; docs/mixtures.md): image sources train
    ``p.model``, token sources gpt-tiny; either validated on ``p.val`` when given (a token folder's val split,
    as `build_lm` validates one dataset). The Mixture takes ``p.seed``, ``p.shuffle_window`` and
    ``p.cache_limit`` (split among URL sources by weight), and ``spec``'s options (``allow_new_sources``...)."""
    from ..datasets.mix_config import open_mixture

    if p.backend != "native" or p.val_fraction:
        raise ConfigError("--mix trains on the native backend and validates on --val DATA: drop --backend dali and "
                          "--val-fraction")
    mix = open_mixture(spec, storage=p.storage, seq_len=seq_len, seed=p.seed, shuffle_window=p.shuffle_window,
                       cache_dir=p.cache_dir, cache_limit=p.cache_limit, retry_seconds=p.retry_seconds, device=device)
    first = mix.sources[0]
    val_cache = {"cache_dir": p.cache_dir, "retry_seconds": p.retry_seconds}  # (cache_limit: the sources' budget)
    if hasattr(first, "vocab_size"):  # token sources
        _check_lm_model(f"--mix {mix.names[0]}", model)
        given = image_flags(p.crop, p.augment)
        if given:  # (ignored without a word before; --hw-decoder-load needs --backend dali, refused above)
            raise ConfigError(f"--mix {mix.names[0]} holds tokens: drop {', '.join(given)}, for image datasets only")
        val_ds = None if p.val is None else _token_val(p, first, seq_len, **val_cache)
        train, val = loaders(mix, val_ds, p.batch_size, p.seed, p.threads, device, prefetch=p.prefetch,
                             pin_memory=p.pin_memory)
        return create_model("gpt-tiny", vocab_size=first.vocab_size, seq_len=seq_len), train, val
    _check_image_model(f"--mix {mix.names[0]}", p.model)
    val_ds = None if p.val is None else _val_dataset(p, device, first.classes, f"--mix {mix.names[0]}",
                                                     first.sample_shape, **val_cache)
    return _image_run(p, device, mix, val_ds, first.sample_shape[0], len(first.classes), None)


def _token_val(p: ImageRun, first: Any, seq_len: int, **cache: Any) -> Any:
    """``--val`` of a token mixture: its val split in windows of ``seq_len``, refused unless it holds a window
    and was tokenised as ``first`` (the mixture's first source) was."""
    from ..datasets.tokens import TokenDataset

    where = f"--val {scrub(str(p.val))}"
    opened = open_path(p.val, (TOKENS,), streamed=lambda m: streamed_files(m, p.storage), **cache)
    tokens = opened.manifest["splits"].get("val", {}).get("tokens", 0)
    if tokens < seq_len + 1:
        raise ConfigError(f"{where} has {tokens} tokens in its val split, fewer than --seq-len + 1 = {seq_len + 1}: "
                          "preprocess it with a larger --val-fraction, or drop --val")
    mine, theirs = opened.manifest["tokenizer"], first.manifest["tokenizer"]
    if mine.get("definition_sha256") != theirs.get("definition_sha256"):
        raise ConfigError(f"{where} was tokenised with {mine.get('spec')}, the --mix sources with "
                          f"{theirs.get('spec')}: validate on text preprocessed with the same tokenizer")
    return TokenDataset(opened, "val", seq_len, storage=p.storage)
