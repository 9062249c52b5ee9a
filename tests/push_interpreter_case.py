"""The push variant's two kernels (``push_partial_rows_kernel``, ``reduce_pushed_rows_kernel``) run by
Triton's interpreter on CPU, one process per simulated rank (forked, so every rank maps the shared
workspaces at the same addresses and the kernels' ``peer - local`` deltas hold in each).

Run by tests/test_push_kernels_interpreted.py as ``TRITON_INTERPRET=1 python
tests/push_interpreter_case.py <skewed> <residual> <dtype>``; exits 0 after checking every output
against the reference and every signal's final value, non-zero otherwise (a rank stuck in a wait
is killed after ``TIMEOUT_S``). Each rank runs the split's schedule of forks and joins (push A1,
push B1, reduce A1, push A2, reduce B1, push B2, ...); with ``skewed`` rank 1 sleeps before each
reduce, so rank 0's pushes run ahead into slots rank 1 has not read yet, which only the CONSUMED
wait keeps from being overwritten.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time

import torch

from weavepass.runtime.cuda import kernels
from weavepass.runtime.cuda.push import STAGING_SLOTS, push_arguments, signal_slots
from weavepass.runtime.cuda.support import MAX_WORLD
from weavepass.runtime.cuda.workspace import _Workspace
from weavepass.runtime.reference import fused_allreduce_rmsnorm_reference
from weavepass.testing.kernel_sim import split_schedule

WORLD, TOKENS, HIDDEN, EPS = 2, 5, 24, 1e-6  # odd rows, a width below its power of two (masked columns)
CALLS = 4  # per half
PUSH_CTAS, REDUCE_CTAS = 2, 3  # several programs: the last-to-finish election is exercised
TIMEOUT_S = 240
SKEW_S = 0.3


def main(skewed: bool, residual: bool, dtype: torch.dtype) -> None:
    capacity = (WORLD - 1) * TOKENS * HIDDEN
    buffers = [torch.full((STAGING_SLOTS * capacity,), float("nan"), dtype=dtype).share_memory_()
               for _ in range(WORLD)]  # poisoned: a row read before it was pushed shows
    pads = [torch.zeros(STAGING_SLOTS * signal_slots(WORLD), dtype=torch.int32).share_memory_()
            for _ in range(WORLD)]
    size = buffers[0].element_size()
    padding = [0] * (MAX_WORLD - WORLD)
    workspaces = [
        _Workspace(buffers[r], pads[r], capacity,
                   (*[(b.data_ptr() - buffers[r].data_ptr()) // size for b in buffers], *padding),
                   (*[(p.data_ptr() - pads[r].data_ptr()) // 4 for p in pads], *padding), r, WORLD)
        for r in range(WORLD)
    ]
    gen = torch.Generator().manual_seed(0)
    draw = lambda *shape: torch.randn(*shape, generator=gen).to(dtype)  # noqa: E731
    calls = [([draw(TOKENS, HIDDEN) for _ in range(WORLD)], draw(TOKENS, HIDDEN) if residual else None)
             for _ in range(2 * CALLS)]  # call i is half i % 2's site i // 2
    weight = (1 + 0.1 * torch.randn(HIDDEN, generator=gen)).to(dtype)
    outputs = [[(torch.empty(TOKENS, HIDDEN, dtype=dtype).share_memory_(),
                 torch.empty(TOKENS, HIDDEN, dtype=dtype).share_memory_()) for _ in calls] for _ in range(WORLD)]

    def rank_main(rank: int) -> None:
        def arguments(i):
            return push_arguments(workspaces[rank], TOKENS, HIDDEN, size, i % 2, residual, PUSH_CTAS, REDUCE_CTAS)

        def push(i):
            a = arguments(i)
            kernels.push_partial_rows_kernel[a.push_grid](calls[i][0][rank], *a.push_tail, **a.push_meta)

        def reduce(i):
            a = arguments(i)
            if skewed and rank == 1:
                time.sleep(SKEW_S)
            partial, res = calls[i][0][rank], calls[i][1]
            kernels.reduce_pushed_rows_kernel[a.reduce_grid](
                partial, partial if res is None else res, weight, *outputs[rank][i], *a.reduce_tail, EPS,
                **a.reduce_meta)

        try:
            for step, i in split_schedule(CALLS):
                (push if step == "push" else reduce)(i)
        except BaseException:
            import traceback

            traceback.print_exc()
            os._exit(1)
        os._exit(0)

    ranks = [multiprocessing.get_context("fork").Process(target=rank_main, args=(r,)) for r in range(WORLD)]
    for p in ranks:
        p.start()
    deadline = time.monotonic() + TIMEOUT_S
    for p in ranks:
        p.join(max(0.0, deadline - time.monotonic()))
    stuck = [r for r, p in enumerate(ranks) if p.is_alive()]
    for p in ranks:
        if p.is_alive():
            p.kill()
    if stuck:
        sys.exit(f"ranks {stuck} still waiting after {TIMEOUT_S} s")
    if any(p.exitcode != 0 for p in ranks):
        sys.exit(f"rank exit codes {[p.exitcode for p in ranks]}")

    # Tolerances: tests/gpu/test_kernel_sim_one_gpu.py's (one rounding of residual_out; normed 2 ulp).
    tol = {torch.float32: ((1e-6, 1e-6), (2e-5, 2e-5)), torch.bfloat16: ((2**-7, 1e-5), (2**-6, 2**-6))}[dtype]
    for i, (partials, res) in enumerate(calls):
        want_normed, want_res = fused_allreduce_rmsnorm_reference(partials, res, weight, EPS, dtype)
        for rank in range(WORLD):
            normed, res_out = outputs[rank][i]
            label = f"call {i} (half {'AB'[i % 2]}) rank {rank}"
            (res_rtol, res_atol), (normed_rtol, normed_atol) = tol
            torch.testing.assert_close(res_out, want_res, rtol=res_rtol, atol=res_atol, msg=lambda m: f"{label}: {m}")
            torch.testing.assert_close(normed, want_normed, rtol=normed_rtol, atol=normed_atol,
                                       msg=lambda m: f"{label}: {m}")
    # Every slot: CALLS pushes and reduces done, DONE counts back to 0, the peer's PUSHED and
    # CONSUMED at the last call's sequence number, nothing else written.
    for rank, pad in enumerate(pads):
        for slot in range(STAGING_SLOTS):
            signals = pad[slot * signal_slots(WORLD):(slot + 1) * signal_slots(WORLD)].tolist()
            peer_seq = [0 if src == rank else CALLS for src in range(WORLD)]
            want = [CALLS, 0, CALLS, 0, *peer_seq, *peer_seq]
            assert signals == want, (rank, slot, signals, want)
    print("push kernels: OK")


if __name__ == "__main__":
    skewed, residual, dtype = sys.argv[1] == "skewed", sys.argv[2] == "residual", getattr(torch, sys.argv[3])
    main(skewed, residual, dtype)
