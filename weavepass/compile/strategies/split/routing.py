"""MoE routing blocks that sort the token-expert pairs by expert (Hugging Face's ``grouped_mm``
experts: Mixtral, Qwen2/3-MoE, DeepSeek-V3), split by running the whole block on each half::

    ids = topk(router(x), k).indices.view(-1)          [P = T*k]  expert of each pair
    keys, perm = sort(ids)                             keys: rows in expert order; perm: positions
    rows = x[perm // k]                                 gather: pair i's token row, in expert order
    offs = cumsum(histc(keys, E, 0, E-1))               rows per expert (counted across rows)
    y = grouped_mm(rows, W, offs) ... * w[perm]         each row times its expert's weights
    inv = index_put(empty(P), [perm], arange(P))        the inverse permutation
    out = y[inv].view(T, k, H).sum(1)                   back to token order, summed over top-k

Each token's output depends on its own row only: the block is token-separable, although its
order (the sort), its counts and its offsets are computed across rows. A half running the block
on its own tokens sorts its own pairs (another order than its part of the whole's, which no one
sees) and counts its own rows per expert, and gives each token what the whole gives it. That
holds when every value computed across rows only steers a permutation or a grouped matmul and
never reaches an output, which the analysis checks op by op with a role per tensor:

- rows (``Rows``): one entry per row along the token dim, in token order (no role: every
  ordinary token tensor) or in the half-local order of one sort (``Rows.order``). Per-row math is
  allowed on rows of one order (``ROW_OPS``, with no token-free input lined up with permuted rows,
  which a half cannot slice); rows in a sort's order must be brought back to token order before
  they leave the block (a view over the rows, a site, the graph's output).
- positions (``Positions``): indices of rows (sort indices, their inverse), whose values are
  half-local. Only gathers (``index``) and scatters (``index_put``, ``index_add``) of rows along
  the token dim read them, and floor division by a divisor of the rows per unit (pair -> token).
  Arithmetic on positions (a capacity limit that drops pairs by position) is refused.
- counts (``Counts``): the histogram of a sort's keys and its cumsum, the grouped matmul's
  offsets and nothing else (a load-balancing term or a capacity from the counts is refused), held
  in dtypes that hold every count exactly (``EXACT_KEYS``).
- block constants: ``empty``/``zeros``/``full`` as long as the rows (the scatter's target) and
  ``arange(P)`` (``iota``), rebuilt per half with the half's size (``block_consts``), read by
  those scatters only.

Offsets group the rows correctly only when the rows are sorted by the counted keys and every key
falls in its own bin: the sorted values are the experts of ``topk`` over ``E`` experts and the
histogram has bins ``0 .. E-1``.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, replace

import torch
from torch.fx import Node
from torch.fx.node import Argument

from weavepass.compile.fx_args import arg, arg_int, arg_list, arg_node, arguments, as_node, unexpected, with_argument
from weavepass.compile.reasons import Reason, ReasonCode

from .attention import HalfEmitter
from .base import Unsupported, norm_dim, op_name, val
from .rules import VIEWS, along, rank_of, register, rule_for
from .state import Analysis, TokenDims, input_token_dim
from .symbolic import hint, shape

aten = torch.ops.aten
prims = torch.ops.prims


@dataclass(frozen=True)
class Rows:
    """Rows in the half-local order of sort ``order`` (None: token order, as every token tensor)."""

    order: Node | None
    keys: bool = False
    """the sort's sorted values (through casts): what the expert histogram may count"""
    experts: int = 0
    """the number of experts the keys are indices of (keys only)"""


@dataclass(frozen=True)
class Positions:
    """Half-local row indices: the tensor's own rows are in order ``order``; its values index the
    rows, in order ``points``, of a token dim of ``space`` rows (hint)."""

    order: Node | None
    points: Node | None
    space: int
    bijection: bool
    """a permutation of the ``space`` rows (sort indices and their inverse)"""


@dataclass(frozen=True)
class Counts:
    """Rows per expert of sort ``sort``'s keys (``histc``), or their cumsum (``cumulative``)."""

    sort: Node
    cumulative: bool


