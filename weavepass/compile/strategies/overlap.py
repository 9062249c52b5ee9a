"""The TokenWeave overlap strategy: a thin adapter around the split (``strategies/split``), which
plans and rewrites the fused sites and reports its own reasons not to split."""

from __future__ import annotations

import logging

from weavepass.config import WeaveConfig
from weavepass.compile.reasons import Reason, ReasonCode
from weavepass.compile.strategies.base import TRAINING, Decision, GraphRewrite, Strategy

log = logging.getLogger("weavepass")


class SplitStrategy(Strategy):
    """Split the fused sites' tokens into two overlapped halves (``WeaveConfig.overlap``)."""

    name = "token split"

    def inductor_patches(self, config: WeaveConfig) -> dict:
        if config.overlap == "off":
            return {}
        from weavepass.compile.strategies.split import inductor_config_patches

        return inductor_config_patches()

    def decide(self, rewrite: GraphRewrite) -> Decision:
        # No records: no all_reduce at all, nothing to say. Otherwise the split says why it does not
        # split (also when nothing was fused).
        if rewrite.config.overlap == "off" or not rewrite.report.records:
            return Decision(False, Reason(ReasonCode.NOT_ASKED))
        if rewrite.fused and rewrite.training:
            return Decision(False, TRAINING)
        return Decision(True)

    def apply(self, rewrite: GraphRewrite, decision: Decision) -> bool:
        from weavepass.compile.strategies.split import apply_token_split

        apply_token_split(rewrite.graph, list(rewrite.fused.values()), rewrite.config, rewrite.report)
        return False

    def decline(self, rewrite: GraphRewrite, decision: Decision) -> None:
        from weavepass.compile.strategies.split import split_skip_level

        rewrite.report.decline("fuse-only", decision.reason)
        log.log(split_skip_level(rewrite.config), "weavepass: graph %d: %s", rewrite.report.graph_index,
                rewrite.report.notes[-1])
