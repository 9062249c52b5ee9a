"""CUDA lowering of ``weave.fused_allreduce_rmsnorm``: Triton kernels over PyTorch symmetric memory.

The algorithm, the memory ordering and the launch rule are described in ``docs/cuda_kernel.md`` and
in ``weavepass.runtime.cuda.kernels``. This module owns the host side: the symmetric workspace, the
one-shot/two-shot and CTA-count rule, and the fallbacks to the portable lowering.

NVLink multicast (multimem, NVLS, ``cuMulticastCreate``) is never used: the kernels only do
peer-to-peer loads, stores and atomics through unicast symmetric pointers, and this module sets
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` (and its NCCL/NVSHMEM siblings) unless the process already
chose, so that the symmetric allocator does not create a multicast object we would never use.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import warnings
from dataclasses import dataclass

for _name in ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "NCCL_NVLS_ENABLE", "NVSHMEM_DISABLE_NVLS"):
    os.environ.setdefault(_name, "0" if _name == "NCCL_NVLS_ENABLE" else "1")

import torch  # noqa: E402

from weavepass.runtime.portable import (  # noqa: E402
    fused_allreduce_rmsnorm_portable,
    resolve_group,
    rows_per_rank,
)

logger = logging.getLogger("weavepass")

DEFAULT_WORKSPACE_TOKENS = 16384
"""Largest batch (tokens) the workspace serves; with hidden ``H`` the workspace holds
``2 * DEFAULT_WORKSPACE_TOKENS * H`` elements of the partial's dtype (512 MiB at H=8192, bf16)."""

MIN_WORKSPACE_TOKENS = 256  # smallest size class: decode-only runs stay small
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_HIDDEN = 16384  # one row per tile lives in registers
MAX_WORLD = 8  # the kernels take per-peer addresses as 8 scalar arguments
MIN_CTAS, MAX_CTAS = 2, 32
SIGNAL_CHANNELS = 4  # two barriers (flat kernel) + two chunk counters (pipelined kernel)
SMALL_TILE_BYTES = 16 << 10  # one bf16 row of 8192: many tiles, so small batches still fill 32 CTAs
LARGE_TILE_BYTES = 64 << 10  # 4 bf16 rows of 8192 per tile: 4x the bytes in flight per CTA

# Launch rule, from benchmarks/bench_fused_allreduce_rmsnorm.py on 2 x H200 (docs/cuda_kernel.md):
ONE_SHOT_MAX_BYTES = 256 << 10
"""One-shot while every rank pushes at most this many bytes ((WORLD-1) * T * H * elem) to its peers.
Measured at H=8192 bf16 on 2 ranks: one-shot wins at 1 and 8 tokens (7.3 vs 7.7 us, 7.9 vs 9.1 us),
ties at 32, loses at 128 (17.6 vs 15.6 us) and beyond; 256 KiB = 16 tokens there."""
PIPELINE_BY_DEFAULT = True
"""Whether the rule may pick the pipelined kernel. On since the whole GPU test file passed on 2 x H200
with the pipelined kernel both forced (every dtype, CTA count and odd shape, 500 back-to-back calls
mixing kernels, CUDA-graph replay) and chosen by this rule (docs/cuda_kernel.md)."""
PIPELINE_CHUNK_TILES = 2
"""Tiles per chunk of the pipelined two-shot kernel (one release/acquire hand-off per chunk).
Measured at 32 CTAs: 2 tiles 0.260 / 0.942 ms vs 4 tiles 0.289 / 0.931 ms at 4096 / 16384 tokens."""
PIPELINE_MIN_CHUNKS_PER_CTA = 8
PIPELINE_MIN_CTAS = 16
"""The pipelined kernel runs (two-shot only) when every CTA gets at least 8 chunks and the grid has
at least 16 CTAs. Measured (H=8192 bf16, 2 ranks): at 32 CTAs it is 6% faster at 4096 tokens (8
chunks per CTA) and 18% at 16384, but 10% slower at 1024 (2 chunks per CTA); at 8 CTAs it is 6% slower
at every size."""


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


