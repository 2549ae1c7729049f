"""``fastdata preprocess text``: .txt / .jsonl (gzip or zstd) / .parquet -> uint16/uint32 token shards.

NOTE [text pieces]: the run is one task per piece of the source, so it scales out as the image runs do.
1. A piece is a run of consecutive input files, or one part of a large file (`documents.plan_pieces`). Its
   task (`text_tasks.piece_task`: a worker of the local pool, or a Ray task) reads its documents where they
   are (a URL in ranged reads), tokenises them, sends each to train or val, writes its own shards and their
   document offsets (fastdata/formats/token_shards.py) in a staging folder and publishes them (NOTE [ray
   byte-identity] rule 3); it returns under ~1 KB. The driver lists the files, plans, journals results in
   order and writes the manifest: it holds nothing per document or per token.
2. A piece holds at most 4 source bytes per token of a shard (about one shard of BPE tokens), and for a
   source of fewer than 64 such pieces, at most a 64th of it but at least 16 MiB (never more than the first
   bound), so one 1 GB file keeps 16 workers busy. The plan is a function of the files and ``shard_tokens``
   alone: the same bytes for any workers or nodes.
3. A large file is cut into parts where its format allows: plain JSON Lines by byte range (a part holds the
   lines that start in it), Parquet by row groups. Compressed and .txt files are read whole by one task.
4. A document goes to val by a hash of its file's position in the source and its key in the file (its line's
   byte offset in the decompressed file, its Parquet row), so no task needs what came before it, and the
   same JSON Lines plain, gzipped or zstd-compressed are split alike.
5. A part numbers its lines from its own start and returns its line count; the driver adds the counts of
   the file's parts before it (results come in order), so a skipped document is named by file and line as a
   whole-file read names it. With ``on_error="fail"`` the task returns the problem and the driver raises it.
6. A task returns its skipped count and at most 100 examples; the journal and the manifest keep the run's
   first 100 and the total.
Completed pieces are journaled, so a killed run resumes after them; the manifest is written last.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import logging
import tempfile
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator, Optional, Union

from .._io import fsync_dir, scrub
from ..errors import SourceError, TextInputError, is_whole, require
from ..formats import token_shards as ts
from ..formats.manifest import TOKENS, new_manifest, write_manifest
from ..formats.tokenizer import Tokenizer, load_tokenizer, token_dtype, tokenizer_spec
from ..storage.object_store import is_url, output_location
from . import journal, parallel, ray_pool, store_out
from .documents import Part, TextFile, piece_bytes, plan_pieces, text_files, zstandard_module
from .text_tasks import MAX_EXAMPLES, TextPlan, piece_task

log = logging.getLogger(__name__)


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
        tokenizer: ``"bytes"`` (default), a ``tokenizer.json`` path, a str or an ``os.PathLike`` (needs
            ``tokenizers``) or ``"tiktoken:NAME"`` (needs ``tiktoken``).
        field: The .jsonl key or Parquet column that holds a document's text (default ``"text"``).
        val_fraction: The share of documents that go to the ``val`` split, in [0, 1) (default 0.001).
        workers: Processes that read and tokenise pieces of the source (default None: every core this process
            may use).
        on_error: ``"skip"`` leaves an unusable document out and counts it in the manifest; ``"fail"`` stops
            (default ``"skip"``).
        shard_tokens: Tokens per shard (default ``1 << 26``: 64 Mi tokens, 128 MiB of uint16).
        seed: The seed of the train/val split, a non-negative integer, drawn per document from its file's place in
            the source and its place in the file (default 0).
        overwrite: Replace a dataset in ``out`` made from another source or with other parameters
            (default False).
        progress: Show a progress bar (default True).
        engine: ``"local"`` (default: a process pool here) or ``"ray"`` (Ray tasks on a cluster; the same bytes,
            NOTE [ray byte-identity] in fastdata/preprocess/ray_pool.py); with Ray, ``workers`` is per node of the
            smallest size (`RayPool.open`).
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
        # Path("") is ".": an unset $SRC would read the current folder, an unset $OUT write into it
        require(str(self.src) != "", "src", self.src, "a non-empty path or URL (an empty one is the current folder)")
        require(str(self.out) != "", "out", self.out, "a non-empty path or URL (an empty one is the current folder)")
        object.__setattr__(self, "src", self.src if is_url(self.src) else Path(self.src))  # Path folds s3:// to s3:/
        object.__setattr__(self, "out", output_location(self.out))  # a URL: NOTE [output at a URL]
        require(0 <= self.val_fraction < 1, "val_fraction", self.val_fraction, "in [0, 1)")
        require(self.on_error in ("skip", "fail"), "on_error", self.on_error, "'skip' or 'fail'")
        require(isinstance(self.shard_tokens, int) and self.shard_tokens >= 1, "shard_tokens", self.shard_tokens,
                "a positive integer")
        require(self.workers is None or self.workers >= 1, "workers", self.workers, "a positive integer")
        require(self.engine in ray_pool.ENGINES, "engine", self.engine, f"one of {ray_pool.ENGINES}")
        object.__setattr__(self, "tokenizer", tokenizer_spec(self.tokenizer))  # a Path: its str, as tasks get it
        # (np.int64 is no JSON: the run's fingerprint failed with a TypeError)
        require(is_whole(self.seed) and self.seed >= 0, "seed", self.seed, "a non-negative integer")
        object.__setattr__(self, "seed", int(self.seed))


def preprocess_text(config: TextPreprocessConfig) -> dict[str, Any]:
    """Tokenise text documents into uint16/uint32 token shards, split into train and val.

    The data's way:

        .txt / .jsonl / .parquet files -> pieces (runs of files, parts of large ones) -> one task each, in
            worker processes or on Ray: read, tokenise, train or val by a hash of each document's place in its
            file, shards written with their document offsets -> each piece journaled -> manifest.json last

    The output is byte-identical for any worker count and on Ray (NOTE [text pieces]).
    A killed run resumes from its complete pieces; a rerun with the same arguments returns at once.

    Args:
        config: What to read, what to write and how (`TextPreprocessConfig`).

    Returns:
        The dataset's manifest, as written to ``config.out/manifest.json``.

    Raises:
        SourceError: The source is missing, holds no text files, or no usable document.
        FastdataError: A document is unusable and ``on_error="fail"``, or the tokenizer gave an id outside
            its vocabulary.
        ConfigError: ``tokenizer`` is not a known spec, or a Ray node's tokenizer file is not this one.
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
    fingerprint = _fingerprint(config, tok, files, config.on_error)
    # a run stopped by --on-error fail finished its pieces without a skip: a skip run takes them over
    continues = (_fingerprint(config, tok, files, "fail"),) if config.on_error == "skip" else ()
    if store is not None:  # each piece put by its task (NOTE [output at a URL])
        done = store.prepare(fingerprint, config.overwrite, continues)
        if done is not None:
            return done
        store.drop_old()
        jr = store.resume(fingerprint, continues)
        pool = _pool(config, None)
        with tempfile.TemporaryDirectory(prefix="fastdata-out-") as staging:
            partial = journal.partial_dir(Path(staging))
            partial.mkdir()
            _run(config, tok, files, jr, partial, store, pool)
            return _finish(replace(config, out=Path(staging)), tok, files, jr, fingerprint, store)
    # NOTE [one writer] and NOTE [overwrite] in fastdata/preprocess/journal.py
    with journal.output(config.out, fingerprint, config.overwrite, continues) as target:
        if target.done is not None:
            return target.done
        config = replace(config, out=target.folder)  # OUT, or the new dataset's folder beside it
        jr, partial = journal.resume(config.out, fingerprint, continues)
        _run(config, tok, files, jr, partial, config.out, _pool(config, config.out))
        return _finish(config, tok, files, jr, fingerprint, None)


