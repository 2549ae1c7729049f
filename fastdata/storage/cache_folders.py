"""The node cache's folders on disk (NOTE [remote cache] in remote.py): where they are, who may read them
(private, or shared with a group), the lock files in them, and listing and removing them (`fastdata cache`)."""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import secrets
import shutil
import stat
import struct
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Union

from .._io import LockFile, disk_error, read_regular
from ..errors import ConfigError, OutputError
from ..formats.manifest import MANIFEST_NAME

log = logging.getLogger(__name__)

SOURCE_NAME = ".source.json"  # in each dataset's folder: the URL it mirrors
CACHE_FULL_ADVICE = ("give the dataset a cache_limit below the free space (`--cache-limit`: shards are then "
                     "streamed and evicted), remove other datasets' copies (`fastdata cache remove`), or point "
                     "cache_dir / $FASTDATA_CACHE at a larger disk; a rerun keeps the files already cached")
CACHE_MODES = {"private": (0o700, 0o600), "group": (0o2770, 0o660)}  # $FASTDATA_CACHE_MODE: folders, files


def cache_advice(folder: Path) -> Optional[str]:
    """What an error about a damaged file of ``folder`` says to do when the folder is a dataset's node cache
    (`integrity.damaged_error`'s ``advice``), else None: the store's copy is intact (a download checks the
    bytes as they come), so neither `fastdata verify URL` nor a new push or preprocess mends it."""
    return copy_advice(Path(folder).name) if (Path(folder) / SOURCE_NAME).is_file() else None


def copy_advice(cache_id: str) -> str:
    """`cache_advice` of the dataset cached as ``cache_id``."""
    return (f"the node cache's copy is damaged, not the store's (a download checks its bytes); remove it "
            f"(`fastdata cache remove {cache_id}`) and check this node's disk")


