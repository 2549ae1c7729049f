"""CUDA graphs for CUDAPrefetcher's image conversion: one replay a batch instead of about a hundred launches.

NOTE [graphed convert]: the rules of replaying the image conversion from CUDA graphs.

1. On a GPU, CUDAPrefetcher converts each image batch (crop, flip, normalise: 115 dispatched ops for
   random-resized-crop + flip, most of them small kernels on per-sample numbers) from the training loop's thread.
2. There every launch costs host time that a fast model's step cannot spare: for small models the data stall is
   host launch time (benchmarks/RESULTS.md).
3. Once a batch shape has been converted ``WARMUP`` times eagerly (which also fills the transforms' caches), its
   conversion up to the float32 normalised image is captured in a CUDA graph.
4. Each later batch of that shape costs a copy into the graph's input, a fill of its key, the replay, and the
   cast to the output dtype into a new tensor (a copy for float32).
5. The key is the batch's `Draws` key, read by the captured draw kernels, so each replay draws its own
   batch's numbers (NOTE [crop draws]).
6. The consumer gets that new tensor, never the graph's own buffers, so a batch kept past the next one stays
   intact.
7. The same kernels run on the same inputs, so the output is bit-equal to the eager path (tests/test_prefetch.py,
   on a GPU).
8. Graphs are used only where every op is known to be capturable (static shapes, no host sync): fastdata's
   RandomResizedCrop, RandomCrop, CenterCrop and RandomHorizontalFlip, alone or in a Compose, and Normalize.
9. Dict batches (their boxes change in number), other transforms and ``torch.Generator`` draws run eagerly.
10. At most ``MAX_SHAPES`` shapes are captured (typically a full and a last partial batch); each graph keeps its
    intermediates (about 2.5x its batch in float32) for the prefetcher's life.
11. A capture that fails leaves the eager path, with a warning.
12. ``FASTDATA_CUDA_GRAPHS=0`` or ``CUDAPrefetcher(cuda_graphs=False)`` turn graphs off.
13. A capture marks torch's default CUDA generator as capturing for the whole process, so the model's own random
    ops (dropout) fail while one is under way on another thread. With ``defer`` (CUDAPrefetcher's run_ahead:
    conversions on a side thread), a shape due for capture is converted eagerly and noted; the training thread
    captures it with `capture_due` between its steps, the side thread idle (NOTE [prefetch thread]).
"""
from __future__ import annotations

import os
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Optional

import torch

from ..imaging.draws import Draws
from ..imaging.transforms import CenterCrop, Compose, RandomCrop, RandomHorizontalFlip, RandomResizedCrop, Transform

ENV = "FASTDATA_CUDA_GRAPHS"
WARMUP = 2  # eager conversions of a shape before its capture: caches filled, lazy CUDA state made
MAX_SHAPES = 4  # graphs kept per prefetcher
MAX_SEEN = 64  # shapes counted towards a capture; a loader of ever-new shapes stays eager
CAPTURABLE = (RandomResizedCrop, RandomCrop, CenterCrop, RandomHorizontalFlip)

Convert = Callable[[torch.Tensor, Optional[Draws]], torch.Tensor]


def enabled() -> bool:
    """False where ``FASTDATA_CUDA_GRAPHS=0``."""
    return os.environ.get(ENV, "1") != "0"


def capturable(transforms: Optional[Transform]) -> bool:
    """Whether ``transforms`` use only ops a CUDA graph can hold: fastdata's own crops and flip (exact types:
    a subclass may sync), alone or in a `Compose`."""
    if transforms is None:
        return True
    if type(transforms) is Compose:
        return all(capturable(t) for t in transforms.transforms)
    return type(transforms) in CAPTURABLE


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    image: torch.Tensor  # the static input the captured kernels read
    key: torch.Tensor  # 0-d int64: the Draws key of the batch being replayed
    out: torch.Tensor  # the static output the captured kernels write
    draws: int  # numbers one conversion draws


