"""The functional ``weave`` custom ops that the rewrite puts into graphs.

``torch.ops.weave.fused_allreduce_rmsnorm(partial, residual, weight, eps, group_name, out_dtype,
lowering) -> (normed, residual_out)`` replaces ``all_reduce(sum) -> [+ residual] -> RMSNorm``.
Shapes: ``partial`` and ``residual`` are ``[..., H]`` with the same shape, ``weight`` is ``[H]``;
``weight`` may be None (a norm without
scale); both outputs have ``partial``'s shape, ``normed`` in ``out_dtype`` and ``residual_out`` in
``partial.dtype``. ``residual_out`` is the all-reduced sum plus the residual: the tensor the model
carries on as its residual stream. The op is functional: it mutates nothing and aliases nothing.

The ops a compiled graph calls once per site (this one and ``fused_allreduce_rmsnorm_async``) are
registered with ``define_hot_op``: a schema and one ``CompositeExplicitAutograd`` kernel, without
``torch.library.custom_op``'s Python autograd wrapper and per-call alias checks. Measured on the CPU
dev machine: 8.8 us per call against 24.9 us, where the body itself costs 2.3 us. They are
inference ops (no backward).

``torch.ops.weave.fused_allreduce_rmsnorm_train(<same arguments>) -> (normed, residual_out,
inv_rms)`` is the same op for the forward graph of a training compile, where AOT autograd saves the
norm's inverse RMS for the backward graph: ``inv_rms = rsqrt(mean(x^2, -1) + eps)`` with ``x`` the
upcast ``residual_out``, shape ``partial.shape[:-1] + [1]``, dtype fp32 (fp64 for fp64 inputs),
gathered like the other outputs. It is a separate op, so the inference op's schema, outputs and
host cost stay as they are; only the portable lowering computes it (the scheduler keeps training
sites of other lowerings as all_reduce).
"""

from __future__ import annotations

from typing import Callable

import torch

from weavepass.runtime import TRAINING_LOWERINGS, get_lowering
from weavepass.runtime.portable import fused_allreduce_rmsnorm_portable
from weavepass.runtime.reference import accumulation_dtype

_LIB = torch.library.Library("weave", "FRAGMENT")


def define_hot_op(name: str, schema: str, impl: Callable, fake: Callable):
    """Define ``weave::<name><schema>`` with ``impl`` for every device and ``fake`` for tracing;
    returns the op's default overload. For functional ops called once per site at run time."""
    _LIB.define(name + schema)
    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"weave::{name}", fake, lib=_LIB)
    return getattr(torch.ops.weave, name).default


FUSED_SCHEMA_ARGS = (
    "Tensor partial, Tensor? residual, Tensor? weight, float eps, str group_name, "
    "ScalarType out_dtype, str lowering"
)


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


def _fake(partial, residual, weight, eps, group_name, out_dtype, lowering):
    return (
        partial.new_empty(partial.shape, dtype=out_dtype),
        partial.new_empty(partial.shape),
    )


FUSED_ALLREDUCE_RMSNORM = define_hot_op(
    "fused_allreduce_rmsnorm", f"({FUSED_SCHEMA_ARGS}) -> (Tensor, Tensor)", fused_allreduce_rmsnorm, _fake
)


def fused_allreduce_rmsnorm_train(partial, residual, weight, eps, group_name, out_dtype, lowering):
    if lowering not in TRAINING_LOWERINGS:
        raise ValueError(f"weave lowering {lowering!r} does not return the inverse RMS; training "
                         f"sites need one of {TRAINING_LOWERINGS}")
    return fused_allreduce_rmsnorm_portable(
        partial, residual, weight, eps, group_name, out_dtype, return_inv_rms=True
    )


def _fake_train(partial, residual, weight, eps, group_name, out_dtype, lowering):
    inv_rms = partial.new_empty((*partial.shape[:-1], 1), dtype=accumulation_dtype(partial.dtype))
    return (*_fake(partial, residual, weight, eps, group_name, out_dtype, lowering), inv_rms)


FUSED_ALLREDUCE_RMSNORM_TRAIN = define_hot_op(
    "fused_allreduce_rmsnorm_train", f"({FUSED_SCHEMA_ARGS}) -> (Tensor, Tensor, Tensor)",
    fused_allreduce_rmsnorm_train, _fake_train,
)
