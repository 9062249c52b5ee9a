"""Which quantizations the CUDA kernel carries in its norm epilogue, and their compile-time form.

``weave.fused_allreduce_rmsnorm_quant`` carries the graph's own quantization steps as text
(``weavepass.runtime.quant``). The kernel (``kernels._quantize_rows``) runs a fixed shape of
program on the normed rows while they are in registers:

    s = scale_ops(amax(|y|))      per row, per group of GROUP columns | the static scale (one fp32)
    q = cast(code_ops(div(y, s)))  division in fp32, then round / clamps in fp32, cast to fp8 e4m3 or int8

``plan_quant_epilogue`` reads the step text into that shape (``QuantEpilogue``: one packed
constexpr and 16 fp32 constants) or says why the kernel does not carry it (an ``Unsupported`` of a
``QuantFormIssue``); then the site keeps the quantization outside the fused op (compile time) or the
call runs the portable lowering (run time).

Rounding, against eager on the same GPU (``quantize_rows`` on CUDA tensors):

* every step computes in fp32 and rounds to the step's dtype, as ATen's CUDA kernels do
  (``opmath``); a division by a number is a multiplication by its fp32 reciprocal, as ATen's CUDA
  ``div`` by a scalar is (``BinaryDivTrueKernel.cu``), a tensor division and ``reciprocal`` are
  IEEE-rounded (``tl.div_rn``), ``round`` is half-to-even, the fp8 cast rounds to nearest even. So
  codes and scales equal eager's bit for bit on the GPU;
* against eager on the CPU (the interpreter tests) a division by a number is IEEE-rounded there:
  the scale may differ by one fp32 rounding, and a code by one step where it does;
* a clamp's bound is taken in fp32 and the result rounded to the step's dtype (eager rounds the
  bound to a bf16/fp16 tensor's dtype directly): the two differ only when the bound is hit, i.e.
  for rows whose amax is below it (all-zero rows), and then at most by one rounding of the bound.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from weavepass.config import StrEnum
from weavepass.runtime.issue import Unsupported, register
from weavepass.runtime.quant import decode_steps

# Scale ops (after the amax), a nibble each; constants at qconst[i].
SCALE_MUL, SCALE_CLAMP_MIN, SCALE_CLAMP_MAX, SCALE_ROUND_BF16, SCALE_ROUND_FP16 = 1, 2, 3, 4, 5
# Code ops, a nibble each; constants at qconst[8 + i].
CODE_DIV, CODE_MUL_RECIPROCAL, CODE_ROUND, CODE_CLAMP_MIN, CODE_CLAMP_MAX, CODE_CAST_FP8, CODE_CAST_INT8 = range(1, 8)
MAX_OPS = 6
"""Ops per program (six nibbles of the packed constexpr)."""
STATIC, DYNAMIC = 1, 2
ARITH_RECIPROCAL, ARITH_HARDWARE_FP8, ARITH_SATURATE = 1, 2, 4
"""How the kernel runs three steps (bits 56-58 of its ``QUANT``; ``kernel_quant``): the division by
the scale through one reciprocal per scale and a correction per element
(``kernels._divide_rn``); the fp8 cast as the GPU's ``cvt.rn.satfinite`` alone; and, with that
cast, no clamps when they are exactly fp8's [-448, 448] (the cast saturates to the same codes, and
keeps a NaN as eager's clamp does). Either way the codes are eager's; without them, ``div.rn`` per
element, the clamps, and a written-out fp8 rounding."""
FAST_ARITHMETIC = True
"""Whether launches use ``ARITH_*`` (False: the first version's per-element IEEE division and
software fp8 rounding; benchmarks/bench_local_cost.py ``--quant`` measures both)."""
CODE_DTYPES = (torch.float8_e4m3fn, torch.int8)
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)
_ROUND = {torch.bfloat16: SCALE_ROUND_BF16, torch.float16: SCALE_ROUND_FP16}
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class QuantEpilogue:
    """The quantization as ``kernels._quantize_rows`` runs it."""

    packed: int
    """The kernels' ``QUANT`` constexpr: bits 0-1 mode (1 static, 2 dynamic), bit 2 store the normed
    rows too, bits 3-7 log2 of the group width (0: per row), bits 8-31 the scale ops, 32-55 the code
    ops (a nibble each, first op lowest); ``kernel_quant`` adds bits 56-57 (``ARITH_*``)."""
    constants: tuple[float, ...]
    """16 fp32 values: the scale ops' constants, then (from 8) the code ops'."""
    code_dtype: torch.dtype
    scale_dtype: torch.dtype
    """The dynamic scales' dtype (the scale program's last dtype); static: the static scale's."""
    group_size: int

    def constants_tensor(self, device) -> torch.Tensor:
        return torch.tensor(self.constants, dtype=torch.float32, device=device)


