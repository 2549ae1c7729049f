"""Datasets at an fsspec URL (``s3://``, ``gs://``, ``az://``, ``https://``, ``file://``): a node-local cache of
verified files, and ``push`` to upload a finished dataset.

NOTE [remote cache]: ``cache_dir/<id>/`` mirrors one remote dataset, ``id`` naming the URL and the sha256
of its manifest, so a manifest changed under a running job gives another folder and is never mixed with
the old files. A file is downloaded under ``<name>.part-<pid>-<random>``, hashed while it streams, compared
with the manifest's size and sha256, then renamed: nothing partial or corrupt ever has a final name. A
per-file lock (``flock`` under ``.locks/``) makes every rank and worker on a node wait for one download
instead of starting their own; leftovers of a killed downloader (``.part-*`` of a dead pid) are removed.
The folder holds the manifest from the start (its id is that manifest's hash) and the files as they
arrive: FastDataset streams image shards into it as batches need them (storage/cache.py), any other
reader waits for every file, and then it is an ordinary dataset folder. The next job on the same data
reuses it; ``fastdata cache list|remove`` manage the folders. A download whose bytes do not match while
the remote manifest changed is refused: a job never mixes two versions of a dataset. A network fault is
retried; a full cache disk is not (trying again does not free space): the partial file is removed and
one line says what to do (DiskFullError; a rerun keeps what is cached).

NOTE [push]: data files go up first, each followed by a small marker ``.fastdata-push/<name>.sha256``
(object stores write whole objects: a marker exists only after its object is complete); the manifest goes
last, so a reader never sees a half-uploaded dataset. A rerun skips objects whose size and marker match.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import posixpath
import re
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

from .._io import HASH_NAME, disk_error, fsync_dir, new_hash, write_bytes_atomic
from ..errors import ChecksumError, ConfigError, FormatError, MissingDependencyError, OutputError
from ..formats.manifest import MANIFEST_NAME, file_problem

REMOTE_EXTRA = "pip install 'fastdata[remote]'"
_PROTOCOL_PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs",
                      "abfss": "adlfs", "http": "aiohttp", "https": "aiohttp"}
PUSH_MARKERS = ".fastdata-push"
SOURCE_NAME = ".source.json"
_BLOCK = 8 << 20
_WHOLE = 64 << 20
CACHE_FULL_ADVICE = ("give the dataset a cache_limit below the free space (`--cache-limit`: shards are then "
                     "streamed and evicted), remove other datasets' copies (`fastdata cache remove`), or point "
                     "cache_dir / $FASTDATA_CACHE at a larger disk; a rerun keeps the files already cached")
_SECRET = re.compile(r"((?:X-Amz-[A-Za-z-]+|Signature|sig|token|AWSAccessKeyId|key|secret)=)[^&\s'\"]+", re.I)


def is_url(path: Union[str, Path]) -> bool:
    """True for ``protocol://...`` (``file://`` included); plain paths are read in place, as before."""
    return isinstance(path, str) and re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", path) is not None


def scrub(text: str) -> str:
    """``text`` without signed-URL query values or credentials (safe for errors and logs)."""
    return _SECRET.sub(r"\1***", text)


def filesystem(url: str, storage_options: Optional[dict[str, Any]] = None) -> tuple[Any, str]:
    """``(fsspec filesystem, path inside it)`` for ``url``; names the extra to install when it is missing.
    Credentials and endpoints come from the usual places (AWS_* variables such as ``AWS_ENDPOINT_URL``,
    profiles, ...) or ``storage_options``."""
    protocol = url.split("://", 1)[0].lower()
    try:
        import fsspec
    except ImportError as exc:
        raise MissingDependencyError(f"{scrub(url)} is a URL: reading it needs fsspec ({REMOTE_EXTRA})") from exc
    try:
        return fsspec.core.url_to_fs(url, **(storage_options or {}))
    except ImportError as exc:
        package = _PROTOCOL_PACKAGES.get(protocol, f"the fsspec backend for {protocol}://")
        raise MissingDependencyError(f"{scrub(url)}: {protocol}:// needs {package} ({REMOTE_EXTRA})") from exc
    except ValueError as exc:  # an unknown protocol
        raise ConfigError(f"{scrub(url)}: {exc}") from exc


