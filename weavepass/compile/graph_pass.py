"""``WeavePass``: the Inductor post-grad pass that rewrites all_reduce -> add -> RMSNorm sites."""

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

import weavepass.ops  # noqa: F401  (registers torch.ops.weave.*)
from weavepass.config import WeaveConfig
from weavepass.ops import FUSED_ALLREDUCE_RMSNORM, FUSED_ALLREDUCE_RMSNORM_TRAIN
from weavepass.compile.patterns import find_allreduce_rmsnorm_sites
from weavepass.plan_check import check_plan_across_ranks
from weavepass.replication import insert_checks
from weavepass.report import AllReduceRecord, GraphReport
from weavepass.compile.planner import CUDA_COPY_NOTE, INDUCTOR_CUDAGRAPHS_NOTE, plan_sites

log = logging.getLogger("weavepass")

_PACKAGE = Path(__file__).resolve().parent.parent  # the whole weavepass package


FLASHCOMM_DROPS_OVERLAP_NOTE = (
    "overlap={overlap!r} dropped: FlashComm took this graph, and the token split overlaps only "
    "fused all_reduce sites, of which FlashComm leaves none"
)

TRAINING_NOTE = (
    "training: the norms' inverse RMS is saved for backward; FlashComm and the token split "
    "rewrite inference graphs only (the graph's sites are fused without them)"
)


def nothing_to_rewrite_note(num_all_reduces: int) -> str:
    """The graph-wide note when no all_reduce of a graph is a site."""
    if num_all_reduces == 0:
        return "nothing to rewrite: the graph has no all_reduce"
    return (f"nothing to rewrite: none of its {num_all_reduces} all_reduce(s) feeds an "
            "[add residual ->] RMSNorm (each one's reason is listed)")


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
    and loaded at world 4 fails), and which devices and lowerings are available here. Not the rank:
    the rewrite is the same on every rank, so ranks may share one cache."""
    groups = []
    if dist.is_initialized():
        from torch.distributed.distributed_c10d import _world

        groups = sorted((name, pg.size(), str(dist.get_backend(pg))) for pg, name in _world.pg_names.items())
    cuda = torch.cuda.is_available()
    devices = {
        "cuda": torch.cuda.get_device_capability() if cuda else None,
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
        (which Inductor keys itself): the code, the config and ``environment_key()``."""
        return hashlib.sha256(f"{source_hash()}|{self.config!r}|{environment_key()}".encode()).hexdigest()

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
        if not sites:
            report.add_note(nothing_to_rewrite_note(len(rejected)))
            log.info("weavepass: graph %d: %s", report.graph_index, report.notes[-1])
        if plans and plans[0].reason == INDUCTOR_CUDAGRAPHS_NOTE:  # graph-wide: no strategy runs
            report.add_note(f"not rewritten: {INDUCTOR_CUDAGRAPHS_NOTE}")
            log.warning("weavepass: graph %d %s", report.graph_index, report.notes[-1])
            return

        training = any(plan.site.training for plan in plans)
        if self.config.enable_flashcomm and training:
            report.add_note(f"FlashComm not used: {TRAINING_NOTE}")
            log.warning("weavepass: graph %d: %s", report.graph_index, report.notes[-1])
        elif self.config.enable_flashcomm:
            from weavepass.compile.strategies.flashcomm import apply_flashcomm

            if apply_flashcomm(graph, plans, self.config, report):
                if self.config.overlap != "off":
                    report.add_note(FLASHCOMM_DROPS_OVERLAP_NOTE.format(overlap=self.config.overlap))
                    log.warning("weavepass: graph %d: %s", report.graph_index, report.notes[-1])
                if self.config.check_replicated:  # FlashComm shards the residual stream by design
                    report.add_note("check_replicated: not done in a FlashComm graph (the residual "
                                    "stream is sharded by token there)")
                graph.lint()
                return

        fused: dict[str, torch.fx.Node] = {}
        for plan in plans:
            record = by_name[plan.site.all_reduce.name]
            if plan.lowering is None:
                log.info("weavepass: %s matched but not rewritten: %s", record.node, plan.reason)
                continue
            plan.site.lowering = plan.lowering
            op = FUSED_ALLREDUCE_RMSNORM_TRAIN if plan.site.training else FUSED_ALLREDUCE_RMSNORM
            fused[record.node] = plan.site.replace_with(graph, op, self.config.cuda_workspace_tokens)
            record.lowering = plan.lowering
            log.info("weavepass: %s fused (%s) -> %s", record.node, record.kind, plan.lowering)
            if plan.reason:  # a fallback is a warning; the cuda_symm copy is only information
                level = logging.INFO if plan.reason == CUDA_COPY_NOTE else logging.WARNING
                log.log(level, "weavepass: %s: %s", record.node, plan.reason)

        if fused and self.config.check_replicated:
            checked = insert_checks(graph, fused)
            report.add_note(f"check_replicated: the residual and norm weight of {checked} site(s) "
                            "are compared across ranks on every call")
        if fused and self.config.overlap != "off" and training:
            report.add_note(f"fuse-only: {TRAINING_NOTE}")
            log.info("weavepass: graph %d: %s", report.graph_index, report.notes[-1])
        elif self.config.overlap != "off" and report.records:  # also says why a graph is not split
            from weavepass.compile.strategies.split import apply_token_split

            apply_token_split(graph, list(fused.values()), self.config, report)
        graph.lint()
