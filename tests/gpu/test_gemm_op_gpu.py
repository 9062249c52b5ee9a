"""The ``cuda_symm`` lowering of the matmul ops (``runtime.cuda.matmul``; docs/gemm_epilogue.md) on
GPUs: simulated ranks through the lowering's own calls, then real ranks (2 GPUs, or 2 processes
sharing one with ``WEAVE_GPU_SHARED=1``: gloo, CUDA IPC for the symmetric workspace).

* Simulated (one process, ``testing.gemm_sim.SimulatedMatmulRanks``): N = 2 and 4 ranks' GEMM,
  reduce, push and collect, bf16 and fp16, 1030 tokens (no owner count divides it), the full stream
  and FlashComm's 16-row shards, two calls (both slots); then one call of 2 ranks captured in a CUDA
  graph and replayed on new inputs.
* Real ranks (one spawn, ``gpu_cases``): the ops called directly, both dtypes, 1 / 7 / 301 / 1030
  tokens, both forms, with no fallback to the portable lowering; then the reference decoder compiled
  with ``gemm_epilogue="force"`` (every o_proj and down_proj inside the op on ``cuda_symm``) against
  eager and the fp32 reference, and under ``mode="reduce-overhead"`` (CUDA-graph trees: replays on new
  inputs against eager).

Tolerances, and why:

* The op's partials are the Triton GEMM's, which differ from ``torch.mm``'s (cuBLAS) by at most one
  ulp where their fp32 sums straddle a rounding (tests/gpu/test_gemm_gpu.py); so the reference here is
  ``runtime.reference`` fed the plain Triton GEMM's partials with the scatter's config (the same tile
  and K order as the scatter's tiles: equal to the bit expected). Against it ``residual_out`` is one
  final rounding (an ulp where the fp32 sums' order differs) and ``normed`` two ulp (``RESIDUAL_TOL``,
  ``NORMED_TOL``, test_gemm_gpu.py's). Every rank's full-stream outputs are equal to the bit (the
  gathered rows are copies of their owner's).
* The model: ``check_against_eager``'s rule (``err <= 2 err_eager + atol(dtype) max(1, max|ref|)``);
  against the plain fused op's compile the logits differ by the GEMM's ulps carried through two
  layers, reported, not asserted equal.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from gpu_cases import Case, check_replays_match_eager, needs_gpus, shared_ranks  # tests/gpu/gpu_cases.py
from test_gemm_gpu import NORMED_TOL, RESIDUAL_TOL, _in_child  # tests/gpu/test_gemm_gpu.py

import weavepass
from weavepass.runtime.reference import add_rmsnorm_local, fused_allreduce_rmsnorm_reference
from weavepass.testing.harness import check_against_eager
from weavepass.testing.models import TPConfig, build_tp_model, random_token_ids
from weavepass.testing.shared_gpu import rank_device

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

EPS = 1e-6
WORLD = 2  # the real-rank cases: two GPUs, or two processes sharing one (WEAVE_GPU_SHARED=1)
OP = "weave.matmul_reduce_scatter_rmsnorm.default"


def _draw(gen, rows, cols, dtype, device="cuda", scale=1.0):
    return (torch.randn(rows, cols, generator=gen, device=device) * scale).to(dtype)


def _plain(x, w):
    """The plain Triton GEMM with the scatter's tiling (``select_config``'s for the shape, which the
    scatter takes too: the reference's partials; TMA or pointer stores write the same values)."""
    from weavepass.runtime.cuda.gemm import matmul

    return matmul(x, w)


