"""The functional ``weave`` custom ops that the rewrite puts into graphs.

``torch.ops.weave.fused_allreduce_rmsnorm(partial, residual, weight, eps, group_name, out_dtype,
lowering) -> (normed, residual_out)`` replaces ``all_reduce(sum) -> [+ residual] -> RMSNorm``.
Shapes: ``partial`` and ``residual`` are ``[..., H]`` with the same shape, ``weight`` is ``[H]``;
``weight`` may be None (a norm without
scale); both outputs have ``partial``'s shape, ``normed`` in ``out_dtype`` and ``residual_out`` in
``partial.dtype``. ``residual_out`` is the all-reduced sum plus the residual: the tensor the model
carries on as its residual stream. The op is functional: it mutates nothing and aliases nothing.
"""

from __future__ import annotations

import torch

from weavepass.lowering import get_lowering


@torch.library.custom_op("weave::fused_allreduce_rmsnorm", mutates_args=())
def fused_allreduce_rmsnorm(
    partial: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    eps: float,
    group_name: str,
    out_dtype: torch.dtype,
    lowering: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    return get_lowering(lowering)(partial, residual, weight, eps, group_name, out_dtype)


@fused_allreduce_rmsnorm.register_fake
def _(partial, residual, weight, eps, group_name, out_dtype, lowering):
    return (
        partial.new_empty(partial.shape, dtype=out_dtype),
        partial.new_empty(partial.shape),
    )


FUSED_ALLREDUCE_RMSNORM = torch.ops.weave.fused_allreduce_rmsnorm.default
