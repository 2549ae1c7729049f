"""The journal of an unfinished preprocess run: which units are complete, so a rerun resumes after them.

It lives in ``OUT/.fastdata-partial/journal.jsonl``: a first line with the run's fingerprint, then one
line appended (and fsynced) per completed unit with the files skipped before its end, so recording a unit
costs the same at the millionth shard as at the first. A line torn by a crash is ignored; a resumed run
rewrites the file with the units still intact. It is removed once the manifest is written. A unit is
trusted on resume only if its files still have their sizes (the newest ones: their sha256, `Journal.keep_intact`).

NOTE [one writer]: a run holds OUT (``flock`` on the folder) from its first check to its manifest, so two
runs never write the same temporary files: a second one (every rank of a torchrun job calling the
preprocess, two terminals) says it waits, then finds OUT finished (a rerun with the same arguments returns
its manifest) or resumes what the first left. The lock goes with the process that holds it, ``kill -9``
included: forked workers close their inherited copy, so an orphaned worker never holds OUT. A run that
waited checks, once it holds the lock, that the folder it locked is still the one at OUT (an overwrite
swaps another in: NOTE [overwrite]); if not, it waits on the new one. On a file system without ``flock``
on folders (some NFS mounts) runs are not serialised.

NOTE [overwrite]: ``--overwrite`` never deletes a finished dataset before its replacement exists.
1. The new dataset is built in ``.NAME.fastdata-next`` beside OUT (same parent, so the same file system),
   with its own journal: a killed overwrite leaves OUT as it was, and rerunning it resumes there.
2. Once that folder holds its manifest, the two folders are exchanged in one ``renameat2(RENAME_EXCHANGE)``
   (Linux); the old dataset, now under the staging name, is renamed ``.NAME.fastdata-old`` and deleted.
   A ``.fastdata-old`` folder is only ever garbage, removed by the next run that holds OUT.
3. The run holds both folders (NOTE [one writer]) through the exchange and the deletion, so a run waiting
   on OUT finds the new dataset.
4. Where the folders cannot be exchanged (no ``renameat2``, a file system without the flag) OUT is renamed
   away and the new folder renamed in: a crash between those two renames leaves OUT missing, the old
   dataset in ``.NAME.fastdata-old`` and the new one in ``.NAME.fastdata-next``. Where nothing can be made
   beside OUT (its parent read-only, or OUT a mount point) the old dataset is deleted first, as a warning says.
5. Both names beside OUT are used only when nothing or a folder of this user is there (`_check_beside`): in a
   shared parent (/tmp) another user could plant a folder there to read the new dataset, or a link to have the
   clean-up delete and overwrite another dataset. Anything else is refused, before any work; the staging folder
   is made 0700 and given OUT's mode just before the exchange.
"""
from __future__ import annotations

import bisect
import contextlib
import ctypes
import errno
import fcntl
import json
import logging
import os
import re
import shutil
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

from .._io import LOCKS_HELD, disk_error, fsync_dir, make_folder, write_bytes_atomic
from ..errors import OutputError
from ..formats.manifest import MANIFEST_NAME, PARTIAL_DIR
from ..formats.integrity import check_file

log = logging.getLogger(__name__)
_held = LOCKS_HELD  # folder descriptors locked by this process, let go in forked children (NOTE [locks across fork])

JOURNAL_NAME = "journal.jsonl"
_HASHED_UNITS = 2  # the newest units hashed on resume; the others' sizes are checked (`Journal.keep_intact`)
# What this module may delete in OUT when overwriting: its own outputs and temporaries, nothing else.
OWNED = re.compile(r"^(manifest\.json|images-\d{5,}\.npy|labels-\d{5,}\.npy|images(-\d{5,})?\.lmdb|labels\.npy|"
                    r"field\.[a-z][a-z0-9_]*(\.offsets)?-\d{5,}\.npy|"
                    r"(train|val)-\d{5,}(-\d{6,})?\.npy|(train|val)-docs(-\d{5,}-\d{6,})?\.npy|"
                    + re.escape(PARTIAL_DIR) + r")(\.tmp|\.tmp\.body)?$")

