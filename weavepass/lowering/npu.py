"""The torch_npu adapter: the only module of weavepass that ever imports ``torch_npu``.

FlashComm on Ascend NPUs uses two torch_npu ops, both through this module:

* ``torch_npu.npu_mm_reduce_scatter_base(input, x2, hcom, world_size, *, reduce_op="sum",
  bias=None, comm_turn=0, comm_mode=...)``: ``reduce_scatter(input @ x2)`` over the HCCL group
  ``hcom``, with the matmul and the communication pipelined inside one op (MMRS).
* ``torch_npu.npu_add_rms_norm(x1, x2, gamma, epsilon) -> (y, rstd, x)``: ``x = x1 + x2`` and
  ``y = x * rsqrt(mean(x^2, -1) + epsilon) * gamma``, in one kernel.

``torch_npu`` is imported lazily, on the first call that needs it, through ``resolve_torch_npu()``;
tests replace that function (and ``hccl_comm_name``) with an emulator of the documented API
(``weavepass.testing.npu_emulator``), so this path is verified against the documentation, not on
hardware.

``mmrs_unsupported_reason`` states the documented preconditions of ``npu_mm_reduce_scatter_base``
(torch_npu / op-plugin docs): 2-D operands ``(m, k) @ (k, n)``; fp16 or bf16, both the same dtype;
``k`` in ``[256, 65535)``; ``m`` divisible by ``world_size``; ``world_size`` in {2, 4, 8, 16, 32}
(2/4/8 on Atlas A2); ``input`` not a transposed view (``x2`` may be one); no bias (the op's
``bias`` must be None in current releases); ``reduce_op="sum"`` and ``comm_turn=0`` only.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

MMRS_DTYPES = (torch.float16, torch.bfloat16)
MMRS_WORLD_SIZES = (2, 4, 8, 16, 32)
MMRS_MIN_K, MMRS_MAX_K = 256, 65535  # k in [256, 65535)
ADD_RMS_NORM_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def resolve_torch_npu() -> Any:
    """The ``torch_npu`` module (imported on first use). Tests monkeypatch this function."""
    try:
        import torch_npu  # noqa: F401  (only ever imported here)
    except ImportError as error:
        raise RuntimeError(
            "weavepass's NPU lowering needs torch_npu (with Ascend CANN); it is not importable: "
            f"{error}"
        ) from error
    return torch_npu


def hccl_comm_name(group: torch.distributed.ProcessGroup) -> str:
    """The HCCL communicator name of ``group`` that torch_npu's fused ops take as ``hcom``.

    Tests monkeypatch this function (a gloo group has no HCCL backend).
    """
    rank = torch.distributed.get_rank()
    return group._get_backend(torch.device("npu")).get_hccl_comm_name(rank)


@functools.cache
def _hcom_for(group_name: str) -> str:
    from weavepass.lowering.portable import resolve_group

    return hccl_comm_name(resolve_group(group_name))


def mmrs_unsupported_reason(
    x_shape: tuple[int, ...],
    x_stride: tuple[int, ...],
    x_dtype: torch.dtype,
    w_shape: tuple[int, ...],
    w_dtype: torch.dtype,
    world_size: int,
    has_bias: bool,
) -> str | None:
    """Why ``npu_mm_reduce_scatter_base(x, w, ...)`` cannot take these operands, or None."""
    if has_bias:
        return "the matmul adds a bias (addmm); npu_mm_reduce_scatter_base takes no bias"
    if len(x_shape) != 2 or len(w_shape) != 2:
        return f"operands are {len(x_shape)}-D and {len(w_shape)}-D; MMRS needs 2-D (m, k) @ (k, n)"
    if x_dtype not in MMRS_DTYPES or w_dtype != x_dtype:
        return f"dtypes {x_dtype} @ {w_dtype}; MMRS needs fp16 or bf16, both the same"
    if world_size not in MMRS_WORLD_SIZES:
        return f"world size {world_size} is not one of {MMRS_WORLD_SIZES}"
    (m, k), (k2, _n) = x_shape, w_shape
    if k != k2:
        return f"inner dims differ ({k} vs {k2})"
    if not MMRS_MIN_K <= k < MMRS_MAX_K:
        return f"k={k} is outside [{MMRS_MIN_K}, {MMRS_MAX_K})"
    if m % world_size:
        return f"m={m} is not divisible by the world size {world_size}"
    if x_stride[-1] != 1 or (m > 1 and x_stride[0] != k):
        return f"x1 is a transposed or strided view (strides {tuple(x_stride)}); MMRS needs it row-major"
    return None


def mm_reduce_scatter(
    x: torch.Tensor, w: torch.Tensor, group_name: str, world_size: int, comm_mode: str
) -> torch.Tensor:
    """``reduce_scatter(x @ w, "sum")`` over the group: ``[m, k] @ [k, n] -> [m / world_size, n]``.

    ``comm_mode`` is ``WeaveConfig.mmrs_comm_mode``; ``"none"`` leaves the op's default.
    """
    kwargs = {"reduce_op": "sum", "bias": None, "comm_turn": 0}
    if comm_mode != "none":
        kwargs["comm_mode"] = comm_mode
    return resolve_torch_npu().npu_mm_reduce_scatter_base(
        x, w, _hcom_for(group_name), world_size, **kwargs
    )


def add_rms_norm(
    x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rmsnorm(x1 + x2) * gamma, x1 + x2)`` through ``npu_add_rms_norm`` (rstd is dropped)."""
    y, _rstd, x = resolve_torch_npu().npu_add_rms_norm(x1, x2, gamma, eps)
    return y, x


def add_rms_norm_unsupported_reason(
    dtype: torch.dtype, weight_dtype: torch.dtype | None, out_dtype: torch.dtype, has_residual: bool
) -> str | None:
    """Why the shard's add + RMSNorm cannot run as ``npu_add_rms_norm``, or None."""
    if not has_residual:
        return "no residual add"
    if dtype not in ADD_RMS_NORM_DTYPES:
        return f"dtype {dtype} is not fp16, bf16 or fp32"
    if weight_dtype is None:
        return "the norm has no weight (gamma)"
    if weight_dtype != dtype:
        return f"norm weight is {weight_dtype}, activations {dtype}"
    if out_dtype != dtype:
        return f"norm output is {out_dtype}, activations {dtype}"
    return None
