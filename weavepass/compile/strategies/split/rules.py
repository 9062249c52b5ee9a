"""Which dim of a node's output carries the tokens, from its inputs' token dims: one small rule
per op or op category, registered by op (the idea of DTensor's per-op sharding rules, for one
sharded dim).

``rule_for(target)`` is a function ``(node, info) -> token dims`` that raises ``Unsupported`` with
the report's reason. A token dim is an int; an op with several outputs gets a tuple with one entry
per output (None: that output carries no tokens); a token-free value (a size) gets None. ``info``
is the ``Analysis`` in progress: the token dims of every earlier node (``info.token``), the cut
(``info.cut``), and where token-free inputs must be sliced per half (``info.sliced``, filled by the
rules). Ops tagged pointwise need no registration; an op with no rule is refused, so the graph
stays fuse-only rather than be split wrongly.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import NoReturn, TypeVar

import torch
from torch.fx import Node
from torch.fx.node import Argument

from weavepass.compile.fx_args import (
    arg,
    arg_int,
    arg_ints,
    arg_list,
    arg_node,
    arguments,
    as_list,
    as_node,
    as_optional_node,
    tensor,
)
from weavepass.compile.reasons import Reason, ReasonCode

from .attention import ATTENTION, attention_dims
from .base import Unsupported, norm_dim, op_name, val
from .state import Analysis, TokenDims, input_token_dim
from .symbolic import hint, shape

aten = torch.ops.aten
prims = torch.ops.prims
c10d = torch.ops._c10d_functional

Rule = Callable[[Node, Analysis], TokenDims]

_RULES: dict[object, Rule] = {}

VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


R = TypeVar("R", bound=Rule)


def register(*targets: object) -> Callable[[R], R]:
    """Decorator: the rule gives the token dim of every op in ``targets``."""
    def add(rule: R) -> R:
        for target in targets:
            if target in _RULES:
                raise ValueError(f"two token-dim rules for {target}")
            _RULES[target] = rule
        return rule
    return add


def rule_for(target: object) -> Rule:
    """The token-dim rule of ``target``: its registered rule, the broadcast rule for an op tagged
    pointwise, else a rule that refuses it."""
    rule = _RULES.get(target)
    if rule is not None:
        return rule
    if isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags:
        return broadcast_dims
    return _no_rule


def _no_rule(node: Node, info: Analysis) -> NoReturn:
    input_token_dim(node, info)  # a token tensor in another argument is named as such first
    raise Unsupported(Reason.of(ReasonCode.SPLIT_NO_RULE, node=node.name, op=op_name(node.target)))


def site_dims(node: Node, info: Analysis) -> tuple[int, int]:
    """A fused site (not a registered rule: only the sites being split get it): both outputs carry
    tokens where its input does. The first site's inputs come from outside the region and are
    sliced; every later site's residual must come from an earlier site."""
    args = arguments(node)
    partial = as_node(args["partial"], node, "partial")
    residual = as_optional_node(args["residual"], node, "residual")
    first = node is info.sites[0]
    if partial in info.token:
        dim = info.dim(partial)
    elif first:
        dim = info.cut.entry_dim
    else:
        raise Unsupported(Reason.of(ReasonCode.SPLIT_PARTIAL_NOT_FROM_TOKENS, node=node.name, partial=partial.name))
    if residual is not None and residual in info.token and info.token[residual] != dim:
        raise Unsupported(Reason.of(ReasonCode.SPLIT_RESIDUAL_PARTIAL_DIMS, node=node.name))
    if residual is not None and residual not in info.token:
        if not first:
            raise Unsupported(Reason.of(ReasonCode.SPLIT_RESIDUAL_NOT_FROM_SITE, node=node.name,
                                        residual=residual.name))
        info.sliced.setdefault(node, {})[residual] = dim
    if first and partial not in info.token:
        info.sliced.setdefault(node, {})[partial] = dim
    return dim, dim


# ---- structure: outputs of multi-output ops, sizes ------------------------------------------------

@register(operator.getitem)
def _output(node: Node, info: Analysis) -> int | None:
    source, index = arg_node(node, 0), arg_int(node, 1)
    dims = info.token[source]
    if not isinstance(dims, tuple) or dims[index] is None:
        raise Unsupported(Reason.of(ReasonCode.SPLIT_OUTPUT_NOT_SPLIT, node=node.name, index=index, source=source.name))
    return dims[index]


@register(aten.sym_size.int)
def _size(node: Node, info: Analysis) -> None:
    if node.args[1] == info.token[arg_node(node, 0)]:
        raise Unsupported(Reason.of(ReasonCode.SPLIT_READS_TOKEN_SIZE, node=node.name))
    return None  # a shared size: computed from half A's copy


