"""Recognise RMSNorm and LayerNorm in a post-grad (aten-level) FX graph.

Models emit RMSNorm in several forms; after AOT decomposition they reach the post-grad graph as:

* decomposed, optionally with an fp32 upcast and a downcast (``LlamaRMSNorm``, ``nn.RMSNorm``)::

      xf = convert(x, f32)?            # upcast, optional
      r  = rsqrt(mean(pow(xf, 2) | xf * xf, [-1], keepdim) + eps)     # or 1 / sqrt(...)
      y  = xf * r                      # or xf / sqrt(...)
      y  = convert(y, dtype)?          # downcast, optional
      y  = y * w  |  w * y             # weight, optional, any dtype
      y  = convert(y, dtype)?          # final cast, optional

* ``aten.rms_norm`` / ``aten._fused_rms_norm`` when a backend keeps them undecomposed.

LayerNorm (``kind == LAYER_NORM``) reaches it as::

      xf = convert(x, f32)?            # upcast, optional
      var, mean = var_mean(xf, [-1], correction=0, keepdim)      # F.layer_norm's decomposition
        | mean = mean(xf, [-1], keepdim); var = mean(pow(xf - mean, 2) | d * d, [-1], keepdim)
                                       # written out (CohereLayerNorm; ``xf - mean`` once or twice)
      y  = (xf - mean) * rsqrt(var + eps)                        # or / sqrt(var + eps)
      y  = convert(y, dtype)?          # downcast, optional
      y  = y * w  |  w * y             # weight, optional
      y  = y + b  |  b + y             # bias, optional
      y  = convert(y, dtype)?          # final cast, optional

or as ``aten.native_layer_norm`` / ``aten.layer_norm`` when a backend keeps them undecomposed.

``match_rmsnorm(x)`` returns an ``RMSNormMatch`` (either kind) or a ``Reason`` saying why ``x``
does not feed a norm over its last dim. eps is read from the graph, never assumed.
"""

from __future__ import annotations

import operator
from collections.abc import Collection
from dataclasses import dataclass
from typing import Literal

import torch
from torch.fx import Node

from weavepass.compile.fx_args import arg, arguments
from weavepass.compile.reasons import Reason, ReasonCode
from weavepass.compile.where import where

aten = torch.ops.aten
prims = torch.ops.prims

CONVERTS = {prims.convert_element_type.default, aten._to_copy.default}
MEAN = {aten.mean.dim}
ADDS = {aten.add.Tensor, aten.add.Scalar}
MULS = {aten.mul.Tensor}
FUSED_RMS_NORMS = {aten.rms_norm.default}
FUSED_LAYER_NORMS = {aten.native_layer_norm.default, aten.layer_norm.default}
VAR_MEAN = aten.var_mean.correction
NormKind = Literal["RMSNorm", "LayerNorm"]
RMS_NORM: NormKind = "RMSNorm"
LAYER_NORM: NormKind = "LayerNorm"
"""``RMSNormMatch.kind``: ``x * rsqrt(mean(x^2) + eps) * w``, or ``(x - mean(x)) * rsqrt(var(x) + eps) * w + b``."""
if hasattr(aten, "_fused_rms_norm"):
    FUSED_RMS_NORMS.add(aten._fused_rms_norm.default)


def val(node: object) -> torch.Tensor | None:
    """The fake tensor recorded for ``node`` (None for non-tensor values)."""
    v = node.meta.get("val") if isinstance(node, Node) else None
    return v if isinstance(v, torch.Tensor) else None


def is_target(node: object, targets: Collection[object]) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def _convert_dtype(node: Node) -> torch.dtype | None:
    """The dtype a convert node casts to, or None when ``node`` is not a pure cast. Read by the
    schema's names: a pass chained before weave's may give ``self`` (and ``dtype``) by keyword."""
    if node.target is prims.convert_element_type.default:
        dtype = arg(node, 1)
    elif node.target is aten._to_copy.default and set(node.kwargs) <= {"self", "dtype"}:
        dtype = node.kwargs.get("dtype")
    else:
        return None
    return dtype if isinstance(dtype, torch.dtype) else None


def _only_user(node: Node, targets: Collection[object]) -> Node | None:
    users = list(node.users)
    if len(users) == 1 and is_target(users[0], targets):
        return users[0]
    return None


