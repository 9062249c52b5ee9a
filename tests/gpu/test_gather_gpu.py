"""The gather prologue (``runtime.cuda.gather``: the owners' push and the gather GEMM) on one GPU at
real sizes: 2, 4 and 8 ranks simulated (``testing.gemm_sim.SimulatedGatherRanks``: one stream per
rank, so a GEMM really waits for the owners' flags), bf16 and fp16, ragged splits, q/k/v-like weights
in one call; the launch orders (every push first, and rank by rank); one call captured in a CUDA
graph and replayed; and an owner that never pushes (the bounded wait gives up with its site code).

Tolerances: each output against the fp32 product of the same rows (``ULP`` / ``GEMM_ATOL``,
tests/gpu/test_gemm_gpu.py's: one rounding of an fp32 accumulation), and every rank's output equal to
rank 0's to the bit (the same rows, weights and K order; only the tile order differs). Each test runs
in a child process (``_in_child``): a kernel fault fails the CUDA context of its process for good.
The op ``weave.all_gather_matmul`` on ``cuda_symm`` runs on real ranks (2 GPUs, or 2 processes
sharing one with ``WEAVE_GPU_SHARED=1``): FlashComm's shards, both dtypes, 1 to 1030 tokens, two
weights, no fallback to the portable lowering, every rank equal to the bit.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from gpu_cases import Case, needs_gpus, shared_ranks  # tests/gpu/gpu_cases.py
from test_gemm_gpu import GEMM_ATOL, ULP, _draw, _in_child  # tests/gpu/test_gemm_gpu.py

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

HIDDEN = 8192  # K: 70b's hidden size
OUTS = (1024, 128, 128)  # q, k, v of 70b_tp8 (64 heads, 8 kv heads, head 128, over 8 ranks)
TOKENS = 4100  # no multiple of 8 ranks, of 16 or of the 128-row tile


def _splits(world: int) -> list[list[int] | None]:
    """The fused op's split (default), FlashComm's (``ceil(T / 16N) * 16`` each, the last fewer) and a
    ragged one with owners of no rows from world 3 on."""
    per = -(-TOKENS // (16 * world)) * 16
    flashcomm = [max(0, min(per, TOKENS - j * per)) for j in range(world)]
    ragged = [TOKENS // 2 - 3] + [0] * (world - 2) + [TOKENS - (TOKENS // 2 - 3)]
    return [None, flashcomm, ragged]


def _check(outputs, rows, weights, dtype, label):
    for i, w in enumerate(weights):
        want = rows.float() @ w.float().T
        for r, out in enumerate(outputs):
            torch.testing.assert_close(out[i].float(), want, rtol=ULP[dtype], atol=GEMM_ATOL,
                                       msg=lambda e: f"{label} w{i} rank {r}: {e}")
            assert torch.equal(out[i], outputs[0][i]), f"{label}: rank {r} differs from rank 0 (w{i})"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("world", [2, 4, 8], ids=["world2", "world4", "world8"])
def test_gather_simulated(world, dtype, request):
    """A sequential warm-up call (loads every kernel before any rank waits), then the three splits with
    every push launched first, then rank by rank (a GEMM launched before its peers' pushes; the GEMMs'
    grids leave SMs for them). bf16 through the descriptor loads where supported, fp16 through
    pointers."""
    if _in_child(request):
        return
    from weavepass.runtime.cuda.gemm import _sm_count, descriptor_unsupported_reason, owner_row_starts
    from weavepass.testing.gemm_sim import SimulatedGatherRanks

    capacity = max(b - a for c in _splits(world) for a, b in itertools.pairwise(owner_row_starts(TOKENS, world, c)))
    sim = SimulatedGatherRanks(world, HIDDEN, capacity, dtype)
    gen = torch.Generator(device="cuda").manual_seed(world)
    weights = [_draw(gen, n, HIDDEN, dtype, scale=HIDDEN**-0.5) for n in OUTS]
    desc = dtype == torch.bfloat16 and descriptor_unsupported_reason(weights[0], weights[0]) is None
    calls = [(None, True, False)] + [(c, False, False) for c in _splits(world)] + [(_splits(world)[1], False, True)]
    for call, (counts, one_stream, interleaved) in enumerate(calls, start=1):
        starts = owner_row_starts(TOKENS, world, counts)
        rows = _draw(gen, TOKENS, HIDDEN, dtype)
        shards = [torch.cat([rows[starts[r]:starts[r + 1]], torch.zeros(3, HIDDEN, dtype=dtype, device="cuda")])
                  for r in range(world)]  # padding rows after each owner's: never pushed
        counts = [b - a for a, b in itertools.pairwise(starts)]
        ctas = max(1, _sm_count(0) // (world + 1)) if interleaved else None
        outputs = sim.run(shards, weights, counts, use_descriptors=desc, one_stream=one_stream,
                          interleaved=interleaved, gemm_ctas=ctas)
        torch.cuda.synchronize()
        _check(outputs, rows, weights, dtype, f"world {world} call {call} counts {counts}")
        assert sim.sequence_numbers() == [call] * world, sim.sequence_numbers()


def test_gather_replays_in_a_cuda_graph(request):
    """One call of 4 ranks captured (one stream: every push, then every GEMM) and replayed with new
    rows: each replay's answer, and GATHER_SEQ (read by the kernels, never by the host) advancing by
    one per replay. The split's table and the outputs are held here for the graph's life."""
    if _in_child(request):
        return
    from weavepass.runtime.cuda.gemm import OwnerRows, descriptor_unsupported_reason
    from weavepass.testing.gemm_sim import SimulatedGatherRanks

    world, tokens, dtype = 4, 1030, torch.bfloat16
    owners = OwnerRows.build(tokens, world, "cuda")
    sim = SimulatedGatherRanks(world, HIDDEN, owners.count(0), dtype)
    gen = torch.Generator(device="cuda").manual_seed(11)
    weights = [_draw(gen, n, HIDDEN, dtype, scale=HIDDEN**-0.5) for n in OUTS]
    shards = [_draw(gen, owners.count(r), HIDDEN, dtype) for r in range(world)]
    desc = descriptor_unsupported_reason(weights[0], weights[0]) is None
    sim.run(shards, weights, owners=owners, use_descriptors=desc, one_stream=True)  # compiles, loads: call 1
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = sim.run(shards, weights, owners=owners, use_descriptors=desc, one_stream=True)
    for replay in range(1, 4):
        for s in shards:
            s.copy_(_draw(gen, *s.shape, dtype))
        graph.replay()
        torch.cuda.synchronize()
        _check(outputs, torch.cat(shards), weights, dtype, f"replay {replay}")
        assert sim.sequence_numbers() == [1 + replay] * world, sim.sequence_numbers()


def test_an_owner_that_never_pushes_stops_the_gather_gemm():
    """Rank 1 never pushes: rank 0's gather GEMM gives up after 2 s with the wait site's words and
    the process fails (not a hang, not rows computed from the poison). 90 s for the whole process."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    from weavepass.runtime.cuda import peer_wait

    start = time.monotonic()
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("gather_wait_case.py"))],
                          capture_output=True, text=True, timeout=90, cwd=Path(__file__).parents[2])
    output = done.stdout + done.stderr
    assert done.returncode != 0 and "UNREACHED" not in output, output[-3000:]
    assert "weave: rank 0 of a 2-rank group waited 2 s for rank 1" in output, output[-3000:]
    assert peer_wait.SITES[11] in output, output[-3000:]
    assert time.monotonic() - start < 90


