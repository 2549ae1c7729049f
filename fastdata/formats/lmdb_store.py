"""JPEG store in LMDB: one record per sample, keys ``b"%012d" % i`` (they sort in sample order), labels in
``labels.npy`` beside it. Values are plain JPEG bytes; nothing is pickled.

Format version 2 splits the records over LMDB shards ``images-00000.lmdb`` ... of ``shard_size`` samples
(the manifest's ``lmdb_shards``; keys stay global), so a dataset in object storage streams shard by shard
like the npy format. Version 1 datasets (one ``images.lmdb``, the manifest's ``lmdb``) still load.

Format version 3 adds sample fields (NOTE [fields] in fastdata/formats/schema.py): the images, stored square at the
dataset's size like npy images so that masks and boxes share their geometry, are the LMDB's JPEG
records; every other field is the npy datasets' files (``mask-00000.npy``, ...), one per LMDB shard.

Format version 4 (what `fastdata preprocess` writes now) keys each shard's records by their row in that
shard (``b"%012d" % row``), so a shard is a function of its own samples and a Ray task can write it alone;
its shards may hold fewer than ``shard_size`` samples (shard ``k`` holds what decoded of source positions
``[k * shard_size, (k + 1) * shard_size)``, fastdata/formats/base.py); each shard's ``labels-K.npy`` is the
run's own (the journal's), merged into the one ``labels.npy`` and removed when the run ends. Readers find a
sample's shard from the shards' counts (`manifest.shard_starts`).

Each shard is built in one append-only pass with a fixed commit pattern: LMDB page contents depend on the
write history, so this is what makes the output byte-identical for any worker count and after resume.
"""
from __future__ import annotations

import contextlib
import errno
import os
import weakref
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import numpy as np

from .. import _limits
from .._io import HASH_NAME, disk_error, folder_prefix, hash_file, write_bytes_atomic
from ..errors import FormatError
from .base import UnitWriter, npy_bytes
from .image_shards import FieldParts, Rows, labels_name
from .lmdb_envs import CALLS, Holds, ended
from .manifest import ShardIndex, shard_starts
from .rows import column
from .schema import Field

LMDB_NAME = "images.lmdb"  # version 1: the one store
LABELS_NAME = "labels.npy"
_COMMIT_EVERY = 1024  # records per write transaction while building (fixed: part of the byte layout)


def key(i: int) -> bytes:
    return b"%012d" % i


def shard_name(k: int) -> str:
    return f"images-{k:05d}.lmdb"


LOCAL_KEYS_VERSION = 4  # from this format version on, keys are rows within their shard


def lmdb_shards(manifest: dict[str, Any]) -> list[str]:
    """The store files of an LMDB dataset, in sample order (version 1: its one store)."""
    if "lmdb_shards" in manifest:
        return column(manifest["lmdb_shards"], "path")
    return [manifest["lmdb"]]


class LmdbShardWriter(UnitWriter):
    """Collects one shard's JPEG bytes in memory (~25 KB a sample) and builds ``images-K.lmdb`` (keys: rows
    in the shard, format version 4) and ``labels-K.npy`` when it is sealed. With ``fields`` (samples come as
    `Rows` of JPEG bytes) the shard's other fields get their npy files beside it."""

    def __init__(self, out: Path, shard_size: int, first_shard: int = 0, *,
                 fields: Sequence[Field] = (), labels: bool = True) -> None:
        super().__init__(shard_size, first_shard)
        self.out = Path(out)
        self._blobs: list[bytes] = []
        self.fields = FieldParts(self.out, fields)
        self._with_labels = labels

    def _open_unit(self) -> None:
        self._blobs = []

    def _write(self, samples: Any) -> None:
        if isinstance(samples, Rows):
            self.fields.add(samples.fields)
            samples = samples.images
        self._blobs.extend(samples)

    def _seal(self, labels: np.ndarray) -> Callable[[], list[dict[str, Any]]]:
        blobs, k = self._blobs, self.index
        self._blobs = []
        extra = [(self.out / labels_name(k), labels)] if self._with_labels else []
        extra += self.fields.arrays(k, len(blobs))

        def commit() -> list[dict[str, Any]]:
            return [build_shard(self.out / shard_name(k), blobs)] + [
                write_bytes_atomic(path, npy_bytes(arr)) for path, arr in extra]
        return commit

    def _abort_unit(self) -> None:
        self._blobs = []
        self.fields.clear()


