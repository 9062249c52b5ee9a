"""Host cost of one fused op call, next to its GPU time: is a small batch host-bound?

Per rank (``--world`` GPUs, NCCL; 2 by default), for a bf16 ``[tokens, 8192]`` partial, it enqueues
``--calls`` calls back to back without synchronising and reports, per call:

    host_us   wall time of the enqueue loop / calls (what the Python side costs)
    gpu_us    CUDA-event time of the same loop / calls (when host_us > gpu_us the GPU waits on the host)

for these ways of running all_reduce + add + RMSNorm:

    nccl_unfused   functional all_reduce + wait, then add and RMSNorm in eager ops (what eager runs)
    dispatch       an op defined like the fused op (``define_hot_op``, same schema) whose body does
                   nothing: the floor of a call through ``torch.ops`` from Python
    lowering       ``weavepass.runtime.cuda.dispatch.fused_allreduce_rmsnorm_cuda`` called directly
    lowering_triton  the same with every launch through Triton's ``JITFunction`` dispatch (the path
                   before the cached direct launch)
    op             ``torch.ops.weave.fused_allreduce_rmsnorm`` (what a fuse-only graph calls)
    async_op       ``torch.ops.weave.fused_allreduce_rmsnorm_async`` + ``torch.ops.weave.join_async``
                   on its outputs and inputs (what a split graph calls, per half and site)
    push_op        ``torch.ops.weave.fused_allreduce_rmsnorm_push_async`` (slot 0) + ``join_async``
                   (``split_comm="push"``: two launches through Triton's dispatch; on a world
                   other than 2 it runs as async_op)
    graph_op       the fused op as a weave-compiled graph calls it: its kernel, directly
                   (``extern_kernels.weave_fused_allreduce_rmsnorm``, ``weavepass.compile.direct_calls``)
    graph_async    the async op and its join as a split graph calls them (direct)

and, for issue 34's op (the row-parallel matmul inside the op, ``gemm_epilogue``; x ``[tokens, K]``
with ``--matmul-k`` (1024: 70b_tp8's o_proj), mat2 ``[K, 8192]``, the transposed weight):

    mm_graph_op    ``torch.mm`` then the fused op's direct call: what a fuse-only graph runs for the
                   same site (cuBLAS + the fused op)
    matmul_lowering  ``weavepass.runtime.cuda.matmul.matmul_reduce_scatter_rmsnorm_cuda`` directly
    matmul_unplanned the same with ``matmul.PLAN_CALLS`` off: every call validated and planned, its
                   launches through Triton's dispatch (the path before ``gemm.ScatterPlan``)
    graph_matmul   ``weave.matmul_reduce_scatter_rmsnorm`` as a compiled graph calls it (direct call)

``--profile WAY`` then runs ``--profile-calls`` calls of that way under ``cProfile`` (rank 0) and
prints the functions by own time: where the host time of a call goes. ``--kernels`` prints each
way's GPU kernels with their mean time per call (``torch.profiler``): where its GPU time goes.

Before measuring, each rank compiles a two-op function with the weave backend and checks that the
generated code calls the ops directly (``direct_calls_in_graph`` in the CSV): graph_* are the
graph's cost only if it does.

``--world 1`` runs on one GPU: the kernel then has no peers (add + RMSNorm), but the host side is the
same code, so the host column is the real one. Ranks are aligned with a barrier before each loop;
the ways take turns, one loop each per repeat, and each reports its median loop. Output: a table on stdout and
``<out>/bench_host_overhead.csv`` (``_tpN`` when ``--world`` is not 2).
Run: ``python3 benchmarks/bench_host_overhead.py``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import gpu_env  # noqa: F401  (must precede torch: multicast off, checkout on sys.path)
import torch
import torch.distributed as dist
from report import world_name, write_csv  # benchmarks/report.py

WAYS = ("nccl_unfused", "dispatch", "lowering", "lowering_triton", "op", "async_op", "push_op", "graph_op",
        "graph_async", "mm_graph_op", "matmul_lowering", "matmul_unplanned", "graph_matmul")
MATMUL_WAYS = ("mm_graph_op", "matmul_lowering", "matmul_unplanned", "graph_matmul")
"""Ways called with ``(x, mat2, residual, weight)``, not ``(partial, residual, weight)``."""


def _callables(group_name: str):
    from weavepass.ops import (
        FUSED_ALLREDUCE_RMSNORM,
        FUSED_ALLREDUCE_RMSNORM_ASYNC,
        FUSED_ALLREDUCE_RMSNORM_PUSH_ASYNC,
        JOIN_ASYNC,
    )
    from weavepass.runtime.cuda import launcher
    from weavepass.runtime.cuda.dispatch import fused_allreduce_rmsnorm_cuda
    from weavepass.runtime.cuda.workspace import DEFAULT_WORKSPACE_TOKENS as capacity

    funcol = torch.ops._c10d_functional

    def nccl_unfused(p, r, w):
        total = funcol.wait_tensor(funcol.all_reduce(p, "sum", group_name)) + r
        var = total.float().pow(2).mean(-1, keepdim=True)
        return (total.float() * torch.rsqrt(var + 1e-5)).to(p.dtype) * w, total

    def lowering(p, r, w):
        return fused_allreduce_rmsnorm_cuda(p, r, w, 1e-5, group_name, p.dtype)

    def lowering_triton(p, r, w):
        launcher.DIRECT_LAUNCH = False
        try:
            return fused_allreduce_rmsnorm_cuda(p, r, w, 1e-5, group_name, p.dtype)
        finally:
            launcher.DIRECT_LAUNCH = True

    def dispatch(p, r, w):
        return _empty_op()(p, r, w, 1e-5, group_name, p.dtype, "cuda_symm", capacity)

    def op(p, r, w):
        return FUSED_ALLREDUCE_RMSNORM(p, r, w, 1e-5, group_name, p.dtype, "cuda_symm", capacity)

    def async_op(p, r, w):
        normed, res = FUSED_ALLREDUCE_RMSNORM_ASYNC(p, r, w, 1e-5, group_name, p.dtype, "cuda_symm",
                                                    capacity, 0)
        JOIN_ASYNC(normed, res, [p, r])
        return normed, res

    def push_op(p, r, w):
        normed, res = FUSED_ALLREDUCE_RMSNORM_PUSH_ASYNC(p, r, w, 1e-5, group_name, p.dtype, "cuda_symm",
                                                         capacity, 0, 0)
        JOIN_ASYNC(normed, res, [p, r])
        return normed, res

    from torch._inductor.select_algorithm import extern_kernels

    from weavepass.compile import direct_calls

    direct_calls.install()
    direct_fused = getattr(extern_kernels, direct_calls.extern_name(FUSED_ALLREDUCE_RMSNORM))
    direct_async = getattr(extern_kernels, direct_calls.extern_name(FUSED_ALLREDUCE_RMSNORM_ASYNC))
    direct_join = getattr(extern_kernels, direct_calls.extern_name(JOIN_ASYNC))

    def graph_op(p, r, w):
        return direct_fused(p, r, w, 1e-5, group_name, p.dtype, "cuda_symm", capacity)

    def graph_async(p, r, w):
        normed, res = direct_async(p, r, w, 1e-5, group_name, p.dtype, "cuda_symm", capacity, 0)
        direct_join(normed, res, [p, r])
        return normed, res

    from weavepass.ops import MATMUL_REDUCE_SCATTER_RMSNORM
    from weavepass.runtime.cuda import matmul
    from weavepass.runtime.cuda.matmul import matmul_reduce_scatter_rmsnorm_cuda

    direct_matmul = getattr(extern_kernels, direct_calls.extern_name(MATMUL_REDUCE_SCATTER_RMSNORM))

    def mm_graph_op(x, m, r, w):
        return direct_fused(torch.mm(x, m), r, w, 1e-5, group_name, x.dtype, "cuda_symm", capacity)

    def matmul_lowering(x, m, r, w):
        return matmul_reduce_scatter_rmsnorm_cuda(x, m, r, w, 1e-5, group_name, x.dtype, max_workspace_tokens=capacity)

    def matmul_unplanned(x, m, r, w):
        matmul.PLAN_CALLS = False
        try:
            return matmul_lowering(x, m, r, w)
        finally:
            matmul.PLAN_CALLS = True

    def graph_matmul(x, m, r, w):
        return direct_matmul(x, m, r, w, 1e-5, group_name, x.dtype, "cuda_symm", capacity)

    return {"mm_graph_op": mm_graph_op, "matmul_lowering": matmul_lowering, "matmul_unplanned": matmul_unplanned,
            "graph_matmul": graph_matmul,
            "nccl_unfused": nccl_unfused, "dispatch": dispatch, "lowering": lowering,
            "lowering_triton": lowering_triton, "op": op, "async_op": async_op, "push_op": push_op,
            "graph_op": graph_op, "graph_async": graph_async}


def _direct_calls_in_graph(group_name: str, device: torch.device) -> list[str]:
    """The weave ops a weave-compiled graph calls directly (``extern_kernels.weave_*``), sorted."""
    import re

    from torch._inductor.utils import run_and_get_code

    from weavepass.backend import WeaveBackend
    from weavepass.ops import FUSED_ALLREDUCE_RMSNORM_ASYNC, JOIN_ASYNC

    def two_ops(p, r, w):
        normed, res = FUSED_ALLREDUCE_RMSNORM_ASYNC(p, r, w, 1e-5, group_name, p.dtype, "cuda_symm", 8192, 0)
        JOIN_ASYNC(normed, res, [p, r])
        return normed + 1, res
    p = torch.randn(8, 8192, device=device, dtype=torch.bfloat16)
    _, code = run_and_get_code(torch.compile(two_ops, backend=WeaveBackend()), p, torch.randn_like(p),
                               torch.ones(8192, device=device, dtype=torch.bfloat16))
    return sorted(set(re.findall(r"extern_kernels\.(weave_\w+)\(", code[0])))


_EMPTY_OP = []


def _empty_op():
    """``weave_bench::empty``: the fused op's schema, registered the way the fused op is, returning
    two preallocated tensors (defined once per process, on first use)."""
    if not _EMPTY_OP:
        from weavepass.ops import FUSED_SCHEMA_ARGS

        lib = torch.library.Library("weave_bench", "DEF")
        outs = {}

        def impl(partial, residual, weight, eps, group_name, out_dtype, lowering, workspace_tokens):
            key = (partial.shape, partial.dtype, partial.device)
            if key not in outs:
                outs[key] = (torch.empty_like(partial), torch.empty_like(partial))
            return outs[key]

        lib.define(f"empty({FUSED_SCHEMA_ARGS}) -> (Tensor, Tensor)")
        lib.impl("empty", impl, "CompositeExplicitAutograd")
        _EMPTY_OP.extend([lib, torch.ops.weave_bench.empty.default])
    return _EMPTY_OP[1]


def _measure_once(fn, args, calls: int) -> tuple[float, float]:
    """(host us per call, GPU us per call) of one loop of ``calls`` calls."""
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    for _ in range(calls):
        fn(*args)
    end.record()
    host = (time.perf_counter() - t0) * 1e6 / calls
    end.synchronize()
    return host, start.elapsed_time(end) * 1e3 / calls


def _run_rank(rank: int, world: int, config: dict) -> list[dict]:
    """Per token count, the ways are measured round-robin (one loop of each per repeat) and each
    way's median over the repeats is reported: the host's speed drifts (the lent machine's host
    timings moved by 1.5x between runs), and interleaving lets every way see the same drift."""
    device = torch.device("cuda", rank)
    group_name = dist.group.WORLD.group_name
    ways = _callables(group_name)
    direct = _direct_calls_in_graph(group_name, device)
    if direct != ["weave_fused_allreduce_rmsnorm_async", "weave_join_async"]:
        print(f"rank {rank}: a weave graph does NOT call the ops directly on this torch ({direct}): "
              "graph_* rows are not what a compiled graph costs")
    rows = []
    with torch.no_grad():
        for tokens in config["tokens"]:
            gen = torch.Generator(device=device).manual_seed(tokens)
            p = torch.randn(tokens, 8192, device=device, dtype=torch.bfloat16, generator=gen)
            r = torch.randn_like(p)
            w = torch.ones(8192, device=device, dtype=torch.bfloat16)
            k = config["matmul_k"]
            x = torch.randn(tokens, k, device=device, dtype=torch.bfloat16, generator=gen) / k ** 0.5
            mat2 = torch.randn(8192, k, device=device, dtype=torch.bfloat16, generator=gen).t()  # a linear's weight.T
            inputs = {name: (x, mat2, r, w) if name in MATMUL_WAYS else (p, r, w) for name in config["ways"]}
            for name in config["ways"]:
                for _ in range(5):  # warm up: Triton compile, workspace, NCCL communicator
                    ways[name](*inputs[name])
            samples = {name: ([], []) for name in config["ways"]}
            for _ in range(config["repeats"]):
                for name in config["ways"]:
                    host, gpu = _measure_once(ways[name], inputs[name], config["calls"])
                    samples[name][0].append(host)
                    samples[name][1].append(gpu)
            for name, (host, gpu) in samples.items():
                host_us, gpu_us = statistics.median(host), statistics.median(gpu)
                rows.append({"way": name, "tokens": tokens, "host_us": host_us, "gpu_us": gpu_us,
                             "host_bound": host_us > gpu_us, "direct_calls_in_graph": bool(direct)})
            if config["profile"] and rank == 0:
                _profile(ways[config["profile"]], inputs[config["profile"]], config["profile_calls"],
                         f"{config['profile']} at {tokens} tokens")
            if config["kernels"] and rank == 0:
                for name in config["ways"]:
                    _kernel_times(ways[name], inputs[name], 20, f"{name} at {tokens} tokens")
    return rows


def _kernel_times(fn, args, calls: int, label: str) -> None:
    """Each GPU kernel's mean time over ``calls`` calls of ``fn`` (torch.profiler, CUDA activity):
    which of a way's kernels its GPU time goes to."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn(*args)
        torch.cuda.synchronize()
    print(f"--- kernels of {label} ({calls} calls; us per call)")
    for event in sorted(prof.key_averages(), key=lambda e: -e.device_time_total):
        if event.device_time_total > 0:
            print(f"    {event.device_time_total / calls:9.1f} us  x{event.count // calls:<2} {event.key[:110]}")


