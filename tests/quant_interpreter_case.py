"""The CUDA kernels' quantized norm epilogue (``kernels._quantize_rows``) run by Triton's interpreter on
CPU: every form the kernel carries (``weavepass.testing.quant.FUSED_FORMS``), at a group of one rank
and at two simulated ranks (one forked process per rank, as tests/push_interpreter_case.py), through
the flat kernel (one-shot and two-shot), the pipelined two-shot kernel (with and without its
software-pipelined loads) and the Lamport one-shot.

Run by tests/test_quant_kernels_interpreted.py as ``TRITON_INTERPRET=1 python
tests/quant_interpreter_case.py <world> <algorithm> <dtype>``; prints ``quant kernels: OK`` after
checking, for every form:

* the normed rows and ``residual_out`` against the fp32 reference (``reference.py``): two roundings
  of the operands for ``residual_out`` (the interpreter's bf16 cast truncates); the normed rows
  within two roundings of the fp32 RMSNorm of the kernel's own ``residual_out``;
* codes and scales against eager's quantization of the kernel's own normed rows, computed as ATen
  computes on CUDA (a division by a number is a multiplication by its fp32 reciprocal:
  ``quant_epilogue``): bit for bit;
* the same against eager on the CPU (``quantize_rows`` as it is, a true division by a number):
  scales within one fp32 rounding, and codes equal where the scale is, else one code step apart;
* every rank's codes and scales equal (each normalises every row from the same ``residual_out``);
* without ``return_normed`` the normed rows are not written and the codes are the same;
* all of it with the division by the scale as one reciprocal per scale and a correction per element
  (``quant_epilogue.FAST_ARITHMETIC``, the default) and as ``div.rn`` per element.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time

import numpy as np
import torch

from weavepass.runtime.cuda import quant_epilogue
from weavepass.runtime.cuda.dispatch import kernel_arguments
from weavepass.runtime.cuda.launch_plan import LaunchOverrides, choose_launch_plan
from weavepass.runtime.cuda.quant_epilogue import QuantEpilogue, plan_quant_epilogue
from weavepass.runtime.cuda.support import MAX_WORLD
from weavepass.runtime.cuda.workspace import _Workspace, lamport_flag_slot, lamport_region_elements
from weavepass.runtime.portable import rows_per_rank
from weavepass.runtime.quant import decode_steps, encode_steps, quantize_rows
from weavepass.runtime.reference import fused_allreduce_rmsnorm_reference
from weavepass.testing.quant import FP8, FP8_MAX, FUSED_FORMS, STATIC_ACT_SCALE
from weavepass.testing.quant_steps import form_steps

TOKENS, HIDDEN, EPS = 5, 256, 1e-6  # odd rows; two groups of 128
TIMEOUT_S = 240
ALGORITHMS = {
    "one_shot": LaunchOverrides(one_shot=True, lamport=False, num_ctas=2, tile_elements=2 * HIDDEN),
    "two_shot": LaunchOverrides(one_shot=False, pipelined=False, num_ctas=2, tile_elements=2 * HIDDEN),
    "pipelined": LaunchOverrides(one_shot=False, pipelined=True, num_ctas=1, tile_elements=HIDDEN, chunk_tiles=1),
    # the software-pipelined loads' loops (two tiles per chunk: the loop body runs twice)
    "pipelined_loads": LaunchOverrides(one_shot=False, pipelined=True, num_ctas=1, tile_elements=HIDDEN,
                                       chunk_tiles=2, load_stages=2),
    "lamport": LaunchOverrides(lamport=True, num_ctas=2, tile_elements=2 * HIDDEN),
}


def cuda_division(steps: str) -> str:
    """``steps`` with each division by a number written as ATen computes it on CUDA: a
    multiplication by the number's fp32 reciprocal (``BinaryDivTrueKernel.cu``)."""
    return encode_steps([("mul", float(np.float32(1.0) / np.float32(arg))) if name == "div" else (name, arg)
                         for name, arg in decode_steps(steps)])


def inputs(dtype, world):
    """Every rank's partial sums, a residual and a norm weight with large entries (static codes
    saturate at +-448, dynamic ones reach the largest code) and tiny ones (fp8 subnormals)."""
    gen = torch.Generator().manual_seed(0)
    partials = [torch.randn(TOKENS, HIDDEN, generator=gen).to(dtype) for _ in range(world)]
    residual = torch.randn(TOKENS, HIDDEN, generator=gen).to(dtype)
    weight = 1 + 0.1 * torch.randn(HIDDEN, generator=gen)
    weight[:8] = 12.0
    weight[8:16] = 1e-3
    return partials, residual, weight.to(dtype)


