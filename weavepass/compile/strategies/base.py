"""The interface every graph-wide strategy implements, and what a strategy sees of one rewrite.

``WeavePass`` runs its strategies in order on each graph: for each, ``decide()``; on yes,
``apply()``; on no, ``decline()`` reports why (a ``NOT_ASKED`` decision is not reported). A
strategy whose ``apply()`` returns True has taken the whole graph: the strategies after it do not
run. The backend merges every strategy's ``inductor_patches(config)`` into Inductor's config
(those of a strategy that ``defers_settings`` only once it may rewrite the graph: the backend then
compiles that graph again with them).

The contract: each strategy states what of the ``GraphRewrite`` it reads and writes (``reads``,
``writes``: ``Part`` names) and whether it may take the whole graph. ``check_order`` checks an
order against it (``weavepass.compile.strategies`` checks ``STRATEGIES`` on import), and
``WeavePass`` checks after each strategy that it changed nothing it did not declare. Adding a
strategy means adding one class, stating its contract, and listing it in
``weavepass.compile.strategies`` where its reads are written.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch

from weavepass.compile.planner import NO_REASON, SitePlan
from weavepass.compile.reasons import Reason, ReasonCode
from weavepass.compile.tuned import TunedDecision
from weavepass.config import WeaveConfig
from weavepass.report import GraphReport

TRAINING = Reason(ReasonCode.TRAINING)
"""Why FlashComm and the split refuse a training graph."""


@dataclass(frozen=True)
class Decision:
    """Whether a strategy rewrites the graph, and if not, why."""

    use: bool
    reason: Reason = NO_REASON
    stopped_at: str = ""
    """The all_reduce whose site stopped the strategy, when a particular one did."""

    @property
    def code(self) -> ReasonCode:
        return self.reason.code


@dataclass
class GraphRewrite:
    """One graph being rewritten: what the strategies read and add to, in order."""

    graph: torch.fx.Graph
    plans: list[SitePlan]
    config: WeaveConfig
    report: GraphReport
    fused: dict[str, torch.fx.Node] = field(default_factory=dict)
    """all_reduce name -> the fused op that replaced its site (filled by the fuse strategy)."""
    before_rewrite: Callable[[], None] = field(default=lambda: None, repr=False)
    """What a strategy that defers its Inductor settings (``Strategy.defers_settings``) calls in
    ``apply`` once it may rewrite, before it reads what the settings change and before it changes
    the graph: the pass sets it (``graph_pass.SettingsNeeded`` is raised from it when the compile
    lacks the settings)."""
    training: bool = field(init=False)
    """A training graph's forward (a site's norm saves its inverse RMS for backward): read from
    the sites once, before any strategy rewrites them."""
    tuned: TunedDecision | None = field(init=False)
    """The tuning table's call for the graph (``planner.SitePlan.tuned``), read from the plans once."""

    def __post_init__(self) -> None:
        self.training = any(plan.site.training for plan in self.plans)
        self.tuned = next((plan.tuned for plan in self.plans if plan.tuned is not None), None)


Part = Literal["sites", "fused", "records", "notes"]
"""What of a ``GraphRewrite`` a strategy reads or writes:

* ``sites``: the planned, not yet rewritten sites (``plans``). Writing them is rewriting them away:
  after a strategy that writes them, they are no longer in the graph.
* ``fused``: ``GraphRewrite.fused``, the fused op of each site.
* ``records``: the report's per-all_reduce records (``lowering``, reasons, notes).
* ``notes``: the report's graph-wide notes and declines.
"""


class Strategy(abc.ABC):
    """One graph-wide rewrite (fuse, split, FlashComm, ...), and its contract."""

    name: str
    reads: ClassVar[frozenset[Part]]
    """What ``decide``, ``apply`` and ``decline`` read."""
    writes: ClassVar[frozenset[Part]]
    """What they change (the graph itself aside, which every strategy may rewrite)."""
    takes_graph: ClassVar[bool] = False
    """When it applies, it takes the whole graph (``apply`` returns True): no later strategy runs."""

    def inductor_patches(self, config: WeaveConfig) -> dict[str, Any]:
        """Inductor config entries a graph this strategy may rewrite needs (none by default)."""
        return {}

    def defers_settings(self, config: WeaveConfig) -> bool:
        """Whether a compile that can start again (``backend="weave"``) leaves ``inductor_patches``
        out until this strategy may rewrite (``graph_pass.SettingsNeeded``), so that the graphs it
        leaves alone compile with Inductor's own settings. Such a strategy's ``apply`` calls
        ``GraphRewrite.before_rewrite()`` once it may rewrite, before it reads what the settings
        change (so every rank decides the same) and before it changes the graph.
        False by default: the settings are patched in before the graph is seen."""
        return False

    @abc.abstractmethod
    def decide(self, rewrite: GraphRewrite) -> Decision:
        """Whether to ``apply`` to this graph. Reads shapes, the config and group sizes only, so
        every rank decides the same."""

    @abc.abstractmethod
    def apply(self, rewrite: GraphRewrite, decision: Decision) -> bool:
        """Rewrite the graph; True when the strategy took the whole graph (no later strategy runs)."""

    def decline(self, rewrite: GraphRewrite, decision: Decision) -> None:
        """Report a no (not called for ``NOT_ASKED``)."""
        rewrite.report.decline(f"{self.name} not used", decision.reason)


class ContractError(RuntimeError):
    """Strategies in an order, or a strategy's changes, that break the strategy contract."""


def check_order(strategies: Sequence[Strategy]) -> None:
    """Raise ``ContractError`` unless ``strategies`` can run in this order: whatever a strategy
    reads that a strategy of the list writes is written by an earlier one (the split reads
    the fuse strategy's ``fused``), and no strategy reads the ``sites`` after one that rewrites
    them without taking the whole graph (FlashComm, which takes it, runs before fuse)."""
    for i, strategy in enumerate(strategies):
        earlier, later = strategies[:i], strategies[i + 1:]
        for part in sorted(strategy.reads - {"sites"}):
            writers = [s.name for s in strategies if part in s.writes and s is not strategy]
            if writers and not any(part in s.writes for s in earlier):
                raise ContractError(f"{strategy.name} reads {part!r}, written by {', '.join(writers)}, "
                                    "which runs after it")
        if "sites" in strategy.writes and not strategy.takes_graph:
            readers = [s.name for s in later if "sites" in s.reads]
            if readers:
                raise ContractError(f"{', '.join(readers)} read(s) the sites after {strategy.name} "
                                    "rewrote them")


def snapshot(rewrite: GraphRewrite) -> dict[Part, object]:
    """What of ``rewrite`` each ``Part`` holds, to compare before and after a strategy ran."""
    report = rewrite.report
    return {
        "fused": dict(rewrite.fused),
        "records": [(r.lowering, list(r.reasons), list(r.notes)) for r in report.records],
        "notes": (list(report.notes), list(report.reasons), report.tuned),
    }


def check_writes(strategy: Strategy, before: dict[Part, object], rewrite: GraphRewrite) -> None:
    """Raise ``ContractError`` when ``strategy`` changed a part of ``rewrite`` it did not declare."""
    after = snapshot(rewrite)
    changed = sorted(part for part in before if before[part] != after[part] and part not in strategy.writes)
    if changed:
        raise ContractError(f"{strategy.name} changed {changed}, which it does not declare in writes")
