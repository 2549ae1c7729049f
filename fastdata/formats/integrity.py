"""A dataset's files checked against its manifest: sizes always, sha256 digests where asked (readers,
`verify`, the shm copy, the preprocess journal)."""
from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any, Callable, Collection, Optional

from .._io import HASH_NAME, HASH_WORKERS, contained_stat, folder_prefix, hash_file, map_threads, safe_join
from ..errors import ChecksumError, ConfigError, FormatError
from .lmdb_envs import CALLS, Holds
from .lmdb_store import lmdb_shards
from .manifest import IMAGES_LMDB, MANIFEST_NAME, load_columns, shard_starts
from .rows import column


# NOTE [file check]: every reader, `fastdata verify`, the shm copy and the preprocess journal compare a file
# with its manifest entry through `file_problem`; callers that already stream the bytes (a load into RAM,
# the shm copy) pass the digest they computed on the way, so no file is read twice to be checked.
def file_problem(entry: dict[str, Any], size: Optional[int], digest: Optional[str] = None) -> Optional[str]:
    """What is wrong with a file of ``size`` bytes (None: absent) hashing to ``digest`` (None: not hashed)
    against its manifest ``entry``: ``"missing"``, ``"size"``, ``"hash"``, or None when it matches."""
    if size is None:
        return "missing"
    if size != int(entry["bytes"]):
        return "size"
    if digest is not None and digest != entry[HASH_NAME]:
        return "hash"
    return None


def check_file(root: Path, entry: dict[str, Any], *, hashed: bool = True,
               progress: Optional[Callable[[int], None]] = None) -> Optional[str]:
    """`file_problem` for ``root / entry["path"]``: its size, and its sha256 when ``hashed``."""
    st = contained_stat(root, entry["path"])
    size = st.st_size if st is not None and stat.S_ISREG(st.st_mode) else None
    digest = None
    if hashed and size == entry["bytes"]:
        try:
            digest = hash_file(Path(root) / entry["path"], progress)
        except FileNotFoundError:  # gone since its stat (a node cache evicted it): missing
            size = None
    if progress is not None and size is not None and digest is None and hashed:
        progress(int(entry["bytes"]))  # a file refused on its size still counts as done for the bar
    return file_problem(entry, size, digest)


def damaged_error(path: Path, entry: dict[str, Any], problem: str, size: Optional[int] = None,
                  advice: Optional[str] = None) -> FormatError:
    """The error a reader raises for a `file_problem`; it ends with what to do: ``advice`` (default: re-run
    `fastdata preprocess`, a damaged file checked with `fastdata verify` first; a node cache says its own)."""
    local = advice is None
    advice = "re-run `fastdata preprocess`" if advice is None else advice
    if problem == "missing":
        return FormatError(f"{path} is missing: the dataset is incomplete; {advice}")
    if problem == "size":
        return ChecksumError(f"{path} has {size} bytes but the manifest says {entry['bytes']}: truncated or "
                             f"replaced; {advice}")
    return ChecksumError(f"{path} does not match its checksum in the manifest (modified or damaged): "
                         f"{'run `fastdata verify` and ' if local else ''}{advice}")


def require_intact(root: Path, entry: dict[str, Any], *, hashed: bool = True, advice: Optional[str] = None) -> None:
    """Raise `damaged_error` (with ``advice``) unless ``root / entry["path"]`` matches its entry."""
    problem = check_file(root, entry, hashed=hashed)
    if problem is not None:
        raise file_error(root, entry, problem, advice)


def file_error(root: Path, entry: dict[str, Any], problem: str, advice: Optional[str] = None) -> FormatError:
    """`damaged_error` for the `check_file` problem of ``root / entry["path"]``, with its size on disk."""
    path = safe_join(root, entry["path"])
    return damaged_error(path, entry, problem, path.stat().st_size if problem == "size" else None, advice)


