"""The quantization step programs (``weavepass.runtime.quant``) that the site finder reads from each
library form of ``weavepass.testing.quant`` (``tests/test_quant_epilogue.py`` checks them against the
traced graphs), for kernel tests and benchmarks that call the quantized op without compiling."""

from __future__ import annotations

import torch

_FP8_CODES = "clamp_min:-448.0|clamp_max:448.0|convert:float8_e4m3fn"
_STEPS = {
    "fp8_static": ("", f"convert:float32|div_scale|{_FP8_CODES}", 0),
    "fp8_static_inv": ("", f"convert:float32|mul_scale_reciprocal|{_FP8_CODES}", 0),
    "fp8_row": ("abs|amax|convert:float32|div:448.0|clamp_min:4.359654017857143e-06",
                f"convert:float32|mul_scale_reciprocal|{_FP8_CODES}", 0),
    "fp8_row_torchao": ("abs|amax|div:448.0|convert:float32", f"convert:float32|div_scale|{_FP8_CODES}", 0),
    "fp8_group": ("abs|amax|convert:float32|clamp_min:1e-10|convert:{dtype}|convert:float32|div:448.0",
                  f"div_scale|{_FP8_CODES}", 128),
    "int8_row": ("abs|amax|convert:float32|div:127.0",
                 "convert:float32|div_scale|round|clamp_min:-128|clamp_max:127|convert:int8", 0),
}


def form_steps(form: str, dtype: torch.dtype) -> tuple[str, str, int]:
    """``(scale_steps, code_steps, group_size)`` of ``form`` (a ``testing.quant.FUSED_FORMS`` name)
    on normed rows of ``dtype``."""
    scale_steps, code_steps, group = _STEPS[form]
    return scale_steps.replace("{dtype}", str(dtype).removeprefix("torch.")), code_steps, group
