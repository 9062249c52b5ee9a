"""Fuse: each planned site becomes one ``weave`` fused op on its lowering."""

from __future__ import annotations

import logging

from weavepass.compile.patterns.rmsnorm import LAYER_NORM
from weavepass.compile.planner import gemm_epilogue_warns
from weavepass.compile.reasons import ReasonCode
from weavepass.compile.replication import insert_checks
from weavepass.compile.strategies.base import Decision, GraphRewrite, Strategy
from weavepass.ops import (
    FUSED_ALLREDUCE_LAYERNORM,
    FUSED_ALLREDUCE_RMSNORM,
    FUSED_ALLREDUCE_RMSNORM_QUANT,
    FUSED_ALLREDUCE_RMSNORM_TRAIN,
)

log = logging.getLogger("weavepass")


class FuseStrategy(Strategy):
    """Replace every site whose plan has a lowering with the fused op; with ``check_replicated``,
    then insert the cross-rank replication checks on the fused sites."""

    name = "fuse"
    reads = frozenset({"sites"})
    writes = frozenset({"sites", "fused", "records", "notes"})

    def decide(self, rewrite: GraphRewrite) -> Decision:
        # Per site, not per graph: each plan already says whether its site is fused and why not.
        return Decision(True)

    def apply(self, rewrite: GraphRewrite, decision: Decision) -> bool:
        records = {r.node: r for r in rewrite.report.records}
        said: dict[tuple[int, str], list[str]] = {}
        for plan in rewrite.plans:
            record = records[plan.site.all_reduce.name]
            if plan.lowering is None:
                log.info("weavepass: %s matched but not rewritten: %s", record.node, plan.reason)
                continue
            op = FUSED_ALLREDUCE_RMSNORM
            if plan.site.training:
                op = FUSED_ALLREDUCE_RMSNORM_TRAIN
            elif plan.site.norm.kind == LAYER_NORM:
                op = FUSED_ALLREDUCE_LAYERNORM
            elif plan.site.quant is not None:
                op = FUSED_ALLREDUCE_RMSNORM_QUANT
            rewrite.fused[record.node] = plan.site.replace_with(
                rewrite.graph, op, plan.lowering, rewrite.config.cuda_workspace_tokens)
            record.lowering = str(plan.lowering)
            if plan.site.quant_left is not None:
                log.info("weavepass: %s: %s", record.node, plan.site.quant_left.text)
            log.info("weavepass: %s fused (%s) -> %s", record.node, record.kind, plan.lowering)
            if plan.code is not ReasonCode.NONE:  # a fallback is a warning; the cuda_symm copy is information
                level = logging.INFO if plan.code is ReasonCode.CUDA_COPY else logging.WARNING
                said.setdefault((level, plan.reason.render()), []).append(record.node)
            if plan.epilogue.code is not ReasonCode.NONE:
                level = logging.WARNING if gemm_epilogue_warns(plan.epilogue, rewrite.config.gemm_epilogue) \
                    else logging.INFO
                said.setdefault((level, plan.epilogue.render()), []).append(record.node)
        for (level, reason), nodes in said.items():  # one line per reason, not one per site
            where = nodes[0] if len(nodes) == 1 else (
                f"graph {rewrite.report.graph_index}: {len(nodes)} site(s) ({', '.join(nodes)})")
            log.log(level, "weavepass: %s: %s", where, reason)
        if rewrite.fused and rewrite.config.check_replicated:
            checked = insert_checks(rewrite.graph, rewrite.fused)
            rewrite.report.add_note(f"check_replicated: the residual and norm weight of {checked} "
                                    "site(s) are compared across ranks on every call")
        for plan in rewrite.plans:  # after the checks, which read the fused op's arguments
            if plan.matmul is not None:  # weave.matmul_reduce_scatter_rmsnorm (WeaveConfig.gemm_epilogue)
                name = plan.site.all_reduce.name
                rewrite.fused[name] = plan.matmul.absorb(rewrite.graph, rewrite.fused[name])
        return False
