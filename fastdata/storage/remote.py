"""Datasets at an fsspec URL (``s3://``, ``gs://``, ``az://``, ``https://``, ``file://``): a node-local cache of
verified files, and ``push`` to upload a finished dataset.

NOTE [remote cache]: ``cache_dir/<id>/`` mirrors one remote dataset, ``id`` naming the URL and the sha256
of its manifest, so a manifest changed under a running job gives another folder and is never mixed with
the old files. A file is downloaded under ``<name>.part-<pid>-<random>``, hashed while it streams, compared
with the manifest's size and sha256, then renamed: nothing partial or corrupt ever has a final name. A
per-file lock (``flock`` under ``.locks/``) makes every rank and worker on a node wait for one download
instead of starting their own; leftovers of a killed downloader (``.part-*`` whose file's lock is free) are removed.
The folder holds the manifest from the start (its id is that manifest's hash) and the files as they
arrive: FastDataset streams image shards into it as batches need them (storage/cache.py), any other
reader waits for every file, and then it is an ordinary dataset folder. The next job on the same data
reuses it; ``fastdata cache list|fetch|remove`` manage the folders. A download whose bytes do not match while
the remote manifest changed is refused: a job never mixes two versions of a dataset. A network fault is
retried (NOTE [retry budget]); a full cache disk is not (trying again does not free space): the partial file
is removed and one line says what to do (DiskFullError; a rerun keeps what is cached). The cache is private:
folders 0700, files 0600, an existing folder of another user refused (its files could be planted);
``$FASTDATA_CACHE_MODE=group`` shares it with the folders' group instead (02770, 0660).

NOTE [retry budget]: every call to the store (the manifest at opening, each download or prefetch, each
object ``verify`` hashes, each upload of ``push``) is retried by one `Retry` per dataset over one
budget, ``retry_seconds`` (default 120):
1. A failed try waits a random time between 0 and 0.2 s x 2^(tries - 1), at most 10 s (exponential back-off with
   full jitter: many ranks coming back after an outage do not knock together), then tries again.
2. The budget runs from the earlier of this call's first try and the dataset's first failure since its
   last success, so a read that waited for a failed prefetch's download lock gets no budget of its own: an
   outage is given up on once, ``retry_seconds`` after it began (plus one try), not once per shard.
3. The last try is made at the deadline: an outage shorter than the budget is survived.
4. After it, one FormatError names the (scrubbed) URL, the tries and seconds, the last error and what to
   do. Nothing partial has a final name, so a rerun resumes from the files cached.
5. The client's own retry loops would multiply the wait (s3fs tries 5 times, botocore 5 times each): an
   ``s3://`` client tries once per call; the timeouts of one try stay s3fs's (connect 5 s, read 15 s).
6. Not retried: an answer that trying again does not change (no such object, access denied, the same
   wrong bytes twice, a full cache disk).
"""
from __future__ import annotations

import fcntl
import json
import os
import posixpath
import random
import re
import secrets
import stat
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Union

from .._io import HASH_NAME, LockFile, disk_error, fsync_dir, map_threads, new_hash, open_new, scrub, write_bytes_atomic
from ..errors import (ChecksumError, ConfigError, FastdataError, FormatError, MissingDependencyError, OutputError,
                      require)
from ..formats.manifest import MANIFEST_NAME, file_problem
from ..formats.rows import column, lookup, rows_by

REMOTE_EXTRA = "pip install 'fastdata[remote]'"
_PROTOCOL_PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs",
                      "abfss": "adlfs", "http": "aiohttp", "https": "aiohttp"}
SOURCE_NAME = ".source.json"
_BLOCK = 8 << 20
_WHOLE = 64 << 20
CACHE_FULL_ADVICE = ("give the dataset a cache_limit below the free space (`--cache-limit`: shards are then "
                     "streamed and evicted), remove other datasets' copies (`fastdata cache remove`), or point "
                     "cache_dir / $FASTDATA_CACHE at a larger disk; a rerun keeps the files already cached")
RETRY_SECONDS = 120.0  # the outage a read rides out by default: throttling, a failover, a DNS blip
_FIRST_WAIT, _LONGEST_WAIT = 0.2, 10.0  # seconds: the bound of the first wait, doubled per try up to this
CACHE_MODES = {"private": (0o700, 0o600), "group": (0o2770, 0o660)}  # $FASTDATA_CACHE_MODE: folders, files


