"""Host side of the split's push variant (``WeaveConfig.split_comm="push"``, kernels:
``kernels.push_partial_rows_kernel`` and ``kernels.reduce_pushed_rows_kernel``; the stream
choreography is ``weavepass.runtime.streams.fused_allreduce_rmsnorm_push_async``).

One call of ``T`` rows on rank ``r`` of 2:

* side stream: ``push`` stores all ``T`` partial rows into the peer's staging slot ``slot`` (0 for
  half A, 1 for half B) with few CTAs, and returns once the peer's rows are in this rank's slot;
* compute stream, at the join: ``reduce`` sums its own partial and the peer's staged rows in rank
  order, adds the residual and normalises every row, with as many CTAs as the GPU holds.

World 2 only (``support.push_unsupported_reason``): one-shot moves ``(N - 1) S`` bytes per rank where
two-shot moves ``2 (N - 1) / N S``, equal at ``N = 2`` only.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from weavepass.env import disable_multicast
from weavepass.runtime.cuda.launch_plan import SMALL_TILE_BYTES, triton_next_power_of_2
from weavepass.runtime.cuda.launcher import DirectLauncher
from weavepass.runtime.cuda.support import (
    PUSH_WORLD,
    SUPPORTED_DTYPES,
    cuda_unsupported_reason,
    push_unsupported_reason,
)
from weavepass.runtime.cuda.workspace import PUSH, get_workspace, ones_weight
from weavepass.runtime.portable import resolve_group

disable_multicast(override=False)  # before this process's first symmetric allocation (as dispatch)

STAGING_SLOTS = 2
"""Staging slots per workspace: the split alternates halves A and B, one slot each."""
PUSH_CTAS = 16
"""Default grid of the push kernel. Measured for a plain peer-store kernel on 2 x H200
(../shared/DEVICE-FACTS.md): 16 CTAs reached 232 GB/s and cost GEMMs beside them 3 %; 32 CTAs
were no faster (258 GB/s) and cost the GEMMs 8 %. Not yet measured for this kernel."""
PUSH_ROWS_TILE_BYTES = 64 << 10
"""Bytes per push load/store tile (4 bf16 rows of 8192): a few CTAs only reach the link's rate
with many bytes in flight each (launch_plan.LARGE_TILE_BYTES, measured for the fused kernel)."""
REDUCE_CTAS_PER_SM = 4
"""Grid of the reduce kernel: up to this many CTAs per SM (it waits for nothing, so any grid is
correct). Not measured: a starting point for benchmarks/bench_overlap.py's ``weave_overlap_push``."""


def signal_slots(world: int) -> int:
    """Pad slots per staging slot: PUSH_SEQ, PUSH_DONE, REDUCE_SEQ, REDUCE_DONE, PUSHED[world],
    CONSUMED[world] (``kernels.push_partial_rows_kernel``)."""
    return 4 + 2 * world


@dataclass(frozen=True)
class PushArguments:
    """Grids, constexprs and trailing arguments of one call's two kernels on workspace ``ws``::

        push_partial_rows_kernel[push_grid](partial, *push_tail, **push_meta)
        reduce_pushed_rows_kernel[reduce_grid](partial, residual, weight, normed, residual_out,
                                              *reduce_tail, eps, **reduce_meta)
    """

    push_grid: tuple[int]
    push_tail: tuple
    push_meta: dict
    reduce_grid: tuple[int]
    reduce_tail: tuple
    reduce_meta: dict


