"""The journal of an unfinished preprocess run: which units are complete, so a rerun resumes after them.

It lives in ``OUT/.fastdata-partial/journal.json``, rewritten atomically after every completed unit, and
is removed once the manifest is written. A unit is trusted on resume only if its files still hash right.
"""
from __future__ import annotations

import json
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from .._io import write_json_atomic
from ..errors import OutputError
from ..manifest import MANIFEST_NAME, PARTIAL_DIR, check_file

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


def prepare_output(out: Path, fingerprint: str, overwrite: bool) -> Optional[dict[str, Any]]:
    """Make OUT usable; returns the existing manifest when OUT is already finished with these arguments."""
    if out.exists() and not out.is_dir():
        raise OutputError(f"output {out} exists and is not a folder: choose a new or empty folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"cannot create output folder {out}: {exc.strerror}") from exc
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
