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
from dataclasses import dataclass
from typing import Protocol

import torch

from weavepass.config import Lowering, StrEnum
from weavepass.runtime.portable import fused_allreduce_rmsnorm_portable


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


# name -> "module:function"; modules that need triton or torch_npu are imported on first use only.
_LAZY_LOWERINGS: dict[str, str] = {
    Lowering.CUDA_SYMM: "weavepass.runtime.cuda.dispatch:fused_allreduce_rmsnorm_cuda",
}
_LOWERINGS: dict[str, FusedLowering] = {Lowering.PORTABLE: fused_allreduce_rmsnorm_portable}

_LAYER_NORM_LOWERINGS: dict[str, str] = {
    Lowering.PORTABLE: "weavepass.runtime.portable:fused_allreduce_layernorm_portable",
    Lowering.CUDA_SYMM: "weavepass.runtime.cuda.dispatch:fused_allreduce_layernorm_cuda",
}
LAYER_NORM_LOWERINGS = tuple(_LAYER_NORM_LOWERINGS)
"""Lowerings that carry a LayerNorm (``weave.fused_allreduce_layernorm``): every one."""
assert set(_LAZY_LOWERINGS) | set(_LOWERINGS) == set(Lowering) == set(_LAYER_NORM_LOWERINGS)


def get_lowering(name: str) -> FusedLowering:
    """The implementation registered under ``name`` (importing it on first use). The fused ops'
    kernels call this once per op call: a known name costs one dict lookup."""
    run = _LOWERINGS.get(name)
    if run is not None:
        return run
    if name not in _LAZY_LOWERINGS:
        known = sorted(str(n) for n in [*_LOWERINGS, *_LAZY_LOWERINGS])
        raise ValueError(f"unknown weave lowering {name!r}; known lowerings: {known}")
    module_name, attr = _LAZY_LOWERINGS[name].split(":")
    _LOWERINGS[name] = getattr(importlib.import_module(module_name), attr)
    return _LOWERINGS[name]


def lowering_names() -> list[str]:
    return sorted(str(n) for n in {*_LOWERINGS, *_LAZY_LOWERINGS})


def fused_allreduce_rmsnorm(partial, residual, weight, eps, group_name, out_dtype, lowering,
                            workspace_tokens):
    """The kernel of ``weave.fused_allreduce_rmsnorm`` (schema and fake: ``weavepass.ops``): runs
    the ``FusedLowering`` named ``lowering``. Compiled graphs call it directly, once per site and
    forward pass (``weavepass.compile.direct_calls``)."""
    return get_lowering(lowering)(partial, residual, weight, eps, group_name, out_dtype,
                                  max_workspace_tokens=workspace_tokens)


def fused_allreduce_rmsnorm_train(partial, residual, weight, eps, group_name, out_dtype, lowering,
                                  workspace_tokens):
    """The kernel of ``weave.fused_allreduce_rmsnorm_train``: ``(normed, residual_out, inv_rms)``."""
    return get_lowering(lowering)(partial, residual, weight, eps, group_name, out_dtype,
                                  max_workspace_tokens=workspace_tokens, return_inv_rms=True)


def fused_allreduce_layernorm(partial, residual, weight, bias, eps, group_name, out_dtype, lowering,
                              workspace_tokens, **overrides):
    """The kernel of ``weave.fused_allreduce_layernorm``: ``(normed, residual_out)`` with a
    LayerNorm (``weavepass.runtime.reference.add_layernorm_local``) by the lowering named ``lowering``.
    ``overrides`` go to a lowering with a workspace (the async op's ``num_ctas``)."""
    if lowering not in _LAYER_NORM_LOWERINGS:
        raise ValueError(f"weave lowering {lowering!r} does not carry LayerNorm; LayerNorm sites "
                         f"need one of {[str(n) for n in LAYER_NORM_LOWERINGS]}")
    module_name, attr = _LAYER_NORM_LOWERINGS[lowering].split(":")
    run = getattr(importlib.import_module(module_name), attr)
    if lowering == Lowering.PORTABLE:  # no workspace
        return run(partial, residual, weight, bias, eps, group_name, out_dtype)
    return run(partial, residual, weight, bias, eps, group_name, out_dtype, max_workspace_tokens=workspace_tokens,
               **overrides)


