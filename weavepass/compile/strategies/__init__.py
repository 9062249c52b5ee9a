"""Graph-wide strategies behind one interface (``base.Strategy``), in the order ``WeavePass`` runs them.

1. FlashComm (``flashcomm.py``): when it applies, it takes the whole graph.
2. Fuse (``fuse.py``): every planned site becomes a fused op (then the replication checks).
3. The split (``split/strategy.py``, around the ``split`` package): overlaps the fused sites in two halves.
"""

from __future__ import annotations

from typing import Any

from weavepass.compile.strategies.base import ContractError, Decision, GraphRewrite, Strategy, check_order
from weavepass.compile.strategies.flashcomm import FlashCommStrategy
from weavepass.compile.strategies.fuse import FuseStrategy
from weavepass.compile.strategies.split.strategy import SplitStrategy
from weavepass.config import WeaveConfig

STRATEGIES: tuple[Strategy, ...] = (FlashCommStrategy(), FuseStrategy(), SplitStrategy())
"""In order of precedence: FlashComm before fuse (it rewrites the unfused sites and takes the graph),
the split after fuse (it splits the fused ops). ``check_order`` holds this order to the contract."""
check_order(STRATEGIES)


def inductor_patches(config: WeaveConfig, deferred: bool = True) -> dict[str, Any]:
    """Every strategy's Inductor config entries for ``config``, merged; without ``deferred``, not
    those of strategies that defer theirs until they apply (``Strategy.defers_settings``)."""
    patches: dict[str, Any] = {}
    for strategy in STRATEGIES:
        if deferred or not strategy.defers_settings(config):
            patches.update(strategy.inductor_patches(config))
    return patches


__all__ = ["STRATEGIES", "ContractError", "Decision", "GraphRewrite", "Strategy", "check_order",
           "inductor_patches"]
