"""Object storage reached through fsspec (``s3://``, ``gs://``, ``az://``, ``https://``, ``file://``): which paths
are URLs, a filesystem for one (the extra to install named when its package is missing), an object's path
inside a dataset's prefix, and the one retry budget every call to the store goes through.

NOTE [retry budget]: every call to the store (the manifest at opening, each download or prefetch, each
object ``verify`` hashes, each upload of ``push``) is retried by one `Retry` per dataset over one
budget, ``retry_seconds`` (default 120):
1. A failed try waits a random time between 0 and 0.2 s x 2^(tries - 1), at most 10 s (exponential back-off with
   full jitter: many ranks coming back after an outage do not knock together), then tries again.
2. The budget runs from the earlier of this call's first failure and the dataset's first failure since its
   last success (never from a call's first try: a 10-minute download cut once at its end has the whole
   budget), so a read that waited for a failed prefetch's download lock gets no budget of its own: an
   outage is given up on once, ``retry_seconds`` after it began (plus one try), not once per shard; and one
   object that keeps failing beside reads that succeed is given up on ``retry_seconds`` after its first failure.
3. The last try is made at the deadline: an outage shorter than the budget is survived.
4. After it, one FormatError names the (scrubbed) URL, the tries and seconds, the last error and what to
   do. Nothing partial has a final name, so a rerun resumes from the files cached.
5. The client's own retry loops would multiply the wait (s3fs tries 5 times, botocore 5 times each): an
   ``s3://`` client tries once per call; the timeouts of one try stay s3fs's (connect 5 s, read 15 s).
   A read timeout restarts at each byte, so a link that trickles (a byte every few seconds) never hits it: a
   ranged read of a download has a deadline of its own, `read_range`'s (max(60 s, its bytes at 64 KiB/s)),
   and one past it is a failed try.
6. Not retried: an answer that trying again does not change (no such object, access denied, the same
   wrong bytes twice, a full cache disk, a request the client refuses to send: an invalid bucket name).
"""
from __future__ import annotations

import os
import posixpath
import random
import re
import threading
import time
import urllib.parse
import uuid
from pathlib import Path
from typing import Any, Callable, Optional, Union

from .._io import copy_file_atomic, scrub, write_bytes_atomic
from ..errors import ConfigError, FastdataError, FormatError, MissingDependencyError, OutputError, require

REMOTE_EXTRA = "pip install 'fastdata[remote]'"
_PROTOCOL_PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs",
                      "abfss": "adlfs", "http": "aiohttp", "https": "aiohttp"}
RETRY_SECONDS = 120.0  # the outage a read rides out by default: throttling, a failover, a DNS blip
RERUN_ADVICE = "a rerun resumes from what is cached"  # what a spent budget's message ends with, by default
_FIRST_WAIT, _LONGEST_WAIT = 0.2, 10.0  # seconds: the bound of the first wait, doubled per try up to this
# A ranged read's deadline (`read_range`): 64 KiB/s is below any working link even with the 8 downloads of a
# node cache sharing it (4 Mbit/s in all), so only a stalled or trickling one misses it: 128 s for a piece of
# 8 MB, 17 min for a whole file of 64 MB; 60 s at least (a small file, a slow first byte).
_SHORTEST_TRY, _SLOWEST_RATE = 60.0, 64 << 10


def is_url(path: Union[str, Path]) -> bool:
    """True for ``protocol://...`` (``file://`` included); plain paths are read in place, as before."""
    return isinstance(path, str) and re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", path) is not None


def output_location(out: Union[str, Path]) -> Union[str, Path]:
    """Where a run writes: a URL as given, a path as a Path; a ``file://`` URL as the local folder it names,
    so that it gets a folder's journal, locks and never-through-a-link writes, not a store's."""
    if not is_url(out):
        return Path(out)
    parsed = urllib.parse.urlparse(str(out))
    if parsed.scheme.lower() == "file" and parsed.netloc in ("", "localhost"):
        return Path(urllib.parse.unquote(parsed.path))
    return out


_BUCKETS = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl")  # object stores: the netloc is a bucket


