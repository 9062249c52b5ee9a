"""The ``cuda_symm`` lowering of ``weave.all_gather_matmul`` (docs/gemm_epilogue.md, "The gather
prologue"): FlashComm's all_gather of a normed shard and the column-parallel matmuls after it.

One call on rank ``r`` of ``N``, on the current stream (every rank makes the same calls in the same
order, as with every ``cuda_symm`` op):

1. ``push_gather_rows``: this rank's real rows of its shard (``[R, K]``; owner ``j`` has tokens
   ``[j R, min((j + 1) R, T))``, FlashComm's split) into every rank's symmetric gather buffer at
   their token index, one flag per row block there.
2. ``gather_matmuls``: for each weight, the persistent GEMM over all ``T`` tokens' rows from the
   local gather buffer, own rows first, each tile after its row block's flag; the last launch
   releases the slot.

The workspace (``PrologueWorkspace`` per (group, dtype, device, K) and size class, kept for the
process) and each split's device table are built outside CUDA-graph pools and held here: a graph
keeps its kernels' arguments as addresses (docs/gemm_epilogue.md, "CUDA graphs"). One needed for the
first time inside a capture is not built there: that call runs the portable lowering, warned once.

The checks, the workspace and the split depend on the call's signature only (``_signature``): the
first call of a signature the kernels serve validates it and finds both, later ones look them up
(``_served``: no checks, no ``resolve_group`` through ``torch.distributed``). The launches go
through Triton's dispatch on every call.
"""

from __future__ import annotations

import logging
import warnings

import torch

from weavepass.env import disable_multicast
from weavepass.runtime.cuda import matmul, workspace
from weavepass.runtime.cuda.gather import ALIGNMENT, PrologueLayout, PrologueWorkspace, gather_matmuls, push_gather_rows
from weavepass.runtime.cuda.gemm import SUPPORTED_DTYPES, OwnerRows
from weavepass.runtime.cuda.launch_plan import triton_next_power_of_2
from weavepass.runtime.cuda.matmul import FALLBACKS, group_world
from weavepass.runtime.portable import all_gather_matmul_portable, resolve_group

logger = logging.getLogger("weavepass")

disable_multicast(override=False)  # before this process's first symmetric allocation

ROW_ALIGNMENT = 16
"""Owner capacities are multiples of this many rows (FlashComm's shards are)."""

_WARNED: set[str] = set()
_WORKSPACES: dict[tuple[str, torch.dtype, int | None, int], list[PrologueWorkspace]] = {}
_SPLITS: dict[tuple[int, int, int, int | None], OwnerRows] = {}
_SERVED: dict[tuple, tuple[PrologueWorkspace, OwnerRows]] = {}
"""The workspace and split of each call signature the kernels have served (``_served``)."""


