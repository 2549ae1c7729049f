"""Small file-system helpers: atomic writes, hashing writers, safe paths, disk-full errors."""
from __future__ import annotations

import collections
import ctypes
import errno
import functools
import hashlib
import io
import json
import os
import re
import shutil
import stat
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np

from .errors import ConfigError, DiskFullError, FormatError, OutputError

HASH_NAME = "sha256"  # CPUs with SHA extensions hash it faster than blake2b (benchmarks/RESULTS.md)
_COPY_BLOCK = 16 << 20
_HASH_BLOCK = 4 << 20
_OVERLAP_BYTES = 1 << 20  # writes at least this big are hashed on a helper thread while they are written
_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


# NOTE [scrub]: every URL or exception text that reaches a message, a log, a cache's .source.json, `cache list`
# or `inspect` goes through scrub(), the one place that knows the forms a secret takes in them.
_SECRET_NAME = (r"(?:[A-Za-z0-9]+[_-])*(?:secret|password|passwd|secret[_-]access[_-]key|session[_-]token|"
                r"security[_-]token|access[_-]token|refresh[_-]token|sas[_-]token|account[_-]?key|api[_-]?key|"
                r"private[_-]key|client[_-]secret)|X-Amz-[A-Za-z-]+|X-Goog-[A-Za-z-]+|Signature|SharedAccessSignature|"
                r"AWSAccessKeyId|GoogleAccessId|Authorization")
_SECRETS = (  # (pattern, replacement), applied in order
    (re.compile(r"\b(Bearer|Basic)\s+[^\s'\",;&]+", re.I), r"\1 ***"),
    (re.compile(rf"(?<![A-Za-z0-9_-])((?:{_SECRET_NAME})[\"']?\s*[:=]\s*[\"']?)"  # name: value, name='value'
                r"(?!(?:Bearer|Basic)\s)[^&\s'\";]+", re.I), r"\1***"),
    (re.compile(r"(?<![A-Za-z0-9_-])((?:key|token|sig|pwd|credentials?)=)[^&\s'\";]+", re.I), r"\1***"),  # query forms
    # user:secret@host, the secret holding any '/' or '@' (an AWS secret key often has a '/'): up to the '@'
    # after which the host has none
    (re.compile(r"\b([a-zA-Z][a-zA-Z0-9+.-]*://[^/\s@:'\"]*):[^\s'\"]+?@(?=[^\s'\"@/]*(?:[/\s'\"]|$))"),
     r"\1:***@"),
    (re.compile(r"\b((?:https?|ftp|wss?)://)[^/\s@:'\"]+@"), r"\1***@"),  # a token as the user name
    # a URL's netloc a library echoes without its scheme (botocore: Invalid bucket name "key:secret@bucket"),
    # or as a path after a '/' (fsspec's memory store: FileNotFoundError: /user:secret@store/ds/x.npy)
    (re.compile(r"((?:^|[\s\"'(=/])[^/\s@:'\"()=]+):(?!\*\*\*@)[^/\s'\"@]+@(?=\w)"), r"\1:***@"),
)


def scrub(text: str) -> str:
    """``text`` without the secrets URLs and exception texts carry, safe for messages and logs: the password
    of ``user:secret@host`` (and an http user name, often a token), signed-URL and credential query values
    (``X-Amz-Signature=``, GCS's ``X-Goog-Signature=``, ``sig=``, ``token=``, ``password=``),
    ``Authorization``/``Bearer`` values, and ``aws_secret_access_key=``/``'secret': ...`` assignments; each
    value becomes ``***``."""
    for pattern, replacement in _SECRETS:
        text = pattern.sub(replacement, text)
    return text


# NOTE [locks across fork]: an ``flock`` (or an open-file-description byte-range lock: the node cache's pins)
# belongs to an open file, which a forked child (a DataLoader worker, a fork-started pool) shares with its
# parent, so the child would keep every lock the parent held at the fork until it exits: the parent could not
# evict a shard it no longer reads, and a download copied mid-flight would never let its waiters go. Every
# forked child points the descriptors in LOCKS_HELD at /dev/null: the locks stay with the process that took
# them, and the numbers stay valid, so whatever owns one closes it as usual (never another file that took
# its number). The files in FILES_HELD (a checkpoint's nameless spool while it uploads: train/checkpoint.py)
# are let go of the same way, every descriptor of them (the upload reads one through descriptors of its own):
# a child would keep their disk in use until it exits.
LOCKS_HELD: set[int] = set()
FILES_HELD: set[tuple[int, int]] = set()  # (st_dev, st_ino)


