"""The ``cuda_symm`` lowering of ``weave.matmul_reduce_scatter_rmsnorm`` and its sharded form
(docs/gemm_epilogue.md, "The CUDA lowering").

One call on rank ``r`` of ``N``, on the current stream (every rank makes the same calls in the same
order, as with every ``cuda_symm`` op):

1. ``scatter_matmul``: this rank's partial ``x @ mat2`` by the persistent Triton GEMM, each tile
   stored into the symmetric staging of the rank that owns its token rows (peers first), with a
   signal per (owner, row block) (``runtime.cuda.gemm``).
2. ``reduce_scattered``: this rank's own rows, waiting per row block for every source's tiles: the
   sum in rank order in fp32, + residual, RMSNorm (the fused op's roundings), written into the
   outputs.
3. The full residual stream only (``weave.matmul_reduce_scatter_rmsnorm``): ``push_rows`` stores
   this rank's rows of both outputs into every peer's symmetric gather buffer and flags them;
   ``collect_rows`` waits for every peer's flag and copies their rows into the outputs. The sharded
   form (FlashComm) stops after step 2.

The owners' split is the fused op's for the full stream (``ceil(T / N)`` rows each, the last fewer),
FlashComm's for the sharded form (``rows_per_rank`` each, the last ones fewer or none, its padding
rows computed here as the portable lowering computes them: a zero sum plus the residual shard).

What the kernels address lives in a ``MatmulWorkspace`` per (group, dtype, device, hidden) and size
class, kept for the process: the staging and gather buffers, their pads and address tables, and
the split's device table per token count (``OwnerRows``). A CUDA graph keeps its kernels' arguments
as addresses (docs/gemm_epilogue.md, "CUDA graphs"), so nothing a kernel reads is built per call;
a workspace or a split needed for the first time inside a capture is not built there (symmetric
memory's rendezvous cannot be captured): that call runs the portable lowering, with a warning.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from weavepass.env import disable_multicast
from weavepass.runtime.cuda import workspace
from weavepass.runtime.cuda.gemm import (
    STAGING_ALIGNMENT,
    SUPPORTED_DTYPES,
    GatherLayout,
    GatherWorkspace,
    OwnerRows,
    ScatterLayout,
    ScatterPlan,
    ScatterWorkspace,
    collect_rows,
    push_rows,
    reduce_scattered,
    scatter_matmul,
)
from weavepass.runtime.cuda.launch_plan import triton_next_power_of_2
from weavepass.runtime.cuda.support import MAX_WORLD
from weavepass.runtime.portable import (
    matmul_reduce_scatter_rmsnorm_portable,
    matmul_reduce_scatter_rmsnorm_shard_portable,
    resolve_group,
    rows_per_rank,
)
from weavepass.runtime.reference import accumulation_dtype, add_rmsnorm_local

logger = logging.getLogger("weavepass")

disable_multicast(override=False)  # before this process's first symmetric allocation

ROW_ALIGNMENT = 16
"""Owner capacities are multiples of this many rows (FlashComm pads its shards to multiples of 16)."""

_WARNED: set[str] = set()

FALLBACKS: Counter[str] = Counter()
"""Calls of the ``cuda_symm`` matmul ops (the scatter ops here, ``weave.all_gather_matmul`` in
``gather_op``) that ran the portable lowering (cuBLAS's matmul and the group's collectives) instead of
the Triton kernels, per reason, every call counted (the warning is once per reason): a benchmark
reads it so that it never reports the portable path's time as the kernels'
(benchmarks/bench_overlap.py)."""


def _warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        logger.warning(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _sm_count(device: torch.device) -> int:
    from weavepass.runtime.cuda.gemm import _sm_count as count

    return count(device.index or 0) if device.type == "cuda" else 4


@dataclass
class MatmulWorkspace:
    """One rank's symmetric buffers for the matmul op of one (group, dtype, device, hidden) and size
    class: the scatter's staging and pad, the gather's (allocated at the first full-stream call),
    and the splits it has served (``owners``), all kept as long as the process."""

    group_name: str
    tokens: int  # size class: the largest call (tokens) it serves
    scatter: ScatterWorkspace
    gather: GatherWorkspace | None = None
    splits: dict[tuple[int, int], OwnerRows] = field(default_factory=dict)
    make_gather: Callable[[], GatherWorkspace] | None = None  # collective: every rank at the same call

    @property
    def world(self) -> int:
        return self.scatter.layout.world

    @property
    def rank(self) -> int:
        return self.scatter.rank

    def owners(self, num_tokens: int, per_owner: int) -> OwnerRows | None:
        """The split of ``num_tokens`` rows into ``per_owner`` rows each (the last ones fewer or none),
        its device table built once, outside CUDA-graph pools; None inside a capture that needs a
        new one."""
        key = (num_tokens, per_owner)
        owners = self.splits.get(key)
        if owners is None:
            if _capturing():
                return None
            device = self.scatter.staging.device
            counts = [max(0, min(per_owner, num_tokens - j * per_owner)) for j in range(self.world)]
            build = lambda: OwnerRows.build(num_tokens, self.world, device, counts)  # noqa: E731
            owners = workspace.outside_graph_pools(build, device) if device.type == "cuda" else build()
            self.splits[key] = owners
        return owners

    def gather_workspace(self) -> GatherWorkspace | None:
        """The gather buffers (allocated at the first full-stream call; None inside a capture)."""
        if self.gather is None:
            if _capturing() or self.make_gather is None:
                return None
            self.gather = self.make_gather()
        return self.gather


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def capacity_rows(tokens: int, world: int) -> int:
    """Rows per (slot, source) block of the staging for calls of at most ``tokens`` tokens."""
    per = -(-tokens // world)
    return -(-per // ROW_ALIGNMENT) * ROW_ALIGNMENT


def _tables(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def _new_matmul_workspace(group_name: str, dtype: torch.dtype, device: torch.device, hidden: int,
                          tokens: int) -> MatmulWorkspace:
    """Collective: the staging of a size class through ``workspace.new_symmetric`` (looked up on
    the module, so that ``testing.shared_gpu`` may replace it)."""
    world = resolve_group(group_name).size()
    layout = ScatterLayout(world, hidden, capacity_rows(tokens, world))
    sym = workspace.new_symmetric(group_name, dtype, device, layout.staging_elements, layout.pad_slots)
    if any(d % STAGING_ALIGNMENT for d in sym.deltas):
        raise RuntimeError(f"symmetric staging addresses are not {STAGING_ALIGNMENT} elements apart: {sym.deltas}")
    # A group of one: its staging is every owner's, one allocation (the scatter's TMA stores may serve).
    scatter = ScatterWorkspace(layout, sym.rank, sym.buffer, sym.pad, _tables(sym.deltas, device),
                               _tables(sym.pad_deltas, device), sym.watch, sym.timeout_ns,
                               sym.buffer if world == 1 else None)

    def make_gather() -> GatherWorkspace:
        lay = GatherLayout(world, hidden, tokens)

        def build() -> GatherWorkspace:
            g = workspace.new_symmetric(group_name, dtype, device, lay.elements, lay.pad_slots)
            return GatherWorkspace(lay, g.rank, g.buffer, g.pad, _tables(g.deltas, device),
                                   _tables(g.pad_deltas, device), g.watch, g.timeout_ns)

        return workspace.outside_graph_pools(build, device)

    return MatmulWorkspace(group_name, tokens, scatter, make_gather=make_gather)


_WORKSPACES: dict[tuple[str, torch.dtype, int | None, int], list[MatmulWorkspace]] = {}


def get_matmul_workspace(group_name: str, dtype: torch.dtype, device: torch.device, hidden: int, needed: int,
                         max_tokens: int) -> MatmulWorkspace | None:
    """The smallest cached workspace serving calls of ``needed`` tokens (the split's rows times the
    world, padding included); allocates the next size class (power-of-two tokens, at least
    ``workspace.MIN_WORKSPACE_TOKENS``, at most ``max_tokens`` rounded up to FlashComm's padding)
    when none fits. None when the call is larger, or inside CUDA-graph capture."""
    world = resolve_group(group_name).size()
    limit = -(-max_tokens // (ROW_ALIGNMENT * world)) * ROW_ALIGNMENT * world
    if needed > limit:
        return None
    cached = _WORKSPACES.setdefault((group_name, dtype, device.index, hidden), [])
    fitting = [ws for ws in cached if ws.tokens >= needed]
    if fitting:
        return min(fitting, key=lambda ws: ws.tokens)
    if _capturing():
        return None
    tokens = min(max(workspace.MIN_WORKSPACE_TOKENS, triton_next_power_of_2(needed)), limit)
    ws = workspace.outside_graph_pools(
        lambda: _new_matmul_workspace(group_name, dtype, device, hidden, tokens), device)
    cached.append(ws)
    return ws


def unsupported_reason(x: torch.Tensor, mat2: torch.Tensor, residual: torch.Tensor | None,
                       weight: torch.Tensor | None, group_name: str, out_dtype: torch.dtype) -> str | None:
    """Why the kernels cannot serve this call (it then runs the portable lowering), or None."""
    if x.device.type != "cuda" or mat2.device != x.device:
        return f"the operands are on {x.device} and {mat2.device}, not one CUDA device"
    if x.dim() != 2 or mat2.dim() != 2 or x.shape[1] != mat2.shape[0]:
        return f"x {tuple(x.shape)} and mat2 {tuple(mat2.shape)} are not [T, K] and [K, H]"
    if x.dtype not in SUPPORTED_DTYPES or mat2.dtype != x.dtype:
        return f"the Triton GEMM takes bf16 or fp16 operands of one dtype, not {x.dtype} and {mat2.dtype}"
    if out_dtype != x.dtype:
        return f"the norm's output dtype {out_dtype} is not the rows' {x.dtype}"
    hidden = mat2.shape[1]
    if hidden % 8:
        return f"hidden size {hidden} is not a multiple of 8 (16-byte vectors)"
    if weight is not None and (weight.shape != (hidden,) or weight.device != x.device):
        return "the norm's weight is not a [hidden] tensor on the operands' device"
    if residual is not None and residual.device != x.device:
        return "the residual is on another device"
    return group_world(group_name)[1]


def group_world(group_name: str) -> tuple[int, str | None]:
    """``(size, None)`` for a group the GEMM kernels can serve, else ``(size or 0, why not)``: it
    cannot be resolved, or its size is outside 1..``MAX_WORLD``."""
    try:
        world = resolve_group(group_name).size()
    except Exception as error:  # noqa: BLE001 (any failure to resolve is the reason)
        return 0, f"process group {group_name!r} cannot be resolved: {error}"
    if not 1 <= world <= MAX_WORLD:
        return world, f"world size {world} is outside 1..{MAX_WORLD}"
    return world, None


@dataclass
class MatmulCall:
    """One call's steps on one rank (``run`` in order; ``testing.gemm_sim`` runs every rank's step
    before the next step): its tensors, outputs and the workspace's tables."""

    ws: MatmulWorkspace
    owners: OwnerRows
    x: torch.Tensor  # [T, K] contiguous
    w: torch.Tensor  # [H, K] contiguous (mat2 transposed)
    residual: torch.Tensor | None  # this rank's rows [count, H], contiguous
    weight: torch.Tensor
    eps: float
    normed: torch.Tensor  # [T, H] (full stream) or [rows_per_rank, H] (sharded)
    residual_out: torch.Tensor
    full: bool  # the full stream: the outputs hold every token's rows, gathered
    num_ctas: int
    plan: ScatterPlan | None = None  # the signature's planned launches (the op's calls), else the general path

    @property
    def start(self) -> int:
        return self.owners.starts[self.ws.rank]

    @property
    def count(self) -> int:
        return self.owners.count(self.ws.rank)

    def own(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's rows of an output (no rows: the whole tensor, which the kernel does not touch;
        an empty slice at the end of the rows could point one past its allocation, which Triton's
        launcher refuses)."""
        if self.count == 0:
            return t
        return t[self.start: self.start + self.count] if self.full else t[: self.count]

    def gemm(self) -> None:
        if self.plan is not None:
            self.plan.gemm(self.x, self.w)
        else:
            scatter_matmul(self.x, self.w, self.ws.scatter, self.owners)

    def reduce(self) -> None:
        if self.plan is not None:
            self.plan.reduce(self.residual, self.weight, self.own(self.normed), self.own(self.residual_out))
        else:
            reduce_scattered(self.ws.scatter, self.count, self.residual, self.weight, self.eps,
                             self.own(self.normed), self.own(self.residual_out), self.num_ctas)

    def push(self) -> None:
        if self.full and self.ws.world > 1:
            push_rows(self._gather(), self.normed, self.residual_out, self.start, self.count, self.num_ctas)

    def collect(self) -> None:
        if self.full and self.ws.world > 1:
            collect_rows(self._gather(), self.normed, self.residual_out, self.start, self.count, self.num_ctas)

    def _gather(self) -> GatherWorkspace:
        if self.ws.gather is None:  # _lowering_call allocates it before any full-stream call
            raise RuntimeError("the full stream's gather buffers are not allocated")
        return self.ws.gather

    def run(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.gemm()
        self.reduce()
        self.push()
        self.collect()
        return self.normed, self.residual_out


def prepare_call(ws: MatmulWorkspace, owners: OwnerRows, x: torch.Tensor, mat2: torch.Tensor,
                 residual: torch.Tensor | None, weight: torch.Tensor | None, eps: float, out_dtype: torch.dtype,
                 rows_out: int | None, num_ctas: int | None = None) -> MatmulCall:
    """The call's operands and outputs: ``rows_out`` None for the full stream (outputs ``[T, H]``,
    ``residual`` any view of ``T x H`` elements), else the sharded form's ``[rows_out, H]``
    (``residual`` this rank's ``[rows_out, H]`` shard)."""
    hidden = mat2.shape[1]
    tokens = x.shape[0]
    w = mat2.t()
    if not w.is_contiguous():
        _warn_once("mat2", "weave cuda_symm matmul op: mat2 is not a transposed contiguous weight; it is copied "
                           "every call")
        w = w.contiguous()
    x = x if x.is_contiguous() else x.contiguous()
    full = rows_out is None
    rows = tokens if full else rows_out
    normed = torch.empty(rows, hidden, dtype=out_dtype, device=x.device)  # type: ignore[arg-type]
    residual_out = torch.empty(rows, hidden, dtype=x.dtype, device=x.device)  # type: ignore[arg-type]
    rank = ws.rank
    start, count = owners.starts[rank], owners.count(rank)
    own = None
    if residual is not None:
        r = residual.reshape(-1, hidden)
        r = r if r.is_contiguous() else r.contiguous()
        own = r if count == 0 else r[start: start + count] if full else r[:count]  # (MatmulCall.own)
    if weight is None:
        weight = workspace.ones_weight(hidden, x.dtype, x.device)
    ctas = num_ctas or _sm_count(x.device)
    return MatmulCall(ws, owners, x, w, own, weight, eps, normed, residual_out, full, ctas)


def pad_shard_rows(call: MatmulCall, residual: torch.Tensor | None, weight: torch.Tensor | None, eps: float,
                   out_dtype: torch.dtype) -> None:
    """The sharded outputs' rows past this rank's tokens, as the portable lowering computes them:
    a zero sum plus the residual shard's rows, normalised (zeros without a residual)."""
    count, rows = call.count, call.normed.shape[0]
    if count == rows:
        return
    if residual is None:
        call.normed[count:].zero_()
        call.residual_out[count:].zero_()
        return
    pad = residual.reshape(-1, call.normed.shape[1])[count:]
    zeros = pad.new_zeros(pad.shape, dtype=accumulation_dtype(call.x.dtype))
    normed, residual_out = add_rmsnorm_local(zeros, pad, weight, eps, out_dtype, call.x.dtype)
    call.normed[count:].copy_(normed)
    call.residual_out[count:].copy_(residual_out)


def _lowering_call(x, mat2, residual, weight, eps, group_name, out_dtype, max_tokens: int,
                   rows_out: int | None) -> MatmulCall | str:
    """The prepared call, or why it runs the portable lowering (warned once per reason)."""
    cause = unsupported_reason(x, mat2, residual, weight, group_name, out_dtype)
    if cause is not None:
        return cause
    world = resolve_group(group_name).size()
    tokens = x.shape[0]
    per_owner = rows_per_rank(tokens, world) if rows_out is None else rows_out
    if per_owner * world < tokens:
        return f"{tokens} tokens do not fit {world} shards of {per_owner} rows"
    ws = get_matmul_workspace(group_name, x.dtype, x.device, mat2.shape[1], per_owner * world, max_tokens)
    if ws is None:
        return (f"{tokens} tokens need a workspace larger than the {max_tokens}-token limit (or a new one "
                "inside CUDA-graph capture); raise WeaveConfig.cuda_workspace_tokens")
    owners = ws.owners(tokens, per_owner)
    if owners is None:
        return f"the split of {tokens} tokens is new inside CUDA-graph capture (a warm-up call builds it)"
    if rows_out is None and world > 1 and ws.gather_workspace() is None:
        return "the gather buffers would be allocated inside CUDA-graph capture (a warm-up call allocates them)"
    return prepare_call(ws, owners, x, mat2, residual, weight, eps, out_dtype, rows_out)


_PLANS: dict[tuple, tuple[MatmulWorkspace, ScatterPlan]] = {}
"""The planned launches of each call signature the kernels have served (``_planned_call``)."""
PLAN_CALLS = os.environ.get("WEAVE_MATMUL_PLANS", "1") != "0"
"""Debugging switch: ``WEAVE_MATMUL_PLANS=0`` validates and plans every call of the matmul ops, each
launch through Triton's dispatch, as before the plans, and every call of the gather op
(``gather_op._served``); read at each call as ``matmul.PLAN_CALLS`` (benchmarks/bench_host_overhead.py
measures both ways of the matmul ops in one process)."""


def _planned_call(x, mat2, residual, weight, eps, group_name, out_dtype, max_tokens: int,
                  rows_out: int | None) -> MatmulCall | str:
    """``_lowering_call``, validated and planned at the first call of each signature and then only
    prepared (outputs allocated, the residual's rows taken): at a small batch the op is host-bound
    (``gemm.ScatterPlan``). Every property the checks, the workspace, the split and the launches
    depend on is in the key: shapes, strides (what is copied to contiguous first), dtypes, devices,
    eps, the group and the limits. A workspace, once chosen for a signature, stays the smallest that
    fits it (a new one is allocated only when none fits), and a split's table is kept for the process."""
    key = (x.shape, x.stride(), x.dtype, x.device, mat2.shape, mat2.stride(), mat2.dtype, mat2.device,
           None if residual is None else (residual.shape, residual.stride(), residual.dtype, residual.device),
           None if weight is None else (weight.shape, weight.stride(), weight.dtype, weight.device),
           eps, group_name, out_dtype, max_tokens, rows_out)
    if not PLAN_CALLS:
        return _lowering_call(x, mat2, residual, weight, eps, group_name, out_dtype, max_tokens, rows_out)
    planned = _PLANS.get(key)
    if planned is not None:
        ws, plan = planned
        call = prepare_call(ws, plan.owners, x, mat2, residual, weight, eps, out_dtype, rows_out)
        call.plan = plan
        return call
    call = _lowering_call(x, mat2, residual, weight, eps, group_name, out_dtype, max_tokens, rows_out)
    if isinstance(call, str):
        return call  # not kept: outside a capture a later call may find its workspace or split
    call.plan = ScatterPlan(call.x, call.w, call.ws.scatter, call.owners, call.count, eps, call.num_ctas,
                            call.residual is not None)
    _PLANS[key] = (call.ws, call.plan)
    return call


def _fall_back(cause: str) -> None:
    FALLBACKS[cause] += 1
    _warn_once(cause, f"weave cuda_symm matmul op falls back to portable: {cause}")


def matmul_reduce_scatter_rmsnorm_cuda(x, mat2, residual, weight, eps, group_name, out_dtype, *,
                                       max_workspace_tokens: int = workspace.DEFAULT_WORKSPACE_TOKENS):
    """The ``cuda_symm`` kernel of ``weave.matmul_reduce_scatter_rmsnorm``: ``(normed, residual_out)``,
    both ``[T, H]`` (the module docstring says how). Calls the kernels cannot serve run the portable
    lowering, with a one-time warning."""
    if x.shape[0] == 0:
        return matmul_reduce_scatter_rmsnorm_portable(x, mat2, residual, weight, eps, group_name, out_dtype)
    call = _planned_call(x, mat2, residual, weight, eps, group_name, out_dtype, max_workspace_tokens, None)
    if isinstance(call, str):
        _fall_back(call)
        return matmul_reduce_scatter_rmsnorm_portable(x, mat2, residual, weight, eps, group_name, out_dtype)
    return call.run()


def matmul_reduce_scatter_rmsnorm_shard_cuda(x, mat2, residual, weight, eps, group_name, out_dtype, rows_per_rank,
                                             *, max_workspace_tokens: int = workspace.DEFAULT_WORKSPACE_TOKENS):
    """The ``cuda_symm`` kernel of ``weave.matmul_reduce_scatter_rmsnorm_shard``: this rank's
    ``[rows_per_rank, H]`` rows of ``(normed, residual_out)``, FlashComm's split."""
    args = (x, mat2, residual, weight, eps, group_name, out_dtype)
    if x.shape[0] == 0:
        return matmul_reduce_scatter_rmsnorm_shard_portable(*args, rows_per_rank)
    call = _planned_call(*args, max_workspace_tokens, rows_per_rank)
    if isinstance(call, str):
        _fall_back(call)
        return matmul_reduce_scatter_rmsnorm_shard_portable(*args, rows_per_rank)
    out = call.run()
    pad_shard_rows(call, residual, weight, eps, out_dtype)
    return out