# ---- pointwise: inputs broadcast against each other ----------------------------------------------

@register(aten.cat.default, aten.clone.default, aten._to_copy.default, prims.convert_element_type.default,
          aten.alias.default, aten.zeros_like.default, aten.ones_like.default, aten.full_like.default,
          aten.empty_like.default)
def broadcast_dims(node: Node, info: Analysis) -> int:
    """Elementwise ops and ``cat``: inputs aligned from the right (``cat``: same rank). A token-free
    input that lines up with the tokens is sliced per half; one of size 1 there is shared."""
    out = val(node)
    rank = out.dim()
    inputs = arg_list(node, 0) if node.target is aten.cat.default else node.all_input_nodes
    tensors = [t for t in inputs if isinstance(t, Node) and isinstance(val(t), torch.Tensor)]
    dims: set[int] = {info.dim(t) - val(t).dim() + rank for t in tensors if t in info.token}
    if len(dims) != 1:
        raise Unsupported(Reason.of(ReasonCode.SPLIT_INPUT_DIMS_DIFFER, node=node.name, dims=sorted(dims)))
    d = dims.pop()
    if node.target is aten.cat.default and norm_dim(arg_int(node, 1, default=0), rank) == d:
        raise Unsupported(Reason.of(ReasonCode.SPLIT_CAT_TOKEN_DIM, node=node.name))
    full = hint(out.shape[d])
    for t in tensors:
        if t in info.token:
            continue
        pos = d - rank + val(t).dim()
        if pos < 0 or hint(val(t).shape[pos]) == 1:
            continue  # broadcast along tokens: the same tensor serves both halves
        if hint(val(t).shape[pos]) != full:
            raise Unsupported(Reason.of(ReasonCode.SPLIT_NOT_LINED_UP, node=node.name, t=t.name))
        info.sliced.setdefault(node, {})[t] = pos
    return d


@register(aten.copy.default)
def _copy(node: Node, info: Analysis) -> int:
    """``copy(self, src)``: ``src`` broadcast into ``self``'s shape, like an elementwise op (a
    token-free ``self`` as long as the tokens is sliced per half)."""
    return broadcast_dims(node, info)


@register(aten.copy_.default)
def _copy_in_place(node: Node, info: Analysis) -> NoReturn:
    raise Unsupported(Reason.of(ReasonCode.SPLIT_IN_PLACE_WRITE, node=node.name, target=arg_node(node, 0).name))


@register(aten.gather.default, aten.scatter.src, aten.scatter.value, aten.scatter_add.default,
          aten.scatter.reduce)
def _indexed(node: Node, info: Analysis) -> int:
    """Same-rank tensors lined up like an elementwise op, indexed along ``dim`` (arg 1). These ops
    do not broadcast: an index or source shorter than the output in the token dim (1 included)
    reads or writes the first rows only, which for half B are not the whole's first rows."""
    d = _lined_up_along(node, info, arg_int(node, 1))
    tensors = [t for t in node.all_input_nodes if isinstance(val(t), torch.Tensor)] + [node]
    sizes = {t.name: hint(val(t).shape[d]) for t in tensors}
    if len(set(sizes.values())) != 1:
        raise Unsupported(Reason.of(ReasonCode.SPLIT_NO_BROADCAST, node=node.name, op=op_name(node.target),
                                    sizes=sizes))
    return d


@register(aten.index_select.default)
def _index_select(node: Node, info: Analysis) -> int:
    """Rows of ``self`` along ``dim`` (arg 1) picked by a 1-d index: the output keeps ``self``'s
    token dim. An index computed from tokens (an embedding-like lookup) would put the tokens in
    ``dim``, which the elementwise alignment cannot see: refused."""
    dim, index = arg_int(node, 1), arg_node(node, 2)
    if index in info.token:
        raise Unsupported(Reason.of(ReasonCode.SPLIT_INDEX_FROM_TOKENS, node=node.name, index=index.name))
    d = input_token_dim(node, info)
    if norm_dim(dim, rank_of(node)) == d:
        raise Unsupported(Reason.of(ReasonCode.SPLIT_INDEX_SELECT_TOKEN_DIM, node=node.name))
    return d


@register(aten.slice_scatter.default)
def _slice_scattered(node: Node, info: Analysis) -> int:
    """``src`` written into a slice of ``self`` along ``dim`` (arg 2; functionalised ``x[..., a:b] = y``)."""
    return _lined_up_along(node, info, arg_int(node, 2, "dim", 0))


def _lined_up_along(node: Node, info: Analysis, dim: int) -> int:
    d = broadcast_dims(node, info)
    if norm_dim(dim, val(node).dim()) == d:
        raise Unsupported(Reason.of(ReasonCode.SPLIT_INDEXES_TOKEN_DIM, node=node.name, op=op_name(node.target)))
    return d