def _flashcomm_rows(tokens: int, world: int) -> int:
    return -(-tokens // (16 * world)) * 16


def _check_calls(calls, partials, residual, shards, weight, dtype, label):
    tokens = partials[0].shape[0]
    if shards is None:  # the full stream
        want_n, want_r = fused_allreduce_rmsnorm_reference(partials, residual, weight, EPS, dtype)
        for r, c in enumerate(calls):
            assert torch.equal(c.normed, calls[0].normed) and torch.equal(c.residual_out, calls[0].residual_out), \
                f"{label}: rank {r}'s rows differ from rank 0's"
            _close(c.residual_out, want_r, RESIDUAL_TOL[dtype], f"{label} rank {r} residual_out")
            _close(c.normed, want_n, NORMED_TOL[dtype], f"{label} rank {r} normed")
        return
    per = calls[0].normed.shape[0]
    summed = torch.zeros(per * len(calls), partials[0].shape[1], dtype=torch.float32, device=partials[0].device)
    summed[:tokens] = torch.stack([p.float() for p in partials]).sum(0)
    for r, c in enumerate(calls):
        want_n, want_r = add_rmsnorm_local(summed[r * per:(r + 1) * per], shards[r], weight, EPS, dtype, dtype)
        _close(c.residual_out, want_r, RESIDUAL_TOL[dtype], f"{label} rank {r} residual_out")
        _close(c.normed, want_n, NORMED_TOL[dtype], f"{label} rank {r} normed")


def _close(got, want, tol, label):
    torch.testing.assert_close(got, want, rtol=tol[0], atol=tol[1], msg=lambda e: f"{label}: {e}")


def test_matmul_op_replays_in_a_cuda_graph(request):
    """One full-stream call of 2 simulated ranks captured on one stream (every GEMM, reduce, push,
    collect) and replayed three times on new inputs: each replay's answer, and the pads' call numbers
    advancing with no host state. Everything the kernels address is held by the workspaces (staging,
    gather, pads, address tables, the split) or the calls (inputs, outputs)."""
    if _in_child(request):
        return
    from weavepass.testing.gemm_sim import SimulatedMatmulRanks

    world, tokens, hidden, k, dtype = 2, 1030, 4096, 512, torch.bfloat16
    sim = SimulatedMatmulRanks(world, hidden, tokens + 1, dtype)
    gen = torch.Generator(device="cuda").manual_seed(11)
    xs = [_draw(gen, tokens, k, dtype) for _ in range(world)]
    ws = [_draw(gen, hidden, k, dtype, scale=k**-0.5) for _ in range(world)]
    residual = _draw(gen, tokens, hidden, dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen, device="cuda")).to(dtype)
    mat2s = [w.t() for w in ws]
    sim.run(sim.calls(xs, mat2s, [residual] * world, weight, EPS), one_stream=True)  # loads every kernel
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls = sim.calls(xs, mat2s, [residual] * world, weight, EPS)
        sim.run(calls, one_stream=True)
    for replay in range(1, 4):
        for t in (*xs, residual):
            t.copy_(_draw(gen, *t.shape, dtype))
        for t in ws:
            t.copy_(_draw(gen, *t.shape, dtype, scale=k**-0.5))
        junk = [torch.full((128,), -(2**30), dtype=torch.int32, device="cuda") for _ in range(4096)]
        graph.replay()
        del junk
        torch.cuda.synchronize()
        _check_calls(calls, [_plain(x, w) for x, w in zip(xs, ws, strict=True)], residual, None, weight, dtype,
                     f"replay {replay}")
        assert [int(p[0]) for p in sim.pads] == [1 + replay] * world
        assert [int(p[0]) for p in sim.gather_pads] == [1 + replay] * world


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("world", [2, 4])
def test_matmul_op_simulated(world, dtype, request):
    """The lowering's calls on simulated ranks: a warm-up of both forms on one stream (every kernel
    loaded before any rank waits), then both forms with one stream per rank, twice."""
    if _in_child(request):
        return
    from weavepass.runtime.cuda.matmul import pad_shard_rows
    from weavepass.testing.gemm_sim import SimulatedMatmulRanks

    tokens, hidden, k = 1030, 4096, 512
    per = _flashcomm_rows(tokens, world)
    sim = SimulatedMatmulRanks(world, hidden, per * world, dtype)
    gen = torch.Generator(device="cuda").manual_seed(world)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen, device="cuda")).to(dtype)
    for call, (full, one_stream) in enumerate([(True, True), (False, True), (True, False), (False, False),
                                               (True, False), (False, False)]):
        xs = [_draw(gen, tokens, k, dtype) for _ in range(world)]
        ws = [_draw(gen, hidden, k, dtype, scale=k**-0.5) for _ in range(world)]
        residual = _draw(gen, tokens, hidden, dtype)
        shards = None if full else [_draw(gen, per, hidden, dtype) for _ in range(world)]
        calls = sim.calls(xs, [w.t() for w in ws], [residual] * world if full else shards, weight, EPS,
                          rows_per_rank=None if full else per)
        sim.run(calls, one_stream=one_stream)
        for r, c in enumerate(calls):
            if not full:
                pad_shard_rows(c, shards[r], weight, EPS, dtype)
        torch.cuda.synchronize()
        partials = [_plain(x, w) for x, w in zip(xs, ws, strict=True)]
        _check_calls(calls, partials, residual, shards, weight, dtype,
                     f"world {world} call {call} {'full' if full else 'shard'}")
    assert [p[:4].tolist()[0::2] for p in sim.pads] == [[6, 6]] * world  # GEMM_SEQ, REDUCE_SEQ
    assert [int(p[0]) for p in sim.gather_pads] == [3] * world  # GATHER_SEQ: the three full calls


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("world", [1, 2])
def test_planned_calls_match_the_general_path(world, dtype, request):
    """``gemm.ScatterPlan`` (the op's launches after the first call of a signature,
    ``matmul._planned_call``) on the GPU, where its launches go direct (``launcher.DirectLauncher``,
    tensor descriptors rebased on each call's x and w): five calls of one signature, each run first
    by the general path (``scatter_matmul`` + ``reduce_scattered``, Triton's dispatch) and then by the
    plan on the same inputs, equal to the bit (the same kernel, config and store path); the plan's
    GEMM and reduce launched direct from the second call on; then an x off 16-byte alignment (the
    plan launches what ``scatter_matmul`` does for it, pointer loads), against the reference."""
    if _in_child(request):
        return
    from weavepass.runtime.cuda import launcher
    from weavepass.runtime.cuda.gemm import ScatterPlan
    from weavepass.testing.gemm_sim import SimulatedMatmulRanks

    assert launcher.DIRECT_LAUNCH
    tokens, hidden, k = 1030, 4096, 512
    sim = SimulatedMatmulRanks(world, hidden, 2048, dtype)  # 2048 rows per owner: a multiple of every block_m
    if world == 1:  # as the op's group of one: its staging is every owner's, so the scatter stores by TMA
        ws0 = sim.workspaces[0]
        ws0.scatter = dataclasses.replace(ws0.scatter, shared=ws0.scatter.staging)
    gen = torch.Generator(device="cuda").manual_seed(7 * world)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen, device="cuda")).to(dtype)
    plans = None
    for call in range(6):
        xs = [_draw(gen, tokens, k, dtype) for _ in range(world)]
        if call == 5:
            xs = [torch.cat([x.new_zeros(1), x.reshape(-1)])[1:].view(tokens, k) for x in xs]
            assert all(x.data_ptr() % 16 for x in xs)
        ws = [_draw(gen, hidden, k, dtype, scale=k**-0.5) for _ in range(world)]
        residual = _draw(gen, tokens, hidden, dtype)
        general = sim.calls(xs, [w.t() for w in ws], [residual] * world, weight, EPS)
        sim.run(general, one_stream=call == 0)
        planned = sim.calls(xs, [w.t() for w in ws], [residual] * world, weight, EPS)
        if plans is None:
            plans = [ScatterPlan(c.x, c.w, c.ws.scatter, c.owners, c.count, EPS, c.num_ctas, True) for c in planned]
        for c, plan in zip(planned, plans, strict=True):
            c.plan = plan
        sim.run(planned, one_stream=call == 0)
        torch.cuda.synchronize()
        for r, (a, b) in enumerate(zip(general, planned, strict=True)):
            assert torch.equal(a.normed, b.normed) and torch.equal(a.residual_out, b.residual_out), \
                f"call {call} rank {r}: the planned launches differ from the general path"
        partials = [_plain(x.contiguous(), w) for x, w in zip(xs, ws, strict=True)]
        _check_calls(planned, partials, residual, None, weight, dtype, f"planned world {world} call {call}")
    for plan in plans:
        assert plan.use_descriptors and plan.gemm_launcher.compiled is not None \
            and plan.reduce_launcher.compiled is not None, "the plan's launches did not go direct"
        assert plan.gemm_launcher.meta["STORE_DESC"] == (world == 1)  # TMA stores where one allocation holds all


