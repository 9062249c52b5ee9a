"""``WeavePass``: the Inductor post-grad pass that rewrites all_reduce -> add -> RMSNorm sites:
find sites (``patterns``), plan each (``planner``), then run the strategies in order (``strategies``).

Users get it from ``weavepass.inductor_pass(config)`` (``weavepass/inductor.py``), which also
installs the direct calls; the ``weave`` backend builds it the same way."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import itertools
import logging
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from weavepass.compile import dump
from weavepass.compile.patterns import distribute_scales, find_allreduce_rmsnorm_sites, fold_sums_read_back
from weavepass.compile.plan_check import check_plan_across_ranks
from weavepass.compile.planner import plan_sites
from weavepass.compile.reasons import Reason, ReasonCode
from weavepass.compile.strategies import STRATEGIES, Decision, GraphRewrite, Strategy, inductor_patches
from weavepass.compile.strategies.base import ContractError, check_writes, snapshot
from weavepass.compile.where import where_reduced
from weavepass.config import WeaveConfig
from weavepass.report import AllReduceRecord, GraphReport, WeaveReport
from weavepass.tune.table import load_table

log = logging.getLogger("weavepass")

_PACKAGE = Path(__file__).resolve().parent.parent  # the whole weavepass package


def nothing_to_rewrite_note(num_all_reduces: int) -> str:
    """The graph-wide note when no all_reduce of a graph is a site."""
    if num_all_reduces == 0:
        return "nothing to rewrite: the graph has no all_reduce"
    return (f"nothing to rewrite: none of its {num_all_reduces} all_reduce(s) is a sum -> [add "
            "residual ->] RMSNorm or LayerNorm that weave can fuse (each one's reason is listed)")


def op_counts(graph: torch.fx.Graph) -> Counter[str]:
    """``{"ns.op.overload": count}`` for every call_function in ``graph``."""
    counts: Counter[str] = Counter()
    for node in graph.nodes:
        if node.op == "call_function":
            counts[_op_name(node.target)] += 1
    return counts


def _op_name(target: object) -> str:
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


GraphPass = Callable[[torch.fx.Graph], None]
"""What Inductor's ``post_grad_custom_pre_pass`` holds: a ``CustomGraphPass`` or a plain function."""


def current_setting(key: str) -> Any:
    """Inductor's config value ``key`` now (dotted keys name nested configs); ``AttributeError``
    where this torch has no such setting."""
    import torch._inductor.config as inductor_config

    return functools.reduce(getattr, key.split("."), inductor_config)


def unmet_settings(needed: dict[str, Any]) -> dict[str, Any]:
    """``{key: current value}`` for each Inductor setting of ``needed`` that the running compile
    has otherwise (settings this torch lacks count as met: nothing can set them)."""
    unmet = {}
    for key, value in needed.items():
        try:
            current = current_setting(key)
        except AttributeError:
            continue
        if current != value:
            unmet[key] = current
    return unmet


_WARNED: set[tuple[str, ...]] = set()


