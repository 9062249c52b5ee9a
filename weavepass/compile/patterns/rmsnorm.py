"""Recognise RMSNorm in a post-grad (aten-level) FX graph.

Models emit RMSNorm in several forms; after AOT decomposition they reach the post-grad graph as:

* decomposed, optionally with an fp32 upcast and a downcast (``LlamaRMSNorm``, ``nn.RMSNorm``)::

      xf = convert(x, f32)?            # upcast, optional
      r  = rsqrt(mean(pow(xf, 2) | xf * xf, [-1], keepdim) + eps)     # or 1 / sqrt(...)
      y  = xf * r                      # or xf / sqrt(...)
      y  = convert(y, dtype)?          # downcast, optional
      y  = y * w  |  w * y             # weight, optional, any dtype
      y  = convert(y, dtype)?          # final cast, optional

* ``aten.rms_norm`` / ``aten._fused_rms_norm`` when a backend keeps them undecomposed.

``match_rmsnorm(x)`` returns an ``RMSNormMatch`` or a reason string saying why ``x`` does not feed an
RMSNorm over its last dim. eps is read from the graph, never assumed.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch.fx import Node

aten = torch.ops.aten
prims = torch.ops.prims

CONVERTS = {prims.convert_element_type.default, aten._to_copy.default}
MEAN = {aten.mean.dim}
ADDS = {aten.add.Tensor, aten.add.Scalar}
MULS = {aten.mul.Tensor}
FUSED_RMS_NORMS = {aten.rms_norm.default}
LAYER_NORMS = {aten.native_layer_norm.default, aten.layer_norm.default, aten.var_mean.correction}
if hasattr(aten, "_fused_rms_norm"):
    FUSED_RMS_NORMS.add(aten._fused_rms_norm.default)


def val(node) -> torch.Tensor | None:
    """The fake tensor recorded for ``node`` (None for non-tensor values)."""
    v = node.meta.get("val") if isinstance(node, Node) else None
    return v if isinstance(v, torch.Tensor) else None


def is_target(node, targets) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def _convert_dtype(node: Node) -> torch.dtype | None:
    """The dtype a convert node casts to, or None when ``node`` is not a pure cast."""
    if node.target is prims.convert_element_type.default:
        return node.args[1]
    if node.target is aten._to_copy.default and set(node.kwargs) <= {"dtype"}:
        return node.kwargs.get("dtype")
    return None


def _only_user(node: Node, targets) -> Node | None:
    users = list(node.users)
    if len(users) == 1 and is_target(users[0], targets):
        return users[0]
    return None


def add_alpha(node: Node):
    """The ``alpha`` of ``add.Tensor(a, b, *, alpha)`` / ``add.Scalar(a, b, alpha)``: ``a + alpha * b``."""
    if len(node.args) > 2:
        return node.args[2]
    return node.kwargs.get("alpha", 1)


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


def used_also_by(node: Node, user: Node) -> str:
    """Why ``node`` cannot be folded into a fused op: ``user`` reads it too."""
    if user.op == "output" and _saved_for_backward(node, user):
        return (f"training: {node.name} is saved for backward, and the fused op can return only "
                "the norm's inverse RMS (rsqrt, in fp32 or fp64) besides its outputs (run the model "
                "under torch.no_grad() or torch.inference_mode() to fuse it)")
    if user.op == "output":
        return f"{node.name} is also used by output (the graph returns it)"
    return f"{node.name} is also used by {user.name}"


def _sole_user_reason(node: Node, what: str, targets, wanted: str) -> Node | str:
    """The single user of ``node`` in ``targets``, or why there is none (``what`` names ``node``)."""
    found = _only_user(node, targets)
    if found is not None:
        return found
    users = list(node.users)
    if len(users) > 1 and any(is_target(u, targets) for u in users):
        other = next(u for u in users if not is_target(u, targets))
        return f"{what}: {used_also_by(node, other)}"
    return f"{what} is not followed by {wanted}"


def _other_operand(node: Node, operand: Node):
    """For a binary op with ``operand`` as one argument, the other argument."""
    a, b = node.args[0], node.args[1]
    if a is operand:
        return b
    if b is operand:
        return a
    return None


@dataclass
class RMSNormMatch:
    """One RMSNorm: ``output = rmsnorm(input) * weight``, normalised over the last dim."""

    input: Node
    output: Node
    weight: Node | None
    eps: float
    form: str
    # Every node of the norm except ``input``; all are dead once ``output`` is replaced.
    nodes: list[Node] = field(default_factory=list)
    # Training: the rsqrt node the graph also returns as saved for backward; the fused op then
    # returns the inverse RMS, and the saved node is replaced by that output.
    saved_inv_rms: Node | None = None

    @property
    def out_dtype(self) -> torch.dtype:
        return val(self.output).dtype


EPS_NOT_CONSTANT = (
    "the norm's eps is not a constant but a graph input (torch.compile(dynamic=True) lifts Python "
    "floats into inputs): set torch._dynamo.config.specialize_float = True, or mark only the token "
    "dim dynamic with torch._dynamo.mark_dynamic"
)


def _is_last_dim(dims, ndim: int) -> bool:
    return list(dims) in ([-1], [ndim - 1])


def _match_fused(x: Node) -> RMSNormMatch | str | None:
    for user in x.users:
        if not is_target(user, FUSED_RMS_NORMS) or user.args[0] is not x:
            continue
        shape = user.args[1]
        if len(shape) != 1:
            return f"{user.target} normalises over {len(shape)} dims, not only the last"
        weight = user.args[2] if len(user.args) > 2 else user.kwargs.get("weight")
        eps = user.args[3] if len(user.args) > 3 else user.kwargs.get("eps")
        if eps is None:
            eps = torch.finfo(val(x).dtype).eps
        output, nodes = user, []
        if user.target is not aten.rms_norm.default:
            # _fused_rms_norm returns (out, rstd); only ``out`` may be used.
            getters = list(user.users)
            if any(g.target is not operator.getitem or g.args[1] != 0 for g in getters):
                saved = [g for g in getters if g.target is operator.getitem and g.args[1] == 1
                         and any(u.op == "output" and _saved_for_backward(g, u) for u in g.users)]
                if saved:
                    return (f"training: the norm's rstd output {saved[0].name} is saved for "
                            f"backward ({user.target} is not fused in training graphs)")
                return "the norm's rstd output is used elsewhere"
            if len(getters) != 1:
                return "the norm output is read through several getitems"
            output, nodes = getters[0], [user]
        if not isinstance(eps, (int, float)):
            return EPS_NOT_CONSTANT
        return RMSNormMatch(x, output, weight, float(eps), f"{user.target}", nodes)
    return None


def _match_inv_rms(square: Node, xf: Node, ndim: int) -> tuple[Node, list[Node], float, bool] | str:
    """From ``square`` (= xf^2) to the node that scales xf: ``(scale, nodes, eps, is_rsqrt)``."""
    mean = _sole_user_reason(square, "the squared input", MEAN, "a mean")
    if isinstance(mean, str):
        return mean
    dims = mean.args[1]
    keepdim = mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False)
    if not _is_last_dim(dims, ndim):
        return f"the norm reduces over dims {list(dims)}, not the last dim"
    if not keepdim:
        return "the mean of squares drops its dim"
    add_eps = _sole_user_reason(mean, "the mean of squares", ADDS, "an eps add")
    if isinstance(add_eps, str):
        return add_eps
    eps = _other_operand(add_eps, mean)
    if not isinstance(eps, (int, float)):
        return EPS_NOT_CONSTANT
    if add_alpha(add_eps) != 1:  # mean + alpha * eps: refuse rather than guess which eps is meant
        return f"the eps add scales eps by alpha={add_alpha(add_eps)}; only mean + eps is matched"
    rsqrt = _only_user(add_eps, {aten.rsqrt.default})
    if rsqrt is not None:
        return rsqrt, [square, mean, add_eps, rsqrt], float(eps), True
    sqrt = _only_user(add_eps, {aten.sqrt.default})
    if sqrt is not None:
        return sqrt, [square, mean, add_eps, sqrt], float(eps), False
    return "the mean of squares plus eps is not followed by rsqrt or sqrt"


def _match_decomposed(x: Node) -> RMSNormMatch | str | None:
    xv = val(x)
    hidden, ndim = xv.shape[-1], xv.dim()
    xf, nodes = x, []
    upcasts = [u for u in x.users if is_target(u, CONVERTS) and _convert_dtype(u) == torch.float32]
    if xv.dtype != torch.float32 and upcasts:
        xf = upcasts[0]
        nodes.append(xf)

    squares = [
        u for u in xf.users
        if (is_target(u, {aten.pow.Tensor_Scalar}) and u.args[0] is xf and u.args[1] == 2)
        or (is_target(u, MULS) and u.args[0] is xf and u.args[1] is xf)
    ]
    if not squares:
        return None
    inv = _match_inv_rms(squares[0], xf, ndim)
    if isinstance(inv, str):
        return inv
    scale_src, inv_nodes, eps, is_rsqrt = inv
    nodes += inv_nodes
    scales = [
        u for u in scale_src.users
        if is_target(u, MULS if is_rsqrt else {aten.div.Tensor})
        and _other_operand(u, scale_src) is xf and (is_rsqrt or u.args[0] is xf)
    ]
    if not scales:
        return "the inverse RMS does not scale the norm's own input"
    scale = scales[0]
    nodes.append(scale)

    out, weight = scale, None
    down = _only_user(out, CONVERTS)
    if down is not None:
        nodes.append(down)
        out = down
    mul_w = _only_user(out, MULS)
    if mul_w is not None:
        w = _other_operand(mul_w, out)
        wv = val(w)
        if wv is not None and list(wv.shape) == [hidden]:
            weight, out = w, mul_w
            nodes.append(mul_w)
            cast = _only_user(out, CONVERTS)
            if cast is not None:
                nodes.append(cast)
                out = cast
    # ``xf`` and every inner node must serve the norm alone, or removing it would change others.
    inner = set(nodes[:-1])
    if xf is not x and set(xf.users) - {squares[0], scale}:
        extra = next(iter(set(xf.users) - {squares[0], scale}))
        return f"the upcast norm input {used_also_by(xf, extra)}"
    saved = None
    for n in inner:
        extra = [u for u in n.users if u not in inner and u is not out]
        if extra and n is scale_src and is_rsqrt and _saved_inv_rms_only(n, extra, xv.dtype):
            saved = n
        elif extra:
            return f"the norm's intermediate {used_also_by(n, extra[0])}"
    form = "decomposed" + ("+fp32-upcast" if xf is not x else "")
    return RMSNormMatch(x, out, weight, eps, form, [n for n in nodes if n is not out] + [out], saved)


def _saved_inv_rms_only(rsqrt: Node, extra: list[Node], input_dtype: torch.dtype) -> bool:
    """Whether the only use of ``rsqrt`` outside the norm is being saved for backward, in the
    dtype the fused training op returns it in (``accumulation_dtype`` of the norm's input)."""
    from weavepass.runtime.reference import accumulation_dtype

    rv = val(rsqrt)
    return (
        all(u.op == "output" and _saved_for_backward(rsqrt, u) for u in extra)
        and rv is not None and rv.dtype == accumulation_dtype(input_dtype)
    )


def match_rmsnorm(x: Node) -> RMSNormMatch | str:
    """The RMSNorm over the last dim that ``x`` feeds, or the reason there is none."""
    if val(x) is None:
        return f"{x.name} has no tensor metadata"
    for matcher in (_match_fused, _match_decomposed):
        found = matcher(x)
        if found is not None:
            return found
    if _feeds_layer_norm(x):
        return LAYER_NORM_REASON
    first = next(iter(x.users), None)
    used_by = f"{first.target}" if first is not None else "nothing"
    return f"no RMSNorm consumes the value (first user: {used_by})"


LAYER_NORM_REASON = ("a LayerNorm (mean-subtracted) consumes the value, not an RMSNorm; the fused op "
                     "normalises by the root mean square only")


def _feeds_layer_norm(x: Node) -> bool:
    """``x`` (or its fp32 upcast) feeds a LayerNorm: ``native_layer_norm``, Inductor's
    ``var_mean`` decomposition, or ``x - mean(x, -1, keepdim)`` written out (Cohere)."""
    sources = [x] + [u for u in x.users if is_target(u, CONVERTS) and _convert_dtype(u) == torch.float32]
    for source in sources:
        for user in source.users:
            if is_target(user, LAYER_NORMS) and user.args[0] is source:
                return True
            if is_target(user, MEAN) and _is_last_dim(user.args[1], val(source).dim()) and any(
                is_target(sub, {aten.sub.Tensor}) and sub.args == (source, user) for sub in user.users
            ):
                return True
    return False
