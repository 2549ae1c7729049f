"""The training thread's profile for bench_gpu.py's stall rows (GPU issue 40, item 2): what is left on the thread
that runs the Trainer's steps, host ms a step by operator, over a few steps after the loader's start."""
from __future__ import annotations

from typing import Any

import torch

CONV = ("aten::conv2d", "aten::convolution", "aten::_convolution", "aten::linear")


def training_thread_profile(model: torch.nn.Module, loader: Any, steps: int, device: str,
                            skip: int = 3) -> dict[str, Any]:
    """Host time on the training thread over ``steps`` Trainer steps (after ``skip`` more that take the loader's
    start), by top-level operator: ms a step of each (top 8), of all recorded ones, and of the window (the rest is
    Python and waits the profiler does not name); and the gap between one optimizer step's end and the next
    forward's first op (the batch's ``next()``, the Trainer's bookkeeping), with the ops inside it. The training
    thread is the one that runs ``Optimizer.step``. Diagnostic: a failure is returned, never raised."""
    from bench_gpu import fit

    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device == "cuda" else [])
    try:
        with torch.profiler.profile(activities=acts) as prof:
            fit(model, loader, skip + steps, device)
        events = list(prof.events())
        marks = sorted((e for e in events if e.name.startswith("Optimizer.step#")), key=lambda e: e.time_range.start)
        if len(marks) < skip + 1:
            return {"error": f"{len(marks)} Optimizer.step marks in the profile, expected {skip + steps}"}
        tid = marks[0].thread
        marks = marks[skip - 1:]
        t0, t1, n = marks[0].time_range.end, marks[-1].time_range.end, len(marks) - 1
        top: list[Any] = []  # the thread's outermost events (by time: kineto may leave a runtime call unparented)
        for e in sorted((e for e in events if e.thread == tid and str(e.device_type).endswith("CPU")
                         and t0 <= e.time_range.start and e.time_range.end <= t1),
                        key=lambda e: (e.time_range.start, -e.time_range.end)):
            if not top or e.time_range.start >= top[-1].time_range.end:
                top.append(e)
        by_op: dict[str, float] = {}
        for e in top:
            by_op[e.name] = by_op.get(e.name, 0.0) + e.time_range.elapsed_us() / 1e3 / n
        gap_ms, gap_ops, k = 0.0, {}, 0
        for a in marks[:-1]:  # each step's gap: this optimizer step's end -> the next forward's first op
            after = [e for e in top if e.time_range.start >= a.time_range.end]
            first = next((e for e in after if e.name in CONV), None)
            if first is None:
                continue
            k += 1
            gap_ms += (first.time_range.start - a.time_range.end) / 1e3
            for e in after:
                if e is first:
                    break
                gap_ops[e.name] = gap_ops.get(e.name, 0.0) + e.time_range.elapsed_us() / 1e3
        ranked = sorted(by_op.items(), key=lambda kv: -kv[1])
        return {"steps": n, "window_ms_per_step": (t1 - t0) / 1e3 / n,
                "recorded_ms_per_step": sum(by_op.values()), "top_ops_ms_per_step": dict(ranked[:8]),
                "between_steps_ms": gap_ms / max(k, 1),
                "between_steps_ops_ms": dict(sorted(((o, v / max(k, 1)) for o, v in gap_ops.items()),
                                                    key=lambda kv: -kv[1])[:6])}
    except Exception as exc:  # noqa: BLE001 - the profile explains a figure; it must not lose the figure
        return {"error": f"{type(exc).__name__}: {exc}"}


def show_profile(p: dict[str, Any] | None) -> None:
    """Print a training_thread_profile."""
    if not p:
        return
    if "error" in p:
        print(f"    training-thread profile failed: {p['error']}")
        return
    ops = ", ".join(f"{k} {v:.2f}" for k, v in list(p["top_ops_ms_per_step"].items())[:5])
    gap = ", ".join(f"{k} {v:.2f}" for k, v in p["between_steps_ops_ms"].items())
    print(f"    training thread, {p['steps']} profiled steps: {p['window_ms_per_step']:.2f} ms a step, "
          f"{p['recorded_ms_per_step']:.2f} of it in ops (top: {ops}); between the optimizer step and the next "
          f"forward {p['between_steps_ms']:.2f} ms ({gap or 'no op'})")