def is_url(path: Union[str, Path]) -> bool:
    """True for ``protocol://...`` (``file://`` included); plain paths are read in place, as before."""
    return isinstance(path, str) and re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", path) is not None


def filesystem(url: str, storage_options: Optional[dict[str, Any]] = None) -> tuple[Any, str]:
    """``(fsspec filesystem, path inside it)`` for ``url``; names the extra to install when it is missing.
    Credentials and endpoints come from the usual places (AWS_* variables such as ``AWS_ENDPOINT_URL``,
    profiles, ...) or ``storage_options``. An ``s3://`` client tries each request once (s3fs's and botocore's
    own retry loops off, unless ``storage_options`` sets them): `Retry` is the one budget
    (NOTE [retry budget])."""
    protocol = url.split("://", 1)[0].lower()
    try:
        import fsspec
    except ImportError as exc:
        raise MissingDependencyError(f"{scrub(url)} is a URL: reading it needs fsspec ({REMOTE_EXTRA})") from exc
    options = dict(storage_options or {})
    if protocol in ("s3", "s3a"):
        # botocore's own retry loop off (a dict of our own each time: botocore adds to it)
        options["config_kwargs"] = {"retries": {"total_max_attempts": 1}, **options.get("config_kwargs", {})}
    try:
        fs, path = fsspec.core.url_to_fs(url, **options)
    except ImportError as exc:
        package = _PROTOCOL_PACKAGES.get(protocol, f"the fsspec backend for {protocol}://")
        raise MissingDependencyError(f"{scrub(url)}: {protocol}:// needs {package} ({REMOTE_EXTRA})") from exc
    except ValueError as exc:  # an unknown protocol
        raise ConfigError(f"{scrub(url)}: {scrub(str(exc))}") from exc
    if protocol in ("s3", "s3a"):  # (an instance of its own: fsspec caches one per set of options, and these
        fs.retries = 1             # options are ours)
    return fs, path


def object_path(root: str, name: str) -> str:
    """``root/name`` for a name from a manifest, refused unless it stays inside the dataset's prefix."""
    if (not isinstance(name, str) or not name or name.startswith(("/", "\\")) or "://" in name or "\\" in name
            or any(part in ("", ".", "..") for part in name.split("/"))):
        raise FormatError(f"the manifest names {name!r}, which is not a plain relative path inside the dataset: "
                          "refusing to read outside its prefix")
    return posixpath.join(root.rstrip("/"), name)


class Retry:
    """Calls to the store retried over one budget of ``seconds`` (see NOTE [retry budget]); one per dataset
    (or push), shared by its threads.

    Args:
        seconds: How long the store may fail before a read gives up: the time since this call's first try,
            or since the dataset's reads began failing, whichever is earlier. 0 tries once.
    """

    def __init__(self, seconds: float = RETRY_SECONDS) -> None:
        require(isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and 0 <= seconds < float("inf"),
                "retry_seconds", seconds, "a number of seconds >= 0")
        self.seconds = float(seconds)
        self.failing_since: Optional[float] = None  # monotonic time of the first failure since the last success

    def __call__(self, what: str, fn: Callable[[], Any], doing: str = "read") -> Any:
        """``fn()``, tried until it succeeds or the budget is spent; then one FormatError naming ``what``."""
        start, tries = time.monotonic(), 0
        while True:
            tries += 1
            try:
                result = fn()
            except (FileNotFoundError, MissingDependencyError, FastdataError):
                raise  # (OutputError: this machine's disk, e.g. a full cache, which trying again does not mend)
            except PermissionError as exc:  # denied is an answer, not an outage
                raise FormatError(f"cannot {doing} {scrub(what)}: access denied ({_said(exc)}): check the "
                                  "credentials (AWS_* variables, profile or storage_options)") from None
            except Exception as exc:  # noqa: BLE001 - network stacks raise anything: retried, then reported
                now = time.monotonic()
                self.failing_since = self.failing_since or now
                deadline = min(start, self.failing_since) + self.seconds
                if now >= deadline:
                    raise FormatError(
                        f"cannot {doing} {scrub(what)} after {tries} tr{'y' if tries == 1 else 'ies'} over "
                        f"{now - start:.1f} s (retry_seconds={self.seconds:g}), the last: {_said(exc)}; check that "
                        "the store is up and reachable, or raise retry_seconds (`--retry-seconds`) to ride out a "
                        "longer outage; a rerun resumes from what is cached") from None
                bound = min(_LONGEST_WAIT, _FIRST_WAIT * 2 ** min(tries - 1, 30))
                time.sleep(min(random.uniform(0, bound), deadline - now))  # full jitter, the last try at the deadline
                continue
            self.failing_since = None
            return result


