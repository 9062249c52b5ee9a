"""TokenWeave two-way token split (work in progress: see issue 4).

``apply_token_split(graph, fused_nodes, config, report)`` is called after every site has been fused.
Until the split rewrite lands it leaves the graph fuse-only and says so in the report.
"""

from __future__ import annotations

import torch

from weavepass.config import WeaveConfig
from weavepass.report import GraphReport


def apply_token_split(
    graph: torch.fx.Graph, fused_nodes: list[torch.fx.Node], config: WeaveConfig, report: GraphReport
) -> bool:
    """Split the token dimension into two overlapped halves; returns True when the graph changed."""
    report.note = "fuse-only: the two-way token split is not implemented yet"
    return False
