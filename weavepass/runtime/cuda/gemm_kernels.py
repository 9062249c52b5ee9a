"""Triton kernels of the row-parallel GEMM with a scatter epilogue (host side: ``runtime.cuda.gemm``;
design: docs/gemm_epilogue.md).

``persistent_gemm_kernel`` computes ``y = x[M, K] @ W[N, K]^T`` (fp32 accumulation, one rounding to
the output dtype) and stores every ``[BLOCK_M, BLOCK_N]`` tile into the staging buffer of the rank
that owns the tile's token rows. Owner ``j`` owns rows ``[starts[j], starts[j + 1])`` of ``x`` (any
counts, zero included); its rows are tiled on their own, so no tile spans two owners. Tiles are dealt
owner by owner, peers first (``RANK + 1, RANK + 2, ...``) and the rank's own rows last, so the remote
stores travel while the GEMM computes its last tiles; inside one owner the tile order is grouped
(``GROUP_M`` row tiles share the ``W`` tiles they read from L2).

Staging of every rank (``dtype(y)``, symmetric)::

    staging[slot in 0..1][src in 0..WORLD-1][capacity rows][N]

Rank ``r`` stores owner ``j``'s rows ``starts[j] + i`` into ``staging_j[slot][r][i]``. The destination
is ``staging_ptr + deltas[owner] + offset``: arithmetic on a table entry, never an ``if`` between two
stores (Triton 3.6 failed to compile that shape in a flattened, warp-specialised loop;
../shared/DEVICE-FACTS.md). Where every owner's staging lies in one allocation (``STORE_DESC`` with
signals or ``WORLD > 1``), the tile leaves through one tensor descriptor over it instead (TMA) and
``deltas[owner]`` is the row of the owner's staging in it. The plain GEMM is the same kernel at
``WORLD == 1`` without signals.

Signal pad of every rank (int32, symmetric), ``B = ceil(capacity / SIGNAL_ROWS)`` row blocks::

    [0] GEMM_SEQ  [1] GEMM_DONE  [2] REDUCE_SEQ  [3] REDUCE_DONE
    [4 ..]                 COUNT[owner][B]     threads x tiles of (owner, row block) stored so far
    [4 + WORLD*B ..]       FLAG[slot][src][B]  the call (seq) whose rows src stored here

Call ``seq`` (= GEMM_SEQ + 1, read in the kernel; every rank makes the same calls) uses slot
``seq % 2``:

1. GEMM on rank ``r``: before storing, wait until every peer's REDUCE_SEQ >= ``seq - 2`` (the peer
   has read this slot's previous rows; system-scope acquire, bounded as ``runtime.cuda.peer_wait``).
   Then one of two signal paths (``DEFER_SIGNALS``):

   * per tile (the first versions'): after each stored tile, every thread of the CTA adds 1 to
     ``COUNT[owner][b]`` (acq_rel, system scope): each releases its own stores, so no CTA barrier
     is needed (with one, Triton 3.6 does not pipeline a flattened tile loop). The thread that
     brings the count to ``THREADS`` x the row block's tile count resets it and writes
     ``FLAG[slot][r][b] = seq`` into the owner's pad with release at system scope (cumulative:
     every other thread's release was acquired through the count's chain of read-modify-writes).
     Each release compiles to a system-scope fence (``MEMBAR.ALL.SYS``) per tile.
   * deferred (``_release_owners``): nothing inside the tile loop; after it, a CTA barrier (and,
     for TMA stores, waiting for them first), then per owner one acq_rel add of the
     CTA's tile count for that owner to ``COUNT[owner][0]``; the add that completes the owner's
     tiles resets it and releases ``FLAG[slot][r][b] = seq`` for every row block ``b`` of the
     owner. Flags fire per owner rather than per row block, but a CTA deals its owners in the
     order peers first, so peers' flags still fire while its own tiles compute.

   The last CTA to finish advances GEMM_SEQ.
2. Reduce on owner ``j``, per tile of ``ROWS`` rows inside row block ``b``: wait until every
   ``FLAG[slot][src][b] >= seq`` (acquire), sum ``staging[slot][src]`` in rank order in fp32, round
   to ``dtype`` (as eager's all_reduce output), add the residual, round (``residual_out``), RMSNorm.
   The last CTA to finish advances REDUCE_SEQ (release: its loads are done before peers overwrite).

Sequence numbers only grow and are compared with ``>=``, so nothing is reset between calls, no host
counter advances, and CUDA-graph replay is safe. Two slots plus the wait of step 1 keep a rank that
runs ahead from overwriting rows an owner has not read yet.
"""