# ---- views and shape ops ---------------------------------------------------------------------------

@register(*VIEWS)
def _view(node: Node, info: Analysis) -> int:
    d = view_dim(node, input_token_dim(node, info), info)  # a token-free view sized from tokens: refused
    half_view_size(node, d, node.args[1])  # raises when a half's view cannot be written
    return d


def view_dim(node: Node, d: int, info: Analysis) -> int:
    """The output dim a reshape maps token dim ``d`` to: same elements before it, and both halves
    still a whole number of rows there."""
    src, dst = shape(arg_node(node, 0)), shape(node)
    prefix = 1
    for i in range(d):
        prefix *= src[i]
    inner = 1
    for s in src[d + 1:]:
        inner *= s
    first = info.cut.first_units(src[d])
    out_prefix = 1
    for j, size in enumerate(dst):
        out_inner = 1
        for s in dst[j + 1:]:
            out_inner *= s
        if out_prefix == prefix and size > 1 and (first * inner) % out_inner == 0 \
                and 0 < first * inner // out_inner < size:
            return j
        out_prefix *= size
    raise Unsupported(Reason.of(ReasonCode.SPLIT_VIEW_MOVES_CUT, node=node.name, src=src, dst=dst))


def half_view_size(node: Node, token_dim: int, size: Argument) -> list[Argument]:
    """A view's size list for one half: ``-1`` at the token dim, so the half's own size is
    inferred whatever the cut. A view can infer only one entry, so an entry the model itself left
    to inference (HF: ``view(*input_shape, -1, head_dim)``) is written out from the view's output,
    where it is the same for both halves."""
    out = val(node).shape
    half_size = as_list(size, node, "size")
    for i, entry in enumerate(half_size):
        if i != token_dim and isinstance(entry, int) and entry == -1:
            if not isinstance(out[i], int):
                raise Unsupported(Reason.of(ReasonCode.SPLIT_VIEW_SYMBOLIC_SIZE, node=node.name, size=out[i]))
            half_size[i] = out[i]
    half_size[token_dim] = -1
    return half_size


def rank_of(node: Node) -> int:
    return tensor(arg_node(node, 0)).dim()


@register(aten.unsqueeze.default)
def _unsqueeze(node: Node, info: Analysis) -> int:
    d = input_token_dim(node, info)
    return d + (norm_dim(arg_int(node, 1), rank_of(node) + 1) <= d)


@register(aten.squeeze.dim, aten.squeeze.dims)
def _squeeze(node: Node, info: Analysis) -> int:
    d = input_token_dim(node, info)
    squeezed = arg_ints(node, 1) if isinstance(node.args[1], (list, tuple)) else [arg_int(node, 1)]
    dims = [norm_dim(i, rank_of(node)) for i in squeezed]
    if d in dims:
        raise Unsupported(Reason.of(ReasonCode.SPLIT_SQUEEZES_TOKEN_DIM, node=node.name))
    return d - sum(i < d for i in dims)


@register(aten.permute.default)
def _permute(node: Node, info: Analysis) -> int:
    d = input_token_dim(node, info)
    return [norm_dim(p, rank_of(node)) for p in arg_ints(node, 1)].index(d)


@register(aten.transpose.int)
def _transpose(node: Node, info: Analysis) -> int:
    d = input_token_dim(node, info)
    a, b = norm_dim(arg_int(node, 1), rank_of(node)), norm_dim(arg_int(node, 2), rank_of(node))
    return b if d == a else a if d == b else d


@register(aten.t.default)
def _t(node: Node, info: Analysis) -> int:
    return 1 - input_token_dim(node, info)


@register(aten.expand.default)
def _expand(node: Node, info: Analysis) -> int:
    """New leading dims come first; the rewrite writes ``-1`` at the token dim."""
    return input_token_dim(node, info) + len(arg_list(node, 1)) - rank_of(node)


# ---- slicing: any dim but the token dim ------------------------------------------------------------

def _sliced_dim(node: Node, info: Analysis, dim: int) -> tuple[int, int]:
    """(token dim, sliced dim) of a slicing op along ``dim``; slicing the token dim is refused."""
    d = input_token_dim(node, info)
    dim = norm_dim(dim, rank_of(node))
    if dim == d:
        raise Unsupported(Reason.of(ReasonCode.SPLIT_SLICES_TOKEN_DIM, node=node.name, op=op_name(node.target)))
    return d, dim


@register(aten.slice.Tensor)
def _slice(node: Node, info: Analysis) -> int:
    return _sliced_dim(node, info, arg_int(node, 1))[0]


