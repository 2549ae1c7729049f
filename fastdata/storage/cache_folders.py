"""The node cache's folders on disk (NOTE [remote cache] in remote.py): where they are, who may read them
(private, or shared with a group), the lock files in them, and listing and removing them (`fastdata cache`)."""
from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path
from typing import Any, Iterable, Optional, Union

from .._io import LockFile, disk_error, read_regular
from ..errors import ConfigError, OutputError
from ..formats.manifest import MANIFEST_NAME

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
