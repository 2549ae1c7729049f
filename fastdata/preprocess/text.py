"""``fastdata preprocess text``: .txt / .jsonl (gzip or zstd) / .parquet -> uint16/uint32 token shards.

The parent reads documents in order (one per .txt file, one per JSON Lines line or Parquet row: documents.py),
from local files or streamed from a URL (NOTE [url source] in fastdata/preprocess/sources.py), applies the bad-input
policy, and sends chunks of about 1 MB of text to worker processes that tokenise them (batch-encoding);
results are written in source order, so the output is byte-identical for any worker count. Documents
go to train or val by a hash of their position (deterministic, independent of workers). Completed
units are journaled, so a killed run resumes; the manifest is written last.
"""
from __future__ import annotations

import hashlib
import json
import logging
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import numpy as np

from .._io import fsync_dir, scrub, write_bytes_atomic
from ..errors import FastdataError, SourceError, TextInputError, require
from ..formats import token_shards as ts
from ..formats.base import npy_bytes
from ..formats.manifest import TOKENS, new_manifest, write_manifest
from ..formats.tokenizer import Tokenizer, cached_tokenizer, load_tokenizer, token_dtype
from ..storage.remote import is_url
from . import journal, ray_pool, store_out
from .parallel import default_workers, ordered_map
from .documents import TextFile, iter_documents, text_files, zstandard_module

log = logging.getLogger(__name__)
_CHUNK_BYTES = 1 << 20  # text per worker task
_MAX_EXAMPLES = 100  # skipped documents listed by name in the manifest (all are counted)


@dataclass(frozen=True)
class TextPreprocessConfig:
    """Everything ``fastdata preprocess text`` takes, as one frozen dataclass validated on construction.

    Args:
        src: A ``.txt`` / ``.jsonl`` file, plain, gzipped (``.gz``) or zstd-compressed (``.zst``: needs
            ``zstandard``), a ``.json.gz`` / ``.json.zst`` file of JSON Lines (C4's and Dolma's naming; plain
            ``.json`` is never read) or a ``.parquet`` file (Hugging Face's layout: needs ``pyarrow``), or a folder
            of them (searched recursively, hidden paths skipped), local or an fsspec URL (``s3://bucket/owt/``:
            read where it lives). A .txt file is one document; a JSON Lines line is one, and so is a Parquet row
            (named by its row number from 1).
        out: The dataset folder to write.
        tokenizer: ``"bytes"`` (default), a ``tokenizer.json`` path (needs ``tokenizers``) or
            ``"tiktoken:NAME"`` (needs ``tiktoken``).
        field: The .jsonl key or Parquet column that holds a document's text (default ``"text"``).
        val_fraction: The share of documents that go to the ``val`` split, in [0, 1) (default 0.001).
        workers: Tokenising processes (default None: every core this process may use).
        on_error: ``"skip"`` leaves an unusable document out and counts it in the manifest; ``"fail"`` stops
            (default ``"skip"``).
        shard_tokens: Tokens per shard (default ``1 << 26``: 64 Mi tokens, 128 MiB of uint16).
        seed: The seed of the train/val split, drawn per document position (default 0).
        overwrite: Replace a dataset in ``out`` made from another source or with other parameters
            (default False).
        progress: Show a progress bar (default True).
        engine: ``"local"`` (default: a process pool here) or ``"ray"`` (Ray tasks on a cluster; the same bytes,
            NOTE [ray byte-identity] in fastdata/preprocess/ray_pool.py); with Ray, ``workers`` is per node. The
            ``bytes`` tokenizer always runs in this process.
        ray_address: The Ray cluster's ``HOST:PORT`` (default None: the one on this machine, or a new local one).

    Raises:
        ConfigError: A field is out of range; the message names the field and echoes the value.
    """

    src: Union[Path, str]  # a str only for a URL
    out: Union[Path, str]  # a str only for a URL (NOTE [output at a URL] in fastdata/preprocess/store_out.py)
    tokenizer: str = "bytes"
    field: str = "text"
    val_fraction: float = 0.001
    workers: Optional[int] = None
    on_error: str = "skip"
    shard_tokens: int = 1 << 26  # 64 Mi tokens (128 MiB of uint16) per shard
    seed: int = 0
    overwrite: bool = False
    progress: bool = True
    engine: str = "local"  # or "ray": the same bytes (NOTE [ray byte-identity] in fastdata/preprocess/ray_pool.py)
    ray_address: Optional[str] = None  # HOST:PORT; None: the cluster on this machine, or a new local one

    def __post_init__(self) -> None:
        object.__setattr__(self, "src", self.src if is_url(self.src) else Path(self.src))  # Path folds s3:// to s3:/
        object.__setattr__(self, "out", self.out if is_url(self.out) else Path(self.out))
        require(0 <= self.val_fraction < 1, "val_fraction", self.val_fraction, "in [0, 1)")
        require(self.on_error in ("skip", "fail"), "on_error", self.on_error, "'skip' or 'fail'")
        require(isinstance(self.shard_tokens, int) and self.shard_tokens >= 1, "shard_tokens", self.shard_tokens,
                "a positive integer")
        require(self.workers is None or self.workers >= 1, "workers", self.workers, "a positive integer")
        require(self.engine in ray_pool.ENGINES, "engine", self.engine, f"one of {ray_pool.ENGINES}")


