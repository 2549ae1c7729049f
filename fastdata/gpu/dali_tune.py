"""``hw_decoder_load="auto"``: DALILoader's hardware/CUDA JPEG decode split, measured on the batches it serves.

NOTE [hw_decoder_load auto]:
1. What is chosen: DALI's mixed decoder gives the share ``hw_decoder_load`` of a batch's JPEGs to the GPU's
   hardware JPEG decoder (A100/H100-class) and decodes the rest with CUDA kernels, their Huffman stage on
   DALI's CPU threads. The best share depends on the GPU, the CPU threads, the image sizes and the model
   beside it; DALI's documentation says to find it empirically. `CANDIDATES` are tried in turn.
2. Order: 0.65 first (DALI's default: the first batches come as they would without a trial), then the
   extremes 0 and 1, then 0.9 and 0.5.
3. Every candidate serves real batches, in the loader's order. Its first outputs are not timed: the
   pipeline's first batches (buffers allocated, prefetch queue filled), and for the first candidate the
   consumer's first steps too (cuDNN autotuning or compilation hold the loader back, a few batches ahead).
   Then one window of at least `HwLoadTrial.batches` outputs and `HwLoadTrial.seconds` (a steady figure
   for small batches as for large), timed by CUDA events recorded on the stream that carries the batches
   (no host sync inside the window; one at its end): the pace at which batches became ready, the loader's
   own when it is the bottleneck, the model's step with the decoder's kernels beside it when not. At an
   epoch's end the window goes on in the next iteration (warmed up again): the candidate's figure is its
   windows' seconds over their outputs, so epochs shorter than a window still settle the trial (epochs
   shorter than the warm-up never do: the first candidate, DALI's default, stays). A window cut by a
   ``break`` or a decode error is dropped.
4. Switching candidates loses no batch and serves none twice: the measured pipeline's source ends (the
   epoch's plan set aside), DALI's batches in flight are served, the pipeline is reset, and the next one
   pulls the plan where it stopped. The sampler counts handed-out batches only, so ``state_dict()``, resume
   and the order are those of a fixed load (DALILoader._produce, _switch).
5. Memory: at most two pipelines live at once, the best so far (reset, kept so that choosing it costs no
   rebuild) and the one under trial. Once chosen, the others are dropped and DALI's memory pools give
   their unused blocks back (``ReleaseUnusedMemory``).
6. The choice (`choose`): the fewest seconds a batch; loads within `TOLERANCE` of it count as equal, and
   the highest of them wins, since the hardware decoder leaves the SMs to the model, which a loader-bound
   window cannot see.
7. Settling early (`flat`): when the first three candidates are within `TOLERANCE` of one another, the load
   makes no difference here: a GPU without a hardware decoder (DALI then ignores the load) or a loader far
   from being the bottleneck. A batch's decode time modelled as ``max(a * load, b * (1 - load)) + c``
   cannot give three equal times at three loads unless it does not depend on the load.
8. On the CPU there is no hardware decoder: ``"auto"`` is DALI's default, with no trial.
9. Under DDP (``lockstep``) each rank measures and chooses on its own (the load changes how fast batches
   come, never which), but every rank switches pipelines at the same output: a window ends on a count of
   outputs (`LOCKSTEP_BATCHES`), not on the host's clock, and every candidate is measured (no early
   settling, which one rank may reach and another not); a window cut by a decode error counts on (its
   figure then holds the recovery). A rank rebuilding its pipeline while the others time a window would
   stall their collectives inside it, and their figures with them. It relies on every rank serving as many
   batches an epoch, as DDP training needs anyway (DALILoader pads by default when ``train``).
"""
from __future__ import annotations

import numbers
import time
from typing import Any, Mapping, Optional, Sequence

import torch

CANDIDATES = (0.65, 0.0, 1.0, 0.9, 0.5)  # NOTE [hw_decoder_load auto] 2
TOLERANCE = 0.03  # loads within 3% count as equal: under the 5% that issue #40 allows, room left for noise
LOCKSTEP_BATCHES = 32  # a window's timed outputs under DDP: a count every rank reaches at the same step (rule 9)


def valid_load(value: Any) -> bool:
    """Whether ``value`` is an ``hw_decoder_load`` DALILoader takes: None (DALI's default), ``"auto"``, or a
    real number in [0, 1] (not a bool)."""
    if value is None or value == "auto":
        return True
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and 0.0 <= value <= 1.0


def choose(seconds_per_batch: Mapping[float, float], tolerance: float = TOLERANCE) -> Optional[float]:
    """The load to keep among those measured (NOTE [hw_decoder_load auto] 6).

    Args:
        seconds_per_batch: Each measured load's seconds a batch.
        tolerance: Loads within this fraction of the fastest count as equal; the highest of them wins.

    Returns:
        The chosen load, or None when nothing was measured.
    """
    if not seconds_per_batch:
        return None
    best = min(seconds_per_batch.values())
    return max(load for load, s in seconds_per_batch.items() if s <= best * (1 + tolerance))


def flat(seconds: Sequence[float], tolerance: float = TOLERANCE) -> bool:
    """Whether the times of three or more loads are all within ``tolerance`` of the fastest: the load makes
    no difference (NOTE [hw_decoder_load auto] 7)."""
    return len(seconds) >= 3 and max(seconds) <= min(seconds) * (1 + tolerance)