def add_alpha(node: Node) -> object:
    """The ``alpha`` of ``add.Tensor(a, b, *, alpha)`` / ``add.Scalar(a, b, alpha)``: ``a + alpha * b``
    (and of ``sub.Tensor``: ``a - alpha * b``)."""
    return arguments(node).get("alpha", 1)


def _saved_for_backward(node: Node, output: Node) -> bool:
    """Whether the graph returns ``node`` only as a tensor saved for backward.

    AOT autograd's forward graph of a training compile returns the model's outputs first and the
    saved tensors after them; ``fw_metadata.num_forward`` counts the former.
    """
    from torch._guards import TracingContext

    context = TracingContext.try_get()
    num_forward = getattr(getattr(context, "fw_metadata", None), "num_forward", None)
    returned = output.args[0] if isinstance(output.args[0], (list, tuple)) else [output.args[0]]
    positions = [i for i, n in enumerate(returned) if n is node]
    return num_forward is not None and bool(positions) and min(positions) >= num_forward


def used_also_by(node: Node, user: Node, kind: NormKind = RMS_NORM) -> Reason:
    """Why ``node`` cannot be folded into a fused op: ``user`` reads it too (``kind``: the norm's)."""
    if (user.op == "output" and _saved_for_backward(node, user)) or (
            user.users and all(u.op == "output" and _saved_for_backward(user, u) for u in user.users)):
        saved_as = "" if user.op == "output" else user.name  # one step, e.g. rsqrt / H
        return Reason.of(ReasonCode.SAVED_FOR_BACKWARD, node=node.name, user=saved_as, norm_kind=kind)
    if user.op == "output":
        return Reason.of(ReasonCode.READ_BY_OUTPUT, node=node.name)
    return Reason.of(ReasonCode.READ_BY, node=node.name, user=user.name)


def _shared(what: str, node: Node, user: Node, kind: NormKind = RMS_NORM) -> Reason:
    """``what`` (``node``, a value inside the norm) is read by ``user`` too."""
    return Reason.of(ReasonCode.NORM_VALUE_SHARED, what=what, cause=used_also_by(node, user, kind))


def _sole_user_reason(node: Node, what: str, targets: Collection[object], wanted: str) -> Node | Reason:
    """The single user of ``node`` in ``targets``, or why there is none (``what`` names ``node``)."""
    found = _only_user(node, targets)
    if found is not None:
        return found
    users = list(node.users)
    if len(users) > 1 and any(is_target(u, targets) for u in users):
        other = next(u for u in users if not is_target(u, targets))
        return _shared(what, node, other)
    return Reason.of(ReasonCode.NOT_FOLLOWED_BY, what=what, wanted=wanted)


def _other_operand(node: Node, operand: Node) -> object:
    """For a binary op with ``operand`` as one argument, the other argument (read by the schema's
    names, ``self`` and ``other``: a chained pass may give them by keyword)."""
    a, b = arg(node, 0), arg(node, 1)
    if a is operand:
        return b
    if b is operand:
        return a
    return None


@dataclass(frozen=True)
class RMSNormMatch:
    """One norm over the last dim: ``output = rmsnorm(input) * weight`` (``kind == RMS_NORM``) or
    ``output = layernorm(input) * weight + bias`` (``kind == LAYER_NORM``; biased variance)."""

    input: Node
    output: Node
    weight: Node | None
    eps: float
    form: str
    nodes: tuple[Node, ...] = ()
    """Every node of the norm except ``input``; all are dead once ``output`` is replaced."""
    saved_inv_rms: Node | None = None
    """Training: the rsqrt node the graph also returns as saved for backward; the fused op then
    returns the inverse RMS, and the saved node is replaced by that output."""
    kind: NormKind = RMS_NORM
    bias: Node | None = None
    """LayerNorm only: the bias added after the weight, ``[H]``, or None."""

    @property
    def out_dtype(self) -> torch.dtype:
        return _val(self.output).dtype


def _val(node: object) -> torch.Tensor:
    """``val(node)`` where the match already checked it is a tensor."""
    value = val(node)
    assert value is not None, node
    return value


EPS_NOT_CONSTANT = Reason(ReasonCode.EPS_NOT_CONSTANT)


