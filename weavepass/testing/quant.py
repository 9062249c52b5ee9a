"""Quantized linears written as the serving libraries write them, for the FP8 / W8A8 test models.

Each ``ACT_QUANTS`` entry quantizes an activation ``x`` ``[..., K]`` the way one library does (in
its eager / native form, which is what ``torch.compile`` traces), and ``QuantLinear`` feeds the
codes and scales to the matmul that library uses:

* ``fp8_static`` / ``fp8_static_inv``: a static per-tensor scale ``s``, ``x / s`` (torchao's static
  float8 config, vLLM's ``scaled_fp8_quant(x, scale)``) or ``x * (1 / s)`` (vLLM's ``QuantFP8``
  native path); ``torch._scaled_mm`` with tensor-wise scales.
* ``fp8_row``: vLLM's dynamic per-token ``QuantFP8``: ``amax -> fp32 -> / 448 -> clamp(min=1 /
  (448 * 512))``, ``x * reciprocal(s)``, on the flattened rows; ``_scaled_mm`` row-wise.
* ``fp8_row_torchao``: torchao's ``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())``
  (``_choose_scale_float8``: amax and ``/ 448`` in the activation dtype, then fp32;
  ``_quantize_affine_float8``: fp32 ``x / s``, clamp, cast), on the 3-D activation.
* ``fp8_group``: per group of 128 along K (DeepSeek-V3 / HF fine-grained FP8; vLLM's native
  ``per_token_group_quant_fp8``: ``amax.clamp(min=eps) -> fp32 -> / 448``). Block-scaled
  ``_scaled_mm`` needs CUDA, so the matmul is the dequantize-then-matmul reference form.
* ``int8_row``: W8A8 dynamic per-token int8 (vLLM's ``scaled_int8_quant`` reference, the Ascend
  stack's form): ``s = amax / 127``, ``round(x / s).clamp(-128, 127)``; ``torch._int_mm`` then
  ``* s * w_scale``.
* ``fp8_tensor_dynamic``: one dynamic scale for the whole tensor (``amax()`` over every element);
  weave leaves it outside the fused op (``ReasonCode.QUANT_GLOBAL_SCALE``).

Weights are quantized per output channel (fp8 or int8), or per tensor for the static forms
(``_scaled_mm``'s tensor-wise mode wants both scales single numbers).
"""

from __future__ import annotations

import torch
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
INT8_MAX = 127.0
GROUP = 128
STATIC_ACT_SCALE = 4.0 / FP8_MAX
"""The static activation scale of the test models: normed values beyond +-4 saturate at +-448."""