@register(aten.select.int)
def _select(node: Node, info: Analysis) -> int:
    d, dim = _sliced_dim(node, info, arg_int(node, 1))
    return d - (dim < d)


@register(aten.split.Tensor, aten.split_with_sizes.default)
def _split(node: Node, info: Analysis) -> tuple[int, ...]:
    d, _ = _sliced_dim(node, info, arg_int(node, 2, "dim", 0))
    return tuple(d for _ in val(node))


# ---- reductions and ops along one dim ------------------------------------------------------------------

@register(aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default)
def _reduction(node: Node, info: Analysis) -> int:
    """Over any dims but the token dim: a reduction over tokens mixes the halves."""
    d = input_token_dim(node, info)
    args, rank = node.args, rank_of(node)
    dims = [norm_dim(i, rank) for i in (arg_ints(node, 1) if len(args) > 1 and args[1] else range(rank))]
    keep = arg(node, 2, "keepdim", False)
    if d in dims:
        raise Unsupported(Reason.of(ReasonCode.SPLIT_REDUCES_TOKEN_DIM, node=node.name, op=op_name(node.target)))
    return d if keep else d - sum(i < d for i in dims)


@register(aten.var_mean.correction)
def _var_mean(node: Node, info: Analysis) -> tuple[int, int]:
    """A LayerNorm's statistics (``(var, mean)``, keepdim a keyword): the reduction's rule for each
    (GPT-NeoX's second LayerNorm of the parallel residual reads the stream, outside any site)."""
    d = _reduction(node, info)
    return d, d


def along(node: Node, info: Analysis, dim: int) -> int:
    """An op along ``dim`` that keeps the rank: fine unless it is the token dim, with every other
    tensor input carrying tokens in the same dim."""
    x = node.args[0]
    d = input_token_dim(node, info)
    if norm_dim(dim, rank_of(node)) == d:
        raise Unsupported(Reason.of(ReasonCode.SPLIT_ALONG_TOKEN_DIM, node=node.name, op=op_name(node.target)))
    for other in node.all_input_nodes:
        if other is not x and info.token.get(other, d) != d:
            raise Unsupported(Reason.of(ReasonCode.SPLIT_OP_INPUT_DIMS_DIFFER, node=node.name, op=op_name(node.target)))
        if other is not x and other not in info.token:
            raise Unsupported(Reason.of(ReasonCode.SPLIT_TOKEN_FREE_INDEX, node=node.name, op=op_name(node.target)))
    return d


@register(aten._softmax.default, aten._log_softmax.default, aten.softmax.int, aten.cumsum.default)
def _along_dim_arg(node: Node, info: Analysis) -> int:
    return along(node, info, arg_int(node, 1))


@register(aten.topk.default)
def _topk(node: Node, info: Analysis) -> tuple[int, int]:
    d = along(node, info, arg_int(node, 2, "dim", -1))
    return d, d


# ---- collectives on token tensors -------------------------------------------------------------------

@register(c10d.all_gather_into_tensor.default)
def _all_gather(node: Node, info: Analysis) -> int:
    """The ranks' tensors stacked along dim 0 (a gathered column-parallel output, before the model
    moves the rank blocks to the last dim): the tokens stay where they are when dim 0 is not
    theirs. Along the token dim a half's gather is ``[rank 0's half; rank 1's half; ...]``,
    which is not a half of the whole gather's ``[rank 0's rows; rank 1's rows; ...]``."""
    d = input_token_dim(node, info)
    if d == 0:
        raise Unsupported(Reason.of(ReasonCode.SPLIT_ALL_GATHER_TOKEN_DIM, node=node.name))
    return d


@register(c10d.wait_tensor.default)
def _wait(node: Node, info: Analysis) -> int:
    return input_token_dim(node, info)


# ---- matrix products and attention -----------------------------------------------------------------------

@register(aten.mm.default, aten.addmm.default)
def _rows(node: Node, info: Analysis) -> int:
    """Tokens are the rows of the left operand (``addmm``: the bias comes first, added like an
    elementwise op's input: a bias with one row per token is sliced per half)."""
    addmm = node.target is aten.addmm.default
    a, b = (arg_node(node, 1), arg_node(node, 2)) if addmm else (arg_node(node, 0), arg_node(node, 1))
    if info.token.get(a) != 0 or b in info.token or (addmm and node.args[0] in info.token):
        raise Unsupported(Reason.of(ReasonCode.SPLIT_TOKENS_NOT_ROWS, node=node.name, op=op_name(node.target)))
    if addmm and val(node.args[0]).dim() == 2 and shape(arg_node(node, 0))[0] != 1:
        info.sliced.setdefault(node, {})[arg_node(node, 0)] = 0
    return 0


register(*ATTENTION)(attention_dims)