def choose_launch_plan(
    num_tokens: int,
    hidden: int,
    element_size: int,
    world_size: int,
    *,
    num_ctas: int | None = None,
    one_shot: bool | None = None,
    tile_elements: int | None = None,
    num_warps: int | None = None,
    pipelined: bool | None = None,
    chunk_tiles: int | None = None,
) -> LaunchPlan:
    """The measured rule (no per-model table).

    * one-shot iff ``(world - 1) * T * H * elem <= ONE_SHOT_MAX_BYTES``;
    * CTAs = ``clamp(owned tiles, MIN_CTAS, MAX_CTAS)``: one tile per CTA until 32 (owned rows: ``T``
      in one-shot, ``ceil(T / world)`` in two-shot). Measured: time falls with every CTA added up to
      32 at every size, because each CTA is latency-bound (one tile in flight), not link-bound;
    * kernel (only while ``PIPELINE_BY_DEFAULT``; else always the flat kernel): the chunk-pipelined
      two-shot kernel when two-shot, ``CTAs >= PIPELINE_MIN_CTAS`` and
      every CTA gets ``>= PIPELINE_MIN_CHUNKS_PER_CTA`` chunks of ``PIPELINE_CHUNK_TILES`` tiles (4096
      tokens and up at H=8192 bf16 on 2 ranks), else the flat kernel (one barrier per phase);
    * tile = ``LARGE_TILE_BYTES`` of rows when the owned rows fill ``MAX_CTAS`` such tiles, else
      ``SMALL_TILE_BYTES`` (at least one row of ``next_pow2(H)`` columns); warps = tile bytes / 4 KiB,
      clamped to [8, 16]. Measured: at 32 CTAs the 64 KiB tile is 14-16% faster than the 16 KiB one
      from 1024 tokens up (each CTA is latency-bound, bigger tiles keep more bytes in flight).

    ``num_ctas``, ``one_shot``, ``tile_elements``, ``num_warps``, ``pipelined`` and ``chunk_tiles``
    override the rule (benchmarks, tests); ``pipelined`` is ignored in one-shot mode.
    """
    block_h = triton_next_power_of_2(hidden)
    if one_shot is None:
        one_shot = (world_size - 1) * num_tokens * hidden * element_size <= ONE_SHOT_MAX_BYTES
    owned = num_tokens if one_shot else rows_per_rank(num_tokens, world_size)
    if tile_elements is None:
        large = owned * block_h * element_size >= MAX_CTAS * LARGE_TILE_BYTES
        tile_elements = (LARGE_TILE_BYTES if large else SMALL_TILE_BYTES) // element_size
    rows_per_tile = max(1, tile_elements // block_h)
    if num_warps is None:
        num_warps = max(8, min(16, rows_per_tile * block_h * element_size // 4096))
    if num_ctas is None:
        num_ctas = -(-owned // rows_per_tile)
    num_ctas = max(MIN_CTAS, min(MAX_CTAS, num_ctas))
    chunk_tiles = chunk_tiles or PIPELINE_CHUNK_TILES
    chunk_rows = rows_per_tile * chunk_tiles
    if pipelined is None:
        pipelined = (
            PIPELINE_BY_DEFAULT
            and num_ctas >= PIPELINE_MIN_CTAS
            and owned >= PIPELINE_MIN_CHUNKS_PER_CTA * num_ctas * chunk_rows
        )
    pipelined = bool(pipelined) and not one_shot
    if not pipelined:
        return LaunchPlan(one_shot, num_ctas, rows_per_tile, block_h, num_warps)
    push_rows = min(chunk_rows, 2 * rows_per_tile)  # two tiles in flight per push load/store
    return LaunchPlan(one_shot, num_ctas, rows_per_tile, block_h, num_warps, True, chunk_rows, push_rows)


def triton_next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def cuda_site_unsupported_reason(
    dtype: torch.dtype, hidden: int, device: torch.device, group_name: str
) -> str | None:
    """Why the CUDA lowering cannot serve sites of this kind (compile-time form), or None."""
    if torch.device(device).type != "cuda":
        return f"tensors are on {torch.device(device).type}, not CUDA"
    if dtype not in SUPPORTED_DTYPES:
        return f"dtype {dtype} is not bf16, fp16 or fp32"
    if hidden <= 0 or hidden % 8 != 0:
        return f"hidden size {hidden} is not a positive multiple of 8 (16-byte vectors)"
    if hidden > MAX_HIDDEN:
        return f"hidden size {hidden} exceeds {MAX_HIDDEN} (a row must fit one tile)"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    try:
        world = resolve_group(group_name).size()
    except Exception as exc:  # an unknown group name is a reason, not a crash
        return f"process group {group_name!r} cannot be resolved: {exc}"
    # A group of one runs the same code with no peers (add + RMSNorm only): one GPU can then test
    # the launch path and measure its host cost. The plan leaves such groups alone by default
    # (WeaveConfig.min_world_size).
    if not 1 <= world <= MAX_WORLD:
        return f"world size {world} is outside 1..{MAX_WORLD}"
    return None


def cuda_unsupported_reason(partial, residual, weight, group_name: str) -> str | None:
    """Why the CUDA lowering cannot serve this call (for the scheduler and the report), or None.

    Takes the call's tensors ``(partial, residual, weight, group_name)``; the scheduler's compile-time
    form ``(dtype, hidden, device, group_name)`` is accepted too and forwarded to
    ``cuda_site_unsupported_reason``. Batch size is not checked here: a batch larger than the
    workspace falls back at run time.
    """
    if isinstance(partial, torch.dtype):
        return cuda_site_unsupported_reason(partial, residual, weight, group_name)
    hidden = partial.shape[-1] if partial.dim() else 0
    if residual is not None and (residual.shape != partial.shape or residual.device != partial.device):
        return "residual differs from partial in shape or device"
    if weight.shape != (hidden,) or weight.device != partial.device:
        return "weight is not a [hidden] tensor on partial's device"
    return cuda_site_unsupported_reason(partial.dtype, hidden, partial.device, group_name)


@dataclass
class _Workspace:
    """One rendezvoused symmetric buffer: ``staging [capacity] | recv [capacity]`` in ``dtype``."""

    buffer: torch.Tensor  # local view of the symmetric allocation, [2 * capacity]
    pad: torch.Tensor  # local signal pad, int32
    capacity: int  # elements per region
    buffer_deltas: tuple[int, ...]  # peer address - local address, in elements, padded to MAX_WORLD
    pad_deltas: tuple[int, ...]  # the same for signal pads, in int32 slots
    rank: int
    world: int


_WORKSPACES: dict[tuple[str, torch.dtype, int], list[_Workspace]] = {}
_WARNED: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        logger.warning(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _signal_pad_bytes() -> int:
    import torch.distributed._symmetric_memory as symm_mem

    if hasattr(symm_mem, "get_signal_pad_size"):
        return symm_mem.get_signal_pad_size()
    return torch._C._distributed_c10d._SymmetricMemory.signal_pad_size


def _new_workspace(group_name: str, dtype: torch.dtype, device: torch.device, capacity: int):
    import torch.distributed._symmetric_memory as symm_mem

    if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed by older torch, deprecated later
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(group_name)
    buffer = symm_mem.empty(2 * capacity, dtype=dtype, device=device)
    handle = symm_mem.rendezvous(buffer, group_name)
    if handle.multicast_ptr != 0:  # never touched, but say so if the allocator made one anyway
        logger.warning("symmetric workspace got a multicast object; weave never uses it")
    rank, world = handle.rank, handle.world_size
    pad_slots = _signal_pad_bytes() // 4
    if pad_slots < SIGNAL_CHANNELS * MAX_CTAS * world:
        raise RuntimeError(f"signal pad of {pad_slots} slots is too small for {world} ranks")
    pad = handle.get_signal_pad(rank, [pad_slots], torch.int32)
    size = buffer.element_size()
    deltas = [(p - handle.buffer_ptrs[rank]) // size for p in handle.buffer_ptrs]
    pad_deltas = [(p - handle.signal_pad_ptrs[rank]) // 4 for p in handle.signal_pad_ptrs]
    padding = [0] * (MAX_WORLD - world)
    return _Workspace(buffer, pad, capacity, (*deltas, *padding), (*pad_deltas, *padding), rank, world)


def _outside_graph_pools(make, device: torch.device):
    """``make()`` run on a helper thread, then synchronised: what it allocates must outlive every
    CUDA graph. During a CUDA-graph tree's warm-up run Inductor sends every allocation *of the
    calling thread* into the graph's private pool and afterwards checks that nothing but the graph's
    outputs stayed alive there; the workspace and the small device tables the symmetric-memory
    rendezvous allocates stay alive by design (seen on 2 H200s: "2 tensors in the cudagraph pool
    not tracked as outputs"). Another thread allocates from the ordinary pools."""
    result: dict = {}

    def run() -> None:
        try:
            torch.cuda.set_device(device)
            result["value"] = make()
            torch.cuda.synchronize(device)  # its fills are done before any stream reads them
        except BaseException as error:  # re-raised on the calling thread
            result["error"] = error

    worker = threading.Thread(target=run, name="weave-workspace")
    worker.start()
    worker.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


def _workspace(group_name, dtype, device, needed: int, hidden: int, max_tokens: int):
    """The smallest cached workspace with ``needed`` elements per region; allocates the next size class
    (power-of-two tokens, at most ``max_tokens``) when none fits. None when the batch is too large, or
    when a new one would be needed inside CUDA-graph capture (rendezvous cannot be captured)."""
    limit = max_tokens * hidden
    if needed > limit:
        return None
    cached = _WORKSPACES.setdefault((group_name, dtype, device.index), [])
    fitting = [ws for ws in cached if ws.capacity >= needed]
    if fitting:
        return min(fitting, key=lambda ws: ws.capacity)
    if torch.cuda.is_current_stream_capturing():
        return None
    tokens = max(MIN_WORKSPACE_TOKENS, triton_next_power_of_2(-(-needed // hidden)))
    capacity = min(tokens * hidden, limit)
    ws = _outside_graph_pools(lambda: _new_workspace(group_name, dtype, device, capacity), device)
    cached.append(ws)
    return ws


@dataclass
class _Launch:
    """Everything one call of a given signature needs besides its tensors: worked out on the first
    call (validation, plan, workspace, kernel) and reused, so a call costs two output allocations
    and one launch.

    The first launch goes through Triton's ``JITFunction`` (it compiles, and specialises integer
    arguments and pointer alignment); it returns the compiled kernel, whose launcher later calls use
    directly (``_launch``). Triton's own dispatch re-derives the specialisation from every argument on
    every call, which cost more host time than the rest of the op (benchmarks/bench_host_overhead.py).
    The direct path is valid while the specialisation cannot change: the integer arguments are part
    of the call signature's key, and the tensor pointers are checked for the 16-byte alignment the
    first call saw (an unaligned call takes Triton's path, which picks its own variant)."""

    kernel: object  # triton JITFunction
    grid: tuple[int]
    tail: tuple  # ws buffer, pad, 2 x MAX_WORLD deltas, tokens, rows per rank, capacity
    meta: dict  # constexprs and num_warps
    hidden: int
    ones: torch.Tensor | None = None  # the weight of a norm without scale
    empty: bool = False  # no rows: nothing to launch
    compiled: object = None  # triton CompiledKernel, after the first launch
    constexprs: tuple = ()  # the kernel's constexpr arguments in parameter order (the launcher skips them)
    aligned: bool = True  # whether the first launch saw 16-byte aligned tensor pointers
    runtime: object = None  # triton.knobs.runtime: the launch hooks, read at every launch


_PORTABLE = "portable"
"""Cached for a call signature the kernel can never serve: later calls go straight to portable."""
_LAUNCHES: dict[tuple, _Launch | str] = {}
_ONES: dict[tuple, torch.Tensor] = {}


def _ones(hidden: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The weight of a norm without scale (multiplying by 1.0 in fp32 is exact)."""
    key = (hidden, dtype, device)
    if key not in _ONES:
        make = lambda: torch.ones(hidden, dtype=dtype, device=device)  # noqa: E731
        _ONES[key] = _outside_graph_pools(make, device) if device.type == "cuda" else make()
    return _ONES[key]


def fused_allreduce_rmsnorm_cuda(
    partial: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    eps: float,
    group_name: str,
    out_dtype: torch.dtype,
    *,
    max_workspace_tokens: int | None = None,
    num_ctas: int | None = None,
    one_shot: bool | None = None,
    tile_elements: int | None = None,
    num_warps: int | None = None,
    pipelined: bool | None = None,
    chunk_tiles: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``partial`` [..., H] -> ``(normed, residual_out)``, same math and shapes as the portable lowering.

    The partial sums are copied (pushed by the kernel) into the peers' symmetric staging buffers;
    writing the producing matmul straight into symmetric memory is a later optimisation. Outputs are
    fresh tensors, never views of the workspace, which the next call reuses. Unsupported inputs and
    batches larger than ``max_workspace_tokens`` (default ``DEFAULT_WORKSPACE_TOKENS``) run the portable
    lowering instead, with a one-time warning. A norm without weight (``weight=None``) scales by 1.

    The first call of each signature (shapes, dtypes, devices, group, options) validates and plans;
    later ones reuse that (``_LAUNCHES``): this op runs once per site and forward pass, and at small
    batches its host cost, not the kernel, sets the time (benchmarks/bench_host_overhead.py).
    """
    max_tokens = max_workspace_tokens or DEFAULT_WORKSPACE_TOKENS
    options = (num_ctas, one_shot, tile_elements, num_warps, pipelined, chunk_tiles)
    # Every property the compiled kernel depends on is in the key (the direct launch trusts it):
    # dtypes (Triton specialises on pointer types), shapes (integer arguments) and contiguity.
    key = (
        partial.shape, partial.dtype, partial.device, partial.is_contiguous(),
        None if residual is None else (residual.shape, residual.dtype, residual.device, residual.is_contiguous()),
        None if weight is None else (weight.shape, weight.dtype, weight.device, weight.is_contiguous()),
        group_name, out_dtype, max_tokens, options,
    )
    launch = _LAUNCHES.get(key)
    if launch is None:
        launch = _prepare(partial, residual, weight, group_name, out_dtype, max_tokens, *options)
        if launch is not None:
            _LAUNCHES[key] = launch
    if not isinstance(launch, _Launch):  # unsupported or no workspace: the reason was warned once
        return fused_allreduce_rmsnorm_portable(partial, residual, weight, eps, group_name, out_dtype)
    # The kernel reads rows through raw pointers: a contiguous tensor of any shape [..., H] is its
    # [T, H] matrix already (no reshape needed); others are copied once.
    rows = partial if key[3] else partial.contiguous()
    normed = torch.empty_like(rows, dtype=out_dtype)
    residual_out = torch.empty_like(rows)
    if launch.empty:
        return normed, residual_out
    if residual is None:
        res = rows
    else:
        res = residual if key[4][3] else residual.contiguous()
    if weight is None:
        w = launch.ones
    else:
        w = weight if key[5][3] else weight.contiguous()
    _launch(launch, (rows, res, w, normed, residual_out, *launch.tail, eps))
    return normed, residual_out


def _aligned(args: tuple) -> bool:
    """Whether the five tensor pointers (partial, residual, weight, outputs) are 16-byte aligned."""
    return not ((args[0].data_ptr() | args[1].data_ptr() | args[2].data_ptr()
                 | args[3].data_ptr() | args[4].data_ptr()) & 15)


def _launch(launch: _Launch, args: tuple) -> None:
    """Launch ``launch.kernel`` on ``args`` (its non-constexpr arguments, in order): straight through
    the compiled kernel's launcher when the first launch's specialisation still holds, else through
    Triton's ``JITFunction`` (which also records the compiled kernel on the first call). Launch hooks
    (profilers) get what Triton's own path gives them."""
    compiled = launch.compiled
    if compiled is not None and _DIRECT_LAUNCH and _aligned(args) == launch.aligned:
        runtime = launch.runtime
        stream = torch._C._cuda_getCurrentRawStream(args[0].device.index)
        enter = runtime.launch_enter_hook
        metadata = None if enter is None else compiled.launch_metadata(launch.grid, stream, *args)
        compiled.run(launch.grid[0], 1, 1, stream, compiled.function, compiled.packed_metadata,
                     metadata, enter, runtime.launch_exit_hook, *args, *launch.constexprs)
        return
    result = launch.kernel[launch.grid](*args, **launch.meta)
    runtime = _triton_runtime_knobs()
    if compiled is None and runtime is not None and hasattr(result, "packed_metadata"):
        names = launch.kernel.arg_names[len(args):]
        if set(names) <= set(launch.meta):  # every remaining parameter is a constexpr we pass
            launch.constexprs = tuple(launch.meta[name] for name in names)
            launch.aligned = _aligned(args)
            launch.runtime = runtime
            launch.compiled = result


_DIRECT_LAUNCH = os.environ.get("WEAVE_TRITON_DIRECT_LAUNCH", "1") != "0"
"""Debugging switch: ``WEAVE_TRITON_DIRECT_LAUNCH=0`` sends every launch through Triton's dispatch."""


@functools.cache
def _triton_runtime_knobs():
    """``triton.knobs.runtime`` (where launch hooks live), or None in a Triton without it (then
    every launch goes through Triton's dispatch)."""
    try:
        from triton import knobs
    except ImportError:
        return None
    return getattr(knobs, "runtime", None)


def _prepare(
    partial, residual, weight, group_name, out_dtype, max_tokens,
    num_ctas, one_shot, tile_elements, num_warps, pipelined, chunk_tiles,
) -> _Launch | str | None:
    """Validate a new call signature and plan its launch. ``_PORTABLE`` when the kernel cannot
    serve it; None when no workspace fits now (not cached: the batch may fit later outside
    CUDA-graph capture, or never: then the warning is not repeated)."""
    hidden = partial.shape[-1] if partial.dim() else 0
    reason = cuda_unsupported_reason(
        partial, residual, _ones(hidden, partial.dtype, partial.device) if weight is None else weight,
        group_name,
    )
    if reason is not None:
        _warn_once(reason, f"weave cuda_symm lowering falls back to portable: {reason}")
        return _PORTABLE
    if out_dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"out_dtype {out_dtype} is not bf16, fp16 or fp32")
    num_tokens = partial.numel() // hidden
    world = resolve_group(group_name).size()
    overrides = dict(
        num_ctas=num_ctas, tile_elements=tile_elements, num_warps=num_warps,
        pipelined=pipelined, chunk_tiles=chunk_tiles,
    )
    elem = partial.element_size()
    plan = choose_launch_plan(num_tokens, hidden, elem, world, one_shot=one_shot, **overrides)
    if plan.one_shot and world * num_tokens > max_tokens and one_shot is None:
        plan = choose_launch_plan(num_tokens, hidden, elem, world, one_shot=False, **overrides)
    owned = num_tokens if plan.one_shot else rows_per_rank(num_tokens, world)
    needed = max(world * owned, num_tokens) * hidden
    ws = _workspace(group_name, partial.dtype, partial.device, needed, hidden, max_tokens)
    if ws is None:
        _warn_once(
            f"capacity:{group_name}",
            f"weave cuda_symm lowering falls back to portable: {num_tokens} tokens x {hidden} need "
            f"{needed} workspace elements, more than the {max_tokens}-token workspace holds (or a new "
            "workspace would be allocated inside CUDA-graph capture); raise the workspace limit",
        )
        return None  # not cached: outside capture a later call may allocate it

    from weavepass.runtime.cuda.kernels import (
        fused_allreduce_rmsnorm_kernel,
        fused_allreduce_rmsnorm_pipelined_kernel,
    )

    if plan.pipelined:
        kernel = fused_allreduce_rmsnorm_pipelined_kernel
        variant = dict(CHUNK_ROWS=plan.chunk_rows, PUSH_ROWS=plan.push_rows)
    else:
        kernel = fused_allreduce_rmsnorm_kernel
        variant = dict(ONE_SHOT=plan.one_shot)
    meta = dict(
        RANK=ws.rank,
        WORLD=world,
        HIDDEN=hidden,
        BLOCK_H=plan.block_h,
        ROWS=plan.rows_per_tile,
        HAS_RESIDUAL=residual is not None,
        MAX_CTAS=MAX_CTAS,
        num_warps=plan.num_warps,
        **variant,
    )
    tail = (
        ws.buffer, ws.pad, *ws.buffer_deltas, *ws.pad_deltas,
        num_tokens, rows_per_rank(num_tokens, world), ws.capacity,
    )
    ones = _ones(hidden, partial.dtype, partial.device) if weight is None else None
    return _Launch(kernel, (plan.num_ctas,), tail, meta, hidden, ones, num_tokens == 0)
