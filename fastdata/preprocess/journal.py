"""The journal of an unfinished preprocess run: which units are complete, so a rerun resumes after them.

It lives in ``OUT/.fastdata-partial/journal.json``, rewritten atomically after every completed unit, and
is removed once the manifest is written. A unit is trusted on resume only if its files still hash right.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .._io import HASH_NAME, hash_file, write_json_atomic
from ..manifest import MANIFEST_NAME, PARTIAL_DIR

JOURNAL_NAME = "journal.json"


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
                base = partial if unit.get("in_partial") else out
                p = base / f["path"]
                if not p.is_file() or p.stat().st_size != f["bytes"] or hash_file(p) != f[HASH_NAME]:
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
