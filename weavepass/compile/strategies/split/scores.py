"""Attention written out as ``bmm -> softmax -> bmm`` (Hugging Face's eager attention, which Gemma2's
softcapping needs) over a sequence cut in two, handled as the fused attention ops are
(``attention.py``)::

    scores = q @ k^T      [BH, Tq, Tk]    (bmm: q's tokens in dim 1, k^T's in dim 2)
    scores -> scale, softcap, + mask, softmax over the keys (amax, exp, sum, div)
    out = probs @ v       [BH, Tq, d]     (bmm: v's tokens in dim 1, contracted with the keys)

A score tensor carries the query tokens in its token dim (``info.token``) and the key tokens in a
second dim (``info.keys``). Half A's copy has A's queries and A's keys; half B's has B's queries
and all keys, ``k`` and ``v`` being read as ``cat(A's copy, B's copy)`` (``info.key_operands``).
A token-free tensor lined up with the keys (the mask) is read in A's keys by half A and whole by
half B (``info.key_sliced``), and in the half's query rows (``info.sliced``), as for the fused ops.

Half A leaving out B's keys assumes what the fused ops' masked path assumes: no query of A sees a
key of B (a causal or sliding-window decoder mask, what every family with a TP plan has). Only
ops whose meaning over the keys is known are taken: elementwise ops, views and expands that keep
the keys in the last dim, softmax over the keys, the max of masked scores and the sum of the
softmax's ``exp`` over the keys (``_UNCHANGED_BY_HIDDEN_KEYS``), and ``probs @ v``; anything else
reading a score tensor is refused.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch.fx import Node
from torch.fx.node import Argument

from weavepass.compile.fx_args import arg, arg_int, arg_ints, arg_list, arg_node, as_node
from weavepass.compile.reasons import Reason, ReasonCode

from .base import Unsupported, norm_dim, op_name, val
from .rules import VIEWS, broadcast_dims, half_view_size, register, view_dim
from .state import Analysis
from .symbolic import hint

aten = torch.ops.aten
prims = torch.ops.prims

_REDUCTIONS = (aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default)
_SOFTMAX = (aten._softmax.default, aten._log_softmax.default, aten.softmax.int)
_ELEMENTWISE = (aten.clone.default, aten._to_copy.default, prims.convert_element_type.default, aten.alias.default)
_UNCHANGED_BY_HIDDEN_KEYS = {aten.amax.default: "low", aten.sum.dim_IntList: "zero"}
"""reduction over the keys -> the state (``_hidden_as``) of its input in which the keys a mask hides
do not change its result: the max of scores where they hold the lowest value, the sum of weights
where they hold 0 (a ``mean`` divides by the key count, an ``amin`` is the hidden keys' value)"""


def scores_bmm(node: Node, info: Analysis) -> int:
    """``q @ k^T`` over a cut sequence: q's tokens are the rows (dim 1), k^T's the columns (dim 2);
    the product's rows are the queries, its columns the keys."""
    a, b = arg_node(node, 0), arg_node(node, 1)
    if info.token.get(a) != 1 or info.token.get(b) != 2 or a in info.keys or b in info.keys:
        raise Unsupported(Reason.of(ReasonCode.SPLIT_BMM_CUT_SEQUENCE, node=node.name))
    info.keys[node] = 2
    info.key_operands[node] = {b: 2}
    return 1


def score_dims(node: Node, info: Analysis) -> int:
    """The token dim of an op reading a score tensor (and its key dim, into ``info.keys``)."""
    if node.op != "call_function":
        raise Unsupported(Reason.of(ReasonCode.SPLIT_READS_SCORES, node=node.name, node_kind=node.op))
    target = node.target
    x = node.args[0]
    if target is aten.bmm.default:
        return _probs_times_values(node, info)
    if target in _ELEMENTWISE or (isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags):
        return _elementwise(node, info)
    if x not in info.keys:
        raise Unsupported(Reason.of(ReasonCode.SPLIT_SCORES_ARGUMENT_POSITION, node=node.name, op=op_name(target)))
    x = as_node(x, node, "argument 0")
    d, k, rank = info.dim(x), info.keys[x], val(x).dim()
    if target in VIEWS:
        return _view(node, info, d, k)
    if target is aten.expand.default:
        shift: int = len(arg_list(node, 1)) - rank
        info.keys[node] = k + shift
        return d + shift
    if target in _REDUCTIONS:
        dims = [norm_dim(i, rank) for i in arg_ints(node, 1)] if len(node.args) > 1 and node.args[1] else []
        keep = arg(node, 2, "keepdim", False)
        if dims != [k] or not keep:
            raise Unsupported(Reason.of(ReasonCode.SPLIT_SCORES_REDUCED_OTHER_DIMS, node=node.name, op=op_name(target)))
        if _hidden_as(x, info, {}) != _UNCHANGED_BY_HIDDEN_KEYS.get(target):
            raise Unsupported(Reason.of(ReasonCode.SPLIT_SCORES_REDUCED_OVER_KEYS, node=node.name, op=op_name(target)))
        return d
    if target in _SOFTMAX:
        if norm_dim(arg_int(node, 1), rank) != k:
            raise Unsupported(Reason.of(ReasonCode.SPLIT_SCORES_OTHER_DIM, node=node.name, op=op_name(target)))
        info.keys[node] = k
        return d
    raise Unsupported(Reason.of(ReasonCode.SPLIT_NO_SCORES_RULE, node=node.name, op=op_name(target)))


def _probs_times_values(node: Node, info: Analysis) -> int:
    a, b = arg_node(node, 0), arg_node(node, 1)
    if info.keys.get(a) != 2 or info.token.get(a) != 1 or info.token.get(b) != 1 or b in info.keys:
        raise Unsupported(Reason.of(ReasonCode.SPLIT_PROBABILITIES_TIMES_NOT_VALUES, node=node.name))
    if _hidden_as(a, info, {}) != "zero":
        # The SDPA ops' rule (``attention_dims``) refuses bidirectional attention likewise.
        raise Unsupported(Reason.of(ReasonCode.SPLIT_PROBABILITIES_NOT_MASKED_SOFTMAX, node=node.name))
    info.key_operands[node] = {b: 1}
    return 1


_KEEP = (*VIEWS, aten.expand.default, *_ELEMENTWISE)


def _hidden_as(node: Node, info: Analysis, seen: dict[Node, str | None]) -> str | None:
    """What score tensor ``node`` holds for a key the mask hides (the mask is checked at run time to
    hide half B's keys from half A's queries, which half A leaves out): ``"low"`` after the mask
    (the dtype's lowest value, or -inf), ``"zero"`` after the softmax (``exp`` of it, divided or
    multiplied by values per query), None when not known: no mask on some path from ``q @ k^T``
    (bidirectional attention) or an op that could make a hidden key count (``1 - sigmoid(x)``)."""
    if node in seen:
        return seen[node]
    inputs = [a for a in node.all_input_nodes if a in info.keys]
    states = {_hidden_as(a, info, seen) for a in inputs}
    state = states.pop() if len(states) == 1 else None
    target, first_is_scores = node.target, bool(node.args) and node.args[0] in info.keys
    if node in info.key_sliced:
        state = "low"
    elif state is None or target in _KEEP:
        pass
    elif state == "low" and target is aten._log_softmax.default:
        pass  # a hidden key's log-probability: still the lowest
    elif state == "low" and (target in _SOFTMAX or target is aten.exp.default):
        state = "zero"
    elif state == "low" and target in (aten.sub.Tensor, aten.add.Tensor) and len(inputs) == 1 and first_is_scores:
        pass  # minus (or plus) a value per query: still the lowest
    elif not (state == "zero" and target in (aten.div.Tensor, aten.mul.Tensor) and len(inputs) == 1
              and first_is_scores):
        state = None
    seen[node] = state
    return state


def _view(node: Node, info: Analysis, d: int, k: int) -> int:
    """Views that keep the keys as the last dim, of the same size (the rewrite writes the half's
    key count there)."""
    src, dst = val(node.args[0]).shape, val(node).shape
    if k != len(src) - 1 or hint(dst[-1]) != hint(src[-1]):
        raise Unsupported(Reason.of(ReasonCode.SPLIT_SCORES_VIEW, node=node.name))
    out = view_dim(node, d, info)
    half_view_size(node, out, node.args[1])
    info.keys[node] = len(dst) - 1
    return out


def _elementwise(node: Node, info: Analysis) -> int:
    """Inputs aligned from the right: every score input has its keys in one dim; other token
    tensors broadcast over the keys (a softmax's row max or sum); a token-free input as long as
    the keys (the mask) is read in the half's keys."""
    d = broadcast_dims(node, info)  # the query rows: consistent, token-free inputs sliced
    rank = val(node).dim()
    tensors = [t for t in node.all_input_nodes if isinstance(val(t), torch.Tensor)]
    keys = {info.keys[t] - val(t).dim() + rank for t in tensors if t in info.keys}
    if len(keys) != 1:
        raise Unsupported(Reason.of(ReasonCode.SPLIT_SCORES_KEY_DIMS, node=node.name, keys=sorted(keys)))
    k = keys.pop()
    full = hint(val(node).shape[k])
    for t in tensors:
        pos = k - rank + val(t).dim()
        if t in info.keys or pos < 0 or hint(val(t).shape[pos]) == 1:
            continue
        if t in info.token or hint(val(t).shape[pos]) != full:
            raise Unsupported(Reason.of(ReasonCode.SPLIT_LINED_UP_WITH_KEYS, node=node.name, t=t.name))
        if mask_blocks(node, t, info.keys) is None:
            raise Unsupported(Reason.of(ReasonCode.SPLIT_KEYS_NOT_MASK, node=node.name, op=op_name(node.target),
                                        t=t.name))
        info.key_sliced.setdefault(node, {})[t] = pos
        if t not in info.run_time_masks:
            info.run_time_masks.append(t)
    info.keys[node] = k
    return d


def mask_blocks(node: Node, mask: Node, keys: Mapping[Node, int]) -> str | None:
    """How ``mask``, lined up with the keys, hides a key from a query in ``node`` (``keys``: the
    score tensors, ``info.keys``): ``"additive"`` (a float added to the scores: the dtype's lowest
    value or -inf hides), ``"false"`` (``where(mask, scores, low)``: False hides), ``"true"``
    (``where(mask, low, scores)``, what ``masked_fill(mask, low)`` decomposes to: True hides), or
    None when that is not known. ``low`` must be a constant at most the dtype's lowest value: any
    other fill (``where(mask, scores, 0)``) leaves the key in the softmax."""
    if val(mask).is_floating_point():
        # scores + mask only: ``scores - mask`` (or ``add`` with another ``alpha``) would turn a
        # -inf mask into +inf (a key shown).
        return "additive" if node.target is aten.add.Tensor and node.kwargs.get("alpha", 1) == 1 else None
    if val(mask).dtype != torch.bool or node.target is not aten.where.self or node.args[0] is not mask:
        return None
    on_true, on_false = node.args[1:3]
    if on_true in keys and _hides(on_false, val(node).dtype):
        return "false"
    if on_false in keys and _hides(on_true, val(node).dtype):
        return "true"
    return None


def _hides(fill: Argument, dtype: torch.dtype) -> bool:
    """Whether ``fill`` is a constant that takes a score out of the softmax: a ``full`` of at most
    ``dtype``'s lowest value (-inf included)."""
    if not isinstance(fill, Node) or fill.target not in (aten.full.default, aten.scalar_tensor.default):
        return False
    value = fill.args[1] if fill.target is aten.full.default else fill.args[0]
    return isinstance(value, (int, float)) and value <= torch.finfo(dtype).min


# The bmm rule lives here, with the attention scores it hands a cut sequence's ``q @ k^T`` to.
@register(aten.bmm.default)
def _batched_rows(node: Node, info: Analysis) -> int:
    """Batched over the tokens (dim 0 of both operands: whole sequences x heads in batch mode, or
    one product per token), whose batch entries are independent; or, over a cut sequence,
    attention's ``q @ k^T`` (``scores``)."""
    a, b = arg_node(node, 0), arg_node(node, 1)
    if info.token.get(a) is None:
        raise Unsupported(Reason.of(ReasonCode.SPLIT_CONTRACTS_TOKEN_DIM, node=node.name, op=op_name(node.target)))
    if info.token.get(a) == 0 and info.token.get(b) == 0:
        return 0
    if info.cut.mode == "sequence":
        return scores_bmm(node, info)
    raise Unsupported(Reason.of(ReasonCode.SPLIT_BMM_RIGHT_SEQUENCES, node=node.name))
