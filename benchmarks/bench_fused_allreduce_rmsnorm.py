"""all_reduce + residual add + RMSNorm on 2 GPUs (one process per GPU), hidden 8192, bf16.

Compared in the same run, per token count:

* ``nccl``: NCCL ``all_reduce`` + add + ``F.rms_norm`` (the unfused baseline, "(a)");
* ``symm_two_shot`` / ``symm_one_shot``: ``torch.ops.symm_mem.two_shot_all_reduce_`` /
  ``one_shot_all_reduce`` on a symmetric buffer + add + ``F.rms_norm`` ("(b)"; the partial is already in
  symmetric memory, a copy those ops would need in a model is not counted; multicast is off, so they
  run their peer-to-peer paths);
* ``weave``: the cuda_symm kernel at the CTA count and algorithm of its rule; ``weave_ctaN`` the same
  with N CTAs forced; ``weave_one_shot`` / ``weave_two_shot`` with the algorithm forced;
  ``weave_flat_ctaN`` the flat (barrier-per-phase) two-shot kernel and ``weave_pipe_ctaN`` the
  chunk-pipelined one, N CTAs forced (``--compare-kernels``); ``weave_pipe_cC_ctaN`` the pipelined
  kernel with C tiles per chunk (``--chunk-variants``);
* ``p2p_bound``: a kernel that only stores ``2 (N-1)/N * S`` bytes into the peer's symmetric buffer
  (best of several CTA counts, both ranks at once): the time any all-reduce of ``S`` bytes needs at the
  measured link bandwidth, the lower bound ("(d)").

Timing: each op is captured ``k`` times into a CUDA graph (so host launch cost is not measured) and the
graph is replayed with CUDA events around each replay; the median per op is reported. Every rank runs
the same fixed number of replays: ``triton.testing.do_bench`` picks its repeat count from a local
estimate, which can differ between ranks and would deadlock the cross-rank barriers.

Writes ``bench_fused_allreduce_rmsnorm.csv`` and ``.png`` under ``--out`` and prints a table with the
median ms, algorithm bandwidth (S / time), the ratio to ``nccl`` and the multiple of ``p2p_bound``.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys

import gpu_env  # noqa: F401,E402  (must precede torch: multicast off, checkout on sys.path)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from weavepass.testing.distributed import spawn  # noqa: E402

HIDDEN = 8192
DTYPE = torch.bfloat16
EPS = 1e-6
TOKENS = (1, 8, 32, 128, 512, 1024, 2048, 4096, 8192, 16384, 32768)
SWEEP_CTAS = (2, 4, 8, 16, 24, 32)
BOUND_CTAS = (16, 32, 64, 132)
FORCED_ONE_SHOT_MAX_TOKENS = 8192


@triton.jit
def _peer_store_kernel(
    src_ptr,  # local buffer, n elements
    dst_ptr,  # local view of the symmetric buffer
    peer_delta,  # peer's address of the symmetric buffer - local one, in elements
    n,  # elements to move
    BLOCK: tl.constexpr,
):
    """Grid-stride copy of local memory into the peer's symmetric buffer: stores only, 16-byte vectors."""
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    for start in range(pid * BLOCK, n, step):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(dst_ptr + peer_delta + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


def _time_op(op, calls_per_graph: int, replays: int) -> float:
    """Median ms per op over ``replays`` replays of a graph holding ``calls_per_graph`` ops."""
    op()  # compiles and allocates outside capture
    torch.cuda.synchronize()
    dist.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls_per_graph):
            op()
    torch.cuda.synchronize()
    dist.barrier()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls_per_graph)
    del graph
    torch.cuda.synchronize()
    dist.barrier()
    return statistics.median(times)


