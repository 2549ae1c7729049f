"""The LMDB environments of a process: one per store file, shared by every reader of it, counted, closed by
its last holder, never carried across a fork, and at most a bound of them held by a reader where the limits
on open files or mappings say so (NOTE [shared environments], NOTE [open files] in fastdata/_limits.py)."""
from __future__ import annotations

import contextlib
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Optional

from .._io import resolved_inside

# NOTE [shared environments]: py-lmdb allows one open environment per file and process, so every reader of a
# file in a process shares one, and closing it unmaps pages that any reader's views may still point into (a
# train and an eval dataset on one LMDB: closing one segfaulted the other).
# 1. Each environment counts the readers holding it; a reader holds a file from its first read until it
#    releases it (`LmdbReader.release`, `LmdbReader.close`, or its garbage collection).
# 2. The environment is closed when its last holder lets go, never before.
# 3. An environment never crosses a fork: the child closes what it inherited and counts afresh.
# 4. A fork waits until no thread is inside a py-lmdb call (`CALLS`), and holds `_ENVS_LOCK` across it: a
#    child that inherits a call in flight waits for ever in its first close (py-lmdb waits for the calls it
#    counts to end), and one that inherits the lock held waits for ever in its first open.
# 5. An environment is a file's, not a name's: a store replaced at its path (`fastdata preprocess --overwrite`
#    while a dataset of the old one is still open in the process) is a new environment, the old file's staying
#    with its holders (keyed by the path alone, a new dataset read the old images beside the new labels).
_ENVS: dict[str, list[Any]] = {}  # `_key` (resolved path, file identity) -> [env, readers holding it]
_ENVS_PID = -1
# Loader threads reach a new store at once: only one may open it. Re-entrant: the collector may run a dropped
# reader's finalizer (a release) inside the locked region, on the same thread.
_ENVS_LOCK = threading.RLock()


def _key(real: str) -> str:
    """The key of the store file at the resolved path ``real``: the path and the file's identity (rule 5); a
    missing file keeps its path alone (lmdb.open says so)."""
    try:
        st = os.stat(real)
    except OSError:
        return real
    return f"{real}\0{st.st_dev}:{st.st_ino}"


class _Calls:
    """Threads inside py-lmdb calls, which a fork waits for (NOTE [shared environments] 4). Never entered twice
    by one thread: a fork waiting for it would wait for ever."""

    def __init__(self) -> None:
        self.cond = threading.Condition(threading.Lock())
        self.inside, self.forking = 0, False

    def __enter__(self) -> None:
        with self.cond:
            while self.forking:
                self.cond.wait()
            self.inside += 1

    def __exit__(self, *exc: Any) -> None:
        with self.cond:
            self.inside -= 1
            if not self.inside:
                self.cond.notify_all()

    def before_fork(self) -> None:
        self.cond.acquire()  # held until after the fork: no thread starts a call meanwhile
        self.forking = True
        while self.inside:
            self.cond.wait()
        _ENVS_LOCK.acquire()

    def after_fork_in_parent(self) -> None:
        _ENVS_LOCK.release()
        self.forking = False
        self.cond.notify_all()
        self.cond.release()

    def after_fork_in_child(self) -> None:
        global _ENVS_LOCK
        _ENVS_LOCK = threading.RLock()  # (the parent's is held by the forking thread, which is this one)
        self.__init__()  # type: ignore[misc]


CALLS = _Calls()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=CALLS.before_fork, after_in_parent=CALLS.after_fork_in_parent,
                        after_in_child=CALLS.after_fork_in_child)


def _forked() -> None:
    """In a forked child (``_ENVS_LOCK`` held): close every inherited environment and start counting afresh.
    Closed, not only dropped: a read transaction inherited from the parent (a loader thread's batch,
    DALILoader's planned one) would keep an environment alive, and while it lives py-lmdb refuses to open
    the same file again."""
    global _ENVS_PID
    if _ENVS_PID == os.getpid():
        return
    inherited = [entry[0] for entry in _ENVS.values()]
    _ENVS.clear()
    _ENVS_PID = os.getpid()
    for old in inherited:
        with contextlib.suppress(Exception):
            old.close()


