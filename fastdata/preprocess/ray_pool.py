"""Ray tasks in place of the local process pool: ``fastdata preprocess ... --ray [ADDRESS]`` (``engine="ray"``).

Ray is optional (``pip install 'fastdata[ray]'``) and imported only here, inside the functions that need it.
Every node of the cluster needs fastdata installed in the Python that runs its Ray workers.

NOTE [ray byte-identity]: a run on Ray writes the same bytes as the local run, for any number of nodes and
workers, and its tasks write the shards themselves: the driver plans, journals and writes the manifest.
1. Unit ``k`` (an npy or LMDB shard) holds what decodes of source positions ``[k * S, (k + 1) * S)`` (of the
   source order, or of the ``--shuffle`` permutation): its bytes are a function of its own samples
   (fastdata/formats/base.py), so one task can make it alone, exactly as the local run's writer does.
2. The driver plans one task per unit after the last journaled one. A task loads its samples (a slice of
   the listing; of tars and Parquet, its own files' records only: NOTE [indexed source] in indexed.py),
   decodes them with the local pool's worker functions (``image_tasks.work``, ``image_tasks.work_fields``) and the same
   writer, in a staging folder of its own (in OUT's partial folder, or on its node for an OUT at a URL),
   then publishes the finished files under their final names (a rename, or one put each: NOTE [output at
   a URL] in store_out.py) and returns their sizes and sha256 and its skipped samples (named by path).
3. A task whose worker dies is run again by Ray (``max_retries``): every attempt stages its own files and a
   publish replaces a final name with the same complete bytes, so no final name ever has two writers
   under way, nor a partial file. Only results taken in order are journaled.
4. The journal, the resume and the manifest are the local run's (journal.py): a killed driver is resumed
   by rerunning the same command, which submits tasks only after the last journaled unit; a task's result
   travels as a few hundred bytes, not its pixels.
5. ``preprocess text --ray`` runs one task per piece of the source in the same way (NOTE [text pieces] in
   fastdata/preprocess/text.py): a piece's shards are a function of its own documents.
"""
from __future__ import annotations

import itertools
import logging
import os
import socket
from collections import deque
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

from ..errors import FastdataError, MissingDependencyError, SourceError

log = logging.getLogger(__name__)

ENGINES = ("local", "ray")
_WINDOW = 2  # tasks in flight per worker slot, as the local pool
_RETRIES = 3  # runs of a task after its worker died (Ray's own default, made explicit)
_PROBE_S = 5.0  # ray.init retries an unreachable address for minutes: a plain TCP connect answers first
_START_HINT = ("start one with `ray start --head` on the head machine (and `ray start --address HEAD:6379` on the "
               "others), then pass the address it printed as --ray HOST:PORT; --ray alone connects to a cluster "
               "started on this machine or starts a local one")


def import_ray() -> Any:
    """The ``ray`` module.

    Raises:
        MissingDependencyError: Ray is not installed; the message names the extra.
    """
    try:
        import ray
    except ImportError as exc:
        raise MissingDependencyError("--ray (engine='ray') needs Ray: pip install 'fastdata[ray]'") from exc
    return ray


def _probe(address: str) -> None:
    """Refuse an address nothing listens on, in seconds (``ray.init`` would retry it for minutes)."""
    hostport = address.split("://", 1)[-1]
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        raise FastdataError(f"--ray {address!r} is not HOST:PORT: {_START_HINT}")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=_PROBE_S):
            pass
    except OSError as exc:
        raise FastdataError(f"cannot reach a Ray cluster at {address} ({exc.strerror or exc}): {_START_HINT}") from exc


def connect(address: Optional[str]) -> Any:
    """Connect this process to Ray (once; a process already connected keeps its connection).

    Args:
        address: ``HOST:PORT`` (or ``ray://HOST:PORT``) of a running cluster; None or ``"auto"``: the cluster
            started on this machine, or else a new local one (said in one log line).

    Returns:
        The ``ray`` module, initialised.

    Raises:
        MissingDependencyError: Ray is not installed.
        FastdataError: Nothing answers at ``address``; the message says how to start a cluster.
    """
    ray = import_ray()
    given = address not in (None, "", "auto")
    if ray.is_initialized():
        current = ray.get_runtime_context().gcs_address
        if given and address != current and not address.startswith("ray://"):
            _probe(address)  # an unreachable address is named as such
            raise FastdataError(f"this process is already connected to the Ray cluster at {current}, not {address}: "
                                f"call ray.shutdown() first, or pass --ray {current}")
        return ray
    if not given:
        try:
            ray.init(address="auto", logging_level=logging.WARNING)
        except ConnectionError:
            log.warning("no Ray cluster is running on this machine: starting a local one with every core here (for "
                        "a cluster: `ray start --head` on its head, then --ray HOST:PORT)")
            ray.init(include_dashboard=False, logging_level=logging.WARNING)
        return ray
    _probe(address)
    try:
        ray.init(address=address, logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError) as exc:
        raise FastdataError(f"cannot connect to the Ray cluster at {address} ({exc}): {_START_HINT}") from exc
    return ray


