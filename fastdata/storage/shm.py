"""One copy of a dataset per machine in ``/dev/shm``, shared by every rank, worker and job on the node.

The copy is named after the dataset's checksums, so two jobs on the same data share it and a changed
dataset gets a new one. The first process copies under an exclusive ``flock`` (released by the kernel
if it dies), checking every byte against the manifest's sha256 as it goes, and renames when complete;
the others wait on the lock, then map the finished file. Copies outlive the job on purpose (the next
run starts instantly): ``fastdata shm list`` / ``fastdata shm remove`` manage them.

NOTE [private shm]: a copy is training data other local users must neither plant nor read.
1. Copies live in a folder only this user can write: the shm folder itself when this user owns it and no one
   else may write it, else ``fastdata-user-<uid>`` inside it (``/dev/shm`` is world-writable), made 0700 and
   checked (a real folder, this user's, mode 0700) before every use.
2. Files are created 0600 with ``O_EXCL | O_NOFOLLOW``: a name planted in advance (a symlink, say) makes the
   copy fail, it is never followed or written through; temporaries carry the pid and a random part.
3. A copy found in place is used only if it is a regular file of this user's, of the expected size, whose
   inode, size and mtime match the stamp its creator wrote beside it; with ``verify`` its bytes are also
   hashed against the manifest first. Anything else is refused with the command that removes it.
4. A copier killed mid-copy leaves its temporary; ``fastdata shm list`` shows it as partial (no process holds
   its lock) and ``fastdata shm remove`` deletes it, as does the next copy of the same data.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import secrets
import shutil
import stat
import time
from pathlib import Path
from typing import Any, Optional

from .._io import (HASH_NAME, HASH_WORKERS, LockFile, disk_error, fsync_dir, iter_blocks, map_threads, new_hash,
                   open_new, read_regular, safe_join)
from ..errors import ChecksumError, OutputError
from ..formats.base import body_offsets
from ..formats.integrity import damaged_error, file_problem
from ..formats.rows import column, rows_by
from .cache_folders import cache_advice

PREFIX = "fastdata-"
COPY_WORKERS = HASH_WORKERS  # source files copied (and hashed) at once

FULL_ADVICE = ("free space there (`fastdata shm list` / `fastdata shm remove`), enlarge it, or use storage='mmap' "
               "(a copy does not resume: it is made anew)")


def shm_dir(override: Optional[Path | str] = None) -> Path:
    """The shm folder as configured (``override``, ``$FASTDATA_SHM_DIR`` or ``/dev/shm``); copies live in
    `private_dir` of it."""
    return Path(override or os.environ.get("FASTDATA_SHM_DIR", "/dev/shm"))


def private_dir(override: Optional[Path | str] = None, create: bool = True) -> Path:
    """The folder this user's copies live in (NOTE [private shm]): the shm folder itself when this user owns it
    and no one else may write it, else its ``fastdata-user-<uid>`` folder (made 0700 when ``create``), checked.

    Raises:
        OutputError: the folder cannot be made, or is not this user's private folder (it says what to remove).
    """
    base = shm_dir(override)
    try:
        st = os.stat(base)
    except OSError as exc:
        raise OutputError(f"cannot use shm folder {base}: {exc.strerror}; is it a writable tmpfs?") from exc
    if st.st_uid == os.getuid() and not st.st_mode & 0o022:
        return base
    d = base / f"{PREFIX}user-{os.getuid()}"
    if create:
        try:
            os.mkdir(d, 0o700)  # (an existing one is checked below)
        except FileExistsError:
            pass
        except OSError as exc:
            raise OutputError(f"cannot create {d}: {exc.strerror}; is {base} a writable tmpfs?") from exc
    if create or os.path.lexists(d):
        _check_private(d)
    return d


def _check_private(d: Path) -> None:
    st = os.lstat(d)
    problem = ("is not a folder" if not stat.S_ISDIR(st.st_mode) else
               f"belongs to uid {st.st_uid}, not to this user (uid {os.getuid()})" if st.st_uid != os.getuid() else
               f"has mode {stat.S_IMODE(st.st_mode):04o}, not 0700" if st.st_mode & 0o077 else None)
    if problem is not None:
        raise OutputError(f"{d} {problem}: it must be this user's private folder for /dev/shm copies, and someone "
                          f"may have made it to plant data; remove it (`rm -rf {d}`, as its owner or root) or set "
                          "FASTDATA_SHM_DIR (shm_dir=) to a folder only you can write")


def copy_id(manifest: dict[str, Any], key: str = "") -> str:
    """16 hex digits naming the dataset's bytes (hash of its files' checksums; ``key`` names a part of it)."""
    h = hashlib.sha256(key.encode())
    files = manifest["files"]
    for path, digest in zip(column(files, "path"), column(files, HASH_NAME)):
        h.update(f"{path}:{digest}\n".encode())
    return h.hexdigest()[:16]


def ensure_copy(root: Path, manifest: dict[str, Any], payload: list[tuple[str, int]], header: bytes,
                directory: Optional[Path] = None, key: str = "", verify: bool = False) -> Path:
    """Return the path of the node's copy, making it first if no process has yet.

    ``payload`` lists ``(manifest file path, bytes to skip at its start)``: the bodies are concatenated
    after ``header`` (an ``.npy`` header for the whole array), so the copy is itself a plain ``.npy``.
    A copy found in place is checked first (NOTE [private shm]); ``verify`` hashes it against the manifest.

    Raises:
        OutputError: the shm folder is not private or is too small, or a found copy is not this user's
            (the message says what to remove). ChecksumError: a found copy's bytes are not the dataset's.
    """
    d = private_dir(directory)
    cid = copy_id(manifest, key)
    target = d / f"{PREFIX}{cid}.npy"
    files = rows_by(manifest["files"], (p for p, _ in payload))
    needed = len(header) + sum(files[p]["bytes"] - skip for p, skip in payload)
    if os.path.lexists(target):
        return _found(target, root, files, payload, header, needed, verify)
    lock_path = d / f"{PREFIX}{cid}.lock"
    try:
        # a LockFile: a child forked mid-copy (a DataLoader worker) never keeps the lock (NOTE [locks across fork])
        lock = LockFile(os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
    except OSError as exc:
        raise OutputError(f"cannot create {lock_path}: {exc.strerror}; remove it if it is not a plain file of "
                          f"yours, and check that {d} is a writable tmpfs") from exc
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the others wait here while the first one copies
        if os.path.lexists(target):
            return _found(target, root, files, payload, header, needed, verify)
        for stale in d.glob(f"{PREFIX}{cid}.*.tmp-*"):  # left by a process that died mid-copy
            _remove(stale)
        free = shutil.disk_usage(d).free
        if needed > free:
            raise OutputError(f"{d} has {free / 2**20:,.0f} MiB free but this dataset needs {needed / 2**20:,.0f} MiB: "
                              f"{FULL_ADVICE}")
        info = {"id": cid, "dataset": str(Path(root).resolve()), "bytes": needed, "created": time.time(),
                "format": manifest["format"]}
        _write_info(d, cid, info)  # before the copy: `fastdata shm list` names a partial one's dataset
        tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            st = _copy(root, files, payload, header, tmp)
            _write_info(d, cid, {**info, "stamp": _stamp(st)})
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            (d / f"{PREFIX}{cid}.json").unlink(missing_ok=True)
            raise
        fsync_dir(d)
    finally:
        lock.close()  # (releases the flock)
    return target


def _stamp(st: os.stat_result) -> dict[str, int]:
    """What the creator records of its finished copy; a file put in its place later differs."""
    return {"bytes": st.st_size, "inode": st.st_ino, "mtime_ns": st.st_mtime_ns}


def _write_info(d: Path, cid: str, info: dict[str, Any]) -> None:
    path = d / f"{PREFIX}{cid}.json"
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        with open_new(tmp, 0o600) as f:
            f.write(json.dumps(info).encode())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise disk_error(exc, path, FULL_ADVICE) from exc


def _found(target: Path, root: Path, files: dict[str, dict[str, Any]], payload: list[tuple[str, int]],
           header: bytes, needed: int, verify: bool) -> Path:
    """``target`` if it is the copy its creator stamped (and, with ``verify``, its bytes are the dataset's)."""
    cid = target.stem[len(PREFIX):]
    st = os.lstat(target)
    try:
        stamp = json.loads(read_regular(target.with_suffix(".json"))).get("stamp")  # (never a FIFO's wait)
    except (OSError, ValueError, AttributeError):
        stamp = None
    problem = ("is not a regular file" if not stat.S_ISREG(st.st_mode) else
               f"belongs to uid {st.st_uid}, not to this user" if st.st_uid != os.getuid() else
               f"may be written by others (mode {stat.S_IMODE(st.st_mode):04o})" if st.st_mode & 0o022 else
               f"has {st.st_size} bytes, not {needed}" if st.st_size != needed else
               "is not the file its creator stamped" if stamp != _stamp(st) else None)
    advice = f"remove it (`fastdata shm remove {cid} --dir {target.parent}`, or `rm {target}`) and retry"
    if problem is not None:
        raise OutputError(f"refusing shm copy {target}: it {problem}; {advice}")
    if verify:
        problem = _verify_copy(target, root, files, payload, header)
        if problem is not None:
            raise ChecksumError(f"shm copy {target} does not match the dataset ({problem}); {advice}")
    return target


def _each(payload: list[tuple[str, int]], work: Any) -> list[Any]:
    """``work(k)`` for every source file, ``COPY_WORKERS`` files at once (sha256 takes a core per file); the
    results in order, the first failure raised."""
    return map_threads(work, range(len(payload)), COPY_WORKERS, "fastdata-shm")


def _verify_copy(target: Path, root: Path, files: dict[str, dict[str, Any]], payload: list[tuple[str, int]],
                 header: bytes) -> Optional[str]:
    """Hash the copy's part of each source file (that file's own header, read from it, then the copy's
    bytes) against the manifest; what differs, or None."""
    slots = body_offsets(files, payload, len(header))
    with open(target, "rb") as f:
        if f.read(len(header)) != header:
            return "its header differs"
        fd = f.fileno()

        def check(k: int) -> Optional[str]:
            rel, skip = payload[k]
            with open(safe_join(root, rel), "rb") as src:
                h = new_hash()
                h.update(src.read(skip))
            pos = slots[k]
            while pos < slots[k + 1]:
                block = os.pread(fd, min(slots[k + 1] - pos, 16 << 20), pos)
                if not block:
                    return f"it ends before {rel}'s rows"
                h.update(block)
                pos += len(block)
            return None if h.hexdigest() == files[rel][HASH_NAME] else f"{rel}'s rows differ"
        return next((p for p in _each(payload, check) if p is not None), None)


def _copy(root: Path, files: dict[str, dict[str, Any]], payload: list[tuple[str, int]], header: bytes,
          tmp: Path) -> os.stat_result:
    """Write the copy to ``tmp`` (created here, 0600, never through a planted name), each source file into its
    own slot by a worker of its own, hashed as it is read; returns the finished file's stat."""
    try:
        out = open_new(tmp, 0o600)
    except FileExistsError as exc:
        raise OutputError(f"{tmp} appeared before this process created it (planted?): refusing to write through "
                          f"it; remove it and retry") from exc
    except OSError as exc:
        raise disk_error(exc, tmp, FULL_ADVICE) from exc
    slots = body_offsets(files, payload, len(header))
    try:
        with out:  # the close() flush can fail on a full disk too: keep it inside the try
            out.write(header)
            out.flush()
            fd = out.fileno()

            def copy(k: int) -> None:
                rel, skip = payload[k]
                h, pos, at = new_hash(), 0, slots[k]
                for block in iter_blocks(safe_join(root, rel)):
                    h.update(block)
                    body = memoryview(block)[max(0, skip - pos):][:max(0, slots[k + 1] - at)]  # (its slot only)
                    while body:
                        n = os.pwrite(fd, body, at)
                        body, at = body[n:], at + n
                    pos += len(block)
                problem = file_problem(files[rel], pos, h.hexdigest())
                if problem is not None:  # (in a node cache, its copy: said so)
                    raise damaged_error(root / rel, files[rel], problem, pos, cache_advice(root))
            _each(payload, copy)
            return os.fstat(fd)
    except OSError as exc:
        raise disk_error(exc, tmp, FULL_ADVICE) from exc


def list_copies(directory: Optional[Path] = None) -> list[dict[str, Any]]:
    """Every copy in this user's shm folder, with its dataset, size and age: finished ones, and partial ones
    (``"partial"`` says ``"copying"`` while a process holds the copy's lock, else ``"left by a killed copy"``)."""
    d = private_dir(directory, create=False)
    found: dict[str, list[Path]] = {}
    for path in sorted(d.glob(f"{PREFIX}*.npy")) + sorted(d.glob(f"{PREFIX}*.npy.tmp-*")):
        found.setdefault(path.name[len(PREFIX):].split(".", 1)[0], []).append(path)
    out = []
    for cid, paths in found.items():
        try:
            info = json.loads(read_regular(d / f"{PREFIX}{cid}.json"))
        except (OSError, ValueError):
            info = {"id": cid, "dataset": "?"}
        try:
            sizes = {p: os.lstat(p) for p in paths}
        except FileNotFoundError:  # finished (or removed) meanwhile
            continue
        info.update(id=cid, path=str(paths[0]), bytes=sizes[paths[0]].st_size)
        info.setdefault("created", sizes[paths[0]].st_mtime)
        if paths[0].suffix != ".npy":
            info["partial"] = "copying" if _locked(d / f"{PREFIX}{cid}.lock") else "left by a killed copy"
        out.append(info)
    return out


def _locked(lock_path: Path) -> bool:
    """Whether a process holds the copy lock ``lock_path`` (a live copier)."""
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def remove_copies(ids: list[str], directory: Optional[Path] = None) -> list[str]:
    """Delete the named copies, finished or partial (all when ``ids`` is empty); returns the ids removed.
    Processes that still map a copy keep reading it until they exit (the kernel frees it then); a copier
    still running fails with an error naming the file."""
    d = private_dir(directory, create=False)
    removed = []
    for info in list_copies(d):
        if not ids or info["id"] in ids:
            cid = info["id"]
            for path in [*d.glob(f"{PREFIX}{cid}.*.tmp-*"), *(d / f"{PREFIX}{cid}{suffix}" for suffix in
                                                                (".npy", ".json", ".lock"))]:
                _remove(path)
            removed.append(cid)
    return removed


def _remove(path: Path) -> None:
    """Delete what is at a copy's name in this user's folder: a file, a link (never followed) or a folder
    someone put there (its tree: `shutil.rmtree` follows no link)."""
    try:
        if stat.S_ISDIR(os.lstat(path).st_mode):
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise OutputError(f"cannot remove {path}: {exc.strerror}; remove it by hand (rm -r {path})") from exc