def _is_last_dim(dims: object, ndim: int) -> bool:
    return isinstance(dims, (list, tuple)) and list(dims) in ([-1], [ndim - 1])


def _match_fused(x: Node) -> RMSNormMatch | Reason | None:
    for user in x.users:
        if not is_target(user, FUSED_RMS_NORMS | FUSED_LAYER_NORMS):
            continue
        given = arguments(user)  # by the schema's names: the ops differ in which follow the weight
        if given["input"] is not x:
            continue
        shape = given["normalized_shape"]
        assert isinstance(shape, (list, tuple))
        if len(shape) != 1:
            return Reason.of(ReasonCode.NORM_OVER_SEVERAL_DIMS, op=str(user.target), ndims=len(shape))
        layer = user.target in FUSED_LAYER_NORMS
        weight, bias, eps = given.get("weight"), given.get("bias"), given.get("eps")
        if eps is None:  # rms_norm's default: the eps of the dtype it computes in (fp32 for bf16, fp16)
            from weavepass.runtime.reference import accumulation_dtype

            eps = 1e-5 if layer else torch.finfo(accumulation_dtype(_val(x).dtype)).eps
        output, nodes = user, [user]
        if user.target not in (aten.rms_norm.default, aten.layer_norm.default):
            # _fused_rms_norm returns (out, rstd), native_layer_norm (out, mean, rstd); only
            # ``out`` may be used (make_fx keeps getitems nobody reads).
            getters = [g for g in user.users if g.users]
            if any(g.target is not operator.getitem or g.args[1] != 0 for g in getters):
                saved = [g for g in getters if g.target is operator.getitem and g.args[1] != 0
                         and any(u.op == "output" and _saved_for_backward(g, u) for u in g.users)]
                if saved:
                    return Reason.of(ReasonCode.NORM_STATS_SAVED, node=saved[0].name, op=str(user.target))
                return Reason(ReasonCode.NORM_STATS_READ)
            if len(getters) != 1:
                return Reason(ReasonCode.NORM_OUTPUT_GETITEMS)
            output = getters[0]
            nodes = [user, *(g for g in user.users if g is not output), output]
        if not isinstance(eps, (int, float)):
            return EPS_NOT_CONSTANT
        assert isinstance(weight, (Node, type(None))) and isinstance(bias, (Node, type(None)))
        return RMSNormMatch(x, output, weight, float(eps), f"{user.target}", tuple(nodes),
                            kind=LAYER_NORM if layer else RMS_NORM, bias=bias)
    return None


def _match_inv_rms(square: Node, xf: Node, ndim: int) -> tuple[Node, list[Node], float, bool] | Reason:
    """From ``square`` (= xf^2) to the node that scales xf: ``(scale, nodes, eps, is_rsqrt)``."""
    mean = _sole_user_reason(square, "the squared input", MEAN, "a mean")
    if isinstance(mean, Reason):
        return mean
    unfit = _unfit_last_dim_mean(mean, ndim, "the mean of squares")
    if unfit is not None:
        return unfit
    found = _eps_rsqrt(mean, "the mean of squares")
    if isinstance(found, Reason):
        return found
    root, nodes, eps, is_rsqrt = found
    return root, [square, mean, *nodes], eps, is_rsqrt


def _unfit_last_dim_mean(mean: Node, ndim: int, what: str) -> Reason | None:
    """Why ``mean`` (``aten.mean.dim``) is not a mean over the last dim that keeps it, or None."""
    given = arguments(mean)
    keepdim, dims = given["keepdim"], given["dim"]
    if not _is_last_dim(dims, ndim):
        return Reason.of(ReasonCode.NORM_NOT_LAST_DIM,
                         dims=list(dims) if isinstance(dims, (list, tuple)) else dims)
    if not keepdim:
        return Reason.of(ReasonCode.MEAN_DROPS_DIM, what=what)
    return None


