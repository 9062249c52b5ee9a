"""Find the FP8 / int8 quantization of a site's normed rows, and the scaled matmuls that read it.

A quantized linear after an RMSNorm reaches the post-grad graph as (``y`` the norm's output)::

    x  = y | view(y, [..., H/g, g])                       # per row / per group of g
    s  = amax(abs(x [-> f32]), -1, keepdim) -> casts, clamps, / qmax or * 1/qmax     # dynamic
       | a one-element graph input                                                    # static
    q  = x [-> f32] / s  |  x [-> f32] * reciprocal(s)  -> [round] -> clamps -> to(fp8 | int8)
    _scaled_mm(q', w, scale_a=s', ...)  |  _int_mm(q', w) * s'  |  to(q', f32) * s'  (dequant)

(``'``: through views). vLLM's ``QuantFP8`` / ``scaled_fp8_quant`` (static and per token), torchao's
float8 per-row and static configs, DeepSeek-V3 / HF fine-grained FP8 (groups of 128) and W8A8 int8
per token all reach it in this form. ``find_quant(site)`` walks back from each cast to a code dtype
to the normed rows and records the steps as the graph wrote them (``weavepass.runtime.quant``), so
the fused op computes exactly what the graph did. It matches the chain, not the pieces: every
reader of the codes must multiply by the scale they were divided by.

A global (dynamic per-tensor) scale is found and left outside the fused op: each rank normalises
1/N of the rows, so its amax needs every rank's rows (one more collective before the codes can be
written), and Inductor then quantizes the gathered rows as before (``QUANT_GLOBAL_SCALE``).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Collection
from dataclasses import dataclass

import torch
from torch.fx import Graph, Node

from weavepass.compile.fx_args import arg, arg_node, arguments, tensor
from weavepass.compile.patterns.rmsnorm import CONVERTS, RMS_NORM, _convert_dtype, is_target, val
from weavepass.compile.reasons import Reason, ReasonCode
from weavepass.runtime.quant import encode_steps

aten = torch.ops.aten

CODE_DTYPES = {torch.float8_e4m3fn: "fp8", torch.float8_e5m2: "fp8 e5m2", torch.int8: "int8"}
VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.squeeze.dim,
         aten.squeeze.dims, aten.unsqueeze.default}
SCALE_READS = VIEWS | {aten.expand.default, aten.clone.default, aten.permute.default}
"""What may stand between a scale and the matmul that multiplies by it (no cast: a bf16 copy of an
fp32 scale is another number)."""
CODE_READS = VIEWS | {aten.permute.default, aten.clone.default}
SCALED_MMS = {aten._scaled_mm.default}
INT_MMS = {aten._int_mm.default}
_SEARCH_DEPTH = 12
QUANT_OPS = VIEWS | CONVERTS | {
    aten.abs.default, aten.amax.default, aten.max.default, aten.div.Tensor, aten.mul.Tensor,
    aten.reciprocal.default, aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default,
    aten.round.default,
}
"""The ops a quantization of the normed rows is made of (where ``_code_casts`` looks)."""


@dataclass(frozen=True)
class QuantLeftOutside:
    """A quantization of the normed rows that stays outside the fused op, and why."""

    label: str
    """What was found, e.g. ``"fp8 per-row quant"``."""
    reason: Reason

    @property
    def code(self) -> ReasonCode:
        return self.reason.code

    @property
    def text(self) -> str:
        return f"{self.label} stays outside the fused op: {self.reason.render()}"


@dataclass(frozen=True)
class QuantMatch:
    """``codes, scale = quantize(normed)`` read by scaled matmuls (module docstring); one or more
    chains with the same steps (each linear of a layer quantizing the same rows), all computed once
    by the fused op."""

    codes: tuple[Node, ...]
    """Each chain's cast to the code dtype; replaced by the op's codes."""
    scales: tuple[Node, ...]
    """Each chain's dynamic scale (replaced by the op's scales), or the one static scale (an input)."""
    static: bool
    group_size: int
    """0: per row (dynamic) or per tensor (static); else the group width along H."""
    scale_steps: str
    code_steps: str
    nodes: tuple[Node, ...]
    """The chains' nodes in graph order per chain; dead once ``codes`` and ``scales`` are replaced."""
    consumers: tuple[Node, ...]
    return_normed: bool
    """Something besides the quantization reads the normed rows."""
    others: int = 0
    """Quantizations of the same rows with other steps or another static scale: they stay outside
    and read the normed rows."""

    @property
    def code_dtype(self) -> torch.dtype:
        return tensor(self.codes[0]).dtype

    @property
    def static_scale(self) -> Node | None:
        return self.scales[0] if self.static else None

    @property
    def label(self) -> str:
        others = f" (and {self.others} other quantization(s) of the rows left outside)" if self.others else ""
        return _label(self.code_dtype, self.static, self.group_size) + others

    @property
    def key(self) -> tuple[Node | None, int, str, str]:
        """Chains with equal keys compute the same codes and scales."""
        return (self.static_scale, self.group_size, self.scale_steps, self.code_steps)


