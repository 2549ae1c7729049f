"""When a training run stops early, decided the same on every rank: on a signal (preemption by SLURM,
Kubernetes or a spot VM), or when ``max_time`` is reached.

NOTE [stop signals]: while `Trainer.fit` runs with a checkpoint folder, SIGTERM (what Kubernetes,
systemd, ``kill`` and torchrun's agent send) and SIGUSR1 (what SLURM's ``--signal`` sends) no longer end
the process at once: the handler only records the signal, and the loop stops at an optimizer-step boundary,
where weights, optimizer, scheduler and loader position agree, saves a checkpoint there and returns. A
signal that arrived mid-step would otherwise be a checkpoint of a half-applied step, or none at all.
A validation due at that step (``val_every_steps``, or the epoch's end) is not run before the save: a pass
over the validation set can outlast the grace period (torchrun's is 30 s) and lose the checkpoint. The
checkpoint says it is owed (``val_due``), and the resumed run runs it before its first step, so it validates,
and stops early, at the same steps as a run never stopped (a ``max_time`` stop owes it the same way). It saves a
checkpoint right after it, so a second stop or a kill before the next save does not make it again.
Further signals while stopping are ignored (``kill -9`` still ends the process). Ctrl-C (SIGINT) stops at
once as it always has: the last checkpoint written is the one ``--resume`` continues from (at a URL, once
the upload under way lands: Ctrl-C again leaves it; NOTE [checkpoint generations] rule 5). Handlers are
Python's, so they are set only from the main thread, and the previous ones come back when ``fit`` returns.

NOTE [agreed stops]: ranks of a process group must stop after the same step, or the ones that go on wait
forever in their next collective while the others save. Each rank's clock and signals are its own (a rank
that began ``fit`` a millisecond later reached ``max_time`` one step later, and the run hung), so:
- one process decides after every step;
- in a group, each rank's view rides on the log interval's reduce (one tiny MAX all-reduce beside the
  interval's sums, no extra sync), and every rank stops after the same step: within ``log_every`` steps.
  torchrun's agent gives its workers 30 s after forwarding SIGTERM, then kills them; keep ``log_every``
  steps plus a checkpoint write under that (or under the scheduler's grace period).
"""
from __future__ import annotations

import signal
import threading
import time
from types import FrameType, TracebackType
from typing import Any, Optional, Sequence

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class EarlyStops:
    """``with EarlyStops(catch_signals, max_time, alone) as stops:`` for the length of ``fit``.

    ``view()`` is this process's own ``(signal number or 0, 1 if max_time is reached)``; ``agree(seen)``
    takes the group's (the element-wise MAX over ranks); ``due()`` says whether to stop after this step.
    ``catch_signals`` must be the same on every rank: ranks agree on a stop only if they all ask.
    """

    def __init__(self, catch_signals: bool, max_time: Optional[float], alone: bool) -> None:
        self.catch_signals, self.max_time, self.alone = catch_signals, max_time, alone
        self.received: Optional[int] = None  # the first stop signal this process got
        self.signal: Optional[int] = None  # the one the run stopped on, once agreed
        self._agreed = (0, 0)
        self._start = time.monotonic()
        self._previous: dict[int, Any] = {}

    def _record(self, signum: int, frame: Optional[FrameType]) -> None:
        if self.received is None:  # set once: a repeat (torchrun forwards what the job already got) changes nothing
            self.received = signum

    def view(self) -> tuple[int, int]:
        time_up = self.max_time is not None and time.monotonic() - self._start >= self.max_time
        return self.received or 0, int(time_up)

    def agree(self, seen: Sequence[int]) -> None:
        self._agreed = (int(seen[0]), int(seen[1]))

    def due(self) -> Optional[str]:
        """``"signal"``, ``"max_time"`` or None: alone, from this process's view now; in a group, from the view
        the last log interval agreed on (NOTE [agreed stops])."""
        if self.alone:
            self._agreed = self.view()
        signum, time_up = self._agreed
        if signum:
            self.signal = signum
            return "signal"
        return "max_time" if time_up else None

    def __enter__(self) -> "EarlyStops":
        self._start = time.monotonic()
        if self.catch_signals and threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._record)
        return self

    def __exit__(self, kind: Optional[type], exc: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name