def object_path(root: str, name: str) -> str:
    """``root/name`` for a name from a manifest, refused unless it stays inside the dataset's prefix."""
    if (not isinstance(name, str) or not name or name.startswith(("/", "\\")) or "://" in name or "\\" in name
            or any(part in ("", ".", "..") for part in name.split("/"))):
        raise FormatError(f"the manifest names {name!r}, which is not a plain relative path inside the dataset: "
                          "refusing to read outside its prefix")
    return posixpath.join(root.rstrip("/"), name)


def _retry(what: str, fn: Callable[[], Any], tries: int, backoff: float) -> Any:
    """``fn()`` with up to ``tries`` attempts and exponential back-off; then one line naming ``what``."""
    for attempt in range(tries):
        try:
            return fn()
        except (FileNotFoundError, ChecksumError, MissingDependencyError, ConfigError, FormatError, OutputError):
            raise  # (OutputError: this machine's disk, e.g. a full cache, which trying again does not mend)
        except Exception as exc:  # noqa: BLE001 - network stacks raise anything: retried, then reported
            if attempt + 1 == tries:
                raise FormatError(f"cannot read {scrub(what)} after {tries} tries: {type(exc).__name__}: "
                                  f"{scrub(str(exc))[:300]}") from None
            time.sleep(backoff * 2 ** attempt)
    raise AssertionError("unreachable")


