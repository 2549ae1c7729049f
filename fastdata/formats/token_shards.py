"""Token shards: per split, a flat stream of token ids with the end-of-document id after every document.

``train-00000.npy`` ... and ``val-00000.npy`` ... hold ``<u2`` (vocab <= 65,536) or ``<u4`` ids; a
document never straddles two shards. ``train-docs.npy`` / ``val-docs.npy`` hold int64 document start
offsets into the split's whole stream (``n_docs + 1`` entries: no 2**31 limit anywhere). Shards are the
resumable units of ``fastdata preprocess text``; their per-unit document lengths wait in the run's
partial folder until the offsets are written at the end.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from .._io import write_bytes_atomic
from .base import npy_bytes

SPLITS = ("train", "val")


def splitmix(seed: int, i: np.ndarray | int) -> np.ndarray:
    """A 64-bit hash of ``(seed, i)``, vectorised (splitmix64): the train/val split of documents and the
    offsets of random windows."""
    with np.errstate(over="ignore"):
        x = np.asarray(i, dtype=np.uint64) + np.uint64(seed & (2**64 - 1)) * np.uint64(0x9E3779B97F4A7C15)
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def shard_name(split: str, k: int) -> str:
    return f"{split}-{k:05d}.npy"


def lengths_name(split: str, k: int) -> str:
    return f"{split}-lengths-{k:05d}.npy"


def offsets_name(split: str) -> str:
    return f"{split}-docs.npy"


class TokenUnitWriter:
    """Collects tokenised documents per split; a unit closes once it holds ``unit_tokens`` tokens."""

    def __init__(self, out: Path, partial: Path, unit_tokens: int, eos_id: int, dtype: np.dtype,
                 first_unit: int = 0) -> None:
        self.out, self.partial, self.unit_tokens = Path(out), Path(partial), unit_tokens
        self.eos, self.dtype, self.index = eos_id, np.dtype(dtype), first_unit
        self._reset()

    def _reset(self) -> None:
        self._docs: dict[str, list[np.ndarray]] = {s: [] for s in SPLITS}
        self._tokens = 0
        self._last_src = -1

    def add(self, split: str, tokens: np.ndarray, src: int) -> list[dict[str, Any]]:
        """Append one document (its ids, without EOS); returns the unit it completed, if any."""
        doc = np.empty(len(tokens) + 1, dtype=self.dtype)
        doc[:-1] = tokens
        doc[-1] = self.eos
        self._docs[split].append(doc)
        self._tokens += len(doc)
        self._last_src = src
        return [self._close()] if self._tokens >= self.unit_tokens else []

    def mark(self, src: int) -> None:
        """A source document that produced nothing (skipped): the unit still covers it."""
        self._last_src = max(self._last_src, src)

    def finish(self) -> list[dict[str, Any]]:
        return [self._close()] if self._tokens else []

    def _close(self) -> dict[str, Any]:
        files, counts = [], {}
        for split in SPLITS:
            docs = self._docs[split]
            stream = np.concatenate(docs) if docs else np.zeros(0, self.dtype)
            lengths = np.array([len(d) for d in docs], dtype="<i8")
            files.append(write_bytes_atomic(self.out / shard_name(split, self.index), npy_bytes(stream)))
            entry = write_bytes_atomic(self.partial / lengths_name(split, self.index), npy_bytes(lengths))
            entry["partial"] = True
            files.append(entry)
            counts[split] = {"tokens": int(len(stream)), "documents": len(docs)}
        unit = {"index": self.index, "source_end": self._last_src + 1, "files": files, "counts": counts}
        self.index += 1
        self._reset()
        return unit

    def abort(self) -> None:
        """Nothing to clean: a unit's files are written whole, atomically, when it closes."""