def _said(exc: BaseException) -> str:
    """``Type: text`` of an exception on one line, at most 300 characters, scrubbed."""
    return scrub(f"{type(exc).__name__}: {' '.join(str(exc).split())}")[:300]


def default_cache_dir() -> Path:
    """``$FASTDATA_CACHE``, else ``$XDG_CACHE_HOME/fastdata``, else ``~/.cache/fastdata``."""
    if os.environ.get("FASTDATA_CACHE"):
        return Path(os.environ["FASTDATA_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fastdata"


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
            self.manifest = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise FormatError(f"{scrub(self.url)}/{MANIFEST_NAME} is not valid JSON ({exc})") from exc
        if not isinstance(self.manifest, dict) or not isinstance(self.manifest.get("files"), list):
            raise FormatError(f"{scrub(self.url)}/{MANIFEST_NAME} is not a fastdata manifest")
        for entry in self.manifest["files"]:
            object_path(self.root, entry.get("path", ""))  # refuse escaping names before anything is fetched
        self._manifest_bytes: Optional[bytes] = raw  # until the node cache holds it (`prepare`): 0.3 GB at 10^6 shards
        self._manifest_sha = new_hash(raw).hexdigest()
        digest = new_hash()
        digest.update(scrub(self.url).encode() + b"\0" + raw)
        self.id = digest.hexdigest()[:20]
        self.dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.dir = self.dir / self.id
        self.fetched = {"files": 0, "bytes": 0}  # downloads made by this process (benchmarks, tests)
        self._count = threading.Lock()

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
        return {k: v for k, v in self.__dict__.items() if k not in ("_count", "_fs", "_fs_pid", "_entries")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._count = threading.Lock()
        self._fs, self._fs_pid = None, None  # made on first use in this process

    def prepare(self, skip: frozenset[str] = frozenset(),
                progress: Optional[Callable[[int], None]] = None) -> Path:
        """The cache folder with the manifest and every file but ``skip`` (those are fetched on demand, see
        `fastdata.storage.cache.ShardCache`), each downloaded once per node and verified."""
        cache_folder(self.dir)
        cache_folder(self.dir / ".locks")
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
        self._manifest_bytes = None  # (read back from the cache when asked for, not held by every process)
        files = self.manifest["files"]
        entries = list(rows_by(files, (path for path in column(files, "path") if path not in skip)).values())
        map_threads(lambda e: self.fetch(e, progress), entries, self.workers, "fastdata-fetch-files")
        return self.dir

    def local(self, progress: Optional[Callable[[int], None]] = None) -> Path:
        """Download (once per node) and verify every file; the local folder, an ordinary dataset folder."""
        return self.prepare(frozenset(), progress)

    def entry(self, name: str) -> dict[str, Any]:
        """The manifest's entry for file ``name``."""
        if not hasattr(self, "_entries"):
            self._entries = lookup(self.manifest["files"])
        entry = self._entries(name)
        if entry is None:
            raise KeyError(name)
        return entry

    def entries(self, names: Iterable[str]) -> dict[str, dict[str, Any]]:
        """The manifest's entries of files ``names``, by name (one pass for all of them)."""
        return rows_by(self.manifest["files"], names)

    def fetch(self, entry: dict[str, Any], progress: Optional[Callable[[int], None]] = None) -> Path:
        """One manifest entry as a verified local file (downloaded at most once per node)."""
        self.get(entry, progress)
        return self.dir / entry["path"]

    def get(self, entry: dict[str, Any], progress: Optional[Callable[[int], None]] = None) -> bool:
        """`fetch`, saying whether this call downloaded the file (False: it was cached already, or
        another thread or process on the node fetched it meanwhile)."""
        name = entry["path"]
        final = self.dir / name
        if final.is_file() and final.stat().st_size == entry.get("bytes"):
            return False  # only verified bytes ever get a final name
        for parent in reversed(final.relative_to(self.dir).parents[:-1]):  # a name's folders, inside the cache
            cache_folder(self.dir / parent)
        lock_path = self._download_lock(name)
        bad: list[str] = []  # digests of the whole bodies that differed from the manifest's

        def download() -> None:
            try:
                self._download(entry, final, progress)
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
            fcntl.flock(lock, fcntl.LOCK_EX)  # another process downloading it: wait for its result
            if final.is_file() and final.stat().st_size == entry.get("bytes"):
                return False
            self.retry(f"{self.url}/{name}", download)
        return True

    def _download(self, entry: dict[str, Any], final: Path, progress: Optional[Callable[[int], None]]) -> None:
        tmp = final.with_name(f"{final.name}.part-{os.getpid()}-{secrets.token_hex(4)}")
        digest, size = new_hash(), 0

        def local(op: Callable[[], Any]) -> Any:  # this machine's side: its errors are not the network's
            try:
                return op()
            except OSError as exc:
                raise disk_error(exc, final, CACHE_FULL_ADVICE) from exc
        try:
            dst = local(lambda: open_new(tmp, cache_modes()[1]))
            try:
                for block in self._blocks(object_path(self.root, entry["path"]), int(entry["bytes"])):
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
                raise FormatError(f"{scrub(self.url)} changed while this job was reading it (its {MANIFEST_NAME} "
                                  "is not the one this job started with): refusing to mix two versions; restart "
                                  "the job to read the new one") from None
            if problem == "hash":  # a corrupted body: retried by the caller, never renamed
                raise _WrongBytes(digest.hexdigest())
            if problem is not None:  # a truncated body
                raise IOError(f"the downloaded bytes' {problem} differs from the manifest's (truncated or corrupted)")
            local(lambda: os.replace(tmp, final))
            with self._count:
                self.fetched["files"] += 1
                self.fetched["bytes"] += size
        finally:
            tmp.unlink(missing_ok=True)

    def _blocks(self, path: str, size: int) -> Iterator[bytes]:
        """The object's ``size`` bytes (the manifest's size) in ranged GETs: one for files up to ``_WHOLE``,
        else ``_BLOCK`` pieces. A ranged read is one request on every fsspec backend; a whole-object read or
        an ``open`` makes s3fs ask for the size first: a HEAD per shard, half the requests, and a large share of
        the server's CPU per byte (benchmarks/RESULTS.md)."""
        step = size if size <= _WHOLE else _BLOCK
        for start in range(0, size, step):
            end = min(size, start + step)
            block = self.fs.cat_file(path, start=start, end=end)
            yield block
            if len(block) > end - start:  # a server that ignores Range sent the whole object: the checks judge it
                return

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
            name = part.relative_to(self.dir).as_posix().rsplit(".part-", 1)[0]
            with lock_file(self._download_lock(name)) as lock:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # downloading now, in some process of this node
                part.unlink(missing_ok=True)


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
            for block in remote._blocks(path, size):
                h.update(block)
                if progress is not None:
                    progress(len(block))
            return None if h.hexdigest() == entry[HASH_NAME] else f"{HASH_NAME} mismatch (replaced or damaged)"
        try:
            problem = remote.retry(f"{remote.url}/{entry['path']}", digest)
        except FileNotFoundError:
            problem = "missing"
        return None if problem is None else f"{scrub(remote.url)}/{entry['path']}: {problem}"

    return [p for p in map_threads(check, remote.manifest["files"], remote.workers, "fastdata-verify-store")
            if p is not None]


class _WrongBytes(IOError):
    """A whole body whose sha256 differs from the manifest's (retried: a second time, the object itself)."""

    def __init__(self, digest: str) -> None:
        super().__init__(f"the downloaded bytes' {HASH_NAME} differs from the manifest's (corrupted)")
        self.digest = digest


def cache_modes() -> tuple[int, int]:
    """``(folder mode, file mode)`` of the node cache: private to this user (0700, 0600) unless
    ``$FASTDATA_CACHE_MODE=group``, a cache shared by the members of its folders' group (02770, 0660; the
    setgid bit gives new files the folder's group). Others never get to plant or read a cached file."""
    name = os.environ.get("FASTDATA_CACHE_MODE") or "private"
    if name not in CACHE_MODES:
        raise ConfigError(f"FASTDATA_CACHE_MODE must be one of {', '.join(CACHE_MODES)}, "
                          f"got FASTDATA_CACHE_MODE={name!r}")
    return CACHE_MODES[name]


def cache_folder(path: Path) -> Path:
    """``path`` made (with any missing parent) with the cache's folder mode (`cache_modes`), or an
    existing one checked: this user's is given that mode; another user's is refused unless the cache is
    shared with a group this user is in (its files could have been planted there)."""
    mode, missing, folder = cache_modes()[0], [], path
    while not os.path.lexists(folder):
        missing.append(folder)
        folder = folder.parent
    for folder in reversed(missing):
        try:
            os.mkdir(folder, mode)
        except FileExistsError:
            continue
        except OSError as exc:
            raise disk_error(exc, folder, CACHE_FULL_ADVICE) from exc
        os.chmod(folder, mode)  # (mkdir's mode passes through the umask)
    info = os.lstat(path)
    mine = info.st_uid == os.geteuid()
    shared = mode & 0o070 and info.st_gid in {os.getegid(), *os.getgroups()} and not info.st_mode & 0o002
    if not stat.S_ISDIR(info.st_mode) or not (mine or shared):
        raise OutputError(f"{path} is in the way of the node cache: it is not a folder of this user"
                          + (" or of a group it shares" if mode & 0o070 else "") + "; remove it, or set cache_dir "
                          "/ $FASTDATA_CACHE to a folder of your own (a cache shared on purpose: "
                          "$FASTDATA_CACHE_MODE=group)")
    if mine and stat.S_IMODE(info.st_mode) != mode:
        os.chmod(path, mode)  # (a folder made before modes were set, or under the other mode)
    return path


def lock_file(path: Path) -> Any:
    """A lock file of the cache opened for ``flock`` (created with the cache's file mode, never through a
    symbolic link)."""
    flags, mode = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, cache_modes()[1]
    try:
        try:
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, mode)
            os.fchmod(fd, mode)  # (the umask took bits from the group's)
        except FileExistsError:
            fd = os.open(path, flags)  # (made by another rank, perhaps another member of the group)
    except OSError as exc:
        raise disk_error(exc, path, CACHE_FULL_ADVICE) from exc
    return LockFile(fd)  # (its lock stays with this process: NOTE [locks across fork])


def list_cached(cache_dir: Optional[Union[str, Path]] = None) -> list[dict[str, Any]]:
    """Every remote dataset in the node cache: id, URL, bytes cached of bytes in all, files cached."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    out = []
    for d in sorted(p for p in root.glob("*") if (p / MANIFEST_NAME).is_file()):
        try:
            info = json.loads((d / SOURCE_NAME).read_text())
            files = json.loads((d / MANIFEST_NAME).read_text())["files"]
        except (OSError, ValueError, KeyError):
            info, files = {"url": "?"}, []
        sizes = [(d / f["path"]).stat().st_size if (d / f["path"]).is_file() else None for f in files]
        out.append({"id": d.name, "url": info.get("url", "?"), "path": str(d), "files": len(files),
                    "cached_files": sum(x is not None for x in sizes), "cached_bytes": sum(x or 0 for x in sizes),
                    "bytes": sum(int(f.get("bytes", 0)) for f in files)})
    return out


def remove_cached(ids: list[str], cache_dir: Optional[Union[str, Path]] = None) -> list[str]:
    """Delete the named datasets' cache folders (all when ``ids`` is empty); the ids removed. A job still
    reading one keeps its open files; run this between jobs."""
    import shutil

    removed = []
    for info in list_cached(cache_dir):
        if not ids or info["id"] in ids:
            shutil.rmtree(info["path"], ignore_errors=True)
            removed.append(info["id"])
    return removed


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