def _let_go_in_child() -> None:
    fds = set(LOCKS_HELD)
    if FILES_HELD:
        try:
            names = os.listdir("/proc/self/fd")
        except OSError:  # (no /proc: the files stay shared, the locks are let go of still)
            names = []
        for name in names:
            try:
                info = os.fstat(int(name))
            except OSError:  # (the listing's own descriptor, closed by now)
                continue
            if (info.st_dev, info.st_ino) in FILES_HELD:
                fds.add(int(name))
        FILES_HELD.clear()
    if not fds:
        return
    null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    for fd in fds:
        try:
            os.dup2(null, fd, inheritable=False)
        except OSError:  # closed meanwhile by a thread that did not survive the fork: nothing to let go
            pass
    os.close(null)
    LOCKS_HELD.clear()


os.register_at_fork(after_in_child=_let_go_in_child)


class LockFile(io.FileIO):
    """An open lock file for ``fcntl.flock`` whose lock no forked child keeps (NOTE [locks across fork]).

    Args:
        fd: A descriptor opened for reading and writing; the object owns it.
    """

    def __init__(self, fd: int) -> None:
        super().__init__(fd, "r+")
        LOCKS_HELD.add(fd)

    def close(self) -> None:
        if not self.closed:
            LOCKS_HELD.discard(self.fileno())
        super().close()


TRIM_FILES = 100_000  # a dataset opened with this many files gives its freed heap back (`trim_heap`)


def trim_heap(files: int) -> None:
    """After opening a dataset of ``files`` files (at least TRIM_FILES), hand the C heap's free pages back to
    the system: glibc keeps what the open's freed temporaries leave (~70 MB in every rank at a million shards,
    once a manifest parsed in pieces has raised its mmap threshold). Nothing where there is no malloc_trim."""
    trim = _malloc_trim() if files >= TRIM_FILES else None
    if trim is not None:
        trim(0)


@functools.lru_cache(maxsize=None)
def _malloc_trim() -> Optional[Callable[[int], int]]:
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # (not glibc)
        return None


def new_hash(data: bytes = b"") -> "hashlib._Hash":
    return hashlib.new(HASH_NAME, data)


def hash_file(path: Path, on_block: Optional[Callable[[int], None]] = None) -> str:
    """Hex digest of a file; ``on_block(n)`` is called per block read (progress bars).

    Two reused 4 MiB buffers: while a helper thread hashes one, the next block is read into the other
    (both release the GIL), so a file in the page cache hashes at close to sha256's own speed; a fresh
    ``read()`` per block (new memory to fault in, no overlap) is slower (bench_preprocess).
    """
    h = new_hash()
    with open(path, "rb", buffering=0) as f:
        if os.fstat(f.fileno()).st_size <= _HASH_BLOCK:  # one block: no thread to start
            data = f.read()
            h.update(data)
            if on_block is not None and data:
                on_block(len(data))
            return h.hexdigest()
        bufs, pending, k = (bytearray(_HASH_BLOCK), bytearray(_HASH_BLOCK)), None, 0
        with ThreadPoolExecutor(1, thread_name_prefix="fastdata-hash") as pool:
            while True:
                n = f.readinto(bufs[k])
                if pending is not None:
                    pending.result()  # the other buffer is free again
                if not n:
                    break
                pending = pool.submit(h.update, memoryview(bufs[k])[:n])
                if on_block is not None:
                    on_block(n)
                k ^= 1
    return h.hexdigest()


