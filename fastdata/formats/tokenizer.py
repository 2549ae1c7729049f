"""Tokenizers for ``fastdata preprocess text``: ``bytes``, a Hugging Face ``tokenizer.json``, ``tiktoken:NAME``.

Each knows its vocabulary size, its end-of-document id and a hash of its definition; the token-shard
manifest records all three so a reader can refuse a mismatch. Nothing is ever downloaded: a tiktoken
encoding must already be in the local cache (``TIKTOKEN_CACHE_DIR``).
"""
from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import numpy as np

from ..errors import ConfigError, MissingDependencyError, require

EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|eos|>", "[SEP]", "<|end_of_text|>")


class Tokenizer:
    kind: str
    vocab_size: int
    eos_id: int
    definition_hash: str

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Token ids of each text (no end-of-document token: the writer inserts it)."""
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "vocab_size": self.vocab_size, "eos_id": self.eos_id,
                "definition_sha256": self.definition_hash, "spec": self.spec}

    spec: str


class ByteTokenizer(Tokenizer):
    """ids 0-255 are the UTF-8 bytes, 256 is end-of-document; encoding is one ``np.frombuffer``."""

    kind, vocab_size, eos_id, spec = "bytes", 257, 256, "bytes"
    definition_hash = hashlib.sha256(b"fastdata bytes tokenizer v1: utf-8 bytes 0-255, eos 256").hexdigest()

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        arr = np.asarray(ids)
        return arr[arr < 256].astype(np.uint8).tobytes().decode("utf-8", errors="replace")


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizers`` JSON file; encoded in batches (the Rust side uses its own threads)."""

    kind = "huggingface"

    def __init__(self, path: Path) -> None:
        try:
            from tokenizers import Tokenizer as HF
        except ImportError as exc:
            raise MissingDependencyError("a tokenizer.json needs the `tokenizers` package: "
                                         "pip install 'fastdata[text]'") from exc
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"tokenizer file {path} does not exist")
        data = path.read_bytes()
        try:
            self._tok = HF.from_str(data.decode("utf-8"))
        except Exception as exc:  # noqa: BLE001 - the tokenizers package raises a bare Exception
            raise ConfigError(f"{path} is not a valid Hugging Face tokenizer.json: {exc}") from exc
        # a file saved from a pipeline keeps its max_length and padding: each document would be cut and padded
        self._tok.no_truncation()
        self._tok.no_padding()
        self.spec, self.definition_hash = str(path), hashlib.sha256(data).hexdigest()
        vocab = self._tok.get_vocab(with_added_tokens=True)
        # ids may have gaps ('</s>' = 70000 among 101 entries): the dtype must hold the highest, not the count
        self.vocab_size = max(vocab.values(), default=-1) + 1
        eos = next((t for t in EOS_CANDIDATES if t in vocab), None)
        if eos is None:
            raise ConfigError(f"{path} has none of the end-of-document tokens {EOS_CANDIDATES}: add one to the "
                              "tokenizer (e.g. as a special token) so documents can be separated")
        self.eos_id, self._eos = vocab[eos], eos
        _text_stays_text(self._tok, eos)
        if self.eos_id in self._tok.encode(eos, add_special_tokens=False).ids:  # (T5's '</s>': a model piece)
            raise ConfigError(self._spelled())

    def _spelled(self) -> str:
        return (f"tokenizer {self.spec} turns text into its end-of-document token {self._eos!r} (id {self.eos_id}), "
                "which would cut a document quoting it in two: use a tokenizer whose model cannot make that token "
                "from text")

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        encoded = self._tok.encode_batch(list(texts), add_special_tokens=False)
        ids = [np.asarray(e.ids, dtype=np.int64) for e in encoded]
        if any((i == self.eos_id).any() for i in ids):  # the model spelled it from other text (a merge)
            raise ConfigError(self._spelled())
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def __getstate__(self) -> dict[str, Any]:  # worker processes rebuild it from the file
        return {"path": self.spec}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(Path(state["path"]))  # type: ignore[misc]


def _text_stays_text(tok: Any, eos: str) -> None:
    """Make ``tok`` encode the text of special tokens as text, as tiktoken's ``encode_ordinary`` does.

    A document quoting ``<|endoftext|>`` must not yield the end-of-document id in its middle: the stream would
    no longer match the manifest's document offsets. The end-of-document token is made special if it is not.

    Raises:
        MissingDependencyError: ``tokenizers`` is older than 0.15.1 (no ``encode_special_tokens``).
    """
    if not hasattr(tok, "encode_special_tokens"):
        import tokenizers

        raise MissingDependencyError(
            f"tokenizers {getattr(tokenizers, '__version__', '?')} cannot keep special tokens quoted in a document "
            "as text (no encode_special_tokens): pip install 'tokenizers>=0.15.1'")
    tok.encode_special_tokens = True
    added = {t.content: t for t in tok.get_added_tokens_decoder().values()}
    if eos not in added or not added[eos].special:  # (a plain added token is still matched in text)
        from tokenizers import AddedToken

        tok.add_special_tokens([AddedToken(eos, special=True)])  # (it keeps its id)


