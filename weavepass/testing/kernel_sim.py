"""Run the ``cuda_symm`` Triton kernels of ``WORLD`` ranks on one GPU, in one process.

Each simulated rank gets its own workspace and signal pad (ordinary allocations on the one device)
and its own stream; rank ``r``'s kernel is launched with the address differences to the other
ranks' buffers, exactly as the real lowering passes the symmetric peers' (``peer - local``, in
elements). The kernels only ever see those differences, so the push, the barriers, the chunk
counters and the finalise run as they do across GPUs, with system-scope atomics on one device's
memory instead of over NVLink.

What this checks: every algorithm's indexing, ordering and self-resetting signals at world 2, 4 and
8 (the 4- and 8-GPU kinds are not lent), on any machine with one GPU. What it does not: link
bandwidth or latency (times here mean nothing), and the symmetric-memory allocation and rendezvous
(``runtime.cuda.workspace``, covered by the multi-GPU tests).

All ranks' grids must be resident at once (the ranks wait for each other inside the kernels), so the
sum of their CTAs must fit the GPU: ``run_ranks`` refuses more than ``max_resident_ctas``.
"""

from __future__ import annotations

import time

import torch

from weavepass.runtime.cuda.launch_plan import MAX_CTAS, LaunchOverrides, choose_launch_plan
from weavepass.runtime.cuda.support import MAX_WORLD
from weavepass.runtime.cuda.workspace import SIGNAL_CHANNELS
from weavepass.runtime.portable import rows_per_rank


