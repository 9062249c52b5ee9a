"""The region analysis: the token dim of every node from the first site to the last, computed
before anything changes, so a reason not to split leaves the graph untouched."""

from __future__ import annotations

import operator

import torch
from torch.fx import Graph, Node

from weavepass.compile.fx_args import arguments
from weavepass.compile.reasons import Reason, ReasonCode
from weavepass.compile.wave_model import GemmShape

from .base import Unsupported
from .routing import check_block, routed, routed_dims
from .rules import rule_for, site_dims
from .scores import score_dims
from .state import Analysis, TokenDims
from .symbolic import Cut, shape

aten = torch.ops.aten


def analyse(graph: Graph, sites: list[Node], cut: Cut) -> Analysis:
    """The token dims of the region from ``sites[0]`` to ``sites[-1]`` (in graph order) and the
    getitems of the last site, for a cut of ``cut.first`` units; raises ``Unsupported``."""
    region: list[Node] = []
    for node in graph.nodes:
        if node is sites[0] or region:
            region.append(node)
        if node is sites[-1]:
            break
    region += [u for u in sites[-1].users if u.target is operator.getitem]
    info = Analysis(cut, sites, region)
    site_index = {n: i for i, n in enumerate(sites)}
    for node in region:
        if node in site_index:
            if any(a in info.roles for a in node.all_input_nodes):
                raise Unsupported(Reason.of(ReasonCode.SPLIT_EXPERT_ROWS_INPUT, node=node.name))
            info.token[node] = site_dims(node, info)
            info.segment[node] = site_index[node]
            continue
        token_inputs = [a for a in node.all_input_nodes if a in info.token]
        if not token_inputs:
            continue  # token-free: shared by both halves, stays where it is
        info.segment[node] = max(info.segment[a] for a in token_inputs)
        info.token[node] = token_dims(node, info)
        if node.target in (aten.mm.default, aten.addmm.default):
            weight_node = arguments(node)["mat2"]  # by name: addmm's bias comes first
            assert isinstance(weight_node, Node)  # mm / addmm: the weight is a tensor
            weight = shape(weight_node)
            info.gemms.append(GemmShape(n=weight[1], k=weight[0]))
        info.moe |= node.target is aten.topk.default
    check_block(info)
    for node in info.keys:  # halves of scores have different key counts: no cat can join them
        if any(u not in info.token for u in node.users):
            raise Unsupported(Reason.of(ReasonCode.SPLIT_SCORES_AFTER_LAST_SITE, node=node.name))
    return info


def token_dims(node: Node, info: Analysis) -> TokenDims:
    """The token dim(s) of ``node``'s output, from its inputs' (or ``Unsupported``)."""
    if any(a in info.keys for a in node.all_input_nodes):
        return score_dims(node, info)
    if node.op != "call_function":
        raise Unsupported(Reason.of(ReasonCode.SPLIT_READS_TOKENS, node=node.name, node_kind=node.op))
    if routed(node, info):
        return routed_dims(node, info)
    return rule_for(node.target)(node, info)
