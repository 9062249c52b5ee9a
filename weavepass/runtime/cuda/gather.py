"""Host side of the gather prologue (kernels: ``runtime.cuda.gather_kernels``; design and diagram:
docs/gemm_epilogue.md, "The gather prologue").

* ``push_gather_rows(ws, rows, owners)``: this owner's rows (and for the full stream its
  ``residual_out`` rows) into every rank's gather buffer, its own included, flagged per row block.
* ``gather_matmul(ws, w, owners, out)``: ``rows[T, K] @ w[N, K]^T`` over every owner's rows from the
  local gather buffer, own rows first, each tile after its row block's flag.
* ``gather_matmuls(ws, ws_list, owners)``: several weights over the same gathered rows (q, k, v or
  gate, up), one launch each, the last one releasing the slot.

The ``cuda_symm`` lowering of ``weave.all_gather_matmul`` (``runtime.cuda.gather_op``) runs these on
a symmetric workspace; ``testing.gemm_sim.SimulatedGatherRanks`` on simulated ranks;
``benchmarks/bench_gather_prologue.py`` times them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from weavepass.runtime.cuda.gemm import (
    INTERPRETER_CONFIG,
    SUPPORTED_DTYPES,
    GemmConfig,
    OwnerRows,
    _grid,
    _operands,
    descriptor_unsupported_reason,
    interpreting,
)
from weavepass.runtime.cuda.launch_plan import SMALL_TILE_BYTES, triton_next_power_of_2

SLOTS = 2
"""Gather slots per rank: call ``seq`` uses slot ``seq % 2`` (gather_kernels' docstring says why two)."""
SIGNAL_ROWS = 128
"""Rows per (owner, row block) flag: ``DEFAULT_CONFIG.block_m``, so one flag guards one row of tiles."""
DEFAULT_CONFIG = GemmConfig(128, 256, 64, 8, 3, 8, epilogue_split=2)
"""The gather GEMM's default on Hopper: the scatter's tiling, unflattened (a flattened loop would
hoist the next tile's loads above its wait), pointer stores (a TMA store is clipped at the tensor,
not at the owner's rows) in two column slices (one 128x256 slice spilled: scripts/gather_resources.py)."""
CHUNK_ROWS = 16
"""Rows per program turn of the push: a 128-row block spreads over 8 CTAs (16 store to NVLink at
232 GB/s, DEVICE-FACTS), each 16 bf16 rows of 8192 = 256 KiB per destination."""
ALIGNMENT = 8
"""Gather buffer deltas are multiples of this many elements: 16-byte vector stores in the push."""


@dataclass(frozen=True)
class PrologueLayout:
    """Sizes of one group's gather buffers and pads (the same on every rank)."""

    world: int
    hidden: int  # K of the gather GEMM: columns of the rows
    owner_capacity: int  # rows per owner at most
    parts: int = 1  # 1: the GEMM's rows; 2: also residual_out (the full residual stream)
    signal_rows: int = SIGNAL_ROWS

    @property
    def capacity(self) -> int:
        """Token rows per (slot, part) block: every owner's rows at their token index."""
        return self.world * self.owner_capacity

    @property
    def num_blocks(self) -> int:
        return -(-self.owner_capacity // self.signal_rows)

    @property
    def elements(self) -> int:
        return SLOTS * self.parts * self.capacity * self.hidden

    @property
    def pad_slots(self) -> int:
        from weavepass.runtime.cuda.gather_kernels import PAD_HEADER

        return PAD_HEADER.value + SLOTS * self.world * self.num_blocks + self.num_blocks  # FLAG, then COUNT


@dataclass(frozen=True)
class PrologueWorkspace:
    """One rank's view of the group's gather buffers and pads, with the address differences to every
    rank's (elements / int32 slots; 0 for itself) as device tables."""

    layout: PrologueLayout
    rank: int
    buffer: torch.Tensor  # [layout.elements], dtype of the rows
    pad: torch.Tensor  # int32 [layout.pad_slots], zeros when new
    deltas: torch.Tensor  # int64 [world]
    pad_deltas: torch.Tensor  # int64 [world]
    watch: int = 0  # peer_wait.record_address(), 0: no record
    timeout_ns: int = 0  # 0: wait for ever

    def rows(self, slot: int, part: int = 0) -> torch.Tensor:
        """``gather[slot][part]`` as ``[capacity, hidden]``."""
        lay = self.layout
        first = (slot * lay.parts + part) * lay.capacity * lay.hidden
        return self.buffer[first: first + lay.capacity * lay.hidden].view(lay.capacity, lay.hidden)

    def flags(self, slot: int) -> torch.Tensor:
        """``FLAG[slot]`` as ``[owner, row block]``."""
        from weavepass.runtime.cuda.gather_kernels import PAD_HEADER

        lay = self.layout
        first = PAD_HEADER.value + slot * lay.world * lay.num_blocks
        return self.pad[first: first + lay.world * lay.num_blocks].view(lay.world, lay.num_blocks)


def push_arguments(hidden: int, element_size: int, signal_rows: int) -> dict:
    """Constexprs of ``push_gather_rows_kernel``: store tiles of about ``SMALL_TILE_BYTES`` (a power
    of two), chunks of at least ``CHUNK_ROWS`` rows per program turn (both divide ``signal_rows``)."""
    block_h = triton_next_power_of_2(hidden)
    rows = max(1, min(signal_rows, SMALL_TILE_BYTES // element_size // block_h))
    rows = 1 << (rows.bit_length() - 1)
    return dict(HIDDEN=hidden, BLOCK_H=block_h, ROWS=rows, CHUNK=min(signal_rows, max(rows, CHUNK_ROWS)),
                SIGNAL_ROWS=signal_rows, num_warps=max(4, min(16, rows * block_h * element_size // 4096)))


def push_gather_rows(ws: PrologueWorkspace, rows: torch.Tensor, owners: OwnerRows,
                     extra: torch.Tensor | None = None, num_ctas: int | None = None) -> None:
    """This rank's ``rows`` (``[count, K]``, contiguous; its first ``owners.count(rank)`` rows are
    pushed, padding past them is not) into every rank's gather slot of this call at the owner's token
    rows, then the flags. ``extra``: ``residual_out`` rows of the same shape (``layout.parts == 2``).
    The gather GEMMs of the call must follow on the same stream."""
    from weavepass.runtime.cuda.gather_kernels import push_gather_rows_kernel

    lay = ws.layout
    count = owners.count(ws.rank)
    if rows.shape[0] < count or rows.shape[1] != lay.hidden or not rows.is_contiguous():
        raise ValueError(f"push rows {tuple(rows.shape)} must be contiguous [>= {count}, {lay.hidden}]")
    if count > lay.owner_capacity:
        raise ValueError(f"{count} rows exceed the gather buffer's {lay.owner_capacity} rows per owner")
    if (extra is not None) != (lay.parts == 2):
        raise ValueError(f"residual_out rows are pushed exactly when the layout has 2 parts (has {lay.parts})")
    meta = push_arguments(lay.hidden, ws.buffer.element_size(), lay.signal_rows)
    chunks = -(-count // meta["CHUNK"])
    grid = (max(1, min(num_ctas or chunks, chunks)),)
    push_gather_rows_kernel[grid](rows, rows if extra is None else extra, ws.buffer, ws.deltas, ws.pad, ws.pad_deltas,
                           owners.starts[ws.rank], count, lay.capacity, lay.num_blocks, ws.watch, ws.timeout_ns,
                           RANK=ws.rank, WORLD=lay.world, PARTS=lay.parts, **meta)


def default_config(device: torch.device) -> GemmConfig:
    return INTERPRETER_CONFIG if interpreting() or device.type != "cuda" else DEFAULT_CONFIG


def gather_matmul(ws: PrologueWorkspace, w: torch.Tensor, owners: OwnerRows, out: torch.Tensor | None = None,
                  release: bool = True, config: GemmConfig | None = None, use_descriptors: bool | None = None,
                  max_ctas: int | None = None) -> torch.Tensor:
    """``rows[T, K] @ w[N, K]^T`` (``T = owners.starts[-1]``) from this rank's gather slot of the call,
    into ``out`` ([T, N], contiguous; new if None). ``release``: the call's last gather GEMM (frees
    the slot for the owners' push two calls later); earlier ones over the same rows pass False."""
    from weavepass.runtime.cuda.gather_kernels import gather_gemm_kernel

    lay = ws.layout
    dtype = ws.buffer.dtype
    if dtype not in SUPPORTED_DTYPES or w.dtype != dtype or w.dim() != 2 or w.shape[1] != lay.hidden \
            or not w.is_contiguous():
        raise ValueError(f"w must be a contiguous [N, {lay.hidden}] {dtype} tensor; got {tuple(w.shape)} {w.dtype}")
    tokens, n = owners.starts[-1], w.shape[0]
    if len(owners.starts) != lay.world + 1 or max(owners.count(j) for j in range(lay.world)) > lay.owner_capacity:
        raise ValueError(f"row offsets {owners.starts} do not fit {lay.world} owners of {lay.owner_capacity} rows")
    out = torch.empty(tokens, n, dtype=dtype, device=w.device) if out is None else out
    if tuple(out.shape) != (tokens, n) or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{tokens}, {n}] {dtype} tensor")
    config = config or default_config(w.device)
    if lay.signal_rows % config.block_m:
        raise ValueError(f"signal rows {lay.signal_rows} are not a multiple of block_m {config.block_m}")
    if config.flatten or config.warp_specialize:
        raise ValueError("the gather GEMM's tile loop is not flattened: it would hoist a tile's loads above its wait")
    source = ws.buffer.view(SLOTS * lay.parts * lay.capacity, lay.hidden)
    if use_descriptors is None:
        use_descriptors = descriptor_unsupported_reason(source, w) is None
    a, b = _operands(source, w, config, use_descriptors)
    tiles = (-(-tokens // config.block_m) + lay.world) * -(-n // config.block_n)  # upper bound, for the grid
    if config.epilogue_split not in (1, 2):
        raise ValueError(f"the gather GEMM stores a tile in 1 or 2 column slices, not {config.epilogue_split}")
    meta = kernel_meta(config)
    gather_gemm_kernel[_grid(tiles, w.device, max_ctas)](
        a, b, out, owners.table, ws.pad, tokens, n, lay.hidden, lay.num_blocks, lay.parts * lay.capacity,
        int(release), ws.watch, ws.timeout_ns, RANK=ws.rank, WORLD=lay.world, SIGNAL_ROWS=lay.signal_rows,
        USE_DESC=use_descriptors, FENCE_PROXY=use_descriptors and not interpreting(),
        DOT_IN_FP32=interpreting() and dtype == torch.bfloat16, **meta)
    return out


def kernel_meta(config: GemmConfig) -> dict:
    """The gather GEMM's compile-time arguments from ``config``, named one by one: ``GemmConfig.meta``
    carries the scatter kernel's too (its loop, store and signal choices), which the gather kernel does
    not take, and Triton on the GPU refuses an unknown keyword where its interpreter does not."""
    return dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
                EPILOGUE_SPLIT=config.epilogue_split, num_stages=config.num_stages, num_warps=config.num_warps)


def gather_matmuls(ws: PrologueWorkspace, weights: list[torch.Tensor], owners: OwnerRows,
                   config: GemmConfig | None = None, use_descriptors: bool | None = None,
                   max_ctas: int | None = None) -> list[torch.Tensor]:
    """Every weight's ``rows @ w^T`` over the call's gathered rows, one launch each (each its own
    output, tiling and descriptors; the waits of the launches after the first are met at once), the
    last one releasing the slot."""
    return [gather_matmul(ws, w, owners, release=i == len(weights) - 1, config=config,
                          use_descriptors=use_descriptors, max_ctas=max_ctas) for i, w in enumerate(weights)]