_MATMUL_LOWERINGS: dict[str, tuple[str, str]] = {
    Lowering.PORTABLE: ("weavepass.runtime.portable:matmul_reduce_scatter_rmsnorm_portable",
                        "weavepass.runtime.portable:matmul_reduce_scatter_rmsnorm_shard_portable"),
    Lowering.CUDA_SYMM: ("weavepass.runtime.cuda.matmul:matmul_reduce_scatter_rmsnorm_cuda",
                         "weavepass.runtime.cuda.matmul:matmul_reduce_scatter_rmsnorm_shard_cuda"),
}
MATMUL_LOWERINGS = tuple(_MATMUL_LOWERINGS)
"""Lowerings that carry ``weave.matmul_reduce_scatter_rmsnorm`` and its sharded form: the portable
one, and ``cuda_symm`` (``runtime.cuda.matmul``: the scatter-epilogue GEMM and its reduce on a
symmetric workspace, and for the full stream a push of the owners' rows to every rank)."""


def matmul_unsupported_reason(lowering: str) -> str | None:
    """Why ``lowering`` cannot run ``weave.matmul_reduce_scatter_rmsnorm`` (and its sharded form), or None."""
    if lowering in _MATMUL_LOWERINGS:
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


def _matmul_kernel(lowering: str, shard: bool):
    cause = matmul_unsupported_reason(lowering)
    if cause is not None:
        raise ValueError(f"weave lowering {lowering!r} does not carry the matmul op: {cause}; it needs one "
                         f"of {[str(n) for n in MATMUL_LOWERINGS]}")
    module_name, attr = _MATMUL_LOWERINGS[lowering][shard].split(":")
    return getattr(importlib.import_module(module_name), attr)


def matmul_reduce_scatter_rmsnorm(x, mat2, residual, weight, eps, group_name, out_dtype, lowering,
                                  workspace_tokens):
    """The kernel of ``weave.matmul_reduce_scatter_rmsnorm``: ``(normed, residual_out)`` ``[T, H]``
    of ``x @ mat2``'s sum over ranks by the lowering named ``lowering``."""
    run = _matmul_kernel(lowering, False)
    if lowering == Lowering.PORTABLE:  # no workspace
        return run(x, mat2, residual, weight, eps, group_name, out_dtype)
    return run(x, mat2, residual, weight, eps, group_name, out_dtype, max_workspace_tokens=workspace_tokens)


def matmul_reduce_scatter_rmsnorm_shard(x, mat2, residual, weight, eps, group_name, out_dtype, rows_per_rank,
                                        lowering, workspace_tokens):
    """The kernel of ``weave.matmul_reduce_scatter_rmsnorm_shard``: this rank's ``[rows_per_rank, H]``
    rows of ``(normed, residual_out)`` (FlashComm's sharded stream)."""
    run = _matmul_kernel(lowering, True)
    if lowering == Lowering.PORTABLE:
        return run(x, mat2, residual, weight, eps, group_name, out_dtype, rows_per_rank)
    return run(x, mat2, residual, weight, eps, group_name, out_dtype, rows_per_rank,
               max_workspace_tokens=workspace_tokens)


_GATHER_LOWERINGS: dict[str, str] = {
    Lowering.PORTABLE: "weavepass.runtime.portable:all_gather_matmul_portable",
    Lowering.CUDA_SYMM: "weavepass.runtime.cuda.gather_op:all_gather_matmul_cuda",
}
GATHER_LOWERINGS = tuple(_GATHER_LOWERINGS)
"""Lowerings that carry ``weave.all_gather_matmul``: the portable one (all_gather + mm) and
``cuda_symm`` (``runtime.cuda.gather_op``: the owners' push and the gather GEMM on a symmetric
workspace)."""


def all_gather_matmul(shard, mat2s, group_name, num_tokens, lowering, workspace_tokens):
    """The kernel of ``weave.all_gather_matmul``: ``[num_tokens, N_i]`` for each ``mat2s[i]``, the
    gathered shards' first ``num_tokens`` rows times it, by the lowering named ``lowering``."""
    if lowering not in _GATHER_LOWERINGS:
        raise ValueError(f"weave lowering {lowering!r} does not carry weave.all_gather_matmul; it needs one of "
                         f"{[str(n) for n in GATHER_LOWERINGS]}")
    module_name, attr = _GATHER_LOWERINGS[lowering].split(":")
    run = getattr(importlib.import_module(module_name), attr)
    if lowering == Lowering.PORTABLE:
        return run(shard, mat2s, group_name, num_tokens)
    return run(shard, mat2s, group_name, num_tokens, max_workspace_tokens=workspace_tokens)


