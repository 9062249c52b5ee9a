"""The split's push variant (``WeaveConfig.split_comm="push"``) on GPUs: equal to eager in
bf16, CUDA-graph capture and replay, Inductor's CUDA-graph trees.

In its own file (its own spawned ranks), apart from test_overlap_gpu.py: the push kernels have not
run on GPUs yet (written 2026-12-01 without a device), and a wrong wait in them would hang the
ranks, which would lose every other case of a shared spawn. Run the one-GPU simulator tests of the
push kernels first (tests/gpu/test_kernel_sim_one_gpu.py, gpu_suite step ``onegpu``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from gpu_cases import (  # tests/gpu/gpu_cases.py
    Case,
    check_replays_match_eager,
    gpu_world,
    needs_gpus,
    replays_on_new_inputs,
    shared_ranks,
)
from test_overlap_gpu import CFG, LAYOUTS, _no_multicast  # noqa: E402  (tests/gpu is on sys.path)

from weavepass import WeaveConfig
from weavepass.backend import WeaveBackend
from weavepass.compile.reasons import ReasonCode
from weavepass.testing import build_tp_model, check_against_eager, random_token_ids
from weavepass.testing.shared_gpu import rank_device

WORLD = gpu_world()
pytestmark = [pytest.mark.gpu, needs_gpus(WORLD)]


PUSH = WeaveConfig(split="force", split_comm="push", cuda_min_tokens=1)
PUSH_NOTE = "communication: push (slot 0 for A, 1 for B)"


def _push_ran(device) -> bool:
    """Whether the push kernels served at least one call (not only the fused async fallback)."""
    from weavepass.runtime.cuda import push

    return any(call is not None and call.pushes[0].tail[0].device == device for call in push._CALLS.values())


def _push_matches_eager(rank, world):
    _no_multicast()
    device = rank_device(rank)
    model = build_tp_model(CFG, rank, world, dist.group.WORLD, device=device, dtype=torch.bfloat16)
    reference = build_tp_model(CFG, device=device)
    notes, codes = [], []
    for batch, seq in LAYOUTS:
        torch._dynamo.reset()
        backend = WeaveBackend(PUSH)
        ids = random_token_ids(CFG, batch, seq, device=device)
        for _ in range(3):  # back to back: each slot is reused by the next call's same half
            check_against_eager(model, ids, lambda m: torch.compile(m, backend=backend), reference)
        notes.append(backend.report.graphs[0].note)
        codes.append(backend.report.graphs[0].codes)
        after = backend.report.graphs[0].ops_after
        op = "weave.fused_allreduce_rmsnorm_push_async.default" if world == 2 else \
            "weave.fused_allreduce_rmsnorm_async.default"
        assert after[op] == 2 * (2 * CFG.n_layers + 1), ((batch, seq), after)
    return notes, codes, _push_ran(device)


def test_push_variant_matches_eager_bf16(case_result):
    """``split_comm="push"``: the push kernels on the communication stream, the reduce + add +
    RMSNorm at the join, equal eager in bf16 (check_against_eager's tolerance) for every
    layout, three calls in a row. On more than 2 ranks the split keeps the fused kernel and says why."""
    notes, codes, ran = case_result[0]
    assert all(n.startswith("split") for n in notes), notes
    if WORLD == 2:
        assert all(n.endswith(PUSH_NOTE) for n in notes) and codes == [[]] * len(notes), notes
        assert ran  # the push kernels served the calls, not the fused fallback
    else:
        assert codes == [[ReasonCode.PUSH_WORLD_SIZE]] * len(notes), notes


def _push_cuda_graph(rank, world):
    _no_multicast()
    device = rank_device(rank)
    model = build_tp_model(CFG, rank, world, dist.group.WORLD, device=device, dtype=torch.bfloat16)
    compiled = torch.compile(model, backend=WeaveBackend(PUSH))
    return replays_on_new_inputs(compiled, model, CFG, device, seeds=(7, 8, 9))


def test_push_variant_captures_and_replays_in_cuda_graph(case_result):
    """The manual-capture test of the fused split (same tolerance) for the push variant, replayed
    three times with new inputs."""
    assert len(case_result) == WORLD


def _push_reduce_overhead(rank, world):
    from torch._dynamo.utils import counters

    _no_multicast()
    device = rank_device(rank)
    model = build_tp_model(CFG, rank, world, dist.group.WORLD, device=device, dtype=torch.bfloat16)
    backend = WeaveBackend(PUSH)
    compiled = torch.compile(model, backend=backend, mode="reduce-overhead")
    counters.clear()
    worst = check_replays_match_eager(compiled, model, CFG, 384, 5, device)
    assert backend.report.graphs[0].note.startswith("split"), backend.report.graphs[0].note
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    return worst


def test_push_variant_under_reduce_overhead_mode(case_result):
    """Inductor's CUDA-graph trees with the push variant: the join's reduce is launched inside the
    recorded graph, and ``join_async`` keeps the partial alive across the push (as for the fused op)."""
    assert len(case_result) == WORLD


CASES = {
    "test_push_variant_matches_eager_bf16": Case(_push_matches_eager),
    "test_push_variant_captures_and_replays_in_cuda_graph": Case(_push_cuda_graph),
    "test_push_variant_under_reduce_overhead_mode": Case(_push_reduce_overhead),
}
gpu_ranks, case_result = shared_ranks(CASES, WORLD)
