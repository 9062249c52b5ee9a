"""The scatter-epilogue GEMM and its reduce (``runtime.cuda.gemm``) for ``world`` ranks in one process.

As ``kernel_sim`` does for the fused op: each simulated rank has its own staging buffer and signal
pad (ordinary allocations), and its kernels get the address differences to the other ranks' as the
real lowering would pass the symmetric peers'. ``run`` launches every rank's GEMM, then every
rank's reduce; on a GPU each rank has a stream of its own, so a reduce may start while other ranks'
GEMMs still run, and it waits for their row blocks' signals. Under ``TRITON_INTERPRET=1`` (CPU
tensors) the launches run one after another, so every wait is already satisfied when it is reached:
the interpreter checks indexing, routing, rounding and the signals' values, not the waits.

All ranks' reduces spin while they wait, so together they get ``REDUCE_CTAS`` CTAs, leaving the
GPU's other SMs to the GEMMs they wait for.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

from weavepass.runtime.cuda import peer_wait
from weavepass.runtime.cuda.gemm import (
    STAGING_ALIGNMENT,
    OwnerRows,
    ScatterLayout,
    ScatterWorkspace,
    address_table,
    reduce_scattered,
    scatter_matmul,
)
from weavepass.runtime.cuda.gemm_kernels import HEADER_SLOTS

REDUCE_CTAS = 64
"""CTAs of all simulated ranks' reduces together (they spin while they wait): about half the SMs of
an H100/H200, so the GEMMs they wait for always find SMs."""
SIM_PEER_TIMEOUT_S = 30.0
"""How long a simulated rank's kernel waits for the others before it gives up (peer_wait); GPU only."""


@dataclass(frozen=True)
class CapturedCall:
    """One call captured in a CUDA graph (``SimulatedScatterRanks.graph_call``) and what its kernels
    address that the caller does not hold. A CUDA graph keeps its kernels' arguments as raw addresses,
    not as tensors: a table it reads that nobody holds goes back to the caching allocator when the
    capturing call returns, the next allocation of its size overwrites it, and a replay then reads
    that instead (the cause, found by reading, of the first H200 run's illegal address at a replay:
    the split's row offsets were freed when the capture returned). So this object holds the split's
    device table for as long as the graph lives; the other tables belong to the workspaces, the
    inputs to the caller."""

    graph: torch.cuda.CUDAGraph | None  # None off CUDA: the call then ran once, uncaptured
    outputs: list[tuple[torch.Tensor, torch.Tensor]]  # every rank's (normed, residual_out), each replay's
    owners: OwnerRows  # the split (its device table is a kernel argument)

    def replay(self) -> None:
        if self.graph is None:
            raise RuntimeError("this call was not captured (no CUDA device): nothing to replay")
        self.graph.replay()


