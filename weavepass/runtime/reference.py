"""The math every lowering of ``weave.fused_allreduce_rmsnorm`` (and ``_layernorm``) must agree with.

Given the partial sums ``P_r`` of ``N`` ranks (shape ``[..., H]``, dtype ``d``), an optional
residual ``R`` and a weight ``w`` of shape ``[H]``, with ``acc = promote(d, fp32)`` (fp32 for
bf16/fp16/fp32, fp64 for fp64):

    S          = round_to(d, sum_r P_r)                    (summed in acc, rounded once to d)
    residual'  = round_to(d, acc(S) + acc(R))               (the new residual stream)
    normed     = round_to(out_dtype, x * rsqrt(mean(x^2, -1) + eps) * w),  x = acc(residual')

and for ``weave.fused_allreduce_layernorm`` (LayerNorm, optional weight ``w`` and bias ``b``)

    normed     = round_to(out_dtype, d * rsqrt(mean(d^2, -1) + eps) * w + b),  d = x - mean(x, -1)

``S`` is rounded to ``d`` before the add because eager code does exactly that: its all_reduce
returns a tensor of dtype ``d``. So an fp16 sum beyond fp16's range is inf, as in eager, even
where adding the residual would bring it back into range. The norm reads the *rounded* residual,
exactly as eager code does when it adds in bf16 and then upcasts for the norm; everything after
that rounding stays in ``acc`` until the single final cast.
"""

from __future__ import annotations

import torch


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype sums and the norm run in: fp32, or the input's own dtype when it is wider (fp64)."""
    return torch.promote_types(dtype, torch.float32)


def _add_residual(summed, residual, residual_dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(residual_out, x)``: ``S`` rounded like eager's all_reduce output, plus the residual,
    rounded to ``residual_dtype``; ``x`` is that rounded value in the accumulation dtype."""
    acc = accumulation_dtype(residual_dtype)
    total = summed.to(residual_dtype).to(acc)  # eager's all_reduce output is in residual_dtype
    if residual is not None:
        total = total + residual.to(acc)
    residual_out = total.to(residual_dtype)
    return residual_out, residual_out.to(acc)


def _affine(normed: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
            out_dtype: torch.dtype) -> torch.Tensor:
    """``round(out_dtype, normed * w + b)``, in ``normed``'s dtype (or the weight's, when wider)."""
    if weight is not None:
        normed = normed * weight.to(torch.promote_types(normed.dtype, weight.dtype))
    if bias is not None:
        normed = normed + bias.to(torch.promote_types(normed.dtype, bias.dtype))
    return normed.to(out_dtype)


def add_rmsnorm_local(
    summed: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    eps: float,
    out_dtype: torch.dtype,
    residual_dtype: torch.dtype,
    return_inv_rms: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Residual add and RMSNorm over the last dim of already reduced rows.

    ``summed`` [..., H] holds the reduced partial sums (in ``accumulation_dtype(residual_dtype)``
    or ``residual_dtype``); ``residual`` is None or has the same shape. Returns
    ``(normed, residual_out)`` with ``normed.dtype == out_dtype`` and
    ``residual_out.dtype == residual_dtype``. With ``return_inv_rms`` a third output follows: the
    inverse RMS ``rsqrt(mean(x^2, -1) + eps)`` [..., 1] in ``accumulation_dtype`` (what the backward
    of a training graph saves).
    """
    residual_out, x = _add_residual(summed, residual, residual_dtype)
    inv_rms = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    normed = _affine(x * inv_rms, weight, None, out_dtype)
    if return_inv_rms:
        return normed, residual_out, inv_rms
    return normed, residual_out


def add_layernorm_local(
    summed: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    out_dtype: torch.dtype,
    residual_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``add_rmsnorm_local`` with a LayerNorm: ``d = x - mean(x, -1)``,
    ``normed = round(out_dtype, d * rsqrt(mean(d^2, -1) + eps) * w + b)`` (biased variance, the
    order ``F.layer_norm``'s decomposition and CohereLayerNorm compute in; ``w``, ``b`` optional)."""
    residual_out, x = _add_residual(summed, residual, residual_dtype)
    centred = x - x.mean(-1, keepdim=True)
    normed = centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + eps)
    return _affine(normed, weight, bias, out_dtype), residual_out


def fused_allreduce_rmsnorm_reference(
    partials: list[torch.Tensor],
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    eps: float,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    layer_norm: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Single-process reference: ``partials`` holds every rank's partial sum; ``layer_norm``
    (with an optional ``bias``) for ``weave.fused_allreduce_layernorm``."""
    acc = accumulation_dtype(partials[0].dtype)
    # In rank order, one add at a time, as every kernel sums (so every rank rounds the same S): S is
    # rounded to the partials' dtype before the residual is added (eager's all_reduce output), and
    # near a rounding boundary another order flips that rounding, which after cancellation against
    # the residual is more than an ulp of residual_out. torch.stack(...).sum(0) on CUDA need not add
    # in rank order (the likely cause of 1 element of 4.2 M off by 2 ulps, 8 ranks, bf16, one H200).
    summed = partials[0].to(acc)
    for partial in partials[1:]:
        summed = summed + partial.to(acc)
    if layer_norm:
        return add_layernorm_local(summed, residual, weight, bias, eps, out_dtype, partials[0].dtype)
    return add_rmsnorm_local(summed, residual, weight, eps, out_dtype, partials[0].dtype)
