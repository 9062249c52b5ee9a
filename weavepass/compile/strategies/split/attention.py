"""Attention in the split: the token-dim rule of the fused attention ops, and half B's attention
over a sequence cut at ``sA``.

Batch mode cuts between sequences, so each half's attention is the same op on its own sequences.
Sequence mode: A is ordinary causal attention over its own tokens; B's queries attend to A's and
B's keys with the causal diagonal at the lower right (a B query at position ``i`` sees keys
``0 .. sA + i``). Without an explicit mask that is two calls of the graph's own attention op merged
by log-sum-exp (``merge_by_lse``); with one, B's rows of the mask over ``cat(K_A, K_B)``.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import torch
from torch.fx import Node
from torch.fx.node import Argument, Target

from weavepass.compile.fx_args import arg, arg_node, node_list
from weavepass.compile.reasons import Reason, ReasonCode

from .base import Unsupported, val
from .state import Analysis, input_token_dim
from .symbolic import hint, shape


class HalfEmitter(Protocol):
    """What the attention ops' emitters use of the rewrite (``rewrite.Rewrite``): the copy of a
    node for a half, and emitting nodes into it."""

    merged: dict[tuple[Node, str], Node]
    checked_masks: set[tuple[Node, str | None]]

    def emit(self, target: Target, args: tuple[Argument, ...], kwargs: dict[str, Argument] | None = None) -> Node:
        """A new node computing a tensor (or tensors)."""

    def read(self, node: Node, half: str) -> Node: ...

    def bounds(self, node: Node, dim: int, half: str) -> tuple[Node | int, Node | int]: ...


EmitNode = Callable[..., Node]
"""``HalfEmitter.emit``: ``emit(target, args, kwargs=None)``, a new node computing a tensor."""


aten = torch.ops.aten
prims = torch.ops.prims

CPU_FLASH = aten._scaled_dot_product_flash_attention_for_cpu.default
CUDA_FLASH = aten._scaled_dot_product_flash_attention.default
CUDA_EFFICIENT = aten._scaled_dot_product_efficient_attention.default
CUDA_CUDNN = aten._scaled_dot_product_cudnn_attention.default
# attention op -> (index of the mask/bias argument or None, index of is_causal)
ATTENTION: dict[object, tuple[int | None, int]] = {
    CPU_FLASH: (None, 4),  # mask is the keyword ``attn_mask``
    CUDA_FLASH: (None, 4),
    CUDA_EFFICIENT: (3, 6),
    CUDA_CUDNN: (3, 6),
}


def attention_dims(node: Node, info: Analysis) -> tuple[int | None, ...]:
    """The token-dim rule of the ops of ``ATTENTION``: q, k and v carry tokens in the batch dim
    (batch mode) or the sequence dim (sequence mode); only output 0 may be read."""
    input_token_dim(node, info)
    q, k, v = arg_node(node, 0), arg_node(node, 1), arg_node(node, 2)
    dims = {info.token.get(t) for t in (q, k, v)}
    mask = _mask(node.target, node.args, node.kwargs)
    dropout_index = 3 if node.target in (CPU_FLASH, CUDA_FLASH) else 5
    if len(node.args) > dropout_index and node.args[dropout_index] != 0.0:
        raise Unsupported(Reason.of(ReasonCode.SPLIT_ATTENTION_DROPOUT, node=node.name))
    if isinstance(mask, Node) and mask in info.token:
        raise Unsupported(Reason.of(ReasonCode.SPLIT_MASK_FROM_TOKENS, node=node.name))
    used = {u.args[1] for u in node.users}
    if any(u.target is not operator.getitem for u in node.users) or used - {0}:
        raise Unsupported(Reason.of(ReasonCode.SPLIT_ATTENTION_OUTPUTS, node=node.name))
    expected = 0 if info.cut.mode == "batch" else 2
    if dims != {expected}:
        raise Unsupported(Reason.of(ReasonCode.SPLIT_QKV_DIMS, node=node.name, dims=dims, expected=expected))
    causal_index = ATTENTION[node.target][1]
    causal = arg(node, causal_index, "is_causal", False)
    if info.cut.mode == "sequence" and mask is None and not causal:
        # Half A runs before half B's keys exist: only attention in which no query of A sees a key
        # of B (causal, or a mask that says so) can be cut inside a sequence.
        raise Unsupported(Reason.of(ReasonCode.SPLIT_BIDIRECTIONAL_CUT, node=node.name))
    if info.cut.mode == "sequence" and mask is None and shape(q)[2] != shape(k)[2]:
        # ``is_causal`` aligns the diagonal at the upper left; half B's two calls (all of A's keys,
        # then its own causally) are that only with one query per key.
        raise Unsupported(Reason.of(ReasonCode.SPLIT_CAUSAL_OFFSET, node=node.name, queries=shape(q)[2],
                                    keys=shape(k)[2]))
    if isinstance(mask, Node):
        mshape = shape(mask)
        if info.cut.mode == "batch":
            if len(mshape) == 4 and mshape[0] != 1:
                info.sliced.setdefault(node, {})[mask] = 0
        elif len(mshape) < 2:
            raise Unsupported(Reason.of(ReasonCode.SPLIT_MASK_SHAPE, node=node.name, mshape=mshape))
        elif mask not in info.run_time_masks:
            info.run_time_masks.append(mask)
    return (expected,) + (None,) * (len(val(node)) - 1)


def emit_attention(rw: HalfEmitter, node: Node, half: str, args: tuple[Argument, ...],
                   kwargs: dict[str, Argument]) -> Node:
    """``half``'s copy of attention ``node`` over a cut sequence; ``args`` and ``kwargs`` are
    ``node``'s, read for ``half``."""
    causal_index = ATTENTION[node.target][1]
    mask = _mask(node.target, args, kwargs)
    causal = bool(args[causal_index]) if len(args) > causal_index else bool(kwargs.get("is_causal", False))
    q, k_half, v_half = node_list(args[:3], node, f"half {half}'s argument")
    scale = kwargs.get("scale")
    if half == "A":
        if isinstance(mask, Node):  # queries [0, sA) x keys [0, sA)
            rank = val(mask).dim()
            kind = "false" if val(mask).dtype == torch.bool else "additive"
            emit_keys_hidden_check(rw, mask, rank - 2, rank - 1, kind)
            mask = _mask_rows_keys(rw, mask, "A")
            args, kwargs = _with_mask(node.target, args, kwargs, mask)
        return rw.emit(node.target, args, kwargs)
    if not isinstance(mask, Node):
        # B's queries see all of A's keys (no mask: A precedes B) and B's own keys (causal, a
        # square, so upper-left and lower-right alignment agree). Two calls of the graph's own
        # attention op, combined by their log-sum-exps: the same kernel as before the split, no
        # bias tensor, no concatenated K/V, and masked blocks are skipped, not computed.
        k_a, v_a = rw.read(arg_node(node, 1), "A"), rw.read(arg_node(node, 2), "A")
        prefix = attend(rw.emit, node.target, q, k_a, v_a, False, scale)
        own = attend(rw.emit, node.target, q, k_half, v_half, causal, scale)
        rw.merged[(node, half)] = merge_by_lse(rw.emit, prefix, own, val(q).dtype)
        return own[0]  # placeholder copy: the one reader (output 0) takes the merged value
    k = rw.emit(aten.cat.default, ([rw.read(arg_node(node, 1), "A"), k_half], 2))
    v = rw.emit(aten.cat.default, ([rw.read(arg_node(node, 2), "A"), v_half], 2))
    bias = _mask_rows_keys(rw, mask, "B")  # explicit masks exclude is_causal (SDPA's rule)
    if node.target is CPU_FLASH:
        return rw.emit(CPU_FLASH, (q, k, v, 0.0, False), {"attn_mask": bias, "scale": scale})
    # CUDA: flash has no mask argument; the efficient kernel takes an additive bias.
    if val(bias).dtype == torch.bool:
        bias = _additive(rw.emit, bias, val(q).dtype)
    bias = rw.emit(aten.expand.default, (bias, [hint(s) for s in val(q).shape[:2]] + [-1, -1]))
    return rw.emit(CUDA_EFFICIENT, (q, k, v, bias, False, 0.0, False), {"scale": scale})