def default_cache_dir() -> Path:
    """``$FASTDATA_CACHE``, else ``$XDG_CACHE_HOME/fastdata``, else ``~/.cache/fastdata``."""
    if os.environ.get("FASTDATA_CACHE"):
        return Path(os.environ["FASTDATA_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fastdata"


class RemoteDataset:
    """One remote dataset and its node-local copy (see NOTE [remote cache]); :meth:`local` gives a folder
    any fastdata reader opens."""

    def __init__(self, url: str, *, storage_options: Optional[dict[str, Any]] = None,
                 cache_dir: Optional[Union[str, Path]] = None, tries: int = 5, backoff: float = 0.2,
                 workers: int = 8) -> None:
        self.url = url.rstrip("/")
        self.fs, self.root = filesystem(self.url, storage_options)
        self.tries, self.backoff, self.workers = tries, backoff, workers
        try:
            raw = _retry(f"{self.url}/{MANIFEST_NAME}",
                         lambda: self.fs.cat_file(object_path(self.root, MANIFEST_NAME)), tries, backoff)
        except FileNotFoundError:
            raise FormatError(f"{scrub(self.url)} has no {MANIFEST_NAME}: not a fastdata dataset, or its `fastdata "
                              "push` has not finished (the manifest is uploaded last)") from None
        try:
            self.manifest = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise FormatError(f"{scrub(self.url)}/{MANIFEST_NAME} is not valid JSON ({exc})") from exc
        if not isinstance(self.manifest, dict) or not isinstance(self.manifest.get("files"), list):
            raise FormatError(f"{scrub(self.url)}/{MANIFEST_NAME} is not a fastdata manifest")
        for entry in self.manifest["files"]:
            object_path(self.root, entry.get("path", ""))  # refuse escaping names before anything is fetched
        self._manifest_bytes = raw
        digest = new_hash()
        digest.update(scrub(self.url).encode() + b"\0" + raw)
        self.id = digest.hexdigest()[:20]
        self.dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.dir = self.dir / self.id
        self.fetched = {"files": 0, "bytes": 0}  # downloads made by this process (benchmarks, tests)
        self._count = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:  # DataLoader workers under spawn
        return {k: v for k, v in self.__dict__.items() if k != "_count"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._count = threading.Lock()

    def prepare(self, skip: frozenset[str] = frozenset(),
                progress: Optional[Callable[[int], None]] = None) -> Path:
        """The cache folder with the manifest and every file but ``skip`` (those are fetched on demand, see
        :class:`fastdata.storage.cache.ShardCache`), each downloaded once per node and verified."""
        (self.dir / ".locks").mkdir(parents=True, exist_ok=True)
        self._clean_leftovers()
        if not (self.dir / MANIFEST_NAME).is_file():  # the folder's id is this manifest's hash: always the same
            with open(self.dir / ".locks" / "manifest.lock", "a+b") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # every rank may get here: one writes (fixed temporary names)
                if not (self.dir / MANIFEST_NAME).is_file():
                    write_bytes_atomic(self.dir / SOURCE_NAME, json.dumps(  # for `fastdata cache list`
                        {"url": scrub(self.url), "id": self.id, "created": time.time()}).encode(), CACHE_FULL_ADVICE)
                    write_bytes_atomic(self.dir / MANIFEST_NAME, self._manifest_bytes, CACHE_FULL_ADVICE)
                    fsync_dir(self.dir)
        entries = [e for e in self.manifest["files"] if e["path"] not in skip]
        if entries:
            with ThreadPoolExecutor(max(1, min(self.workers, len(entries)))) as pool:
                list(pool.map(lambda e: self.fetch(e, progress), entries))
        return self.dir

    def local(self, progress: Optional[Callable[[int], None]] = None) -> Path:
        """Download (once per node) and verify every file; the local folder, an ordinary dataset folder."""
        return self.prepare(frozenset(), progress)

    def entry(self, name: str) -> dict[str, Any]:
        """The manifest's entry for file ``name``."""
        if not hasattr(self, "_entries"):
            self._entries = {e["path"]: e for e in self.manifest["files"]}
        return self._entries[name]

    def fetch(self, entry: dict[str, Any], progress: Optional[Callable[[int], None]] = None) -> Path:
        """One manifest entry as a verified local file (downloaded at most once per node)."""
        self.get(entry, progress)
        return self.dir / entry["path"]

    def get(self, entry: dict[str, Any], progress: Optional[Callable[[int], None]] = None) -> bool:
        """:meth:`fetch`, saying whether this call downloaded the file (False: it was cached already, or
        another thread or process on the node fetched it meanwhile)."""
        name = entry["path"]
        final = self.dir / name
        if final.is_file() and final.stat().st_size == entry.get("bytes"):
            return False  # only verified bytes ever get a final name
        final.parent.mkdir(parents=True, exist_ok=True)
        lock_path = self.dir / ".locks" / (name.replace("/", "%") + ".lock")
        with open(lock_path, "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another process downloading it: wait for its result
            if final.is_file() and final.stat().st_size == entry.get("bytes"):
                return False
            _retry(f"{self.url}/{name}", lambda: self._download(entry, final, progress), self.tries, self.backoff)
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
            dst = local(lambda: open(tmp, "wb"))
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
            if problem is not None:  # a truncated or corrupted body: retried by the caller, never renamed
                what = HASH_NAME if problem == "hash" else problem
                raise IOError(f"the downloaded bytes' {what} differs from the manifest's (truncated or corrupted)")
            local(lambda: os.replace(tmp, final))
            with self._count:
                self.fetched["files"] += 1
                self.fetched["bytes"] += size
        finally:
            tmp.unlink(missing_ok=True)

    def _blocks(self, path: str, size: int) -> Iterator[bytes]:
        """The object's ``size`` bytes (the manifest's size) in ranged GETs: one for files up to ``_WHOLE``,
        else ``_BLOCK`` pieces. A ranged read is one request on every fsspec backend; a whole-object read or
        an ``open`` makes s3fs ask for the size first (a HEAD per shard, half the requests and about 40 %
        of a loopback server's CPU per byte, measured)."""
        step = size if size <= _WHOLE else _BLOCK
        for start in range(0, size, step):
            end = min(size, start + step)
            block = self.fs.cat_file(path, start=start, end=end)
            yield block
            if len(block) > end - start:  # a server that ignores Range sent the whole object: the checks judge it
                return

    def _manifest_changed(self) -> bool:
        try:
            return self.fs.cat_file(object_path(self.root, MANIFEST_NAME)) != self._manifest_bytes
        except Exception:  # noqa: BLE001 - unreachable now: not known to have changed; the caller retries
            return False

    def _clean_leftovers(self) -> None:
        """Remove ``.part-<pid>-*`` files whose downloader process is gone (killed mid-download)."""
        for part in self.dir.rglob("*.part-*"):
            pid = part.name.rsplit(".part-", 1)[1].split("-", 1)[0]
            if pid.isdigit() and not _alive(int(pid)):
                part.unlink(missing_ok=True)


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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError as exc:
        return exc.errno == errno.EPERM
    return True


def push(local: Union[str, Path], url: str, *, workers: int = 8, storage_options: Optional[dict[str, Any]] = None,
         tries: int = 5, backoff: float = 0.2, progress: Optional[Callable[[int], None]] = None) -> dict[str, int]:
    """Upload the finished dataset ``local`` to ``url`` (see NOTE [push]); returns counts of objects
    ``uploaded`` and ``skipped`` (already there with the same size and checksum)."""
    from ..formats.manifest import load_manifest, require_intact

    local = Path(local)
    manifest = load_manifest(local)
    fs, root = filesystem(url.rstrip("/"), storage_options)
    counts = {"uploaded": 0, "skipped": 0}
    folders = _folders(fs)

    def one(entry: dict[str, Any]) -> None:
        name = entry["path"]
        target, marker = object_path(root, name), object_path(root, f"{PUSH_MARKERS}/{name}.{HASH_NAME}")
        folders(target, marker)
        if _retry(f"{url}/{name}", lambda: _already_there(fs, target, marker, entry), tries, backoff):
            counts["skipped"] += 1
            if progress is not None:
                progress(int(entry["bytes"]))
            return
        require_intact(local, entry)  # never upload a file that differs from its own manifest
        _retry(f"{url}/{name}", lambda: fs.put_file(str(local / name), target), tries, backoff)
        _retry(f"{url}/{name}", lambda: fs.pipe_file(marker, entry[HASH_NAME].encode()), tries, backoff)
        counts["uploaded"] += 1
        if progress is not None:
            progress(int(entry["bytes"]))

    with ThreadPoolExecutor(max(1, workers)) as pool:
        list(pool.map(one, manifest["files"]))
    data = (local / MANIFEST_NAME).read_bytes()
    _retry(f"{url}/{MANIFEST_NAME}", lambda: fs.pipe_file(object_path(root, MANIFEST_NAME), data), tries, backoff)
    return counts


def _folders(fs: Any) -> Callable[..., None]:
    """``make(*paths)``: each path's parent folder made, where the target is a file system with folders
    (``file://`` or a plain path, e.g. a shared mount); object stores have none to make."""
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    if not {"file", "local"} & set(protocols):
        return lambda *paths: None

    def make(*paths: str) -> None:
        for path in paths:
            try:
                fs.makedirs(posixpath.dirname(path), exist_ok=True)
            except OSError as exc:
                raise disk_error(exc, Path(path)) from exc
    return make


def _already_there(fs: Any, target: str, marker: str, entry: dict[str, Any]) -> bool:
    try:
        if int(fs.info(target).get("size", -1)) != int(entry["bytes"]):
            return False
        return fs.cat_file(marker).decode(errors="replace") == entry[HASH_NAME]
    except FileNotFoundError:
        return False


def download_bar(remote: RemoteDataset, left: int) -> Optional[Callable[[int], None]]:
    """A progress callback showing the first download of ``left`` bytes of ``remote`` (bytes, rate) on rank 0;
    it closes itself once they are all in; None when nothing is left."""
    from ..progress import progress_bar

    if left == 0:
        return None
    bar = progress_bar(total=left, desc=f"download {remote.url.rsplit('/', 1)[-1]}", unit="B", unit_scale=True)
    lock, done = threading.Lock(), [0]

    def update(n: int) -> None:
        with lock:
            if done[0] < left:
                done[0] += n
                bar.update(n)
                if done[0] >= left:
                    bar.close()
    return update
