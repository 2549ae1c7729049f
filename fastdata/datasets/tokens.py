"""TokenDataset: windows of ``seq_len + 1`` tokens sliced straight from the memory-mapped token stream.

``ds[i]`` gives int64 ``(x, y)`` with ``y`` = ``x`` shifted by one token. ``get_batch`` (used by FastLoader)
keeps the stored uint16/uint32 dtype, so a batch crosses PCIe at 2 bytes a token and CUDAPrefetcher casts
it to int64 on the GPU; its ``x`` and ``y`` are two views of one ``(B, seq_len + 1)`` window buffer.
Window ``i`` starts at ``i * stride`` (default ``stride = seq_len``); with ``random_windows=True`` it
starts at a pseudo-random offset fixed by ``(seed, i)``, as nanoGPT samples, but reproducible and resumable.
"""
from __future__ import annotations

import functools
import os
import warnings
import weakref
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Sequence, Union

import numpy as np
import torch

from .. import _limits
from .._io import trim_heap
from ..errors import ConfigError, FormatError, is_whole
from ..formats.manifest import TOKENS, manifest_digest
from ..formats.rows import column_view, int_column, pairs
from ..formats.token_shards import splitmix
from ..formats.tokenizer import Tokenizer, load_tokenizer
from ..storage.cache import ShardCache
from ..storage.object_store import RETRY_SECONDS
from ..storage.opening import OpenedPath, StreamedReads, open_path
from ..storage.shards import Indices, ShardMaps, ShardSet, batch_rows, map_npy, open_shards
from ..storage.streamed import FileGroups, token_streamed
from .window_copy import Segments, WindowCopy

_TORCH_DTYPES = {np.dtype("<u2"): torch.uint16, np.dtype("<u4"): torch.uint32}
TORCH_GATHER_ROWS = 64  # from this many windows a gather runs in torch (NOTE [window gather])


def shard_of(starts: np.ndarray, shard_offsets: np.ndarray) -> np.ndarray:
    """Index of the shard holding each global token position (int64 throughout: no 2**31 limit)."""
    return np.searchsorted(shard_offsets, starts, side="right") - 1


def touched(first: np.ndarray, last: np.ndarray) -> np.ndarray:
    """Every shard that windows from shard ``first`` to shard ``last`` touch, once each: a window longer than a
    shard spans the shards between them too."""
    wide = np.flatnonzero(last > first + 1)
    return np.unique(np.concatenate([first, last, *(np.arange(first[r] + 1, last[r]) for r in wide)]))


def windows(arr: np.ndarray, length: int, void: np.dtype) -> Optional[np.ndarray]:
    """Every ``length``-token window of ``arr`` as one ``void`` item (None when ``arr`` is shorter)."""
    if len(arr) < length:
        return None
    return np.lib.stride_tricks.sliding_window_view(arr, length).view(void)[:, 0]


_SIGNED = {np.dtype("<u2"): np.dtype("<i2"), np.dtype("<u4"): np.dtype("<i4")}


def signed(arr: np.ndarray) -> np.ndarray:
    """``arr``'s bits as signed integers of its size: torch's index_select has no uint16/uint32 kernel."""
    return arr.view(_SIGNED[arr.dtype])


def window_rows(arr: np.ndarray, length: int) -> Optional[torch.Tensor]:
    """Every ``length``-token window of ``arr`` as one row of a strided torch view (`signed` bits, no copy);
    None when ``arr`` is shorter."""
    if len(arr) < length:
        return None
    with warnings.catch_warnings():  # a read-only map: torch warns, and the view is only ever read
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.from_numpy(signed(arr))
    return flat.as_strided((len(arr) - length + 1, length), (1, 1))


