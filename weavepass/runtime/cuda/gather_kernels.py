"""Triton kernels of the gather prologue: the column-parallel GEMM after the norm (QKV, gate_up) that
reads its rows from a local gather buffer the owners push into (host side: ``runtime.cuda.gather``;
design and diagram: docs/gemm_epilogue.md, "The gather prologue").

Owner ``j`` owns the token rows ``[starts[j], starts[j + 1])`` (any counts, zero included). After
its reduce, every owner pushes its rows into the gather buffer of every rank, its own included
(``push_gather_rows_kernel``: remote stores, 16-byte vectors), and releases one flag per (owner, row block)
there. ``gather_gemm_kernel`` computes ``y = rows @ W^T`` over every token, dealing its row tiles own
rows first, then owner ``RANK + 1``, ``RANK + 2``, ... (the order owners finish their reduce after
the same row-parallel GEMM); before a tile's first K step it waits for its row block's flag.

Gather buffer of every rank (dtype of the rows, symmetric)::

    gather[slot in 0..1][part in 0..PARTS-1][capacity rows][HIDDEN]   (part 0: the GEMM's rows;
                                                                      part 1: residual_out, full stream)

Owner ``j``'s rows sit at their token index ``starts[j] + i``. Signal pad of every rank (int32,
symmetric), ``B = ceil(owner capacity / SIGNAL_ROWS)`` row blocks per owner::

    [0] GATHER_SEQ  [1] GEMM_DONE  [2, 3] spare  [4 ..] FLAG[slot][owner][B]  then COUNT[B]
                                                 (the push's chunks of each of its row blocks)

Call ``seq`` (= this rank's GATHER_SEQ + 1, read by both kernels: every rank pushes, then runs its
gather GEMMs, on one stream) uses slot ``seq % 2``:

1. Push on owner ``r``: wait until every rank's GATHER_SEQ >= ``seq - 2`` (its last gather GEMM
   that read this slot is done: the consumed count; acquire at system scope, bounded as
   ``runtime.cuda.peer_wait``, site 10), store row block ``b`` of the owner's rows into every
   rank's slot in chunks spread over CTAs; the CTA that completes the block's chunks (a count in
   the owner's pad) sets ``FLAG[slot][r][b] = seq`` there, release, system scope.
2. Gather GEMM on rank ``p``: per tile, wait until ``FLAG[slot][owner][b] >= seq`` (acquire; site
   11), then the K loop over ``gather[slot][0]``. With several weights (q, k, v) one launch per
   weight, only the last with ``release``: its last CTA sets GATHER_SEQ = ``seq`` (release, system
   scope), which lets the owners overwrite the slot two calls later.

Sequence numbers only grow and are compared with ``>=``: no reset between calls, no host counter,
CUDA-graph replay safe. The tile loop is not flattened: a flattened, software-pipelined loop issues
the next tile's loads while this tile's epilogue runs, which would hoist them above that tile's wait.
"""

from __future__ import annotations

import triton
import triton.language as tl

from weavepass.runtime.cuda.gemm_kernels import _grouped, _halves, _locate_tile, _store_columns, _total_row_tiles
from weavepass.runtime.cuda.kernels import _deadline, _give_up_after

GATHER_SEQ = tl.constexpr(0)
GEMM_DONE = tl.constexpr(1)
PAD_HEADER = tl.constexpr(4)
"""Pad slots before the FLAG table (the layout above)."""


