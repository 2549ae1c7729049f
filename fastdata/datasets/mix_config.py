"""A Mixture described in words (``fastdata train --mix``): ``name=path:weight`` options or a JSON/TOML file,
its sources opened as the datasets their manifests say they are.

A file holds ``{"sources": {name: {"path": ..., "weight": ...}}, "mix": "sample", "stop": null,
"epoch_size": null, "allow_new_sources": false}`` (JSON), or the same as TOML (``[sources.web]``,
``path = "s3://b/web"``, ``weight = 0.7``); only ``sources`` is required, and a source's ``path``.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from ..errors import ConfigError
from ..formats.manifest import IMAGES_LMDB, IMAGES_NPY, TOKENS
from ..storage.object_store import RETRY_SECONDS, is_url
from ..storage.opening import open_path
from ..storage.streamed import streamed_files
from .mixture import Mixture, cache_shares

FILE_KEYS = ("sources", "mix", "stop", "epoch_size", "allow_new_sources")  # a mixture file's keys
SOURCE_KEYS = ("path", "weight")  # a source entry's keys


@dataclass(frozen=True)
class MixSpec:
    """Sources ``{name: (path or URL, weight)}`` and the Mixture's options."""

    sources: dict[str, tuple[str, float]]
    mix: str = "sample"
    stop: Optional[str] = None
    epoch_size: Optional[int] = None
    allow_new_sources: bool = False  # resume a state that lacks some sources (``--allow-new-sources``)
    where: str = "--mix"  # what the user wrote it in, for messages


def _weight(text: str, where: str) -> float:
    try:
        w = float(text)
    except ValueError:
        w = math.nan
    if not math.isfinite(w) or w < 0:
        raise ConfigError(f"{where}: the weight must be a number >= 0, got {text!r} (name=PATH:WEIGHT)")
    return w


def parse_one(text: str) -> tuple[str, str, float]:
    """``(name, path, weight)`` from ``name=path:weight`` (``name=`` optional: the folder's name; ``:weight``
    optional: 1). A URL keeps its ``scheme://``."""
    name, sep, rest = text.partition("=")
    if not sep or "/" in name or ":" in name:
        name, rest = "", text
    path, weight = rest, 1.0
    head, colon, tail = rest.rpartition(":")
    port = re.fullmatch(r"https?://[^/]*", head) and tail.isdigit()  # http://host:PORT (s3://b:3: a weight)
    if colon and head and "/" not in tail and not port:  # (a weight has no "/": s3://b/x, host:9000/b/x)
        path, weight = head, _weight(tail, f"--mix {text}")
    if not path:
        raise ConfigError(f"--mix {text}: no dataset path (name=PATH:WEIGHT, e.g. web=s3://bucket/web:0.7)")
    return name or Path(path.rstrip("/")).name, path, weight


def parse_mix(values: Sequence[str]) -> MixSpec:
    """The ``--mix`` options: each ``name=path:weight``, or one JSON/TOML file (see the module's docstring).

    Raises:
        ConfigError: a malformed option or file, a name given twice.
    """
    if len(values) == 1 and Path(values[0]).suffix in (".json", ".toml") and Path(values[0]).is_file():
        return _from_file(Path(values[0]))
    sources: dict[str, tuple[str, float]] = {}
    for text in values:
        name, path, weight = parse_one(text)
        if name in sources:
            raise ConfigError(f"--mix names source {name!r} twice: give each source its own name (name=PATH:WEIGHT)")
        sources[name] = (path, weight)
    if not sources:
        raise ConfigError("--mix needs at least one source (name=PATH:WEIGHT)")
    return MixSpec(sources)