def _profile(fn, args, calls: int, label: str) -> None:
    """``calls`` calls of ``fn`` under cProfile, the top functions by own time printed (per call)."""
    import cProfile
    import io
    import pstats

    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn(*args)
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    print(f"--- cProfile of {calls} calls of {label} (times are totals over the calls; cProfile's own "
          f"overhead inflates them, the ranking is what counts)\n{text.getvalue()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 8192])
    parser.add_argument("--ways", default=",".join(WAYS))
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--world", type=int, default=2, help="GPUs (ranks); 1: host cost on one GPU")
    parser.add_argument("--matmul-k", type=int, default=1024, help="K of the matmul ways' x [tokens, K]")
    parser.add_argument("--profile", choices=WAYS, help="then profile this way's calls (cProfile, rank 0)")
    parser.add_argument("--profile-calls", type=int, default=200)
    parser.add_argument("--kernels", action="store_true",
                        help="then each way's GPU kernels and their mean times (torch.profiler, rank 0)")
    args = parser.parse_args()
    unknown = set(args.ways.split(",")) - set(WAYS)
    if unknown:
        parser.error(f"unknown ways {sorted(unknown)}; known: {', '.join(WAYS)}")
    if args.profile and args.profile not in args.ways.split(","):
        parser.error(f"--profile {args.profile} must be one of --ways")
    if torch.cuda.device_count() < args.world:
        raise SystemExit(f"bench_host_overhead --world {args.world} needs {args.world} GPUs")
    from weavepass.testing import spawn

    config = {"tokens": args.tokens, "ways": args.ways.split(","), "calls": args.calls,
              "repeats": args.repeats, "matmul_k": args.matmul_k, "profile": args.profile,
              "profile_calls": args.profile_calls, "kernels": args.kernels}
    rows = spawn(_run_rank, args.world, "nccl", config, timeout_s=600.0)[0]
    for row in rows:
        row["world"] = args.world
    csv_path = write_csv(Path(args.out) / f"{world_name('bench_host_overhead', args.world)}.csv", rows)
    print(f"{'way':>14} {'tokens':>6} {'host us/call':>13} {'GPU us/call':>12}  bound")
    for r in rows:
        bound = "host" if r["host_bound"] else "GPU"
        print(f"{r['way']:>14} {r['tokens']:>6} {r['host_us']:13.1f} {r['gpu_us']:12.1f}  {bound}")
    print(f"wrote {csv_path}")


if __name__ == "__main__":
    main()
