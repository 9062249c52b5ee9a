"""The persistent Triton GEMM, its scatter epilogue and the owners' reduce (``runtime.cuda.gemm``) on one
GPU at real sizes: the GEMM against ``torch.mm`` and the fp32 reference through both load paths
(tensor descriptors where supported, pointers), then 2, 4 and 8 ranks simulated on the GPU
(``testing.gemm_sim``: every rank's GEMM, then every rank's reduce, one stream per rank, so reduces
wait on other ranks' signals for real), bf16 and fp16, ragged splits, back-to-back calls; and one
call captured in a CUDA graph and replayed.

Each test runs in a process of its own (``_in_child``; the plain GEMM's cases share one): a kernel
fault leaves its process's CUDA context failed, which failed every later test of the first H200 run
with the graph test's illegal address and hid whether the others worked.
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys

import pytest
import torch

from weavepass.runtime.reference import fused_allreduce_rmsnorm_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

EPS = 1e-6
ULP = {torch.bfloat16: 2**-7, torch.float16: 2**-10}
"""One ulp relative to the value (upper bound): the GEMM and its reference both round an fp32
accumulation once, so they differ by at most one ulp where the fp32 sums straddle a rounding boundary."""
GEMM_ATOL = 1e-3
"""Values near 0: the fp32 summation orders differ by a random walk of ~sqrt(K) * 2^-24 * |partial
sums| (~1e-5 at these sizes), far below this."""
RESIDUAL_TOL = {torch.bfloat16: (2**-7, 1e-5), torch.float16: (2**-10, 1e-5)}
NORMED_TOL = {torch.bfloat16: (2**-6, 2**-6), torch.float16: (2**-9, 2**-9)}
"""As tests/gpu/test_kernel_sim_one_gpu.py: one final rounding of residual_out; normed 2 ulp."""


@pytest.fixture(autouse=True)
def _full_precision_cublas():
    """cuBLAS may reduce split-K partials in bf16/fp16 by default; the comparison needs fp32 sums."""
    saved = (torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
             torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction)
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    yield
    (torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
     torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction) = saved


CHILD_ENV = "WEAVE_GEMM_TEST_CHILD"
"""Set in a child process to the node id (or the test function's id, for a group) it runs."""
CHILD_TIMEOUT_S = 300  # CUDA start-up, compiles from a cold cache, three calls at 8 ranks
_CHILD_OUTPUT: dict[str, str] = {}


def _in_child(request, group: bool = False) -> bool:
    """Run this test in a fresh process and return True here, where the child's verdict is checked;
    return False in the child, where the test body runs. A kernel fault (an illegal address, a trap
    after a bounded wait) leaves the CUDA context of its process failed for good, so one fault would
    fail every later test of the process. ``group``: every case of this test function runs in one
    child (started by the first case here), so a fault can fail only the cases of that function.
    The child's pytest must report this node PASSED (a skip, an error or a crash there fails here;
    the cases of a group that passed before a crash still count)."""
    node = request.node.nodeid
    target = node.split("[")[0] if group else node
    if os.environ.get(CHILD_ENV) == target:
        return False
    if target not in _CHILD_OUTPUT:
        try:
            done = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", target],
                                  cwd=request.config.rootpath, env=dict(os.environ, **{CHILD_ENV: target}),
                                  capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, check=False)
            output = done.stdout + done.stderr
        except subprocess.TimeoutExpired as timeout:
            output = "".join(part.decode(errors="replace") if isinstance(part, bytes) else part or ""
                             for part in (timeout.stdout, timeout.stderr))
            output += f"\n(the child ran past {CHILD_TIMEOUT_S} s and was killed)"
        _CHILD_OUTPUT[target] = output
    output = _CHILD_OUTPUT[target]
    passed = re.search(rf"^{re.escape(node)} PASSED\b", output, re.MULTILINE) is not None
    assert passed, f"{node} did not pass in its child process; its output:\n{output[-8000:]}"
    return True


def _paths():
    from weavepass.runtime.cuda.gemm import descriptor_unsupported_reason

    if not torch.cuda.is_available():  # collected without CUDA: the module's skipif skips every case
        return [False, True]
    probe = torch.empty(16, 16, dtype=torch.bfloat16, device="cuda")
    why = descriptor_unsupported_reason(probe, probe)
    return [False, pytest.param(True, marks=pytest.mark.skipif(why is not None, reason=str(why)))]


def _draw(gen, rows, cols, dtype, scale=1.0):
    return (torch.randn(rows, cols, generator=gen, device="cuda") * scale).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("use_descriptors", _paths(), ids=["pointers", "descriptors"])
