"""The split: a two-way token split of a post-grad graph whose sites are already fused (the design
of TokenWeave).

``apply_token_split(graph, fused_nodes, config, report)`` cuts the token dimension into halves A
and B from the first fused site to the last. Every token-wise node in that region is copied once
per half (weights and other token-free nodes are shared), every site becomes one
``weave.fused_allreduce_rmsnorm_async`` per half, and the copies are laid out per segment (the
nodes between two sites) as::

    [segment k, half A] [site k+1, A: comm stream] [segment k, half B] [site k+1, B: comm stream]

so half A's communication at a site runs while half B computes (attention A, attention B, MLP A,
MLP B, ...). Each async op is joined by one ``weave::join_async`` placed right before the first
read of either output; Inductor keeps extern kernels and joins in this order (see docs/overlap.md).

The cut: several sequences are cut between sequences (every op, attention included, sees only
whole sequences); one sequence is cut inside, and half B's queries attend to A's and B's keys and
values with the causal diagonal aligned at the lower right (a B query at position ``i`` sees keys
``0 .. sA + i``), A's keys and values being ready first. Anything the rewrite does not understand
(an op it has no rule for, a sort or a reduction over tokens; an MoE routing block that sorts the
token-expert pairs by expert is taken as a whole, ``routing``) leaves the graph fuse-only with the
reason in ``report.note``: the analysis finishes before the graph is touched.

Token counts: the first site's ``TokenCount`` (the planner's) goes to ``weavepass.compile.wave_model.plan_split``,
once per graph. Static shapes get its wave-aware cut. A
symbolic token count gets its cut computed at run time from the symbol (half the sequences; or
half the tokens rounded down to the GEMM row tile), so one graph serves every size from
``MIN_SYMBOLIC_UNITS`` (4) units on, through one guard; 2 or 3 units compile once more, fuse-only
(a one-unit half would specialise the graph). Views are rewritten with ``-1`` for the token entry,
so no other size needs arithmetic.

Modules: ``rules`` (which dim carries the tokens, one rule per op, registered by op),
``analysis`` (the rules over the region), ``attention`` (the attention ops' rule and a cut
sequence's attention), ``scores`` (attention written out as bmm + softmax + bmm over a cut
sequence), ``routing`` (MoE routing blocks that sort the pairs by expert), ``symbolic`` (the cut
and its size arithmetic), ``rewrite`` (the halves).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch.fx import Graph, Node

from weavepass.compile.fx_args import arguments
from weavepass.compile.reasons import Reason, ReasonCode, runtime_issue_reason
from weavepass.compile.tokens import TokenCount
from weavepass.compile.wave_model import plan_split, too_few_tokens_reason
from weavepass.config import Lowering, WeaveConfig
from weavepass.ops import FUSED_ALLREDUCE_LAYERNORM, FUSED_ALLREDUCE_RMSNORM
from weavepass.report import GraphReport

from .analysis import analyse
from .base import Unsupported
from .rewrite import rewrite
from .symbolic import MIN_SYMBOLIC_UNITS, Cut, hint

__all__ = ["INDUCTOR_CONFIG_PATCHES", "MIN_SYMBOLIC_UNITS", "OVERLAP_SCHEDULING", "Unsupported", "apply_token_split",
           "communication_variant", "inductor_config_patches"]

log = logging.getLogger("weavepass")

INDUCTOR_CONFIG_PATCHES = {"reorder_for_peak_memory": False, "shape_padding": False}
"""Inductor settings a split graph needs. The peak-memory reordering otherwise moves all of
half A's kernels ahead of half B's first fused op, undoing the overlap schedule. Shape padding
(``fx_passes/pad_mm.py``, static shapes on CUDA) pads a matmul's token rows to an aligned count
and slices them off again, *when a benchmark on this GPU finds that faster*: the graph the split
sees then depends on a timing, which can differ between ranks, and the split has no rule for the
pad (seen with 2 ranks on one H200, 257 tokens: "no rule for constant_pad_nd", while the same test
on a group of one rank split). Each half has its own token count anyway. The backend merges these
(``inductor_config_patches``) into its ``config_patches``: with ``split="force"`` before the graph is
seen; with ``split="auto"`` only for a graph whose token count may be in the window
(``may_be_in_window``), which it then compiles again with them (``graph_pass.SettingsNeeded``), so a
graph auto leaves unsplit keeps Inductor's own settings."""