HIDDEN_KEYS_MESSAGE = (
    "weave split: the attention mask lets a query before the cut attend to a key after it "
    "(bidirectional attention); the split computes the first half before the second half's keys "
    "exist. Compile this model with WeaveConfig(split='off')."
)


def emit_keys_hidden_check(rw: HalfEmitter, mask: Node, row_dim: int | None, key_dim: int,
                           blocks: str | None) -> None:
    """Half A leaves out half B's keys, which is right only if ``mask`` hides every key of B from
    every query of A (a causal or sliding-window mask). The mask is an input, not known at compile
    time: emit a run-time assertion (once per mask) that its block ``[A's rows, B's keys]`` hides
    all: every element False (``blocks == "false"``), every element True (``"true"``: a
    ``masked_fill`` condition) or at most the dtype's lowest value, which is what -inf and Hugging
    Face's ``finfo.min`` masks hold (``"additive"``; ``scores.mask_blocks`` says which). A failing check stops the
    run with ``HIDDEN_KEYS_MESSAGE`` (on CUDA as a device-side assertion) instead of a wrong answer.
    Emitted once per mask and way of hiding: a mask read as ``where(mask, scores, low)`` by one
    attention and as ``where(mask, low, scores)`` by another must hide B's keys for both."""
    if (mask, blocks) in rw.checked_masks:
        return
    rw.checked_masks.add((mask, blocks))
    sizes = shape(mask)
    block = mask
    if row_dim is not None and hint(sizes[row_dim]) != 1:
        block = rw.emit(aten.slice.Tensor, (block, row_dim, *rw.bounds(mask, row_dim, "A")))
    if hint(sizes[key_dim]) != 1:
        block = rw.emit(aten.slice.Tensor, (block, key_dim, *rw.bounds(mask, key_dim, "B")))
    if blocks == "false":
        visible = block
    elif blocks == "true":
        visible = rw.emit(aten.logical_not.default, (block,))
    else:
        visible = rw.emit(aten.gt.Scalar, (block, torch.finfo(val(mask).dtype).min))
    hidden = rw.emit(aten.logical_not.default, (rw.emit(aten.any.default, (visible,)),))
    rw.emit(aten._assert_async.msg, (hidden, HIDDEN_KEYS_MESSAGE))


