"""Which calls the ``cuda_symm`` lowering can serve: the checks the planner asks at compile time
(``cuda_site_unsupported_reason``) and the dispatcher repeats on a call's tensors. Asking writes
nothing: the capacity a call may use travels in the op call (``workspace_tokens``).

A check that fails returns a ``runtime.issue.Unsupported``: a ``CudaIssue`` code and its detail as
fields; code branches on the code, and ``str()`` renders the sentence (``CUDA_ISSUE_TEXT``, the one
place of these words, registered in ``runtime.issue``). The compile side reports each code as the
``ReasonCode`` of the same value (``weavepass.compile.reasons``), rendered from here."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from weavepass.config import StrEnum
from weavepass.runtime.issue import Unsupported, register
from weavepass.runtime.portable import resolve_group

if TYPE_CHECKING:
    from weavepass.runtime.cuda.quant_epilogue import QuantEpilogue

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_HIDDEN = 16384  # one row per tile lives in registers
MAX_WORLD = 8  # the kernels take per-peer addresses as 8 scalar arguments
PUSH_WORLD = 2
"""The only world size the split's push variant serves (``push_unsupported_reason``)."""


class CudaIssue(StrEnum):
    """Why the CUDA lowering (or the split's push variant) cannot serve a site or a call."""

    NOT_ON_CUDA = "cuda_not_on_cuda"
    DTYPE = "cuda_dtype"
    OUT_DTYPE = "cuda_out_dtype"
    HIDDEN_NOT_MULTIPLE = "cuda_hidden_not_multiple"
    HIDDEN_TOO_LARGE = "cuda_hidden_too_large"
    NO_TRITON = "cuda_no_triton"
    GROUP_UNRESOLVED = "cuda_group_unresolved"
    WORLD_SIZE = "cuda_world_size"
    UNAVAILABLE = "cuda_unavailable"
    """The CUDA lowering's modules do not import in this process (the compile side's check)."""
    RESIDUAL_MISMATCH = "cuda_residual_mismatch"
    WEIGHT_MISMATCH = "cuda_weight_mismatch"
    BIAS_MISMATCH = "cuda_bias_mismatch"
    QUANT_FORM = "cuda_quant_form"
    """The call's quantization is a form the kernel does not carry (``cause``: the form's words)."""
    PUSH_WORLD_SIZE = "push_world_size"


CUDA_ISSUE_TEXT = {
    CudaIssue.NOT_ON_CUDA: "tensors are on {device}, not CUDA",
    CudaIssue.DTYPE: "dtype {dtype} is not bf16, fp16 or fp32",
    CudaIssue.OUT_DTYPE: "the norm's output dtype {dtype} is not bf16, fp16 or fp32",
    CudaIssue.HIDDEN_NOT_MULTIPLE: "hidden size {hidden} is not a positive multiple of 8 (16-byte vectors)",
    CudaIssue.HIDDEN_TOO_LARGE: "hidden size {hidden} exceeds {max_hidden} (a row must fit one tile)",
    CudaIssue.NO_TRITON: "triton is not installed",
    CudaIssue.GROUP_UNRESOLVED: "process group {group!r} cannot be resolved: {error}",
    CudaIssue.WORLD_SIZE: "world size {world} is outside 1..{max_world}",
    CudaIssue.UNAVAILABLE: "CUDA lowering unavailable ({error})",
    CudaIssue.RESIDUAL_MISMATCH: "residual differs from partial in shape or device",
    CudaIssue.WEIGHT_MISMATCH: "weight is not a [hidden] tensor on partial's device",
    CudaIssue.BIAS_MISMATCH: "bias is not a [hidden] tensor on partial's device",
    CudaIssue.QUANT_FORM: "the quantization of the normed rows: {cause}",
    CudaIssue.PUSH_WORLD_SIZE: (
        "the push variant serves 2 ranks only, not {world}: it pushes every row to every peer, "
        "(N-1) S = {peers} S bytes per rank, where two-shot moves 2 (N-1)/N S = {two_shot:.2f} S"),
}
"""The sentence of each ``CudaIssue``, formatted with its fields."""
register(CUDA_ISSUE_TEXT)