def filesystem(url: str, storage_options: Optional[dict[str, Any]] = None) -> tuple[Any, str]:
    """``(fsspec filesystem, path inside it)`` for ``url``; names the extra to install when it is missing.
    Credentials and endpoints come from the usual places (AWS_* variables such as ``AWS_ENDPOINT_URL``,
    profiles, ...) or ``storage_options``. An ``s3://`` client tries each request once (s3fs's and botocore's
    own retry loops off, unless ``storage_options`` sets them): `Retry` is the one budget
    (NOTE [retry budget])."""
    protocol = url.split("://", 1)[0].lower()
    if protocol in _BUCKETS and re.match(r"[^/@]*:[^@]*@", url.split("://", 1)[-1]):  # (key:secret@bucket)
        raise ConfigError(f"{scrub(url)}: {protocol}:// does not read credentials from the URL (its bucket would be "
                          "'key:secret', and the secret would reach the store's error messages): give them as "
                          "the usual variables (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY...), a profile or "
                          "storage_options")
    try:
        import fsspec
    except ImportError as exc:
        raise MissingDependencyError(f"{scrub(url)} is a URL: reading it needs fsspec ({REMOTE_EXTRA})") from exc
    options = dict(storage_options or {})
    if protocol in ("s3", "s3a"):
        # botocore's own retry loop off (a dict of our own each time: botocore adds to it)
        options["config_kwargs"] = {"retries": {"total_max_attempts": 1}, **options.get("config_kwargs", {})}
    if protocol in ("file", "local"):  # folders made as objects are put in them, as a store's prefixes are
        options.setdefault("auto_mkdir", True)
    try:
        fs, path = fsspec.core.url_to_fs(url, **options)
    except ImportError as exc:
        package = _PROTOCOL_PACKAGES.get(protocol, f"the fsspec backend for {protocol}://")
        raise MissingDependencyError(f"{scrub(url)}: {protocol}:// needs {package} ({REMOTE_EXTRA})") from exc
    except ValueError as exc:  # an unknown protocol (from None: a chained cause is printed unscrubbed)
        raise ConfigError(f"{scrub(url)}: {scrub(str(exc))}") from None
    if protocol in ("s3", "s3a"):  # (an instance of its own: fsspec caches one per set of options, and these
        fs.retries = 1             # options are ours)
    return fs, path


def read_range(fs: Any, path: str, start: int, end: int) -> bytes:
    """``fs.cat_file(path, start, end)``, given up on (a TimeoutError: `Retry` tries again) when its bytes have
    not all come after max(60 s, its bytes at 64 KiB/s): a trickling link resets a read timeout at each byte,
    so a read would hang far past the retry budget (NOTE [retry budget] 5). On the async clients (s3fs, gcsfs,
    adlfs, http) the request is cancelled; a local or memory store never stalls."""
    if not getattr(fs, "async_impl", False) or not hasattr(fs, "_cat_file"):
        return fs.cat_file(path, start=start, end=end)
    import asyncio

    from fsspec.asyn import sync

    seconds = max(_SHORTEST_TRY, (end - start) / _SLOWEST_RATE)
    try:
        return sync(fs.loop, asyncio.wait_for, fs._cat_file(path, start=start, end=end), seconds)
    except asyncio.TimeoutError:
        raise TimeoutError(f"{end - start} bytes not all in after {seconds:.0f} s (a stalled or trickling "
                           "connection)") from None


def range_refused(exc: BaseException) -> bool:
    """Whether a failed ranged read may be the store refusing a range past the object's end (HTTP 416: S3's
    InvalidRange, which s3fs raises as an OSError of EINVAL; aiohttp's and gcsfs's errors carry the status): the
    object is shorter than its manifest says, a change no retry mends (`RemoteDataset` then looks at its size
    once). A wrong guess costs one HEAD."""
    for e in (exc, exc.__cause__):
        if e is None:
            continue
        if 416 in (getattr(e, "status", None), getattr(e, "code", None)):
            return True
        response = getattr(e, "response", None)  # (botocore's ClientError, s3fs's cause)
        if isinstance(response, dict) and (response.get("Error", {}).get("Code") == "InvalidRange" or
                                           response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 416):
            return True
    text = str(exc).lower()
    return "range" in text and ("satisf" in text or "invalid" in text)


