"""Timing shared by the model benchmarks: CUDA events around whole forward calls, ranks in step."""

from __future__ import annotations

import torch
import torch.distributed as dist


def cuda_event_times_ms(fn, ids, warmup: int, iters: int) -> list[float]:
    """Milliseconds of ``iters`` calls of ``fn(ids)`` after ``warmup`` calls, each timed with CUDA
    events; a barrier before each call keeps the ranks' calls aligned."""
    with torch.no_grad():
        for _ in range(warmup):
            fn(ids)
        times = []
        for _ in range(iters):
            dist.barrier()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(ids)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    return times
