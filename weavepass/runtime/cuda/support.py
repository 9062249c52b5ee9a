"""Which calls the ``cuda_symm`` lowering can serve: the checks the planner asks at compile time
(``cuda_site_unsupported_reason``) and the dispatcher repeats on a call's tensors. Asking writes
nothing: the capacity a call may use travels in the op call (``workspace_tokens``)."""

from __future__ import annotations

import torch

from weavepass.runtime.portable import resolve_group

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_HIDDEN = 16384  # one row per tile lives in registers
MAX_WORLD = 8  # the kernels take per-peer addresses as 8 scalar arguments
PUSH_WORLD = 2
"""The only world size the split's push variant serves (``push_unsupported_reason``)."""


def cuda_site_unsupported_reason(
    dtype: torch.dtype, hidden: int, device: torch.device, group_name: str, out_dtype: torch.dtype | None = None
) -> str | None:
    """Why the CUDA lowering cannot serve sites of this kind (compile-time form), or None.
    ``out_dtype``: the normed output's dtype (the input's when None)."""
    if torch.device(device).type != "cuda":
        return f"tensors are on {torch.device(device).type}, not CUDA"
    if dtype not in SUPPORTED_DTYPES:
        return f"dtype {dtype} is not bf16, fp16 or fp32"
    if out_dtype is not None and out_dtype not in SUPPORTED_DTYPES:
        return f"the norm's output dtype {out_dtype} is not bf16, fp16 or fp32"
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


def cuda_unsupported_reason(
    partial, residual, weight, group_name: str, out_dtype: torch.dtype | None = None
) -> str | None:
    """Why the CUDA lowering cannot serve this call (run-time form, on the call's tensors), or None.
    Batch size is not checked here: a batch larger than the workspace falls back to portable."""
    hidden = partial.shape[-1] if partial.dim() else 0
    if residual is not None and (residual.shape != partial.shape or residual.device != partial.device):
        return "residual differs from partial in shape or device"
    if weight.shape != (hidden,) or weight.device != partial.device:
        return "weight is not a [hidden] tensor on partial's device"
    return cuda_site_unsupported_reason(partial.dtype, hidden, partial.device, group_name, out_dtype)


def push_unsupported_reason(world: int) -> str | None:
    """Why the split's push variant (``WeaveConfig.split_comm="push"``,
    ``weavepass.runtime.cuda.push``) cannot serve a group of ``world`` ranks, or None. Asked by the
    split at compile time (it then keeps the fused async op, and says this) and by each call."""
    if world != PUSH_WORLD:
        return (f"the push variant serves 2 ranks only, not {world}: it pushes every row to every peer, "
                f"(N-1) S = {world - 1} S bytes per rank, where two-shot moves 2 (N-1)/N S = "
                f"{2 * (world - 1) / world:.2f} S")
    return None


FP8_CAPABILITY = (8, 9)
"""The oldest GPU with fp8 conversion instructions (Ada, sm_89)."""


def cuda_quant_epilogue(
    out_dtype: torch.dtype, hidden: int, device: torch.device, static_scale: tuple[torch.dtype, int] | None,
    group_size: int, scale_steps: str, code_steps: str, return_normed: bool,
):
    """The kernel's form of a site's quantization (``quant_epilogue.QuantEpilogue``), or why the
    CUDA lowering does not carry it (a string): a form the kernel has no program for, or fp8 codes
    on a GPU older than sm_89. Asked by the planner (the quantization then stays outside the fused
    op) and by each new call signature (then the call runs the portable lowering).
    ``static_scale``: the static scale's ``(dtype, ndim)``; None for a dynamic scale."""
    from weavepass.runtime.cuda.quant_epilogue import plan_quant_epilogue

    epilogue = plan_quant_epilogue(out_dtype, hidden, static_scale, group_size, scale_steps, code_steps,
                                   return_normed)
    if isinstance(epilogue, str):
        return epilogue
    device = torch.device(device)
    if epilogue.code_dtype == torch.float8_e4m3fn and device.type == "cuda" and torch.cuda.is_available():
        capability = torch.cuda.get_device_capability(device)
        if capability < FP8_CAPABILITY:
            return (f"fp8 codes need a GPU of compute capability 8.9 or newer; this one is "
                    f"{capability[0]}.{capability[1]}")
    return epilogue