CASTS = (prims.convert_element_type.default, aten._to_copy.default, aten.clone.default, aten.alias.default)
ROW_OPS = frozenset((operator.getitem, *CASTS, *VIEWS, aten.unsqueeze.default, aten.squeeze.dim,
                     aten.squeeze.dims, aten.split.Tensor, aten.split_with_sizes.default, aten.slice.Tensor,
                     aten.select.int, aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default,
                     aten.mm.default, aten.addmm.default))
"""Ops other than pointwise ones that rows in a sort's order may go through: each row's output is
computed from that row alone (the rules in ``rules`` keep the token dim; views are checked to
keep the rows whole)."""
BLOCK_CONSTS = (aten.empty.memory_format, aten.zeros.default, aten.full.default)
ARANGES = (prims.iota.default, aten.arange.default, aten.arange.start_step)
"""``arange(P)`` as written (``arange``) and as Inductor decomposes it (``iota``)"""
GROUPED_MM = ("aten::_grouped_mm", "transformers::grouped_mm_fallback")
"""Grouped matmuls ``(rows [P, K], weights [E, K, N], offs [E])``: rows ``offs[e-1] .. offs[e]``
times ``weights[e]`` (``torch._grouped_mm``; transformers' fallback for non-bf16 weights)."""
EXACT_KEYS = (torch.int32, torch.int64, torch.float32, torch.float64)
"""dtypes a cast of the sorted keys may have and still be counted, and the only ones the counts and
offsets may be held in: the expert indices and the row counts exactly (a narrower one could wrap
or round keys into other experts' bins, or the whole's larger counts where a half's stay exact)"""
ROUTING_OPS = (aten.index.Tensor, aten.index_put.default, aten.index_add.default, aten.histc.default)


def routed(node: Node, info: Analysis) -> bool:
    """Whether ``node`` is for this module: it reads a tensor with a role, or is an op of the block."""
    return (node.target in ROUTING_OPS or _grouped_mm_name(node) is not None
            or any(a in info.roles for a in node.all_input_nodes))


def sort_by_expert(node: Node, info: Analysis) -> tuple[int, int]:
    """``sort`` along the token dim: the keys must be the experts of a ``topk`` (flattened token x
    top-k pairs); values become ``Rows`` in the sort's order, indices ``Positions`` into the pairs."""
    x = arg_node(node, 0)
    experts = _experts_of(x)
    if experts is None or val(x).dim() != 1 or x in info.roles:
        raise Unsupported(Reason.of(ReasonCode.SPLIT_SORT_TOKEN_DIM, node=node.name, op=op_name(node.target)))
    descending = arguments(node)["descending"]
    if descending:  # the offsets count experts upwards: rows must be in ascending expert order
        raise Unsupported(Reason.of(ReasonCode.SPLIT_SORT_DESCENDING, node=node.name, op=op_name(node.target)))
    info.roles[node] = (Rows(node, keys=True, experts=experts),
                        Positions(node, None, shape(x)[0], bijection=True))
    return 0, 0


def _experts_of(node: Node) -> int | None:
    """How many experts ``node``'s values index, when they are a ``topk``'s indices over the last
    dim (through views and casts to an integer dtype); else None."""
    while node.target in VIEWS or node.target in CASTS:
        node = arg_node(node, 0)
        if val(node).is_floating_point():
            return None
    if node.target is not operator.getitem or node.args[1] != 1:
        return None
    topk = arg_node(node, 0)
    if topk.target is not aten.topk.default:
        return None
    dim = arg_int(topk, 2, "dim", -1)
    source = val(arg_node(topk, 0))
    return hint(source.shape[norm_dim(dim, source.dim())])


