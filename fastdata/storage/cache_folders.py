"""The node cache's folders on disk (NOTE [remote cache] in remote.py): where they are, who may read them
(private, or shared with a group), the lock files in them, and listing and removing them (`fastdata cache`)."""
from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path
from typing import Any, Optional, Union

from .._io import LockFile, disk_error
from ..errors import ConfigError, OutputError
from ..formats.manifest import MANIFEST_NAME

SOURCE_NAME = ".source.json"  # in each dataset's folder: the URL it mirrors
CACHE_FULL_ADVICE = ("give the dataset a cache_limit below the free space (`--cache-limit`: shards are then "
                     "streamed and evicted), remove other datasets' copies (`fastdata cache remove`), or point "
                     "cache_dir / $FASTDATA_CACHE at a larger disk; a rerun keeps the files already cached")
CACHE_MODES = {"private": (0o700, 0o600), "group": (0o2770, 0o660)}  # $FASTDATA_CACHE_MODE: folders, files


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
    removed = []
    for info in list_cached(cache_dir):
        if not ids or info["id"] in ids:
            shutil.rmtree(info["path"], ignore_errors=True)
            removed.append(info["id"])
    return removed
