"""The launch rule of the ``cuda_symm`` lowering: one-shot or two-shot, flat or pipelined kernel,
grid and tile shape, from the batch alone. The constants are measured (docs/cuda_kernel.md); there
is no per-model table."""

from __future__ import annotations

from dataclasses import dataclass

from weavepass.runtime.portable import rows_per_rank

MIN_CTAS, MAX_CTAS = 2, 32
SMALL_TILE_BYTES = 16 << 10  # one bf16 row of 8192: many tiles, so small batches still fill 32 CTAs
LARGE_TILE_BYTES = 64 << 10  # 4 bf16 rows of 8192 per tile: 4x the bytes in flight per CTA

# Launch rule, from benchmarks/bench_fused_allreduce_rmsnorm.py on 2 x H200 (docs/cuda_kernel.md):
ONE_SHOT_MAX_BYTES = 256 << 10
"""One-shot while every rank pushes at most this many bytes ((WORLD-1) * T * H * elem) to its peers.
Measured at H=8192 bf16 on 2 ranks: one-shot wins at 1 and 8 tokens (7.3 vs 7.7 us, 7.9 vs 9.1 us),
ties at 32, loses at 128 (17.6 vs 15.6 us) and beyond; 256 KiB = 16 tokens there."""
LAMPORT_MAX_BYTES = 256 << 10
"""Largest batch (``T * H * elem`` per rank) the Lamport one-shot kernel serves: one slot of the
workspace's Lamport region (``workspace.LAMPORT_SLOT_BYTES``)."""
LAMPORT_BY_DEFAULT = False
"""Whether the rule picks the Lamport one-shot kernel for one-shot batches that fit a slot. Off until
it is measured against the barrier one-shot on 2 GPUs (benchmarks/bench_fused_allreduce_rmsnorm.py,
``weave_lamport``); forced with ``LaunchOverrides(lamport=True)``."""
PIPELINE_BY_DEFAULT = True
"""Whether the rule may pick the pipelined kernel. On since the whole GPU test file passed on 2 x H200
with the pipelined kernel both forced (every dtype, CTA count and odd shape, 500 back-to-back calls
mixing kernels, CUDA-graph replay) and chosen by this rule (docs/cuda_kernel.md)."""
PIPELINE_CHUNK_TILES = 2
"""Tiles per chunk of the pipelined two-shot kernel (one release/acquire hand-off per chunk).
Measured at 32 CTAs: 2 tiles 0.260 / 0.942 ms vs 4 tiles 0.289 / 0.931 ms at 4096 / 16384 tokens."""
PIPELINE_LOAD_STAGES = 3
PIPELINED_LOADS_MIN_WORLD = 4
PIPELINED_LOADS_TILE_BYTES = 16 << 10
PIPELINED_LOADS_NUM_WARPS = 16
"""Software-pipelined loads in the pipelined kernel's tile loops (``kernels._push_chunk``): 1 loads
each tile when it is used; ``n > 1`` keeps the next ``n - 1`` tiles' loads in flight as
asynchronous copies into shared memory. The rule uses them from ``PIPELINED_LOADS_MIN_WORLD`` ranks
up: tiles of ``PIPELINED_LOADS_TILE_BYTES`` (as many per chunk as keep the chunk's rows) on
``PIPELINED_LOADS_NUM_WARPS`` warps, ``PIPELINE_LOAD_STAGES`` stages, fewer where ``n - 1`` tiles of
every tensor the reduce reads (``WORLD + 1``) would not fit ``SHARED_BYTES_PER_CTA``
(``load_stages_that_fit``: 2 at 8 ranks). Measured on one H200 with simulated ranks (8192 tokens x
8192 bf16, 32 CTAs per rank, docs/cuda_kernel.md "Pipelined loads"): at 4 ranks 0.921-0.926 ms
against 1.052 ms for the 64 KiB tile without them (1.18x against 1.34x a copy of the minimum bytes);
at 8 ranks (16 CTAs) 2.31 ms, 1.39x, where the 64 KiB tile did not finish in 75 s; at 2 ranks the
same tiles were 11 % slower (0.506 against 0.457 ms; 2 % faster only with 16-row chunks and 4 stages),
so 2 ranks keep the 64 KiB tile."""
SHARED_BYTES_PER_CTA = 200 << 10
"""Shared memory the pipelined loads may take per CTA: sm_90 gives 227 KiB; the rest is the norm's
reduction scratch and headroom (compiled for sm_90: ``scripts/kernel_resources.py``'s ``SHARED``)."""
PIPELINE_MIN_CHUNKS_PER_CTA = 8
PIPELINE_MIN_CTAS = 16
"""The pipelined kernel runs (two-shot only) when every CTA gets at least 8 chunks and the grid has
at least 16 CTAs. Measured (H=8192 bf16, 2 ranks): at 32 CTAs it is 6% faster at 4096 tokens (8
chunks per CTA) and 18% at 16384, but 10% slower at 1024 (2 chunks per CTA); at 8 CTAs it is 6% slower
at every size."""

