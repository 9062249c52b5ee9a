"""all_reduce + residual add + RMSNorm on N GPUs (``--world``, default 2; one process per GPU),
hidden 8192 and 4096, bf16.

Compared in the same run, per hidden size (``--hidden``) and token count:

* ``nccl``: NCCL ``all_reduce`` + add + ``F.rms_norm`` (the unfused baseline, "(a)");
* ``nccl_rs_ag``: its reduce-scatter form: NCCL ``reduce_scatter_tensor`` + add + ``F.rms_norm`` on
  this rank's 1/N of the rows + ``all_gather_into_tensor`` (token counts divisible by N only);
* ``nccl_symm`` / ``nccl_symm_rs_ag``: the same two with every collective buffer in an NCCL
  symmetric window, so NCCL 2.27+ may run its symmetric kernels (``ncclSymk*``; SGLang's
  ``--enable-symm-mem``). The windows come from ``ProcessGroupNCCL.register_mem_pool(pool,
  symm=True)`` on a MemPool of NCCL's allocator, else from ``symm_mem.set_backend("NCCL")`` +
  ``symm_mem.empty`` + ``rendezvous`` (benchmarks/nccl_symm.py says why these two, and why no
  multicast kernel can run). They run in processes of their own, before the others, because the
  symmetric-memory backend is process-wide. The normed rows are copied into a window before the
  all_gather (a copy of 1/N of the rows, counted). The NCCL kernels that one call launched are in
  the CSV column ``nccl_kernels`` (``ncclSymk...`` = the symmetric path ran). If no route works, what
  was tried and how it failed is printed and the other baselines run as before;
* ``symm_two_shot`` / ``symm_one_shot``: ``torch.ops.symm_mem.two_shot_all_reduce_`` /
  ``one_shot_all_reduce`` on a symmetric buffer + add + ``F.rms_norm`` ("(b)"; the partial is already in
  symmetric memory, a copy those ops would need in a model is not counted; multicast is off, so they
  run their peer-to-peer paths);
* ``weave``: the cuda_symm kernel at the CTA count and algorithm of its rule; ``weave_ctaN`` the same
  with N CTAs forced; ``weave_one_shot`` / ``weave_two_shot`` with the algorithm forced;
  ``weave_lamport`` (``_ctaN``) the Lamport one-shot kernel (no barriers) where the batch fits its slot;
  ``weave_flat_ctaN`` the flat (barrier-per-phase) two-shot kernel and ``weave_pipe_ctaN`` the
  chunk-pipelined one, N CTAs forced (``--compare-kernels``); ``weave_pipe_cC_ctaN`` the pipelined
  kernel with C tiles per chunk (``--chunk-variants``);
* ``p2p_bound``: a kernel that only stores ``2 (N-1)/N * S`` bytes into the peers' symmetric buffers,
  ``2 S / N`` into each of the ``N - 1`` peers at once (the traffic of a two-shot all-reduce: S/N to
  every peer in the reduce-scatter and again in the all-gather), every rank at once, best of several
  CTA counts (``p2p_store_ctaN``: N CTAs in all, split evenly over the peers): the time any
  all-reduce of ``S`` bytes needs at the measured link bandwidth, the lower bound ("(d)"). At N = 2
  it is the one-peer store of the 2-GPU tables.

Timing: each op is captured ``k`` times into a CUDA graph (so host launch cost is not measured) and the
graph is replayed with CUDA events around each replay; the median per op is reported. Every rank runs
the same fixed number of replays: ``triton.testing.do_bench`` picks its repeat count from a local
estimate, which can differ between ranks and would deadlock the cross-rank barriers.

Token counts need not be multiples of N: the reduce-scatter baselines skip those sizes (their
collectives need equal shards), every other method runs them (weave pads internally; 1 token on 8
ranks leaves 7 ranks owning no row in two-shot).

Writes ``bench_fused_allreduce_rmsnorm.csv`` and ``.png`` under ``--out`` (``..._tpN`` when N is not
2, ``report.world_name``; ``--name`` sets the stem) and prints a table with the world, median ms,
algorithm bandwidth (S / time), the ratio to ``nccl``, to the fastest baseline (every method not named
``weave*`` or ``p2p*``) and the multiple of ``p2p_bound``; the CSV has a ``world`` column.

``--smoke`` runs ``nccl`` and ``nccl_rs_ag`` on N CPU processes (gloo, fp32, hidden 64, wall-clock
timed, no CUDA graphs) and prints why every other method is skipped: it checks the script, not the
speed.
"""

