"""An emulator of the three torch_npu ops weavepass uses, for testing the NPU path without an NPU.

Arguments are bound by the real op schemas (``TORCH_NPU_SCHEMAS``, the package's own text): what the
schema rejects (an unknown keyword such as ``input=`` where the schema says ``self``, a keyword-only
argument passed by position, a wrong type) raises TypeError here too. Then come the checks of
torch_npu's C++ wrapper (world size, 2-D, k, ``m % world_size``), its routing of ``comm_mode`` to
CANN's V1 or V2 entry per chip, and CANN's documented rules for that entry on that chip (dtypes, k
range, layouts, rank counts, ``commMode``), each raising RuntimeError like the real op. The chip is
``EmulatedTorchNPU.chip``, a ``torch_npu.npu.get_device_name()`` string.

The math:

* ``npu_mm_reduce_scatter_base``: ``self @ x2`` (fp32 accumulation, rounded to the input dtype, as
  the cube unit does), then a sum reduce_scatter over the group named ``hcom`` (a gloo group here);
* ``npu_all_gather_base_mm``: all_gather of ``self``, then the same matmul;
* ``npu_add_rms_norm``: CANN's reference (``ops-nn`` ``norm/add_rms_norm/tests/assets/golden.py``):
  on Ascend910B / Ascend910_93, ``x = x1 + x2`` in the input dtype, ``rstd`` from that ``x``, and
  ``x * rstd`` rounded to bf16 before the fp32 gamma multiply (bf16) or to fp16 with the gamma
  multiply in fp16 (fp16); on newer chips, ``x`` and ``y`` in fp32, rounded once.

These rules are written from the package text and CANN's docs and reference code, independently of
``weavepass.runtime.npu``'s policy table, so that a policy error shows up as an emulated failure.
Passing against the emulator shows the graph calls the real API as documented; it cannot show that
the kernels agree with their documentation, nor anything about speed or hangs.

    with emulated_torch_npu(chip="Ascend910B3") as npu:
        compiled(ids)
        npu.calls   # [("npu_mm_reduce_scatter_base", {...bound arguments...}), ...]
"""

from __future__ import annotations

import contextlib
import re
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from weavepass.runtime import npu as adapter

TORCH_NPU_SCHEMAS = {
    "npu_mm_reduce_scatter_base": "npu_mm_reduce_scatter_base(Tensor self, Tensor x2, str hcom, int world_size, *, str reduce_op='sum', Tensor? bias=None, Tensor? x1_scale=None, Tensor? x2_scale=None, int comm_turn=0, ScalarType? output_dtype=None, str? comm_mode=None) -> Tensor",  # noqa: E501
    "npu_all_gather_base_mm": "npu_all_gather_base_mm(Tensor self, Tensor x2, str hcom, int world_size, *, Tensor? bias=None, Tensor? x1_scale=None, Tensor? x2_scale=None, int gather_index=0, bool gather_output=True, int comm_turn=0, ScalarType? output_dtype=None, str? comm_mode=None) -> (Tensor, Tensor)",  # noqa: E501
    "npu_add_rms_norm": "npu_add_rms_norm(Tensor x1, Tensor x2, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor, Tensor)",  # noqa: E501
}
"""The ``func:`` lines of github.com/Ascend/op-plugin ``op_plugin/config/op_plugin_functions.yaml``
(the yaml torch_npu's op registrations are generated from), identical on its release branches 7.3.0,
26.0.0, 26.1.0 and master 517f2e7d (2026-08-21). Registered under the ``npu`` namespace."""

_SCHEMAS = {name: torch._C.parse_schema(f"npu::{text}") for name, text in TORCH_NPU_SCHEMAS.items()}
# The parsed schema types ScalarType as int; the Python binding takes a torch.dtype there.
_SCALAR_TYPE_ARGS = {name: set(re.findall(r"ScalarType\??\s+(\w+)", text))
                     for name, text in TORCH_NPU_SCHEMAS.items()}
