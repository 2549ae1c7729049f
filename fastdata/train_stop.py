"""Stopping a training run on a signal with a checkpoint: preemption by SLURM, Kubernetes or a spot VM.

NOTE [stop signals]: while :meth:`Trainer.fit` runs with a checkpoint folder, SIGTERM (what Kubernetes,
systemd, ``kill`` and torchrun's agent send) and SIGUSR1 (what SLURM's ``--signal`` sends) no longer end
the process at once: the handler only records the signal, and the loop stops at an optimizer-step boundary,
where weights, optimizer, scheduler and loader position agree, saves a checkpoint there and returns. A
signal that arrived mid-step would otherwise be a checkpoint of a half-applied step, or none at all.

- One process stops after the step it is in.
- Ranks of a process group must stop at the same step, or the ones that go on wait forever in their next
  collective. Each rank's "signal seen" rides on the log interval's reduce (one tiny MAX all-reduce next
  to the interval's sums, no extra sync), so every rank stops after the same step: within ``log_every``
  steps of the signal. torchrun's agent gives its workers 30 s after forwarding SIGTERM, then kills them;
  keep ``log_every`` steps plus a checkpoint write under that (or the scheduler's grace period).
- Further signals while stopping are ignored (``kill -9`` still ends the process). Ctrl-C (SIGINT) stops
  at once as it always has: the last checkpoint written is the one ``--resume`` continues from.
- Handlers are Python's, so they are set only from the main thread, and the previous ones come back when
  ``fit`` returns.
"""
from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType
from typing import Any, Optional

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopSignals:
    """``with StopSignals(enabled) as s:`` records the first SIGTERM/SIGUSR1 in ``s.received`` (its number)
    instead of letting it end the process. ``enabled`` is the same on every rank (ranks agree on a stop
    only if they all ask); the handlers are installed only where Python can run them, the main thread."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.received: Optional[int] = None
        self._previous: dict[int, Any] = {}

    def _record(self, signum: int, frame: Optional[FrameType]) -> None:
        if self.received is None:  # set once: a repeat (torchrun forwards what the job already got) changes nothing
            self.received = signum

    def __enter__(self) -> "StopSignals":
        if self.enabled and threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._record)
        return self

    def __exit__(self, kind: Optional[type], exc: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name
