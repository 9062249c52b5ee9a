"""Every functional ``weave`` op the rewrite puts into graphs: schemas, fakes, and the handles the
compile side emits. The kernels live in ``weavepass.runtime``; each
op here calls its kernel through a trampoline that imports it on first call, so importing this
package imports neither triton nor torch_npu, and runtime code never imports this package.

``weave.fused_allreduce_rmsnorm(partial, residual, weight, eps, group_name, out_dtype, lowering,
workspace_tokens) -> (normed, residual_out)`` replaces ``all_reduce(sum) -> [+ residual] ->
RMSNorm``: a ``weavepass.runtime.FusedLowering`` (shapes, dtypes and math there) chosen by name.
``workspace_tokens`` is the largest batch the CUDA lowering's symmetric workspace serves
(``WeaveConfig.cuda_workspace_tokens``, written into every call by the compile side, so two
backends with different sizes never share a setting); other lowerings ignore it.

``weave.fused_allreduce_rmsnorm_train(<same arguments>) -> (normed, residual_out, inv_rms)`` is the
same op for the forward graph of a training compile, where AOT autograd saves the norm's inverse
RMS for the backward graph: ``inv_rms = rsqrt(mean(x^2, -1) + eps)`` with ``x`` the upcast
``residual_out``, shape ``partial.shape[:-1] + [1]``, dtype fp32 (fp64 for fp64 inputs). It is a
separate op, so the inference op's schema, outputs and host cost stay as they are; every lowering
computes it when asked (``return_inv_rms``).

``weave.fused_allreduce_layernorm(partial, residual, weight, bias, eps, group_name, out_dtype,
lowering, workspace_tokens) -> (normed, residual_out)`` replaces ``all_reduce(sum) -> [+ residual]
-> LayerNorm`` (weight and bias optional; ``weavepass.runtime.reference.add_layernorm_local``). A
separate op with the bias after the weight, so the RMSNorm op's schema, generated calls and host
cost stay as they are; the portable and the CUDA lowering carry it (``runtime.LAYER_NORM_LOWERINGS``).

``weave.fused_allreduce_rmsnorm_quant(partial, residual, weight, eps, group_name, out_dtype,
static_scale, group_size, scale_steps, code_steps, return_normed, lowering, workspace_tokens) ->
(codes, scales, residual_out, normed)`` is the RMSNorm op followed by the FP8 / int8 quantization of
its normed rows, as the graph wrote it (``weavepass.runtime.quant``); ``normed`` is empty unless
``return_normed``. The portable and the CUDA lowering carry it (``runtime.QUANT_LOWERINGS``).

``weave.matmul_reduce_scatter_rmsnorm(x, mat2, residual, weight, eps, group_name, out_dtype, lowering,
workspace_tokens) -> (normed, residual_out)`` is the RMSNorm op with the row-parallel matmul that
makes its partial sum (``x @ mat2``) inside it (``WeaveConfig.gemm_epilogue``, docs/gemm_epilogue.md);
``weave.matmul_reduce_scatter_rmsnorm_shard(<the same>, rows_per_rank, lowering, workspace_tokens)``
is its form for FlashComm's sharded stream (the rows stay on their owner). The portable lowering
carries both (``runtime.MATMUL_LOWERINGS``).

``weave.fused_allreduce_rmsnorm_async(<same arguments>, num_ctas=0)`` and
``weave.join_async(normed, residual_out, inputs)`` are the split's fused op on a second CUDA
stream and its join: the calling stream waits for the op there, and the join's reads of the op's
inputs keep them alive until then (``weavepass.runtime.streams``);
``weave.fused_allreduce_layernorm_async(<the LayerNorm op's arguments>, num_ctas=0)`` is the same for
LayerNorm sites. ``weave.fused_allreduce_rmsnorm_push_async(<same arguments>,
num_ctas, slot)`` is the split's push variant (``WeaveConfig.split_comm="push"``): only the push
of the partial rows runs on the second stream, into staging slot ``slot`` (0 for half A, 1 for
half B), and the reduce + add + RMSNorm runs on the joining stream at the join.
``weave.check_replicated`` is the debug check of ``WeaveConfig.check_replicated``
(``weavepass.compile.replication``). ``weave.flashcomm_shard_rows`` and ``weave.npu_*`` are
FlashComm's (``weavepass.compile.strategies.flashcomm``, kernels in ``weavepass.runtime.portable``
and ``weavepass.runtime.npu``).

The ops a compiled graph calls once per site (the fused ops and ``join_async``) are registered
with ``define_hot_op``: a schema and one ``CompositeExplicitAutograd`` kernel, without
``torch.library.custom_op``'s Python autograd wrapper and per-call alias checks. Measured on the CPU
dev machine: 8.8 us per call against 24.9 us, where the body itself costs 2.3 us. They are
inference ops (no backward). The others (debug check, FlashComm) are ``custom_op``s.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch._ops import OpOverload

_LIB = torch.library.Library("weave", "FRAGMENT")


HOT_OP_KERNELS: dict[OpOverload, str] = {}
"""Every hot op's default overload -> its kernel, ``"module:function"`` in ``weavepass.runtime``.
Compiled graphs call that function directly, not through the dispatcher
(``weavepass.compile.direct_calls``)."""


def define_hot_op(name: str, schema: str, kernel: str, fake: Callable[..., Any]) -> OpOverload:
    """Define ``weave::<name><schema>`` with the runtime function ``kernel`` (``"module:function"``)
    for every device and ``fake`` for tracing; returns the op's default overload. For functional
    ops called once per site at run time."""
    _LIB.define(name + schema)
    _LIB.impl(name, _runtime(kernel), "CompositeExplicitAutograd")
    torch.library.register_fake(f"weave::{name}", fake, lib=_LIB)
    op: OpOverload = getattr(torch.ops.weave, name).default
    HOT_OP_KERNELS[op] = kernel
    return op


def _runtime(path: str) -> Callable[..., Any]:
    """A kernel that calls the runtime function ``"module:function"``, imported on its first call
    (then one extra Python call per op call)."""
    module_name, attr = path.split(":")
    target: list[Callable[..., Any]] = []

    def kernel(*args: Any) -> Any:
        if not target:
            target.append(getattr(importlib.import_module(module_name), attr))
        return target[0](*args)

    kernel.__name__ = attr
    return kernel


FUSED_SCHEMA_ARGS = (
    "Tensor partial, Tensor? residual, Tensor? weight, float eps, str group_name, "
    "ScalarType out_dtype, str lowering, int workspace_tokens"
)


Fake = tuple[torch.Tensor, ...]
"""What a fake implementation returns: the op's outputs, as empty tensors of their shapes and dtypes."""


