"""The fused op's local cost (issue 33): what ``weave.fused_allreduce_rmsnorm`` costs where nothing
is communicated, against Inductor's add + RMSNorm and the HBM floor, on one GPU.

Two parts, each on its own flag (both by default):

``--op``: a group of one rank (one NCCL process). Per hidden size and token count, in one process,
in ``--rounds`` interleaved rounds (``triton.testing.do_bench`` medians; do_bench clears the L2
before every call):

    floor      a device copy of ``2 T H`` elements: the four passes the math needs (read partial,
               read residual, write residual_out, write normed), ``4 T H elem`` bytes
    inductor   ``torch.compile`` of the model's add + RMSNorm (LlamaRMSNorm: normalise in fp32,
               round, scale), the token dim dynamic as in the model benchmarks
    weave      the ``cuda_symm`` lowering called directly, by the launch rule
    weave_cap32  the same kernel on the grid the rule gave a group of one before issue 33 (32 CTAs,
               64 KiB tiles, 16 warps): the before of a before/after in one process
    weave_rR_wW  (``--sweep``) R rows per tile, one CTA per tile, W warps

``--sim N...``: N simulated ranks on one GPU (``weavepass.testing.kernel_sim``), all N kernels in
one CUDA graph, against a device copy of the bytes the algorithm must move through the HBM of all
N ranks together (docs/cuda_kernel.md, "Local bytes"): one GPU's HBM serves every simulated rank,
so ``time / copy time`` is how far the kernels are from moving their minimum local bytes at copy
speed (above 1: more bytes, or the bytes moved slower than a copy).

``--quant [FORM...]`` (off by default; alone: the four forms below): the quantized op (issue 36) at
a group of one rank, per form of
``weavepass.testing.quant`` (fp8_static, fp8_row, fp8_group, int8_row), hidden size and token count:

    inductor_quant      ``torch.compile`` of add + RMSNorm + the library's quantization
    weave_norm          the fused norm alone (``fused_allreduce_rmsnorm_cuda``)
    weave_quant         the fused norm + quantization (``fused_allreduce_rmsnorm_quant_cuda``)
    weave_quant_div_rn  the same with ``quant_epilogue.FAST_ARITHMETIC = False``: an IEEE division
                        per element and the written-out fp8 rounding (the first version)
    weave_norm+inductor_quant  the fused norm, then the compiled quantization of its rows (what a
                        site whose quantization stays outside runs)

Targets (issue 36): weave_quant <= 1.0x inductor_quant from 1K tokens, <= 1.1x weave_norm.
``--quick``: the quantized part only, fp8_row and fp8_group, H=8192, 1/1K/16K tokens, one round.

Output: a table on stdout and ``<out>/bench_local_cost.csv`` (rows of every part).
Run: ``python3 benchmarks/bench_local_cost.py --out $OUT`` (about 3 minutes on one H200), and
``--no-op --sim 8 --sim-tokens 2048`` for 8 ranks (``gpu_suite.sh`` step ``local`` runs both).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics

import gpu_env  # noqa: F401  (must precede torch: multicast off, checkout on sys.path)
import torch
import torch.distributed as dist
from report import write_csv  # benchmarks/report.py

EPS = 1e-5
DTYPE = torch.bfloat16
CAP32 = dict(num_ctas=32, tile_elements=(64 << 10) // 2, num_warps=16)
"""The rule's grid at a group of one rank before issue 33 (>= 128 tokens at H=8192 bf16)."""


def local_bytes_per_rank(world: int, tokens: int, hidden: int, elem: int) -> float:
    """The fewest bytes the two-shot algorithm moves through one rank's HBM (docs/cuda_kernel.md):
    read partial (S) and the owned residual rows (S/N), write residual_out and normed (2 S); the
    reduce-scatter's incoming rows land in staging and are read once (2 (N-1)/N S), and so do the
    all-gather's in recv (2 (N-1)/N S). ``S = T H elem``; a group of one: 4 S."""
    s = tokens * hidden * elem
    if world == 1:
        return 4.0 * s
    return (3 + 1 / world + 4 * (world - 1) / world) * s


