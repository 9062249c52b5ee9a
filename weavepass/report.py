"""The explain report: every all_reduce the pass saw, whether it was rewritten, and why not."""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from weavepass.compile.reasons import Reason, ReasonCode


REPLICATED_ASSUMPTION = (
    "the residual stream and the norm weights are the same on every rank of a group, as tensor "
    "parallelism keeps them (each rank normalises its own rows with its own copy); "
    "WeaveConfig(check_replicated=True) checks it at run time"
)


@dataclass
class AllReduceRecord:
    """One all_reduce in one graph."""

    node: str
    matched: bool
    reasons: list[Reason] = field(default_factory=list)
    """Why it is not rewritten, or not the first way it could be (codes for code and tests)."""
    kind: str = ""
    lowering: str = ""
    matmul: str = ""
    notes: list[Reason] = field(default_factory=list)
    """How it was rewritten, where there was a choice (FlashComm's per-site notes, each a code and
    its fields; ``reason`` renders them)."""
    where: str = ""
    """The module that produced the sum and the source line of its all_reduce
    (``model.layers.0.mlp.down_proj (modeling_llama.py:123: ...)``, ``weavepass.compile.where``);
    "" where the graph carries no such metadata."""
    quant_left: Reason | None = None
    """Why a quantization of the site's normed rows stays outside the fused op (``QUANT_*``; the
    norm is fused all the same, and ``kind`` says it in words), or None."""

    @property
    def codes(self) -> list[ReasonCode]:
        return [r.code for r in self.reasons]

    @property
    def reason(self) -> str:
        """The reasons and notes, as users read them."""
        return "; ".join([r.render() for r in [*self.reasons, *self.notes]])


@dataclass
class GraphReport:
    """What the pass did to one post-grad graph."""

    graph_index: int
    records: list[AllReduceRecord] = field(default_factory=list)
    ops_before: Counter[str] = field(default_factory=Counter)
    ops_after: Counter[str] = field(default_factory=Counter)
    notes: list[str] = field(default_factory=list)
    reasons: list[Reason] = field(default_factory=list)
    """The graph-wide reasons among ``notes``, in order: why a strategy was not used (``decline``),
    or was used otherwise than the config asked (the split's ``split_comm="push"`` not used)."""
    tuned: Reason | None = None
    """``split="auto"`` with a tuning table: the table's call for this graph (``TUNED_*``, or
    ``TUNING_TABLE_NOT_APPLICABLE``), also among ``notes``; None where no table was read."""
    logged_as: int | None = None
    """In a report that numbers its graphs itself (``explain``, ``weave``): the number the backend
    gave this graph, which its log lines and errors use; None where the two are the same."""

    def add_note(self, text: str) -> None:
        """A graph-wide decision (a strategy used, or what it did); notes accumulate."""
        self.notes.append(text)

    def decline(self, prefix: str, reason: Reason) -> None:
        """A strategy not used on this graph: the note ``prefix: <reason>``, and the reason."""
        self.reasons.append(reason)
        self.add_note(f"{prefix}: {reason.render()}")

    @property
    def codes(self) -> list[ReasonCode]:
        """The codes of the graph-wide declines, in order."""
        return [r.code for r in self.reasons]

    @property
    def note(self) -> str:
        return "; ".join(self.notes)

    @property
    def matched(self) -> int:
        return sum(r.matched for r in self.records)

    @property
    def rewritten(self) -> int:
        return sum(bool(r.matched and r.lowering) for r in self.records)


@dataclass
class WeaveReport:
    """All graphs one backend compiled, in compile order."""

    graphs: list[GraphReport] = field(default_factory=list)
    _collected: list[GraphReport] = field(default_factory=list, repr=False, compare=False)
    """The backend's own reports of ``graphs`` (``add_graphs`` keeps renumbered copies)."""
    not_compiled: list[str] = field(default_factory=list)
    """Collectives that broke the graph and ran eagerly, not rewritten (``explain`` fills it from
    Dynamo's graph-break reasons, when it is the call that compiles them)."""

    def add_graphs(self, graphs: list[GraphReport]) -> None:
        """Add each of ``graphs`` not already here (by identity), in order. A collecting report
        (``explain``, ``weave``) numbers its graphs from 0 itself: the backend it shares with other
        calls counts every graph it ever compiled."""
        for graph in graphs:
            if not any(graph is g for g in self._collected):
                self._collected.append(graph)
                index = len(self.graphs)
                logged_as = graph.graph_index if graph.graph_index != index else None
                self.graphs.append(dataclasses.replace(graph, graph_index=index, logged_as=logged_as))

    @property
    def records(self) -> list[AllReduceRecord]:
        return [r for g in self.graphs for r in g.records]

    @property
    def matched(self) -> int:
        return sum(g.matched for g in self.graphs)

    @property
    def rewritten(self) -> int:
        return sum(g.rewritten for g in self.graphs)

    def __str__(self) -> str:
        lines = [f"weavepass: {len(self.graphs)} graph(s), {len(self.records)} all_reduce(s), "
                 f"{self.rewritten} rewritten"]
        if self.rewritten:
            lines.append(f"assumes: {REPLICATED_ASSUMPTION}")
        lines += [f"not in a compiled graph: {what}" for what in self.not_compiled]
        for g in self.graphs:
            logged = f" (graph {g.logged_as} in weavepass's log)" if g.logged_as is not None else ""
            lines.append(f"graph {g.graph_index}{logged}: {g.rewritten}/{len(g.records)} rewritten"
                         + (f" ({g.note})" if g.note else ""))
            for r in g.records:
                if r.matched and r.lowering:
                    status = f"fused  -> {r.lowering}"
                elif r.matched:
                    status = "kept   (site matched, not rewritten)"
                else:
                    status = "kept  "
                detail = "; ".join(x for x in (r.kind, r.reason, f"matmul {r.matmul}" if r.matmul else "") if x)
                lines.append(f"  {r.node:<20} {status:<22} {detail}")
                if r.where:
                    lines.append(f"  {'':<20} {'':<22} in {r.where}")
        return "\n".join(lines)