def _fake(partial: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None, eps: float,
          group_name: str, out_dtype: torch.dtype, *_: object) -> Fake:
    return partial.new_empty(partial.shape, dtype=out_dtype), partial.new_empty(partial.shape)


def _fake_train(partial: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None, eps: float,
                group_name: str, out_dtype: torch.dtype, *_: object) -> Fake:
    from weavepass.runtime.reference import accumulation_dtype

    inv_rms = partial.new_empty((*partial.shape[:-1], 1), dtype=accumulation_dtype(partial.dtype))
    return (*_fake(partial, residual, weight, eps, group_name, out_dtype), inv_rms)


FUSED_ALLREDUCE_RMSNORM = define_hot_op(
    "fused_allreduce_rmsnorm", f"({FUSED_SCHEMA_ARGS}) -> (Tensor, Tensor)",
    "weavepass.runtime:fused_allreduce_rmsnorm", _fake,
)
FUSED_ALLREDUCE_RMSNORM_TRAIN = define_hot_op(
    "fused_allreduce_rmsnorm_train", f"({FUSED_SCHEMA_ARGS}) -> (Tensor, Tensor, Tensor)",
    "weavepass.runtime:fused_allreduce_rmsnorm_train", _fake_train,
)
FUSED_ALLREDUCE_RMSNORM_ASYNC = define_hot_op(
    "fused_allreduce_rmsnorm_async", f"({FUSED_SCHEMA_ARGS}, int num_ctas=0) -> (Tensor, Tensor)",
    "weavepass.runtime.streams:fused_allreduce_rmsnorm_async", _fake,
)
FUSED_ALLREDUCE_RMSNORM_PUSH_ASYNC = define_hot_op(
    "fused_allreduce_rmsnorm_push_async", f"({FUSED_SCHEMA_ARGS}, int num_ctas, int slot) -> (Tensor, Tensor)",
    "weavepass.runtime.streams:fused_allreduce_rmsnorm_push_async", _fake,
)
LAYERNORM_SCHEMA_ARGS = (
    "Tensor partial, Tensor? residual, Tensor? weight, Tensor? bias, float eps, str group_name, "
    "ScalarType out_dtype, str lowering, int workspace_tokens"
)


