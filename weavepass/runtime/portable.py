"""Portable lowering: reduce_scatter -> add + RMSNorm (or LayerNorm) on 1/N of the tokens -> all_gather.

Runs on any process group (gloo on CPU included) through eager ``torch.distributed`` calls. This is
the TokenWeave reorder without the fused kernel, and it is the reference the CUDA and NPU lowerings
are tested against.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from weavepass.runtime.quant import quantize_rows
from weavepass.runtime.reference import accumulation_dtype, add_layernorm_local, add_rmsnorm_local


def resolve_group(group_name: str) -> dist.ProcessGroup:
    """The process group a functional collective named ``group_name`` runs on."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


DEFAULT_GROUP_TIMEOUT_S = 600.0
"""What weave assumes a group's collectives wait when ``group_timeout_s`` cannot read it: PyTorch's
default for NCCL groups."""


def group_timeout_s(group_name: str | None) -> float:
    """The timeout the group's backend was created with (``init_process_group(timeout=...)``: how
    long its own collectives wait for a peer); ``DEFAULT_GROUP_TIMEOUT_S`` where this torch or
    backend does not say."""
    import datetime

    if group_name is None:
        return DEFAULT_GROUP_TIMEOUT_S
    try:
        group = resolve_group(group_name)
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        timeout = group._get_backend(device).options._timeout
    except Exception:  # an older torch, a backend without options, an unknown group
        return DEFAULT_GROUP_TIMEOUT_S
    if isinstance(timeout, datetime.timedelta) and timeout.total_seconds() > 0:
        return timeout.total_seconds()
    return DEFAULT_GROUP_TIMEOUT_S


