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
            cuda_symm._DIRECT_LAUNCH = direct
            try:
                outputs[label] = cuda_symm.fused_allreduce_rmsnorm_cuda(partial, residual, weight, EPS, group, dtype)
            finally:
                cuda_symm._DIRECT_LAUNCH = True
            launches += 1
        launch = [v for k, v in cuda_symm._LAUNCHES.items() if k[0] == partials[rank].shape][0]
        if launch.compiled is None:
            errors.append(f"T={tokens} H={hidden}: the first launch recorded no compiled kernel")
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
}
gpu_ranks, case_result = shared_ranks(CASES, 1)


def test_direct_launch_matches_triton_dispatch(case_result):
    assert case_result == [20]


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