def _label(dtype: torch.dtype, static: bool, group_size: int, global_amax: bool = False) -> str:
    fmt = CODE_DTYPES.get(dtype, str(dtype))
    if static:
        return f"{fmt} per-tensor static quant"
    if global_amax:
        return f"{fmt} per-tensor dynamic quant"
    return f"{fmt} per-group-of-{group_size} quant" if group_size else f"{fmt} per-row quant"


def _scalar(arg: object) -> bool:
    return isinstance(arg, (int, float)) and not isinstance(arg, bool)


def _depends_on(node: Node, target: Node) -> bool:
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if n is target:
            return True
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return False


def _row_view(node: Node, normed: Node) -> bool:
    """``node`` views ``normed`` with other leading dims and the same last (hidden) dim."""
    if not is_target(node, VIEWS) or arg(node, 0) is not normed:
        return False
    out, src = val(node), val(normed)
    return out is not None and src is not None and out.shape[-1] == src.shape[-1]


def _starts(normed: Node) -> dict[Node, int]:
    """Where a quantization may read the normed rows -> its group width (0: none): ``normed``, the
    chains of row views from it (``[B, S, H] -> [B*S, H]``, as vLLM flattens before quantizing) and
    their group views."""
    rows, frontier = [normed], [normed]
    while frontier:
        frontier = [u for n in frontier for u in n.users if _row_view(u, n)]
        rows += frontier
    starts = dict.fromkeys(rows, 0)
    for row in rows:
        starts.update({u: _group_view(u, row) for u in row.users if _group_view(u, row)})
    return starts


def _group_view(node: Node, rows: Node) -> int:
    """``g`` when ``node`` is ``view(rows, [..., H/g, g])`` (any leading dims, ``H/g > 1``), else 0."""
    if not is_target(node, VIEWS) or arg(node, 0) is not rows:
        return 0
    out, src = val(node), val(rows)
    if out is None or src is None or out.ndim < 2:
        return 0
    groups, width = out.shape[-2], out.shape[-1]
    return int(width) if groups * width == src.shape[-1] and groups > 1 else 0


class _NotQuant(Exception):
    """The walk met something that is not a step of a known quantization (``reason``)."""

    def __init__(self, reason: Reason):
        super().__init__(reason.render())
        self.reason = reason


def _op_name(node: Node) -> str:
    """``_scaled_mm`` for ``aten._scaled_mm.default``: the op, for a reason."""
    return str(getattr(node.target, "_opname", None) or getattr(node.target, "__name__", node.target))


def _cast_or_bound(n: Node) -> tuple[str, object] | None:
    """The step at ``n`` if it is a cast (``convert``) or a clamp to one constant bound
    (``clamp_min`` / ``clamp_max``, the bound read by name), which both walks read alike; else None."""
    dtype = _convert_dtype(n) if is_target(n, CONVERTS) else None
    if dtype is not None:
        return "convert", dtype
    if is_target(n, {aten.clamp_min.default, aten.clamp_max.default}):
        bound = arguments(n)["min" if n.target is aten.clamp_min.default else "max"]
        return (_op_name(n), bound) if _scalar(bound) else None
    return None


