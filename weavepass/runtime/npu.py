"""The torch_npu adapter: the only module of weavepass that ever imports ``torch_npu``.

FlashComm on Ascend NPUs uses three torch_npu ops, all through this module:

* ``torch_npu.npu_mm_reduce_scatter_base(self, x2, hcom, world_size, *, reduce_op="sum",
  bias=None, ..., comm_turn=0, ..., comm_mode=None)``: ``reduce_scatter(self @ x2)`` over the HCCL
  group ``hcom``, the matmul and the communication pipelined inside one op (MMRS);
* ``torch_npu.npu_all_gather_base_mm(self, x2, hcom, world_size, *, bias=None, ..., gather_index=0,
  gather_output=True, comm_turn=0, ..., comm_mode=None) -> (all_gather(self) @ x2, all_gather(self))``
  (AGMM);
* ``torch_npu.npu_add_rms_norm(x1, x2, gamma, epsilon) -> (y, rstd, x)``: ``x = x1 + x2`` and
  ``y = x * rsqrt(mean(x^2, -1) + epsilon) * gamma``, in one kernel.

``torch_npu`` is imported lazily, on the first call that needs it, through ``resolve_torch_npu()``;
tests replace that function (and ``hccl_comm_name``) with an emulator bound to the real schema
strings (``weavepass.testing.npu_emulator``), so this path is verified against the package text and
CANN's documentation, not on hardware.

Which fused communication op a chip takes is a per-chip rule (``CHIPS``, read from
``torch_npu.npu.get_device_name()``); ``fused_comm_target`` resolves the chip and ``comm_mode`` once
per graph, ``matmul_comm_unsupported_reason`` checks one matmul against that target. Every rank of a
job is assumed to run on the same chip (true of every Ascend job in practice: HCCL groups do not mix
chip generations); the decision reads only that name, the config and shapes, so all ranks agree.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from weavepass.config import StrEnum
from weavepass.runtime.issue import Unsupported, register

MMRS = "npu_mm_reduce_scatter_base"
AGMM = "npu_all_gather_base_mm"
FUSED_COMM_DTYPES = (torch.float16, torch.bfloat16)
MIN_K, MAX_K = 256, 65535  # k in [256, 65535): torch_npu and CANN docs of both ops
FIELD_FAILING_WORLD_SIZE = 16
"""vllm-ascend found ``npu_mm_reduce_scatter_base`` raising at TP 16 and, on the operator
developers' advice, turns it off from 16 ranks up (vllm-ascend PR 6167/6168, 2026-01). weavepass does
the same, on every chip and for AGMM too (same MC2 family; a refusal only costs the fusion)."""
ADD_RMS_NORM_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class ChipRules:
    """What torch_npu's fused matmul + communication ops accept on one chip family."""

    family: str
    name_prefix: str
    """``torch_npu.npu.get_device_name()`` starts with this (e.g. ``Ascend910B3``)."""
    world_sizes: tuple[int, ...]
    """Documented rank counts (torch_npu / CANN docs, intersected with the wrapper's own check)."""
    comm_modes: tuple[str, ...]
    """``WeaveConfig.mmrs_comm_mode`` values the op takes here (``"none"``: the argument is not
    passed and torch_npu sends ``"ai_cpu"``)."""
    default_comm_mode: str
    """What ``"auto"`` resolves to."""
    agmm_max_gather_bytes: int | None = None
    """CANN's cap on ``m * k * itemsize * world_size`` for all-gather + matmul, where documented."""


CHIPS = (
    # A2 (910B): V1 (ai_cpu) and V2 (aiv) docs both list 2/4/8 ranks; V2 takes only "aiv".
    ChipRules("Atlas A2", "Ascend910B", (2, 4, 8), ("aiv", "ai_cpu", "none"), "aiv"),
    # A3 (910_93): V1 docs list 2..32 ranks, V2 (aiv) docs 2/4/8; 16+ is off (FIELD_FAILING_WORLD_SIZE).
    ChipRules("Atlas A3", "Ascend910_93", (2, 4, 8, 16, 32), ("aiv", "ai_cpu", "none"), "aiv"),
    # Ascend 950: torch_npu always calls V2, whose docs take only "ccu" there; 2..64 ranks documented,
    # the wrapper checks 2..32.
    ChipRules("Ascend 950", "Ascend950", (2, 4, 8, 16, 32), ("ccu",), "ccu",
              agmm_max_gather_bytes=16 * 256 * 2**20),
)


