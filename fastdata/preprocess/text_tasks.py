"""The task side of ``fastdata preprocess text`` (NOTE [text pieces] in text.py): one piece of the source read,
tokenised, sent to train or val, written and published, in a worker of the local pool or as a Ray task.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from ..errors import ConfigError, FastdataError
from ..formats import token_shards as ts
from ..formats.tokenizer import Tokenizer, cached_tokenizer
from . import store_out
from .documents import Part, PartDocuments

_CHUNK_BYTES = 1 << 20  # text tokenised in one batch
MAX_EXAMPLES = 100  # skipped documents listed by name in the manifest (all are counted)


def is_val(index: np.ndarray | int, fraction: float, seed: int) -> np.ndarray:
    """Deterministic split: splitmix64(seed, index) / 2**64 < fraction."""
    return (ts.splitmix(seed, index) >> np.uint64(11)).astype(np.float64) / float(2 ** 53) < fraction


def file_seed(seed: int, index: int) -> int:
    """The split's seed for the source's ``index``-th file (NOTE [text pieces] 4)."""
    return int(ts.splitmix(seed, index))


@dataclass(frozen=True)
class TextPlan:
    """What every piece's task needs besides its parts (pickled with each task: under ~300 bytes)."""

    spec: str
    definition: str  # the tokenizer's definition hash where the run started (a task checks its own)
    field: str
    val_fraction: float
    seed: int
    on_error: str
    shard_tokens: int
    eos_id: int
    vocab_size: int
    dtype: str
    width: int


def piece_task(task: tuple[TextPlan, int, list[Part], Any]) -> dict[str, Any]:
    """A piece's task (NOTE [text pieces] 1): its documents read, tokenised, split, written and published.

    Args:
        task: ``(plan, piece number, its parts, OUT)``: OUT a local folder (files renamed into it) or a
            `StoreOut` (put into the store).

    Returns:
        Its journal record: ``index``, ``files``, ``shards`` per split, ``skipped_count``, ``examples`` (at most
        `MAX_EXAMPLES`), ``parts`` (each cut file's part: ``[file, k, parts, lines, documents]``) and, with
        ``on_error="fail"``, ``fail`` (the first unusable document; then nothing is published).

    Raises:
        ConfigError: The tokenizer here is not the one the run started with.
        FastdataError: The tokenizer gave an id outside its vocabulary.
    """
    plan, index, parts, out = task
    tok = cached_tokenizer(plan.spec)
    if tok.definition_hash != plan.definition:  # a Ray node with another file at the same path
        raise ConfigError(f"the tokenizer {plan.spec} on {socket.gethostname()} is not the one this run started with "
                          "(its definition differs): give every node the same tokenizer file")
    stage = store_out.task_stage(out)
    writer = ts.PieceWriter(stage, index, plan.width, plan.shard_tokens, plan.eos_id, plan.dtype)
    examples: list[dict[str, Any]] = []
    ranged: list[list[int]] = []
    skipped = 0
    try:
        for part in parts:
            docs = PartDocuments(part, plan.field)
            n, fail = _part(tok, plan, writer, docs, examples)
            if fail is not None:
                return {"index": index, "fail": fail}
            skipped += n
            if part.parts > 1:
                ranged.append([part.index, part.k, part.parts, docs.lines, docs.documents])
        files = writer.finish()
        store_out.publish(stage, files, out)
    finally:
        store_out.drop_stage(stage)
    return {"index": index, "source_end": index + 1, "files": files, "shards": writer.shards,
            "skipped_count": skipped, "examples": examples, "parts": ranged}


def _part(tok: Tokenizer, plan: TextPlan, writer: ts.PieceWriter, docs: PartDocuments,
          examples: list[dict[str, Any]]) -> tuple[int, Optional[dict[str, Any]]]:
    """One part's documents tokenised into ``writer`` about a MB of text at a time; returns its unusable
    documents' count (the first ones added to ``examples``), or with ``on_error="fail"`` the first one."""
    part = docs.part
    seed, skipped = file_seed(plan.seed, part.index), 0
    keys: list[int] = []
    texts: list[str] = []
    held = 0
    for key, line, text, reason in docs:
        if text is None:
            where = {"file": part.file.rel, "line": line, "reason": reason, "of": part.index}
            if plan.on_error == "fail":
                return skipped, where
            skipped += 1
            if len(examples) < MAX_EXAMPLES:
                examples.append(where)
            continue
        keys.append(key)
        texts.append(text)
        held += len(text)
        if held >= _CHUNK_BYTES:
            _encode(tok, plan, writer, keys, texts, seed)
            keys, texts, held = [], [], 0
    _encode(tok, plan, writer, keys, texts, seed)
    return skipped, None


def _encode(tok: Tokenizer, plan: TextPlan, writer: ts.PieceWriter, keys: list[int], texts: list[str],
            seed: int) -> None:
    if not texts:
        return
    val = is_val(np.asarray(keys, dtype=np.uint64), plan.val_fraction, seed)
    for ids, v in zip(tok.encode_batch(texts), val):
        if len(ids) and int(ids.max()) >= plan.vocab_size:
            raise FastdataError(f"tokenizer produced id {int(ids.max())} >= its vocabulary size {plan.vocab_size}")
        writer.add("val" if v else "train", ids)
