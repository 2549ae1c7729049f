"""Training checkpoints: everything needed to continue a run exactly where it stopped.

A checkpoint holds tensors, numbers and strings only (no pickled code), so it loads with
``torch.load(weights_only=True)``. NOTE [checkpoint generations]:

1. Each save writes a temporary name of its own (pid + random), flushed to disk, then renamed: two writers in
   one folder never write the same file, and a crash or a full disk mid-write leaves the checkpoints intact
   (a full disk is one clear error).
2. ``keep`` generations are kept: ``checkpoint.pt`` (newest), ``checkpoint.prev.pt``, ``checkpoint.prev2.pt``...
   Before the rename, the newest is hard-linked to ``checkpoint.prev.pt`` (older ones shift by one), so a
   final name only ever holds a complete file and ``checkpoint.pt`` never goes missing.
3. Resuming loads the newest generation whose zip records pass their CRC check, and says so when it falls
   back to an older one (a disk that lost the newest file's tail, say).

The Trainer decides what goes in and when (rank 0 writes).
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import random
import secrets
import shutil
import zipfile
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.nn as nn

from .._io import disk_error, fsync_dir, make_folder
from ..distributed import broadcast_bytes
from ..errors import FormatError, OutputError

CHECKPOINT_NAME = "checkpoint.pt"
KEEP = 2  # generations kept by default: the newest and the one before it
log = logging.getLogger(__name__)


def rng_state() -> dict[str, Any]:
    """torch, Python, numpy and CUDA generator states, numpy's key as a tensor (weights_only loads it)."""
    np_state = np.random.get_state()
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def set_rng_state(rng: dict[str, Any]) -> None:
    torch.set_rng_state(rng["torch"].cpu())
    random.setstate(rng["python"])
    name, keys, *rest = rng["numpy"]
    np.random.set_state((name, keys.cpu().numpy().astype(np.uint32), *rest))  # loaded onto a GPU too
    if rng["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in rng["cuda"]])


def prepare_folder(folder: Path) -> None:
    """Make the checkpoint folder now: a path that cannot hold checkpoints fails before training, not at the
    first save an epoch (or hours) later."""
    make_folder(folder, "checkpoint folder", f"checkpoint folder {folder} is a file: give --checkpoint a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OutputError(f"cannot write in checkpoint folder {folder}: give --checkpoint a writable folder")


def generations(path: Path, keep: int = KEEP) -> list[Path]:
    """The ``keep`` file names of the checkpoint ``path``, newest first: ``checkpoint.pt``,
    ``checkpoint.prev.pt``, ``checkpoint.prev2.pt``... (NOTE [checkpoint generations])."""
    stem, suffix = path.name[:-len(path.suffix)] if path.suffix else path.name, path.suffix
    return [path] + [path.with_name(f"{stem}.prev{'' if k == 1 else k}{suffix}") for k in range(1, keep)]


def existing(path: Path, keep: int = KEEP) -> list[Path]:
    """The generations of ``path`` that exist, newest first."""
    return [p for p in generations(path, keep) if p.is_file()]


def write(path: Path, state: dict[str, Any], keep: int = KEEP) -> None:
    """Save ``state`` to ``path`` atomically and durably, keeping ``keep`` generations (NOTE [checkpoint
    generations]); a write that fails (a full disk: DiskFullError) leaves the checkpoints as they were and
    no temporary file."""
    if keep < 1:
        raise ValueError(f"keep must be 1 or more, got keep={keep!r}")
    tmp = path.with_name(f"{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")  # this writer's own
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(tmp, "xb")
        try:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        finally:
            try:
                f.close()
            except OSError:  # flushing what a failed write left buffered: that error is on its way already
                pass
        _shift(generations(path, keep), tmp)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except (OSError, RuntimeError) as exc:
        with contextlib.suppress(OSError):  # (no folder to hold it, say: the error below says why)
            tmp.unlink(missing_ok=True)
        cause = _os_error(exc)
        if cause is None:
            raise
        kept = existing(path, keep)
        said = (f"the previous checkpoint is intact ({kept[0].name})" if kept else
                "no earlier checkpoint is there to resume from")
        raise disk_error(cause, path, f"free space there or give --checkpoint another folder; {said}") from exc


def _shift(names: list[Path], tmp: Path) -> None:
    """Make room for a new newest generation: each older one moves down a name, the oldest is dropped, and
    the newest is hard-linked (copied where links are refused) under the second name, so the newest name
    stays in place until the caller renames over it. A generation another writer moved meanwhile is skipped."""
    if len(names) < 2 or not names[0].is_file():
        return
    for older, newer in zip(reversed(names[1:]), reversed(names[:-1])):
        if newer is names[0]:
            break
        with contextlib.suppress(FileNotFoundError):
            os.replace(newer, older)
    link = tmp.with_name(tmp.name[:-len(".tmp")] + ".prev.tmp")
    try:
        try:
            os.link(names[0], link)
        except FileNotFoundError:  # another writer moved it: its own shift kept it
            return
        except OSError:  # a file system without hard links
            shutil.copyfile(names[0], link)
        os.replace(link, names[1])
    finally:
        with contextlib.suppress(OSError):
            link.unlink(missing_ok=True)


def _os_error(exc: BaseException) -> "OSError | None":
    """The OSError behind ``exc`` (torch.save reports a failed write as a RuntimeError whose context is it)."""
    seen: BaseException | None = exc
    while seen is not None and not isinstance(seen, OSError):
        seen = seen.__cause__ or seen.__context__
    return seen if isinstance(seen, OSError) else None


def newest(path: Path, keep: int = KEEP) -> Optional[Path]:
    """The newest generation of ``path`` that is intact (its zip records pass their CRC check), saying so when
    that is not the newest one; None when there is none. When every generation is damaged, the newest (for
    `read` to refuse by name)."""
    found = existing(path, keep)
    for k, p in enumerate(found):
        problem = _damage(p)
        if problem is None:
            if k:
                log.warning("checkpoint %s is damaged (%s): resuming from the previous generation, %s",
                            found[0], _damage(found[0]), p)
            return p
    return found[0] if found else None


def _damage(path: Path) -> Optional[str]:
    """What is wrong with the checkpoint file ``path`` (None: it is complete). torch.save writes a zip whose
    records carry CRC-32s, so a truncated or overwritten file is found without unpickling anything."""
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except (OSError, zipfile.BadZipFile, EOFError) as exc:
        return f"not a complete checkpoint: {exc}"
    return None if bad is None else f"record {bad} fails its CRC check"


def rank0_bytes(path: Optional[Path], main: bool) -> Optional[bytes]:
    """Rank 0's checkpoint file ``path`` (None if it has none), on every rank of the process group: rank 0
    alone writes checkpoints, so on node-local disks the other nodes' folders are empty, and ranks that each
    read their own folder resumed from different steps (or not at all) and hung."""
    data = path.read_bytes() if main and path is not None and path.is_file() else None
    return broadcast_bytes(data) or None  # (an empty file is no checkpoint either)


def read(path: Path, device: torch.device, model: nn.Module, data: Optional[bytes] = None) -> dict[str, Any]:
    """Load ``path`` (or ``data``, its bytes) for ``model`` (weights loaded into it), refusing a file that is
    unreadable or was written for another model, with a message that says what to do."""
    try:
        state = torch.load(io.BytesIO(data) if data is not None else path, map_location=device, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is one clear error for the user
        raise FormatError(f"cannot read checkpoint {path}: {exc}") from exc
    if state.get("model_class") != type(model).__name__:
        raise FormatError(f"checkpoint {path} holds a {state.get('model_class')}, not a {type(model).__name__}: "
                          "resume with the same --model, or use another --checkpoint folder")
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as exc:
        first = str(exc).splitlines()[1].strip() if len(str(exc).splitlines()) > 1 else str(exc)
        raise FormatError(f"checkpoint {path} does not fit this model ({first}): resume with the same model "
                          "and dataset, or use another --checkpoint folder") from None
    return state