def object_version(info: dict[str, Any]) -> str:
    """What changes when an object does, from an fsspec ``info``/``ls`` entry: its ETag (S3, GCS, Azure),
    else its modification time; "" when the store says neither."""
    return str(info.get("ETag") or info.get("etag") or info.get("LastModified") or info.get("mtime") or "")


# a component "", "." or ".." of any name, or "\\", "://" or a NUL anywhere, in names joined by newlines (a newline
# inside a name only adds matches, each then checked by object_path)
_SUSPECT = re.compile(r"(?:\A|[\n/])\.{0,2}(?:\Z|[\n/])|\\|://|\x00")


def check_object_names(names: list[Any]) -> None:
    """`object_path`'s refusal for every name of a manifest at once (a pass of one regex over them joined,
    not a call a name: 10^6 shards); raises for the first bad name in their order."""
    if all(type(n) is str for n in names):
        joined = "\n".join(names)
        if _SUSPECT.search(joined) is None:
            return
    for name in names:
        object_path("", name)


def object_path(root: str, name: str) -> str:
    """``root/name`` for a name from a manifest, refused unless it stays inside the dataset's prefix."""
    if (not isinstance(name, str) or not name or name.startswith(("/", "\\")) or "://" in name or "\\" in name
            or "\0" in name or any(part in ("", ".", "..") for part in name.split("/"))):
        raise FormatError(f"the manifest names {name!r}, which is not a plain relative path inside the dataset: "
                          "refusing to read outside its prefix; the manifest is damaged or was not written by "
                          "fastdata: push the dataset again (`fastdata push`)")
    return posixpath.join(root.rstrip("/"), name)


class Retry:
    """Calls to the store retried over one budget of ``seconds`` (see NOTE [retry budget]); one per dataset
    (or push), shared by its threads.

    Args:
        seconds: How long the store may fail before a read gives up: the time since this call's first failure,
            or since the dataset's reads began failing, whichever is earlier. 0 tries once.
        advice: What the message of a spent budget ends with: what a rerun does.
    """

    def __init__(self, seconds: float = RETRY_SECONDS, advice: str = RERUN_ADVICE) -> None:
        require(isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and 0 <= seconds < float("inf"),
                "retry_seconds", seconds, "a number of seconds >= 0")
        self.seconds = float(seconds)
        self.advice = advice
        self.failing_since: Optional[float] = None  # monotonic time of the first failure since the last success

    def __call__(self, what: str, fn: Callable[[], Any], doing: str = "read",
                 stop: Optional[threading.Event] = None) -> Any:
        """``fn()``, tried until it succeeds or the budget is spent; then one FormatError naming ``what``.
        ``stop`` set (its reader was closed): no try more, and a wait between tries ends at once (a
        ConfigError), so a close during an outage does not wait out the budget."""
        start, tries, failed = time.monotonic(), 0, None
        while True:
            if stop is not None and stop.is_set():
                raise stopped(what, doing)
            tries += 1
            try:
                result = fn()
            except (FileNotFoundError, MissingDependencyError, FastdataError):
                raise  # (OutputError: this machine's disk, e.g. a full cache, which trying again does not mend)
            except PermissionError as exc:  # denied is an answer, not an outage
                raise FormatError(f"cannot {doing} {scrub(what)}: access denied ({_said(exc)}): check the "
                                  "credentials (AWS_* variables, profile or storage_options)") from None
            except Exception as exc:  # noqa: BLE001 - network stacks raise anything: retried, then reported
                if type(exc).__name__ == "ParamValidationError":  # (botocore's: never sent, so never mended)
                    raise FormatError(f"cannot {doing} {scrub(what)}: the request is invalid ({_said(exc)}): "
                                      "check the URL") from None
                now = time.monotonic()
                since = self.failing_since = self.failing_since or now  # (a local: another thread may reset it)
                failed = failed or now  # (rule 2: a long try that failed once at its end has the whole budget)
                deadline = min(failed, since) + self.seconds
                if now >= deadline:
                    raise FormatError(
                        f"cannot {doing} {scrub(what)} after {tries} tr{'y' if tries == 1 else 'ies'} over "
                        f"{now - start:.1f} s (retry_seconds={self.seconds:g}), the last: {_said(exc)}; check that "
                        "the store is up and reachable, or raise retry_seconds (`--retry-seconds`) to ride out a "
                        f"longer outage{'; ' + self.advice if self.advice else ''}") from None
                bound = min(_LONGEST_WAIT, _FIRST_WAIT * 2 ** min(tries - 1, 30))
                pause = min(random.uniform(0, bound), deadline - now)  # full jitter, the last try at the deadline
                if stop is None:
                    time.sleep(pause)
                else:
                    stop.wait(pause)
                continue
            self.failing_since = None
            return result


