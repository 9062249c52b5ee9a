"""Lowerings turn a ``weave`` op into kernels, torch_npu calls or portable collectives.

Each lowering of ``weave.fused_allreduce_rmsnorm`` is a function
``(partial, residual, weight, eps, group_name, out_dtype) -> (normed, residual_out)`` with the math of
``weavepass.runtime.reference``. The scheduler picks one by name at compile time and writes the name
into the op call, so the choice is visible in the graph and in the explain report.
"""

from __future__ import annotations

import importlib
from typing import Callable

from weavepass.runtime.portable import fused_allreduce_rmsnorm_portable

FusedLowering = Callable[..., tuple]

# name -> "module:function"; modules that need triton or torch_npu are imported on first use only.
_LAZY_LOWERINGS: dict[str, str] = {
    "cuda_symm": "weavepass.runtime.cuda.dispatch:fused_allreduce_rmsnorm_cuda",
}
_LOWERINGS: dict[str, FusedLowering] = {"portable": fused_allreduce_rmsnorm_portable}

TRAINING_LOWERINGS = ("portable",)
"""Lowerings that also return the inverse RMS a training graph saves for backward
(``weave.fused_allreduce_rmsnorm_train``). The CUDA kernel does not write it."""


def get_lowering(name: str) -> FusedLowering:
    """The implementation registered under ``name`` (importing it on first use)."""
    if name not in _LOWERINGS:
        if name not in _LAZY_LOWERINGS:
            known = sorted([*_LOWERINGS, *_LAZY_LOWERINGS])
            raise ValueError(f"unknown weave lowering {name!r}; known lowerings: {known}")
        module_name, attr = _LAZY_LOWERINGS[name].split(":")
        _LOWERINGS[name] = getattr(importlib.import_module(module_name), attr)
    return _LOWERINGS[name]


def lowering_names() -> list[str]:
    return sorted({*_LOWERINGS, *_LAZY_LOWERINGS})
