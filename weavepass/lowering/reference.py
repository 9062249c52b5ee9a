"""The math every lowering of ``weave.fused_allreduce_rmsnorm`` must agree with.

Given the partial sums ``P_r`` of ``N`` ranks (shape ``[..., H]``), an optional residual ``R`` and a
weight ``w`` of shape ``[H]``:

    S          = sum_r P_r                                  (accumulated in fp32)
    residual'  = round_to(dtype(P), S + R)                  (the new residual stream)
    normed     = round_to(out_dtype, x * rsqrt(mean(x^2, -1) + eps) * w),  x = fp32(residual')

The norm reads the *rounded* residual, exactly as eager code does when it adds in bf16 and then
upcasts for the norm; everything after that rounding stays in fp32 until the single final cast.
"""

from __future__ import annotations

import torch


def add_rmsnorm_local(
    summed: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    eps: float,
    out_dtype: torch.dtype,
    residual_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add and RMSNorm over the last dim of already reduced rows.

    ``summed`` [..., H] holds the reduced partial sums (any float dtype, fp32 preferred);
    ``residual`` is None or has the same shape. Returns ``(normed, residual_out)`` with
    ``normed.dtype == out_dtype`` and ``residual_out.dtype == residual_dtype``.
    """
    total = summed.float()
    if residual is not None:
        total = total + residual.float()
    residual_out = total.to(residual_dtype)
    x = residual_out.float()
    inv_rms = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    normed = x * inv_rms
    if weight is not None:
        normed = normed * weight.float()
    normed = normed.to(out_dtype)
    return normed, residual_out


def fused_allreduce_rmsnorm_reference(
    partials: list[torch.Tensor],
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    eps: float,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Single-process reference: ``partials`` holds every rank's partial sum."""
    summed = torch.stack([p.float() for p in partials]).sum(0)
    return add_rmsnorm_local(summed, residual, weight, eps, out_dtype, partials[0].dtype)
