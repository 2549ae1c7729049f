"""A batch's tensors copied to a device: every CPU tensor, views of one storage (a token batch's x and y)
crossing once as the span they cover (NOTE [prefetch] 2 in prefetch.py)."""
from __future__ import annotations

from typing import Any, Callable

import torch


def walk(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """Apply ``fn`` to every tensor in a nested tuple/list/dict; other leaves pass through."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: walk(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [walk(v, fn) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """``[lo, hi)``: the storage elements a (non-negatively strided, non-empty) tensor reads."""
    lo = t.storage_offset()
    return lo, lo + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1


def _within(t: torch.Tensor, span: list[int]) -> bool:
    """Whether ``t`` is non-empty and reads only storage elements of ``span`` (``[lo, hi, ...]``)."""
    if t.numel() == 0:
        return False
    lo, hi = _extent(t)
    return span[0] <= lo and hi <= span[1]


def _storage_key(t: torch.Tensor) -> tuple[int, int, torch.dtype]:
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes(), t.dtype


def move(batch: Any, device: torch.device, pin: bool) -> tuple[Any, list[torch.Tensor]]:
    """Copy every CPU tensor of ``batch`` to ``device`` (always a copy, never an alias of a loader buffer).

    CPU tensors that view one storage, such as a token batch's ``x`` and ``y`` (one window buffer shifted by
    one), cross once as the span of storage they cover and become the same views on ``device``: half the
    bytes, and no host-side ``.contiguous()`` into pageable memory. With ``pin``, host memory is pinned first
    (buffers that already are, such as FastLoader's, are used as they are) and copies are non-blocking.
    Returns the moved batch and the host tensors read, which must stay alive until the copies complete.
    """
    leaves: list[torch.Tensor] = []
    walk(batch, leaves.append)
    spans: dict[tuple[int, int, torch.dtype], list[int]] = {}  # storage, dtype -> [lo, hi, elements used]
    for t in leaves:
        if t.device.type == "cpu" and t.numel() and not t.is_contiguous() and min(t.stride()) >= 0:
            lo, hi = _extent(t)
            span = spans.setdefault(_storage_key(t), [lo, hi, 0])
            span[0], span[1], span[2] = min(span[0], lo), max(span[1], hi), span[2] + t.numel()
    host: list[torch.Tensor] = []
    moved_spans: dict[tuple[int, int, torch.dtype], tuple[torch.Tensor, int]] = {}

    def copy(src: torch.Tensor) -> torch.Tensor:
        if pin and not src.is_pinned():
            src = src.pin_memory()
        host.append(src)
        return src.to(device, non_blocking=pin, copy=True)

    def one(t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "cpu":
            return t.to(device, copy=True)
        key = _storage_key(t)
        span = spans.get(key)
        # the span is no bigger than its views; a contiguous tensor outside it crosses on its own
        if span is not None and span[1] - span[0] <= span[2] and _within(t, span):
            if key not in moved_spans:
                moved_spans[key] = (copy(t.as_strided((span[1] - span[0],), (1,), span[0])), span[0])
            flat, lo = moved_spans[key]
            return flat.as_strided(t.shape, t.stride(), t.storage_offset() - lo)
        return copy(t if t.is_contiguous() else t.contiguous())

    return walk(batch, one), host