@triton.jit
def _tile_dot(x, w, row0, n0, K, k_tiles, x_rows, b_rows, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, USE_DESC: tl.constexpr, DOT_IN_FP32: tl.constexpr):
    """``x[row0 : row0 + BLOCK_M] @ w[n0 : n0 + BLOCK_N]^T`` in fp32 over every K step: through tensor
    descriptors (TMA; zero past the bounds), or pointers (``x_rows`` / ``b_rows``: int64 row
    indices already clamped into the tensors, K masked). ``DOT_IN_FP32`` (the interpreter with bf16
    only: Triton 3.9's interpreter multiplies bf16 ``tl.dot`` operands as raw integers) widens the
    operands first; fp32 holds bf16 values and their products exactly, so the sum is the same."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    for kt in range(k_tiles):
        if USE_DESC:
            a = x.load([row0, kt * BLOCK_K])
            b = w.load([n0, kt * BLOCK_K])
        else:
            k = kt * BLOCK_K + offs_k
            a = tl.load(x + x_rows[:, None] * K + k[None, :], mask=(k < K)[None, :], other=0.0)
            b = tl.load(w + b_rows[:, None] * K + k[None, :], mask=(k < K)[None, :], other=0.0)
        if DOT_IN_FP32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b.T, acc)
    return acc


@triton.jit
def _fence_async_proxy(token):
    """``fence.proxy.async``: the generic-proxy acquire above is ordered before the TMA (async
    proxy) loads of the rows it guards."""
    tl.inline_asm_elementwise("fence.proxy.async.global;\n\tmov.u32 $0, $1;", "=r,r", [token], dtype=tl.int32,
                              is_pure=False, pack=1)


# Row counts change from call to call: unspecialised, so one compiled kernel serves every split (a
# module loaded while another rank's kernel spins can deadlock; testing.kernel_sim).
@triton.jit(do_not_specialize=["M", "num_blocks", "slot_rows", "release"])
def gather_gemm_kernel(
    x,  # the gather buffer as [2 * PARTS * capacity, K] rows: a tensor descriptor or a pointer (USE_DESC)
    w,  # [N, K] weight, row-major (y = rows @ w^T): a descriptor or a pointer
    y_ptr,  # [M, N] output, token rows
    starts_ptr,  # int32 [WORLD + 1]: owner j owns token rows [starts[j], starts[j + 1])
    pad_ptr,  # int32 this rank's gather pad
    M, N, K,
    num_blocks,  # B: row blocks per owner in the FLAG table
    slot_rows,  # rows of the buffer per slot: PARTS * capacity
    release,  # 1: the last gather GEMM of this call, advance GATHER_SEQ (an argument: one compile serves both)
    watch_addr, timeout_ns,  # the bounded wait (kernels._give_up_after)
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SIGNAL_ROWS: tl.constexpr,  # rows per flag (a multiple of BLOCK_M)
    USE_DESC: tl.constexpr,
    FENCE_PROXY: tl.constexpr,  # USE_DESC on a GPU: order the acquire before the TMA loads
    EPILOGUE_SPLIT: tl.constexpr = 1,  # 1 or 2 column slices per tile's store: fewer live registers
    DOT_IN_FP32: tl.constexpr = False,  # the interpreter with bf16 rows (_tile_dot says why)
):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    num_n_tiles = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    num_tiles = _total_row_tiles(starts_ptr, M, BLOCK_M, WORLD) * num_n_tiles
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    seq = tl.load(pad_ptr + GATHER_SEQ, volatile=True) + 1
    slot = seq % 2
    flags = pad_ptr + PAD_HEADER + slot * WORLD * num_blocks
    deadline = _deadline(timeout_ns)

    for tile in range(pid, num_tiles, num_programs):
        # _locate_tile deals RANK + 1, RANK + 2, ...; from RANK - 1 that is own rows first, then r + 1, ...
        owner, start, count, u, m_tiles = _locate_tile(tile, starts_ptr, M, num_n_tiles, BLOCK_M,
                                                       (RANK + WORLD - 1) % WORLD, WORLD)
        pid_m, pid_n = _grouped(u, m_tiles, num_n_tiles, GROUP_M)
        local = pid_m * BLOCK_M
        if WORLD > 1:
            flag = flags + owner * num_blocks + local // SIGNAL_ROWS
            while tl.atomic_add(flag, 0, sem="acquire", scope="sys") < seq:
                _give_up_after(deadline, watch_addr, timeout_ns, owner, 11, RANK, WORLD)  # site: peer_wait.SITES
            tl.debug_barrier()  # no thread loads the block's rows before the acquire
            if FENCE_PROXY:
                _fence_async_proxy(seq)
        row0 = start + local  # token row of the tile
        n0 = pid_n * BLOCK_N
        # Pointer path: rows past the owner's read its first row instead (results never stored),
        # columns past N read row 0 of w: no mask on those axes keeps the loads vectorised.
        x_rows = (slot * slot_rows + tl.where(local + rows < count, row0 + rows, start)).to(tl.int64)
        b_rows = tl.where(n0 + cols < N, n0 + cols, 0).to(tl.int64)
        acc = _tile_dot(x, w, slot * slot_rows + row0, n0, K, k_tiles, x_rows, b_rows, BLOCK_M, BLOCK_N,
                        BLOCK_K, USE_DESC, DOT_IN_FP32)
        # The tile's rows of the owner only (the next owner's rows may not have arrived): pointer
        # stores, masked (a TMA store clips at the tensor, not at the owner).
        dst_rows = (row0 + rows).to(tl.int64)
        row_ok = local + rows < count
        if EPILOGUE_SPLIT == 1:
            _store_columns(acc, n0, y_ptr, y_ptr, 0, dst_rows, row_ok, row0, N, False, BLOCK_N)
        else:
            left, right = _halves(acc, BLOCK_M, BLOCK_N)
            _store_columns(left, n0, y_ptr, y_ptr, 0, dst_rows, row_ok, row0, N, False, BLOCK_N // 2)
            _store_columns(right, n0 + BLOCK_N // 2, y_ptr, y_ptr, 0, dst_rows, row_ok, row0, N, False, BLOCK_N // 2)

    # the last CTA of the call's last GEMM tells the owners this slot may be pushed into again
    tl.debug_barrier()  # every thread's loads are done before the release
    if release != 0:
        if tl.atomic_add(pad_ptr + GEMM_DONE, 1, sem="acq_rel", scope="gpu") == num_programs - 1:
            tl.atomic_xchg(pad_ptr + GEMM_DONE, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(pad_ptr + GATHER_SEQ, seq, sem="release", scope="sys")


@triton.jit(do_not_specialize=["start", "count", "capacity", "num_blocks"])
def push_gather_rows_kernel(
    rows_ptr,  # [count, HIDDEN] the owner's rows for the GEMM (FlashComm: its normed shard)
    extra_ptr,  # [count, HIDDEN] residual_out rows (PARTS == 2), else unused
    gather_ptr,  # this rank's gather buffer (layout above)
    deltas_ptr,  # int64 [WORLD]: rank j's gather buffer - this rank's, in elements (multiples of 8)
    pad_ptr,  # int32 this rank's gather pad
    pad_deltas_ptr,  # int64 [WORLD]: rank j's gather pad - this rank's, in int32 slots
    start, count,  # the owner's token rows [start, start + count)
    capacity,  # token rows per (slot, part) block of the buffer
    num_blocks,  # B of the FLAG table
    watch_addr, timeout_ns,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    HIDDEN: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ROWS: tl.constexpr,  # rows per store tile (divides CHUNK)
    CHUNK: tl.constexpr,  # rows per program turn (divides SIGNAL_ROWS): a row block spreads over CTAs
    SIGNAL_ROWS: tl.constexpr,
    PARTS: tl.constexpr,
):
    """Chunks of ``CHUNK`` rows of the owner's rows per program turn: wait for every rank's consumed
    count, store the chunk into every rank's slot; the program that completes a row block's chunks
    (``COUNT[b]`` in this rank's pad, acq_rel at system scope after a CTA barrier, as the scatter
    GEMM counts its tiles) resets the count and releases the block's flag in every rank's pad."""
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    r = tl.arange(0, ROWS)
    cols = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK_H), BLOCK_H), BLOCK_H)
    seq = tl.load(pad_ptr + GATHER_SEQ, volatile=True) + 1
    slot = seq % 2
    part = capacity.to(tl.int64) * HIDDEN
    counts = pad_ptr + PAD_HEADER + 2 * WORLD * num_blocks
    deadline = _deadline(timeout_ns)
    for i in tl.static_range(WORLD - 1):  # every peer's gather GEMM of call seq - 2 read this slot
        peer = (RANK + 1 + i) % WORLD
        consumed = pad_ptr + tl.load(pad_deltas_ptr + peer) + GATHER_SEQ
        while tl.atomic_add(consumed, 0, sem="acquire", scope="sys") < seq - 2:
            _give_up_after(deadline, watch_addr, timeout_ns, peer, 10, RANK, WORLD)  # site: peer_wait.SITES
    tl.debug_barrier()  # no thread stores before the acquire
    for chunk in range(pid, tl.cdiv(count, CHUNK), num_programs):
        for t in range(CHUNK // ROWS):
            local = chunk * CHUNK + t * ROWS + r
            mask = (local < count)[:, None] & (cols < HIDDEN)[None, :]
            src = local.to(tl.int64)[:, None] * HIDDEN + cols[None, :]
            dst = gather_ptr + slot * PARTS * part + (start + local).to(tl.int64)[:, None] * HIDDEN + cols[None, :]
            values = tl.load(rows_ptr + src, mask=mask).to(gather_ptr.dtype.element_ty)
            if PARTS == 2:
                extra = tl.load(extra_ptr + src, mask=mask).to(gather_ptr.dtype.element_ty)
            for i in tl.static_range(WORLD):
                delta = tl.multiple_of(tl.load(deltas_ptr + (RANK + i) % WORLD), 8)  # 16-byte vectors
                tl.store(dst + delta, values, mask=mask)
                if PARTS == 2:
                    tl.store(dst + delta + part, extra, mask=mask)
        block = (chunk * CHUNK) // SIGNAL_ROWS
        chunks = tl.cdiv(tl.minimum(count - block * SIGNAL_ROWS, SIGNAL_ROWS), CHUNK)
        tl.debug_barrier()  # every thread's stores of the chunk are done before the count's release
        if tl.atomic_add(counts + block, 1, sem="acq_rel", scope="sys") == chunks - 1:
            tl.atomic_xchg(counts + block, 0, sem="relaxed", scope="gpu")
            for i in tl.static_range(WORLD):
                peer_pad = pad_ptr + tl.load(pad_deltas_ptr + (RANK + i) % WORLD)
                flag = peer_pad + PAD_HEADER + (slot * WORLD + RANK) * num_blocks + block
                tl.atomic_xchg(flag, seq, sem="release", scope="sys")