def _from_file(path: Path) -> MixSpec:
    try:
        if path.suffix == ".toml":
            try:
                import tomllib
            except ModuleNotFoundError:  # Python 3.10: the same parser, as the tomli package (a dependency there)
                import tomli as tomllib

            raw = tomllib.loads(path.read_text())
        else:
            raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the mixture file {path}: {exc}") from exc
    if not isinstance(raw, dict) or not isinstance(raw.get("sources"), dict) or not raw["sources"]:
        raise ConfigError(f"{path} must hold a 'sources' table: {{name: {{path, weight}}}}")
    unknown = sorted(set(raw) - set(FILE_KEYS))
    if unknown:
        raise ConfigError(f"{path}: unknown key {unknown[0]!r} (keys: {', '.join(FILE_KEYS)})")
    sources = {}
    for name, entry in raw["sources"].items():
        if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
            raise ConfigError(f"{path}: source {name!r} needs a 'path' (and a 'weight')")
        unknown = sorted(set(entry) - set(SOURCE_KEYS))  # (a misspelt weight would otherwise weigh 1)
        if unknown:
            raise ConfigError(f"{path}: source {name!r}: unknown key {unknown[0]!r} (keys: {', '.join(SOURCE_KEYS)})")
        sources[str(name)] = (entry["path"], _weight(str(entry.get("weight", 1.0)), f"{path}: source {name!r}"))
    epoch_size, allow = raw.get("epoch_size"), raw.get("allow_new_sources", False)
    if epoch_size is not None and (type(epoch_size) is not int or epoch_size < 1):  # (JSON's true is no size)
        raise ConfigError(f"{path}: epoch_size must be a positive integer (positions a mixture epoch takes), got "
                          f"{epoch_size!r}")
    if type(allow) is not bool:
        raise ConfigError(f"{path}: allow_new_sources must be true or false, got {allow!r}")
    return MixSpec(sources, raw.get("mix", "sample"), raw.get("stop"), epoch_size, allow, str(path))


def open_mixture(spec: MixSpec, *, storage: str = "mmap", seq_len: int = 256, seed: int = 0,
                 shuffle_window: Optional[int] = None, cache_dir: Union[str, Path, None] = None,
                 cache_limit: Union[int, str, None] = None, device: Any = "cpu",
                 retry_seconds: float = RETRY_SECONDS) -> Mixture:
    """Open every source of ``spec`` (image folders as FastDataset, token folders' train split as TokenDataset;
    URLs through the node cache, ``cache_limit`` split among them by weight, again whenever the weights change:
    `Mixture`'s ``cache_limit``) as one `Mixture`, with ``spec``'s options. A URL's reads are retried over
    ``retry_seconds``, as for one dataset (NOTE [retry budget] in fastdata/storage/object_store.py).

    Raises:
        ConfigError: sources of different kinds or classes (the two are named), bad weights or options.
        FormatError: a source is not a dataset, or its store stayed unreachable for ``retry_seconds``.
    """
    urls = {n: w for n, (p, w) in spec.sources.items() if is_url(p)}
    if urls and not sum(urls.values()):  # URL sources all of weight 0 share the budget equally, as Mixture does
        urls = dict.fromkeys(urls, 1.0)
    shares = cache_shares(cache_limit, urls) if cache_limit is not None and urls else {}
    datasets: dict[str, Any] = {}
    for name, (path, _) in spec.sources.items():
        remote = {"cache_dir": cache_dir, "cache_limit": shares.get(name), "retry_seconds": retry_seconds} \
            if is_url(path) else {}
        opened = open_path(path, (IMAGES_NPY, IMAGES_LMDB, TOKENS), streamed=lambda m: streamed_files(m, storage),
                           **remote)
        if opened.manifest["format"] == TOKENS:
            from .tokens import TokenDataset

            datasets[name] = TokenDataset(opened, "train", seq_len, storage=storage)
        else:
            from .images import FastDataset

            datasets[name] = FastDataset(opened, storage=storage, device=device)
    return Mixture(datasets, {n: w for n, (_, w) in spec.sources.items()}, seed=seed, mix=spec.mix, stop=spec.stop,
                   epoch_size=spec.epoch_size, shuffle_window=shuffle_window,
                   allow_new_sources=spec.allow_new_sources, cache_limit=cache_limit if shares else None)
