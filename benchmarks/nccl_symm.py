"""NCCL symmetric-memory windows through PyTorch's APIs, for the NCCL-symmetric baselines (issue 18).

NCCL 2.27+ runs its symmetric kernels (``ncclSymk*``: one-shot LL and RS+AG load/store kernels)
for all_reduce / reduce_scatter / all_gather when the send and receive buffers lie in windows
registered with ``ncclCommWindowRegister(..., NCCL_WIN_COLL_SYMMETRIC)`` on the communicator that
runs the collective. PyTorch reaches that in two ways, tried in this order:

1. ``window_pool``: a ``torch.cuda.MemPool`` on ``ProcessGroupNCCL.mem_allocator`` (``ncclMemAlloc``),
   registered with ``ProcessGroupNCCL.register_mem_pool(pool, symm=True)`` (symmetric windows on the
   group's own communicator). Without the ``symm`` argument ``register_mem_pool`` only does
   ``ncclCommRegister`` (user-buffer registration, no symmetric kernels): that is reported as a
   failure, not measured under this name.
2. ``symm_mem_nccl_buffers``: ``torch.distributed._symmetric_memory.set_backend("NCCL")``, then
   ``symm_mem.empty`` + ``symm_mem.rendezvous`` (which registers the window). The backend is
   process-global and cannot change once symmetric memory is allocated, so this runs only in a
   process of its own (weave's kernel allocates CUDA-backend symmetric memory).

Multicast: NCCL drops every multimem kernel (``*MC*``) unless the communicator has NVLS support
(``ncclSymPickKernel``: ``if (!hasNvls) kmask &= ~kernelMask_nvls``, with ``hasNvls =
comm->nvlsSupport && ...``), and NVLS support is off with ``NCCL_NVLS_ENABLE=0``, which
``gpu_env`` sets in every process; NCCL's sm90 cost tables also have no 2-rank entries for the
multimem kernels. ``nccl_kernel_names`` profiles one call so the report shows which kernels ran
(``ncclSymk...`` proves the symmetric path; a name with ``MC`` would show multicast).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class SymmetricWindowUnavailable(RuntimeError):
    """What was tried, and how it failed (printed by the benchmarks, which carry on without it)."""


def nccl_backend(group: dist.ProcessGroup, device: torch.device):
    return group._get_backend(device)


def window_pool(group: dist.ProcessGroup, device: torch.device) -> tuple[torch.cuda.MemPool, object]:
    """An empty MemPool on NCCL's allocator, and the group's NCCL backend (route 1, step 1).

    Collective: one all_reduce first, because ProcessGroupNCCL creates its communicator lazily and
    the window is registered with that communicator.
    """
    tried = "torch.cuda.MemPool(group._get_backend(device).mem_allocator)"
    try:
        dist.all_reduce(torch.zeros(1, device=device), group=group)
        backend = nccl_backend(group, device)
        return torch.cuda.MemPool(backend.mem_allocator), backend
    except Exception as err:  # an older or differently built torch: say what failed
        raise SymmetricWindowUnavailable(f"{tried}: {type(err).__name__}: {err}") from err


def register_window(backend, pool: torch.cuda.MemPool) -> str:
    """Register every segment of ``pool`` as a symmetric window (route 1, step 2); collective."""
    tried = "ProcessGroupNCCL.register_mem_pool(pool, symm=True)"
    try:
        backend.register_mem_pool(pool, symm=True)
    except Exception as err:  # TypeError: this torch has no symm argument
        raise SymmetricWindowUnavailable(f"{tried}: {type(err).__name__}: {err}") from err
    return tried


def symm_mem_nccl_buffers(group: dist.ProcessGroup, sizes: list[int], dtype) -> list[torch.Tensor]:
    """One tensor per entry of ``sizes`` (elements) from the NCCL symmetric-memory backend, each
    rendezvoused (route 2). Call only in a process that has allocated no symmetric memory before."""
    import torch.distributed._symmetric_memory as symm_mem

    steps = [('symm_mem.set_backend("NCCL")', lambda: symm_mem.set_backend("NCCL"))]
    out: list[torch.Tensor] = []
    for i, numel in enumerate(sizes):
        steps.append((f"symm_mem.empty({numel})",
                      lambda numel=numel: out.append(symm_mem.empty(numel, dtype=dtype, device="cuda"))))
        steps.append((f"symm_mem.rendezvous(buffer {i}, group)",
                      lambda i=i: symm_mem.rendezvous(out[i], group.group_name)))
    for tried, step in steps:
        try:
            step()
        except Exception as err:
            raise SymmetricWindowUnavailable(f"{tried}: {type(err).__name__}: {err}") from err
    return out


def nccl_kernel_names(fn) -> list[str]:
    """Names of the NCCL kernels one call of ``fn()`` launches (every rank must call this)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = {e.name for e in prof.events() if "nccl" in e.name.lower()}
    return sorted(names)


class InWindowPool:
    """Runs a compiled model with every allocation in a MemPool on NCCL's allocator, registered as
    symmetric windows after the first call, so the compiled graph's all_reduce buffers (Inductor
    allocates them in the current pool) lie in windows and NCCL may pick its symmetric kernels.

    One instance per input shape: the pool is registered once, after the first call has created
    its segments; calls of the same shape reuse them (a new segment would be unregistered, and
    registering a pool twice is an NCCL error). ``close()`` deregisters.
    """

    def __init__(self, fn, group: dist.ProcessGroup, device: torch.device):
        self.fn = fn
        self.pool, self.backend = window_pool(group, device)
        self.registered = None  # what was registered, once it is

    def __call__(self, ids):
        with torch.cuda.use_mem_pool(self.pool):
            out = self.fn(ids)
        if self.registered is None:
            torch.cuda.synchronize()
            self.registered = register_window(self.backend, self.pool)
        return out

    def close(self) -> None:
        """Deregister the windows (collective); a failure is printed, not raised: the timings
        are taken by then."""
        if self.registered is not None:
            torch.cuda.synchronize()
            try:
                self.backend.deregister_mem_pool(self.pool)
            except Exception as err:
                print(f"deregister_mem_pool failed: {type(err).__name__}: {err}", flush=True)
            self.registered = None
