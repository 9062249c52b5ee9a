"""CUDA lowering of ``weave.fused_allreduce_rmsnorm``: Triton kernels over PyTorch symmetric memory.

The algorithm, the memory ordering and the launch rule are described in ``docs/cuda_kernel.md`` and
in ``weavepass.runtime.cuda.kernels``. The host side is split by concern: ``support`` (what the
kernel can serve), ``launch_plan`` (one-shot/two-shot, grid and tile rule), ``workspace`` (the
symmetric buffers), ``launcher`` (the direct launch of a kernel) and this module, the op's entry: a
per-signature launch cache and the fallback to the portable lowering.

NVLink multicast (multimem, NVLS, ``cuMulticastCreate``) is never used: the kernels only do
peer-to-peer loads, stores and atomics through unicast symmetric pointers, and importing this module
turns multicast off (``weavepass.env``) unless the process already chose, so that the symmetric
allocator does not create a multicast object we would never use.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, replace

import torch

from weavepass.config import Lowering
from weavepass.env import disable_multicast
from weavepass.runtime.cuda import launcher, quant_epilogue
from weavepass.runtime.cuda.launch_plan import MAX_CTAS, LaunchOverrides, choose_launch_plan
from weavepass.runtime.cuda.launcher import DirectLauncher
from weavepass.runtime.cuda.quant_epilogue import QuantEpilogue, QuantFormIssue, kernel_quant
from weavepass.runtime.cuda.support import CudaIssue, cuda_quant_epilogue, cuda_unsupported_reason
from weavepass.runtime.cuda.workspace import (
    DEFAULT_WORKSPACE_TOKENS,
    constant_vector,
    get_workspace,
    lamport_flag_slot,
    ones_weight,
)
from weavepass.runtime.issue import Unsupported
from weavepass.runtime.portable import (
    fused_allreduce_layernorm_portable,
    fused_allreduce_rmsnorm_portable,
    fused_allreduce_rmsnorm_quant_portable,
    resolve_group,
    rows_per_rank,
)

logger = logging.getLogger("weavepass")

disable_multicast(override=False)  # before this process's first symmetric allocation

_WARNED: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        logger.warning(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


@dataclass
class _Launch(DirectLauncher):
    """Everything one call of a given signature needs besides its tensors: worked out on the first
    call (validation, plan, workspace, kernel) and reused, so a call costs two output allocations
    and one direct launch (``launcher.DirectLauncher``: the kernel's arguments are ``(partial,
    residual, weight, normed, residual_out, inv_rms, bias, codes, scales, static_scale, qconst,
    *tail, eps)``; the last four are the quantized epilogue's, any tensor stands in without one)."""

    hidden: int = 0
    ones: torch.Tensor | None = None  # the weight of a norm without scale
    empty: bool = False  # no rows: nothing to launch
    zeros: torch.Tensor | None = None  # the bias of a LayerNorm without one
    contiguous: tuple = (True, True, True)  # whether partial, residual, weight are contiguous (no copy)
    same_dtype: bool = True  # whether out_dtype is partial's dtype
    on_stream: bool = False  # whether a call may launch on another stream without making it current
    quant: QuantEpilogue | None = None  # the quantized epilogue (fused_allreduce_rmsnorm_quant_cuda)
    qconst: torch.Tensor | None = None  # its constants on the device
    normed_stand_in: torch.Tensor | None = None  # the normed pointer when the rows are not returned


"""Cached for a call signature the kernel can never serve: later calls go straight to portable."""
_LAUNCHES: dict[tuple, _Launch | str] = {}