from __future__ import annotations

import triton
import triton.language as tl

from weavepass.runtime.cuda.kernels import _deadline, _give_up_after, _norm_rows

# Globals a kernel reads must be tl.constexpr (Triton refuses plain Python globals); host code
# reads ``.value``.
GEMM_SEQ = tl.constexpr(0)
GEMM_DONE = tl.constexpr(1)
REDUCE_SEQ = tl.constexpr(2)
REDUCE_DONE = tl.constexpr(3)
HEADER_SLOTS = tl.constexpr(4)
"""Pad slots before the COUNT table (the layout above)."""



@triton.jit
def _locate_tile(tile, starts_ptr, M, num_n_tiles, BLOCK_M: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr):
    """Which owner tile ``tile`` belongs to, in the order peers first, own rows last: returns
    ``(owner, first row of the owner in x, its row count, the tile's index among the owner's tiles,
    the owner's row-tile count)``. Branch-free (``tl.where`` over the ``WORLD`` owners). One owner
    (the plain GEMM): arithmetic on ``M`` only, no table load before the tile's first TMA load."""
    if WORLD == 1:
        return tile * 0, tile * 0, M + tile * 0, tile, tl.cdiv(M, BLOCK_M) + tile * 0
    owner = tile * 0
    start = tile * 0
    count = tile * 0
    first = tile * 0
    m_tiles = tile * 0
    base = tile * 0  # row tiles of the owners before this one in the order
    for i in tl.static_range(WORLD):
        o = (RANK + 1 + i) % WORLD
        s = tl.load(starts_ptr + o)
        c = tl.load(starts_ptr + o + 1) - s
        m = tl.cdiv(c, BLOCK_M)
        hit = (tile >= base * num_n_tiles) & (tile < (base + m) * num_n_tiles)
        owner = tl.where(hit, o, owner)
        start = tl.where(hit, s, start)
        count = tl.where(hit, c, count)
        first = tl.where(hit, base * num_n_tiles, first)
        m_tiles = tl.where(hit, m, m_tiles)
        base += m
    return owner, start, count, tile - first, m_tiles


@triton.jit
def _total_row_tiles(starts_ptr, M, BLOCK_M: tl.constexpr, WORLD: tl.constexpr):
    """Row tiles over all owners (each owner's rows tiled on their own)."""
    if WORLD == 1:
        return tl.cdiv(M, BLOCK_M)
    total = tl.load(starts_ptr) * 0
    for o in tl.static_range(WORLD):
        total += tl.cdiv(tl.load(starts_ptr + o + 1) - tl.load(starts_ptr + o), BLOCK_M)
    return total


