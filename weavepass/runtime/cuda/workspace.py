"""The symmetric workspace of the ``cuda_symm`` lowering: one rendezvoused buffer and signal pad per
(group, dtype, device) and size class, allocated on first need and kept for the process's lifetime
(the kernels' peers address it by pointer; CUDA graphs replay against it). Its capacity is asked
for by each call (``max_workspace_tokens``, from the op call), never set process-wide."""

from __future__ import annotations

import logging
import threading
import warnings
from dataclasses import dataclass

import torch

from weavepass.runtime.cuda import peer_wait
from weavepass.runtime.cuda.launch_plan import MAX_CTAS, triton_next_power_of_2
from weavepass.runtime.cuda.support import MAX_WORLD
from weavepass.runtime.portable import resolve_group

logger = logging.getLogger("weavepass")

DEFAULT_WORKSPACE_TOKENS = 16384
"""Largest batch (tokens) the workspace serves when a direct caller of the lowering does not say
(graphs pass ``WeaveConfig.cuda_workspace_tokens``, whose default this is); with hidden ``H`` the
workspace holds ``2 * tokens * H`` elements of the partial's dtype (512 MiB at H=8192, bf16)."""

MIN_WORKSPACE_TOKENS = 256  # smallest size class: decode-only runs stay small
SIGNAL_CHANNELS = 4  # two barriers (flat kernel) + two chunk counters (pipelined kernel)
LAMPORT_SLOT_BYTES = 256 << 10
"""Bytes per (parity, source rank) slot of the Lamport region: the largest batch the Lamport one-shot
kernel serves (``launch_plan.LAMPORT_MAX_BYTES``)."""


def lamport_flag_slot(world: int) -> int:
    """The pad slot of the Lamport kernel's call counter (the next slot counts finished programs):
    just past the barrier and counter channels."""
    return SIGNAL_CHANNELS * MAX_CTAS * world


