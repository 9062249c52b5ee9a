"""The split as a strategy (``base.Strategy``): a thin adapter around the split's package
(``strategies/split``), which plans and rewrites the fused sites and reports its own reasons not
to split."""

from __future__ import annotations

import logging
from typing import Any

from weavepass.compile.reasons import Reason, ReasonCode
from weavepass.compile.strategies.base import TRAINING, Decision, GraphRewrite, Strategy
from weavepass.compile.strategies.split import apply_token_split, inductor_config_patches, split_skip_level
from weavepass.config import WeaveConfig

log = logging.getLogger("weavepass")


class SplitStrategy(Strategy):
    """Split the fused sites' tokens into two overlapped halves (``WeaveConfig.split``)."""

    name = "split"
    reads = frozenset({"fused", "records"})
    writes = frozenset({"notes"})

    def inductor_patches(self, config: WeaveConfig) -> dict[str, Any]:
        if config.split == "off":
            return {}
        return inductor_config_patches()

    def defers_settings(self, config: WeaveConfig) -> bool:
        # "auto" often decides not to split (the token window, the tuning table): those graphs keep
        # Inductor's own settings. It asks for them (apply_token_split's before_rewrite) from the
        # token count alone, before reading the matmuls that shape padding could change per rank.
        # "force" splits wherever it can, so it patches them in at once.
        return config.split == "auto"

    def decide(self, rewrite: GraphRewrite) -> Decision:
        # No records: no all_reduce at all, nothing to say. Otherwise the split says why it does not
        # split (also when nothing was fused).
        if rewrite.config.split == "off" or not rewrite.report.records:
            return Decision(False, Reason(ReasonCode.NOT_ASKED))
        if rewrite.fused and rewrite.training:
            return Decision(False, TRAINING)
        quantized = [p.site.all_reduce.name for p in rewrite.plans if p.lowering and p.site.quant is not None]
        if quantized:
            return Decision(False, Reason.of(ReasonCode.QUANT_SPLIT, sites=", ".join(quantized)))
        tuned = rewrite.tuned
        if tuned is not None and tuned.rewrite in ("inductor", "fuse"):
            return Decision(False, tuned.reason)
        if tuned is not None:  # the split, or no entry for this graph (the window decides)
            return Decision(True, tuned.reason)
        return Decision(True)

    def apply(self, rewrite: GraphRewrite, decision: Decision) -> bool:
        config = rewrite.config
        if decision.code is ReasonCode.TUNED_SPLIT:  # the table's token range replaces the window
            assert rewrite.tuned is not None and rewrite.tuned.window is not None
            low, high = rewrite.tuned.window
            config = config.replace(split_min_tokens=low, split_min_tokens_moe=low, split_max_tokens=high)
            rewrite.report.tuned = decision.reason
            rewrite.report.add_note(decision.reason.render())
        apply_token_split(rewrite.graph, list(rewrite.fused.values()), config, rewrite.report, rewrite.before_rewrite)
        if decision.code is ReasonCode.TUNING_TABLE_NOT_APPLICABLE:
            rewrite.report.tuned = decision.reason
            rewrite.report.add_note(decision.reason.render())
        return False

    def decline(self, rewrite: GraphRewrite, decision: Decision) -> None:
        if decision.code in (ReasonCode.TUNED_NO_REWRITE, ReasonCode.TUNED_FUSE_ONLY):
            rewrite.report.reasons.append(decision.reason)  # its sentence starts with "auto: "
            rewrite.report.tuned = decision.reason
            rewrite.report.add_note(decision.reason.render())
        else:
            rewrite.report.decline("fuse-only", decision.reason)
        log.log(split_skip_level(rewrite.config), "weavepass: graph %d: %s", rewrite.report.graph_index,
                rewrite.report.notes[-1])