def routed_dims(node: Node, info: Analysis) -> TokenDims:
    """The token dim(s) of an op of a routing block, and its role (``info.roles``)."""
    name = _grouped_mm_name(node)
    if name is not None:
        return _grouped_mm(node, info, name)
    target = node.target
    inputs = [a for a in node.all_input_nodes if a in info.roles]
    counts = [a for a in inputs if isinstance(info.roles[a], Counts)]
    if counts:
        _counts_op(node, info, counts)
        return None  # counts carry no tokens
    if target is aten.index.Tensor:
        return _gather(node, info)
    if target in (aten.index_put.default, aten.index_add.default):
        return _scatter(node, info)
    if target is aten.histc.default:
        _histogram(node, info)
        return None
    source_role = info.roles[arg_node(node, 0)] if target is operator.getitem else None
    if isinstance(source_role, tuple):
        info.roles[node] = source_role[arg_int(node, 1)]
        return rule_for(target)(node, info)
    positions = [a for a in inputs if isinstance(info.roles[a], Positions)]
    if positions:
        return _position_op(node, info, positions[0])
    return _row_op(node, info)


def _row_op(node: Node, info: Analysis) -> TokenDims:
    """Per-row math on rows in one sort's order."""
    target = node.target
    pointwise = isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags
    if not pointwise and target not in ROW_OPS:
        raise Unsupported(Reason.of(ReasonCode.SPLIT_READS_EXPERT_ROWS, node=node.name, op=op_name(target)))
    orders = {_order(a, info) for a in node.all_input_nodes if info.token.get(a) is not None}  # not sizes
    if len(orders) != 1:
        raise Unsupported(Reason.of(ReasonCode.SPLIT_MIXES_ROW_ORDERS, node=node.name, op=op_name(target)))
    (order,) = orders
    dims = rule_for(target)(node, info)
    if node in info.sliced:
        lined_up = ', '.join(a.name for a in info.sliced[node])
        raise Unsupported(Reason.of(ReasonCode.SPLIT_TOKEN_FREE_EXPERT_ROWS, node=node.name, op=op_name(target),
                                    lined_up=lined_up))
    if target in VIEWS:
        x = arg_node(node, 0)
        if not isinstance(dims, int):  # (a view's rule gives one token dim)
            raise unexpected(node, "token dim", dims, "an int")
        if shape(node)[dims] != shape(x)[info.dim(x)]:
            raise Unsupported(Reason.of(ReasonCode.SPLIT_VIEW_REGROUPS_EXPERT_ROWS, node=node.name))
    keys = [info.roles[a] for a in node.all_input_nodes if a in info.roles]
    # (rows only: a node reading positions or counts is ``_position_op``'s or ``_counts_op``'s)
    if target in CASTS and len(keys) == 1 and isinstance(keys[0], Rows) and keys[0].keys \
            and val(node).dtype in EXACT_KEYS:
        info.roles[node] = keys[0]  # a cast of the sorted keys that holds every expert index exactly
    elif order is not None:
        info.roles[node] = Rows(order)
    return dims


def _order(node: Node, info: Analysis) -> Node | None:
    role = info.roles.get(node)
    if role is None:
        return None
    if isinstance(role, (Rows, Positions)):
        return role.order
    raise Unsupported(Reason.of(ReasonCode.SPLIT_COUNTS_AS_ROWS, node=node.name))