# torch 2.13 renamed the tensor-in/tensor-out collectives; 2.11 has only the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def rows_per_rank(num_tokens: int, world_size: int) -> int:
    """Rows each rank owns after padding ``num_tokens`` up to a multiple of ``world_size``."""
    return -(-num_tokens // world_size)


def shard_rows(x: torch.Tensor, padded_tokens: int, world_size: int, group_name: str) -> torch.Tensor:
    """The kernel of ``weave.flashcomm_shard_rows``: this rank's rows of ``x`` [T, H] zero-padded to
    ``[padded_tokens, H]``, i.e. ``[padded_tokens / world_size, H]`` (FlashComm shards a residual
    that enters the first site from outside the sharded stream)."""
    rank = resolve_group(group_name).rank()
    per_rank = padded_tokens // world_size
    shard = x.new_zeros((per_rank, x.shape[1]))
    lo, hi = rank * per_rank, min((rank + 1) * per_rank, x.shape[0])
    if hi > lo:
        shard[: hi - lo] = x[lo:hi]
    return shard


def fused_allreduce_rmsnorm_portable(
    partial: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    eps: float,
    group_name: str,
    out_dtype: torch.dtype,
    *,
    max_workspace_tokens: int = 0,
    return_inv_rms: bool = False,
) -> tuple[torch.Tensor, ...]:
    """A ``weavepass.runtime.FusedLowering``; with ``return_inv_rms`` it also returns the inverse
    RMS ``[..., 1]`` in ``accumulation_dtype`` (training). ``max_workspace_tokens`` is ignored: the
    buffers are allocated per call, so any batch fits.

    Tokens are the flattened leading dims (T rows). They are padded with zero rows to
    ``world * ceil(T / world)`` so every rank owns the same number of rows; the padding never
    reaches the outputs. The reduction runs in ``accumulation_dtype`` (fp32, or fp64 for fp64
    inputs); the gather carries both outputs in one buffer ``[rows, 2H]`` of a dtype that holds
    both exactly (both were already rounded to their dtypes); the inverse RMS, when asked for, rides
    in the same gather as one more column (the carrier holds ``accumulation_dtype`` exactly).
    """
    return _reduce_norm_gather(partial, residual, group_name, out_dtype, add_rmsnorm_local,
                               (weight, eps, out_dtype, partial.dtype, return_inv_rms))


def fused_allreduce_layernorm_portable(
    partial: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    group_name: str,
    out_dtype: torch.dtype,
    *,
    max_workspace_tokens: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``fused_allreduce_rmsnorm_portable`` with a LayerNorm (``add_layernorm_local``) on the
    rows each rank owns: the kernel of ``weave.fused_allreduce_layernorm``."""
    return _reduce_norm_gather(partial, residual, group_name, out_dtype, add_layernorm_local,
                               (weight, bias, eps, out_dtype, partial.dtype))


def _reduce_norm_gather(partial, residual, group_name, out_dtype, add_norm, norm_args):
    """reduce_scatter of the padded rows -> ``add_norm(shard, shard_residual, *norm_args)`` ->
    one all_gather of its outputs (``fused_allreduce_rmsnorm_portable`` says how)."""
    group, shard, shard_residual = _reduce_scatter_rows(partial, residual, group_name)
    local = add_norm(shard, shard_residual, *norm_args)
    widths = [t.shape[-1] for t in local]
    gathered = _gather_rows(list(local), partial.shape[:-1].numel(), group)
    # copy=True: the outputs must not alias each other (or anything else).
    outputs = (
        gathered[0].to(out_dtype, copy=True).reshape(partial.shape),
        gathered[1].to(partial.dtype, copy=True).reshape(partial.shape),
    )
    if len(local) == 3:  # the inverse RMS (training)
        inv_rms = gathered[2].to(local[2].dtype, copy=True)
        return (*outputs, inv_rms.reshape(*partial.shape[:-1], widths[2]))
    return outputs


def _reduce_scatter_rows(partial, residual, group_name):
    """``(group, shard, shard_residual)``: this rank's ``ceil(T / N)`` rows of the fp32 (``acc``)
    sum of the zero-padded partials, and the same rows of the residual (or None)."""
    group = resolve_group(group_name)
    world, rank = group.size(), group.rank()
    hidden = partial.shape[-1]
    rows = partial.reshape(-1, hidden)
    num_tokens = rows.shape[0]
    per_rank = rows_per_rank(num_tokens, world)

    shard = _reduce_scatter_padded(rows, per_rank, group)

    shard_residual = None
    if residual is not None:
        shard_residual = residual.new_zeros((per_rank, hidden))
        lo, hi = rank * per_rank, min((rank + 1) * per_rank, num_tokens)
        if hi > lo:
            shard_residual[: hi - lo] = residual.reshape(-1, hidden)[lo:hi]
    return group, shard, shard_residual


def _reduce_scatter_padded(rows: torch.Tensor, per_rank: int, group) -> torch.Tensor:
    """This rank's ``per_rank`` rows ``[per_rank, H]`` of the sum over ranks of ``rows`` ``[T, H]``,
    each rank's rows zero-padded to ``per_rank x N``; summed in ``accumulation_dtype``, in rank order
    as the group's reduce_scatter adds."""
    hidden = rows.shape[-1]
    padded = rows.new_zeros((per_rank * group.size(), hidden), dtype=accumulation_dtype(rows.dtype))
    padded[: rows.shape[0]] = rows
    shard = padded.new_empty((per_rank, hidden))
    _reduce_scatter(shard, padded, group=group)
    return shard


def matmul_reduce_scatter_rmsnorm_portable(
    x: torch.Tensor,
    mat2: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    eps: float,
    group_name: str,
    out_dtype: torch.dtype,
    *,
    max_workspace_tokens: int = 0,
) -> tuple[torch.Tensor, ...]:
    """The portable kernel of ``weave.matmul_reduce_scatter_rmsnorm``: the partial ``x [T, K] @
    mat2 [K, H]`` (``torch.mm``, rounded to ``x.dtype`` as the graph's matmul rounded it), then
    ``fused_allreduce_rmsnorm_portable``: reduce_scatter in fp32 -> add + RMSNorm on this rank's
    ``ceil(T / N)`` rows -> one all_gather. Returns ``(normed, residual_out)``, both ``[T, H]``."""
    return fused_allreduce_rmsnorm_portable(torch.mm(x, mat2), residual, weight, eps, group_name, out_dtype)


def matmul_reduce_scatter_rmsnorm_shard_portable(
    x: torch.Tensor,
    mat2: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    eps: float,
    group_name: str,
    out_dtype: torch.dtype,
    rows_per_rank: int,
    *,
    max_workspace_tokens: int = 0,
) -> tuple[torch.Tensor, ...]:
    """The portable kernel of ``weave.matmul_reduce_scatter_rmsnorm_shard`` (FlashComm's sharded
    stream): the partial ``x @ mat2`` as above, its rows zero-padded to ``rows_per_rank x N`` and
    reduce-scattered in fp32, then ``residual`` (this rank's ``[rows_per_rank, H]`` shard, or None)
    added and the shard normalised (``reference.add_rmsnorm_local``). Returns ``(normed,
    residual_out)``, both ``[rows_per_rank, H]``; padding rows stay zero."""
    partial = torch.mm(x, mat2)
    shard = _reduce_scatter_padded(partial, rows_per_rank, resolve_group(group_name))
    return add_rmsnorm_local(shard, residual, weight, eps, out_dtype, partial.dtype)


def _gather_rows(local: list[torch.Tensor], num_tokens: int, group) -> list[torch.Tensor]:
    """Every rank's ``local`` tensors (each ``[rows, ...]``, the same rows on every rank) gathered
    in one all_gather and cut back to ``num_tokens`` rows, each ``[num_tokens, width]`` in the
    carrier dtype: one that holds every input exactly (each was already rounded to its dtype:
    bf16/fp16/fp8/int8 values and fp32 scales are exact in fp32)."""
    per_rank = local[0].shape[0]
    flat = [t.reshape(per_rank, -1) for t in local]
    wide = [t.dtype for t in flat if t.is_floating_point() and t.element_size() > 1]  # (fp8 does not promote)
    carrier = functools.reduce(torch.promote_types, wide, torch.float32)
    packed = torch.cat([t.to(carrier) for t in flat], dim=1)
    gathered = packed.new_empty((per_rank * group.size(), packed.shape[1]))
    _all_gather(gathered, packed, group=group)
    gathered = gathered[:num_tokens]
    return list(torch.split(gathered, [t.shape[1] for t in flat], dim=1))


def fused_allreduce_rmsnorm_quant_portable(
    partial: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    eps: float,
    group_name: str,
    out_dtype: torch.dtype,
    static_scale: torch.Tensor | None,
    group_size: int,
    scale_steps: str,
    code_steps: str,
    return_normed: bool,
    *,
    max_workspace_tokens: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The portable kernel of ``weave.fused_allreduce_rmsnorm_quant``: reduce_scatter -> add +
    RMSNorm on this rank's rows -> their quantization (``weavepass.runtime.quant.quantize_rows``)
    -> one all_gather of the codes, the dynamic scales, the residual and (``return_normed``) the
    normed rows. Returns ``(codes, scales, residual_out, normed)``: codes ``[..., H]`` (grouped:
    ``[..., H/g, g]``), scales ``[..., 1]`` (grouped: ``[..., H/g, 1]``; static: a copy of
    ``static_scale``), ``normed`` empty (shape ``[0]``) unless ``return_normed``."""
    group, shard, shard_residual = _reduce_scatter_rows(partial, residual, group_name)
    normed, residual_out = add_rmsnorm_local(shard, shard_residual, weight, eps, out_dtype, partial.dtype)
    codes, scales = quantize_rows(normed, static_scale, group_size, scale_steps, code_steps)
    local = [codes, residual_out] + ([] if static_scale is not None else [scales]) \
        + ([normed] if return_normed else [])
    lead = partial.shape[:-1]
    gathered = _gather_rows(local, lead.numel(), group)
    out_codes = gathered[0].to(codes.dtype).reshape(*lead, *codes.shape[1:])
    out_residual = gathered[1].to(partial.dtype, copy=True).reshape(partial.shape)
    if static_scale is not None:
        out_scales = static_scale.clone()
    else:
        out_scales = gathered[2].to(scales.dtype, copy=True).reshape(*lead, *scales.shape[1:])
    out_normed = (gathered[-1].to(out_dtype, copy=True).reshape(partial.shape) if return_normed
                  else partial.new_empty((0,), dtype=out_dtype))
    return out_codes, out_scales, out_residual, out_normed


def all_gather_matmul_portable(shard: torch.Tensor, mat2s: list[torch.Tensor], group_name: str,
                               num_tokens: int, *, max_workspace_tokens: int = 0) -> list[torch.Tensor]:
    """The portable kernel of ``weave.all_gather_matmul``: every rank's ``shard`` ``[R, K]`` gathered
    in rank order (one all_gather, in the shard's dtype) into ``[R N, K]``, cut to the first
    ``num_tokens`` rows, then ``rows @ mat2`` (``torch.mm``) for each ``mat2`` ``[K, N_i]``: what
    FlashComm's portable graph computes with ``all_gather -> slice -> mm``. ``max_workspace_tokens`` is
    ignored (no workspace)."""
    group = resolve_group(group_name)
    rows = shard.reshape(shard.shape[0], -1).contiguous()
    gathered = rows.new_empty((rows.shape[0] * group.size(), rows.shape[1]))
    _all_gather(gathered, rows, group=group)
    return [torch.mm(gathered[:num_tokens], mat2) for mat2 in mat2s]