# ---------------------------------------------------------------- real ranks


def _rank_operands(rank, tokens, dtype, hidden, k, device):
    """Rank ``rank``'s ``x [T, K]`` and linear weight ``w [H, K]``, and the replicated residual and
    norm weight: drawn from seeds, so every rank can rebuild every rank's."""
    gen = torch.Generator(device=device).manual_seed(1000 * tokens + rank)
    x, w = _draw(gen, tokens, k, dtype, device), _draw(gen, hidden, k, dtype, device, scale=k**-0.5)
    shared = torch.Generator(device=device).manual_seed(tokens)
    residual = _draw(shared, tokens, hidden, dtype, device)
    weight = (1 + 0.1 * torch.randn(hidden, generator=shared, device=device)).to(dtype)
    return x, w, residual, weight


def _fallbacks(lowering) -> list[str]:
    """The lowering's one-time warnings that a call ran the portable lowering (not the one that
    says a weight was copied, which changes no answer)."""
    return [key for key in lowering._WARNED if key != "mat2"]


def _ops_rank(rank, world):
    """Both ops, called as a compiled graph calls them, on ``cuda_symm``, against the reference on
    every rank's plain-GEMM partials; the full stream's rows returned for the cross-rank check."""
    from weavepass.runtime.cuda import matmul as lowering

    device = rank_device(rank)
    group_name = dist.group.WORLD.group_name
    hidden, k = 1024, 768
    results = []
    for dtype in (torch.bfloat16, torch.float16):
        for tokens in (1, 7, 301, 1030):
            x, w, residual, weight = _rank_operands(rank, tokens, dtype, hidden, k, device)
            partials = [_plain(*_rank_operands(peer, tokens, dtype, hidden, k, device)[:2])
                        for peer in range(world)]
            normed, res = torch.ops.weave.matmul_reduce_scatter_rmsnorm(
                x, w.t(), residual, weight, EPS, group_name, dtype, "cuda_symm", 16384)
            want_n, want_r = fused_allreduce_rmsnorm_reference(partials, residual, weight, EPS, dtype)
            label = f"rank {rank} {dtype} {tokens} tokens"
            _close(res, want_r, RESIDUAL_TOL[dtype], f"{label} full residual_out")
            _close(normed, want_n, NORMED_TOL[dtype], f"{label} full normed")
            per = _flashcomm_rows(tokens, world)
            lo, hi = min(rank * per, tokens), min((rank + 1) * per, tokens)
            shard = torch.zeros(per, hidden, dtype=dtype, device=device)
            shard[: hi - lo] = residual[lo:hi]
            s_normed, s_res = torch.ops.weave.matmul_reduce_scatter_rmsnorm_shard(
                x, w.t(), shard, weight, EPS, group_name, dtype, per, "cuda_symm", 16384)
            assert s_normed.shape == s_res.shape == (per, hidden)
            _close(s_res[: hi - lo], want_r[lo:hi], RESIDUAL_TOL[dtype], f"{label} shard residual_out")
            _close(s_normed[: hi - lo], want_n[lo:hi], NORMED_TOL[dtype], f"{label} shard normed")
            assert not s_normed[hi - lo:].any() and not s_res[hi - lo:].any()  # zero residual padding
            results.append((str(dtype), tokens, normed.cpu(), res.cpu()))
            print(f"[gemm_op] {label}: full and shard within tolerance", flush=True)  # progress, for a killed step
    assert not _fallbacks(lowering), lowering._WARNED
    return results


