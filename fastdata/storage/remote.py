"""Datasets at an fsspec URL (``s3://``, ``gs://``, ``az://``, ``https://``, ``file://``): a node-local cache of
verified files (its folders on disk: cache_folders.py; reaching the store: object_store.py).

NOTE [remote cache]: ``cache_dir/<id>/`` mirrors one remote dataset, ``id`` naming the URL and the sha256 of its
manifest, so a manifest changed under a running job gives another folder and is never mixed with the old files. A
file is downloaded under ``<name>.part-<pid>-<random>``, hashed while it streams, compared with the manifest's size
and sha256, then renamed: nothing partial or corrupt ever has a final name. A per-file lock (``flock`` under
``.locks/``) makes every rank and worker on a node wait for one download instead of starting their own; leftovers of
a killed downloader (``.part-*`` whose file's lock is free) are removed. The folder holds the manifest from the
start (its id is that manifest's hash) and the files as they arrive: FastDataset streams image shards into it as
batches need them (storage/cache.py), any other reader waits for every file, and then it is an ordinary dataset
folder. The next job on the same data reuses it; ``fastdata cache list|fetch|remove`` manage the folders. Each
opening removes the folders of the URL's other versions that no reader holds (every opening and reader holds its
own folder: `ShardPins` rule 4), so a dataset pushed again leaves no old copy outside every cache_limit. A download
whose bytes do not match while the remote manifest changed is refused: a job never mixes two versions of a dataset.
An object replaced after `fastdata push` is named at once, not retried: a body of the wrong sha256 twice, a body
or a piece that fails its check (or a range refused as past the object's end) while the store says the object is
of another size than the manifest's (one HEAD; a body cut on its way, the object still of the manifest's size, is
a network fault).
A network fault is retried (NOTE [retry budget] in object_store.py); a full cache disk is not (trying again does not
free space): the partial file is removed and one line says what to do (DiskFullError; a rerun keeps what is cached).
A file over 64 MB comes in 8 MB ranged pieces, each retried on its own, the ``.part`` file and its running sha256
kept: a fault on piece k does not throw away pieces 0..k-1 (restarting whole, a store answering one GET in 10
with 503 delivered a 25-piece shard on 7% of tries); only a whole body whose size or sha256 fails its check is
fetched again from its first byte.
The cache is private: folders 0700, files 0600, an existing folder of another user refused (its files could be
planted); ``$FASTDATA_CACHE_MODE=group`` shares it with the folders' group instead (02770, 0660).
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import secrets
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import numpy as np

from .._io import HASH_NAME, disk_error, fsync_dir, map_threads, new_hash, open_new, scrub, write_bytes_atomic
from ..errors import ChecksumError, FastdataError, FormatError
from ..formats.manifest import MANIFEST_NAME, parse_manifest
from ..formats.integrity import file_problem
from ..formats.rows import Rows, column, int_column, is_rows, lookup, rows_by
from .cache_folders import (CACHE_FULL_ADVICE, SOURCE_NAME, cache_folder, cache_modes, cached_size, copy_advice,
                            default_cache_dir, lock_file)
from .cache_locks import FolderRemoved, ShardPins, remove_other_versions
from .object_store import (RETRY_SECONDS, Retry, check_object_names, filesystem, object_path, range_refused,
                           read_range, stopped, stored_size)

_BLOCK = 8 << 20
_WHOLE = 64 << 20


class RemoteDataset:
    """One remote dataset and its node-local copy (see NOTE [remote cache]); `local` gives a folder
    any fastdata reader opens.

    Args:
        url: The dataset's fsspec URL.
        storage_options: Options passed to fsspec (credentials, endpoint).
        cache_dir: The node cache folder (default `default_cache_dir`).
        retry_seconds: How long the store may fail (refuse connections, time out, answer 5xx) before a read
            gives up with one line naming the object (NOTE [retry budget]); default 120.
        workers: Parallel downloads of `prepare`.

    Raises:
        FormatError: No manifest at ``url``, a malformed one, or the store unreachable for ``retry_seconds``.
    """

    def __init__(self, url: str, *, storage_options: Optional[dict[str, Any]] = None,
                 cache_dir: Optional[Union[str, Path]] = None, retry_seconds: float = RETRY_SECONDS,
                 workers: int = 8, manifest_bytes: Optional[bytes] = None) -> None:
        self.url = url.rstrip("/")
        self.retry = Retry(retry_seconds)
        self._options = storage_options
        self._fs, self.root = filesystem(self.url, storage_options)
        self._fs_pid = os.getpid()
        self.workers = workers
        raw = manifest_bytes if manifest_bytes is not None else self._fetch_manifest()
        try:
            text = raw.decode(json.detect_encoding(raw), "surrogatepass")  # (as json.loads decodes bytes)
            self.manifest = parse_manifest(text, columns=True)  # (a reader keeps it)
            del text
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise FormatError(f"{scrub(self.url)}/{MANIFEST_NAME} is not valid JSON ({exc})") from exc
        if not isinstance(self.manifest, dict) or not is_rows(self.manifest.get("files")):
            raise FormatError(f"{scrub(self.url)}/{MANIFEST_NAME} is not a fastdata manifest")
        # refuse escaping names before anything is fetched
        files = self.manifest["files"]
        names = (column(files, "path", "") if isinstance(files, Rows) else
                 [e.get("path", "") if isinstance(e, dict) else e for e in files])
        check_object_names(names)
        _refuse_cache_names(self.url, names)
        del names
        self._manifest_bytes: Optional[bytes] = raw  # until the node cache holds it (`prepare`): 0.3 GB at 10^6 shards
        self._manifest_sha = new_hash(raw).hexdigest()
        digest = new_hash()
        digest.update(scrub(self.url).encode() + b"\0" + raw)
        self.id = digest.hexdigest()[:20]
        self.dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.dir = self.dir / self.id
        self.fetched = {"files": 0, "bytes": 0}  # downloads made by this process (benchmarks, tests)
        self._count = threading.Lock()
        self._holding: Optional[tuple[int, ShardPins]] = None  # (pid, the folder held whole: `prepare(hold=True)`)
        self.whole_reader = False  # prepared for readers of every file: each holds the folder (`hold_whole`)

    def _fetch_manifest(self) -> bytes:
        try:
            return self.retry(f"{self.url}/{MANIFEST_NAME}", lambda: self.fs.cat_file(object_path(self.root,
                                                                                                   MANIFEST_NAME)))
        except FileNotFoundError:
            raise FormatError(f"{scrub(self.url)} has no {MANIFEST_NAME}: not a fastdata dataset, or its `fastdata "
                              "push` has not finished (the manifest is uploaded last)") from None

    @property
    def fs(self) -> Any:
        """This process's fsspec filesystem: a forked child (a DataLoader worker) makes its own, since an
        async client (s3fs) refuses to run on the event loop of the process that forked it."""
        if self._fs_pid != os.getpid():
            self._fs, _ = filesystem(self.url, self._options)
            self._fs_pid = os.getpid()
        return self._fs

    def __getstate__(self) -> dict[str, Any]:  # DataLoader workers under spawn
        return {k: v for k, v in self.__dict__.items() if k not in ("_count", "_fs", "_fs_pid", "_entries",
                                                                  "_holding")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._count = threading.Lock()
        self._fs, self._fs_pid = None, None  # made on first use in this process
        self._holding = None  # (the sending process holds the folder while it lives)

    def prepare(self, skip: frozenset[str] = frozenset(), progress: Optional[Callable[[int], None]] = None, *,
                hold: bool = False) -> Path:
        """The cache folder with the manifest and every file but ``skip`` (those are fetched on demand, see
        `fastdata.storage.cache.ShardCache`), each downloaded once per node and verified. ``hold``: a reader
        of every file (storage "ram", "shm", "cuda"; an LMDB of version 1) holds the folder from before the
        downloads until `release`, so that a job with a cache_limit sharing it evicts none of the files it
        reads (`ShardPins.hold_all`; its workers may read them again); each reader then takes its own
        (`hold_whole`). Every opening holds the folder as read from here until `release` (or until its reader
        holds it: `hold_whole`), so that the opening of another version leaves it (`remove_other_versions`);
        the folders of other versions of this URL that no reader holds are removed."""
        pins = self._hold_folder()
        if hold:
            self.whole_reader = True
            pins.hold_all()  # (before a file is looked at: one evicted meanwhile is fetched below)
        self._clean_leftovers()
        if not (self.dir / MANIFEST_NAME).is_file():  # the folder's id is this manifest's hash: always the same
            with lock_file(self.dir / ".locks" / "manifest.lock") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # every rank may get here: one writes (fixed temporary names)
                if not (self.dir / MANIFEST_NAME).is_file():
                    mode = cache_modes()[1]
                    write_bytes_atomic(self.dir / SOURCE_NAME, json.dumps(  # for `fastdata cache list`
                        {"url": scrub(self.url), "id": self.id, "created": time.time()}).encode(), CACHE_FULL_ADVICE,
                        mode=mode)
                    write_bytes_atomic(self.dir / MANIFEST_NAME, self.manifest_bytes(), CACHE_FULL_ADVICE, mode=mode)
                    fsync_dir(self.dir)
        remove_other_versions(self.dir, scrub(self.url))  # (before the downloads: their disk comes back first)
        self._manifest_bytes = None  # (read back from the cache when asked for, not held by every process)
        files = self.manifest["files"]
        entries = list(rows_by(files, (path for path in column(files, "path") if path not in skip)).values())
        map_threads(lambda e: self.fetch(e, progress), entries, self.workers, "fastdata-fetch-files")
        return self.dir

    def _hold_folder(self) -> ShardPins:
        """This opening's hold on its cache folder (a reader of it: `ShardPins`), the folder made first, and
        made again where the opening of another version removed it meanwhile (no reader held it then)."""
        if self._holding is not None and self._holding[0] == os.getpid():  # (a forked child holds none of its parent's)
            return self._holding[1]
        for _ in range(8):  # (each turn needs another process to remove the folder between two of our calls)
            cache_folder(self.dir)
            cache_folder(self.dir / ".locks")
            try:
                pins = ShardPins(self.dir / ".locks")
            except FolderRemoved:
                continue
            weakref.finalize(self, pins.close)  # (a dropped opening lets go: no lock or descriptor outlives it)
            self._holding = (os.getpid(), pins)
            return pins
        raise FolderRemoved(self.dir)

    def hold_whole(self) -> Optional[ShardPins]:
        """A reader's own hold on the folder, where `prepare` held it for readers of every file (else None):
        each reader keeps its own until it is closed, so closing one of two readers of one opened path leaves
        the other's; the opening's hold is let go, now that the reader holds the folder (a streamed reader's
        through the pins of its `ShardCache`)."""
        if not self.whole_reader:
            self.release()
            return None
        pins = ShardPins(self.dir / ".locks")
        pins.hold_all()
        self.release()
        return pins

    def release(self) -> None:
        """Let go of the folder `prepare` held: other jobs may evict its files again (``hold``), and the
        opening of another version may remove it once no reader holds it."""
        held, self._holding = self._holding, None
        if held is not None and held[0] == os.getpid():
            held[1].close()

    def local(self, progress: Optional[Callable[[int], None]] = None) -> Path:
        """Download (once per node) and verify every file; the local folder, an ordinary dataset folder."""
        return self.prepare(frozenset(), progress)

    @property
    def damaged_advice(self) -> str:
        """What an error about a file damaged in this node cache says to do (`integrity.damaged_error`'s
        ``advice``): the store's copy is intact (a download checks the bytes as they come), so neither `fastdata
        verify URL` nor a new push or preprocess mends it."""
        return copy_advice(self.id)

    def entry(self, name: str) -> dict[str, Any]:
        """The manifest's entry for file ``name``."""
        if not hasattr(self, "_entries"):
            self._entries = lookup(self.manifest["files"])
        entry = self._entries(name)
        if entry is None:
            raise KeyError(name)
        return entry

    def sizes(self, names: Sequence[str]) -> np.ndarray:
        """The manifest's bytes of files ``names`` (one sorted search for all of them: 10^6 shards).

        Raises:
            KeyError: A name the manifest does not list.
        """
        files = self.manifest["files"]
        if isinstance(files, Rows):
            at = files.find_many("path", names)
        else:
            table = {p: i for i, p in reversed(list(enumerate(column(files, "path"))))}
            at = np.array([table.get(n, -1) for n in names], dtype=np.int64)
        if (at < 0).any():
            raise KeyError(names[int(np.flatnonzero(at < 0)[0])])
        return int_column(files, "bytes")[at]

    def fetch(self, entry: dict[str, Any], progress: Optional[Callable[[int], None]] = None) -> Path:
        """One manifest entry as a verified local file (downloaded at most once per node)."""
        self.get(entry, progress)
        return self.dir / entry["path"]

    def get(self, entry: dict[str, Any], progress: Optional[Callable[[int], None]] = None,
            stop: Optional[threading.Event] = None) -> bool:
        """`fetch`, saying whether this call downloaded the file (False: it was cached already, or
        another thread or process on the node fetched it meanwhile). ``stop`` set (the reader was closed):
        the download gives up at its next try or piece, a ConfigError (`Retry`)."""
        name, what = entry["path"], f"{self.url}/{entry['path']}"
        final = self.dir / name
        if cached_size(self.dir, name) == entry.get("bytes"):
            return False  # only verified bytes ever get a final name
        for parent in reversed(final.relative_to(self.dir).parents[:-1]):  # a name's folders, inside the cache
            cache_folder(self.dir / parent)
        lock_path = self._download_lock(name)
        bad: list[str] = []  # digests of the whole bodies that differed from the manifest's

        def download() -> None:
            try:
                self._download(entry, final, progress, stop)
            except _WrongBytes as exc:
                bad.append(exc.digest)
                if bad.count(exc.digest) > 1:  # the same wrong bytes twice: the stored object, not the network
                    raise ChecksumError(f"cannot read {scrub(self.url)}/{name} after {len(bad)} tries: the store's "
                                        f"object has {HASH_NAME} {exc.digest[:12]}... each time, not the manifest's "
                                        f"{entry[HASH_NAME][:12]}...: it was replaced or damaged after `fastdata "
                                        "push`; push the dataset again (`fastdata verify URL` lists every such "
                                        "object)") from None
                raise
        with lock_file(lock_path) as lock:
            _wait_lock(lock, what, stop)  # another process downloading it: wait for its result
            if cached_size(self.dir, name) == entry.get("bytes"):
                return False
            try:
                self.retry(what, download, stop=stop)  # (again from byte 0: a whole body failed its checks)
            except FastdataError:  # (names the object already)
                raise
            except Exception as exc:  # noqa: BLE001 - final errors (the object deleted from the store since)
                # (from None, as `Retry`: the store's own error echoes the unscrubbed URL, and a traceback
                # prints a chained cause whole: a script dying uncaught, logging.exception, a job's log)
                raise FormatError(f"cannot fetch {scrub(self.url)}/{name}: {type(exc).__name__}: "
                                  f"{scrub(' '.join(str(exc).split()))[:300]}; check that the dataset is intact in "
                                  "the store (`fastdata verify URL`)") from None
        return True

    def _download(self, entry: dict[str, Any], final: Path, progress: Optional[Callable[[int], None]],
                  stop: Optional[threading.Event] = None) -> None:
        tmp = final.with_name(f"{final.name}.part-{os.getpid()}-{secrets.token_hex(4)}")
        digest, size, done = new_hash(), 0, False

        def local(op: Callable[[], Any]) -> Any:  # this machine's side: its errors are not the network's
            try:
                return op()
            except OSError as exc:
                raise disk_error(exc, final, CACHE_FULL_ADVICE) from exc
        try:
            dst = local(lambda: open_new(tmp, cache_modes()[1]))
            try:
                for block in self._blocks(object_path(self.root, entry["path"]), int(entry["bytes"]),
                                          f"{self.url}/{entry['path']}", stop):
                    digest.update(block)
                    local(lambda: dst.write(block))
                    size += len(block)
                    if progress is not None:
                        progress(len(block))
                local(lambda: (dst.flush(), os.fsync(dst.fileno())))
            finally:
                try:
                    dst.close()
                except OSError:  # flushing what a failed write left buffered: that error is on its way already
                    pass
            problem = file_problem(entry, size, digest.hexdigest())
            if problem is not None and self._manifest_changed():
                raise self._changed_under_job() from None
            if problem is not None:  # the store's object of another size (grown, cut): named now, not retried
                self._check_object(object_path(self.root, entry["path"]), int(entry["bytes"]))
            if problem == "hash":  # a corrupted body: retried by the caller, never renamed
                raise _WrongBytes(digest.hexdigest())
            if problem is not None:  # a body cut on its way: retried
                raise IOError(f"the downloaded bytes' {problem} differs from the manifest's (truncated on the way)")
            local(lambda: os.replace(tmp, final))
            done = True
            with self._count:
                self.fetched["files"] += 1
                self.fetched["bytes"] += size
        finally:
            tmp.unlink(missing_ok=True)
            if not done and size and progress is not None:  # the next try counts from byte 0: a bar counts once
                progress(-size)

    def _blocks(self, path: str, size: int, what: str = "",
                stop: Optional[threading.Event] = None) -> Iterator[bytes]:
        """The object's ``size`` bytes (the manifest's size) in ranged GETs: one for files up to ``_WHOLE``,
        else ``_BLOCK`` pieces. A ranged read is one request on every fsspec backend; a whole-object read or
        an ``open`` makes s3fs ask for the size first: a HEAD per shard, half the requests, and a large share of
        the server's CPU per byte (benchmarks/RESULTS.md). Each piece is retried on its own within the budget
        (NOTE [remote cache]), named ``what``; ``stop``: `Retry`'s. A piece refused as past the object's end, or
        one that comes short, is one look at the object's size: another than the manifest's is an error at once
        (`_check_object`), not a fault retried for the whole budget."""
        step = size if size <= _WHOLE else _BLOCK
        for start in range(0, size, step):
            end = min(size, start + step)
            block = self.retry(what or path, lambda: self._piece(path, start, end, size), stop=stop)
            yield block
            if len(block) > end - start:  # a server that ignores Range sent the whole object: the checks judge it
                return

    def _piece(self, path: str, start: int, end: int, size: int) -> bytes:
        """Bytes ``start:end`` of object ``path`` (of the manifest's ``size``); a try of `_blocks`."""
        try:
            block = read_range(self.fs, path, start, end)
        except Exception as exc:  # noqa: BLE001 - re-raised: `Retry` judges it
            if range_refused(exc):
                self._check_object(path, size)
            raise
        if len(block) < end - start:  # (a range is never past the manifest's size: the object is shorter, or cut)
            self._check_object(path, size)
            raise IOError(f"{len(block)} bytes of a piece of {end - start} came (cut on the way)")
        return block

    def _check_object(self, path: str, size: int) -> None:
        """Raise when the store's object ``path`` is not of the manifest's ``size`` now (one HEAD): it changed
        since the manifest was written, which no retry mends; a new manifest (a push under this job) is said
        first. Nothing when it is of that size: the caller's fault is the network's.

        Raises:
            FormatError: The dataset's manifest changed while this job reads it.
            ChecksumError: The object alone changed: replaced, cut, or written by another writer.
        """
        stored = stored_size(self.fs, path)  # (a HEAD, asked afresh)
        if stored is None or stored == size:
            return
        if self._manifest_changed():  # (from None: called while a store's error, naming the URL, is handled)
            raise self._changed_under_job() from None
        root = self.root.rstrip("/")
        name = path[len(root) + 1:] if root else path  # (`object_path`'s name)
        raise ChecksumError(f"cannot read {scrub(self.url)}/{name}: the store's object has {stored} bytes, not the "
                            f"manifest's {size}: it was replaced or damaged after `fastdata push` (changed since the "
                            "manifest was written: a push or preprocess run over it that did not finish, or another "
                            "writer at this URL); check that no other job writes there, then push the dataset again "
                            "(`fastdata push`) or re-run `fastdata preprocess` to this URL (`fastdata verify URL` "
                            "lists every such object)") from None

    def _changed_under_job(self) -> FormatError:
        return FormatError(f"{scrub(self.url)} changed while this job was reading it (its {MANIFEST_NAME} is not the "
                           "one this job started with): refusing to mix two versions; restart the job to read the "
                           "new one")

    def manifest_bytes(self) -> bytes:
        """The manifest's bytes as this dataset read them: held until the node cache has them, then read back
        from there (or fetched again) and checked against their sha256."""
        if self._manifest_bytes is not None:
            return self._manifest_bytes
        cached = self.dir / MANIFEST_NAME
        raw = cached.read_bytes() if cached.is_file() else self._fetch_manifest()
        if new_hash(raw).hexdigest() != self._manifest_sha:
            raise FormatError(f"{scrub(self.url)}/{MANIFEST_NAME} changed since this dataset was opened (or its "
                              f"copy in {self.dir} was): open the dataset again")
        return raw

    def _manifest_changed(self) -> bool:
        try:
            return new_hash(self.fs.cat_file(object_path(self.root, MANIFEST_NAME))).hexdigest() != self._manifest_sha
        except Exception:  # noqa: BLE001 - unreachable now: not known to have changed; the caller retries
            return False

    def _download_lock(self, name: str) -> Path:
        """The lock file held while file ``name`` is downloaded, from before its ``.part-*`` file exists until
        after that is renamed or removed."""
        return self.dir / ".locks" / (name.replace("/", "%") + ".lock")

    def _clean_leftovers(self) -> None:
        """Remove ``.part-*`` files of killed downloads: those whose download lock is free. Judged by the lock,
        not by the pid in the name, which may be another PID namespace's (containers sharing a node cache)."""
        for part in self.dir.rglob("*.part-*"):
            if part.is_dir() and not part.is_symlink():
                continue  # (no download makes a folder: not a leftover of one)
            name = part.relative_to(self.dir).as_posix().rsplit(".part-", 1)[0]
            with lock_file(self._download_lock(name)) as lock:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # downloading now, in some process of this node
                part.unlink(missing_ok=True)