def _eps_rsqrt(var: Node, what: str) -> tuple[Node, list[Node], float, bool] | Reason:
    """``rsqrt(var + eps)`` or ``sqrt(var + eps)`` (or ``pow(var + eps, -0.5 | 0.5)``) after ``var``
    (``what`` names it): ``(rsqrt or sqrt, [add, rsqrt or sqrt], eps, is_rsqrt)``."""
    add_eps = _sole_user_reason(var, what, ADDS, "an eps add")
    if isinstance(add_eps, Reason):
        return add_eps
    eps = _other_operand(add_eps, var)
    if not isinstance(eps, (int, float)):
        return EPS_NOT_CONSTANT
    if add_alpha(add_eps) != 1:  # var + alpha * eps: refuse rather than guess which eps is meant
        return Reason.of(ReasonCode.EPS_ALPHA, alpha=add_alpha(add_eps))
    for target, is_rsqrt in ((aten.rsqrt.default, True), (aten.sqrt.default, False)):
        root = _only_user(add_eps, {target})
        if root is not None:
            return root, [add_eps, root], float(eps), is_rsqrt
    # ``torch.pow(var + eps, -0.5)`` (Gemma3n's and Gemma4's RMSNorm), or ``** 0.5``
    root = _only_user(add_eps, {aten.pow.Tensor_Scalar})
    exponent = arguments(root)["exponent"] if root is not None else None
    if root is not None and arg(root, 0) is add_eps and exponent in (-0.5, 0.5):
        return root, [add_eps, root], float(eps), bool(exponent == -0.5)
    return Reason.of(ReasonCode.NO_ROOT_AFTER_EPS, what=what)


def _match_decomposed(x: Node) -> RMSNormMatch | Reason | None:
    xv = _val(x)
    hidden, ndim = xv.shape[-1], xv.dim()
    xf = _upcast(x)
    nodes = [xf] if xf is not x else []

    squares = [
        u for u in xf.users
        if (is_target(u, {aten.pow.Tensor_Scalar}) and arg(u, 0) is xf and arg(u, 1) == 2)
        or (is_target(u, MULS) and arg(u, 0) is xf and arg(u, 1) is xf)
    ]
    if not squares:
        return None
    inv = _match_inv_rms(squares[0], xf, ndim)
    if isinstance(inv, Reason):
        return inv
    scale_src, inv_nodes, eps, is_rsqrt = inv
    nodes += inv_nodes
    scales = [
        u for u in scale_src.users
        if is_target(u, MULS if is_rsqrt else {aten.div.Tensor})
        and _other_operand(u, scale_src) is xf and (is_rsqrt or arg(u, 0) is xf)
    ]
    if not scales:
        return Reason(ReasonCode.INV_RMS_NOT_SCALING_INPUT)
    narrowed = _narrowing_cast_reason(x, xf)
    if narrowed is not None:
        return narrowed
    scale = scales[0]
    nodes.append(scale)

    out, weight, _ = _affine(scale, hidden, nodes, RMS_NORM)
    # ``xf`` and every inner node must serve the norm alone, or removing it would change others.
    # Users and nodes in graph order, never a set's order: every rank must give the same reason.
    inner = set(nodes[:-1])
    others = [u for u in xf.users if u not in (squares[0], scale)] if xf is not x else []
    if others:
        return _shared("the upcast norm input", xf, others[0])
    saved = None
    for n in nodes[:-1]:
        extra = [u for u in n.users if u not in inner and u is not out]
        if extra and n is scale_src and is_rsqrt and _saved_inv_rms_only(n, extra, xv.dtype):
            saved = n
        elif extra:
            return _shared("the norm's intermediate", n, extra[0])
    form = "decomposed" + ("+fp32-upcast" if xf is not x else "")
    return RMSNormMatch(x, out, weight, eps, form, (*[n for n in nodes if n is not out], out), saved)


def _upcast(x: Node) -> Node:
    """``x``'s fp32 upcast when it has one and is not fp32 already, else ``x``."""
    upcasts = [u for u in x.users if is_target(u, CONVERTS) and _convert_dtype(u) == torch.float32]
    return upcasts[0] if _val(x).dtype != torch.float32 and upcasts else x


def _narrowing_cast_reason(x: Node, xf: Node) -> Reason | None:
    """Why a norm computed on ``xf`` (``_upcast(x)``) cannot be fused, or None: the fused op
    computes in ``accumulation_dtype`` of ``x``'s dtype, so a cast to fp32 must widen ``x``."""
    from weavepass.runtime.reference import accumulation_dtype

    dtype = _val(x).dtype
    if xf is x or accumulation_dtype(dtype) == torch.float32:
        return None
    return Reason.of(ReasonCode.NARROWING_CAST, dtype=dtype, acc_dtype=accumulation_dtype(dtype))


