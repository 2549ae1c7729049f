"""fastdata: preprocess once into compact uint8 shards, serve whole batches, normalise on the GPU.

The public API is listed in ``__all__``. Names are imported on first use (PEP 562), so that the
``fastdata preprocess`` command and its worker processes never import torch; optional backends
(``fastdata.dali``) are never imported from here.
"""
from __future__ import annotations

import importlib
from typing import Any

from ._version import __version__  # noqa: F401 - re-exported

_EXPORTS = {
    "CUDAPrefetcher": "fastdata.prefetch",
    "CenterCrop": "fastdata.gpu_transforms",
    "ChecksumError": "fastdata.errors",
    "Compose": "fastdata.gpu_transforms",
    "ConfigError": "fastdata.errors",
    "DiskFullError": "fastdata.errors",
    "DistributedBatchSampler": "fastdata.sampler",
    "FastDataset": "fastdata.dataset",
    "FastLoader": "fastdata.loader",
    "FastdataError": "fastdata.errors",
    "FormatError": "fastdata.errors",
    "ImageDecodeError": "fastdata.errors",
    "ImagePreprocessConfig": "fastdata.preprocess.images",
    "MissingDependencyError": "fastdata.errors",
    "Normalize": "fastdata.gpu_transforms",
    "OutputError": "fastdata.errors",
    "RandomCrop": "fastdata.gpu_transforms",
    "RandomHorizontalFlip": "fastdata.gpu_transforms",
    "RandomResizedCrop": "fastdata.gpu_transforms",
    "SourceError": "fastdata.errors",
    "TextPreprocessConfig": "fastdata.preprocess.text",
    "TokenDataset": "fastdata.token_dataset",
    "TrainConfig": "fastdata.train_config",
    "Trainer": "fastdata.train",
    "VersionError": "fastdata.errors",
    "describe": "fastdata.manifest",
    "init_distributed": "fastdata.distributed",
    "load_manifest": "fastdata.manifest",
    "preprocess_images": "fastdata.preprocess.images",
    "preprocess_text": "fastdata.preprocess.text",
    "shutdown_distributed": "fastdata.distributed",
    "verify": "fastdata.manifest",
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