def _wait_lock(lock: Any, what: str, stop: Optional[threading.Event]) -> None:
    """Take download lock ``lock`` (another process downloading the file: wait for its result); with ``stop``,
    polled 10 times a second, so a closed reader does not wait out another's retries."""
    if stop is None:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if stop.wait(0.1):
                raise stopped(what) from None


# names the node cache keeps for itself in a dataset's folder: its manifest, source, locks, partial downloads
_CACHE_NAMES = re.compile(r"(?:\A|\n)(?:\.locks(?:/[^\n]*)?|" + re.escape(SOURCE_NAME) + "|" + re.escape(MANIFEST_NAME)
                          + r")(?:\n|\Z)|\.part-[^\n/]*(?:\n|\Z)")


def _refuse_cache_names(url: str, names: list[str]) -> None:
    """Refuse a manifest that lists a file at a name the node cache keeps for itself: fetched, it would
    replace the cache's own file (the pins every rank locks, the cached manifest, what `fastdata cache list`
    reports). One search over the names joined (they are checked plain relative paths)."""
    if _CACHE_NAMES.search("\n".join(names)) is not None:
        name = next(n for n in names if _CACHE_NAMES.search(n))
        raise FormatError(f"{scrub(url)}/{MANIFEST_NAME} lists {name!r}, a name the node cache "
                          "keeps for itself (.locks/, .source.json, manifest.json, *.part-*): not a manifest "
                          "fastdata wrote; push the dataset again (`fastdata push`)")