class SimulatedRanks:
    """``world`` ranks' workspaces and pads on the current GPU, reused across calls (as the real
    workspace is), so back-to-back calls also test that the kernels leave their signals reset."""

    def __init__(self, world: int, hidden: int, max_tokens: int, dtype: torch.dtype):
        if not 1 <= world <= MAX_WORLD:
            raise ValueError(f"world {world} outside 1..{MAX_WORLD}")
        self.world, self.hidden, self.dtype = world, hidden, dtype
        # One region holds the larger of one-shot's world * T rows and two-shot's world * ceil(T/world).
        self.capacity = world * max_tokens * hidden
        self.buffers = [torch.zeros(2 * self.capacity, dtype=dtype, device="cuda") for _ in range(world)]
        slots = SIGNAL_CHANNELS * MAX_CTAS * world
        self.pads = [torch.zeros(slots, dtype=torch.int32, device="cuda") for _ in range(world)]
        self.streams = [torch.cuda.Stream() for _ in range(world)]
        size = self.buffers[0].element_size()
        padding = [0] * (MAX_WORLD - world)
        self.buffer_deltas, self.pad_deltas = [], []
        for r in range(world):
            diffs = [b.data_ptr() - self.buffers[r].data_ptr() for b in self.buffers]
            pads = [p.data_ptr() - self.pads[r].data_ptr() for p in self.pads]
            assert all(d % size == 0 for d in diffs) and all(d % 4 == 0 for d in pads)
            self.buffer_deltas.append((*[d // size for d in diffs], *padding))
            self.pad_deltas.append((*[d // 4 for d in pads], *padding))

    def poison(self) -> None:
        """NaN into every workspace: a kernel that reads rows nobody wrote this call shows it."""
        for b in self.buffers:
            b.fill_(float("nan"))

    def signals_clear(self) -> bool:
        """Whether every signal slot is back to 0 (each kernel must leave them so)."""
        return all(int(p.abs().sum()) == 0 for p in self.pads)

    def run(
        self,
        partials: list[torch.Tensor],
        residual: torch.Tensor | None,
        weight: torch.Tensor,
        eps: float,
        out_dtype: torch.dtype,
        overrides: LaunchOverrides = LaunchOverrides(),
        max_resident_ctas: int = 128,
        wait: bool = True,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every rank's ``(normed, residual_out)`` for the ranks' ``partials`` ([T, H] each), computed
        after the calling stream's work so far. ``wait``: return once the kernels finished
        (``wait_all``). Without it each rank's calls queue up on its own stream, so one rank can
        start its next call while another is still in this one (as real ranks do); the outputs are
        ready for the calling stream after ``wait_all``."""
        from weavepass.runtime.cuda.kernels import (
            fused_allreduce_rmsnorm_kernel,
            fused_allreduce_rmsnorm_pipelined_kernel,
        )

        world, hidden = self.world, self.hidden
        tokens = partials[0].shape[0]
        plan = choose_launch_plan(tokens, hidden, partials[0].element_size(), world, overrides)
        owned = tokens if plan.one_shot else rows_per_rank(tokens, world)
        if max(world * owned, tokens) * hidden > self.capacity:
            raise ValueError(f"{tokens} tokens exceed the simulated workspace")
        if world * plan.num_ctas > max_resident_ctas:
            raise ValueError(
                f"{world} ranks x {plan.num_ctas} CTAs cannot all be resident on one GPU "
                f"(limit {max_resident_ctas}); pass LaunchOverrides(num_ctas=...)"
            )
        if plan.pipelined:
            kernel = fused_allreduce_rmsnorm_pipelined_kernel
            variant = dict(CHUNK_ROWS=plan.chunk_rows, PUSH_ROWS=plan.push_rows)
        else:
            kernel = fused_allreduce_rmsnorm_kernel
            variant = dict(ONE_SHOT=plan.one_shot)
        caller = torch.cuda.current_stream()
        outputs, launches = [], []
        for rank in range(world):
            partial = partials[rank]
            normed = torch.empty_like(partial, dtype=out_dtype)
            residual_out = torch.empty_like(partial)
            outputs.append((normed, residual_out))
            launches.append((
                partial, partial if residual is None else residual, weight, normed, residual_out,
                self.buffers[rank], self.pads[rank], *self.buffer_deltas[rank], *self.pad_deltas[rank],
                tokens, rows_per_rank(tokens, world), self.capacity, eps,
            ))
        meta = [
            dict(RANK=rank, WORLD=world, HIDDEN=hidden, BLOCK_H=plan.block_h, ROWS=plan.rows_per_tile,
                 HAS_RESIDUAL=residual is not None, MAX_CTAS=MAX_CTAS, num_warps=plan.num_warps, **variant)
            for rank in range(world)
        ]
        # Compile and load every rank's kernel before launching any: once rank 0's kernel runs it
        # waits for the others, and loading a module (CUDA's lazy loading defers it to first use)
        # can wait for the running kernels to finish, a deadlock. Triton's handle set-up queries a
        # function attribute, which forces the load.
        for rank in range(world):
            compiled = kernel.warmup(*launches[rank], grid=(plan.num_ctas,), **meta[rank])
            if hasattr(compiled, "_init_handles"):
                compiled._init_handles()
        for rank in range(world):
            stream = self.streams[rank]
            stream.wait_stream(caller)
            with torch.cuda.stream(stream):
                kernel[(plan.num_ctas,)](*launches[rank], **meta[rank])
        if wait:
            self.wait_all(f"{tokens} tokens, {plan}")
        return outputs

    def wait_all(self, what: str = "queued calls", timeout_s: float = 60.0) -> None:
        """Wait until every rank's stream is idle. A kernel that waits for a signal never sent cannot
        be stopped from the host: raise (naming ``what``) instead of blocking forever; the process
        must then be ended."""
        events = []
        for stream in self.streams:
            event = torch.cuda.Event()
            event.record(stream)
            events.append(event)
        deadline = time.monotonic() + timeout_s
        while not all(e.query() for e in events):
            if time.monotonic() > deadline:
                raise TimeoutError(f"simulated ranks did not finish in {timeout_s} s: {what}")
            time.sleep(1e-3)
        caller = torch.cuda.current_stream()
        for stream in self.streams:
            caller.wait_stream(stream)
