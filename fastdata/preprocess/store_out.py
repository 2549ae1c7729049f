"""Where a preprocess run puts its finished files: OUT itself, or an object store when OUT is a URL.

NOTE [output at a URL]: ``fastdata preprocess ... SRC s3://bucket/prefix`` writes the dataset straight to
the store, with the guarantees of a local run (NOTE [one writer], NOTE [overwrite] in journal.py) where a
store allows them.
1. Every file is written complete and hashed in a local staging folder (a Ray task's own), then put under
   its final key in one request: a store's put is atomic, so no reader ever sees part of a shard under its
   final name, and a task run twice puts the same bytes twice.
2. Each finished unit is then recorded by one small journal object, ``OUT/.fastdata-partial/unit-K.json``
   (its files' sizes and sha256, the samples skipped in it); ``run.json`` beside them holds the run's
   fingerprint. Objects are never appended to, so recording the millionth unit costs what the first did.
3. A rerun with the same arguments lists OUT once and keeps the units, from the first on, whose files are
   there with their recorded sizes; it redoes only the rest (a shard's bytes are checked against their
   sha256 by every reader and by ``fastdata verify``).
4. The manifest is put last, then the journal objects are deleted: a dataset with a manifest is complete.
5. A store has no lock: one run at a time per OUT URL (a second run would redo work, never mix two
   datasets: every unit is a function of the arguments and the source). ``--overwrite`` deletes the old
   dataset's objects first, as a warning says: a store has no folder to build beside OUT and swap in.
6. Every message passes the URL through ``scrub``: secrets never appear.
"""
from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import re
import shutil
import tempfile
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator, Optional

from .._io import fsync_dir, process_alive, scrub
from ..errors import OutputError
from ..formats.manifest import MANIFEST_NAME, PARTIAL_DIR
from ..storage.object_store import RETRY_SECONDS, StoreFolder, is_url
from .journal import OWNED, Journal, left_after_manifest

log = logging.getLogger(__name__)

RUN_NAME = "run.json"
_UNIT = re.compile(r"^unit-(\d{8})\.json$")
_AHEAD, _THREADS = 64, 16  # a resume's journal objects requested ahead, on this many threads


def unit_name(k: int) -> str:
    return f"unit-{k:08d}.json"


class StoreOut(StoreFolder):
    """OUT as an fsspec URL: puts files, journal objects and the manifest (NOTE [output at a URL]).
    Picklable (a Ray task publishes its own shard): the client is made anew in each process.

    Args:
        url: OUT.
        retry_seconds: How long the store may fail before a call gives up (NOTE [retry budget]).
    """

    def __init__(self, url: str, retry_seconds: float = RETRY_SECONDS) -> None:
        super().__init__(url, retry_seconds)
        self._old: list[str] = []  # the dataset --overwrite replaces (`drop_old`)

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "_old": []}

    def check_writable(self, folder: str = PARTIAL_DIR) -> None:
        super().check_writable(folder)

    def read_json(self, name: str) -> Optional[dict[str, Any]]:
        data = self.read_bytes(name)
        if data is None:
            return None
        try:
            return json.loads(data)
        except ValueError:
            return None

    def put_json(self, name: str, obj: dict[str, Any]) -> None:
        self.put_bytes(name, json.dumps(obj, sort_keys=True, indent=None, separators=(",", ":")).encode())

    def prepare(self, fingerprint: str, overwrite: bool, continues: tuple[str, ...] = ()
                ) -> Optional[dict[str, Any]]:
        """The store's side of `journal.prepare_output`: the manifest when OUT is complete with these
        arguments, else None once OUT may be written (with ``overwrite``, another run's objects deleted, and
        an old dataset named for `drop_old`; an unfinished run of one of ``continues`` is taken over)."""
        names = self.listing()
        if not names:
            return None
        ours: list[str] = []
        foreign: list[str] = []
        for n in names:  # (one pass: 10^6 objects)
            (ours if OWNED.match(n.split("/", 1)[0]) else foreign).append(n)
        if foreign and MANIFEST_NAME not in names and not any(n.startswith(PARTIAL_DIR + "/") for n in names):
            raise OutputError(f"output {scrub(self.url)} is not empty and is not a fastdata dataset (it holds "
                              f"{foreign[:3]}): choose a new or empty prefix")
        manifest = self.read_json(MANIFEST_NAME) if MANIFEST_NAME in names else None
        if manifest is not None and not overwrite:
            if manifest.get("fingerprint") == fingerprint:
                self.delete(left_after_manifest(list(names), manifest))  # (a run killed before its clean-up)
                return manifest
            raise OutputError(f"{scrub(self.url)} already holds a dataset made from another source or with other "
                              "parameters: pass --overwrite to replace it, or choose another output URL")
        run = self.read_json(f"{PARTIAL_DIR}/{RUN_NAME}")
        if run is not None and run.get("fingerprint") not in (fingerprint, *continues) and not overwrite:
            raise OutputError(f"{scrub(self.url)} holds an unfinished run with another source or other parameters: "
                              "rerun that command to finish it, or pass --overwrite to start this one")
        if overwrite and ours:
            this_run = run is not None and run.get("fingerprint") == fingerprint  # killed before its first shard
            if manifest is not None:  # a whole dataset stays until the new run may begin (`drop_old`)
                self._old = [n for n in ours if not n.startswith(PARTIAL_DIR + "/")]
            if not this_run:
                old = set(self._old)
                self.delete([n for n in ours if n not in old])
        return None

    def abandon(self) -> None:
        """Delete this run's journal objects: a run whose arguments the source refuses never resumes."""
        self.delete([n for n in self.listing() if n.startswith(PARTIAL_DIR + "/")])

    def drop_old(self) -> None:
        """Delete the dataset ``--overwrite`` replaces (`prepare` named it): called once the new run's
        arguments are checked against its source, just before its first shard."""
        old, self._old = self._old, []
        if old:
            log.warning("deleting the dataset at %s before the new one exists (a store cannot swap one in)",
                        scrub(self.url))
            self.delete(old)

    def resume(self, fingerprint: str, continues: tuple[str, ...] = ()) -> "StoreJournal":
        """The journal of OUT's unfinished run with this fingerprint (or one of ``continues``, taken over), its
        units checked against one listing (NOTE [output at a URL] rule 3); a fresh one otherwise."""
        jr = StoreJournal(fingerprint, store=self)
        run = self.read_json(f"{PARTIAL_DIR}/{RUN_NAME}")
        if run is not None and run.get("fingerprint") in continues:
            self.put_json(f"{PARTIAL_DIR}/{RUN_NAME}", {"fingerprint": fingerprint})
            run = {"fingerprint": fingerprint}
        names = self.listing()
        if run is None or run.get("fingerprint") != fingerprint:
            self.delete([n for n in names if n.startswith(PARTIAL_DIR + "/")])
            self.put_json(f"{PARTIAL_DIR}/{RUN_NAME}", {"fingerprint": fingerprint})
            return jr
        recorded = sorted(int(m.group(1)) for n in names
                          if (m := _UNIT.match(n[len(PARTIAL_DIR) + 1:])) and n.startswith(PARTIAL_DIR + "/"))
        first = [k for i, k in enumerate(recorded) if k == i]  # (sorted: the units up to the first gap)
        with contextlib.closing(self._entries(first)) as entries:
            for entry in entries:
                unit = entry.get("unit") if entry else None
                if not unit or any(names.get(f["path"]) != int(f["bytes"]) for f in unit["files"]):
                    break
                jr.units.append(unit)
                jr.skipped.extend(entry.get("skipped", []))
        stale = [f"{PARTIAL_DIR}/{unit_name(k)}" for k in recorded if k >= len(jr.units)]
        self.delete(stale)  # a later unit must not be taken on the next resume once its predecessor is redone
        return jr

    def finish(self, staging: Path, last_files: list[str], transient: list[str]) -> None:
        """Put the last files (``last_files``, from ``staging``) and the manifest after them, then delete the
        journal objects and the ``transient`` files, which only the journal needed (rule 4)."""
        for name in last_files:
            self.put(staging / name, name)
        self.put(staging / MANIFEST_NAME, MANIFEST_NAME)
        drop = set(transient)
        self.delete([n for n in self.listing() if n.startswith(PARTIAL_DIR + "/") or n in drop])

    def _entries(self, recorded: list[int]) -> Iterator[Optional[dict[str, Any]]]:
        """The journal objects of units ``recorded`` (in order), up to `_AHEAD` requested ahead: a store answers
        each small read in a round trip (10^6 units read one by one: hours before a resume began)."""
        with ThreadPoolExecutor(_THREADS, thread_name_prefix="fastdata-journal") as pool:
            ahead: collections.deque = collections.deque()
            later = iter(recorded)
            try:
                while True:
                    while len(ahead) < _AHEAD and (k := next(later, None)) is not None:
                        ahead.append(pool.submit(self.read_json, f"{PARTIAL_DIR}/{unit_name(k)}"))
                    if not ahead:
                        return
                    yield ahead.popleft().result()
            finally:  # (a gap or a bad unit stops the caller: the reads not begun are not made)
                for f in ahead:
                    f.cancel()