def _clamp_bounds(n: Node) -> tuple[object, object]:
    """``(min, max)`` of a ``clamp`` call, by name (either may be None or left out)."""
    given = arguments(n)
    return given["min"], given["max"]


def _operands(node: Node) -> tuple[object, object]:
    """``(self, other)`` of a binary op (``mul.Tensor``), by the schema's names: a pass chained
    before weave's may give them by keyword."""
    return arg(node, 0), arg(node, 1)


def _walk_codes(codes: Node, starts: set[Node]) -> tuple[list[tuple[str, object]], Node, Node, list[Node]]:
    """From the cast to the code dtype back to a start: ``(steps, start, scale, nodes)``."""
    steps: list[tuple[str, object]] = [("convert", tensor(codes).dtype)]
    nodes, scale = [codes], None
    n = arg_node(codes, 0)
    while n not in starts:
        nodes.append(n)
        step = _cast_or_bound(n)
        if step is not None:
            steps.append(step)
        elif is_target(n, {aten.clamp.default}) and all(_scalar(b) or b is None for b in _clamp_bounds(n)):
            lo, hi = _clamp_bounds(n)
            steps += [s for s in (("clamp_max", hi), ("clamp_min", lo)) if s[1] is not None]
        elif is_target(n, {aten.round.default}):
            steps.append(("round", None))
        elif is_target(n, {aten.div.Tensor}) and isinstance(arg(n, 1), Node) and scale is None:
            steps.append(("div_scale", None))
            scale = arg_node(n, 1)
        elif is_target(n, {aten.mul.Tensor}) and scale is None and any(
                is_target(a, {aten.reciprocal.default}) for a in _operands(n)):
            recip = next(a for a in _operands(n) if isinstance(a, Node) and is_target(a, {aten.reciprocal.default}))
            steps.append(("mul_scale_reciprocal", None))
            nodes.append(recip)
            scale = arg_node(recip, 0)
            n = arg_node(n, 1) if arg(n, 0) is recip else arg_node(n, 0)
            continue
        elif is_target(n, {aten.mul.Tensor}) and scale is None:
            raise _NotQuant(Reason.of(ReasonCode.QUANT_UNPROVEN_INVERSE, node=n.name))
        else:
            raise _NotQuant(Reason.of(ReasonCode.QUANT_UNKNOWN_STEP, node=n.name, op=_op_name(n)))
        n = arg_node(n, 0)
    if scale is None:
        raise _NotQuant(Reason.of(ReasonCode.QUANT_NO_SCALE, node=codes.name))
    return list(reversed(steps)), n, scale, list(reversed(nodes))


def _walk_scale(scale: Node, start: Node) -> tuple[list[tuple[str, object]], list[Node], bool]:
    """From the dynamic scale back to ``start``: ``(steps, nodes, global_amax)``."""
    steps: list[tuple[str, object]] = []
    nodes: list[Node] = []
    global_amax = False
    n = scale
    while n is not start:
        nodes.append(n)
        step = _cast_or_bound(n)
        if step is not None:
            steps.append(step)
        elif is_target(n, {aten.div.Tensor}) and _scalar(arg(n, 1)):
            steps.append(("div", arg(n, 1)))
        elif is_target(n, {aten.mul.Tensor}) and _scalar(arg(n, 1)):
            steps.append(("mul", arg(n, 1)))
        elif is_target(n, {aten.abs.default}):
            steps.append(("abs", None))
        elif is_target(n, {aten.amax.default}):
            given = arguments(n)  # by name: dim and keepdim may be keywords
            dims = list(given["dim"]) if isinstance(given["dim"], (list, tuple)) else []
            keep = bool(given["keepdim"])
            ndim = tensor(arg_node(n, 0)).ndim
            if dims not in ([-1], [ndim - 1]) or not keep:
                global_amax = True
            steps.append(("amax", None))
        elif is_target(n, {aten.max.default}):
            global_amax = True
            steps.append(("amax", None))
        else:
            raise _NotQuant(Reason.of(ReasonCode.QUANT_UNKNOWN_STEP, node=n.name, op=_op_name(n)))
        n = arg_node(n, 0)
    return list(reversed(steps)), list(reversed(nodes)), global_amax


