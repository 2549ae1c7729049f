"""One copy of a dataset per machine in ``/dev/shm``, shared by every rank, worker and job on the node.

The copy is named after the dataset's checksums, so two jobs on the same data share it and a changed
dataset gets a new one. The first process copies under an exclusive ``flock`` (released by the kernel
if it dies), checking every byte against the manifest's sha256 as it goes, and renames when complete;
the others wait on the lock, then map the finished file. Copies outlive the job on purpose (the next
run starts instantly): ``fastdata shm list`` / ``fastdata shm remove`` manage them.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Optional

from .._io import HASH_NAME, disk_error, fsync_dir, iter_blocks, new_hash, safe_join
from ..errors import OutputError
from ..formats.manifest import damaged_error, file_problem

PREFIX = "fastdata-"


def shm_dir(override: Optional[Path | str] = None) -> Path:
    return Path(override or os.environ.get("FASTDATA_SHM_DIR", "/dev/shm"))


def copy_id(manifest: dict[str, Any], key: str = "") -> str:
    """16 hex digits naming the dataset's bytes (hash of its files' checksums; ``key`` names a part of it)."""
    h = hashlib.sha256(key.encode())
    for f in manifest["files"]:
        h.update(f"{f['path']}:{f[HASH_NAME]}\n".encode())
    return h.hexdigest()[:16]


def ensure_copy(root: Path, manifest: dict[str, Any], payload: list[tuple[str, int]], header: bytes,
                directory: Optional[Path] = None, key: str = "") -> Path:
    """Return the path of the node's copy, making it first if no process has yet.

    ``payload`` lists ``(manifest file path, bytes to skip at its start)``: the bodies are concatenated
    after ``header`` (an ``.npy`` header for the whole array), so the copy is itself a plain ``.npy``.
    """
    d = shm_dir(directory)
    cid = copy_id(manifest, key)
    target = d / f"{PREFIX}{cid}.npy"
    if target.exists():
        return target
    lock_path = d / f"{PREFIX}{cid}.lock"
    try:
        lock = open(lock_path, "a+")
    except OSError as exc:
        raise OutputError(f"cannot create {lock_path}: {exc.strerror}; is {d} a writable tmpfs?") from exc
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the others wait here while the first one copies
        if target.exists():
            return target
        for stale in d.glob(f"{PREFIX}{cid}.npy.tmp-*"):  # left by a process that died mid-copy
            stale.unlink(missing_ok=True)
        files = {f["path"]: f for f in manifest["files"]}
        needed = len(header) + sum(files[p]["bytes"] - skip for p, skip in payload)
        free = shutil.disk_usage(d).free
        if needed > free:
            raise OutputError(f"{d} has {free / 2**20:,.0f} MiB free but this dataset needs {needed / 2**20:,.0f} MiB: "
                              f"free space there (`fastdata shm list` / `fastdata shm remove`), enlarge it, or use "
                              f"storage='mmap'")
        tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
        try:
            _copy(root, files, payload, header, tmp)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        info = {"id": cid, "dataset": str(Path(root).resolve()), "bytes": needed, "created": time.time(),
                "format": manifest["format"]}
        (d / f"{PREFIX}{cid}.json").write_text(json.dumps(info))
        os.replace(tmp, target)
        fsync_dir(d)
    return target


def _copy(root: Path, files: dict[str, dict[str, Any]], payload: list[tuple[str, int]], header: bytes,
          tmp: Path) -> None:
    try:
        with open(tmp, "wb") as out:  # the close() flush can fail on a full disk too: keep it inside the try
            out.write(header)
            for rel, skip in payload:
                h, pos = new_hash(), 0
                for block in iter_blocks(safe_join(root, rel)):
                    h.update(block)
                    out.write(block[max(0, skip - pos):])
                    pos += len(block)
                problem = file_problem(files[rel], pos, h.hexdigest())
                if problem is not None:
                    raise damaged_error(root / rel, files[rel], problem, pos)
    except OSError as exc:
        raise disk_error(exc, tmp) from exc


def list_copies(directory: Optional[Path] = None) -> list[dict[str, Any]]:
    """Every finished copy in the shm folder, with its dataset, size and age."""
    d = shm_dir(directory)
    out = []
    for npy in sorted(d.glob(f"{PREFIX}*.npy")):
        info_path = npy.with_suffix(".json")
        try:
            info = json.loads(info_path.read_text())
        except (OSError, ValueError):
            info = {"id": npy.stem[len(PREFIX):], "dataset": "?", "created": npy.stat().st_mtime}
        info.update(path=str(npy), bytes=npy.stat().st_size)
        out.append(info)
    return out


def remove_copies(ids: list[str], directory: Optional[Path] = None) -> list[str]:
    """Delete the named copies (all when ``ids`` is empty); returns the ids removed. Processes that
    still map a copy keep reading it until they exit (the kernel frees it then)."""
    d = shm_dir(directory)
    removed = []
    for info in list_copies(d):
        if not ids or info["id"] in ids:
            for suffix in (".npy", ".json", ".lock"):
                (d / f"{PREFIX}{info['id']}{suffix}").unlink(missing_ok=True)
            removed.append(info["id"])
    return removed