class Holds:
    """The environments one reader holds in this process (NOTE [shared environments]); with a ``bound``, at
    most that many, least recently used let go first, never one a read block still uses (NOTE [open files]
    in fastdata/_limits.py). A store's path is resolved each time it is opened, and refused unless it stays
    ``inside`` the dataset's folder (NOTE [manifest paths] in fastdata/_io.py)."""

    def __init__(self, bound: Optional[int] = None, inside: Optional[str] = None) -> None:
        self.pid = -1
        self.bound, self.inside = bound, inside
        self.envs: OrderedDict[str, Any] = OrderedDict()  # resolved path -> environment
        self.keys: dict[str, str] = {}  # path as given -> resolved, while held...
        self.names: dict[str, str] = {}  # ...and back
        self.busy: dict[str, int] = {}  # bounded: environments inside a read block, and how many blocks
        self.reserved = 0  # bounded: stores the read blocks in flight may hold (`room`)

    def held(self) -> int:
        return len(self.envs)

    def env(self, path: str) -> tuple[Any, str]:
        """``path``'s environment, opened in this process if it is not yet, and its key; bounded, it counts as
        used until `done` (called inside `CALLS`)."""
        if self.bound is None and self.pid == os.getpid():
            key = self.keys.get(path, "")
            env = self.envs.get(key)
            if env is not None:  # the common case: no lock on the read path
                return env, key
        with _ENVS_LOCK:
            self._here()
            key = self.keys.get(path)
            if key is None or key not in self.envs:
                key = self._open(path)
            env = self.envs[key]
            if self.bound is not None:
                self.busy[key] = self.busy.get(key, 0) + 1
                self.envs.move_to_end(key)
                self._trim()
            return env, key

    def _here(self) -> None:
        """Start counting afresh in a forked child (``_ENVS_LOCK`` held): what it held in the parent is not
        counted here."""
        _forked()
        if self.pid != os.getpid():
            self.pid, self.envs, self.keys, self.names, self.busy = os.getpid(), OrderedDict(), {}, {}, {}
            self.reserved = 0

    def room(self, stores: int) -> int:
        """How many stores a read block over ``stores`` may hold at once (bounded): all of them when they fit
        beside the stores the blocks in flight may hold, else what is left, at least one (never a wait: this
        thread may itself be inside a block). Give it back with `give_back` when the block ends."""
        with _ENVS_LOCK:
            self._here()
            granted = max(1, min(stores, self.bound - self.reserved))  # type: ignore[operator]
            self.reserved += granted
            return granted

    def give_back(self, granted: int, pid: int) -> None:
        """The room `room` granted in process ``pid`` (a block begun before a fork ends in the child too: not
        the child's to give back)."""
        with _ENVS_LOCK:
            if self.pid == pid == os.getpid():
                self.reserved -= granted

    def _trim(self) -> None:
        """Let go of the least recently used stores no read block uses, down to the bound (``_ENVS_LOCK``
        held); a block reading more stores than the bound keeps them until it ends (`done`)."""
        excess = len(self.envs) - self.bound  # type: ignore[operator]
        if excess <= 0:
            return
        idle = []
        for k in self.envs:
            if len(idle) == excess:
                break
            if not self.busy.get(k):
                idle.append(k)
        for old in idle:
            self._let_go(old)

    def _open(self, path: str) -> str:
        # (resolving stats each component: once a store is opened, not once a batch)
        real = os.path.realpath(path) if self.inside is None else resolved_inside(path, self.inside, path)
        key = _key(real)
        while key not in self.envs:
            entry = _ENVS.get(key)
            if entry is None:
                import lmdb

                entry = _ENVS[key] = [lmdb.open(real, subdir=False, readonly=True, lock=False, readahead=False,
                                                meminit=False, max_readers=1024), 0]
            entry[1] += 1
            if _ENVS.get(key) is entry:  # (else a finalizer closed it meanwhile: open it again)
                self.envs[key] = entry[0]
        self.keys[path], self.names[key] = key, path
        return key

    def done(self, key: str, pid: int) -> None:
        """A read block that took the environment of ``key`` from `env` in process ``pid`` has ended (bounded
        readers only; the key, not the path: a store let go of meanwhile has no path left)."""
        with _ENVS_LOCK:
            if self.pid == pid == os.getpid() and self.busy.get(key):
                self.busy[key] -= 1
                if not self.busy[key]:
                    del self.busy[key]
                    self._trim()

    def release(self, path: Optional[Path] = None) -> None:
        """Let go of ``path`` (None: of every file held); the last holder closes the environment (under the
        lock: py-lmdb refuses to open a file again while its old environment is not yet closed)."""
        with _ENVS_LOCK:
            if self.pid != os.getpid():  # held in the parent process: not ours to count down
                return
            real = None if path is None else os.path.realpath(path)
            for key in [k for k in self.envs if real is None or k.split("\0", 1)[0] == real]:
                self._let_go(key)

    def _let_go(self, key: str) -> None:
        if self.envs.pop(key, None) is None:
            return
        self.keys.pop(self.names.pop(key, ""), None)
        entry = _ENVS[key]
        entry[1] -= 1
        if entry[1] == 0:
            del _ENVS[key]
            entry[0].close()


def ended(txn: Any) -> None:
    """A read block's transaction ended (read-only: an abort), counted as a py-lmdb call."""
    with CALLS:
        txn.abort()
