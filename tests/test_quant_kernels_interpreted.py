"""The CUDA kernels' quantized norm epilogue on CPU through Triton's interpreter
(tests/quant_interpreter_case.py): every carried form's codes and scales bit for bit against eager's
quantization as ATen computes it on CUDA, and within one fp32 rounding of the scale against eager on
the CPU, at a group of one rank and at two simulated ranks through every kernel (flat one-shot and
two-shot, pipelined, Lamport), bf16 and fp16; and the quantizing kernel compiled ahead of time to
sm_90 PTX (the interpreter compiles nothing). Skipped where Triton is not installed. What neither
shows: the GPU's own casts and memory ordering (tests/gpu/test_quant_epilogue_gpu.py)."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (interpreter)")

CASE = pathlib.Path(__file__).with_name("quant_interpreter_case.py")


@pytest.mark.parametrize("world, algorithm, dtype", [
    (1, "one_shot", "bfloat16"),
    (1, "one_shot", "float16"),
    (2, "two_shot", "bfloat16"),
    (2, "one_shot", "float16"),
    (2, "pipelined", "bfloat16"),
    (2, "pipelined_loads", "bfloat16"),
    (3, "pipelined_loads", "bfloat16"),  # an odd world: uneven shards, a CTA with no chunk
    (2, "lamport", "bfloat16"),
])
def test_quantized_epilogue_matches_eager(world, algorithm, dtype):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(CASE.parent.parent))
    result = subprocess.run([sys.executable, str(CASE), str(world), algorithm, dtype], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "quant kernels: OK" in result.stdout


POINTERS = {"codes_ptr": None, "scales_ptr": "*fp32", "static_scale_ptr": "*fp32", "qconst_ptr": "*fp32",
            "inv_rms_ptr": "*fp32", "pad_ptr": "*i32"}


@pytest.mark.parametrize("form", ["fp8_group", "int8_row"])
def test_quantizing_kernel_compiles_for_sm90(form):
    """What the interpreter does not check: that Triton compiles the epilogue to PTX (constexpr
    rules, reshapes, casts). Compiled ahead of time for sm_90 with the installed Triton; no GPU needed.
    The IEEE divisions stay (no contraction into FMAs) and the fp8 casts are the hardware's."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from weavepass.runtime.cuda import kernels
    from weavepass.runtime.cuda.quant_epilogue import plan_quant_epilogue
    from weavepass.testing.quant_steps import form_steps

    scale_steps, code_steps, group = form_steps(form, torch.bfloat16)
    quant = plan_quant_epilogue(torch.bfloat16, 8192, None, group, scale_steps, code_steps, False)
    constexprs = dict(RANK=0, WORLD=2, HIDDEN=8192, BLOCK_H=8192, ROWS=2, ONE_SHOT=False, HAS_RESIDUAL=True,
                      MAX_CTAS=32, HAS_INV_RMS=False, NORM=0, QUANT=quant.packed)
    kernel = kernels.fused_allreduce_rmsnorm_kernel
    pointers = {**POINTERS, "codes_ptr": "*i8" if quant.code_dtype == torch.int8 else "*fp8e4nv"}
    signature = {name: "constexpr" if name in constexprs else pointers.get(name, "*bf16") if name.endswith("_ptr")
                 else "fp32" if name == "eps" else "i64" for name in kernel.arg_names}
    try:
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8, enable_fp_fusion=False))
    except RuntimeError as error:  # no ptxas in this Triton install
        if "ptxas" in str(error):
            pytest.skip(f"Triton cannot assemble for sm_90 here: {error}")
        raise
    ptx = compiled.asm["ptx"]
    assert "div.rn.f32" in ptx and "fma.rn.f32" not in ptx
    assert ("e4m3" in ptx) == (quant.code_dtype != torch.int8)