def _where(src: Union[Path, str]) -> str:
    """The source as the manifest names it: a local path resolved, a URL as given (without secrets)."""
    return scrub(src) if isinstance(src, str) else str(src.resolve())


def _fingerprint(config: TextPreprocessConfig, tok: Tokenizer, files: list[TextFile], on_error: str) -> str:
    """The run's arguments and source (its files' names, sizes and versions), with ``on_error``."""
    params = {**_params(config, tok, files), "on_error": on_error}
    h = hashlib.sha256(json.dumps([params, _where(config.src)], sort_keys=True).encode())
    for f in files:
        h.update(f"{f.rel}:{f.size}:{f.stamp}\n".encode())
    return h.hexdigest()


def _params(config: TextPreprocessConfig, tok: Tokenizer, files: list[TextFile]) -> dict[str, Any]:
    return {"tokenizer": tok.describe(), "field": config.field, "val_fraction": config.val_fraction,
            "on_error": config.on_error, "shard_tokens": config.shard_tokens, "seed": config.seed,
            "piece_bytes": piece_bytes(sum(f.size for f in files), config.shard_tokens)}


def _pool(config: TextPreprocessConfig, out: Optional[Path]) -> Optional[ray_pool.RayPool]:
    """The Ray pool of a ``--ray`` run (None: the local pool), told the local folders its tasks need."""
    if config.engine != "ray":
        return None
    needs = [] if isinstance(config.src, str) else [str(config.src)]
    return ray_pool.RayPool.open(config.ray_address, config.workers, needs + ([str(out)] if out else []))


