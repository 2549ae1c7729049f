"""``fastdata preprocess text``: .txt / .jsonl (optionally gzipped) -> uint16/uint32 token shards.

The parent reads documents in order (one per .txt file, one per .jsonl line), applies the bad-input
policy, and sends chunks of about 1 MB of text to worker processes that tokenise them (batch-encoding);
results are written in source order, so the output is byte-identical for any worker count. Documents
go to train or val by a hash of their position (deterministic, independent of workers). Completed
units are journaled, so a killed run resumes; the manifest is written last.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np

from .._io import fsync_dir, write_bytes_atomic
from ..errors import FastdataError, SourceError, require
from ..formats import token_shards as ts
from ..formats.base import npy_bytes
from ..formats.manifest import TOKENS, new_manifest, write_manifest
from ..formats.tokenizer import Tokenizer, cached_tokenizer, load_tokenizer, token_dtype
from . import journal, ray_pool
from .parallel import default_workers, ordered_map

log = logging.getLogger(__name__)
TEXT_SUFFIXES = (".txt", ".txt.gz", ".jsonl", ".jsonl.gz")
_CHUNK_BYTES = 1 << 20  # text per worker task
_MAX_EXAMPLES = 100  # skipped documents listed by name in the manifest (all are counted)


class TextInputError(FastdataError):
    """A document is unreadable and --on-error is fail."""


@dataclass(frozen=True)
class TextPreprocessConfig:
    """Everything ``fastdata preprocess text`` takes, as one frozen dataclass validated on construction.

    Args:
        src: A ``.txt`` / ``.jsonl`` file (optionally gzipped), or a folder of them (searched recursively,
            hidden paths skipped). A .txt file is one document; a .jsonl line is one.
        out: The dataset folder to write.
        tokenizer: ``"bytes"`` (default), a ``tokenizer.json`` path (needs ``tokenizers``) or
            ``"tiktoken:NAME"`` (needs ``tiktoken``).
        field: The .jsonl key that holds a document's text (default ``"text"``).
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

    src: Path
    out: Path
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
        object.__setattr__(self, "src", Path(self.src))
        object.__setattr__(self, "out", Path(self.out))
        require(0 <= self.val_fraction < 1, "val_fraction", self.val_fraction, "in [0, 1)")
        require(self.on_error in ("skip", "fail"), "on_error", self.on_error, "'skip' or 'fail'")
        require(isinstance(self.shard_tokens, int) and self.shard_tokens >= 1, "shard_tokens", self.shard_tokens,
                "a positive integer")
        require(self.workers is None or self.workers >= 1, "workers", self.workers, "a positive integer")
        require(self.engine in ray_pool.ENGINES, "engine", self.engine, f"one of {ray_pool.ENGINES}")


def text_files(src: Path) -> list[Path]:
    if not src.exists():
        raise SourceError(f"source {src} does not exist: pass a .txt/.jsonl file (optionally .gz) or a folder of them")
    if src.is_file():
        if not src.name.endswith(TEXT_SUFFIXES):
            raise SourceError(f"source {src} is not one of {TEXT_SUFFIXES}")
        return [src]
    files = sorted(p for p in src.rglob("*") if p.is_file() and p.name.endswith(TEXT_SUFFIXES)
                   and not any(part.startswith(".") for part in p.relative_to(src).parts))
    if not files:
        raise SourceError(f"source folder {src} holds no {', '.join(TEXT_SUFFIXES)} files")
    return files


def _open(path: Path) -> Any:
    return gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb")


Doc = tuple[str, int, Optional[str], str, int]  # file, line, text (None if unusable), reason, raw bytes


def iter_documents(files: list[Path], root: Path, field: str) -> Iterator[Doc]:
    """Yield ``(file, line, text, reason, nbytes)`` for every candidate document in order: ``text`` is None
    and ``reason`` says why when it is unusable. Line is 0 for whole-file (.txt) documents."""
    for path in files:
        rel = path.relative_to(root).as_posix() if path != root else path.name
        try:
            with _open(path) as f:
                if ".jsonl" in path.name:
                    yield from _jsonl(f, rel, field)
                else:
                    data = f.read()
                    yield (rel, 0, *_decode_text(data), len(data))
        except (OSError, EOFError, gzip.BadGzipFile) as exc:
            yield rel, 0, None, f"unreadable ({exc})", 0


def _decode_text(data: bytes) -> tuple[Optional[str], str]:
    if not data.strip():
        return None, "empty document"
    try:
        return data.decode("utf-8"), ""
    except UnicodeDecodeError as exc:
        return None, f"invalid UTF-8 at byte {exc.start}"


