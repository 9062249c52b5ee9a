"""The quantization of a fused site's normed rows: a small step program, read from the graph, that
every lowering of ``weave.fused_allreduce_rmsnorm_quant`` runs on the rows it normalises.

A quantized linear reads the norm's output ``y`` ``[..., H]`` (dtype ``out_dtype``) as codes
``q`` (``float8_e4m3fn`` or ``int8``) and scales ``s``, with ``y ~= q * s``:

    x      = y                                  (per row, per tensor)
           | y.view(..., H / g, g)              (per group of g along the hidden dim)
    s      = scale_steps(x)                     (dynamic: abs -> amax(-1, keepdim) -> casts,
                                                 clamps, / or * constants; [..., 1] or [..., H/g, 1])
           | static_scale                       (static: one number, a graph input)
    q      = code_steps(x, s)                   (casts, x / s or x * reciprocal(s), round,
                                                 clamps, the final cast to the code dtype)

The steps are the graph's own ops, in its order and dtypes, so a lowering that runs them on the
same ``y`` gives eager's codes and scales bit for bit. The compile side writes them into the op call
as text (``encode_steps``); a lowering with a kernel (CUDA) checks the program against the forms
its kernel carries, so adding one needs no change on the compile side.
"""

from __future__ import annotations

import functools

import torch

SCALE_STEPS = ("abs", "amax", "convert", "div", "mul", "clamp_min", "clamp_max")
"""Steps of the scale program; ``div``/``mul``/clamps take a number, ``convert`` a dtype."""
CODE_STEPS = ("convert", "div_scale", "mul_scale_reciprocal", "round", "clamp_min", "clamp_max")
"""Steps of the code program: ``div_scale`` is ``x / s``, ``mul_scale_reciprocal`` ``x * (1 / s)``
(``aten.reciprocal``), where ``s`` is the scale (dynamic or static)."""

Step = tuple[str, object]
"""A step's name and its argument: a number, a dtype (``convert``) or None."""


def encode_steps(steps: list[Step] | tuple[Step, ...]) -> str:
    """``[("abs", None), ("div", 448.0), ("convert", torch.float32)] -> "abs|div:448.0|convert:float32"``."""
    parts = []
    for name, arg in steps:
        if arg is None:
            parts.append(name)
        elif isinstance(arg, torch.dtype):
            parts.append(f"{name}:{str(arg).removeprefix('torch.')}")
        else:
            parts.append(f"{name}:{arg!r}")
    return "|".join(parts)


@functools.lru_cache(maxsize=256)
def decode_steps(text: str) -> tuple[Step, ...]:
    """The inverse of ``encode_steps`` (cached: a compiled graph passes the same text every call)."""
    steps: list[Step] = []
    for part in text.split("|") if text else []:
        name, _, arg = part.partition(":")
        if not arg:
            steps.append((name, None))
        elif name == "convert":
            steps.append((name, getattr(torch, arg)))
        else:
            steps.append((name, int(arg) if arg.lstrip("-").isdigit() else float(arg)))
    return tuple(steps)


def _run(x: torch.Tensor, steps: tuple[Step, ...], scale: torch.Tensor | None) -> torch.Tensor:
    for name, arg in steps:
        if name == "abs":
            x = x.abs()
        elif name == "amax":
            x = x.amax(-1, keepdim=True)
        elif name == "convert":
            assert isinstance(arg, torch.dtype)
            x = x.to(arg)
        elif name in ("div_scale", "mul_scale_reciprocal"):
            assert scale is not None, name
            x = x / scale if name == "div_scale" else x * scale.reciprocal()
        elif name == "round":
            x = x.round()
        else:
            assert isinstance(arg, (int, float)), (name, arg)
            if name == "div":
                x = x / arg
            elif name == "mul":
                x = x * arg
            elif name == "clamp_min":
                x = x.clamp_min(arg)
            elif name == "clamp_max":
                x = x.clamp_max(arg)
            else:
                raise ValueError(f"unknown quantization step {name!r}")
    return x


def quantize_rows(normed: torch.Tensor, static_scale: torch.Tensor | None, group_size: int,
                  scale_steps: str, code_steps: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scales)`` of ``normed`` ``[..., H]`` (module docstring).

    ``group_size`` 0: one scale per row (or the static one); else groups of ``group_size`` along
    H: codes ``[..., H / g, g]``, scales ``[..., H / g, 1]``. Dynamic scales are ``[..., 1]`` per
    row. With ``static_scale`` the scales returned are ``static_scale`` itself (not a copy: the op
    kernel copies it)."""
    x = normed if group_size == 0 else normed.unflatten(-1, (normed.shape[-1] // group_size, group_size))
    scale = static_scale if static_scale is not None else _run(x, decode_steps(scale_steps), None)
    return _run(x, decode_steps(code_steps), scale), scale