def chip_rules(device_name: str) -> ChipRules | None:
    """The rules for the chip called ``device_name``, or None for a chip weavepass has none for."""
    return next((c for c in CHIPS if device_name.startswith(c.name_prefix)), None)


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
    from weavepass.runtime.portable import resolve_group

    return hccl_comm_name(resolve_group(group_name))


class NpuIssue(StrEnum):
    """Why a torch_npu fused op cannot take a site (``fused_comm_target``,
    ``matmul_comm_unsupported_reason``, ``add_rms_norm_unsupported_reason``)."""

    NO_CHIP_NAME = "npu_no_chip_name"
    UNKNOWN_CHIP = "npu_unknown_chip"
    COMM_MODE = "npu_comm_mode"
    BIAS = "npu_bias"
    NOT_2D = "npu_not_2d"
    DTYPES = "npu_dtypes"
    WORLD_SIZE = "npu_world_size"
    WORLD_SIZE_FAILING = "npu_world_size_failing"
    INNER_DIMS = "npu_inner_dims"
    K_RANGE = "npu_k_range"
    M_NOT_DIVISIBLE = "npu_m_not_divisible"
    X1_LAYOUT = "npu_x1_layout"
    X2_LAYOUT = "npu_x2_layout"
    GATHER_BYTES = "npu_gather_bytes"
    NORM_LAYER_NORM = "npu_norm_layer_norm"
    NORM_NO_RESIDUAL = "npu_norm_no_residual"
    NORM_DTYPE = "npu_norm_dtype"
    NORM_NO_WEIGHT = "npu_norm_no_weight"
    NORM_WEIGHT_DTYPE = "npu_norm_weight_dtype"
    NORM_OUT_DTYPE = "npu_norm_out_dtype"


NPU_ISSUE_TEXT = {
    NpuIssue.NO_CHIP_NAME: "cannot read the NPU chip name: {error}",
    NpuIssue.UNKNOWN_CHIP: "chip {chip!r} is not one weavepass has fused-op rules for ({known})",
    NpuIssue.COMM_MODE: "comm_mode {mode!r} is not taken on {family} ({chip}); it takes {modes}",
    NpuIssue.BIAS: "the matmul adds a bias (addmm); {op} takes no bias",
    NpuIssue.NOT_2D: "operands are {x_dims}-D and {w_dims}-D; {op} needs 2-D (m, k) @ (k, n)",
    NpuIssue.DTYPES: "dtypes {x_dtype} @ {w_dtype}; {op} needs fp16 or bf16, both the same",
    NpuIssue.WORLD_SIZE: "world size {world} is not one of {world_sizes} documented for {op} on {family} ({chip})",
    NpuIssue.WORLD_SIZE_FAILING: ("world size {world}: {op} is off from {failing} ranks "
                                  "(vllm-ascend found npu_mm_reduce_scatter_base failing at TP 16)"),
    NpuIssue.INNER_DIMS: "inner dims differ ({k} vs {k2})",
    NpuIssue.K_RANGE: "k={k} is outside [{min_k}, {max_k})",
    NpuIssue.M_NOT_DIVISIBLE: "m={m} is not divisible by the world size {world}",
    NpuIssue.X1_LAYOUT: "x1 is a transposed or strided view (strides {stride}); {op} needs it row-major",
    NpuIssue.X2_LAYOUT: ("x2 {shape} has strides {stride}: neither contiguous nor a plain transpose, the only "
                         "layouts {op} takes"),
    NpuIssue.GATHER_BYTES: "the gather moves {bytes} bytes, over CANN's {limit} on {family}",
    NpuIssue.NORM_LAYER_NORM: "the norm is a LayerNorm (npu_add_rms_norm normalises by the root mean square only)",
    NpuIssue.NORM_NO_RESIDUAL: "no residual add",
    NpuIssue.NORM_DTYPE: "dtype {dtype} is not fp16, bf16 or fp32",
    NpuIssue.NORM_NO_WEIGHT: "the norm has no weight (gamma)",
    NpuIssue.NORM_WEIGHT_DTYPE: "norm weight is {weight_dtype}, activations {dtype}",
    NpuIssue.NORM_OUT_DTYPE: "norm output is {out_dtype}, activations {dtype}",
}
"""The sentence of each ``NpuIssue``, formatted with its fields."""
register(NPU_ISSUE_TEXT)


