"""TokenWeave two-way token split of a post-grad graph whose sites are already fused.

``apply_token_split(graph, fused_nodes, config, report)`` cuts the token dimension into halves A
and B from the first fused site to the last. Every token-wise node in that region is copied once
per half (weights and other token-free nodes are shared), every site becomes one
``weave.fused_allreduce_rmsnorm_async`` per half, and the copies are laid out per segment (the
nodes between two sites) as::

    [segment k, half A] [site k+1, A: comm stream] [segment k, half B] [site k+1, B: comm stream]

so half A's communication at a site runs while half B computes (attention A, attention B, MLP A,
MLP B, ...). Each async output is read through ``_c10d_functional.wait_tensor`` placed right before
its first consumer; Inductor keeps extern kernels and waits in this order (see docs/overlap.md).

The cut: several sequences are cut between sequences (every op, attention included, sees only
whole sequences); one sequence is cut inside, and half B's queries attend to A's and B's keys and
values with the causal diagonal aligned at the lower right (a B query at position ``i`` sees keys
``0 .. sA + i``), A's keys and values being ready first. Anything the rewrite does not understand
(an op it has no rule for, attention as a math decomposition across a cut, a reduction over tokens)
leaves the graph fuse-only with the reason in ``report.note``: the analysis finishes before the
graph is touched.

Token counts: static shapes get the wave-aware cut of ``weavepass.compile.planner.plan_token_split``. A
symbolic token count gets its cut computed at run time from the symbol (half the sequences; or
half the tokens rounded down to the GEMM row tile), so one graph serves every size from
``MIN_SYMBOLIC_UNITS`` (4) units on, through one guard; 2 or 3 units compile once more, fuse-only
(a one-unit half would specialise the graph). Views are rewritten with ``-1`` for the token entry, so no other size needs
arithmetic.
"""

from __future__ import annotations

import logging
import math
import operator
from dataclasses import dataclass, field

import torch
from torch.fx import Graph, Node
from torch.fx.node import map_arg

from weavepass.config import WeaveConfig
from weavepass.ops import FUSED_ALLREDUCE_RMSNORM, FUSED_ALLREDUCE_RMSNORM_ASYNC, HOLD_INPUTS, WAIT_TENSOR
from weavepass.report import GraphReport
from weavepass.compile.planner import (
    GemmShape,
    TokenSplitPlan,
    device_wave_model,
    overlap_window_reason,
    plan_token_split,
)

log = logging.getLogger("weavepass")

INDUCTOR_CONFIG_PATCHES = {"reorder_for_peak_memory": False}
"""Inductor settings a split graph needs: the peak-memory reordering otherwise moves all of
half A's kernels ahead of half B's first fused op, undoing the overlap schedule. The backend
merges these into its ``config_patches`` when ``overlap != "off"``."""

aten = torch.ops.aten
prims = torch.ops.prims

HALVES = ("A", "B")

VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
REDUCTIONS = {aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default}
DIM_OPS = {  # ops acting along one dim (arg 1) that keep the rank: fine unless it is the token dim
    aten._softmax.default, aten._log_softmax.default, aten.softmax.int, aten.cumsum.default,
}
INDEXED = {aten.gather.default, aten.scatter.src, aten.scatter.value, aten.scatter_add.default,
           aten.scatter.reduce, aten.index_select.default}
ELEMENTWISE_EXTRA = {aten.clone.default, aten._to_copy.default, prims.convert_element_type.default,
                     aten.alias.default, aten.zeros_like.default, aten.ones_like.default,
                     aten.full_like.default, aten.empty_like.default}
CPU_FLASH = aten._scaled_dot_product_flash_attention_for_cpu.default
CUDA_FLASH = aten._scaled_dot_product_flash_attention.default
CUDA_EFFICIENT = aten._scaled_dot_product_efficient_attention.default
CUDA_CUDNN = aten._scaled_dot_product_cudnn_attention.default
# attention op -> (index of the mask/bias argument or None, index of is_causal, keyword of scale)
ATTENTION = {
    CPU_FLASH: (None, 4),  # mask is the keyword ``attn_mask``
    CUDA_FLASH: (None, 4),
    CUDA_EFFICIENT: (3, 6),
    CUDA_CUDNN: (3, 6),
}


class Unsupported(Exception):
    """The split cannot handle a node; the message is the report's reason."""


def _val(node):
    return node.meta.get("val") if isinstance(node, Node) else None


