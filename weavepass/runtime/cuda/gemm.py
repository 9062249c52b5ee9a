"""Host side of the persistent Triton GEMM and its scatter epilogue (kernels:
``runtime.cuda.gemm_kernels``; design and diagram: docs/gemm_epilogue.md).

* ``matmul(x, w)``: ``x[M, K] @ w[N, K]^T`` (bf16/fp16, fp32 accumulation), the plain persistent GEMM.
* ``scatter_matmul(x, w, ws, owners)``: the same GEMM whose epilogue stores each tile into the
  staging buffer of the rank that owns its token rows (``ScatterWorkspace``), peers first, and signals
  each (owner, row block) once all its tiles are stored.
* ``reduce_scattered(ws, ...)``: the owner's reduce + residual add + RMSNorm over its rows, waiting per
  row block.

Loads go through host-side tensor descriptors (``triton.tools.tensor_descriptor.TensorDescriptor``,
TMA on Hopper; Triton >= 3.4; needs no ``triton.set_allocator``, which only the in-kernel
``tl.make_tensor_descriptor`` does) where ``descriptor_unsupported_reason`` finds nothing against them,
else through pointers (``use_descriptors=False`` forces that path). The plain GEMM stores through a
descriptor of ``y`` where its config says so; the scatter through one descriptor over every owner's
staging where they are one allocation (simulated ranks, a group of one: ``scatter_store_reason``),
each owner's staging a row range of it, else through pointers; either way one destination computed
from a table, so no per-owner descriptor and no branch between stores.

The ``cuda_symm`` lowering of the matmul ops (``runtime.cuda.matmul``) runs these on a symmetric
workspace; ``weavepass.testing.gemm_sim`` runs them on simulated ranks, ``benchmarks/bench_gemm.py``
times them. ``push_rows`` / ``collect_rows``: the full residual stream's gather of the owners' rows.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

import torch

from weavepass.runtime.cuda.gemm_kernels import HEADER_SLOTS
from weavepass.runtime.cuda.launch_plan import LARGE_TILE_BYTES, SMALL_TILE_BYTES, triton_next_power_of_2
from weavepass.runtime.portable import rows_per_rank

STAGING_SLOTS = 2
"""Staging slots per rank: call ``seq`` uses slot ``seq % 2`` (gemm_kernels' docstring says why two)."""
SIGNAL_ROWS = 128
"""Rows per (owner, row block) signal: the largest ``block_m`` of ``GPU_CONFIGS``, so a signal
fires after one row of tiles. The reduce waits per signal, so smaller means earlier starts but more
atomics; not measured yet."""
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class GemmConfig:
    """One tiling of ``persistent_gemm_kernel``."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_stages: int
    num_warps: int
    flatten: bool = False  # one pipelined loop over tiles and K steps (the next tile's loads overlap the epilogue)
    warp_specialize: bool = False
    epilogue_split: int = 1  # each tile stored in 1, 2 or 4 column slices (less shared memory, more stages)
    store_desc: bool = False  # stores through a tensor descriptor (TMA) where the loads use them; the
    # scatter only where scatter_store_reason finds nothing against it, else through pointers
    defer_signals: bool = True  # the scatter releases once per (CTA, owner) after its tile loop; False: the
    # first versions' release after every tile (gemm_kernels' docstring)

    def __post_init__(self) -> None:
        if self.epilogue_split not in (1, 2, 4) or self.block_n % (8 * self.epilogue_split):
            raise ValueError(f"epilogue_split {self.epilogue_split} must be 1, 2 or 4 and leave slices of at "
                             f"least 8 of block_n {self.block_n}'s columns")

    def meta(self, store_desc: bool = False) -> dict:
        return dict(BLOCK_M=self.block_m, BLOCK_N=self.block_n, BLOCK_K=self.block_k, GROUP_M=self.group_m,
                    FLATTEN=self.flatten, WARP_SPECIALIZE=self.warp_specialize, EPILOGUE_SPLIT=self.epilogue_split,
                    STORE_DESC=store_desc, DEFER_SIGNALS=self.defer_signals, num_stages=self.num_stages,
                    num_warps=self.num_warps)

    def label(self) -> str:
        """Short text, as the benchmark's CSV writes it: ``128x256x64 g8 s3 w8 flat e2 tma``."""
        loop = (" flat" if self.flatten else "") + (" ws" if self.warp_specialize else "")
        tail = ((f" e{self.epilogue_split}" if self.epilogue_split > 1 else "") + (" tma" if self.store_desc else "")
                + ("" if self.defer_signals else " tilesig"))
        return (f"{self.block_m}x{self.block_n}x{self.block_k} g{self.group_m} s{self.num_stages} "
                f"w{self.num_warps}{loop}{tail}")


GPU_CONFIGS = (
    # The plain GEMM: the tile loop flattened (the next tile's loads overlap this one's epilogue) and
    # TMA stores in two column slices, as Triton's persistent-matmul tutorial does.
    GemmConfig(128, 256, 64, 8, 3, 8, flatten=True, epilogue_split=2, store_desc=True),
    GemmConfig(128, 256, 64, 16, 3, 8, flatten=True, epilogue_split=2, store_desc=True),
    GemmConfig(128, 256, 64, 8, 4, 8, flatten=True, epilogue_split=2, store_desc=True),
    GemmConfig(128, 256, 64, 8, 4, 8, flatten=True, epilogue_split=4, store_desc=True),
    GemmConfig(128, 128, 64, 8, 4, 8, flatten=True, store_desc=True),
    GemmConfig(128, 128, 64, 8, 5, 4, flatten=True, epilogue_split=2, store_desc=True),
    GemmConfig(128, 128, 128, 8, 3, 8, flatten=True, epilogue_split=2, store_desc=True),
    GemmConfig(128, 256, 64, 8, 3, 8, epilogue_split=2, store_desc=True),
    # Unflattened with pointer stores: the first version's default and its variants, for comparison.
    GemmConfig(128, 256, 64, 8, 3, 8, epilogue_split=2),
    GemmConfig(128, 128, 64, 8, 4, 8),
    GemmConfig(128, 256, 64, 8, 3, 8),
)
"""What ``tune`` tries on a GPU (Hopper-sized tiles; a config that does not compile or fit is skipped).
128x128 tiles are there for the shapes whose 128x256 tiles leave the last wave of the 132 SMs mostly
idle (N = 7168 at 2K tokens: 448 tiles, 3.4 waves). The scatter takes the same configs
(``select_config``); it stores through the descriptor only where ``scatter_store_reason`` allows,
else through pointers."""
DEFAULT_GPU_CONFIG = GPU_CONFIGS[0]
INTERPRETER_CONFIG = GemmConfig(16, 16, 16, 2, 1, 4)
"""Tiny tiles for ``TRITON_INTERPRET=1`` (each program runs in numpy)."""

MEASURED_CONFIGS: dict[tuple[int, int, int], GemmConfig] = {
    (1280, 8192, 2048): GemmConfig(128, 256, 64, 8, 4, 8, flatten=True, epilogue_split=4, store_desc=True),
    (1280, 8192, 8192): GemmConfig(128, 128, 64, 8, 4, 8, flatten=True, store_desc=True),
    (3072, 4096, 8192): GemmConfig(128, 256, 64, 8, 4, 8, flatten=True, epilogue_split=4, store_desc=True),
    (4096, 2048, 8192): GemmConfig(128, 256, 64, 8, 4, 8, flatten=True, epilogue_split=2, store_desc=True),
    (4096, 7168, 2048): GemmConfig(128, 256, 64, 8, 4, 8, flatten=True, epilogue_split=2, store_desc=True),
    (8192, 1024, 2048): GemmConfig(128, 256, 64, 8, 4, 8, flatten=True, epilogue_split=4, store_desc=True),
    (8192, 1024, 8192): GemmConfig(128, 256, 64, 8, 4, 8, flatten=True, epilogue_split=2, store_desc=True),
    (8192, 3584, 2048): GemmConfig(128, 256, 64, 8, 4, 8, flatten=True, epilogue_split=2, store_desc=True),
    (8192, 3584, 8192): GemmConfig(128, 256, 64, 8, 4, 8, flatten=True, epilogue_split=4, store_desc=True),
    (14336, 4096, 8192): GemmConfig(128, 256, 64, 16, 3, 8, flatten=True, epilogue_split=2, store_desc=True),
}
"""The fastest plain config per ``(N, K, token bucket)`` (``token_bucket``), measured on one H200
(2026-12-04, torch 2.11 / Triton 3.6, ``bench_gemm.py --quick --repeat 2 --rep 15 --owners 1 2 8``,
then ``--table-from``: the keys whose two repeats agreed by ``bench_gemm.TABLE_RULE``; six keys were
left out, four of them at 2K: docs/gemm_epilogue.md, "Third version: measured"); shapes not in it take
``DEFAULT_GPU_CONFIG``."""


MEASURED_SPEED: dict[tuple[int, int, int], float] = {
    (4096, 2048, 8192): 0.769,
    (4096, 7168, 2048): 0.778,
    (8192, 1024, 2048): 0.585,
    (8192, 1024, 8192): 0.815,
    (8192, 3584, 2048): 0.731,
    (8192, 3584, 8192): 0.925,
}
"""cuBLAS's time / the Triton GEMM's, same keys (``do_bench`` medians over the bucket's token counts,
the median of ``bench_gemm --repeat`` rounds that agree: ``bench_gemm.TABLE_RULE``; above 1: the
Triton GEMM is faster), for the row-parallel shapes only: the scatter's time (the GEMM the op runs at
each group size: ``bench_gemm.op_scatter_owners``, the slowest owner count measured). What the
planner reads to keep cuBLAS where the op's GEMM is slower (``measured_speed``); a column-parallel
shape's plain speed is not written, since another model's row-parallel GEMM may share its (N, K)."""


def measured_speed(m: int, n: int, k: int) -> float | None:
    """``MEASURED_SPEED``'s entry for ``x[m, k] @ w[n, k]^T``, or None where the shape was not measured."""
    return MEASURED_SPEED.get((n, k, token_bucket(m)))


def token_bucket(m: int) -> int:
    """The measured token count whose config serves ``m`` rows: 2048 up to 4096, else 8192."""
    return 2048 if m <= 4096 else 8192


TOKEN_BUCKETS = (2048, 8192)
"""Every value ``token_bucket`` returns."""


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def select_config(m: int, n: int, k: int, device: torch.device) -> GemmConfig:
    """The GEMM's config for ``x[m, k] @ w[n, k]^T`` (plain and scatter): ``MEASURED_CONFIGS``' entry
    for the shape, else the default."""
    if interpreting() or device.type != "cuda":
        return INTERPRETER_CONFIG
    return MEASURED_CONFIGS.get((n, k, token_bucket(m)), DEFAULT_GPU_CONFIG)


def descriptor_unsupported_reason(*tensors: torch.Tensor, addresses: bool = True) -> str | None:
    """Why the tensor-descriptor (TMA) loads cannot serve these operands, or None. ``addresses``
    False: leave out their base addresses (``ScatterPlan``, which checks each call's)."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return "this Triton has no triton.tools.tensor_descriptor (added in Triton 3.4)"
    if not interpreting():
        if tensors[0].device.type != "cuda":
            return "tensor descriptors need a CUDA device (or TRITON_INTERPRET=1)"
        if _capability(tensors[0].device.index or 0)[0] < 9:
            return "TMA needs compute capability 9.0 or newer"
    for t in tensors:
        if (addresses and t.data_ptr() % 16) or (t.stride(0) * t.element_size()) % 16 or t.stride(-1) != 1:
            return "a TMA operand needs a 16-byte aligned base and row stride, and contiguous rows"
    return None


def owner_row_starts(num_tokens: int, world: int, counts: list[int] | None = None) -> list[int]:
    """Row offsets ``[world + 1]`` of the owners' rows: ``counts`` if given (any, zero included), else
    the fused op's split (``rows_per_rank``: owner ``j`` has ``[j*S, min((j+1)*S, T))``)."""
    if counts is None:
        per = rows_per_rank(num_tokens, world)
        counts = [max(0, min(per, num_tokens - j * per)) for j in range(world)]
    if len(counts) != world or min(counts) < 0 or sum(counts) != num_tokens:
        raise ValueError(f"row counts {counts} do not split {num_tokens} tokens among {world} owners")
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    return starts


@dataclass(frozen=True)
class ScatterLayout:
    """Sizes of one group's staging buffers and signal pads (the same on every rank)."""

    world: int
    hidden: int  # N: columns of y
    capacity: int  # rows per (slot, src) block: at least the largest owner's row count
    signal_rows: int = SIGNAL_ROWS

    @property
    def num_blocks(self) -> int:
        return -(-self.capacity // self.signal_rows)

    @property
    def staging_elements(self) -> int:
        return STAGING_SLOTS * self.world * self.capacity * self.hidden

    @property
    def pad_slots(self) -> int:
        return HEADER_SLOTS.value + self.world * self.num_blocks + STAGING_SLOTS * self.world * self.num_blocks


@dataclass(frozen=True)
class ScatterWorkspace:
    """One rank's view of the group's staging buffers and pads: its own, plus the address differences
    to every rank's (in elements / int32 slots; 0 for itself), as device tables the kernels read."""

    layout: ScatterLayout
    rank: int
    staging: torch.Tensor  # [layout.staging_elements], dtype of y
    pad: torch.Tensor  # int32 [layout.pad_slots], zeros when new
    deltas: torch.Tensor  # int64 [world]
    pad_deltas: torch.Tensor  # int64 [world]
    watch: int = 0  # peer_wait.record_address(), 0: no record
    timeout_ns: int = 0  # 0: wait for ever
    shared: torch.Tensor | None = None  # one allocation holding every rank's staging (simulated ranks, a
    # group of one), or None (peers' buffers on other devices): the scatter's TMA stores need it
    shared_rows: torch.Tensor | None = field(default=None, init=False)  # int64 [world]: row of each rank's
    # staging in ``shared`` viewed as [rows, hidden] (set from ``shared``; None where it does not hold them)
    shared_reason: str | None = field(default=None, init=False)  # why not (``shared_staging_reason``)
    _descriptors: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Once, here: it reads the address table back from the device, which a CUDA-graph capture forbids.
        why = shared_staging_reason(self)
        object.__setattr__(self, "shared_reason", why)
        if why is None:
            assert self.shared is not None
            mine = (self.staging.data_ptr() - self.shared.data_ptr()) // self.staging.element_size()
            rows = [(mine + d) // self.layout.hidden for d in self.deltas.tolist()]
            object.__setattr__(self, "shared_rows", torch.tensor(rows, dtype=torch.int64, device=self.staging.device))

    def store_descriptor(self, block_m: int, block_n: int):
        """``shared`` as ``[rows, hidden]`` behind a tensor descriptor of block ``[block_m, block_n]``,
        kept per block shape (a host object: built once, not per call)."""
        from triton.tools.tensor_descriptor import TensorDescriptor

        key = (block_m, block_n)
        if key not in self._descriptors:
            assert self.shared is not None
            y = self.shared.view(-1, self.layout.hidden)
            self._descriptors[key] = TensorDescriptor(y, list(y.shape), list(y.stride()), [block_m, block_n])
        return self._descriptors[key]

    def staged(self, src: int, rows: int, slot: int) -> torch.Tensor:
        """``staging[slot][src][:rows]`` as ``[rows, hidden]``: what ``src`` stored here."""
        lay = self.layout
        block = (slot * lay.world + src) * lay.capacity * lay.hidden
        return self.staging[block: block + rows * lay.hidden].view(rows, lay.hidden)

    def last_slot(self) -> int:
        """The slot of this rank's latest GEMM call (read from the pad: a host sync)."""
        return int(self.pad[0]) % STAGING_SLOTS


def shared_staging_reason(ws: ScatterWorkspace) -> str | None:
    """Why ``ws.shared`` cannot serve as one ``[rows, hidden]`` tensor over every rank's staging
    (each staging starting on a row of it), or None. Reads ``ws.deltas`` back from the device: the
    workspace calls it once (``ScatterWorkspace.shared_reason``)."""
    if ws.shared is None:
        return "the ranks' stagings are separate allocations (peers on other devices)"
    size, hidden = ws.staging.element_size(), ws.layout.hidden
    mine = ws.staging.data_ptr() - ws.shared.data_ptr()
    if mine % size or ws.shared.dtype != ws.staging.dtype:
        return "the staging is not an element of the shared allocation"
    starts = [mine // size + d for d in ws.deltas.tolist()]
    if any(a < 0 or a + ws.layout.staging_elements > ws.shared.numel() or a % hidden for a in starts):
        return "a rank's staging lies outside the shared allocation or does not start on a row of it"
    if ws.shared.numel() % hidden:
        return f"the shared allocation's {ws.shared.numel()} elements are not rows of {hidden}"
    if (hidden * size) % 16 or ws.shared.data_ptr() % 16:
        return "a TMA tensor needs 16-byte aligned rows and base"
    return None


def scatter_store_reason(ws: ScatterWorkspace, config: GemmConfig, use_descriptors: bool,
                         signals: bool) -> str | None:
    """Why the scatter's tiles cannot leave through one tensor descriptor (TMA stores) over every
    owner's staging (``ws.shared``), so they go through pointers; None where they can. Each owner's
    staging is a row range of that one tensor, and a tile's destination is a row offset from a table,
    as the pointer path's is an address offset."""
    if not config.store_desc:
        return "the config stores through pointers"
    if not use_descriptors:
        return "the loads do not use tensor descriptors (no TMA here)"
    if signals and not config.defer_signals:
        return ("the per-tile signals release after each tile's stores, where an asynchronous TMA store is not "
                "known complete (defer_signals releases after the loop, waiting for them)")
    if ws.shared_reason is not None:
        return ws.shared_reason
    if ws.layout.capacity % config.block_m:
        return (f"the staging's {ws.layout.capacity} rows per source are not a multiple of block_m "
                f"{config.block_m}: a TMA tile is clipped at the tensor's end only, so an owner's last tile "
                "would cross into the next source's rows")
    return None


def address_table(tensors: list[torch.Tensor], rank: int, multiple: int = 1) -> torch.Tensor:
    """int64 [len(tensors)] on ``tensors[rank]``'s device: ``tensors[j]``'s address minus
    ``tensors[rank]``'s, in elements of that tensor's dtype, each a multiple of ``multiple`` (the GEMM
    declares its staging deltas multiples of 16 elements, which keeps its epilogue stores 16-byte
    vectors)."""
    size = tensors[rank].element_size()
    deltas = [t.data_ptr() - tensors[rank].data_ptr() for t in tensors]
    if any(d % (size * multiple) for d in deltas):
        raise ValueError(f"buffer addresses {[t.data_ptr() for t in tensors]} are not {size * multiple}-byte "
                         "apart: the kernels need that alignment")
    return torch.tensor([d // size for d in deltas], dtype=torch.int64, device=tensors[rank].device)


STAGING_ALIGNMENT = 16
"""Staging deltas are multiples of this many elements (``address_table``)."""


def _operands(x: torch.Tensor, w: torch.Tensor, config: GemmConfig, use_descriptors: bool):
    if not use_descriptors:
        return x, w
    from triton.tools.tensor_descriptor import TensorDescriptor

    return (TensorDescriptor(x, list(x.shape), list(x.stride()), [config.block_m, config.block_k]),
            TensorDescriptor(w, list(w.shape), list(w.stride()), [config.block_n, config.block_k]))


def _check(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype) -> None:
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"need x [M, K] and w [N, K]; got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.dtype not in SUPPORTED_DTYPES or w.dtype != x.dtype or out_dtype != x.dtype:
        raise ValueError(f"the Triton GEMM takes bf16 or fp16 (x, w and y of one dtype); got {x.dtype}, {w.dtype}")
    if not (x.is_contiguous() and w.is_contiguous()):
        raise ValueError("the Triton GEMM reads contiguous x and w")


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)  # per call it costs microseconds of host time


def _grid(num_tiles: int, device: torch.device, max_ctas: int | None) -> tuple[int]:
    ctas = max_ctas if max_ctas else (_sm_count(device.index or 0) if device.type == "cuda" else 4)
    return (max(1, min(ctas, num_tiles)),)


def _launch(x, w, staging, starts, deltas, pad, pad_deltas, n, capacity, num_blocks, watch, timeout_ns, rank,
            world, signal_rows, config, use_descriptors, has_signals, num_tiles, max_ctas, store_desc=False,
            y_desc=None):
    """One launch of ``persistent_gemm_kernel``. ``store_desc`` with ``y_desc`` None: the plain GEMM's
    TMA stores into ``staging`` (y [M, N]); with ``y_desc``: the scatter's, ``deltas`` then holding
    each owner's staging row in it."""
    from weavepass.runtime.cuda.gemm_kernels import persistent_gemm_kernel

    grid, tail, meta = _gemm_arguments(x, staging, starts, deltas, pad, pad_deltas, n, capacity, num_blocks, watch,
                                       timeout_ns, rank, world, signal_rows, config, use_descriptors, has_signals,
                                       num_tiles, max_ctas, store_desc, y_desc)
    persistent_gemm_kernel[grid](*_operands(x, w, config, use_descriptors), *tail, **meta)


def _gemm_arguments(x, staging, starts, deltas, pad, pad_deltas, n, capacity, num_blocks, watch, timeout_ns, rank,
                    world, signal_rows, config, use_descriptors, has_signals, num_tiles, max_ctas, store_desc=False,
                    y_desc=None):
    """``(grid, tail, meta)`` of a ``persistent_gemm_kernel`` launch (``_launch``'s arguments): the
    kernel runs as ``kernel[grid](x operand, w operand, *tail, **meta)``."""
    if signal_rows % config.block_m:
        raise ValueError(f"signal rows {signal_rows} are not a multiple of block_m {config.block_m}")
    if store_desc and y_desc is None:  # the plain GEMM: staging is y [M, N]
        from triton.tools.tensor_descriptor import TensorDescriptor

        y_desc = TensorDescriptor(staging, list(staging.shape), list(staging.stride()),
                                  [config.block_m, config.block_n // config.epilogue_split])
    grid = _grid(num_tiles, x.device, max_ctas)
    tail = (staging, staging if y_desc is None else y_desc, starts, deltas, pad, pad_deltas, x.shape[0], n,
            x.shape[1], capacity, num_blocks, watch, timeout_ns)
    meta = dict(RANK=rank, WORLD=world, SIGNAL_ROWS=signal_rows, USE_DESC=use_descriptors, HAS_SIGNALS=has_signals,
                THREADS=config.num_warps * 32, GPU_FENCES=not interpreting(), **config.meta(store_desc))
    return grid, tail, meta


def _resolve(x, w, config: GemmConfig, use_descriptors) -> tuple[GemmConfig, bool]:
    if use_descriptors is None:
        use_descriptors = descriptor_unsupported_reason(x, w) is None
    elif use_descriptors and (why := descriptor_unsupported_reason(x, w)):
        raise ValueError(f"tensor descriptors asked for, but {why}")
    return config, use_descriptors


@functools.cache
def _plain_tables(m: int, device: torch.device):
    return (torch.tensor([0, m], dtype=torch.int32, device=device), torch.zeros(1, dtype=torch.int64, device=device),
            torch.zeros(1, dtype=torch.int32, device=device))


def matmul(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, config: GemmConfig | None = None,
           use_descriptors: bool | None = None, max_ctas: int | None = None) -> torch.Tensor:
    """``x[M, K] @ w[N, K]^T`` into ``out`` ([M, N], contiguous; new if None). ``config`` None:
    ``select_config``'s for the shape; ``use_descriptors`` None: TMA loads (and, where the config
    says so, TMA stores) where supported; ``max_ctas`` None: one CTA per SM (persistent)."""
    _check(x, w, x.dtype)
    m, n = x.shape[0], w.shape[0]
    config, use_descriptors = _resolve(x, w, config or select_config(m, n, x.shape[1], x.device), use_descriptors)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    if tuple(out.shape) != (m, n) or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{m}, {n}] {x.dtype} tensor; got {tuple(out.shape)} {out.dtype}")
    store_desc = use_descriptors and config.store_desc and descriptor_unsupported_reason(out) is None
    starts, deltas, pad = _plain_tables(m, x.device)
    tiles = -(-m // config.block_m) * -(-n // config.block_n)
    if m:
        _launch(x, w, out, starts, deltas, pad, deltas, n, m, 1, 0, 0, 0, 1, config.block_m, config,
                use_descriptors, False, tiles, max_ctas, store_desc)
    return out


@dataclass(frozen=True)
class OwnerRows:
    """Which rows of ``x`` each owner gets: ``starts`` (host, ``owner_row_starts``) and the same
    offsets as the int32 [world + 1] device table the GEMM reads. A CUDA graph that captured a GEMM
    keeps only the table's address: hold this object for as long as the graph is replayed
    (``testing.gemm_sim.CapturedCall`` does), or a replay reads whatever reused that memory."""

    starts: tuple[int, ...]
    table: torch.Tensor

    @staticmethod
    def build(num_tokens: int, world: int, device, counts: list[int] | None = None) -> OwnerRows:
        starts = owner_row_starts(num_tokens, world, counts)
        return OwnerRows(tuple(starts), torch.tensor(starts, dtype=torch.int32, device=device))

    def count(self, owner: int) -> int:
        return self.starts[owner + 1] - self.starts[owner]

    def rows(self, owner: int) -> slice:
        return slice(self.starts[owner], self.starts[owner + 1])


def scatter_matmul(x: torch.Tensor, w: torch.Tensor, ws: ScatterWorkspace, owners: OwnerRows,
                   config: GemmConfig | None = None, use_descriptors: bool | None = None,
                   max_ctas: int | None = None, signals: bool = True) -> None:
    """This rank's partial ``x @ w^T`` stored into the owners' staging (``ws``): owner ``j``'s rows
    ``owners.rows(j)``. ``config`` None: ``select_config``'s for the shape; its TMA stores where
    ``scatter_store_reason`` finds nothing against them, else pointer stores. ``signals=False``
    stores only (slot 0, no signal, no wait): the routing cost alone, for the benchmark; the owners'
    reduce must not run on such a call."""
    _check(x, w, ws.staging.dtype)
    lay = ws.layout
    if w.shape[0] != lay.hidden:
        raise ValueError(f"w has {w.shape[0]} rows; the staging holds {lay.hidden} columns")
    if len(owners.starts) != lay.world + 1 or owners.starts[-1] != x.shape[0]:
        raise ValueError(f"row offsets {owners.starts} do not split x's {x.shape[0]} rows among {lay.world} owners")
    if max(owners.count(j) for j in range(lay.world)) > lay.capacity:
        raise ValueError(f"row counts of {owners.starts} exceed the staging capacity of {lay.capacity} rows")
    config, use_descriptors = _resolve(x, w, config or select_config(x.shape[0], lay.hidden, x.shape[1], x.device),
                                       use_descriptors)
    from weavepass.runtime.cuda.gemm_kernels import persistent_gemm_kernel

    grid, tail, meta = _scatter_arguments(x, ws, owners, config, use_descriptors, max_ctas, signals)
    persistent_gemm_kernel[grid](*_operands(x, w, config, use_descriptors), *tail, **meta)


def _scatter_arguments(x: torch.Tensor, ws: ScatterWorkspace, owners: OwnerRows, config: GemmConfig,
                       use_descriptors: bool, max_ctas: int | None, signals: bool):
    """``(grid, tail, meta)`` of ``scatter_matmul``'s launch (``_gemm_arguments``)."""
    lay = ws.layout
    # Upper bound of the tiles (the kernel counts exactly): enough to size the persistent grid.
    tiles = (-(-x.shape[0] // config.block_m) + lay.world) * -(-lay.hidden // config.block_n)
    store_desc = scatter_store_reason(ws, config, use_descriptors, signals) is None
    deltas, y_desc = ws.deltas, None
    if store_desc:
        deltas, y_desc = ws.shared_rows, ws.store_descriptor(config.block_m, config.block_n // config.epilogue_split)
    return _gemm_arguments(x, ws.staging, owners.table, deltas, ws.pad, ws.pad_deltas, lay.hidden, lay.capacity,
                           lay.num_blocks, ws.watch, ws.timeout_ns, ws.rank, lay.world, lay.signal_rows, config,
                           use_descriptors, signals, tiles, max_ctas, store_desc, y_desc)


class ScatterPlan:
    """``scatter_matmul`` and ``reduce_scattered`` of one call signature (shapes, dtypes, workspace,
    split, eps), planned once and launched with little host work (``launcher.DirectLauncher``): the
    ``cuda_symm`` matmul op's path after its first call of a signature. At a small batch the op is
    host-bound: through Triton's dispatch its two launches and the per-call planning cost ~170 us of
    host time on the H200 host, against ~90 us of GPU time at 2048 tokens
    (benchmarks/bench_host_overhead.py, 2026-12-04).

    The config and the store path are fixed here, as ``scatter_matmul`` would choose them for a
    16-byte aligned call of the signature (whatever the first call's addresses); the TMA operands'
    descriptors are copies of the first descriptor launch's with the new bases (the shapes and
    strides are the signature's). A call whose x or w is not 16-byte aligned where the plan loads
    through descriptors launches what ``scatter_matmul`` would for it (pointer loads and stores)."""

    def __init__(self, x: torch.Tensor, w: torch.Tensor, ws: ScatterWorkspace, owners: OwnerRows, count: int,
                 eps: float, num_ctas: int, has_residual: bool) -> None:
        from weavepass.runtime.cuda.gemm_kernels import persistent_gemm_kernel, reduce_scattered_rows_kernel
        from weavepass.runtime.cuda.launcher import DirectLauncher

        _check(x, w, ws.staging.dtype)
        self.ws, self.owners = ws, owners
        # Descriptors where the signature allows them, whatever this call's addresses: an x off
        # 16-byte alignment at the first call must not send every later call through pointers.
        self.config = config = select_config(x.shape[0], ws.layout.hidden, x.shape[1], x.device)
        self.use_descriptors = descriptor_unsupported_reason(x, w, addresses=False) is None
        grid, tail, meta = _scatter_arguments(x, ws, owners, config, self.use_descriptors, None, True)
        self.gemm_launcher = DirectLauncher(persistent_gemm_kernel, grid, tail, meta)
        grid, tail, meta = _reduce_arguments(ws, count, eps, num_ctas, has_residual)
        self.reduce_launcher = DirectLauncher(reduce_scattered_rows_kernel, grid, tail, meta)
        self._templates: tuple | None = None  # the first descriptor launch's (x, w) descriptors
        self.pointer_launcher: DirectLauncher | None = None  # a descriptor plan's misaligned calls (built at the first)

    def gemm(self, x: torch.Tensor, w: torch.Tensor) -> None:
        """``scatter_matmul(x, w, ws, owners)`` for x and w of the planned signature."""
        if not self.use_descriptors:
            self.gemm_launcher.launch((x, w))
            return
        if (x.data_ptr() | w.data_ptr()) & 15:  # scatter_matmul's launch for it: pointer loads and stores
            if self.pointer_launcher is None:
                from weavepass.runtime.cuda.gemm_kernels import persistent_gemm_kernel
                from weavepass.runtime.cuda.launcher import DirectLauncher

                grid, tail, meta = _scatter_arguments(x, self.ws, self.owners, self.config, False, None, True)
                self.pointer_launcher = DirectLauncher(persistent_gemm_kernel, grid, tail, meta)
            self.pointer_launcher.launch((x, w))
            return
        if self._templates is None:
            operands = _operands(x, w, self.config, True)
            self.gemm_launcher.launch(operands)
            self._templates = tuple(_rebased(t, None) for t in operands)  # holds neither x nor w
            return
        tx, tw = self._templates
        self.gemm_launcher.launch((_rebased(tx, x), _rebased(tw, w)))

    def reduce(self, residual: torch.Tensor | None, weight: torch.Tensor, normed: torch.Tensor,
               residual_out: torch.Tensor) -> None:
        """``reduce_scattered`` of the planned count, eps and grid."""
        self.reduce_launcher.launch((self.ws.staging, self.ws.pad, residual_out if residual is None else residual,
                                     weight, normed, residual_out))


def _rebased(template, base: torch.Tensor | None):
    """A copy of the tensor descriptor ``template`` over ``base``: same shape, strides and block
    (the caller has checked that ``base`` has them and a 16-byte aligned address), without the
    constructor's checks, which cost microseconds per call."""
    desc = object.__new__(type(template))
    desc.__dict__.update(template.__dict__)
    desc.base = base
    return desc


def reduce_arguments(hidden: int, element_size: int, signal_rows: int, count: int = 0, num_ctas: int = 0) -> dict:
    """Constexprs of ``reduce_scattered_rows_kernel``: tiles of about ``LARGE_TILE_BYTES`` where the
    ``count`` rows fill ``num_ctas`` programs with such tiles, else ``SMALL_TILE_BYTES`` (the fused
    kernel's rule, ``launch_plan``), at most ``signal_rows`` rows so that no tile spans two signals.
    Each tile waits for its row block's signals before its loads, so small tiles were latency-bound:
    at 8192 rows of 8192 on one H200 the reduce took 168 us with one-row tiles against 130 us for the
    fused op's kernel over the same bytes (benchmarks/bench_host_overhead.py --kernels, 2026-12-04)."""
    block_h = triton_next_power_of_2(hidden)
    large = num_ctas > 0 and count * block_h * element_size >= num_ctas * LARGE_TILE_BYTES
    rows = max(1, min(signal_rows, (LARGE_TILE_BYTES if large else SMALL_TILE_BYTES) // element_size // block_h))
    rows = 1 << (rows.bit_length() - 1)  # a power of two, so it divides signal_rows
    # num_stages=1: no software pipelining may hoist a tile's staging loads above its wait.
    return dict(HIDDEN=hidden, BLOCK_H=block_h, ROWS=rows, SIGNAL_ROWS=signal_rows, num_stages=1,
                num_warps=max(4, min(16, rows * block_h * element_size // 4096)))


def reduce_scattered(ws: ScatterWorkspace, count: int, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float, normed: torch.Tensor, residual_out: torch.Tensor, num_ctas: int) -> None:
    """The owner's reduce of the call its GEMM made last (``scatter_matmul`` with signals): its
    ``count`` rows (``residual``, ``normed``, ``residual_out``: ``[count, hidden]``, contiguous) on
    ``num_ctas`` programs."""
    from weavepass.runtime.cuda.gemm_kernels import reduce_scattered_rows_kernel

    grid, tail, meta = _reduce_arguments(ws, count, eps, num_ctas, residual is not None)
    reduce_scattered_rows_kernel[grid](ws.staging, ws.pad, residual_out if residual is None else residual, weight,
                                       normed, residual_out, *tail, **meta)


def _reduce_arguments(ws: ScatterWorkspace, count: int, eps: float, num_ctas: int, has_residual: bool):
    """``(grid, tail, meta)`` of ``reduce_scattered``'s launch: the kernel runs as
    ``kernel[grid](staging, pad, residual, weight, normed, residual_out, *tail, **meta)``."""
    lay = ws.layout
    if lay.signal_rows & (lay.signal_rows - 1):
        raise ValueError(f"signal rows {lay.signal_rows} must be a power of two (reduce tiles divide it)")
    meta = reduce_arguments(lay.hidden, ws.staging.element_size(), lay.signal_rows, count, num_ctas)
    grid = (max(1, min(num_ctas, -(-count // meta["ROWS"]))),)
    tail = (count, lay.capacity, lay.num_blocks, ws.watch, ws.timeout_ns, eps)
    return grid, tail, dict(RANK=ws.rank, WORLD=lay.world, HAS_RESIDUAL=has_residual, **meta)


def tune(run, configs=GPU_CONFIGS, report=None) -> tuple[GemmConfig, dict]:
    """The fastest of ``configs`` for ``run(config)`` (one launch of the GEMM), by
    ``triton.testing.do_bench`` medians; a config that fails (too much shared memory, a compile error)
    is skipped and its error kept. Returns ``(best, {config: ms or error text})``; raises if every
    config failed. ``report(config, result)`` is called after each, if given."""
    from triton.testing import do_bench

    results: dict = {}
    for config in configs:
        try:
            ms = do_bench(lambda c=config: run(c), warmup=10, rep=40, return_mode="median")
        except Exception as error:  # noqa: BLE001 (any compile or launch failure disqualifies the config)
            ms = f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
        results[config] = ms
        if report is not None:
            report(config, ms)
    timed = {c: ms for c, ms in results.items() if isinstance(ms, float)}
    if not timed:
        raise RuntimeError("no GEMM config ran: " + "; ".join(f"{c}: {e}" for c, e in results.items()))
    return min(timed, key=timed.get), results


@dataclass(frozen=True)
class GatherLayout:
    """Sizes of one group's gather buffers and pads (``gemm_kernels.push_rows_kernel``'s layout)."""

    world: int
    hidden: int
    capacity: int  # tokens per (slot, output) block: the largest call's token count

    @property
    def elements(self) -> int:
        return STAGING_SLOTS * 2 * self.capacity * self.hidden

    @property
    def pad_slots(self) -> int:
        from weavepass.runtime.cuda.gemm_kernels import GATHER_HEADER

        return GATHER_HEADER.value + STAGING_SLOTS * self.world


@dataclass(frozen=True)
class GatherWorkspace:
    """One rank's view of the group's gather buffers (``[2 slots][normed, residual_out][capacity][H]``)
    and their pads, with the address differences to every rank's as device tables."""

    layout: GatherLayout
    rank: int
    buffer: torch.Tensor  # [layout.elements], dtype of the rows
    pad: torch.Tensor  # int32 [layout.pad_slots], zeros when new
    deltas: torch.Tensor  # int64 [world]
    pad_deltas: torch.Tensor  # int64 [world]
    watch: int = 0
    timeout_ns: int = 0


def copy_arguments(hidden: int, element_size: int) -> dict:
    """Constexprs of ``push_rows_kernel`` / ``collect_rows_kernel``: tiles of about ``SMALL_TILE_BYTES``."""
    block_h = triton_next_power_of_2(hidden)
    rows = max(1, SMALL_TILE_BYTES // element_size // block_h)
    rows = 1 << (rows.bit_length() - 1)
    return dict(HIDDEN=hidden, BLOCK_H=block_h, ROWS=rows,
                num_warps=max(4, min(16, rows * block_h * element_size // 4096)))


def push_rows(ws: GatherWorkspace, normed: torch.Tensor, residual_out: torch.Tensor, start: int, count: int,
              num_ctas: int) -> None:
    """Rows ``[start, start + count)`` of this rank's outputs (``[T, H]``, contiguous) into every peer's
    gather slot of this call, then the peers' flags. ``collect_rows`` must follow on the same stream."""
    from weavepass.runtime.cuda.gemm_kernels import push_rows_kernel

    lay = ws.layout
    meta = copy_arguments(lay.hidden, ws.buffer.element_size())
    grid = (max(1, min(num_ctas, -(-count // meta["ROWS"]))),)
    push_rows_kernel[grid](normed, residual_out, ws.buffer, ws.deltas, ws.pad, ws.pad_deltas, start, count,
                           lay.capacity, RANK=ws.rank, WORLD=lay.world, **meta)


def collect_rows(ws: GatherWorkspace, normed: torch.Tensor, residual_out: torch.Tensor, start: int, count: int,
                 num_ctas: int) -> None:
    """Every peer's rows of this call (waiting for their pushes, bounded) into the outputs ``[T, H]``:
    all rows but ``[start, start + count)``, this rank's own."""
    from weavepass.runtime.cuda.gemm_kernels import collect_rows_kernel

    lay = ws.layout
    meta = copy_arguments(lay.hidden, ws.buffer.element_size())
    tokens = normed.shape[0]
    grid = (max(1, min(num_ctas, -(-tokens // meta["ROWS"]))),)
    collect_rows_kernel[grid](normed, residual_out, ws.buffer, ws.pad, start, count, tokens, lay.capacity,
                              ws.watch, ws.timeout_ns, RANK=ws.rank, WORLD=lay.world, **meta)