def _add_rms_norm(partial, residual, weight):
    x = partial + residual
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)
    return weight * x32.to(x.dtype), x


def _op_rank(rank: int, world: int, args: dict) -> list[dict]:
    import triton

    from weavepass.runtime.cuda.dispatch import fused_allreduce_rmsnorm_cuda
    from weavepass.runtime.cuda.launch_plan import choose_launch_plan

    group = dist.group.WORLD.group_name
    inductor = torch.compile(_add_rms_norm)
    rows, gen = [], torch.Generator(device="cuda").manual_seed(0)
    for hidden in args["hidden"]:
        variants = {"weave": {}, "weave_cap32": CAP32}
        for r, w in args["sweep"]:
            variants[f"weave_r{r}_w{w}"] = dict(tile_elements=r * hidden, num_warps=w)
        for tokens in args["tokens"]:
            p = torch.randn(tokens, hidden, generator=gen, device="cuda", dtype=DTYPE)
            res = torch.randn(tokens, hidden, generator=gen, device="cuda", dtype=DTYPE)
            w = 1 + 0.1 * torch.randn(hidden, generator=gen, device="cuda", dtype=DTYPE)
            src = torch.randn(2 * tokens * hidden, generator=gen, device="cuda", dtype=DTYPE)
            dst = torch.empty_like(src)
            torch._dynamo.mark_dynamic(p, 0)
            torch._dynamo.mark_dynamic(res, 0)
            want_n, want_r = _add_rms_norm(p.float(), res.float(), w.float())
            calls = {"floor": lambda: dst.copy_(src), "inductor": lambda: inductor(p, res, w)}
            for name, opts in variants.items():  # one CTA per tile at a group of one (launch_plan)
                calls[name] = (lambda o: lambda: fused_allreduce_rmsnorm_cuda(p, res, w, EPS, group, DTYPE, **o))(opts)
                normed, res_out = calls[name]()
                err = max(float((normed.float() - want_n).norm() / want_n.norm()),
                          float((res_out.float() - want_r).norm() / want_r.norm()))
                if not err < 1e-2:  # bf16 outputs against an fp32 reference (NaN fails too)
                    raise AssertionError(f"{name} H={hidden} T={tokens}: relative error {err}")
            calls["inductor"]()
            per_round = {name: [] for name in calls}
            for _ in range(args["rounds"]):
                for name, fn in calls.items():
                    per_round[name].append(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))
            plan = choose_launch_plan(tokens, hidden, 2, 1)
            for name, times in per_round.items():
                rows.append({"part": "op", "world": 1, "hidden": hidden, "tokens": tokens, "variant": name,
                             "ms": statistics.median(times), "ms_rounds": " ".join(f"{t:.4f}" for t in times),
                             "plan": f"{plan.num_ctas} CTAs x {plan.rows_per_tile} rows, {plan.num_warps} warps"
                             if name == "weave" else ""})
                print(f"row: {rows[-1]}", flush=True)
            p = res = src = dst = None  # free this size's buffers (the timed closures hold them too)
    return rows