def stopped(what: str, doing: str = "read") -> ConfigError:
    """The error of a call to the store given up on because its reader was closed (`Retry`'s ``stop``)."""
    return ConfigError(f"cannot {doing} {scrub(what)}: its reader was closed meanwhile; open the dataset again to "
                       "read it")


class StoreFolder:
    """A prefix at a URL that fastdata writes (a preprocess run's OUT, a run's checkpoints): each call retried
    over one budget (NOTE [retry budget]), a spent budget or a missing bucket one OutputError naming the
    scrubbed URL. Picklable: the client is made anew in each process (a fork, a Ray task).

    Args:
        url: The prefix, an fsspec URL.
        retry_seconds: How long the store may fail before a call gives up.
        advice: What a spent budget's message ends with (`Retry`'s ``advice``).
    """

    def __init__(self, url: str, retry_seconds: float = RETRY_SECONDS,
                 advice: str = RERUN_ADVICE) -> None:
        if re.search(r"[*?\[\]]", url.split("://", 1)[-1]):  # fsspec would expand them in copies and deletes
            raise ConfigError(f"{scrub(url)}: '*', '?', '[' and ']' are patterns to fsspec, which would copy or "
                              "delete other objects than these: choose a prefix without them")
        self.url = url.rstrip("/")
        self.retry_seconds = retry_seconds
        self.advice = advice
        self._fs: Optional[tuple[int, Any, str, Retry]] = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fs": None}

    def _client(self) -> tuple[Any, str, Retry]:
        if self._fs is None or self._fs[0] != os.getpid():  # a fork or another process: a client of its own
            fs, root = filesystem(self.url)
            self._fs = (os.getpid(), fs, root, Retry(self.retry_seconds, self.advice))
        return self._fs[1], self._fs[2], self._fs[3]

    def _key(self, name: str) -> str:
        return object_path(self._client()[1], name)

    def _call(self, name: str, fn: Any, doing: str) -> Any:
        try:
            return self._client()[2](f"{self.url}/{name}", fn, doing)
        except FormatError as exc:  # the budget is spent, or access was denied: the output's problem
            raise OutputError(str(exc)) from None
        except FileNotFoundError as exc:  # s3fs: no such bucket
            raise no_bucket(f"{doing} {scrub(self.url)}/{name}", exc) from None

    def check_writable(self, folder: str = "") -> None:
        """Put and delete a probe object (in ``folder``), so a store that refuses writes is named before any
        work."""
        fs, _, _ = self._client()
        name = f"{folder + '/' if folder else ''}.fastdata-probe-{uuid.uuid4().hex}"
        self._call(name, lambda: fs.pipe_file(self._key(name), b""), "write")
        self._call(name, lambda: fs.rm_file(self._key(name)), "write")

    def listing(self) -> dict[str, int]:
        """Every object under the prefix (``name -> size``), in one listing, never an answer cached by the
        client (another process may have written since)."""
        fs, root, _ = self._client()

        def find() -> dict[str, Any]:
            fs.invalidate_cache(root)
            try:
                return fs.find(root, detail=True)
            except FileNotFoundError:
                return {}
        found = self._call("", find, "list")
        prefix = root.rstrip("/") + "/"
        return {k[len(prefix):]: int(v.get("size") or 0) for k, v in found.items() if k.startswith(prefix)}

    def size(self, name: str) -> Optional[int]:
        """An object's size; None when it does not exist (asked of the store, not of the client's cache)."""
        fs, _, _ = self._client()

        def info() -> Optional[int]:
            try:
                return stored_size(fs, self._key(name))
            except FileNotFoundError:
                return None
        return self._call(name, info, "read")

    def put(self, local: Path, name: str) -> None:
        fs, _, _ = self._client()
        self._call(name, lambda: put_file(fs, local, self._key(name)), "upload")

    def get(self, name: str, local: Path) -> None:
        fs, _, _ = self._client()
        self._call(name, lambda: fs.get_file(self._key(name), str(local)), "download")

    def copy(self, name: str, to: str) -> None:
        """Copy an object within the store (no bytes through this machine), replacing ``to`` whole."""
        fs, _, _ = self._client()
        if _local(fs):  # (as `put_file`: never through a link at ``to``)
            self._call(to, lambda: put_file(fs, Path(self._key(name)), self._key(to)), "copy to")
            return
        self._call(to, lambda: fs.cp_file(self._key(name), self._key(to)), "copy to")

    def put_bytes(self, name: str, data: bytes) -> None:
        fs, _, _ = self._client()
        self._call(name, lambda: pipe_file(fs, self._key(name), data), "upload")

    def read_bytes(self, name: str) -> Optional[bytes]:
        """An object's bytes; None when it does not exist."""
        fs, _, _ = self._client()

        def get() -> Optional[bytes]:
            try:
                return fs.cat_file(self._key(name))
            except FileNotFoundError:
                return None
        return self._call(name, get, "read")

    def delete(self, names: list[str]) -> None:
        """Delete objects, 1,000 a request where the store deletes in bulk (S3): a run of 10^6 shards leaves
        as many journal objects."""
        fs, _, _ = self._client()
        for i in range(0, len(names), 1000):
            batch = [self._key(n) for n in names[i:i + 1000]]
            self._call(names[i], lambda batch=batch: fs.rm(batch), "delete")


