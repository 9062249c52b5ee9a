"""Lowerings turn a ``weave`` op into kernels, torch_npu calls or portable collectives.

Every lowering of ``weave.fused_allreduce_rmsnorm`` is a ``FusedLowering`` with the math of
``weavepass.runtime.reference``. The planner picks one by name at compile time and writes the name
into the op call, so the choice is visible in the graph and in the explain report.

Runtime code never imports ``weavepass.ops`` or ``weavepass.compile``: the ops package registers
these functions as the ops' kernels (importing them on first call), and the compile side only asks
the support checks (``weavepass.runtime.cuda.support``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Protocol, cast

import torch

from weavepass.config import Lowering, StrEnum
from weavepass.runtime.issue import Unsupported, register


class FusedLowering(Protocol):
    """A lowering of ``weave.fused_allreduce_rmsnorm``.

    ``partial`` and ``residual`` are ``[..., H]`` (same shape), ``weight`` is ``[H]``; ``residual``
    may be None (the reduced sum is then the residual stream) and so may ``weight`` (a norm without
    scale). Returns ``(normed, residual_out)``, both shaped like ``partial``: ``normed`` in
    ``out_dtype``, ``residual_out = all_reduce(partial) + residual`` in ``partial.dtype``. Fresh
    tensors: nothing is mutated or aliased. ``max_workspace_tokens`` is the largest batch a lowering
    with a preallocated workspace serves (the op call's ``workspace_tokens``, from
    ``WeaveConfig.cuda_workspace_tokens``); lowerings without one ignore it. With ``return_inv_rms``
    a third output follows: the per-row inverse RMS ``[..., 1]`` in
    ``reference.accumulation_dtype`` (a training graph saves it for backward).
    """

    def __call__(
        self,
        partial: torch.Tensor,
        residual: torch.Tensor | None,
        weight: torch.Tensor | None,
        eps: float,
        group_name: str,
        out_dtype: torch.dtype,
        *,
        max_workspace_tokens: int,
        return_inv_rms: bool = False,
    ) -> tuple[torch.Tensor, ...]: ...


_KERNELS: dict[tuple[str, str], str] = {
    ("fused_allreduce_rmsnorm", Lowering.PORTABLE): "weavepass.runtime.portable:fused_allreduce_rmsnorm_portable",
    ("fused_allreduce_rmsnorm", Lowering.CUDA_SYMM): "weavepass.runtime.cuda.dispatch:fused_allreduce_rmsnorm_cuda",
    ("fused_allreduce_layernorm", Lowering.PORTABLE):
        "weavepass.runtime.portable:fused_allreduce_layernorm_portable",
    ("fused_allreduce_layernorm", Lowering.CUDA_SYMM):
        "weavepass.runtime.cuda.dispatch:fused_allreduce_layernorm_cuda",
    ("fused_allreduce_rmsnorm_quant", Lowering.PORTABLE):
        "weavepass.runtime.portable:fused_allreduce_rmsnorm_quant_portable",
    ("fused_allreduce_rmsnorm_quant", Lowering.CUDA_SYMM):
        "weavepass.runtime.cuda.dispatch:fused_allreduce_rmsnorm_quant_cuda",
    ("matmul_reduce_scatter_rmsnorm", Lowering.PORTABLE):
        "weavepass.runtime.portable:matmul_reduce_scatter_rmsnorm_portable",
    ("matmul_reduce_scatter_rmsnorm", Lowering.CUDA_SYMM):
        "weavepass.runtime.cuda.matmul:matmul_reduce_scatter_rmsnorm_cuda",
    ("matmul_reduce_scatter_rmsnorm_shard", Lowering.PORTABLE):
        "weavepass.runtime.portable:matmul_reduce_scatter_rmsnorm_shard_portable",
    ("matmul_reduce_scatter_rmsnorm_shard", Lowering.CUDA_SYMM):
        "weavepass.runtime.cuda.matmul:matmul_reduce_scatter_rmsnorm_shard_cuda",
    ("all_gather_matmul", Lowering.PORTABLE): "weavepass.runtime.portable:all_gather_matmul_portable",
    ("all_gather_matmul", Lowering.CUDA_SYMM): "weavepass.runtime.cuda.gather_op:all_gather_matmul_cuda",
}
"""``(op, lowering)`` -> the lowering's kernel of ``weave.<op>``, ``"module:function"``; modules
that need triton or torch_npu are imported on first use only. Every kernel takes the op's arguments
up to ``lowering`` (exclusive) positionally and ``max_workspace_tokens`` (the op call's
``workspace_tokens``) as a keyword; a kernel without a preallocated workspace ignores it."""
_LOADED: dict[tuple[str, str], Callable[..., Any]] = {}


def carrying(op: str) -> tuple[str, ...]:
    """The lowerings with a kernel of ``weave.<op>``."""
    return tuple(lowering for (name, lowering) in _KERNELS if name == op)


def _kernel(op: str, lowering: str) -> Callable[..., Any]:
    """The kernel of ``weave.<op>`` by the lowering named ``lowering`` (imported on first use). Op
    kernels call this once per op call: a known pair costs one dict lookup."""
    key = (op, lowering)
    run = _LOADED.get(key)
    if run is not None:
        return run
    path = _KERNELS.get(key)
    if path is None:
        if lowering not in set(Lowering):
            raise ValueError(f"unknown weave lowering {lowering!r}; known lowerings: {lowering_names()}")
        raise ValueError(f"weave lowering {lowering!r} does not carry weave.{op}; it needs one of "
                         f"{[str(n) for n in carrying(op)]}")
    module_name, attr = path.split(":")
    run = _LOADED[key] = getattr(importlib.import_module(module_name), attr)
    return run


def get_lowering(name: str) -> FusedLowering:
    """The ``FusedLowering`` (the kernel of ``weave.fused_allreduce_rmsnorm``) registered under ``name``."""
    return cast(FusedLowering, _kernel("fused_allreduce_rmsnorm", name))


def lowering_names() -> list[str]:
    return sorted(str(n) for n in Lowering)


LAYER_NORM_LOWERINGS = carrying("fused_allreduce_layernorm")
"""Lowerings that carry a LayerNorm (``weave.fused_allreduce_layernorm``): every one."""
assert set(carrying("fused_allreduce_rmsnorm")) == set(Lowering) == set(LAYER_NORM_LOWERINGS)


def fused_allreduce_rmsnorm(partial, residual, weight, eps, group_name, out_dtype, lowering,
                            workspace_tokens):
    """The kernel of ``weave.fused_allreduce_rmsnorm`` (schema and fake: ``weavepass.ops``): runs
    the ``FusedLowering`` named ``lowering``. Compiled graphs call it directly, once per site and
    forward pass (``weavepass.compile.direct_calls``)."""
    return _kernel("fused_allreduce_rmsnorm", lowering)(partial, residual, weight, eps, group_name, out_dtype,
                                                         max_workspace_tokens=workspace_tokens)


def fused_allreduce_rmsnorm_train(partial, residual, weight, eps, group_name, out_dtype, lowering,
                                  workspace_tokens):
    """The kernel of ``weave.fused_allreduce_rmsnorm_train``: ``(normed, residual_out, inv_rms)``."""
    return _kernel("fused_allreduce_rmsnorm", lowering)(partial, residual, weight, eps, group_name, out_dtype,
                                                         max_workspace_tokens=workspace_tokens, return_inv_rms=True)


def fused_allreduce_layernorm(partial, residual, weight, bias, eps, group_name, out_dtype, lowering,
                              workspace_tokens, **overrides):
    """The kernel of ``weave.fused_allreduce_layernorm``: ``(normed, residual_out)`` with a
    LayerNorm (``weavepass.runtime.reference.add_layernorm_local``) by the lowering named ``lowering``.
    ``overrides`` go to a lowering with a workspace (the async op's ``num_ctas``)."""
    return _kernel("fused_allreduce_layernorm", lowering)(partial, residual, weight, bias, eps, group_name,
                                                           out_dtype, max_workspace_tokens=workspace_tokens,
                                                           **overrides)


MATMUL_LOWERINGS = carrying("matmul_reduce_scatter_rmsnorm")
"""Lowerings that carry ``weave.matmul_reduce_scatter_rmsnorm`` and its sharded form: the portable
one, and ``cuda_symm`` (``runtime.cuda.matmul``: the scatter-epilogue GEMM and its reduce on a
symmetric workspace, and for the full stream a push of the owners' rows to every rank)."""
assert carrying("matmul_reduce_scatter_rmsnorm_shard") == MATMUL_LOWERINGS


def matmul_unsupported_reason(lowering: str) -> str | None:
    """Why ``lowering`` cannot run ``weave.matmul_reduce_scatter_rmsnorm`` (and its sharded form), or None."""
    if lowering in MATMUL_LOWERINGS:
        return None
    return "no kernel of the op runs there"


def matmul_measured_speed(lowering: str, tokens: int | None, hidden: int, k: int) -> float | None:
    """How fast ``lowering``'s GEMM of the op runs against the plain matmul (cuBLAS) for rows
    ``[tokens, k] @ [k, hidden]``, as measured (above 1: faster), or None where nobody measured it.
    ``cuda_symm``: ``runtime.cuda.gemm.measured_speed``; a symbolic token count (None) takes the
    slower of the measured token buckets, None unless every bucket is measured. Other lowerings run
    the plain matmul: None (nothing to gain)."""
    if lowering != Lowering.CUDA_SYMM:
        return None
    from weavepass.runtime.cuda.gemm import TOKEN_BUCKETS, measured_speed

    counts = TOKEN_BUCKETS if tokens is None else (tokens,)
    speeds = [measured_speed(m, hidden, k) for m in counts]
    return None if any(s is None for s in speeds) else min(s for s in speeds if s is not None)


def matmul_reduce_scatter_rmsnorm(x, mat2, residual, weight, eps, group_name, out_dtype, lowering,
                                  workspace_tokens):
    """The kernel of ``weave.matmul_reduce_scatter_rmsnorm``: ``(normed, residual_out)`` ``[T, H]``
    of ``x @ mat2``'s sum over ranks by the lowering named ``lowering``."""
    return _kernel("matmul_reduce_scatter_rmsnorm", lowering)(x, mat2, residual, weight, eps, group_name, out_dtype,
                                                               max_workspace_tokens=workspace_tokens)


def matmul_reduce_scatter_rmsnorm_shard(x, mat2, residual, weight, eps, group_name, out_dtype, rows_per_rank,
                                        lowering, workspace_tokens):
    """The kernel of ``weave.matmul_reduce_scatter_rmsnorm_shard``: this rank's ``[rows_per_rank, H]``
    rows of ``(normed, residual_out)`` (FlashComm's sharded stream)."""
    return _kernel("matmul_reduce_scatter_rmsnorm_shard", lowering)(
        x, mat2, residual, weight, eps, group_name, out_dtype, rows_per_rank, max_workspace_tokens=workspace_tokens)


GATHER_LOWERINGS = carrying("all_gather_matmul")
"""Lowerings that carry ``weave.all_gather_matmul``: the portable one (all_gather + mm) and
``cuda_symm`` (``runtime.cuda.gather_op``: the owners' push and the gather GEMM on a symmetric
workspace)."""


def all_gather_matmul(shard, mat2s, group_name, num_tokens, lowering, workspace_tokens):
    """The kernel of ``weave.all_gather_matmul``: ``[num_tokens, N_i]`` for each ``mat2s[i]``, the
    gathered shards' first ``num_tokens`` rows times it, by the lowering named ``lowering``."""
    return _kernel("all_gather_matmul", lowering)(shard, mat2s, group_name, num_tokens,
                                                  max_workspace_tokens=workspace_tokens)


QUANT_LOWERINGS = carrying("fused_allreduce_rmsnorm_quant")
"""Lowerings that carry a quantized site (``weave.fused_allreduce_rmsnorm_quant``): every one, each
for the forms it answers for in ``quant_unsupported_reason`` (the CUDA kernel: the forms
``runtime.cuda.support.cuda_quant_epilogue`` accepts); for another form the planner keeps the
quantization outside the fused op and says so."""
assert set(QUANT_LOWERINGS) == set(Lowering)


CUDA_QUANT_EPILOGUE_VERIFIED = True
"""Whether the planner puts quantized sites on the CUDA kernel's quantized epilogue (False: the
quantization stays outside the fused op on CUDA, the norm is fused, with the reason below). True since
``tests/gpu/test_quant_epilogue_gpu.py`` passed whole on one H200 (2026-12-03, torch 2.11, Triton 3.6,
branch h36g on main b1b0d03 with the fix of the fp8 sign of zero): every carried form (fp8 static
``x / s`` and ``x * reciprocal(s)``, per row (vLLM's and torchao's spellings), per group of 128, int8
per row) at a group of one rank (bf16 H=8192 at 1 / 1024 / 4099 tokens, fp16 H=4096) and on 2 and 4
simulated ranks through every kernel, codes and scales bit for bit against eager's quantization of the
kernel's own rows on the GPU, and the op's CUDA lowering at a group of one (docs/cuda_kernel.md).
Not run there yet: 2 real GPUs, ``SHARED=1``."""


class QuantIssue(StrEnum):
    """Why a lowering cannot compute a site's quantization in its fused op
    (``quant_unsupported_reason``); the compile side reports each as the ``ReasonCode`` of the same
    value (``weavepass.compile.reasons.QUANT_ISSUES``), rendered from ``QUANT_ISSUE_TEXT``."""

    LOWERING = "quant_lowering_not_carried"
    """The lowering (``lowering``) has no quantized kernel."""
    CUDA_STATIC_SCALE_DTYPE = "quant_cuda_static_scale_dtype"
    CUDA_FORM = "quant_cuda_form"
    """The CUDA kernel has no program for this form (``cause``: ``support.cuda_quant_epilogue``'s
    ``Unsupported`` of a ``cuda.quant_epilogue.QuantFormIssue``)."""
    CUDA_UNVERIFIED = "quant_cuda_unverified"
    """``CUDA_QUANT_EPILOGUE_VERIFIED`` is False."""


QUANT_ISSUE_TEXT = {
    QuantIssue.LOWERING: "the {lowering!r} lowering does not carry it yet",
    QuantIssue.CUDA_STATIC_SCALE_DTYPE: "the CUDA kernel needs its static scale's dtype",
    QuantIssue.CUDA_FORM: "the CUDA kernel does not carry it: {cause}",
    QuantIssue.CUDA_UNVERIFIED: (
        "the CUDA kernel's quantized epilogue is not verified on a GPU (runtime.CUDA_QUANT_EPILOGUE_VERIFIED "
        "is False)"),
}
"""The sentence of each ``QuantIssue``, formatted with its fields."""
register(QUANT_ISSUE_TEXT)


def quant_unsupported_reason(lowering: str, static: bool, group_size: int, scale_steps: str, code_steps: str, *,
                             out_dtype: torch.dtype, hidden: int, device: torch.device,
                             static_scale: tuple[torch.dtype, int] | None = None,
                             return_normed: bool = False) -> Unsupported | None:
    """Why ``lowering`` cannot compute this quantization (``weavepass.runtime.quant``) in its fused
    op, or None. The planner asks here: a lowering with a quantized kernel answers for itself (CUDA:
    the forms ``runtime.cuda.support.cuda_quant_epilogue`` accepts for rows of ``out_dtype`` and
    width ``hidden`` on ``device``; ``static_scale``: the static scale's ``(dtype, ndim)``)."""
    if lowering not in QUANT_LOWERINGS:
        return Unsupported.of(QuantIssue.LOWERING, lowering=str(lowering))
    if lowering == Lowering.CUDA_SYMM:
        from weavepass.runtime.cuda.support import cuda_quant_epilogue

        if static and static_scale is None:
            return Unsupported(QuantIssue.CUDA_STATIC_SCALE_DTYPE)
        epilogue = cuda_quant_epilogue(out_dtype, hidden, device, static_scale if static else None, group_size,
                                       scale_steps, code_steps, return_normed)
        if isinstance(epilogue, Unsupported):
            return Unsupported.of(QuantIssue.CUDA_FORM, cause=epilogue)
        if not CUDA_QUANT_EPILOGUE_VERIFIED:
            return Unsupported(QuantIssue.CUDA_UNVERIFIED)
    return None


def fused_allreduce_rmsnorm_quant(partial, residual, weight, eps, group_name, out_dtype, static_scale,
                                  group_size, scale_steps, code_steps, return_normed, lowering,
                                  workspace_tokens):
    """The kernel of ``weave.fused_allreduce_rmsnorm_quant``: ``(codes, scales, residual_out,
    normed)`` by the lowering named ``lowering`` (``weavepass.runtime.quant``)."""
    return _kernel("fused_allreduce_rmsnorm_quant", lowering)(
        partial, residual, weight, eps, group_name, out_dtype, static_scale, group_size, scale_steps, code_steps,
        return_normed, max_workspace_tokens=workspace_tokens)
