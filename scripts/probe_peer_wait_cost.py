"""What the bounded waits (``runtime.cuda.peer_wait``) cost the kernels, on one GPU with simulated ranks.

Two ``SimulatedRanks`` of 2 ranks, one with waits bounded at 600 s and one unbounded (``timeout 0``:
the same kernels, the deadline branch never taken), measured in interleaved rounds in one process
(the kernels' own GPU durations from the profiler, both ranks, ``ROUNDS`` x ``CALLS`` calls, medians;
the host-side launch work of the simulator is not in them). Simulated ranks share one
GPU's memory, so the absolute times say nothing about NVLink; the ratio says what the timer reads
and the deadline checks in the spin loops add to the same waits.

    python3 scripts/probe_peer_wait_cost.py        (prints one row per algorithm and size)
"""

from __future__ import annotations

import os
import statistics
import sys

sys.path.insert(0, os.getcwd())

from weavepass.env import disable_multicast  # noqa: E402

disable_multicast(override=True)

import torch  # noqa: E402

from weavepass.runtime.cuda.launch_plan import LaunchOverrides  # noqa: E402
from weavepass.testing.kernel_sim import SimulatedRanks  # noqa: E402

ROUNDS, CALLS, HIDDEN = 15, 50, 8192
CASES = [
    ("lamport", 1, LaunchOverrides(lamport=True)),
    ("lamport", 8, LaunchOverrides(lamport=True)),
    ("one_shot", 32, LaunchOverrides(one_shot=True, num_ctas=16)),
    ("two_shot", 256, LaunchOverrides(one_shot=False, pipelined=False, num_ctas=16)),
    ("two_shot", 4096, LaunchOverrides(one_shot=False, pipelined=False, num_ctas=32)),
    ("pipelined", 4096, LaunchOverrides(one_shot=False, pipelined=True, num_ctas=32)),
]


def main() -> None:
    dtype = torch.bfloat16
    sims = {"bounded": SimulatedRanks(2, HIDDEN, 4096, dtype, peer_timeout_s=600.0),
            "unbounded": SimulatedRanks(2, HIDDEN, 4096, dtype, peer_timeout_s=0.0)}
    weight = torch.ones(HIDDEN, dtype=dtype, device="cuda")
    print(f"{'algorithm':>10} {'tokens':>6} {'unbounded us':>13} {'bounded us':>11} {'ratio':>6}")
    for name, tokens, overrides in CASES:
        partials = [torch.randn(tokens, HIDDEN, device="cuda").to(dtype) for _ in range(2)]
        residual = torch.randn(tokens, HIDDEN, device="cuda").to(dtype)
        times = {key: [] for key in sims}
        for sim in sims.values():  # warm-up: compile and load both
            sim.run(partials, residual, weight, 1e-6, dtype, overrides)
        for _ in range(ROUNDS):
            for key, sim in sims.items():
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    for _ in range(CALLS):
                        sim.run(partials, residual, weight, 1e-6, dtype, overrides, wait=False)
                    sim.wait_all()
                times[key] += [e.device_time for e in prof.events() if "fused_allreduce" in e.name]
        u, b = statistics.median(times["unbounded"]), statistics.median(times["bounded"])
        print(f"{name:>10} {tokens:>6} {u:>13.1f} {b:>11.1f} {b / u:>6.3f}", flush=True)


if __name__ == "__main__":
    main()
