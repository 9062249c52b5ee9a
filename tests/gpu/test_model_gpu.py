"""The reference TP model compiled with ``backend="weave"`` on 2 GPUs (NCCL; ``WEAVE_GPU_WORLD``
/ ``--gpu-world`` for 4 or 8) matches eager.

On CUDA the planner's ``auto`` lowering must pick the symmetric-memory kernel for every site. One
spawned group of ranks runs every case (gpu_cases.py); each test asserts on its own case's result.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from gpu_cases import Case, gpu_world, needs_gpus, shared_ranks  # tests/gpu/gpu_cases.py

import weavepass
from weavepass.testing.harness import check_against_eager
from weavepass.testing.models import TPConfig, build_tp_model, random_token_ids
from weavepass.testing.shared_gpu import rank_device

WORLD = gpu_world()

pytestmark = [pytest.mark.gpu, needs_gpus(WORLD)]


def _rank(rank: int, world: int, batch: int, seq: int, n_experts: int) -> dict:
    # 8 kv heads: whole heads on every rank up to 8 ranks (GQA groups of 2).
    cfg = TPConfig(vocab=1024, hidden=1024, n_layers=2, n_heads=16, n_kv_heads=8, head_dim=64,
                   intermediate=2048, n_experts=n_experts, dtype=torch.bfloat16)
    device = rank_device(rank)
    group = dist.group.WORLD
    model = build_tp_model(cfg, rank, world, group, device=device)
    reference = build_tp_model(cfg, rank, world, group, device=device, dtype=torch.float32)
    ids = random_token_ids(cfg, batch, seq, seed=3, device=device)
    # cuda_min_tokens=1: the kernel at every size (by default small batches stay all_reduce
    # without CUDA graphs, see WeaveConfig.cuda_min_tokens and tests/test_scheduler.py).
    backend = weavepass.make_backend(weavepass.WeaveConfig(split="off", cuda_min_tokens=1))
    comparison = check_against_eager(
        model, (ids,), lambda m: torch.compile(m, backend=backend), reference, cfg.dtype
    )
    return dict(
        lowerings=[r.lowering for r in backend.report.records],
        max_abs=comparison.max_abs_diff,
        table=str(comparison),
    )


SHAPES = [(1, 1, 0), (2, 37, 0), (1, 1024, 0), (1, 300, 4)]  # (batch, seq, n_experts)
SHAPE_IDS = ["-".join(map(str, shape)) for shape in SHAPES]
CASES = {
    f"test_reference_model_on_gpus_uses_cuda_kernel_and_matches_eager[{name}]": Case(_rank, shape)
    for name, shape in zip(SHAPE_IDS, SHAPES)
}
gpu_ranks, case_result = shared_ranks(CASES, WORLD)


@pytest.mark.parametrize("batch,seq,n_experts", SHAPES, ids=SHAPE_IDS)
def test_reference_model_on_gpus_uses_cuda_kernel_and_matches_eager(case_result, batch, seq, n_experts):
    for result in case_result:
        print(result["table"])
        assert result["lowerings"] == ["cuda_symm"] * 5, result
