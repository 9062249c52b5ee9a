"""FlashComm on 2 GPUs (NCCL, one process per GPU; ``WEAVE_GPU_WORLD`` / ``--gpu-world`` for 4 or 8):
the CUDA path against eager.

Run on the GPU machine: ``python -m pytest -m gpu tests/gpu/test_flashcomm_gpu.py -q``.
NVLink multicast stays off (conftest.py and ``spawn`` set NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1). One spawned group of ranks runs every
case (gpu_cases.py); each test asserts on its own case's result.
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
    shared_gpu_skip,
    shared_ranks,
)

from weavepass import WeaveConfig, make_backend
from weavepass.testing import TPConfig, build_tp_model, check_against_eager, random_token_ids
from weavepass.testing.shared_gpu import rank_device

WORLD = gpu_world()
pytestmark = [
    pytest.mark.gpu,
    needs_gpus(WORLD),
    # FlashComm's CUDA path without MMRS is the functional reduce_scatter + all_gather; with gloo
    # standing in for NCCL, reduce_scatter on CUDA tensors segfaults by itself (one H200,
    # 2026-12-01: scripts/probe_shared_gpu.py funcol), and MMRS needs NCCL.
    shared_gpu_skip("FlashComm's collectives need NCCL (gloo's reduce_scatter on CUDA tensors segfaults)"),
]

CFG = TPConfig(vocab=1000, hidden=1024, n_layers=2, n_heads=16, n_kv_heads=8, head_dim=64,
               intermediate=2816, dtype=torch.bfloat16)
MOE = TPConfig(vocab=1000, hidden=1024, n_layers=1, n_heads=16, n_kv_heads=8, head_dim=64,
               intermediate=1024, n_experts=4, dtype=torch.bfloat16)
MMRS = [False, True]


def _run(rank, world, cases):
    """Every ``(cfg, tokens, mmrs)`` case in one process group: one NCCL start-up for all."""
    device = rank_device(rank)
    results = []
    for cfg, tokens, mmrs in cases:
        torch._dynamo.reset()
        config = WeaveConfig(enable_flashcomm=True, flashcomm_min_prefill_tokens=1, split="off",
                             enable_mmrs_fusion=mmrs)
        backend = make_backend(config)
        model = build_tp_model(cfg, rank, world, dist.group.WORLD, device=device)
        reference = build_tp_model(cfg, rank, world, dist.group.WORLD, device=device, dtype=torch.float32)
        ids = random_token_ids(cfg, 1, tokens, seed=tokens, device=device)
        check_against_eager(model, ids, lambda m: torch.compile(m, backend=backend, dynamic=False), reference)
        graph = backend.report.graphs[0]
        results.append(([r.lowering for r in graph.records], dict(graph.ops_after)))
    return results


def _models(mmrs: bool) -> list:
    """1 token (< world), 1000 (not a multiple of 32), 4096 (no padding), and the MoE model."""
    return [(CFG, 1, mmrs), (CFG, 1000, mmrs), (CFG, 4096, mmrs), (MOE, 777, mmrs)]


@pytest.mark.parametrize("mmrs", MMRS, ids=str)
def test_flashcomm_cuda_matches_eager(case_result, mmrs):
    cases = _models(mmrs)
    assert len(case_result[0]) == len(cases)
    for (cfg, tokens, _), (lowerings, ops) in zip(cases, case_result[0]):
        where = f"{tokens} tokens, n_experts={cfg.n_experts}: {lowerings}"
        assert all(lowering.startswith("flashcomm:") for lowering in lowerings), where
        assert not any("all_reduce" in op for op in ops), where
        if not mmrs:
            assert ops["_c10d_functional.reduce_scatter_tensor.default"] == len(lowerings), where
        elif cfg is CFG:
            # Every row-parallel site (all but the embedding's) runs the fused matmul-reduce_scatter;
            # QKV and gate/up read the shards through fused all_gather-matmul.
            assert lowerings[1:] == ["flashcomm:cuda_symm"] * (len(lowerings) - 1), where
            assert ops.get("symm_mem.fused_matmul_reduce_scatter.default", 0) == len(lowerings) - 1, where
            assert ops.get("symm_mem.fused_all_gather_matmul.default", 0) == len(lowerings) - 1, where


def _reduce_overhead(rank, world, mmrs):
    from torch._dynamo.utils import counters

    device = rank_device(rank)
    model = build_tp_model(CFG, rank, world, dist.group.WORLD, device=device)
    backend = make_backend(WeaveConfig(enable_flashcomm=True, flashcomm_min_prefill_tokens=1, split="off",
                                       enable_mmrs_fusion=mmrs))
    compiled = torch.compile(model, backend=backend, mode="reduce-overhead", dynamic=False)
    counters.clear()
    check_replays_match_eager(compiled, model, CFG, 1000, 4, device)
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    return [r.lowering for r in backend.report.graphs[0].records]


@pytest.mark.parametrize("mmrs", MMRS, ids=str)
def test_flashcomm_under_reduce_overhead_mode(case_result, mmrs):
    """FlashComm under Inductor's CUDA-graph trees (allowed by default): warm-up, recording and
    replays on new inputs equal eager. Tolerance as the overlap file's reduce-overhead test: the
    compiled and eager bf16 models round differently through 2 layers (sums reordered by
    reduce-scatter + all-gather against all_reduce), measured max abs error 0.06-0.08 there."""
    lowerings = case_result[0]
    assert all(lowering.startswith("flashcomm:") for lowering in lowerings), lowerings


CASES = {
    **{f"test_flashcomm_cuda_matches_eager[{mmrs}]": Case(_run, (_models(mmrs),), 600) for mmrs in MMRS},
    **{f"test_flashcomm_under_reduce_overhead_mode[{mmrs}]": Case(_reduce_overhead, (mmrs,)) for mmrs in MMRS},
}
gpu_ranks, case_result = shared_ranks(CASES, WORLD)
