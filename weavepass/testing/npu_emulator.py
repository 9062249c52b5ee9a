"""An emulator of the two torch_npu ops weavepass uses, for testing the NPU path without an NPU.

It implements the documented semantics and argument checks of

* ``npu_mm_reduce_scatter_base(input, x2, hcom, world_size, *, reduce_op="sum", bias=None,
  x1_scale=None, x2_scale=None, comm_turn=0, output_dtype=None, comm_mode=None)``: the matmul
  ``input @ x2`` (fp32 accumulation, rounded to the input dtype, as the NPU cube unit does), then a
  sum reduce_scatter over the group named ``hcom`` (here: a gloo group), and
* ``npu_add_rms_norm(x1, x2, gamma, epsilon=1e-6) -> (y, rstd, x)``,

raising RuntimeError where the real op's checks would (shapes, dtypes, world size, bias, a
transposed ``input``). It is written from the documentation, not from the implementation: passing
against it proves the graph calls the documented API correctly, not that the NPU kernels agree.

    with emulated_torch_npu() as npu:
        compiled(ids)
        npu.calls   # [("npu_mm_reduce_scatter_base", {...arguments...}), ...]
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from weavepass.lowering import npu as adapter

_WORLD_SIZES = (2, 4, 8, 16, 32)
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class EmulatedTorchNPU:
    """Stands in for the ``torch_npu`` module; records every call with its arguments."""

    groups: dict[str, dist.ProcessGroup] = field(default_factory=dict)
    """hcom name -> the process group it stands for."""
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def hccl_comm_name(self, group: dist.ProcessGroup) -> str:
        name = f"emulated_hccl_{group.group_name}"
        self.groups[name] = group
        return name

    def npu_mm_reduce_scatter_base(
        self, input, x2, hcom, world_size, *, reduce_op="sum", bias=None, x1_scale=None,
        x2_scale=None, comm_turn=0, output_dtype=None, comm_mode=None,
    ):
        self.calls.append(("npu_mm_reduce_scatter_base", {
            "input": (tuple(input.shape), input.dtype), "x2": (tuple(x2.shape), x2.dtype),
            "hcom": hcom, "world_size": world_size, "reduce_op": reduce_op, "bias": bias,
            "comm_turn": comm_turn, "comm_mode": comm_mode,
        }))
        _check(world_size in _WORLD_SIZES, f"world_size should be in {list(_WORLD_SIZES)}, got {world_size}")
        _check(input.dim() == 2 and x2.dim() == 2, "input and x2 must be 2-D")
        _check(input.dtype in (torch.float16, torch.bfloat16), f"input dtype {input.dtype} not fp16/bf16")
        _check(x2.dtype == input.dtype, "x2 must have input's dtype")
        (m, k), (k2, _n) = input.shape, x2.shape
        _check(k == k2, f"k of input ({k}) and x2 ({k2}) differ")
        _check(256 <= k < 65535, f"k={k} must be in [256, 65535)")
        _check(m % world_size == 0, f"m={m} must be divisible by world_size={world_size}")
        _check(input.is_contiguous(), "input must not be transposed (row-major ND only)")
        _check(reduce_op == "sum", f"reduce_op {reduce_op!r}: only 'sum' is supported")
        _check(bias is None, "bias is not supported")
        _check(x1_scale is None and x2_scale is None and output_dtype is None,
               "quantised MMRS is not emulated")
        _check(comm_turn == 0, "comm_turn must be 0")
        _check(comm_mode in (None, "aiv", "ai_cpu"), f"unknown comm_mode {comm_mode!r}")
        _check(hcom in self.groups, f"unknown hcom {hcom!r}")
        group = self.groups[hcom]
        _check(group.size() == world_size, f"world_size {world_size} != hcom group size {group.size()}")
        product = (input.float() @ x2.float()).to(input.dtype)
        shard = torch.empty((m // world_size, x2.shape[1]), dtype=torch.float32, device=input.device)
        _reduce_scatter(shard, product.float(), group=group)
        return shard.to(input.dtype)

    def npu_add_rms_norm(self, x1, x2, gamma, epsilon=1e-6):
        self.calls.append(("npu_add_rms_norm", {
            "x1": (tuple(x1.shape), x1.dtype), "x2": (tuple(x2.shape), x2.dtype),
            "gamma": (tuple(gamma.shape), gamma.dtype), "epsilon": epsilon,
        }))
        dtypes = (torch.float16, torch.bfloat16, torch.float32)
        _check(x1.shape == x2.shape, f"x1 {tuple(x1.shape)} and x2 {tuple(x2.shape)} differ")
        _check(x1.dtype == x2.dtype and x1.dtype in dtypes, f"x1/x2 dtypes {x1.dtype}/{x2.dtype}")
        _check(gamma.dtype == x1.dtype, f"gamma dtype {gamma.dtype} != {x1.dtype}")
        _check(tuple(gamma.shape) == tuple(x1.shape[x1.dim() - gamma.dim():]),
               f"gamma {tuple(gamma.shape)} is not the trailing shape of x1 {tuple(x1.shape)}")
        x = x1 + x2  # in the input dtype, as the op's x output
        xf = x.float()
        dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
        rstd = torch.rsqrt(xf.pow(2).mean(dims, keepdim=True) + epsilon)
        y = (xf * rstd * gamma.float()).to(x1.dtype)
        return y, rstd, x


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise RuntimeError(f"[emulated torch_npu] {message}")


@contextlib.contextmanager
def emulated_torch_npu() -> Iterator[EmulatedTorchNPU]:
    """Route ``weavepass.lowering.npu`` to a fresh emulator for the duration of the block."""
    emulator = EmulatedTorchNPU()
    saved = adapter.resolve_torch_npu, adapter.hccl_comm_name
    adapter.resolve_torch_npu = lambda: emulator
    adapter.hccl_comm_name = emulator.hccl_comm_name
    adapter._hcom_for.cache_clear()
    try:
        yield emulator
    finally:
        adapter.resolve_torch_npu, adapter.hccl_comm_name = saved
        adapter._hcom_for.cache_clear()
