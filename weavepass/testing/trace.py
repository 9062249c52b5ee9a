"""Read a profiler trace: which stream each kernel ran on, and how much of the fused communication
kernels' time overlapped kernels on other streams. Used by the overlap GPU test and the overlap
benchmark's ``--profile`` mode (the evidence that the split actually overlaps, not only reorders)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

COMM_KERNEL_MARKERS = ("fused_allreduce_rmsnorm", "nccl", "all_gather", "reduce_scatter")
"""Substrings of the kernels counted as communication (the weave kernels, NCCL, fallbacks)."""


@dataclass
class StreamOverlap:
    """Kernel time per stream and the overlap of communication kernels with the rest."""

    comm_us: float = 0.0
    """total time of communication kernels"""
    comm_overlapped_us: float = 0.0
    """part of ``comm_us`` during which a non-communication kernel ran on another stream"""
    compute_us: float = 0.0
    """total time of the other kernels"""
    busy_us: float = 0.0
    """wall time during which any kernel ran"""
    comm_streams: set = field(default_factory=set)
    compute_streams: set = field(default_factory=set)
    top: list = field(default_factory=list)
    """(total us, calls, name) of the 15 most expensive kernels"""
    host_ops: dict = field(default_factory=dict)
    """name -> (total us, calls) of the host-side ``weave::`` op calls (CPU time, profiler on)"""
    wall_us: float = 0.0
    """wall time of the profiled call, synchronised (0 when the trace came from elsewhere)"""

    @property
    def overlap_fraction(self) -> float:
        return self.comm_overlapped_us / self.comm_us if self.comm_us else 0.0

    def summary(self) -> str:
        text = (
            f"comm kernels {self.comm_us / 1e3:.3f} ms on streams {sorted(self.comm_streams)}, "
            f"{self.overlap_fraction:.0%} of it overlapped by compute; compute kernels "
            f"{self.compute_us / 1e3:.3f} ms on streams {sorted(self.compute_streams)}; "
            f"GPU busy {self.busy_us / 1e3:.3f} ms"
        )
        if self.wall_us:
            text += f" of {self.wall_us / 1e3:.3f} ms wall (profiler on)"
        for name, (total, calls) in sorted(self.host_ops.items()):
            text += f"; host {name}: {calls}x {total / max(calls, 1):.1f} us"
        return text


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _covered(interval: tuple[float, float], union: list[tuple[float, float]]) -> float:
    start, end = interval
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in union)


def profile_stream_overlap(fn, *args) -> StreamOverlap:
    """Profile one call ``fn(*args)`` (CPU and CUDA activities, synchronised before the profiler
    stops) and analyse its trace with ``stream_overlap``. Warm up and align ranks before calling."""
    import tempfile
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        fn(*args)
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - start) * 1e6
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        result = stream_overlap(f.name)
    result.wall_us = wall_us
    return result


def stream_overlap(trace: str | Path | dict) -> StreamOverlap:
    """Analyse a Chrome trace written by ``torch.profiler`` (``export_chrome_trace``)."""
    data = trace if isinstance(trace, dict) else json.loads(Path(trace).read_text())
    kernels = [
        e for e in data.get("traceEvents", [])
        if e.get("ph") == "X" and e.get("cat") == "kernel" and "dur" in e
    ]
    result = StreamOverlap()
    for e in data.get("traceEvents", []):
        name = str(e.get("name", ""))
        if e.get("ph") == "X" and e.get("cat") == "cpu_op" and name.startswith("weave::") and "dur" in e:
            total, calls = result.host_ops.get(name, (0.0, 0))
            result.host_ops[name] = (total + float(e["dur"]), calls + 1)
    comm, compute, totals = [], [], {}
    for e in kernels:
        name = e.get("name", "")
        stream = e.get("args", {}).get("stream", e.get("tid"))
        span = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        is_comm = any(m in name.lower() for m in COMM_KERNEL_MARKERS)
        (comm if is_comm else compute).append((span, stream))
        (result.comm_streams if is_comm else result.compute_streams).add(stream)
        total, calls = totals.get(name, (0.0, 0))
        totals[name] = (total + float(e["dur"]), calls + 1)
    by_stream: dict = {}
    for span, stream in compute:
        by_stream.setdefault(stream, []).append(span)
    unions = {s: _union(spans) for s, spans in by_stream.items()}
    others: dict = {}  # stream -> union of compute on every other stream
    for span, stream in comm:
        if stream not in others:
            others[stream] = _union([iv for s, u in unions.items() if s != stream for iv in u])
        result.comm_us += span[1] - span[0]
        result.comm_overlapped_us += _covered(span, others[stream])
    result.compute_us = sum(b - a for (a, b), _ in compute)
    result.busy_us = sum(b - a for a, b in _union([span for span, _ in comm + compute]))
    result.top = sorted(((t, c, n) for n, (t, c) in totals.items()), reverse=True)[:15]
    return result
