"""``WeaveConfig(check_replicated=True)``, the compile side: route each fused site's residual (and
norm weight and bias) through ``weave::check_replicated`` (kernel: ``weavepass.runtime.replication``),
which raises ``ReplicationError`` when they differ between the ranks of the site's group."""

from __future__ import annotations

import torch

from weavepass.compile.fx_args import arguments, as_optional_node, as_str, set_argument
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
            checked_arg, x = "residual", residual
        elif weight is not None:
            checked_arg, x = "weight", weight
        elif bias is not None:  # no residual and no weight: nothing assumed replicated but a bias
            checked_arg, x = "bias", bias
        else:
            continue
        other = weight if checked_arg == "residual" else None
        name = {"residual": "residual", "weight": "norm weight", "bias": "norm bias"}[checked_arg]
        with graph.inserting_before(node):
            check = graph.call_function(
                CHECK_REPLICATED, (x, other, name, site, group_name, bias if checked_arg != "bias" else None),
            )
        check.meta["val"] = torch.empty_like(x.meta["val"])
        set_argument(node, checked_arg, check)
        checked += 1
    return checked