def _quant_rank(rank: int, world: int, args: dict) -> list[dict]:
    """The ``--quant`` part (module docstring), in the one rank's process."""
    import triton

    from weavepass.runtime.cuda import quant_epilogue
    from weavepass.runtime.cuda.dispatch import fused_allreduce_rmsnorm_cuda, fused_allreduce_rmsnorm_quant_cuda
    from weavepass.testing.quant import ACT_QUANTS, STATIC_ACT_SCALE
    from weavepass.testing.quant_steps import form_steps

    group = dist.group.WORLD.group_name
    scale = torch.tensor(STATIC_ACT_SCALE, dtype=torch.float32, device="cuda")
    rows, gen = [], torch.Generator(device="cuda").manual_seed(0)
    for form in args["quant"]:
        quantize = ACT_QUANTS[form]
        static = scale if form.startswith("fp8_static") else None
        scale_steps, code_steps, group_size = form_steps(form, DTYPE)

        def norm_quant(p, res, w, quantize=quantize):
            normed, res_out = _add_rms_norm(p, res, w)
            return (*quantize(normed.reshape(-1, normed.shape[-1]), scale), res_out)

        inductor = torch.compile(norm_quant)
        inductor_quant = torch.compile(lambda normed, quantize=quantize: quantize(normed, scale))
        for hidden in args["hidden"]:
            for tokens in args["tokens"]:
                p = torch.randn(tokens, hidden, generator=gen, device="cuda", dtype=DTYPE)
                res = torch.randn(tokens, hidden, generator=gen, device="cuda", dtype=DTYPE)
                w = 1 + 0.1 * torch.randn(hidden, generator=gen, device="cuda", dtype=DTYPE)
                for t in (p, res):
                    torch._dynamo.mark_dynamic(t, 0)

                def weave_quant(p=p, res=res, w=w, steps=(static, group_size, scale_steps, code_steps), fast=True):
                    quant_epilogue.FAST_ARITHMETIC = fast  # (a launch per setting, cached apart)
                    return fused_allreduce_rmsnorm_quant_cuda(p, res, w, EPS, group, DTYPE, *steps, False)

                def weave_norm(p=p, res=res, w=w):
                    return fused_allreduce_rmsnorm_cuda(p, res, w, EPS, group, DTYPE)

                calls = {"inductor_quant": lambda p=p, res=res, w=w: inductor(p, res, w),
                         "weave_norm": weave_norm, "weave_quant": weave_quant,
                         "weave_quant_div_rn": functools.partial(weave_quant, fast=False),
                         "weave_norm+inductor_quant": lambda: inductor_quant(weave_norm()[0])}
                # the fused codes dequantize to the fp32 rows within the format's error; both
                # arithmetic settings give the same codes
                first, _, _, _ = calls["weave_quant_div_rn"]()
                codes, scales, _, _ = weave_quant()
                if not torch.equal(first.view(torch.uint8), codes.view(torch.uint8)):
                    raise AssertionError(f"{form} H={hidden} T={tokens}: the two arithmetic settings' codes differ")
                want = _add_rms_norm(p.float(), res.float(), w.float())[0]
                grouped = codes.float().reshape(tokens, -1, group_size or hidden)
                back = (grouped * scales.reshape(tokens, -1, 1) if static is None else grouped * static)
                back = back.reshape(tokens, hidden)
                clip = FP8_STATIC_RANGE * STATIC_ACT_SCALE if static is not None else float("inf")
                err = float((back - want.clamp(-clip, clip)).norm() / want.clamp(-clip, clip).norm())
                if not err < 0.08:  # fp8 e4m3: 2^-4 relative per value at most; int8: less
                    raise AssertionError(f"{form} H={hidden} T={tokens}: dequantized relative error {err}")
                for fn in calls.values():
                    fn()
                per_round = {name: [] for name in calls}
                for _ in range(args["rounds"]):
                    for name, fn in calls.items():
                        per_round[name].append(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))
                for name, times in per_round.items():
                    rows.append({"part": "quant", "world": 1, "hidden": hidden, "tokens": tokens,
                                 "variant": f"{form} {name}", "ms": statistics.median(times),
                                 "ms_rounds": " ".join(f"{t:.4f}" for t in times)})
                    print(f"row: {rows[-1]}", flush=True)
                del p, res
    return rows


FP8_STATIC_RANGE = 448.0
"""Static codes saturate at +-448 scales: the dequantized rows are compared with the clipped rows."""


def _grid_copy_kernel():
    """A grid-stride copy on a fixed number of CTAs (64 KiB per step, 16 warps): what moving the
    same bytes costs on the SMs the simulated kernels hold (the ``grid_copy_ms`` column)."""
    import triton
    import triton.language as tl

    @triton.jit
    def grid_copy(src, dst, n, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        step = tl.num_programs(0) * BLOCK
        for start in range(pid * BLOCK, n, step):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < n
            tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)

    return grid_copy


