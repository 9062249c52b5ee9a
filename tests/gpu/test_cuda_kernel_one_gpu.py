"""The ``cuda_symm`` lowering on a group of one GPU: the launch path, not the communication.

With one rank the kernels have no peers (push, barriers and gather compile away), so what runs is
the host side (signature cache, workspace, launch plan, the cached direct launch) and the local
add + RMSNorm. That is what this file checks, on any machine with one GPU; the two-rank behaviour
is ``test_cuda_kernel.py``'s. The same workers serve both files, and as there one spawned rank
runs every case (gpu_cases.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from gpu_cases import Case, shared_ranks  # tests/gpu/gpu_cases.py
from test_cuda_kernel import (  # noqa: E402  (tests/gpu is on sys.path under pytest's rootdir-relative import)
    DTYPES,
    EPS,
    NORMED_TOL,
    RESIDUAL_TOL,
    _cuda_graph_worker,
    _dtype_id,
    _inverse_rms_worker,
    _layer_norm_worker,
    _make_inputs,
    _matches_reference_worker,
    _modes_worker,
)

from weavepass.runtime.reference import fused_allreduce_rmsnorm_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _direct_launch_worker(rank, world):
    """Triton's dispatch and the cached direct launch give bit-identical outputs, call after call,
    also when a call's pointers lose the 16-byte alignment the first call was compiled for."""
    from weavepass.runtime.cuda import dispatch as cuda_symm
    from weavepass.runtime.cuda import launcher

    group = dist.group.WORLD.group_name
    dtype = torch.bfloat16
    errors, launches = [], 0
    for tokens, hidden in ((1, 4096), (7, 8192), (1024, 8192), (3000, 1032)):
        partials, residual, weight = _make_inputs(tokens, tokens, hidden, dtype, True, world)
        want_normed, want_res = fused_allreduce_rmsnorm_reference(partials, residual, weight, EPS, dtype)
        # The same values at an address 2 bytes off 16-byte alignment.
        shifted = torch.empty(tokens * hidden + 1, dtype=dtype, device="cuda")[1:].view(tokens, hidden)
        shifted.copy_(partials[rank])
        assert shifted.data_ptr() % 16 != 0
        outputs = {}
        for label, partial, direct in (
            ("triton", partials[rank], False),
            ("direct", partials[rank], True),
            ("direct again", partials[rank], True),
            ("direct, unaligned partial", shifted, True),
            ("direct after unaligned", partials[rank], True),
        ):
            launcher.DIRECT_LAUNCH = direct
            try:
                outputs[label] = cuda_symm.fused_allreduce_rmsnorm_cuda(partial, residual, weight, EPS, group, dtype)
            finally:
                launcher.DIRECT_LAUNCH = True
            launches += 1
        launch = [v for k, v in cuda_symm._LAUNCHES.items() if k[0] == partials[rank].shape][0]
        if launch.compiled is None:
            errors.append(f"T={tokens} H={hidden}: the first launch recorded no compiled kernel")
        else:
            # The C launcher without Triton's Python wrapper (``_bare_launcher``): in use on the
            # Triton it was written for, and equal to the wrapper's launch.
            import triton

            bare = launch.bare is not launch.compiled.run
            if triton.__version__.startswith("3.6") and not bare:
                errors.append(f"T={tokens} H={hidden}: Triton {triton.__version__} launches through its wrapper")
            saved = launch.bare, launch.bare_fixed
            launch.bare, launch.bare_fixed = launch.compiled.run, ()
            try:
                outputs["direct, Triton's wrapper"] = cuda_symm.fused_allreduce_rmsnorm_cuda(
                    partials[rank], residual, weight, EPS, group, dtype)
            finally:
                launch.bare, launch.bare_fixed = saved
            launches += 1
        reference = outputs["triton"]
        for label, (normed, res_out) in outputs.items():
            if not (torch.equal(normed, reference[0]) and torch.equal(res_out, reference[1])):
                errors.append(f"T={tokens} H={hidden} {label}: differs from Triton's dispatch")
            for name, got, want, tol in (("residual_out", res_out, want_res, RESIDUAL_TOL[dtype]),
                                         ("normed", normed, want_normed, NORMED_TOL[dtype])):
                try:
                    torch.testing.assert_close(got.float(), want.float(), rtol=tol[0], atol=tol[1])
                except AssertionError as err:
                    errors.append(f"T={tokens} H={hidden} {label} {name}: {str(err).splitlines()[:3]}")
    assert not errors, "\n".join(errors)
    return launches