_QUANT_LOWERINGS: dict[str, str] = {
    Lowering.PORTABLE: "weavepass.runtime.portable:fused_allreduce_rmsnorm_quant_portable",
    Lowering.CUDA_SYMM: "weavepass.runtime.cuda.dispatch:fused_allreduce_rmsnorm_quant_cuda",
}
QUANT_LOWERINGS = tuple(_QUANT_LOWERINGS)
"""Lowerings that carry a quantized site (``weave.fused_allreduce_rmsnorm_quant``): every one, each
for the forms it answers for in ``quant_unsupported_reason`` (the CUDA kernel: the forms
``runtime.cuda.support.cuda_quant_epilogue`` accepts); for another form the planner keeps the
quantization outside the fused op and says so."""
assert set(_QUANT_LOWERINGS) == set(Lowering)


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
    ``Unsupported``, a ``cuda.quant_epilogue.QuantFormIssue``)."""
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
CUDA_QUANT_EPILOGUE_UNVERIFIED = QUANT_ISSUE_TEXT[QuantIssue.CUDA_UNVERIFIED]


@dataclass(frozen=True)
class QuantUnsupported:
    """Why a lowering cannot compute a site's quantization: ``issue`` and its detail (``fields``)."""

    issue: QuantIssue
    fields: tuple[tuple[str, object], ...] = ()

    @classmethod
    def of(cls, issue: QuantIssue, **fields: object) -> QuantUnsupported:
        return cls(issue, tuple(fields.items()))

    def __str__(self) -> str:
        return QUANT_ISSUE_TEXT[self.issue].format(**dict(self.fields))


def quant_unsupported_reason(lowering: str, static: bool, group_size: int, scale_steps: str, code_steps: str, *,
                             out_dtype: torch.dtype, hidden: int, device: torch.device,
                             static_scale: tuple[torch.dtype, int] | None = None,
                             return_normed: bool = False) -> QuantUnsupported | None:
    """Why ``lowering`` cannot compute this quantization (``weavepass.runtime.quant``) in its fused
    op, or None. The planner asks here: a lowering with a quantized kernel answers for itself (CUDA:
    the forms ``runtime.cuda.support.cuda_quant_epilogue`` accepts for rows of ``out_dtype`` and
    width ``hidden`` on ``device``; ``static_scale``: the static scale's ``(dtype, ndim)``)."""
    if lowering not in _QUANT_LOWERINGS:
        return QuantUnsupported.of(QuantIssue.LOWERING, lowering=str(lowering))
    if lowering == Lowering.CUDA_SYMM:
        from weavepass.runtime.cuda.support import cuda_quant_epilogue
        from weavepass.runtime.issue import Unsupported

        if static and static_scale is None:
            return QuantUnsupported(QuantIssue.CUDA_STATIC_SCALE_DTYPE)
        epilogue = cuda_quant_epilogue(out_dtype, hidden, device, static_scale if static else None, group_size,
                                       scale_steps, code_steps, return_normed)
        if isinstance(epilogue, Unsupported):
            return QuantUnsupported.of(QuantIssue.CUDA_FORM, cause=epilogue)
        if not CUDA_QUANT_EPILOGUE_VERIFIED:
            return QuantUnsupported(QuantIssue.CUDA_UNVERIFIED)
    return None


def fused_allreduce_rmsnorm_quant(partial, residual, weight, eps, group_name, out_dtype, static_scale,
                                  group_size, scale_steps, code_steps, return_normed, lowering,
                                  workspace_tokens):
    """The kernel of ``weave.fused_allreduce_rmsnorm_quant``: ``(codes, scales, residual_out,
    normed)`` by the lowering named ``lowering`` (``weavepass.runtime.quant``)."""
    if lowering not in _QUANT_LOWERINGS:
        raise ValueError(f"weave lowering {lowering!r} does not carry a quantized site; "
                         f"quantized sites need one of {[str(n) for n in QUANT_LOWERINGS]}")
    module_name, attr = _QUANT_LOWERINGS[lowering].split(":")
    run = getattr(importlib.import_module(module_name), attr)
    args = (partial, residual, weight, eps, group_name, out_dtype, static_scale, group_size, scale_steps,
            code_steps, return_normed)
    if lowering == Lowering.PORTABLE:  # no workspace
        return run(*args)
    return run(*args, max_workspace_tokens=workspace_tokens)