def default_cache_dir() -> Path:
    """``$FASTDATA_CACHE``, else ``$XDG_CACHE_HOME/fastdata``, else ``~/.cache/fastdata``."""
    if os.environ.get("FASTDATA_CACHE"):
        return Path(os.environ["FASTDATA_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fastdata"


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
    shared with a group this user is in (its files could have been planted there). The folders above it are
    checked too (`_check_above`).

    Raises:
        OutputError: ``path``, or a folder above it, could be swapped by another user.
    """
    mode, missing, folder = cache_modes()[0], [], path
    while not os.path.lexists(folder):
        missing.append(folder)
        folder = folder.parent
    _check_above(folder if missing else path.parent, path)  # (before anything is made there)
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
        _refuse_planted(path, stat.S_IMODE(info.st_mode), mode)
        os.chmod(path, mode)  # (a folder made before modes were set, or under the other mode)
    return path


def _check_above(start: Path, path: Path) -> None:
    """Refuse the cache folder ``path`` when ``start`` (its nearest existing parent) or a folder above it, up
    to ``/``, is another user's and open to writes by others: they could rename our private folder away and
    put one with planted shards at its name, which a running job serves (NOTE [shard cache] 20 in cache.py).
    1. A sticky bit does not help there: a folder's owner may rename any entry in it.
    2. Root's and this user's folders are trusted whatever their mode (/tmp; a home left group-writable).
    3. So is a folder only its group may write to, of a group this user is in (a project folder of a cluster:
       its members are trusted as much as the cache shared with them under ``$FASTDATA_CACHE_MODE=group``).
    4. A link's own mode means nothing and its target cannot change: another user's link is refused only in a
       sticky folder others may write to (/tmp), where its owner may replace it. The folders it leads to are
       walked too.
    One lstat a folder (~10 a call), each time a cache folder is opened: nothing beside a download."""
    me, groups = os.geteuid(), {os.getegid(), *os.getgroups()}
    seen: set[str] = set()
    for here in (os.path.abspath(start), os.path.realpath(start)):
        while here not in seen:
            seen.add(here)
            try:
                info = os.lstat(here)
            except OSError as exc:
                raise disk_error(exc, Path(here), CACHE_FULL_ADVICE) from exc
            if info.st_uid in (me, 0):
                swappable = None
            elif stat.S_ISLNK(info.st_mode):
                swappable = "is a link of user {}, who may replace it in a folder open to all" if _open_sticky(
                    os.path.dirname(here)) else None
            elif info.st_mode & 0o022 and not (info.st_gid in groups and not info.st_mode & 0o002):
                swappable = "belongs to user {} and others may write to it (mode {:o})"
            else:
                swappable = None
            if swappable is not None:
                raise OutputError(
                    f"{here}, on the way to the node cache folder {path}, "
                    + swappable.format(info.st_uid, stat.S_IMODE(info.st_mode)) + ": the cache's folders could "
                    "be swapped for ones holding planted files; set cache_dir / $FASTDATA_CACHE to a folder of "
                    "your own (a cache shared on purpose: $FASTDATA_CACHE_MODE=group)")
            here = os.path.dirname(here)


def _open_sticky(folder: str) -> bool:
    """Whether ``folder`` is sticky and everyone may write to it (/tmp): each entry's owner may replace it."""
    try:
        mode = os.lstat(folder).st_mode
    except OSError:
        return False
    return bool(mode & stat.S_ISVTX and mode & 0o002)


def _refuse_planted(path: Path, now: int, mode: int) -> None:
    """A folder of this user that was open to writes the cache does not allow (a mode of 0777) may hold what
    others put there while it was: refuse it when it holds anything of another user (their files would be
    served as cached data once the folder is private)."""
    if not now & ~mode & 0o022:  # (0755 of a folder made before modes were set: nobody else could write)
        return
    me = os.geteuid()
    try:
        with os.scandir(path) as entries:
            for entry in entries:
                owner = entry.stat(follow_symlinks=False).st_uid
                if owner == me:
                    continue
                if now & 0o2000 and not now & 0o002:  # made for a group (FASTDATA_CACHE_MODE=group): its members'
                    raise OutputError(f"{path} is a node cache shared with its group (mode {now:o}) and holds "
                                      f"{entry.name!r} of user {owner}: set FASTDATA_CACHE_MODE=group to use it, or "
                                      "give this job a cache of its own (cache_dir / $FASTDATA_CACHE)")
                raise OutputError(f"{path} was open to other users (mode {now:o}) and holds {entry.name!r} of "
                                  f"user {owner}: its files may have been planted; remove the folder (rm -r "
                                  f"{path}) and run again (the node cache keeps its folders at {mode:o})")
    except OSError as exc:
        raise disk_error(exc, path, CACHE_FULL_ADVICE) from exc


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


def on_disk(folder: Path, subfolders: Iterable[str]) -> set[str]:
    """The regular files now in ``subfolders`` of ``folder`` (relative paths; "" for ``folder`` itself): not
    links, nor reached through one. A listing of each folder, not a stat per file (10^6 shards of two
    files: 0.4 s against 11 s); `FileGroups.present` says which shards they make whole.

    Args:
        folder: A dataset's folder in the cache.
        subfolders: The folders (relative, "" for ``folder`` itself) holding its files.

    Returns:
        The files' paths relative to ``folder``.
    """
    present: set[str] = set()
    for sub in subfolders:
        fd = _folder_fd(folder, sub)  # (never through a link: NOTE [shard cache] 20)
        if fd is None:
            continue
        try:
            with os.scandir(fd) as entries:
                present.update(os.path.join(sub, e.name) for e in entries if _is_file(e))
        finally:
            os.close(fd)
    return present


def _is_file(entry: os.DirEntry) -> bool:
    """A listed entry is a regular file (not a link to one: the cache makes none)."""
    try:
        return entry.is_file(follow_symlinks=False)
    except OSError:
        return False


# struct flock for F_OFD_*: l_type, l_whence, l_start, l_len, l_pid (0 for these locks), padded as C does
_FLOCK = "hhqqi4x" if struct.calcsize("hhqqi4x") == 32 else "hhqqi"
_OFFSETS = (1 << 62) - 1  # a pin's byte: a 62-bit hash of its shard's name (off_t is signed 64-bit)
# bytes past every hash: the folder held whole; evictions under way; a reader of the folder (rule 4)
_WHOLE, _EVICTING, _READING = 1 << 62, (1 << 62) + 1, (1 << 62) + 2


class FolderRemoved(OutputError):
    """A cache folder removed as a reader came to hold it: the opening of another version of its dataset found
    no reader holding it (`remove_other_versions`)."""

    def __init__(self, folder: Path) -> None:
        super().__init__(f"{folder} was removed from the node cache meanwhile (another version of its dataset was "
                         "opened while no reader held this one): open the dataset again")


class ShardPins:
    """The shards of one cache folder this object has in use, so that no process evicts them (NOTE [shard
    cache] 11 in cache.py): a shared byte-range lock per shard on one file, ``.locks/shards.pins``, at an
    offset hashed from the shard's name; an eviction takes that byte exclusively, and cannot while anyone
    holds it. Open-file-description locks (Linux): one descriptor however many shards are pinned (a batch
    over 10,000 shards under a limit of 1,024 open files), two objects in one process exclude each other,
    and forked children keep none (NOTE [locks across fork] in fastdata/_io.py). Two shards whose names
    hash alike share a byte (counted here: it stays locked while either is pinned, and neither is evicted
    meanwhile, by this object or another). Where a folder's file system has no such locks, a pin is a
    shared ``flock`` on a file of its own (a descriptor per pinned shard), in every process alike (the kind
    is decided by the folder).

    A job that reads every file of the dataset (storage "ram", "shm", "cuda", an LMDB of version 1) holds
    the folder whole instead (`hold_all`): one lock, not one a file (10^4 byte locks on one file cost 1 s,
    3 x 10^4 cost 14 s: the kernel walks its list of them at each), and it covers files whatever shards another
    job groups them in. Every eviction, whatever its shard, is refused while anyone holds the folder:
    1. `hold_all` takes a shared lock on the WHOLE byte, then waits for the evictions under way (each holds the
       EVICTING byte shared while it deletes; `hold_all` takes it exclusively once, and lets go at once).
    2. `evicting` takes the EVICTING byte shared, then asks whether anyone holds the WHOLE byte (F_OFD_GETLK:
       no lock taken on it, so evictions never exclude each other): an eviction either sees the hold or
       ends before `hold_all` returns, and the files it deleted are fetched again by the holder.
    3. Evictors hold the EVICTING byte only while deleting a shard's files, so `hold_all` waits for no more.
       (Without OFD locks: files ``whole.pin`` and ``evicting.pin``; there two evictions at the same instant
       may each find the other's test of ``whole.pin`` and keep their shards this time.)
    4. Every object is a reader of the folder from its making until `close`: it holds the READING byte shared
       (without OFD locks: ``reading.pin``). The opening of another version of the dataset removes the folder
       only when it can take every byte exclusively (`claim`): no reader, pin, hold or eviction anywhere. An
       object made as a removal renames the folder away finds its file gone, and says so (FolderRemoved).

    Args:
        folder: The dataset's ``.locks`` folder in the cache.
        reader: Hold the folder as read (rule 4); False only for `claim`.

    Raises:
        FolderRemoved: The folder was removed as this reader came to hold it.
    """

    def __init__(self, folder: Path, reader: bool = True) -> None:
        self.folder, self.reader = folder, reader
        self._file: Optional[LockFile] = None
        self._ofd: Optional[bool] = None  # byte-range locks on one file (decided at the first use)
        self._files: dict[str, LockFile] = {}  # without them: shard name -> its pin file
        self._own: list[LockFile] = []  # without them: reading.pin (a reader), or the files `claim` took
        self._held: dict[int, int] = {}  # with them: byte -> pins on it (names may hash alike)
        self._whole: Optional[Union[bool, LockFile]] = None  # `hold_all`: True (OFD), or whole.pin (flock)
        if reader:
            self._open()  # (a reader from now on: rule 4)

    @staticmethod
    def _offset(name: str) -> int:
        return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little") & _OFFSETS

    def _lock(self, offset: int, kind: int, wait: bool) -> None:
        command = fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK
        fcntl.fcntl(self._file, command, struct.pack(_FLOCK, kind, os.SEEK_SET, offset, 1, 0))

    def _open(self) -> bool:
        """Whether pins are byte ranges of one file here (opened, and tried once, at the first use)."""
        if self._ofd is None:
            try:
                self._file = lock_file(self.folder / "shards.pins")
            except OutputError:
                if self.reader and not os.path.isdir(self.folder):  # (removed as it was being opened)
                    raise FolderRemoved(self.folder.parent) from None
                raise
            try:
                if not hasattr(fcntl, "F_OFD_GETLK"):
                    raise OSError(errno.EINVAL, "no open file description locks")
                fcntl.fcntl(self._file, fcntl.F_OFD_GETLK, struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, 0, 1, 0))
                self._ofd = True
            except OSError as exc:
                if exc.errno not in (errno.EINVAL, errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    raise
                self._ofd = False
                self._file.close()
                self._file = None
            if self.reader:
                self._read()
        return self._ofd

    def _read(self) -> None:
        """Hold the folder as read (rule 4), then check that it is still in place."""
        if self._ofd:
            held, name = self._file, "shards.pins"
            self._lock(_READING, fcntl.F_RDLCK, wait=True)  # (waits for a removal under way: then it is gone)
        else:
            name = "reading.pin"
            held = lock_file(self.folder / name)
            self._own.append(held)
            fcntl.flock(held, fcntl.LOCK_SH)
        try:
            here = os.stat(self.folder / name, follow_symlinks=False)
        except OSError:
            here = None
        there = os.fstat(held.fileno())
        if here is None or (here.st_dev, here.st_ino) != (there.st_dev, there.st_ino):
            self.close()
            raise FolderRemoved(self.folder.parent)

    def claim(self) -> bool:
        """(An object made with ``reader=False``.) Take the folder from every reader without waiting: True when
        none holds anything in it (rule 4), and none can until `close`; False when one does."""
        if self._open():
            try:  # (every byte, from 0 to the end of all offsets: a length of 0)
                fcntl.fcntl(self._file, fcntl.F_OFD_SETLK, struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0))
                return True
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                return False
        for name in ("reading.pin", "whole.pin"):
            lock = lock_file(self.folder / name)
            self._own.append(lock)
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self.close()
                return False
        return True

    def pin(self, name: str) -> None:
        """Hold shard ``name``, once until `unpin` (waits for an eviction of it under way to end)."""
        if self._open():
            offset = self._offset(name)
            if offset not in self._held:
                self._lock(offset, fcntl.F_RDLCK, wait=True)
            self._held[offset] = self._held.get(offset, 0) + 1
        else:
            lock = lock_file(self._pin_file(name))
            try:
                fcntl.flock(lock, fcntl.LOCK_SH)
            except BaseException:
                lock.close()
                raise
            self._files[name] = lock

    def unpin(self, name: str) -> None:
        if self._ofd:
            offset = self._offset(name)
            left = self._held.pop(offset, 0) - 1
            if left > 0:
                self._held[offset] = left
            elif left == 0:
                self._lock(offset, fcntl.F_UNLCK, wait=False)
        elif name in self._files:
            self._files.pop(name).close()

    def hold_all(self) -> None:
        """Hold every file of the folder, so that no process evicts any (waits for evictions under way to end:
        rule 1 above); once until `close`."""
        if self._whole is not None:
            return
        if self._open():
            self._lock(_WHOLE, fcntl.F_RDLCK, wait=True)
            self._whole = True
            self._lock(_EVICTING, fcntl.F_WRLCK, wait=True)
            self._lock(_EVICTING, fcntl.F_UNLCK, wait=False)
            return
        whole = lock_file(self.folder / "whole.pin")
        try:
            fcntl.flock(whole, fcntl.LOCK_SH)
            with lock_file(self.folder / "evicting.pin") as barrier:
                fcntl.flock(barrier, fcntl.LOCK_EX)
        except BaseException:
            whole.close()
            raise
        self._whole = whole

    def _held_whole(self) -> bool:
        """(OFD locks, the EVICTING byte held.) Whether this object or another holds the folder whole."""
        if self._whole is not None:
            return True
        found = fcntl.fcntl(self._file, fcntl.F_OFD_GETLK, struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, _WHOLE,
                                                                        1, 0))
        return struct.unpack(_FLOCK, found)[0] != fcntl.F_UNLCK

    @contextlib.contextmanager
    def evicting(self, name: str) -> Iterator[bool]:
        """Whether shard ``name`` may be deleted now (no process holds it, nor the folder whole), held so while
        the block runs. This object must not hold it itself (unpin it first)."""
        if self._open():
            offset, free = self._offset(name), False
            self._lock(_EVICTING, fcntl.F_RDLCK, wait=True)  # (`hold_all` waits for this block to end)
            try:
                if offset not in self._held and not self._held_whole():  # (a pin of this object's stays)
                    try:
                        self._lock(offset, fcntl.F_WRLCK, wait=False)
                        free = True
                    except OSError as exc:  # EAGAIN, EACCES: another process reads it (free stays False)
                        if exc.errno not in (errno.EAGAIN, errno.EACCES):
                            raise
                try:
                    yield free
                finally:
                    if free:
                        self._lock(offset, fcntl.F_UNLCK, wait=False)
            finally:
                if self._file is not None:  # (closed meanwhile: its locks went with it)
                    self._lock(_EVICTING, fcntl.F_UNLCK, wait=False)
        else:
            with lock_file(self.folder / "evicting.pin") as barrier, lock_file(self._pin_file(name)) as lock:
                fcntl.flock(barrier, fcntl.LOCK_SH)
                free = self._whole is None and _free(self.folder / "whole.pin")
                if free:
                    try:
                        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:
                        free = False
                yield free

    def _pin_file(self, name: str) -> Path:
        return self.folder / (name.replace("/", "%") + ".pin")

    def close(self) -> None:
        """Let go of every pin, of the folder held whole, and of the folder as read (rule 4)."""
        for lock in [*self._files.values(), *self._own]:
            lock.close()
        self._files.clear()
        self._own.clear()
        self._held.clear()
        if isinstance(self._whole, LockFile):
            self._whole.close()
        self._whole = None
        if self._file is not None:
            self._file.close()
        self._file, self._ofd = None, None


