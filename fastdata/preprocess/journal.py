"""The journal of an unfinished preprocess run: which units are complete, so a rerun resumes after them.

It lives in ``OUT/.fastdata-partial/journal.json``, rewritten atomically after every completed unit, and
is removed once the manifest is written. A unit is trusted on resume only if its files still hash right.

NOTE [one writer]: a run holds OUT (``flock`` on the folder) from its first check to its manifest, so two
runs never write the same temporary files: a second one (every rank of a torchrun job calling the
preprocess, two terminals) says it waits, then finds OUT finished (a rerun with the same arguments returns
its manifest) or resumes what the first left. The lock goes with the process that holds it, ``kill -9``
included: forked workers close their inherited copy, so an orphaned worker never holds OUT. On a file
system without ``flock`` on folders (some NFS mounts) runs are not serialised.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

from .._io import disk_error, make_folder, write_json_atomic
from ..errors import OutputError
from ..formats.manifest import MANIFEST_NAME, PARTIAL_DIR, check_file

log = logging.getLogger(__name__)
_held: set[int] = set()  # folder descriptors locked by this process (NOTE [one writer])


def _forget_in_child() -> None:
    """In a forked child: close the inherited lock descriptors, so that only the holder keeps OUT locked."""
    for fd in list(_held):
        with contextlib.suppress(OSError):
            os.close(fd)
    _held.clear()


os.register_at_fork(after_in_child=_forget_in_child)

JOURNAL_NAME = "journal.json"
# What this module may delete in OUT when overwriting: its own outputs and temporaries, nothing else.
_OWNED = re.compile(r"^(manifest\.json|images-\d{5}\.npy|labels-\d{5}\.npy|images\.lmdb|labels\.npy|"
                    r"field\.[a-z][a-z0-9_]*(\.offsets)?-\d{5}\.npy|"
                    r"(train|val)-\d{5}\.npy|(train|val)-docs\.npy|"
                    + re.escape(PARTIAL_DIR) + r")(\.tmp|\.tmp\.body)?$")


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
        """Record a completed unit and the skipped files before its end, then persist."""
        self.units.append(unit)
        self.skipped = [s for s in skipped if s["index"] < unit["source_end"]]
        write_json_atomic(partial / JOURNAL_NAME, asdict(self))

    def keep_intact(self, out: Path, partial: Path) -> None:
        """Drop units (and all after them) whose files are missing or changed since they were recorded."""
        for n, unit in enumerate(self.units):
            for f in unit["files"]:
                base = partial if f.get("partial", unit.get("in_partial")) else out
                if check_file(base, f) is not None:
                    del self.units[n:]
                    self.skipped = [s for s in self.skipped if s["index"] < self.source_end]
                    return


def load(partial: Path) -> Journal | None:
    try:
        data = json.loads((partial / JOURNAL_NAME).read_text())
        return Journal(data["fingerprint"], data["units"], data["skipped"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # no journal, or one torn by a crash before its first rename: start afresh


def partial_dir(out: Path) -> Path:
    return out / PARTIAL_DIR


def remove_partial(out: Path) -> None:
    shutil.rmtree(partial_dir(out), ignore_errors=True)


def read_fingerprint(out: Path) -> str | None:
    try:
        return json.loads((out / MANIFEST_NAME).read_text()).get("fingerprint")
    except (OSError, ValueError, AttributeError):
        return None


@contextlib.contextmanager
def exclusive(out: Path) -> Iterator[None]:
    """OUT made if needed, and held by this run until the block ends (NOTE [one writer])."""
    make_folder(out, "output folder", f"output {out} exists and is not a folder: choose a new or empty folder")
    fd = os.open(out, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    _held.add(fd)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.warning("%s is being written by another fastdata preprocess: waiting for it to end", out)
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as exc:  # no flock on this file system's folders: run unserialised
            if exc.errno not in (errno.EBADF, errno.EINVAL, errno.ENOLCK, errno.EOPNOTSUPP):
                raise
        yield
    finally:
        _held.discard(fd)
        os.close(fd)


def resume(out: Path, fingerprint: str) -> tuple[Journal, Path]:
    """The journal of OUT's unfinished run with this fingerprint, its units checked (a fresh one otherwise),
    and the partial folder, made."""
    partial = partial_dir(out)
    jr = load(partial)
    if jr is None or jr.fingerprint != fingerprint:
        remove_partial(out)
        jr = Journal(fingerprint)
    try:
        partial.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise disk_error(exc, partial) from exc
    jr.keep_intact(out, partial)
    return jr, partial


def prepare_output(out: Path, fingerprint: str, overwrite: bool) -> Optional[dict[str, Any]]:
    """Make OUT (made and held by :func:`exclusive`) usable; returns the existing manifest when OUT is already
    finished with these arguments."""
    names = [p.name for p in out.iterdir()]
    if not names:
        return None
    foreign = [n for n in names if not _OWNED.match(n)]
    ours = MANIFEST_NAME in names or PARTIAL_DIR in names
    if foreign and not ours:
        raise OutputError(f"output {out} is not empty and is not a fastdata dataset (it holds {foreign[:3]}): "
                          "choose a new or empty folder")
    if MANIFEST_NAME in names and not overwrite:
        if read_fingerprint(out) == fingerprint:
            return json.loads((out / MANIFEST_NAME).read_text())
        raise OutputError(f"{out} already holds a dataset made from another source or with other parameters: "
                          "pass --overwrite to replace it, or choose another output folder")
    pending = load(partial_dir(out))
    if pending is not None and pending.fingerprint != fingerprint and not overwrite:
        raise OutputError(f"{out} holds an unfinished run with another source or other parameters: rerun that "
                          "command to finish it, or pass --overwrite to start this one")
    if overwrite:
        for name in names:
            if _OWNED.match(name):
                p = out / name
                shutil.rmtree(p) if p.is_dir() else p.unlink()
    return None
