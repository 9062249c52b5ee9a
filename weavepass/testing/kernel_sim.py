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

from weavepass.runtime.cuda.dispatch import kernel_arguments
from weavepass.runtime.cuda.launch_plan import LaunchOverrides, choose_launch_plan
from weavepass.runtime.cuda.support import MAX_WORLD
from weavepass.runtime.cuda.workspace import (
    _Workspace,
    lamport_flag_slot,
    lamport_region_elements,
)
from weavepass.runtime.portable import rows_per_rank


class SimulatedRanks:
    """``world`` ranks' workspaces and pads on the current GPU, reused across calls (as the real
    workspace is), so back-to-back calls also test that the kernels leave their signals reset."""

    def __init__(self, world: int, hidden: int, max_tokens: int, dtype: torch.dtype):
        if not 1 <= world <= MAX_WORLD:
            raise ValueError(f"world {world} outside 1..{MAX_WORLD}")
        self.world, self.hidden, self.dtype = world, hidden, dtype
        # One region holds the larger of one-shot's world * T rows and two-shot's world * ceil(T/world).
        capacity = world * max_tokens * hidden
        size = torch.empty((), dtype=dtype).element_size()
        self.buffers = []
        for _ in range(world):
            buffer = torch.zeros(2 * capacity + lamport_region_elements(world, size), dtype=dtype, device="cuda")
            buffer[2 * capacity:].fill_(-0.0)  # the Lamport region starts "empty", as the workspace's
            self.buffers.append(buffer)
        self.pads = [torch.zeros(lamport_flag_slot(world) + 2, dtype=torch.int32, device="cuda")
                     for _ in range(world)]
        self.streams = [torch.cuda.Stream() for _ in range(world)]
        padding = [0] * (MAX_WORLD - world)
        self.workspaces = []
        for r in range(world):
            diffs = [b.data_ptr() - self.buffers[r].data_ptr() for b in self.buffers]
            pads = [p.data_ptr() - self.pads[r].data_ptr() for p in self.pads]
            assert all(d % size == 0 for d in diffs) and all(d % 4 == 0 for d in pads)
            self.workspaces.append(_Workspace(
                self.buffers[r], self.pads[r], capacity,
                (*[d // size for d in diffs], *padding), (*[d // 4 for d in pads], *padding), r, world,
            ))

    def poison(self) -> None:
        """NaN into every workspace's staging and recv regions: a kernel that reads rows nobody wrote
        this call shows it. (The Lamport region must hold "empty" values between calls: see
        ``lamport_clear``.)"""
        for ws in self.workspaces:
            ws.buffer[: ws.lamport_offset].fill_(float("nan"))

    def signals_clear(self) -> bool:
        """Whether every barrier and counter slot is back to 0 (each kernel must leave them so), and
        no Lamport kernel left its done count set."""
        flag = lamport_flag_slot(self.world)
        return all(int(p[:flag].abs().sum()) == 0 and int(p[flag + 1]) == 0 for p in self.pads)

    def lamport_clear(self) -> bool:
        """Whether every Lamport region is all "empty" (negative zero) again, as calls must leave it."""
        bits = torch.int16 if self.buffers[0].element_size() == 2 else torch.int32
        empty = torch.tensor(-0.0, dtype=self.dtype).view(bits).item()
        return all(bool((ws.buffer[ws.lamport_offset:].view(bits) == empty).all()) for ws in self.workspaces)

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
        timeout_s: float = 60.0,
        return_inv_rms: bool = False,
        layer_norm: bool = False,
        bias: torch.Tensor | None = None,
    ) -> list[tuple[torch.Tensor, ...]]:
        """Every rank's ``(normed, residual_out)`` (``return_inv_rms``: plus the per-row inverse RMS,
        [T, 1] fp32; ``layer_norm``: a LayerNorm with an optional ``bias``) for the ranks' ``partials``
        ([T, H] each), computed
        after the calling stream's work so far. ``wait``: return once the kernels finished
        (``wait_all``). Without it each rank's calls queue up on its own stream, so one rank can
        start its next call while another is still in this one (as real ranks do); the outputs are
        ready for the calling stream after ``wait_all``."""
        world, hidden = self.world, self.hidden
        tokens = partials[0].shape[0]
        elem = partials[0].element_size()
        plan = choose_launch_plan(tokens, hidden, elem, world, overrides)
        owned = tokens if plan.one_shot else rows_per_rank(tokens, world)
        if max(world * owned, tokens) * hidden > self.workspaces[0].capacity:
            raise ValueError(f"{tokens} tokens exceed the simulated workspace")
        if world * plan.num_ctas > max_resident_ctas:
            raise ValueError(
                f"{world} ranks x {plan.num_ctas} CTAs cannot all be resident on one GPU "
                f"(limit {max_resident_ctas}); pass LaunchOverrides(num_ctas=...)"
            )
        caller = torch.cuda.current_stream()
        outputs, launches, meta = [], [], []
        for rank in range(world):
            partial = partials[rank]
            normed = torch.empty_like(partial, dtype=out_dtype)
            residual_out = torch.empty_like(partial)
            inv_rms = torch.empty(tokens, 1, dtype=torch.float32, device=partial.device)
            outputs.append((normed, residual_out, inv_rms) if return_inv_rms else (normed, residual_out))
            kernel, tail, rank_meta = kernel_arguments(
                plan, self.workspaces[rank], hidden, residual is not None, elem, tokens, return_inv_rms, layer_norm)
            b = weight if not layer_norm else torch.zeros_like(weight) if bias is None else bias
            launches.append((partial, partial if residual is None else residual, weight, normed, residual_out,
                             inv_rms, b, *tail, eps))
            meta.append(rank_meta)
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
            self.wait_all(f"{tokens} tokens, {plan}", timeout_s)
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
