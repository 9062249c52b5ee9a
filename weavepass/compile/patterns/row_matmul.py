"""The row-parallel matmul that makes a site's partial sum, for the GEMM-epilogue lowering.

``find_row_parallel_matmul(site)`` reads, on a site as the finder matched it (before ``prepare``),
whether its all_reduce sums ``views(mm(x, mat2))``: a 2-D ``aten.mm`` without a bias, every node
from it to the all_reduce a view the finder walks (``VIEWS``) read by nothing else. It returns a
``RowParallelMatmul`` (the match) or the ``Reason`` it is not one, each rejection a
``GEMM_EPILOGUE_*`` code whose sentence names the module that produced the sum. A bias the family
forms move onto the residual (``SumTree``: ``(S + b) + r``) leaves the matmul a plain ``mm``; a sum
merged with another all_reduce's, or scaled, does not.

``RowParallelMatmul.absorb(graph, fused)`` then turns the site's fused op (already in the graph)
into ``weave.matmul_reduce_scatter_rmsnorm``: the op reads ``x`` and ``mat2`` itself, its ``[T, H]``
outputs are viewed back to the fused op's shapes, and the matmul and its views are erased.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch.fx import Graph, Node

from weavepass.compile.fx_args import arg_node, arguments, positional
from weavepass.compile.patterns.allreduce_rmsnorm import VIEWS, FusedAllReduceRMSNormSite, _set_fake_vals
from weavepass.compile.patterns.rmsnorm import LAYER_NORM, is_target, val
from weavepass.compile.reasons import Reason, ReasonCode
from weavepass.compile.where import module_path
from weavepass.ops import MATMUL_REDUCE_SCATTER_RMSNORM

aten = torch.ops.aten


@dataclass(frozen=True)
class RowParallelMatmul:
    """``mm(x, mat2) -> views -> partial``: the matmul whose output is a site's partial sum."""

    mm: Node
    views: tuple[Node, ...]
    """The views from ``mm`` to the all_reduce's input, in order (each read only by the next)."""

    @property
    def x(self) -> Node:
        """The rows ``[T, K]`` (this rank's slice of the hidden features)."""
        return _arg(self.mm, 0)

    @property
    def mat2(self) -> Node:
        """``[K, H]``: the transposed row-parallel weight, as ``aten.mm`` takes it."""
        return _arg(self.mm, 1)

    @property
    def partial(self) -> Node:
        return self.views[-1] if self.views else self.mm

    def absorb(self, graph: Graph, fused: Node) -> Node:
        """Replace ``fused`` (the site's ``weave.fused_allreduce_rmsnorm``, reading this partial
        through views) by ``weave.matmul_reduce_scatter_rmsnorm`` on ``x`` and ``mat2``; returns the
        new op. Its ``[T, H]`` outputs go through this matmul's views and the fused op's own (the
        ``views_to_add`` ``replace_with`` replayed) to the fused op's output shapes."""
        args = arguments(fused)
        partial_in = args["partial"]
        assert isinstance(partial_in, Node), fused
        own_views = _views_between(self.partial, partial_in)
        hidden = int(_val(self.mm).shape[-1])
        residual = args["residual"]
        new: list[Node] = []
        with graph.inserting_before(fused):
            if isinstance(residual, Node) and _val(residual).dim() != 2:
                residual = graph.call_function(aten.reshape.default, (residual, [-1, hidden]))
                new.append(residual)
            op = graph.call_function(MATMUL_REDUCE_SCATTER_RMSNORM, (
                self.x, self.mat2, residual, args["weight"], args["eps"], args["group_name"],
                args["out_dtype"], args["lowering"], args["workspace_tokens"]))
            new.append(op)
            outputs = {}
            for user in list(fused.users):
                index = user.args[1]
                assert user.target is operator.getitem and isinstance(index, int), user
                out = graph.call_function(operator.getitem, (op, index))
                new.append(out)
                for view in (*self.views, *own_views):  # (positional: a chained pass may give keywords)
                    view_args, view_kwargs = positional(view)
                    out = graph.call_function(view.target, (out, *view_args[1:]), view_kwargs)  # type: ignore[arg-type]
                    new.append(out)
                outputs[user] = out
        _set_fake_vals(new)
        for user, out in outputs.items():
            user.replace_all_uses_with(out)
            graph.erase_node(user)
        graph.erase_node(fused)
        for node in [*reversed(own_views), *reversed(self.views), self.mm]:
            if not node.users:
                graph.erase_node(node)
        return op


