"""A gather GEMM whose owner never pushes (``python3 gather_wait_case.py``): 2 simulated ranks on one
GPU, rank 0 pushes its own rows and runs its gather GEMM, rank 1 never pushes. The GEMM's wait for
rank 1's row block is bounded at ``TIMEOUT_S``: it must give up, write the pinned record and trap,
so that ``torch.cuda.synchronize`` raises and the process exits with weave's message naming the
gather GEMM's wait site (``peer_wait.SITES[11]``). Run by
tests/gpu/test_gather_gpu.py::test_an_owner_that_never_pushes_stops_the_gather_gemm, in a process of
its own: the trap leaves this process's CUDA context failed.
"""

import sys

from weavepass.env import disable_multicast

disable_multicast(override=True)

import torch  # noqa: E402

TIMEOUT_S = 2.0
HIDDEN, TOKENS, OUT = 1024, 300, 512

if __name__ == "__main__":
    from weavepass.runtime.cuda.gather import gather_matmul, push_gather_rows
    from weavepass.runtime.cuda.gemm import OwnerRows
    from weavepass.testing.gemm_sim import SimulatedGatherRanks

    sim = SimulatedGatherRanks(2, HIDDEN, TOKENS // 2, torch.bfloat16, peer_timeout_s=TIMEOUT_S)
    owners = OwnerRows.build(TOKENS, 2, "cuda")
    rows = torch.randn(TOKENS // 2, HIDDEN, device="cuda").to(torch.bfloat16)
    w = torch.randn(OUT, HIDDEN, device="cuda").to(torch.bfloat16)
    push_gather_rows(sim.workspaces[0], rows, owners)
    out = gather_matmul(sim.workspaces[0], w, owners)
    try:
        torch.cuda.synchronize()  # raises once the kernel has trapped
    except Exception:
        from weavepass.runtime.cuda import peer_wait

        print("record:", None if peer_wait._RECORD is None else peer_wait._RECORD.tolist(), flush=True)
        raise
    print("UNREACHED: the GEMM finished without rank 1's rows", file=sys.stderr)