def _position_op(node: Node, info: Analysis, pos: Node) -> int:
    """Floor division of pair positions by ``c`` (pair -> token: ``perm // k``), where the cut
    falls on a multiple of ``c`` so that the half-local quotient is the half-local token."""
    role = info.roles[pos]
    if not isinstance(role, Positions):  # (``routed_dims`` picked ``pos`` for its role)
        raise unexpected(pos, "role", role, "Positions")
    c = arg(node, 1, "other")
    floor = (node.target is aten.div.Tensor_mode and arguments(node)["rounding_mode"] == "floor") \
        or node.target is aten.floor_divide.default  # on integers: a floor too
    units = hint(info.cut.units)
    # (operands by the schema's names: a call may give ``self`` by keyword)
    if not (floor and arg(node, 0) is pos and isinstance(c, int) and c > 0 and role.points is None
            and role.space % units == 0 and (role.space // units) % c == 0):
        raise Unsupported(Reason.of(ReasonCode.SPLIT_ROW_POSITIONS_ARITHMETIC, node=node.name, op=op_name(node.target)))
    info.roles[node] = Positions(role.order, None, role.space // c, bijection=False)
    return info.dim(pos)


def _counts_op(node: Node, info: Analysis, counts: list[Node]) -> None:
    """The cumsum of the counts (the offsets), and casts: still counts of the same sort."""
    role = info.roles[counts[0]]
    if not isinstance(role, Counts):  # (``routed_dims`` picked ``counts`` for their role)
        raise unexpected(counts[0], "role", role, "Counts")
    source = arg(node, 0)  # (by the schema's name: a keyword ``self`` too)
    cast = node.target in CASTS and source is counts[0]
    cumsum = node.target is aten.cumsum.default and source is counts[0] \
        and norm_dim(arg_int(node, 1), 1) == 0 and not role.cumulative and val(counts[0]).dim() == 1
    if (cast or cumsum) and val(node).dtype not in EXACT_KEYS:
        raise Unsupported(Reason.of(ReasonCode.SPLIT_COUNTS_DTYPE, node=node.name, op=op_name(node.target),
                                    dtype=val(node).dtype))
    if cast or cumsum:
        info.roles[node] = Counts(role.sort, cumulative=True) if cumsum else role
        return None
    raise Unsupported(Reason.of(ReasonCode.SPLIT_READS_EXPERT_COUNTS, node=node.name, op=op_name(node.target)))


def _histogram(node: Node, info: Analysis) -> None:
    """``histc(keys, E, 0, E - 1)``: every expert's own bin, counted from the sorted keys."""
    x = arg_node(node, 0)
    role = info.roles.get(x)
    given = arguments(node)  # by name, the schema's defaults filled in (bins=100, min=0, max=0)
    bins, low, high = given["bins"], given["min"], given["max"]
    # (``bins`` is an int by histc's schema; the keys of a sort have their sort as order)
    if not (isinstance(role, Rows) and role.keys and role.order is not None and isinstance(bins, int)
            and bins == role.experts and low == 0 and high == bins - 1):
        raise Unsupported(Reason.of(ReasonCode.SPLIT_HISTC_BINS, node=node.name))
    info.roles[node] = Counts(role.order, cumulative=False)
    return None


def _grouped_mm_name(node: Node) -> str | None:
    name = getattr(node.target, "name", None)
    name = name() if callable(name) else None
    return name if name in GROUPED_MM else None


def _grouped_mm(node: Node, info: Analysis, name: str) -> int:
    """Rows in a sort's order times their experts' weights, grouped by that sort's offsets."""
    rows, weights = arg_node(node, 0), arg_node(node, 1)
    offs = arg(node, 2, "offs")
    bias = arg(node, 3, "bias")
    rows_role, offs_role = info.roles.get(rows), info.roles.get(offs) if isinstance(offs, Node) else None
    if not (isinstance(rows_role, Rows) and rows_role.order is not None and info.token.get(rows) == 0
            and val(rows).dim() == 2 and val(weights).dim() == 3 and weights not in info.token and bias is None
            and isinstance(offs_role, Counts) and offs_role.cumulative and offs_role.sort is rows_role.order):
        raise Unsupported(Reason.of(ReasonCode.SPLIT_GROUPED_MM_OPERANDS, node=node.name, op=name))
    info.roles[node] = Rows(rows_role.order)
    return 0


def _gather(node: Node, info: Analysis) -> int:
    """``x[index]`` along dim 0: by positions (rows of ``x`` moved into the positions' order), or
    a token-free ``x`` (an expert's bias) looked up per row by the row's values."""
    x, indices = arg_node(node, 0), arg_list(node, 1)
    index = indices[0] if len(indices) == 1 else None
    if not isinstance(index, Node):
        raise Unsupported(Reason.of(ReasonCode.SPLIT_INDEX_SEVERAL_DIMS, node=node.name))
    pos = info.roles.get(index)
    if isinstance(pos, Positions):
        if info.token.get(x) != 0 or _order(x, info) != pos.points or shape(x)[0] != pos.space:
            raise Unsupported(Reason.of(ReasonCode.SPLIT_GATHER_OTHER_ROWS, node=node.name, x=x.name))
        x_role = info.roles.get(x, Rows(None))
        role: Rows | Positions = replace(x_role, order=pos.order, bijection=x_role.bijection and pos.bijection) \
            if isinstance(x_role, Positions) else Rows(pos.order)
    elif x not in info.token and index in info.token and not isinstance(pos, Counts) and val(index).dim() == 1:
        role = Rows(_order(index, info))
    else:
        raise Unsupported(Reason.of(ReasonCode.SPLIT_INDEX_TOKEN_DIM_BY_TOKENS, node=node.name))
    if role != Rows(None):
        info.roles[node] = role
    return 0


def _scatter(node: Node, info: Analysis) -> int:
    """``index_put(target, [positions], values)`` / ``index_add(target, 0, positions, values)``:
    rows of ``values`` (in the positions' own order) written to the rows the positions name. The
    target is a block constant rebuilt per half, or rows in that order; without accumulation the
    positions must be a permutation, so that every row is written (``empty`` holds garbage)."""
    index: Argument
    if node.target is aten.index_put.default:
        target, values = arg_node(node, 0), arg_node(node, 2)
        indices = arg_list(node, 1)
        accumulate = arg(node, 3, "accumulate", False)
        index = indices[0] if len(indices) == 1 else None
    else:
        target, dim, index, values = arg_node(node, 0), arg_int(node, 1), arg_node(node, 2), arg_node(node, 3)
        accumulate = True
        if norm_dim(dim, val(target).dim()) != 0:
            raise Unsupported(Reason.of(ReasonCode.SPLIT_INDEX_ADD_DIM, node=node.name))
    pos = info.roles.get(index) if isinstance(index, Node) else None
    what = f"{node.name} ({op_name(node.target)})"
    if not isinstance(pos, Positions):
        raise Unsupported(Reason.of(ReasonCode.SPLIT_SCATTER_NOT_BY_POSITIONS, what=what))
    rows = shape(as_node(index, node, "index"))[0]
    if not accumulate and not (pos.bijection and rows == pos.space):
        raise Unsupported(Reason.of(ReasonCode.SPLIT_SCATTER_NOT_PERMUTATION, what=what))
    _block_target(node, target, pos, info, what)
    role: Rows | Positions
    if _is_block_const(values, ARANGES, rows, info):
        info.block_consts.setdefault(values, set()).add(node)
        role = Positions(pos.points, pos.order, rows, bijection=True)  # the inverse permutation
    elif info.token.get(values) == 0 and _order(values, info) == pos.order and shape(values)[0] == rows:
        values_role = info.roles.get(values, Rows(None))
        role = replace(values_role, order=pos.points) if isinstance(values_role, Positions) else Rows(pos.points)
    else:
        raise Unsupported(Reason.of(ReasonCode.SPLIT_SCATTER_VALUES_ORDER, what=what))
    if isinstance(role, Positions) and accumulate:
        raise Unsupported(Reason.of(ReasonCode.SPLIT_SCATTER_ADDS_POSITIONS, what=what))
    if role != Rows(None):
        info.roles[node] = role
    return 0


def _block_target(node: Node, target: Node, pos: Positions, info: Analysis, what: str) -> None:
    if _is_block_const(target, BLOCK_CONSTS, pos.space, info):
        info.block_consts.setdefault(target, set()).add(node)
    elif isinstance(info.roles.get(target), Positions) or not (
            info.token.get(target) == 0 and _order(target, info) == pos.points and shape(target)[0] == pos.space):
        raise Unsupported(Reason.of(ReasonCode.SPLIT_SCATTER_TARGET, what=what))


def _is_block_const(node: Argument, targets: tuple[object, ...], rows: int, info: Analysis) -> bool:
    """A token-free ``empty``/``zeros``/``full`` of ``rows`` rows, or ``arange(rows)`` (from 0 by 1),
    read only by the block's scatters (``check_block``): rebuilt per half with the half's rows."""
    if not isinstance(node, Node) or node.target not in targets or node in info.token:
        return False
    if node.target in ARANGES:
        return _arange_length(node) == rows
    size = arg_list(node, 0)[0]
    return isinstance(size, int) and size == rows


def _arange_length(node: Node) -> int | None:
    """``n`` of ``arange(n)`` / ``arange(0, n, 1)`` / ``iota(n, start=0, step=1)``; else None."""
    given = arguments(node)  # by name: any of them may be a keyword
    if node.target is prims.iota.default:
        start, step, end = given.get("start", 0), given.get("step", 1), given["length"]
    elif node.target is aten.arange.default:
        start, step, end = 0, 1, given["end"]
    else:
        start, step, end = given["start"], given["step"], given["end"]
    return end if (start, step) == (0, 1) and isinstance(end, int) else None


def check_block(info: Analysis) -> None:
    """After the region: nothing with a role is read outside the halves (a permuted row, a
    position or a count would be joined by ``cat`` as if it were token rows), and every block
    constant is read by the scatters that took it only."""
    if (info.roles or info.block_consts) and isinstance(info.cut.units, torch.SymInt):
        raise Unsupported(Reason.of(ReasonCode.SPLIT_ROUTING_SYMBOLIC))
    for node in info.roles:
        outside = [u.name for u in node.users if u not in info.token]
        if outside:
            raise Unsupported(Reason.of(ReasonCode.SPLIT_ROUTING_READ_OUTSIDE, node=node.name,
                                        readers=', '.join(outside)))
    region = set(info.region)
    for node, scatters in info.block_consts.items():
        if node not in region:
            raise Unsupported(Reason.of(ReasonCode.SPLIT_ROUTING_CONSTANT_EARLY, node=node.name))
        # Every reader gets the per-half copy, its rows counted from 0: right for the scatters that
        # took it as the block's target or ``arange(P)``, wrong for anything else (a token op would
        # need half B's rows of the whole, ``P_A .. P``, not ``0 .. P_B``).
        others = [f"{u.name} ({op_name(u.target)})" for u in node.users if u not in scatters]
        if others:
            raise Unsupported(Reason.of(ReasonCode.SPLIT_ROUTING_CONSTANT_SHARED, node=node.name,
                                        readers=', '.join(others)))


def emit_block_const(rw: HalfEmitter, node: Node, half: str) -> Node:
    """``half``'s copy of block constant ``node``: its row count cut like a token dim."""
    size = val(node).shape[0]
    start, end = rw.bounds(node, 0, half)
    if not isinstance(start, int) or not isinstance(end, int):  # (``check_block``: no symbolic cut)
        raise unexpected(node, f"half {half}'s rows", (start, end), "static bounds")
    rows = end - start if half == "A" else size - start
    if node.target is prims.iota.default:
        args, kwargs = with_argument(node, "length", rows)
    elif node.target in ARANGES:
        args, kwargs = with_argument(node, "end", rows)
    else:  # zeros, empty, full, ...: the size's first dim
        args, kwargs = with_argument(node, "size", [rows, *arg_list(node, 0)[1:]])
    with val(node).fake_mode:  # no tensor argument to find the mode from: the original's
        return rw.emit(node.target, args, kwargs)


# The sort rule lives here, with the routing blocks it hands a sort along the tokens to.
@register(aten.sort.default, aten.sort.stable)
def _sort(node: Node, info: Analysis) -> tuple[int, int]:
    """Along another dim (the experts of one token): values and indices carry the tokens. Along
    the token dim the order of each half's tokens is not their order in the whole: only MoE
    routing that groups the token-expert pairs by expert is taken, as a block (``routing``)."""
    dim = arguments(node)["dim"]
    if not isinstance(dim, int):
        raise unexpected(node, "argument dim", dim, "an int")
    if norm_dim(dim, rank_of(node)) == input_token_dim(node, info):
        return sort_by_expert(node, info)
    d = along(node, info, dim)
    return d, d