HASH_WORKERS = min(8, os.cpu_count() or 1)  # files hashed at once by default: sha256 takes a core per file


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` of this machine exists (another user's counts: not ours to judge; a reused pid
    counts too, so what it names is kept, never lost)."""
    if pid <= 0:  # (os.kill(0, ...) signals the process group)
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def map_threads(fn: Callable[[Any], Any], items: Sequence[Any], workers: int, name: str) -> list[Any]:
    """``[fn(item) for item in items]`` on ``workers`` threads, in order, the first failure raised; at most
    4 x ``workers`` submitted ahead (a million files must not queue a million futures)."""
    out: list[Any] = []
    with ThreadPoolExecutor(max(1, min(workers, len(items))), thread_name_prefix=name) as pool:
        pending: collections.deque = collections.deque()
        for item in items:
            pending.append(pool.submit(fn, item))
            if len(pending) >= 4 * workers:
                out.append(pending.popleft().result())
        while pending:
            out.append(pending.popleft().result())
    return out


RESUME_ADVICE = "free some space and rerun the same command, which resumes from the last complete shard"


def make_folder(folder: Path, what: str, not_a_folder: str) -> None:
    """Make ``folder`` (and its parents) or raise one OutputError: ``not_a_folder`` where a file holds the
    path, else "cannot create WHAT FOLDER: why"."""
    if folder.exists() and not folder.is_dir():
        raise OutputError(not_a_folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"cannot create {what} {folder}: {exc.strerror or exc}") from exc


def require_folder_of(path: Path, name: str) -> None:
    """Refuse an output file whose folder does not exist (said before the work that makes the file, not
    after it, as a traceback).

    Raises:
        ConfigError: naming the option ``name``, the path and what to do.
    """
    if not Path(path).parent.is_dir():
        raise ConfigError(f"{name} {path}: the folder {Path(path).parent} does not exist: make it, or write "
                          "elsewhere")


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning raised by its caller point at the first frame outside fastdata
    (the user's line, however deep in the library the warning is raised)."""
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def disk_error(exc: OSError, path: Path, advice: str = RESUME_ADVICE) -> OutputError:
    """Turn an ``OSError`` raised while writing ``path`` into a user-facing error; ``advice`` says what to do
    when the disk is full."""
    if exc.errno in _FULL_ERRNOS:
        free = shutil.disk_usage(path.parent).free if path.parent.exists() else 0
        return DiskFullError(
            f"no space left while writing {path} ({os.strerror(exc.errno)}; {free / 2**20:.1f} MiB free): {advice}")
    where = Path(exc.filename) if isinstance(exc.filename, str) else path
    if exc.errno == errno.EISDIR and isinstance(exc.filename2, str):  # a rename: the folder is at its target
        where = Path(exc.filename2)
    what = {errno.EISDIR: f"remove the folder {where}, which is in the way of a file",
            errno.ENOTDIR: f"a file stands where a folder on the way to {where} should be: remove that file",
            errno.ELOOP: f"{where} is a symbolic link, which fastdata never writes through: remove it",
            errno.EACCES: "give this user write permission there, or write elsewhere",
            errno.EPERM: "give this user write permission there, or write elsewhere",
            errno.EROFS: "the file system is read-only: write elsewhere"}.get(exc.errno)
    return OutputError(f"cannot write {path}: {exc.strerror or exc}" + (f"; {what}" if what else ""))


def read_regular(path: Path, limit: int = 64 << 20) -> bytes:
    """The bytes of the small regular file at ``path`` (a record of a shared folder: a copy's stamp, a cache
    folder's source), never through a link at its name, never blocking on a FIFO someone put there.

    Raises:
        OSError: There is none, it is not a regular file (a link, a FIFO, a folder) or it is over ``limit``.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > limit:
            raise OSError(errno.EINVAL, "not a regular file of a record's size", str(path))
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read()  # (its size checked above)
    finally:
        os.close(fd)


def open_new(path: Path, mode: Optional[int] = 0o644) -> Any:
    """A new file opened for binary writing with exactly ``mode`` (None: the umask's), refusing one that exists
    or a symbolic link at ``path`` (a name another user could have planted)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o666 if mode is None else mode)
    try:
        if mode is not None:
            os.fchmod(fd, mode)
    except OSError:
        os.close(fd)
        raise
    return os.fdopen(fd, "wb")


class HashingWriter:
    """Writes a file under ``<name>.tmp``, hashing the bytes as they go; ``commit()`` renames it.

    Until ``commit()`` nothing carries the final name, so an interrupted run leaves only ``.tmp`` files.
    Large writes are hashed on a helper thread while the write runs (both release the GIL): the
    preprocessing parent's time per shard is then the longer of the two, not their sum. The ``.tmp`` is
    created anew, never through a link; ``mode``: its exact permissions (None: the umask's).
    """

    def __init__(self, path: Path, advice: str = RESUME_ADVICE, mode: Optional[int] = None) -> None:
        self.path = Path(path)
        self.advice = advice  # what a full disk's error tells the user to do
        self.tmp = self.path.with_name(self.path.name + ".tmp")
        self.hash = new_hash()
        self.size = 0
        self._hasher: Optional[ThreadPoolExecutor] = None
        try:
            # a leftover .tmp (a killed writer's) goes first: created anew, never written through a link
            # planted at its name (which would overwrite the file it points to)
            self.tmp.unlink(missing_ok=True)
            self._f = open_new(self.tmp, mode)
        except OSError as exc:
            raise disk_error(exc, self.tmp, self.advice) from exc

    def write(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        hashed = None
        if view.nbytes >= _OVERLAP_BYTES:
            if self._hasher is None:
                self._hasher = ThreadPoolExecutor(1, thread_name_prefix="fastdata-hash")
            hashed = self._hasher.submit(self.hash.update, view)
        try:
            self._f.write(view)
        except OSError as exc:
            self.abort()
            raise disk_error(exc, self.tmp, self.advice) from exc
        finally:
            if hashed is not None:
                hashed.result()  # the caller may reuse `data` once this returns
        if hashed is None:
            self.hash.update(view)
        self.size += view.nbytes

    def _stop_hasher(self) -> None:
        if self._hasher is not None:
            self._hasher.shutdown(wait=True)
            self._hasher = None

    def commit(self) -> dict[str, Any]:
        """fsync, rename to the final name; returns ``{"path", "bytes", "sha256"}``."""
        self._stop_hasher()
        try:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
            os.replace(self.tmp, self.path)
        except OSError as exc:
            self.abort()
            raise disk_error(exc, self.path, self.advice) from exc
        return {"path": self.path.name, "bytes": self.size, HASH_NAME: self.hash.hexdigest()}

    def abort(self) -> None:
        self._stop_hasher()
        try:
            self._f.close()  # flushing buffered bytes can fail again on a full disk; the file goes anyway
        except OSError:
            pass
        self.tmp.unlink(missing_ok=True)


def write_bytes_atomic(path: Path, data: bytes, advice: str = RESUME_ADVICE,
                       mode: Optional[int] = None) -> dict[str, Any]:
    """``data`` written to ``path`` by `HashingWriter` (``mode``: the file's exact permissions)."""
    w = HashingWriter(path, advice, mode)
    w.write(data)
    return w.commit()


def copy_file_atomic(src: Path, dst: Path) -> None:
    """``src``'s bytes at ``dst``, by `HashingWriter` (a new ``.tmp``, renamed): never through a link at
    ``dst`` (an object put into a ``file://`` store: fsspec's copy follows one)."""
    w = HashingWriter(dst)
    try:
        with open(src, "rb") as f:
            for block in iter(lambda: f.read(_HASH_BLOCK), b""):
                w.write(block)
    except BaseException:
        w.abort()
        raise
    w.commit()


def write_json_atomic(path: Path, obj: Any) -> None:
    """JSON with sorted keys and a trailing newline, so equal objects give equal bytes. Written as it is
    encoded: ``json.dumps`` with an indent joins one small string per token, about 7x the text's size (2.5
    GB for the manifest of a million shards)."""
    w = HashingWriter(path)
    try:
        buf: list[str] = []
        held = 0
        for piece in json.JSONEncoder(indent=1, sort_keys=True).iterencode(obj):
            buf.append(piece)
            held += len(piece)
            if held >= 1 << 20:
                w.write("".join(buf).encode())
                buf, held = [], 0
        buf.append("\n")
        w.write("".join(buf).encode())
    except BaseException:
        w.abort()
        raise
    w.commit()


def fsync_dir(path: Path) -> None:
    """Make renames inside ``path`` durable (a crash after rename keeps the new name)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# NOTE [manifest paths]: a path taken from a manifest is used only inside the dataset's folder, and checking
# that costs an lstat a file, which is also its size check (a dataset of 10^6 shards opens in every rank;
# resolving each path stats every component of it and of the folder's path, twice: minutes at that size).
# 1. `plain_relative` refuses, by the text alone, an empty, absolute or ``..`` path: done for every path when
#    a manifest is loaded.
# 2. `contained_stat` then stats each component of the path inside the folder without following links; only
#    where one is a link is the whole path resolved, and refused unless it stays inside the folder.
# 3. Every opening of a file named by a manifest goes through `contained_stat` (`safe_join`, `check_file`,
#    `contained_sizes`, which stats a plain file name beside the folder's descriptor and hands it the rest).
def plain_relative(root: Path, rel: Any) -> None:
    """Refuse a manifest path that is not a plain relative path (NOTE [manifest paths] 1): no file is read."""
    if not isinstance(rel, str) or not rel or rel.startswith("/") or ".." in rel.split("/") or "\0" in rel:
        raise FormatError(f"manifest path {rel!r} is not a plain relative path inside {root}: refusing to use it; "
                          "the manifest is damaged or was not written by fastdata: make the dataset again "
                          "(`fastdata preprocess`) or restore its manifest")


def contained_stat(root: Path, rel: str) -> Optional[os.stat_result]:
    """The status of ``root / rel`` (a manifest path), None when it does not exist; refusing a path that
    leaves ``root`` by its text or through a link (NOTE [manifest paths] 2).

    Raises:
        FormatError: ``rel`` is not a plain relative path, no path this file system can open (a name too long,
            a loop of links), or a link in it leads outside ``root``.
    """
    plain_relative(root, rel)
    here = os.fspath(root)
    st = None
    for part in rel.split("/"):
        if part in ("", "."):
            continue
        here = os.path.join(here, part)
        try:
            st = os.lstat(here)
            if stat.S_ISLNK(st.st_mode):
                return os.stat(resolved_inside(os.path.join(root, rel), folder_prefix(root), rel))
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            if exc.errno not in _NO_PATH:
                raise
            raise FormatError(f"{root}: the manifest names {rel[:200]!r}, which this file system cannot open "
                              f"({exc.strerror}): the dataset's files are not the ones its manifest names; "
                              "preprocess or download it again") from None
    return st if st is not None else os.stat(root)


_NOT_NAMES = ("", ".", "..")
_NO_PATH = (errno.ENAMETOOLONG, errno.ELOOP)  # a manifest's path no file can have here: refused, not missing


def contained_sizes(root: Path, rels: Sequence[Any]) -> np.ndarray:
    """The size of each regular file ``root / rel`` (manifest paths): -1 where none is, -2 where something else
    is (a folder), -3 where `contained_stat` refuses the path (call it to raise its error). A plain file name
    is stat'd beside a descriptor of ``root`` (no walk of components, no path joined: 2·10^6 files a rank
    opens); any other path, or a link, goes through `contained_stat`."""
    sizes: list[int] = []
    add, lstat, fd = sizes.append, os.lstat, _folder_descriptor(root)
    prefix = os.path.join(os.fspath(root), "")
    try:
        for rel in rels:
            if type(rel) is str and "/" not in rel and rel not in _NOT_NAMES:  # one component, no `..`
                try:
                    st = os.stat(rel, dir_fd=fd, follow_symlinks=False) if fd is not None else lstat(prefix + rel)
                except (FileNotFoundError, NotADirectoryError):
                    add(-1)
                    continue
                except OSError as exc:
                    if exc.errno not in _NO_PATH:
                        raise
                    add(-3)
                    continue
                kind = stat.S_IFMT(st.st_mode)
                if kind != stat.S_IFLNK:  # (a link is resolved and checked by contained_stat)
                    add(st.st_size if kind == stat.S_IFREG else -2)
                    continue
            try:
                found = contained_stat(root, rel)
            except FormatError:
                add(-3)
                continue
            add(-1 if found is None else found.st_size if stat.S_ISREG(found.st_mode) else -2)
    finally:
        if fd is not None:
            os.close(fd)
    return np.array(sizes, dtype=np.int64)


def _folder_descriptor(root: Path) -> Optional[int]:
    """A descriptor of the folder ``root`` to stat names beside (``O_PATH`` where there is one: a folder this
    user may enter but not list still serves), or None where that is not to be had."""
    if os.stat not in os.supports_dir_fd or not os.path.isdir(root):
        return None
    try:
        return os.open(root, getattr(os, "O_PATH", os.O_RDONLY) | getattr(os, "O_DIRECTORY", 0) | os.O_CLOEXEC)
    except OSError:
        return None


def folder_prefix(root: Path | str) -> str:
    """``root`` with its links resolved and a final separator: what a path inside it starts with."""
    return os.path.join(os.path.realpath(root), "")


def resolved_inside(path: Path | str, inside: str, rel: Any) -> str:
    """``path`` with its links resolved, refused unless it starts with ``inside`` (`folder_prefix`); ``rel``
    names it in the message (NOTE [manifest paths] 2)."""
    full = os.path.realpath(path)
    if not full.startswith(inside):
        raise FormatError(f"manifest path {rel!r} resolves to {full}, outside {inside}: refusing to use it")
    return full


def safe_join(root: Path, rel: str) -> Path:
    """``root / rel`` for a path taken from a manifest, refusing anything that escapes ``root``
    (`contained_stat`)."""
    contained_stat(root, rel)
    return Path(root) / rel


def iter_blocks(path: Path, start: int = 0) -> Iterator[bytes]:
    with open(path, "rb") as f:
        f.seek(start)
        while block := f.read(_COPY_BLOCK):
            yield block