_UNIT_LABELS = re.compile(r"^labels-\d{5,}\.npy$")  # an LMDB run's per-shard labels: only its journal needs them


def left_after_manifest(names: list[str], manifest: dict[str, Any]) -> list[str]:
    """Of ``names`` (OUT's), what a run killed after writing its manifest, before its clean-up, left: the
    journal and the per-shard labels files the manifest does not name. An uninterrupted run leaves neither."""
    kept = {f.get("path") for f in manifest.get("files", []) if isinstance(f, dict)}
    return [n for n in names if n == PARTIAL_DIR or n.startswith(PARTIAL_DIR + "/")
            or (_UNIT_LABELS.match(n) and n not in kept)]


@dataclass
class Journal:
    fingerprint: str
    units: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)

    @property
    def source_end(self) -> int:
        return self.units[-1]["source_end"] if self.units else 0

    @property
    def num_samples(self) -> int:
        return sum(u["samples"] for u in self.units)

    def add(self, unit: dict[str, Any], skipped: list[dict[str, Any]], partial: Path) -> None:
        """Record a completed unit and the skipped files before its end: one line appended and made durable.
        ``skipped``: the run's, in source order, beginning with this journal's (its cost is the new ones')."""
        assert skipped is not self.skipped, "pass the run's own list, which begins with a copy of the journal's"
        self.units.append(unit)
        end = len(self.skipped)
        while end < len(skipped) and skipped[end]["index"] < unit["source_end"]:
            end += 1
        new = skipped[len(self.skipped):end]
        self.skipped.extend(new)
        self._write({"unit": unit, "skipped": new}, partial)

    def _write(self, entry: dict[str, Any], partial: Path) -> None:
        """Make one unit's entry durable: a line appended to ``partial/journal.jsonl`` and fsynced."""
        path = partial / JOURNAL_NAME
        try:  # (never appended through a link planted at its name)
            flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
            with os.fdopen(os.open(path, flags, 0o666), "ab") as f:
                f.write(_line(entry))
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            raise disk_error(exc, path) from exc

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` units only, and the skipped files before their end."""
        del self.units[n:]
        self.skipped = [s for s in self.skipped if s["index"] < self.source_end]

    def save(self, partial: Path) -> None:
        """Write the whole journal afresh (atomically): a new run, or one resumed with fewer units."""
        lines = [_line({"fingerprint": self.fingerprint})]
        skipped = sorted(self.skipped, key=lambda s: s["index"])  # (in order already: a linear check)
        at = [s["index"] for s in skipped]
        end = 0
        for unit in self.units:  # each unit's skipped files a slice: 10^6 units x 10^6 skipped is not a product
            lo, hi = bisect.bisect_left(at, end), bisect.bisect_left(at, unit["source_end"])
            lines.append(_line({"unit": unit, "skipped": skipped[lo:hi]}))
            end = unit["source_end"]
        write_bytes_atomic(partial / JOURNAL_NAME, b"".join(lines))

    def keep_intact(self, out: Path) -> None:
        """Drop units (and all after them) whose files are missing or changed since they were recorded: every
        file's size is checked, and the newest `_HASHED_UNITS` units' files are hashed too. A unit's files
        were fsynced and renamed whole before its line was, so only a file system that lost the last writes
        (power lost) could leave the newest ones wrong; hashing every file again would read all the run has
        written, on one core (hours at 100 TB), before a resume starts. The journal's sha256 goes into the
        manifest, so a file changed later at the same size is still found by ``fastdata verify`` and by
        readers that hash (``storage="ram"``, ``verify=True``)."""
        tail = len(self.units) - _HASHED_UNITS
        for n, unit in enumerate(self.units):
            for f in unit["files"]:
                if check_file(out, f, hashed=n >= tail) is not None:
                    self.truncate(n)
                    return


def _line(obj: dict[str, Any]) -> bytes:
    return (json.dumps(obj, sort_keys=True, separators=(",", ":")) + "\n").encode()


def load(partial: Path) -> Journal | None:
    """The journal in ``partial`` (None when there is none or its first line is unreadable: start afresh);
    a last line torn by a crash is dropped, with the unit it was recording."""
    try:
        with open(partial / JOURNAL_NAME, "rb") as f:
            jr = Journal(json.loads(f.readline())["fingerprint"])
            for raw in f:
                try:
                    entry = json.loads(raw)
                    unit, skipped = entry["unit"], entry["skipped"]
                except (ValueError, KeyError, TypeError):
                    break
                jr.units.append(unit)
                jr.skipped.extend(skipped)
        return jr
    except (OSError, ValueError, KeyError, TypeError):
        return None


def partial_dir(out: Path) -> Path:
    return out / PARTIAL_DIR


def remove_partial(out: Path) -> None:
    partial = partial_dir(out)
    if partial.is_symlink():  # (never followed: rmtree refuses a link, and the journal would be written there)
        partial.unlink()
    shutil.rmtree(partial, ignore_errors=True)


def read_fingerprint(out: Path) -> str | None:
    try:
        return json.loads((out / MANIFEST_NAME).read_text()).get("fingerprint")
    except (OSError, ValueError, AttributeError):
        return None


@contextlib.contextmanager
def exclusive(out: Path) -> Iterator[None]:
    """OUT made if needed, and held by this run until the block ends (NOTE [one writer])."""
    while True:
        make_folder(out, "output folder", f"output {out} exists and is not a folder: choose a new or empty folder")
        fd = os.open(out, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
        _held.add(fd)
        try:
            _lock(fd, out)
            if _is_at(fd, out):
                break
        except BaseException:
            _held.discard(fd)
            os.close(fd)
            raise
        _held.discard(fd)  # OUT was swapped (NOTE [overwrite]) or removed while we waited: hold what is there now
        os.close(fd)
    try:
        yield
    finally:
        _held.discard(fd)
        os.close(fd)


def _lock(fd: int, out: Path) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        log.warning("%s is being written by another fastdata preprocess: waiting for it to end", out)
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError as exc:  # no flock on this file system's folders: run unserialised
        if exc.errno not in (errno.EBADF, errno.EINVAL, errno.ENOLCK, errno.EOPNOTSUPP):
            raise


def _is_at(fd: int, path: Path) -> bool:
    """Whether the folder open as ``fd`` is still the one at ``path``."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)


def resume(out: Path, fingerprint: str, continues: tuple[str, ...] = ()) -> tuple[Journal, Path]:
    """The journal of OUT's unfinished run with this fingerprint (or one of ``continues``: a run whose
    finished units are this one's, taken over), its units checked (a fresh one otherwise), and the partial
    folder, made."""
    partial = partial_dir(out)
    if partial.is_symlink():  # a link at the journal's own name is never this run's journal
        remove_partial(out)
    jr = load(partial)
    if jr is not None and jr.fingerprint in continues:
        jr.fingerprint = fingerprint  # (saved below: this run's from now on)
    if jr is None or jr.fingerprint != fingerprint:
        remove_partial(out)
        jr = Journal(fingerprint)
    try:
        partial.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise disk_error(exc, partial) from exc
    jr.keep_intact(out)
    jr.save(partial)  # compact: the intact units only, no torn line
    return jr, partial


def prepare_output(out: Path, fingerprint: str, overwrite: bool, continues: tuple[str, ...] = ()
                   ) -> Optional[dict[str, Any]]:
    """Make OUT (made and held by `exclusive`) usable; returns the existing manifest when OUT is already
    finished with these arguments. An unfinished run of one of ``continues`` is taken over (`resume`)."""
    names = [p.name for p in out.iterdir()]
    if not names:
        return None
    foreign = [n for n in names if not OWNED.match(n)]
    ours = MANIFEST_NAME in names or PARTIAL_DIR in names
    if foreign and not ours:
        raise OutputError(f"output {out} is not empty and is not a fastdata dataset (it holds {foreign[:3]}): "
                          "choose a new or empty folder")
    if MANIFEST_NAME in names and not overwrite:
        if read_fingerprint(out) == fingerprint:
            manifest = json.loads((out / MANIFEST_NAME).read_text())
            if PARTIAL_DIR in names:  # killed after its manifest: the clean-up it did not get to
                for name in left_after_manifest(names, manifest):
                    remove_partial(out) if name == PARTIAL_DIR else (out / name).unlink(missing_ok=True)
                fsync_dir(out)
            return manifest
        raise OutputError(f"{out} already holds a dataset made from another source or with other parameters: "
                          "pass --overwrite to replace it, or choose another output folder")
    pending = load(partial_dir(out))
    if pending is not None and pending.fingerprint not in (fingerprint, *continues) and not overwrite:
        raise OutputError(f"{out} holds an unfinished run with another source or other parameters: rerun that "
                          "command to finish it, or pass --overwrite to start this one")
    if overwrite:
        for name in names:
            if OWNED.match(name):
                p = out / name
                if name == PARTIAL_DIR:
                    remove_partial(out)  # (a link there unlinked, never followed)
                else:
                    p.unlink() if p.is_symlink() or not p.is_dir() else shutil.rmtree(p)
    return None


def check_writable(out: Path) -> None:
    """Refuse an OUT this process cannot write before any work (a tar source is read whole to be listed): a
    file is made and removed in OUT, or in its nearest existing parent when OUT is still to be made.

    Raises:
        OutputError: naming OUT and why, and saying what to do.
    """
    if out.exists() and not out.is_dir():  # the messages of exclusive(), which makes OUT
        raise OutputError(f"output {out} exists and is not a folder: choose a new or empty folder")
    where = Path(out).absolute()
    while not where.exists() and where != where.parent:
        where = where.parent
    if not where.is_dir():
        raise OutputError(f"cannot create output folder {out}: {os.strerror(errno.ENOTDIR)} ({where} is a file)")
    try:
        fd, probe = tempfile.mkstemp(prefix=".fastdata-probe-", dir=where)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise OutputError(f"cannot write the output folder {out} ({exc.strerror or exc} at {where}): choose a "
                          "folder you can write to") from exc


@dataclass
class Target:
    """Where a run writes: ``folder`` is OUT itself, or its staging folder beside it (NOTE [overwrite]);
    ``done`` is the manifest when the dataset asked for is already complete."""

    folder: Path
    done: Optional[dict[str, Any]]


def staging_dir(out: Path) -> Path:
    """The folder an overwrite builds in, beside OUT (NOTE [overwrite])."""
    real = out.resolve()
    return real.parent / f".{real.name}.fastdata-next"


def _trash_dir(out: Path) -> Path:
    real = out.resolve()
    return real.parent / f".{real.name}.fastdata-old"


@contextlib.contextmanager
def output(out: Path, fingerprint: str, overwrite: bool, continues: tuple[str, ...] = ()) -> Iterator[Target]:
    """Hold OUT (NOTE [one writer]) and say where to write; a staged dataset whose manifest exists when the
    block ends without an error replaces OUT (NOTE [overwrite]).

    Args:
        out: the dataset folder.
        fingerprint: the run's arguments and source, as the manifest records them.
        overwrite: replace a dataset made with other arguments.
        continues: the fingerprints of unfinished runs this one may take over (their finished units are the
            ones it writes: ``--on-error fail``'s, for ``skip``).

    Yields:
        The `Target`: a run with ``done`` set returns it; otherwise it resumes the journal in
        ``folder`` and writes its manifest there.

    Raises:
        OutputError: OUT holds something else, or a dataset made otherwise and ``overwrite`` is not set, or
            an overwrite's name beside OUT holds a link or another user's folder (NOTE [overwrite] rule 5).
    """
    with exclusive(out):
        if (out / MANIFEST_NAME).exists() and _not_ours(_trash_dir(out)) is None:
            shutil.rmtree(_trash_dir(out), ignore_errors=True)  # the last overwrite's old dataset (rule 2)
        staging = staging_dir(out)
        if not (overwrite and (out / MANIFEST_NAME).exists() and _can_stage(out)):
            if overwrite and (out / MANIFEST_NAME).exists():
                log.warning("cannot build beside %s (its parent is not writable, or it is a mount point): deleting "
                            "the old dataset before the new one exists", out)
            yield Target(out, prepare_output(out, fingerprint, overwrite, continues))
            return
        _check_beside(_trash_dir(out), out, "moves the old dataset to")
        try:
            os.mkdir(staging, 0o700)  # (rule 5; mkdir makes nothing through a link at the name)
        except FileExistsError:
            pass
        except OSError as exc:
            raise disk_error(exc, staging) from exc
        _check_beside(staging, out, "builds the new dataset in")  # (after mkdir: what is there now is judged)
        with exclusive(staging):
            try:
                done = prepare_output(staging, fingerprint, overwrite=False, continues=continues)
            except OutputError:  # work towards another dataset, or an old one left by a kill (rule 2): ours to drop
                done = prepare_output(staging, fingerprint, overwrite=True)
            yield Target(staging, done)
            if (staging / MANIFEST_NAME).exists():
                _swap(out, staging)


def _not_ours(path: Path) -> Optional[str]:
    """Why the name ``path`` beside OUT is not this user's own folder; None when it is, or when nothing is there."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(info.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(info.st_mode):
        return "is not a folder"
    if info.st_uid != os.geteuid():
        return f"is a folder of user {info.st_uid}, not of this user ({os.geteuid()})"
    return None


def _check_beside(path: Path, out: Path, what: str) -> None:
    """Refuse a name beside OUT that an overwrite uses when something not of this user's making is there
    (NOTE [overwrite] rule 5); ``what`` says what the overwrite does with it."""
    why = _not_ours(path)
    if why is not None:
        raise OutputError(f"{path} {why}: --overwrite of {out} {what} it, and someone may have put it there to read "
                          f"or replace what is written; remove it (`rm -r {path}`, as its owner or root) and rerun, "
                          "or choose another OUT")


def _can_stage(out: Path) -> bool:
    real = out.resolve()
    try:
        return os.stat(real.parent).st_dev == os.stat(real).st_dev and os.access(real.parent, os.W_OK | os.X_OK)
    except OSError:
        return False


def _swap(out: Path, staging: Path) -> None:
    """Put the complete dataset in ``staging`` at OUT and delete the old one (NOTE [overwrite] rule 2)."""
    real, trash = out.resolve(), _trash_dir(out)
    _check_beside(trash, out, "moves the old dataset to")  # (again: planted while the new one was built)
    shutil.rmtree(trash, ignore_errors=True)
    try:
        os.chmod(staging, stat.S_IMODE(os.stat(real).st_mode))  # (made 0700: rule 5) the dataset keeps OUT's mode
        exchanged = _exchange(staging, real)
        if not exchanged:  # rule 4
            os.replace(real, trash)
            try:
                os.replace(staging, real)
            except OSError:
                os.replace(trash, real)  # the old dataset back in place
                raise
        fsync_dir(real.parent)
    except OSError as exc:
        raise OutputError(f"cannot move the new dataset from {staging} to {out}: {exc.strerror or exc}; the old "
                          "dataset is still there: rerun the same command to try again") from exc
    old = staging if exchanged else trash  # the old dataset, now under the staging name or the trash's
    with contextlib.suppress(OSError):
        if old == staging:
            os.replace(staging, trash)  # so that a kill while it is deleted leaves garbage by its name only
            old = trash
    shutil.rmtree(old, ignore_errors=True)


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap two folders atomically (``renameat2(RENAME_EXCHANGE)``); False where that cannot be done here."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a))