def workspaces(world, dtype):
    capacity = world * TOKENS * HIDDEN
    size = torch.empty((), dtype=dtype).element_size()
    buffers = []
    for _ in range(world):
        buffer = torch.full((2 * capacity + lamport_region_elements(world, size),), float("nan"), dtype=dtype)
        buffer[2 * capacity:] = -0.0  # the Lamport region starts "empty"
        buffers.append(buffer.share_memory_())
    pads = [torch.zeros(lamport_flag_slot(world) + 2, dtype=torch.int32).share_memory_() for _ in range(world)]
    padding = [0] * (MAX_WORLD - world)
    return [_Workspace(buffers[r], pads[r], capacity,
                       (*[(b.data_ptr() - buffers[r].data_ptr()) // size for b in buffers], *padding),
                       (*[(p.data_ptr() - pads[r].data_ptr()) // 4 for p in pads], *padding), r, world)
            for r in range(world)]


def run_ranks(world, algorithm, dtype, partials, residual, weight, epilogue, static, outputs):
    """Every rank's kernel (forked processes for two ranks), writing into the shared ``outputs``."""
    spaces = workspaces(world, dtype)
    plan = choose_launch_plan(TOKENS, HIDDEN, partials[0].element_size(), world, ALGORITHMS[algorithm])
    qconst = epilogue.constants_tensor("cpu")

    def rank_main(rank):
        kernel, tail, meta = kernel_arguments(plan, spaces[rank], HIDDEN, True, partials[0].element_size(),
                                              TOKENS, False, False, epilogue)
        normed, residual_out, codes, scales = outputs[rank]
        kernel[(plan.num_ctas,)](partials[rank], residual, weight, normed, residual_out, weight, weight,
                                 codes, scales, weight if static is None else static, qconst, *tail, EPS, **meta)

    if world == 1:
        rank_main(0)
        return plan

    def forked(rank):
        try:
            rank_main(rank)
        except BaseException:
            import traceback

            traceback.print_exc()
            os._exit(1)
        os._exit(0)

    ranks = [multiprocessing.get_context("fork").Process(target=forked, args=(r,)) for r in range(world)]
    for p in ranks:
        p.start()
    deadline = time.monotonic() + TIMEOUT_S
    for p in ranks:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in ranks:
        if p.is_alive():
            p.kill()
            sys.exit(f"a rank still waits after {TIMEOUT_S} s ({algorithm})")
    if any(p.exitcode != 0 for p in ranks):
        sys.exit(f"rank exit codes {[p.exitcode for p in ranks]} ({algorithm})")
    return plan


def e4m3_step(v: torch.Tensor) -> torch.Tensor:
    """The spacing of float8_e4m3fn at each |v| (subnormals below 2^-6 step 2^-9)."""
    a = v.abs()
    normal_step = torch.exp2(torch.floor(torch.log2(a.clamp_min(2.0**-6))) - 3)
    return torch.where(a < 2.0**-6, torch.full_like(a, 2.0**-9), normal_step)


def check_form(form, world, algorithm, dtype):
    scale_steps, code_steps, group = form_steps(form, dtype)
    static = torch.tensor(STATIC_ACT_SCALE, dtype=torch.float32) if form.startswith("fp8_static") else None
    partials, residual, weight = inputs(dtype, world)
    code_dtype = torch.int8 if form.startswith("int8") else FP8
    groups = HIDDEN // group if group else 1
    results = {}
    for return_normed in (True, False):
        epilogue = plan_quant_epilogue(dtype, HIDDEN, None if static is None else (torch.float32, 0), group,
                                       scale_steps, code_steps, return_normed)
        assert isinstance(epilogue, QuantEpilogue), (form, epilogue)
        assert epilogue.code_dtype == code_dtype
        outputs = [(torch.full((TOKENS, HIDDEN), float("nan"), dtype=dtype).share_memory_(),
                    torch.empty(TOKENS, HIDDEN, dtype=dtype).share_memory_(),
                    torch.empty(TOKENS, HIDDEN, dtype=code_dtype).share_memory_(),
                    torch.full((1,) if static is not None else (TOKENS * groups,), float("nan")).share_memory_())
                   for _ in range(world)]
        plan = run_ranks(world, algorithm, dtype, partials, residual, weight, epilogue, static, outputs)
        assert (plan.one_shot, plan.pipelined, plan.lamport) == (
            algorithm in ("one_shot", "lamport"), algorithm.startswith("pipelined"), algorithm == "lamport"), plan
        results[return_normed] = outputs
    label = f"{form} {dtype} world {world} {algorithm} ({plan})"

    _, want_res = fused_allreduce_rmsnorm_reference(partials, residual, weight, EPS, dtype)
    normed_tol = {torch.bfloat16: 2**-6, torch.float16: 2**-9}[dtype]
    # residual_out = round(round(S) + r): within two roundings of |S| + |r| (the interpreter's
    # fp32 -> bf16 cast truncates, so one rounding of S can be a whole ulp; on the GPU it is half)
    magnitude = sum(p.float() for p in partials).abs() + residual.float().abs()
    res_bound = 2 * magnitude * torch.finfo(dtype).eps + 1e-6
    normed = results[True][0][0]
    for rank in range(world):
        res_out = results[True][rank][1].float()
        assert ((res_out - want_res.float()).abs() <= res_bound).all(), label
        # the normed rows: the RMSNorm (fp32) of the kernel's own residual_out, within two roundings
        own_normed = res_out * torch.rsqrt(res_out.pow(2).mean(-1, keepdim=True) + EPS) * weight.float()
        torch.testing.assert_close(results[True][rank][0].float(), own_normed, rtol=normed_tol, atol=1e-5,
                                   msg=lambda m: f"{label}: {m}")
        assert torch.equal(results[True][rank][0], normed), label  # every rank the same rows
        assert results[False][rank][0].isnan().all(), label  # not written without return_normed
        for with_normed in (True, False):  # every rank, with or without the normed rows: the same
            _, _, codes, scales = results[with_normed][rank]
            assert torch.equal(codes.view(torch.uint8), results[True][0][2].view(torch.uint8)), label
            assert torch.equal(scales, results[True][0][3]), label

    _, _, codes, scales = results[True][0]
    codes = codes.reshape(TOKENS, groups, -1) if group else codes
    scales = scales if static is not None else scales.reshape(TOKENS, groups, 1) if group else scales.reshape(TOKENS, 1)
    # 1. eager's steps as ATen runs them on CUDA, on the kernel's normed rows: bit for bit
    cuda_codes, cuda_scales = quantize_rows(normed, static, group, cuda_division(scale_steps), code_steps)
    assert torch.equal(codes.view(torch.uint8), cuda_codes.view(torch.uint8)), label
    assert torch.equal(scales, cuda_scales.reshape(scales.shape)), (label, scales, cuda_scales)
    # 2. eager on the CPU (a true division by a number): scales within one fp32 rounding, codes
    # equal where the scale is, else one code step apart
    cpu_codes, cpu_scales = quantize_rows(normed, static, group, scale_steps, code_steps)
    cpu_scales = cpu_scales.reshape(scales.shape)
    ulp = (torch.nextafter(cpu_scales.abs(), torch.full_like(cpu_scales, float("inf"))) - cpu_scales.abs())
    assert ((scales - cpu_scales).abs() <= ulp).all(), label
    ours, theirs = codes.float().reshape(TOKENS, HIDDEN), cpu_codes.float().reshape(TOKENS, HIDDEN)
    same_scale = (scales == cpu_scales).expand(*scales.shape[:-1], HIDDEN // groups).reshape(TOKENS, HIDDEN) \
        if static is None else torch.ones(TOKENS, HIDDEN, dtype=torch.bool)
    assert torch.equal(ours[same_scale], theirs[same_scale]), label
    step = torch.ones_like(ours) if code_dtype == torch.int8 else torch.maximum(e4m3_step(ours), e4m3_step(theirs))
    assert ((ours - theirs).abs() <= step).all(), label
    # the inputs reach the format's limits: the largest code, and fp8 subnormals
    assert (ours.abs() == (127 if code_dtype == torch.int8 else FP8_MAX)).any(), label
    if code_dtype == FP8:
        assert ((ours.abs() < 2.0**-6) & (ours != 0)).any(), label
    differ = int((~same_scale).sum())
    print(f"{label}: codes and scales OK ({differ} codes under a scale one fp32 rounding from the CPU's)")


def main(world: int, algorithm: str, dtype: torch.dtype) -> None:
    assert rows_per_rank(TOKENS, world) * world >= TOKENS
    for fast in (True, False):  # the reciprocal division (kernels._divide_rn), then div.rn per element
        quant_epilogue.FAST_ARITHMETIC = fast
        print(f"quant_epilogue.FAST_ARITHMETIC = {fast}")
        for form in FUSED_FORMS:
            check_form(form, world, algorithm, dtype)
    print("quant kernels: OK")


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], getattr(torch, sys.argv[3]))