def cuda_site_unsupported_reason(
    dtype: torch.dtype, hidden: int, device: torch.device, group_name: str, out_dtype: torch.dtype | None = None
) -> Unsupported | None:
    """Why the CUDA lowering cannot serve sites of this kind (compile-time form), or None.
    ``out_dtype``: the normed output's dtype (the input's when None)."""
    if torch.device(device).type != "cuda":
        return Unsupported.of(CudaIssue.NOT_ON_CUDA, device=torch.device(device).type)
    if dtype not in SUPPORTED_DTYPES:
        return Unsupported.of(CudaIssue.DTYPE, dtype=dtype)
    if out_dtype is not None and out_dtype not in SUPPORTED_DTYPES:
        return Unsupported.of(CudaIssue.OUT_DTYPE, dtype=out_dtype)
    if hidden <= 0 or hidden % 8 != 0:
        return Unsupported.of(CudaIssue.HIDDEN_NOT_MULTIPLE, hidden=hidden)
    if hidden > MAX_HIDDEN:
        return Unsupported.of(CudaIssue.HIDDEN_TOO_LARGE, hidden=hidden, max_hidden=MAX_HIDDEN)
    try:
        import triton  # noqa: F401
    except ImportError:
        return Unsupported(CudaIssue.NO_TRITON)
    try:
        world = resolve_group(group_name).size()
    except Exception as exc:  # an unknown group name is a reason, not a crash
        return Unsupported.of(CudaIssue.GROUP_UNRESOLVED, group=group_name, error=str(exc))
    # A group of one runs the same code with no peers (add + RMSNorm only): one GPU can then test
    # the launch path and measure its host cost. The plan leaves such groups alone by default
    # (WeaveConfig.min_world_size).
    if not 1 <= world <= MAX_WORLD:
        return Unsupported.of(CudaIssue.WORLD_SIZE, world=world, max_world=MAX_WORLD)
    return None


def cuda_unsupported_reason(
    partial, residual, weight, group_name: str, out_dtype: torch.dtype | None = None
) -> Unsupported | None:
    """Why the CUDA lowering cannot serve this call (run-time form, on the call's tensors), or None.
    Batch size is not checked here: a batch larger than the workspace falls back to portable."""
    hidden = partial.shape[-1] if partial.dim() else 0
    if residual is not None and (residual.shape != partial.shape or residual.device != partial.device):
        return Unsupported(CudaIssue.RESIDUAL_MISMATCH)
    if weight.shape != (hidden,) or weight.device != partial.device:
        return Unsupported(CudaIssue.WEIGHT_MISMATCH)
    return cuda_site_unsupported_reason(partial.dtype, hidden, partial.device, group_name, out_dtype)


def push_unsupported_reason(world: int) -> Unsupported | None:
    """Why the split's push variant (``WeaveConfig.split_comm="push"``,
    ``weavepass.runtime.cuda.push``) cannot serve a group of ``world`` ranks, or None. Asked by the
    split at compile time (it then keeps the fused async op, and says this) and by each call."""
    if world != PUSH_WORLD:
        return Unsupported.of(CudaIssue.PUSH_WORLD_SIZE, world=world, peers=world - 1,
                              two_shot=2 * (world - 1) / world)
    return None


FP8_CAPABILITY = (8, 9)
"""The oldest GPU with fp8 conversion instructions (Ada, sm_89)."""


def cuda_quant_epilogue(
    out_dtype: torch.dtype, hidden: int, device: torch.device, static_scale: tuple[torch.dtype, int] | None,
    group_size: int, scale_steps: str, code_steps: str, return_normed: bool,
) -> QuantEpilogue | Unsupported:
    """The kernel's form of a site's quantization (``quant_epilogue.QuantEpilogue``), or why the
    CUDA lowering does not carry it (an ``Unsupported`` of a ``quant_epilogue.QuantFormIssue``): a
    form the kernel has no program for, or fp8 codes on a GPU older than sm_89. Asked by the
    planner (the quantization then stays outside the fused op) and by each new call signature
    (then the call runs the portable lowering).
    ``static_scale``: the static scale's ``(dtype, ndim)``; None for a dynamic scale."""
    from weavepass.runtime.cuda.quant_epilogue import QuantFormIssue, plan_quant_epilogue

    epilogue = plan_quant_epilogue(out_dtype, hidden, static_scale, group_size, scale_steps, code_steps,
                                   return_normed)
    if isinstance(epilogue, Unsupported):
        return epilogue
    device = torch.device(device)
    if epilogue.code_dtype == torch.float8_e4m3fn and device.type == "cuda" and torch.cuda.is_available():
        capability = torch.cuda.get_device_capability(device)
        if capability < FP8_CAPABILITY:
            return Unsupported.of(QuantFormIssue.FP8_CAPABILITY, capability=capability)
    return epilogue