OVERLAP_SCHEDULING = "aten_distributed_optimizations.enable_overlap_scheduling"
"""Inductor's opt-in collective overlap scheduler (torch 2.12+). It orders nodes by data
dependencies only, and ``weave::join_async`` has no users: it would schedule the join after the
reads of the outputs it joins (wrong answers; found by reading ``fx_passes/overlap_scheduling.py``,
not reproduced). Switched off in split graphs."""


def inductor_config_patches() -> dict[str, bool]:
    """``INDUCTOR_CONFIG_PATCHES``, plus the overlap scheduler off where this torch has it."""
    import torch._inductor.config as inductor_config

    patches = dict(INDUCTOR_CONFIG_PATCHES)
    try:
        inductor_config.aten_distributed_optimizations.enable_overlap_scheduling  # noqa: B018
    except AttributeError:  # torch 2.11: no such scheduler
        return patches
    patches[OVERLAP_SCHEDULING] = False
    return patches


def communication_variant(sites: list[Node], config: WeaveConfig) -> tuple[bool, str | None, Reason | None]:
    """``(push, note, refused)``: whether the sites become the push variant's op
    (``WeaveConfig.split_comm="push"``), the report's words for what the communication stream runs
    (None with the default, ``"fused"``), and why push was asked for and not used (or None). Push
    needs every site's group to have 2 ranks
    (``push_unsupported_reason``); a site on another lowering than ``cuda_symm`` still gets the op,
    which runs there as the fused async op, and the note says so. Every rank decides the same: group
    sizes and lowerings are the plan's, equal on every rank (``weavepass.compile.plan_check``)."""
    if config.split_comm != "push":
        return False, None, None
    from weavepass.runtime.cuda.support import push_unsupported_reason
    from weavepass.runtime.portable import resolve_group

    def refused(reason: Reason) -> tuple[bool, str, Reason]:
        return False, f"communication: fused kernel (split_comm='push' not used: {reason.render()})", reason

    if any(site.target is FUSED_ALLREDUCE_LAYERNORM for site in sites):
        return refused(Reason(ReasonCode.PUSH_LAYER_NORM))
    groups = sorted({str(arguments(site)["group_name"]) for site in sites})
    for group in groups:
        issue = push_unsupported_reason(resolve_group(group).size())
        if issue is not None:
            return refused(runtime_issue_reason(issue))
    others = sorted({str(arguments(site)["lowering"]) for site in sites} - {Lowering.CUDA_SYMM})
    if others:
        return True, (f"communication: push (slot 0 for A, 1 for B); sites on lowering {', '.join(others)} "
                      "run it as the fused async op (the push kernels are cuda_symm's)"), None
    return True, "communication: push (slot 0 for A, 1 for B)", None


def split_skip_level(config: WeaveConfig) -> int:
    """The log level of a graph left fuse-only: a warning where ``split="force"`` asked for the
    split; under ``"auto"`` not splitting is the cost model's call (INFO)."""
    return logging.WARNING if config.split == "force" else logging.INFO


def may_be_in_window(tokens: TokenCount, config: WeaveConfig) -> bool:
    """False where ``split="auto"`` certainly does not split ``tokens``: a static count outside
    both windows (dense and MoE: which one applies is known only after the analysis), or a
    symbolic count where both windows are one size (``wave_model.split_window_reason``). Installs
    no guard. True for every other count and for the other split modes."""
    if config.split != "auto":
        return True
    low = min(config.split_min_tokens, config.split_min_tokens_moe)
    if tokens.symbolic:
        return not config.split_min_tokens == config.split_min_tokens_moe == config.split_max_tokens
    return low <= tokens.hint <= config.split_max_tokens