def fused_allreduce_rmsnorm_cuda(
    partial: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    eps: float,
    group_name: str,
    out_dtype: torch.dtype,
    *,
    max_workspace_tokens: int = DEFAULT_WORKSPACE_TOKENS,
    return_inv_rms: bool = False,
    layer_norm: bool = False,
    bias: torch.Tensor | None = None,
    stream: torch.cuda.Stream | None = None,
    **overrides,
) -> tuple[torch.Tensor, ...]:
    """``partial`` [..., H] -> ``(normed, residual_out)``, same math and shapes as the portable lowering;
    with ``return_inv_rms`` also the per-row inverse RMS ``[..., 1]`` in fp32 (a training graph's).
    ``layer_norm``: a LayerNorm with an optional ``bias`` instead of the RMSNorm
    (``fused_allreduce_layernorm_cuda``).

    The kernel reads the partial sums once: the peers' rows are pushed into their symmetric staging
    buffers (the reduce-scatter's transfer), this rank's own rows are reduced in place (no copy pass;
    docs/cuda_kernel.md, "Local cost", says what writing the matmul into the workspace would save). Outputs are
    fresh tensors, never views of the workspace, which the next call reuses. Unsupported inputs and
    batches larger than ``max_workspace_tokens`` (the op call's ``workspace_tokens``) run the portable
    lowering instead, with a one-time warning. A norm without weight (``weight=None``) scales by 1.

    ``overrides`` are fields of ``LaunchOverrides`` (benchmarks, tests, the async op's grid).

    ``stream``: the stream to run on instead of the current one (the async op's communication
    stream, which must already wait for the inputs). A call of a known signature with contiguous
    inputs launches there directly, its outputs allocated on the current stream (the caller orders
    their use and their release after the kernel: ``weavepass.runtime.streams``). Any other call
    (the first of its signature, a copy of a strided input, the portable fallback) runs whole with
    ``stream`` made current, so that every piece of GPU work it queues stays in that stream's order.

    The first call of each signature (shapes, dtypes, devices, group, options) validates and plans;
    later ones reuse that (``_LAUNCHES``): this op runs once per site and forward pass, and at small
    batches its host cost, not the kernel, sets the time (benchmarks/bench_host_overhead.py).
    """
    options = tuple(sorted(overrides.items())) if overrides else ()
    # Every property the compiled kernel depends on is in the key (the direct launch trusts it):
    # dtypes (Triton specialises on pointer types), shapes (integer arguments), and strides (which
    # inputs are copied to contiguous rows first: ``_Launch.contiguous``).
    key = (
        partial.shape, partial.stride(), partial.dtype, partial.device,
        None if residual is None else (residual.shape, residual.stride(), residual.dtype, residual.device),
        None if weight is None else (weight.shape, weight.stride(), weight.dtype, weight.device),
        group_name, out_dtype, max_workspace_tokens, options, return_inv_rms,
        layer_norm and (None if bias is None else (bias.shape, bias.stride(), bias.dtype, bias.device)),
    )
    launch = _LAUNCHES.get(key)
    if stream is not None and not (launch.__class__ is _Launch and launch.on_stream and launcher.DIRECT_LAUNCH):
        with torch.cuda.stream(stream):  # see the docstring
            return fused_allreduce_rmsnorm_cuda(
                partial, residual, weight, eps, group_name, out_dtype, max_workspace_tokens=max_workspace_tokens,
                return_inv_rms=return_inv_rms, layer_norm=layer_norm, bias=bias, **overrides)
    if launch is None:
        launch = _prepare(partial, residual, weight, group_name, out_dtype, max_workspace_tokens,
                          LaunchOverrides(**overrides), return_inv_rms, layer_norm, bias)
        if launch is not None:
            _LAUNCHES[key] = launch
    if not isinstance(launch, _Launch):  # unsupported or no workspace: the reason was warned once
        if layer_norm:
            return fused_allreduce_layernorm_portable(partial, residual, weight, bias, eps, group_name, out_dtype)
        return fused_allreduce_rmsnorm_portable(partial, residual, weight, eps, group_name, out_dtype,
                                                return_inv_rms=return_inv_rms)
    # The kernel reads rows through raw pointers: a contiguous tensor of any shape [..., H] is its
    # [T, H] matrix already (no reshape needed); others are copied once.
    p_contiguous, r_contiguous, w_contiguous = launch.contiguous
    rows = partial if p_contiguous else partial.contiguous()
    normed = torch.empty_like(rows) if launch.same_dtype else torch.empty_like(rows, dtype=out_dtype)
    residual_out = torch.empty_like(rows)
    # Training only: the kernel writes one fp32 per row (any pointer stands in otherwise).
    inv_rms = partial.new_empty((*partial.shape[:-1], 1), dtype=torch.float32) if return_inv_rms else normed
    if launch.empty:
        return (normed, residual_out, inv_rms) if return_inv_rms else (normed, residual_out)
    if residual is None:
        res = rows
    else:
        res = residual if r_contiguous else residual.contiguous()
    if weight is None:
        w = launch.ones
    else:
        w = weight if w_contiguous else weight.contiguous()
    # The bias: a LayerNorm's own (zeros without one); an RMSNorm reads none (the weight stands in).
    b = w if not layer_norm else launch.zeros if bias is None else bias if bias.is_contiguous() else bias.contiguous()
    launch.launch((rows, res, w, normed, residual_out, inv_rms, b, w, w, w, w), (eps,), stream)
    return (normed, residual_out, inv_rms) if return_inv_rms else (normed, residual_out)