def _hint(size) -> int:
    """A concrete value for a possibly symbolic size (its example value)."""
    if isinstance(size, torch.SymInt):
        return size.node.hint if size.node.hint is not None else int(size.node.expr.subs({}))
    return int(size)


def _shape(node: Node) -> list[int]:
    return [_hint(s) for s in _val(node).shape]


def _norm_dim(dim: int, rank: int) -> int:
    return dim + rank if dim < 0 else dim


def _is_elementwise(target) -> bool:
    return target in ELEMENTWISE_EXTRA or (
        isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags
    )


@dataclass
class _Analysis:
    """What the rewrite needs to know about the region, computed before anything changes."""

    region: list[Node]
    token: dict[Node, object] = field(default_factory=dict)
    """token node -> its token dim (int), or a tuple of dims (None: not a token tensor) for tuples"""
    sliced: dict[Node, dict[Node, int]] = field(default_factory=dict)
    """token node -> {token-free input that must be sliced: the dim to slice}"""
    segment: dict[Node, int] = field(default_factory=dict)
    gemms: list[GemmShape] = field(default_factory=list)
    moe: bool = False


class TokenSplit:
    """The split of one graph: ``analyse()`` (may raise ``Unsupported``), then ``rewrite()``."""

    def __init__(self, graph: Graph, fused: list[Node], config: WeaveConfig):
        self.graph = graph
        order = {n: i for i, n in enumerate(graph.nodes)}
        self.order = order
        self.fused = sorted(fused, key=order.__getitem__)
        self.config = config
        first = self.fused[0]
        partial = _val(first.args[0])
        if partial.dim() == 3:
            self.batch, self.seq = partial.shape[0], partial.shape[1]
        elif partial.dim() == 2:
            self.batch, self.seq = 1, partial.shape[0]
        else:
            raise Unsupported(f"first site's input has shape {tuple(partial.shape)}, not [B, S, H] or [T, H]")
        self.mode = "batch" if _hint(self.batch) >= 2 else "sequence"
        # Token dims count in units: sequences (batch mode) or tokens of the one sequence.
        self.units = self.batch if self.mode == "batch" else self.seq
        self.entry_dim = 0 if self.mode == "batch" or partial.dim() == 2 else 1
        self.device = partial.device

    # ---- analysis -------------------------------------------------------------------------------

    def analyse(self) -> _Analysis:
        last = self.fused[-1]
        start, end = self.order[self.fused[0]], self.order[last]
        region = [n for n in self.graph.nodes if start <= self.order[n] <= end]
        region += [u for u in last.users if u.target is operator.getitem]
        info = _Analysis(region)
        fused_index = {n: i for i, n in enumerate(self.fused)}
        for node in region:
            if node in fused_index:
                info.token[node] = self._fused_dims(node, info)
                info.segment[node] = fused_index[node]
                continue
            token_inputs = [a for a in node.all_input_nodes if a in info.token]
            if not token_inputs:
                continue  # token-free: shared by both halves, stays where it is
            info.segment[node] = max(info.segment[a] for a in token_inputs)
            info.token[node] = self._dims(node, info)
            if node.target in (aten.mm.default, aten.addmm.default):
                weight = _shape(node.args[-1])
                info.gemms.append(GemmShape(n=weight[1], k=weight[0]))
            info.moe |= node.target is aten.topk.default
        return info

    def _fused_dims(self, node: Node, info: _Analysis) -> tuple[int, int]:
        partial, residual = node.args[0], node.args[1]
        if partial in info.token:
            dim = info.token[partial]
        elif node is self.fused[0]:
            dim = self.entry_dim
        else:
            raise Unsupported(f"{node.name}: its input {partial.name} is not computed from the tokens of the first site")
        if residual is not None and residual in info.token and info.token[residual] != dim:
            raise Unsupported(f"{node.name}: residual and partial carry tokens in different dims")
        if residual is not None and residual not in info.token:
            if node is not self.fused[0]:
                raise Unsupported(f"{node.name}: residual {residual.name} does not come from an earlier site")
            info.sliced.setdefault(node, {})[residual] = dim
        if node is self.fused[0] and partial not in info.token:
            info.sliced.setdefault(node, {})[partial] = dim
        return dim, dim

    def _dims(self, node: Node, info: _Analysis):
        """The token dim of ``node``'s output, from its inputs' token dims (or ``Unsupported``)."""
        target, args = node.target, node.args
        tok = info.token
        name = getattr(target, "__name__", str(target))
        if node.op != "call_function":
            raise Unsupported(f"{node.name} ({node.op}) reads token tensors")
        if target is operator.getitem:
            dims = tok[args[0]]
            if not isinstance(dims, tuple) or dims[args[1]] is None:
                raise Unsupported(f"{node.name}: output {args[1]} of {args[0].name} is not split along tokens")
            return dims[args[1]]
        if target is aten.sym_size.int:
            if args[1] == tok[args[0]]:
                raise Unsupported(f"{node.name} reads the size of the token dim")
            return None  # a shared size: computed from half A's copy
        x = args[0]
        if _is_elementwise(target) or target is aten.cat.default:
            return self._broadcast_dims(node, info)
        if target in INDEXED:  # same-rank tensors lined up like an elementwise op, along ``dim``
            d = self._broadcast_dims(node, info)
            if _norm_dim(args[1], _val(node).dim()) == d:
                raise Unsupported(f"{node.name} ({name}) indexes along the token dim")
            return d
        if target in VIEWS:
            d = self._view_dim(node, tok[x])
            _half_view_size(node, d, node.args[1])  # raises when a half's view cannot be written
            return d
        if target in (aten.mm.default, aten.addmm.default):  # addmm: the bias comes first
            a, b = (args[1], args[2]) if target is aten.addmm.default else (args[0], args[1])
            if tok.get(a) != 0 or b in tok or (target is aten.addmm.default and args[0] in tok):
                raise Unsupported(f"{node.name} ({name}): tokens are not the rows of the left operand")
            return 0
        d = tok.get(x) if isinstance(x, Node) else None
        if d is None:
            if target in (aten.mm.default, aten.bmm.default):
                raise Unsupported(f"{node.name} ({name}) contracts or indexes over the token dim")
            raise Unsupported(f"{node.name} ({name}): token tensor in an unsupported argument position")
        rank = _val(x).dim()
        if target is aten.unsqueeze.default:
            return d + (_norm_dim(args[1], rank + 1) <= d)
        if target in (aten.squeeze.dim, aten.squeeze.dims):
            dims = args[1] if isinstance(args[1], (list, tuple)) else [args[1]]
            dims = [_norm_dim(i, rank) for i in dims]
            if d in dims:
                raise Unsupported(f"{node.name} squeezes the token dim")
            return d - sum(i < d for i in dims)
        if target is aten.permute.default:
            return [_norm_dim(p, rank) for p in args[1]].index(d)
        if target is aten.transpose.int:
            a, b = _norm_dim(args[1], rank), _norm_dim(args[2], rank)
            return b if d == a else a if d == b else d
        if target is aten.t.default:
            return 1 - d
        if target is aten.expand.default:
            return d + len(args[1]) - rank
        if target in (aten.slice.Tensor, aten.select.int, aten.split.Tensor, aten.split_with_sizes.default):
            dim = _norm_dim(args[1] if target in (aten.slice.Tensor, aten.select.int) else
                            (args[2] if len(args) > 2 else node.kwargs.get("dim", 0)), rank)
            if dim == d:
                raise Unsupported(f"{node.name} ({name}) slices the token dim")
            if target is aten.select.int:
                return d - (dim < d)
            if target in (aten.split.Tensor, aten.split_with_sizes.default):
                return tuple(d for _ in _val(node))
            return d
        if target in REDUCTIONS:
            dims = [_norm_dim(i, rank) for i in (args[1] if len(args) > 1 and args[1] else range(rank))]
            keep = args[2] if len(args) > 2 else node.kwargs.get("keepdim", False)
            if d in dims:
                raise Unsupported(f"{node.name} ({name}) reduces over the token dim")
            return d if keep else d - sum(i < d for i in dims)
        if target in DIM_OPS or target is aten.topk.default:
            if target is aten.topk.default:
                dim_arg = args[2] if len(args) > 2 else node.kwargs.get("dim", -1)
            else:
                dim_arg = args[1]
            if _norm_dim(dim_arg, rank) == d:
                raise Unsupported(f"{node.name} ({name}) works along the token dim")
            for other in node.all_input_nodes:
                if other is not x and tok.get(other, d) != d:
                    raise Unsupported(f"{node.name} ({name}): inputs carry tokens in different dims")
                if other is not x and other not in tok:
                    raise Unsupported(f"{node.name} ({name}): token-free index or source")
            return (d, d) if target is aten.topk.default else d
        if target is aten.bmm.default:
            a, b = args
            if self.mode == "batch" and tok.get(a) == 0 and tok.get(b) == 0:
                return 0  # batched over (sequence x head): whole sequences on each side
            raise Unsupported(f"{node.name} (bmm): attention as a math decomposition across a cut sequence")
        if target in ATTENTION:
            return self._attention_dims(node, info)
        raise Unsupported(f"{node.name}: the token split has no rule for {name}")

    def _broadcast_dims(self, node: Node, info: _Analysis) -> int:
        """Elementwise ops and ``cat``: inputs aligned from the right (``cat``: same rank)."""
        out = _val(node)
        rank = out.dim()
        tensors = node.args[0] if node.target is aten.cat.default else node.all_input_nodes
        tensors = [t for t in tensors if isinstance(t, Node) and isinstance(_val(t), torch.Tensor)]
        dims = {info.token[t] - _val(t).dim() + rank for t in tensors if t in info.token}
        if len(dims) != 1:
            raise Unsupported(f"{node.name}: inputs carry tokens in different dims {sorted(dims)}")
        d = dims.pop()
        if node.target is aten.cat.default and _norm_dim(node.args[1] if len(node.args) > 1 else 0, rank) == d:
            raise Unsupported(f"{node.name} concatenates along the token dim")
        full = _hint(out.shape[d])
        for t in tensors:
            if t in info.token:
                continue
            pos = d - rank + _val(t).dim()
            if pos < 0 or _hint(_val(t).shape[pos]) == 1:
                continue  # broadcast along tokens: the same tensor serves both halves
            if _hint(_val(t).shape[pos]) != full:
                raise Unsupported(f"{node.name}: {t.name} does not line up with the tokens")
            info.sliced.setdefault(node, {})[t] = pos
        return d

    def _view_dim(self, node: Node, d: int) -> int:
        """The output dim a reshape maps the token dim to: same elements before it, and both halves
        still a whole number of rows there."""
        src, dst = _shape(node.args[0]), _shape(node)
        prefix = 1
        for i in range(d):
            prefix *= src[i]
        inner = 1
        for s in src[d + 1:]:
            inner *= s
        first = self._first_units(src[d])
        out_prefix = 1
        for j, size in enumerate(dst):
            out_inner = 1
            for s in dst[j + 1:]:
                out_inner *= s
            if out_prefix == prefix and size > 1 and (first * inner) % out_inner == 0 \
                    and 0 < first * inner // out_inner < size:
                return j
            out_prefix *= size
        raise Unsupported(f"{node.name}: view {src} -> {dst} does not keep the token cut in one dim")

    def _first_units(self, size: int) -> int:
        """Half A's share of a token dim of ``size`` (hint values)."""
        units = _hint(self.units)
        if size % units:
            raise Unsupported(f"a token dim of size {size} is not a multiple of {units} {self.mode} units")
        return size // units * self.first_hint

    def _attention_dims(self, node: Node, info: _Analysis) -> tuple:
        q, k, v = node.args[:3]
        dims = {info.token.get(t) for t in (q, k, v)}
        mask_index, causal_index = ATTENTION[node.target]
        mask = node.kwargs.get("attn_mask") if mask_index is None else (
            node.args[mask_index] if len(node.args) > mask_index else None)
        dropout_index = 3 if node.target in (CPU_FLASH, CUDA_FLASH) else 5
        if len(node.args) > dropout_index and node.args[dropout_index] != 0.0:
            raise Unsupported(f"{node.name}: attention with dropout")
        if isinstance(mask, Node) and mask in info.token:
            raise Unsupported(f"{node.name}: the attention mask is computed from token tensors")
        used = {u.args[1] for u in node.users}
        if any(u.target is not operator.getitem for u in node.users) or used - {0}:
            raise Unsupported(f"{node.name}: attention outputs other than the result are used")
        expected = 0 if self.mode == "batch" else 2
        if dims != {expected}:
            raise Unsupported(f"{node.name}: q/k/v carry tokens in dims {dims}, expected {expected}")
        if isinstance(mask, Node):
            mshape = _shape(mask)
            if self.mode == "batch":
                if len(mshape) == 4 and mshape[0] != 1:
                    info.sliced.setdefault(node, {})[mask] = 0
            elif len(mshape) < 2:
                raise Unsupported(f"{node.name}: attention mask of shape {mshape}")
        return (expected,) + (None,) * (len(_val(node)) - 1)

    # ---- plan -----------------------------------------------------------------------------------

    def plan(self, info: _Analysis) -> TokenSplitPlan:
        batch, seq = _hint(self.batch), _hint(self.seq)
        return plan_token_split(
            batch if self.mode == "batch" else 1, seq if self.mode == "batch" else batch * seq,
            info.gemms, self.config, device_wave_model(self.device), moe=info.moe,
        )

    # ---- rewrite --------------------------------------------------------------------------------

    def rewrite(self, info: _Analysis) -> None:
        g = self.graph
        last = info.region[-1]
        anchor = last.next
        while anchor.op != "output" and anchor.target is operator.getitem and anchor.args[0] is self.fused[-1]:
            anchor = anchor.next
        self.copies: dict[str, dict[Node, Node]] = {h: {} for h in HALVES}
        self.waited: dict[Node, Node] = {}
        self.held: set[Node] = set()  # async ops whose inputs a hold_inputs already reads
        self.slices: dict[tuple, Node] = {}
        self.merged: dict[tuple, Node] = {}  # (attention node, half) -> its output 0, already merged
        with g.inserting_before(anchor):
            self.split_point = self._emit_split_point()
            by_segment: dict[int, list[Node]] = {}
            for node in info.region:
                if node in info.token and node not in self.fused:
                    by_segment.setdefault(info.segment[node], []).append(node)
            for half in HALVES:
                self._emit(self.fused[0], half, info)
            for k in range(len(self.fused)):
                for half in HALVES:
                    for node in by_segment.get(k, []):
                        self._emit(node, half, info)
                    if k + 1 < len(self.fused):
                        self._emit(self.fused[k + 1], half, info)
            outside = [n for n in info.token if any(u not in info.token for u in n.users)]
            for node in outside:
                joined = self._emit_new(
                    aten.cat.default,
                    ([self._read(node, h) for h in HALVES], info.token[node]),
                )
                for user in [u for u in node.users if u not in info.token]:
                    user.replace_input_with(node, joined)
            for half in HALVES:  # join every fork, also where an output is never read
                for node in list(self.copies[half]):
                    self._read(node, half)
        for node in reversed(list(info.token)):
            g.erase_node(node)

    def _emit_new(self, target, args, kwargs=None) -> Node | int:
        """A new node computing ``target(*args)``, or the plain int when it computes a number.

        Size arithmetic on a symbolic token count that guards have pinned to one value yields ints,
        and Inductor rejects graph nodes whose value is a plain int, so those are folded into their
        users' arguments. (The one-size ``auto`` window used to pin it; it no longer compares a
        symbolic count at all, but guards from the model itself can still pin one.)"""
        kwargs = kwargs or {}
        args_v, kwargs_v = map_arg((args, kwargs), lambda n: n.meta["val"])
        val = _fake_call(target, args_v, kwargs_v)
        if type(val) is int:
            return val
        node = self.graph.call_function(target, args, kwargs)
        node.meta["val"] = val
        return node

    def _emit_split_point(self):
        """Half A's number of units (sequences or tokens): an int, or a SymInt node for a symbolic
        token count (``units // 2``; tokens rounded down to a GEMM row tile when there are 2+ tiles)."""
        if not isinstance(self.units, torch.SymInt):
            return self.first_hint
        partial = self.fused[0].args[0]
        units = self._emit_new(aten.sym_size.int, (partial, 0 if self.mode == "batch" else self.entry_dim))
        half = self._emit_new(operator.floordiv, (units, 2))
        if self.mode == "batch":
            return half
        tile = device_wave_model(self.device).tile_m
        tiles = self._emit_new(operator.mul, (self._emit_new(operator.floordiv, (half, tile)), tile))
        small = self._emit_new(torch.sym_min, (half, tile - 1))
        return self._emit_new(torch.sym_max, (tiles, small))

    def _bounds(self, node: Node, dim: int, half: str) -> tuple:
        """``(start, end)`` of ``half`` along token dim ``dim`` of ``node`` (full size there)."""
        size = _val(node).shape[dim]
        if isinstance(self.split_point, int) and not isinstance(size, torch.SymInt):
            cut = size // _hint(self.units) * self.split_point
        else:
            size_node = self._emit_new(aten.sym_size.int, (node, dim))
            per_unit = self._emit_new(operator.floordiv, (size_node, self._units_node()))
            cut = self._emit_new(operator.mul, (per_unit, self.split_point))
        return (0, cut) if half == "A" else (cut, torch.iinfo(torch.int64).max)

    def _units_node(self):
        if not isinstance(self.units, torch.SymInt):
            return self.units
        partial = self.fused[0].args[0]
        return self._emit_new(aten.sym_size.int, (partial, 0 if self.mode == "batch" else self.entry_dim))

    def _slice(self, node: Node, dim: int, half: str) -> Node:
        key = (node, dim, half)
        if key not in self.slices:
            start, end = self._bounds(node, dim, half)
            self.slices[key] = self._emit_new(aten.slice.Tensor, (node, dim, start, end))
        return self.slices[key]

    def _read(self, node: Node, half: str) -> Node:
        """``node``'s copy for ``half``, through its wait when it is an async fused op's output."""
        copy = self.copies[half][node]
        if copy.target is operator.getitem and copy.args[0].target is FUSED_ALLREDUCE_RMSNORM_ASYNC:
            if copy not in self.waited:
                self.waited[copy] = self._emit_new(WAIT_TENSOR, (copy,))
                fork = copy.args[0]
                if fork not in self.held:  # the first wait joins the stream: inputs free after it
                    self.held.add(fork)
                    inputs = [a for a in fork.args[:2] if isinstance(a, Node)]  # partial, residual
                    self._emit_new(HOLD_INPUTS, (self.waited[copy], inputs))
            return self.waited[copy]
        return copy

    def _emit(self, node: Node, half: str, info: _Analysis) -> None:
        sliced = info.sliced.get(node, {})

        def arg(a):
            if a in info.token:
                return self._read(a, half)
            if a in sliced:
                return self._slice(a, sliced[a], half)
            return a

        if node.target is operator.getitem and (node.args[0], half) in self.merged:
            self.copies[half][node] = self.merged[(node.args[0], half)]  # output 0, the only one read
            return
        args, kwargs = map_arg((node.args, node.kwargs), arg)
        target = node.target
        if node in self.fused:
            target = FUSED_ALLREDUCE_RMSNORM_ASYNC
            args = (*args, self.config.overlap_comm_ctas)
        elif target in VIEWS:
            args = (args[0], _half_view_size(node, info.token[node], args[1]), *args[2:])
        elif target is aten.expand.default:
            size = list(args[1])
            size[info.token[node]] = -1  # keep the half's own size, whatever the cut
            args = (args[0], size, *args[2:])
        elif target is aten.sym_size.int:
            self.copies[half][node] = self.copies["A"][node] if half == "B" else self._emit_new(target, args)
            return
        elif target in ATTENTION and self.mode == "sequence":
            self.copies[half][node] = self._emit_attention(node, half, args, kwargs)
            return
        self.copies[half][node] = self._emit_new(target, args, kwargs)

    def _emit_attention(self, node: Node, half: str, args, kwargs) -> Node:
        """One sequence cut at ``sA``: A is ordinary causal attention over its own tokens; B's
        queries attend to A's and B's keys with the causal diagonal at the lower right. Without an
        explicit mask that is two calls of the same op merged by log-sum-exp (``_merge_by_lse``);
        with one, B's rows of the mask over ``cat(K_A, K_B)``."""
        mask_index, causal_index = ATTENTION[node.target]
        mask = kwargs.get("attn_mask") if mask_index is None else (
            args[mask_index] if len(args) > mask_index else None)
        causal = bool(args[causal_index]) if len(args) > causal_index else bool(kwargs.get("is_causal", False))
        q, k_half, v_half = args[:3]
        scale = kwargs.get("scale")
        if half == "A":
            if isinstance(mask, Node):  # queries [0, sA) x keys [0, sA)
                mask = self._mask_rows_keys(mask, "A")
                args, kwargs = self._with_mask(node.target, args, kwargs, mask)
            return self._emit_new(node.target, args, kwargs)
        if not isinstance(mask, Node):
            # B's queries see all of A's keys (no mask: A precedes B) and B's own keys (causal, a
            # square, so upper-left and lower-right alignment agree). Two calls of the graph's own
            # attention op, combined by their log-sum-exps: the same kernel as before the split, no
            # bias tensor, no concatenated K/V, and masked blocks are skipped, not computed.
            k_a, v_a = self._read(node.args[1], "A"), self._read(node.args[2], "A")
            prefix = self._attend(node.target, q, k_a, v_a, False, scale)
            own = self._attend(node.target, q, k_half, v_half, causal, scale)
            self.merged[(node, half)] = self._merge_by_lse(prefix, own, _val(q).dtype)
            return own[0]  # placeholder copy: the one reader (output 0) takes the merged value
        k = self._emit_new(aten.cat.default, ([self._read(node.args[1], "A"), k_half], 2))
        v = self._emit_new(aten.cat.default, ([self._read(node.args[2], "A"), v_half], 2))
        bias = self._mask_rows_keys(mask, "B")  # explicit masks exclude is_causal (SDPA's rule)
        if node.target is CPU_FLASH:
            return self._emit_new(CPU_FLASH, (q, k, v, 0.0, False), {"attn_mask": bias, "scale": scale})
        # CUDA: flash has no mask argument; the efficient kernel takes an additive bias.
        if _val(bias).dtype == torch.bool:
            bias = self._additive(bias, _val(q).dtype)
        bias = self._emit_new(aten.expand.default, (bias, [_hint(s) for s in _val(q).shape[:2]] + [-1, -1]))
        return self._emit_new(CUDA_EFFICIENT, (q, k, v, bias, False, 0.0, False), {"scale": scale})

    def _attend(self, target, q: Node, k: Node, v: Node, causal: bool, scale) -> tuple[Node, Node]:
        """``target`` (an attention op of ``ATTENTION``) without mask: (output, log-sum-exp as
        ``[B, H, Sq, 1]`` fp32)."""
        if target is CPU_FLASH:
            call = self._emit_new(CPU_FLASH, (q, k, v, 0.0, causal), {"scale": scale})
        elif target is CUDA_FLASH:
            call = self._emit_new(CUDA_FLASH, (q, k, v, 0.0, causal, False), {"scale": scale})
        elif target is CUDA_EFFICIENT:
            call = self._emit_new(CUDA_EFFICIENT, (q, k, v, None, True, 0.0, causal), {"scale": scale})
        else:
            call = self._emit_new(CUDA_CUDNN, (q, k, v, None, True, 0.0, causal, False), {"scale": scale})
        out = self._emit_new(operator.getitem, (call, 0))
        lse = self._emit_new(operator.getitem, (call, 1))
        if _val(lse).dim() == 4:  # cuDNN: [B, H, Sq, 1] already
            return out, lse
        rows = _val(q).shape[2]
        if _val(lse).shape[2] != rows:  # the efficient kernel pads Sq to a multiple of 32
            end = self._emit_new(aten.sym_size.int, (q, 2)) if isinstance(rows, torch.SymInt) else rows
            lse = self._emit_new(aten.slice.Tensor, (lse, 2, 0, end))
        return out, self._emit_new(aten.unsqueeze.default, (lse, 3))

    def _merge_by_lse(self, first: tuple[Node, Node], second: tuple[Node, Node], dtype) -> Node:
        """Softmax attention over the union of two disjoint key sets, from each set's output and
        log-sum-exp: ``(o1 e^(l1-m) + o2 e^(l2-m)) / (e^(l1-m) + e^(l2-m))``, in fp32."""
        e = self._emit_new
        (o1, l1), (o2, l2) = first, second
        m = e(aten.maximum.default, (l1, l2))
        w1 = e(aten.exp.default, (e(aten.sub.Tensor, (l1, m)),))
        w2 = e(aten.exp.default, (e(aten.sub.Tensor, (l2, m)),))
        f32 = torch.float32
        num = e(aten.add.Tensor, (
            e(aten.mul.Tensor, (e(prims.convert_element_type.default, (o1, f32)), w1)),
            e(aten.mul.Tensor, (e(prims.convert_element_type.default, (o2, f32)), w2)),
        ))
        out = e(aten.div.Tensor, (num, e(aten.add.Tensor, (w1, w2))))
        return e(prims.convert_element_type.default, (out, dtype))

    def _mask_rows_keys(self, mask: Node, half: str) -> Node:
        """Rows (queries) of ``half``; keys ``[0, sA)`` for A, all keys for B."""
        rank = _val(mask).dim()
        shape = _shape(mask)
        out = mask
        if shape[-2] != 1:
            out = self._emit_new(aten.slice.Tensor, (out, rank - 2, *self._bounds(mask, rank - 2, half)))
        if half == "A" and shape[-1] != 1:
            out = self._emit_new(aten.slice.Tensor, (out, rank - 1, *self._bounds(mask, rank - 1, "A")))
        return out

    def _additive(self, allowed: Node, dtype: torch.dtype) -> Node:
        zero = self._emit_new(aten.full.default, ([], 0.0), dict(dtype=dtype, device=_val(allowed).device))
        ninf = self._emit_new(aten.full.default, ([], float("-inf")), dict(dtype=dtype, device=_val(allowed).device))
        return self._emit_new(aten.where.self, (allowed, zero, ninf))

    @staticmethod
    def _with_mask(target, args, kwargs, mask):
        mask_index, _ = ATTENTION[target]
        if mask_index is None:
            return args, {**kwargs, "attn_mask": mask}
        args = list(args)
        args[mask_index] = mask
        return tuple(args), kwargs


