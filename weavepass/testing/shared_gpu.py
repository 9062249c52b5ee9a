"""Several ranks on one GPU: the multi-rank code paths checked where only one GPU is lent.

Set ``WEAVE_GPU_SHARED=1`` and the GPU tests' ``spawn`` (``allow_shared_gpu=True``: the tests only,
never the benchmarks) puts every rank on ``cuda:0`` with a gloo group (gloo
carries CUDA tensors; NCCL refuses two ranks on one device: "Duplicate GPU detected"), and each rank
builds the ``cuda_symm`` workspace through CUDA IPC handles (``torch.multiprocessing``) instead of
PyTorch symmetric memory, whose rendezvous refuses "allocations from overlapping devices from
different ranks". The kernels only ever see peer-minus-local address differences
(``runtime.cuda.workspace._Workspace``), so they run unchanged: pushes, barriers and Lamport flags go
to the peer process's allocation on the same device.

What it checks: the compile path at world N with real cross-process kernels, every rank making the
same rewrite decisions, the split's streams and joins, CUDA graphs, all on one GPU (measured on one
H200, 2026-12-01: the fused kernel at 2 ranks matched the reference and 50 back-to-back calls took
0.23 s; the processes' kernels take turns on the GPU, so a kernel waiting for its peer spins until
the GPU switches to the peer's context). What it does not: speed (the ranks time-slice one GPU),
NCCL (gloo stands in), PyTorch's symmetric-memory rendezvous, and NVLink. Nor cross-GPU memory
ordering and races: both ranks share one L2 and their kernels take turns, so a missing release /
acquire, a too-narrow fence scope or a slot reused too early (Lamport, the push variant's staging)
cannot show; gloo also makes the portable lowering's collectives synchronous with the host, which
hides stream-ordering mistakes there. A pass here is evidence about the compile path and the
arithmetic, not about the kernels' synchronisation across GPUs. Timings taken in this mode mean
nothing.
"""

from __future__ import annotations

import os

import torch

ENV = "WEAVE_GPU_SHARED"

_PEERS: list = []  # the peers' imported tensors: alive as long as the process (the workspace is)


def enabled() -> bool:
    """Whether the ranks share one GPU (``WEAVE_GPU_SHARED=1``)."""
    return os.environ.get(ENV, "") == "1"


def rank_device(rank: int) -> torch.device:
    """The CUDA device of ``rank``: ``cuda:rank``, or ``cuda:0`` when the ranks share one GPU."""
    return torch.device("cuda", 0 if enabled() else rank)


def gpus_needed(world: int) -> int:
    """GPUs a test of ``world`` ranks needs here: 1 when the ranks share one."""
    return 1 if enabled() else world


def _exchange(buffer: torch.Tensor, pad: torch.Tensor, group, rank: int, world: int) -> tuple[list[int], list[int]]:
    """Every rank's ``buffer`` and ``pad`` opened here through CUDA IPC (held in ``_PEERS`` for the
    process's life): their offsets from this rank's, in elements of each (the kernels' deltas)."""
    import torch.distributed as dist
    from torch.multiprocessing.reductions import reduce_tensor

    handles: list = [None] * world
    dist.all_gather_object(handles, (reduce_tensor(buffer), reduce_tensor(pad)), group=group)
    buffers, pads = [], []
    for peer, ((rebuild_b, args_b), (rebuild_p, args_p)) in enumerate(handles):
        buffers.append(buffer if peer == rank else rebuild_b(*args_b))
        pads.append(pad if peer == rank else rebuild_p(*args_p))
    _PEERS.append((buffers, pads))
    deltas = [(b.data_ptr() - buffer.data_ptr()) // buffer.element_size() for b in buffers]
    pad_deltas = [(p.data_ptr() - pad.data_ptr()) // pad.element_size() for p in pads]
    return deltas, pad_deltas


def _ipc_workspace(group_name: str, dtype: torch.dtype, device: torch.device, capacity: int,
                   purpose: str = "fused"):
    """``workspace._new_workspace`` through CUDA IPC: the same layout (regions, Lamport region of
    negative zeros, a signal pad of zeros), exchanged with the group's ranks by ``all_gather_object``."""
    import torch.distributed as dist

    from weavepass.runtime.cuda import workspace as ws
    from weavepass.runtime.cuda.support import MAX_WORLD
    from weavepass.runtime.portable import resolve_group

    group = resolve_group(group_name)
    rank, world = dist.get_rank(group), group.size()
    itemsize = torch.empty((), dtype=dtype).element_size()
    lamport = ws.lamport_region_elements(world, itemsize) if purpose == ws.FUSED else 0
    buffer = torch.empty(2 * capacity + lamport, dtype=dtype, device=device)
    buffer[:2 * capacity].fill_(float("nan"))  # as uninitialised as symm_mem.empty: rows read unwritten show
    buffer[2 * capacity:].fill_(-0.0)
    pad = torch.zeros(ws.lamport_flag_slot(world) + 2, dtype=torch.int32, device=device)
    torch.cuda.synchronize(device)  # filled before any peer can address them
    deltas, pad_deltas = _exchange(buffer, pad, group, rank, world)
    padding = [0] * (MAX_WORLD - world)
    dist.barrier(group)  # every rank imported every peer before any kernel runs
    from weavepass.runtime.cuda import peer_wait

    return ws._Workspace(buffer, pad, capacity, (*deltas, *padding), (*pad_deltas, *padding), rank, world,
                         watch=peer_wait.record_address(), timeout_ns=peer_wait.peer_timeout_ns(group_name))


def _ipc_symmetric(group_name: str, dtype: torch.dtype, device: torch.device, numel: int, pad_slots: int):
    """``workspace.new_symmetric`` through CUDA IPC: a buffer of NaNs (as uninitialised as
    ``symm_mem.empty``) and a pad of zeros, exchanged with the group's ranks by ``all_gather_object``."""
    import torch.distributed as dist

    from weavepass.runtime.cuda import peer_wait
    from weavepass.runtime.cuda import workspace as ws
    from weavepass.runtime.portable import resolve_group

    group = resolve_group(group_name)
    rank, world = dist.get_rank(group), group.size()
    buffer = torch.full((numel,), float("nan"), dtype=dtype, device=device)
    pad = torch.zeros(pad_slots, dtype=torch.int32, device=device)
    torch.cuda.synchronize(device)
    deltas, pad_deltas = _exchange(buffer, pad, group, rank, world)
    dist.barrier(group)
    return ws.SymmetricBuffer(buffer, pad, deltas, pad_deltas, rank, world, watch=peer_wait.record_address(),
                              timeout_ns=peer_wait.peer_timeout_ns(group_name))


def install() -> None:
    """In a rank process of a shared-GPU run: build workspaces through CUDA IPC (a no-op otherwise):
    the fused op's (``workspace._new_workspace``) and every other symmetric allocation
    (``workspace.new_symmetric``: the matmul op's staging and gather buffers)."""
    if not enabled():
        return
    from weavepass.runtime.cuda import workspace

    workspace._new_workspace = _ipc_workspace
    workspace.new_symmetric = _ipc_symmetric