class TokenDataset(StreamedReads, torch.utils.data.Dataset):
    """A split of a ``fastdata preprocess text`` folder as fixed-length training windows.

    ``ds[i]`` is int64 ``(x, y)``, ``y`` being ``x`` shifted by one token.
    `get_batch` (used by FastLoader) keeps the stored uint16/uint32 dtype, and its ``x`` and ``y`` are two
    views of one ``(B, seq_len + 1)`` window buffer, so a batch crosses PCIe once at 2 bytes a token.
    CUDAPrefetcher casts it to int64 on the GPU.
    ``path`` may be an fsspec URL: with ``storage="mmap"`` its token shards stream in as batches need them
    (NOTE [shard cache]).

    Args:
        path: The dataset folder, an fsspec URL of one, or an ``OpenedPath`` of either (its manifest read once).
        split: The split to read, one of the manifest's (default ``"train"``).
        seq_len: Tokens of input per window; a window holds ``seq_len + 1`` (default 1024).
        stride: Window ``i`` starts at ``i * stride`` (default None: ``seq_len``, windows side by side).
        random_windows: Start window ``i`` at a pseudo-random offset fixed by ``(seed, i)`` instead, as nanoGPT
            samples, but reproducible and resumable (default False).
        seed: The seed of ``random_windows``, a non-negative integer (default 0).
        storage: ``"mmap"`` (default), ``"ram"`` or ``"shm"``, as for FastDataset.
        tokenizer: A tokenizer (or its spec: ``"bytes"``, a ``tokenizer.json`` path as a str or an
            ``os.PathLike``, ``"tiktoken:NAME"``) that must be the one the dataset was made with (default None: not
            checked).
        verify: Hash the token shards against the manifest while opening (default None: with ``storage="ram"``).
        shm_dir: The folder of the shared copy for ``storage="shm"`` (default: ``$FASTDATA_SHM_DIR``, else
            /dev/shm).
        storage_options: URLs only: options passed to fsspec (default None).
        cache_dir: URLs only: the node-local cache folder (default: ``$FASTDATA_CACHE``, else
            ``$XDG_CACHE_HOME/fastdata``, else ``~/.cache/fastdata``).
        cache_limit: URLs only: the most bytes of this dataset kept in the cache, as a number or a size such as
            ``"200GB"`` (default None: no bound).
        retry_seconds: URLs only: how long the store may fail (refused connections, timeouts, 5xx) before a
            read gives up with one line naming the object (default 120 s: an outage up to two minutes, at
            opening or mid-epoch, is ridden out). Retried with exponential backoff and jitter.

    Raises:
        ConfigError: ``split``, ``storage``, ``seq_len``, ``stride``, ``seed``, ``tokenizer`` or a URL option is
            bad, or the split has fewer than ``seq_len + 1`` tokens.
        FormatError: The folder is not a token dataset, a file's size is not the manifest's, ``tokenizer`` is
            not the one the dataset was made with, or the store stayed unreachable for ``retry_seconds``.
        VersionError: The manifest was written by a format version this fastdata cannot read.
        ChecksumError: A shard's bytes do not match the manifest.
        MissingDependencyError: ``path`` is a URL and fsspec is not installed, or ``tokenizer`` needs a package
            that is not.

    Examples:
        >>> ds = TokenDataset("data/owt", "train", seq_len=1024)
        >>> loader = CUDAPrefetcher(FastLoader(ds, batch_size=64), "cuda")
        >>> for x, y in loader:  # (64, 1024) int64 each, on the GPU
        ...     loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    """

    def __init__(self, path: Union[str, Path, OpenedPath], split: str = "train", seq_len: int = 1024, *,
                 stride: Optional[int] = None, random_windows: bool = False, seed: int = 0, storage: str = "mmap",
                 tokenizer: Union[str, os.PathLike, Tokenizer, None] = None, verify: Optional[bool] = None,
                 shm_dir: Optional[Union[str, Path]] = None, storage_options: Optional[dict[str, Any]] = None,
                 cache_dir: Optional[Union[str, Path]] = None, cache_limit: Union[int, str, None] = None,
                 retry_seconds: float = RETRY_SECONDS) -> None:
        # A URL: its node-local cache; memory-mapped token shards stream in as batches need them
        opened = open_path(path, (TOKENS,), storage_options=storage_options, cache_dir=cache_dir,
                           cache_limit=cache_limit, streamed=lambda m: token_streamed(m, storage),
                           retry_seconds=retry_seconds)
        self.root, self.manifest = opened.root, opened.manifest
        self._remote, self._limit = opened.remote, opened.limit
        if split not in self.manifest["splits"]:
            raise ConfigError(f"split must be one of {sorted(self.manifest['splits'])}, got split={split!r}")
        if storage not in ("mmap", "ram", "shm"):
            raise ConfigError(f"storage must be 'mmap', 'ram' or 'shm' for tokens, got storage={storage!r}")
        if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
            raise ConfigError(f"seq_len must be a positive integer, got seq_len={seq_len!r}")
        # (0 once meant seq_len silently, -1 failed in len() and 2.5 at the first batch; True is no stride)
        if stride is not None and (not is_whole(stride) or stride < 1):
            raise ConfigError(f"stride must be None (seq_len) or a positive integer, got stride={stride!r}")
        # (None, 1.5 and "7" failed at the first batch with a TypeError, np.int64 overflowed in splitmix)
        if not is_whole(seed) or seed < 0:
            raise ConfigError(f"seed must be a non-negative integer, got seed={seed!r}")
        self.split, self.seq_len, self.storage = split, seq_len, storage
        self.stride = seq_len if stride is None else int(stride)
        self.random_windows, self.seed = random_windows, int(seed)
        self._shm_dir = shm_dir
        info = self.manifest["tokenizer"]
        if tokenizer is not None:
            # a spec (a str, a Path) is loaded; an object with a tokenizer's identity is used as it is
            spec = isinstance(tokenizer, (str, os.PathLike)) or not hasattr(tokenizer, "definition_hash")
            tok = load_tokenizer(tokenizer) if spec else tokenizer
            if (tok.kind, tok.vocab_size, tok.eos_id, tok.definition_hash) != (
                    info["kind"], info["vocab_size"], info["eos_id"], info["definition_sha256"]):
                raise FormatError(f"{self.root} was tokenised with {info['spec']} ({info['kind']}, vocab "
                                  f"{info['vocab_size']}), not with {tok.spec}: use the same tokenizer")
        self.vocab_size, self.eos_id = int(info["vocab_size"]), int(info["eos_id"])
        self.np_dtype = np.dtype(self.manifest["dtype"])
        self.sample_dtype = _TORCH_DTYPES[self.np_dtype]
        self.sample_shape = torch.Size((seq_len + 1,))
        self._void = np.dtype((np.void, (seq_len + 1) * self.np_dtype.itemsize))  # one window as one item
        self.device = torch.device("cpu")
        s = self.manifest["splits"][split]
        self.num_tokens = int(s["tokens"])
        counts = int_column(s["shards"], "tokens")
        self._shard_offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        if self.num_tokens < seq_len + 1:
            raise ConfigError(f"the {split} split of {self.root} has {self.num_tokens} tokens, fewer than "
                              f"seq_len + 1 = {seq_len + 1}: use a shorter seq_len or more text")
        self._count = (self.num_tokens - 1 - seq_len) // self.stride + 1  # windows (kept: get_batch checks it)
        self._verify = verify if verify is not None else storage == "ram"
        self._open()
        trim_heap(len(self.manifest["files"]))

    def _open(self) -> None:
        shards = self.manifest["splits"][self.split]["shards"]
        tokens = ShardSet(self.root, self.manifest, pairs(shards, "path", "tokens"), (), self.np_dtype,
                          key=self.split)
        self._cache: Optional[ShardCache] = None
        if self._remote is not None and self.storage == "mmap":  # streamed: shards mapped as they arrive...
            root, dtype, length, void = self.root, self.np_dtype, self.seq_len + 1, self._void
            bounded = not _limits.room_for_maps(len(tokens.files))  # ... or as batches read them (NOTE [open files])
            maps = ShardMaps(tokens, *_limits.bounded_maps()) if bounded else []

            def opener(s: int, path: Path) -> Any:
                # (refers to no dataset: a dropped dataset is collected and its cache closed, see close())
                if bounded:
                    return path
                arr = map_npy(root, tokens.files[s][0], (tokens.files[s][1],), dtype)
                return arr, windows(arr, length, void)
            closer = (lambda s, path: maps.drop(s)) if bounded else None  # (a map would keep an evicted file's disk)
            names = FileGroups([column_view(shards, "path")], len(shards))  # (a view: no name kept a shard)
            self._cache = ShardCache(self._remote, names, opener, limit=self._limit, closer=closer, eager=not bounded)
            self._flat, self._shards, self._flat_windows, self._shard_windows = None, maps, None, []
            self._flat_rows = self._copy_table = None
            self._hold()
            return
        opened = open_shards(tokens, self.storage, verify=self._verify, shm_dir=self._shm_dir)
        self._flat, self._shards = opened.flat, opened.maps
        if len(self._shards) == 1:  # one shard: serve it as the flat stream (no shard lookup per batch)
            self._flat, self._shards = self._shards[0], []
        # Window views are made once here: making one costs more than gathering a small batch.
        self._flat_windows = self._windows(self._flat) if self._flat is not None else None
        self._flat_rows = window_rows(self._flat, self.seq_len + 1) if self._flat is not None else None
        # the segments a compiled copy reads (NOTE [compiled window copy] 3), in one attribute: read at once
        if isinstance(self._shards, ShardMaps):  # more shards than may stay mapped: mapped as batches read them,
            self._shard_windows, self._copy_table = None, None  # their windows made per batch (NOTE [open files])
        else:
            self._shard_windows = [self._windows(a) for a in self._shards]
            self._copy_table = Segments([self._flat], [0, self.num_tokens]) if self._flat is not None else \
                Segments(self._shards, self._shard_offsets)
        self._hold()

    def _keep_limit(self, limit: Optional[int]) -> None:
        self._limit = limit

    def _drop_storage(self) -> None:
        self._flat, self._shards, self._flat_windows, self._shard_windows, self._cache = None, [], None, [], None
        self._flat_rows = self._copy_table = None

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("_flat", "_shards", "_flat_windows", "_flat_rows",
                                                                     "_shard_windows", "_cache", "_released",
                                                                     "_copy_table", "_copy")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._open()

    # -- windows --------------------------------------------------------------------------------------
    @functools.cached_property
    def manifest_sha256(self) -> str:
        """The dataset's version, as a loader's state names it (`manifest_digest`): made when first asked for,
        since it serialises the whole manifest (seconds at a million shards)."""
        return manifest_digest(self.manifest)

    @property
    def state_key(self) -> dict[str, Any]:
        """Which windows a position means, as a loader's state names it: a state saved with another
        ``seq_len``, ``stride``, window seed or split would serve other windows from the same positions."""
        key = {"split": self.split, "seq_len": self.seq_len, "stride": self.stride,
               "random_windows": self.random_windows}
        return {**key, "seed": self.seed} if self.random_windows else key

    def __len__(self) -> int:
        return self._count

    def starts(self, indices: np.ndarray) -> np.ndarray:
        """Global start position of each window (int64)."""
        if self.random_windows:
            span = np.uint64(self.num_tokens - self.seq_len)
            return (splitmix(self.seed, indices) % span).astype(np.int64)
        return indices.astype(np.int64, copy=False) * self.stride

    def get_batch(self, indices: Indices, out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)`` as two views of one ``(B, seq_len + 1)`` window buffer, in the stored dtype.

        ``out`` (e.g. a pinned buffer of at least ``B`` rows) receives the windows; the result views ``out[:B]``.
        """
        self._check_open()
        idx = indices if type(indices) is np.ndarray and indices.dtype == np.int64 else np.asarray(
            indices.cpu().numpy() if isinstance(indices, torch.Tensor) else indices, dtype=np.int64)
        idx = idx.reshape(-1)  # (a (B, 1) column of indices is B windows, as it always was)
        b = len(idx)
        # negative indices wrap to huge as uint64: one reduction for both ends, no copy
        if b and idx.view(np.uint64).max() >= self._count:
            raise IndexError(f"window index out of range for {self._count} windows (got {idx.min()}..{idx.max()})")
        # without out=, a few windows are served faster by the gather's own result (~4 us less a call)
        copy = self._compiled() if out is not None or b >= TORCH_GATHER_ROWS else None
        if copy is not None:  # the batch in one compiled call, without the GIL (rule 5 of NOTE [window gather])
            w = batch_rows(out, b, self.sample_dtype, self.sample_shape) if out is not None else torch.empty(
                (b, self.seq_len + 1), dtype=self.sample_dtype)
            if copy(idx, w.numpy()) is not None:
                return w[:, :-1], w[:, 1:]
            self._check_open()  # (no table: closed meanwhile, which says so rather than a gather's IndexError)
            self._gather(self.starts(idx), w.numpy())  # (not served: the usual gather, or its error)
        elif out is not None:
            w = batch_rows(out, b, self.sample_dtype, self.sample_shape)
            self._gather(self.starts(idx), w.numpy())
        elif self._flat_windows is not None:  # the gather's own result is the batch: no second copy
            w = torch.from_numpy(self._flat_windows[self.starts(idx)].view(self.np_dtype).reshape(b, self.seq_len + 1))
        else:
            w = torch.empty((b, self.seq_len + 1), dtype=self.sample_dtype)
            self._gather(self.starts(idx), w.numpy())
        return w[:, :-1], w[:, 1:]

    def _compiled(self) -> Optional[WindowCopy]:
        """The compiled window copy of this dataset alone, once numba has compiled it (started on a thread the
        first time: no batch waits for it); None for random windows, a streamed dataset, or without numba."""
        copy = self.__dict__.get("_copy")
        if copy is None:  # (a proxy: no cycle keeps a dropped dataset's memory mapped)
            copy = self._copy = WindowCopy([weakref.proxy(self)])
        return copy if copy.ready() else None

    def _windows(self, arr: np.ndarray) -> Optional[np.ndarray]:
        """Every window of ``arr`` as one item of a 1-D array (a void item of ``seq_len + 1`` tokens, one token
        apart): no data is copied, and a gather copies each window with one memcpy (see NOTE [window gather])."""
        return windows(arr, self.seq_len + 1, self._void)

    def _gather(self, starts: np.ndarray, dst: np.ndarray) -> None:
        # NOTE [window gather]:
        # 1. numpy: indexing the 1-D view of void windows copies each window with one memcpy, at the speed of
        #    np.take over contiguous rows at the same random offsets, the memory system's limit for 2 KB reads
        #    (bench_text measures both), into a new array then copied into ``dst``: a second pass
        #    (benchmarks/RESULTS.md). A 2-D fancy index of the sliding-window view and an element-wise take of
        #    start + arange(L) are slower; np.take on a strided view materialises every window. numpy keeps the
        #    GIL for fewer than ~500 rows.
        # 2. torch: index_select over the strided view of the same windows (`window_rows`) writes ``dst`` in one
        #    pass without the GIL, so loader threads overlap; from TORCH_GATHER_ROWS (64) windows. Below, its
        #    fixed cost (~2 us a call more) outweighs that: at batch 32, FastLoader served ~12 % fewer windows/s
        #    with the threshold at 16 than at 64 (2-core VM).
        # 3. torch only on a thread of one intra-op thread (FastLoader's threads on a machine they fill):
        #    index_select splits every batch among the intra-op threads, and on a busy 2-core VM that took
        #    0.2-3.4 ms a 512-window batch instead of 0.14 ms.
        # 4. A Mixture's token sources: one compiled copy for the whole batch where numba is installed (NOTE
        #    [compiled window copy] in window_copy.py), else `WindowGather`, these rules for each source's rows.
        # 5. One dataset: the same compiled copy (`_compiled`) where numba is installed, the batch written in
        #    one pass without the GIL (with ``out=``, or from TORCH_GATHER_ROWS windows: below, without ``out=``,
        #    the gather's own result costs ~4 us less); these rules until it has compiled, and without numba.
        # 6. The maps are read once into locals: a close() on another thread meanwhile leaves this batch its maps
        #    (they are unmapped when the last reference goes), or, when it came first, says "closed".
        flat_rows, flat_windows, shards, shard_windows, cache = (self._flat_rows, self._flat_windows, self._shards,
                                                                 self._shard_windows, self._cache)
        if flat_windows is None and not shards and cache is None:
            self._check_open()
        if flat_rows is not None and len(starts) >= TORCH_GATHER_ROWS and torch.get_num_threads() == 1:
            torch.index_select(flat_rows, 0, torch.from_numpy(starts), out=torch.from_numpy(signed(dst)))
            return
        rows = dst.view(self._void).reshape(-1)
        if flat_windows is not None:
            rows[...] = flat_windows[starts]
            return
        length = dst.shape[1]
        first = shard_of(starts, self._shard_offsets)
        last = shard_of(starts + length - 1, self._shard_offsets)
        if cache is None:  # bounded maps: one shard mapped (or kept) at a time, while its windows are copied
            views = shard_windows if shard_windows is not None else _Views(shards, self._windows)
            self._gather_shards(starts, first, last, rows, dst, shards, views)
            return
        used = touched(first, last)
        with cache.reading(used) as opened:  # streamed: this batch's shards fetched and pinned
            if len(shards):  # (bounded maps beside the cache: mapped as the batch reads them)
                self._gather_shards(starts, first, last, rows, dst, shards, _Views(shards, self._windows))
                return
            arrays, windows = {s: opened[s][0] for s in used.tolist()}, {s: opened[s][1] for s in used.tolist()}
            self._gather_shards(starts, first, last, rows, dst, arrays, windows)

    def _gather_shards(self, starts: np.ndarray, first: np.ndarray, last: np.ndarray, rows: np.ndarray,
                       dst: np.ndarray, arrays: Any, windows: Any) -> None:
        length = dst.shape[1]
        inside = first == last
        for s in np.unique(first[inside]):  # one gather per shard for windows inside it
            sel = np.flatnonzero(inside & (first == s))
            rows[sel] = windows[s][starts[sel] - self._shard_offsets[s]]
        for r in np.flatnonzero(~inside):  # the rare window that straddles a shard boundary
            pos = starts[r] + np.arange(length, dtype=np.int64)
            sh = shard_of(pos, self._shard_offsets)
            for s in np.unique(sh):
                m = sh == s
                dst[r, m] = arrays[s][pos[m] - self._shard_offsets[s]]

    def sample_shards(self) -> np.ndarray:
        """The shard holding each window's first token (for ``shuffle_window``)."""
        return shard_of(self.starts(np.arange(len(self), dtype=np.int64)), self._shard_offsets)

    def shard_bounds(self) -> Optional[np.ndarray]:
        """Each token shard's first window, then ``len(self)`` (for ``shuffle_window``): windows ``stride``
        apart lie in the shard of their first token in order, so a windowed shuffle needs no number per window
        (`sample_shards` holds 8 bytes a window: 16 GB for 2·10^9). Shards after the last window's first token
        are left out, as `sample_shards` leaves them. None with ``random_windows`` (windows in no order)."""
        if self.random_windows:
            return None
        last = int(shard_of(np.array([(self._count - 1) * self.stride], dtype=np.int64), self._shard_offsets)[0])
        firsts = -(-self._shard_offsets[:last + 1] // self.stride)  # the first window starting at or after each
        return np.append(firsts, self._count).astype(np.int64)

    def plan_reads(self, batches: Iterable[np.ndarray], now: Optional[int] = None) -> Optional[object]:
        """Tell a streamed dataset the coming batches (an iterator of window index arrays, in order; the
        next epoch's after the first ``now``), so their shards are fetched ahead of them (FastLoader calls
        this); a token for `end_reads`."""
        if self._cache is None:
            return None

        def reads() -> Iterator[np.ndarray]:
            for b in batches:  # a window may span two shards, or more where shards are shorter than it
                starts = self.starts(np.asarray(b, dtype=np.int64))
                offsets = self._shard_offsets
                yield touched(shard_of(starts, offsets), shard_of(starts + self.seq_len, offsets))
        return self._cache.plan(reads(), now)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.get_batch([int(i)])
        return x[0].long(), y[0].long()

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        x, y = self.get_batch(indices)
        return list(zip(x.long().unbind(0), y.long().unbind(0)))

    def __repr__(self) -> str:
        return (f"TokenDataset({str(self.root)!r}, split={self.split!r}, seq_len={self.seq_len}, windows={len(self)}, "
                f"tokens={self.num_tokens}, vocab={self.vocab_size})")


class _Views:
    """Window views of bounded shard maps (`ShardMaps`), made when one is asked for: each keeps its shard
    mapped only while it is used."""

    def __init__(self, maps: Any, make: Any) -> None:
        self.maps, self.make = maps, make

    def __getitem__(self, s: int) -> np.ndarray:
        return self.make(self.maps[s])


class WindowGather:
    """The windows of several token datasets (a Mixture's sources) gathered into one batch, each source's into
    its run of rows (NOTE [window gather]), with little work a source: when the sources share a stride one
    multiplication gives every window's start, and a source's few rows take one numpy index.

    Args:
        sources: Token datasets of one window length and dtype.
    """

    def __init__(self, sources: Sequence[TokenDataset]) -> None:
        self.sources = list(sources)
        strides = {ds.stride for ds in self.sources}
        plain = not any(ds.random_windows for ds in self.sources)
        self.stride = strides.pop() if plain and len(strides) == 1 else None  # None: each source's starts
        self.void = self.sources[0]._void

    def __call__(self, parts: Iterable[tuple[int, int, int]], indices: np.ndarray, dst: np.ndarray) -> None:
        """Rows ``a:c`` of ``dst`` get windows ``indices[a:c]`` of source ``k``, for each ``(k, a, c)`` of
        ``parts``. ``indices`` are int64 and in range (not checked); ``dst`` is C-contiguous, of the sources'
        dtype and window length."""
        starts = None if self.stride is None else indices * self.stride
        rows = dst.view(self.void).reshape(-1)
        for k, a, c in parts:
            ds = self.sources[k]
            ds._check_open()
            at = ds.starts(indices[a:c]) if starts is None else starts[a:c]
            if ds._flat_windows is not None and c - a < TORCH_GATHER_ROWS:
                rows[a:c] = ds._flat_windows[at]
            else:
                ds._gather(at, dst[a:c])