def _bench_rank(
    rank: int, world: int, tokens_list, replays: int, tile_variants=(), sweep=SWEEP_CTAS,
    compare_kernels=False, chunk_variants=(),
):
    import torch.distributed._symmetric_memory as symm_mem

    from weavepass.lowering.cuda_symm import choose_launch_plan, fused_allreduce_rmsnorm_cuda

    group = dist.group.WORLD.group_name
    max_tokens = max(tokens_list)
    rows = []
    progress = None
    if rank == 0:
        from tqdm import tqdm

        progress = tqdm(total=len(tokens_list), desc="token counts", file=sys.stdout)

    scratch = symm_mem.empty(max_tokens * HIDDEN, dtype=DTYPE, device="cuda")
    scratch_handle = symm_mem.rendezvous(scratch, group)
    peer = (rank + 1) % world
    peer_delta = (scratch_handle.buffer_ptrs[peer] - scratch_handle.buffer_ptrs[rank]) // scratch.element_size()

    for tokens in tokens_list:
        gen = torch.Generator(device="cuda")
        gen.manual_seed(tokens + 17 * rank)
        partial = torch.randn(tokens, HIDDEN, generator=gen, device="cuda").to(DTYPE)
        residual = torch.randn(tokens, HIDDEN, generator=gen, device="cuda").to(DTYPE)
        weight = torch.ones(HIDDEN, device="cuda", dtype=DTYPE)
        size_bytes = tokens * HIDDEN * partial.element_size()
        calls = max(1, min(20, (256 << 20) // size_bytes))
        results: dict[str, tuple[float, int | None]] = {}

        nccl_buf = partial.clone()

        def nccl():
            dist.all_reduce(nccl_buf)
            return F.rms_norm(nccl_buf + residual, (HIDDEN,), weight, EPS)

        results["nccl"] = (_time_op(nccl, calls, replays), None)

        symm_buf = scratch[: tokens * HIDDEN]
        symm_buf.copy_(partial.flatten())

        def symm_two_shot():
            torch.ops.symm_mem.two_shot_all_reduce_(symm_buf, "sum", group)
            return F.rms_norm(symm_buf.view(tokens, HIDDEN) + residual, (HIDDEN,), weight, EPS)

        def symm_one_shot():
            reduced = torch.ops.symm_mem.one_shot_all_reduce(symm_buf, "sum", group)
            return F.rms_norm(reduced.view(tokens, HIDDEN) + residual, (HIDDEN,), weight, EPS)

        for name, op in (("symm_two_shot", symm_two_shot), ("symm_one_shot", symm_one_shot)):
            try:
                results[name] = (_time_op(op, calls, replays), None)
            except Exception as err:  # same failure on every rank: the op is unavailable here
                if rank == 0:
                    print(f"{name} at T={tokens} skipped: {type(err).__name__}: {err}".splitlines()[0])

        def weave(ctas=None, one_shot=None, **tile):  # tile: tile_elements, num_warps, pipelined, ...
            return lambda: fused_allreduce_rmsnorm_cuda(
                partial, residual, weight, EPS, group, DTYPE,
                max_workspace_tokens=max_tokens, num_ctas=ctas, one_shot=one_shot, **tile,
            )

        plan = choose_launch_plan(tokens, HIDDEN, partial.element_size(), world)
        results["weave"] = (_time_op(weave(), calls, replays), plan.num_ctas)
        if not (compare_kernels and tokens >= 128):  # else weave_ctaN is one of flat / pipe below
            for ctas in sweep:
                results[f"weave_cta{ctas}"] = (_time_op(weave(ctas), calls, replays), ctas)
        if compare_kernels and tokens >= 128:
            for ctas in sweep:
                for kind, flag in (("flat", False), ("pipe", True)):
                    op = weave(ctas, False, pipelined=flag)
                    results[f"weave_{kind}_cta{ctas}"] = (_time_op(op, calls, replays), ctas)
        if tokens >= 1024:
            for chunk in chunk_variants:
                for ctas in (16, 32):
                    op = weave(ctas, False, pipelined=True, chunk_tiles=chunk)
                    results[f"weave_pipe_c{chunk}_cta{ctas}"] = (_time_op(op, calls, replays), ctas)
        if tokens <= FORCED_ONE_SHOT_MAX_TOKENS:
            results["weave_one_shot"] = (_time_op(weave(None, True), calls, replays), None)
        results["weave_two_shot"] = (_time_op(weave(None, False), calls, replays), None)
        for tile, warps in tile_variants:
            for ctas in (16, 32):
                name = f"weave_t{tile // 1024}k_w{warps}_cta{ctas}"
                op = weave(ctas, tile_elements=tile, num_warps=warps)
                results[name] = (_time_op(op, calls, replays), ctas)

        move = 2 * (world - 1) * tokens * HIDDEN // world
        best = None
        for ctas in BOUND_CTAS:
            def copy(ctas=ctas):
                _peer_store_kernel[(ctas,)](partial, scratch, peer_delta, move, BLOCK=8192, num_warps=8)

            ms = _time_op(copy, calls, replays)
            results[f"p2p_store_cta{ctas}"] = (ms, ctas)
            best = ms if best is None else min(best, ms)
        for ctas, block, warps in ((16, 32768, 16), (32, 32768, 16)):  # more bytes in flight per CTA
            def copy(ctas=ctas, block=block, warps=warps):
                _peer_store_kernel[(ctas,)](
                    partial, scratch, peer_delta, move, BLOCK=block, num_warps=warps
                )

            ms = _time_op(copy, calls, replays)
            results[f"p2p_store_b{block // 1024}k_cta{ctas}"] = (ms, ctas)
            best = min(best, ms)
        results["p2p_bound"] = (best, None)

        for name, (ms, ctas) in results.items():
            rows.append({"tokens": tokens, "method": name, "ctas": ctas, "ms": ms, "bytes": size_bytes})
        del nccl_buf, partial, residual
        torch.cuda.empty_cache()
        if progress is not None:
            progress.update(1)
    if progress is not None:
        progress.close()
    return rows


def _annotate(rows):
    by_key = {(r["tokens"], r["method"]): r["ms"] for r in rows}
    for r in rows:
        r["gbps"] = r["bytes"] / (r["ms"] * 1e-3) / 1e9
        r["vs_nccl"] = r["ms"] / by_key[(r["tokens"], "nccl")]
        r["vs_bound"] = r["ms"] / by_key[(r["tokens"], "p2p_bound")]
    return rows


def _print_table(rows):
    print(f"{'tokens':>6} {'method':<22} {'ctas':>4} {'median ms':>10} {'GB/s':>7} {'/nccl':>6} {'/bound':>6}")
    for r in rows:
        ctas = "" if r["ctas"] is None else r["ctas"]
        print(
            f"{r['tokens']:>6} {r['method']:<22} {ctas:>4} {r['ms']:>10.4f} {r['gbps']:>7.1f} "
            f"{r['vs_nccl']:>6.2f} {r['vs_bound']:>6.2f}"
        )


def _plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 6))
    for method in ("nccl", "symm_two_shot", "symm_one_shot", "weave", "weave_cta16", "p2p_bound"):
        points = sorted((r["tokens"], r["ms"]) for r in rows if r["method"] == method)
        if points:
            ax.plot(*zip(*points), marker="o", label=method)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens (hidden 8192, bf16)")
    ax.set_ylabel("median ms per call")
    ax.set_title("all_reduce + add + RMSNorm, 2 x H200")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=120, bbox_inches="tight")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_out", help="folder for the CSV and the PNG")
    parser.add_argument("--tokens", type=int, nargs="*", default=list(TOKENS))
    parser.add_argument("--replays", type=int, default=25)
    parser.add_argument("--timeout-s", type=float, default=480)
    parser.add_argument(
        "--tile-variants", nargs="*", default=[], metavar="ELEMENTS:WARPS",
        help="extra tile shapes to time at 16 and 32 CTAs, e.g. 16384:16",
    )
    parser.add_argument("--ctas", type=int, nargs="*", default=list(SWEEP_CTAS),
                        help="CTA counts of the weave_ctaN sweep")
    parser.add_argument("--compare-kernels", action="store_true",
                        help="also time the flat and the pipelined two-shot kernel at each swept CTA count")
    parser.add_argument("--chunk-variants", type=int, nargs="*", default=[], metavar="TILES",
                        help="tiles per chunk of the pipelined kernel to time at 16 and 32 CTAs")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)

    tiles = [tuple(int(x) for x in v.split(":")) for v in args.tile_variants]
    rows = spawn(
        _bench_rank, 2, "nccl", args.tokens, args.replays, tiles, tuple(args.ctas),
        args.compare_kernels, tuple(args.chunk_variants), timeout_s=args.timeout_s,
    )[0]
    rows = _annotate(rows)
    _print_table(rows)
    csv_path = os.path.join(args.out, "bench_fused_allreduce_rmsnorm.csv")
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    _plot(rows, os.path.join(args.out, "bench_fused_allreduce_rmsnorm.png"))
    print(f"wrote {csv_path} and the PNG beside it")


if __name__ == "__main__":
    main()
