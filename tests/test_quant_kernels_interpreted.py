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

import pytest
from interpreted import run_interpreted  # tests/interpreted.py

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
    run_interpreted(CASE.name, str(world), algorithm, dtype, ok="quant kernels: OK", timeout=600)


def test_division_through_one_reciprocal_per_scale_is_ieee_division():
    """``kernels._divide_rn`` against numpy's IEEE division (tests/quant_divide_case.py): bit for
    bit wherever a quotient can reach a nonzero code, over every bf16 and fp16 dividend, fp32
    significands, special values, and scales from 1e-45 to inf (negative too)."""
    run_interpreted("quant_divide_case.py", ok="divide_rn: OK", timeout=600)


def _sass(cubin: bytes) -> str:
    """The SASS of ``cubin`` (Triton's bundled ``cuobjdump``)."""
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.cubin")
        pathlib.Path(path).write_bytes(cubin)
        return subprocess.run([tool, "-sass", path], capture_output=True, text=True, check=True).stdout


POINTERS = {"codes_ptr": None, "scales_ptr": "*fp32", "static_scale_ptr": "*fp32", "qconst_ptr": "*fp32",
            "inv_rms_ptr": "*fp32", "pad_ptr": "*i32"}


@pytest.mark.parametrize("fast", [False, True], ids=["div_rn", "fast"])
@pytest.mark.parametrize("form", ["fp8_group", "int8_row"])
def test_quantizing_kernel_compiles_for_sm90(form, fast):
    """What the interpreter does not check: that Triton compiles the epilogue to PTX (constexpr
    rules, reshapes, casts). Compiled ahead of time for sm_90 with the installed Triton; no GPU needed.
    The fp8 casts are the hardware's. Without ``quant_epilogue.ARITH_*``: an IEEE division per
    element and no FMA (no contraction); with them (as ``kernel_quant`` sets them on a GPU): the
    divisions only for the scales' reciprocals (one per group or row), the FMAs of the correction."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from weavepass.runtime.cuda import kernels
    from weavepass.runtime.cuda.quant_epilogue import (
        ARITH_HARDWARE_FP8,
        ARITH_RECIPROCAL,
        ARITH_SATURATE,
        plan_quant_epilogue,
    )
    from weavepass.testing.quant_steps import form_steps

    scale_steps, code_steps, group = form_steps(form, torch.bfloat16)
    quant = plan_quant_epilogue(torch.bfloat16, 8192, None, group, scale_steps, code_steps, False)
    arith = (ARITH_RECIPROCAL | ARITH_HARDWARE_FP8 | ARITH_SATURATE) if fast else 0
    constexprs = dict(RANK=0, WORLD=2, HIDDEN=8192, BLOCK_H=8192, ROWS=2, ONE_SHOT=False, HAS_RESIDUAL=True,
                      MAX_CTAS=32, HAS_INV_RMS=False, NORM=0, QUANT=quant.packed | arith << 56)
    kernel = kernels.fused_allreduce_rmsnorm_kernel
    pointers = {**POINTERS, "codes_ptr": "*i8" if quant.code_dtype == torch.int8 else "*fp8e4nv"}
    signature = {name: "constexpr" if name in constexprs else pointers.get(name, "*bf16") if name.endswith("_ptr")
                 else "fp32" if name == "eps" else "i64" for name in kernel.arg_names}
    # 16-byte aligned pointers, as the dispatcher's tensors are (vectorised rows, as on the GPU)
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names) if name.endswith("_ptr")}
    try:
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=aligned),
                                  target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8, enable_fp_fusion=False))
    except RuntimeError as error:  # no ptxas in this Triton install
        if "ptxas" in str(error):
            pytest.skip(f"Triton cannot assemble for sm_90 here: {error}")
        raise
    ptx = compiled.asm["ptx"]
    divisions = ptx.count("div.rn.f32")
    per_thread = 8192 // (8 * 32) * 2  # elements per thread per tile (8 warps, 2 rows)
    if fast:  # the reciprocals, after ptxas (the PTX repeats a group's scale in every thread that reads it)
        reciprocals = _sass(compiled.asm["cubin"]).count("MUFU.RCP")
        assert 0 < reciprocals < per_thread // 4 and "fma.rn.f32" in ptx, reciprocals
    else:
        assert divisions >= per_thread and "fma.rn.f32" not in ptx, divisions
    assert ("e4m3" in ptx) == (quant.code_dtype != torch.int8)


def test_kernel_quant_arithmetic_bits(monkeypatch):
    """``quant_epilogue.kernel_quant``: the reciprocal division everywhere; the hardware fp8 cast and
    the dropped clamps only on a GPU (not under the interpreter), the clamps only when they are fp8's
    own +-448; nothing while ``FAST_ARITHMETIC`` is off."""
    import torch

    from weavepass.runtime.cuda import quant_epilogue as qe
    from weavepass.testing.quant_steps import form_steps

    def bits(form, code_steps=None):
        scale_steps, steps, group = form_steps(form, torch.bfloat16)
        static = (torch.float32, 0) if form.startswith("fp8_static") else None
        epilogue = qe.plan_quant_epilogue(torch.bfloat16, 8192, static, group, scale_steps, code_steps or steps, False)
        assert not isinstance(epilogue, str), epilogue
        quant = qe.kernel_quant(epilogue)
        assert quant & ((1 << 56) - 1) == epilogue.packed
        return quant >> 56

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    every = qe.ARITH_RECIPROCAL | qe.ARITH_HARDWARE_FP8 | qe.ARITH_SATURATE
    assert [bits(form) for form in ("fp8_static", "fp8_row", "fp8_group")] == [every] * 3
    assert bits("int8_row") == qe.ARITH_RECIPROCAL | qe.ARITH_HARDWARE_FP8  # int8: the clamps stay
    narrower = "convert:float32|div_scale|clamp_min:-400.0|clamp_max:448.0|convert:float8_e4m3fn"
    assert bits("fp8_row_torchao", narrower) == qe.ARITH_RECIPROCAL | qe.ARITH_HARDWARE_FP8
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert bits("fp8_row") == qe.ARITH_RECIPROCAL
    monkeypatch.setattr(qe, "FAST_ARITHMETIC", False)
    assert bits("fp8_row") == 0