LOCAL_TILE_BYTES = 16 << 10
LOCAL_NUM_WARPS = 8
"""A group of one rank: nothing is exchanged, so the kernel is one pass (read partial and residual,
write residual_out and normed) with no barrier and no signal slot per CTA. The grid is then one
CTA per tile of ``LOCAL_TILE_BYTES`` (one row of 8192 bf16), as many as there are tiles, as
Inductor's add + RMSNorm launches. The 32-CTA cap that the barriers of several ranks need left 100
of the 132 SMs idle here: 1.7-1.8x the four-pass HBM floor, against 1.03-1.07x uncapped
(docs/cuda_kernel.md, "Local cost")."""


@dataclass(frozen=True)
class LaunchOverrides:
    """Choices that replace the launch rule's (None: the rule decides). Benchmarks and tests pass
    them; the split's async op sets ``num_ctas`` (``WeaveConfig.split_comm_ctas``)."""

    num_ctas: int | None = None
    one_shot: bool | None = None
    tile_elements: int | None = None  # elements per tile (rows = tile_elements // next_pow2(H))
    num_warps: int | None = None
    pipelined: bool | None = None  # ignored in one-shot mode
    chunk_tiles: int | None = None  # tiles per chunk of the pipelined kernel
    lamport: bool | None = None  # Lamport one-shot (no barriers); True implies one-shot
    load_stages: int | None = None  # the pipelined kernel's software-pipelined loads (LaunchPlan.load_stages)


NO_OVERRIDES = LaunchOverrides()


@dataclass(frozen=True)
class LaunchPlan:
    """How one call runs: algorithm, grid and tile shape."""

    one_shot: bool
    num_ctas: int
    rows_per_tile: int
    block_h: int
    num_warps: int
    pipelined: bool = False  # two-shot, chunk-pipelined kernel with per-chunk counters
    chunk_rows: int = 0  # rows per chunk (pipelined only)
    push_rows: int = 0  # rows per push load/store (pipelined only)
    lamport: bool = False  # one-shot without barriers: the data is its own flag (one-shot only)
    load_stages: int = 1  # pipelined only: 1, each tile loaded when used; n, n - 1 tiles loaded ahead


