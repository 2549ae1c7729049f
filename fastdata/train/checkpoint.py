"""Training checkpoints: everything needed to continue a run exactly where it stopped.

A checkpoint holds tensors, numbers and strings only (no pickled code), so it loads with
``torch.load(weights_only=True)``; it is written under a temporary name, flushed to disk and renamed, so a
crash or a full disk mid-write leaves the previous checkpoint intact (a full disk is one clear error). The
Trainer decides what goes in and when (rank 0 writes).
"""
from __future__ import annotations

import contextlib
import io
import os
import random
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

from .._io import disk_error, fsync_dir, make_folder
from ..errors import FormatError, OutputError

CHECKPOINT_NAME = "checkpoint.pt"


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


def write(path: Path, state: dict[str, Any]) -> None:
    """Save ``state`` to ``path`` atomically and durably; a write that fails (a full disk: DiskFullError)
    leaves the previous checkpoint as it was and no temporary file."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(tmp, "wb")
        try:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        finally:
            try:
                f.close()
            except OSError:  # flushing what a failed write left buffered: that error is on its way already
                pass
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except (OSError, RuntimeError) as exc:
        with contextlib.suppress(OSError):  # (no folder to hold it, say: the error below says why)
            tmp.unlink(missing_ok=True)
        cause = _os_error(exc)
        if cause is None:
            raise
        raise disk_error(cause, path, "free space there or give --checkpoint another folder; the previous "
                                      "checkpoint is intact") from exc


def _os_error(exc: BaseException) -> "OSError | None":
    """The OSError behind ``exc`` (torch.save reports a failed write as a RuntimeError whose context is it)."""
    seen: BaseException | None = exc
    while seen is not None and not isinstance(seen, OSError):
        seen = seen.__cause__ or seen.__context__
    return seen if isinstance(seen, OSError) else None


def rank0_bytes(path: Path, main: bool, device: torch.device) -> Optional[bytes]:
    """Rank 0's checkpoint file (None if it has none), on every rank of the process group: rank 0 alone
    writes checkpoints, so on node-local disks the other nodes' folders are empty, and ranks that each read
    their own folder resumed from different steps (or not at all) and hung."""
    data = path.read_bytes() if main and path.is_file() else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(size, 0)
    if int(size) == 0:
        return None
    buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if main else
           torch.empty(int(size), dtype=torch.uint8, device=device))
    dist.broadcast(buf, 0)
    return data if main else buf.cpu().numpy().tobytes()


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