def find_row_parallel_matmul(site: FusedAllReduceRMSNormSite) -> RowParallelMatmul | Reason:
    """The matmul whose output ``site`` sums, or why there is none the lowering can replace.
    Reads the site as the finder matched it (it does not change the graph)."""
    module = _module(site)
    if site.inner is not None and site.inner.merged_sums:
        return Reason.of(ReasonCode.GEMM_EPILOGUE_MERGED_SUMS, module=module)
    if site.scale is not None:
        return Reason.of(ReasonCode.GEMM_EPILOGUE_SCALED, module=module, factor=site.scale.text)
    views: list[Node] = []
    node = site.partial
    while is_target(node, VIEWS):
        views.append(node)
        node = _arg(node, 0)
    if site.matmul is None or node is not site.matmul:
        return Reason.of(ReasonCode.GEMM_EPILOGUE_NO_MATMUL, module=module, producer=_describe(node))
    mm = site.matmul
    if mm.target is aten.addmm.default:
        return Reason.of(ReasonCode.GEMM_EPILOGUE_MATMUL_BIAS, module=module, matmul=mm.name)
    if mm.target is not aten.mm.default:
        return Reason.of(ReasonCode.GEMM_EPILOGUE_NOT_MM, module=module, matmul=mm.name, op=str(mm.target))
    shape = list(_val(mm).shape)
    if shape[-1] != site.hidden:
        return Reason.of(ReasonCode.GEMM_EPILOGUE_MATMUL_SHAPE, module=module, matmul=mm.name, shape=shape,
                         hidden=site.hidden)
    chain = [mm, *reversed(views)]
    for node, reader in zip(chain, [*chain[1:], site.all_reduce]):
        others = [user.name for user in node.users if user is not reader]
        if others:
            return Reason.of(ReasonCode.GEMM_EPILOGUE_MATMUL_READ, module=module, node=node.name,
                             readers=", ".join(others))
    return RowParallelMatmul(mm, tuple(chain[1:]))


def site_form_reason(site: FusedAllReduceRMSNormSite) -> Reason | None:
    """``GEMM_EPILOGUE_SITE_FORM`` when the op cannot stand in for the site's fused op (a LayerNorm,
    a training site, a quantized site), else None."""
    form = ("a LayerNorm site" if site.norm.kind == LAYER_NORM else
            "a training site (the norm's inverse RMS is saved for backward)" if site.training else
            f"quantized ({site.quant.label})" if site.quant is not None else None)
    return None if form is None else Reason.of(ReasonCode.GEMM_EPILOGUE_SITE_FORM, form=form)


def _module(site: FusedAllReduceRMSNormSite) -> str:
    """The module that produced the site's sum (the partial's producer, else the all_reduce's)."""
    node = site.partial
    while is_target(node, VIEWS) and not module_path(node):
        node = _arg(node, 0)
    return module_path(node) or module_path(site.all_reduce)


def _describe(node: Node) -> str:
    return f"{node.name} ({node.target})" if node.op == "call_function" else f"{node.name} (a graph input)"


def _views_between(start: Node, end: Node) -> list[Node]:
    """The views from ``start`` to ``end`` (``end`` reached from ``start`` through first arguments)."""
    views = []
    while end is not start:
        views.append(end)
        end = _arg(end, 0)
    return list(reversed(views))


def _arg(node: Node, index: int) -> Node:
    """``node``'s tensor argument at schema position ``index``, by the schema's name: a pass chained
    before weave's may give the matmul's or a view's operands by keyword (``mm(self=x, mat2=w)``)."""
    return arg_node(node, index)


def _val(node: Node) -> torch.Tensor:
    value = val(node)
    assert value is not None, node
    return value
