"""Timing shared by the tuning command and the model benchmarks: whole forward calls, ranks in step.

On CUDA each call is timed with CUDA events; on the CPU (``--smoke`` runs on gloo) with
``time.perf_counter``, which is what the CPU's synchronous execution allows.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist


def _cuda_event_ms(fn, ids) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn(ids)
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _wall_ms(fn, ids) -> float:
    start = time.perf_counter()
    fn(ids)
    return (time.perf_counter() - start) * 1e3


def times_ms(fn, ids, warmup: int, iters: int) -> list[float]:
    """Milliseconds of ``iters`` calls of ``fn(ids)`` after ``warmup`` calls: CUDA events for CUDA
    inputs, ``time.perf_counter`` for CPU inputs. A barrier before each timed call keeps the ranks'
    calls aligned."""
    one_call_ms = _cuda_event_ms if ids.is_cuda else _wall_ms
    with torch.no_grad():
        for _ in range(warmup):
            fn(ids)
        times = []
        for _ in range(iters):
            dist.barrier()
            times.append(one_call_ms(fn, ids))
    return times


def interleaved_ms(cells: list, step, inputs, warmup: int, iters: int, rounds: int, prepare=None,
                   warmed=None, per_round: dict | None = None) -> dict:
    """Median milliseconds of each cell, the cells measured in turn: every cell is first warmed up
    (``warmup`` calls of ``step(cell)`` on ``inputs(cell)``, then ``warmed(cell)``), then ``rounds``
    rounds each time every cell for ``iters // rounds`` calls (after one more warm-up call); a cell's
    time is the median of its rounds' medians. ``prepare(cell)`` runs before a cell's calls (a
    global switch the cell needs). The lent machine's host speed drifts between and within runs
    (two processes of one run read the same Inductor decode step at 7.4 and 15.2 ms, 2026-12-02):
    measured in turn, every cell sees the same drift, so ratios between cells carry. ``per_round``
    (a dict), if given, receives each cell's list of round medians (ratios of two cells per round
    are paired: the same round saw the same drift)."""
    for cell in cells:
        if prepare is not None:
            prepare(cell)
        times_ms(step(cell), inputs(cell), warmup, 1)
        if warmed is not None:
            warmed(cell)
    calls = max(1, iters // rounds)
    samples: dict = {cell: [] for cell in cells}
    for _ in range(rounds):
        for cell in cells:
            if prepare is not None:
                prepare(cell)
            samples[cell].append(statistics.median(times_ms(step(cell), inputs(cell), 1, calls)))
    if per_round is not None:
        per_round.update(samples)
    return {cell: statistics.median(values) for cell, values in samples.items()}


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