def _fake_layer_norm(partial: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None,
                     bias: torch.Tensor | None, eps: float, group_name: str, out_dtype: torch.dtype,
                     *_: object) -> Fake:
    return _fake(partial, residual, weight, eps, group_name, out_dtype)


FUSED_ALLREDUCE_LAYERNORM = define_hot_op(
    "fused_allreduce_layernorm", f"({LAYERNORM_SCHEMA_ARGS}) -> (Tensor, Tensor)",
    "weavepass.runtime:fused_allreduce_layernorm", _fake_layer_norm,
)
FUSED_ALLREDUCE_LAYERNORM_ASYNC = define_hot_op(
    "fused_allreduce_layernorm_async", f"({LAYERNORM_SCHEMA_ARGS}, int num_ctas=0) -> (Tensor, Tensor)",
    "weavepass.runtime.streams:fused_allreduce_layernorm_async", _fake_layer_norm,
)
QUANT_SCHEMA_ARGS = (
    "Tensor partial, Tensor? residual, Tensor? weight, float eps, str group_name, ScalarType out_dtype, "
    "Tensor? static_scale, int group_size, str scale_steps, str code_steps, bool return_normed, "
    "str lowering, int workspace_tokens"
)


def _fake_quant(partial: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None, eps: float,
                group_name: str, out_dtype: torch.dtype, static_scale: torch.Tensor | None, group_size: int,
                scale_steps: str, code_steps: str, return_normed: bool, *_: object) -> Fake:
    from weavepass.runtime.quant import quantize_rows

    normed = partial.new_empty(partial.shape, dtype=out_dtype)
    codes, scales = quantize_rows(normed, static_scale, group_size, scale_steps, code_steps)
    return (codes, scales.clone(), partial.new_empty(partial.shape),
            normed if return_normed else partial.new_empty((0,), dtype=out_dtype))


FUSED_ALLREDUCE_RMSNORM_QUANT = define_hot_op(
    "fused_allreduce_rmsnorm_quant", f"({QUANT_SCHEMA_ARGS}) -> (Tensor, Tensor, Tensor, Tensor)",
    "weavepass.runtime:fused_allreduce_rmsnorm_quant", _fake_quant,
)
"""``weave.fused_allreduce_rmsnorm_quant``: the RMSNorm op whose normed rows are quantized
(``weavepass.runtime.quant``: ``static_scale`` or the dynamic ``scale_steps``, per group of
``group_size`` or per row, then ``code_steps``). Returns ``(codes, scales, residual_out, normed)``;
``normed`` is empty unless ``return_normed`` (something besides the quantization reads it)."""
MATMUL_SCHEMA_ARGS = (
    "Tensor x, Tensor mat2, Tensor? residual, Tensor? weight, float eps, str group_name, ScalarType out_dtype"
)


def _fake_matmul(x: torch.Tensor, mat2: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None,
                 eps: float, group_name: str, out_dtype: torch.dtype, *_: object) -> Fake:
    rows = (x.shape[0], mat2.shape[1])
    return x.new_empty(rows, dtype=out_dtype), x.new_empty(rows)


def _fake_matmul_shard(x: torch.Tensor, mat2: torch.Tensor, residual: torch.Tensor | None,
                       weight: torch.Tensor | None, eps: float, group_name: str, out_dtype: torch.dtype,
                       rows_per_rank: int, *_: object) -> Fake:
    rows = (rows_per_rank, mat2.shape[1])
    return x.new_empty(rows, dtype=out_dtype), x.new_empty(rows)