def _async_join_worker(rank, world):
    """The split's fork/join (``weave::fused_allreduce_rmsnorm_async`` + ``weave::join_async``) on
    one GPU, eager and in a CUDA graph. A sleep queued on the communication stream first holds the
    fused kernel back by ~10 ms, so a read of the outputs that is not ordered after it sees what the
    blocks held before: a control round without the join must see wrong values (the race is
    observable), and every round with the join the right ones (new inputs each round, so stale
    values from a previous round fail too). The join also empties the pending entries and returns
    both events to the pool."""
    from weavepass.ops import FUSED_ALLREDUCE_RMSNORM_ASYNC as ASYNC
    from weavepass.ops import JOIN_ASYNC as JOIN
    from weavepass.runtime import streams
    from weavepass.runtime.cuda.workspace import DEFAULT_WORKSPACE_TOKENS

    group = dist.group.WORLD.group_name
    dtype, tokens, hidden = torch.bfloat16, 512, 8192
    side = streams.comm_stream(torch.device("cuda", torch.cuda.current_device()))
    errors = []

    def call(partial, residual, weight):
        return ASYNC(partial, residual, weight, EPS, group, dtype, "cuda_symm", DEFAULT_WORKSPACE_TOKENS, 0)

    def check(label, got, want):
        for name, g, w, tol in (("normed", got[0], want[0], NORMED_TOL[dtype]),
                                ("residual_out", got[1], want[1], RESIDUAL_TOL[dtype])):
            try:
                torch.testing.assert_close(g.float(), w.float(), rtol=tol[0], atol=tol[1])
            except AssertionError as err:
                errors.append(f"{label} {name}: {str(err).splitlines()[:3]}")

    rounds = 0
    for joined in (False, True, True, True):
        partials, residual, weight = _make_inputs(rounds, tokens, hidden, dtype, True, world)
        want = fused_allreduce_rmsnorm_reference(partials, residual, weight, EPS, dtype)
        torch.cuda.synchronize()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(20_000_000)  # the fused kernel starts ~10 ms late
        normed, res_out = call(partials[rank], residual, weight)
        if joined:
            JOIN(normed, res_out, [partials[rank], residual])
        got = (normed.clone(), res_out.clone())  # read on the compute stream
        if not joined:
            JOIN(normed, res_out, [partials[rank], residual])
        torch.cuda.synchronize()
        if joined:
            check(f"round {rounds}", got, want)
        elif torch.equal(got[0], want[0].to(dtype)) and torch.equal(got[1], want[1].to(dtype)):
            errors.append("control round without a join read the right values: the test cannot see a race")
        rounds += 1
    if streams._PENDING:
        errors.append(f"{len(streams._PENDING)} pending join(s) left after every output was joined")
    pooled = len(streams._EVENTS.get(torch.cuda.current_device(), []))
    if pooled > 2:
        errors.append(f"event pool grew to {pooled} (expected at most 2: fork and done)")

    # The calls that run with the communication stream made current instead of launching on it
    # by handle (``fused_allreduce_rmsnorm_cuda``'s ``stream``): a strided residual (copied first)
    # and an unaligned partial (Triton's own launch). The sleep again holds the kernel back.
    for label in ("strided residual", "unaligned partial"):
        partials, residual, weight = _make_inputs(80 + rounds, tokens, hidden, dtype, True, world)
        want = fused_allreduce_rmsnorm_reference(partials, residual, weight, EPS, dtype)
        partial = partials[rank]
        if label == "strided residual":
            wide = torch.empty(tokens, hidden + 64, dtype=dtype, device="cuda")
            wide[:, :hidden].copy_(residual)
            residual = wide[:, :hidden]
        else:
            partial = torch.empty(tokens * hidden + 1, dtype=dtype, device="cuda")[1:].view(tokens, hidden)
            partial.copy_(partials[rank])
        torch.cuda.synchronize()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(20_000_000)
        normed, res_out = call(partial, residual, weight)
        JOIN(normed, res_out, [partial, residual])
        got = (normed.clone(), res_out.clone())
        torch.cuda.synchronize()
        check(label, got, want)
        rounds += 1

    # Captured: the fork and the join are recorded into the graph, and replays order them too.
    static = _make_inputs(50, tokens, hidden, dtype, True, world)
    normed, res_out = call(static[0][rank], static[1], static[2])  # warm-up outside capture
    JOIN(normed, res_out, [static[0][rank], static[1]])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        normed, res_out = call(static[0][rank], static[1], static[2])
        JOIN(normed, res_out, [static[0][rank], static[1]])
        outs = (normed * 1, res_out * 1)
    for replay in range(3):
        fresh = _make_inputs(60 + replay, tokens, hidden, dtype, True, world)
        static[0][rank].copy_(fresh[0][rank])
        static[1].copy_(fresh[1])
        graph.replay()
        torch.cuda.synchronize()
        check(f"replay {replay}", outs, fused_allreduce_rmsnorm_reference(fresh[0], fresh[1], static[2], EPS, dtype))
    # Eager again: the pooled events were last recorded inside the capture.
    partials, residual, weight = _make_inputs(70, tokens, hidden, dtype, True, world)
    normed, res_out = call(partials[rank], residual, weight)
    JOIN(normed, res_out, [partials[rank], residual])
    got = (normed.clone(), res_out.clone())
    torch.cuda.synchronize()
    check("eager after capture", got, fused_allreduce_rmsnorm_reference(partials, residual, weight, EPS, dtype))
    assert not errors, "\n".join(errors)
    return rounds + 4