def verify(root: Path | str, progress: Optional[Callable[[int], None]] = None, *, partial: bool = False,
           workers: Optional[int] = None) -> list[str]:
    """Re-hash every file a dataset's manifest lists, as ``fastdata verify`` does.

    Args:
        root: The dataset folder.
        progress: Called with the bytes of each block hashed, from the worker threads, for a progress bar
            (default None).
        partial: The folder is a node cache of a remote dataset (default False).
            A file not (or no longer) cached there is fetched and checked when read, so absent files are not
            problems.
        workers: Files hashed at once (default: this machine's cores, at most 8): sha256 takes a core per
            file, and a disk array or NVMe drive reads faster than one core hashes.

    Returns:
        One line per problem (a file missing, of the wrong size, or whose checksum differs), in the
        manifest's order, then (LMDB datasets) one per intact store whose record count is not the manifest's;
        empty when the dataset is intact.

    Raises:
        ConfigError: ``workers`` is not a positive integer.
        FormatError: ``root`` is not a dataset folder, or its manifest is damaged.
        VersionError: The manifest was written by a format version this fastdata cannot read.

    Examples:
        >>> problems = verify("data/train")
        >>> problems  # e.g. ["images-00003.npy: sha256 mismatch (file was modified or damaged)"]
        []
    """
    workers = HASH_WORKERS if workers is None else workers
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ConfigError(f"workers must be a positive integer, got workers={workers!r}")
    root = Path(root)
    before = _identity(root)
    manifest = load_columns(root)  # (its files as columns: a million entries are not a million dicts at once)

    def problem_of(entry: dict[str, Any]) -> Optional[str]:
        problem = check_file(root, entry, progress=progress)
        if problem == "missing":
            return None if partial else f"{entry['path']}: missing"
        if problem == "size":
            try:
                size = safe_join(root, entry["path"]).stat().st_size
            except FileNotFoundError:  # (evicted since: missing)
                return None if partial else f"{entry['path']}: missing"
            return f"{entry['path']}: {size} bytes on disk, manifest says {entry['bytes']} (truncated or replaced)"
        if problem == "hash":
            return f"{entry['path']}: {HASH_NAME} mismatch (file was modified or damaged)"
        return None
    found = map_threads(problem_of, manifest["files"], workers, "fastdata-verify")
    problems = [p for p in found if p is not None]
    if manifest["format"] == IMAGES_LMDB:  # (the stores' bytes are as written: are their counts the manifest's?)
        intact = {path for path, p in zip(column(manifest["files"], "path"), found) if p is None}
        problems += record_count_problems(root, manifest, intact)
    if problems and _identity(root) != before:  # its files are another dataset's now: none of them is damage
        raise FormatError(f"{root} was replaced while it was verified (a `fastdata preprocess --overwrite` or a new "
                          "copy): run `fastdata verify` again")
    return problems


def record_count_problems(root: Path, manifest: dict[str, Any], intact: Collection[str]) -> list[str]:
    """An LMDB dataset's stores among ``intact`` (paths whose bytes matched the manifest) whose record counts
    are not the manifest's, one line each: its checksums can all match while its counts were edited, and a
    reader then refuses the store (`LmdbReader`) or reads another shard's rows. One read-only open a store,
    through the environments the readers share (NOTE [shared environments] in lmdb_envs.py)."""
    import lmdb

    holds = Holds(None, folder_prefix(root))
    out = []
    starts = shard_starts(manifest)
    for s, name in enumerate(lmdb_shards(manifest)):
        if name not in intact or not os.path.isfile(safe_join(root, name)):  # (partial: evicted meanwhile)
            continue
        path = str(safe_join(root, name))
        want = int(starts[s + 1] - starts[s])
        try:
            with CALLS:
                have = int(holds.env(path)[0].stat()["entries"])
        except (lmdb.Error, FormatError) as exc:  # (FormatError: a link that leaves the folder)
            out.append(f"{name}: cannot be read as an LMDB store ({type(exc).__name__}: {exc})")
            continue
        finally:
            holds.release(Path(path))
        if have != want:
            out.append(f"{name}: holds {have} records, the manifest says {want} (the manifest is damaged: re-run "
                       "`fastdata preprocess`, or restore the dataset's own manifest.json)")
    return out


def _identity(root: Path) -> Optional[tuple[int, ...]]:
    """The folder and its manifest as they are now (an overwrite swaps the folder, a rewrite the manifest)."""
    try:
        folder, m = os.stat(root), os.stat(root / MANIFEST_NAME)
    except OSError:
        return None
    return folder.st_dev, folder.st_ino, m.st_ino, m.st_size, m.st_mtime_ns