def is_val(index: np.ndarray | int, fraction: float, seed: int) -> np.ndarray:
    """Deterministic split by document position: splitmix64(seed, index) / 2**64 < fraction."""
    return (ts.splitmix(seed, index) >> np.uint64(11)).astype(np.float64) / float(2 ** 53) < fraction


Task = tuple[str, list[int], list[str], list[bool]]


def _tokenize(task: Task) -> tuple[list[int], list[np.ndarray], list[bool]]:
    """Worker: tokenise one chunk of documents (the tokenizer is built once per process)."""
    spec, indices, texts, ok = task
    return indices, cached_tokenizer(spec).encode_batch(texts), ok


def preprocess_text(config: TextPreprocessConfig) -> dict[str, Any]:
    """Tokenise text documents into uint16/uint32 token shards, split into train and val.

    The data's way:

        .txt / .jsonl documents, in order -> chunks of about 1 MB of text -> worker processes tokenise
            -> results written in source order, an end-of-document token between documents -> train or val
            by a hash of each document's position -> each complete unit journaled -> manifest.json last

    The output is byte-identical for any worker count.
    A killed run resumes from its complete units; a rerun with the same arguments returns at once.

    Args:
        config: What to read, what to write and how (`TextPreprocessConfig`).

    Returns:
        The dataset's manifest, as written to ``config.out/manifest.json``.

    Raises:
        SourceError: The source is missing, holds no text files, or no usable document.
        FastdataError: A document is unusable and ``on_error="fail"``, or the tokenizer gave an id outside
            its vocabulary.
        ConfigError: ``tokenizer`` is not a known spec.
        MissingDependencyError: The tokenizer needs ``tokenizers`` or ``tiktoken``, or a .zst file needs
            ``zstandard``, not installed.
        OutputError: The output folder cannot be written, holds something else, or holds a dataset made with
            other arguments and ``overwrite`` is off (DiskFullError when the disk fills up).

    Examples:
        >>> manifest = preprocess_text(TextPreprocessConfig(src="raw/owt", out="data/owt", tokenizer="tiktoken:gpt2"))
        >>> ds = TokenDataset("data/owt", "train", seq_len=1024)
    """
    store = store_out.StoreOut(config.out) if isinstance(config.out, str) else None
    if store is not None:
        store.check_writable()
    else:
        journal.check_writable(config.out)
    tok = load_tokenizer(config.tokenizer)
    files = text_files(config.src)
    if any(f.rel.endswith(".zst") for f in files):
        zstandard_module()  # missing: said now, before any output
    h = hashlib.sha256(json.dumps([_params(config, tok), _where(config.src)], sort_keys=True).encode())
    for f in files:
        h.update(f"{f.rel}:{f.size}:{f.stamp}\n".encode())
    fingerprint = h.hexdigest()
    if store is not None:  # staged here, each unit put when complete (NOTE [output at a URL])
        done = store.prepare(fingerprint, config.overwrite)
        if done is not None:
            return done
        store.drop_old()
        jr = store.resume(fingerprint)
        with tempfile.TemporaryDirectory(prefix="fastdata-out-") as staging:
            partial = journal.partial_dir(Path(staging))
            partial.mkdir()
            config = replace(config, out=Path(staging))
            total_bytes = _run(config, tok, files, jr, partial, store)
            return _finish(config, tok, files, jr, partial, fingerprint, total_bytes, store)
    # NOTE [one writer] and NOTE [overwrite] in fastdata/preprocess/journal.py
    with journal.output(config.out, fingerprint, config.overwrite) as target:
        if target.done is not None:
            return target.done
        config = replace(config, out=target.folder)  # OUT, or the new dataset's folder beside it
        jr, partial = journal.resume(config.out, fingerprint)
        total_bytes = _run(config, tok, files, jr, partial, None)
        return _finish(config, tok, files, jr, partial, fingerprint, total_bytes, None)