MATMUL_REDUCE_SCATTER_RMSNORM = define_hot_op(
    "matmul_reduce_scatter_rmsnorm",
    f"({MATMUL_SCHEMA_ARGS}, str lowering, int workspace_tokens) -> (Tensor, Tensor)",
    "weavepass.runtime:matmul_reduce_scatter_rmsnorm", _fake_matmul,
)
"""``weave.matmul_reduce_scatter_rmsnorm``: the RMSNorm op with the row-parallel matmul that makes
its partial sum inside it (``WeaveConfig.gemm_epilogue``): ``x [T, K] @ mat2 [K, H]`` (``mat2`` as
``aten.mm`` takes it: the transposed linear weight) is each rank's partial, rounded to ``x.dtype``
as the matmul's output was; then the fused op's math (``weavepass.runtime.reference``). ``residual``
holds ``T x H`` elements in row order (None: no residual add). Returns ``(normed, residual_out)``,
both ``[T, H]``."""
MATMUL_REDUCE_SCATTER_RMSNORM_SHARD = define_hot_op(
    "matmul_reduce_scatter_rmsnorm_shard",
    f"({MATMUL_SCHEMA_ARGS}, int rows_per_rank, str lowering, int workspace_tokens) -> (Tensor, Tensor)",
    "weavepass.runtime:matmul_reduce_scatter_rmsnorm_shard", _fake_matmul_shard,
)
"""``weave.matmul_reduce_scatter_rmsnorm_shard``: the same for FlashComm's sharded residual stream:
the partials' rows zero-padded to ``rows_per_rank x N``, this rank's ``rows_per_rank`` rows of
their sum, ``residual`` (None, or this rank's ``[rows_per_rank, H]`` shard of the stream) added and
the rows normalised there. Returns ``(normed, residual_out)``, both ``[rows_per_rank, H]``: nothing
is gathered."""
def _fake_all_gather_matmul(shard: torch.Tensor, mat2s: list[torch.Tensor], group_name: str, num_tokens: int,
                            *_: object) -> list[torch.Tensor]:
    return [shard.new_empty((num_tokens, mat2.shape[1])) for mat2 in mat2s]


_LIB.define("all_gather_matmul(Tensor shard, Tensor[] mat2s, str group_name, SymInt num_tokens, str lowering, "
            "int workspace_tokens) -> Tensor[]")
_LIB.impl("all_gather_matmul", _runtime("weavepass.runtime:all_gather_matmul"), "CompositeExplicitAutograd")
torch.library.register_fake("weave::all_gather_matmul", _fake_all_gather_matmul, lib=_LIB)
ALL_GATHER_MATMUL: OpOverload = torch.ops.weave.all_gather_matmul.default
"""``weave.all_gather_matmul``: FlashComm's all_gather of a site's normed shard and the
column-parallel matmuls that read the gathered rows (QKV, gate_up), in one op: every rank's
``shard`` ``[R, K]`` in rank order, the first ``num_tokens`` rows, times each ``mat2s[i]``
(``[K, N_i]``, as ``aten.mm`` takes it). Returns ``[num_tokens, N_i]`` per matmul. Not a hot op
(``define_hot_op``): its output is a list, which the direct-call renaming was never checked with;
it is called through the dispatcher."""


ASYNC_FUSED_OPS = (FUSED_ALLREDUCE_RMSNORM_ASYNC, FUSED_ALLREDUCE_RMSNORM_PUSH_ASYNC, FUSED_ALLREDUCE_LAYERNORM_ASYNC)
"""The split's async fused ops: ``JOIN_ASYNC`` on both outputs and the inputs comes before the first
read of either output."""

JOIN_ASYNC = define_hot_op(
    "join_async", "(Tensor(a!) normed, Tensor(b!) residual_out, Tensor[] inputs) -> ()",
    "weavepass.runtime.streams:join_async", lambda normed, residual_out, inputs: None,
)
"""The join of an async fused op (``weavepass.runtime.streams.join_async``): both outputs, declared
mutated so that Inductor orders every later read of them after it (and never drops it), and the
op's inputs, read here last so that Inductor keeps their buffers until the communication stream is
done with them."""


# ------------------------------------------------------------------ debug check (not per-call hot)


