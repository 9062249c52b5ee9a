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

The kernels' waits are bounded as in the real lowering (``runtime.cuda.peer_wait``), by
``peer_timeout_s`` (30 s by default, less than ``wait_all``'s host limit): a simulated rank that waits
for a signal never sent writes the pinned record and traps, so the test process fails with the
reason instead of spinning for ever.

``SimulatedPushRanks`` does the same for the split's push variant (``runtime.cuda.push``),
with two streams per simulated rank (side: pushes; main: reduces) in the split's fork/join order.
"""

from __future__ import annotations

import time

import torch

from weavepass.runtime.cuda import peer_wait
from weavepass.runtime.cuda.dispatch import kernel_arguments
from weavepass.runtime.cuda.launch_plan import NO_OVERRIDES, LaunchOverrides, choose_launch_plan
from weavepass.runtime.cuda.support import MAX_WORLD
from weavepass.runtime.cuda.workspace import (
    _Workspace,
    lamport_flag_slot,
    lamport_region_elements,
)
from weavepass.runtime.portable import rows_per_rank

SIM_PEER_TIMEOUT_S = 30.0
"""How long a simulated rank's kernel waits for the others before it gives up (peer_wait)."""


class SimulatedRanks:
    """``world`` ranks' workspaces and pads on the current GPU, reused across calls (as the real
    workspace is), so back-to-back calls also test that the kernels leave their signals reset."""

    def __init__(self, world: int, hidden: int, max_tokens: int, dtype: torch.dtype,
                 peer_timeout_s: float = SIM_PEER_TIMEOUT_S):
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
        self.last_compiled = None
        """The last kernel ``run`` compiled (Triton's ``CompiledKernel``), for its resource usage."""
        padding = [0] * (MAX_WORLD - world)
        self.workspaces = []
        for r in range(world):
            diffs = [b.data_ptr() - self.buffers[r].data_ptr() for b in self.buffers]
            pads = [p.data_ptr() - self.pads[r].data_ptr() for p in self.pads]
            assert all(d % size == 0 for d in diffs) and all(d % 4 == 0 for d in pads)
            self.workspaces.append(_Workspace(
                self.buffers[r], self.pads[r], capacity,
                (*[d // size for d in diffs], *padding), (*[d // 4 for d in pads], *padding), r, world,
                peer_wait.record_address(), int(peer_timeout_s * 1e9),
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
        overrides: LaunchOverrides = NO_OVERRIDES,
        max_resident_ctas: int = 128,
        wait: bool = True,
        timeout_s: float = 60.0,
        return_inv_rms: bool = False,
        layer_norm: bool = False,
        bias: torch.Tensor | None = None,
        ranks=None,
        quant=None,
        static_scale: torch.Tensor | None = None,
    ) -> list[tuple[torch.Tensor, ...]]:
        """Every rank's ``(normed, residual_out)`` (``return_inv_rms``: plus the per-row inverse RMS,
        [T, 1] fp32; ``layer_norm``: a LayerNorm with an optional ``bias``) for the ranks' ``partials``
        ([T, H] each), computed
        after the calling stream's work so far. ``wait``: return once the kernels finished
        (``wait_all``). Without it each rank's calls queue up on its own stream, so one rank can
        start its next call while another is still in this one (as real ranks do); the outputs are
        ready for the calling stream after ``wait_all``. ``ranks``: launch only these ranks' kernels
        (default: all); the others never come, so the launched ones give up after ``peer_timeout_s``
        (the bounded-wait test, ``tests/gpu/peer_wait_case.py``). ``quant``: a
        ``runtime.cuda.quant_epilogue.QuantEpilogue`` (with ``static_scale`` for a static one): each
        rank's outputs are then ``(normed, residual_out, codes [T, H], scales)``, scales ``[T, 1]``,
        ``[T, H / g]`` per group or ``[1]`` (static); ``normed`` is written only if the epilogue
        stores it."""
        world, hidden = self.world, self.hidden
        tokens = partials[0].shape[0]
        elem = partials[0].element_size()
        plan = choose_launch_plan(tokens, hidden, elem, world, overrides)
        owned = tokens if plan.one_shot else rows_per_rank(tokens, world)
        if max(world * owned, tokens) * hidden > self.workspaces[0].capacity:
            raise ValueError(f"{tokens} tokens exceed the simulated workspace")
        if world > 1 and world * plan.num_ctas > max_resident_ctas:  # a group of one waits for nobody
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
            quant_args = (weight,) * 4
            if quant is not None:
                codes = torch.empty_like(partial, dtype=quant.code_dtype)
                groups = hidden // quant.group_size if quant.group_size else 1
                scales = torch.empty(1 if static_scale is not None else tokens * groups, dtype=quant.scale_dtype,
                                     device=partial.device)
                outputs[-1] = (normed, residual_out, codes,
                               scales if static_scale is not None else scales.view(tokens, groups))
                quant_args = (codes, scales, weight if static_scale is None else static_scale,
                              quant.constants_tensor(partial.device))
            kernel, tail, rank_meta = kernel_arguments(
                plan, self.workspaces[rank], hidden, residual is not None, elem, tokens, return_inv_rms, layer_norm,
                quant)
            b = weight if not layer_norm else torch.zeros_like(weight) if bias is None else bias
            launches.append((partial, partial if residual is None else residual, weight, normed, residual_out,
                             inv_rms, b, *quant_args, *tail, eps))
            meta.append(rank_meta)
        # Compile and load every rank's kernel before launching any: once rank 0's kernel runs it
        # waits for the others, and loading a module (CUDA's lazy loading defers it to first use)
        # can wait for the running kernels to finish, a deadlock. Triton's handle set-up queries a
        # function attribute, which forces the load.
        for rank in range(world):
            compiled = kernel.warmup(*launches[rank], grid=(plan.num_ctas,), **meta[rank])
            if hasattr(compiled, "_init_handles"):
                compiled._init_handles()
            self.last_compiled = compiled  # its n_regs / n_spills: benchmarks/bench_local_cost.py
        for rank in range(world) if ranks is None else ranks:
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


class SimulatedPushRanks:
    """The split's push variant (``weavepass.runtime.cuda.push``) with ``world`` simulated
    ranks on one GPU: per rank a push workspace and signal pad of its own, and two streams, ``side``
    (the push kernels, as the communication stream) and ``main`` (the reduce kernels, as the stream
    that waits for the op's outputs). Workspaces and pads persist across calls, as the real ones do,
    so back-to-back calls and CUDA-graph replays test the kernels' self-advancing signals."""

    def __init__(self, hidden: int, max_tokens: int, dtype: torch.dtype, world: int = 2,
                 peer_timeout_s: float = SIM_PEER_TIMEOUT_S):
        from weavepass.runtime.cuda.push import STAGING_SLOTS, signal_slots

        self.world, self.hidden, self.dtype = world, hidden, dtype
        capacity = (world - 1) * max_tokens * hidden
        size = torch.empty((), dtype=dtype).element_size()
        self.buffers = [torch.zeros(STAGING_SLOTS * capacity, dtype=dtype, device="cuda") for _ in range(world)]
        self.pads = [torch.zeros(STAGING_SLOTS * signal_slots(world), dtype=torch.int32, device="cuda")
                     for _ in range(world)]
        self.side = [torch.cuda.Stream() for _ in range(world)]
        self.main = [torch.cuda.Stream() for _ in range(world)]
        padding = [0] * (MAX_WORLD - world)
        self.workspaces = [
            _Workspace(self.buffers[r], self.pads[r], capacity,
                       (*[(b.data_ptr() - self.buffers[r].data_ptr()) // size for b in self.buffers], *padding),
                       (*[(p.data_ptr() - self.pads[r].data_ptr()) // 4 for p in self.pads], *padding), r, world,
                       peer_wait.record_address(), int(peer_timeout_s * 1e9))
            for r in range(world)
        ]

    def poison(self) -> None:
        """NaN into every staging slot: a reduce that reads rows not pushed for its call shows it."""
        for buffer in self.buffers:
            buffer.fill_(float("nan"))

    def signals(self) -> list[list[int]]:
        """Every rank's signal pad (``kernels.push_partial_rows_kernel`` documents the slots)."""
        return [pad.tolist() for pad in self.pads]

    def split_schedule(
        self,
        calls: list[tuple[list[torch.Tensor], torch.Tensor | None]],
        weight: torch.Tensor,
        eps: float,
        out_dtype: torch.dtype,
        push_ctas: int = 8,
        reduce_ctas: int = 32,
        delay_reduce_cycles: dict[int, int] | None = None,
    ) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        """Run ``calls`` (each: the ranks' partials [T, H] and a residual) as the split does,
        call ``i`` being half ``i % 2`` (staging slot ``i % 2``) of site ``i // 2``: per rank, push A1,
        push B1, reduce A1, push A2, reduce B1, push B2, ... with fork and join as the op's (the side
        stream waits for main before each push; main waits for the push's event before its reduce).
        ``delay_reduce_cycles[r]``: rank ``r``'s main stream spins that many cycles before each
        reduce, so the other ranks' pushes run ahead of it. Returns ``[rank][call] -> (normed,
        residual_out)``, ready for the calling stream; capturable in a CUDA graph (no host sync)."""
        from weavepass.runtime.cuda.kernels import push_partial_rows_kernel, reduce_pushed_rows_kernel
        from weavepass.runtime.cuda.push import push_arguments

        world, hidden = self.world, self.hidden
        tokens = calls[0][0][0].shape[0]
        if world * push_ctas > 128:
            raise ValueError(f"{world} ranks x {push_ctas} push CTAs cannot all be resident on one GPU")
        elem = calls[0][0][0].element_size()
        args = [[push_arguments(self.workspaces[r], tokens, hidden, elem, slot, calls[0][1] is not None,
                                push_ctas, reduce_ctas) for slot in range(2)] for r in range(world)]
        outputs = [[(torch.empty(tokens, hidden, dtype=out_dtype, device="cuda"),
                     torch.empty(tokens, hidden, dtype=self.dtype, device="cuda")) for _ in calls]
                   for _ in range(world)]

        def push_launch(r, i):
            a = args[r][i % 2]
            return (calls[i][0][r], *a.push_tail), a.push_grid, a.push_meta

        def reduce_launch(r, i):
            a = args[r][i % 2]
            partial, residual = calls[i][0][r], calls[i][1]
            return ((partial, partial if residual is None else residual, weight, *outputs[r][i], *a.reduce_tail, eps),
                    a.reduce_grid, a.reduce_meta)

        # Compile and load every kernel before any runs (a rank's push waits for the others, and
        # loading a module can wait for running kernels: see SimulatedRanks.run). Both slots: the
        # slot's integers are specialised (0 and 1 are, in Triton), so each slot may be a kernel of
        # its own; warming slot 0 only hung the first run of these tests on the H200 (2026-12-01).
        if not torch.cuda.is_current_stream_capturing():
            for r, i in ((r, i) for r in range(world) for i in range(min(2, len(calls)))):
                for kernel, (launch_args, grid, meta) in ((push_partial_rows_kernel, push_launch(r, i)),
                                                          (reduce_pushed_rows_kernel, reduce_launch(r, i))):
                    compiled = kernel.warmup(*launch_args, grid=grid, **meta)
                    if hasattr(compiled, "_init_handles"):
                        compiled._init_handles()
        caller = torch.cuda.current_stream()
        for r in range(world):
            self.main[r].wait_stream(caller)
        done: dict[tuple[int, int], torch.cuda.Event] = {}

        def push(i):
            for r in range(world):
                self.side[r].wait_stream(self.main[r])  # fork
                with torch.cuda.stream(self.side[r]):
                    launch_args, grid, meta = push_launch(r, i)
                    push_partial_rows_kernel[grid](*launch_args, **meta)
                    done[(r, i)] = self.side[r].record_event()

        def reduce(i):
            for r in range(world):
                with torch.cuda.stream(self.main[r]):
                    self.main[r].wait_event(done.pop((r, i)))  # join
                    if delay_reduce_cycles and r in delay_reduce_cycles:
                        torch.cuda._sleep(delay_reduce_cycles[r])
                    launch_args, grid, meta = reduce_launch(r, i)
                    reduce_pushed_rows_kernel[grid](*launch_args, **meta)

        sites = len(calls) // 2
        if len(calls) != 2 * sites:
            raise ValueError("calls alternate halves A and B: give an even number")
        for step, i in split_schedule(sites):
            (push if step == "push" else reduce)(i)
        for r in range(world):
            caller.wait_stream(self.main[r])
            caller.wait_stream(self.side[r])
        return outputs


def split_schedule(sites: int):
    """The order in which the split issues the push variant's calls for ``sites`` sites, as
    ``("push" | "reduce", call)``: call ``2 * site + half``; both halves' first pushes, then each
    call's reduce (its join) followed by the push of the same half's next site."""
    yield "push", 0
    yield "push", 1
    for site in range(sites):
        for half in range(2):
            yield "reduce", 2 * site + half
            if site + 1 < sites:
                yield "push", 2 * (site + 1) + half
