"""``fastdata push``: a finished dataset folder copied into object storage, manifest last.

NOTE [push]: data files go up first, each followed by a small marker ``.fastdata-push/<name>.sha256``
(object stores write whole objects: a marker exists only after its object is complete; an object's old
marker is deleted before the object is put, so a push killed between the two never leaves a marker naming
other bytes); the manifest goes last, so a reader never sees a half-uploaded dataset. A rerun skips objects
whose size and marker match. A push over another version first deletes that version's manifest: its objects
are about to be replaced, and a reader meanwhile must find no manifest ("push not finished"), not the old one
beside new objects (which passed for complete and failed every job at its first replaced shard).
"""
from __future__ import annotations

import posixpath
from pathlib import Path
from typing import Any, Callable, Optional, Union

from .._io import HASH_NAME, disk_error, map_threads, scrub
from ..formats.manifest import MANIFEST_NAME
from .object_store import RETRY_SECONDS, Retry, filesystem, no_bucket, object_path, pipe_file, put_file

PUSH_MARKERS = ".fastdata-push"


def push(local: Union[str, Path], url: str, *, workers: int = 8, storage_options: Optional[dict[str, Any]] = None,
         retry_seconds: float = RETRY_SECONDS, progress: Optional[Callable[[int], None]] = None) -> dict[str, int]:
    """Upload the finished dataset ``local`` to ``url`` (see NOTE [push]).

    Args:
        local: The dataset folder.
        url: The fsspec URL to upload to.
        workers: Parallel uploads.
        storage_options: Options passed to fsspec (credentials, endpoint).
        retry_seconds: How long the store may fail before the push gives up (NOTE [retry budget]); a rerun
            skips what is uploaded.
        progress: Called with the bytes of each object done.

    Returns:
        Counts of objects ``uploaded`` and ``skipped`` (already there with the same size and checksum).
    """
    from ..formats.manifest import load_manifest
    from ..formats.integrity import require_intact

    local = Path(local)
    manifest = load_manifest(local)
    retry = Retry(retry_seconds)
    fs, root = filesystem(url.rstrip("/"), storage_options)
    counts = {"uploaded": 0, "skipped": 0}
    folders = _folders(fs)

    def one(entry: dict[str, Any]) -> None:
        name = entry["path"]
        target, marker = object_path(root, name), object_path(root, f"{PUSH_MARKERS}/{name}.{HASH_NAME}")
        folders(target, marker)
        if retry(f"{url}/{name}", lambda: _already_there(fs, target, marker, entry)):
            counts["skipped"] += 1
            if progress is not None:
                progress(int(entry["bytes"]))
            return
        require_intact(local, entry)  # never upload a file that differs from its own manifest
        retry(f"{url}/{name}", lambda: _drop(fs, marker), "upload")  # (before the object: NOTE [push])
        retry(f"{url}/{name}", lambda: put_file(fs, local / name, target), "upload")
        retry(f"{url}/{name}", lambda: pipe_file(fs, marker, entry[HASH_NAME].encode()), "upload")
        counts["uploaded"] += 1
        if progress is not None:
            progress(int(entry["bytes"]))

    data = (local / MANIFEST_NAME).read_bytes()
    target = object_path(root, MANIFEST_NAME)
    try:
        if retry(f"{url}/{MANIFEST_NAME}", lambda: _stored(fs, target)) not in (None, data):  # another version
            retry(f"{url}/{MANIFEST_NAME}", lambda: _drop(fs, target), "upload")  # (before any object: NOTE [push])
        map_threads(one, manifest["files"], max(1, workers), "fastdata-push")
        retry(f"{url}/{MANIFEST_NAME}", lambda: pipe_file(fs, target, data), "upload")
    except FileNotFoundError as exc:  # s3fs: no such bucket (a local file missing is refused by require_intact)
        raise no_bucket(f"push to {scrub(url)}", exc) from None
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


def _stored(fs: Any, key: str) -> Optional[bytes]:
    """The object at ``key``, or None where there is none (a first push)."""
    try:
        return fs.cat_file(key)
    except FileNotFoundError:
        return None


def _drop(fs: Any, key: str) -> None:
    try:
        fs.rm_file(key)
    except FileNotFoundError:
        pass


def _already_there(fs: Any, target: str, marker: str, entry: dict[str, Any]) -> bool:
    try:
        if int(fs.info(target).get("size", -1)) != int(entry["bytes"]):
            return False
        return fs.cat_file(marker).decode(errors="replace") == entry[HASH_NAME]
    except FileNotFoundError:
        return False