def build_shard(path: Path, blobs: Sequence[Any]) -> dict[str, Any]:
    """Write ``blobs`` as one LMDB store at ``path`` (keys ``0..n-1``, via ``path.tmp``); its manifest entry."""
    import lmdb

    # Values over a page go to overflow pages (up to 4 KiB waste each); 1.5x + 1 MiB has room for that.
    map_size = int(sum(len(b) for b in blobs) * 1.5) + (1 << 20)
    tmp = path.with_name(path.name + ".tmp")
    while True:
        tmp.unlink(missing_ok=True)
        try:
            _write_lmdb(lmdb, tmp, map_size, blobs)
            break
        except lmdb.MapFullError:
            map_size *= 2  # deterministic: the same data always takes the same retries
        except lmdb.Error as exc:
            code = _write_errno(exc, tmp, map_size)
            tmp.unlink(missing_ok=True)
            raise disk_error(OSError(code, os.strerror(code) + f" ({exc})"), tmp) from exc
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise disk_error(exc, tmp) from exc
    entry = {"path": path.name, "bytes": tmp.stat().st_size, HASH_NAME: hash_file(tmp)}
    os.replace(tmp, path)
    return entry


def _write_errno(exc: Exception, tmp: Path, need: int) -> int:
    """What a write's ``lmdb.Error`` means: py-lmdb gives no errno, and LMDB reports a full disk as the OS's
    words ("No space left") or, where a write came up short (the disk filled, or the file size limit
    reached), as EIO. Judged by the room left for the ``need`` bytes the store may take (its map size)."""
    if "space" in str(exc).lower():
        return errno.ENOSPC
    import resource
    import shutil

    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY and limit < need:
        return errno.EFBIG
    try:
        free = shutil.disk_usage(tmp.parent).free
    except OSError:
        return errno.EIO
    return errno.ENOSPC if free < need else errno.EIO


def _write_lmdb(lmdb: Any, tmp: Path, map_size: int, blobs: Sequence[Any]) -> None:
    env = lmdb.open(str(tmp), subdir=False, map_size=map_size, lock=False, meminit=True, sync=True,
                    metasync=True, max_dbs=0)
    try:
        txn = env.begin(write=True)
        for i, blob in enumerate(blobs):
            txn.put(key(i), blob, append=True)
            if (i + 1) % _COMMIT_EVERY == 0:
                txn.commit()
                txn = env.begin(write=True)
        txn.commit()
        env.sync(True)
    except BaseException:
        env.close()
        raise
    env.close()