def verify_store(remote: RemoteDataset, progress: Optional[Callable[[int], None]] = None) -> list[str]:
    """Check every object of ``remote`` in the store (not the node cache) against its manifest: its size,
    then its sha256 over its bytes as they stream (nothing is kept), ``remote.workers`` objects at a time,
    each retried within the dataset's budget.

    Args:
        remote: The dataset (its manifest as the store holds it now).
        progress: Called with the bytes of each block hashed (a progress bar).

    Returns:
        One line per problem, naming the object's (scrubbed) URL: missing, of the wrong size, or whose
        checksum differs; empty when every object is intact.

    Raises:
        FormatError: The store stayed unreachable for the dataset's ``retry_seconds``.
    """
    def check(entry: dict[str, Any]) -> Optional[str]:
        path, size = object_path(remote.root, entry["path"]), int(entry["bytes"])

        def digest() -> Optional[str]:
            stored = int(remote.fs.info(path).get("size", -1))
            if stored != size:
                return f"{stored} bytes in the store, manifest says {size} (truncated or replaced)"
            h = new_hash()
            for block in remote._blocks(path, size, f"{remote.url}/{entry['path']}"):
                h.update(block)
                if progress is not None:
                    progress(len(block))
            return None if h.hexdigest() == entry[HASH_NAME] else f"{HASH_NAME} mismatch (replaced or damaged)"
        try:
            problem = remote.retry(f"{remote.url}/{entry['path']}", digest)
        except FileNotFoundError:
            problem = "missing"
        except ChecksumError:  # (`_check_object`: it changed while it was hashed)
            problem = "replaced while it was read (its size is no longer the manifest's)"
        return None if problem is None else f"{scrub(remote.url)}/{entry['path']}: {problem}"

    return [p for p in map_threads(check, remote.manifest["files"], remote.workers, "fastdata-verify-store")
            if p is not None]


class _WrongBytes(IOError):
    """A whole body whose sha256 differs from the manifest's (retried: a second time, the object itself)."""

    def __init__(self, digest: str) -> None:
        super().__init__(f"the downloaded bytes' {HASH_NAME} differs from the manifest's (corrupted)")
        self.digest = digest


def download_bar(remote: RemoteDataset, left: int) -> Optional[Callable[[int], None]]:
    """A progress callback showing the first download of ``left`` bytes of ``remote`` (bytes, rate) on rank 0;
    it closes itself once they are all in; None when nothing is left."""
    from ..progress import progress_bar

    if left == 0:
        return None
    bar = progress_bar(total=left, desc=f"download {scrub(remote.url).rsplit('/', 1)[-1]}", unit="B", unit_scale=True)
    lock, done = threading.Lock(), [0]

    def update(n: int) -> None:
        with lock:
            if done[0] < left:
                done[0] += n
                bar.update(n)
                if done[0] >= left:
                    bar.close()
    return update