def _source(node: Node, reads: Collection[object]) -> Node:
    while is_target(node, reads):
        node = arg_node(node, 0)
    return node


def _terminal_readers(node: Node, reads: Collection[object]) -> list[tuple[Node, Node]]:
    """``(reader, operand)`` for every reader of ``node`` past the ops in ``reads``."""
    found = []
    for user in node.users:
        if is_target(user, reads):
            found += _terminal_readers(user, reads)
        else:
            found.append((user, node))
    return found


def _check_consumers(codes: Node, scale: Node) -> list[Node] | Reason:
    """The matmuls that read ``codes`` and multiply by ``scale``, or why the chain is not one."""
    consumers = []

    def multiplies_by_scale(n: Node) -> bool:
        for user, _ in _terminal_readers(n, VIEWS | CONVERTS):
            if not is_target(user, {aten.mul.Tensor}) or not any(
                    isinstance(a, Node) and _source(a, SCALE_READS) is scale for a in _operands(user)):
                return False
        return bool(n.users)

    for user, operand in _terminal_readers(codes, CODE_READS):
        if is_target(user, SCALED_MMS):
            given = arguments(user)
            factor = given["scale_a" if given["self"] is operand else "scale_b"]
            if not isinstance(factor, Node) or _source(factor, SCALE_READS) is not scale:
                return Reason.of(ReasonCode.QUANT_SCALE_MISMATCH, reader=user.name, op=_op_name(user),
                                 factor=getattr(factor, "name", factor), scale=scale.name)
        elif is_target(user, INT_MMS | CONVERTS):
            if not multiplies_by_scale(user):
                return Reason.of(ReasonCode.QUANT_SCALE_MISMATCH, reader=user.name, op=_op_name(user),
                                 factor="another value", scale=scale.name)
        else:
            return Reason.of(ReasonCode.QUANT_NOT_A_MATMUL, reader=user.name)
        consumers.append(user)
    return consumers or Reason.of(ReasonCode.QUANT_NOT_A_MATMUL, reader="nothing")


