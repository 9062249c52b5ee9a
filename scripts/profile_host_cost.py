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
    from weavepass.ops import FUSED_ALLREDUCE_RMSNORM, FUSED_ALLREDUCE_RMSNORM_ASYNC, JOIN_ASYNC
    from weavepass.runtime.cuda import dispatch as cuda_symm
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
    graph_fused = extern_kernels.weave_fused_allreduce_rmsnorm
    graph_async_fn = extern_kernels.weave_fused_allreduce_rmsnorm_async
    graph_join = extern_kernels.weave_join_async
    graph_op = lambda: graph_fused(p, r, w, 1e-5, group, p.dtype, "cuda_symm", capacity)  # noqa: E731

    def graph_async():
        normed, res = graph_async_fn(p, r, w, 1e-5, group, p.dtype, "cuda_symm", capacity, 0)
        graph_join(normed, res, [p, r])
        return normed, res

    lowering()
    launch = next(v for k, v in cuda_symm._LAUNCHES.items() if k[0] == p.shape)
    runtime = cuda_symm._triton_runtime_knobs()
    print("direct launch recorded:", launch.compiled is not None, "misaligned:", launch.misaligned,
          "launch hooks:", runtime.launch_enter_hook, runtime.launch_exit_hook)
    n_out = torch.empty_like(p)
    o_out = torch.empty_like(p)
    tensors = (p, r, w, n_out, o_out, n_out, w, w, w, w, w)  # inv_rms, bias, the quant epilogue: stand-ins
    call_args = (*tensors, *launch.tail, 1e-5)
    ptr_args = (*(t.data_ptr() for t in tensors), *launch.tail_ptrs, 1e-5)
    c = launch.compiled
    stream = torch._C._cuda_getCurrentRawStream(0)
    from weavepass.runtime import streams

    side = streams.comm_stream(p.device)
    main_stream = torch.cuda.current_stream()
    event = torch.cuda.Event()
    record_c, wait_c = torch._C._CudaEventBase.record, torch._C._CudaEventBase.wait
    set_stream_c = torch._C._cuda_setStream
    side_ids = dict(stream_id=side.stream_id, device_index=side.device_index, device_type=side.device_type)
    main_ids = dict(stream_id=main_stream.stream_id, device_index=main_stream.device_index,
                    device_type=main_stream.device_type)
    shape2 = (2, *p.shape)
    key_of = lambda: (  # noqa: E731  (the lowering's signature key, as built per call)
        p.shape, p.stride(), p.dtype, p.device, (r.shape, r.stride(), r.dtype, r.device),
        (w.shape, w.stride(), w.dtype, w.device), group, p.dtype, capacity, (), False, False)
    key_get_device = lambda: (  # noqa: E731  (the same with device indices instead of torch.device objects)
        p.shape, p.stride(), p.dtype, p.get_device(), (r.shape, r.stride(), r.dtype, r.get_device()),
        (w.shape, w.stride(), w.dtype, w.get_device()), group, p.dtype, capacity, (), False, False)
    launches = cuda_symm._LAUNCHES

    def set_stream_c_pair():
        set_stream_c(**side_ids)
        set_stream_c(**main_ids)

    def set_stream_pair():
        torch.cuda.set_stream(side)
        torch.cuda.set_stream(main_stream)

    import inspect

    wrapper_source = inspect.getsource(type(c.run).__call__)
    print("Triton launcher wrapper:\n" + wrapper_source)
    print("bare launcher in use:", launch.bare is not c.run)
    bare = None
    if launch.bare is not c.run:
        bare_args = (launch.grid[0], 1, 1, stream, c.function, *launch.bare_fixed, c.packed_metadata, None, None, None,
                     *ptr_args, *launch.constexprs)
        bare = lambda: launch.bare(*bare_args)  # noqa: E731
    steps = {
        "set_stream(side), set_stream(main)": set_stream_pair,
        "_cuda_setStream x 2 (ids precomputed)": set_stream_c_pair,
        "Event.record(main) + side.wait_event": lambda: (event.record(main_stream), side.wait_event(event)),
        "_CudaEventBase.record + .wait (C)": lambda: (record_c(event, main_stream), wait_c(event, side)),
        "signature key + _LAUNCHES.get": lambda: launches.get(key_of()),
        "the key, get_device() for .device": lambda: launches.get(key_get_device()),
        "torch.empty((2, *shape)).unbind(0)": lambda: torch.empty(shape2, dtype=p.dtype, device=p.device).unbind(0),
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
        "_launch (direct)": lambda: launch.launch(tensors, (1e-5,)),
        "lowering": lowering,
        "op (torch.ops)": op,
        "async op + join_async": async_op,
        "op as a weave graph calls it (direct)": graph_op,
        "async op + join, direct": graph_async,
        # last: a wrong guess of this Triton's argument list fails here, after everything else
        **({"launcher.launch (no Python wrapper)": bare} if bare is not None else {}),
    }
    print(f"T={args.tokens} H={args.hidden}, us per call (median of 5 loops of {args.calls}):")
    for name, fn in steps.items():
        try:
            runs = sorted(per_call_us(fn, args.calls) for _ in range(5))
        except Exception as error:  # noqa: BLE001  (the bare launch's guessed argument list)
            print(f"  {name:<40} failed: {type(error).__name__}: {error}")
            continue
        print(f"  {name:<40} {runs[2]:8.2f}")
    # A/B of this session's launch changes, interleaved in one process (host drift cancels):
    # Triton's launcher wrapper against its C launch, and the async op launching on the
    # communication stream by handle against switching the current stream around the lowering.
    cuda_lowering = cuda_symm.fused_allreduce_rmsnorm_cuda

    def async_with(takes_stream):
        def call():
            normed, res = streams._run_async(cuda_lowering, (p, r, w, 1e-5, group, p.dtype),
                                             {"max_workspace_tokens": capacity}, (p, r, w), takes_stream)
            streams.join_async(normed, res, [p, r])
        return call

    def lowering_with(bare_launch):
        def call():
            saved = launch.bare, launch.bare_fixed
            if not bare_launch:
                launch.bare, launch.bare_fixed = c.run, ()
            try:
                for _ in range(args.calls):
                    lowering()
            finally:
                launch.bare, launch.bare_fixed = saved
        return call

    variants = {
        "lowering, Triton's launcher wrapper": lowering_with(False),
        "lowering, its C launch (bare)": lowering_with(True),
        "async + join, stream made current": async_with(False),
        "async + join, launched on the stream": async_with(True),
    }
    timings = {name: [] for name in variants}
    for _ in range(15):
        for name, fn in variants.items():
            calls = 1 if name.startswith("lowering") else args.calls
            timings[name].append(per_call_us(fn, calls) / (args.calls if calls == 1 else 1))
    print(f"A/B, interleaved: median of 15 rounds of {args.calls} calls, us per call")
    for name, values in timings.items():
        values.sort()
        print(f"  {name:<40} {values[7]:8.2f}  (quartiles {values[3]:.2f}-{values[11]:.2f})")
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