class QuantFormIssue(StrEnum):
    """Why the kernel's epilogue does not carry a quantization's form (``plan_quant_epilogue``,
    ``support.cuda_quant_epilogue``); the compile side reports each as the ``ReasonCode`` of the same
    value (``weavepass.compile.reasons.RUNTIME_ISSUES``)."""

    STATIC_SCALE_PER_GROUP = "quant_form_static_scale_per_group"
    GROUP_SIZE = "quant_form_group_size"
    STATIC_SCALE_DTYPE = "quant_form_static_scale_dtype"
    STATIC_SCALE_NOT_SCALAR = "quant_form_static_scale_not_scalar"
    """(Run time) the static scale is not one number on the partial sums' device."""
    TOO_MANY_STEPS = "quant_form_too_many_steps"
    SCALE_NOT_AMAX = "quant_form_scale_not_amax"
    SCALE_CAST = "quant_form_scale_cast"
    SCALE_STEP = "quant_form_scale_step"
    SCALE_NO_AMAX = "quant_form_scale_no_amax"
    CODE_DTYPE = "quant_form_code_dtype"
    FP8_NOT_CLAMPED = "quant_form_fp8_not_clamped"
    CODE_CAST_EARLY = "quant_form_code_cast_early"
    DIVISION_NOT_FIRST = "quant_form_division_not_first"
    RECIPROCAL_DTYPE = "quant_form_reciprocal_dtype"
    DIVISION_DTYPE = "quant_form_division_dtype"
    STEP_BEFORE_DIVISION = "quant_form_step_before_division"
    CODE_STEP = "quant_form_code_step"
    NO_CODE_CAST = "quant_form_no_code_cast"
    FP8_CAPABILITY = "quant_form_fp8_capability"
    """fp8 codes on a GPU older than sm_89 (``support.FP8_CAPABILITY``): ``capability``, ``(major, minor)``."""


register({
    QuantFormIssue.STATIC_SCALE_PER_GROUP: "a static scale per group",
    QuantFormIssue.GROUP_SIZE: "its groups of {group_size} are not a power of two dividing the hidden size {hidden}",
    QuantFormIssue.STATIC_SCALE_DTYPE: "its static scale is {dtype}, not fp32",
    QuantFormIssue.STATIC_SCALE_NOT_SCALAR: "the static scale is not one number on the partial sums' device",
    QuantFormIssue.TOO_MANY_STEPS: "it has more than {max_ops} steps",
    QuantFormIssue.SCALE_NOT_AMAX: "its scale does not start as amax(|x|) (step {step!r})",
    QuantFormIssue.SCALE_CAST: "its scale is cast to {dtype}",
    QuantFormIssue.SCALE_STEP: "its scale has a step the kernel does not run ({step!r})",
    QuantFormIssue.SCALE_NO_AMAX: "its scale has no amax",
    QuantFormIssue.CODE_DTYPE: "its codes are {dtype}, not fp8 e4m3 or int8",
    QuantFormIssue.FP8_NOT_CLAMPED: ("its codes are not clamped to +-448 before the fp8 cast (eager makes an "
                                     "overflow NaN; the kernel rounds clamped values only)"),
    QuantFormIssue.CODE_CAST_EARLY: "its codes are cast to {dtype} before the last step",
    QuantFormIssue.DIVISION_NOT_FIRST: "its division by the scale is not its first arithmetic step",
    QuantFormIssue.RECIPROCAL_DTYPE: "its scale's reciprocal is taken in {dtype}",
    QuantFormIssue.DIVISION_DTYPE: "it divides by the scale in {dtype}; the kernel divides in fp32",
    QuantFormIssue.STEP_BEFORE_DIVISION: "its codes take step {step!r} before the division by the scale",
    QuantFormIssue.CODE_STEP: "its codes have a step the kernel does not run ({step!r})",
    QuantFormIssue.NO_CODE_CAST: "its codes end without a cast to fp8 or int8",
    QuantFormIssue.FP8_CAPABILITY: (
        "fp8 codes need a GPU of compute capability 8.9 or newer; this one is {capability[0]}.{capability[1]}"),
})