_WRAPPER_WORLD_SIZES = (2, 4, 8, 16, 32)  # TORCH_CHECK in both fused ops' C++ wrappers
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def bind(op: str, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``args``/``kwargs`` bound to ``op``'s schema as the dispatcher binds them, defaults filled.

    Raises TypeError for too many positionals, an unknown or repeated keyword, a missing argument,
    or a value of the wrong type.
    """
    schema = _SCHEMAS[op]
    positional = [a for a in schema.arguments if not a.kwarg_only]
    if len(args) > len(positional):
        raise TypeError(f"{op}() takes {len(positional)} positional arguments but {len(args)} were given")
    bound = {a.name: value for a, value in zip(positional, args)}
    by_name = {a.name: a for a in schema.arguments}
    for name, value in kwargs.items():
        if name not in by_name:
            raise TypeError(f"{op}() got an unexpected keyword argument {name!r} (schema: {schema})")
        if name in bound:
            raise TypeError(f"{op}() got multiple values for argument {name!r}")
        bound[name] = value
    for arg in schema.arguments:
        if arg.name not in bound:
            if not arg.has_default_value():
                raise TypeError(f"{op}() missing required argument {arg.name!r}")
            bound[arg.name] = arg.default_value
        _check_type(op, arg, bound[arg.name])
    return bound


_PYTHON_TYPES = {"Tensor": torch.Tensor, "str": str, "int": int, "float": (float, int), "bool": bool}


def _check_type(op: str, arg, value) -> None:
    kind = arg.type
    optional = isinstance(kind, torch._C.OptionalType)
    if optional:
        kind = kind.getElementType()
    expected = torch.dtype if arg.name in _SCALAR_TYPE_ARGS[op] else _PYTHON_TYPES[str(kind)]
    if value is None and optional:
        return
    if not isinstance(value, expected) or (isinstance(value, bool) and expected is not bool):
        raise TypeError(f"{op}(): argument {arg.name!r} must be {arg.type}, not {type(value).__name__}")


def _chip_family(chip: str) -> str:
    for prefix in ("Ascend910B", "Ascend910_93", "Ascend950"):
        if chip.startswith(prefix):
            return prefix
    raise RuntimeError(f"[emulated torch_npu] the MC2 fused ops do not run on {chip!r}")


def _cann_entry(chip: str, comm_mode: str | None) -> tuple[str, tuple[int, ...]]:
    """torch_npu's routing to CANN's V1 or V2 entry, and the entry's documented rank counts.

    The wrapper sends ``comm_mode or "ai_cpu"``: on chips below Ascend950, ``"ai_cpu"`` goes to V1
    (no commMode) and anything else to V2; on Ascend950 everything goes to V2. V2's docs take only
    ``"aiv"`` on A2/A3 and only ``"ccu"`` on Ascend 950.
    """
    family, mode = _chip_family(chip), comm_mode or "ai_cpu"
    if family == "Ascend950":
        _check(mode == "ccu", f"V2 on {chip}: commMode {mode!r}; only 'ccu' is supported")
        return "V2", (2, 4, 8, 16, 32, 64)
    if mode == "ai_cpu":
        return "V1", (2, 4, 8) if family == "Ascend910B" else (2, 4, 8, 16, 32)
    _check(mode == "aiv", f"V2 on {chip}: commMode {mode!r}; only 'aiv' is supported")
    return "V2", (2, 4, 8)


@dataclass
class EmulatedTorchNPU:
    """Stands in for the ``torch_npu`` module; records every call with its bound arguments."""

    chip: str = "Ascend910B3"
    """What ``torch_npu.npu.get_device_name()`` returns."""
    groups: dict[str, dist.ProcessGroup] = field(default_factory=dict)
    """hcom name -> the process group it stands for."""
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.npu = types.SimpleNamespace(get_device_name=lambda device=None: self.chip)

    def hccl_comm_name(self, group: dist.ProcessGroup) -> str:
        name = f"emulated_hccl_{group.group_name}"
        self.groups[name] = group
        return name

    def _record(self, op: str, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
        a = bind(op, args, kwargs)
        self.calls.append((op, {k: (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v
                                for k, v in a.items()}))
        return a

    def _check_matmul_comm(self, a: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, dist.ProcessGroup]:
        x1, x2, world = a["self"], a["x2"], a["world_size"]
        # torch_npu's C++ wrapper
        _check(world in _WRAPPER_WORLD_SIZES, f"world_size should be in {list(_WRAPPER_WORLD_SIZES)}, got {world}")
        _check(x1.dim() == 2 and x2.dim() == 2, "Both inputs of mm are required to be 2D")
        _check(x1.shape[1] == x2.shape[0], f"K-axis of x1 ({x1.shape[1]}) and x2 ({x2.shape[0]}) differ")
        # CANN, for the entry the wrapper picks on this chip
        entry, world_sizes = _cann_entry(self.chip, a["comm_mode"])
        _check(world in world_sizes, f"{entry} on {self.chip}: {world} ranks; documented {world_sizes}")
        _check(x1.dtype in (torch.float16, torch.bfloat16) and x2.dtype == x1.dtype,
               f"dtypes {x1.dtype} @ {x2.dtype}: fp16/bf16, both the same")
        _check(256 <= x1.shape[1] < 65535, f"k={x1.shape[1]} must be in [256, 65535)")
        _check(x1.is_contiguous(), "x1 must not be transposed (row-major ND only)")
        _check(x2.is_contiguous() or x2.t().is_contiguous(),
               "x2: the only non-contiguous layout supported is a transpose of both axes")
        _check(a["bias"] is None, "bias: only None is emulated (CANN takes none or zeros)")
        _check(a["x1_scale"] is None and a["x2_scale"] is None and a["output_dtype"] is None,
               "quantised ops are not emulated")
        _check(a["comm_turn"] == 0, "comm_turn must be 0")
        hcom = a["hcom"]
        _check(hcom in self.groups, f"unknown hcom {hcom!r}")
        group = self.groups[hcom]
        _check(group.size() == world, f"world_size {world} != hcom group size {group.size()}")
        return x1, x2, group

    def npu_mm_reduce_scatter_base(self, *args, **kwargs):
        a = self._record("npu_mm_reduce_scatter_base", args, kwargs)
        x1, x2, group = self._check_matmul_comm(a)
        world, m = a["world_size"], x1.shape[0]
        _check(m % world == 0, f"M-axis {m} must be divisible by world_size={world}")
        _check(a["reduce_op"] == "sum", f"reduce_op {a['reduce_op']!r}: only 'sum' is supported")
        product = (x1.float() @ x2.float()).to(x1.dtype)
        shard = torch.empty((m // world, x2.shape[1]), dtype=torch.float32, device=x1.device)
        _reduce_scatter(shard, product.float(), group=group)
        return shard.to(x1.dtype)

    def npu_all_gather_base_mm(self, *args, **kwargs):
        a = self._record("npu_all_gather_base_mm", args, kwargs)
        x1, x2, group = self._check_matmul_comm(a)
        _check(a["gather_index"] == 0, "gather_index must be 0")
        _check(a["gather_output"] or (a["comm_mode"] or "ai_cpu") == "ai_cpu",
               "gather_output=False is only supported with comm_mode 'ai_cpu'")
        gathered = x1.new_empty((x1.shape[0] * a["world_size"], x1.shape[1]))
        dist.all_gather_into_tensor(gathered, x1.contiguous(), group=group)
        product = (gathered.float() @ x2.float()).to(x1.dtype)
        return product, gathered if a["gather_output"] else x1.new_empty((0,))

    def npu_add_rms_norm(self, *args, **kwargs):
        a = self._record("npu_add_rms_norm", args, kwargs)
        x1, x2, gamma, eps = a["x1"], a["x2"], a["gamma"], a["epsilon"]
        _check(x1.shape == x2.shape, f"x1 {tuple(x1.shape)} and x2 {tuple(x2.shape)} differ")
        _check(x1.dtype == x2.dtype and x1.dtype in (torch.float16, torch.bfloat16, torch.float32),
               f"x1/x2 dtypes {x1.dtype}/{x2.dtype}")
        _check(gamma.dtype == x1.dtype, f"gamma dtype {gamma.dtype} != {x1.dtype}")
        _check(tuple(gamma.shape) == tuple(x1.shape[x1.dim() - gamma.dim():]),
               f"gamma {tuple(gamma.shape)} is not the trailing shape of x1 {tuple(x1.shape)}")
        return add_rms_norm_reference(x1, x2, gamma, eps, self.chip)


def add_rms_norm_reference(x1, x2, gamma, eps: float, chip: str):
    """CANN's ``AddRmsNorm`` reference for ``chip``: ``(y, rstd, x)``, rstd in fp32 (see module doc)."""
    dims = tuple(range(x1.dim() - gamma.dim(), x1.dim()))
    legacy = chip.startswith(("Ascend910B", "Ascend910_93"))
    xf = (x1 + x2).float() if legacy else x1.float() + x2.float()
    rstd = torch.rsqrt(xf.pow(2).mean(dims, keepdim=True) + eps)
    normed = xf * rstd
    if legacy and x1.dtype == torch.bfloat16:
        y = (normed.bfloat16().float() * gamma.float()).bfloat16()
    elif legacy and x1.dtype == torch.float16:
        y = normed.half() * gamma
    else:
        y = (normed * gamma.float()).to(x1.dtype)
    return y, rstd, xf.to(x1.dtype)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise RuntimeError(f"[emulated torch_npu] {message}")


@contextlib.contextmanager
def emulated_torch_npu(chip: str = "Ascend910B3") -> Iterator[EmulatedTorchNPU]:
    """Route ``weavepass.runtime.npu`` to a fresh emulator of ``chip`` for the duration of the block."""
    emulator = EmulatedTorchNPU(chip)
    saved = adapter.resolve_torch_npu, adapter.hccl_comm_name
    adapter.resolve_torch_npu = lambda: emulator
    adapter.hccl_comm_name = emulator.hccl_comm_name
    adapter._hcom_for.cache_clear()
    try:
        yield emulator
    finally:
        adapter.resolve_torch_npu, adapter.hccl_comm_name = saved
        adapter._hcom_for.cache_clear()
