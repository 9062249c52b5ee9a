"""The persistent GEMM, its scatter epilogue and the owners' reduce (``runtime.cuda.gemm``) run by
Triton's interpreter on CPU, all simulated ranks in this one process (``testing.gemm_sim``: every
rank's GEMM, then every rank's reduce, one after another, so each wait is met when reached).

Run by tests/test_gemm_interpreted.py as ``TRITON_INTERPRET=1 python tests/gemm_interpreter_case.py
<case>``; prints ``<case>: OK`` after its checks, raises otherwise.

fp16 only: Triton 3.9's interpreter multiplies bf16 operands of ``tl.dot`` as their raw 16-bit
integers (``create_dot`` passes the uint16 storage to ``np.matmul``), so a bf16 GEMM is garbage
there; bf16 runs on the GPU (tests/gpu/test_gemm_gpu.py).
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import sys
import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from weavepass.runtime.cuda.gemm import (
    INTERPRETER_CONFIG,
    STAGING_SLOTS,
    matmul,
    owner_row_starts,
    scatter_store_reason,
)
from weavepass.runtime.reference import fused_allreduce_rmsnorm_reference
from weavepass.testing.gemm_sim import SimulatedScatterRanks

DTYPE = torch.float16
EPS = 1e-6
# The GEMM against torch.mm: both accumulate exact fp16 products in fp32 (in different orders) and
# round once, so they differ by at most one fp16 ulp (<= 2^-10 relative) where the fp32 sums
# straddle a rounding boundary; atol covers values near 0, where the fp32 order difference
# (<= K * 2^-24 * sum |x||w|, ~1e-5 here) is not small relative to the value.
GEMM_TOL = dict(rtol=2**-10, atol=1e-4)
# The reduce against the fp32 reference fed the same partials: residual_out is one final rounding
# (an ulp where the fp32 sums differ in order), normed 2 ulp (tests/gpu/test_kernel_sim_one_gpu.py's).
RESIDUAL_TOL = dict(rtol=2**-10, atol=1e-5)
NORMED_TOL = dict(rtol=2**-9, atol=2**-9)
SIGNAL_ROWS = 16  # = INTERPRETER_CONFIG.block_m: several signals per owner at these sizes
FLATTENED = dataclasses.replace(INTERPRETER_CONFIG, flatten=True, warp_specialize=True)
SPLIT_STORES = (dataclasses.replace(INTERPRETER_CONFIG, block_n=32, epilogue_split=2),
                dataclasses.replace(INTERPRETER_CONFIG, block_n=32, epilogue_split=4))
"""The epilogue in column slices (pointer stores, or TMA stores where the loads use descriptors)."""
TMA_STORES = tuple(dataclasses.replace(c, store_desc=True) for c in (INTERPRETER_CONFIG, FLATTENED) + SPLIT_STORES)


def _draw(gen, *shape):
    return torch.randn(*shape, generator=gen).to(DTYPE)


def case_gemm() -> None:
    """Plain GEMM, both load paths, odd sizes (rows, columns and K not multiples of the tiles), the
    flattened, warp-specialised loop (the interpreter runs it as the plain loop: the flags' syntax),
    the epilogue in 2 and 4 column slices, and TMA stores (the descriptor clips the edge tiles). The
    output is poisoned first: a tile or slice never stored shows as NaN."""
    gen = torch.Generator().manual_seed(0)
    configs = ([(False, INTERPRETER_CONFIG), (True, INTERPRETER_CONFIG), (True, FLATTENED)]
               + [(False, c) for c in SPLIT_STORES] + [(True, c) for c in SPLIT_STORES + TMA_STORES])
    for m, n, k in ((37, 40, 48), (1, 16, 16), (50, 24, 72), (33, 72, 16)):
        x, w = _draw(gen, m, k), _draw(gen, n, k)
        want = torch.mm(x, w.T)
        for desc, config in configs:
            got = matmul(x, w, out=torch.full((m, n), float("nan"), dtype=DTYPE), config=config,
                         use_descriptors=desc, max_ctas=3)
            torch.testing.assert_close(got, want, **GEMM_TOL, msg=lambda e: f"{m}x{n}x{k} {config} desc={desc}: {e}")
    print("gemm: OK")


def _world_run(world: int, tokens: int, hidden: int, k: int, counts, calls: int, desc: bool, residual: bool,
               config=INTERPRETER_CONFIG, one_allocation: bool = False, tma_stores: bool = False):
    """``calls`` back-to-back calls of ``world`` simulated ranks; checks every call's staged partials
    and outputs, and the signals after the last. ``one_allocation``: the stagings in one tensor, the
    capacity rounded up to whole tiles; ``tma_stores``: asserts the scatter stores through the
    descriptor there (``scatter_store_reason`` None), else that it stores through pointers."""
    gen = torch.Generator().manual_seed(world * 100 + tokens)
    starts = owner_row_starts(tokens, world, counts)
    capacity = max(b - a for a, b in itertools.pairwise(starts)) or 1
    if one_allocation:
        capacity = -(-capacity // config.block_m) * config.block_m
    sim = SimulatedScatterRanks(world, hidden, capacity, DTYPE, "cpu", signal_rows=SIGNAL_ROWS,
                                one_allocation=one_allocation)
    why = scatter_store_reason(sim.workspaces[0], config, desc, signals=True)
    assert (why is None) == tma_stores, why
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(DTYPE)
    for call in range(calls):
        xs = [_draw(gen, tokens, k) for _ in range(world)]
        ws = [_draw(gen, hidden, k) for _ in range(world)]
        res = _draw(gen, tokens, hidden) if residual else None
        outputs = sim.run(xs, ws, res, weight, EPS, counts, config, desc, reduce_ctas=2, gemm_ctas=3)
        slot = (call + 1) % STAGING_SLOTS
        label = f"world {world}, counts {counts}, call {call}, desc={desc}, {config.label()}"
        assert sim.counts_clear(), f"{label}: tile counters not reset: {[p.tolist() for p in sim.pads]}"
        # Routing: owner j's staging[slot][src] holds exactly src's GEMM of j's rows (the same
        # kernel and K order as the plain GEMM of all rows, so equal to the bit).
        plain = [matmul(xs[s], ws[s], config=config, use_descriptors=desc) for s in range(world)]
        for j in range(world):
            rows = starts[j + 1] - starts[j]
            for s in range(world):
                staged = sim.workspaces[j].staged(s, rows, slot)
                assert torch.equal(staged, plain[s][starts[j]:starts[j + 1]]), f"{label}: owner {j} src {s}"
        # The reduce: the reference's math on those partials, for each owner's rows.
        want_normed, want_res = fused_allreduce_rmsnorm_reference(plain, res, weight, EPS, DTYPE)
        for j, (normed, res_out) in enumerate(outputs):
            rows = slice(starts[j], starts[j + 1])
            torch.testing.assert_close(res_out, want_res[rows], **RESIDUAL_TOL, msg=lambda e: f"{label} {j}: {e}")
            torch.testing.assert_close(normed, want_normed[rows], **NORMED_TOL, msg=lambda e: f"{label} {j}: {e}")
    # Signals: every rank made `calls` GEMMs and reduces, the done counts are back to 0 (the tile
    # counters were checked after each call), and each (src, row block) flag of an owner's rows
    # holds the last call that used its slot; flags past the owner's rows were never written.
    assert sim.sequence_numbers() == [[calls, 0, calls, 0]] * world, sim.sequence_numbers()
    for j in range(world):
        blocks = -(-(starts[j + 1] - starts[j]) // SIGNAL_ROWS)
        for slot in range(STAGING_SLOTS):
            last = max((c + 1 for c in range(calls) if (c + 1) % STAGING_SLOTS == slot), default=0)
            flags = sim.flags(j, slot)
            assert bool((flags[:, :blocks] == last).all()), (j, slot, flags.tolist(), last)
            assert bool((flags[:, blocks:] == 0).all()), (j, slot, flags.tolist())


def case_scatter() -> None:
    """World 2, 3 and 4, default and ragged splits (an owner without rows, counts that are not
    multiples of the tile or the signal block), three calls each (both slots, then slot 1 again),
    alternating the pointer and the descriptor loads, and the epilogue in one, two or four column
    slices (pointer stores: the scatter never stores through a descriptor)."""
    splits = ((2, 37, None), (2, 33, [33, 0]), (3, 41, [20, 4, 17]), (3, 7, None), (4, 45, [1, 16, 0, 28]),
              (4, 37, None))
    configs = (INTERPRETER_CONFIG, *SPLIT_STORES)
    for i, (world, tokens, counts) in enumerate(splits):  # each world through both load paths
        _world_run(world, tokens, 24, 32, counts, 3, desc=bool(i % 2), residual=True, config=configs[i % 3])
    print("scatter: OK")


def case_scatter_paths() -> None:
    """The scatter's signal and store paths: the per-tile signals of the first versions
    (``defer_signals=False``), the deferred ones (the default) with TMA stores through one descriptor
    over one allocation of every rank's staging, in one, two and four column slices, flattened, and
    TMA asked for where it cannot serve (separate allocations; per-tile signals): pointer stores.
    Each run checks the staged partials against the plain GEMM to the bit, the reduce, and the
    signals' values after three calls (as ``case_scatter``)."""
    tilesig = dataclasses.replace(INTERPRETER_CONFIG, defer_signals=False)
    tma = [dataclasses.replace(c, store_desc=True) for c in (INTERPRETER_CONFIG, FLATTENED, *SPLIT_STORES)]
    for world, tokens, counts in ((2, 37, None), (3, 41, [20, 4, 17]), (4, 45, [1, 16, 0, 28])):
        _world_run(world, tokens, 24, 32, counts, 3, desc=True, residual=True, config=tilesig)
        _world_run(world, tokens, 24, 32, counts, 3, desc=False, residual=True, config=tilesig)
        for config in tma:
            _world_run(world, tokens, 24 if config.block_n == 16 else 40, 32, counts, 3, desc=True, residual=True,
                       config=config, one_allocation=True, tma_stores=True)
        _world_run(world, tokens, 24, 32, counts, 3, desc=True, residual=True, config=tma[0])  # separate buffers
        _world_run(world, tokens, 24, 32, counts, 3, desc=True, residual=True, one_allocation=True,
                   config=dataclasses.replace(tma[0], defer_signals=False))
    print("scatter_paths: OK")


def case_reduce() -> None:
    """The reduce without a residual, and more signal blocks per owner than reduce programs."""
    _world_run(2, 70, 40, 16, [51, 19], 2, True, residual=False)
    _world_run(3, 64, 24, 16, None, 1, False, residual=True)
    print("reduce: OK")


class _Recorded:
    """A kernel whose launches record a weak reference to every tensor argument's storage (a tensor
    descriptor's: its base tensor's), in launch order, into ``launches``."""

    def __init__(self, kernel, name: str, launches: list):
        self.kernel, self.name, self.launches = kernel, name, launches

    def __getitem__(self, grid):
        run = self.kernel[grid]

        def launch(*args, **kwargs):
            tensors = [(i, getattr(a, "base", a)) for i, a in enumerate(args)]
            self.launches.append((self.name, [(i, StorageWeakRef(t.untyped_storage())) for i, t in tensors
                                              if isinstance(t, torch.Tensor)]))
            return run(*args, **kwargs)

        return launch


def case_capture() -> None:
    """What a captured call's kernels address outlives the capture. A CUDA graph keeps its kernels'
    arguments as raw addresses, so after ``graph_call`` returns every tensor its captured launches
    were given must still be held, by the caller's inputs, the workspaces or the returned
    ``CapturedCall``; one nobody holds goes back to the allocator and a replay reads whatever reuses
    it (the first H200 run: the split's table, then an illegal address). Off CUDA ``graph_call`` runs
    the call once uncaptured: its launches are recorded here, its outputs checked."""
    from weavepass.runtime.cuda import gemm_kernels

    world, tokens, hidden, k, counts = 3, 41, 24, 32, [20, 4, 17]
    gen = torch.Generator().manual_seed(5)
    sim = SimulatedScatterRanks(world, hidden, max(counts), DTYPE, "cpu", signal_rows=SIGNAL_ROWS)
    xs = [_draw(gen, tokens, k) for _ in range(world)]
    ws = [_draw(gen, hidden, k) for _ in range(world)]
    res, weight = _draw(gen, tokens, hidden), (1 + 0.1 * torch.randn(hidden, generator=gen)).to(DTYPE)
    launches: list = []
    kernels = gemm_kernels.persistent_gemm_kernel, gemm_kernels.reduce_scattered_rows_kernel
    gemm_kernels.persistent_gemm_kernel = _Recorded(kernels[0], "gemm", launches)
    gemm_kernels.reduce_scattered_rows_kernel = _Recorded(kernels[1], "reduce", launches)
    try:
        captured = sim.graph_call(xs, ws, res, weight, EPS, counts, INTERPRETER_CONFIG, use_descriptors=True)
    finally:
        gemm_kernels.persistent_gemm_kernel, gemm_kernels.reduce_scattered_rows_kernel = kernels
    # The warm-up's launches (its outputs are rightly dropped), then the captured call's.
    names = [name for name, _ in launches]
    assert names == (["gemm"] * world + ["reduce"] * world) * 2, names
    assert captured.graph is None and sim.sequence_numbers() == [[2, 0, 2, 0]] * world, sim.sequence_numbers()
    gc.collect()
    freed = [(n, name, i) for n, (name, refs) in enumerate(launches[2 * world:]) for i, ref in refs if ref.expired()]
    assert not freed, f"captured launches (number, kernel, argument) whose tensors nobody holds: {freed}"
    starts = owner_row_starts(tokens, world, counts)
    plain = [matmul(xs[s], ws[s], config=INTERPRETER_CONFIG, use_descriptors=True) for s in range(world)]
    want_normed, want_res = fused_allreduce_rmsnorm_reference(plain, res, weight, EPS, DTYPE)
    for j, (normed, res_out) in enumerate(captured.outputs):
        rows = slice(starts[j], starts[j + 1])
        torch.testing.assert_close(res_out, want_res[rows], **RESIDUAL_TOL, msg=lambda e: f"owner {j}: {e}")
        torch.testing.assert_close(normed, want_normed[rows], **NORMED_TOL, msg=lambda e: f"owner {j}: {e}")
    print("capture: OK")


def case_matmul_op() -> None:
    """The ``cuda_symm`` lowering of the matmul ops (``runtime.cuda.matmul``: ``MatmulCall``'s GEMM,
    reduce, push and collect) on simulated workspaces (``SimulatedMatmulRanks``), two calls back to
    back (both slots of staging and gather): the full stream at N = 2 and 3 with token counts no
    owner count divides, every rank's ``[T, H]`` outputs against the reference fed the plain GEMM's
    partials (the same tiles, checked to the bit in ``case_scatter``) and equal across ranks to the
    bit (the gathered rows are copies of their owner's); FlashComm's split (16-row shards, an owner
    with no rows, padding rows that get the residual's own norm) against the portable lowering's
    math on the same partials; the call counters after the two calls."""
    from weavepass.runtime.cuda.matmul import pad_shard_rows
    from weavepass.runtime.reference import add_rmsnorm_local
    from weavepass.testing.gemm_sim import SimulatedMatmulRanks

    hidden, k = 24, 40
    for world, tokens, rows_per_rank, residual in [(2, 21, None, True), (3, 37, None, False), (3, 37, 16, True),
                                                   (3, 20, 16, True), (2, 21, 16, False)]:
        gen = torch.Generator().manual_seed(world * 100 + tokens)
        sim = SimulatedMatmulRanks(world, hidden, 64, DTYPE, "cpu", signal_rows=SIGNAL_ROWS)
        for _call in range(2):
            xs = [_draw(gen, tokens, k) for _ in range(world)]
            ws = [_draw(gen, hidden, k) for _ in range(world)]
            mat2s = [w.t() for w in ws]
            weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(DTYPE)
            partials = [matmul(x, w, config=INTERPRETER_CONFIG) for x, w in zip(xs, ws, strict=True)]
            if rows_per_rank is None:
                res = _draw(gen, tokens, hidden) if residual else None
                calls = sim.calls(xs, mat2s, None if res is None else [res] * world, weight, EPS, num_ctas=2)
                sim.run(calls)
                want_n, want_r = fused_allreduce_rmsnorm_reference(partials, res, weight, EPS, DTYPE)
                for c in calls:
                    assert c.normed.shape == (tokens, hidden)
                    assert torch.equal(c.normed, calls[0].normed) and torch.equal(c.residual_out,
                                                                                  calls[0].residual_out)
                    torch.testing.assert_close(c.residual_out, want_r, **RESIDUAL_TOL)
                    torch.testing.assert_close(c.normed, want_n, **NORMED_TOL)
            else:
                padded = rows_per_rank * world
                shards = [_draw(gen, rows_per_rank, hidden) for _ in range(world)] if residual else None
                calls = sim.calls(xs, mat2s, shards, weight, EPS, rows_per_rank=rows_per_rank, num_ctas=2)
                sim.run(calls)
                summed = torch.zeros(padded, hidden, dtype=torch.float32)
                summed[:tokens] = torch.stack([p.float() for p in partials]).sum(0)
                for r, c in enumerate(calls):
                    pad_shard_rows(c, None if shards is None else shards[r], weight, EPS, DTYPE)
                    rows = slice(r * rows_per_rank, (r + 1) * rows_per_rank)
                    want_n, want_r = add_rmsnorm_local(summed[rows], None if shards is None else shards[r], weight,
                                                       EPS, DTYPE, DTYPE)
                    assert c.normed.shape == (rows_per_rank, hidden)
                    torch.testing.assert_close(c.residual_out, want_r, **RESIDUAL_TOL)
                    torch.testing.assert_close(c.normed, want_n, **NORMED_TOL)
        for r in range(world):
            assert sim.pads[r][:4].tolist()[0::2] == [2, 2]  # GEMM_SEQ, REDUCE_SEQ: two calls
            if rows_per_rank is None:
                assert sim.gather_pads[r][0].item() == 2  # GATHER_SEQ
    print("matmul_op: OK")


def case_planned() -> None:
    """``gemm.ScatterPlan`` (the op's launches after the first call of a signature:
    ``matmul._planned_call``) against the general path (``scatter_matmul`` + ``reduce_scattered``) on
    the same inputs, to the bit, at world 1 and 2 with and without a residual: three calls of one
    signature (the first launches with the call's own descriptors, the later ones with copies rebased
    on new x and w), then an x 2 bytes off 16-byte alignment (the plan then launches what
    ``scatter_matmul`` does for it, pointer loads), against the reference. The plan holds neither the
    first call's x nor its w. A signature whose first call is off alignment still loads through
    descriptors at its aligned calls."""
    from weavepass.runtime.cuda.gemm import ScatterPlan
    from weavepass.testing.gemm_sim import SimulatedMatmulRanks

    hidden, k, tokens = 24, 40, 37
    for world, residual in [(1, True), (2, False), (2, True)]:
        gen = torch.Generator().manual_seed(world * 10 + residual)
        sim = SimulatedMatmulRanks(world, hidden, 64, DTYPE, "cpu", signal_rows=SIGNAL_ROWS)
        weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(DTYPE)
        plans = None
        for step in range(4):
            xs = [_draw(gen, tokens, k) for _ in range(world)]
            if step == 3:  # x off alignment: a flat buffer viewed from its second element
                xs = [torch.cat([x.new_zeros(1), x.reshape(-1)])[1:].view(tokens, k) for x in xs]
                assert all(x.data_ptr() % 16 for x in xs)
            mats = [_draw(gen, hidden, k) for _ in range(world)]
            res = [_draw(gen, tokens, hidden)] * world if residual else None
            general = sim.calls(xs, [m.t() for m in mats], res, weight, EPS, num_ctas=2)
            sim.run(general)
            planned = sim.calls(xs, [m.t() for m in mats], res, weight, EPS, num_ctas=2)
            if plans is None:
                plans = [ScatterPlan(c.x, c.w, c.ws.scatter, c.owners, c.count, EPS, c.num_ctas, residual)
                         for c in planned]
                refs = [weakref.ref(t) for c in planned for t in (c.x, c.w)]
            for c, plan in zip(planned, plans, strict=True):
                c.plan = plan
            sim.run(planned)
            for a, b in zip(general, planned, strict=True):
                assert torch.equal(a.normed, b.normed) and torch.equal(a.residual_out, b.residual_out), step
            partials = [matmul(x.contiguous(), m, config=INTERPRETER_CONFIG) for x, m in zip(xs, mats, strict=True)]
            want_n, want_r = fused_allreduce_rmsnorm_reference(partials, None if res is None else res[0], weight, EPS,
                                                               DTYPE)
            torch.testing.assert_close(planned[0].residual_out, want_r, **RESIDUAL_TOL)
            torch.testing.assert_close(planned[0].normed, want_n, **NORMED_TOL)
            if step == 0:
                del general, planned, partials, c, a, b, xs, mats
                gc.collect()
                assert all(r() is None for r in refs), "a plan keeps its first call's x or w alive"
        assert all(p.use_descriptors for p in plans)  # the interpreter takes descriptors: the rebased path ran
    # A signature whose first call has x off 16-byte alignment (pointer loads): the plan's later,
    # aligned calls still load through descriptors, as the general path's do.
    sim = SimulatedMatmulRanks(1, hidden, 64, DTYPE, "cpu", signal_rows=SIGNAL_ROWS)
    plan = None
    for step in range(3):
        x = _draw(gen, tokens, k)
        if step == 0:
            x = torch.cat([x.new_zeros(1), x.reshape(-1)])[1:].view(tokens, k)
            assert x.data_ptr() % 16
        mat = _draw(gen, hidden, k)
        general = sim.calls([x], [mat.t()], None, weight, EPS, num_ctas=2)
        sim.run(general)
        planned = sim.calls([x], [mat.t()], None, weight, EPS, num_ctas=2)
        if plan is None:
            (c,) = planned
            plan = ScatterPlan(c.x, c.w, c.ws.scatter, c.owners, c.count, EPS, c.num_ctas, False)
        planned[0].plan = plan
        sim.run(planned)
        assert torch.equal(general[0].normed, planned[0].normed), step
        assert torch.equal(general[0].residual_out, planned[0].residual_out), step
    assert plan.use_descriptors and plan.gemm_launcher.meta["USE_DESC"], "a misaligned first call pinned pointer loads"
    assert plan._templates is not None  # the aligned calls launched through (rebased) descriptors
    assert plan.pointer_launcher is not None and not plan.pointer_launcher.meta["USE_DESC"]
    print("planned: OK")


def case_matmul_entry() -> None:
    """The lowering's entry points (``matmul_reduce_scatter_rmsnorm_cuda`` and the shard form) at a
    gloo group of one rank, the symmetric allocation replaced by ordinary CPU tensors (the kernels'
    peers are then only itself): the workspace's size classes (a larger call allocates the next, a
    smaller one reuses the smallest that fits), the splits it holds per token count, the residual as
    any view of ``T x H`` elements, the shard's padding rows, against the reference."""
    import os
    import tempfile

    import torch.distributed as dist

    from weavepass.runtime.cuda import matmul as lowering
    from weavepass.runtime.cuda import workspace
    from weavepass.runtime.reference import add_rmsnorm_local

    def cpu_symmetric(group_name, dtype, device, numel, pad_slots):
        return workspace.SymmetricBuffer(torch.full((numel,), float("nan"), dtype=dtype),
                                         torch.zeros(pad_slots, dtype=torch.int32), [0], [0], 0, 1)

    workspace.new_symmetric = cpu_symmetric
    workspace.outside_graph_pools = lambda make, device: make()
    lowering.unsupported_reason = lambda *args: None  # the CPU tensors: the interpreter runs the kernels
    with tempfile.TemporaryDirectory() as folder:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(folder, 'store')}", rank=0, world_size=1)
        group = dist.group.WORLD.group_name
        gen = torch.Generator().manual_seed(3)
        hidden, k = 24, 40
        weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(DTYPE)
        for tokens in (300, 21, 300, 600):
            x, w = _draw(gen, tokens, k), _draw(gen, hidden, k)
            residual = _draw(gen, 2, tokens // 2 if tokens % 2 == 0 else tokens, hidden)[: 1 if tokens % 2 else 2]
            want_n, want_r = fused_allreduce_rmsnorm_reference([matmul(x, w, config=INTERPRETER_CONFIG)],
                                                               residual.reshape(tokens, hidden), weight, EPS, DTYPE)
            normed, res = lowering.matmul_reduce_scatter_rmsnorm_cuda(x, w.t(), residual, weight, EPS, group, DTYPE,
                                                                      max_workspace_tokens=1024)
            torch.testing.assert_close(res, want_r, **RESIDUAL_TOL)
            torch.testing.assert_close(normed, want_n, **NORMED_TOL)
            per = -(-tokens // 16) * 16 + 16  # a shard with padding rows
            shard = _draw(gen, per, hidden)
            s_normed, s_res = lowering.matmul_reduce_scatter_rmsnorm_shard_cuda(
                x, w.t(), shard, None, EPS, group, DTYPE, per, max_workspace_tokens=1024)
            summed = torch.zeros(per, hidden)
            summed[:tokens] = matmul(x, w, config=INTERPRETER_CONFIG).float()
            want_n, want_r = add_rmsnorm_local(summed, shard, None, EPS, DTYPE, DTYPE)
            torch.testing.assert_close(s_res, want_r, **RESIDUAL_TOL)
            torch.testing.assert_close(s_normed, want_n, **NORMED_TOL)
        (cached,) = lowering._WORKSPACES.values()
        assert [ws.tokens for ws in cached] == [512, 1024], [ws.tokens for ws in cached]  # 21 reused 512
        assert sorted(cached[0].splits) == [(21, 21), (21, 48), (300, 300), (300, 320)], sorted(cached[0].splits)
        assert sorted(cached[1].splits) == [(600, 600), (600, 624)], sorted(cached[1].splits)
        # A group of one: its staging is every owner's, one allocation, so a config with TMA stores
        # scatters through one descriptor (select_config's, here the interpreter's with TMA stores).
        from weavepass.runtime.cuda import gemm

        tma = dataclasses.replace(INTERPRETER_CONFIG, store_desc=True)
        gemm.INTERPRETER_CONFIG = tma
        try:
            why = gemm.scatter_store_reason(cached[0].scatter, tma, True, True)
            assert why is None, why
            x, w = _draw(gen, 300, k), _draw(gen, hidden, k)
            residual = _draw(gen, 300, hidden)
            want_n, want_r = fused_allreduce_rmsnorm_reference([matmul(x, w, config=INTERPRETER_CONFIG)], residual,
                                                               weight, EPS, DTYPE)
            normed, res = lowering.matmul_reduce_scatter_rmsnorm_cuda(x, w.t(), residual, weight, EPS, group, DTYPE,
                                                                      max_workspace_tokens=1024)
            # Planned under the patched config (a plan of an earlier call of this signature would not be).
            (plan,) = [p for _, p in lowering._PLANS.values() if p.config is tma]
            assert plan.gemm_launcher.meta["STORE_DESC"]
            scatter = cached[0].scatter  # the TMA-stored partial: the plain GEMM's to the bit
            assert torch.equal(scatter.staged(0, 300, scatter.last_slot()), matmul(x, w, config=INTERPRETER_CONFIG))
            torch.testing.assert_close(res, want_r, **RESIDUAL_TOL)
            torch.testing.assert_close(normed, want_n, **NORMED_TOL)
        finally:
            gemm.INTERPRETER_CONFIG = INTERPRETER_CONFIG
        # The plans' key (matmul._planned_call): calls of one shape that differ only in eps or in
        # the residual's presence are planned apart, each right (a plan served to the other is not).
        x, w = _draw(gen, 21, k), _draw(gen, hidden, k)
        residual = _draw(gen, 21, hidden)
        plans = len(lowering._PLANS)
        for eps, res in [(EPS, residual), (0.5, residual), (EPS, None), (EPS, residual)]:
            want_n, want_r = fused_allreduce_rmsnorm_reference([matmul(x, w, config=INTERPRETER_CONFIG)], res, weight,
                                                               eps, DTYPE)
            normed, res_out = lowering.matmul_reduce_scatter_rmsnorm_cuda(x, w.t(), res, weight, eps, group, DTYPE,
                                                                          max_workspace_tokens=1024)
            torch.testing.assert_close(res_out, want_r, **RESIDUAL_TOL)
            torch.testing.assert_close(normed, want_n, **NORMED_TOL)
        assert len(lowering._PLANS) == plans + 3, len(lowering._PLANS) - plans
        assert not lowering._WARNED and not lowering.FALLBACKS, (lowering._WARNED, lowering.FALLBACKS)
        x = _draw(gen, 1100, k)  # past the 1024-token limit: the portable lowering, said once, counted twice
        for _ in range(2):
            lowering.matmul_reduce_scatter_rmsnorm_cuda(x, _draw(gen, hidden, k).t(), None, weight, EPS, group,
                                                        DTYPE, max_workspace_tokens=1024)
        assert len(lowering._WARNED) == 1 and "1024-token limit" in next(iter(lowering._WARNED))
        assert list(lowering.FALLBACKS.values()) == [2] and "1024-token limit" in next(iter(lowering.FALLBACKS))
        dist.destroy_process_group()
    print("matmul_entry: OK")


if __name__ == "__main__":
    {"gemm": case_gemm, "scatter": case_scatter, "reduce": case_reduce, "capture": case_capture,
     "matmul_op": case_matmul_op, "matmul_entry": case_matmul_entry, "scatter_paths": case_scatter_paths,
     "planned": case_planned}[sys.argv[1]]()
