"""Training checkpoints: everything needed to continue a run exactly where it stopped.

A checkpoint holds tensors, numbers and strings only (no pickled code), so it loads with
``torch.load(weights_only=True)``. NOTE [checkpoint generations]:

1. Each save writes a temporary name of its own (pid + random), flushed to disk, then renamed: two writers in
   one folder never write the same file, and a crash or a full disk mid-write leaves the checkpoints intact
   (a full disk is one clear error). The name carries the machine's tag and the writer's pid, so that a new
   run deletes what writers on this machine killed mid-save (kill -9) left, and nothing else (`_tmp_name`).
2. ``keep`` generations are kept: ``checkpoint.pt`` (newest), ``checkpoint.prev.pt``, ``checkpoint.prev2.pt``...
   Before the rename, the newest is hard-linked to ``checkpoint.prev.pt`` (older ones shift by one), so a
   final name only ever holds a complete file and ``checkpoint.pt`` never goes missing.
3. Resuming loads the newest generation whose zip records pass their CRC check, and says so when it falls
   back to an older one (a disk that lost the newest file's tail, say).
4. At a URL (``--checkpoint s3://bucket/run``, where a preempted job may come back on another machine) the
   same names hold the same generations: the state is written to a local temporary file first (without a
   name on Linux: a kill mid-upload leaves nothing behind) and put as ``checkpoint.pt.uploading``; once
   the store holds all its bytes, each older generation is copied within the store down a name (oldest
   first) and the upload is copied over ``checkpoint.pt``. Puts and copies are atomic, so every name holds
   a whole file, and a save that fails anywhere leaves ``checkpoint.pt`` as the last save wrote it. Every
   call is retried over ``retry_seconds`` (NOTE [retry budget] in fastdata/storage/object_store.py).
   Resuming downloads the generations newest first until one passes rule 3's check.
5. The Trainer's saves to a URL upload while training goes on (`Saves`): the state is serialised at its
   step, then a thread uploads it; the next save, and the end of ``fit``, first wait for it, and its error
   is raised once the next save is made (a failed upload never costs the save after it). At most one
   upload is under way, so a link slower than the saves slows training to its pace. A ``fit`` that fails
   (or Ctrl-C) still waits for the upload under way, logging its error rather than hiding its own; Ctrl-C
   again leaves it.

The Trainer decides what goes in and when (rank 0 writes).
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import random
import re
import secrets
import shutil
import socket
import tempfile
import threading
import zipfile
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
import torch
import torch.nn as nn

from .._io import FILES_HELD, disk_error, fsync_dir, make_folder, process_alive, scrub
from ..distributed import broadcast_bytes, group_size
from ..errors import ConfigError, FormatError, OutputError
from ..storage.object_store import RETRY_SECONDS, StoreFolder, is_url

CHECKPOINT_NAME = "checkpoint.pt"
KEEP = 2  # generations kept by default: the newest and the one before it
log = logging.getLogger(__name__)
Location = Union[Path, str]  # a checkpoint file: a local path, or a URL (NOTE [checkpoint generations] rule 4)
UPLOADING = ".uploading"  # a save's name in a store until its size is checked


def rng_state() -> dict[str, Any]:
    """torch, Python, numpy and CUDA generator states, numpy's key as a tensor (weights_only loads it)."""
    np_state = np.random.get_state()
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def rng_states_of_ranks() -> Optional[list[dict[str, Any]]]:
    """Every rank's `rng_state()`, in rank order, on rank 0 (None on the others, and without a process group):
    ranks seeded apart (``manual_seed(1337 + rank)``, for their own dropout masks) each resume their own. A
    collective: every rank calls it at the same point. Each state travels as `torch.save` bytes in uint8
    tensors (two all-gathers; 15.6 kB a rank on a CPU) and is read back weights-only: nothing is pickled."""
    if group_size() == 1:
        return None
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    buf = io.BytesIO()
    torch.save(rng_state(), buf)
    mine = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor([len(mine)], dtype=torch.int64, device=device))
    longest = max(int(n) for n in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[:len(mine)] = mine.to(device)
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded)
    if dist.get_rank() != 0:
        return None
    return [torch.load(io.BytesIO(part[:int(n)].cpu().numpy().tobytes()), weights_only=True)
            for part, n in zip(parts, sizes)]