def fused_allreduce_layernorm_cuda(partial, residual, weight, bias, eps, group_name, out_dtype, *,
                                   max_workspace_tokens: int = DEFAULT_WORKSPACE_TOKENS, **overrides):
    """The CUDA lowering of ``weave.fused_allreduce_layernorm``: the same kernels with a LayerNorm
    (``reference.add_layernorm_local``) in place of the RMSNorm."""
    return fused_allreduce_rmsnorm_cuda(partial, residual, weight, eps, group_name, out_dtype,
                                        max_workspace_tokens=max_workspace_tokens, layer_norm=True,
                                        bias=bias, **overrides)



def fused_allreduce_rmsnorm_quant_cuda(
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
    max_workspace_tokens: int = DEFAULT_WORKSPACE_TOKENS,
    **overrides,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The CUDA lowering of ``weave.fused_allreduce_rmsnorm_quant``: the same kernels, whose norm
    epilogue quantizes the rows it has just normalised (``kernels._quantize_rows``;
    ``quant_epilogue`` says which forms, and how each rounds). Returns ``(codes, scales,
    residual_out, normed)`` shaped as the portable lowering's: codes ``[..., H]`` (grouped:
    ``[..., H/g, g]``), scales ``[..., 1]`` (grouped ``[..., H/g, 1]``; static: a copy of
    ``static_scale``), ``normed`` empty unless ``return_normed``. A form the kernel does not carry,
    and what ``fused_allreduce_rmsnorm_cuda`` cannot serve, run the portable lowering (warned once)."""
    options = tuple(sorted(overrides.items())) if overrides else ()
    key = (
        "quant", partial.shape, partial.stride(), partial.dtype, partial.device,
        None if residual is None else (residual.shape, residual.stride(), residual.dtype, residual.device),
        None if weight is None else (weight.shape, weight.stride(), weight.dtype, weight.device),
        group_name, out_dtype, max_workspace_tokens, options,
        None if static_scale is None else (static_scale.shape, static_scale.dtype, static_scale.device),
        group_size, scale_steps, code_steps, return_normed, quant_epilogue.FAST_ARITHMETIC,
    )
    launch = _LAUNCHES.get(key)
    if launch is None:
        hidden = partial.shape[-1] if partial.dim() else 0
        static = None if static_scale is None else (static_scale.dtype, static_scale.dim())
        quant = cuda_quant_epilogue(out_dtype, hidden, partial.device, static, group_size, scale_steps, code_steps,
                                    return_normed)
        if isinstance(quant, QuantEpilogue) and static_scale is not None and (
                static_scale.numel() != 1 or static_scale.device != partial.device):
            quant = Unsupported(QuantFormIssue.STATIC_SCALE_NOT_SCALAR)
        launch = _prepare(partial, residual, weight, group_name, out_dtype, max_workspace_tokens,
                          LaunchOverrides(**overrides), quant=quant)
        if launch is not None:
            _LAUNCHES[key] = launch
    if not isinstance(launch, _Launch):  # unsupported or no workspace: the reason was warned once
        return fused_allreduce_rmsnorm_quant_portable(partial, residual, weight, eps, group_name, out_dtype,
                                                      static_scale, group_size, scale_steps, code_steps,
                                                      return_normed)
    quant = launch.quant
    p_contiguous, r_contiguous, w_contiguous = launch.contiguous
    rows = partial if p_contiguous else partial.contiguous()
    lead = partial.shape[:-1]
    hidden = launch.hidden
    codes = torch.empty((*lead, hidden // group_size, group_size) if group_size else partial.shape,
                        dtype=quant.code_dtype, device=partial.device)
    if static_scale is not None:
        scales = torch.empty_like(static_scale, memory_format=torch.contiguous_format)
    else:
        scales = torch.empty((*lead, hidden // group_size, 1) if group_size else (*lead, 1),
                             dtype=quant.scale_dtype, device=partial.device)
    residual_out = torch.empty_like(rows)
    normed = torch.empty_like(rows, dtype=out_dtype) if return_normed else partial.new_empty((0,), dtype=out_dtype)
    if launch.empty:
        if static_scale is not None:
            scales.copy_(static_scale)
        return codes, scales, residual_out, normed
    res = rows if residual is None else residual if r_contiguous else residual.contiguous()
    w = launch.ones if weight is None else weight if w_contiguous else weight.contiguous()
    static = w if static_scale is None else static_scale
    launch.launch((rows, res, w, normed if return_normed else launch.normed_stand_in, residual_out, w, w,
                   codes, scales, static, launch.qconst), (eps,))
    return codes, scales, residual_out, normed


def _prepare(
    partial, residual, weight, group_name, out_dtype, max_tokens: int, overrides: LaunchOverrides,
    return_inv_rms: bool = False,
    layer_norm: bool = False,
    bias=None,
    quant: QuantEpilogue | Unsupported | None = None,
) -> _Launch | Lowering | None:
    """Validate a new call signature and plan its launch. ``Lowering.PORTABLE`` when the kernel cannot
    serve it; None when no workspace fits now (not cached: the batch may fit later outside
    CUDA-graph capture, or never: then the warning is not repeated)."""
    hidden = partial.shape[-1] if partial.dim() else 0
    reason = cuda_unsupported_reason(
        partial, residual, ones_weight(hidden, partial.dtype, partial.device) if weight is None else weight,
        group_name, out_dtype,
    )
    if reason is None and layer_norm and bias is not None and (
        bias.shape != (hidden,) or bias.device != partial.device
    ):
        reason = Unsupported(CudaIssue.BIAS_MISMATCH)
    if reason is None and isinstance(quant, Unsupported):
        reason = Unsupported.of(CudaIssue.QUANT_FORM, cause=quant)
    if reason is not None:
        _warn_once(str(reason), f"weave cuda_symm lowering falls back to portable: {reason}")
        return Lowering.PORTABLE
    num_tokens = partial.numel() // hidden
    world = resolve_group(group_name).size()
    elem = partial.element_size()
    plan = choose_launch_plan(num_tokens, hidden, elem, world, overrides)
    if plan.one_shot and not plan.lamport and world * num_tokens > max_tokens and overrides.one_shot is None:
        two_shot = replace(overrides, one_shot=False)
        plan = choose_launch_plan(num_tokens, hidden, elem, world, two_shot)
    owned = num_tokens if plan.one_shot else rows_per_rank(num_tokens, world)
    # The Lamport kernel uses its own region of the workspace, never the staging and recv rows.
    needed = hidden if plan.lamport else max(world * owned, num_tokens) * hidden
    ws = get_workspace(group_name, partial.dtype, partial.device, needed, hidden, max_tokens)
    if ws is None:
        _warn_once(
            f"capacity:{group_name}",
            f"weave cuda_symm lowering falls back to portable: {num_tokens} tokens x {hidden} need "
            f"{needed} workspace elements, more than the {max_tokens}-token workspace holds (or a new "
            "workspace would be allocated inside CUDA-graph capture); raise the workspace limit",
        )
        return None  # not cached: outside capture a later call may allocate it

    kernel, tail, meta = kernel_arguments(plan, ws, hidden, residual is not None, elem, num_tokens,
                                          return_inv_rms, layer_norm, quant)
    ones = ones_weight(hidden, partial.dtype, partial.device) if weight is None else None
    zeros = constant_vector(hidden, partial.dtype, partial.device, 0.0) if layer_norm and bias is None else None
    contiguous = tuple(t is None or t.is_contiguous() for t in (partial, residual, weight))
    # Launching on a given stream without making it current is only for calls that queue nothing
    # but the kernel: no input copies (a strided bias is copied too), rows to launch on.
    on_stream = all(contiguous) and (bias is None or bias.is_contiguous()) and num_tokens > 0
    launch = _Launch(kernel, (plan.num_ctas,), tail, meta, hidden=hidden, ones=ones, empty=num_tokens == 0,
                     zeros=zeros, contiguous=contiguous, same_dtype=out_dtype == partial.dtype, on_stream=on_stream)
    if quant is not None:
        launch.quant, launch.qconst = quant, quant.constants_tensor(partial.device)
        launch.normed_stand_in = torch.empty(8, dtype=out_dtype, device=partial.device)  # never written
    return launch


def kernel_arguments(plan, ws, hidden: int, has_residual: bool, element_size: int, num_tokens: int,
                     has_inv_rms: bool = False, layer_norm: bool = False, quant: QuantEpilogue | None = None):
    """``(kernel, tail, meta)`` of one call planned as ``plan`` on workspace ``ws``: the kernel runs
    as ``kernel[(plan.num_ctas,)](partial, residual, weight, normed, residual_out, inv_rms, bias,
    codes, scales, static_scale, qconst, *tail, eps, **meta)`` (also by
    ``weavepass.testing.kernel_sim``, on simulated workspaces). ``quant``: the quantized epilogue."""
    from weavepass.runtime.cuda import kernels

    world = ws.world
    meta = dict(
        RANK=ws.rank, WORLD=world, HIDDEN=hidden, BLOCK_H=plan.block_h, ROWS=plan.rows_per_tile,
        HAS_RESIDUAL=has_residual, HAS_INV_RMS=has_inv_rms, NORM=int(layer_norm), num_warps=plan.num_warps,
        QUANT=0 if quant is None else kernel_quant(quant),
    )
    if quant is not None:  # every step rounds as eager's separate ops do: no fused multiply-add
        meta.update(enable_fp_fusion=False)
    if plan.lamport:
        meta.update(BITS=8 * element_size, FLAG_SLOT=lamport_flag_slot(world))
        tail = (ws.buffer, ws.pad, *ws.buffer_deltas, num_tokens, ws.lamport_offset, ws.lamport_slot_elements,
                ws.watch, ws.timeout_ns)
        return kernels.fused_allreduce_rmsnorm_lamport_kernel, tail, meta
    if plan.pipelined:
        kernel = kernels.fused_allreduce_rmsnorm_pipelined_kernel
        meta.update(CHUNK_ROWS=plan.chunk_rows, PUSH_ROWS=plan.push_rows, LOAD_STAGES=plan.load_stages)
    else:
        kernel = kernels.fused_allreduce_rmsnorm_kernel
        meta.update(ONE_SHOT=plan.one_shot)
    meta.update(MAX_CTAS=MAX_CTAS)
    tail = (
        ws.buffer, ws.pad, *ws.buffer_deltas, *ws.pad_deltas,
        num_tokens, rows_per_rank(num_tokens, world), ws.capacity, ws.watch, ws.timeout_ns,
    )
    return kernel, tail, meta
