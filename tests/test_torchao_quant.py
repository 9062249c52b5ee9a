"""torchao's own float8 per-row tensors (``Float8Tensor``, as ``Float8DynamicActivationFloat8WeightConfig(
granularity=PerRow())`` builds them) in the reference TP model, on the CPU (issue 36): the graph
torchao's tensor subclass traces to is the one weave fuses, and the compiled model's output on 2 gloo
ranks is within the harness's tolerance of the fp32 reference (relative to eager's own error, which
carries the same fp8 error).

``quantize_`` refuses float8 without CUDA sm_89+, so the weights are built here the way its config
builds them (``Float8Tensor.from_hp`` with the config's activation kwargs), without that check, and
with ``use_fast_accum=False`` (the config's default asks the GPU's fast accumulation). The GPU case
with ``quantize_`` itself is tests/gpu/test_torchao_gpu.py. torchao is not a weavepass dependency:
skipped where it is not installed.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import weavepass
from weavepass.testing.distributed import spawn
from weavepass.testing.harness import check_against_eager
from weavepass.testing.models import TPConfig, build_tp_model, random_token_ids
from weavepass.testing.quant import linears_as_modules

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchao") is None,
                                reason="needs torchao (not a weavepass dependency; pip install torchao)")

QUANT = "weave.fused_allreduce_rmsnorm_quant.default"
FUSED = "weave.fused_allreduce_rmsnorm.default"
AR = "_c10d_functional.all_reduce.default"
CFG = TPConfig(vocab=256, hidden=256, n_layers=2, n_heads=8, n_kv_heads=4, head_dim=32, intermediate=512,
               dtype=torch.bfloat16)


def torchao_float8_per_row(model: torch.nn.Module) -> int:
    """The linears that read a norm's output as torchao's float8 per-row tensors (weights per output
    row, activations per token, dynamic); returns how many."""
    from torchao.float8.inference import Float8MMConfig
    from torchao.quantization import PerRow
    from torchao.quantization.quantize_.workflows.float8.float8_tensor import (
        Float8Tensor,
        QuantizeTensorToFloat8Kwargs,
    )

    count = linears_as_modules(model)
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            weight = Float8Tensor.from_hp(
                module.weight.data, float8_dtype=torch.float8_e4m3fn, granularity=PerRow(),
                mm_config=Float8MMConfig(use_fast_accum=False),
                act_quant_kwargs=QuantizeTensorToFloat8Kwargs(torch.float8_e4m3fn, PerRow()))
            module.weight = torch.nn.Parameter(weight, requires_grad=False)
    return count


@pytest.fixture(scope="module")
def fake_world():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_torchao_float8_per_row_graph(fake_world):
    model = build_tp_model(CFG, 0, 2, fake_world)
    assert torchao_float8_per_row(model) == 5 * CFG.n_layers
    backend = weavepass.make_backend()
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=backend, fullgraph=True)(random_token_ids(CFG, 2, 5))
    (graph,) = backend.report.graphs
    # q/k/v and gate/up of every layer: one quantization each, shared by its linears; the final norm plain
    assert graph.ops_after[QUANT] == 2 * CFG.n_layers and graph.ops_after[FUSED] == 1 and graph.ops_after[AR] == 0
    assert "aten.amax.default" not in graph.ops_after
    assert graph.rewritten == graph.matched == 2 * CFG.n_layers + 1
    kinds = [r.kind for r in backend.report.records]
    assert sum("+ fp8 per-row quant" in k for k in kinds) == 2 * CFG.n_layers, kinds
    assert all(r.quant_left is None for r in backend.report.records), kinds


def _model_rank(rank: int, world: int) -> str:
    group = dist.group.WORLD
    model = build_tp_model(CFG, rank, world, group)
    torchao_float8_per_row(model)
    reference = build_tp_model(CFG, rank, world, group, dtype=torch.float32)
    backend = weavepass.make_backend()
    comparison = check_against_eager(model, (random_token_ids(CFG, 2, 7, seed=1),),
                                     lambda m: torch.compile(m, backend=backend), reference, CFG.dtype)
    assert sum(g.ops_after.get(QUANT, 0) for g in backend.report.graphs) == 2 * CFG.n_layers
    return str(comparison)


def test_torchao_float8_per_row_model_on_gloo():
    for table in spawn(_model_rank, 2, "gloo"):
        print(table)