def _free(path: Path) -> bool:
    """(Without OFD locks.) Whether nobody holds lock file ``path`` (its exclusive lock taken and let go)."""
    with lock_file(path) as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True


def list_cached(cache_dir: Optional[Union[str, Path]] = None) -> list[dict[str, Any]]:
    """Every remote dataset in the node cache: id, URL, bytes cached of bytes in all, files cached."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    out = []
    for d in sorted(p for p in root.glob("*") if not p.is_symlink() and p.is_dir()):  # (a link: not a folder of it)
        try:
            manifest = read_regular(d / MANIFEST_NAME, limit=1 << 40)
        except OSError:
            continue  # (not a dataset's folder)
        try:
            info = json.loads(read_regular(d / SOURCE_NAME))  # (a FIFO put there: never waited on)
        except (OSError, ValueError, RecursionError):
            info = {}
        try:
            files = json.loads(manifest)["files"]
            total = sum(int(f["bytes"]) for f in files)
            sizes = [cached_size(d, f["path"]) for f in files]  # (never outside: a path that leaves is not there)
        except (ValueError, KeyError, TypeError, OverflowError, RecursionError):  # (damaged: listed, to be removed)
            files, total, sizes = [], 0, []
        out.append({"id": d.name, "url": info.get("url", "?") if isinstance(info, dict) else "?", "path": str(d),
                    "files": len(files), "cached_files": sum(x is not None for x in sizes),
                    "cached_bytes": sum(x or 0 for x in sizes), "bytes": total})
    return out


_FOLDER_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _folder_fd(folder: Path, sub: str) -> Optional[int]:
    """A descriptor of ``folder / sub`` reached through no link (None: missing, not a folder, or a link on
    the way). The node cache makes no links: one in the way was put there by someone else, and a listing or
    an unlink through it would reach outside the cache."""
    try:
        fd = os.open(folder, _FOLDER_FLAGS)
    except (OSError, ValueError):
        return None
    for part in sub.split("/"):
        if part in ("", "."):
            continue
        try:
            inner = os.open(part, _FOLDER_FLAGS, dir_fd=fd) if part != ".." else -1
        except (OSError, ValueError):
            inner = -1
        os.close(fd)
        if inner < 0:
            return None
        fd = inner
    return fd


def cached_size(folder: Path, rel: str) -> Optional[int]:
    """The size of the cached file ``folder / rel`` (a manifest path), None when there is none: missing, not a
    regular file, a link at its name or on its way (`_folder_fd`). One stat: another rank may evict it at
    any moment (an `is_file` then a `stat` can fail between the two)."""
    try:
        sub, name = os.path.split(rel)
        if not sub:  # (``folder`` is the cache's own: a name beside it needs no walk)
            info = os.lstat(os.path.join(folder, name))
        else:
            fd = _folder_fd(folder, sub)
            if fd is None:
                return None
            try:
                info = os.stat(name, dir_fd=fd, follow_symlinks=False)
            finally:
                os.close(fd)
    except (OSError, ValueError, TypeError):  # (a NUL or a number where a path should be: not a cached file)
        return None
    return info.st_size if stat.S_ISREG(info.st_mode) and name not in ("", ".", "..") else None


def remove_cached_file(folder: Path, rel: str) -> None:
    """Delete the cached file ``folder / rel`` (a link at its name: the link itself), never through a link on
    its way (`_folder_fd`: then nothing of the cache's is there to delete)."""
    sub, name = os.path.split(rel)
    fd = _folder_fd(folder, sub)
    if fd is None:
        return
    try:
        os.unlink(name, dir_fd=fd)
    except FileNotFoundError:
        pass
    finally:
        os.close(fd)


def remove_cached(ids: list[str], cache_dir: Optional[Union[str, Path]] = None) -> list[str]:
    """Delete the named datasets' cache folders (all when ``ids`` is empty); the ids removed. A job still
    reading one keeps its open files; run this between jobs."""
    removed = []
    for info in list_cached(cache_dir):
        if not ids or info["id"] in ids:
            try:
                shutil.rmtree(info["path"])  # (follows no link)
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise OutputError(f"cannot remove {exc.filename or info['path']}: {exc.strerror}; remove it by hand "
                                  f"(rm -r {info['path']}); removed before it: {removed}") from exc
            removed.append(info["id"])
    return removed


_GOING = ".removing-"  # a version's folder renamed away, being deleted (hidden: `list_cached` skips it)


def remove_other_versions(folder: Path, url: str) -> list[str]:
    """Remove the cache folders beside ``folder`` that mirror other versions of the dataset at ``url`` (as
    ``.source.json`` names it, scrubbed) and that no reader holds (`ShardPins` rule 4): a dataset pushed again
    leaves its old files behind, outside every ``cache_limit`` (each bounds its own version), so a node's cache
    grew with each push. A folder a live reader holds, in any process or container sharing the cache, stays
    (removed at a later opening); so does one without ``.locks`` (not judged). A reader of an older fastdata
    holds no such lock while it pins nothing: share a cache only between jobs of one version. Never fails the
    opening: an error is logged. Removals cut short (a killed process) are finished here.

    Args:
        folder: This version's cache folder.
        url: The dataset's URL, scrubbed.

    Returns:
        The ids of the folders removed.
    """
    removed = []
    try:
        with os.scandir(folder.parent) as entries:
            found = [e for e in entries if e.name != folder.name and e.is_dir(follow_symlinks=False)]
    except OSError:
        return removed
    for entry in found:
        path, going = Path(entry.path), entry.name.startswith(_GOING)  # (no reader reaches a renamed folder)
        if not going:
            try:
                source = json.loads(read_regular(path / SOURCE_NAME))  # (a FIFO put there: never waited on)
            except (OSError, ValueError, RecursionError):
                continue  # not a dataset's folder, or one being made
            if not isinstance(source, dict) or source.get("url") != url:
                continue
        try:
            if going:
                _delete(path)
            elif _remove_unread(path):
                removed.append(entry.name)
        except (OSError, OutputError) as exc:
            log.warning("could not remove %s, another version's folder, from the node cache (%s): the next "
                        "opening tries again, or remove it by hand", path, exc)
    return removed


def _remove_unread(path: Path) -> bool:
    """Rename the dataset folder ``path`` away, then delete it, if no reader holds it (taken from them all
    while it is renamed: an opening of that version meanwhile makes a new folder, and a reader that waited
    finds its folder gone: `FolderRemoved`); whether it went."""
    try:
        if not stat.S_ISDIR(os.lstat(path / ".locks").st_mode):
            return False
    except FileNotFoundError:
        return False
    pins = ShardPins(path / ".locks", reader=False)
    try:
        if not pins.claim():
            return False
        going = path.with_name(f"{_GOING}{path.name}-{secrets.token_hex(4)}")
        os.rename(path, going)
    finally:
        pins.close()
    _delete(going)
    return True


def _delete(path: Path) -> None:
    """``shutil.rmtree`` (which follows no link), where another opening may be deleting the same folder."""
    for _ in range(100):
        try:
            shutil.rmtree(path)
            return
        except FileNotFoundError:  # (an entry the other removed first: go on with the rest)
            if not os.path.lexists(path):
                return
