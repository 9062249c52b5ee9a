"""``WeavePass``: the Inductor post-grad pass that rewrites all_reduce -> add -> RMSNorm sites:
find sites (``patterns``), plan each (``planner``), then run the strategies in order (``strategies``)."""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import logging
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from weavepass.config import WeaveConfig
from weavepass.compile.patterns import find_allreduce_rmsnorm_sites, fold_sums_read_back
from weavepass.compile.planner import plan_sites
from weavepass.compile.reasons import ReasonCode
from weavepass.compile.strategies import STRATEGIES, GraphRewrite
from weavepass.compile.plan_check import check_plan_across_ranks
from weavepass.compile.strategies.base import ContractError, check_writes, snapshot
from weavepass.tune.table import load_table
from weavepass.report import AllReduceRecord, GraphReport

log = logging.getLogger("weavepass")

_PACKAGE = Path(__file__).resolve().parent.parent  # the whole weavepass package


def nothing_to_rewrite_note(num_all_reduces: int) -> str:
    """The graph-wide note when no all_reduce of a graph is a site."""
    if num_all_reduces == 0:
        return "nothing to rewrite: the graph has no all_reduce"
    return (f"nothing to rewrite: none of its {num_all_reduces} all_reduce(s) is a sum -> [add "
            "residual ->] RMSNorm or LayerNorm that weave can fuse (each one's reason is listed)")


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


def environment_key() -> str:
    """What the rewrite reads about the process and not from the graph: each process group's
    name, size and backend (a FlashComm graph bakes in the world size: a graph cached at world 2
    and loaded at world 4 fails), which devices and lowerings are available here, and the GPU's
    SM count (the split's cut depends on it). Not the rank:
    the rewrite is the same on every rank, so ranks may share one cache."""
    groups = []
    if dist.is_initialized():
        from torch.distributed.distributed_c10d import _world

        groups = sorted((name, pg.size(), str(dist.get_backend(pg))) for pg, name in _world.pg_names.items())
    cuda = torch.cuda.is_available()
    devices = {
        "cuda": torch.cuda.get_device_capability() if cuda else None,
        # The split's wave model cuts where the GEMM waves of this GPU's SM count fall.
        "sms": torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        if cuda else None,
        "triton": importlib.util.find_spec("triton") is not None,
        "torch_npu": importlib.util.find_spec("torch_npu") is not None,
    }
    return f"{groups}|{devices}"


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
        """Inductor's cache key for this pass: everything the rewrite reads besides the graph
        (which Inductor keys itself): the code, the config, the tuning table's contents and
        ``environment_key()``."""
        table = load_table(self.config.tuning_table)  # its contents, not only its path
        digest = table.digest if table is not None else ""
        return hashlib.sha256(f"{source_hash()}|{self.config!r}|{digest}|{environment_key()}".encode()).hexdigest()

    def __call__(self, graph: torch.fx.Graph) -> None:
        report = GraphReport(next(self.graph_ids), ops_before=op_counts(graph))
        if not self.config.enabled:
            report.add_note("WeaveConfig.enabled is False")
        else:
            self._rewrite(graph, report)
            if self.config.check_plan_across_ranks:
                check_plan_across_ranks(graph, report.graph_index, self.config.plan_check_timeout_s)
        report.ops_after = op_counts(graph)
        if self.on_report is not None:
            self.on_report(report)

    def _rewrite(self, graph: torch.fx.Graph, report: GraphReport) -> None:
        fold_sums_read_back(graph)
        position = {n: i for i, n in enumerate(graph.nodes)}
        sites, rejected = find_allreduce_rmsnorm_sites(graph)
        records: dict[int, AllReduceRecord] = {}
        for rejection in rejected:
            name = rejection.all_reduce.name
            records[position[rejection.all_reduce]] = AllReduceRecord(name, False, [rejection.reason])
            log.info("weavepass: %s left alone: %s", name, rejection.reason)
        plans = plan_sites(sites, self.config)
        for plan in plans:
            site = plan.site
            matmul = site.matmul.name if site.matmul is not None else ""
            reasons = [plan.reason] if plan.code is not ReasonCode.NONE else []
            records[position[site.all_reduce]] = AllReduceRecord(
                site.all_reduce.name, True, reasons, site.kind, "", matmul
            )
        report.records = [records[i] for i in sorted(records)]
        for plan in plans:  # a merged all_reduce has no record of its own: the graph says where it went
            site = plan.site
            partner = site.inner.merged if site.inner is not None else None
            if partner is not None and plan.lowering is not None:  # merged only when rewritten
                report.add_note(f"{partner.all_reduce.name} is summed with {site.all_reduce.name}'s sum "
                                f"into one all_reduce (see {site.all_reduce.name})")
        if not sites:
            report.add_note(nothing_to_rewrite_note(len(rejected)))
            log.info("weavepass: graph %d: %s", report.graph_index, report.notes[-1])
        if plans and plans[0].code is ReasonCode.INDUCTOR_CUDAGRAPHS:  # graph-wide: no strategy runs
            report.decline("not rewritten", plans[0].reason)
            log.warning("weavepass: graph %d %s", report.graph_index, report.notes[-1])
            return

        rewrite = GraphRewrite(graph, plans, self.config, report)
        for strategy in STRATEGIES:
            before = snapshot(rewrite)
            decision = strategy.decide(rewrite)
            took_graph = False
            if decision.use:
                took_graph = strategy.apply(rewrite, decision)
            elif decision.code is not ReasonCode.NOT_ASKED:
                strategy.decline(rewrite, decision)
            check_writes(strategy, before, rewrite)
            if took_graph:
                if not strategy.takes_graph:
                    raise ContractError(f"{strategy.name} took the graph without declaring takes_graph")
                break
        graph.lint()
