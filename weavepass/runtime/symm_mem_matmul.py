"""FlashComm on CUDA: symmetric-memory fused matmul + reduce_scatter and all_gather + matmul.

When PyTorch symmetric memory serves the group, FlashComm's communication moves into the matmuls:

* ``torch.ops.symm_mem.fused_matmul_reduce_scatter(A [m, k], B [k, n], "sum", 0, group)
  -> [m / N, n]`` replaces ``mm -> reduce_scatter`` (row-parallel o_proj / down_proj), and
* ``torch.ops.symm_mem.fused_all_gather_matmul(A_shard [m / N, k], [B_1, ...], 0, group)
  -> (A [m, k], [A @ B_1, ...])`` replaces ``all_gather -> mm`` (the QKV and gate/up projections).

Both ops are micro-pipelined in PyTorch (chunks of the matmul overlap chunks of the transfer over
NVLink P2P copies). ``fused_all_gather_matmul`` has a multicast variant for small inputs; it is
never picked here: we always ask for ``return_A=True``, which that variant does not serve, and
FlashComm only runs above thousands of tokens. Otherwise FlashComm uses NCCL reduce_scatter /
all_gather (functional collectives), and the add + RMSNorm on the shard stays aten ops that Inductor
fuses into one Triton kernel.
"""

from __future__ import annotations

import torch

from weavepass.config import StrEnum
from weavepass.runtime.cuda.workspace import enable_symm_mem_for_group
from weavepass.runtime.issue import Unsupported, register

FUSED_MATMUL_REDUCE_SCATTER = "fused_matmul_reduce_scatter"
FUSED_ALL_GATHER_MATMUL = "fused_all_gather_matmul"


class SymmMemIssue(StrEnum):
    """Why PyTorch's symmetric-memory fused ops cannot take a group or a matmul."""

    UNAVAILABLE = "symm_mem_unavailable"
    NOT_ON_CUDA = "symm_mem_not_on_cuda"
    GROUP_UNRESOLVED = "symm_mem_group_unresolved"
    NOT_NCCL = "symm_mem_not_nccl"
    BIAS = "symm_mem_bias"
    NOT_2D = "symm_mem_not_2d"
    M_NOT_DIVISIBLE = "symm_mem_m_not_divisible"


SYMM_MEM_ISSUE_TEXT = {
    SymmMemIssue.UNAVAILABLE: "symmetric-memory fused ops unavailable in this torch ({error})",
    SymmMemIssue.NOT_ON_CUDA: "tensors are on {device}, not CUDA",
    SymmMemIssue.GROUP_UNRESOLVED: "process group {group!r} cannot be resolved: {error}",
    SymmMemIssue.NOT_NCCL: "process group backend is {backend}, not NCCL",
    SymmMemIssue.BIAS: "the matmul adds a bias (addmm); the fused op has no bias",
    SymmMemIssue.NOT_2D: "A is {dims}-D",
    SymmMemIssue.M_NOT_DIVISIBLE: "m={m} is not divisible by the world size {world}",
}
"""The sentence of each ``SymmMemIssue``, formatted with its fields."""
register(SYMM_MEM_ISSUE_TEXT)


def symm_mem_op(name: str):
    """``torch.ops.symm_mem.<name>.default``."""
    return getattr(torch.ops.symm_mem, name).default


def symm_mem_unavailable_reason(group_name: str, device: torch.device) -> Unsupported | None:
    """Why the symmetric-memory fused ops cannot run for this group, or None.

    PyTorch's symmetric-memory test mode (``torch.distributed._symmetric_memory._test_mode``) runs
    the fused ops as their unfused fallbacks on any device; it is accepted so the graph rewrite can
    be tested on CPU.
    """
    try:
        import torch.distributed._symmetric_memory as symm_mem

        for name in (FUSED_MATMUL_REDUCE_SCATTER, FUSED_ALL_GATHER_MATMUL):
            symm_mem_op(name)
    except (ImportError, AttributeError) as error:
        return Unsupported.of(SymmMemIssue.UNAVAILABLE, error=str(error))
    if getattr(symm_mem, "_is_test_mode", False):
        return None
    if torch.device(device).type != "cuda":
        return Unsupported.of(SymmMemIssue.NOT_ON_CUDA, device=torch.device(device).type)
    from weavepass.runtime.portable import resolve_group

    try:
        group = resolve_group(group_name)
    except Exception as error:  # an unknown group is a reason, not a crash
        return Unsupported.of(SymmMemIssue.GROUP_UNRESOLVED, group=group_name, error=str(error))
    backend = torch.distributed.get_backend(group)
    if "nccl" not in str(backend):
        return Unsupported.of(SymmMemIssue.NOT_NCCL, backend=str(backend))
    enable_symm_mem_for_group(group_name)
    return None


def matmul_reduce_scatter_unsupported_reason(
    x_shape: tuple[int, ...], world_size: int, has_bias: bool
) -> Unsupported | None:
    """Why ``fused_matmul_reduce_scatter`` cannot take this matmul, or None."""
    if has_bias:
        return Unsupported(SymmMemIssue.BIAS)
    if len(x_shape) != 2:
        return Unsupported.of(SymmMemIssue.NOT_2D, dims=len(x_shape))
    if x_shape[0] % world_size:
        return Unsupported.of(SymmMemIssue.M_NOT_DIVISIBLE, m=x_shape[0], world=world_size)
    return None
