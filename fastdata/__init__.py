"""fastdata: preprocess once into compact uint8 shards, serve whole batches, normalise on the GPU.

The public API is listed in ``__all__``. Names are imported on first use (PEP 562), so that the
``fastdata preprocess`` command and its worker processes never import torch (unless ``--filter fast-bicubic``
asks for its resize kernel); optional backends
(``fastdata.dali``) are never imported from here.
"""
from __future__ import annotations

import importlib
from typing import Any

from ._version import __version__  # noqa: F401 - re-exported

_EXPORTS = {
    "CUDAPrefetcher": "fastdata.gpu.prefetch",
    "CenterCrop": "fastdata.imaging.transforms",
    "ChecksumError": "fastdata.errors",
    "Compose": "fastdata.imaging.transforms",
    "ConfigError": "fastdata.errors",
    "DiskFullError": "fastdata.errors",
    "DistributedBatchSampler": "fastdata.loading.sampler",
    "FastDataset": "fastdata.datasets.images",
    "FastLoader": "fastdata.loading.loader",
    "FastdataError": "fastdata.errors",
    "FormatError": "fastdata.errors",
    "ImageDecodeError": "fastdata.errors",
    "ImagePreprocessConfig": "fastdata.preprocess.images",
    "MissingDependencyError": "fastdata.errors",
    "Mixture": "fastdata.datasets.mixture",
    "Normalize": "fastdata.imaging.transforms",
    "OutputError": "fastdata.errors",
    "RandomCrop": "fastdata.imaging.transforms",
    "RandomHorizontalFlip": "fastdata.imaging.transforms",
    "RandomResizedCrop": "fastdata.imaging.transforms",
    "SourceError": "fastdata.errors",
    "TextPreprocessConfig": "fastdata.preprocess.text",
    "TokenDataset": "fastdata.datasets.tokens",
    "TrainConfig": "fastdata.train.config",
    "Trainer": "fastdata.train.trainer",
    "VersionError": "fastdata.errors",
    "describe": "fastdata.formats.manifest",
    "init_distributed": "fastdata.distributed",
    "load_manifest": "fastdata.formats.manifest",
    "preprocess_images": "fastdata.preprocess.images",
    "preprocess_text": "fastdata.preprocess.text",
    "shutdown_distributed": "fastdata.distributed",
    "verify": "fastdata.formats.integrity",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fastdata' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