# The direct-launch case first: it needs the first call of each of its signatures to go through
# Triton's dispatch, as in a fresh process.
CASES = {
    "test_direct_launch_matches_triton_dispatch": Case(_direct_launch_worker),
    **{f"test_matches_reference_on_one_gpu[{_dtype_id(d)}]": Case(_matches_reference_worker, (d,), 420)
       for d in DTYPES},
    "test_every_algorithm_and_cta_count_on_one_gpu": Case(_modes_worker),
    "test_cuda_graph_capture_and_replay_on_one_gpu": Case(_cuda_graph_worker),
    "test_inverse_rms_on_one_gpu": Case(_inverse_rms_worker),
    "test_layer_norm_on_one_gpu": Case(_layer_norm_worker),
    "test_async_op_and_join_on_one_gpu": Case(_async_join_worker),
}
gpu_ranks, case_result = shared_ranks(CASES, 1)


def test_direct_launch_matches_triton_dispatch(case_result):
    assert case_result == [24]  # 4 shapes x (5 calls + 1 through Triton's launcher wrapper)


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_matches_reference_on_one_gpu(case_result, dtype):
    assert case_result[0] > 0


# The workers assert inside the rank; here: it ran its case to the end.
def test_every_algorithm_and_cta_count_on_one_gpu(case_result):
    assert case_result == [None]


def test_cuda_graph_capture_and_replay_on_one_gpu(case_result):
    assert case_result == [None]


def test_inverse_rms_on_one_gpu(case_result):
    assert case_result[0] == 18  # 2 dtypes x 3 kernels x 3 sizes (no Lamport without peers)


def test_layer_norm_on_one_gpu(case_result):
    assert case_result[0] == 24  # 2 dtypes x 3 kernels x 2 sizes x bias or not (no Lamport without peers)


def test_async_op_and_join_on_one_gpu(case_result):
    assert case_result == [10]  # 4 eager rounds (one a control without the join), 2 strided or
    # unaligned rounds, 3 replays, 1 more eager