@pytest.mark.parametrize("m, n, k", [(1000, 8192, 1024), (4096, 4096, 7168), (77, 7168, 8192)])
def test_gemm_matches_torch_mm(m, n, k, use_descriptors, dtype, request):
    if _in_child(request, group=True):
        return
    from weavepass.runtime.cuda.gemm import matmul

    gen = torch.Generator(device="cuda").manual_seed(m + n + k)
    x, w = _draw(gen, m, k, dtype), _draw(gen, n, k, dtype, scale=k**-0.5)
    got = matmul(x, w, use_descriptors=use_descriptors)
    reference = x.float() @ w.float().T  # fp32 (TF32 is off for fp32 matmuls by default)
    torch.testing.assert_close(got.float(), reference, rtol=ULP[dtype], atol=GEMM_ATOL)
    torch.testing.assert_close(got, torch.mm(x, w.T), rtol=ULP[dtype], atol=GEMM_ATOL)


def test_every_gpu_config_matches_torch_mm(request):
    """Every tiling ``gemm.tune`` may pick (``gemm.GPU_CONFIGS``: flattened or not, TMA or pointer
    stores, the epilogue in slices), bf16, through the descriptor loads where supported, at a size
    that is not a multiple of any tile; the output poisoned first (a slice never stored stays NaN).
    A config that does not compile or fit on this GPU fails here: ``tune`` would skip it silently."""
    if _in_child(request):
        return
    from weavepass.runtime.cuda.gemm import GPU_CONFIGS, descriptor_unsupported_reason, matmul

    gen = torch.Generator(device="cuda").manual_seed(7)
    m, n, k = 1000, 1280 + 48, 1024 + 32
    x, w = _draw(gen, m, k, torch.bfloat16), _draw(gen, n, k, torch.bfloat16, scale=k**-0.5)
    reference = x.float() @ w.float().T
    use_descriptors = descriptor_unsupported_reason(x, w) is None
    for config in GPU_CONFIGS:
        got = matmul(x, w, out=torch.full((m, n), float("nan"), dtype=x.dtype, device="cuda"), config=config,
                     use_descriptors=use_descriptors)
        torch.testing.assert_close(got.float(), reference, rtol=ULP[torch.bfloat16], atol=GEMM_ATOL,
                                   msg=lambda e, c=config: f"{c.label()}: {e}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("world", [2, 4, 8])
def test_scatter_and_reduce_simulated(world, dtype, request):
    """An o_proj-sized GEMM (70b_tp8: N 8192, K 1024 per rank) of 4100 tokens (not a multiple of the
    world, the tile or the signal block): a sequential warm-up call (compiles and loads every rank's
    kernels before any rank waits), then the fused op's split and a ragged split (owners of no rows
    at world 4 and 8), each rank on its own stream. bf16 through the descriptor loads where supported, fp16
    through the pointer loads (both paths for both dtypes: test_gemm_matches_torch_mm)."""
    if _in_child(request):
        return
    _scatter_and_reduce(world, dtype, one_allocation=False)


@pytest.mark.parametrize("world", [2, 8])
def test_scatter_tma_stores_simulated(world, request):
    """``test_scatter_and_reduce_simulated``'s calls (bf16) with every rank's staging in one
    allocation, so the scatter stores through one tensor descriptor (TMA) with the deferred signals,
    which wait for those asynchronous stores before releasing (``gemm_kernels._release_owners``)."""
    if _in_child(request):
        return
    _scatter_and_reduce(world, torch.bfloat16, one_allocation=True)


def _scatter_and_reduce(world: int, dtype: torch.dtype, one_allocation: bool) -> None:
    from weavepass.runtime.cuda.gemm import (
        DEFAULT_GPU_CONFIG,
        STAGING_SLOTS,
        descriptor_unsupported_reason,
        matmul,
        owner_row_starts,
        scatter_store_reason,
    )
    from weavepass.testing.gemm_sim import SimulatedScatterRanks

    tokens, hidden, k = 4100, 8192, 1024
    ragged = [tokens // 2 - 3] + [0] * (world - 2) + [tokens - (tokens // 2 - 3)]  # zeros from world 3 on
    splits = [None, None, ragged]
    capacity = max(b - a for c in splits for a, b in itertools.pairwise(owner_row_starts(tokens, world, c)))
    if one_allocation:
        capacity = -(-capacity // DEFAULT_GPU_CONFIG.block_m) * DEFAULT_GPU_CONFIG.block_m
    sim = SimulatedScatterRanks(world, hidden, capacity, dtype, one_allocation=one_allocation)
    if one_allocation:
        why = scatter_store_reason(sim.workspaces[0], DEFAULT_GPU_CONFIG, True, True)
        assert why is None, why
    gen = torch.Generator(device="cuda").manual_seed(world)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen, device="cuda")).to(dtype)
    for call, counts in enumerate(splits):
        xs = [_draw(gen, tokens, k, dtype) for _ in range(world)]
        ws = [_draw(gen, hidden, k, dtype, scale=k**-0.5) for _ in range(world)]
        residual = _draw(gen, tokens, hidden, dtype)
        desc = dtype == torch.bfloat16 and descriptor_unsupported_reason(xs[0], ws[0]) is None
        run = sim.run if call else sim.warm_up
        outputs = run(xs, ws, residual, weight, EPS, counts, use_descriptors=desc)
        torch.cuda.synchronize()
        starts = owner_row_starts(tokens, world, counts)
        slot = int(sim.pads[0][0]) % STAGING_SLOTS
        plain = [matmul(xs[s], ws[s], use_descriptors=desc) for s in range(world)]
        label = f"world {world} call {call} counts {counts}"
        for j, (normed, res_out) in enumerate(outputs):
            rows = slice(starts[j], starts[j + 1])
            staged = [sim.workspaces[j].staged(s, starts[j + 1] - starts[j], slot) for s in range(world)]
            for s in range(world):
                # The GEMM: expected equal to the bit (the same K order); an ulp allowed. A routing
                # error shows as another owner's rows or the NaN poison.
                torch.testing.assert_close(staged[s], plain[s][rows], rtol=ULP[dtype], atol=0,
                                           msg=lambda e: f"{label}: owner {j} src {s}: {e}")
            # The owner's reduce, against the fp32 reference of the partials it was given (what the
            # GEMM staged, checked just above): one rounding of residual_out, as the fused op's
            # tests. Against torch.mm's partials, each staged partial's ulp would add up over N
            # sources (8 ranks, bf16: 1 element of 4.2 M off by 1.06 % against 0.78 %, on one H200).
            want_normed, want_res = fused_allreduce_rmsnorm_reference(staged, residual[rows], weight, EPS, dtype)
            rtol, atol = RESIDUAL_TOL[dtype]
            torch.testing.assert_close(res_out, want_res, rtol=rtol, atol=atol,
                                       msg=lambda e: f"{label}: owner {j} residual_out: {e}")
            rtol, atol = NORMED_TOL[dtype]
            torch.testing.assert_close(normed, want_normed, rtol=rtol, atol=atol,
                                       msg=lambda e: f"{label}: owner {j} normed: {e}")
        assert sim.counts_clear(), label
        assert sim.sequence_numbers() == [[call + 1, 0, call + 1, 0]] * world, (label, sim.sequence_numbers())


def test_scatter_and_reduce_replay_in_a_cuda_graph(request):
    """The call captured once (4 ranks, bf16, one stream: every GEMM, then every reduce) and replayed
    with new inputs: each replay must give that replay's answer, with the pads' call numbers (read by
    the kernels, never by the host) advancing by one per replay and the tile counters back to 0. The
    first H200 run failed here with an illegal address; the cause found by reading: the split's
    device table, a kernel argument of the captured GEMMs, was freed when graph_call returned (now
    held by the CapturedCall)."""
    if _in_child(request):
        return
    from weavepass.runtime.cuda.gemm import (
        descriptor_unsupported_reason,
        matmul,
        owner_row_starts,
    )
    from weavepass.testing.gemm_sim import SimulatedScatterRanks

    world, tokens, hidden, k, dtype = 4, 1030, 4096, 512, torch.bfloat16
    starts = owner_row_starts(tokens, world)
    sim = SimulatedScatterRanks(world, hidden, starts[1], dtype)
    gen = torch.Generator(device="cuda").manual_seed(7)
    xs = [_draw(gen, tokens, k, dtype) for _ in range(world)]
    ws = [_draw(gen, hidden, k, dtype, scale=k**-0.5) for _ in range(world)]
    residual = _draw(gen, tokens, hidden, dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen, device="cuda")).to(dtype)
    desc = descriptor_unsupported_reason(xs[0], ws[0]) is None
    captured = sim.graph_call(xs, ws, residual, weight, EPS, use_descriptors=desc)
    for replay in range(1, 4):
        for t in (*xs, residual):
            t.copy_(_draw(gen, *t.shape, dtype))
        for t in ws:
            t.copy_(_draw(gen, *t.shape, dtype, scale=k**-0.5))
        # Junk into freed small blocks (2 MiB of 512-byte ones, the tables' size class): a split table
        # the graph still addressed but nobody held would most likely read -2^30 now (no tiles, so the
        # reduces' bounded waits give up with weave's message) instead of its old values by luck.
        junk = [torch.full((128,), -(2**30), dtype=torch.int32, device="cuda") for _ in range(4096)]
        captured.replay()
        del junk
        torch.cuda.synchronize()
        plain = [matmul(xs[s], ws[s], use_descriptors=desc) for s in range(world)]
        want_normed, want_res = fused_allreduce_rmsnorm_reference(plain, residual, weight, EPS, dtype)
        for j, (normed, res_out) in enumerate(captured.outputs):
            rows = slice(starts[j], starts[j + 1])
            rtol, atol = RESIDUAL_TOL[dtype]
            torch.testing.assert_close(res_out, want_res[rows], rtol=rtol, atol=atol,
                                       msg=lambda e: f"replay {replay} owner {j} residual_out: {e}")
            rtol, atol = NORMED_TOL[dtype]
            torch.testing.assert_close(normed, want_normed[rows], rtol=rtol, atol=atol,
                                       msg=lambda e: f"replay {replay} owner {j} normed: {e}")
        assert sim.sequence_numbers() == [[1 + replay, 0, 1 + replay, 0]] * world, sim.sequence_numbers()
        assert sim.counts_clear()