def put_file(fs: Any, local: Path, key: str) -> None:
    """``fs.put_file``, then the size the store holds checked (an OSError when it is not the file's: called
    under a `Retry`, the upload is tried again); into a local folder (``file://``) a new file renamed over the
    name, as fastdata writes its own files: fsspec's copy writes through a link planted at the name (into the
    file it points to)."""
    if not _local(fs):
        size = Path(local).stat().st_size
        fs.put_file(str(local), key)
        held = stored_size(fs, key)
        if held != size:  # a store or a gateway that kept part of the body and answered 200
            raise OSError(f"the store holds {held} bytes of {size} after the upload (a proxy that loses bytes?)")
        return
    Path(key).parent.mkdir(parents=True, exist_ok=True)
    copy_file_atomic(Path(local), Path(key))


def stored_size(fs: Any, key: str) -> Optional[int]:
    """The size object ``key`` has in the store now, asked afresh (not from the client's cached listings: a
    HEAD on s3); None for a folder, or where the store gives no size.

    Raises:
        FileNotFoundError: There is no such object.
    """
    fs.invalidate_cache(key)
    found = fs.info(key)
    size = found.get("size")
    return None if size is None or found.get("type", "file") != "file" else int(size)


def no_bucket(doing: str, exc: FileNotFoundError) -> OutputError:
    """The error of a FileNotFoundError from a write or a listing at a URL (s3fs: no such bucket): ``cannot
    DOING: ...`` (``doing`` names the scrubbed URL) and what to check."""
    return OutputError(f"cannot {doing}: {scrub(str(exc)) or 'not found'}; check that the bucket exists and the URL "
                       "is right")


def pipe_file(fs: Any, key: str, data: bytes) -> None:
    """``fs.pipe_file``; into a local folder, as `put_file`."""
    if not _local(fs):
        fs.pipe_file(key, data)
        return
    Path(key).parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(Path(key), data)


def _local(fs: Any) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return bool({"file", "local"} & set(protocol))


def _said(exc: BaseException) -> str:
    """``Type: text`` of an exception on one line, at most 300 characters, scrubbed."""
    return scrub(f"{type(exc).__name__}: {' '.join(str(exc).split())}")[:300]
