"""``WeaveConfig(check_replicated=True)``, the compile side: route each fused site's residual (and
norm weight and bias) through ``weave::check_replicated`` (kernel: ``weavepass.runtime.replication``),
which raises ``ReplicationError`` when they differ between the ranks of the site's group."""

from __future__ import annotations

import torch

from weavepass.compile.fx_args import arguments, as_optional_node, as_str
from weavepass.ops import CHECK_REPLICATED


def insert_checks(graph: torch.fx.Graph, fused: dict[str, torch.fx.Node]) -> int:
    """Route each fused op's residual (or, without one, its weight, or else a LayerNorm's bias)
    through ``weave.check_replicated``, which compares the weight and the bias too; ``fused`` maps a
    site's name (its all_reduce's, as the report says) to its fused op. Returns how many sites are checked."""
    checked = 0
    for site, node in fused.items():
        # By name: the LayerNorm op has a bias after the weight.
        args = arguments(node)
        residual = as_optional_node(args["residual"], node, "residual")
        weight = as_optional_node(args["weight"], node, "weight")
        bias = as_optional_node(args.get("bias"), node, "bias")  # the LayerNorm op's
        group_name = as_str(args["group_name"], node, "group_name")
        if residual is not None:
            target_index, x = 1, residual
        elif weight is not None:
            target_index, x = 2, weight
        elif bias is not None:  # no residual and no weight: nothing assumed replicated but a bias
            target_index, x = 3, bias
        else:
            continue
        other = weight if target_index == 1 else None
        name = {1: "residual", 2: "norm weight", 3: "norm bias"}[target_index]
        with graph.inserting_before(node):
            check = graph.call_function(
                CHECK_REPLICATED, (x, other, name, site, group_name, bias if target_index != 3 else None),
            )
        check.meta["val"] = torch.empty_like(x.meta["val"])
        new_args = list(node.args)
        new_args[target_index] = check
        node.args = tuple(new_args)
        checked += 1
    return checked
