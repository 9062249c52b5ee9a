"""The kernel of ``weave::check_replicated`` (``WeaveConfig(check_replicated=True)``): check at run
time that a site's residual and norm weight are the same on every rank of its group.

Tensor parallelism keeps the residual stream and the norm weights replicated; the fused lowerings
rely on it, since each rank computes the add + RMSNorm of its own block of rows with its own copy
and gathers the rows from the others. A rank-dependent residual or weight therefore gives silently
wrong rows instead of an error. This debug check puts ``weave::check_replicated`` before each fused
site (``weavepass.compile.replication.insert_checks``): it all-gathers a digest of both tensors and
raises ``ReplicationError`` on mismatch.

The digest is exact and order-independent: the tensor's bits, read as integers, summed plainly and
weighted by position (int64 sums wrap the same way on every rank), so any change of one element is
seen, whatever the reduction order of the device's sum.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class ReplicationError(RuntimeError):
    """A tensor that tensor parallelism assumes replicated differs between ranks of a group."""


def digest(x: torch.Tensor) -> torch.Tensor:
    """``int64[2]``: the sum of ``x``'s bits read as integers, and that sum weighted by position."""
    bits = x.detach().contiguous().view(_INT_OF_SIZE[x.element_size()]).flatten().to(torch.int64)
    weights = torch.arange(bits.numel(), device=bits.device) % 8191 + 1
    return torch.stack([bits.sum(), (bits * weights).sum()])


def check_replicated(x: torch.Tensor, weight: torch.Tensor | None, x_name: str, site: str,
                     group_name: str, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel of ``weave.check_replicated`` (schema and fake: ``weavepass.ops``). Raise
    ``ReplicationError`` unless ``x``, ``weight`` and ``bias`` (a LayerNorm's) have the same digest
    on every rank of the group; return a copy of ``x`` (the fused op reads the copy, so the check
    stays in the functional graph ahead of it)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    group = _resolve_process_group(group_name)
    tensors = {x_name: x} | ({"norm weight": weight} if weight is not None else {}) | (
        {"norm bias": bias} if bias is not None else {})
    local = torch.cat([digest(t) for t in tensors.values()])
    gathered = torch.empty(group.size() * local.numel(), dtype=local.dtype, device=local.device)
    dist.all_gather_into_tensor(gathered, local, group=group)
    per_rank = gathered.view(group.size(), len(tensors), 2)
    ranks = dist.get_process_group_ranks(group)
    for i, name in enumerate(tensors):
        differ = [ranks[r] for r in range(group.size()) if not torch.equal(per_rank[r, i], per_rank[0, i])]
        if differ:
            raise ReplicationError(
                f"weavepass: the {name} of site {site} differs between ranks of group {group_name!r}: "
                f"ranks {differ} differ from rank {ranks[0]} (WeaveConfig.check_replicated). Tensor "
                "parallelism assumes the residual stream and the norm weights are replicated; each "
                "rank normalises its own block of rows with its own copy, so the result would be "
                "silently wrong. Broadcast them from one rank, or make the code that computes them "
                "identical on every rank"
            )
    return x.clone()