def _half_view_size(node: Node, token_dim: int, size) -> list:
    """A view's size list for one half: ``-1`` at the token dim, so the half's own size is
    inferred whatever the cut. A view can infer only one entry, so an entry the model itself left
    to inference (HF: ``view(*input_shape, -1, head_dim)``) is written out from the view's output,
    where it is the same for both halves."""
    out = _val(node).shape
    size = list(size)
    for i, entry in enumerate(size):
        if i != token_dim and isinstance(entry, int) and entry == -1:
            if not isinstance(out[i], int):
                raise Unsupported(f"{node.name}: view infers a symbolic size ({out[i]}) besides the token dim")
            size[i] = out[i]
    size[token_dim] = -1
    return size


def _fake_call(target, args, kwargs):
    from torch._guards import detect_fake_mode

    mode = detect_fake_mode([a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)])
    if mode is None:
        return target(*args, **kwargs)
    with mode:
        return target(*args, **kwargs)


MIN_SYMBOLIC_UNITS = 4
"""A symbolic token count is split only when it has at least this many units (tokens, or sequences
in batch mode), through one guard. Below it a half could be a single unit, and size-1 dims are
special to shape checks and Inductor (contiguity, broadcasting): they guard on ``half != 1`` in
many places, and 2 and 3 units then compiled a graph each (3 compiles for one ``mark_dynamic``
input). With the guard, sizes of 4 and more share one graph and 2-3 share one fuse-only graph."""