def _run(config: TextPreprocessConfig, tok: Tokenizer, files: list[TextFile], jr: journal.Journal, partial: Path,
         out: Any, pool: Optional[ray_pool.RayPool]) -> None:
    """Run the pieces after the journaled ones and journal each in order (NOTE [text pieces]); ``out``: a local
    folder or a `StoreOut`."""
    from ..progress import progress_bar

    count = sum(1 for _ in plan_pieces(files, config.shard_tokens))
    plan = TextPlan(config.tokenizer, tok.definition_hash, config.field, config.val_fraction, config.seed,
                    config.on_error, config.shard_tokens, tok.eos_id, tok.vocab_size, token_dtype(tok.vocab_size).str,
                    max(5, len(str(count - 1))))
    lines: dict[int, int] = {}  # a cut file's lines and documents in its parts so far (NOTE [text pieces] 5)
    found: dict[int, int] = {}
    for unit in jr.units:
        _count_parts(unit["parts"], lines, found)
    start = len(jr.units)
    skipped = list(jr.skipped)
    bar = progress_bar(total=sum(f.size for f in files), desc="tokenize", unit="B", unit_scale=True,
                       enabled=config.progress)
    pieces = plan_pieces(files, config.shard_tokens)
    bar.update(sum(p.nbytes for piece in itertools.islice(pieces, start) for p in piece))
    sizes: deque[int] = deque()  # each task's source bytes, for the bar

    def tasks() -> Iterator[tuple[TextPlan, int, list[Part], Any]]:
        for k, piece in enumerate(pieces, start):
            sizes.append(sum(p.nbytes for p in piece))
            yield plan, k, piece, out
    workers = max(1, min(pool.workers if pool else config.workers or parallel.default_workers(), count - start))
    try:
        for unit in (pool.ordered_map if pool else parallel.ordered_map)(piece_task, tasks(), workers):
            fail, examples = unit.pop("fail", None), unit.pop("examples", [])
            for e in examples + ([fail] if fail else []):  # numbered from its part's start: from the file's now
                of = e.pop("of")  # (nothing counted for a whole file, or a first part: it stays)
                if e["line"]:
                    e["line"] += lines.get(of, 0)
            if fail:
                raise _unusable(fail)
            for i in _count_parts(unit["parts"], lines, found):  # a cut file without a line of text
                e = {"file": files[i].rel, "line": 0, "reason": "empty file"}
                if config.on_error == "fail":
                    raise _unusable(e)
                examples.append(e)
                unit["skipped_count"] += 1
            skipped += [{"index": unit["index"], **e} for e in examples[:max(0, MAX_EXAMPLES - len(skipped))]]
            jr.add(unit, skipped, partial)
            bar.update(sizes.popleft())
        jr.skipped = skipped
    finally:
        bar.close()