def _hidden_vector(node: object, hidden: int) -> bool:
    v = val(node)
    return v is not None and list(v.shape) == [hidden]


def _affine(out: Node, hidden: int, nodes: list[Node], kind: NormKind) -> tuple[Node, Node | None, Node | None]:
    """After the normalised ``out``: ``convert? -> (* w)? -> (+ b)? -> convert?`` (a bias only for
    LayerNorm), each step the previous one's only user; appends the steps to ``nodes``. Returns
    ``(output, weight, bias)``."""
    weight: Node | None = None
    bias: Node | None = None
    down = _only_user(out, CONVERTS)
    if down is not None:
        nodes.append(down)
        out = down
    mul_w = _only_user(out, MULS)
    w = _other_operand(mul_w, out) if mul_w is not None else None
    if mul_w is not None and isinstance(w, Node) and _hidden_vector(w, hidden):
        weight, out = w, mul_w
        nodes.append(mul_w)
    add_b = _only_user(out, {aten.add.Tensor}) if kind == LAYER_NORM else None
    b = _other_operand(add_b, out) if add_b is not None else None
    if add_b is not None and add_alpha(add_b) == 1 and isinstance(b, Node) and _hidden_vector(b, hidden):
        bias, out = b, add_b
        nodes.append(add_b)
    cast = _only_user(out, CONVERTS) if weight is not None or bias is not None else None
    if cast is not None:
        nodes.append(cast)
        out = cast
    return out, weight, bias


def _match_layer_norm(x: Node) -> RMSNormMatch | Reason | None:
    """The decomposed LayerNorm over the last dim that ``x`` (or its fp32 upcast) feeds, a reason,
    or None when no mean or ``var_mean`` over the last dim reads it."""
    xv = _val(x)
    hidden, ndim = xv.shape[-1], xv.dim()
    xf = _upcast(x)
    nodes = [xf] if xf is not x else []
    stats = _layer_norm_stats(xf, ndim)
    if stats is None:
        return None
    if isinstance(stats, Reason):
        return stats
    var, centred, stat_nodes, form = stats
    inv = _eps_rsqrt(var, "the variance")
    if isinstance(inv, Reason):
        return inv
    root, inv_nodes, eps, is_rsqrt = inv
    scales = [u for u in root.users
              if is_target(u, MULS if is_rsqrt else {aten.div.Tensor})
              and _other_operand(u, root) in centred and (is_rsqrt or arg(u, 1) is root)]
    if not scales:
        return Reason(ReasonCode.INV_STD_NOT_SCALING_CENTRED)
    narrowed = _narrowing_cast_reason(x, xf)
    if narrowed is not None:
        return narrowed
    nodes += [*stat_nodes, *inv_nodes, scales[0]]
    out, weight, bias = _affine(scales[0], hidden, nodes, LAYER_NORM)
    # ``xf`` and every inner node must serve the norm alone, or removing it would change others.
    inner = set(nodes) - {out}
    for n in (n for n in nodes if n is not out):  # graph order: every rank gives the same reason
        extra = [u for u in n.users if u not in inner and u is not out]
        if extra:
            what = "the upcast norm input" if n is xf else "the norm's intermediate"
            return _shared(what, n, extra[0], LAYER_NORM)
    form = f"LayerNorm ({form}{'+fp32-upcast' if xf is not x else ''})"
    return RMSNormMatch(x, out, weight, eps, form, (*[n for n in nodes if n is not out], out),
                        kind=LAYER_NORM, bias=bias)