def _warn_once(*key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning("weavepass: %s", message)


class SettingsNeeded(Exception):  # noqa: N818  (a request, not an error: the backend compiles again)
    """A strategy decided to apply to a graph whose compile lacks its Inductor settings, which the
    pass deferred (``WeavePass.defer_settings``): raised out of the compile so that
    ``backend="weave"`` compiles the graph again with ``settings`` (as graph ``graph_index``)."""

    def __init__(self, strategy: str, settings: dict[str, Any], graph_index: int):
        super().__init__(f"the {strategy} strategy applies to graph {graph_index} and needs the Inductor "
                         f"settings {settings}: compile it again with them")
        self.strategy, self.settings, self.graph_index = strategy, settings, graph_index


def settings_needed(error: BaseException) -> SettingsNeeded | None:
    """The ``SettingsNeeded`` that ``error`` is or wraps (Inductor wraps a pass's exception in an
    ``InductorError``), else None."""
    seen = 0
    current: BaseException | None = error
    while current is not None and seen < 8:
        if isinstance(current, SettingsNeeded):
            return current
        current = getattr(current, "inner_exception", None) or current.__cause__ or current.__context__
        seen += 1
    return None


class WeavePass(CustomGraphPass):
    """Find sites, plan them, rewrite them, and add a ``GraphReport`` to ``report`` (then hand it
    to ``on_report``).

    ``graph_ids`` numbers the reported graphs; a backend passes its own counter and report, so its
    report numbers its graphs from 0 across the passes it creates (one per compiled graph).
    ``chain``: passes that were in Inductor's ``post_grad_custom_pre_pass`` before this one; each
    runs first, in order, on every graph this pass sees. ``check_settings``: a strategy whose
    Inductor settings the running compile lacks is declined (``weavepass.inductor_pass`` sets it;
    graph-level tests that call the pass outside a compile do not). ``defer_settings`` (the
    backend's): the settings of strategies that defer theirs (``Strategy.defers_settings``: the
    split with ``split="auto"``) are left out of ``config_patches()``, and when such a strategy
    decides to apply to a graph whose compile lacks them, the pass raises ``SettingsNeeded``
    instead of declining (the backend then compiles that graph again with them)."""

    def __init__(self, config: WeaveConfig, on_report: Callable[[GraphReport], None] | None = None,
                 graph_ids: Iterator[int] | None = None, *, report: WeaveReport | None = None,
                 chain: Sequence[GraphPass] = (), check_settings: bool = False, defer_settings: bool = False):
        self.config = config
        self.check_settings = check_settings
        self.defer_settings = defer_settings
        self.on_report = on_report
        self.graph_ids = graph_ids if graph_ids is not None else itertools.count()
        self.report = report if report is not None else WeaveReport()
        """Every graph this pass rewrote or left alone, in compile order (``print(pass_.report)``)."""
        self.chain = tuple(chain)

    def uuid(self) -> str | tuple[Any, ...] | None:
        """Inductor's cache key for this pass: everything the rewrite reads besides the graph
        (which Inductor keys itself): the code, the config, the tuning table's contents and
        ``environment_key()``, and the graph dump directory when one is set (so that a dump is
        written, not skipped by a cache hit).
        Chained passes add their own ``uuid()``; when one has none (a plain function, or a pass
        whose ``uuid()`` is None), this is None too, and Inductor does not cache the graph, as it
        would not for that pass alone. Inductor asks for it when it looks a graph up in its caches."""
        self._warn_about_caching()
        table = load_table(self.config.tuning_table)  # its contents, not only its path
        digest = table.digest if table is not None else ""
        key = f"{source_hash()}|{self.config!r}|{digest}|{environment_key()}"
        dump_dir = dump.directory(self.config)
        if dump_dir is not None:
            key += f"|dump {dump_dir}"
        if self.defer_settings:  # a graph this pass declines for lacking settings, another raises for
            key += "|deferred settings"
        own = hashlib.sha256(key.encode()).hexdigest()
        if not self.chain:
            return own
        others = [p.uuid() if isinstance(p, CustomGraphPass) else None for p in self.chain]
        return None if any(not u for u in others) else (own, *others)

    def strategy_settings(self) -> dict[str, Any]:
        """The Inductor settings the strategies this config enables need (the split:
        ``reorder_for_peak_memory=False``, ``shape_padding=False``; FlashComm: ``shape_padding=False``),
        without the deferred ones where ``defer_settings``."""
        return inductor_patches(self.config, deferred=not self.defer_settings)

    def inductor_settings(self) -> dict[str, Any]:
        """``strategy_settings()``, and ``fx_graph_cache=False`` unless ``WeaveConfig.fx_graph_cache``
        (a graph loaded from Inductor's cache skips the pass, and the report would miss it)."""
        settings = self.strategy_settings()
        if not self.config.fx_graph_cache:
            settings["fx_graph_cache"] = False
        return settings

    def config_patches(self) -> dict[str, Any]:
        """Everything to patch into Inductor's config for this pass: the pass itself and
        ``inductor_settings()``. ``torch._inductor.config.patch(pass_.config_patches())`` or
        ``torch.compile(model, options=pass_.config_patches())``."""
        return {"post_grad_custom_pre_pass": self, **self.inductor_settings()}

    def __call__(self, graph: torch.fx.Graph) -> None:
        for chained in self.chain:
            chained(graph)
        report = GraphReport(next(self.graph_ids), ops_before=op_counts(graph))
        dumps = dump.GraphDumps.start(self.config, graph, report)
        if not self.config.enabled:
            report.add_note("WeaveConfig.enabled is False")
        else:
            self._rewrite(graph, report, dumps)
            if self.config.check_plan_across_ranks:
                check_plan_across_ranks(graph, report.graph_index, self.config.plan_check_timeout_s)
        report.ops_after = op_counts(graph)
        if dumps is not None:
            dumps.finish(graph, report)
        self.report.graphs.append(report)
        if self.on_report is not None:
            self.on_report(report)

    def _warn_about_caching(self) -> None:
        """Inductor's FX-graph cache on while the config says off: only possible where the pass was
        patched in without ``inductor_settings()`` (the backend applies them). Called from
        ``uuid()``, which Inductor calls before a cache lookup, so a hit warns too."""
        if not self.config.fx_graph_cache and current_setting("fx_graph_cache"):
            _warn_once("fx_graph_cache", message=(
                "Inductor's FX-graph cache is on (fx_graph_cache=True) although WeaveConfig.fx_graph_cache "
                "is False: a graph loaded from the cache later skips this pass, so the report lacks it "
                "(the rewrite itself is cached and stays correct). Patch in pass_.config_patches(), not "
                "only the pass, to turn it off"))

    def _unmet_settings_decision(self, strategy: Strategy) -> Decision | None:
        """A no for ``strategy`` when the compile lacks an Inductor setting it needs (the pass was
        patched in without ``inductor_settings()``), else None. Every rank compiles with the same
        settings, so every rank decides the same."""
        unmet = unmet_settings(strategy.inductor_patches(self.config))
        if not unmet:
            return None
        needed = strategy.inductor_patches(self.config)
        reason = Reason.of(ReasonCode.INDUCTOR_SETTINGS, strategy=strategy.name,
                           settings=tuple((key, needed[key], current) for key, current in unmet.items()))
        _warn_once("settings", strategy.name, *sorted(unmet), message=reason.render())
        return Decision(False, reason)

    def _settings_needed(self, strategy: Strategy, graph_index: int, deferred: bool) -> None:
        """``GraphRewrite.before_rewrite``: raise ``SettingsNeeded`` where ``strategy`` deferred
        its Inductor settings and this compile lacks them (the backend compiles again with them)."""
        needed = strategy.inductor_patches(self.config)
        if deferred and unmet_settings(needed):
            raise SettingsNeeded(strategy.name, needed, graph_index)

    def _rewrite(self, graph: torch.fx.Graph, report: GraphReport, dumps: dump.GraphDumps | None) -> None:
        fold_sums_read_back(graph)
        distribute_scales(graph)
        position = {n: i for i, n in enumerate(graph.nodes)}
        sites, rejected = find_allreduce_rmsnorm_sites(graph)
        records: dict[int, AllReduceRecord] = {}
        for rejection in rejected:
            name = rejection.all_reduce.name
            place = where_reduced(rejection.all_reduce)
            records[position[rejection.all_reduce]] = AllReduceRecord(name, False, [rejection.reason], where=place)
            log.info("weavepass: %s (%s) left alone: %s", name, place or "no source metadata", rejection.reason)
        plans = plan_sites(sites, self.config)
        for plan in plans:
            site = plan.site
            matmul = site.matmul.name if site.matmul is not None else ""
            reasons = [r for r in (plan.reason, plan.epilogue) if r.code is not ReasonCode.NONE]
            records[position[site.all_reduce]] = AllReduceRecord(
                site.all_reduce.name, True, reasons, site.kind, "", matmul, where=where_reduced(site.all_reduce),
                quant_left=None if site.quant_left is None else site.quant_left.reason,
            )
        report.records = [records[i] for i in sorted(records)]
        for plan in plans:  # a merged all_reduce has no record of its own: the graph says where it went
            site = plan.site
            for partner in site.inner.merged_sums if site.inner is not None else []:
                if plan.lowering is None:  # merged only when rewritten
                    break
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
            deferred = self.check_settings and self.defer_settings and strategy.defers_settings(self.config)
            if decision.use and self.check_settings and not deferred:
                decision = self._unmet_settings_decision(strategy) or decision
            if decision.use:
                rewrite.before_rewrite = functools.partial(self._settings_needed, strategy, report.graph_index,
                                                           deferred)
                took_graph = strategy.apply(rewrite, decision)
                if dumps is not None:
                    dumps.after(strategy.name, graph)
            elif decision.code is not ReasonCode.NOT_ASKED:
                strategy.decline(rewrite, decision)
            check_writes(strategy, before, rewrite)
            if took_graph:
                if not strategy.takes_graph:
                    raise ContractError(f"{strategy.name} took the graph without declaring takes_graph")
                break
        graph.lint()