def _unusable(e: dict[str, Any]) -> TextInputError:
    return TextInputError(f"{e['file']}{':' + str(e['line']) if e['line'] else ''}: {e['reason']} (rerun with "
                          "--on-error skip to leave such documents out: it keeps the shards made so far)")


def _count_parts(parts: list[list[int]], lines: dict[int, int], found: dict[int, int]) -> list[int]:
    """Count a piece's cut-file parts (``[file, k, parts, lines, documents]``) into ``lines`` and ``found``;
    returns the files whose last part this was and that held no document."""
    empty = []
    for i, k, n, n_lines, n_docs in parts:
        lines[i] = lines.get(i, 0) + n_lines
        found[i] = found.get(i, 0) + n_docs
        if k == n - 1:
            lines.pop(i)
            if not found.pop(i):
                empty.append(i)
    return empty


def _finish(config: TextPreprocessConfig, tok: Tokenizer, files: list[TextFile], jr: journal.Journal,
            fingerprint: str, store: Optional[store_out.StoreOut]) -> dict[str, Any]:
    out = config.out
    splits = {}
    for split in ts.SPLITS:
        shards = [sh for u in jr.units for sh in u["shards"][split]]
        splits[split] = {"tokens": sum(sh["tokens"] for sh in shards),
                         "documents": sum(sh["documents"] for sh in shards), "shards": shards}
    if splits["train"]["tokens"] == 0:
        raise _no_train(config, splits["val"]["documents"], jr.skipped)
    tokens = splits["train"]["tokens"] + splits["val"]["tokens"]
    total_bytes = sum(f.size for f in files)
    manifest = new_manifest(
        TOKENS, tokenizer=tok.describe(), dtype=token_dtype(tok.vocab_size).str, splits=splits,
        files=[f for u in jr.units for f in u["files"]], params=_params(config, tok, files), fingerprint=fingerprint,
        source={"path": _where(config.src), "files": len(files), "bytes": total_bytes},
        bytes_per_token=total_bytes / max(1, tokens), skipped_count=sum(u["skipped_count"] for u in jr.units),
        skipped=[{k: s[k] for k in ("file", "line", "reason")} for s in jr.skipped[:MAX_EXAMPLES]])
    write_manifest(out, manifest)
    if store is not None:
        store.finish(out, [], [])
        return manifest
    journal.remove_partial(out)
    fsync_dir(out)
    return manifest


def _no_train(config: TextPreprocessConfig, val_documents: int, skipped: list[dict[str, Any]]) -> SourceError:
    """The error of a run whose train split is empty: its usable documents all went to val, or there were none."""
    if val_documents:  # (a tiny source: one document drawn into val at --val-fraction 0.5)
        return SourceError(f"the train split of {_where(config.src)} is empty: all {val_documents} usable "
                           f"document(s) went to the validation split (val_fraction={config.val_fraction}): "
                           "rerun with a lower --val-fraction (0 keeps every document in train) and --overwrite, "
                           "or with more documents")
    first = skipped[0] if skipped else {"file": "?", "reason": "no text"}
    return SourceError(f"no usable documents in {_where(config.src)} (first problem: {first['file']}: "
                       f"{first['reason']})")


def summary(manifest: dict[str, Any], limit: int = 5) -> str:
    s = manifest["splits"]
    lines = [f"{s['train']['documents'] + s['val']['documents']} documents, {s['train']['tokens']:,} train + "
             f"{s['val']['tokens']:,} val tokens ({manifest['tokenizer']['kind']}, vocab "
             f"{manifest['tokenizer']['vocab_size']}, {manifest['bytes_per_token']:.2f} source bytes/token)"]
    if manifest["skipped_count"]:
        lines.append(f"skipped {manifest['skipped_count']} document(s) (first ones listed in manifest.json):")
        for e in manifest["skipped"][:limit]:
            lines.append(f"  {e['file']}{':' + str(e['line']) if e['line'] else ''}: {e['reason']}")
    return "\n".join(lines)