def _jsonl(f: Any, rel: str, field: str) -> Iterator[Doc]:
    seen = False
    for lineno, raw in enumerate(f, start=1):
        if not raw.strip():
            continue
        seen = True
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            yield rel, lineno, None, f"invalid UTF-8 at byte {exc.start}", len(raw)
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            yield rel, lineno, None, f"invalid JSON ({exc.msg})", len(raw)
            continue
        if not isinstance(obj, dict) or field not in obj:
            yield rel, lineno, None, f"missing field {field!r}", len(raw)
        elif not isinstance(obj[field], str):
            yield rel, lineno, None, f"field {field!r} is not a string", len(raw)
        elif not obj[field]:
            yield rel, lineno, None, "empty document", len(raw)
        else:
            yield rel, lineno, obj[field], "", len(raw)
    if not seen:
        yield rel, 0, None, "empty file", 0


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
        MissingDependencyError: The tokenizer needs ``tokenizers`` or ``tiktoken``, not installed.
        OutputError: The output folder cannot be written, holds something else, or holds a dataset made with
            other arguments and ``overwrite`` is off (DiskFullError when the disk fills up).

    Examples:
        >>> manifest = preprocess_text(TextPreprocessConfig(src="raw/owt", out="data/owt", tokenizer="tiktoken:gpt2"))
        >>> ds = TokenDataset("data/owt", "train", seq_len=1024)
    """
    journal.check_writable(config.out)
    tok = load_tokenizer(config.tokenizer)
    files = text_files(config.src)
    root = config.src if config.src.is_dir() else config.src.parent
    h = hashlib.sha256(json.dumps([_params(config, tok), str(config.src.resolve())], sort_keys=True).encode())
    for p in files:
        st = p.stat()
        h.update(f"{p.relative_to(root)}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    fingerprint = h.hexdigest()
    # NOTE [one writer] and NOTE [overwrite] in fastdata/preprocess/journal.py
    with journal.output(config.out, fingerprint, config.overwrite) as target:
        if target.done is not None:
            return target.done
        config = replace(config, out=target.folder)  # OUT, or the new dataset's folder beside it
        jr, partial = journal.resume(config.out, fingerprint)
        total_bytes = _run(config, tok, files, root, jr, partial)
        return _finish(config, tok, files, jr, partial, fingerprint, total_bytes)


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


def _run(config: TextPreprocessConfig, tok: Tokenizer, files: list[Path], root: Path, jr: journal.Journal,
         partial: Path) -> int:
    from ..progress import progress_bar

    total_bytes = sum(p.stat().st_size for p in files)
    start = jr.source_end
    skipped = list(jr.skipped)
    docs = ((i, *d) for i, d in enumerate(iter_documents(files, root, config.field)) if i >= start)
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
                    jr.add(unit, skipped, partial)
        for unit in writer.finish():
            jr.add(unit, skipped, partial)
        jr.skipped = skipped
    finally:
        bar.close()
    return total_bytes


def _finish(config: TextPreprocessConfig, tok: Tokenizer, files: list[Path], jr: journal.Journal, partial: Path,
            fingerprint: str, total_bytes: int) -> dict[str, Any]:
    out = config.out
    files_out = [f for u in jr.units for f in u["files"] if not f.get("partial")]
    splits = {}
    for split in ts.SPLITS:
        lengths = [np.load(partial / ts.lengths_name(split, u["index"]), allow_pickle=False) for u in jr.units]
        lengths_all = np.concatenate(lengths) if lengths else np.zeros(0, "<i8")
        offsets = np.zeros(len(lengths_all) + 1, dtype="<i8")
        np.cumsum(lengths_all, out=offsets[1:])
        files_out.append(write_bytes_atomic(out / ts.offsets_name(split), npy_bytes(offsets)))
        splits[split] = {"tokens": int(offsets[-1]), "documents": int(len(lengths_all)),
                         "offsets": ts.offsets_name(split),
                         "shards": [{"path": ts.shard_name(split, u["index"]), **u["counts"][split]} for u in jr.units]}
    if splits["train"]["tokens"] == 0:
        first = jr.skipped[0] if jr.skipped else {"file": "?", "reason": "no text"}
        raise SourceError(f"no usable documents in {config.src} (first problem: {first['file']}: {first['reason']})")
    tokens = splits["train"]["tokens"] + splits["val"]["tokens"]
    manifest = new_manifest(
        TOKENS, tokenizer=tok.describe(), dtype=token_dtype(tok.vocab_size).str, splits=splits, files=files_out,
        params=_params(config, tok), fingerprint=fingerprint,
        source={"path": str(config.src.resolve()), "files": len(files), "bytes": total_bytes},
        bytes_per_token=total_bytes / max(1, tokens), skipped_count=len(jr.skipped),
        skipped=[{k: s[k] for k in ("file", "line", "reason")} for s in jr.skipped[:_MAX_EXAMPLES]])
    write_manifest(out, manifest)
    journal.remove_partial(out)
    fsync_dir(out)
    return manifest


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
