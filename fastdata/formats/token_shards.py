"""Token shards: per split, flat streams of token ids with the end-of-document id after every document.

Format version 2 (``fastdata preprocess text`` from this version on): piece ``P`` of the run (a run of input
files, or one part of a large one: NOTE [text pieces] in fastdata/preprocess/text.py) writes its own shards,
``train-PPPPP-KKKKKK.npy`` ... and ``val-PPPPP-KKKKKK.npy``, each a ``<u2`` (vocab <= 65,536) or ``<u4``
stream of whole documents, and beside each its documents' start offsets, ``train-docs-PPPPP-KKKKKK.npy``
(int64, the shard's documents + 1 entries: the last is the shard's length). A document never straddles two
shards; a split's stream is its shards in the manifest's order (sorted names give it too). Nothing in the
dataset holds a number per document of the whole split, so no process ever needs one.

Version 1 (read as before): shards ``train-00000.npy`` ... and one ``train-docs.npy`` of offsets into the
split's whole stream.
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
        # int(): a numpy seed's & with 2**64 - 1 overflows (np.int64(3) raised an OverflowError)
        x = np.asarray(i, dtype=np.uint64) + np.uint64(int(seed) & (2**64 - 1)) * np.uint64(0x9E3779B97F4A7C15)
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def shard_name(split: str, piece: int, k: int, width: int) -> str:
    """Shard ``k`` of piece ``piece``: ``width`` digits for every piece of a run and six for ``k`` (a 1 TB .zst
    file is one piece of ~16,000 shards at the default size), so sorted names keep the order."""
    return f"{split}-{piece:0{width}d}-{k:06d}.npy"


def docs_name(split: str, piece: int, k: int, width: int) -> str:
    """The document offsets beside `shard_name`."""
    return f"{split}-docs-{piece:0{width}d}-{k:06d}.npy"


class PieceWriter:
    """Writes one piece's documents into its shards, per split, in ``folder``: a shard closes at the first
    document end at or past ``shard_tokens`` tokens; a split that gets no document writes no shard.

    Args:
        folder: Where the files are written (atomically, each hashed as it is written).
        piece: The piece's number (names its files).
        width: Digits of the piece number (the same for every piece of a run).
        shard_tokens: Tokens after which a shard closes.
        eos_id: The end-of-document id written after every document.
        dtype: The token dtype (``<u2`` or ``<u4``).
    """

    def __init__(self, folder: Path, piece: int, width: int, shard_tokens: int, eos_id: int, dtype: Any) -> None:
        self.folder, self.piece, self.width = Path(folder), piece, width
        self.shard_tokens, self.eos, self.dtype = shard_tokens, eos_id, np.dtype(dtype)
        self.files: list[dict[str, Any]] = []
        self.shards: dict[str, list[dict[str, Any]]] = {s: [] for s in SPLITS}
        self._docs: dict[str, list[np.ndarray]] = {s: [] for s in SPLITS}
        self._tokens = {s: 0 for s in SPLITS}

    def add(self, split: str, tokens: np.ndarray) -> None:
        """Append one document (its ids, without the end-of-document id) to ``split``."""
        doc = np.empty(len(tokens) + 1, dtype=self.dtype)
        doc[:-1] = tokens
        doc[-1] = self.eos
        self._docs[split].append(doc)
        self._tokens[split] += len(doc)
        if self._tokens[split] >= self.shard_tokens:
            self._close(split)

    def finish(self) -> list[dict[str, Any]]:
        """Close the open shards; returns every file written (``{"path", "bytes", "sha256"}``)."""
        for split in SPLITS:
            if self._docs[split]:
                self._close(split)
        return self.files

    def _close(self, split: str) -> None:
        docs = self._docs[split]
        k = len(self.shards[split])
        starts = np.zeros(len(docs) + 1, dtype="<i8")
        np.cumsum([len(d) for d in docs], out=starts[1:])
        stream = np.concatenate(docs)
        name, docs_file = shard_name(split, self.piece, k, self.width), docs_name(split, self.piece, k, self.width)
        self.files.append(write_bytes_atomic(self.folder / name, npy_bytes(stream)))
        self.files.append(write_bytes_atomic(self.folder / docs_file, npy_bytes(starts)))
        self.shards[split].append({"path": name, "tokens": int(len(stream)), "documents": len(docs),
                                   "docs": docs_file})
        self._docs[split], self._tokens[split] = [], 0