def _where(src: Union[Path, str]) -> str:
    """The source as the manifest names it: a local path resolved, a URL as given (without secrets)."""
    return scrub(src) if isinstance(src, str) else str(src.resolve())


def _params(config: TextPreprocessConfig, tok: Tokenizer) -> dict[str, Any]:
    return {"tokenizer": tok.describe(), "field": config.field, "val_fraction": config.val_fraction,
            "on_error": config.on_error, "shard_tokens": config.shard_tokens, "seed": config.seed}


def _chunks(docs: Iterator[tuple[int, str, int, Optional[str], str, int]], spec: str,
            skipped: list[dict[str, Any]], on_error: str, bar: Any) -> Iterator[Task]:
    """Group documents into ~1 MB tasks; unusable ones are recorded (or raise) and travel as empty
    placeholders flagged not-ok, so every source position stays covered by the unit that follows it."""
    indices: list[int] = []
    texts: list[str] = []
    ok: list[bool] = []
    size = 0
    for idx, rel, line, text, reason, nbytes in docs:
        bar.update(nbytes)
        if text is None:
            where = f"{rel}:{line}" if line else rel
            if on_error == "fail":
                raise TextInputError(f"{where}: {reason} (use --on-error skip to leave such documents out)")
            skipped.append({"index": idx, "file": rel, "line": line, "reason": reason})
        indices.append(idx)
        texts.append(text or "")
        ok.append(text is not None)
        size += len(text or "")
        if size >= _CHUNK_BYTES:
            yield spec, indices, texts, ok
            indices, texts, ok, size = [], [], [], 0
    if indices:
        yield spec, indices, texts, ok


def _run(config: TextPreprocessConfig, tok: Tokenizer, files: list[TextFile], jr: journal.Journal,
         partial: Path, store: Optional[store_out.StoreOut]) -> int:
    from ..progress import progress_bar

    total_bytes = sum(f.size for f in files)
    start = jr.source_end
    skipped = list(jr.skipped)
    docs = ((i, *d) for i, d in enumerate(iter_documents(files, config.field)) if i >= start)
    writer = ts.TokenUnitWriter(config.out, partial, config.shard_tokens, tok.eos_id, token_dtype(tok.vocab_size),
                                len(jr.units))
    # The bytes tokenizer is one np.frombuffer per document: shipping text to worker processes costs more
    # than it saves (benchmarks/RESULTS.md), so it always runs here.
    ray = config.engine == "ray" and tok.kind != "bytes"
    pool = ray_pool.RayPool.open(config.ray_address, config.workers) if ray else None
    workers = pool.workers if pool else 1 if tok.kind == "bytes" else config.workers or default_workers()
    bar = progress_bar(total=total_bytes, desc="tokenize", unit="B", unit_scale=True, enabled=config.progress)
    try:
        tasks = _chunks(docs, config.tokenizer, skipped, config.on_error, bar)
        for indices, encoded, ok in (pool.ordered_map if pool else ordered_map)(_tokenize, tasks, workers):
            val = is_val(np.asarray(indices), config.val_fraction, config.seed)
            for idx, ids, v, good in zip(indices, encoded, val, ok):
                if not good:
                    writer.mark(idx)
                    continue
                if len(ids) and int(ids.max()) >= tok.vocab_size:
                    raise FastdataError(f"tokenizer produced id {int(ids.max())} >= its vocabulary size "
                                        f"{tok.vocab_size}")
                for unit in writer.add("val" if v else "train", ids, idx):
                    _put(unit, config.out, partial, store)
                    jr.add(unit, skipped, partial)
        for unit in writer.finish():
            _put(unit, config.out, partial, store)
            jr.add(unit, skipped, partial)
        jr.skipped = skipped
    finally:
        bar.close()
    return total_bytes