SimConfig = tuple[int | None, int | None, int | None, int | None, int | None]


def sim_config(text: str) -> SimConfig:
    """``"CTAS:KIB:WARPS[:CHUNK_TILES[:LOAD_STAGES]]"`` -> ``(ctas, tile KiB, warps, chunk tiles,
    load stages)`` (the last two: the pipelined kernel's tiles per chunk and software-pipelined
    loads, ``LaunchOverrides``); a field that is ``-``, empty or missing is None (the rule's)."""
    if len(text.split(":")) > 5:
        raise ValueError(f"--sim-configs: {text!r} is not CTAS:KIB:WARPS[:CHUNK_TILES[:LOAD_STAGES]]")
    fields = (text.split(":") + [""] * 5)[:5]
    ctas, kib, warps, chunk, stages = (None if f in ("", "-") else int(f) for f in fields)
    return ctas, kib, warps, chunk, stages


def _sim_rows(worlds, tokens: int, hidden: int, reps: int, num_warps: int | None = None,
              peer_timeout_s: float = 30.0, configs=None, pipelined=None) -> list[dict]:
    """Each world's kernels by the rule at ``min(32, 128 // world)`` CTAs per rank, or at every
    ``(CTAs, tile KiB, warps)`` of ``configs`` (a None field: the rule's) with ``pipelined`` (None:
    the rule's), against a device copy of the minimum bytes on the whole GPU and a grid-stride copy
    of them on the ranks' CTAs together."""
    import triton

    from weavepass.runtime.cuda.launch_plan import LaunchOverrides, choose_launch_plan
    from weavepass.testing.kernel_sim import SimulatedRanks

    rows, elem, wrong = [], 2, []
    grid_copy = _grid_copy_kernel()
    gen = torch.Generator(device="cuda").manual_seed(1)
    for world in worlds:
        sim = SimulatedRanks(world, hidden, tokens, DTYPE, peer_timeout_s=peer_timeout_s)
        partials = [torch.randn(tokens, hidden, generator=gen, device="cuda", dtype=DTYPE) for _ in range(world)]
        residual = torch.randn(tokens, hidden, generator=gen, device="cuda", dtype=DTYPE)
        weight = torch.ones(hidden, device="cuda", dtype=DTYPE)
        want_n, want_r = _add_rms_norm(sum(q.float() for q in partials).to(DTYPE).float(), residual.float(),
                                       weight.float())
        # all ranks resident (128 CTAs in all); 32 is the kernels' cap (signal slots per channel)
        cases = [(c or min(32, 128 // world), t, w or num_warps, k, s)
                 for c, t, w, k, s in (configs or [(None,) * 5])]
        first = None  # the first case's outputs: every later case's residual_out must equal them bit for bit
        for ctas, tile_kib, warps, chunk_tiles, stages in [c for c in cases if c[0] * world <= 128 and c[0] <= 32]:
            overrides = LaunchOverrides(num_ctas=ctas, num_warps=warps, pipelined=pipelined,
                                        tile_elements=None if tile_kib is None else (tile_kib << 10) // elem,
                                        chunk_tiles=chunk_tiles, load_stages=stages)
            plan = choose_launch_plan(tokens, hidden, elem, world, overrides)
            label = (f"{'pipelined' if plan.pipelined else 'flat'} {ctas} CTAs/rank, {plan.rows_per_tile} rows x "
                     f"{plan.num_warps} warps" + (f", chunk {plan.chunk_rows} rows, load stages {plan.load_stages}"
                                                  if plan.pipelined else ""))
            sim.poison()  # NaN in staging and recv: a case that read rows before they were written shows
            try:  # a kernel that does not compile or fit (shared memory) fails before any rank runs
                outs = sim.run(partials, residual, weight, EPS, DTYPE, overrides)  # compiles every rank's kernel
            except Exception as e:  # noqa: BLE001  (reported as a row; the other cases still run)
                if first is None:  # the reference case must run
                    raise
                rows.append({"part": "sim", "world": world, "hidden": hidden, "tokens": tokens, "variant": label,
                             "ms": "", "error": f"{type(e).__name__}: {str(e)[:120]}"})
                print(f"row: {rows[-1]}", flush=True)
                continue
            err = max(max(float((normed.float() - want_n).norm() / want_n.norm()),
                           float((res_out.float() - want_r).norm() / want_r.norm())) for normed, res_out in outs)
            first = first or [(n.clone(), r.clone()) for n, r in outs]
            same_res = all(torch.equal(r, r0) for (_, r), (_, r0) in zip(outs, first))
            same_normed = all(torch.equal(n, n0) for (n, _), (n0, _) in zip(outs, first))
            # The sum in rank order in fp32 is the same whatever the tile or the pipeline: a wrong
            # case is reported (and fails the process at the end), the other cases still run.
            if not (err < 1e-2 and same_res):  # bf16 outputs against fp32 (NaN fails too)
                wrong.append(f"sim world {world} {label}: relative error {err}, residual_out bits as the first "
                             f"case's: {same_res}")
                print(f"WRONG: {wrong[-1]}", flush=True)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                sim.run(partials, residual, weight, EPS, DTYPE, overrides, wait=False)
                for stream in sim.streams:
                    torch.cuda.current_stream().wait_stream(stream)
            graph.replay()
            torch.cuda.synchronize()
            need = world * local_bytes_per_rank(world, tokens, hidden, elem)
            src = torch.empty(int(need // 2 // elem), device="cuda", dtype=DTYPE).normal_()
            dst = torch.empty_like(src)
            t_kernel = triton.testing.do_bench(graph.replay, warmup=5, rep=reps, return_mode="median")
            t_copy = triton.testing.do_bench(lambda: dst.copy_(src), warmup=5, rep=reps, return_mode="median")
            n = src.numel()
            if n + world * ctas * 32768 >= 2**31:  # the copy's int32 offsets and loop bound
                raise ValueError(f"grid copy of {n} elements needs int64 offsets")
            t_grid = triton.testing.do_bench(
                lambda: grid_copy[(world * ctas,)](src, dst, n, BLOCK=32768, num_warps=16),
                warmup=5, rep=reps, return_mode="median")
            rows.append({"part": "sim", "world": world, "hidden": hidden, "tokens": tokens,
                         "variant": label, "ms": t_kernel, "normed_bits_as_first": same_normed,
                         "floor_ms": t_copy, "min_bytes_per_rank": local_bytes_per_rank(world, tokens, hidden, elem),
                         "vs_floor": t_kernel / t_copy, "grid_copy_ms": t_grid, "vs_grid_copy": t_kernel / t_grid,
                         "regs": getattr(sim.last_compiled, "n_regs", ""),
                         "spills": getattr(sim.last_compiled, "n_spills", ""),
                         "shared_bytes": getattr(getattr(sim.last_compiled, "metadata", None), "shared", "")})
            print(f"row: {rows[-1]}", flush=True)
            graph = src = dst = None  # free them (the timed closure holds src and dst too)
        del sim, partials
        torch.cuda.empty_cache()
    if wrong:
        raise AssertionError("wrong results (their times are in the rows above):\n" + "\n".join(wrong))
    return rows


def _ncu_rank(rank: int, world: int, args: dict) -> None:
    """One call of each kernel between cudaProfilerStart/Stop, for ``ncu --profile-from-start off``."""
    from weavepass.runtime.cuda.dispatch import fused_allreduce_rmsnorm_cuda

    group = dist.group.WORLD.group_name
    tokens, hidden = args["tokens"][-1], args["hidden"][0]
    p, res = (torch.randn(tokens, hidden, device="cuda", dtype=DTYPE) for _ in range(2))
    w = torch.ones(hidden, device="cuda", dtype=DTYPE)
    src = torch.randn(2 * tokens * hidden, device="cuda", dtype=DTYPE)
    dst = torch.empty_like(src)
    torch._dynamo.mark_dynamic(p, 0)
    torch._dynamo.mark_dynamic(res, 0)
    inductor = torch.compile(_add_rms_norm)
    calls = [lambda: fused_allreduce_rmsnorm_cuda(p, res, w, EPS, group, DTYPE),
             lambda: fused_allreduce_rmsnorm_cuda(p, res, w, EPS, group, DTYPE, **CAP32),
             lambda: inductor(p, res, w), lambda: dst.copy_(src)]
    for fn in calls:
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for fn in calls:
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    parser.add_argument("--hidden", type=int, nargs="+", default=[8192, 4096])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds of every variant")
    parser.add_argument("--sweep", default="", help="tiles to try, 'R:W,...' (R rows per tile, W warps)")
    parser.add_argument("--sim", type=int, nargs="*", default=[2, 4],
                        help="simulated worlds ('--sim' alone: none). 8 ranks at 8192 tokens (the pipelined "
                             "kernel) did not finish on one H200 (docs/cuda_kernel.md): use --sim-tokens 2048 there")
    parser.add_argument("--sim-tokens", type=int, default=8192)
    parser.add_argument("--sim-timeout", type=float, default=30.0, help="seconds a simulated rank waits for a peer")
    parser.add_argument("--sim-warps", type=int, default=None,
                        help="warps per CTA of the simulated kernels (default: the rule's)")
    parser.add_argument("--sim-configs", nargs="+", default=None, metavar="CTAS:KIB:WARPS[:CHUNK:STAGES]",
                        help="simulated launches to sweep: CTAs per rank, tile KiB, warps per CTA, and for the "
                             "pipelined kernel tiles per chunk and load stages ('-' or empty: the rule's; "
                             "default: the rule at min(32, 128 / world) CTAs). The first case is the reference "
                             "whose residual_out every later case must equal bit for bit")
    parser.add_argument("--sim-pipelined", choices=("rule", "on", "off"), default="rule",
                        help="the simulated two-shot kernel: the rule's choice, pipelined or flat")
    parser.add_argument("--no-op", action="store_true", help="skip the group-of-one part")
    parser.add_argument("--name", default="bench_local_cost", help="CSV file name (no suffix)")
    parser.add_argument("--ncu", action="store_true", help="only the calls to profile with ncu (see _ncu_rank)")
    parser.add_argument("--quant", nargs="*", default=None,
                        help="quantized forms to measure ('--quant' alone: fp8_static fp8_row fp8_group int8_row)")
    parser.add_argument("--quant-tokens", type=int, nargs="+", default=[1, 128, 1024, 4096, 16384])
    parser.add_argument("--quick", action="store_true",
                        help="the quantized part only: fp8_row and fp8_group, H=8192, 1/1K/16K tokens, one round")
    args = parser.parse_args()
    if args.quant == []:
        args.quant = ["fp8_static", "fp8_row", "fp8_group", "int8_row"]
    if args.quick:
        args.no_op, args.sim, args.rounds = True, [], 1
        args.quant, args.quant_tokens, args.hidden = ["fp8_row", "fp8_group"], [1, 1024, 16384], [8192]
    from weavepass.testing import spawn

    sweep = [tuple(int(x) for x in item.split(":")) for item in args.sweep.split(",") if item]
    config = {"hidden": args.hidden, "tokens": args.tokens, "rounds": args.rounds, "sweep": sweep}
    if args.ncu:
        spawn(_ncu_rank, 1, "nccl", config, timeout_s=600.0)
        return
    rows = [] if args.no_op else spawn(_op_rank, 1, "nccl", config, timeout_s=1200.0)[0]
    if args.quant:
        quant_config = {**config, "quant": args.quant, "tokens": args.quant_tokens}
        rows += spawn(_quant_rank, 1, "nccl", quant_config, timeout_s=1200.0)[0]
    if args.sim:
        print(f"simulated ranks {args.sim}, {args.sim_tokens} tokens", flush=True)
        pipelined = {"rule": None, "on": True, "off": False}[args.sim_pipelined]
        configs = None if not args.sim_configs else [sim_config(item) for item in args.sim_configs]
        rows += _sim_rows(args.sim, args.sim_tokens, 8192, 100, args.sim_warps, args.sim_timeout, configs, pipelined)
    os.makedirs(args.out, exist_ok=True)
    path = write_csv(os.path.join(args.out, args.name + ".csv"), rows,
                     ["part", "world", "hidden", "tokens", "variant", "ms", "ms_rounds", "plan", "floor_ms",
                      "min_bytes_per_rank", "vs_floor", "grid_copy_ms", "vs_grid_copy", "regs", "spills",
                      "shared_bytes", "normed_bits_as_first", "error"])
    print(f"wrote {path}")
    ops = {(r["hidden"], r["tokens"], r["variant"]): r["ms"] for r in rows if r["part"] == "op"}
    if ops:
        names = list(dict.fromkeys(k[2] for k in ops))
        print(f"{'hidden':>6} {'tokens':>6} " + " ".join(f"{n:>12}" for n in names)
              + "   weave/inductor  weave/floor  cap32/inductor  inductor/floor")
        for hidden, tokens in dict.fromkeys((k[0], k[1]) for k in ops):
            get = lambda n: ops[(hidden, tokens, n)]  # noqa: E731
            print(f"{hidden:>6} {tokens:>6} " + " ".join(f"{get(n):12.4f}" for n in names)
                  + f"   {get('weave') / get('inductor'):14.2f} {get('weave') / get('floor'):12.2f}"
                  f" {get('weave_cap32') / get('inductor'):15.2f} {get('inductor') / get('floor'):15.2f}")
    quant = {(r["hidden"], r["tokens"], *r["variant"].split(" ")): r["ms"] for r in rows if r["part"] == "quant"}
    if quant:
        print(f"{'form':>15} {'hidden':>6} {'tokens':>6} {'inductor':>9} {'w_norm':>8} {'w_quant':>8} {'w_q_div':>8}"
              f" {'w_n+i_q':>8}   quant/inductor  quant/norm  div_rn/norm")
        for hidden, tokens, form in dict.fromkeys(k[:3] for k in quant):
            get = lambda n: quant[(hidden, tokens, form, n)]  # noqa: E731
            print(f"{form:>15} {hidden:>6} {tokens:>6} {get('inductor_quant'):9.4f} {get('weave_norm'):8.4f} "
                  f"{get('weave_quant'):8.4f} {get('weave_quant_div_rn'):8.4f} {get('weave_norm+inductor_quant'):8.4f}"
                  f"   {get('weave_quant') / get('inductor_quant'):14.2f}"
                  f" {get('weave_quant') / get('weave_norm'):11.2f}"
                  f" {get('weave_quant_div_rn') / get('weave_norm'):12.2f}")
    for r in rows:
        if r["part"] == "sim" and r.get("error"):
            print(f"sim world {r['world']} {r['variant']}: not run ({r['error']})")
        elif r["part"] == "sim":
            print(f"sim world {r['world']} {r['variant']}: {r['ms']:.4f} ms, copy of the minimum bytes "
                  f"{r['floor_ms']:.4f} ms, ratio {r['vs_floor']:.2f}; on the ranks' {r['variant'].split()[1]} x "
                  f"{r['world']} CTAs {r['grid_copy_ms']:.4f} ms, ratio {r['vs_grid_copy']:.2f}; "
                  f"{r['regs']} registers, {r['spills']} spilled, {r['shared_bytes']} B shared; "
                  f"normed bits as the first case's: {r['normed_bits_as_first']}")


if __name__ == "__main__":
    main()