def choose_launch_plan(
    num_tokens: int,
    hidden: int,
    element_size: int,
    world_size: int,
    overrides: LaunchOverrides = NO_OVERRIDES,
) -> LaunchPlan:
    """The measured rule (no per-model table).

    * one-shot iff ``(world - 1) * T * H * elem <= ONE_SHOT_MAX_BYTES``;
    * CTAs = ``clamp(owned tiles, MIN_CTAS, MAX_CTAS)``: one tile per CTA until 32 (owned rows: ``T``
      in one-shot, ``ceil(T / world)`` in two-shot). Measured: time falls with every CTA added up to
      32 at every size, because each CTA is latency-bound (one tile in flight), not link-bound;
    * a group of one rank (no peers, so no barrier slots and no residency across ranks): one CTA
      per tile of ``LOCAL_TILE_BYTES``, uncapped, ``LOCAL_NUM_WARPS`` warps (a ``num_ctas``
      override is not capped either);
    * kernel (only while ``PIPELINE_BY_DEFAULT``; else always the flat kernel): the chunk-pipelined
      two-shot kernel when two-shot, ``CTAs >= PIPELINE_MIN_CTAS`` and
      every CTA gets ``>= PIPELINE_MIN_CHUNKS_PER_CTA`` chunks of ``PIPELINE_CHUNK_TILES`` tiles (4096
      tokens and up at H=8192 bf16 on 2 ranks), else the flat kernel (one barrier per phase);
    * Lamport one-shot (only while ``LAMPORT_BY_DEFAULT``, or forced): one-shot batches of at most
      ``LAMPORT_MAX_BYTES`` per rank on 2+ ranks;
    * tile = ``LARGE_TILE_BYTES`` of rows when the owned rows fill ``MAX_CTAS`` such tiles, else
      ``SMALL_TILE_BYTES`` (at least one row of ``next_pow2(H)`` columns); warps = tile bytes / 4 KiB,
      clamped to [8, 16]. Measured: at 32 CTAs the 64 KiB tile is 14-16% faster than the 16 KiB one
      from 1024 tokens up (each CTA is latency-bound, bigger tiles keep more bytes in flight).

    A field of ``overrides`` that is not None replaces the rule's choice (benchmarks, tests).
    """
    one_shot, tile_elements, num_warps = overrides.one_shot, overrides.tile_elements, overrides.num_warps
    num_ctas, pipelined, chunk_tiles = overrides.num_ctas, overrides.pipelined, overrides.chunk_tiles
    block_h = triton_next_power_of_2(hidden)
    lamport = overrides.lamport
    fits_lamport = world_size > 1 and num_tokens * hidden * element_size <= LAMPORT_MAX_BYTES
    if lamport:
        if one_shot is False or not fits_lamport:
            raise ValueError(
                f"the Lamport kernel serves one-shot batches of at most {LAMPORT_MAX_BYTES} bytes per "
                f"rank on 2+ ranks, not {num_tokens} x {hidden} x {element_size} bytes on {world_size}"
            )
        one_shot = True
    if one_shot is None:
        one_shot = (world_size - 1) * num_tokens * hidden * element_size <= ONE_SHOT_MAX_BYTES
    owned = num_tokens if one_shot else rows_per_rank(num_tokens, world_size)
    local = world_size == 1
    if local and tile_elements is None:
        tile_elements = LOCAL_TILE_BYTES // element_size
        num_warps = LOCAL_NUM_WARPS if num_warps is None else num_warps
    if tile_elements is None:
        large = owned * block_h * element_size >= MAX_CTAS * LARGE_TILE_BYTES
        tile_elements = (LARGE_TILE_BYTES if large else SMALL_TILE_BYTES) // element_size
    rows_per_tile = max(1, tile_elements // block_h)
    if num_warps is None:
        num_warps = max(8, min(16, rows_per_tile * block_h * element_size // 4096))
    if num_ctas is None:
        num_ctas = -(-owned // rows_per_tile)
    num_ctas = max(1, num_ctas) if local else max(MIN_CTAS, min(MAX_CTAS, num_ctas))
    chunk_tiles = chunk_tiles or PIPELINE_CHUNK_TILES
    chunk_rows = rows_per_tile * chunk_tiles
    if pipelined is None:
        pipelined = (
            PIPELINE_BY_DEFAULT
            and num_ctas >= PIPELINE_MIN_CTAS
            and owned >= PIPELINE_MIN_CHUNKS_PER_CTA * num_ctas * chunk_rows
        )
    pipelined = bool(pipelined) and not one_shot
    if lamport is None:
        lamport = LAMPORT_BY_DEFAULT and one_shot and fits_lamport
    if not pipelined:
        return LaunchPlan(one_shot, num_ctas, rows_per_tile, block_h, num_warps, lamport=bool(lamport))
    load_stages = overrides.load_stages
    if load_stages is None:
        load_stages = PIPELINE_LOAD_STAGES if world_size >= PIPELINED_LOADS_MIN_WORLD else 1
        if load_stages > 1 and overrides.tile_elements is None and overrides.chunk_tiles is None:
            # the same chunk in smaller tiles, so that tiles ahead fit shared memory
            rows_per_tile = max(1, PIPELINED_LOADS_TILE_BYTES // element_size // block_h)
            while chunk_rows % rows_per_tile:
                rows_per_tile -= 1
            num_warps = overrides.num_warps or PIPELINED_LOADS_NUM_WARPS
        load_stages = load_stages_that_fit(load_stages, world_size, rows_per_tile * block_h * element_size)
    push_rows = min(chunk_rows, 2 * rows_per_tile)  # two tiles in flight per push load/store
    return LaunchPlan(one_shot, num_ctas, rows_per_tile, block_h, num_warps, True, chunk_rows, push_rows,
                      load_stages=load_stages)


def load_stages_that_fit(stages: int, world_size: int, tile_bytes: int) -> int:
    """At most ``stages``, fewer while the reduce's ``stages - 1`` tiles ahead of its ``WORLD + 1``
    tensors (``tile_bytes`` each) exceed ``SHARED_BYTES_PER_CTA``; 1 (no loads ahead) at least."""
    while stages > 1 and (world_size + 1) * tile_bytes * (stages - 1) > SHARED_BYTES_PER_CTA:
        stages -= 1
    return max(1, stages)


def triton_next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
