"""Who holds a dataset's node cache folder (NOTE [shard cache] in cache.py): shard pins, the folder held whole
by a reader of every file, evictions under way, every reader of the folder (`ShardPins`), and the removal of
another version's folder that no reader holds (`remove_other_versions`)."""
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
from typing import Iterator, Optional, Union

from .._io import LockFile, read_regular
from ..errors import OutputError
from .cache_folders import SOURCE_NAME, lock_file

log = logging.getLogger(__name__)

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