class SimulatedScatterRanks:
    """``world`` ranks' staging buffers and pads on ``device``, reused across calls (as a real
    workspace is), so back-to-back calls test the slot alternation and the sequence numbers."""

    def __init__(self, world: int, hidden: int, capacity: int, dtype: torch.dtype, device="cuda",
                 signal_rows: int | None = None, peer_timeout_s: float = SIM_PEER_TIMEOUT_S,
                 one_allocation: bool = False):
        """``one_allocation``: every rank's staging a slice of one tensor (``ScatterWorkspace.shared``),
        so the scatter may store through one tensor descriptor (``gemm.scatter_store_reason``)."""
        self.layout = ScatterLayout(world, hidden, capacity, **({} if signal_rows is None else
                                                                 {"signal_rows": signal_rows}))
        self.device = torch.device(device)
        lay = self.layout
        # poisoned: a row read before it was stored shows
        shared = (torch.full((world * lay.staging_elements,), float("nan"), dtype=dtype, device=self.device)
                  if one_allocation else None)
        self.buffers = ([shared[r * lay.staging_elements: (r + 1) * lay.staging_elements] for r in range(world)]
                        if shared is not None else
                        [torch.full((lay.staging_elements,), float("nan"), dtype=dtype, device=self.device)
                         for _ in range(world)])
        self.pads = [torch.zeros(lay.pad_slots, dtype=torch.int32, device=self.device) for _ in range(world)]
        on_gpu = self.device.type == "cuda"
        self.streams = [torch.cuda.Stream(self.device) for _ in range(world)] if on_gpu else None
        watch, timeout_ns = (peer_wait.record_address(), int(peer_timeout_s * 1e9)) if on_gpu else (0, 0)
        self.workspaces = [
            ScatterWorkspace(lay, r, self.buffers[r], self.pads[r],
                             address_table(self.buffers, r, STAGING_ALIGNMENT), address_table(self.pads, r),
                             watch, timeout_ns, shared)
            for r in range(world)]

    def run(self, xs: list[torch.Tensor], ws: list[torch.Tensor], residual: torch.Tensor | None,
            weight: torch.Tensor, eps: float, counts: list[int] | None = None, config=None,
            use_descriptors: bool | None = None, reduce_ctas: int | None = None, gemm_ctas: int | None = None,
            timeout_s: float = 60.0, owners: OwnerRows | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Rank ``r`` computes ``xs[r] @ ws[r]^T`` ([T, N]: its partial of the row-parallel GEMM) and
        scatters it; then owner ``r`` reduces its rows (``counts``: rows per owner, default the fused
        op's split). Returns every rank's ``(normed, residual_out)`` for its own rows ``[count_r, N]``,
        ready for the calling stream. ``residual`` [T, N] is the full residual stream (each owner
        reads its rows). ``reduce_ctas``: each reduce's grid, default ``REDUCE_CTAS // world``;
        ``owners``: the split already on the device (``counts`` is then ignored)."""
        lay = self.layout
        tokens = xs[0].shape[0]
        reduce_ctas = reduce_ctas or max(1, REDUCE_CTAS // lay.world)
        owners = owners or OwnerRows.build(tokens, lay.world, self.device, counts)
        outputs = [(torch.empty(owners.count(r), lay.hidden, dtype=xs[0].dtype, device=self.device),
                    torch.empty(owners.count(r), lay.hidden, dtype=xs[0].dtype, device=self.device))
                   for r in range(lay.world)]
        residuals = [None if residual is None else residual[owners.rows(r)].contiguous() for r in range(lay.world)]

        def gemm(r):
            scatter_matmul(xs[r], ws[r], self.workspaces[r], owners, config, use_descriptors, gemm_ctas)

        def reduce(r):
            reduce_scattered(self.workspaces[r], owners.count(r), residuals[r], weight, eps,
                             *outputs[r], reduce_ctas)

        if self.streams is None:
            for r in range(lay.world):
                gemm(r)
            for r in range(lay.world):
                reduce(r)
            return outputs
        caller = torch.cuda.current_stream(self.device)
        for stream in self.streams:
            stream.wait_stream(caller)
        for r in range(lay.world):
            with torch.cuda.stream(self.streams[r]):
                gemm(r)
        for r in range(lay.world):
            with torch.cuda.stream(self.streams[r]):
                reduce(r)
        self.wait_all(f"{tokens} tokens, world {lay.world}", timeout_s)
        return outputs

    def warm_up(self, xs, ws, residual, weight, eps, counts=None, config=None, use_descriptors=None,
                reduce_ctas: int | None = None, gemm_ctas: int | None = None,
                owners: OwnerRows | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``run``'s call on the calling stream, one rank's kernel after another, so no wait can
        block: it compiles and loads every rank's kernels before any rank waits on another (a module
        loaded lazily while another rank's kernel spins can wait for that kernel;
        ``kernel_sim.SimulatedRanks.run``). The kernels take row counts unspecialised, so later
        calls with other splits reuse them."""
        saved, self.streams = self.streams, None
        try:
            return self.run(xs, ws, residual, weight, eps, counts, config, use_descriptors, reduce_ctas, gemm_ctas,
                            owners=owners)
        finally:
            self.streams = saved

    def graph_call(self, xs, ws, residual, weight, eps, counts=None, config=None,
                   use_descriptors=None) -> CapturedCall:
        """A CUDA graph of one call, with the outputs it writes and the split it reads
        (``CapturedCall``: keep it as long as the graph is replayed). A warm-up call first (compiles
        and loads the kernels; it is a call, so the pads advance), then the capture of ``warm_up``'s
        single-stream order. Each replay is a new call of the inputs' current values: the kernels read
        their call number from the pads, so no host state changes between replays. Off CUDA (the
        interpreter) the second call runs once, uncaptured, so tests can check what it keeps alive."""
        owners = OwnerRows.build(xs[0].shape[0], self.layout.world, self.device, counts)
        self.warm_up(xs, ws, residual, weight, eps, config=config, use_descriptors=use_descriptors,
                     owners=owners)
        graph = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
        saved, self.streams = self.streams, None
        try:
            with torch.cuda.graph(graph) if graph is not None else contextlib.nullcontext():
                outputs = self.run(xs, ws, residual, weight, eps, config=config, use_descriptors=use_descriptors,
                                   owners=owners)
        finally:
            self.streams = saved
        return CapturedCall(graph, outputs, owners)

    def wait_all(self, what: str, timeout_s: float) -> None:
        """Wait for every rank's stream; raise (naming ``what``) rather than block for ever."""
        events = [s.record_event() for s in self.streams]
        deadline = time.monotonic() + timeout_s
        while not all(e.query() for e in events):
            if time.monotonic() > deadline:
                raise TimeoutError(f"simulated ranks did not finish in {timeout_s} s: {what}")
            time.sleep(1e-3)
        caller = torch.cuda.current_stream(self.device)
        for stream in self.streams:
            caller.wait_stream(stream)

    def sequence_numbers(self) -> list[list[int]]:
        """Every rank's ``[GEMM_SEQ, GEMM_DONE, REDUCE_SEQ, REDUCE_DONE]``."""
        return [p[:4].tolist() for p in self.pads]

    def counts_clear(self) -> bool:
        """Whether every (owner, row block) tile counter is back to 0 (each GEMM must leave them so)."""
        lay = self.layout
        first = HEADER_SLOTS.value
        return all(int(p[first:first + lay.world * lay.num_blocks].abs().sum()) == 0 for p in self.pads)

    def flags(self, rank: int, slot: int) -> torch.Tensor:
        """``FLAG[slot]`` of ``rank``'s pad as ``[src, row block]``."""
        lay = self.layout
        first = HEADER_SLOTS.value + lay.world * lay.num_blocks + slot * lay.world * lay.num_blocks
        return self.pads[rank][first:first + lay.world * lay.num_blocks].view(lay.world, lay.num_blocks)


class SimulatedMatmulRanks:
    """The ``cuda_symm`` lowering of the matmul ops (``runtime.cuda.matmul``) for ``world`` ranks in
    one process: each rank's ``MatmulWorkspace`` built from ordinary allocations (staging, gather
    buffers and pads; NaN-poisoned buffers) with the address differences to the others', so each
    rank's ``MatmulCall`` is the lowering's own. ``run`` makes every rank's call step by step: every
    GEMM, then every reduce, then every push, then every collect (on a GPU each rank on its own
    stream, so waits are real; under the interpreter one after another)."""

    def __init__(self, world: int, hidden: int, tokens: int, dtype: torch.dtype, device="cuda",
                 signal_rows: int | None = None, peer_timeout_s: float = SIM_PEER_TIMEOUT_S):
        from weavepass.runtime.cuda.gemm import GatherLayout, GatherWorkspace
        from weavepass.runtime.cuda.matmul import MatmulWorkspace, capacity_rows

        self.device = torch.device(device)
        self.world = world
        on_gpu = self.device.type == "cuda"
        watch, timeout_ns = (peer_wait.record_address(), int(peer_timeout_s * 1e9)) if on_gpu else (0, 0)
        scatter = ScatterLayout(world, hidden, capacity_rows(tokens, world),
                                **({} if signal_rows is None else {"signal_rows": signal_rows}))
        gather = GatherLayout(world, hidden, tokens)

        def buffers(n: int, t: torch.dtype, fill: float) -> list[torch.Tensor]:
            return [torch.full((n,), fill, dtype=t, device=self.device) for _ in range(world)]

        staging, gathers = buffers(scatter.staging_elements, dtype, float("nan")), buffers(gather.elements, dtype,
                                                                                            float("nan"))
        pads, gather_pads = buffers(scatter.pad_slots, torch.int32, 0), buffers(gather.pad_slots, torch.int32, 0)
        self.pads, self.gather_pads = pads, gather_pads
        self.workspaces = [
            MatmulWorkspace(
                f"sim{world}", tokens,
                ScatterWorkspace(scatter, r, staging[r], pads[r], address_table(staging, r, STAGING_ALIGNMENT),
                                 address_table(pads, r), watch, timeout_ns),
                GatherWorkspace(gather, r, gathers[r], gather_pads[r], address_table(gathers, r),
                                address_table(gather_pads, r), watch, timeout_ns))
            for r in range(world)]
        self.streams = [torch.cuda.Stream(self.device) for _ in range(world)] if on_gpu else None

    def calls(self, xs, mat2s, residuals, weight, eps, rows_per_rank: int | None = None,
              num_ctas: int | None = None):
        """Every rank's ``MatmulCall`` (``rows_per_rank`` None: the full stream, else the sharded
        form with that split). ``residuals``: each rank's residual argument (the full stream's [T, H]
        or its [rows_per_rank, H] shard), or None."""
        from weavepass.runtime.cuda.matmul import prepare_call
        from weavepass.runtime.portable import rows_per_rank as ceil_split

        tokens = xs[0].shape[0]
        per = ceil_split(tokens, self.world) if rows_per_rank is None else rows_per_rank
        ctas = num_ctas or max(1, REDUCE_CTAS // self.world)
        out = []
        for r, ws in enumerate(self.workspaces):
            owners = ws.owners(tokens, per)
            out.append(prepare_call(ws, owners, xs[r], mat2s[r], None if residuals is None else residuals[r], weight,
                                    eps, xs[r].dtype, rows_per_rank, ctas))
        return out

    def run(self, calls, timeout_s: float = 60.0, one_stream: bool = False) -> None:
        """Every rank's steps in phases (``one_stream``: on the calling stream, one after another:
        no wait can block, so it loads every kernel first)."""
        steps = ("gemm", "reduce", "push", "collect")
        if self.streams is None or one_stream:
            for step in steps:
                for call in calls:
                    getattr(call, step)()
            return
        caller = torch.cuda.current_stream(self.device)
        for stream in self.streams:
            stream.wait_stream(caller)
        for step in steps:
            for r, call in enumerate(calls):
                with torch.cuda.stream(self.streams[r]):
                    getattr(call, step)()
        events = [s.record_event() for s in self.streams]
        deadline = time.monotonic() + timeout_s
        while not all(e.query() for e in events):
            if time.monotonic() > deadline:
                raise TimeoutError(f"simulated matmul ranks did not finish in {timeout_s} s")
            time.sleep(1e-3)
        for stream in self.streams:
            caller.wait_stream(stream)


class SimulatedGatherRanks:
    """The gather prologue (``runtime.cuda.gather``) for ``world`` ranks in one process: each rank's
    gather buffer and pad (ordinary allocations, the buffers NaN-poisoned) with the address
    differences to the others', as the ``cuda_symm`` lowering passes symmetric peers'. ``run``
    launches every rank's push, then every rank's gather GEMMs (on a GPU each rank on its own
    stream, so a GEMM really waits for the owners' flags; the pushes are launched first, so a
    spinning GEMM never holds the SMs a push it waits for needs). Under the interpreter the launches
    run one after another."""

    def __init__(self, world: int, hidden: int, owner_capacity: int, dtype: torch.dtype, device="cuda",
                 parts: int = 1, signal_rows: int | None = None, peer_timeout_s: float = SIM_PEER_TIMEOUT_S):
        from weavepass.runtime.cuda.gather import ALIGNMENT, PrologueLayout, PrologueWorkspace

        self.layout = PrologueLayout(world, hidden, owner_capacity, parts,
                                     **({} if signal_rows is None else {"signal_rows": signal_rows}))
        self.device = torch.device(device)
        lay = self.layout
        self.buffers = [torch.full((lay.elements,), float("nan"), dtype=dtype, device=self.device)
                        for _ in range(world)]
        self.pads = [torch.zeros(lay.pad_slots, dtype=torch.int32, device=self.device) for _ in range(world)]
        on_gpu = self.device.type == "cuda"
        self.streams = [torch.cuda.Stream(self.device) for _ in range(world)] if on_gpu else None
        watch, timeout_ns = (peer_wait.record_address(), int(peer_timeout_s * 1e9)) if on_gpu else (0, 0)
        self.workspaces = [
            PrologueWorkspace(lay, r, self.buffers[r], self.pads[r], address_table(self.buffers, r, ALIGNMENT),
                              address_table(self.pads, r), watch, timeout_ns)
            for r in range(world)]

    def launch(self, rank: int, step: str, rows, owners: OwnerRows, weights, outputs, extras=None, config=None,
               use_descriptors: bool | None = None, gemm_ctas: int | None = None) -> None:
        """One rank's ``step`` (``"push"`` or ``"gemm"``) on the current stream; ``outputs[rank]`` is
        filled by the GEMMs."""
        from weavepass.runtime.cuda.gather import gather_matmuls, push_gather_rows

        ws = self.workspaces[rank]
        if step == "push":
            push_gather_rows(ws, rows[rank], owners, None if extras is None else extras[rank])
        else:
            outputs[rank] = gather_matmuls(ws, weights, owners, config, use_descriptors, gemm_ctas)

    def run(self, rows: list[torch.Tensor], weights: list[torch.Tensor], counts: list[int] | None = None,
            extras: list[torch.Tensor] | None = None, config=None, use_descriptors: bool | None = None,
            gemm_ctas: int | None = None, one_stream: bool = False, owners: OwnerRows | None = None,
            interleaved: bool = False, timeout_s: float = 60.0) -> list[list[torch.Tensor]]:
        """Owner ``r`` pushes ``rows[r]`` (its ``[>= count_r, K]`` rows; ``extras[r]``: residual_out
        rows, two-part layouts) and every rank computes ``gathered @ w^T`` for each of ``weights``
        (``[N_i, K]``, the same on every rank here: a column-parallel weight shard per rank in a
        model). ``counts``: rows per owner, or ``owners``: the split itself (one of the two is
        needed; without either the call is refused). Returns every rank's
        outputs ``[T, N_i]``. ``one_stream``: every launch on the calling stream, one after another
        (no wait can block: the warm-up and a CUDA-graph capture use it). ``interleaved`` (GPU only):
        rank by rank, push then GEMMs, so rank 0's GEMM is launched before its peers' pushes; give
        ``gemm_ctas`` so that every rank's grid fits the GPU at once, or a spinning GEMM can hold the
        SMs a later push needs (on real ranks each GPU runs only its own kernels)."""
        lay = self.layout
        tokens = sum(counts) if counts is not None else None
        if owners is None:
            if tokens is None:
                raise ValueError("give the row counts or the split")
            owners = OwnerRows.build(tokens, lay.world, self.device, counts)
        outputs: list = [None] * lay.world
        args = (rows, owners, weights, outputs, extras, config, use_descriptors, gemm_ctas)
        if self.streams is None or one_stream:
            if interleaved:
                raise ValueError("interleaved launches on one stream would wait for a push never launched")
            for step in ("push", "gemm"):
                for r in range(lay.world):
                    self.launch(r, step, *args)
            return outputs
        caller = torch.cuda.current_stream(self.device)
        for stream in self.streams:
            stream.wait_stream(caller)
        order = ([(r, step) for r in range(lay.world) for step in ("push", "gemm")] if interleaved
                 else [(r, step) for step in ("push", "gemm") for r in range(lay.world)])
        for r, step in order:
            with torch.cuda.stream(self.streams[r]):
                self.launch(r, step, *args)
        events = [s.record_event() for s in self.streams]
        deadline = time.monotonic() + timeout_s
        while not all(e.query() for e in events):
            if time.monotonic() > deadline:
                raise TimeoutError(f"simulated gather ranks did not finish in {timeout_s} s")
            time.sleep(1e-3)
        for stream in self.streams:
            caller.wait_stream(stream)
        return outputs

    def sequence_numbers(self) -> list[int]:
        """Every rank's GATHER_SEQ (calls whose gather GEMMs finished)."""
        return [int(p[0]) for p in self.pads]