class TiktokenTokenizer(Tokenizer):
    """A tiktoken encoding whose files are already in the local cache; a download is refused, not tried."""

    kind = "tiktoken"

    def __init__(self, name: str) -> None:
        try:
            import tiktoken
            import tiktoken.load as tl
        except ImportError as exc:
            raise MissingDependencyError("tiktoken:NAME needs the `tiktoken` package: pip install tiktoken") from exc
        real = tl.read_file

        def offline(blobpath: str) -> bytes:
            if "://" in blobpath:
                raise MissingDependencyError(
                    f"tiktoken encoding {name!r} is not in the local cache and fastdata never downloads: put its "
                    "files in TIKTOKEN_CACHE_DIR (tiktoken's cache) on this machine first")
            return real(blobpath)
        tl.read_file = offline
        try:
            self._enc = tiktoken.get_encoding(name)
        except ValueError as exc:
            raise ConfigError(f"unknown tiktoken encoding {name!r}: {exc}") from exc
        finally:
            tl.read_file = real
        self.spec = f"tiktoken:{name}"
        self.vocab_size = self._enc.n_vocab
        self.eos_id = self._enc.eot_token
        self.definition_hash = hashlib.sha256(f"tiktoken:{name}:{self._enc.n_vocab}:{self._enc._pat_str}".encode()
                                              ).hexdigest()

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.asarray(ids, dtype=np.int64) for ids in self._enc.encode_ordinary_batch(list(texts))]

    def decode(self, ids: Sequence[int]) -> str:
        return self._enc.decode([int(i) for i in ids])

    def __getstate__(self) -> dict[str, Any]:
        return {"name": self.spec.split(":", 1)[1]}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["name"])  # type: ignore[misc]


def cached_tokenizer(spec: Union[str, os.PathLike]) -> Tokenizer:
    """`load_tokenizer`, built once per process for each version of a tokenizer.json (worker processes tokenise
    many chunks): a file edited since, in a notebook's process or its forked workers, is loaded afresh."""
    spec = tokenizer_spec(spec)
    return _cached(spec, _file_version(spec) if spec.endswith(".json") else None)


def _file_version(path: str) -> Optional[tuple[int, ...]]:
    """What changes when the file is rewritten: its size, times and inode (None: no such file, which
    `load_tokenizer` reports). A stat, not a sha256: a caption field calls `cached_tokenizer` for each record,
    and hashing a 2 MB tokenizer.json takes about a millisecond."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino


@functools.lru_cache(maxsize=8)
def _cached(spec: str, version: Optional[tuple[int, ...]]) -> Tokenizer:
    return load_tokenizer(spec)


def tokenizer_spec(spec: Any) -> str:
    """``spec`` as a str: an ``os.PathLike`` (a ``pathlib.Path``) is its path.

    Raises:
        ConfigError: ``spec`` is neither a str nor an ``os.PathLike`` of a str.
    """
    spec = os.fspath(spec) if isinstance(spec, os.PathLike) else spec
    require(isinstance(spec, str), "tokenizer", spec,
            "'bytes', a tokenizer.json path (a str or an os.PathLike) or 'tiktoken:NAME'")
    return spec


def load_tokenizer(spec: Union[str, os.PathLike]) -> Tokenizer:
    """``bytes``, ``PATH/tokenizer.json`` (a str or an ``os.PathLike``) or ``tiktoken:NAME``.

    Raises:
        ConfigError: ``spec`` is none of these, or its tokenizer cannot be used.
        MissingDependencyError: The tokenizer needs ``tokenizers`` or ``tiktoken``, not installed.
    """
    spec = tokenizer_spec(spec)
    if spec == "bytes":
        return ByteTokenizer()
    if spec.startswith("tiktoken:"):
        return TiktokenTokenizer(spec.split(":", 1)[1])
    if spec.endswith(".json"):
        return HFTokenizer(Path(spec))
    raise ConfigError(f"tokenizer must be 'bytes', a tokenizer.json path or 'tiktoken:NAME', got {spec!r}")


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id fits (2 bytes a token on disk and over PCIe), else uint32; little-endian."""
    return np.dtype("<u2") if vocab_size <= 65536 else np.dtype("<u4")
