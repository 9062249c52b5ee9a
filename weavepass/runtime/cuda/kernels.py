"""Triton kernels of the ``cuda_symm`` lowering of ``weave.fused_allreduce_rmsnorm``.

Pure ``@triton.jit`` code: the host side is in this package's ``support``, ``launch_plan``,
``workspace`` and ``dispatch`` modules.

Every rank launches the same grid of ``G`` programs (CTAs) over a symmetric workspace::

    workspace (per rank, symmetric) = staging [WORLD, slot_rows, HIDDEN] | recv [T, HIDDEN]   (dtype of P)

Two-shot (``ONE_SHOT=False``): rank ``j`` owns token shard ``j`` (rows ``[j*S, min((j+1)*S, T))``,
``S = ceil(T / WORLD)``).

1. push: rank ``r`` stores its partial rows of shard ``j`` into rank ``j``'s ``staging[r]``.
2. barrier (channel 0).
3. reduce: rank ``j`` sums ``staging[s]`` (its own partial for ``s == j``) in rank order in fp32, adds the
   residual, rounds to ``dtype(P)`` (``residual_out``), writes it locally and *pushes* it into every
   peer's ``recv``; then normalises the rounded rows into ``normed``.
4. barrier (channel 1).
5. finalise: rank ``r`` copies the peers' shards from its local ``recv`` into ``residual_out`` and
   normalises them into ``normed``: only ``residual_out`` travels, ``normed`` is recomputed, so the link
   carries exactly an all-reduce's bytes.

One-shot (``ONE_SHOT=True``): every rank owns every row; step 1 pushes all rows to every peer, step 3
reduces all rows locally, step 5 does not exist. The barrier of step 4 stays: it keeps the next call
from overwriting a peer's staging rows that the peer is still reading.

All remote traffic is stores (NVLink stores need few SMs; remote loads need many requests in flight).
Pipelined two-shot (``fused_allreduce_rmsnorm_pipelined_kernel``): the same three steps per chunk of
``CHUNK_ROWS`` rows instead of per phase, with per-chunk counters (signal pad channels 2 and 3) instead
of the two barriers, so the remote stores of one chunk drain while the local loads of the next run;
see its docstring. Counters are incremented with ``red.release.sys`` by the sender after a CTA barrier,
polled with ``ld.acquire.sys`` by the receiver, and decremented by the receiver after its last wait.

Both barriers are per program: program ``b`` on rank ``r`` only meets program ``b`` on its peers. That
suffices because row tiles are dealt to programs by the same rule on every rank (tile ``t`` goes to
program ``t % G``), so the rows that program ``b`` reads after a barrier were written by programs ``b``
of the peers before it. Signal slots reset themselves (the waiter swaps 1 -> 0), so no host state
advances between calls and CUDA-graph replay is safe.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _select(i: tl.constexpr, v0, v1, v2, v3, v4, v5, v6, v7):
    """``(v0, ..., v7)[i]`` for a compile-time ``i`` (kernels take the per-peer values as scalars so
    that Triton's 16-divisibility specialisation of integer arguments keeps the stores vectorised)."""
    r = v0
    if i == 1:
        r = v1
    if i == 2:
        r = v2
    if i == 3:
        r = v3
    if i == 4:
        r = v4
    if i == 5:
        r = v5
    if i == 6:
        r = v6
    if i == 7:
        r = v7
    return r


# ------------------------------------------------------------------ bounded waits (runtime.cuda.peer_wait)


@triton.jit
def _globaltimer(x):
    """The GPU's nanosecond clock (``%globaltimer``); ``x`` (any int64) only gives the asm an operand."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,l", [x], dtype=tl.int64, is_pure=False,
                                     pack=1)


@triton.jit
def _deadline(timeout_ns):
    """When a wait that starts now gives up: ``%globaltimer + timeout_ns``; 0 (never) for a timeout of 0."""
    t = timeout_ns.to(tl.int64)
    deadline = t * 0
    if t > 0:
        deadline = _globaltimer(t) + t
    return deadline


@triton.jit
def _give_up_after(deadline, watch_addr, timeout_ns, peer, SITE: tl.constexpr, RANK: tl.constexpr,
                   WORLD: tl.constexpr):
    """Called once per turn of every spin loop: past ``deadline`` (not 0), write who waited for whom
    and where into the pinned host record at ``watch_addr`` (``peer_wait.RECORD_SLOTS`` int32; none at
    0), make it visible system-wide and ``trap``: the kernel ends and the CUDA context fails, so the
    host's next CUDA call raises instead of the GPU spinning for ever (``runtime.cuda.peer_wait``)."""
    if deadline > 0:
        if _globaltimer(deadline) > deadline:
            addr = watch_addr.to(tl.int64)
            if addr != 0:
                # The record's stores, the system-scope fence and the trap in one asm block, so that
                # nothing can reorder a store past the trap (which ends the kernel).
                seconds = (timeout_ns.to(tl.int64) // 1000000000).to(tl.int32)
                tl.inline_asm_elementwise(
                    "st.volatile.u32 [$1+4], $2;\n\tst.volatile.u32 [$1+8], $3;\n\t"
                    "st.volatile.u32 [$1+12], $4;\n\tst.volatile.u32 [$1+16], $5;\n\t"
                    "st.volatile.u32 [$1+20], $6;\n\tst.volatile.u32 [$1], 1;\n\t"
                    "fence.sc.sys;\n\ttrap;\n\tmov.u64 $0, $1;",
                    "=l,l,r,r,r,r,r",
                    [addr, tl.full([], RANK, tl.int32), tl.full([], peer, tl.int32), tl.full([], SITE, tl.int32),
                     tl.full([], WORLD, tl.int32), seconds],
                    dtype=tl.int64, is_pure=False, pack=1)
            else:
                tl.inline_asm_elementwise("trap;\n\tmov.u64 $0, $1;", "=l,l", [deadline], dtype=tl.int64,
                                          is_pure=False, pack=1)


@triton.jit
def _block_barrier(
    pad_ptr,  # int32*: this rank's signal pad
    pd0, pd1, pd2, pd3, pd4, pd5, pd6, pd7,  # peer pad address - local pad address, in int32 slots
    channel: tl.constexpr,  # which of the two barriers of a call
    watch_addr, timeout_ns,  # the bounded wait (_give_up_after)
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    MAX_CTAS: tl.constexpr,
):
    """Program ``b`` of this rank meets program ``b`` of every peer.

    Slot ``[channel, b, src]`` of rank ``dst``'s pad is 1 while ``src``'s signal waits to be consumed.
    Send: CAS 0 -> 1 with release at system scope (orders this program's earlier stores, made visible to
    the CAS thread by the CTA barrier, before the flag). Wait: CAS 1 -> 0 with acquire at system scope,
    which also resets the slot for the next barrier on it.
    """
    tl.debug_barrier()  # every thread's stores are issued before the release
    base = (channel * MAX_CTAS + tl.program_id(0)) * WORLD
    deadline = _deadline(timeout_ns)
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            remote = pad_ptr + _select(peer, pd0, pd1, pd2, pd3, pd4, pd5, pd6, pd7) + base + RANK
            while tl.atomic_cas(remote, 0, 1, sem="release", scope="sys") != 0:
                _give_up_after(deadline, watch_addr, timeout_ns, peer, 1, RANK, WORLD)
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            while tl.atomic_cas(pad_ptr + base + peer, 1, 0, sem="acquire", scope="sys") != 1:
                _give_up_after(deadline, watch_addr, timeout_ns, peer, 2, RANK, WORLD)
    tl.debug_barrier()  # no thread reads peer data before the acquire


@triton.jit
def _norm_rows(
    res,  # [ROWS, BLOCK_H] residual_out rows in dtype(P), padding zero
    w,  # [BLOCK_H] fp32 weight
    b,  # [BLOCK_H] fp32 bias (LayerNorm; zeros without one)
    eps, normed_ptr, inv_rms_ptr, offs,
    row,  # [ROWS] row indices in [T]
    mask,
    codes_ptr, scales_ptr, static_scale_ptr, qconst_ptr,  # the quantized epilogue (_quantize_rows)
    HIDDEN: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ROWS: tl.constexpr,
    HAS_INV_RMS: tl.constexpr,
    NORM: tl.constexpr,  # 0: RMSNorm, 1: LayerNorm
    QUANT: tl.constexpr,  # 0: none, else the packed quantization (runtime.cuda.quant_epilogue)
):
    """RMSNorm: ``normed = x * rsqrt(mean(x^2) + eps) * w`` over the last dim of ``x = fp32(res)``;
    LayerNorm: ``d = x - mean(x)``, ``normed = d * rsqrt(mean(d^2) + eps) * w + b`` (biased variance,
    ``reference.add_layernorm_local``'s order). Stored in the output's dtype; with ``HAS_INV_RMS``
    also the per-row ``rsqrt(mean(x^2) + eps)`` (fp32; what a training graph saves for backward).
    With ``QUANT`` the rounded normed rows are also quantized (``_quantize_rows``), and stored
    only if something else reads them."""
    x = res.to(tl.float32)
    if NORM == 1:
        x = tl.where(mask, x - (tl.sum(x, axis=1) / HIDDEN)[:, None], 0.0)  # padding stays 0
    inv_rms = tl.math.rsqrt(tl.sum(x * x, axis=1) / HIDDEN + eps)
    y = x * inv_rms[:, None] * w[None, :]
    if NORM == 1:
        y = y + b[None, :]
    normed = y.to(normed_ptr.dtype.element_ty)
    if QUANT == 0 or (QUANT >> 2) & 1 == 1:
        tl.store(normed_ptr + offs, normed, mask=mask)
    if HAS_INV_RMS:
        tl.store(inv_rms_ptr + row, inv_rms, mask=tl.max(mask.to(tl.int32), axis=1) > 0)
    if QUANT != 0:
        _quantize_rows(normed.to(tl.float32), row, offs, mask, codes_ptr, scales_ptr, static_scale_ptr, qconst_ptr,
                       HIDDEN, BLOCK_H, ROWS, QUANT)


@triton.jit
def _scale_steps(a, qconst_ptr, OPS: tl.constexpr):
    """The dynamic scale's steps after the amax (``quant_epilogue.SCALE_*``; up to six, a nibble
    each, op ``i``'s constant at ``qconst[i]``), on fp32 values that hold the step's dtype."""
    for i in tl.static_range(6):
        if (OPS >> (4 * i)) & 15 == 1:  # * c (a division by c is * fp32(1 / c), as ATen's CUDA division by a scalar)
            a = a * tl.load(qconst_ptr + i)
        if (OPS >> (4 * i)) & 15 == 2:
            a = tl.maximum(a, tl.load(qconst_ptr + i))
        if (OPS >> (4 * i)) & 15 == 3:
            a = tl.minimum(a, tl.load(qconst_ptr + i))
        if (OPS >> (4 * i)) & 15 == 4:  # the step's result in a bf16 tensor
            a = _round_to_bf16(a)
        if (OPS >> (4 * i)) & 15 == 5:
            a = a.to(tl.float16).to(tl.float32)
    return a


@triton.jit
def _round_to_bf16(x):
    """fp32 ``x`` rounded to the nearest bf16 value, ties to even, still in fp32 (what the GPU's
    cvt.rn.bf16.f32 gives; Triton's interpreter truncates, so the rounding is written out)."""
    bits = x.to(tl.int32, bitcast=True)
    return ((bits + 32767 + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _code_steps(x, s, r, sk, neg_r, neg_k, qconst_ptr, OPS: tl.constexpr, ARITH: tl.constexpr):
    """The codes of ``x`` (fp32) with scale ``s`` (fp32) and its ``_scale_reciprocals`` (each
    taken per scale, then broadcast to ``x``): the division first
    (``quant_epilogue.CODE_*``, a nibble each, op ``i``'s constant at ``qconst[8 + i]``), then
    round / clamps in fp32, then the cast to the code dtype (the last op). ``ARITH``
    (``quant_epilogue.ARITH_*``): bit 0 divides through one reciprocal per scale
    (``_divide_rn``), else ``div.rn`` per element; bit 1 casts to fp8 with the GPU's own
    ``cvt.rn.satfinite``, else rounds in software first (``_round_to_e4m3``); bit 2 (with bit 1)
    drops the clamps, which are then fp8's own +-448. Each gives eager's codes (the interpreter
    tests check bit 0, the GPU tests all of them)."""
    for i in tl.static_range(6):
        if (OPS >> (4 * i)) & 15 == 1:  # x / s, IEEE-rounded (eager's fp32 division)
            if ARITH & 1 == 1:
                x = _divide_rn(x, sk, neg_r, neg_k)
            else:
                x = tl.div_rn(x, s + tl.zeros_like(x))
        if (OPS >> (4 * i)) & 15 == 2:  # x * reciprocal(s), each IEEE-rounded
            x = x * r
        if (OPS >> (4 * i)) & 15 == 3:  # round half to even (torch.round)
            x = _round_half_even(x)
        if (OPS >> (4 * i)) & 15 == 4 and ARITH & 4 == 0:  # (bit 2: fp8's bound, the cast saturates)
            x = tl.maximum(x, tl.load(qconst_ptr + 8 + i))
        if (OPS >> (4 * i)) & 15 == 5 and ARITH & 4 == 0:
            x = tl.minimum(x, tl.load(qconst_ptr + 8 + i))
        if (OPS >> (4 * i)) & 15 == 6:  # (clamped to +-448 before: no saturation is relied on)
            if ARITH & 2 == 2:  # cvt.rn.satfinite.e4m3x2.f32: nearest even, -0.0 kept (GPU only)
                x = x.to(tl.float8e4nv)
            else:
                x = _round_to_e4m3(x).to(tl.float8e4nv)
        if (OPS >> (4 * i)) & 15 == 7:  # (integral values in [-128, 127] after round and clamps)
            x = x.to(tl.int8)
    return x


@triton.jit
def _scale_reciprocals(s):
    """What the divisions by the scales ``s`` need, per scale (before they are broadcast to the
    elements, so that each is computed once per scale and thread): ``RN(1 / s)`` (the
    ``x * reciprocal(s)`` form), and for ``_divide_rn`` the scale times a power of two ``k``
    bringing it into ``[2^-64, 2^64]``, ``-RN(1 / (s k))`` and ``-k``."""
    a = tl.abs(s)
    tiny = a < 5.421010862427522e-20  # 2^-64
    huge = a > 1.8446744073709552e19  # 2^64
    k = tl.where(tiny, 1.8446744073709552e19, tl.where(huge, 5.421010862427522e-20, 1.0))
    neg_k = tl.where(tiny, -1.8446744073709552e19, tl.where(huge, -5.421010862427522e-20, -1.0))
    sk = s * k
    r = tl.div_rn(tl.full(s.shape, 1.0, tl.float32), s)
    neg_r = tl.div_rn(tl.full(s.shape, -1.0, tl.float32), sk)
    return r, sk, neg_r, neg_k


@triton.jit
def _divide_rn(x, sk, neg_r, neg_k):
    """``x / s`` rounded to nearest even as ``div.rn.f32`` rounds it, from ``_scale_reciprocals(s)``
    (taken once per scale: per row, per group, or one number; broadcast to ``x``): each element
    costs two multiplications, two FMAs, two compares and a select instead of a ``div.rn``.

    With ``r = RN(1 / s)`` and ``q0 = RN(x * r)`` (within one ulp of ``x / s``), the residual
    ``x - q0 * s`` is exact in an FMA and ``RN(q0 + r * (x - q0 * s))`` is the correctly rounded
    quotient (Markstein's theorem; no underflow nor overflow on the way). Both are arranged so:

    * the scale is first brought into ``[2^-64, 2^64]`` by a power of two ``k`` (per scale; ``x``
      scaled by the same ``k``, exactly wherever the quotient can reach a nonzero code, so the
      quotient is unchanged); the residual then stays a normal number wherever
      ``|x / s| >= 2^-11``. Smaller quotients may be off by an ulp: every code is then zero and
      keeps the quotient's sign (fp8 e4m3's smallest step is 2^-9; int8 rounds them to 0);
    * where the residual is zero (``q0`` exact, also every zero quotient, whose sign the
      correction could flip: ``+0 + -0`` is +0) or the correction NaN (an infinite quotient,
      ``s`` zero or infinite), ``q0`` stands: it is then IEEE's quotient (exact, inf, a signed
      zero, or NaN). The residual is formed negated, ``q0 * s - x``, from negated constants (no
      per-element negation: Triton 3.6 compiles ``-v`` as ``0 - v``).

    Checked against IEEE division on every bf16 and fp16 value, every fp32 significand over
    boundary-hard scales, and the special values (docs/cuda_kernel.md, "Quantized epilogue")."""
    neg_xk = x * neg_k
    q0 = neg_xk * neg_r  # RN(x k * r): the product's rounding is symmetric in sign
    e = tl.fma(q0, sk, neg_xk)  # q0 * s k - x k, exact
    q1 = tl.fma(e, neg_r, q0)  # q0 + (x k - q0 * s k) * r
    return tl.where((e != 0) & (q1 == q1), q1, q0)


@triton.jit
def _round_half_even(x):
    """``torch.round`` of fp32 ``x`` for ``|x| < 2^22`` (larger values only move within their own
    magnitude, which the clamps that follow it in every carried form absorb): adding and removing
    1.5 * 2^23 leaves no fraction bits, and IEEE addition rounds ties to even. Exact only if the add
    is not contracted with a product before it: quantizing kernels compile with
    ``enable_fp_fusion=False`` (``dispatch.kernel_arguments``)."""
    return (x + 12582912.0) - 12582912.0


@triton.jit
def _round_to_e4m3(x):
    """``x`` (fp32, ``|x| <= 448`` or NaN) rounded to the nearest float8 e4m3 value, ties to even,
    still in fp32: the cast that follows is then exact whatever rounding mode it uses (Triton's
    interpreter rounds fp32 -> fp8 wrongly; an exact value it converts right)."""
    bits = x.to(tl.int32, bitcast=True)
    a = tl.abs(x)
    magnitude = a.to(tl.int32, bitcast=True)
    # normals (|x| >= 2^-6): keep 3 of fp32's 23 mantissa bits, rounding the 20 dropped ones to even
    normal = ((magnitude + 524287 + ((magnitude >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    subnormal = _round_half_even(a * 512.0) * 0.001953125  # multiples of 2^-9 (exact scalings)
    r = tl.where(a < 0.015625, subnormal, normal)
    # The sign bit put back with integer ops, so that a negative value that rounds to zero is -0.0
    # (code 0x80), as eager's cast gives: Triton 3.6 compiles a float ``-r`` as ``0 - r``, which
    # is +0.0 for r = +0.0 (the mismatch of the first GPU run, docs/cuda_kernel.md).
    return (r.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def _quantize_rows(
    y,  # [ROWS, BLOCK_H] fp32 holding the normed rows rounded to the output dtype (padding 0)
    row,  # [ROWS] row indices in [T]
    offs, mask,  # the rows' element offsets and mask (the codes are [T, HIDDEN] like the rows)
    codes_ptr,  # [T, HIDDEN] codes (fp8 e4m3 or int8)
    scales_ptr,  # [T] (per row), [T, HIDDEN / GROUP] (per group) or [1] (a copy of the static scale)
    static_scale_ptr,  # the static scale (one fp32), any pointer otherwise
    qconst_ptr,  # fp32 [16]: the steps' constants (quant_epilogue.QuantEpilogue.constants)
    HIDDEN: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ROWS: tl.constexpr,
    QUANT: tl.constexpr,  # packed: mode, store-normed, group, scale ops, code ops (quant_epilogue)
):
    """The quantization the graph wrote after the norm (``weavepass.runtime.quant``), on rows that
    are in registers: dynamic scale ``s = scale_steps(amax(|y|))`` per row or per group of
    ``GROUP`` columns (or the static one), codes ``code_steps(y, s)``."""
    MODE: tl.constexpr = QUANT & 3
    GROUP_LOG2: tl.constexpr = (QUANT >> 3) & 31  # 0: per row
    ARITH: tl.constexpr = (QUANT >> 56) & 7  # quant_epilogue.ARITH_*: how the division, clamps and fp8 cast run
    SCALE_OPS: tl.constexpr = (QUANT >> 8) & 16777215
    CODE_OPS: tl.constexpr = (QUANT >> 32) & 16777215
    row_ok = tl.max(mask.to(tl.int32), axis=1) > 0
    if MODE == 1:  # static: one scale; the tile holding row 0 copies it out
        s = tl.load(static_scale_ptr).to(tl.float32)
        r, sk, neg_r, neg_k = _scale_reciprocals(s)
        tl.store(codes_ptr + offs, _code_steps(y, s, r, sk, neg_r, neg_k, qconst_ptr, CODE_OPS, ARITH), mask=mask)
        tl.store(scales_ptr + row * 0, s + tl.zeros([ROWS], tl.float32), mask=row_ok & (row == 0))
    elif GROUP_LOG2 == 0:  # dynamic per row
        s = _scale_steps(tl.max(tl.abs(y), axis=1), qconst_ptr, SCALE_OPS)
        r, sk, neg_r, neg_k = _scale_reciprocals(s)
        q = _code_steps(y, s[:, None], r[:, None], sk[:, None], neg_r[:, None], neg_k[:, None], qconst_ptr,
                        CODE_OPS, ARITH)
        tl.store(codes_ptr + offs, q, mask=mask)
        tl.store(scales_ptr + row.to(tl.int64), s.to(scales_ptr.dtype.element_ty), mask=row_ok)
    else:  # dynamic per group of GROUP columns (GROUP divides HIDDEN; both BLOCK_H and GROUP powers of 2)
        GROUP: tl.constexpr = 1 << GROUP_LOG2
        y3 = tl.reshape(y, (ROWS, BLOCK_H // GROUP, GROUP))
        s = _scale_steps(tl.max(tl.abs(y3), axis=2), qconst_ptr, SCALE_OPS)
        r, sk, neg_r, neg_k = _scale_reciprocals(s)
        q = _code_steps(y3, s[:, :, None], r[:, :, None], sk[:, :, None], neg_r[:, :, None], neg_k[:, :, None],
                        qconst_ptr, CODE_OPS, ARITH)
        q = tl.reshape(q, (ROWS, BLOCK_H))
        tl.store(codes_ptr + offs, q, mask=mask)
        g = tl.arange(0, BLOCK_H // GROUP)
        tl.store(scales_ptr + row.to(tl.int64)[:, None] * (HIDDEN // GROUP) + g[None, :],
                 s.to(scales_ptr.dtype.element_ty), mask=row_ok[:, None] & (g < HIDDEN // GROUP)[None, :])


@triton.jit
def _load_bias(bias_ptr, cols, col_mask, w, NORM: tl.constexpr):
    """The LayerNorm bias in fp32 (``NORM == 1``); an RMSNorm reads none (``w`` stands in, unused)."""
    if NORM == 1:
        b = tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    else:
        b = w
    return b


@triton.jit
def _finalise_rows(
    normed_ptr, residual_out_ptr, inv_rms_ptr, ws_ptr, recv_offset,
    start,  # first row of the peer's shard
    end,  # one past its last row (rows at or beyond it are masked)
    local,  # [ROWS] row indices within the shard
    eps, w, b, cols, col_mask,
    codes_ptr, scales_ptr, static_scale_ptr, qconst_ptr,
    HIDDEN: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ROWS: tl.constexpr,
    HAS_INV_RMS: tl.constexpr,
    NORM: tl.constexpr,
    QUANT: tl.constexpr,
):
    """Step 5 for one tile of a peer's shard: copy its ``residual_out`` rows from the local recv
    buffer and normalise them into ``normed`` (both kernels finalise this way)."""
    mask = ((start + local) < end)[:, None] & col_mask[None, :]
    offs = (start + local).to(tl.int64)[:, None] * HIDDEN + cols[None, :]
    res = tl.load(ws_ptr + recv_offset + offs, mask=mask, other=0.0)
    tl.store(residual_out_ptr + offs, res, mask=mask)
    _norm_rows(res, w, b, eps, normed_ptr, inv_rms_ptr, offs, start + local, mask,
               codes_ptr, scales_ptr, static_scale_ptr, qconst_ptr,
               HIDDEN, BLOCK_H, ROWS, HAS_INV_RMS, NORM, QUANT)


@triton.jit
def _reduce_rows(
    partial_ptr, residual_ptr, ws_ptr, residual_out_ptr,
    offs,  # [ROWS, BLOCK_H] element offsets of the rows in the [T, HIDDEN] tensors
    local,  # [ROWS] row indices within this rank's owned rows (the staging slot's row)
    owned,  # rows per staging slot
    cols,  # [BLOCK_H] column indices (with the kernel's contiguity hints)
    mask,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    HIDDEN: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ROWS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    """Step 3's arithmetic for one tile (both kernels reduce this way): the peers' partial rows from
    the local staging slots plus this rank's own, summed in rank order in fp32 (every rank rounds the
    same sum), rounded to ``dtype(P)``, plus the residual; returns ``residual_out`` in ``dtype(P)``."""
    acc = tl.zeros([ROWS, BLOCK_H], dtype=tl.float32)
    for src in tl.static_range(WORLD):
        if src == RANK:
            acc += tl.load(partial_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        else:
            slot = (src * owned + local).to(tl.int64)[:, None] * HIDDEN + cols[None, :]
            acc += tl.load(ws_ptr + slot, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        # The sum is rounded to dtype(P) first, as eager's all_reduce output is (an fp16
        # overflow stays inf); the reference's ``S = round(d, sum)`` step.
        acc = acc.to(residual_out_ptr.dtype.element_ty).to(tl.float32)
        acc += tl.load(residual_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return acc.to(residual_out_ptr.dtype.element_ty)


@triton.jit
def fused_allreduce_rmsnorm_kernel(
    partial_ptr,  # [T, HIDDEN] this rank's partial sums (local memory)
    residual_ptr,  # [T, HIDDEN] residual, any float dtype (unused when HAS_RESIDUAL is False)
    weight_ptr,  # [HIDDEN] norm weight
    normed_ptr,  # [T, HIDDEN] output, out_dtype
    residual_out_ptr,  # [T, HIDDEN] output, dtype(P)
    inv_rms_ptr,  # [T] fp32 output (only with HAS_INV_RMS; any pointer otherwise)
    bias_ptr,  # [HIDDEN] LayerNorm bias (only with NORM == 1; zeros without one; any pointer otherwise)
    codes_ptr,  # [T, HIDDEN] codes (only with QUANT; any pointer otherwise; _quantize_rows)
    scales_ptr,  # their scales (only with QUANT)
    static_scale_ptr,  # the static scale (only with a static QUANT)
    qconst_ptr,  # fp32 [16] the quantization's constants (only with QUANT)
    ws_ptr,  # this rank's symmetric workspace, dtype(P): staging at 0, recv at recv_offset
    pad_ptr,  # int32* this rank's symmetric signal pad
    wd0, wd1, wd2, wd3, wd4, wd5, wd6, wd7,  # peer workspace address - local one, in elements
    pd0, pd1, pd2, pd3, pd4, pd5, pd6, pd7,  # peer signal pad address - local one, in int32 slots
    num_tokens,  # T
    shard_rows,  # S = ceil(T / WORLD): rows per owner in two-shot mode
    recv_offset,  # element offset of recv in the workspace
    watch_addr,  # pinned host record of a wait that gave up (runtime.cuda.peer_wait), 0: none
    timeout_ns,  # how long any wait for a peer may last, 0: for ever
    eps,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    HIDDEN: tl.constexpr,
    BLOCK_H: tl.constexpr,  # next power of two >= HIDDEN
    ROWS: tl.constexpr,  # rows per tile
    ONE_SHOT: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    MAX_CTAS: tl.constexpr,  # signal slots per channel
    HAS_INV_RMS: tl.constexpr,  # also write the per-row inverse RMS (training graphs)
    NORM: tl.constexpr,  # 0: RMSNorm, 1: LayerNorm (_norm_rows)
    QUANT: tl.constexpr,  # 0, or the packed quantization of the normed rows (_quantize_rows)
):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    rows = tl.arange(0, ROWS)
    cols = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK_H), BLOCK_H), BLOCK_H)
    col_mask = cols < HIDDEN
    if ONE_SHOT:
        owned = num_tokens  # every rank owns every row
    else:
        owned = shard_rows
    num_tiles = tl.cdiv(owned, ROWS)

    # 1. push partial rows to their owners' staging[RANK]
    for owner in tl.static_range(WORLD):
        if owner != RANK:
            delta = _select(owner, wd0, wd1, wd2, wd3, wd4, wd5, wd6, wd7)
            if ONE_SHOT:
                start = 0
            else:
                start = owner * shard_rows
            end = tl.minimum(start + owned, num_tokens)
            for tile in range(pid, num_tiles, num_programs):
                local = tile * ROWS + rows
                mask = ((start + local) < end)[:, None] & col_mask[None, :]
                src = (start + local).to(tl.int64)[:, None] * HIDDEN + cols[None, :]
                dst = (RANK * owned + local).to(tl.int64)[:, None] * HIDDEN + cols[None, :]
                x = tl.load(partial_ptr + src, mask=mask)
                tl.store(ws_ptr + delta + dst, x, mask=mask)

    _block_barrier(pad_ptr, pd0, pd1, pd2, pd3, pd4, pd5, pd6, pd7, 0, watch_addr, timeout_ns, RANK, WORLD,
                   MAX_CTAS)

    # 3. reduce the owned rows, add the residual, push residual_out, normalise
    w = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    b = _load_bias(bias_ptr, cols, col_mask, w, NORM)
    if ONE_SHOT:
        start = 0
    else:
        start = RANK * shard_rows
    end = tl.minimum(start + owned, num_tokens)
    for tile in range(pid, num_tiles, num_programs):
        local = tile * ROWS + rows
        mask = ((start + local) < end)[:, None] & col_mask[None, :]
        offs = (start + local).to(tl.int64)[:, None] * HIDDEN + cols[None, :]
        res = _reduce_rows(partial_ptr, residual_ptr, ws_ptr, residual_out_ptr, offs, local, owned, cols, mask,
                           RANK, WORLD, HIDDEN, BLOCK_H, ROWS, HAS_RESIDUAL)
        tl.store(residual_out_ptr + offs, res, mask=mask)
        if not ONE_SHOT:
            for dst in tl.static_range(WORLD):
                if dst != RANK:
                    delta = _select(dst, wd0, wd1, wd2, wd3, wd4, wd5, wd6, wd7)
                    tl.store(ws_ptr + delta + recv_offset + offs, res, mask=mask)
        _norm_rows(res, w, b, eps, normed_ptr, inv_rms_ptr, offs, start + local, mask,
                   codes_ptr, scales_ptr, static_scale_ptr, qconst_ptr,
               HIDDEN, BLOCK_H, ROWS, HAS_INV_RMS, NORM, QUANT)

    _block_barrier(pad_ptr, pd0, pd1, pd2, pd3, pd4, pd5, pd6, pd7, 1, watch_addr, timeout_ns, RANK, WORLD,
                   MAX_CTAS)

    # 5. two-shot only: finalise the peers' shards from the local recv buffer
    if not ONE_SHOT:
        for owner in tl.static_range(WORLD):
            if owner != RANK:
                start = owner * shard_rows
                end = tl.minimum(start + owned, num_tokens)
                for tile in range(pid, num_tiles, num_programs):
                    local = tile * ROWS + rows
                    _finalise_rows(normed_ptr, residual_out_ptr, inv_rms_ptr, ws_ptr, recv_offset, start, end,
                                   local, eps, w, b, cols, col_mask,
                                   codes_ptr, scales_ptr, static_scale_ptr, qconst_ptr,
                                   HIDDEN, BLOCK_H, ROWS, HAS_INV_RMS, NORM, QUANT)


# ------------------------------------------------------------------ pipelined two-shot (large batches)


@triton.jit
def _signal_counters(
    pad_ptr, pd0, pd1, pd2, pd3, pd4, pd5, pd6, pd7,
    send_push,  # runtime bool: also count one more pushed chunk (channel 2)
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    MAX_CTAS: tl.constexpr,
):
    """Add 1 to every peer's counter ``[3, b, RANK]`` (one more reduced chunk) and, if ``send_push``,
    to ``[2, b, RANK]`` (one more pushed chunk), with release at system scope after a CTA barrier."""
    tl.debug_barrier()  # every thread's stores are issued before the release
    pid = tl.program_id(0)
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            remote = pad_ptr + _select(peer, pd0, pd1, pd2, pd3, pd4, pd5, pd6, pd7) + RANK
            if send_push:
                tl.atomic_add(remote + (2 * MAX_CTAS + pid) * WORLD, 1, sem="release", scope="sys")
            tl.atomic_add(remote + (3 * MAX_CTAS + pid) * WORLD, 1, sem="release", scope="sys")


@triton.jit
def _wait_counters(
    pad_ptr,
    channel: tl.constexpr,
    target,  # wait until every peer's counter [channel, b, peer] reaches this
    watch_addr, timeout_ns,  # the bounded wait (_give_up_after)
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    MAX_CTAS: tl.constexpr,
):
    base = pad_ptr + (channel * MAX_CTAS + tl.program_id(0)) * WORLD
    deadline = _deadline(timeout_ns)
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            while tl.atomic_add(base + peer, 0, sem="acquire", scope="sys") < target:
                _give_up_after(deadline, watch_addr, timeout_ns, peer, 3, RANK, WORLD)
    tl.debug_barrier()  # no thread reads peer data before the acquire


@triton.jit
def _push_chunk(
    partial_ptr, ws_ptr, wd0, wd1, wd2, wd3, wd4, wd5, wd6, wd7,
    chunk, num_tokens, shard_rows, cols, col_mask,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    HIDDEN: tl.constexpr,
    CHUNK_ROWS: tl.constexpr,
    PUSH_ROWS: tl.constexpr,
    LOAD_STAGES: tl.constexpr,
):
    """Store this rank's partial rows of chunk ``chunk`` of every peer's shard into that peer's
    ``staging[RANK]``; ``PUSH_ROWS`` rows per load/store pair (several tiles in flight). With
    ``LOAD_STAGES > 1`` the loop over a chunk's row groups is software-pipelined: the loads of the
    next ``LOAD_STAGES - 1`` groups are in flight (asynchronous copies into shared memory) while
    this group's stores issue."""
    prow = tl.arange(0, PUSH_ROWS)
    for owner in tl.static_range(WORLD):
        if owner != RANK:
            delta = _select(owner, wd0, wd1, wd2, wd3, wd4, wd5, wd6, wd7)
            start = owner * shard_rows
            end = tl.minimum(start + shard_rows, num_tokens)
            if LOAD_STAGES == 1:
                for k in tl.static_range(CHUNK_ROWS // PUSH_ROWS):
                    _push_rows(partial_ptr, ws_ptr + delta, chunk * CHUNK_ROWS + k * PUSH_ROWS + prow, start, end,
                               shard_rows, cols, col_mask, RANK, HIDDEN)
            else:
                for k in tl.range(0, CHUNK_ROWS // PUSH_ROWS, num_stages=LOAD_STAGES):
                    _push_rows(partial_ptr, ws_ptr + delta, chunk * CHUNK_ROWS + k * PUSH_ROWS + prow, start, end,
                               shard_rows, cols, col_mask, RANK, HIDDEN)


@triton.jit
def _push_rows(partial_ptr, peer_ws_ptr, local, start, end, shard_rows, cols, col_mask, RANK: tl.constexpr,
               HIDDEN: tl.constexpr):
    """Rows ``start + local`` of the partial into the peer's ``staging[RANK]`` rows ``local``."""
    mask = ((start + local) < end)[:, None] & col_mask[None, :]
    src = (start + local).to(tl.int64)[:, None] * HIDDEN + cols[None, :]
    dst = (RANK * shard_rows + local).to(tl.int64)[:, None] * HIDDEN + cols[None, :]
    x = tl.load(partial_ptr + src, mask=mask)
    tl.store(peer_ws_ptr + dst, x, mask=mask)


@triton.jit
def _reduce_chunk(
    partial_ptr, residual_ptr, normed_ptr, residual_out_ptr, inv_rms_ptr, ws_ptr,
    wd0, wd1, wd2, wd3, wd4, wd5, wd6, wd7,
    chunk, num_tokens, shard_rows, recv_offset, eps, w, b, rows, cols, col_mask,
    codes_ptr, scales_ptr, static_scale_ptr, qconst_ptr,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    HIDDEN: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ROWS: tl.constexpr,
    CHUNK_ROWS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_INV_RMS: tl.constexpr,
    NORM: tl.constexpr,
    QUANT: tl.constexpr,
    LOAD_STAGES: tl.constexpr,
):
    """Step 3 for the chunk's tiles of this rank's shard (``LOAD_STAGES``: as in ``_push_chunk``;
    the pipelined loop starts after the wait for the peers' pushes, so no load runs ahead of it)."""
    if LOAD_STAGES == 1:
        for k in tl.static_range(CHUNK_ROWS // ROWS):
            _reduce_tile(partial_ptr, residual_ptr, normed_ptr, residual_out_ptr, inv_rms_ptr, ws_ptr,
                         wd0, wd1, wd2, wd3, wd4, wd5, wd6, wd7,
                         chunk * CHUNK_ROWS + k * ROWS + rows, num_tokens, shard_rows, recv_offset, eps, w, b, cols,
                         col_mask, codes_ptr, scales_ptr, static_scale_ptr, qconst_ptr,
                         RANK, WORLD, HIDDEN, BLOCK_H, ROWS, HAS_RESIDUAL, HAS_INV_RMS, NORM, QUANT)
    else:
        for k in tl.range(0, CHUNK_ROWS // ROWS, num_stages=LOAD_STAGES):
            _reduce_tile(partial_ptr, residual_ptr, normed_ptr, residual_out_ptr, inv_rms_ptr, ws_ptr,
                         wd0, wd1, wd2, wd3, wd4, wd5, wd6, wd7,
                         chunk * CHUNK_ROWS + k * ROWS + rows, num_tokens, shard_rows, recv_offset, eps, w, b, cols,
                         col_mask, codes_ptr, scales_ptr, static_scale_ptr, qconst_ptr,
                         RANK, WORLD, HIDDEN, BLOCK_H, ROWS, HAS_RESIDUAL, HAS_INV_RMS, NORM, QUANT)


@triton.jit
def _reduce_tile(
    partial_ptr, residual_ptr, normed_ptr, residual_out_ptr, inv_rms_ptr, ws_ptr,
    wd0, wd1, wd2, wd3, wd4, wd5, wd6, wd7,
    local,  # [ROWS] row indices within this rank's shard
    num_tokens, shard_rows, recv_offset, eps, w, b, cols, col_mask,
    codes_ptr, scales_ptr, static_scale_ptr, qconst_ptr,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    HIDDEN: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ROWS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_INV_RMS: tl.constexpr,
    NORM: tl.constexpr,
    QUANT: tl.constexpr,
):
    """One tile of step 3: reduce, push ``residual_out`` into the peers' recv, store it, normalise."""
    start = RANK * shard_rows
    end = tl.minimum(start + shard_rows, num_tokens)
    mask = ((start + local) < end)[:, None] & col_mask[None, :]
    offs = (start + local).to(tl.int64)[:, None] * HIDDEN + cols[None, :]
    res = _reduce_rows(partial_ptr, residual_ptr, ws_ptr, residual_out_ptr, offs, local, shard_rows, cols, mask,
                       RANK, WORLD, HIDDEN, BLOCK_H, ROWS, HAS_RESIDUAL)
    for dst in tl.static_range(WORLD):
        if dst != RANK:
            delta = _select(dst, wd0, wd1, wd2, wd3, wd4, wd5, wd6, wd7)
            tl.store(ws_ptr + delta + recv_offset + offs, res, mask=mask)
    tl.store(residual_out_ptr + offs, res, mask=mask)
    _norm_rows(res, w, b, eps, normed_ptr, inv_rms_ptr, offs, start + local, mask,
               codes_ptr, scales_ptr, static_scale_ptr, qconst_ptr,
               HIDDEN, BLOCK_H, ROWS, HAS_INV_RMS, NORM, QUANT)


@triton.jit
def _finalise_chunk(
    normed_ptr, residual_out_ptr, inv_rms_ptr, ws_ptr,
    chunk, num_tokens, shard_rows, recv_offset, eps, w, b, rows, cols, col_mask,
    codes_ptr, scales_ptr, static_scale_ptr, qconst_ptr,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    HIDDEN: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ROWS: tl.constexpr,
    CHUNK_ROWS: tl.constexpr,
    HAS_INV_RMS: tl.constexpr,
    NORM: tl.constexpr,
    QUANT: tl.constexpr,
    LOAD_STAGES: tl.constexpr,
):
    """Step 5 for the chunk's tiles of every peer's shard (``LOAD_STAGES``: as in ``_reduce_chunk``,
    after the wait for the peers' reduces)."""
    for owner in tl.static_range(WORLD):
        if owner != RANK:
            start = owner * shard_rows
            end = tl.minimum(start + shard_rows, num_tokens)
            if LOAD_STAGES == 1:
                for k in tl.static_range(CHUNK_ROWS // ROWS):
                    _finalise_rows(normed_ptr, residual_out_ptr, inv_rms_ptr, ws_ptr, recv_offset, start, end,
                                   chunk * CHUNK_ROWS + k * ROWS + rows, eps, w, b, cols, col_mask,
                                   codes_ptr, scales_ptr, static_scale_ptr, qconst_ptr,
                                   HIDDEN, BLOCK_H, ROWS, HAS_INV_RMS, NORM, QUANT)
            else:
                for k in tl.range(0, CHUNK_ROWS // ROWS, num_stages=LOAD_STAGES):
                    _finalise_rows(normed_ptr, residual_out_ptr, inv_rms_ptr, ws_ptr, recv_offset, start, end,
                                   chunk * CHUNK_ROWS + k * ROWS + rows, eps, w, b, cols, col_mask,
                                   codes_ptr, scales_ptr, static_scale_ptr, qconst_ptr,
                                   HIDDEN, BLOCK_H, ROWS, HAS_INV_RMS, NORM, QUANT)


@triton.jit
def fused_allreduce_rmsnorm_pipelined_kernel(
    partial_ptr, residual_ptr, weight_ptr, normed_ptr, residual_out_ptr, inv_rms_ptr, bias_ptr,
    codes_ptr, scales_ptr, static_scale_ptr, qconst_ptr,  # the quantized epilogue, as in fused_allreduce_rmsnorm_kernel
    ws_ptr, pad_ptr,
    wd0, wd1, wd2, wd3, wd4, wd5, wd6, wd7,
    pd0, pd1, pd2, pd3, pd4, pd5, pd6, pd7,
    num_tokens, shard_rows, recv_offset,
    watch_addr, timeout_ns,  # the bounded waits, as in fused_allreduce_rmsnorm_kernel
    eps,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    HIDDEN: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ROWS: tl.constexpr,  # rows per reduce / finalise tile
    CHUNK_ROWS: tl.constexpr,  # rows per chunk (a multiple of ROWS and PUSH_ROWS)
    PUSH_ROWS: tl.constexpr,  # rows per push load/store
    HAS_RESIDUAL: tl.constexpr,
    MAX_CTAS: tl.constexpr,
    HAS_INV_RMS: tl.constexpr,
    NORM: tl.constexpr,
    QUANT: tl.constexpr,
    LOAD_STAGES: tl.constexpr,  # 1: each tile loaded when it is reduced; n > 1: n - 1 tiles ahead (_push_chunk)
):
    """Two-shot, software-pipelined over chunks of ``CHUNK_ROWS`` rows (see the module docstring).

    Chunk ``g`` of every shard goes to program ``g % G``; program ``b`` handles its ``n`` chunks
    ``c = 0..n-1`` (``g = b + c*G``) as: push chunk 0; then for each ``c``: push chunk ``c+1``, wait
    until the peers pushed chunk ``c`` (counter ``[2, b, peer] >= c+1``), reduce chunk ``c`` (pushing
    its ``residual_out`` into the peers' recv), wait until the peers reduced chunk ``c-1`` (counter
    ``[3, b, peer] >= c``), finalise chunk ``c-1``, then one release covers both signals. Remote stores
    of one step drain while the local loads of the next run. Counters are reset by their owner
    (``-n``) after its last wait, so they are 0 between calls (CUDA-graph safe).
    """
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    rows = tl.arange(0, ROWS)
    cols = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK_H), BLOCK_H), BLOCK_H)
    col_mask = cols < HIDDEN
    total_chunks = tl.cdiv(shard_rows, CHUNK_ROWS)
    n = (total_chunks - pid + num_programs - 1) // num_programs
    w = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    b = _load_bias(bias_ptr, cols, col_mask, w, NORM)
    if n > 0:
        _push_chunk(partial_ptr, ws_ptr, wd0, wd1, wd2, wd3, wd4, wd5, wd6, wd7,
                    pid, num_tokens, shard_rows, cols, col_mask,
                    RANK, WORLD, HIDDEN, CHUNK_ROWS, PUSH_ROWS, LOAD_STAGES)
        tl.debug_barrier()
        for peer in tl.static_range(WORLD):
            if peer != RANK:
                remote = pad_ptr + _select(peer, pd0, pd1, pd2, pd3, pd4, pd5, pd6, pd7) + RANK
                tl.atomic_add(remote + (2 * MAX_CTAS + pid) * WORLD, 1, sem="release", scope="sys")
    for c in range(0, n):
        chunk = pid + c * num_programs
        more = c + 1 < n
        if more:
            _push_chunk(partial_ptr, ws_ptr, wd0, wd1, wd2, wd3, wd4, wd5, wd6, wd7,
                        chunk + num_programs, num_tokens, shard_rows, cols, col_mask,
                        RANK, WORLD, HIDDEN, CHUNK_ROWS, PUSH_ROWS, LOAD_STAGES)
        _wait_counters(pad_ptr, 2, c + 1, watch_addr, timeout_ns, RANK, WORLD, MAX_CTAS)
        _reduce_chunk(partial_ptr, residual_ptr, normed_ptr, residual_out_ptr, inv_rms_ptr, ws_ptr,
                      wd0, wd1, wd2, wd3, wd4, wd5, wd6, wd7,
                      chunk, num_tokens, shard_rows, recv_offset, eps, w, b, rows, cols, col_mask,
                      codes_ptr, scales_ptr, static_scale_ptr, qconst_ptr,
                      RANK, WORLD, HIDDEN, BLOCK_H, ROWS, CHUNK_ROWS, HAS_RESIDUAL, HAS_INV_RMS, NORM, QUANT,
                      LOAD_STAGES)
        if c > 0:
            _wait_counters(pad_ptr, 3, c, watch_addr, timeout_ns, RANK, WORLD, MAX_CTAS)
            _finalise_chunk(normed_ptr, residual_out_ptr, inv_rms_ptr, ws_ptr,
                            chunk - num_programs, num_tokens, shard_rows, recv_offset, eps, w, b,
                            rows, cols, col_mask, codes_ptr, scales_ptr, static_scale_ptr, qconst_ptr,
                            RANK, WORLD, HIDDEN, BLOCK_H, ROWS, CHUNK_ROWS, HAS_INV_RMS, NORM, QUANT, LOAD_STAGES)
        _signal_counters(pad_ptr, pd0, pd1, pd2, pd3, pd4, pd5, pd6, pd7, more, RANK, WORLD, MAX_CTAS)
    if n > 0:
        _wait_counters(pad_ptr, 3, n, watch_addr, timeout_ns, RANK, WORLD, MAX_CTAS)
        _finalise_chunk(normed_ptr, residual_out_ptr, inv_rms_ptr, ws_ptr,
                        pid + (n - 1) * num_programs, num_tokens, shard_rows, recv_offset, eps, w, b,
                        rows, cols, col_mask, codes_ptr, scales_ptr, static_scale_ptr, qconst_ptr,
                        RANK, WORLD, HIDDEN, BLOCK_H, ROWS, CHUNK_ROWS, HAS_INV_RMS, NORM, QUANT, LOAD_STAGES)
        for peer in tl.static_range(WORLD):  # consume this call's counts (the peers' next call may
            if peer != RANK:  # already be adding: counters are exact, so subtracting keeps those)
                tl.atomic_add(pad_ptr + (2 * MAX_CTAS + pid) * WORLD + peer, -n, sem="relaxed", scope="sys")
                tl.atomic_add(pad_ptr + (3 * MAX_CTAS + pid) * WORLD + peer, -n, sem="relaxed", scope="sys")


# ------------------------------------------------------------------ Lamport one-shot (decode sizes)


@triton.jit
def _empty_bits(v, BITS: tl.constexpr):
    """Which elements of ``v`` still hold the Lamport "empty" value, negative zero (bit pattern
    ``1 << (BITS - 1)``): compared as bits, since ``-0.0 == 0.0`` as floats."""
    if BITS == 16:
        return v.to(tl.int16, bitcast=True) == -32768
    else:
        return v.to(tl.int32, bitcast=True) == -2147483648


@triton.jit
def _empty_value(ROWS: tl.constexpr, BLOCK_H: tl.constexpr, dtype: tl.constexpr, BITS: tl.constexpr):
    """A [ROWS, BLOCK_H] tile of negative zeros of ``dtype``, built from its bits."""
    if BITS == 16:
        return tl.full([ROWS, BLOCK_H], -32768, dtype=tl.int16).to(dtype, bitcast=True)
    else:
        return tl.full([ROWS, BLOCK_H], -2147483648, dtype=tl.int32).to(dtype, bitcast=True)


@triton.jit
def fused_allreduce_rmsnorm_lamport_kernel(
    partial_ptr, residual_ptr, weight_ptr, normed_ptr, residual_out_ptr, inv_rms_ptr, bias_ptr,
    codes_ptr, scales_ptr, static_scale_ptr, qconst_ptr,  # the quantized epilogue, as in fused_allreduce_rmsnorm_kernel
    ws_ptr, pad_ptr,
    wd0, wd1, wd2, wd3, wd4, wd5, wd6, wd7,
    num_tokens,
    lamport_offset,  # element offset of the Lamport region in the workspace
    slot_elems,  # elements per (parity, source) slot: T * HIDDEN fits one
    watch_addr, timeout_ns,  # the bounded waits, as in fused_allreduce_rmsnorm_kernel
    eps,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    HIDDEN: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ROWS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BITS: tl.constexpr,  # bits per element of dtype(P): 16 or 32
    FLAG_SLOT: tl.constexpr,  # pad slots: [FLAG_SLOT] = calls so far, [FLAG_SLOT + 1] = CTAs done
    HAS_INV_RMS: tl.constexpr,
    NORM: tl.constexpr,
    QUANT: tl.constexpr,
):
    """One-shot without barriers, for decode-sized batches (Lamport's scheme, as in TensorRT-LLM's and
    FlashInfer's one-shot all-reduce).

    The workspace's Lamport region is ``[2 parities][WORLD sources][slot_elems]``, and every element
    of it holds negative zero ("empty") between calls. Call ``k`` uses parity ``k % 2`` (the call
    counter lives in this rank's pad; every rank makes the same calls, so the counters agree):

    1. push: rank ``r`` stores its partial rows, with ``-0.0`` turned into ``+0.0`` (equal in every
       sum; only the empty value's bits are reserved), into every peer's slot ``[k % 2][r]``;
    2. reduce: for each tile, poll the peers' slots ``[k % 2][src]`` in the local region (volatile
       loads) until no element is empty: the data is its own flag, so no barrier round trip is
       needed. Sum in rank order, add the residual and normalise as the other kernels do, then store
       "empty" back into the slots just read.

    Why two parities suffice: a peer writes parity ``p`` again only in call ``k + 2``, which it can
    reach only after reading this rank's pushes of call ``k + 1``, which this rank makes after call
    ``k`` (its reads and its clearing stores) has finished. Rows are dealt to programs by the same
    rule on every rank, as in the flat kernel. The last program to finish advances the call counter
    (the next launch on the stream sees it), so CUDA-graph replay is safe.
    """
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    rows = tl.arange(0, ROWS)
    cols = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK_H), BLOCK_H), BLOCK_H)
    col_mask = cols < HIDDEN
    num_tiles = tl.cdiv(num_tokens, ROWS)
    parity = tl.load(pad_ptr + FLAG_SLOT, volatile=True) % 2
    region = lamport_offset + parity * WORLD * slot_elems

    # 1. push this rank's rows into slot [parity][RANK] of every peer
    for tile in range(pid, num_tiles, num_programs):
        local = tile * ROWS + rows
        mask = (local < num_tokens)[:, None] & col_mask[None, :]
        offs = local.to(tl.int64)[:, None] * HIDDEN + cols[None, :]
        x = tl.load(partial_ptr + offs, mask=mask)
        x = tl.where(x == 0.0, 0.0, x).to(x.dtype)  # -0.0 -> +0.0: the empty value is reserved
        for dst in tl.static_range(WORLD):
            if dst != RANK:
                delta = _select(dst, wd0, wd1, wd2, wd3, wd4, wd5, wd6, wd7)
                tl.store(ws_ptr + delta + region + RANK * slot_elems + offs, x, mask=mask)

    # 2. reduce each tile once every peer's rows have arrived, then mark the slots empty again
    deadline = _deadline(timeout_ns)
    w = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    b = _load_bias(bias_ptr, cols, col_mask, w, NORM)
    for tile in range(pid, num_tiles, num_programs):
        local = tile * ROWS + rows
        mask = (local < num_tokens)[:, None] & col_mask[None, :]
        offs = local.to(tl.int64)[:, None] * HIDDEN + cols[None, :]
        acc = tl.zeros([ROWS, BLOCK_H], dtype=tl.float32)
        for src in tl.static_range(WORLD):  # rank order: every rank rounds the same sum
            if src == RANK:
                acc += tl.load(partial_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            else:
                slot = ws_ptr + region + src * slot_elems + offs
                v = tl.load(slot, mask=mask, other=0.0, volatile=True)
                while tl.max((_empty_bits(v, BITS) & mask).to(tl.int32)) > 0:
                    _give_up_after(deadline, watch_addr, timeout_ns, src, 4, RANK, WORLD)
                    v = tl.load(slot, mask=mask, other=0.0, volatile=True)
                acc += v.to(tl.float32)
                tl.store(slot, _empty_value(ROWS, BLOCK_H, v.dtype, BITS), mask=mask)
        if HAS_RESIDUAL:
            # The sum is rounded to dtype(P) first, as eager's all_reduce output is (see _reduce_rows).
            acc = acc.to(residual_out_ptr.dtype.element_ty).to(tl.float32)
            acc += tl.load(residual_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        res = acc.to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + offs, res, mask=mask)
        _norm_rows(res, w, b, eps, normed_ptr, inv_rms_ptr, offs, local, mask,
                   codes_ptr, scales_ptr, static_scale_ptr, qconst_ptr,
               HIDDEN, BLOCK_H, ROWS, HAS_INV_RMS, NORM, QUANT)

    # 3. the last program to finish advances the call counter (and resets the done count)
    tl.debug_barrier()
    if tl.atomic_add(pad_ptr + FLAG_SLOT + 1, 1, sem="acq_rel", scope="gpu") == num_programs - 1:
        tl.atomic_xchg(pad_ptr + FLAG_SLOT + 1, 0, sem="relaxed", scope="gpu")
        tl.atomic_add(pad_ptr + FLAG_SLOT, 1, sem="relaxed", scope="gpu")


# ------------------------------------------------------------------ push variant of the split


@triton.jit
def _staging_offsets(src: tl.constexpr, dst: tl.constexpr, num_tokens, local, cols, HIDDEN: tl.constexpr):
    """Element offsets of rows ``local`` of source ``src``'s block in rank ``dst``'s staging slot:
    the slot holds the ``WORLD - 1`` peers' ``[T, HIDDEN]`` blocks in rank order, none for ``dst``."""
    return ((src - (src > dst)) * num_tokens + local).to(tl.int64)[:, None] * HIDDEN + cols[None, :]


@triton.jit
def push_partial_rows_kernel(
    partial_ptr,  # [T, HIDDEN] this rank's partial sums (local memory)
    ws_ptr,  # this rank's symmetric push workspace, dtype(P): slot 0 at 0, slot 1 at capacity
    pad_ptr,  # int32* this rank's symmetric signal pad (the push workspace's own)
    wd0, wd1, wd2, wd3, wd4, wd5, wd6, wd7,  # peer workspace address - local one, in elements
    pd0, pd1, pd2, pd3, pd4, pd5, pd6, pd7,  # peer signal pad address - local one, in int32 slots
    num_tokens,  # T
    slot_offset,  # element offset of the staging slot this call uses (slot * capacity)
    signal_base,  # pad slot of this staging slot's signals (slot * (4 + 2 * WORLD))
    watch_addr, timeout_ns,  # the bounded waits, as in fused_allreduce_rmsnorm_kernel
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    HIDDEN: tl.constexpr,
    BLOCK_H: tl.constexpr,  # next power of two >= HIDDEN
    ROWS: tl.constexpr,  # rows per load/store
):
    """The side-stream half of the push variant (``WeaveConfig.split_comm="push"``): store all
    ``T`` partial rows into every peer's staging slot, and return once the peers' rows of the same
    call are in this rank's slot. ``reduce_pushed_rows_kernel`` then does the arithmetic on the
    compute stream, after the caller's stream has waited for this kernel.

    Signals of a staging slot, at ``pad[signal_base + i]`` on every rank (all 0 in a new pad):

    * ``[0]`` PUSH_SEQ: pushes of this slot this rank has completed; this call is ``seq = [0] + 1``;
    * ``[1]`` PUSH_DONE: programs of the current push that finished (the last one resets it);
    * ``[2]``, ``[3]``: REDUCE_SEQ and REDUCE_DONE, the same for ``reduce_pushed_rows_kernel``;
    * ``[4 + src]`` PUSHED: the ``seq`` of ``src``'s latest push into this rank's slot;
    * ``[4 + WORLD + dst]`` CONSUMED: the ``seq`` of ``dst``'s latest reduce of this rank's rows.

    1. every program waits until each peer has CONSUMED push ``seq - 1`` of this slot: a peer's
       reduce runs on its compute stream, which nothing orders before this rank's next push of
       the slot, so without the wait this push could overwrite rows the peer has not read;
    2. stores its tiles (tile ``t`` to program ``t % G``) into every peer's slot, block ``RANK``;
    3. counts itself done (release, system scope); the last program publishes ``PUSHED = seq`` to
       every peer (release: the other programs' stores were acquired through the count), waits for
       every peer's ``PUSHED == seq`` in the local pad (acquire), then advances PUSH_SEQ.

    Values are sequence numbers compared for equality, never reset: a peer's PUSHED can only move
    from ``seq - 1`` to ``seq`` while this rank waits (its next push waits for this rank's
    CONSUMED), so no host counter and no reset is needed, and CUDA-graph replay is safe. Only the
    last program waits for the peers: the others leave their SMs as soon as their stores are out.
    """
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    rows = tl.arange(0, ROWS)
    cols = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK_H), BLOCK_H), BLOCK_H)
    col_mask = cols < HIDDEN
    signals = pad_ptr + signal_base
    seq = tl.load(signals, volatile=True) + 1  # the previous push of this slot finished on this stream

    # 1. the peers have read this slot's previous push
    deadline = _deadline(timeout_ns)
    for dst in tl.static_range(WORLD):
        if dst != RANK:
            while tl.atomic_add(signals + 4 + WORLD + dst, 0, sem="acquire", scope="sys") != seq - 1:
                _give_up_after(deadline, watch_addr, timeout_ns, dst, 5, RANK, WORLD)
    tl.debug_barrier()  # no thread stores before the acquire

    # 2. push every row into every peer's slot
    num_tiles = tl.cdiv(num_tokens, ROWS)
    for tile in range(pid, num_tiles, num_programs):
        local = tile * ROWS + rows
        mask = (local < num_tokens)[:, None] & col_mask[None, :]
        offs = local.to(tl.int64)[:, None] * HIDDEN + cols[None, :]
        x = tl.load(partial_ptr + offs, mask=mask)
        for dst in tl.static_range(WORLD):
            if dst != RANK:
                delta = _select(dst, wd0, wd1, wd2, wd3, wd4, wd5, wd6, wd7)
                block = _staging_offsets(RANK, dst, num_tokens, local, cols, HIDDEN)
                tl.store(ws_ptr + delta + slot_offset + block, x, mask=mask)

    # 3. the last program publishes the call and waits for the peers' rows
    tl.debug_barrier()  # every thread's stores are issued before the release
    if tl.atomic_add(signals + 1, 1, sem="acq_rel", scope="sys") == num_programs - 1:
        for dst in tl.static_range(WORLD):
            if dst != RANK:
                remote = signals + _select(dst, pd0, pd1, pd2, pd3, pd4, pd5, pd6, pd7) + 4 + RANK
                tl.atomic_xchg(remote, seq, sem="release", scope="sys")
        deadline = _deadline(timeout_ns)
        for src in tl.static_range(WORLD):
            if src != RANK:
                while tl.atomic_add(signals + 4 + src, 0, sem="acquire", scope="sys") != seq:
                    _give_up_after(deadline, watch_addr, timeout_ns, src, 6, RANK, WORLD)
        tl.atomic_xchg(signals + 1, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(signals, seq, sem="release", scope="gpu")


@triton.jit
def reduce_pushed_rows_kernel(
    partial_ptr,  # [T, HIDDEN] this rank's partial sums
    residual_ptr,  # [T, HIDDEN] residual (unused when HAS_RESIDUAL is False)
    weight_ptr,  # [HIDDEN] norm weight
    normed_ptr,  # [T, HIDDEN] output, out_dtype
    residual_out_ptr,  # [T, HIDDEN] output, dtype(P)
    ws_ptr,  # this rank's symmetric push workspace (push_partial_rows_kernel)
    pad_ptr,  # int32* this rank's signal pad
    pd0, pd1, pd2, pd3, pd4, pd5, pd6, pd7,  # peer signal pad address - local one, in int32 slots
    num_tokens,  # T
    slot_offset,  # element offset of the staging slot (as the push of this call)
    signal_base,  # pad slot of the staging slot's signals (as the push of this call)
    eps,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    HIDDEN: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ROWS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    """The compute-stream half of the push variant: all ``T`` rows, the peers' from the staging
    slot, reduced in rank order in fp32 with the reference's rounding (``_reduce_rows``'s), plus the
    residual, normalised; then the last program to finish tells every peer its rows were CONSUMED.

    It waits for no signal of its own: it must run after the caller's stream waited for this
    call's ``push_partial_rows_kernel``, which returns only once the peers' rows have arrived (its
    system-scope acquire, then the stream order, make them visible here). Any grid works: no
    program meets a peer's program, so the grid is the full GPU, not the push's few CTAs."""
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    rows = tl.arange(0, ROWS)
    cols = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK_H), BLOCK_H), BLOCK_H)
    col_mask = cols < HIDDEN
    signals = pad_ptr + signal_base
    seq = tl.load(signals + 2, volatile=True) + 1
    w = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    num_tiles = tl.cdiv(num_tokens, ROWS)
    for tile in range(pid, num_tiles, num_programs):
        local = tile * ROWS + rows
        mask = (local < num_tokens)[:, None] & col_mask[None, :]
        offs = local.to(tl.int64)[:, None] * HIDDEN + cols[None, :]
        acc = tl.zeros([ROWS, BLOCK_H], dtype=tl.float32)
        for src in tl.static_range(WORLD):  # rank order: every rank rounds the same sum
            if src == RANK:
                acc += tl.load(partial_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            else:
                block = _staging_offsets(src, RANK, num_tokens, local, cols, HIDDEN)
                acc += tl.load(ws_ptr + slot_offset + block, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:  # S rounded to dtype(P) before the add, as in _reduce_rows
            acc = acc.to(residual_out_ptr.dtype.element_ty).to(tl.float32)
            acc += tl.load(residual_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        res = acc.to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + offs, res, mask=mask)
        _norm_rows(res, w, w, eps, normed_ptr, normed_ptr, offs, local, mask, normed_ptr, normed_ptr, normed_ptr,
                   normed_ptr, HIDDEN, BLOCK_H, ROWS, False, 0, 0)

    # the last program to finish hands the slot back to the peers
    tl.debug_barrier()  # every thread's staging loads are done before the release
    if tl.atomic_add(signals + 3, 1, sem="acq_rel", scope="sys") == num_programs - 1:
        tl.atomic_xchg(signals + 3, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(signals + 2, seq, sem="relaxed", scope="gpu")
        for src in tl.static_range(WORLD):
            if src != RANK:
                remote = signals + _select(src, pd0, pd1, pd2, pd3, pd4, pd5, pd6, pd7) + 4 + WORLD + RANK
                tl.atomic_xchg(remote, seq, sem="release", scope="sys")