@triton.jit
def _grouped(u, m_tiles, num_n_tiles, GROUP_M: tl.constexpr):
    """Grouped order of an owner's tiles: ``GROUP_M`` row tiles walk the column tiles together, so
    the ``W`` tiles they read stay in L2. Returns ``(row tile, column tile)`` of local tile ``u``."""
    in_group = GROUP_M * num_n_tiles
    first_m = (u // in_group) * GROUP_M
    size_m = tl.minimum(m_tiles - first_m, GROUP_M)
    return first_m + (u % size_m), (u % in_group) // size_m


@triton.jit
def _store_columns(part, col0, y_desc, staging_ptr, delta, dst_rows, row_ok, desc_row, N,
                   STORE_DESC: tl.constexpr, WIDTH: tl.constexpr):
    """Store ``part`` (``[BLOCK_M, WIDTH]`` fp32, columns ``col0 ..`` of the tile), rounded once:
    through the tensor descriptor ``y_desc`` at row ``desc_row`` (TMA: asynchronous, clipped at the
    tensor's bounds), or through pointers at ``staging_ptr + delta + dst_rows * N``, masked."""
    out = part.to(staging_ptr.dtype.element_ty)
    if STORE_DESC:
        y_desc.store([desc_row, col0], out)
    else:
        cols = col0 + tl.arange(0, WIDTH)
        dst = staging_ptr + delta + dst_rows[:, None] * N + cols[None, :]
        tl.store(dst, out, mask=row_ok[:, None] & (cols < N)[None, :])


@triton.jit
def _halves(acc, ROWS: tl.constexpr, WIDTH: tl.constexpr):
    """Columns ``[0, WIDTH / 2)`` and ``[WIDTH / 2, WIDTH)`` of ``acc`` (``[ROWS, WIDTH]``)."""
    return tl.split(tl.permute(tl.reshape(acc, (ROWS, 2, WIDTH // 2)), (0, 2, 1)))


@triton.jit
def _tiles_below(n, pid, num_programs):
    """How many of this CTA's tiles ``pid, pid + num_programs, ...`` are below ``n``."""
    return tl.maximum(n - pid + num_programs - 1, 0) // num_programs


@triton.jit
def _fence(ASYNC_STORES: tl.constexpr):
    """A system-scope fence (``fence.acq_rel.sys``); with ``ASYNC_STORES`` first the wait for this
    thread's bulk (TMA) stores to complete and the proxy fence that orders them before what follows."""
    if ASYNC_STORES:
        tl.inline_asm_elementwise("cp.async.bulk.wait_group 0;\n\tfence.proxy.async.global;\n\t"
                                  "fence.acq_rel.sys;\n\tmov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False,
                                  pack=1)
    else:
        tl.inline_asm_elementwise("fence.acq_rel.sys;\n\tmov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def _release_owners(pid, num_programs, starts_ptr, counts, flags, pad_deltas_ptr, slot, seq, num_n_tiles, num_blocks,
                    BLOCK_M: tl.constexpr, SIGNAL_ROWS: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr,
                    ASYNC_STORES: tl.constexpr, GPU_FENCES: tl.constexpr):
    """Deferred signals (``DEFER_SIGNALS``), after the CTA's tile loop: for each owner whose tiles
    this CTA stored (its tiles of an owner are a stride-``num_programs`` subset of the owner's
    contiguous range in the order, so counted by arithmetic), one acq_rel add of that many tiles to
    ``COUNT[owner][0]`` at system scope, after a CTA barrier (one release covers every thread's
    stores). The add that completes the owner's tiles (every CTA's) resets the count and releases
    ``FLAG[slot][RANK][b] = seq`` for every row block ``b`` of the owner's rows, as the per-tile path
    does block by block. One system-scope fence per (CTA, owner) instead of one per tile. On a GPU
    (``GPU_FENCES``) the flags are one fence then relaxed stores (each a release pattern with that
    fence), not a release each (a ``MEMBAR.ALL.SYS`` per row block); TMA stores (``ASYNC_STORES``)
    are waited for first. The interpreter runs the releases as written."""
    if GPU_FENCES and ASYNC_STORES:  # TMA stores are asynchronous: complete them before the barrier
        _fence(True)
    tl.debug_barrier()  # every thread's stores of this CTA are done before the releases below
    base = pid * 0  # row tiles of the owners before this one in the order
    for i in tl.static_range(WORLD):
        o = (RANK + 1 + i) % WORLD
        c = tl.load(starts_ptr + o + 1) - tl.load(starts_ptr + o)
        m = tl.cdiv(c, BLOCK_M)
        mine = (_tiles_below((base + m) * num_n_tiles, pid, num_programs)
                - _tiles_below(base * num_n_tiles, pid, num_programs))
        if mine > 0:
            counter = counts + o * num_blocks
            if tl.atomic_add(counter, mine, sem="acq_rel", scope="sys") == m * num_n_tiles - mine:
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
                flag = flags + tl.load(pad_deltas_ptr + o) + (slot * WORLD + RANK) * num_blocks
                if GPU_FENCES:
                    _fence(False)  # cumulative: orders every store the count's chain acquired before the flags
                    for b in range(tl.cdiv(c, SIGNAL_ROWS)):
                        tl.atomic_xchg(flag + b, seq, sem="relaxed", scope="sys")
                else:
                    for b in range(tl.cdiv(c, SIGNAL_ROWS)):
                        tl.atomic_xchg(flag + b, seq, sem="release", scope="sys")
        base += m


# Row counts change from call to call; specialising on them (value 1, multiples of 16) would compile
# a kernel per split, and a module loaded while another rank's kernel spins can deadlock
# (testing.kernel_sim). N, K and HIDDEN stay specialised: they keep the loads and stores vectorised.
@triton.jit(do_not_specialize=["M", "capacity", "num_blocks"])
def persistent_gemm_kernel(
    x,  # [M, K] activations: a tensor descriptor (block [BLOCK_M, BLOCK_K]) or a pointer (USE_DESC)
    w,  # [N, K] weight, row-major (y = x @ w^T): a descriptor (block [BLOCK_N, BLOCK_K]) or a pointer
    staging_ptr,  # this rank's staging buffer (dtype of y); the plain GEMM: y itself
    y_desc,  # STORE_DESC: y as a tensor descriptor (block [BLOCK_M, BLOCK_N // EPILOGUE_SPLIT]); else unused
    starts_ptr,  # int32 [WORLD + 1]: owner j owns rows [starts[j], starts[j + 1]) of x
    deltas_ptr,  # int64 [WORLD]: owner j's staging address - this rank's, in elements
    pad_ptr,  # int32 this rank's signal pad (unused without HAS_SIGNALS)
    pad_deltas_ptr,  # int64 [WORLD]: owner j's pad address - this rank's, in int32 slots
    M, N, K,
    capacity,  # rows per (slot, src) block of a staging buffer
    num_blocks,  # B: signal row blocks per (slot, src) block, ceil(capacity / SIGNAL_ROWS)
    watch_addr, timeout_ns,  # the bounded wait (kernels._give_up_after), 0: no record / for ever
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SIGNAL_ROWS: tl.constexpr,  # rows per signal (a multiple of BLOCK_M)
    USE_DESC: tl.constexpr,  # x and w are tensor descriptors (TMA loads; zero padding out of bounds)
    HAS_SIGNALS: tl.constexpr,  # the scatter protocol (module docstring); False: plain stores only
    FLATTEN: tl.constexpr = False,  # one pipelined loop over tiles and K steps
    WARP_SPECIALIZE: tl.constexpr = False,  # producer / consumer warps (Triton's warp specialisation)
    STORE_DESC: tl.constexpr = False,  # the plain GEMM's tiles leave through y_desc (TMA stores)
    EPILOGUE_SPLIT: tl.constexpr = 1,  # 1, 2 or 4 column slices per tile's store: less shared memory
    # and fewer live registers in the epilogue, so more pipeline stages fit (Triton's persistent tutorial)
    THREADS: tl.constexpr = 128,  # num_warps * 32: one signal lane per thread (HAS_SIGNALS)
    DEFER_SIGNALS: tl.constexpr = False,  # HAS_SIGNALS: one release per (CTA, owner) after the tile loop
    # (_release_owners) instead of one per tile
    GPU_FENCES: tl.constexpr = False,  # compiled for a GPU (not the interpreter): DEFER_SIGNALS issues its
    # fences as PTX (_release_owners)
):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    num_n_tiles = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    num_tiles = _total_row_tiles(starts_ptr, M, BLOCK_M, WORLD) * num_n_tiles
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)

    seq = num_tiles * 0
    if HAS_SIGNALS:
        seq = tl.load(pad_ptr + GEMM_SEQ, volatile=True) + 1  # the previous call finished on this stream
        deadline = _deadline(timeout_ns)
        for i in tl.static_range(WORLD - 1):  # every peer has read this slot's previous rows
            o = (RANK + 1 + i) % WORLD
            peer_reduced = pad_ptr + tl.load(pad_deltas_ptr + o) + REDUCE_SEQ
            while tl.atomic_add(peer_reduced, 0, sem="acquire", scope="sys") < seq - 2:
                _give_up_after(deadline, watch_addr, timeout_ns, o, 7, RANK, WORLD)  # site: peer_wait.SITES
        tl.debug_barrier()  # no thread stores before the acquire
    slot = seq % 2
    counts = pad_ptr + HEADER_SLOTS
    flags = pad_ptr + HEADER_SLOTS + WORLD * num_blocks

    for tile in tl.range(pid, num_tiles, num_programs, flatten=FLATTEN, warp_specialize=WARP_SPECIALIZE):
        owner, start, count, u, m_tiles = _locate_tile(tile, starts_ptr, M, num_n_tiles, BLOCK_M, RANK, WORLD)
        pid_m, pid_n = _grouped(u, m_tiles, num_n_tiles, GROUP_M)
        row0 = start + pid_m * BLOCK_M  # first row of the tile in x
        n0 = pid_n * BLOCK_N

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if USE_DESC:
            for kt in range(k_tiles):
                a = x.load([row0, kt * BLOCK_K])
                b = w.load([n0, kt * BLOCK_K])
                acc = tl.dot(a, b.T, acc)
        else:
            # Rows past M and columns past N read row 0 instead (results never stored): no mask
            # on the M/N axes keeps the loads vectorised.
            a_rows = tl.where(row0 + rows < M, row0 + rows, 0).to(tl.int64)
            b_rows = tl.where(n0 + cols < N, n0 + cols, 0).to(tl.int64)
            for kt in range(k_tiles):
                k = kt * BLOCK_K + offs_k
                a = tl.load(x + a_rows[:, None] * K + k[None, :], mask=(k < K)[None, :], other=0.0)
                b = tl.load(w + b_rows[:, None] * K + k[None, :], mask=(k < K)[None, :], other=0.0)
                acc = tl.dot(a, b.T, acc)

        # Epilogue: the tile into owner's staging[slot][RANK], rows local to the owner (the plain
        # GEMM with STORE_DESC: into y at row0 through the descriptor).
        local = pid_m * BLOCK_M + rows
        dst_rows = ((slot * WORLD + RANK) * capacity + local).to(tl.int64)
        row_ok = local < count
        if STORE_DESC:
            delta = 0
            if WORLD > 1 or HAS_SIGNALS:  # the scatter: deltas[owner] is the row of owner's staging in y_desc
                row0 = (tl.load(deltas_ptr + owner) + (slot * WORLD + RANK) * capacity + pid_m * BLOCK_M).to(tl.int32)
        else:
            delta = tl.multiple_of(tl.load(deltas_ptr + owner), 16)  # (host-checked) keeps the stores vectorised
        if EPILOGUE_SPLIT == 1:
            _store_columns(acc, n0, y_desc, staging_ptr, delta, dst_rows, row_ok, row0, N, STORE_DESC, BLOCK_N)
        else:
            left, right = _halves(acc, BLOCK_M, BLOCK_N)
            if EPILOGUE_SPLIT == 2:
                _store_columns(left, n0, y_desc, staging_ptr, delta, dst_rows, row_ok, row0, N, STORE_DESC,
                               BLOCK_N // 2)
                _store_columns(right, n0 + BLOCK_N // 2, y_desc, staging_ptr, delta, dst_rows, row_ok, row0, N,
                               STORE_DESC, BLOCK_N // 2)
            else:  # 4: each half in two (the interpreter needs the widths as constexpr expressions)
                a, b = _halves(left, BLOCK_M, BLOCK_N // 2)
                _store_columns(a, n0, y_desc, staging_ptr, delta, dst_rows, row_ok, row0, N, STORE_DESC,
                               BLOCK_N // 4)
                _store_columns(b, n0 + BLOCK_N // 4, y_desc, staging_ptr, delta, dst_rows, row_ok, row0, N,
                               STORE_DESC, BLOCK_N // 4)
                c, d = _halves(right, BLOCK_M, BLOCK_N // 2)
                _store_columns(c, n0 + BLOCK_N // 2, y_desc, staging_ptr, delta, dst_rows, row_ok, row0, N,
                               STORE_DESC, BLOCK_N // 4)
                _store_columns(d, n0 + 3 * (BLOCK_N // 4), y_desc, staging_ptr, delta, dst_rows, row_ok, row0, N,
                               STORE_DESC, BLOCK_N // 4)

        if HAS_SIGNALS and not DEFER_SIGNALS:
            block = (pid_m * BLOCK_M) // SIGNAL_ROWS
            block_rows = tl.minimum(count - block * SIGNAL_ROWS, SIGNAL_ROWS)
            target = tl.cdiv(block_rows, BLOCK_M) * num_n_tiles * THREADS
            # One lane per thread (a [THREADS] tensor is one element per thread): each thread's
            # acq_rel add releases its own stores above, so no CTA barrier, which would stop Triton
            # 3.6 pipelining a flattened loop. Masked atomics rather than an `if`: 3.6 fails to
            # compile an scf.if there (DEVICE-FACTS).
            lane0 = tl.arange(0, THREADS) * 0
            counter = counts + owner * num_blocks + block + lane0
            flag = flags + tl.load(pad_deltas_ptr + owner) + (slot * WORLD + RANK) * num_blocks + block + lane0
            done = tl.atomic_add(counter, lane0 + 1, sem="acq_rel", scope="sys") == target - 1
            tl.atomic_xchg(counter, lane0, mask=done, sem="relaxed", scope="gpu")
            tl.atomic_xchg(flag, lane0 + seq, mask=done, sem="release", scope="sys")

    if HAS_SIGNALS and DEFER_SIGNALS:
        _release_owners(pid, num_programs, starts_ptr, counts, flags, pad_deltas_ptr, slot, seq, num_n_tiles,
                        num_blocks, BLOCK_M, SIGNAL_ROWS, RANK, WORLD, STORE_DESC, GPU_FENCES)
    if HAS_SIGNALS:  # the last CTA to finish advances this rank's call count
        tl.debug_barrier()
        if tl.atomic_add(pad_ptr + GEMM_DONE, 1, sem="acq_rel", scope="gpu") == num_programs - 1:
            tl.atomic_xchg(pad_ptr + GEMM_DONE, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(pad_ptr + GEMM_SEQ, seq, sem="relaxed", scope="gpu")


@triton.jit(do_not_specialize=["count", "capacity", "num_blocks"])
def reduce_scattered_rows_kernel(
    staging_ptr,  # this rank's staging buffer (persistent_gemm_kernel's layout)
    pad_ptr,  # int32 this rank's signal pad
    residual_ptr,  # [count, HIDDEN] residual of this rank's rows (unused without HAS_RESIDUAL)
    weight_ptr,  # [HIDDEN] RMSNorm weight
    normed_ptr,  # [count, HIDDEN] output, out_dtype
    residual_out_ptr,  # [count, HIDDEN] output, dtype of the staging
    count,  # rows this rank owns
    capacity,  # rows per (slot, src) block of the staging
    num_blocks,  # signal row blocks per (slot, src) block
    watch_addr, timeout_ns,  # the bounded wait (kernels._give_up_after)
    eps,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    HIDDEN: tl.constexpr,
    BLOCK_H: tl.constexpr,  # next power of two >= HIDDEN
    ROWS: tl.constexpr,  # rows per tile (divides SIGNAL_ROWS)
    SIGNAL_ROWS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    """The owner's half: for each tile of its rows, wait for the row block's signals of every source,
    then ``residual_out = round(round(sum_src P_src) + R)``, ``normed = RMSNorm(residual_out) * w``
    (``runtime.reference``'s math; the sum in rank order in fp32, so every owner rounds as the
    fused op's kernels do). Any grid: no program meets another rank's program."""
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    rows = tl.arange(0, ROWS)
    cols = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK_H), BLOCK_H), BLOCK_H)
    col_mask = cols < HIDDEN
    seq = tl.load(pad_ptr + REDUCE_SEQ, volatile=True) + 1
    slot = seq % 2
    flags = pad_ptr + HEADER_SLOTS + WORLD * num_blocks + slot * WORLD * num_blocks
    w = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    for tile in range(pid, tl.cdiv(count, ROWS), num_programs):
        block = (tile * ROWS) // SIGNAL_ROWS
        deadline = _deadline(timeout_ns)
        for src in tl.static_range(WORLD):
            while tl.atomic_add(flags + src * num_blocks + block, 0, sem="acquire", scope="sys") < seq:
                _give_up_after(deadline, watch_addr, timeout_ns, src, 8, RANK, WORLD)  # site: peer_wait.SITES
        tl.debug_barrier()  # no thread reads staged rows before the acquire
        local = tile * ROWS + rows
        mask = (local < count)[:, None] & col_mask[None, :]
        acc = tl.zeros([ROWS, BLOCK_H], dtype=tl.float32)
        for src in tl.static_range(WORLD):  # rank order: every owner rounds the same sum
            staged = ((slot * WORLD + src) * capacity + local).to(tl.int64)[:, None] * HIDDEN + cols[None, :]
            acc += tl.load(staging_ptr + staged, mask=mask, other=0.0).to(tl.float32)
        offs = local.to(tl.int64)[:, None] * HIDDEN + cols[None, :]
        if HAS_RESIDUAL:  # S rounded to dtype(P) before the add (kernels._reduce_rows)
            acc = acc.to(residual_out_ptr.dtype.element_ty).to(tl.float32)
            acc += tl.load(residual_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        res = acc.to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + offs, res, mask=mask)
        _norm_rows(res, w, w, eps, normed_ptr, normed_ptr, offs, local, mask, normed_ptr, normed_ptr, normed_ptr,
                   normed_ptr, HIDDEN, BLOCK_H, ROWS, False, 0, 0)  # (no quantized epilogue)

    # the last program to finish tells the peers this call's slot may be written again
    tl.debug_barrier()  # every thread's staging loads are done before the release
    if tl.atomic_add(pad_ptr + REDUCE_DONE, 1, sem="acq_rel", scope="sys") == num_programs - 1:
        tl.atomic_xchg(pad_ptr + REDUCE_DONE, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(pad_ptr + REDUCE_SEQ, seq, sem="release", scope="sys")


# -- The gather of the owners' rows (the full residual stream; ``runtime.cuda.matmul``)
#
# Gather buffer of every rank (dtype of the rows, symmetric): ``[slot in 0..1][2][capacity][HIDDEN]``
# (normed rows, then residual_out rows, at their token index). Its own pad (int32, symmetric):
#
#     [0] GATHER_SEQ  [1] GATHER_PUSHED  [2] GATHER_DONE  [3] (spare)  [4 ..] FLAG[slot][src]
#
# Call ``seq`` (= GATHER_SEQ + 1) uses slot ``seq % 2``. ``push_rows_kernel`` stores the owner's rows
# into every peer's slot, and its last CTA releases ``FLAG[slot][RANK] = seq`` there;
# ``collect_rows_kernel`` waits for every peer's flag, copies their rows into the outputs and its last
# CTA advances GATHER_SEQ. No acknowledgement is needed before a push: a rank that pushes call ``seq``
# into a peer's slot has collected call ``seq - 1``, so it saw the peer's push of ``seq - 1``, which
# the peer's stream runs after its collect of ``seq - 2``, the last reader of that slot.
GATHER_SEQ = tl.constexpr(0)
GATHER_PUSHED = tl.constexpr(1)
GATHER_DONE = tl.constexpr(2)
GATHER_HEADER = tl.constexpr(4)
"""Pad slots of the gather before its FLAG table."""


@triton.jit(do_not_specialize=["start", "count", "capacity"])
def push_rows_kernel(
    normed_ptr,  # [T, HIDDEN] this rank's output; its rows [start, start + count) are written
    residual_out_ptr,  # [T, HIDDEN] the same for residual_out (dtype of the gather buffer)
    gather_ptr,  # this rank's gather buffer (layout above)
    deltas_ptr,  # int64 [WORLD]: rank j's gather buffer - this rank's, in elements
    pad_ptr,  # int32 this rank's gather pad
    pad_deltas_ptr,  # int64 [WORLD]: rank j's gather pad - this rank's, in int32 slots
    start, count,  # this rank's rows
    capacity,  # tokens per (slot, output) block of the gather buffer
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    HIDDEN: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ROWS: tl.constexpr,
):
    """The owner's rows of both outputs into every peer's gather slot, then (last CTA) the flags."""
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    rows = tl.arange(0, ROWS)
    cols = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK_H), BLOCK_H), BLOCK_H)
    seq = tl.load(pad_ptr + GATHER_SEQ, volatile=True) + 1
    slot = seq % 2
    block = capacity.to(tl.int64) * HIDDEN
    for tile in range(pid, tl.cdiv(count, ROWS), num_programs):
        token = (start + tile * ROWS + rows).to(tl.int64)
        mask = (tile * ROWS + rows < count)[:, None] & (cols < HIDDEN)[None, :]
        offs = token[:, None] * HIDDEN + cols[None, :]
        normed = tl.load(normed_ptr + offs, mask=mask)
        res = tl.load(residual_out_ptr + offs, mask=mask)
        dst = gather_ptr + 2 * slot * block + offs
        for i in tl.static_range(WORLD - 1):
            peer = tl.load(deltas_ptr + (RANK + 1 + i) % WORLD)
            tl.store(dst + peer, normed.to(gather_ptr.dtype.element_ty), mask=mask)
            tl.store(dst + peer + block, res, mask=mask)
    tl.debug_barrier()  # every thread's stores are done before the release below
    if tl.atomic_add(pad_ptr + GATHER_PUSHED, 1, sem="acq_rel", scope="sys") == num_programs - 1:
        tl.atomic_xchg(pad_ptr + GATHER_PUSHED, 0, sem="relaxed", scope="gpu")
        for i in tl.static_range(WORLD - 1):
            peer_pad = pad_ptr + tl.load(pad_deltas_ptr + (RANK + 1 + i) % WORLD)
            tl.atomic_xchg(peer_pad + GATHER_HEADER + slot * WORLD + RANK, seq, sem="release", scope="sys")


@triton.jit(do_not_specialize=["start", "count", "num_tokens", "capacity"])
def collect_rows_kernel(
    normed_ptr,  # [T, HIDDEN] this rank's outputs: every row but its own [start, start + count)
    residual_out_ptr,
    gather_ptr,  # this rank's gather buffer
    pad_ptr,  # int32 this rank's gather pad
    start, count, num_tokens, capacity,
    watch_addr, timeout_ns,  # the bounded wait (kernels._give_up_after)
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    HIDDEN: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ROWS: tl.constexpr,
):
    """Wait for every peer's push of this call (acquire), copy their rows into the outputs; the last
    CTA advances GATHER_SEQ (the next call's slot)."""
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    rows = tl.arange(0, ROWS)
    cols = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK_H), BLOCK_H), BLOCK_H)
    seq = tl.load(pad_ptr + GATHER_SEQ, volatile=True) + 1
    slot = seq % 2
    block = capacity.to(tl.int64) * HIDDEN
    deadline = _deadline(timeout_ns)
    for i in tl.static_range(WORLD - 1):
        peer = (RANK + 1 + i) % WORLD
        while tl.atomic_add(pad_ptr + GATHER_HEADER + slot * WORLD + peer, 0, sem="acquire", scope="sys") < seq:
            _give_up_after(deadline, watch_addr, timeout_ns, peer, 9, RANK, WORLD)  # site: peer_wait.SITES
    tl.debug_barrier()  # no thread reads gathered rows before the acquire
    for tile in range(pid, tl.cdiv(num_tokens, ROWS), num_programs):
        token = tile * ROWS + rows
        theirs = (token < num_tokens) & ((token < start) | (token >= start + count))
        mask = theirs[:, None] & (cols < HIDDEN)[None, :]
        offs = token.to(tl.int64)[:, None] * HIDDEN + cols[None, :]
        gathered = gather_ptr + 2 * slot * block + offs
        tl.store(normed_ptr + offs, tl.load(gathered, mask=mask).to(normed_ptr.dtype.element_ty), mask=mask)
        tl.store(residual_out_ptr + offs, tl.load(gathered + block, mask=mask), mask=mask)
    tl.debug_barrier()  # every thread's loads are done before the next call may be pushed
    if tl.atomic_add(pad_ptr + GATHER_DONE, 1, sem="acq_rel", scope="gpu") == num_programs - 1:
        tl.atomic_xchg(pad_ptr + GATHER_DONE, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(pad_ptr + GATHER_SEQ, seq, sem="relaxed", scope="gpu")