@dataclass(frozen=True)
class FusedCommTarget:
    """The chip and ``comm_mode`` the fused matmul + communication ops of one graph use."""

    device_name: str
    rules: ChipRules | None
    comm_mode: str
    """Resolved: never ``"auto"``."""
    reason: Unsupported | None
    """Why no fused communication op can run on this chip with this mode (None: they can)."""


def fused_comm_target(configured_mode: str) -> FusedCommTarget:
    """Read the chip name (``torch_npu.npu.get_device_name()``) and resolve ``configured_mode``."""
    try:
        name = str(resolve_torch_npu().npu.get_device_name())
    except Exception as error:  # noqa: BLE001  (any failure to read the chip turns the fusion off)
        return FusedCommTarget("", None, configured_mode, Unsupported.of(NpuIssue.NO_CHIP_NAME, error=str(error)))
    rules = chip_rules(name)
    if rules is None:
        known = ", ".join(f"{c.family} ({c.name_prefix}*)" for c in CHIPS)
        return FusedCommTarget(name, None, configured_mode,
                               Unsupported.of(NpuIssue.UNKNOWN_CHIP, chip=name, known=known))
    mode = rules.default_comm_mode if configured_mode == "auto" else configured_mode
    reason = None
    if mode not in rules.comm_modes:
        reason = Unsupported.of(NpuIssue.COMM_MODE, mode=mode, family=rules.family, chip=name,
                                modes=rules.comm_modes)
    return FusedCommTarget(name, rules, mode, reason)