def fp8_static(x, scale):
    return (x.to(torch.float32) / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def fp8_static_inv(x, scale):
    return (x.to(torch.float32) * scale.reciprocal()).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def fp8_row(x, scale=None):
    x_max = x.abs().amax(-1, keepdim=True).to(torch.float32)
    s = (x_max / FP8_MAX).clamp(min=1.0 / (FP8_MAX * 512.0))
    return (x.to(torch.float32) * s.reciprocal()).clamp(-FP8_MAX, FP8_MAX).to(FP8), s


def fp8_row_torchao(x, scale=None):
    s = (x.abs().amax(-1, keepdim=True) / FP8_MAX).to(torch.float32)
    return (x.to(torch.float32) / s).clamp(min=-FP8_MAX, max=FP8_MAX).to(FP8), s


def fp8_group(x, scale=None):
    grouped = x.reshape(*x.shape[:-1], x.shape[-1] // GROUP, GROUP)
    s = grouped.abs().amax(-1, keepdim=True).clamp(min=1e-10).to(torch.float32) / FP8_MAX
    q = (grouped / s).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.reshape(x.shape), s.reshape(*x.shape[:-1], x.shape[-1] // GROUP)


def int8_row(x, scale=None):
    s = x.abs().amax(-1, keepdim=True).to(torch.float32) / INT8_MAX
    return (x.to(torch.float32) / s).round().clamp(-128, 127).to(torch.int8), s


def fp8_tensor_dynamic(x, scale=None):
    s = x.abs().amax().to(torch.float32) / FP8_MAX
    return (x.to(torch.float32) / s).clamp(-FP8_MAX, FP8_MAX).to(FP8), s


ACT_QUANTS = {f.__name__: f for f in (fp8_static, fp8_static_inv, fp8_row, fp8_row_torchao, fp8_group,
                                      int8_row, fp8_tensor_dynamic)}
"""Quantization forms by name (``TPConfig.quant``)."""
FUSED_FORMS = ("fp8_static", "fp8_static_inv", "fp8_row", "fp8_row_torchao", "fp8_group", "int8_row")
"""The forms weave fuses on the portable lowering (``fp8_tensor_dynamic`` stays outside)."""


def quantize_weight(w: torch.Tensor, form: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scale)`` of an fp32 weight ``[N, K]``: int8 or fp8, per output channel ``[N, 1]``,
    or per tensor (``[]``) for the static forms."""
    qmax, dtype = (INT8_MAX, torch.int8) if form.startswith("int8") else (FP8_MAX, FP8)
    amax = w.abs().amax() if "static" in form or "tensor" in form else w.abs().amax(1, keepdim=True)
    scale = (amax / qmax).clamp(min=1e-12)
    codes = (w / scale).clamp(-qmax, qmax)
    return (codes.round() if dtype == torch.int8 else codes).to(dtype), scale.to(torch.float32)


class QuantLinear(nn.Module):
    """``x [..., K] -> [..., N]``: the activation quantized by ``ACT_QUANTS[form]``, the weight
    ``[N, K]`` (fp32, quantized here), and the library's matmul; output in ``x``'s dtype."""

    w_codes: torch.Tensor
    w_scale: torch.Tensor
    weight_fp32: torch.Tensor
    act_scale: torch.Tensor

    def __init__(self, weight: torch.Tensor, form: str, act_scale: torch.Tensor | None = None):
        """``act_scale``: the static activation scale (a one-element fp32 tensor; default
        ``STATIC_ACT_SCALE``). Linears that read the same rows share one, as vLLM's merged QKV and
        gate/up projections do, so that one quantization serves them all."""
        super().__init__()
        self.form = form
        codes, scale = quantize_weight(weight.float(), form)
        self.register_buffer("w_codes", codes.to(weight.device), persistent=False)
        self.register_buffer("w_scale", scale.to(weight.device), persistent=False)
        self.register_buffer("weight_fp32", weight.float(), persistent=False)  # the unquantized weight
        if act_scale is None:
            act_scale = torch.tensor(STATIC_ACT_SCALE, device=weight.device)
        self.register_buffer("act_scale", act_scale, persistent=False)

    @property
    def out_features(self) -> int:
        return self.w_codes.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        quant = ACT_QUANTS[self.form]
        if self.form == "fp8_row_torchao":  # torchao quantizes the 3-D activation, then flattens
            q, s = quant(x, self.act_scale)
            q, s = q.reshape(-1, x.shape[-1]), s.reshape(-1, 1)
        else:
            q, s = quant(x.reshape(-1, x.shape[-1]), self.act_scale)
        return self.matmul(q, s, x.dtype).reshape(*x.shape[:-1], self.out_features)

    def matmul(self, q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The library's matmul of codes ``q`` ``[T, K]`` and their scales ``s`` (``[T, 1]``, per
        group ``[T, K / 128]``, or static ``[]``) with the weight: ``[T, N]`` in ``dtype``."""
        if self.form == "int8_row":
            y = torch._int_mm(q, self.w_codes.t()).to(torch.float32) * s * self.w_scale.t()
        elif self.form == "fp8_group":
            grouped = q.to(torch.float32).reshape(q.shape[0], -1, GROUP) * s.unsqueeze(-1)
            y = grouped.reshape(q.shape) @ (self.w_codes.to(torch.float32) * self.w_scale).t()
        else:
            scale_b = self.w_scale if self.w_scale.ndim == 0 else self.w_scale.t()
            return torch._scaled_mm(q, self.w_codes.t(), scale_a=s, scale_b=scale_b, out_dtype=dtype)
        return y.to(dtype)


READS_NORM = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
"""The column-parallel linears of ``testing.models`` that read a norm's output."""


def linears_as_modules(model: nn.Module) -> int:
    """Give the linears that read a norm's output (``READS_NORM``) an ``nn.Linear`` holding the same
    weight, so that a library that quantizes ``nn.Linear`` modules (torchao's ``quantize_``) finds
    them; the reference model keeps them as parameters (``testing.models.linear`` calls either).
    Returns how many were replaced."""
    count = 0
    for module in list(model.modules()):
        for name in READS_NORM:
            weight = module._parameters.get(name)
            if weight is None:
                continue
            linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
            linear.weight = weight
            delattr(module, name)
            setattr(module, name, linear)
            count += 1
    return count
