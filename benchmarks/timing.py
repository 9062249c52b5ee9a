"""Timing shared by the model benchmarks: whole forward calls, ranks in step.

On CUDA each call is timed with CUDA events; on the CPU (``--smoke`` runs on gloo) with
``time.perf_counter``, which is what the CPU's synchronous execution allows.
"""

from __future__ import annotations

import time

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


def wall_times_ms(fn, ids, warmup: int, iters: int) -> list[float]:
    """The same as ``cuda_event_times_ms`` for CPU tensors: ``time.perf_counter`` around each call."""
    with torch.no_grad():
        for _ in range(warmup):
            fn(ids)
        times = []
        for _ in range(iters):
            dist.barrier()
            start = time.perf_counter()
            fn(ids)
            times.append((time.perf_counter() - start) * 1e3)
    return times


def times_ms(fn, ids, warmup: int, iters: int) -> list[float]:
    """CUDA events for CUDA inputs, wall time for CPU inputs."""
    timer = cuda_event_times_ms if ids.is_cuda else wall_times_ms
    return timer(fn, ids, warmup, iters)


class LineProgress:
    """A progress counter printing one line per step (when tqdm is not installed)."""

    def __init__(self, total: int, desc: str):
        self.total, self.done, self.desc = total, 0, desc

    def update(self, n: int = 1) -> None:
        self.done += n
        print(f"{self.desc}: {self.done}/{self.total}", flush=True)

    def close(self) -> None:
        pass


def progress_bar(total: int, desc: str):
    """tqdm when installed (the device machine may lack it), else one line per step."""
    try:
        from tqdm import tqdm
    except ImportError:
        return LineProgress(total, desc)
    return tqdm(total=total, desc=desc)