def _put(unit: dict[str, Any], out: Path, partial: Path, store: Optional[store_out.StoreOut]) -> None:
    """A complete unit's files into the store (its document lengths under the journal's prefix, for
    `_finish`), the local copies removed; nothing without a store."""
    if store is None:
        return
    for f in unit["files"]:
        local = (partial if f.get("partial") else out) / f["path"]
        store.put(local, store_out.journal_key(f))
        local.unlink()


def _finish(config: TextPreprocessConfig, tok: Tokenizer, files: list[TextFile], jr: journal.Journal, partial: Path,
            fingerprint: str, total_bytes: int, store: Optional[store_out.StoreOut]) -> dict[str, Any]:
    out = config.out
    files_out = [f for u in jr.units for f in u["files"] if not f.get("partial")]
    splits = {}
    for split in ts.SPLITS:
        lengths = [np.load(_local(partial, ts.lengths_name(split, u["index"]), store), allow_pickle=False)
                   for u in jr.units]
        lengths_all = np.concatenate(lengths) if lengths else np.zeros(0, "<i8")
        offsets = np.zeros(len(lengths_all) + 1, dtype="<i8")
        np.cumsum(lengths_all, out=offsets[1:])
        files_out.append(write_bytes_atomic(out / ts.offsets_name(split), npy_bytes(offsets)))
        splits[split] = {"tokens": int(offsets[-1]), "documents": int(len(lengths_all)),
                         "offsets": ts.offsets_name(split),
                         "shards": [{"path": ts.shard_name(split, u["index"]), **u["counts"][split]} for u in jr.units]}
    if splits["train"]["tokens"] == 0:
        first = jr.skipped[0] if jr.skipped else {"file": "?", "reason": "no text"}
        raise SourceError(f"no usable documents in {_where(config.src)} (first problem: {first['file']}: "
                          f"{first['reason']})")
    tokens = splits["train"]["tokens"] + splits["val"]["tokens"]
    manifest = new_manifest(
        TOKENS, tokenizer=tok.describe(), dtype=token_dtype(tok.vocab_size).str, splits=splits, files=files_out,
        params=_params(config, tok), fingerprint=fingerprint,
        source={"path": _where(config.src), "files": len(files), "bytes": total_bytes},
        bytes_per_token=total_bytes / max(1, tokens), skipped_count=len(jr.skipped),
        skipped=[{k: s[k] for k in ("file", "line", "reason")} for s in jr.skipped[:_MAX_EXAMPLES]])
    write_manifest(out, manifest)
    if store is not None:
        store.finish(out, [ts.offsets_name(split) for split in ts.SPLITS], [])
        return manifest
    journal.remove_partial(out)
    fsync_dir(out)
    return manifest


def _local(partial: Path, name: str, store: Optional[store_out.StoreOut]) -> Path:
    """A journal file (a unit's document lengths) here, fetched from the store when an earlier run made it."""
    path = partial / name
    if store is not None and not path.exists():
        store.get(f"{journal.PARTIAL_DIR}/{name}", path)
    return path


def summary(manifest: dict[str, Any], limit: int = 5) -> str:
    s = manifest["splits"]
    lines = [f"{s['train']['documents'] + s['val']['documents']} documents, {s['train']['tokens']:,} train + "
             f"{s['val']['tokens']:,} val tokens ({manifest['tokenizer']['kind']}, vocab "
             f"{manifest['tokenizer']['vocab_size']}, {manifest['bytes_per_token']:.2f} bytes/token)"]
    if manifest["skipped_count"]:
        lines.append(f"skipped {manifest['skipped_count']} document(s) (first ones listed in manifest.json):")
        for e in manifest["skipped"][:limit]:
            lines.append(f"  {e['file']}{':' + str(e['line']) if e['line'] else ''}: {e['reason']}")
    return "\n".join(lines)
