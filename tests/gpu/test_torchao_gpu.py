"""torchao's float8 inference config on the reference TP model, compiled with ``backend="weave"`` on
GPUs (issue 36): ``quantize_(model, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))``
on the linears that read a norm's output (q/k/v, gate/up), as a user of torchao writes it.

What it checks: every site runs the CUDA kernel (``cuda_symm``); the q/k/v and gate/up sites fuse
torchao's per-row activation quantization (their kind says ``+ fp8 per-row quant``, none says
``stays outside``), the final norm is a plain site; and the compiled model's output is within the
harness's tolerance of the fp32 (unquantized) reference, relative to eager's own error
(``check_against_eager``: the eager model carries the same fp8 error).

GPU only: torchao's ``quantize_`` refuses float8 without CUDA sm_89+. torchao is not a dependency of
weavepass: the test skips where it is missing. On the device machine (no network) carry its wheel
(``pip download --no-deps torchao``; pure Python for this path) and install it with
``pip install --no-deps --target``. Two ranks on two GPUs, or on one with ``WEAVE_GPU_SHARED=1``.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.distributed as dist
from gpu_cases import Case, gpu_world, needs_gpus, shared_ranks  # tests/gpu/gpu_cases.py

import weavepass
from weavepass.testing.harness import check_against_eager
from weavepass.testing.models import TPConfig, build_tp_model, random_token_ids
from weavepass.testing.quant import linears_as_modules
from weavepass.testing.shared_gpu import rank_device

WORLD = gpu_world()

pytestmark = [
    pytest.mark.gpu,
    needs_gpus(WORLD),
    pytest.mark.skipif(importlib.util.find_spec("torchao") is None,
                       reason="needs torchao (not a weavepass dependency; pip install torchao)"),
    pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
                       reason="torchao's float8 config needs CUDA sm_89+"),
]

def _rank(rank: int, world: int, batch: int, seq: int) -> dict:
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    cfg = TPConfig(vocab=1024, hidden=1024, n_layers=2, n_heads=16, n_kv_heads=8, head_dim=64,
                   intermediate=2048, dtype=torch.bfloat16)
    device = rank_device(rank)
    group = dist.group.WORLD
    model = build_tp_model(cfg, rank, world, group, device=device)
    linears = linears_as_modules(model)
    quantize_(model, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))
    quantized = sum(type(m.weight).__name__ == "Float8Tensor" for m in model.modules()
                    if isinstance(m, torch.nn.Linear))
    reference = build_tp_model(cfg, rank, world, group, device=device, dtype=torch.float32)
    ids = random_token_ids(cfg, batch, seq, seed=3, device=device)
    backend = weavepass.make_backend(weavepass.WeaveConfig(split="off", cuda_min_tokens=1))
    comparison = check_against_eager(
        model, (ids,), lambda m: torch.compile(m, backend=backend), reference, cfg.dtype
    )
    records = backend.report.records
    return dict(linears=linears, quantized=quantized, n_layers=cfg.n_layers,
                lowerings=[r.lowering for r in records], kinds=[r.kind for r in records],
                table=str(comparison))


SHAPES = [(1, 1), (2, 37), (1, 1024)]  # (batch, seq)
SHAPE_IDS = ["-".join(map(str, shape)) for shape in SHAPES]
CASES = {
    f"test_torchao_float8_per_row_model_fuses_its_quantization[{name}]": Case(_rank, shape)
    for name, shape in zip(SHAPE_IDS, SHAPES)
}
gpu_ranks, case_result = shared_ranks(CASES, WORLD)


@pytest.mark.parametrize("batch,seq", SHAPES, ids=SHAPE_IDS)
def test_torchao_float8_per_row_model_fuses_its_quantization(case_result, batch, seq):
    for result in case_result:
        print(result["table"])
        layers = result["n_layers"]
        assert result["linears"] == result["quantized"] == 5 * layers, result  # every one quantized
        assert result["lowerings"] == ["cuda_symm"] * (2 * layers + 1), result
        fused = [kind for kind in result["kinds"] if "+ fp8 per-row quant" in kind]
        assert len(fused) == 2 * layers, result["kinds"]  # q/k/v and gate/up sites of every layer
        assert not any("stays outside" in kind for kind in result["kinds"]), result["kinds"]