def apply_token_split(
    graph: Graph, fused_nodes: list[Node], config: WeaveConfig, report: GraphReport,
    before_rewrite: Callable[[], None] = lambda: None,
) -> bool:
    """Split the token dimension into two overlapped halves; returns True when the graph changed.

    On any reason not to split, the graph stays fuse-only and ``report.note`` says why.
    ``before_rewrite`` (``GraphRewrite.before_rewrite``) is called once the token count alone does
    not rule the split out (``may_be_in_window``), before the analysis reads the graph's matmuls.
    """
    def skip(reason: Reason) -> bool:
        report.decline("fuse-only", reason)
        log.log(split_skip_level(config), "weavepass: graph %d: split skipped: %s", report.graph_index, reason)
        return False

    fused_nodes = [n for n in fused_nodes if n.target in (FUSED_ALLREDUCE_RMSNORM, FUSED_ALLREDUCE_LAYERNORM)]
    if not fused_nodes:
        return skip(Reason(ReasonCode.SPLIT_NOTHING_FUSED))
    if len(fused_nodes) < 2:
        return skip(Reason(ReasonCode.SPLIT_ONE_SITE))
    position = {n: i for i, n in enumerate(graph.nodes)}
    sites = sorted(fused_nodes, key=position.__getitem__)
    partial = arguments(sites[0])["partial"]
    assert isinstance(partial, Node)  # a fused op's partial sum is a tensor
    tokens = TokenCount.of(partial)  # the planner's count of the first site
    too_few = too_few_tokens_reason(tokens.hint)  # before the analysis: a decode step needs none
    if too_few is not None:
        return skip(Reason.of(ReasonCode.SPLIT_PLAN, cause=too_few))
    if may_be_in_window(tokens, config):
        # From here the split reads the graph's matmuls, which its Inductor settings (no shape
        # padding) must have kept the same on every rank: the compile needs them now.
        before_rewrite()
    try:
        cut = Cut.of(sites[0])
        info = analyse(graph, sites, cut)
        plan = plan_split(tokens, hint(cut.batch), info.gemms, config, cut.device, moe=info.moe)
        if plan.first is None:
            return skip(Reason.of(ReasonCode.SPLIT_PLAN, cause=plan.reason))
        symbolic_cut = isinstance(cut.units, torch.SymInt)  # batch mode on a symbolic S cuts static units
        if symbolic_cut and not cut.units >= MIN_SYMBOLIC_UNITS:  # one guard
            return skip(Reason.of(ReasonCode.SPLIT_FEW_SYMBOLIC_UNITS, units=hint(cut.units), mode=cut.mode,
                                  min_units=MIN_SYMBOLIC_UNITS))
        cut.first = plan.first // (plan.tokens // hint(cut.units))
        info = analyse(graph, sites, cut)  # re-check every view against the real cut
    except Unsupported as error:
        return skip(Reason.of(ReasonCode.SPLIT_NOT_POSSIBLE, cause=error.reason))
    if info.run_time_masks and config.split == "auto":
        # A bidirectional mask would stop the run (on CUDA a device-side assertion ends the
        # process): `auto` never risks that; `force` splits with the check.
        names = ", ".join(m.name for m in info.run_time_masks)
        return skip(Reason.of(ReasonCode.SPLIT_RUN_TIME_MASK, masks=names))
    push, comm, push_refused = communication_variant(sites, config)
    if push_refused is not None:
        report.reasons.append(push_refused)
    rewrite(graph, info, config, push)
    where = "computed at run time from the symbolic size" if symbolic_cut else (
        f"A = {plan.first} / B = {plan.tokens - plan.first} tokens"
        + (", wave inequality holds" if plan.free else ", wave inequality does not hold"))
    comm = "" if comm is None else f"; {comm}"
    report.add_note(f"split ({plan.mode}): {where}; {len(fused_nodes)} sites x 2 halves{comm}")
    log.info("weavepass: %s", report.notes[-1])
    return True