def _call(fn: Callable[..., Any], task: Any, slotted: bool, needs: Sequence[str]) -> Any:
    """A Ray task: the local pool's worker function on one task (no shared slot: the data is returned)."""
    for path in needs:  # else every file would be skipped as unreadable, or written where no one looks
        if not os.path.exists(path):
            raise SourceError(f"{path} is not visible on the Ray node {socket.gethostname()}: each node reads the "
                              "source and writes its shards itself, so put SRC and OUT where every node mounts "
                              "them at the same path, or use URLs (s3://...)")
    return fn(task, None) if slotted else fn(task)


class RayPool:
    """Runs a preprocess's tasks on a Ray cluster, results in task order (NOTE [ray byte-identity]).

    Args:
        workers: Worker slots: tasks run at once across the cluster (``_WINDOW`` times as many in flight).
        num_cpus: The CPUs each task asks Ray for.
        needs: Paths every task uses (the source folder, a local OUT): a task on a node that does not see
            one fails with a `SourceError` instead of skipping every sample as unreadable (default none).
    """

    def __init__(self, workers: int, num_cpus: float = 1.0, needs: Sequence[str] = ()) -> None:
        self.workers, self.num_cpus, self.needs = workers, num_cpus, tuple(needs)

    @classmethod
    def open(cls, address: Optional[str], workers_per_node: Optional[int] = None,
             needs: Sequence[str] = ()) -> "RayPool":
        """Connect (`connect`) and size the pool from the cluster's live nodes.

        Args:
            address: As `connect`.
            workers_per_node: Tasks at once on the smallest node: each task asks for its ``CPUs /
                workers_per_node`` (whole CPUs when that is 1 or more: Ray gives fractions of one CPU only), so
                a node with more CPUs runs proportionally more at once (nodes of 1 and 3 CPUs, 1: one and
                three); the pool's ``workers`` is ``workers_per_node`` x nodes, twice that submitted at once.
                None: one task per CPU of the cluster.
            needs: As the class takes it.

        Returns:
            The pool.
        """
        ray = connect(address)
        cpus = [n["Resources"].get("CPU", 0.0) for n in ray.nodes() if n.get("Alive")]
        cpus = [c for c in cpus if c > 0]
        if not cpus:
            raise FastdataError(f"the Ray cluster at {address or 'auto'} has no node with a CPU: add one "
                                "(`ray start --address HEAD:6379 --num-cpus N`)")
        need = [str(p) for p in needs]
        if workers_per_node is None:
            pool = cls(max(1, int(sum(cpus))), 1.0, need)
        else:  # Ray takes fractions of one CPU, or whole CPUs
            share = min(cpus) / workers_per_node
            pool = cls(workers_per_node * len(cpus), float(int(share)) if share >= 1 else share, need)
        log.info("running on Ray: %d node(s), %g CPUs, %d task(s) at once", len(cpus), sum(cpus), pool.workers)
        return pool

    def ordered_map(self, fn: Callable[..., Any], tasks: Iterable[Any], workers: Optional[int] = None,
                    slot_bytes: Optional[int] = None) -> Iterator[Any]:
        """`fastdata.preprocess.parallel.ordered_map` on Ray: the same calls of ``fn``, the same results
        in the same order (with ``slot_bytes`` given, ``(result, None)``: a Ray task returns its data).

        Raises:
            FastdataError: A task's worker died more than ``_RETRIES`` times. An error raised by ``fn`` is
                raised here as it was raised in the task.
        """
        ray = import_ray()
        # SPREAD: the tasks in flight are queued at the nodes, not all at the driver's, so a node that finishes
        # a task starts its next at once. With Ray's default a queued task reaches another node only when the
        # driver's node learns it is free, and the other nodes idle between tasks (bench_cluster.py's 1 -> 2
        # node row, benchmarks/RESULTS.md).
        remote = ray.remote(_call).options(num_cpus=self.num_cpus, max_retries=_RETRIES, retry_exceptions=False,
                                           scheduling_strategy="SPREAD")
        it = iter(tasks)
        pending: deque[Any] = deque()
        slotted = slot_bytes is not None
        try:
            for t in itertools.islice(it, _WINDOW * (workers or self.workers)):
                pending.append(remote.remote(fn, t, slotted, self.needs))
            while pending:
                r = _get(ray, pending.popleft())
                for t in itertools.islice(it, 1):
                    pending.append(remote.remote(fn, t, slotted, self.needs))
                yield (r, None) if slotted else r
        finally:
            for ref in pending:  # an error, an interrupt or a consumer that stopped: leave no work behind
                try:
                    ray.cancel(ref)
                except Exception:  # already finished, or the cluster is gone: nothing to cancel
                    pass


def _get(ray: Any, ref: Any) -> Any:
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as exc:  # fn raised: the same exception as in the local pool
        cause = getattr(exc, "cause", None)
        if isinstance(cause, BaseException):
            raise cause from None
        raise FastdataError(f"a preprocessing task failed on Ray: {exc}") from exc
    except ray.exceptions.RayError as exc:  # a worker or node died once more than Ray retries
        raise FastdataError(f"a preprocessing task's Ray worker died {_RETRIES + 1} times (killed, or out of "
                            f"memory?) [{type(exc).__name__}]: rerun the same command to resume") from exc
