"""The interface every graph-wide strategy implements, and what a strategy sees of one rewrite.

``WeavePass`` runs its strategies in order on each graph: for each, ``decide()``; on yes,
``apply()``; on no, ``decline()`` reports why (a ``NOT_ASKED`` decision is not reported). A
strategy whose ``apply()`` returns True has taken the whole graph: the strategies after it do not
run. The backend merges every strategy's ``inductor_patches(config)`` into Inductor's config.
Adding a strategy means adding one class and listing it in ``weavepass.compile.strategies``.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

import torch

from weavepass.config import WeaveConfig
from weavepass.compile.planner import NO_REASON, SitePlan
from weavepass.compile.reasons import Reason, ReasonCode
from weavepass.report import GraphReport


TRAINING = Reason(ReasonCode.TRAINING)
"""Why FlashComm and the token split refuse a training graph."""


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

    @property
    def training(self) -> bool:
        return any(plan.site.training for plan in self.plans)


class Strategy(abc.ABC):
    """One graph-wide rewrite (fuse, token split, FlashComm, ...)."""

    name: str

    def inductor_patches(self, config: WeaveConfig) -> dict:
        """Inductor config entries a graph this strategy may rewrite needs (none by default)."""
        return {}

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