def _warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        logger.warning(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def unsupported_reason(shard: torch.Tensor, mat2s: list[torch.Tensor], group_name: str,
                       num_tokens: int) -> str | None:
    """Why the kernels cannot serve this call (it then runs the portable lowering), or None."""
    if shard.device.type != "cuda" or any(m.device != shard.device for m in mat2s):
        return "the operands are not on one CUDA device"
    if shard.dim() != 2 or any(m.dim() != 2 or m.shape[0] != shard.shape[1] for m in mat2s) or not mat2s:
        return f"shard {tuple(shard.shape)} and the mat2s are not [R, K] and [K, N_i]"
    if shard.dtype not in SUPPORTED_DTYPES or any(m.dtype != shard.dtype for m in mat2s):
        weights = ", ".join(sorted({str(m.dtype) for m in mat2s}))
        return f"the Triton GEMM takes bf16 or fp16 operands of one dtype, not {shard.dtype} rows and {weights} weights"
    if shard.shape[1] % 8:
        return f"K = {shard.shape[1]} is not a multiple of 8 (16-byte vectors)"
    world, why = group_world(group_name)
    if why is not None:
        return why
    if shard.shape[0] * world < num_tokens:
        return f"{num_tokens} tokens do not fit {world} shards of {shard.shape[0]} rows"
    return None


def _new_workspace(group_name: str, dtype: torch.dtype, device: torch.device, hidden: int,
                   owner_capacity: int) -> PrologueWorkspace:
    """Collective: one size class's gather buffer and pad through ``workspace.new_symmetric``."""
    world = resolve_group(group_name).size()
    lay = PrologueLayout(world, hidden, owner_capacity)
    sym = workspace.new_symmetric(group_name, dtype, device, lay.elements, lay.pad_slots)
    if any(d % ALIGNMENT for d in sym.deltas):
        raise RuntimeError(f"symmetric gather buffers are not {ALIGNMENT} elements apart: {sym.deltas}")

    def table(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    return PrologueWorkspace(lay, sym.rank, sym.buffer, sym.pad, table(sym.deltas), table(sym.pad_deltas),
                             sym.watch, sym.timeout_ns)


def get_workspace(group_name: str, dtype: torch.dtype, device: torch.device, hidden: int, rows: int,
                  max_tokens: int) -> PrologueWorkspace | None:
    """The smallest cached workspace whose owners hold ``rows`` rows each; allocates the next size
    class (power-of-two tokens from ``workspace.MIN_WORKSPACE_TOKENS``, at most ``max_tokens``
    rounded up to FlashComm's padding) when none fits. None when the call is larger, or inside
    CUDA-graph capture."""
    world = resolve_group(group_name).size()
    limit = -(-max_tokens // (ROW_ALIGNMENT * world)) * ROW_ALIGNMENT
    if rows > limit:
        return None
    cached = _WORKSPACES.setdefault((group_name, dtype, device.index, hidden), [])
    fitting = [ws for ws in cached if ws.layout.owner_capacity >= rows]
    if fitting:
        return min(fitting, key=lambda ws: ws.layout.owner_capacity)
    if _capturing():
        return None
    tokens = max(workspace.MIN_WORKSPACE_TOKENS, triton_next_power_of_2(rows * world))
    capacity = min(-(-tokens // (world * ROW_ALIGNMENT)) * ROW_ALIGNMENT, limit)
    ws = workspace.outside_graph_pools(lambda: _new_workspace(group_name, dtype, device, hidden, capacity), device)
    cached.append(ws)
    return ws


def owners(num_tokens: int, per_owner: int, world: int, device: torch.device) -> OwnerRows | None:
    """FlashComm's split of ``num_tokens`` rows, ``per_owner`` each (the last ones fewer or none), its
    device table built once per process outside CUDA-graph pools; None inside a capture that needs a
    new one."""
    key = (num_tokens, per_owner, world, device.index)
    split = _SPLITS.get(key)
    if split is None:
        if _capturing():
            return None
        counts = [max(0, min(per_owner, num_tokens - j * per_owner)) for j in range(world)]
        split = workspace.outside_graph_pools(lambda: OwnerRows.build(num_tokens, world, device, counts), device)
        _SPLITS[key] = split
    return split


def _signature(shard: torch.Tensor, mat2s: list[torch.Tensor], group_name: str, num_tokens: int,
               max_tokens: int) -> tuple:
    """Every property ``unsupported_reason``, ``get_workspace`` and ``owners`` read: the shard's and
    each mat2's shape, dtype and device (their number), the group, the tokens and the limit. (Strides
    are not read there: whether a tensor is copied to contiguous is decided per call.)"""
    return (shard.shape, shard.dtype, shard.device, tuple((m.shape, m.dtype, m.device) for m in mat2s),
            group_name, num_tokens, max_tokens)


def _served(shard: torch.Tensor, mat2s: list[torch.Tensor], group_name: str, num_tokens: int,
            max_tokens: int) -> tuple[PrologueWorkspace, OwnerRows] | str:
    """The workspace and split of a call the kernels serve, or why it runs the portable lowering.
    Validated at the first call of each signature and then looked up (``_SERVED``; with
    ``matmul.PLAN_CALLS`` off, ``WEAVE_MATMUL_PLANS=0``, every call is validated). A workspace, once
    chosen for a signature, stays the smallest that fits it (a new one is allocated only when none
    fits, larger than every cached one), and a split's table is kept for the process, so a lookup
    gives what the checks would. A call that runs the portable lowering is not kept: outside a
    capture a later call of its signature may find its workspace or split."""
    key = _signature(shard, mat2s, group_name, num_tokens, max_tokens) if matmul.PLAN_CALLS else None
    if key is not None:
        served = _SERVED.get(key)
        if served is not None:
            return served
    if not num_tokens:
        return "no tokens"
    cause = unsupported_reason(shard, mat2s, group_name, num_tokens)
    if cause is not None:
        return cause
    world = resolve_group(group_name).size()
    ws = get_workspace(group_name, shard.dtype, shard.device, shard.shape[1], shard.shape[0], max_tokens)
    if ws is None:
        return (f"{num_tokens} tokens need a gather workspace larger than the {max_tokens}-token limit "
                "(or a new one inside CUDA-graph capture); raise WeaveConfig.cuda_workspace_tokens")
    split = owners(num_tokens, shard.shape[0], world, shard.device)
    if split is None:
        return f"the split of {num_tokens} tokens is new inside CUDA-graph capture (a warm-up call builds it)"
    if key is not None:
        _SERVED[key] = (ws, split)
    return ws, split


def all_gather_matmul_cuda(shard: torch.Tensor, mat2s: list[torch.Tensor], group_name: str, num_tokens: int, *,
                           max_workspace_tokens: int = workspace.DEFAULT_WORKSPACE_TOKENS) -> list[torch.Tensor]:
    """The ``cuda_symm`` kernel of ``weave.all_gather_matmul`` (the module docstring says how). Calls
    the kernels cannot serve run the portable lowering, with a one-time warning."""
    served = _served(shard, mat2s, group_name, num_tokens, max_workspace_tokens)
    if isinstance(served, str):
        if num_tokens:  # counted with the matmul ops' (a benchmark reads it: it must not time this as the kernels)
            FALLBACKS[served] += 1
            _warn_once(served, f"weave cuda_symm all_gather_matmul falls back to portable: {served}")
        return all_gather_matmul_portable(shard, mat2s, group_name, num_tokens)
    ws, split = served
    weights = []
    for mat2 in mat2s:
        w = mat2.t()
        if not w.is_contiguous():
            _warn_once("mat2", "weave cuda_symm all_gather_matmul: a mat2 is not a transposed contiguous weight; "
                               "it is copied every call")
            w = w.contiguous()
        weights.append(w)
    push_gather_rows(ws, shard if shard.is_contiguous() else shard.contiguous(), split)
    return gather_matmuls(ws, weights, split)