def _layer_norm_stats(xf: Node, ndim: int) -> tuple[Node, list[Node], list[Node], str] | Reason | None:
    """``(var, centred, nodes, form)``: the biased variance of ``xf`` over the last dim, the
    ``xf - mean`` nodes (one or two), and the nodes computing them; a reason; or None when nothing
    takes ``xf``'s mean over the last dim."""
    for user in xf.users:
        given = arguments(user) if is_target(user, {VAR_MEAN}) else {}
        if given and given["self"] is xf:
            correction = given["correction"]
            correction = 1 if correction is None else correction  # var_mean's default: unbiased
            dims = given["dim"]
            if dims is None or not _is_last_dim(dims, ndim) or not given["keepdim"]:
                return Reason(ReasonCode.VAR_MEAN_NOT_LAST_DIM)
            if correction != 0:
                return Reason.of(ReasonCode.UNBIASED_VARIANCE, correction=correction)
            getters = {g.args[1]: g for g in user.users if g.target is operator.getitem}
            if len(user.users) != 2 or set(getters) != {0, 1}:
                return Reason(ReasonCode.VAR_MEAN_OUTPUTS)
            var, mean = getters[0], getters[1]
            centred = _centred(xf, mean)
            if isinstance(centred, Reason):
                return centred
            if len(centred) != len(mean.users):
                other = next(u for u in mean.users if u not in centred)
                return _shared("the norm's mean", mean, other, LAYER_NORM)
            return var, centred, [user, var, mean, *centred], "var_mean"
        if is_target(user, MEAN) and arg(user, 0) is xf and _unfit_last_dim_mean(user, ndim, "") is None:
            mean = user
            centred = _centred(xf, mean)
            if isinstance(centred, Reason):
                return centred
            squares = [u for c in centred for u in c.users
                       if (is_target(u, {aten.pow.Tensor_Scalar}) and _operands(u) == (c, 2))
                       or (is_target(u, MULS) and _operands(u) == (c, c))]
            if not squares:  # (a variance may still come from a var_mean)
                continue
            variance = _sole_user_reason(squares[0], "the squared deviation", MEAN, "a mean")
            if isinstance(variance, Reason):
                return variance
            unfit = _unfit_last_dim_mean(variance, ndim, "the variance")
            if unfit is not None:
                return unfit
            return variance, centred, [mean, *centred, squares[0], variance], "decomposed"
    return None


def _operands(node: Node) -> tuple[object, object] | None:
    """``(self, other)`` (``(self, exponent)`` of ``pow``) of a binary op called with those two
    arguments and no other (``sub``'s ``alpha`` by keyword is read by ``add_alpha``), given by
    position or by keyword; else None."""
    names = [a.name for a in node.target._schema.arguments] if isinstance(node.target, torch._ops.OpOverload) else []
    given = dict(zip(names, node.args)) | dict(node.kwargs)
    if len(names) < 2 or set(given) - {"alpha"} != set(names[:2]):
        return None
    return given[names[0]], given[names[1]]


def _centred(xf: Node, mean: Node) -> list[Node] | Reason:
    """The ``xf - mean`` nodes among ``mean``'s users, or why one of them is not LayerNorm's
    centring (``sub(xf, mean, alpha=a)`` computes ``xf - a * mean``)."""
    centred = [u for u in mean.users if is_target(u, {aten.sub.Tensor}) and _operands(u) == (xf, mean)]
    for sub in centred:
        if add_alpha(sub) != 1:
            return Reason.of(ReasonCode.MEAN_SUB_ALPHA, node=sub.name, alpha=add_alpha(sub))
    return centred


def _saved_inv_rms_only(rsqrt: Node, extra: list[Node], input_dtype: torch.dtype) -> bool:
    """Whether the only use of ``rsqrt`` outside the norm is being saved for backward, in the
    dtype the fused training op returns it in (``accumulation_dtype`` of the norm's input)."""
    from weavepass.runtime.reference import accumulation_dtype

    rv = val(rsqrt)
    return (
        all(u.op == "output" and _saved_for_backward(rsqrt, u) for u in extra)
        and rv is not None and rv.dtype == accumulation_dtype(input_dtype)
    )


def match_rmsnorm(x: Node) -> RMSNormMatch | Reason:
    """The RMSNorm or LayerNorm over the last dim that ``x`` feeds, or the reason there is none."""
    if val(x) is None:
        return Reason.of(ReasonCode.INPUT_NO_METADATA, node=x.name)
    for matcher in (_match_fused, _match_decomposed, _match_layer_norm):
        found = matcher(x)
        if found is not None:
            return found
    first = next(iter(x.users), None)
    if first is None:
        return Reason.of(ReasonCode.NO_NORM, first_user="nothing", place="")
    place = where(first)  # (the model's code that reads the value: what the user recognises)
    return Reason.of(ReasonCode.NO_NORM, first_user=f"{first.target}", place=f" in {place}" if place else "")