class StoreJournal(Journal):
    """A `Journal` kept as one object per unit in the store (NOTE [output at a URL] rule 2)."""

    def __init__(self, fingerprint: str, *, store: StoreOut) -> None:
        super().__init__(fingerprint)
        self.store = store

    def _write(self, entry: dict[str, Any], partial: Path) -> None:
        self.store.put_json(f"{PARTIAL_DIR}/{unit_name(entry['unit']['index'])}", entry)


def publish(stage: Path, files: list[dict[str, Any]], out: Any) -> None:
    """Move a finished unit's files from ``stage`` to OUT: renamed into a local OUT (same file system), or
    put into the store (a `StoreOut`) and the local copies removed."""
    if isinstance(out, StoreOut):
        for f in files:
            out.put(stage / f["path"], f["path"])
            (stage / f["path"]).unlink()
        return
    for f in files:
        os.replace(stage / f["path"], Path(out) / f["path"])
    fsync_dir(Path(out))


_STAGE = re.compile(r"^fastdata-stage-(\d+)-")


def task_stage(out: Any) -> Path:
    """A staging folder of a task's own: in OUT's partial folder for a local OUT (the same file system, so
    `publish` renames), in this machine's temporary folder for a store, named by the process (the folders
    of processes gone, a Ray worker killed mid-task, are removed first)."""
    if isinstance(out, StoreOut):
        _drop_orphans(Path(tempfile.gettempdir()))
        return Path(tempfile.mkdtemp(prefix=f"fastdata-stage-{os.getpid()}-"))
    stage = Path(out) / PARTIAL_DIR / f"task-{uuid.uuid4().hex}"
    stage.mkdir(parents=True)
    return stage


def drop_stage(stage: Path) -> None:
    shutil.rmtree(stage, ignore_errors=True)


def _drop_orphans(folder: Path) -> None:
    """Remove the staging folders in ``folder`` whose process no longer runs."""
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        m = _STAGE.match(name)
        if m is None or process_alive(int(m.group(1))):
            continue
        drop_stage(folder / name)


def output_of(out: Any, retry_seconds: float = RETRY_SECONDS) -> Any:
    """A `StoreOut` for a URL, else the local folder as a Path."""
    return StoreOut(out, retry_seconds) if is_url(out) else Path(out)
