"""The ``cuda_symm`` lowering against the fp32 reference, one process per GPU (NCCL; 2 ranks, or
``WEAVE_GPU_WORLD`` / ``--gpu-world``).

Every rank draws every rank's partial sums from one seed, so each can compute the reference alone.
Before each call the symmetric workspace and the blocks the outputs will be carved from are filled
with NaN, so a row the kernel forgets to write fails the comparison. One spawned group of ranks runs
every case (gpu_cases.py); each test asserts on its own case's result.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from gpu_cases import Case, gpu_world, needs_gpus, shared_ranks  # tests/gpu/gpu_cases.py

from weavepass.runtime.reference import fused_allreduce_rmsnorm_reference

WORLD = gpu_world()
EPS = 1e-6
TOKENS = (1, 2, 3, 127, 1024, 4097, 16384)
HIDDENS = (128, 4096, 8192)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# (rtol, atol) for residual_out, by dtype. The kernel sums the partials in fp32 in the reference's
# order, rounds the sum to the dtype, adds the residual in fp32 and rounds again, as the reference
# does, so the two can differ by at most one final rounding step (bf16 2^-7, fp16 2^-10 relative);
# fp32 allows for FMA contraction.
RESIDUAL_TOL = {
    torch.bfloat16: (2**-7, 1e-5),
    torch.float16: (2**-10, 1e-5),
    torch.float32: (1e-6, 1e-6),
}
# (rtol, atol) for normed, by out_dtype. rsqrt.approx and a different sum-of-squares order move the
# fp32 value by ~1e-6 relative, which can flip the last rounding of a bf16/fp16 output (2 ulp margin:
# bf16 2^-6, fp16 2^-9); fp32 outputs keep that ~1e-6 error, values are O(1).
NORMED_TOL = {
    torch.bfloat16: (2**-6, 2**-6),
    torch.float16: (2**-9, 2**-9),
    torch.float32: (2e-5, 2e-5),
}

pytestmark = [pytest.mark.gpu, needs_gpus(WORLD)]


# ---------------------------------------------------------------- helpers run inside the ranks


def _make_inputs(seed, tokens, hidden, dtype, with_residual, world):
    gen = torch.Generator(device="cuda")
    gen.manual_seed(seed)

    def draw(*shape):
        return torch.randn(*shape, generator=gen, device="cuda")

    partials = [draw(tokens, hidden).to(dtype) for _ in range(world)]
    residual = draw(tokens, hidden).to(dtype) if with_residual else None
    weight = (1 + 0.1 * draw(hidden)).to(dtype)
    return partials, residual, weight


def _poison(tokens, hidden, dtype, out_dtype):
    """NaN into the local workspace and into the freed blocks the outputs will reuse."""
    from weavepass.runtime.cuda.workspace import _WORKSPACES

    torch.cuda.synchronize()
    dist.barrier()  # no peer is still writing into our workspace
    for workspaces in _WORKSPACES.values():
        for ws in workspaces:  # not the Lamport region: it must hold "empty" (-0.0) between calls
            ws.buffer[: ws.lamport_offset].fill_(float("nan"))
    blocks = [
        torch.full((tokens, hidden), float("nan"), dtype=out_dtype, device="cuda"),
        torch.full((tokens, hidden), float("nan"), dtype=dtype, device="cuda"),
    ]
    del blocks  # back to the caching allocator, which hands them to the next same-size request
    torch.cuda.synchronize()
    dist.barrier()  # no peer pushes into us before the poison landed


def _compare(label, got, want, tol):
    rtol, atol = tol
    try:
        torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol)
    except AssertionError as err:
        return [f"{label}: {str(err).splitlines()[0:4]}"]
    return []


def _same_on_all_ranks(label, tensor):
    """Every rank must hold bit-identical outputs (they feed the next layer on every rank)."""
    mine = tensor.contiguous().view(torch.uint8)
    first = mine.clone()
    dist.broadcast(first, src=0)
    return [] if torch.equal(mine, first) else [f"{label}: differs from rank 0"]


def _check_call(rank, world, seed, tokens, hidden, dtype, with_residual, out_dtype, with_weight=True,
                **kwargs):
    from weavepass.runtime.cuda.dispatch import fused_allreduce_rmsnorm_cuda

    partials, residual, weight = _make_inputs(seed, tokens, hidden, dtype, with_residual, world)
    weight = weight if with_weight else None  # a norm without scale
    want_normed, want_res = fused_allreduce_rmsnorm_reference(partials, residual, weight, EPS, out_dtype)
    _poison(tokens, hidden, dtype, out_dtype)
    group = dist.group.WORLD.group_name
    normed, res_out = fused_allreduce_rmsnorm_cuda(
        partials[rank], residual, weight, EPS, group, out_dtype, **kwargs
    )
    label = f"T={tokens} H={hidden} {dtype} residual={with_residual} weight={with_weight} out={out_dtype} {kwargs}"
    errors = _compare(label + " residual_out", res_out, want_res, RESIDUAL_TOL[dtype])
    errors += _compare(label + " normed", normed, want_normed, NORMED_TOL[out_dtype])
    assert normed.dtype == out_dtype and res_out.dtype == dtype
    errors += _same_on_all_ranks(label + " normed", normed)
    errors += _same_on_all_ranks(label + " residual_out", res_out)
    return errors


def _matches_reference_worker(rank, world, dtype):
    errors, cases = [], 0
    for tokens in TOKENS:
        for hidden in HIDDENS:
            for with_residual in (True, False):
                seed = 1000 * tokens + hidden + with_residual
                errors += _check_call(rank, world, seed, tokens, hidden, dtype, with_residual, dtype)
                cases += 1
    if dtype == torch.bfloat16:  # normed in another dtype than the residual stream
        for tokens in (3, 1024):
            errors += _check_call(rank, world, 7 + tokens, tokens, 4096, dtype, True, torch.float32)
            errors += _check_call(rank, world, 9 + tokens, tokens, 4096, dtype, True, dtype, with_weight=False)
            cases += 2
    for tokens, hidden in ((4097, 8192), (1024, 4096)):  # the pipelined kernel, forced, every dtype
        for ctas in (16, 32):
            errors += _check_call(rank, world, 11 * tokens + ctas, tokens, hidden, dtype, True, dtype,
                                  num_ctas=ctas, pipelined=True)
            cases += 1
    assert not errors, "\n".join(errors)
    return cases


def _modes_worker(rank, world):
    """Every kernel (one-shot, flat two-shot, pipelined two-shot with 1 and 2 tiles per chunk) and
    every CTA count of the rule's range on odd shapes, including CTAs with no rows and CTAs with many
    chunks (1000 tokens)."""
    errors = []
    kernels = (
        dict(one_shot=True),
        dict(one_shot=False, pipelined=False),
        dict(one_shot=False, pipelined=True),
        dict(one_shot=False, pipelined=True, chunk_tiles=1),
        dict(lamport=True),
    )
    for kernel in kernels:
        for ctas in (2, 3, 16, 32):
            for tokens in (1, 5, 129, 1000):
                # Lamport: peers needed, and 127 x 1032 bf16 rows fill its 256 KiB slot
                if kernel.get("lamport") and (world == 1 or tokens > 127):
                    continue
                errors += _check_call(
                    rank, world, 31 * tokens + ctas, tokens, 1032, torch.bfloat16, True,
                    torch.bfloat16, num_ctas=ctas, **kernel,
                )
    assert not errors, "\n".join(errors)


def _back_to_back_worker(rank, world, calls, batch):
    """``calls`` calls on fresh data, ``batch`` of them in flight between host syncs, each checked.
    Sizes, CTA counts and kernels (flat and pipelined two-shot, one-shot) change from call to call,
    so the row-to-CTA mapping and the signal protocol keep changing."""
    from weavepass.runtime.cuda.dispatch import fused_allreduce_rmsnorm_cuda

    group = dist.group.WORLD.group_name
    sizes = (1, 127, 1024, 4097, 33, 2048, 8)
    hidden, dtype = 4096, torch.bfloat16
    errors = []
    for start in range(0, calls, batch):
        inputs, outputs = [], []
        for i in range(start, min(start + batch, calls)):
            tokens = sizes[i % len(sizes)]
            inputs.append((tokens, _make_inputs(i, tokens, hidden, dtype, True, world)))
        for i, (tokens, (partials, residual, weight)) in enumerate(inputs):
            ctas = (2, 8, 16, 32, None)[(start + i) % 5]
            pipelined = (None, True, False)[(start + i) % 3]
            # Lamport on some small calls, between the barrier one-shot ones (it needs peers)
            lamport = True if world > 1 and tokens <= 8 and (start + i) % 2 else None
            outputs.append(fused_allreduce_rmsnorm_cuda(
                partials[rank], residual, weight, EPS, group, dtype, num_ctas=ctas, pipelined=pipelined,
                lamport=lamport,
            ))
        for i, ((tokens, (partials, residual, weight)), (normed, res_out)) in enumerate(
            zip(inputs, outputs)
        ):
            want_normed, want_res = fused_allreduce_rmsnorm_reference(partials, residual, weight, EPS, dtype)
            errors += _compare(f"call {start + i} T={tokens} residual_out", res_out, want_res, RESIDUAL_TOL[dtype])
            errors += _compare(f"call {start + i} T={tokens} normed", normed, want_normed, NORMED_TOL[dtype])
    assert not errors, "\n".join(errors[:20])
    return calls


def _cuda_graph_worker(rank, world):
    """Four consecutive layers (a chained residual stream, decode and prefill sizes, every kernel)
    captured once and replayed on new data."""
    from weavepass.runtime.cuda.dispatch import fused_allreduce_rmsnorm_cuda

    group = dist.group.WORLD.group_name
    hidden, dtype = 4096, torch.bfloat16
    # flat two-shot, flat, one-shot, Lamport one-shot twice (forced: its call counter must alternate
    # inside the graph and across replays), pipelined two-shot (forced)
    layer_tokens = (1024, 1024, 8, 8, 8, 4096)
    lamport_layers = (3, 4)
    static = [_make_inputs(i, t, hidden, dtype, True, world) for i, t in enumerate(layer_tokens)]

    def layers():
        outs = []
        for i, (partials, residual, weight) in enumerate(static):
            if i > 0 and layer_tokens[i] == layer_tokens[i - 1]:
                residual = outs[-1][1]  # the residual stream carries on
            pipelined = True if i == len(layer_tokens) - 1 else None
            outs.append(fused_allreduce_rmsnorm_cuda(
                partials[rank], residual, weight, EPS, group, dtype, pipelined=pipelined,
                lamport=True if i in lamport_layers and world > 1 else None,  # needs peers
            ))
        return outs

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        layers()  # compiles the kernels and allocates the workspace outside capture
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    dist.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = layers()

    errors = []
    for replay in range(3):
        for i, t in enumerate(layer_tokens):
            fresh = _make_inputs(100 * replay + i, t, hidden, dtype, True, world)
            for dst, src in zip(static[i][0], fresh[0]):
                dst.copy_(src)
            static[i][1].copy_(fresh[1])
            static[i][2].copy_(fresh[2])
        _poison(1, 8, dtype, dtype)  # NaN into the workspace (outputs live in the graph's pool)
        for normed, res_out in outs:
            normed.fill_(float("nan"))
            res_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        residual = None
        for i, (partials, layer_residual, weight) in enumerate(static):
            if not (i > 0 and layer_tokens[i] == layer_tokens[i - 1]):
                residual = layer_residual
            want_normed, want_res = fused_allreduce_rmsnorm_reference(partials, residual, weight, EPS, dtype)
            label = f"replay {replay} layer {i}"
            errors += _compare(label + " residual_out", outs[i][1], want_res, RESIDUAL_TOL[dtype])
            errors += _compare(label + " normed", outs[i][0], want_normed, NORMED_TOL[dtype])
            residual = outs[i][1]
    assert not errors, "\n".join(errors)


def _fallback_worker(rank, world):
    """Batches over the workspace and unsupported hidden sizes run the portable lowering, correctly."""
    from weavepass.runtime.cuda.support import CudaIssue, cuda_unsupported_reason

    group = dist.group.WORLD.group_name
    errors = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        errors += _check_call(rank, world, 1, 1024, 1024, torch.bfloat16, True, torch.bfloat16,
                              max_workspace_tokens=64)
        errors += _check_call(rank, world, 2, 1024, 1024, torch.bfloat16, True, torch.bfloat16,
                              max_workspace_tokens=64)
        errors += _check_call(rank, world, 3, 17, 132, torch.float16, True, torch.float16)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert sum("workspace" in m for m in messages) == 1, messages  # warned once, not per call
    assert any("multiple of 8" in m for m in messages), messages  # rendering test: the fallback's warning
    x = torch.zeros(4, 132, device="cuda")
    odd = cuda_unsupported_reason(x, None, torch.ones(132, device="cuda"), group)
    assert odd.issue is CudaIssue.HIDDEN_NOT_MULTIPLE
    assert cuda_unsupported_reason(x.cpu(), None, torch.ones(132), group).issue is CudaIssue.NOT_ON_CUDA
    y = torch.zeros(4, 64, device="cuda", dtype=torch.bfloat16)
    assert cuda_unsupported_reason(y, y, torch.ones(64, device="cuda"), group) is None
    assert not errors, "\n".join(errors)


def _fp16_overflow_worker(rank, world):
    """An fp16 sum beyond 65504 is inf before the residual is added, as in eager (whose all_reduce
    returns fp16), even where the residual would bring it back into range; -inf residual: NaN."""
    from weavepass.runtime.cuda.dispatch import fused_allreduce_rmsnorm_cuda

    group = dist.group.WORLD.group_name
    partial = torch.full((4, 64), 40000.0 / world * 2, dtype=torch.float16, device="cuda")
    residual = torch.full((4, 64), -30000.0, dtype=torch.float16, device="cuda")
    residual[1] = float("-inf")
    partial[2:] = 1.0  # rows 2-3 stay in range: 2 + residual
    normed, res_out = fused_allreduce_rmsnorm_cuda(partial, residual, None, EPS, group, torch.float16)
    eager = (torch.ops._c10d_functional.wait_tensor(
        torch.ops._c10d_functional.all_reduce(partial, "sum", group)) + residual)
    assert torch.equal(res_out.isinf(), eager.isinf()) and torch.equal(res_out.isnan(), eager.isnan()), (
        res_out[:, 0], eager[:, 0])
    assert res_out[0].isinf().all() and res_out[1].isnan().all()
    torch.testing.assert_close(res_out[2:], eager[2:])
    return "PASS"


def _forced_kernels(world):
    """Launch overrides forcing each algorithm: one-shot, flat and pipelined two-shot, and the
    Lamport one-shot where there are peers."""
    kernels = [dict(one_shot=True), dict(one_shot=False, pipelined=False), dict(one_shot=False, pipelined=True)]
    return kernels + [dict(lamport=True)] if world > 1 else kernels


def _inverse_rms_worker(rank, world):
    """Training: every algorithm also returns the per-row inverse RMS ``[T, 1]`` fp32 (the rows a
    rank reduces and those it finalises from its peers), and the other outputs stay as they are."""
    from weavepass.runtime.cuda.dispatch import fused_allreduce_rmsnorm_cuda
    from weavepass.runtime.reference import accumulation_dtype, add_rmsnorm_local

    group = dist.group.WORLD.group_name
    kernels = _forced_kernels(world)
    errors, cases = [], 0
    for dtype in (torch.bfloat16, torch.float32):
        for kernel in kernels:
            for tokens in (3, 16, 1024):
                if kernel.get("lamport") and tokens * 4096 * torch.empty((), dtype=dtype).element_size() > 256 << 10:
                    continue
                partials, residual, weight = _make_inputs(tokens, tokens, 4096, dtype, True, world)
                summed = torch.stack([p.to(accumulation_dtype(dtype)) for p in partials]).sum(0)
                want = add_rmsnorm_local(summed, residual, weight, EPS, dtype, dtype, return_inv_rms=True)
                normed, res_out, inv_rms = fused_allreduce_rmsnorm_cuda(
                    partials[rank], residual, weight, EPS, group, dtype, return_inv_rms=True, num_ctas=16, **kernel)
                label = f"inv_rms T={tokens} {dtype} {kernel}"
                errors += _compare(label + " residual_out", res_out, want[1], RESIDUAL_TOL[dtype])
                errors += _compare(label + " normed", normed, want[0], NORMED_TOL[dtype])
                # fp32 either way: rsqrt.approx and the sum-of-squares order, ~1e-6 relative.
                errors += _compare(label, inv_rms, want[2], (2e-5, 0.0))
                assert inv_rms.shape == (tokens, 1) and inv_rms.dtype == torch.float32
                cases += 1
    assert not errors, "\n".join(errors)
    return cases


def _layer_norm_worker(rank, world):
    """``weave.fused_allreduce_layernorm``'s CUDA lowering: every algorithm with a LayerNorm, with
    and without bias, against the reference (tolerances as for RMSNorm: the mean's fp32 summation
    order adds an absolute error of ~1e-7 x |mean| / std on centred values, inside atol)."""
    from weavepass.runtime.cuda.dispatch import fused_allreduce_layernorm_cuda

    group = dist.group.WORLD.group_name
    kernels = _forced_kernels(world)
    errors, cases = [], 0
    for dtype in (torch.bfloat16, torch.float32):
        for kernel in kernels:
            for tokens in (3, 1024):
                if kernel.get("lamport") and tokens > 16:
                    continue
                for with_bias in (False, True):
                    partials, residual, weight = _make_inputs(tokens + with_bias, tokens, 4096, dtype, True, world)
                    partials = [p + 0.5 for p in partials]  # a non-zero mean to subtract
                    bias = (0.1 * torch.arange(4096, device="cuda") / 4096).to(dtype) if with_bias else None
                    want_normed, want_res = fused_allreduce_rmsnorm_reference(
                        partials, residual, weight, EPS, dtype, bias=bias, layer_norm=True)
                    normed, res_out = fused_allreduce_layernorm_cuda(
                        partials[rank], residual, weight, bias, EPS, group, dtype, num_ctas=16, **kernel)
                    label = f"LayerNorm T={tokens} {dtype} bias={with_bias} {kernel}"
                    errors += _compare(label + " residual_out", res_out, want_res, RESIDUAL_TOL[dtype])
                    errors += _compare(label + " normed", normed, want_normed, NORMED_TOL[dtype])
                    cases += 1
    assert not errors, "\n".join(errors)
    return cases


def small_case_worker(rank, world):
    """One decode-size and one prefill-size call (for compute-sanitizer runs)."""
    errors = _check_call(rank, world, 5, 127, 4096, torch.bfloat16, True, torch.bfloat16)
    errors += _check_call(rank, world, 6, 1024, 4096, torch.bfloat16, True, torch.bfloat16)
    assert not errors, "\n".join(errors)
    return "PASS"


# ---------------------------------------------------------------- tests


def _dtype_id(dtype) -> str:
    return str(dtype).removeprefix("torch.")


# Test name -> the case its ranks run; the fallback case last, so the warnings it counts are its own.
CASES = {
    **{f"test_matches_reference[{_dtype_id(d)}]": Case(_matches_reference_worker, (d,), 420) for d in DTYPES},
    "test_every_algorithm_and_cta_count": Case(_modes_worker),
    "test_back_to_back_calls_race_free": Case(_back_to_back_worker, (500, 10)),
    "test_cuda_graph_capture_and_replay": Case(_cuda_graph_worker),
    "test_fp16_overflow_as_in_eager": Case(_fp16_overflow_worker),
    "test_inverse_rms_for_training": Case(_inverse_rms_worker),
    "test_layer_norm": Case(_layer_norm_worker),
    "test_fallbacks_to_portable": Case(_fallback_worker),
}
gpu_ranks, case_result = shared_ranks(CASES, WORLD)


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_matches_reference(case_result, dtype):
    cases = case_result[0]
    assert cases == len(TOKENS) * len(HIDDENS) * 2 + (4 if dtype == torch.bfloat16 else 0) + 4


def test_inverse_rms_for_training(case_result):
    assert len(set(case_result)) == 1 and case_result[0] >= 18  # every rank, every case


def test_layer_norm(case_result):
    assert len(set(case_result)) == 1 and case_result[0] >= 24  # every rank, every case


# The workers below assert inside the ranks; here: every rank ran its case to the end.
def test_every_algorithm_and_cta_count(case_result):
    assert case_result == [None] * WORLD


def test_back_to_back_calls_race_free(case_result):
    assert case_result[0] == 500


def test_cuda_graph_capture_and_replay(case_result):
    assert case_result == [None] * WORLD


def test_fp16_overflow_as_in_eager(case_result):
    assert case_result == ["PASS"] * WORLD


def test_fallbacks_to_portable(case_result):
    assert case_result == [None] * WORLD


# ------------------------------------------ a stalled peer (its own ranks: it ends rank 0's CUDA context)


def _stalled_peer_worker(rank, world, timeout_s, stall_s):
    """Both ranks make one call (the workspace is made together), then every rank but 0 stalls
    while rank 0 calls again: its kernel must give up after ``timeout_s`` (``WEAVE_PEER_TIMEOUT_S``,
    read when the workspace is made), stop the GPU and leave weave's message."""
    import os
    import time

    os.environ["WEAVE_PEER_TIMEOUT_S"] = str(timeout_s)
    from weavepass.runtime.cuda import peer_wait
    from weavepass.runtime.cuda.dispatch import fused_allreduce_rmsnorm_cuda

    group = dist.group.WORLD.group_name
    x = torch.randn(64, 1024, device="cuda").to(torch.bfloat16)
    w = torch.ones(1024, device="cuda", dtype=torch.bfloat16)
    fused_allreduce_rmsnorm_cuda(x, x, w, EPS, group, torch.bfloat16)
    torch.cuda.synchronize()
    dist.barrier()
    if rank != 0:
        time.sleep(stall_s)
        return None
    start = time.monotonic()
    try:
        fused_allreduce_rmsnorm_cuda(x, x, w, EPS, group, torch.bfloat16)
        torch.cuda.synchronize()
    except Exception as error:  # noqa: BLE001 (the CUDA error the trap leaves)
        return str(error).splitlines()[0], peer_wait.describe(peer_wait._RECORD), time.monotonic() - start
    return "finished without its peers", None, time.monotonic() - start


def test_a_stalled_peer_stops_the_kernel_with_the_reason():
    """A peer that stops calling (alive, stalled): rank 0's kernel gives up after 3 s instead of
    spinning for ever (before the bounded waits it never returned), its process's next CUDA call
    raises, and weave's message names the ranks and the wait (runtime.cuda.peer_wait)."""
    from weavepass.testing.distributed import spawn

    timeout_s, stall_s = 3, 25
    results = spawn(_stalled_peer_worker, WORLD, "nccl", timeout_s, stall_s, timeout_s=240, allow_shared_gpu=True)
    error, message, elapsed = results[0]
    assert "CUDA error" in error, error
    assert message is not None and f"rank 0 of a {WORLD}-rank group waited {timeout_s} s for rank " in message, message
    assert timeout_s * 0.9 <= elapsed < stall_s, elapsed  # it gave up, and before the peer could have come back
    assert results[1:] == [None] * (WORLD - 1)