def _match_codes(codes: Node, normed: Node, rows: torch.Size) -> QuantMatch | QuantLeftOutside:
    starts = _starts(normed)
    dtype = tensor(codes).dtype
    try:
        code_steps, start, scale, code_nodes = _walk_codes(codes, set(starts))
    except _NotQuant as why:
        return QuantLeftOutside(_label(dtype, False, 0), why.reason)
    group = starts[start]
    static = not _depends_on(scale, normed)
    scale_steps: list[tuple[str, object]] = []
    scale_nodes: list[Node] = []
    global_amax = False
    if not static:
        try:
            scale_steps, scale_nodes, global_amax = _walk_scale(scale, start)
        except _NotQuant as why:
            return QuantLeftOutside(_label(dtype, False, group), why.reason)
    label = _label(dtype, static, group, global_amax)
    if global_amax:
        return QuantLeftOutside(label, Reason(ReasonCode.QUANT_GLOBAL_SCALE))
    if static and (val(scale) is None or tensor(scale).numel() != 1):
        return QuantLeftOutside(label, Reason.of(ReasonCode.QUANT_STATIC_NOT_SCALAR, node=scale.name))
    views: list[Node] = []
    n = start
    while n is not normed:  # the row and group views from the normed rows to the start
        views.insert(0, n)
        n = arg_node(n, 0)
    chain = [*views, *scale_nodes, *code_nodes]
    for node in set(chain) - {codes, scale, *views}:
        outside = [u for u in node.users if u not in chain]
        if outside:
            return QuantLeftOutside(label, Reason.of(ReasonCode.QUANT_SHARED_STEP, node=node.name,
                                                     reader=outside[0].name))
    consumers = _check_consumers(codes, scale)
    if isinstance(consumers, Reason):
        return QuantLeftOutside(label, consumers)
    hidden = tensor(normed).shape[-1]
    op_codes = [*rows, hidden // group, group] if group else [*rows, hidden]
    shape = list(tensor(codes).shape)
    if shape != op_codes and not all(isinstance(d, int) for d in (*shape, *op_codes)):
        return QuantLeftOutside(label, Reason.of(ReasonCode.QUANT_SYMBOLIC_VIEW, rows=list(rows),
                                                 shape=shape[:-1]))
    return QuantMatch((codes,), (scale,), static, group, encode_steps(scale_steps), encode_steps(code_steps),
                      tuple(chain), tuple(consumers), False)


def _merge(matches: list[QuantMatch], normed: Node) -> QuantMatch:
    """One match for the chains of ``matches`` (the same key); ``return_normed`` when a reader of
    the normed rows (or of a view of them) is in none of the chains."""
    nodes = [n for m in matches for n in m.nodes]
    chain = set(nodes)
    views = [n for n in nodes if is_target(n, VIEWS)]  # (the only views in a chain: from the normed rows)
    readers = [u for n in (normed, *views) for u in n.users]
    first = matches[0]
    return QuantMatch(tuple(m.codes[0] for m in matches),
                      first.scales if first.static else tuple(m.scales[0] for m in matches),
                      first.static, first.group_size, first.scale_steps, first.code_steps,
                      tuple(dict.fromkeys(nodes)), tuple(c for m in matches for c in m.consumers),
                      any(u not in chain for u in readers))


def _code_casts(normed: Node) -> list[Node]:
    """Casts to a code dtype within ``_SEARCH_DEPTH`` pointwise or amax steps of ``normed`` (not
    through a matmul: a later linear's own quantization is not this one), in graph order."""
    found, frontier, seen = [], [normed], {normed}
    for _ in range(_SEARCH_DEPTH):
        frontier = [u for n in frontier for u in n.users if u not in seen and is_target(u, QUANT_OPS)]
        seen.update(frontier)
        found += [n for n in frontier if is_target(n, CONVERTS) and _convert_dtype(n) in CODE_DTYPES]
    order = {n: i for i, n in enumerate(normed.graph.nodes)}
    return sorted(dict.fromkeys(found), key=order.__getitem__)


def find_quant(normed: Node, rows: torch.Size, norm_kind: str,
               training: bool) -> QuantMatch | QuantLeftOutside | None:
    """The quantization of the normed rows ``normed`` that the fused op can compute, else why the
    first one found stays outside; None when nothing quantizes them. ``rows``: the fused op's
    leading dims."""
    casts = _code_casts(normed)
    if not casts:
        return None
    found = [_match_codes(codes, normed, rows) for codes in casts]
    matches = [m for m in found if isinstance(m, QuantMatch)]
    if not matches:
        return found[0]
    same = [m for m in matches if m.key == matches[0].key]
    match = dataclasses.replace(_merge(same, normed), others=len(casts) - len(same))
    if norm_kind != RMS_NORM:
        return QuantLeftOutside(match.label, Reason(ReasonCode.QUANT_LAYER_NORM))
    if training:
        return QuantLeftOutside(match.label, Reason(ReasonCode.QUANT_TRAINING))
    return match


def replace_outputs(quant: QuantMatch, graph: Graph, fused: Node) -> list[Node]:
    """Point the readers of the codes and of the dynamic scales at the fused op's outputs (viewed to
    each chain's shape where the op's rows differ: ``[B, S]`` against ``[B*S]``), then erase the
    chains. ``fused`` has its ``meta["val"]``; returns the nodes added (for theirs)."""
    new = []
    outputs = [(0, c) for c in quant.codes] + ([] if quant.static else [(1, s) for s in quant.scales])
    for index, old in outputs:
        with graph.inserting_after(fused):
            out = graph.call_function(operator.getitem, (fused, index))
        new.append(out)
        shape = list(tensor(old).shape)
        if list(fused.meta["val"][index].shape) != shape:  # (static sizes: ``_match_codes``)
            with graph.inserting_after(out):
                out = graph.call_function(aten.view.default, (out, shape))
            new.append(out)
        old.replace_all_uses_with(out)
    for node in reversed(quant.nodes):
        if not node.users:
            graph.erase_node(node)
    return new