def apply_token_split(
    graph: Graph, fused_nodes: list[Node], config: WeaveConfig, report: GraphReport
) -> bool:
    """Split the token dimension into two overlapped halves; returns True when the graph changed.

    On any reason not to split, the graph stays fuse-only and ``report.note`` says why.
    """
    def skip(reason: str) -> bool:
        report.add_note(f"fuse-only: {reason}")
        log.info("weavepass: token split skipped: %s", reason)
        return False

    fused_nodes = [n for n in fused_nodes if n.target is FUSED_ALLREDUCE_RMSNORM]
    if len(fused_nodes) < 2:
        return skip(f"{len(fused_nodes)} fused site(s): no compute between sites to overlap with")
    tokens = math.prod(_shape(fused_nodes[0].args[0])[:-1])  # hints: reading sizes adds no guard
    if tokens < 2:
        return skip(f"{tokens} token(s): nothing to split")
    try:
        split = TokenSplit(graph, fused_nodes, config)
        split.first_hint = 1  # provisional: the analysis needs a cut to check views against
        info = split.analyse()
        tokens_sym = math.prod(_val(fused_nodes[0].args[0]).shape[:-1])
        if isinstance(tokens_sym, torch.SymInt):  # static counts: plan_token_split checks them
            outside = overlap_window_reason(tokens_sym, config, info.moe)  # guards the window
            if outside is not None:
                return skip(outside)
        if isinstance(split.units, torch.SymInt) and not split.units >= MIN_SYMBOLIC_UNITS:  # one guard
            return skip(f"{_hint(split.units)} {split.mode} unit(s) on a symbolic count: a half of one "
                        f"unit would specialise the graph; split from {MIN_SYMBOLIC_UNITS} units on")
        plan = split.plan(info)
        if plan.first is None:
            return skip(plan.reason)
        unit = plan.tokens // _hint(split.units)
        split.first_hint = plan.first // unit
        info = split.analyse()  # re-check every view against the real cut
    except Unsupported as error:
        return skip(f"token split not possible: {error}")
    split.rewrite(info)
    symbolic = isinstance(split.units, torch.SymInt)
    cut = "computed at run time from the symbolic size" if symbolic else (
        f"A = {plan.first} / B = {plan.tokens - plan.first} tokens"
        + (", wave inequality holds" if plan.free else ", wave inequality does not hold"))
    report.add_note(f"token split ({plan.mode}): {cut}; {len(fused_nodes)} sites x 2 halves")
    log.info("weavepass: %s", report.notes[-1])
    return True