def _row_major(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    (rows, cols), (s0, s1) = shape, stride
    return (cols <= 1 or s1 == 1) and (rows <= 1 or s0 == cols)


def _transposed(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """A ``.t()`` of a row-major tensor: the one non-contiguous x2 CANN takes."""
    (rows, cols), (s0, s1) = shape, stride
    return (rows <= 1 or s0 == 1) and (cols <= 1 or s1 == rows)


def matmul_comm_unsupported_reason(
    op: str,
    target: FusedCommTarget,
    x_shape: tuple[int, ...],
    x_stride: tuple[int, ...],
    x_dtype: torch.dtype,
    w_shape: tuple[int, ...],
    w_stride: tuple[int, ...],
    w_dtype: torch.dtype,
    world_size: int,
    has_bias: bool,
) -> Unsupported | None:
    """Why ``op`` (``MMRS`` or ``AGMM``) cannot take ``x @ w`` on ``target``, or None.

    torch_npu's wrapper checks (C++): 2-D operands, equal k, world size in {2, 4, 8, 16, 32}, and for
    MMRS ``m % world_size == 0``. CANN's docs add: fp16/bf16 of one dtype; ``k`` in [256, 65535);
    ``x`` (x1) row-major; ``w`` (x2) row-major or a plain transpose; no (non-zero) bias; the chip's
    rank counts and ``comm_mode``. ``x_shape`` is the op's x1: ``[T_pad, k]`` for MMRS, the shard
    ``[T_pad / N, k]`` for AGMM.
    """
    if target.reason is not None:
        return target.reason
    rules = target.rules
    if has_bias:
        return Unsupported.of(NpuIssue.BIAS, op=op)
    if len(x_shape) != 2 or len(w_shape) != 2:
        return Unsupported.of(NpuIssue.NOT_2D, x_dims=len(x_shape), w_dims=len(w_shape), op=op)
    if x_dtype not in FUSED_COMM_DTYPES or w_dtype != x_dtype:
        return Unsupported.of(NpuIssue.DTYPES, x_dtype=x_dtype, w_dtype=w_dtype, op=op)
    if world_size not in rules.world_sizes:
        return Unsupported.of(NpuIssue.WORLD_SIZE, world=world_size, world_sizes=rules.world_sizes, op=op,
                              family=rules.family, chip=target.device_name)
    if world_size >= FIELD_FAILING_WORLD_SIZE:
        return Unsupported.of(NpuIssue.WORLD_SIZE_FAILING, world=world_size, op=op, failing=FIELD_FAILING_WORLD_SIZE)
    (m, k), (k2, _n) = x_shape, w_shape
    if k != k2:
        return Unsupported.of(NpuIssue.INNER_DIMS, k=k, k2=k2)
    if not MIN_K <= k < MAX_K:
        return Unsupported.of(NpuIssue.K_RANGE, k=k, min_k=MIN_K, max_k=MAX_K)
    if op == MMRS and m % world_size:
        return Unsupported.of(NpuIssue.M_NOT_DIVISIBLE, m=m, world=world_size)
    if not _row_major(x_shape, x_stride):
        return Unsupported.of(NpuIssue.X1_LAYOUT, stride=tuple(x_stride), op=op)
    if not (_row_major(w_shape, w_stride) or _transposed(w_shape, w_stride)):
        return Unsupported.of(NpuIssue.X2_LAYOUT, shape=tuple(w_shape), stride=tuple(w_stride), op=op)
    gather_bytes = m * k * x_dtype.itemsize * world_size
    if op == AGMM and rules.agmm_max_gather_bytes and gather_bytes > rules.agmm_max_gather_bytes:
        return Unsupported.of(NpuIssue.GATHER_BYTES, bytes=gather_bytes, limit=rules.agmm_max_gather_bytes,
                              family=rules.family)
    return None


def _comm_mode_kwargs(comm_mode: str) -> dict[str, str]:
    return {} if comm_mode == "none" else {"comm_mode": comm_mode}


def mm_reduce_scatter(
    x: torch.Tensor, w: torch.Tensor, group_name: str, world_size: int, comm_mode: str
) -> torch.Tensor:
    """``reduce_scatter(x @ w, "sum")`` over the group: ``[m, k] @ [k, n] -> [m / world_size, n]``.

    ``comm_mode`` is ``FusedCommTarget.comm_mode``; ``"none"`` leaves the op's default.
    """
    return resolve_torch_npu().npu_mm_reduce_scatter_base(
        x, w, _hcom_for(group_name), world_size, reduce_op="sum", bias=None, comm_turn=0,
        **_comm_mode_kwargs(comm_mode),
    )


def all_gather_mm(
    x: torch.Tensor, w: torch.Tensor, group_name: str, world_size: int, comm_mode: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(all_gather(x) @ w, all_gather(x))``: ``[m, k], [k, n] -> [m * world_size, n], [m * world_size, k]``."""
    return resolve_torch_npu().npu_all_gather_base_mm(
        x, w, _hcom_for(group_name), world_size, bias=None, gather_index=0, gather_output=True,
        comm_turn=0, **_comm_mode_kwargs(comm_mode),
    )


def add_rms_norm(
    x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rmsnorm(x1 + x2) * gamma, x1 + x2)`` through ``npu_add_rms_norm`` (rstd is dropped)."""
    y, _rstd, x = resolve_torch_npu().npu_add_rms_norm(x1, x2, gamma, eps)
    return y, x


def add_rms_norm_unsupported_reason(
    dtype: torch.dtype, weight_dtype: torch.dtype | None, out_dtype: torch.dtype, has_residual: bool,
    layer_norm: bool = False,
) -> Unsupported | None:
    """Why the shard's add + norm cannot run as ``npu_add_rms_norm``, or None."""
    if layer_norm:
        return Unsupported(NpuIssue.NORM_LAYER_NORM)
    if not has_residual:
        return Unsupported(NpuIssue.NORM_NO_RESIDUAL)
    if dtype not in ADD_RMS_NORM_DTYPES:
        return Unsupported.of(NpuIssue.NORM_DTYPE, dtype=dtype)
    if weight_dtype is None:
        return Unsupported(NpuIssue.NORM_NO_WEIGHT)
    if weight_dtype != dtype:
        return Unsupported.of(NpuIssue.NORM_WEIGHT_DTYPE, weight_dtype=weight_dtype, dtype=dtype)
    if out_dtype != dtype:
        return Unsupported.of(NpuIssue.NORM_OUT_DTYPE, out_dtype=out_dtype, dtype=dtype)
    return None