CFG = TPConfig(vocab=1024, hidden=1024, n_layers=2, n_heads=16, n_kv_heads=8, head_dim=64, intermediate=2048,
               dtype=torch.bfloat16)
MATMUL_SITES = 2 * CFG.n_layers  # o_proj and down_proj; the embedding's sum is no matmul


def _model_rank(rank, world, tokens):
    """The reference decoder with ``gemm_epilogue="force"`` against eager and fp32, and against the
    plain fused op's compile (reported)."""
    from weavepass.runtime.cuda import matmul as lowering

    device = rank_device(rank)
    group = dist.group.WORLD
    model = build_tp_model(CFG, rank, world, group, device=device)
    reference = build_tp_model(CFG, rank, world, group, device=device, dtype=torch.float32)
    ids = random_token_ids(CFG, 1, tokens, seed=3, device=device)
    outputs = {}
    reports = {}
    for name, mode in (("plain", "off"), ("force", "force")):
        backend = weavepass.make_backend(weavepass.WeaveConfig(split="off", cuda_min_tokens=1, gemm_epilogue=mode))
        torch._dynamo.reset()

        def compile_fn(m, backend=backend, name=name):
            compiled = torch.compile(m, backend=backend)
            return lambda *a: outputs.__setitem__(name, compiled(*a)) or outputs[name]

        comparison = check_against_eager(model, (ids,), compile_fn, reference, CFG.dtype)
        (graph,) = backend.report.graphs
        reports[name] = (str(comparison), graph.ops_after.get(OP, 0), [r.lowering for r in graph.records],
                         [[c.value for c in r.codes] for r in graph.records])
    assert reports["force"][1] == MATMUL_SITES, reports["force"]
    assert reports["force"][2] == ["cuda_symm"] * (MATMUL_SITES + 1), reports["force"]
    assert all("gemm_epilogue" in codes for codes in reports["force"][3][1:]), reports["force"]
    assert not _fallbacks(lowering), lowering._WARNED
    diff = (outputs["force"].float() - outputs["plain"].float()).abs().max().item()
    print(f"[gemm_op] rank {rank} model at {tokens} tokens:\n{reports['force'][0]}\nmax |force - plain| = {diff}",
          flush=True)
    return dict(table=reports["force"][0], plain_vs_force=diff, mat2_copied="mat2" in lowering._WARNED)