# ---------------------------------------------------------------- real ranks

WORLD = 2


def _op_rank(rank, world):
    """``weave.all_gather_matmul`` on ``cuda_symm`` as FlashComm's graph calls it: each rank's shard of
    ``R = ceil(T / 16N) * 16`` rows (its tokens, then zero padding), q- and kv-like weights (the same
    on every rank here), against the fp32 product of every token's rows; outputs returned for the
    cross-rank check."""
    from weavepass.runtime.cuda import gather_op
    from weavepass.testing.shared_gpu import rank_device

    device = rank_device(rank)
    group_name = dist.group.WORLD.group_name
    k, results = 1024, []
    for dtype in (torch.bfloat16, torch.float16):
        for tokens in (1, 7, 301, 1030):
            gen = torch.Generator(device=device).manual_seed(tokens)
            rows = _draw_on(gen, tokens, k, dtype, device)
            mat2s = [_draw_on(gen, n, k, dtype, device, scale=k**-0.5).t() for n in (512, 128)]
            per = -(-tokens // (16 * world)) * 16
            lo, hi = min(rank * per, tokens), min((rank + 1) * per, tokens)
            shard = torch.zeros(per, k, dtype=dtype, device=device)
            shard[: hi - lo] = rows[lo:hi]
            got = torch.ops.weave.all_gather_matmul(shard, mat2s, group_name, tokens, "cuda_symm", 16384)
            for i, (out, mat2) in enumerate(zip(got, mat2s, strict=True)):
                torch.testing.assert_close(out.float(), rows.float() @ mat2.float(), rtol=ULP[dtype], atol=GEMM_ATOL,
                                           msg=lambda e, i=i: f"rank {rank} {dtype} {tokens} tokens w{i}: {e}")
            results.append([out.cpu() for out in got])
            print(f"[gather_op] rank {rank} {dtype} {tokens} tokens: within tolerance", flush=True)
    assert not gather_op._WARNED, gather_op._WARNED  # no call fell back to the portable lowering
    return results


def _draw_on(gen, rows, cols, dtype, device, scale=1.0):
    return (torch.randn(rows, cols, generator=gen, device=device) * scale).to(dtype)


CASES = {"test_all_gather_matmul_on_real_ranks": Case(_op_rank)}
gpu_ranks, case_result = shared_ranks(CASES, WORLD)


@needs_gpus(WORLD)
def test_all_gather_matmul_on_real_ranks(case_result):
    for calls in zip(*case_result, strict=True):  # every rank's outputs of a call, equal to the bit
        assert all(torch.equal(a, b) for outs in calls for a, b in zip(outs, calls[0], strict=True))
