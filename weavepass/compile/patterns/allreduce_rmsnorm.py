"""Find ``[matmul] -> all_reduce(sum) -> [residual add] -> RMSNorm | LayerNorm`` sites in a post-grad graph.

``find_allreduce_rmsnorm_sites(graph)`` looks at every all_reduce and returns, for each, either a
``FusedAllReduceRMSNormSite`` (an immutable record of the nodes it matched, which knows how to
replace itself) or a ``RejectedAllReduce`` with the ``Reason`` it is left alone. Finding never
changes the graph. What is decided later (the lowering) lives in the plan, not in the match; the
rewrites that ready a site (``hoist_scale``, ``fold_inner_add``, ``prepare``) change the graph and
return a new match.

Shape-only views (``[B, S, H] <-> [B*S, H]``) between the steps are walked through and replayed on
the fused op's outputs, so they never hide a site.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass

import torch
from torch.fx import Graph, Node

from weavepass.compile.fx_args import arg_node, arguments
from weavepass.compile.patterns.quant import QuantLeftOutside, QuantMatch, find_quant
from weavepass.compile.patterns.quant import replace_outputs as replace_quant_outputs
from weavepass.compile.patterns.rmsnorm import (
    RMS_NORM,
    RMSNormMatch,
    add_alpha,
    is_target,
    match_rmsnorm,
    val,
)
from weavepass.compile.reasons import Reason, ReasonCode
from weavepass.compile.where import module_path
from weavepass.config import Lowering

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

ALL_REDUCES = {c10d.all_reduce.default, c10d.all_reduce_.default}
WAIT = c10d.wait_tensor.default
VIEWS = {
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.unsqueeze.default,
}
RESIDUAL_ADD = aten.add.Tensor
MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.matmul.default}


def _node(value: object) -> Node:
    """``value`` (an argument the match has checked is a node) as a ``Node``."""
    assert isinstance(value, Node), value
    return value


def _all_reduce_input(ar: Node) -> Node:
    """The tensor an all_reduce sums (``input``), read by its schema name: a graph may pass it by keyword."""
    return _node(arguments(ar)["input"])


def _group_name(ar: Node) -> str:
    """The group an all_reduce runs on (``group_name``), read by its schema name."""
    group_name = arguments(ar)["group_name"]
    assert isinstance(group_name, str)
    return group_name


def _tensor(node: object) -> torch.Tensor:
    """The fake tensor of a node the match has checked carries one."""
    value = val(node)
    assert value is not None, node
    return value


def _is_row_view(node: Node, source: Node) -> bool:
    """A view of ``source`` that keeps its last (hidden) dim and its element count."""
    if not is_target(node, VIEWS) or node.args[0] is not source:
        return False
    out, src = val(node), val(source)
    return out is not None and src is not None and out.shape[-1] == src.shape[-1]


def _find_norm(root: Node) -> tuple[list[Node], RMSNormMatch] | Reason:
    """The norm fed by ``root`` directly or through a chain of row views."""
    found = match_rmsnorm(root)
    if isinstance(found, RMSNormMatch):
        return [], found
    for user in root.users:
        if _is_row_view(user, root):
            deeper = _find_norm(user)
            if not isinstance(deeper, Reason):
                # A view shared with other users stays (it then reads the new residual).
                views, norm = deeper
                return [user, *views], norm
    return found


def _producer_matmul(node: Node) -> Node | None:
    while is_target(node, VIEWS):
        node = arg_node(node, 0)  # by name: a chained pass may give a view's input by keyword
    return node if is_target(node, MATMULS) else None


@dataclass(frozen=True)
class RejectedAllReduce:
    """An all_reduce the pass leaves alone, and why."""

    all_reduce: Node
    reason: Reason

    @property
    def code(self) -> ReasonCode:
        return self.reason.code


@dataclass(frozen=True)
class PartnerSum:
    """Another all_reduce's sum, added to this one's: ``partial -> all_reduce -> wait -> views``."""

    all_reduce: Node
    wait: Node
    views: tuple[Node, ...]
    """row views (and sums over leading dims: ``_is_expert_sum``; replicated scales: ``_scaled``)
    from the wait to the inner add, each read only by the next; replayed on the partial when the
    sums are merged"""

    @property
    def partial(self) -> Node:
        return _all_reduce_input(self.all_reduce)


@dataclass(frozen=True)
class SumTree:
    """The sum reaches the residual add through a tree of adds whose other leaves are bias rows
    (``[H]``: a row-parallel layer's replicated bias, added after its all_reduce), other all_reduce
    sums over the same group (each read only by the tree), and replicated values of the sum's shape,
    the outermost being the residual stream: ``(S + b) + r`` (StarCoder2), ``((S_m + b_m) + (S_a +
    b_a)) + r`` (GPT-NeoX's parallel residual), ``(S_a + (S_m + b_m)) + r`` (GPT-J, CodeGen),
    ``((S_a + b_a) + (S_m + b_m)) + r`` (Phi). ``_fold_tree`` makes it ``all_reduce(p + p_m + ...)
    + ((b + ...) + r)``."""

    adds: tuple[Node, ...]
    """every add of the tree in graph order; the last is the root, the value the norm reads"""
    own_views: tuple[Node, ...]
    """row views from this site's (scaled) sum to the first add, each read only by the next"""
    sums: tuple[PartnerSum, ...]
    extra_slots: tuple[tuple[Node, int], ...]
    """(add, argument index) of each bias row and each other replicated term of the sum's shape:
    read at use time, like ``stream_slot``"""
    stream_slot: tuple[Node, int]
    """(add, argument index) of the residual: an earlier site's rewrite replaces that node"""
    rows: int
    """how many of ``extra_slots`` (the first) are bias rows"""

    @property
    def extras(self) -> list[Node]:
        return [_node(add.args[i]) for add, i in self.extra_slots]

    @property
    def stream(self) -> Node:
        add, i = self.stream_slot
        return _node(add.args[i])

    @property
    def terms(self) -> list[Node]:
        return [self.stream, *self.extras]

    @property
    def kind(self) -> str:
        """What the fold does, for the report."""
        rows, full = self.extras[:self.rows], self.extras[self.rows:]
        text = (f"bias row(s) {', '.join(r.name for r in rows)} of the row-parallel layer(s) added "
                "to the residual instead of the sum (replicated; eager adds them to the sum first, so "
                "the rounding order differs)")
        if full:
            text += ", and " + ", ".join(x.name for x in full) + " as well"
        if self.sums:
            text = (f"summed with {', '.join(s.all_reduce.name for s in self.sums)}: one all_reduce of "
                    f"the partials' sum (parallel branches), {text}")
        return text


@dataclass(frozen=True)
class InnerAdd:
    """``sum + x`` between the reduced sum and the residual add (or the norm). MoE layers add the
    routed experts' sum to a replicated shared expert's output (Qwen2-MoE), or to the shared
    experts' own all_reduce sum (``partner``, DeepSeek-V3)."""

    add: Node
    views: tuple[Node, ...]
    """row views from the (scaled) sum to ``add``, each read only by the next"""
    other: Node
    """``add``'s operand that is not this all_reduce's sum"""
    partner: PartnerSum | None = None
    parallel: PartnerSum | None = None
    """Another all_reduce's sum that the residual add right after ``add`` adds: ``(S + x) + S_2``
    (Cohere's attention and MLP run in parallel on one input: ``x`` is the residual stream)."""
    tree: SumTree | None = None
    """Bias rows, or other sums with bias rows, in the adds up to the residual add (``SumTree``)."""

    @property
    def merged(self) -> PartnerSum | None:
        """The all_reduce whose sum this site's one collective carries, if any (a ``SumTree``: the
        first of its sums)."""
        if self.tree is not None:
            return self.tree.sums[0] if self.tree.sums else None
        return self.partner or self.parallel

    @property
    def merged_sums(self) -> list[PartnerSum]:
        """Every all_reduce whose sum this site's one collective carries."""
        if self.tree is not None:
            return list(self.tree.sums)
        return [self.merged] if self.merged is not None else []

    @property
    def kind(self) -> str:
        """What the fold does, for the report."""
        if self.tree is not None:
            return self.tree.kind
        other = self.other.name
        if self.partner is not None:
            scales = [_view_args(v)[0] for v in self.partner.views if is_target(v, SCALES)]
            scaled = "".join(f", its sum scaled by {f.name if isinstance(f, Node) else repr(f)} (replicated: moved "
                             "onto its partial)" for f in scales)
            return (f"summed with {self.partner.all_reduce.name} ({other}{scaled}): one all_reduce of the "
                    "partials' sum (eager rounds each sum, then their sum)")
        if self.parallel is not None:
            return (f"summed with {self.parallel.all_reduce.name}, which the next add adds (parallel "
                    f"branches: one all_reduce of the partials' sum, then + {other}; eager adds "
                    "each sum to the stream in turn)")
        text = (f"{other} added to the sum before the residual add: moved onto the residual "
                f"({other} + residual; eager adds it to the sum first, so the rounding order differs)")
        if DISTRIBUTED in self.add.meta:
            text = f"the scale of (sum + x) distributed over both terms (distribute_scales), {text}"
        return text


@dataclass(frozen=True)
class ScaledSum:
    """``sum * c`` between the wait and the add (or the norm), ``c`` a scalar known before the
    all_reduce: hoisted onto the partial by ``hoist_scale`` when the site is rewritten."""

    mul: Node
    factor: Node | int | float
    late_factor: bool
    """``c`` is computed after the all_reduce from values that exist before it (Gemma's constant
    ``full([], sqrt(H))``, MiniCPM3's ``embed_scale.to(dtype)`` of a buffer): moved up."""
    views: tuple[Node, ...] = ()
    """row views between the wait and ``mul`` (MiniMax: ``[T, H] -> [B, S, H]``, then ``* beta``),
    each read only by the next: after the hoist, the first of ``views_to_add``."""
    late_nodes: tuple[Node, ...] = ()
    """with ``late_factor``: the nodes after the all_reduce that compute ``c`` (``c`` last), in
    graph order: moved before the all_reduce."""

    @property
    def text(self) -> str:
        """``c`` for the report: the number, a 0-d constant's value, or the node's name."""
        factor = self.factor
        if not isinstance(factor, Node):
            return repr(factor)
        if is_target(factor, {aten.full.default}) and not factor.args[0]:  # a 0-d constant
            return repr(factor.args[1])
        return factor.name


@dataclass(frozen=True)
class FusedAllReduceRMSNormSite:
    """What the finder matched: ``partial -> all_reduce -> wait -> [* c] -> views -> [+ x] ->
    [add residual] -> views -> RMSNorm`` (or a LayerNorm: ``norm.kind``). Immutable: the plan
    (``planner.SitePlan``) holds what is decided about it, and ``prepare`` returns a new match."""

    all_reduce: Node
    wait: Node
    group_name: str
    views_to_add: tuple[Node, ...]
    add: Node | None
    views_to_norm: tuple[Node, ...]
    norm: RMSNormMatch
    matmul: Node | None
    scale: ScaledSum | None = None
    """``sum * c`` (``_scale_after_sum``); None once hoisted."""
    inner: InnerAdd | None = None
    """``sum + x`` before the residual add (or the norm) (``_match_inner_add``); None once folded."""
    late_inputs: tuple[Node, ...] = ()
    """Pure computations of earlier values that the op reads but the graph computes after its
    insertion point (``_late_inputs``), in the order ``prepare`` moves them up."""
    quant: QuantMatch | None = None
    """The quantization of the normed rows the fused op computes (``patterns.quant``), if any."""
    quant_left: QuantLeftOutside | None = None
    """A quantization of the normed rows that stays outside the fused op, and why."""

    @property
    def partial(self) -> Node:
        return _all_reduce_input(self.all_reduce)

    @property
    def residual(self) -> Node | None:
        """The residual stream's value ``r`` that this site's residual add adds (None: no residual
        add). It is the residual add's operand that is not the (scaled, merged) sum, also where
        ``x`` is added to the sum first (``shared``: after ``prepare``, the add's operand is the
        new ``x + r``, which the op then reads); for parallel branches ``(S + x) + S_2``, ``x``
        (the residual add's other operand is ``S_2``). Read from the graph at use time: an earlier
        rewrite may have replaced the residual node."""
        if self.add is None:
            return None
        if self.inner is not None and self.inner.tree is not None:
            return self.inner.tree.stream
        if self.inner is not None and self.inner.parallel is not None:
            return self.inner.other
        start = self.inner.add if self.inner is not None else self.scale.mul if self.scale else self.wait
        summed = self.views_to_add[-1] if self.views_to_add else start
        return _node(self.add.args[1] if self.add.args[0] is summed else self.add.args[0])

    @property
    def shared(self) -> Node | None:
        """Before ``prepare``: the replicated ``x`` of ``(S + x) + r`` (a shared expert's output),
        which ``fold_inner_add`` moves onto the residual; else None (also for the merged forms: a
        partner's sum added first, or parallel branches, where ``x`` is the stream itself)."""
        if self.inner is not None and self.inner.tree is not None:  # the bias rows (and other terms)
            return self.inner.tree.extras[0] if self.inner.tree.extras else None
        if self.add is None or self.inner is None or self.inner.merged is not None:
            return None
        return self.inner.other

    @property
    def dtype(self) -> torch.dtype:
        return _tensor(self.partial).dtype

    @property
    def device(self) -> torch.device:
        return _tensor(self.partial).device

    @property
    def hidden(self) -> int:
        return int(_tensor(self.partial).shape[-1])

    @property
    def kind(self) -> str:
        residual = "residual" if self.add is not None else "no-residual"
        scaled = f", sum scaled by {self.scale.text}" if self.scale is not None else ""
        inner = f", {self.inner.kind}" if self.inner is not None else ""
        weight = "" if self.norm.weight is None else f", weight {_tensor(self.norm.weight).dtype}"
        bias = "" if self.norm.bias is None else f", bias {_tensor(self.norm.bias).dtype}"
        quant = f" + {self.quant.label}" if self.quant is not None else ""
        left = f"; {self.quant_left.text}" if self.quant_left is not None else ""
        return (f"{residual}{scaled}{inner}, {self.norm.form}{weight}{bias}{quant}, sum {self.dtype}, "
                f"hidden {self.hidden}{left}")

    def without_quant(self, reason: Reason) -> FusedAllReduceRMSNormSite:
        """This site with its quantization left outside the fused op, for ``reason`` (a lowering or
        strategy that does not carry it); the site itself if it has none."""
        if self.quant is None:
            return self
        return dataclasses.replace(self, quant=None, quant_left=QuantLeftOutside(self.quant.label, reason))

    @property
    def stream(self) -> Node:
        """The node holding the new residual stream value: the add, else the (scaled, merged) sum."""
        if self.add is not None:
            return self.add
        if self.inner is not None:
            return self.inner.add
        return self.scale.mul if self.scale is not None else self.wait

    @property
    def training(self) -> bool:
        """The forward graph of a training compile saves this norm's inverse RMS for backward."""
        return self.norm.saved_inv_rms is not None

    def insertion_point(self) -> Node:
        """The fused op goes where the residual add (or the wait) was: all consumers follow. (A
        merged sum without a residual add: where the two sums were added; ``fold_inner_add`` puts
        the one wait there.)"""
        if self.add is None and self.inner is not None:
            return self.inner.add
        return self.add if self.add is not None else self.wait

    def inputs(self) -> list[Node]:
        """Nodes the fused op and its replayed views read (and, before ``fold_inner_add``, the
        nodes it reads)."""
        first = self.shared if self.shared is not None else self.residual
        if self.inner is not None and self.inner.parallel is not None:
            first = self.inner.other
        static_scale = self.quant.static_scale if self.quant is not None else None
        nodes = [n for n in (self.partial, first, self.norm.weight, self.norm.bias, static_scale)
                 if n is not None]
        views = [*self.views_to_add, *self.views_to_norm]
        if self.inner is not None and self.inner.tree is not None:
            tree = self.inner.tree
            nodes += [s.partial for s in tree.sums] + tree.terms
            views += [*tree.own_views, *(v for s in tree.sums for v in s.views)]
        elif self.inner is not None:
            nodes.append(self.inner.other)
            views += self.inner.views
            if self.inner.partner is not None:
                nodes.append(self.inner.partner.partial)
                views += self.inner.partner.views
            elif self.add is not None:
                nodes.append(_node(self.residual))
            if self.inner.parallel is not None:
                nodes.append(self.inner.parallel.partial)
                views += self.inner.parallel.views
        for view in views:
            torch.fx.node.map_arg(_view_args(view), nodes.append)
        return nodes

    def replace_with(self, graph: Graph, fused_op: torch._ops.OpOverload, lowering: Lowering,
                     workspace_tokens: int) -> Node:
        """Insert ``fused_op`` on ``lowering`` for this site and erase the nodes it replaces;
        returns the op node. ``workspace_tokens`` goes into the call (``weavepass.ops``: the CUDA
        workspace's capacity). A LayerNorm site's op takes the bias after the weight
        (``weave.fused_allreduce_layernorm``)."""
        site = prepare(self, graph)
        norm = site.norm
        with graph.inserting_before(site.insertion_point()):
            partial = _replay(graph, site.views_to_add if site.add is not None else (), site.partial)
            affine = (norm.weight,) if norm.kind == RMS_NORM else (norm.weight, norm.bias)
            quant = site.quant
            if quant is not None:  # weave.fused_allreduce_rmsnorm_quant
                args = (partial, site.residual, norm.weight, norm.eps, site.group_name, norm.out_dtype,
                        quant.static_scale, quant.group_size, quant.scale_steps, quant.code_steps,
                        quant.return_normed)
            else:
                args = (partial, site.residual, *affine, norm.eps, site.group_name, norm.out_dtype)
            fused = graph.call_function(fused_op, (*args, str(lowering), workspace_tokens))  # the schema takes the name
            residual_out = graph.call_function(operator.getitem, (fused, 2 if quant is not None else 1))
            new_nodes = [partial, fused, residual_out]
            normed_out = None  # (a quantized site's op returns no normed rows unless they are read)
            if quant is None or quant.return_normed:
                normed = graph.call_function(operator.getitem, (fused, 3 if quant is not None else 0))
                norm_views = site.views_to_norm
                if site.add is None:
                    norm_views = site.views_to_add + norm_views
                normed_out = _replay(graph, norm_views, normed)
                new_nodes += [normed, *_chain(normed, normed_out)]
            inv_rms = graph.call_function(operator.getitem, (fused, 2)) if site.training else None
        _set_fake_vals(new_nodes + ([inv_rms] if inv_rms is not None else []))

        if quant is not None:
            _set_fake_vals(replace_quant_outputs(quant, graph, fused))
        if normed_out is not None:
            norm.output.replace_all_uses_with(normed_out)
        if norm.saved_inv_rms is not None and inv_rms is not None:
            # the backward graph reads the op's inverse RMS where it read rsqrt
            norm.saved_inv_rms.replace_all_uses_with(inv_rms)
        _erase_dead([*reversed(norm.nodes), *reversed(site.views_to_norm)], graph)
        carried = site.add if site.add is not None else site.wait
        carried.replace_all_uses_with(residual_out)
        _erase_dead(
            [carried, *reversed(site.views_to_add), site.wait, site.all_reduce], graph
        )
        return fused


# ----------------------------------------------------------------------------------------------
# Readying a site for a rewrite: each step changes the graph and returns the new match.


def prepare(site: FusedAllReduceRMSNormSite, graph: Graph) -> FusedAllReduceRMSNormSite:
    """Ready the graph for a rewrite at ``insertion_point()`` (every strategy calls this): the
    scale moved onto the partial, the inner add folded, and the late inputs moved up. Returns the
    match of the readied graph (a plain site: no scale, no inner add, no late inputs)."""
    site = fold_inner_add(hoist_scale(site, graph), graph)
    for node in site.late_inputs:
        site.insertion_point().prepend(node)
    return dataclasses.replace(site, late_inputs=())


def hoist_scale(site: FusedAllReduceRMSNormSite, graph: Graph) -> FusedAllReduceRMSNormSite:
    """``all_reduce(p) * c -> all_reduce(p * c)``: equal in exact arithmetic; eager rounds
    ``S`` and then ``S * c``, here each rank rounds ``p_r * c`` once (in the partial's dtype)
    and the fused op sums in fp32. Returns the site without the scale: the wait holds the
    scaled sum."""
    if site.scale is None:
        return site
    mul, partial, factor = site.scale.mul, site.partial, site.scale.factor
    if site.scale.late_factor:
        assert isinstance(factor, Node)
        for node in site.scale.late_nodes or (factor,):
            site.all_reduce.prepend(node)
    assert callable(mul.target)  # the finder matched it as a call_function of a mul op
    with graph.inserting_before(site.all_reduce):
        scaled = graph.call_function(mul.target, (partial, factor))
    _set_fake_vals([scaled])
    site.all_reduce.replace_input_with(partial, scaled)
    summed = site.scale.views[-1] if site.scale.views else site.wait
    mul.replace_all_uses_with(summed)
    graph.erase_node(mul)
    norm = site.norm
    if norm.input is mul:  # a no-residual site's norm read the product
        norm = dataclasses.replace(norm, input=summed)
    if site.inner is not None and site.inner.tree is None:  # the views now lead to the inner add
        inner = dataclasses.replace(site.inner, views=site.scale.views + site.inner.views)
        return dataclasses.replace(site, scale=None, norm=norm, inner=inner)
    return dataclasses.replace(site, scale=None, norm=norm, views_to_add=site.scale.views + site.views_to_add)


def fold_inner_add(site: FusedAllReduceRMSNormSite, graph: Graph) -> FusedAllReduceRMSNormSite:
    """Fold ``sum + x`` (``inner``) away (after ``hoist_scale``); returns the plain site.

    * ``x`` another all_reduce's sum over the same group: ``all_reduce(a) + all_reduce(b) ->
      all_reduce(a + b)``, one collective fewer. Eager rounds each sum and then their sum;
      here each rank rounds ``a + b`` once (in the partial's dtype) and the op sums in fp32.
    * ``x`` replicated (a shared expert's output): ``(S + x) + r -> S + (x + r)``, the op's
      residual ``x + r`` computed before it. The same sum, rounded in another order: eager
      rounds ``S + x`` and then ``+ r``, here ``x + r`` and then ``S + (x + r)``.
    """
    assert site.scale is None, "hoist_scale first"
    inner = site.inner
    if inner is None:
        return site
    if inner.tree is not None:
        return _fold_tree(site, inner.tree, graph)
    if inner.partner is not None:
        return _merge_partner(site, inner, inner.partner, graph)
    if inner.parallel is not None:
        return _merge_parallel(site, inner, inner.parallel, graph)
    return _add_to_residual(site, inner, graph)


def _merge_partner(site: FusedAllReduceRMSNormSite, inner: InnerAdd, partner: PartnerSum,
                   graph: Graph) -> FusedAllReduceRMSNormSite:
    merged, wait = _one_all_reduce(site, inner, graph, inner.add, partner)
    inner.add.replace_all_uses_with(wait)
    _erase_dead([inner.add, *reversed(inner.views), site.wait, site.all_reduce,
                 *reversed(partner.views), partner.wait, partner.all_reduce], graph)
    norm = site.norm
    if norm.input is inner.add:  # no residual add: the norm read the merged sum
        norm = dataclasses.replace(norm, input=wait)
    return dataclasses.replace(site, all_reduce=merged, wait=wait, matmul=None, norm=norm, inner=None)


def _merge_parallel(site: FusedAllReduceRMSNormSite, inner: InnerAdd, parallel: PartnerSum,
                    graph: Graph) -> FusedAllReduceRMSNormSite:
    """``(S + x) + S_2 -> all_reduce(p + p_2) + x``: the residual add keeps its node (later
    sites read it as their residual) and now adds ``x`` to the merged sum."""
    add = _node(site.add)
    summed = inner.views[-1] if inner.views else site.wait
    x = inner.add.args[1] if inner.add.args[0] is summed else inner.add.args[0]
    merged, wait = _one_all_reduce(site, inner, graph, add, parallel)
    add.replace_input_with(parallel.views[-1] if parallel.views else parallel.wait, wait)
    add.replace_input_with(inner.add, _node(x))
    _erase_dead([inner.add, *reversed(inner.views), site.wait, site.all_reduce,
                 *reversed(parallel.views), parallel.wait, parallel.all_reduce], graph)
    return dataclasses.replace(site, all_reduce=merged, wait=wait, matmul=None, views_to_add=(),
                               inner=None)


def _one_all_reduce(site: FusedAllReduceRMSNormSite, inner: InnerAdd, graph: Graph, before: Node,
                    other: PartnerSum) -> tuple[Node, Node]:
    """``all_reduce(p + p_2)`` inserted before ``before``: this site's partial through the inner
    sum's views plus ``other``'s partial through its views; returns (all_reduce, wait)."""
    with graph.inserting_before(before):
        mine = _replay(graph, inner.views, site.partial)
        theirs = _replay(graph, other.views, other.partial)
        summed = graph.call_function(aten.add.Tensor, (mine, theirs))
        merged = graph.call_function(c10d.all_reduce.default, (summed, "sum", site.group_name))
        wait = graph.call_function(WAIT, (merged,))
    _set_fake_vals([*_chain(site.partial, mine), *_chain(other.partial, theirs), summed, merged, wait])
    return merged, wait


def _add_to_residual(site: FusedAllReduceRMSNormSite, inner: InnerAdd,
                     graph: Graph) -> FusedAllReduceRMSNormSite:
    add, x, residual = _node(site.add), inner.other, _node(site.residual)
    with graph.inserting_before(add):
        x_rows = _replay(graph, site.views_to_add, x)  # in the residual add's shape
        new_residual = graph.call_function(aten.add.Tensor, (x_rows, residual))
    _set_fake_vals([*_chain(x, x_rows), new_residual])
    summed = inner.views[-1] if inner.views else site.wait
    (site.views_to_add[0] if site.views_to_add else add).replace_input_with(inner.add, summed)
    add.replace_input_with(residual, new_residual)
    _erase_dead([inner.add], graph)
    return dataclasses.replace(site, views_to_add=inner.views + site.views_to_add, inner=None)


def _fold_tree(site: FusedAllReduceRMSNormSite, tree: SumTree, graph: Graph) -> FusedAllReduceRMSNormSite:
    """``SumTree``: the tree's adds become ``all_reduce(p + p_2 + ...) + ((b + ...) + r)``, one
    all_reduce of this site's and the merged sums' partials, then the bias rows (and other
    replicated terms) summed, added to the residual ``r``. The same terms as eager's, summed in
    another order (eager rounds each sum, adds its bias, then the branches and the residual)."""
    root = _node(site.add)
    stream, extras = tree.stream, tree.extras  # read now: an earlier rewrite may have replaced them
    own = site.views_to_add + tree.own_views  # (after ``hoist_scale``: the views before the scale)
    new: list[Node] = []
    merged = None
    with graph.inserting_before(root):
        if tree.sums:
            partial = _replay(graph, own, site.partial)
            new += _chain(site.partial, partial)
            for other in tree.sums:
                theirs = _replay(graph, other.views, other.partial)
                partial = graph.call_function(aten.add.Tensor, (partial, theirs))
                new += [*_chain(other.partial, theirs), partial]
            merged = graph.call_function(c10d.all_reduce.default, (partial, "sum", site.group_name))
            summed = graph.call_function(WAIT, (merged,))
            new += [merged, summed]
        else:
            summed = own[-1] if own else site.wait
        residual = stream
        if extras:
            x = extras[0]
            for term in extras[1:]:
                x = graph.call_function(aten.add.Tensor, (x, term))
                new.append(x)
            residual = graph.call_function(aten.add.Tensor, (x, stream))
            new.append(residual)
        add = graph.call_function(aten.add.Tensor, (summed, residual))
    _set_fake_vals([*new, add])
    root.replace_all_uses_with(add)
    norm = site.norm
    if norm.input is root:
        norm = dataclasses.replace(norm, input=add)
    dead = [root, *reversed(tree.adds[:-1])]
    if merged is not None:
        dead += [*reversed(own), site.wait, site.all_reduce]
        for other in tree.sums:
            dead += [*reversed(other.views), other.wait, other.all_reduce]
    _erase_dead(dead, graph)
    if merged is not None:
        return dataclasses.replace(site, all_reduce=merged, wait=summed, matmul=None, views_to_add=(),
                                   add=add, norm=norm, inner=None)
    return dataclasses.replace(site, views_to_add=own, add=add, norm=norm, inner=None)


def _replay(graph: Graph, views: tuple[Node, ...], node: Node) -> Node:
    """Apply the same chain of views to ``node`` (size arguments are reused as they are; a scale's
    factor, ``_scaled``, multiplies ``node`` from the right)."""
    for view in views:
        node = graph.call_function(view.target, (node, *_view_args(view)), dict(view.kwargs))  # type: ignore[arg-type]
    return node


def _view_args(view: Node) -> tuple[torch.fx.node.Argument, ...]:
    """The arguments of a chain step other than the value it reads: a view's sizes, a scale's factor."""
    if is_target(view, SCALES):
        chain = _scaled(view)
        assert chain is not None, view
        return tuple(a for a in view.args if a is not chain)
    return tuple(view.args[1:])


def _chain(start: Node, end: Node) -> list[Node]:
    nodes = []
    while end is not start:
        nodes.append(end)
        end = _node(end.args[0])
    return list(reversed(nodes))


def _set_fake_vals(nodes: list[Node]) -> None:
    """Give new nodes ``meta['val']`` by running them on the fake values of their inputs."""
    from torch._guards import detect_fake_mode

    for node in nodes:
        if "val" in node.meta:
            continue
        args, kwargs = torch.fx.node.map_arg(
            (node.args, node.kwargs), lambda n: n.meta["val"]
        )
        mode = detect_fake_mode([a for a in torch.utils._pytree.tree_leaves(args)
                                 if isinstance(a, torch.Tensor)])
        assert callable(node.target)
        if mode is None:
            node.meta["val"] = node.target(*args, **kwargs)
        else:
            with mode:
                node.meta["val"] = node.target(*args, **kwargs)


def _erase_dead(nodes: list[Node], graph: Graph) -> None:
    for node in dict.fromkeys(nodes):  # ordered, without repeats
        if not node.users:
            graph.erase_node(node)


# ----------------------------------------------------------------------------------------------
# Matching


def _match_one(ar: Node, order: dict[Node, int]) -> FusedAllReduceRMSNormSite | RejectedAllReduce:
    unfit = _unfit_all_reduce(ar)
    if unfit is not None:
        return RejectedAllReduce(ar, unfit)
    wait = next(iter(ar.users))
    scale = _scale_after_sum(ar, wait, order)
    summed = scale.mul if scale is not None else wait

    tree = _match_sum_tree(ar, wait, summed, scale, order)
    if isinstance(tree, FusedAllReduceRMSNormSite):  # bias rows: no other reading fuses them
        return tree
    found = _match_readings(ar, wait, scale, summed, order)
    if isinstance(found, FusedAllReduceRMSNormSite):
        return found
    # Bias rows on the sum stop the other readings at the bias (a broadcast): the tree's reason
    # says what stopped it.
    return tree or _post_norm_sum(ar, summed) or found


def _post_norm_sum(ar: Node, summed: Node) -> RejectedAllReduce | None:
    """The rejection of a post-norm model's first sum, in its terms, or None: linear layers read the
    sum (through views) as their input, without a norm, and its other readers are adds that no norm
    reads either, as a post-norm model's first layer reads the embedding (OLMo2/3 and Exaone4 norm
    each branch's output before adding it to the stream)."""
    layers = []
    for user in summed.users:
        prev, node = summed, user
        while is_target(node, VIEWS) and len(node.users) == 1:
            prev, node = node, next(iter(node.users))
        if is_target(node, MATMULS) and _weight_operand(node) is not prev:  # the layer's input, not its weight
            layers.append(node)
        elif not is_target(node, {RESIDUAL_ADD}) or not isinstance(_find_norm(node), Reason):
            return None
    if not layers:
        return None
    return RejectedAllReduce(ar, Reason.of(ReasonCode.POST_NORM_SUM, layer=module_path(layers[0]) or layers[0].name))


def _weight_operand(matmul: Node) -> object:
    """The right-hand operand (a linear layer's weight) of a call of ``MATMULS``, by its schema
    name (``mat2``; ``other`` of ``aten.matmul``): a chained pass may give it by keyword."""
    return arguments(matmul)["other" if matmul.target is aten.matmul.default else "mat2"]


def _match_readings(ar: Node, wait: Node, scale: ScaledSum | None, summed: Node,
                    order: dict[Node, int]) -> FusedAllReduceRMSNormSite | RejectedAllReduce:
    """The readings without bias rows: ``sum [+ x] [+ residual] -> norm`` (``InnerAdd``)."""
    group_name, partial = _group_name(ar), _all_reduce_input(ar)
    inner = _match_inner_add(ar, summed)
    if inner is not None and inner.partner is not None:  # before reading x as a residual
        return _inner_site(ar, wait, scale, inner, order)
    found = _match_after_sum(summed)
    if isinstance(found, Reason):
        if inner is not None:
            return _inner_site(ar, wait, scale, inner, order, found)
        return RejectedAllReduce(ar, found)
    views_to_add, add, views_to_norm, norm = found
    site = FusedAllReduceRMSNormSite(
        ar, wait, group_name, views_to_add, add, views_to_norm, norm, _producer_matmul(partial), scale
    )
    return _checked(site, order)


def _match_sum_tree(ar: Node, wait: Node, summed: Node, scale: ScaledSum | None,
                    order: dict[Node, int]) -> FusedAllReduceRMSNormSite | RejectedAllReduce | None:
    """The site of ``SumTree``, a rejection when such a tree (one with bias rows) cannot be fused,
    or None when the sum's adds hold no bias row (the other readings apply).

    From the sum on, each add must be the only reader of the value before it; the tree's other
    operands are walked down through adds that hold another all_reduce's sum."""
    own_views, cur = _exclusive_views(summed)
    shape, dtype = _tensor(cur).shape, _tensor(cur).dtype
    adds: list[Node] = []
    sums: list[PartnerSum] = []
    rows: list[tuple[Node, int]] = []
    full: list[tuple[Node, int]] = []
    norm: tuple[list[Node], RMSNormMatch] | Reason = Reason(ReasonCode.NO_NORM_AFTER_BIAS)
    while True:
        add = next(iter(cur.users)) if len(cur.users) == 1 else None
        if add is None or not _plain_add(add, shape, dtype):
            break
        index = 1 if add.args[0] is cur else 0
        unfit = _tree_leaves(add, index, ar, shape, dtype, adds, sums, rows, full)
        if unfit is not None:
            return RejectedAllReduce(ar, unfit) if rows else None
        adds.append(add)
        norm = _find_norm(add)
        if not isinstance(norm, Reason):
            break
        cur = add
    if not rows:
        return None
    bias = _node(rows[0][0].args[rows[0][1]]).name
    if not adds or isinstance(norm, Reason):
        return RejectedAllReduce(ar, Reason.of(ReasonCode.BIAS_NO_NORM, bias=bias))
    if not full:
        return RejectedAllReduce(ar, Reason.of(ReasonCode.BIAS_NO_RESIDUAL, bias=bias))
    views_to_norm, match = norm
    adds.sort(key=order.__getitem__)
    tree = SumTree(tuple(adds), tuple(own_views), tuple(sums), tuple(rows + full[:-1]), full[-1], len(rows))
    site = FusedAllReduceRMSNormSite(ar, wait, _group_name(ar), (), adds[-1], tuple(views_to_norm), match,
                                     None if sums else _producer_matmul(_all_reduce_input(ar)), scale,
                                     InnerAdd(adds[0], tuple(own_views), tree.stream, tree=tree))
    return _checked(site, order)


def _plain_add(add: Node, shape: torch.Size, dtype: torch.dtype) -> bool:
    """``add`` is ``a + b`` (alpha 1) of two tensors, producing ``shape`` and ``dtype``."""
    if not is_target(add, {RESIDUAL_ADD}) or add_alpha(add) != 1 or len(add.args) != 2:
        return False
    out = val(add)
    return (all(isinstance(a, Node) for a in add.args) and out is not None
            and out.shape == shape and out.dtype == dtype)


def _holds_sum(node: Node, ar: Node) -> bool:
    """``node`` is another all_reduce's sum, or an add (read only once) of values that hold one."""
    if _partner_sum(node, ar) is not None:
        return True
    return (is_target(node, {RESIDUAL_ADD}) and len(node.users) == 1
            and any(isinstance(a, Node) and _holds_sum(a, ar) for a in node.args))


def _tree_leaves(add: Node, index: int, ar: Node, shape: torch.Size, dtype: torch.dtype, adds: list[Node],
                 sums: list[PartnerSum], rows: list[tuple[Node, int]],
                 full: list[tuple[Node, int]]) -> Reason | None:
    """Sort ``add.args[index]`` into ``sums`` (another all_reduce's sum), ``rows`` (a bias row
    ``[H]`` broadcast over the tokens) or ``full`` (a value of the sum's shape), walking down adds
    that hold a sum (into ``adds``); why not, or None."""
    node = _node(add.args[index])
    partner = _partner_sum(node, ar)
    if isinstance(partner, PartnerSum):
        sums.append(partner)
        return None
    if isinstance(partner, Reason):
        return Reason.of(ReasonCode.PARTNER_UNFIT, cause=partner)
    if _plain_add(node, shape, dtype) and len(node.users) == 1 and _holds_sum(node, ar):
        adds.append(node)
        for i in (0, 1):
            unfit = _tree_leaves(node, i, ar, shape, dtype, adds, sums, rows, full)
            if unfit is not None:
                return unfit
        return None
    v = val(node)
    if v is None or v.dtype != dtype:
        return Reason.of(ReasonCode.BIAS_TREE_DTYPE, node=node.name, dtype=None if v is None else v.dtype,
                         expected=dtype)
    if v.shape == shape:
        full.append((add, index))
    elif v.dim() == 1 and v.shape[-1] == shape[-1]:  # ``[H]``, as Linear's bias
        rows.append((add, index))
    else:
        return Reason.of(ReasonCode.BIAS_TREE_BROADCAST, node=node.name, shape=tuple(v.shape),
                         sum_shape=tuple(shape))
    return None


def _is_expert_sum(node: Node) -> bool:
    """``x.sum(dims)`` over leading dims only (not the hidden one), keepdim False, no dtype: Llama4
    sums its routed experts' rows ``[E, T, H] -> [T, H]`` after their all_reduce. It is linear, so
    it moves onto the partial (``_replay``): ``all_reduce(p).view(E, T, H).sum(0) ==
    all_reduce(p.view(E, T, H).sum(0))``, each rank summing its experts before the collective."""
    if not is_target(node, {aten.sum.dim_IntList}) or not node.args:  # (the chain reads its input at 0)
        return False
    given = arguments(node)  # by name: dim, keepdim and dtype may be keywords
    src, out = val(node.args[0]), val(node)
    if src is None or out is None or given["keepdim"] or given["dtype"] is not None:
        return False
    dims = given["dim"]
    return (isinstance(dims, (list, tuple)) and bool(dims)
            and all(isinstance(d, int) and d % src.dim() != src.dim() - 1 for d in dims)
            and out.shape[-1] == src.shape[-1])


def _scaled(node: Node) -> Node | None:
    """For ``node = g * x`` with ``x`` an all_reduce's sum (through row views, sums over experts and
    such scales, each read only by the next) and ``g`` anything else that broadcasts onto ``x``
    without changing its shape or dtype (a number, a per-token gate ``[T, 1]``): ``x``; else None.
    Qwen3-Next gates its shared expert's sum by ``sigmoid(gate(h))``. ``g`` is replicated like the
    residual (it is computed from the stream: ``_rank_local_input`` checks it is not computed from
    a merged partial), so ``g * all_reduce(p) == all_reduce(g * p)``."""
    if not is_target(node, SCALES) or len(node.args) != 2 or node.kwargs:
        return None
    chains = [a for a in node.args if isinstance(a, Node) and _reaches_sum(a)]
    if len(chains) != 1:  # (a product of two sums is not linear in either)
        return None
    (chain,) = chains
    factor = node.args[1] if node.args[0] is chain else node.args[0]
    out, src = val(node), val(chain)
    if isinstance(factor, bool) or not isinstance(factor, (Node, int, float)) or out is None or src is None:
        return None
    fv = val(factor) if isinstance(factor, Node) else None
    if isinstance(factor, Node) and (fv is None or fv.dtype != src.dtype):
        return None
    return chain if out.shape == src.shape and out.dtype == src.dtype else None


def _reaches_sum(node: Node) -> bool:
    """``node`` is an all_reduce's wait, or a row view, sum over experts or scale (``_scaled``) of
    one, each read only by the next."""
    while len(node.users) == 1:
        if is_target(node, {WAIT}):
            return is_target(node.args[0], ALL_REDUCES)
        if is_target(node, VIEWS) and _is_row_view(node, _node(node.args[0])) or _is_expert_sum(node):
            node = _node(node.args[0])
        elif (scaled := _scaled(node)) is not None:
            node = scaled
        else:
            return False
    return False


def _unfit_all_reduce(ar: Node) -> Reason | None:
    """Why ``ar`` is not a row-parallel sum read through one wait, or None."""
    reduce_op = str(arguments(ar)["reduce_op"]).lower()
    if reduce_op != "sum":
        return Reason.of(ReasonCode.REDUCE_OP_NOT_SUM, op=reduce_op)
    partial = _all_reduce_input(ar)
    if val(partial) is None:
        return Reason.of(ReasonCode.INPUT_NO_METADATA, node=partial.name)
    if ar.target is c10d.all_reduce_.default and len(partial.users) > 1:
        return Reason(ReasonCode.IN_PLACE_INPUT_READ)
    if len(ar.users) != 1 or next(iter(ar.users)).target is not WAIT:
        return Reason(ReasonCode.NOT_ONE_WAIT)
    return None


AfterSum = tuple[tuple[Node, ...], Node | None, tuple[Node, ...], RMSNormMatch]
"""``(views_to_add, add, views_to_norm, norm)``"""


def _match_after_sum(summed: Node) -> AfterSum | Reason:
    """From the (scaled, merged) sum on: ``views -> [add residual] -> views -> RMSNorm``, as
    ``(views_to_add, add, views_to_norm, norm)``, or why not."""
    # Without a residual: the reduced sum itself is normalised (and may be used elsewhere).
    found = _find_norm(summed)
    if not isinstance(found, Reason):
        views_to_norm, norm = found
        return (), None, tuple(views_to_norm), norm
    no_norm_reason = found

    # With a residual: sum -> (exclusive views) -> add(x, residual) -> views -> norm.
    views_to_add, cur = _exclusive_views(summed)
    for add in [u for u in cur.users if is_target(u, {RESIDUAL_ADD})]:
        unfit = _unfit_residual_add(add, cur)
        if unfit is not None:
            no_norm_reason = Reason.of(ReasonCode.RESIDUAL_ADD_UNFIT, add=add.name, cause=unfit)
            continue
        residual = _node(add.args[1] if add.args[0] is cur else add.args[0])
        found = _find_norm(add)
        if isinstance(found, Reason):
            # a residual or not: unknown here
            no_norm_reason = Reason.of(ReasonCode.AFTER_ADD, added=residual.name, cause=found)
            continue
        if len(cur.users) != 1:
            readers = tuple(_reader(u) for u in cur.users if u is not add)
            return Reason.of(ReasonCode.SUM_OTHER_READERS, readers=readers)
        views_to_norm, norm = found
        return tuple(views_to_add), add, tuple(views_to_norm), norm
    return no_norm_reason


def _reader(node: Node) -> tuple[str, str]:
    """A reader of the sum, for a reason: its name, and the graph input it writes the sum back into
    (an in-place all_reduce of, or a ``copy_`` into, an input), else ``""``."""
    target = node.args[0] if node.args else None
    if is_target(node, {aten.copy_.default}) and isinstance(target, Node) and target.op == "placeholder":
        return node.name, target.name
    return node.name, ""


def _exclusive_views(node: Node) -> tuple[list[Node], Node]:
    """The chain of row views from ``node`` in which each is its input's only user, and its end."""
    views = []
    while len(node.users) == 1 and _is_row_view(next(iter(node.users)), node):
        node = next(iter(node.users))
        views.append(node)
    return views, node


def _match_inner_add(ar: Node, summed: Node) -> InnerAdd | None:
    """``sum -> views -> add(sum, x)``, the sum's only reader a plain add of its shape and dtype,
    with ``x`` another all_reduce's sum that can share this one's collective (``partner``) or
    anything else (a candidate shared-expert output, checked by ``_inner_site``). The add is the
    sum's only reader, so ``x`` cannot depend on the sum."""
    views, cur = _exclusive_views(summed)
    add = next(iter(cur.users), None)
    if add is None or len(cur.users) != 1 or not is_target(add, {RESIDUAL_ADD}) \
            or _unfit_residual_add(add, cur):
        return None
    other = _node(add.args[1] if add.args[0] is cur else add.args[0])
    partner = _partner_sum(other, ar)
    return InnerAdd(add, tuple(views), other, partner if isinstance(partner, PartnerSum) else None)


def _partner_sum(x: Node, ar: Node) -> PartnerSum | Reason | None:
    """``x`` as another all_reduce's sum read only by the add (through row views) that can be
    merged into ``ar``'s collective; a reason when it is such a sum but cannot be; else None."""
    views = []
    while len(x.users) == 1:
        if is_target(x, VIEWS) and _is_row_view(x, _node(x.args[0])) or _is_expert_sum(x):
            views.append(x)
            x = _node(x.args[0])
        elif (scaled := _scaled(x)) is not None:
            views.append(x)
            x = scaled
        else:
            break
    if not is_target(x, {WAIT}) or len(x.users) != 1 or not is_target(x.args[0], ALL_REDUCES):
        return None
    other = _node(x.args[0])
    unfit = _unfit_all_reduce(other)
    if unfit is not None:
        return Reason.of(ReasonCode.PARTNER_NOT_A_SUM, partner=other.name, cause=unfit)
    if _group_name(other) != _group_name(ar):
        return Reason.of(ReasonCode.PARTNER_OTHER_GROUP, partner=other.name, group=_group_name(other),
                         expected=_group_name(ar))
    dtype, expected = _tensor(_all_reduce_input(other)).dtype, _tensor(_all_reduce_input(ar)).dtype
    if dtype != expected:
        return Reason.of(ReasonCode.PARTNER_OTHER_DTYPE, partner=other.name, dtype=dtype, expected=expected)
    return PartnerSum(other, x, tuple(reversed(views)))


def _inner_site(ar: Node, wait: Node, scale: ScaledSum | None, inner: InnerAdd, order: dict[Node, int],
                plain_reason: Reason | None = None) -> FusedAllReduceRMSNormSite | RejectedAllReduce:
    """The site ``sum + x -> [add residual] -> RMSNorm`` (``InnerAdd``), or why not.

    ``plain_reason`` is why the plain reading (``x`` as the residual) failed (None for a partner's
    sum, which is read this way first); the reason given carries it when this reading fails too.
    """
    found = _match_after_sum(inner.add)
    if isinstance(found, Reason):
        if inner.partner is not None:
            return RejectedAllReduce(ar, Reason.of(ReasonCode.AFTER_PARTNER_ADD, added=inner.other.name,
                                                   partner=inner.partner.all_reduce.name, cause=found))
        assert plain_reason is not None
        return RejectedAllReduce(ar, Reason.of(ReasonCode.BOTH_READINGS_FAIL, plain=plain_reason,
                                               folded=found))
    views_to_add, add, views_to_norm, norm = found
    if inner.partner is None:  # (``sum + x -> norm`` without a residual add is the plain site)
        partner = _partner_sum(inner.other, ar)
        if isinstance(partner, Reason):
            return RejectedAllReduce(ar, Reason.of(ReasonCode.PARTNER_UNFIT, cause=partner))
        if add is not None:
            inner = dataclasses.replace(inner, parallel=_parallel_sum(add, views_to_add, inner.add, ar))
    site = FusedAllReduceRMSNormSite(ar, wait, _group_name(ar), views_to_add, add, views_to_norm, norm,
                                     None if inner.merged else _producer_matmul(_all_reduce_input(ar)),
                                     scale, inner)
    return _checked(site, order)


def _parallel_sum(add: Node, views_to_add: tuple[Node, ...], inner_add: Node, ar: Node) -> PartnerSum | None:
    """The residual add ``add = (S + x) + S_2`` right after ``inner_add = S + x`` (no views between),
    with ``S_2`` another all_reduce's sum that can share ``ar``'s collective, as a ``PartnerSum``;
    else None (``S_2`` is then an ordinary residual)."""
    if views_to_add:
        return None
    residual = _node(add.args[1] if add.args[0] is inner_add else add.args[0])
    partner = _partner_sum(residual, ar)
    return partner if isinstance(partner, PartnerSum) else None


def _unfit_residual_add(add: Node, summed: Node) -> Reason | None:
    """Why ``add`` is not ``summed + residual`` exactly as the fused op computes it, or None.

    The op computes ``round(dtype, S + R)`` with ``R`` of ``S``'s shape and dtype, so the add may
    not scale an operand (``alpha``), broadcast, or promote; either operand order is fine.
    """
    if add.args[0] is summed and add.args[1] is summed:
        return Reason(ReasonCode.ADDS_SUM_TO_ITSELF)
    alpha = add_alpha(add)
    if alpha != 1:
        scaled = "the reduced sum" if add.args[1] is summed else "the residual"
        return Reason.of(ReasonCode.ADD_ALPHA, alpha=alpha, operand=scaled)
    residual = add.args[1] if add.args[0] is summed else add.args[0]
    rv, sv, av = val(residual), _tensor(summed), _tensor(add)
    if rv is None:
        return Reason.of(ReasonCode.RESIDUAL_NOT_TENSOR, residual=repr(residual))
    if rv.shape != sv.shape:
        return Reason.of(ReasonCode.RESIDUAL_BROADCAST, shape=tuple(rv.shape), sum_shape=tuple(sv.shape))
    if not rv.dtype == sv.dtype == av.dtype:
        return Reason.of(ReasonCode.RESIDUAL_DTYPE, sum_dtype=sv.dtype, dtype=rv.dtype, out_dtype=av.dtype)
    return None


SCALES = {aten.mul.Tensor, aten.mul.Scalar}


def _scale_after_sum(ar: Node, wait: Node, order: dict[Node, int]) -> ScaledSum | None:
    """``wait * c``, the sum's only reader, for a scalar ``c`` that exists before the all_reduce
    (a number, or a one-element tensor such as Gemma's ``sqrt(hidden)``): Granite's residual and
    embedding multipliers, Gemma's embedding scale. The all_reduce is linear, so
    ``all_reduce(p) * c == all_reduce(p * c)``, and the site is matched from the product. Also
    after row views of the sum (MiniMax's ``h.reshape(B, S, H) * beta``: ``ScaledSum.views``)."""
    views, end = _exclusive_views(wait)
    if len(end.users) != 1:
        return None
    mul = next(iter(end.users))
    if not is_target(mul, SCALES) or len(mul.args) != 2 or mul.kwargs:
        return None
    factor = mul.args[1] if mul.args[0] is end else mul.args[0]
    late = False
    late_nodes: list[Node] = []
    if isinstance(factor, Node):
        fv = val(factor)
        # After the all_reduce only as a pure computation of earlier values (Gemma's constant
        # ``full([], sqrt(H))``, MiniCPM3's ``embed_scale.to(dtype)``): it moves up.
        late = order[factor] > order[ar]
        if fv is None or fv.numel() != 1 or (late and not _movable_above(factor, ar, order, late_nodes)):
            return None
    elif isinstance(factor, bool) or not isinstance(factor, (int, float)):
        return None
    mv, wv = val(mul), val(end)
    if mv is None or wv is None or mv.shape != wv.shape or mv.dtype != wv.dtype:
        return None
    late_nodes.sort(key=order.__getitem__)
    return ScaledSum(mul, factor, late, tuple(views), tuple(late_nodes))


def _movable_above(node: Node, ar: Node, order: dict[Node, int], moved: list[Node]) -> bool:
    """``node`` (after ``ar``) and what it reads after ``ar`` are computations of values that
    exist before ``ar`` (no collective, wait or in-place op among them): collected into ``moved``."""
    if order[node] < order[ar] or node in moved:
        return True
    target = node.target
    if node.op != "call_function" or is_target(node, ALL_REDUCES | {WAIT}) \
            or (isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable):
        return False
    moved.append(node)
    return all(_movable_above(arg, ar, order, moved) for arg in node.all_input_nodes)


def _checked(site: FusedAllReduceRMSNormSite,
             order: dict[Node, int]) -> FusedAllReduceRMSNormSite | RejectedAllReduce:
    """``site`` with its late inputs (``_late_inputs``), if its values may be the same on every
    rank (``_rank_local_input``) and its inputs exist where the op goes; else why not."""
    reason = _rank_local_input(site) or _unfit_saved_inv_rms(site)
    late = _late_inputs(site, order) if reason is None else reason
    if isinstance(late, Reason):
        return RejectedAllReduce(site.all_reduce, late)
    return dataclasses.replace(site, late_inputs=tuple(late))


def _rank_local_input(site: FusedAllReduceRMSNormSite) -> Reason | None:
    """Why ``site`` reads a value that differs between ranks where the fused op needs it the same
    on every rank (``weavepass.report.REPLICATED_ASSUMPTION``), or None: the residual, a value added
    to the sum, the norm's weight or bias computed from the site's own partial sum (not through a
    collective). Each rank would normalise its rows with another rank's copy. So may the factor of
    a scaled sum not: ``all_reduce(p) * c`` is ``all_reduce(p * c)`` only for one ``c`` on every rank."""
    partials = [site.partial] + ([s.partial for s in site.inner.merged_sums] if site.inner is not None else [])
    local = set()
    for node in partials:
        local.add(node)
        while is_target(node, VIEWS):
            node = arg_node(node, 0)
            local.add(node)
    inner = site.inner.other if site.inner is not None else None
    factor = site.scale.factor if site.scale is not None else None
    terms = site.inner.tree.terms if site.inner is not None and site.inner.tree is not None else []
    for start in (site.residual, inner, site.norm.weight, site.norm.bias, factor, *terms):
        stack: list[Node] = [start] if isinstance(start, Node) else []
        seen: set[Node] = set()
        while stack:
            node = stack.pop()
            if node in local:
                assert isinstance(start, Node)
                return Reason.of(ReasonCode.RANK_LOCAL_INPUT, input=start.name, partial=node.name)
            if node not in seen and not is_target(node, ALL_REDUCES):  # a sum is the same everywhere
                seen.add(node)
                stack.extend(node.all_input_nodes)
    return None


def _late_inputs(site: FusedAllReduceRMSNormSite, order: dict[Node, int]) -> list[Node] | Reason:
    """Inputs computed after the fused op's insertion point, in the order to move them up.

    A weight cast to fp32 (``w.float()``) often sits after the residual add; such pure
    computations of earlier values are moved before the fused op. Anything that depends on the
    site's own nodes cannot be, and the site is rejected.
    """
    point = order[site.insertion_point()]
    moved: list[Node] = []

    def visit(node: Node) -> Reason | None:
        if order.get(node, -1) < point or node in moved:
            return None
        if node.op != "call_function" or is_target(node, ALL_REDUCES | {WAIT}) \
                or node in (site.add, site.inner.add if site.inner is not None else None):
            return Reason.of(ReasonCode.LATE_INPUT, node=node.name, point=site.insertion_point().name)
        for arg in node.all_input_nodes:
            reason = visit(arg)
            if reason is not None:
                return reason
        moved.append(node)
        return None

    for node in site.inputs():
        reason = visit(node)
        if reason is not None:
            return reason
    return moved


def _unfit_saved_inv_rms(site: FusedAllReduceRMSNormSite) -> Reason | None:
    """A saved inverse RMS must have the shape the op returns (the op's input rows, one column)."""
    saved = site.norm.saved_inv_rms
    if saved is None:
        return None
    shape = list(_tensor(saved).shape)
    rows = list(_tensor(site.stream).shape[:-1])
    if shape != [*rows, 1]:
        return Reason.of(ReasonCode.SAVED_INV_RMS_SHAPE, node=saved.name, shape=shape, expected=[*rows, 1])
    return None


READ_BACKS = {
    aten.slice.Tensor: (aten.slice_scatter.default, (("dim", 0), ("start", None), ("end", None), ("step", 1))),
    aten.select.int: (aten.select_scatter.default, (("dim", None), ("index", None))),
}
"""A read of part of a tensor -> the op that writes that part, and the arguments naming the part."""


def _part(node: Node, first: int, params: tuple[tuple[str, object], ...]) -> tuple[object, ...]:
    """The part a read (``first=1``) or a write (``first=2``) names, defaults filled in."""
    args = node.args[first:]
    return tuple(args[i] if i < len(args) else node.kwargs.get(name, default)
                 for i, (name, default) in enumerate(params))


def fold_sums_read_back(graph: Graph) -> None:
    """``slice(slice_scatter(buf, S, part), part) -> S`` (and ``select`` / ``select_scatter``) for
    a reduced sum ``S``.

    An in-place all_reduce on part of a buffer (``dist.all_reduce(buf[:T])``, ``buf[i]``),
    functionalised, writes the sum into a copy of the buffer and reads the same part back: the
    read is the sum itself, and would otherwise stand between the sum and its residual add. Only
    the read is replaced; a buffer copy that something else reads keeps the sum, and is then
    another user of it (the site is kept, and says so). Run before finding sites."""
    for read in list(graph.nodes):
        if read.op != "call_function" or read.target not in READ_BACKS:
            continue
        write_op, params = READ_BACKS[read.target]
        write = read.args[0]
        if not is_target(write, {write_op}) or len(write.args) < 2:
            continue
        summed = write.args[1]
        if not (is_target(summed, {WAIT}) and is_target(summed.args[0], ALL_REDUCES)):
            continue
        rv, sv = val(read), val(summed)
        if (_part(read, 1, params) != _part(write, 2, params) or rv is None or sv is None
                or rv.shape != sv.shape or rv.dtype != sv.dtype):
            continue
        read.replace_all_uses_with(summed)
        graph.erase_node(read)
        _erase_dead([write], graph)


DISTRIBUTED = "weave_distributed_scale"
"""``meta`` key of the add ``distribute_scales`` makes (the report says the scale was distributed)."""


def distribute_scales(graph: Graph) -> None:
    """``(S + x) * c -> S * c + x * c`` where ``S`` is an all_reduce's sum (through row views) and
    the product reaches a norm, directly or through one more add, and ``c`` is a scalar (a number
    or a one-element tensor): GraniteMoeHybrid scales the MoE
    block's output, the experts' sum plus the replicated shared MLP's, by ``residual_multiplier``
    before adding it to the stream. The scale then reads the sum alone (``ScaledSum``, hoisted
    onto the partial) and ``x * c`` is added to the scaled sum (``InnerAdd``: moved onto the
    residual). Equal in exact arithmetic: eager rounds ``S + x`` and then the product, here each
    product and then their sum. ``c`` must not change either term's shape or dtype. Run before
    finding sites."""
    for mul in list(graph.nodes):
        if not is_target(mul, SCALES) or len(mul.args) != 2 or mul.kwargs:
            continue
        add = next((a for a in mul.args if isinstance(a, Node) and is_target(a, {RESIDUAL_ADD})), None)
        if add is None or len(add.users) != 1 or add_alpha(add) != 1 or len(add.args) != 2 or add.kwargs:
            continue
        factor = mul.args[1] if mul.args[0] is add else mul.args[0]
        terms = [a for a in add.args if isinstance(a, Node)]
        out = val(mul)
        if len(terms) != 2 or out is None or isinstance(factor, bool) or not any(_reaches_sum(t) for t in terms):
            continue
        if isinstance(factor, Node):  # a one-element tensor, as ``_scale_after_sum`` hoists
            fv = val(factor)
            if fv is None or fv.dtype != out.dtype or fv.numel() != 1 or _reaches_sum(factor):
                continue
        elif not isinstance(factor, (int, float)):
            continue
        if not all((tv := val(t)) is not None and tv.shape == out.shape and tv.dtype == out.dtype for t in terms):
            continue
        _, end = _exclusive_views(mul)
        nexts = [u for u in end.users if is_target(u, {RESIDUAL_ADD})] if len(end.users) == 1 else []
        if isinstance(_find_norm(end), Reason) and not (nexts and not isinstance(_find_norm(nexts[0]), Reason)):
            continue
        with graph.inserting_before(mul):
            assert callable(mul.target)
            scaled = [graph.call_function(mul.target, (t, factor)) for t in terms]
            summed = graph.call_function(aten.add.Tensor, tuple(scaled))
        for node in (*scaled, summed):
            node.meta.update({k: v for k, v in mul.meta.items() if k in ("nn_module_stack", "stack_trace")})
        summed.meta[DISTRIBUTED] = True
        _set_fake_vals([*scaled, summed])
        mul.replace_all_uses_with(summed)
        graph.erase_node(mul)
        graph.erase_node(add)


def find_allreduce_rmsnorm_sites(
    graph: Graph,
) -> tuple[list[FusedAllReduceRMSNormSite], list[RejectedAllReduce]]:
    """Every all_reduce in ``graph``, as an accepted site or a rejection (graph order)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    sites: list[FusedAllReduceRMSNormSite] = []
    rejected: list[RejectedAllReduce] = []
    merged: set[Node] = set()  # partners whose sum an earlier site's collective carries
    claimed: dict[Node, Node] = {}  # node a site replaces -> that site's all_reduce
    for node in graph.nodes:
        if not is_target(node, ALL_REDUCES) or node in merged:
            continue
        found = _match_one(node, order)
        if isinstance(found, FusedAllReduceRMSNormSite):
            found = _claim(found, claimed)
        if isinstance(found, FusedAllReduceRMSNormSite):
            found = _with_quant(found, order)
            sites.append(found)
            if found.inner is not None:
                merged.update(s.all_reduce for s in found.inner.merged_sums)
        else:
            rejected.append(found)
    # An all_reduce that a later site's collective carries (its own reading stopped, say, at
    # Llama4's sum over experts) has no record of its own: the site names it.
    return sites, [r for r in rejected if r.all_reduce not in merged]


def _claim(site: FusedAllReduceRMSNormSite,
           claimed: dict[Node, Node]) -> FusedAllReduceRMSNormSite | RejectedAllReduce:
    """``site``, unless an earlier site replaces one of its adds (two all_reduces added to each
    other that cannot share a collective would both read the add as their residual add)."""
    adds = [site.add, site.inner.add if site.inner is not None else None]
    if site.inner is not None and site.inner.tree is not None:
        adds += site.inner.tree.adds
    replaced = list(dict.fromkeys(n for n in adds if n is not None))
    for node in replaced:
        if node in claimed:
            return RejectedAllReduce(site.all_reduce, Reason.of(
                ReasonCode.ALREADY_CLAIMED, node=node.name, site=claimed[node].name))
    claimed.update(dict.fromkeys(replaced, site.all_reduce))
    return site


def _with_quant(site: FusedAllReduceRMSNormSite, order: dict[Node, int]) -> FusedAllReduceRMSNormSite:
    """``site`` with the quantization of its normed rows (``patterns.quant``), fused or left
    outside (also when its static scale is computed after the op's place and cannot move up)."""
    rows = _tensor(site.add if site.add is not None else site.partial).shape[:-1]
    found = find_quant(site.norm.output, rows, site.norm.kind, site.training)
    if found is None:
        return site
    if isinstance(found, QuantLeftOutside):
        return dataclasses.replace(site, quant_left=found)
    quantized = dataclasses.replace(site, quant=found)
    late = _late_inputs(quantized, order)
    if isinstance(late, Reason):
        return quantized.without_quant(Reason.of(ReasonCode.QUANT_LATE_SCALE, cause=late))
    return dataclasses.replace(quantized, late_inputs=tuple(late))