def _reduce_overhead_rank(rank, world):
    """``mode="reduce-overhead"``: CUDA-graph trees capture the ops (the split cached in the
    workspace at the warm-up call); replays on new ids against eager."""
    from torch._dynamo.utils import counters

    from weavepass.runtime.cuda import matmul as lowering

    device = rank_device(rank)
    model = build_tp_model(CFG, rank, world, dist.group.WORLD, device=device)
    backend = weavepass.make_backend(weavepass.WeaveConfig(split="off", cuda_min_tokens=1, gemm_epilogue="force"))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, mode="reduce-overhead")
    counters.clear()
    worst = check_replays_match_eager(compiled, model, CFG, 301, 5, device)
    assert backend.report.graphs[0].ops_after.get(OP, 0) == MATMUL_SITES
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    assert not _fallbacks(lowering), lowering._WARNED
    print(f"[gemm_op] rank {rank} reduce-overhead: worst max abs error {worst}", flush=True)
    return worst


CASES = {
    "test_ops_on_real_ranks": Case(_ops_rank),
    "test_reference_model_with_the_gemm_epilogue[301]": Case(_model_rank, (301,)),
    "test_reference_model_with_the_gemm_epilogue[1024]": Case(_model_rank, (1024,)),
    "test_reference_model_with_the_gemm_epilogue_under_reduce_overhead": Case(_reduce_overhead_rank),
}
gpu_ranks, case_result = shared_ranks(CASES, WORLD)


@needs_gpus(WORLD)
def test_ops_on_real_ranks(case_result):
    by_rank = case_result
    for cells in zip(*by_rank, strict=True):  # every rank's full-stream rows, equal to the bit
        assert all(torch.equal(c[2], cells[0][2]) and torch.equal(c[3], cells[0][3]) for c in cells), cells[0][:2]


@needs_gpus(WORLD)
@pytest.mark.parametrize("tokens", [301, 1024])
def test_reference_model_with_the_gemm_epilogue(case_result, tokens):
    for result in case_result:
        print(result["table"], "\nmax |force - plain fused op| =", result["plain_vs_force"],
              "mat2 copied per call:", result["mat2_copied"])


@needs_gpus(WORLD)
def test_reference_model_with_the_gemm_epilogue_under_reduce_overhead(case_result):
    assert len(case_result) == WORLD  # each rank checked its replays against eager
    print("worst max abs error per rank:", case_result)

