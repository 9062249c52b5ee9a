"""Where the host time of one fused-op call goes, on one GPU (a group of one rank).

Prints (1) the cost of each step of ``fused_allreduce_rmsnorm_cuda`` timed in isolation, per call,
and (2) a cProfile of many calls of the lowering and of the op, by own time. Run on a GPU machine:
``python3 scripts/profile_host_cost.py [--tokens 256] [--calls 2000]``.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

# benchmarks/gpu_env: multicast off before torch starts, and the checkout on sys.path.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import gpu_env  # noqa: E402, F401

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def per_call_us(fn, calls: int) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize()
    return elapsed * 1e6 / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=8192)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    from weavepass.runtime.cuda import dispatch as cuda_symm
    from weavepass.ops import FUSED_ALLREDUCE_RMSNORM, FUSED_ALLREDUCE_RMSNORM_ASYNC, JOIN_ASYNC
    from weavepass.runtime.cuda.workspace import DEFAULT_WORKSPACE_TOKENS as capacity

    group = dist.group.WORLD.group_name
    p = torch.randn(args.tokens, args.hidden, device="cuda", dtype=torch.bfloat16)
    r, w = torch.randn_like(p), torch.ones(args.hidden, device="cuda", dtype=torch.bfloat16)
    lowering = lambda: cuda_symm.fused_allreduce_rmsnorm_cuda(p, r, w, 1e-5, group, p.dtype)  # noqa: E731
    op = lambda: FUSED_ALLREDUCE_RMSNORM(p, r, w, 1e-5, group, p.dtype, "cuda_symm", capacity)  # noqa: E731

    def async_op():
        normed, res = FUSED_ALLREDUCE_RMSNORM_ASYNC(p, r, w, 1e-5, group, p.dtype, "cuda_symm", capacity, 0)
        JOIN_ASYNC(normed, res, [p, r])
        return normed, res

    from torch._inductor.select_algorithm import extern_kernels

    from weavepass.compile import direct_calls

    print("direct calls installed:", direct_calls.install())
    graph_fused = getattr(extern_kernels, "weave_fused_allreduce_rmsnorm")
    graph_async_fn = getattr(extern_kernels, "weave_fused_allreduce_rmsnorm_async")
    graph_join = getattr(extern_kernels, "weave_join_async")
    graph_op = lambda: graph_fused(p, r, w, 1e-5, group, p.dtype, "cuda_symm", capacity)  # noqa: E731

    def graph_async():
        normed, res = graph_async_fn(p, r, w, 1e-5, group, p.dtype, "cuda_symm", capacity, 0)
        graph_join(normed, res, [p, r])
        return normed, res

    lowering()
    launch = next(v for k, v in cuda_symm._LAUNCHES.items() if k[0] == p.shape)
    runtime = cuda_symm._triton_runtime_knobs()
    print("direct launch recorded:", launch.compiled is not None, "aligned:", launch.aligned,
          "launch hooks:", runtime.launch_enter_hook, runtime.launch_exit_hook)
    n_out = torch.empty_like(p)
    o_out = torch.empty_like(p)
    tensors = (p, r, w, n_out, o_out, n_out, w)  # inv_rms, bias: stand-ins (inference)
    call_args = (*tensors, *launch.tail, 1e-5)
    ptr_args = (*(t.data_ptr() for t in tensors), *launch.tail_ptrs, 1e-5)
    c = launch.compiled
    stream = torch._C._cuda_getCurrentRawStream(0)
    steps = {
        "torch.empty(shape, dtype, device)": lambda: torch.empty(p.shape, dtype=p.dtype, device=p.device),
        "torch.empty_like(p)": lambda: torch.empty_like(p),
        "torch.empty_like(p, dtype=)": lambda: torch.empty_like(p, dtype=torch.bfloat16),
        "p.new_empty(p.shape)": lambda: p.new_empty(p.shape),
        "p.shape, p.dtype, p.device, is_contiguous": lambda: (p.shape, p.dtype, p.device, p.is_contiguous()),
        "p.shape, p.stride(), p.dtype, p.device": lambda: (p.shape, p.stride(), p.dtype, p.device),
        "p.reshape(-1, H)": lambda: p.reshape(-1, args.hidden),
        "r.reshape(-1, H).contiguous()": lambda: r.reshape(-1, args.hidden).contiguous(),
        "7 x data_ptr": lambda: [t.data_ptr() for t in tensors],
        "_cuda_getCurrentRawStream": lambda: torch._C._cuda_getCurrentRawStream(0),
        "compiled.run, tensor arguments": lambda: c.run(launch.grid[0], 1, 1, stream, c.function, c.packed_metadata,
                                                       None, None, None, *call_args, *launch.constexprs),
        "compiled.run, address arguments": lambda: c.run(launch.grid[0], 1, 1, stream, c.function, c.packed_metadata,
                                                        None, None, None, *ptr_args, *launch.constexprs),
        "compiled.launch_metadata": lambda: c.launch_metadata(launch.grid, stream, *call_args),
        "JITFunction[grid](...)": lambda: launch.kernel[launch.grid](*call_args, **launch.meta),
        "_launch (direct)": lambda: cuda_symm._launch(launch, tensors, 1e-5),
        "lowering": lowering,
        "op (torch.ops)": op,
        "async op + join_async": async_op,
        "op as a weave graph calls it (direct)": graph_op,
        "async op + join, direct": graph_async,
    }
    print(f"T={args.tokens} H={args.hidden}, us per call (median of 5 loops of {args.calls}):")
    for name, fn in steps.items():
        runs = sorted(per_call_us(fn, args.calls) for _ in range(5))
        print(f"  {name:<40} {runs[2]:8.2f}")
    for name, fn in (("lowering", lowering), ("op", op), ("async op", async_op), ("op, direct", graph_op),
                     ("async op, direct", graph_async)):
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        print(f"--- cProfile of {args.calls} calls of {name}, by own time")
        pstats.Stats(prof).sort_stats("tottime").print_stats(14)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