from __future__ import annotations

import argparse
import os
import statistics

import gpu_env  # noqa: F401,E402  (must precede torch: multicast off, checkout on sys.path)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from report import pyplot, save_figure, world_name, world_size, write_csv  # noqa: E402  (benchmarks/report.py)
from timing import progress_bar  # noqa: E402  (benchmarks/timing.py)

from weavepass.testing.distributed import spawn  # noqa: E402

try:
    import triton  # noqa: E402
    import triton.language as tl  # noqa: E402
except ImportError:  # CPU-only installs (--smoke): the peer-store kernel needs Triton and CUDA
    triton = None

HIDDENS = (8192, 4096)
DTYPE = torch.bfloat16
EPS = 1e-6
TOKENS = (1, 8, 32, 128, 512, 1024, 2048, 4096, 8192, 16384, 32768)
SWEEP_CTAS = (2, 4, 8, 16, 24, 32)
BOUND_CTAS = (16, 32, 64, 132)
FORCED_ONE_SHOT_MAX_TOKENS = 8192


def _peer_store_kernel_fn(
    src_ptr,  # local buffer, n elements
    dst_ptr,  # local view of the symmetric buffer
    deltas_ptr,  # int64 [peers]: where peer p's copy goes - dst_ptr, in elements (peer_store_deltas)
    n,  # elements to move to each peer
    BLOCK: tl.constexpr,
):
    """Grid-stride copy of local memory into every peer's symmetric buffer at once (program column
    ``program_id(1)`` serves one peer): stores only, 16-byte vectors."""
    pid = tl.program_id(0)
    delta = tl.load(deltas_ptr + tl.program_id(1))
    step = tl.num_programs(0) * BLOCK
    for start in range(pid * BLOCK, n, step):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(dst_ptr + delta + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


_peer_store_kernel = triton.jit(_peer_store_kernel_fn) if triton is not None else None


def peer_store_deltas(buffer_ptrs: list[int], rank: int, per_peer: int, element_size: int) -> list[int]:
    """For each peer of ``rank`` (in rank order), the offset in elements from ``rank``'s view of the
    symmetric buffer to where its ``per_peer`` elements land in that peer's buffer. Each sender gets
    its own slot ``(rank - peer) mod N - 1`` of the receiver, so the N - 1 senders into one buffer
    never overlap: the buffer needs ``(N - 1) * per_peer`` elements."""
    world = len(buffer_ptrs)
    deltas = []
    for peer in range(world):
        if peer == rank:
            continue
        slot = (rank - peer) % world - 1
        deltas.append((buffer_ptrs[peer] - buffer_ptrs[rank]) // element_size + slot * per_peer)
    return deltas


def bound_grid(ctas: int, world: int) -> tuple[int, int]:
    """The peer-store grid for ``ctas`` CTAs in all: as many per peer, at least one, on N - 1 peers."""
    peers = world - 1
    return max(1, ctas // peers), peers


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


def _allreduce_norm(buf, residual, weight, hidden: int):
    """NCCL all_reduce of ``buf`` in place, + residual, RMSNorm."""

    def op():
        dist.all_reduce(buf)
        return F.rms_norm(buf + residual, (hidden,), weight, EPS)

    return op


def _rs_norm_ag(buf, shard, normed, full, residual_shard, weight, hidden: int):
    """The reduce-scatter form: reduce_scatter ``buf`` [T, H] into ``shard`` [T/N, H], + residual
    rows, RMSNorm into ``normed``, all_gather into ``full`` [T, H]."""

    def op():
        dist.reduce_scatter_tensor(shard, buf)
        normed.copy_(F.rms_norm(shard + residual_shard, (hidden,), weight, EPS))
        dist.all_gather_into_tensor(full, normed)
        return full

    return op


def _time(op, calls: int, replays: int, smoke: bool) -> float:
    """CUDA-graph replay timing on GPUs; wall clock of plain calls on the CPU (--smoke)."""
    if not smoke:
        return _time_op(op, calls, replays)
    import time

    op()
    times = []
    for _ in range(replays):
        dist.barrier()
        start = time.perf_counter()
        op()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _inputs(tokens: int, hidden: int, rank: int, device, dtype):
    gen = torch.Generator(device=device)
    gen.manual_seed(tokens + 17 * rank + hidden)
    partial = torch.randn(tokens, hidden, generator=gen, device=device).to(dtype)
    residual = torch.randn(tokens, hidden, generator=gen, device=device).to(dtype)
    return partial, residual, torch.ones(hidden, device=device, dtype=dtype)


def _nccl_symm_rank(rank: int, world: int, hiddens, tokens_list, replays: int):
    """``nccl_symm`` and ``nccl_symm_rs_ag`` rows, and the notes on how the windows were made
    (or what failed). Runs in processes of its own (see the module docstring)."""
    import nccl_symm

    group = dist.group.WORLD
    device = torch.device("cuda", rank)
    numel = max(tokens_list) * max(hiddens)
    notes, bufs = [], None
    try:  # route 1: a MemPool on NCCL's allocator, registered as symmetric windows
        pool, backend = nccl_symm.window_pool(group, device)
        with torch.cuda.use_mem_pool(pool):
            bufs = [torch.empty(n, dtype=DTYPE, device=device) for n in (numel, numel // world, numel // world, numel)]
        notes.append(f"windows: {nccl_symm.register_window(backend, pool)}")
    except nccl_symm.SymmetricWindowUnavailable as err:
        notes.append(f"route 1 failed: {err}")
        bufs = None
    if bufs is None:
        try:  # route 2: the NCCL backend of torch symmetric memory
            bufs = nccl_symm.symm_mem_nccl_buffers(group, [numel, numel // world, numel // world, numel], DTYPE)
            notes.append('windows: symm_mem.set_backend("NCCL") + symm_mem.empty + rendezvous')
        except nccl_symm.SymmetricWindowUnavailable as err:
            notes.append(f"route 2 failed: {err}")
            return [], notes
    buf, shard, normed, full = bufs
    rows = []
    for hidden in hiddens:
        for tokens in tokens_list:
            partial, residual, weight = _inputs(tokens, hidden, rank, device, DTYPE)
            size_bytes = tokens * hidden * partial.element_size()
            calls = max(1, min(20, (256 << 20) // size_bytes))
            n = tokens * hidden
            window = buf[:n].view(tokens, hidden)
            window.copy_(partial)
            ops = {"nccl_symm": _allreduce_norm(window, residual, weight, hidden)}
            if tokens % world == 0:
                rows_per_rank = tokens // world
                ops["nccl_symm_rs_ag"] = _rs_norm_ag(
                    window, shard[: n // world].view(rows_per_rank, hidden),
                    normed[: n // world].view(rows_per_rank, hidden), full[:n].view(tokens, hidden),
                    residual[:rows_per_rank], weight, hidden)
            for name, op in ops.items():
                try:
                    kernels = nccl_symm.nccl_kernel_names(op)
                    ms = _time_op(op, calls, replays)
                except Exception as err:  # same failure on every rank: say it, go on
                    notes.append(f"{name} at H={hidden} T={tokens}: {type(err).__name__}: {err}".splitlines()[0])
                    continue
                rows.append({"hidden": hidden, "tokens": tokens, "method": name, "ctas": None, "ms": ms,
                             "bytes": size_bytes, "nccl_kernels": " ".join(kernels)})
            del partial, residual
    return rows, notes


def _smoke_rank(rank: int, world: int, hiddens, tokens_list, replays: int):
    """CPU / gloo: the two NCCL-style baselines only, wall-clock timed."""
    rows = []
    for hidden in hiddens:
        for tokens in tokens_list:
            partial, residual, weight = _inputs(tokens, hidden, rank, "cpu", torch.float32)
            ops = {"nccl": _allreduce_norm(partial.clone(), residual, weight, hidden)}
            if tokens % world == 0:
                rows_per_rank = tokens // world
                ops["nccl_rs_ag"] = _rs_norm_ag(
                    partial.clone(), torch.empty(rows_per_rank, hidden), torch.empty(rows_per_rank, hidden),
                    torch.empty(tokens, hidden), residual[:rows_per_rank], weight, hidden)
            for name, op in ops.items():
                rows.append({"hidden": hidden, "tokens": tokens, "method": name, "ctas": None,
                             "ms": _time(op, 1, replays, smoke=True), "bytes": tokens * hidden * 4})
    return rows


def _bench_rank(
    rank: int, world: int, hiddens, tokens_list, replays: int, tile_variants=(), sweep=SWEEP_CTAS,
    compare_kernels=False, chunk_variants=(),
):
    import torch.distributed._symmetric_memory as symm_mem

    from weavepass.runtime.cuda.dispatch import fused_allreduce_rmsnorm_cuda
    from weavepass.runtime.cuda.launch_plan import LAMPORT_MAX_BYTES, choose_launch_plan

    group = dist.group.WORLD.group_name
    max_tokens = max(tokens_list)
    rows = []
    progress = None
    if rank == 0:
        progress = progress_bar(len(tokens_list) * len(hiddens), "cases")

    # Twice the largest batch: the bound's N - 1 senders write 2 S / N elements each into every buffer.
    scratch = symm_mem.empty(2 * max_tokens * max(hiddens), dtype=DTYPE, device="cuda")
    scratch_handle = symm_mem.rendezvous(scratch, group)
    buffer_ptrs = list(scratch_handle.buffer_ptrs)

    for hidden, tokens in [(h, t) for h in hiddens for t in tokens_list]:
        partial, residual, weight = _inputs(tokens, hidden, rank, "cuda", DTYPE)
        size_bytes = tokens * hidden * partial.element_size()
        calls = max(1, min(20, (256 << 20) // size_bytes))
        results: dict[str, tuple[float, int | None]] = {}

        nccl_buf = partial.clone()
        results["nccl"] = (_time_op(_allreduce_norm(nccl_buf, residual, weight, hidden), calls, replays), None)
        if tokens % world == 0:
            rows_per_rank = tokens // world
            rs_ag = _rs_norm_ag(
                partial.clone(), torch.empty_like(partial[:rows_per_rank]), torch.empty_like(partial[:rows_per_rank]),
                torch.empty_like(partial), residual[:rows_per_rank], weight, hidden)
            results["nccl_rs_ag"] = (_time_op(rs_ag, calls, replays), None)

        symm_buf = scratch[: tokens * hidden]
        symm_buf.copy_(partial.flatten())

        def symm_two_shot():
            torch.ops.symm_mem.two_shot_all_reduce_(symm_buf, "sum", group)
            return F.rms_norm(symm_buf.view(tokens, hidden) + residual, (hidden,), weight, EPS)

        def symm_one_shot():
            reduced = torch.ops.symm_mem.one_shot_all_reduce(symm_buf, "sum", group)
            return F.rms_norm(reduced.view(tokens, hidden) + residual, (hidden,), weight, EPS)

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

        plan = choose_launch_plan(tokens, hidden, partial.element_size(), world)
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
        if tokens * hidden * partial.element_size() <= LAMPORT_MAX_BYTES:
            results["weave_lamport"] = (_time_op(weave(None, lamport=True), calls, replays), None)
            for ctas in (4, 16):
                results[f"weave_lamport_cta{ctas}"] = (_time_op(weave(ctas, lamport=True), calls, replays), ctas)
        results["weave_two_shot"] = (_time_op(weave(None, False), calls, replays), None)
        for tile, warps in tile_variants:
            for ctas in (16, 32):
                name = f"weave_t{tile // 1024}k_w{warps}_cta{ctas}"
                op = weave(ctas, tile_elements=tile, num_warps=warps)
                results[name] = (_time_op(op, calls, replays), ctas)

        # 2 S / N elements to each peer (2 (N-1)/N S in all), read from the partial (S >= 2 S / N elements).
        per_peer = -(-2 * tokens * hidden // world)
        deltas = torch.tensor(peer_store_deltas(buffer_ptrs, rank, per_peer, scratch.element_size()),
                              dtype=torch.int64, device="cuda")
        best = None
        for ctas in BOUND_CTAS:
            def copy(ctas=ctas):
                _peer_store_kernel[bound_grid(ctas, world)](partial, scratch, deltas, per_peer, BLOCK=8192,
                                                            num_warps=8)

            ms = _time_op(copy, calls, replays)
            results[f"p2p_store_cta{ctas}"] = (ms, ctas)
            best = ms if best is None else min(best, ms)
        for ctas, block, warps in ((16, 32768, 16), (32, 32768, 16)):  # more bytes in flight per CTA
            def copy(ctas=ctas, block=block, warps=warps):
                _peer_store_kernel[bound_grid(ctas, world)](
                    partial, scratch, deltas, per_peer, BLOCK=block, num_warps=warps
                )

            ms = _time_op(copy, calls, replays)
            results[f"p2p_store_b{block // 1024}k_cta{ctas}"] = (ms, ctas)
            best = min(best, ms)
        results["p2p_bound"] = (best, None)

        for name, (ms, ctas) in results.items():
            rows.append({"hidden": hidden, "tokens": tokens, "method": name, "ctas": ctas, "ms": ms,
                         "bytes": size_bytes})
            if rank == 0:  # in the log as it comes, should a time limit stop the run before the table
                print(f"row: {rows[-1]}", flush=True)
        nccl_buf = partial = residual = None  # free this case's buffers (the timed closures hold them too)
        torch.cuda.empty_cache()
        if progress is not None:
            progress.update(1)
    if progress is not None:
        progress.close()
    return rows


def _is_baseline(method: str) -> bool:
    """What a user could pick instead of weave: every method but weave's and the P2P probes."""
    return not method.startswith(("weave", "p2p"))


def _annotate(rows):
    """Bandwidth and the ratios to ``nccl``, to the fastest baseline and to ``p2p_bound``."""
    by_key = {(r["hidden"], r["tokens"], r["method"]): r["ms"] for r in rows}
    best = {}
    for r in rows:
        if _is_baseline(r["method"]):
            key = (r["hidden"], r["tokens"])
            if key not in best or r["ms"] < best[key][0]:
                best[key] = (r["ms"], r["method"])
    for r in rows:
        key = (r["hidden"], r["tokens"])
        r["gbps"] = r["bytes"] / (r["ms"] * 1e-3) / 1e9
        r["vs_nccl"] = r["ms"] / by_key[(*key, "nccl")]
        r["best_baseline"] = best[key][1]
        r["vs_best_baseline"] = r["ms"] / best[key][0]
        bound = by_key.get((*key, "p2p_bound"))
        r["vs_bound"] = r["ms"] / bound if bound else float("nan")
        r.setdefault("nccl_kernels", "")
    return rows


def _print_table(rows):
    print(f"{'world':>5} {'hidden':>6} {'tokens':>6} {'method':<22} {'ctas':>4} {'median ms':>10} {'GB/s':>7} "
          f"{'/nccl':>6} {'/best':>6} {'/bound':>6}  best baseline")
    for r in sorted(rows, key=lambda r: (-r["hidden"], r["tokens"])):
        ctas = "" if r["ctas"] is None else r["ctas"]
        print(
            f"{r['world']:>5} {r['hidden']:>6} {r['tokens']:>6} {r['method']:<22} {ctas:>4} {r['ms']:>10.4f} "
            f"{r['gbps']:>7.1f} "
            f"{r['vs_nccl']:>6.2f} {r['vs_best_baseline']:>6.2f} {r['vs_bound']:>6.2f}  {r['best_baseline']}"
        )


def _plot(rows, path, world: int) -> None:
    """The PNG, one panel per hidden size (none where matplotlib is missing)."""
    plt = pyplot()
    if plt is None:
        return
    hiddens = sorted({r["hidden"] for r in rows}, reverse=True)
    fig, axes = plt.subplots(1, len(hiddens), figsize=(9 * len(hiddens), 6), squeeze=False)
    methods = ("nccl", "nccl_rs_ag", "nccl_symm", "nccl_symm_rs_ag", "symm_two_shot", "symm_one_shot",
               "weave", "weave_cta16", "weave_lamport", "p2p_bound")
    for ax, hidden in zip(axes[0], hiddens):
        for method in methods:
            points = sorted((r["tokens"], r["ms"]) for r in rows if r["method"] == method and r["hidden"] == hidden)
            if points:
                ax.plot(*zip(*points), marker="o", label=method)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(f"tokens (hidden {hidden}, bf16)")
        ax.set_ylabel("median ms per call")
        ax.set_title(f"all_reduce + add + RMSNorm, hidden {hidden}, {world} x H200")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    save_figure(fig, path, bbox_inches="tight")


def _nccl_symm_rows(world, hiddens, tokens, replays, timeout_s) -> list[dict]:
    """The NCCL-symmetric baselines from their own spawn; on any failure, say what and go on."""
    try:
        rows, notes = spawn(_nccl_symm_rank, world, "nccl", hiddens, tokens, replays, timeout_s=timeout_s)[0]
    except Exception as err:  # e.g. an NCCL error that killed the ranks
        print(f"nccl_symm baselines failed, carrying on without them:\n{err}", flush=True)
        return []
    for note in notes:
        print(f"nccl_symm: {note}", flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_out", help="folder for the CSV and the PNG")
    parser.add_argument("--world", type=world_size, default=2, help="ranks, one GPU each (default 2)")
    parser.add_argument("--name", default=None,
                        help="file name of the CSV and PNG, without suffix (default "
                             "bench_fused_allreduce_rmsnorm, with _tpN when --world is not 2)")
    parser.add_argument("--smoke", action="store_true",
                        help="--world CPU processes (gloo): the NCCL-style baselines only, to check the script runs")
    parser.add_argument("--hidden", type=int, nargs="+", default=None,
                        help=f"hidden sizes (default {' '.join(map(str, HIDDENS))}; 64 with --smoke)")
    parser.add_argument("--tokens", type=int, nargs="*", default=None,
                        help=f"token counts (default {' '.join(map(str, TOKENS))}; 1 8 with --smoke)")
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
    parser.add_argument("--no-nccl-symm", action="store_true", help="skip the NCCL symmetric-window baselines")
    args = parser.parse_args()
    world = args.world
    if not args.smoke and torch.cuda.device_count() < world:
        parser.error(f"--world {world} needs {world} GPUs, found {torch.cuda.device_count()} (or --smoke)")
    os.makedirs(args.out, exist_ok=True)

    if args.smoke:
        hiddens, tokens = args.hidden or [64], args.tokens or [1, 8]
        for method in ("nccl_symm", "nccl_symm_rs_ag", "symm_two_shot", "symm_one_shot", "weave*", "p2p*"):
            print(f"{method} skipped on the CPU: needs CUDA (NCCL windows, symmetric memory or Triton)")
        rows = spawn(_smoke_rank, world, "gloo", hiddens, tokens, 3, timeout_s=args.timeout_s)[0]
    else:
        hiddens, tokens = args.hidden or list(HIDDENS), args.tokens or list(TOKENS)
        rows = [] if args.no_nccl_symm else _nccl_symm_rows(world, hiddens, tokens, args.replays, args.timeout_s)
        tiles = [tuple(int(x) for x in v.split(":")) for v in args.tile_variants]
        rows += spawn(
            _bench_rank, world, "nccl", hiddens, tokens, args.replays, tiles, tuple(args.ctas),
            args.compare_kernels, tuple(args.chunk_variants), timeout_s=args.timeout_s,
        )[0]
    rows = _annotate([{"world": world, **r} for r in rows])
    _print_table(rows)
    name = args.name or world_name("bench_fused_allreduce_rmsnorm", world)
    print(f"wrote {write_csv(os.path.join(args.out, f'{name}.csv'), rows)}")
    _plot(rows, os.path.join(args.out, f"{name}.png"), world)


if __name__ == "__main__":
    main()