def interpreting() -> bool:
    """Whether Triton's interpreter runs the kernels (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def kernel_quant(epilogue: QuantEpilogue) -> int:
    """The kernels' ``QUANT`` constexpr for ``epilogue``: its packed form with the ``ARITH_*`` bits
    (while ``FAST_ARITHMETIC``). The hardware fp8 cast only on a GPU: Triton's interpreter rounds
    fp32 -> fp8 subnormals wrongly (Triton 3.9), so there the rounding stays written out, and the
    interpreter tests check the reciprocal division."""
    if not FAST_ARITHMETIC:
        return epilogue.packed
    arith = ARITH_RECIPROCAL
    if not interpreting():
        arith |= ARITH_HARDWARE_FP8 | (ARITH_SATURATE if _clamps_to_fp8_range(epilogue) else 0)
    return epilogue.packed | arith << 56


def _clamps_to_fp8_range(epilogue: QuantEpilogue) -> bool:
    """Whether the codes are cast to fp8 and every clamp before the cast is fp8's own bound
    (``clamp_min(-448)``, ``clamp_max(448)``): ``cvt.rn.satfinite`` alone then gives the same codes."""
    ops = [(epilogue.packed >> (32 + 4 * i)) & 15 for i in range(MAX_OPS)]
    if CODE_CAST_FP8 not in ops:
        return False
    bounds = {CODE_CLAMP_MIN: -FP8_MAX, CODE_CLAMP_MAX: FP8_MAX}
    return all(epilogue.constants[8 + i] == bounds[op] for i, op in enumerate(ops) if op in bounds)


def _f32(value: float) -> float:
    return float(np.float32(value))


def _reciprocal_f32(value: float) -> float:
    """``fp32(1 / fp32(c))``: what ATen's CUDA division by the scalar ``c`` multiplies by."""
    return float(np.float32(1.0) / np.float32(value))


def _pack(ops: list[int]) -> int:
    return sum(op << (4 * i) for i, op in enumerate(ops))


def _scale_program(steps, out_dtype: torch.dtype) -> tuple[list[int], list[float], torch.dtype] | Unsupported:
    """``abs`` and ``amax`` (in any float dtype that holds ``out_dtype`` exactly), then numbers."""
    dtype, ops, consts, seen_abs, seen_amax = out_dtype, [], [], False, False
    for name, arg in steps:
        if not seen_amax:
            if name == "convert" and arg in _FLOATS and torch.promote_types(arg, dtype) == arg:
                dtype = arg  # a widening cast is exact
            elif name == "abs":
                seen_abs = True
            elif name == "amax" and seen_abs:
                seen_amax = True
            else:
                return Unsupported.of(QuantFormIssue.SCALE_NOT_AMAX, step=name)
            continue
        if name == "convert":
            if arg not in _FLOATS:
                return Unsupported.of(QuantFormIssue.SCALE_CAST, dtype=arg)
            if torch.promote_types(arg, dtype) != arg:  # narrowing: a rounding
                ops.append(_ROUND[arg])
                consts.append(0.0)
            dtype = arg
            continue
        if name in ("div", "mul"):
            ops.append(SCALE_MUL)
            consts.append(_reciprocal_f32(arg) if name == "div" else _f32(arg))
        elif name in ("clamp_min", "clamp_max"):
            ops.append(SCALE_CLAMP_MIN if name == "clamp_min" else SCALE_CLAMP_MAX)
            consts.append(_f32(arg))
        else:
            return Unsupported.of(QuantFormIssue.SCALE_STEP, step=name)
        if dtype in _ROUND:
            ops.append(_ROUND[dtype])
            consts.append(0.0)
    if not seen_amax:
        return Unsupported(QuantFormIssue.SCALE_NO_AMAX)
    return ops, consts, dtype