def attend(emit: EmitNode, target: object, q: Node, k: Node, v: Node, causal: bool,
           scale: Argument) -> tuple[Node, Node]:
    """``target`` (an attention op of ``ATTENTION``) without mask: (output, log-sum-exp as
    ``[B, H, Sq, 1]`` fp32)."""
    if target is CPU_FLASH:
        call = emit(CPU_FLASH, (q, k, v, 0.0, causal), {"scale": scale})
    elif target is CUDA_FLASH:
        call = emit(CUDA_FLASH, (q, k, v, 0.0, causal, False), {"scale": scale})
    elif target is CUDA_EFFICIENT:
        call = emit(CUDA_EFFICIENT, (q, k, v, None, True, 0.0, causal), {"scale": scale})
    else:
        call = emit(CUDA_CUDNN, (q, k, v, None, True, 0.0, causal, False), {"scale": scale})
    out = emit(operator.getitem, (call, 0))
    lse = emit(operator.getitem, (call, 1))
    if val(lse).dim() == 4:  # cuDNN: [B, H, Sq, 1] already
        return out, lse
    rows = val(q).shape[2]
    if val(lse).shape[2] != rows:  # the efficient kernel pads Sq to a multiple of 32
        end = emit(aten.sym_size.int, (q, 2)) if isinstance(rows, torch.SymInt) else rows
        lse = emit(aten.slice.Tensor, (lse, 2, 0, end))
    return out, emit(aten.unsqueeze.default, (lse, 3))


def merge_by_lse(emit: EmitNode, first: tuple[Node, Node], second: tuple[Node, Node], dtype: torch.dtype) -> Node:
    """Softmax attention over the union of two disjoint key sets, from each set's output and
    log-sum-exp: ``(o1 e^(l1-m) + o2 e^(l2-m)) / (e^(l1-m) + e^(l2-m))``, in fp32."""
    (o1, l1), (o2, l2) = first, second
    m = emit(aten.maximum.default, (l1, l2))
    w1 = emit(aten.exp.default, (emit(aten.sub.Tensor, (l1, m)),))
    w2 = emit(aten.exp.default, (emit(aten.sub.Tensor, (l2, m)),))
    f32 = torch.float32
    num = emit(aten.add.Tensor, (
        emit(aten.mul.Tensor, (emit(prims.convert_element_type.default, (o1, f32)), w1)),
        emit(aten.mul.Tensor, (emit(prims.convert_element_type.default, (o2, f32)), w2)),
    ))
    out = emit(aten.div.Tensor, (num, emit(aten.add.Tensor, (w1, w2))))
    return emit(prims.convert_element_type.default, (out, dtype))


def _mask(target: object, args: Sequence[Argument], kwargs: Mapping[str, Argument]) -> Argument:
    """The mask/bias argument of attention op ``target`` called with ``args``, ``kwargs`` (or None)."""
    mask_index = ATTENTION[target][0]
    if mask_index is None:
        return kwargs.get("attn_mask")
    return args[mask_index] if len(args) > mask_index else None


def _mask_rows_keys(rw: HalfEmitter, mask: Node, half: str) -> Node:
    """Rows (queries) of ``half``; keys ``[0, sA)`` for A, all keys for B."""
    rank = val(mask).dim()
    sizes = shape(mask)
    out = mask
    if sizes[-2] != 1:
        out = rw.emit(aten.slice.Tensor, (out, rank - 2, *rw.bounds(mask, rank - 2, half)))
    if half == "A" and sizes[-1] != 1:
        out = rw.emit(aten.slice.Tensor, (out, rank - 1, *rw.bounds(mask, rank - 1, "A")))
    return out


def _additive(emit: EmitNode, allowed: Node, dtype: torch.dtype) -> Node:
    """A boolean mask (True: may attend) as an additive bias of ``dtype``."""
    zero = emit(aten.full.default, ([], 0.0), dict(dtype=dtype, device=val(allowed).device))
    ninf = emit(aten.full.default, ([], float("-inf")), dict(dtype=dtype, device=val(allowed).device))
    return emit(aten.where.self, (allowed, zero, ninf))


def _with_mask(target: object, args: tuple[Argument, ...], kwargs: dict[str, Argument],
               mask: Argument) -> tuple[tuple[Argument, ...], dict[str, Argument]]:
    mask_index = ATTENTION[target][0]
    if mask_index is None:
        return args, {**kwargs, "attn_mask": mask}
    new_args = list(args)
    new_args[mask_index] = mask
    return tuple(new_args), kwargs
