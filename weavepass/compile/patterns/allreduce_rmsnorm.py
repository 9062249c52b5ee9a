"""Find ``[matmul] -> all_reduce(sum) -> [residual add] -> RMSNorm | LayerNorm`` sites in a post-grad graph.

``find_allreduce_rmsnorm_sites(graph)`` looks at every all_reduce and returns, for each, either a
``FusedAllReduceRMSNormSite`` (which knows its nodes and how to replace itself) or a
``RejectedAllReduce`` with the reason it is left alone. Finding never changes the graph.

Shape-only views (``[B, S, H] <-> [B*S, H]``) between the steps are walked through and replayed on
the fused op's outputs, so they never hide a site.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch.fx import Graph, Node

from weavepass.compile.patterns.rmsnorm import (
    RMS_NORM,
    RMSNormMatch,
    add_alpha,
    is_target,
    match_rmsnorm,
    val,
)

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


def _is_row_view(node: Node, source: Node) -> bool:
    """A view of ``source`` that keeps its last (hidden) dim and its element count."""
    if not is_target(node, VIEWS) or node.args[0] is not source:
        return False
    out, src = val(node), val(source)
    return out is not None and src is not None and out.shape[-1] == src.shape[-1]


def _find_norm(root: Node) -> tuple[list[Node], RMSNormMatch] | str:
    """The norm fed by ``root`` directly or through a chain of row views."""
    found = match_rmsnorm(root)
    if isinstance(found, RMSNormMatch):
        return [], found
    for user in root.users:
        if _is_row_view(user, root):
            deeper = _find_norm(user)
            if not isinstance(deeper, str):
                # A view shared with other users stays (it then reads the new residual).
                views, norm = deeper
                return [user, *views], norm
    return found


def _producer_matmul(node: Node) -> Node | None:
    while is_target(node, VIEWS):
        node = node.args[0]
    return node if is_target(node, MATMULS) else None


@dataclass
class RejectedAllReduce:
    """An all_reduce the pass leaves alone, and why."""

    all_reduce: Node
    reason: str


@dataclass
class FusedAllReduceRMSNormSite:
    """``partial -> all_reduce -> wait -> views -> [add residual] -> views -> RMSNorm`` (or a
    LayerNorm: ``norm.kind``)."""

    all_reduce: Node
    wait: Node
    group_name: str
    views_to_add: list[Node]
    add: Node | None
    views_to_norm: list[Node]
    norm: RMSNormMatch
    matmul: Node | None
    lowering: str = "portable"
    extra: dict = field(default_factory=dict)
    scale: Node | None = None
    """``sum * c`` between the wait and the add (or the norm), c a scalar: hoisted onto the partial
    by ``hoist_scale`` when the site is rewritten (``_scale_after_sum``)."""
    scale_text: str = ""
    inner: InnerAdd | None = None
    """``sum + x`` between the wait and the residual add (or the norm): folded by ``fold_inner_add``
    when the site is rewritten (``_match_inner_add``)."""
    inner_text: str = ""

    @property
    def partial(self) -> Node:
        return self.all_reduce.args[0]

    @property
    def residual(self) -> Node | None:
        """Read from the add at use time: an earlier rewrite may have replaced the residual node."""
        if self.add is None:
            return None
        if self.inner is not None and self.inner.partner is None:
            # The op's residual will be ``x + r`` (``fold_inner_add``), not the stream's value: until
            # then, ``x`` stands for it, so that no strategy takes it for the stream by mistake
            # (FlashComm reads ``shared`` and ``stream_residual()`` for such a site).
            return self.inner.other
        return self.stream_residual()

    @property
    def shared(self) -> Node | None:
        """Before ``prepare``: the replicated ``x`` of ``(S + x) + r`` (a shared expert's output),
        which ``fold_inner_add`` moves onto the residual; else None (also for the merged forms: a
        partner's sum added first, or parallel branches, where ``x`` is the stream itself)."""
        if self.add is None or self.inner is None or self.inner.merged is not None:
            return None
        return self.inner.other

    def stream_residual(self) -> Node:
        """The residual stream's value ``r`` this site adds: the residual add's operand that is not
        the (scaled, merged) sum, also where ``x`` is added to the sum first (``shared``); for
        parallel branches ``(S + x) + S_2``, ``x`` (the residual add's other operand is ``S_2``)."""
        if self.inner is not None and self.inner.parallel is not None:
            return self.inner.other
        start = self.inner.add if self.inner is not None else self.scale or self.wait
        summed = self.views_to_add[-1] if self.views_to_add else start
        return self.add.args[1] if self.add.args[0] is summed else self.add.args[0]

    @property
    def dtype(self) -> torch.dtype:
        return val(self.partial).dtype

    @property
    def device(self) -> torch.device:
        return val(self.partial).device

    @property
    def hidden(self) -> int:
        return val(self.partial).shape[-1]

    @property
    def kind(self) -> str:
        residual = "residual" if self.add is not None else "no-residual"
        scaled = f", sum scaled by {self.scale_text}" if self.scale_text else ""
        inner = f", {self.inner_text}" if self.inner_text else ""
        weight = "" if self.norm.weight is None else f", weight {val(self.norm.weight).dtype}"
        bias = "" if self.norm.bias is None else f", bias {val(self.norm.bias).dtype}"
        return (f"{residual}{scaled}{inner}, {self.norm.form}{weight}{bias}, sum {self.dtype}, "
                f"hidden {self.hidden}")

    @property
    def stream(self) -> Node:
        """The node holding the new residual stream value: the add, else the (scaled, merged) sum."""
        if self.add is not None:
            return self.add
        return self.inner.add if self.inner is not None else self.scale or self.wait

    def prepare(self, graph: Graph) -> None:
        """Ready the graph for a rewrite at ``insertion_point()`` (every strategy calls this): the
        scale moved onto the partial, the inner add folded, and the late inputs (``_late_inputs``)
        moved up."""
        self.hoist_scale(graph)
        self.fold_inner_add(graph)
        for node in self.extra.get("hoist", []):
            self.insertion_point().prepend(node)

    def hoist_scale(self, graph: Graph) -> None:
        """``all_reduce(p) * c -> all_reduce(p * c)``: equal in exact arithmetic; eager rounds
        ``S`` and then ``S * c``, here each rank rounds ``p_r * c`` once (in the partial's dtype)
        and the fused op sums in fp32. Afterwards the site is a plain one: the wait holds the
        scaled sum."""
        if self.scale is None:
            return
        mul, partial = self.scale, self.partial
        factor = _scale_factor(mul, self.wait)
        if self.extra.get("move_factor"):
            self.all_reduce.prepend(factor)
        with graph.inserting_before(self.all_reduce):
            scaled = graph.call_function(mul.target, (partial, factor))
        _set_fake_vals([scaled])
        self.all_reduce.replace_input_with(partial, scaled)
        mul.replace_all_uses_with(self.wait)
        graph.erase_node(mul)
        if self.norm.input is mul:  # a no-residual site's norm read the product
            self.norm.input = self.wait
        self.scale = None

    def fold_inner_add(self, graph: Graph) -> None:
        """Fold ``sum + x`` (``inner``) away; afterwards the site is a plain one.

        * ``x`` another all_reduce's sum over the same group: ``all_reduce(a) + all_reduce(b) ->
          all_reduce(a + b)``, one collective fewer. Eager rounds each sum and then their sum;
          here each rank rounds ``a + b`` once (in the partial's dtype) and the op sums in fp32.
        * ``x`` replicated (a shared expert's output): ``(S + x) + r -> S + (x + r)``, the op's
          residual ``x + r`` computed before it. The same sum, rounded in another order: eager
          rounds ``S + x`` and then ``+ r``, here ``x + r`` and then ``S + (x + r)``.
        """
        if self.inner is None:
            return
        if self.inner.partner is not None:
            self._merge_partner(graph)
        elif self.inner.parallel is not None:
            self._merge_parallel(graph)
        else:
            self._add_to_residual(graph)
        self.inner = None

    def _merge_partner(self, graph: Graph) -> None:
        inner, partner = self.inner, self.inner.partner
        merged, wait = self._one_all_reduce(graph, inner.add, partner)
        inner.add.replace_all_uses_with(wait)
        _erase_dead([inner.add, *reversed(inner.views), self.wait, self.all_reduce,
                     *reversed(partner.views), partner.wait, partner.all_reduce], graph)
        if self.norm.input is inner.add:  # no residual add: the norm read the merged sum
            self.norm.input = wait
        self.all_reduce, self.wait, self.matmul = merged, wait, None

    def _merge_parallel(self, graph: Graph) -> None:
        """``(S + x) + S_2 -> all_reduce(p + p_2) + x``: the residual add keeps its node (later
        sites read it as their residual) and now adds ``x`` to the merged sum."""
        inner, parallel, add = self.inner, self.inner.parallel, self.add
        summed = inner.views[-1] if inner.views else self.wait  # the scale is hoisted by now
        x = inner.add.args[1] if inner.add.args[0] is summed else inner.add.args[0]
        merged, wait = self._one_all_reduce(graph, add, parallel)
        add.replace_input_with(parallel.views[-1] if parallel.views else parallel.wait, wait)
        add.replace_input_with(inner.add, x)
        _erase_dead([inner.add, *reversed(inner.views), self.wait, self.all_reduce,
                     *reversed(parallel.views), parallel.wait, parallel.all_reduce], graph)
        self.all_reduce, self.wait, self.matmul, self.views_to_add = merged, wait, None, []

    def _one_all_reduce(self, graph: Graph, before: Node, other: PartnerSum) -> tuple[Node, Node]:
        """``all_reduce(p + p_2)`` inserted before ``before``: this site's partial through the inner
        sum's views plus ``other``'s partial through its views; returns (all_reduce, wait)."""
        with graph.inserting_before(before):
            mine = _replay(graph, self.inner.views, self.partial)
            theirs = _replay(graph, other.views, other.partial)
            summed = graph.call_function(aten.add.Tensor, (mine, theirs))
            merged = graph.call_function(c10d.all_reduce.default, (summed, "sum", self.group_name))
            wait = graph.call_function(WAIT, (merged,))
        _set_fake_vals([*_chain(self.partial, mine), *_chain(other.partial, theirs), summed, merged, wait])
        return merged, wait

    def _add_to_residual(self, graph: Graph) -> None:
        inner, add = self.inner, self.add
        x, residual = inner.other, self.stream_residual()
        with graph.inserting_before(add):
            x_rows = _replay(graph, self.views_to_add, x)  # in the residual add's shape
            new_residual = graph.call_function(aten.add.Tensor, (x_rows, residual))
        _set_fake_vals([*_chain(x, x_rows), new_residual])
        summed = inner.views[-1] if inner.views else self.wait  # the scale is hoisted by now
        (self.views_to_add[0] if self.views_to_add else add).replace_input_with(inner.add, summed)
        add.replace_input_with(residual, new_residual)
        _erase_dead([inner.add], graph)
        self.views_to_add = inner.views + self.views_to_add

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
        nodes = [n for n in (self.partial, self.residual, self.norm.weight, self.norm.bias) if n is not None]
        views = self.views_to_add + self.views_to_norm
        if self.inner is not None:
            nodes.append(self.inner.other)
            views = views + self.inner.views
            if self.inner.partner is not None:
                nodes.append(self.inner.partner.all_reduce.args[0])
                views = views + self.inner.partner.views
            elif self.add is not None:
                nodes.append(self.stream_residual())
            if self.inner.parallel is not None:
                nodes.append(self.inner.parallel.partial)
                views = views + self.inner.parallel.views
        for view in views:
            torch.fx.node.map_arg(view.args[1:], nodes.append)
        return nodes

    def replace_with(self, graph: Graph, fused_op, workspace_tokens: int) -> Node:
        """Insert ``fused_op`` for this site and erase the nodes it replaces; returns the op node.
        ``workspace_tokens`` goes into the call (``weavepass.ops``: the CUDA workspace's capacity).
        A LayerNorm site's op takes the bias after the weight (``weave.fused_allreduce_layernorm``)."""
        self.prepare(graph)
        with graph.inserting_before(self.insertion_point()):
            partial = _replay(graph, self.views_to_add if self.add is not None else [], self.partial)
            affine = (self.norm.weight,) if self.norm.kind == RMS_NORM else (self.norm.weight, self.norm.bias)
            fused = graph.call_function(
                fused_op,
                (partial, self.residual, *affine, self.norm.eps, self.group_name,
                 self.norm.out_dtype, self.lowering, workspace_tokens),
            )
            normed = graph.call_function(operator.getitem, (fused, 0))
            residual_out = graph.call_function(operator.getitem, (fused, 1))
            norm_views = self.views_to_norm
            if self.add is None:
                norm_views = self.views_to_add + norm_views
            normed_out = _replay(graph, norm_views, normed)
            inv_rms = graph.call_function(operator.getitem, (fused, 2)) if self.training else None
        new_nodes = [partial, fused, normed, residual_out, *_chain(normed, normed_out)]
        _set_fake_vals(new_nodes + ([inv_rms] if self.training else []))

        self.norm.output.replace_all_uses_with(normed_out)
        if self.training:  # the backward graph reads the op's inverse RMS where it read rsqrt
            self.norm.saved_inv_rms.replace_all_uses_with(inv_rms)
        _erase_dead([*reversed(self.norm.nodes), *reversed(self.views_to_norm)], graph)
        carried = self.add if self.add is not None else self.wait
        carried.replace_all_uses_with(residual_out)
        _erase_dead(
            [carried, *reversed(self.views_to_add), self.wait, self.all_reduce], graph
        )
        return fused


@dataclass
class PartnerSum:
    """Another all_reduce's sum, added to this one's: ``partial -> all_reduce -> wait -> views``."""

    all_reduce: Node
    wait: Node
    views: list[Node]
    """row views from the wait to the inner add, each read only by the next"""

    @property
    def partial(self) -> Node:
        return self.all_reduce.args[0]


@dataclass
class InnerAdd:
    """``sum + x`` between the reduced sum and the residual add (or the norm). MoE layers add the
    routed experts' sum to a replicated shared expert's output (Qwen2-MoE), or to the shared
    experts' own all_reduce sum (``partner``, DeepSeek-V3)."""

    add: Node
    views: list[Node]
    """row views from the (scaled) sum to ``add``, each read only by the next"""
    other: Node
    """``add``'s operand that is not this all_reduce's sum"""
    partner: PartnerSum | None = None
    parallel: PartnerSum | None = None
    """Another all_reduce's sum that the residual add right after ``add`` adds: ``(S + x) + S_2``
    (Cohere's attention and MLP run in parallel on one input: ``x`` is the residual stream)."""

    @property
    def merged(self) -> PartnerSum | None:
        """The all_reduce whose sum this site's one collective carries, if any."""
        return self.partner or self.parallel


def _replay(graph: Graph, views: list[Node], node: Node) -> Node:
    """Apply the same chain of views to ``node`` (size arguments are reused as they are)."""
    for view in views:
        node = graph.call_function(view.target, (node, *view.args[1:]), dict(view.kwargs))
    return node


def _chain(start: Node, end: Node) -> list[Node]:
    nodes = []
    while end is not start:
        nodes.append(end)
        end = end.args[0]
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
        if mode is None:
            node.meta["val"] = node.target(*args, **kwargs)
        else:
            with mode:
                node.meta["val"] = node.target(*args, **kwargs)


def _erase_dead(nodes: list[Node], graph: Graph) -> None:
    for node in dict.fromkeys(nodes):  # ordered, without repeats
        if not node.users:
            graph.erase_node(node)


def _match_one(ar: Node, order: dict[Node, int]) -> FusedAllReduceRMSNormSite | RejectedAllReduce:
    def reject(reason: str) -> RejectedAllReduce:
        return RejectedAllReduce(ar, reason)

    reason = _unfit_all_reduce(ar)
    if reason is not None:
        return reject(reason)
    group_name, partial = ar.args[2], ar.args[0]
    wait = next(iter(ar.users))
    scale = _scale_after_sum(ar, wait, order)
    summed = scale or wait

    inner = _match_inner_add(ar, summed)
    if isinstance(inner, InnerAdd) and inner.partner is not None:  # before reading x as a residual
        return _inner_site(ar, wait, scale, inner, order)
    found = _match_after_sum(summed)
    if isinstance(found, str):
        if isinstance(inner, InnerAdd):
            return _inner_site(ar, wait, scale, inner, order, found)
        return reject(found)
    views_to_add, add, views_to_norm, norm = found
    site = FusedAllReduceRMSNormSite(
        ar, wait, group_name, views_to_add, add, views_to_norm, norm, _producer_matmul(partial)
    )
    return _with_scale(site, scale, order)


def _unfit_all_reduce(ar: Node) -> str | None:
    """Why ``ar`` is not a row-parallel sum read through one wait, or None."""
    reduce_op = str(ar.args[1]).lower()
    if reduce_op != "sum":
        return f"all_reduce op is {reduce_op!r}; only 'sum' is a row-parallel reduction"
    partial = ar.args[0]
    if val(partial) is None:
        return "the all_reduce input has no tensor metadata"
    if ar.target is c10d.all_reduce_.default and len(partial.users) > 1:
        return "in-place all_reduce whose input is read elsewhere"
    if len(ar.users) != 1 or next(iter(ar.users)).target is not WAIT:
        return "the all_reduce result is not consumed through exactly one wait_tensor"
    return None


def _match_after_sum(summed: Node) -> tuple[list[Node], Node | None, list[Node], RMSNormMatch] | str:
    """From the (scaled, merged) sum on: ``views -> [add residual] -> views -> RMSNorm``, as
    ``(views_to_add, add, views_to_norm, norm)``, or why not."""
    # Without a residual: the reduced sum itself is normalised (and may be used elsewhere).
    found = _find_norm(summed)
    if not isinstance(found, str):
        views_to_norm, norm = found
        return [], None, views_to_norm, norm
    no_norm_reason = found

    # With a residual: sum -> (exclusive views) -> add(x, residual) -> views -> norm.
    views_to_add, cur = _exclusive_views(summed)
    for add in [u for u in cur.users if is_target(u, {RESIDUAL_ADD})]:
        unfit = _unfit_residual_add(add, cur)
        if unfit is not None:
            no_norm_reason = f"the residual add ({add.name}): {unfit}"
            continue
        residual = add.args[1] if add.args[0] is cur else add.args[0]
        found = _find_norm(add)
        if isinstance(found, str):
            no_norm_reason = f"after adding {residual.name}: {found}"  # a residual or not: unknown here
            continue
        if len(cur.users) != 1:
            others = ", ".join(_reader(u) for u in cur.users if u is not add)
            return (f"the all_reduce result has {len(cur.users) - 1} other user(s) besides the "
                    f"residual add that feeds the norm: {others}")
        views_to_norm, norm = found
        return views_to_add, add, views_to_norm, norm
    return no_norm_reason


def _reader(node: Node) -> str:
    """A reader of the sum, for a reason: its name, and what a write-back into an input means."""
    if is_target(node, {aten.copy_.default}) and node.args[0].op == "placeholder":
        return (f"{node.name} (the sum is written back into the graph input {node.args[0].name}: "
                "an in-place all_reduce of, or a copy_ into, a tensor the compiled code was given)")
    return node.name


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
    if len(cur.users) != 1 or not is_target(add, {RESIDUAL_ADD}) or _unfit_residual_add(add, cur):
        return None
    other = add.args[1] if add.args[0] is cur else add.args[0]
    partner = _partner_sum(other, ar)
    return InnerAdd(add, views, other, partner if isinstance(partner, PartnerSum) else None)


def _partner_sum(x: Node, ar: Node) -> PartnerSum | str | None:
    """``x`` as another all_reduce's sum read only by the add (through row views) that can be
    merged into ``ar``'s collective; a reason when it is such a sum but cannot be; else None."""
    views = []
    while is_target(x, VIEWS) and len(x.users) == 1 and _is_row_view(x, x.args[0]):
        views.append(x)
        x = x.args[0]
    if not is_target(x, {WAIT}) or len(x.users) != 1 or not is_target(x.args[0], ALL_REDUCES):
        return None
    other = x.args[0]
    if _unfit_all_reduce(other) is not None:
        return f"{other.name}: {_unfit_all_reduce(other)}"
    if other.args[2] != ar.args[2]:
        return f"{other.name} reduces over group {other.args[2]!r}, not {ar.args[2]!r}"
    if val(other.args[0]).dtype != val(ar.args[0]).dtype:
        return f"{other.name} sums {val(other.args[0]).dtype}, not {val(ar.args[0]).dtype}"
    return PartnerSum(other, x, list(reversed(views)))


def _after_add_cause(reason: str) -> str:
    """``reason`` without its leading ``after adding <node>: `` (where a reading stopped)."""
    if reason.startswith("after adding ") and ": " in reason:
        return reason.split(": ", 1)[1]
    return reason


def _inner_site(ar: Node, wait: Node, scale: Node | None, inner: InnerAdd, order,
                plain_reason: str = "") -> FusedAllReduceRMSNormSite | RejectedAllReduce:
    """The site ``sum + x -> [add residual] -> RMSNorm`` (``InnerAdd``), or why not.

    ``plain_reason`` is why the plain reading (``x`` as the residual) failed; the reason given
    starts with it when this reading fails too, and goes on with where this one stopped.
    """
    found = _match_after_sum(inner.add)
    if isinstance(found, str) and inner.partner is not None:
        return RejectedAllReduce(ar, f"after adding {inner.other.name} "
                                 f"({inner.partner.all_reduce.name}'s sum): {found}")
    if isinstance(found, str):  # (the same words when the first reading stopped at the same place,
        # or for the same cause one add further on: a lifted eps stops every norm alike)
        same = plain_reason == f"after adding {inner.other.name}: {found}" or (
            _after_add_cause(plain_reason) == _after_add_cause(found))
        return RejectedAllReduce(ar, plain_reason if same else f"{plain_reason}; after that: {found}")
    views_to_add, add, views_to_norm, norm = found
    other = inner.other
    if inner.partner is None:  # (``sum + x -> norm`` without a residual add is the plain site)
        partner = _partner_sum(other, ar)
        if isinstance(partner, str):
            return RejectedAllReduce(ar, f"the sum is added to another all_reduce's sum, which "
                                         f"cannot share its collective: {partner}")
        inner.parallel = _parallel_sum(add, views_to_add, inner.add, ar)
        if inner.parallel is not None:
            text = (f"summed with {inner.parallel.all_reduce.name}, which the next add adds (parallel "
                    f"branches: one all_reduce of the partials' sum, then + {other.name}; eager adds "
                    "each sum to the stream in turn)")
        else:
            text = (f"{other.name} added to the sum before the residual add: moved onto the residual "
                    f"({other.name} + residual; eager adds it to the sum first, so the rounding order differs)")
    else:
        text = (f"summed with {inner.partner.all_reduce.name} ({other.name}): one all_reduce of the "
                "partials' sum (eager rounds each sum, then their sum)")
    site = FusedAllReduceRMSNormSite(ar, wait, ar.args[2], views_to_add, add, views_to_norm, norm,
                                     None if inner.merged else _producer_matmul(ar.args[0]),
                                     inner=inner, inner_text=text)
    return _with_scale(site, scale, order)


def _parallel_sum(add: Node, views_to_add: list[Node], inner_add: Node, ar: Node) -> PartnerSum | None:
    """The residual add ``add = (S + x) + S_2`` right after ``inner_add = S + x`` (no views between),
    with ``S_2`` another all_reduce's sum that can share ``ar``'s collective, as a ``PartnerSum``;
    else None (``S_2`` is then an ordinary residual)."""
    if views_to_add:
        return None
    residual = add.args[1] if add.args[0] is inner_add else add.args[0]
    partner = _partner_sum(residual, ar)
    return partner if isinstance(partner, PartnerSum) else None


def _unfit_residual_add(add: Node, summed: Node) -> str | None:
    """Why ``add`` is not ``summed + residual`` exactly as the fused op computes it, or None.

    The op computes ``round(dtype, S + R)`` with ``R`` of ``S``'s shape and dtype, so the add may
    not scale an operand (``alpha``), broadcast, or promote; either operand order is fine.
    """
    if add.args[0] is summed and add.args[1] is summed:
        return "it adds the reduced sum to itself, so there is no residual"
    alpha = add_alpha(add)
    if alpha != 1:
        scaled = "the reduced sum" if add.args[1] is summed else "the residual"
        return f"alpha={alpha} scales {scaled}; only a plain add (alpha=1) is fused"
    residual = add.args[1] if add.args[0] is summed else add.args[0]
    rv, sv, av = val(residual), val(summed), val(add)
    if rv is None:
        return f"the residual {residual!r} is not a tensor"
    if rv.shape != sv.shape:
        return (f"the residual's shape {tuple(rv.shape)} is not the reduced sum's "
                f"{tuple(sv.shape)} (broadcasting is not fused)")
    if not rv.dtype == sv.dtype == av.dtype:
        return (f"it adds {sv.dtype} and a {rv.dtype} residual into {av.dtype}; the fused op "
                "needs one dtype (no type promotion)")
    return None


SCALES = {aten.mul.Tensor, aten.mul.Scalar}


def _scale_after_sum(ar: Node, wait: Node, order: dict[Node, int]) -> Node | None:
    """``wait * c``, the sum's only reader, for a scalar ``c`` that exists before the all_reduce
    (a number, or a one-element tensor such as Gemma's ``sqrt(hidden)``): Granite's residual and
    embedding multipliers, Gemma's embedding scale. The all_reduce is linear, so
    ``all_reduce(p) * c == all_reduce(p * c)``, and the site is matched from the product."""
    if len(wait.users) != 1:
        return None
    mul = next(iter(wait.users))
    if not is_target(mul, SCALES) or len(mul.args) != 2 or mul.kwargs:
        return None
    factor = _scale_factor(mul, wait)
    if isinstance(factor, Node):
        fv = val(factor)
        # After the all_reduce only as a constant (Gemma's ``full([], sqrt(H))``): it moves up.
        late = order[factor] > order[ar]
        if fv is None or fv.numel() != 1 or (late and (factor.op != "call_function" or factor.all_input_nodes)):
            return None
    elif isinstance(factor, bool) or not isinstance(factor, (int, float)):
        return None
    mv, wv = val(mul), val(wait)
    if mv is None or mv.shape != wv.shape or mv.dtype != wv.dtype:
        return None
    return mul


def _scale_factor(mul: Node, wait: Node):
    return mul.args[1] if mul.args[0] is wait else mul.args[0]


def _with_scale(site: FusedAllReduceRMSNormSite, scale: Node | None,
                order) -> FusedAllReduceRMSNormSite | RejectedAllReduce:
    """``site`` with its scale recorded (what the report shows, whether the factor moves up),
    then checked like every site."""
    if scale is not None:
        site.scale = scale
        factor = _scale_factor(scale, site.wait)
        if not isinstance(factor, Node):
            site.scale_text = repr(factor)
        elif is_target(factor, {aten.full.default}) and not factor.args[0]:  # a 0-d constant
            site.scale_text = repr(factor.args[1])
        else:
            site.scale_text = factor.name
        site.extra["move_factor"] = isinstance(factor, Node) and order[factor] > order[site.all_reduce]
    return _rank_local_input(site) or _check_order(site, order) or site


def _rank_local_input(site: FusedAllReduceRMSNormSite) -> RejectedAllReduce | None:
    """Why ``site`` reads a value that differs between ranks where the fused op needs it the same
    on every rank (``weavepass.report.REPLICATED_ASSUMPTION``), or None: the residual, a value added
    to the sum, the norm's weight or bias computed from the site's own partial sum (not through a
    collective). Each rank would normalise its rows with another rank's copy. So may the factor of
    a scaled sum not: ``all_reduce(p) * c`` is ``all_reduce(p * c)`` only for one ``c`` on every rank."""
    partials = [site.partial] + ([site.inner.merged.partial] if site.inner and site.inner.merged else [])
    local = set()
    for node in partials:
        local.add(node)
        while is_target(node, VIEWS):
            node = node.args[0]
            local.add(node)
    inner = site.inner.other if site.inner is not None else None
    factor = _scale_factor(site.scale, site.wait) if site.scale is not None else None
    for start in (site.stream_residual() if site.add is not None else None, inner,
                  site.norm.weight, site.norm.bias, factor):
        stack, seen = [start] if isinstance(start, Node) else [], set()
        while stack:
            node = stack.pop()
            if node in local:
                return RejectedAllReduce(site.all_reduce, (
                    f"{start.name} is computed from the all_reduce's own partial sum ({node.name}), "
                    "which differs between ranks; the fused op needs it the same on every rank"))
            if node not in seen and not is_target(node, ALL_REDUCES):  # a sum is the same everywhere
                seen.add(node)
                stack.extend(node.all_input_nodes)
    return None


def _late_inputs(site: FusedAllReduceRMSNormSite, order) -> list[Node] | str:
    """Inputs computed after the fused op's insertion point, in the order to move them up.

    A weight cast to fp32 (``w.float()``) often sits after the residual add; such pure
    computations of earlier values are moved before the fused op. Anything that depends on the
    site's own nodes cannot be, and the site is rejected.
    """
    point = order[site.insertion_point()]
    moved: list[Node] = []

    def visit(node: Node) -> str | None:
        if order.get(node, -1) < point or node in moved:
            return None
        if node.op != "call_function" or is_target(node, ALL_REDUCES | {WAIT}) \
                or node in (site.add, site.inner.add if site.inner is not None else None):
            return (f"{node.name} is computed after {site.insertion_point().name}, where the fused "
                    "op goes, and depends on it; cannot fuse")
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


def _check_order(site: FusedAllReduceRMSNormSite, order) -> RejectedAllReduce | None:
    """All inputs of the fused op must exist (or be movable to) where it is inserted, and a saved
    inverse RMS must have the shape the op returns (the op's input rows, one column)."""
    if site.training:
        saved = val(site.norm.saved_inv_rms).shape
        rows = val(site.stream).shape[:-1]
        if list(saved) != [*rows, 1]:
            return RejectedAllReduce(site.all_reduce, (
                f"training: the inverse RMS {site.norm.saved_inv_rms.name} saved for backward "
                f"has shape {list(saved)}, not the fused op's {[*rows, 1]} (a view between the "
                "residual add and the norm)"))
    late = _late_inputs(site, order)
    if isinstance(late, str):
        return RejectedAllReduce(site.all_reduce, late)
    site.extra["hoist"] = late
    return None


READ_BACKS = {
    aten.slice.Tensor: (aten.slice_scatter.default, (("dim", 0), ("start", None), ("end", None), ("step", 1))),
    aten.select.int: (aten.select_scatter.default, (("dim", None), ("index", None))),
}
"""A read of part of a tensor -> the op that writes that part, and the arguments naming the part."""


def _part(node: Node, first: int, params) -> tuple:
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


def find_allreduce_rmsnorm_sites(
    graph: Graph,
) -> tuple[list[FusedAllReduceRMSNormSite], list[RejectedAllReduce]]:
    """Every all_reduce in ``graph``, as an accepted site or a rejection (graph order)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    sites, rejected = [], []
    merged: set[Node] = set()  # partners whose sum an earlier site's collective carries
    claimed: dict[Node, Node] = {}  # node a site replaces -> that site's all_reduce
    for node in graph.nodes:
        if not is_target(node, ALL_REDUCES) or node in merged:
            continue
        found = _match_one(node, order)
        if isinstance(found, FusedAllReduceRMSNormSite):
            found = _claim(found, claimed)
        if isinstance(found, FusedAllReduceRMSNormSite):
            sites.append(found)
            if found.inner is not None and found.inner.merged is not None:
                merged.add(found.inner.merged.all_reduce)
        else:
            rejected.append(found)
    return sites, rejected


def _claim(site: FusedAllReduceRMSNormSite,
           claimed: dict[Node, Node]) -> FusedAllReduceRMSNormSite | RejectedAllReduce:
    """``site``, unless an earlier site replaces one of its adds (two all_reduces added to each
    other that cannot share a collective would both read the add as their residual add)."""
    replaced = [site.add, site.inner.add if site.inner is not None else None]
    replaced = [n for n in replaced if n is not None]
    for node in replaced:
        if node in claimed:
            return RejectedAllReduce(site.all_reduce, f"{node.name} is already part of the site of "
                                     f"{claimed[node].name}")
    claimed.update(dict.fromkeys(replaced, site.all_reduce))
    return site