def _code_program(steps, out_dtype: torch.dtype, scale_dtype: torch.dtype,
                  scale_ndim: int) -> tuple[list[int], list[float], torch.dtype] | Unsupported:
    """A widening cast, the division by the scale in fp32, round / clamps, the cast to the codes."""
    dtype, ops, consts, lo, hi = out_dtype, [], [], None, None
    for i, (name, arg) in enumerate(steps):
        last = i == len(steps) - 1
        if name == "convert" and last:
            if arg not in CODE_DTYPES:
                return Unsupported.of(QuantFormIssue.CODE_DTYPE, dtype=arg)
            if arg == torch.float8_e4m3fn and (lo is None or hi is None or lo < -FP8_MAX or hi > FP8_MAX):
                return Unsupported(QuantFormIssue.FP8_NOT_CLAMPED)
            ops.append(CODE_CAST_FP8 if arg == torch.float8_e4m3fn else CODE_CAST_INT8)
            consts.append(0.0)
            return ops, consts, arg
        if name == "convert":
            if arg not in _FLOATS or torch.promote_types(arg, dtype) != arg:
                return Unsupported.of(QuantFormIssue.CODE_CAST_EARLY, dtype=arg)
            dtype = arg
        elif name in ("div_scale", "mul_scale_reciprocal"):
            if ops:
                return Unsupported(QuantFormIssue.DIVISION_NOT_FIRST)
            if name == "mul_scale_reciprocal" and scale_dtype != torch.float32:
                return Unsupported.of(QuantFormIssue.RECIPROCAL_DTYPE, dtype=scale_dtype)
            x = torch.empty((2, 2), dtype=dtype, device="meta")
            s = torch.empty((1,) * scale_ndim, dtype=scale_dtype, device="meta")
            dtype = torch.result_type(x, s)
            if dtype != torch.float32:
                return Unsupported.of(QuantFormIssue.DIVISION_DTYPE, dtype=dtype)
            ops.append(CODE_DIV if name == "div_scale" else CODE_MUL_RECIPROCAL)
            consts.append(0.0)
        elif not ops:
            return Unsupported.of(QuantFormIssue.STEP_BEFORE_DIVISION, step=name)
        elif name == "round":
            ops.append(CODE_ROUND)
            consts.append(0.0)
        elif name in ("clamp_min", "clamp_max"):
            ops.append(CODE_CLAMP_MIN if name == "clamp_min" else CODE_CLAMP_MAX)
            consts.append(_f32(arg))
            lo = arg if name == "clamp_min" else lo
            hi = arg if name == "clamp_max" else hi
        else:
            return Unsupported.of(QuantFormIssue.CODE_STEP, step=name)
    return Unsupported(QuantFormIssue.NO_CODE_CAST)


def plan_quant_epilogue(
    out_dtype: torch.dtype, hidden: int, static_scale: tuple[torch.dtype, int] | None, group_size: int,
    scale_steps: str, code_steps: str, return_normed: bool,
) -> QuantEpilogue | Unsupported:
    """The kernel's form of a quantization (module docstring), or why it does not carry it.
    ``static_scale``: the static scale's ``(dtype, ndim)``, or None for a dynamic one."""
    if group_size:
        if static_scale is not None:
            return Unsupported(QuantFormIssue.STATIC_SCALE_PER_GROUP)
        if hidden % group_size or group_size & (group_size - 1) or not 2 <= group_size < 1 << 16:
            return Unsupported.of(QuantFormIssue.GROUP_SIZE, group_size=group_size, hidden=hidden)
    if static_scale is not None:
        scale_dtype, scale_ndim = static_scale
        if scale_dtype != torch.float32:
            return Unsupported.of(QuantFormIssue.STATIC_SCALE_DTYPE, dtype=scale_dtype)
        scale_ops, scale_consts = [], []
    else:
        scale = _scale_program(decode_steps(scale_steps), out_dtype)
        if isinstance(scale, Unsupported):
            return scale
        scale_ops, scale_consts, scale_dtype = scale
        scale_ndim = 2
    codes = _code_program(decode_steps(code_steps), out_dtype, scale_dtype, scale_ndim)
    if isinstance(codes, Unsupported):
        return codes
    code_ops, code_consts, code_dtype = codes
    if len(scale_ops) > MAX_OPS or len(code_ops) > MAX_OPS:
        return Unsupported.of(QuantFormIssue.TOO_MANY_STEPS, max_ops=MAX_OPS)
    mode = STATIC if static_scale is not None else DYNAMIC
    group_log2 = group_size.bit_length() - 1 if group_size else 0
    packed = mode | int(return_normed) << 2 | group_log2 << 3 | _pack(scale_ops) << 8 | _pack(code_ops) << 32
    constants = [0.0] * 16
    constants[:len(scale_consts)] = scale_consts
    constants[8:8 + len(code_consts)] = code_consts
    return QuantEpilogue(packed, tuple(constants), code_dtype, scale_dtype, group_size)