def lamport_region_elements(world: int, element_size: int) -> int:
    return 2 * world * (LAMPORT_SLOT_BYTES // element_size)


@dataclass
class _Workspace:
    """One rendezvoused symmetric buffer: ``staging [capacity] | recv [capacity] | Lamport region`` in
    ``dtype``; the Lamport region (``[2 parities][world][LAMPORT_SLOT_BYTES]``) holds negative zeros
    between calls (kernels.fused_allreduce_rmsnorm_lamport_kernel). A ``PUSH`` workspace has no
    Lamport region: its two regions are the push variant's staging slots."""

    buffer: torch.Tensor  # local view of the symmetric allocation, [2 * capacity + Lamport region]
    pad: torch.Tensor  # local signal pad, int32
    capacity: int  # elements per region
    buffer_deltas: tuple[int, ...]  # peer address - local address, in elements, padded to MAX_WORLD
    pad_deltas: tuple[int, ...]  # the same for signal pads, in int32 slots
    rank: int
    world: int
    watch: int = 0  # address of the pinned record a kernel writes when a wait gives up (peer_wait), 0: none
    timeout_ns: int = 0  # how long a kernel waits for a peer before it gives up (peer_wait), 0: for ever

    @property
    def lamport_offset(self) -> int:
        return 2 * self.capacity

    @property
    def lamport_slot_elements(self) -> int:
        return LAMPORT_SLOT_BYTES // self.buffer.element_size()


_WORKSPACES: dict[tuple[str, torch.dtype, int, str], list[_Workspace]] = {}

FUSED = "fused"
"""Workspace purpose of the fused kernels: ``staging | recv | Lamport region``."""
PUSH = "push"
"""Workspace purpose of the split's push variant (``weavepass.runtime.cuda.push``): two staging
slots ``[capacity] | [capacity]`` and a signal pad of its own. A buffer apart from the fused kernels':
their pushes are not ordered after the push variant's reduces (on another stream), so sharing
staging rows would let one overwrite rows the other has not read."""


def enable_symm_mem_for_group(group_name: str) -> None:
    """Register ``group_name`` with PyTorch symmetric memory where this torch still needs it (the
    call is deprecated, with a FutureWarning, in later releases, which need nothing)."""
    import torch.distributed._symmetric_memory as symm_mem

    if hasattr(symm_mem, "enable_symm_mem_for_group"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(group_name)


def _signal_pad_bytes() -> int:
    import torch.distributed._symmetric_memory as symm_mem

    if hasattr(symm_mem, "get_signal_pad_size"):
        return symm_mem.get_signal_pad_size()
    return torch._C._distributed_c10d._SymmetricMemory.signal_pad_size


def _new_workspace(group_name: str, dtype: torch.dtype, device: torch.device, capacity: int,
                   purpose: str = FUSED):
    import torch.distributed._symmetric_memory as symm_mem

    enable_symm_mem_for_group(group_name)
    itemsize = torch.empty((), dtype=dtype).element_size()
    lamport = lamport_region_elements(resolve_group(group_name).size(), itemsize) if purpose == FUSED else 0
    buffer = symm_mem.empty(2 * capacity + lamport, dtype=dtype, device=device)
    buffer[2 * capacity:].fill_(-0.0)  # "empty" before any peer can push:
    # done, not only queued, before the rendezvous lets a peer address the buffer. A peer leaves the
    # rendezvous and may launch a Lamport call whose pushes would land before a queued fill (this
    # stream waits behind the caller's work) and be overwritten: its data lost, this rank's poll
    # never ends.
    torch.cuda.synchronize(device)
    handle = symm_mem.rendezvous(buffer, group_name)
    if handle.multicast_ptr != 0:  # never touched, but say so if the allocator made one anyway
        logger.warning("symmetric workspace got a multicast object; weave never uses it")
    rank, world = handle.rank, handle.world_size
    pad_slots = _signal_pad_bytes() // 4
    if pad_slots < lamport_flag_slot(world) + 2:
        raise RuntimeError(f"signal pad of {pad_slots} slots is too small for {world} ranks")
    pad = handle.get_signal_pad(rank, [pad_slots], torch.int32)
    size = buffer.element_size()
    deltas = [(p - handle.buffer_ptrs[rank]) // size for p in handle.buffer_ptrs]
    pad_deltas = [(p - handle.signal_pad_ptrs[rank]) // 4 for p in handle.signal_pad_ptrs]
    padding = [0] * (MAX_WORLD - world)
    return _Workspace(buffer, pad, capacity, (*deltas, *padding), (*pad_deltas, *padding), rank, world,
                      watch=peer_wait.record_address(), timeout_ns=peer_wait.peer_timeout_ns(group_name))


@dataclass
class SymmetricBuffer:
    """One rendezvoused allocation of ``numel`` elements and its signal pad (``pad_slots`` int32,
    zeros when new), with every rank's address minus this rank's: what a workspace of another layout
    than ``_Workspace``'s is built on (``runtime.cuda.matmul``)."""

    buffer: torch.Tensor
    pad: torch.Tensor
    deltas: list[int]  # in elements of the buffer's dtype
    pad_deltas: list[int]  # in int32 slots
    rank: int
    world: int
    watch: int = 0
    timeout_ns: int = 0


def new_symmetric(group_name: str, dtype: torch.dtype, device: torch.device, numel: int,
                  pad_slots: int) -> SymmetricBuffer:
    """A symmetric allocation through PyTorch symmetric memory (``_new_workspace``'s path; with
    ``WEAVE_GPU_SHARED=1``, ``testing.shared_gpu`` replaces it by CUDA IPC). Collective: every rank
    of the group calls it at the same point. Raises where the signal pad is smaller than ``pad_slots``."""
    import torch.distributed._symmetric_memory as symm_mem

    have = _signal_pad_bytes() // 4
    if pad_slots > have:
        raise RuntimeError(f"the symmetric signal pad holds {have} int32 slots; this workspace needs {pad_slots}")
    enable_symm_mem_for_group(group_name)
    buffer = symm_mem.empty(numel, dtype=dtype, device=device)
    torch.cuda.synchronize(device)
    handle = symm_mem.rendezvous(buffer, group_name)
    if handle.multicast_ptr != 0:
        logger.warning("symmetric workspace got a multicast object; weave never uses it")
    rank, world = handle.rank, handle.world_size
    pad = handle.get_signal_pad(rank, [pad_slots], torch.int32)
    size = buffer.element_size()
    deltas = [(p - handle.buffer_ptrs[rank]) // size for p in handle.buffer_ptrs]
    pad_deltas = [(p - handle.signal_pad_ptrs[rank]) // 4 for p in handle.signal_pad_ptrs]
    return SymmetricBuffer(buffer, pad, deltas, pad_deltas, rank, world, watch=peer_wait.record_address(),
                           timeout_ns=peer_wait.peer_timeout_ns(group_name))


def outside_graph_pools(make, device: torch.device):
    """``make()`` run on a helper thread, then synchronised: what it allocates must outlive every
    CUDA graph. During a CUDA-graph tree's warm-up run Inductor sends every allocation *of the
    calling thread* into the graph's private pool and afterwards checks that nothing but the graph's
    outputs stayed alive there; the workspace and the small device tables the symmetric-memory
    rendezvous allocates stay alive by design (seen on 2 H200s: "2 tensors in the cudagraph pool
    not tracked as outputs"). Another thread allocates from the ordinary pools."""
    result: dict = {}

    def run() -> None:
        try:
            torch.cuda.set_device(device)
            result["value"] = make()
            torch.cuda.synchronize(device)  # its fills are done before any stream reads them
        except BaseException as error:  # re-raised on the calling thread
            result["error"] = error

    worker = threading.Thread(target=run, name="weave-workspace")
    worker.start()
    worker.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


def get_workspace(group_name, dtype, device, needed: int, hidden: int, max_tokens: int, purpose: str = FUSED):
    """The smallest cached workspace of ``purpose`` (``FUSED`` or ``PUSH``) with ``needed`` elements
    per region; allocates the next size class (power-of-two tokens, at most ``max_tokens``) when
    none fits. None when the batch is too large, or when a new one would be needed inside
    CUDA-graph capture (rendezvous cannot be captured)."""
    limit = max_tokens * hidden
    if needed > limit:
        return None
    cached = _WORKSPACES.setdefault((group_name, dtype, device.index, purpose), [])
    fitting = [ws for ws in cached if ws.capacity >= needed]
    if fitting:
        return min(fitting, key=lambda ws: ws.capacity)
    if torch.cuda.is_current_stream_capturing():
        return None
    tokens = max(MIN_WORKSPACE_TOKENS, triton_next_power_of_2(-(-needed // hidden)))
    capacity = min(tokens * hidden, limit)
    ws = outside_graph_pools(lambda: _new_workspace(group_name, dtype, device, capacity, purpose), device)
    cached.append(ws)
    return ws


_CONSTANTS: dict[tuple, torch.Tensor] = {}


def constant_vector(hidden: int, dtype: torch.dtype, device: torch.device, value: float) -> torch.Tensor:
    """A cached ``[hidden]`` vector of ``value`` (kept for the process, outside CUDA-graph pools)."""
    key = (hidden, dtype, device, value)
    if key not in _CONSTANTS:
        make = lambda: torch.full((hidden,), value, dtype=dtype, device=device)  # noqa: E731
        _CONSTANTS[key] = outside_graph_pools(make, device) if device.type == "cuda" else make()
    return _CONSTANTS[key]


def ones_weight(hidden: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The weight of a norm without scale (multiplying by 1.0 in fp32 is exact)."""
    return constant_vector(hidden, dtype, device, 1.0)