@torch.library.custom_op("weave::check_replicated", mutates_args=())
def _check_replicated(x: torch.Tensor, weight: torch.Tensor | None, x_name: str, site: str,
                      group_name: str, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Raise ``ReplicationError`` unless ``x``, ``weight`` and ``bias`` (a LayerNorm's) are the
    same on every rank of the group; returns a copy of ``x``
    (``weavepass.runtime.replication.check_replicated``)."""
    from weavepass.runtime.replication import check_replicated

    return check_replicated(x, weight, x_name, site, group_name, bias)


@_check_replicated.register_fake
def _(x: torch.Tensor, weight: torch.Tensor | None, x_name: str, site: str, group_name: str,
      bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.empty_like(x)


CHECK_REPLICATED = torch.ops.weave.check_replicated.default


# ------------------------------------------------------------------ FlashComm


@torch.library.custom_op("weave::flashcomm_shard_rows", mutates_args=())
def _flashcomm_shard_rows(x: torch.Tensor, padded_tokens: int, world_size: int,
                          group_name: str) -> torch.Tensor:
    """This rank's rows of ``x`` [T, H] zero-padded to [padded_tokens, H]: ``[padded_tokens / N, H]``
    (``weavepass.runtime.portable.shard_rows``)."""
    from weavepass.runtime.portable import shard_rows

    return shard_rows(x, padded_tokens, world_size, group_name)


@_flashcomm_shard_rows.register_fake
def _(x: torch.Tensor, padded_tokens: int, world_size: int, group_name: str) -> torch.Tensor:
    return x.new_empty((padded_tokens // world_size, x.shape[1]))


@torch.library.custom_op("weave::npu_mm_reduce_scatter", mutates_args=())
def _npu_mm_reduce_scatter(x: torch.Tensor, w: torch.Tensor, group_name: str, world_size: int,
                           comm_mode: str) -> torch.Tensor:
    """``reduce_scatter(x @ w)``: ``[m, k] @ [k, n] -> [m / N, n]`` via ``npu_mm_reduce_scatter_base``."""
    from weavepass.runtime import npu

    return npu.mm_reduce_scatter(x, w, group_name, world_size, comm_mode)


@_npu_mm_reduce_scatter.register_fake
def _(x: torch.Tensor, w: torch.Tensor, group_name: str, world_size: int, comm_mode: str) -> torch.Tensor:
    return x.new_empty((x.shape[0] // world_size, w.shape[1]))


@torch.library.custom_op("weave::npu_all_gather_mm", mutates_args=())
def _npu_all_gather_mm(x: torch.Tensor, w: torch.Tensor, group_name: str, world_size: int,
                       comm_mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(all_gather(x) @ w, all_gather(x))``: ``[R, k], [k, n] -> [R N, n], [R N, k]`` via
    ``npu_all_gather_base_mm``."""
    from weavepass.runtime import npu

    return npu.all_gather_mm(x, w, group_name, world_size, comm_mode)


@_npu_all_gather_mm.register_fake
def _(x: torch.Tensor, w: torch.Tensor, group_name: str, world_size: int,
      comm_mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    rows = x.shape[0] * world_size
    return x.new_empty((rows, w.shape[1])), x.new_empty((rows, x.shape[1]))


@torch.library.custom_op("weave::npu_add_rms_norm", mutates_args=())
def _npu_add_rms_norm(x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rmsnorm(x1 + x2) * gamma, x1 + x2)`` via ``npu_add_rms_norm``; all ``[R, H]`` but gamma [H]."""
    from weavepass.runtime import npu

    return npu.add_rms_norm(x1, x2, gamma, eps)


@_npu_add_rms_norm.register_fake
def _(x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return x1.new_empty(x1.shape), x1.new_empty(x1.shape)


FLASHCOMM_SHARD_ROWS = torch.ops.weave.flashcomm_shard_rows.default
NPU_MM_REDUCE_SCATTER = torch.ops.weave.npu_mm_reduce_scatter.default
NPU_ALL_GATHER_MM = torch.ops.weave.npu_all_gather_mm.default
NPU_ADD_RMS_NORM = torch.ops.weave.npu_add_rms_norm.default