class HwLoadTrial:
    """The candidates' measurements and which load comes next; DALILoader switches pipelines by it.

    Args:
        device: The device the batches are made on: CUDA events time the windows there, the host clock
            elsewhere.
        candidates: The loads to try, in order (default `CANDIDATES`).
        warmup: Untimed outputs of each candidate's pipeline before its window (default 4).
        first_warmup: The same for the first candidate, which also sees the consumer's first steps
            (default 12).
        batches: Timed outputs a window, at least (default 8).
        seconds: Seconds a window lasts, at least (default 0.5: the trial takes a few seconds).
        tolerance: See `choose` and `flat` (default `TOLERANCE`).
        lockstep: Every rank of a DDP run switches at the same output (NOTE [hw_decoder_load auto] 9):
            windows of `LOCKSTEP_BATCHES` outputs (``batches`` and ``seconds`` ignored), every candidate
            measured (default False).

    Attributes:
        seconds_per_batch: Each measured load's seconds a batch, in the order measured.
        chosen: The load kept once the trial is over (None until then).
    """

    def __init__(self, device: torch.device, candidates: Sequence[float] = CANDIDATES, *, warmup: int = 4,
                 first_warmup: int = 12, batches: int = 8, seconds: float = 0.5,
                 tolerance: float = TOLERANCE, lockstep: bool = False) -> None:
        if not candidates or min(warmup, first_warmup, batches) < 1:
            raise ValueError("a trial needs candidates, and warmup, first_warmup and batches >= 1")
        if lockstep:
            batches, seconds = LOCKSTEP_BATCHES, 0.0
        self.device, self.candidates = device, tuple(float(c) for c in candidates)
        self.warmup, self.first_warmup, self.batches, self.seconds = warmup, first_warmup, batches, seconds
        self.tolerance, self.lockstep = tolerance, lockstep
        self.seconds_per_batch: dict[float, float] = {}
        self.chosen: Optional[float] = None
        self._carried = (0.0, 0, 0.0)  # the current candidate's windows ended with an epoch: seconds, outputs, host s

    @property
    def done(self) -> bool:
        """Whether the load is chosen."""
        return self.chosen is not None

    @property
    def load(self) -> float:
        """The load to run now: the next candidate to measure, or the chosen one."""
        if self.chosen is not None:
            return self.chosen
        return next(c for c in self.candidates if c not in self.seconds_per_batch)

    def pick(self) -> Optional[float]:
        """The load `choose` keeps among those measured so far (the pipeline worth keeping)."""
        return choose(self.seconds_per_batch, self.tolerance)

    def enough(self, outputs: int, host_s: float) -> bool:
        """Whether the current candidate's windows, with one more of ``outputs`` timed over ``host_s`` seconds
        of the host's clock, make a figure."""
        _, n, host = self._carried
        return n + outputs >= self.batches and host + host_s >= self.seconds

    def add(self, load: float, seconds: float, outputs: int, host_s: float) -> None:
        """One window of ``load``: its figure is recorded once its windows are `enough`, else carried on."""
        s, n, host = self._carried
        s, n, host = s + seconds, n + outputs, host + host_s
        self._carried = (s, n, host)
        if n >= self.batches and host >= self.seconds:
            self._carried = (0.0, 0, 0.0)
            self.record(load, s / n)

    def record(self, load: float, seconds_per_batch: float) -> None:
        """One window's result; the trial ends after the last candidate, or early when the first three
        are `flat` (not in ``lockstep``)."""
        self.seconds_per_batch[load] = seconds_per_batch
        measured = list(self.seconds_per_batch.values())
        early = not self.lockstep and len(measured) == 3 and flat(measured, self.tolerance)
        if len(measured) == len(self.candidates) or early:
            self.chosen = self.pick()

    def window(self) -> Optional["Window"]:
        """A window for the current candidate, None once the load is chosen."""
        if self.done:
            return None
        warmup = self.warmup if self.seconds_per_batch or self._carried[1] else self.first_warmup
        return Window(self, self.load, warmup)


class Window:
    """One candidate's outputs in one iteration: ``warmup`` untimed, then timed until the candidate's windows
    are `HwLoadTrial.enough` (NOTE [hw_decoder_load auto] 3).

    Args:
        trial: The trial the result is recorded in.
        load: The candidate whose pipeline made the outputs.
        warmup: Untimed outputs first.
    """

    def __init__(self, trial: HwLoadTrial, load: float, warmup: int) -> None:
        self.trial, self.load, self.warmup = trial, load, warmup
        self.outputs = 0
        self.start: Any = None
        self.last: Any = None
        self.host_start = 0.0

    def _stamp(self) -> Any:
        if self.trial.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.trial.device))  # after the batch's copy on this stream
        return event

    def _seconds(self) -> float:
        if self.trial.device.type != "cuda":
            return self.last - self.start
        self.last.synchronize()  # once a window, on the thread that makes the batches
        return self.start.elapsed_time(self.last) / 1e3

    def tick(self) -> bool:
        """Count one output, its work already queued on the current stream. Returns True when this output
        made the candidate's figure (recorded in the trial)."""
        self.outputs += 1
        if self.outputs < self.warmup:
            return False
        stamp = self._stamp()
        if self.outputs == self.warmup:
            self.start, self.host_start = stamp, time.perf_counter()
            return False
        self.last = stamp
        timed, host_s = self.outputs - self.warmup, time.perf_counter() - self.host_start  # the host's clock: no sync
        if not self.trial.enough(timed, host_s):
            return False
        self.trial.add(self.load, self._seconds(), timed, host_s)
        return True

    def close(self) -> None:
        """The epoch ended first: what this window timed is carried on to the candidate's next one."""
        if self.last is not None:
            host_s = time.perf_counter() - self.host_start
            self.trial.add(self.load, self._seconds(), self.outputs - self.warmup, host_s)
            self.last = None


def release_unused_memory() -> None:
    """Give the blocks DALI's memory pools hold unused back to the device and the host (the dropped
    candidates' buffers); safe while pipelines run."""
    from nvidia.dali.backend import ReleaseUnusedMemory

    ReleaseUnusedMemory()
