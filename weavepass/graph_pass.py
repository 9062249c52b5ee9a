"""``WeavePass``: the Inductor post-grad pass that rewrites all_reduce -> add -> RMSNorm sites."""

from __future__ import annotations

import hashlib
import itertools
import logging
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Callable

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

import weavepass.ops  # noqa: F401  (registers torch.ops.weave.*)
from weavepass.config import WeaveConfig
from weavepass.ops import FUSED_ALLREDUCE_RMSNORM
from weavepass.patterns import find_allreduce_rmsnorm_sites
from weavepass.report import AllReduceRecord, GraphReport
from weavepass.scheduler import CUDA_COPY_NOTE, INDUCTOR_CUDAGRAPHS_NOTE, plan_sites

log = logging.getLogger("weavepass")

_PACKAGE = Path(__file__).resolve().parent


def op_counts(graph: torch.fx.Graph) -> Counter:
    """``{"ns.op.overload": count}`` for every call_function in ``graph``."""
    counts = Counter()
    for node in graph.nodes:
        if node.op == "call_function":
            counts[_op_name(node.target)] += 1
    return counts


def _op_name(target) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._opname}.{target._overloadname}"
    return getattr(target, "__name__", str(target))


def source_hash() -> str:
    """Hash of every source file of the package, so caches change when the pass code does."""
    files = tuple(sorted(str(p) for p in _PACKAGE.rglob("*.py")))
    return get_hash_for_files(files).hex()


class WeavePass(CustomGraphPass):
    """Find sites, plan them, rewrite them, and hand a ``GraphReport`` to ``on_report``.

    ``graph_ids`` numbers the reported graphs; a backend passes its own counter, so its report
    numbers its graphs from 0 across the passes it creates (one per compiled graph)."""

    def __init__(self, config: WeaveConfig, on_report: Callable[[GraphReport], None] | None = None,
                 graph_ids: Iterator[int] | None = None):
        self.config = config
        self.on_report = on_report
        self.graph_ids = graph_ids if graph_ids is not None else itertools.count()

    def uuid(self) -> str:
        return hashlib.sha256(f"{source_hash()}|{self.config!r}".encode()).hexdigest()

    def __call__(self, graph: torch.fx.Graph) -> None:
        report = GraphReport(next(self.graph_ids), ops_before=op_counts(graph))
        if not self.config.enabled:
            report.add_note("WeaveConfig.enabled is False")
        else:
            self._rewrite(graph, report)
        report.ops_after = op_counts(graph)
        if self.on_report is not None:
            self.on_report(report)

    def _rewrite(self, graph: torch.fx.Graph, report: GraphReport) -> None:
        position = {n: i for i, n in enumerate(graph.nodes)}
        sites, rejected = find_allreduce_rmsnorm_sites(graph)
        records: dict[int, AllReduceRecord] = {}
        for rejection in rejected:
            name = rejection.all_reduce.name
            records[position[rejection.all_reduce]] = AllReduceRecord(name, False, rejection.reason)
            log.info("weavepass: %s left alone: %s", name, rejection.reason)
        plans = plan_sites(sites, self.config)
        for plan in plans:
            site = plan.site
            matmul = site.matmul.name if site.matmul is not None else ""
            records[position[site.all_reduce]] = AllReduceRecord(
                site.all_reduce.name, True, plan.reason, site.kind, "", matmul
            )
        report.records = [records[i] for i in sorted(records)]
        by_name = {r.node: r for r in report.records}
        if plans and plans[0].reason == INDUCTOR_CUDAGRAPHS_NOTE:  # graph-wide: no strategy runs
            report.add_note(f"not rewritten: {INDUCTOR_CUDAGRAPHS_NOTE}")
            log.warning("weavepass: graph %d %s", report.graph_index, report.notes[-1])
            return

        if self.config.enable_flashcomm:
            from weavepass.flashcomm import apply_flashcomm

            if apply_flashcomm(graph, plans, self.config, report):
                graph.lint()
                return

        fused = []
        for plan in plans:
            record = by_name[plan.site.all_reduce.name]
            if plan.lowering is None:
                log.info("weavepass: %s matched but not rewritten: %s", record.node, plan.reason)
                continue
            plan.site.lowering = plan.lowering
            fused.append(plan.site.replace_with(graph, FUSED_ALLREDUCE_RMSNORM))
            record.lowering = plan.lowering
            log.info("weavepass: %s fused (%s) -> %s", record.node, record.kind, plan.lowering)
            if plan.reason:  # a fallback is a warning; the cuda_symm copy is only information
                level = logging.INFO if plan.reason == CUDA_COPY_NOTE else logging.WARNING
                log.log(level, "weavepass: %s: %s", record.node, plan.reason)

        if self.config.overlap != "off" and report.records:  # also says why a graph is not split
            from weavepass.token_split import apply_token_split

            apply_token_split(graph, fused, self.config, report)
        graph.lint()