def push_arguments(ws, num_tokens: int, hidden: int, element_size: int, slot: int, has_residual: bool,
                   push_ctas: int, reduce_ctas: int) -> PushArguments:
    """The kernels' arguments for ``num_tokens`` rows into staging slot ``slot`` of ``ws`` (also
    used by ``weavepass.testing.kernel_sim`` on simulated workspaces)."""
    if not 0 <= slot < STAGING_SLOTS:
        raise ValueError(f"staging slot {slot} outside 0..{STAGING_SLOTS - 1}")
    if (ws.world - 1) * num_tokens * hidden > ws.capacity:
        raise ValueError(f"{num_tokens} rows x {hidden} from {ws.world - 1} peer(s) exceed a staging slot "
                         f"of {ws.capacity} elements")
    block_h = triton_next_power_of_2(hidden)
    common = dict(RANK=ws.rank, WORLD=ws.world, HIDDEN=hidden, BLOCK_H=block_h)
    push_rows = max(1, PUSH_ROWS_TILE_BYTES // element_size // block_h)
    reduce_rows = max(1, SMALL_TILE_BYTES // element_size // block_h)
    where = (num_tokens, slot * ws.capacity, slot * signal_slots(ws.world))
    return PushArguments(
        push_grid=(max(1, min(push_ctas, -(-num_tokens // push_rows))),),
        push_tail=(ws.buffer, ws.pad, *ws.buffer_deltas, *ws.pad_deltas, *where, ws.watch, ws.timeout_ns),
        push_meta=dict(common, ROWS=push_rows, num_warps=_warps(push_rows * block_h * element_size)),
        reduce_grid=(max(1, min(reduce_ctas, -(-num_tokens // reduce_rows))),),
        reduce_tail=(ws.buffer, ws.pad, *ws.pad_deltas, *where),
        reduce_meta=dict(common, ROWS=reduce_rows, HAS_RESIDUAL=has_residual,
                         num_warps=_warps(reduce_rows * block_h * element_size)),
    )


def _warps(tile_bytes: int) -> int:
    """The fused kernel's rule (launch_plan): one warp per 4 KiB of tile, 8 to 16."""
    return max(8, min(16, tile_bytes // 4096))


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


class PushCall:
    """One prepared call signature: its two kernels per slot, each a ``launcher.DirectLauncher``
    (launched directly after its first launch, as the fused op's kernel), reused by every call (the
    slot is an argument of the op, so both halves of a site share one ``PushCall``)."""

    __slots__ = ("pushes", "reduces", "ones")

    def __init__(self, by_slot: tuple[PushArguments, ...], ones: torch.Tensor | None):
        from weavepass.runtime.cuda.kernels import push_partial_rows_kernel, reduce_pushed_rows_kernel

        self.pushes = tuple(DirectLauncher(push_partial_rows_kernel, a.push_grid, a.push_tail, a.push_meta)
                            for a in by_slot)
        self.reduces = tuple(DirectLauncher(reduce_pushed_rows_kernel, a.reduce_grid, a.reduce_tail, a.reduce_meta)
                             for a in by_slot)
        self.ones = ones  # the weight of a norm without scale

    def push(self, partial: torch.Tensor, slot: int, stream: torch.cuda.Stream | None = None) -> None:
        """The side-stream kernel, on ``stream`` (default: the current one)."""
        self.pushes[slot].launch((partial,), (), stream)

    def reduce(self, partial, residual, weight, normed, residual_out, eps: float, slot: int) -> None:
        """The compute-stream kernel, on the current stream: it must run after that stream waited
        for this call's ``push``."""
        self.reduces[slot].launch(
            (partial, partial if residual is None else residual, self.ones if weight is None else weight,
             normed, residual_out), (eps,))


_CALLS: dict[tuple, PushCall | None] = {}


def prepare_push(partial, residual, weight, group_name: str, out_dtype, max_tokens: int,
                 num_ctas: int) -> PushCall | None:
    """The prepared push call for these tensors, or None when the push kernels cannot serve it (the
    caller then runs the fused async op): a world other than 2, what the fused CUDA lowering cannot
    serve either (``support.cuda_unsupported_reason``), non-contiguous tensors, or more rows than
    ``max_tokens`` (the op call's ``workspace_tokens``). The answer depends only on the call's
    shapes, dtypes, group and options, so every rank gets the same one. ``num_ctas`` > 0 sets the
    push kernel's grid (``WeaveConfig.split_comm_ctas``)."""
    key = (partial.shape, partial.dtype, partial.device, partial.is_contiguous(),
           None if residual is None else (residual.shape, residual.dtype, residual.is_contiguous()),
           None if weight is None else (weight.shape, weight.dtype, weight.is_contiguous()),
           group_name, out_dtype, max_tokens, num_ctas)
    if key in _CALLS:
        return _CALLS[key]
    call = _prepare(partial, residual, weight, group_name, out_dtype, max_tokens, num_ctas)
    if call is not None or not torch.cuda.is_current_stream_capturing():
        _CALLS[key] = call  # (a workspace that could not be allocated during capture may be later)
    return call


def _prepare(partial, residual, weight, group_name, out_dtype, max_tokens, num_ctas) -> PushCall | None:
    hidden = partial.shape[-1] if partial.dim() else 0
    ones = ones_weight(hidden, partial.dtype, partial.device) if weight is None and hidden else None
    if cuda_unsupported_reason(partial, residual, ones if weight is None else weight, group_name) is not None:
        return None
    if out_dtype not in SUPPORTED_DTYPES or push_unsupported_reason(resolve_group(group_name).size()):
        return None
    if not all(t is None or t.is_contiguous() for t in (partial, residual, weight)):
        return None  # (the kernels read rows through raw pointers)
    num_tokens = partial.numel() // hidden
    if num_tokens == 0:
        return None
    ws = get_workspace(group_name, partial.dtype, partial.device, (PUSH_WORLD - 1) * num_tokens * hidden,
                       hidden, max_tokens, purpose=PUSH)
    if ws is None:
        return None
    reduce_ctas = REDUCE_CTAS_PER_SM * _sm_count(partial.device.index)
    by_slot = tuple(
        push_arguments(ws, num_tokens, hidden, partial.element_size(), slot, residual is not None,
                       num_ctas or PUSH_CTAS, reduce_ctas)
        for slot in range(STAGING_SLOTS))
    return PushCall(by_slot, ones)
