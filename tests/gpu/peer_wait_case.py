"""One kernel of 2 simulated ranks on one GPU whose peer never comes (``python3 peer_wait_case.py KIND``).

Only rank 0's kernel is launched, with waits bounded at ``TIMEOUT_S``: it must give up, write the
pinned record and trap, so that ``torch.cuda.synchronize`` raises and the process exits with
weave's message on stderr (``runtime.cuda.peer_wait``). Before the bounded waits this process spun
for ever. Run by ``test_kernel_sim_one_gpu.py::test_a_peer_that_never_comes_stops_the_kernel``, one
process per kind: the trap leaves this process's CUDA context failed.
"""

import os
import sys

from weavepass.env import disable_multicast

disable_multicast(override=True)

import torch  # noqa: E402

from weavepass.runtime.cuda.launch_plan import LaunchOverrides  # noqa: E402

TIMEOUT_S = 2.0
HIDDEN, TOKENS = 1024, 64
KINDS = {
    "one_shot": LaunchOverrides(one_shot=True),
    "two_shot": LaunchOverrides(one_shot=False, pipelined=False),
    "pipelined": LaunchOverrides(one_shot=False, pipelined=True, num_ctas=4),
    "lamport": LaunchOverrides(lamport=True),
}


def fused(kind: str) -> None:
    from weavepass.testing.kernel_sim import SimulatedRanks

    sim = SimulatedRanks(2, HIDDEN, TOKENS, torch.bfloat16, peer_timeout_s=TIMEOUT_S)
    partials = [torch.randn(TOKENS, HIDDEN, device="cuda").to(torch.bfloat16) for _ in range(2)]
    weight = torch.ones(HIDDEN, dtype=torch.bfloat16, device="cuda")
    sim.run(partials, None, weight, 1e-6, torch.bfloat16, KINDS[kind], wait=False, ranks=[0])


def push() -> None:
    from weavepass.runtime.cuda import kernels
    from weavepass.runtime.cuda.push import push_arguments
    from weavepass.testing.kernel_sim import SimulatedPushRanks

    sim = SimulatedPushRanks(HIDDEN, TOKENS, torch.bfloat16, peer_timeout_s=TIMEOUT_S)
    partial = torch.randn(TOKENS, HIDDEN, device="cuda").to(torch.bfloat16)
    a = push_arguments(sim.workspaces[0], TOKENS, HIDDEN, 2, 0, False, 4, 8)
    kernels.push_partial_rows_kernel[a.push_grid](partial, *a.push_tail, **a.push_meta)


if __name__ == "__main__":
    kind = sys.argv[1]
    push() if kind == "push" else fused(kind)
    try:
        torch.cuda.synchronize()  # raises once the kernel has trapped
    except Exception:
        from weavepass.runtime.cuda import peer_wait

        print("record:", None if peer_wait._RECORD is None else peer_wait._RECORD.tolist(), flush=True)
        raise
    print("UNREACHED: the kernel finished without its peer", flush=True)
    os._exit(3)
