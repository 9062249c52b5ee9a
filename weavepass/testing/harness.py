"""Check that a compiled model is as accurate as the eager model it came from.

A rewrite such as ``all_reduce -> add -> RMSNorm`` into one fused op may round at different points
than eager code, so bit equality with eager is the wrong test in low precision. Instead both eager
and compiled outputs are compared against an fp32 eager reference of the same model (fp64 for an
fp64 model), and each
output must satisfy

    err_compiled <= 2 * err_eager + atol[dtype] * max(1, max|ref|)

where ``err_x = max |x - ref|``. The compiled model may be as inaccurate as eager (and then some,
rounding differently), but not less accurate beyond one extra rounding of the output.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

# atol[dtype], relative to max(1, max|ref|): a value v moves by up to one ulp ~ v * 2^-mantissa when
# it is rounded at a different point. Each allows one output rounding beyond eager's own error.
ATOL: dict[torch.dtype, float] = {
    # Eager fp32 *is* the reference, so err_eager == 0 and only this term remains. Compiled code
    # reassociates sums (matmul tiling, fused reductions over H, collective order): ~sqrt(H) * 2^-24
    # per reduction, compounded over layers; 1e-4 covers H = 8192 and dozens of layers with margin,
    # and is still 10^3 below the O(0.1) error of a wrong rewrite (a lost residual, a missing rank).
    torch.float32: 1e-4,
    # bf16 keeps 8 significant bits: one ulp is 2^-7 relative. Eager bf16 error against fp32 is
    # already several ulps (2 * err_eager covers the compiled path's own rounding noise); this is
    # one more ulp for an output rounded once differently.
    torch.bfloat16: 2.0**-7,
    # fp16 keeps 11 significant bits: one ulp is 2^-10 relative.
    torch.float16: 2.0**-10,
    # fp64: the reference is the fp64 model itself (see ``check_against_eager``), so as for fp32
    # only this term remains. The same margin over the unit roundoff as fp32's (1e-4 ~ 1700 *
    # 2^-24) gives 1700 * 2^-53 ~ 2e-13; 1e-12 adds headroom and stays 10^5 below the ~1e-7
    # relative error of a sum or norm done in fp32, which this tolerance exists to catch.
    torch.float64: 1e-12,
}
EAGER_ERROR_FACTOR = 2.0


@dataclass(frozen=True)
class OutputComparison:
    """One output tensor: errors against the fp32 reference and differences from eager."""

    name: str
    err_eager: float
    """max |eager - ref|"""
    err_compiled: float
    """max |compiled - ref|"""
    allowed: float
    """``2 * err_eager + atol[dtype] * max(1, max|ref|)``"""
    abs_diff: float
    """max |compiled - eager|"""
    rel_diff: float
    """max |compiled - eager| / max |eager| (normwise: element-wise ratios explode near zero)"""
    problem: str = ""
    """Why the output fails before any number is compared (shape, dtype, non-finite values)."""

    @property
    def passed(self) -> bool:
        return not self.problem and self.err_compiled <= self.allowed


@dataclass
class ComparisonReport:
    """Per-output comparison of a compiled model with eager, both against an fp32 reference.

    ``str(report)`` is a table with one row per output; ``passed`` says whether every row is within
    its allowed error; ``max_abs_diff`` / ``max_rel_diff`` summarise compiled vs eager.
    """

    dtype: torch.dtype
    outputs: list[OutputComparison] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(o.passed for o in self.outputs)

    @property
    def max_abs_diff(self) -> float:
        return max((o.abs_diff for o in self.outputs), default=0.0)

    @property
    def max_rel_diff(self) -> float:
        return max((o.rel_diff for o in self.outputs), default=0.0)

    def __str__(self) -> str:
        header = (
            "output", "err eager", "err compiled", "allowed", "abs diff", "rel diff", "status"
        )
        rows = [
            (
                o.name,
                f"{o.err_eager:.3e}",
                f"{o.err_compiled:.3e}",
                f"{o.allowed:.3e}",
                f"{o.abs_diff:.3e}",
                f"{o.rel_diff:.3e}",
                "ok" if o.passed else f"FAIL {o.problem}".rstrip(),
            )
            for o in self.outputs
        ]
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        lines = [
            f"compiled vs eager, errors against the {_reference_dtype(self.dtype)} reference "
            f"(dtype {self.dtype}; "
            f"allowed = {EAGER_ERROR_FACTOR:g} * err eager "
            f"+ {ATOL[self.dtype]:.3g} * max(1, max|ref|)):"
        ]
        for row in [header, *rows]:
            lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        return "\n".join(lines)


def _reference_dtype(dtype: torch.dtype) -> str:
    return "fp64" if dtype == torch.float64 else "fp32"


def check_against_eager(
    model: Callable[..., Any],
    inputs: Any,
    compile_fn: Callable[[Callable[..., Any]], Callable[..., Any]],
    reference_model: Callable[..., Any],
    dtype: torch.dtype | None = None,
    *,
    raise_on_failure: bool = True,
) -> ComparisonReport:
    """Run ``model`` eagerly and compiled on ``inputs``; compare both with an fp32 reference.

    Args:
        model: the module or function under test, in its working dtype (e.g. bf16).
        inputs: a tuple of positional arguments (or a single tensor) for ``model``.
        compile_fn: turns ``model`` into the compiled callable, e.g.
            ``lambda m: torch.compile(m, backend="weave")``. Called once.
        reference_model: the same model in fp32 (e.g. ``build_tp_model(cfg, dtype=torch.float32)``),
            or in fp64 for an fp64 model; floating-point inputs are cast to fp32 for it (fp64
            inputs stay fp64).
        dtype: the dtype whose tolerance applies; default: the dtype of the first floating-point
            output of the eager model. Must be a key of ``ATOL`` (fp32, bf16, fp16, fp64).
        raise_on_failure: raise AssertionError (message: the report table) when an output fails.

    Every run is under ``torch.no_grad()``. Outputs may be any pytree of tensors; they are matched
    by their pytree path, and must have the eager output's shape and dtype and be finite. In a
    distributed run every rank must call this (the models run collectives); each rank checks its
    own outputs. An output passes when
    ``max|compiled - ref| <= 2 * max|eager - ref| + ATOL[dtype] * max(1, max|ref|)``.

    Returns:
        The ComparisonReport (also when it failed, if ``raise_on_failure`` is False).
    """
    if not isinstance(inputs, tuple):
        inputs = (inputs,)
    # fp32 for the reference, except that fp64 stays fp64: an fp32 reference of an fp64 model
    # would hide every precision loss below fp32's.
    reference_inputs = pytree.tree_map_only(
        torch.Tensor,
        lambda t: t.to(torch.promote_types(t.dtype, torch.float32)) if t.is_floating_point() else t,
        inputs,
    )
    with torch.no_grad():
        expected = reference_model(*reference_inputs)
        eager = model(*inputs)
        compiled = compile_fn(model)(*inputs)

    eager_leaves, eager_spec = pytree.tree_flatten_with_path(eager)
    for label, out in (("compiled", compiled), ("reference", expected)):
        if pytree.tree_structure(out) != eager_spec:
            structure = pytree.tree_structure(out)
            raise AssertionError(f"{label} output structure {structure} != eager {eager_spec}")
    compiled_leaves, expected_leaves = pytree.tree_leaves(compiled), pytree.tree_leaves(expected)

    if dtype is None:
        leaves = [t for _, t in eager_leaves if isinstance(t, torch.Tensor)]
        floats = [t for t in leaves if t.is_floating_point()]
        dtype = floats[0].dtype if floats else torch.float32
    if dtype not in ATOL:
        raise ValueError(f"no tolerance for dtype {dtype}; known: {list(ATOL)}")

    report = ComparisonReport(dtype)
    for (path, e), c, r in zip(eager_leaves, compiled_leaves, expected_leaves):
        name = pytree.keystr(path) or "output"
        if not isinstance(e, torch.Tensor) or not e.is_floating_point():
            if not _equal(e, c):
                raise AssertionError(f"output {name}: compiled {c!r} != eager {e!r}")
            continue
        report.outputs.append(_compare(name, e, c, r, dtype))
    if raise_on_failure and not report.passed:
        raise AssertionError(f"compiled model is less accurate than eager\n{report}")
    return report


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
    return a == b


def _compare(
    name: str, eager: torch.Tensor, compiled: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype
) -> OutputComparison:
    problem = ""
    if not isinstance(compiled, torch.Tensor):
        problem = f"compiled gave {type(compiled).__name__}, not a tensor"
    elif compiled.shape != eager.shape:
        problem = f"shape {tuple(compiled.shape)} != eager {tuple(eager.shape)}"
    elif compiled.dtype != eager.dtype:
        problem = f"dtype {compiled.dtype} != eager {eager.dtype}"
    elif ref.shape != eager.shape:
        problem = f"reference shape {tuple(ref.shape)} != {tuple(eager.shape)}"
    elif not bool(torch.isfinite(compiled).all()):
        problem = "non-finite values"
    if problem:
        nan = math.nan
        return OutputComparison(name, nan, nan, nan, nan, nan, problem)

    def amax(t: torch.Tensor) -> float:
        return t.abs().max().item() if t.numel() else 0.0

    ref, eager, compiled = ref.double(), eager.double(), compiled.double()
    err_eager, err_compiled = amax(eager - ref), amax(compiled - ref)
    abs_diff, eager_scale, ref_scale = amax(compiled - eager), amax(eager), amax(ref)
    allowed = EAGER_ERROR_FACTOR * err_eager + ATOL[dtype] * max(1.0, ref_scale)
    rel_diff = abs_diff / eager_scale if eager_scale > 0 else (0.0 if abs_diff == 0 else math.inf)
    return OutputComparison(name, err_eager, err_compiled, allowed, abs_diff, rel_diff)