def set_rng_state(rng: dict[str, Any]) -> None:
    torch.set_rng_state(rng["torch"].cpu())
    random.setstate(rng["python"])
    name, keys, *rest = rng["numpy"]
    np.random.set_state((name, keys.cpu().numpy().astype(np.uint32), *rest))  # loaded onto a GPU too
    if rng["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in rng["cuda"]])


def location(folder: Union[str, Path]) -> Location:
    """``checkpoint.pt`` in ``folder``: a Path, or a URL where ``folder`` is one (``file://``, ``local://``: a
    local path)."""
    folder = str(folder)
    if folder.startswith(("file://", "local://")):  # (a file system's copies are not atomic: its own rules)
        return Path(folder.split("://", 1)[1]) / CHECKPOINT_NAME
    if folder.lower().startswith(("http://", "https://")):
        raise ConfigError(f"{scrub(folder)}: an HTTP server cannot hold checkpoints; give a folder or an object "
                          "store's URL (s3://, gs://, az://)")
    if is_url(folder):
        return f"{folder.rstrip('/')}/{CHECKPOINT_NAME}"
    return Path(folder) / CHECKPOINT_NAME


def _at_url(path: str, retry_seconds: float) -> tuple[StoreFolder, str]:
    """The store folder of the checkpoint URL ``path`` and the file's name in it: a client made for each
    save or load, so its retry budget is that operation's and the endpoint is today's."""
    folder, name = path.rsplit("/", 1)
    return StoreFolder(folder, retry_seconds, advice=""), name


def prepare_folder(folder: Union[str, Path], retry_seconds: float = RETRY_SECONDS) -> None:
    """Make the checkpoint folder now (at a URL: put and delete a probe object): a path that cannot hold
    checkpoints fails before training, not at the first save an epoch (or hours) later."""
    path = location(folder)
    if isinstance(path, str):
        _at_url(path, retry_seconds)[0].check_writable()
        return
    folder = path.parent
    make_folder(folder, "checkpoint folder", f"checkpoint folder {folder} is a file: give --checkpoint a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OutputError(f"cannot write in checkpoint folder {folder}: give --checkpoint a writable folder")
    _remove_dead_writers(path)


def _machine_tag() -> str:
    """Where a pid means one process: this host and its PID namespace (a container's ids are its own), as a
    name part. A folder may be shared by machines, whose pids say nothing here."""
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:  # (no /proc: the host alone)
        namespace = 0
    return f"{re.sub(r'[^A-Za-z0-9_-]', '_', socket.gethostname())}-{namespace}"


def _tmp_name(path: Path) -> Path:
    """This writer's own temporary file beside ``path`` (rule 1): ``checkpoint.pt.<machine>.<pid>-<hex>.tmp``."""
    return path.with_name(f"{path.name}.{_machine_tag()}.{os.getpid()}-{secrets.token_hex(4)}.tmp")


def _remove_dead_writers(path: Path) -> None:
    """Delete the temporary files (and their ``.prev.tmp`` links) of this machine's writers of ``path`` that are
    no longer alive: a save killed mid-write left a checkpoint-sized file there for good. Another machine's
    files, a live process's and names of any other form are left alone."""
    ours = re.compile(rf"{re.escape(path.name)}\.{re.escape(_machine_tag())}\.(\d+)-[0-9a-f]+(\.prev)?\.tmp")
    for file in path.parent.iterdir():
        found = ours.fullmatch(file.name)
        if found and not process_alive(int(found.group(1))):
            with contextlib.suppress(OSError):  # (another run removing it too)
                file.unlink()
                log.info("removed %s, left by a checkpoint save that was killed", file)


def generations(path: Location, keep: int = KEEP) -> list[Any]:
    """The ``keep`` file names of the checkpoint ``path``, newest first: ``checkpoint.pt``,
    ``checkpoint.prev.pt``, ``checkpoint.prev2.pt``... (NOTE [checkpoint generations]); URLs for a URL."""
    if isinstance(path, str):
        folder, name = path.rsplit("/", 1)
        return [f"{folder}/{n}" for n in _names(name, keep)]
    return [path.with_name(n) for n in _names(path.name, keep)]


def _names(name: str, keep: int) -> list[str]:
    stem, dot, suffix = name.rpartition(".")
    stem, suffix = (stem, dot + suffix) if stem else (name, "")
    return [name] + [f"{stem}.prev{'' if k == 1 else k}{suffix}" for k in range(1, keep)]


def existing(path: Location, keep: int = KEEP, retry_seconds: float = RETRY_SECONDS) -> list[Any]:
    """The generations of ``path`` that exist, newest first."""
    if isinstance(path, str):
        store, _ = _at_url(path, retry_seconds)
        return [p for p in generations(path, keep) if store.size(p.rsplit("/", 1)[1]) is not None]
    return [p for p in generations(path, keep) if p.is_file()]


def write(path: Location, state: dict[str, Any], keep: int = KEEP, retry_seconds: float = RETRY_SECONDS) -> None:
    """Save ``state`` to ``path`` atomically and durably, keeping ``keep`` generations (NOTE [checkpoint
    generations]); a write that fails (a full disk: DiskFullError; a store down past ``retry_seconds``:
    OutputError) leaves the newest checkpoint as it was and no temporary file."""
    if keep < 1:
        raise ValueError(f"keep must be 1 or more, got keep={keep!r}")
    if isinstance(path, str):
        _write_url(path, state, keep, retry_seconds)
        return
    tmp = _tmp_name(path)
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


def _write_url(url: str, state: dict[str, Any], keep: int, retry_seconds: float) -> None:
    """`write` at a URL (NOTE [checkpoint generations] rule 4)."""
    spool = Spool(state)
    try:
        _upload(url, spool, keep, retry_seconds, "checkpoint not saved")
    finally:
        spool.close()


class Spool:
    """A save on its way to a URL, serialised into a local file (a state's tensors may change once the step
    after it runs). On Linux the file has no name (it is read through its /proc/self/fd path), so the kernel
    frees it even when the process is killed mid-upload (a preempted job's grace running out) and no spool
    of a dead job fills the temporary folder; elsewhere it is a named file of this writer's own.

    Raises:
        DiskFullError: The temporary folder (TMPDIR) is full.
        OutputError: It cannot be written.
    """

    def __init__(self, state: dict[str, Any]) -> None:
        self.file: Any = None
        self._id: Optional[tuple[int, int]] = None
        self.path, self._named = Path(tempfile.gettempdir()) / "fastdata-checkpoint", False
        try:
            self.file = tempfile.TemporaryFile(prefix="fastdata-checkpoint-")
            self.path = Path(f"/proc/self/fd/{self.file.fileno()}")
            if not self.path.exists():
                self.file.close()
                name = f"fastdata-checkpoint-{os.getpid()}-{secrets.token_hex(4)}.pt"
                self.path = Path(tempfile.gettempdir()) / name
                self.file, self._named = open(self.path, "xb"), True
            info = os.fstat(self.file.fileno())
            self._id = (info.st_dev, info.st_ino)
            FILES_HELD.add(self._id)  # (children forked meanwhile hold none of its disk: NOTE [locks across fork])
            torch.save(state, self.file)
            self.file.flush()
            self.size = os.fstat(self.file.fileno()).st_size
        except BaseException as exc:  # (any failure: no spool, nor its entry in FILES_HELD, outlives it)
            self.close()
            cause = _os_error(exc) if isinstance(exc, (OSError, RuntimeError)) else None
            if cause is None:
                raise
            raise disk_error(cause, Path(tempfile.gettempdir()) / "fastdata-checkpoint", "free space in the "
                             "temporary folder (TMPDIR): a checkpoint for a URL is written there first; the "
                             "checkpoints in the store are as they were") from exc

    def close(self) -> None:
        FILES_HELD.discard(self._id)
        with contextlib.suppress(OSError, AttributeError):  # (None: never opened)
            self.file.close()
        if self._named:
            with contextlib.suppress(OSError):
                self.path.unlink(missing_ok=True)


def _upload(url: str, spool: Spool, keep: int, retry_seconds: float, what: str) -> None:
    """``spool`` put at ``url`` as its newest generation; an OutputError that starts with ``what`` when the
    store fails (NOTE [checkpoint generations] rule 4)."""
    store, name = _at_url(url, retry_seconds)
    names = _names(name, keep)
    upload = f"{names[0]}{UPLOADING}"
    try:
        store.put(spool.path, upload)  # (checked by the size the store then holds: `put_file`)
        for older, newer in zip(reversed(names[1:]), reversed(names[:-1])):
            if store.size(newer) is not None:
                store.copy(newer, older)
        store.copy(upload, names[0])
    except OutputError as exc:
        with contextlib.suppress(OutputError):  # one try: the store may be what failed
            _at_url(url, 0)[0].delete([upload])
        raise OutputError(f"{what}: {exc}; {names[0]} in {scrub(store.url)} holds the last save, if "
                          "any") from None
    with contextlib.suppress(OutputError):  # (a leftover is replaced by the next save's upload)
        store.delete([upload])


class Saves:
    """A run's checkpoint saves: to a folder at once (`write`); to a URL serialised at once and uploaded on a
    thread of its own while training goes on, one upload at a time (NOTE [checkpoint generations] rule 5).
    `finish` waits for the upload under way and raises its error."""

    def __init__(self) -> None:
        self._thread: Optional[threading.Thread] = None
        self._failed: Optional[BaseException] = None
        self._label = ""

    def save(self, path: Location, state: dict[str, Any], *, keep: int = KEEP,
             retry_seconds: float = RETRY_SECONDS, wait: bool = True, label: str = "") -> None:
        """Save ``state`` as `write` does; at a URL with ``wait`` False, return once it is serialised. The
        upload before it is waited for first; its error is raised after this save is made (or under way).

        Raises:
            OutputError: This save or the upload before it failed (DiskFullError: a full disk or TMPDIR).
        """
        before = self._wait()
        try:
            if not isinstance(path, str) or wait:
                write(path, state, keep, retry_seconds)
            else:
                spool = Spool(state)
                self._label = label
                self._thread = threading.Thread(target=self._upload, args=(path, spool, keep, retry_seconds),
                                                name="fastdata-checkpoint-upload", daemon=True)
                self._thread.start()
        except BaseException:
            if before is not None:  # (said, not hidden: this save's own error goes on)
                log.error("%s", scrub(str(before)))
            raise
        if before is not None:
            raise before

    def _upload(self, url: str, spool: Spool, keep: int, retry_seconds: float) -> None:
        label = self._label
        try:
            _upload(url, spool, keep, retry_seconds, f"the checkpoint{' of ' + label if label else ''} was not saved")
        except BaseException as exc:  # noqa: BLE001 - raised in the training thread by `finish`
            self._failed = exc
        finally:
            spool.close()

    def _wait(self) -> Optional[BaseException]:
        """Wait for the upload under way, if any (interruptible: Ctrl-C); its error."""
        if self._thread is not None:
            while self._thread.is_alive():
                self._thread.join(0.5)
            self._thread = None
        failed, self._failed = self._failed, None
        return failed

    def finish(self, quiet: bool = False) -> None:
        """Wait for the upload under way, if any; raise its error (``quiet``: log it instead, for a run that
        stops on an error of its own, which it must not hide)."""
        if quiet and self._thread is not None and self._thread.is_alive():
            log.warning("waiting for the upload of the checkpoint%s (Ctrl-C again to leave it)",
                        f" of {self._label}" if self._label else "")
        failed = self._wait()
        if failed is not None and quiet:
            log.error("%s", scrub(str(failed)))
        elif failed is not None:
            raise failed


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


def newest(path: Location, keep: int = KEEP, retry_seconds: float = RETRY_SECONDS) -> tuple[Any, Optional[bytes]]:
    """The newest generation of ``path`` that is intact (its zip records pass their CRC check), saying so when
    that is not the newest one, and its bytes where they had to be downloaded to be checked (a URL's; None
    for a local file); ``(None, None)`` when there is none. When every generation is damaged, the newest (for
    `read` to refuse by name)."""
    found: list[tuple[Any, Optional[str], Optional[bytes]]] = []
    store = _at_url(path, retry_seconds)[0] if isinstance(path, str) else None
    for p in generations(path, keep):
        if store is not None:
            data = store.read_bytes(p.rsplit("/", 1)[1])
            if data is None:
                continue
            problem = _damage(io.BytesIO(data))
        elif p.is_file():
            data, problem = None, _damage(p)
        else:
            continue
        if problem is None:
            if found:
                log.warning("checkpoint %s is damaged (%s): resuming from the previous generation, %s",
                            scrub(str(found[0][0])), found[0][1], scrub(str(p)))
            return p, data
        found.append((p, problem, None if found else data))  # (the newest's bytes only: `read` names it)
    return (found[0][0], found[0][2]) if found else (None, None)


def _damage(file: Any) -> Optional[str]:
    """What is wrong with the checkpoint ``file`` (a path or a file object; None: it is complete). torch.save
    writes a zip whose records carry CRC-32s, so a truncated or overwritten file is found without unpickling
    anything."""
    try:
        with zipfile.ZipFile(file) as z:
            bad = z.testzip()
    except (OSError, zipfile.BadZipFile, EOFError) as exc:
        return f"not a complete checkpoint: {exc}"
    return None if bad is None else f"record {bad} fails its CRC check"


def rank0_bytes(path: Optional[Location], main: bool, data: Optional[bytes] = None) -> Optional[bytes]:
    """Rank 0's checkpoint ``path`` (its ``data`` where rank 0 has them already; None if it has none), on
    every rank of the process group: rank 0 alone writes checkpoints, so on node-local disks the other
    nodes' folders are empty, and ranks that each read their own folder resumed from different steps (or not
    at all) and hung."""
    if main and data is None and isinstance(path, Path) and path.is_file():
        data = path.read_bytes()
    return broadcast_bytes(data if main else None) or None  # (an empty file is no checkpoint either)


def read(path: Location, device: torch.device, model: nn.Module, data: Optional[bytes] = None) -> dict[str, Any]:
    """Load ``path`` (or ``data``, its bytes) for ``model`` (weights loaded into it), refusing a file that is
    unreadable, is not a Trainer's checkpoint (naming its first missing or bad key) or was written for another
    model, with a message that says what to do."""
    where = scrub(str(path))
    try:
        state = torch.load(io.BytesIO(data) if data is not None else path, map_location=device, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is one clear error for the user
        raise FormatError(f"cannot read checkpoint {where}: {exc}") from exc
    _check_keys(state, where)
    if state["model_class"] != type(model).__name__:
        raise FormatError(f"checkpoint {where} holds a {state['model_class']}, not a {type(model).__name__}: "
                          "resume with the same --model, or use another --checkpoint folder")
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as exc:
        first = str(exc).splitlines()[1].strip() if len(str(exc).splitlines()) > 1 else str(exc)
        raise FormatError(f"checkpoint {where} does not fit this model ({first}): resume with the same model "
                          "and dataset, or use another --checkpoint folder") from None
    return state


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _rng(value: Any) -> bool:
    return isinstance(value, dict) and {"torch", "python", "numpy", "cuda"} <= set(value)  # (`set_rng_state`'s)


# What `read` requires of a checkpoint (the Trainer's keys, each with its test and what it must be), in the order
# they are checked; other keys are optional ("config", "val_step" and "val_due" came later, and "rng_ranks" only
# under torchrun: files without them still load).
_KEYS: tuple[tuple[str, Any, str], ...] = (
    ("model", lambda v: isinstance(v, dict), "a state_dict"),
    ("model_class", lambda v: isinstance(v, str), "a class name"),
    ("optimizer", lambda v: isinstance(v, dict), "an optimizer's state_dict"),
    ("scheduler", lambda v: isinstance(v, dict), "a scheduler's state_dict"),
    ("scaler", lambda v: isinstance(v, dict), "a GradScaler's state_dict"),
    ("loader", None, ""),  # (any loader's own state, or None)
    ("epoch", _whole, "a whole number >= 0"),
    ("step", _whole, "a whole number >= 0"),
    ("best", lambda v: v is None or _number(v), "a number or None"),
    ("bad_evals", _whole, "a whole number >= 0"),
    ("rng", _rng, "the random generators' states"),
)
_OPTIONAL: tuple[tuple[str, Any, str], ...] = (
    ("config", lambda v: v is None or isinstance(v, dict), "the run's settings"),
    ("val_step", lambda v: v is None or _whole(v), "a whole number >= 0 or None"),
    ("val_due", lambda v: isinstance(v, bool), "True or False"),
    ("rng_ranks", lambda v: isinstance(v, list) and all(map(_rng, v)), "a list of each rank's random states"),
)


def _check_keys(state: Any, where: str) -> None:
    """Refuse, naming the first missing or bad key, a file that loads weights-only but is not a Trainer's
    checkpoint (a list, a model's state_dict saved there, a hand-edited epoch): resuming it failed with a
    KeyError, TypeError or AttributeError traceback, or trained on from a negative step."""
    advice = ("resume from a checkpoint that fastdata train (a Trainer) saved, or give --checkpoint another folder "
              "(or move this file away to start afresh)")
    if not isinstance(state, dict):
        raise FormatError(f"checkpoint {where} is not a fastdata training checkpoint (it holds a "
                          f"{type(state).__name__}, not a dict): {advice}")
    for key, _, _ in _KEYS:
        if key not in state:
            raise FormatError(f"checkpoint {where} is not a fastdata training checkpoint (missing {key!r}): {advice}")
    for key, ok, expected in (*_KEYS, *((k, o, e) for k, o, e in _OPTIONAL if k in state)):
        if ok is not None and not ok(state[key]):
            shown = repr(state[key]) if len(repr(state[key])) <= 40 else f"a {type(state[key]).__name__}"
            raise FormatError(f"checkpoint {where} is not a fastdata training checkpoint (its {key!r} is {shown}, "
                              f"not {expected}): {advice}")