class LmdbReader:
    """Read-only access to LMDB stores (one, or shards in sample order), each opened lazily in each process
    (safe in DataLoader workers).

    Args:
        paths: The store, or the shards in order.
        starts: Each shard's first sample, then the number of samples (`manifest.shard_starts`); needed
            with more than one store.
        local_keys: Keys are rows within their shard (format version 4), not global sample indices.
        root: The dataset folder the stores must stay inside, links resolved (None: not checked).
    """

    def __init__(self, paths: Union[str, Path, Sequence[Union[str, Path]]], starts: Optional[np.ndarray] = None,
                 local_keys: bool = False, root: Optional[Path] = None) -> None:
        # strings, not Path objects: a million stores' paths are parsed once each, when first opened
        self.paths = [os.fspath(paths)] if isinstance(paths, (str, Path)) else [os.fspath(p) for p in paths]
        self.index = ShardIndex(np.asarray([0, 1 << 62] if starts is None else starts, dtype=np.int64))
        self.local_keys = local_keys
        self._counted: set[int] = set()  # shards whose record count matched the manifest
        self.path = Path(self.paths[0]) if len(self.paths) == 1 else Path(self.paths[0]).parent
        self._inside = None if root is None else folder_prefix(root)
        # Each open store holds a descriptor and a mapping: past what fits, open them as read (NOTE [open files])
        self.bound, why = (None, "") if _limits.room_for_maps(len(self.paths)) else _limits.bounded_maps()
        self._hold()
        if self.bound is not None:
            _limits.register_bounded(self, len(self.paths), self.path, why, self.bound)
        elif len(self.paths) > 1:  # (counted while unbounded too: it opens its stores as it reads them)
            _limits.register_bounded(self)

    def held(self) -> int:
        """How many stores this reader holds open in this process."""
        return self._holds.held()

    def promised(self) -> int:
        """How many more stores this reader may open in this process (NOTE [open files] 5)."""
        return (len(self.paths) if self.bound is None else self.bound) - self.held()

    def _hold(self) -> None:
        self._holds = Holds(self.bound, self._inside)
        weakref.finalize(self, self._holds.release)  # a dropped reader lets go of its environments

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_holds"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._hold()
        if len(self.paths) > 1:
            _limits.register_bounded(self)

    def _count(self, s: int, env: Any) -> None:
        """Refuse a shard whose records are not as many as the manifest says (its keys are rows: a wrong
        count would serve another shard's row numbers)."""
        want, have = int(self.index.starts[s + 1] - self.index.starts[s]), int(env.stat()["entries"])
        if want != have:
            raise FormatError(f"{self.paths[s]} holds {have} records, the manifest says {want}: the manifest is "
                              "damaged; re-run `fastdata preprocess` (or restore the dataset's own manifest.json)")
        self._counted.add(s)

    def release(self, path: Path) -> None:
        """Stop holding the store ``path`` (its file may then be deleted): its environment is closed unless
        another reader in this process still holds it (NOTE [shared environments] in lmdb_envs.py). A later read
        reopens it."""
        self._holds.release(path)

    def close(self) -> None:
        """Let go of every store (as `release`); views handed out earlier must no longer be used."""
        self._holds.release()

    def path_of(self, i: int) -> Path:
        """The store holding sample ``i``."""
        return Path(self.paths[int(self.index.locate(np.asarray([i]))[0][0])])

    def get_many(self, indices: Sequence[int]) -> list[bytes]:
        """The records of ``indices``, copied out as ``bytes`` (valid for ever)."""
        with self._reading(indices, copy=True) as out:
            return out

    def views(self, indices: Sequence[int]) -> "contextlib.AbstractContextManager[list[memoryview]]":
        """``with reader.views(indices) as blobs``: the records as read-only views of the memory-mapped
        stores, valid only inside the block (their read transactions stay open until it ends). No copy:
        the loader decodes straight from the page cache, whereas a record copied into ``bytes`` is copied with
        the GIL held (py-lmdb copies under it), which two loader threads then queue for. A bounded reader
        gives copies for a block over more stores than it may hold open (NOTE [open files] 6)."""
        return self._reading(indices, copy=False)

    @contextlib.contextmanager
    def _reading(self, indices: Sequence[int], copy: bool) -> Iterator[list[Any]]:
        idx = np.asarray(indices, dtype=np.int64)
        out: list[Any] = [b""] * len(idx)
        shard, row = self.index.locate(idx)
        keys = (row if self.local_keys else idx).tolist()
        if len(self.paths) == 1:
            groups = [(0, range(len(idx)))]
        else:
            groups = [(s, np.flatnonzero(shard == s).tolist()) for s in np.unique(shard).tolist()]
        pid = os.getpid()  # (a block begun before a fork is given back by the parent only)
        room = len(groups) if self.bound is None else self._holds.room(len(groups))
        try:
            if room >= len(groups):
                with contextlib.ExitStack() as txns:
                    self._read(groups, keys, out, copy, txns)
                    yield out
                return
            for part in range(0, len(groups), room):  # (NOTE [open files] 6: copies, `room` stores at a time)
                with contextlib.ExitStack() as txns:
                    self._read(groups[part:part + room], keys, out, True, txns)
        finally:
            if self.bound is not None:
                self._holds.give_back(room, pid)
        yield out

    def _read(self, groups: Sequence[tuple[int, Sequence[int]]], keys: list[int], out: list[Any], copy: bool,
              txns: contextlib.ExitStack) -> None:
        """``out[r]`` for the rows of each ``(store, rows)`` group: one read transaction a store, ended (and the
        store let go of, bounded) when ``txns`` closes."""
        import lmdb

        for s, rows in groups:
            with CALLS:  # (a fork waits for this, and for the transaction's end below)
                try:
                    env, held = self._holds.env(self.paths[s])
                    if self.bound is not None:  # (registered first: it runs after the transaction's end)
                        txns.callback(self._holds.done, held, os.getpid())
                    if self.local_keys and s not in self._counted:
                        self._count(s, env)
                    txn = env.begin(buffers=not copy)
                    txns.callback(ended, txn)
                    for r in rows:
                        out[r] = txn.get(key(keys[r]))
                        if out[r] is None:  # (a page damaged in place: the key is gone)
                            raise FormatError(f"{self.paths[s]} has no record {key(keys[r]).decode()}: the store "
                                              "is damaged; run `fastdata verify` on the dataset")
                except (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.InvalidError) as exc:  # damaged in place
                    raise FormatError(f"cannot read {self.paths[s]} ({type(exc).__name__}: {exc}): the store is "
                                      "damaged; run `fastdata verify` on the dataset") from None


def open_lmdb(root: Path, manifest: dict[str, Any]) -> LmdbReader:
    """The reader of an LMDB dataset folder, any version."""
    names = lmdb_shards(manifest)  # (plain relative paths: `check_manifest`; links checked when opened)
    return LmdbReader([os.path.join(root, n) for n in names], shard_starts(manifest), root=root,
                      local_keys=manifest["format_version"] >= LOCAL_KEYS_VERSION)