def _release_default_generator(device: torch.device) -> None:
    """Undo what a failed capture leaves in torch's default CUDA generator of ``device``: ``torch.cuda.graph``
    marks its state as capturing, and only a capture that ends well clears the mark, so every later random op
    on the device fails ("Offset increment outside graph capture encountered unexpectedly"; torch 2.11).
    A clone of the state (the same seed and offset, unmarked) takes its place."""
    gen = torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    try:
        gen.graphsafe_set_state(gen.clone_state())
    except (AttributeError, RuntimeError) as exc:  # a torch without graph-safe generator states
        warnings.warn(f"after a failed CUDA-graph capture, torch's CUDA generator could not be reset ({exc}): "
                      f"random ops on {device} may fail; set {ENV}=0", RuntimeWarning, stacklevel=4)


class GraphedConvert:
    """``fn(image, draws)`` on CUDA tensors, replayed from a CUDA graph per input shape once that shape was
    converted eagerly ``WARMUP`` times (NOTE [graphed convert]). Returns ``fn``'s output or the graph's own
    static output: callers copy it out before the next call."""

    def __init__(self, fn: Convert, defer: bool = False) -> None:
        self.fn = fn
        self.graphs: dict[Hashable, _Graph] = {}
        self.seen: Counter = Counter()
        self.failed = False
        self.defer = defer  # captures wait for `capture_due` (13)
        self.due: set[tuple[Any, ...]] = set()  # with defer: the shapes to capture
        self._stream: Optional[torch.cuda.Stream] = None  # the capture's own stream (replays run on the caller's)

    def __call__(self, image: torch.Tensor, draws: Optional[Draws]) -> torch.Tensor:
        shape = (tuple(image.shape), image.stride(), image.dtype, image.device,
                 None if draws is None else draws.used)
        g = self.graphs.get(shape)
        if g is None:
            if self.failed or len(self.graphs) >= MAX_SHAPES or (shape not in self.seen and len(self.seen) >= MAX_SEEN):
                return self.fn(image, draws)
            self.seen[shape] += 1
            if self.seen[shape] <= WARMUP:
                return self.fn(image, draws)
            if self.defer:  # captured by the training thread (13); this one converts eagerly
                self.due.add(shape)
                return self.fn(image, draws)
            g = self._capture(*shape)
            if g is None:
                return self.fn(image, draws)
            self.graphs[shape] = g
        g.image.copy_(image)
        if draws is not None:
            g.key.fill_(draws.key)
            draws.used += g.draws
        g.graph.replay()
        return g.out

    def capture_due(self) -> None:
        """Capture the shapes a deferring converter noted (13), on the calling thread."""
        while self.due:
            shape = self.due.pop()
            if shape in self.graphs or self.failed or len(self.graphs) >= MAX_SHAPES:
                continue
            g = self._capture(*shape)
            if g is not None:
                self.graphs[shape] = g

    def _capture(self, size: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 start: Optional[int]) -> Optional[_Graph]:
        """A graph of ``fn`` on a static input of the layout a shape key names (the kernels are recorded, not
        run: no data is needed), drawing from the Draws key it holds, ``start`` numbers into its stream (None:
        no draws)."""
        static = torch.empty_strided(size, stride, dtype=dtype, device=device)
        key = torch.zeros((), dtype=torch.int64, device=device)
        keyed = None if start is None else Draws.keyed(key, start)
        graph = torch.cuda.CUDAGraph()
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=device)
        try:
            # A stream of its own: a failed capture can leave torch's allocator routing that stream's allocations
            # to the graph's pool, and torch.cuda.graph's stream current; the outer context restores the caller's
            # stream whatever happens. thread_local: the loader's threads may pin host memory meanwhile.
            with torch.cuda.stream(self._stream), torch.cuda.graph(graph, stream=self._stream,
                                                                   capture_error_mode="thread_local"):
                out = self.fn(static, keyed)
        except Exception as e:  # noqa: BLE001  (any capture failure: the eager path still works)
            self.failed = True
            _release_default_generator(device)
            warnings.warn(f"CUDAPrefetcher could not capture its batch conversion in a CUDA graph ({type(e).__name__}: "
                          f"{e}); it converts batches eagerly instead (the same values, more host time a batch). "
                          f"Set {ENV}=0 to skip the attempt.", RuntimeWarning, stacklevel=3)
            return None
        return _Graph(graph, static, key, out, 0 if keyed is None else keyed.used - start)
