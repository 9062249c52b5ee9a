"""``split="auto"`` from a measured table: plain Inductor, fuse-only or the split for one graph.

``tuned_decision(sites, config, world, cudagraphs)`` reads the graph's facts (device, world size,
dtype, compile mode, hidden size, the row-parallel matmuls' inner widths, the token count), finds
the table's entry (``WeaveConfig.tuning_table``, ``weavepass.tune.table``) and applies its rule.
The planner calls it to leave sites as all_reduce; the split's strategy calls it for fuse-only or
split. Both get the same answer: it reads only the graph, the config, the group's size and the table.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass

import torch
from torch.fx import Node

from weavepass.compile.fx_args import arguments
from weavepass.compile.patterns import FusedAllReduceRMSNormSite
from weavepass.compile.reasons import Reason, ReasonCode
from weavepass.compile.tokens import TokenCount
from weavepass.config import WeaveConfig
from weavepass.tune.table import TuningTable, choose, load_table, region_of

log = logging.getLogger("weavepass")

_WEIGHT_ARGUMENT = {
    torch.ops.aten.mm.default: "mat2",
    torch.ops.aten.addmm.default: "mat2",
    torch.ops.aten.bmm.default: "mat2",
    torch.ops.aten.matmul.default: "other",
}
"""The ``[.., K, N]`` operand of each matmul a site's partial comes from, by schema name."""

_CODES = {"inductor": ReasonCode.TUNED_NO_REWRITE, "fuse": ReasonCode.TUNED_FUSE_ONLY, "split": ReasonCode.TUNED_SPLIT}
_warned: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class TunedDecision:
    """The table's call for one graph. ``rewrite`` is ``"inductor"``, ``"fuse"`` or ``"split"``,
    or None when the table has no entry for the graph (then the split window decides)."""

    rewrite: str | None
    reason: Reason
    """The call as a reason: ``TUNED_*`` (the measurements behind it as fields) or
    ``TUNING_TABLE_NOT_APPLICABLE`` (why, as its ``cause``)."""
    window: tuple[int, int] | None = None
    """For ``"split"``: the token range ``[low, high]`` decided alike, the split's split window
    (for a symbolic count, the range its guards keep the graph to)."""

    @property
    def code(self) -> ReasonCode:
        return self.reason.code

    @property
    def text(self) -> str:
        return self.reason.render()


def inner_width(matmul: Node) -> int | None:
    """``K`` of a matmul ``[.., T, K] x [.., K, N]`` (its weight operand's second-to-last dim)."""
    target = matmul.target
    if not isinstance(target, torch._ops.OpOverload) or target not in _WEIGHT_ARGUMENT:
        return None
    value = getattr(arguments(matmul)[_WEIGHT_ARGUMENT[target]], "meta", {}).get("val")
    if not isinstance(value, torch.Tensor) or value.dim() < 2:
        return None
    return int(value.shape[-2])


def _not_applicable(table: TuningTable, why: Reason) -> TunedDecision:
    return TunedDecision(None, Reason.of(ReasonCode.TUNING_TABLE_NOT_APPLICABLE, table=table.label, cause=why))


def _warn_once(table: TuningTable, what: str, text: str) -> None:
    if (table.digest, what) not in _warned:
        _warned.add((table.digest, what))
        warnings.warn(f"weavepass: tuning table {table.label}: {text}", stacklevel=2)


def _check_versions(table: TuningTable, device: torch.device) -> None:
    """Warn (once per table) where this process differs from the one that measured: the times may
    have moved, but the table is still the best evidence there is. Refusing is for what changes
    what was measured (world, device type, dtype, widths, mode: ``tuned_decision``)."""
    here = torch.__version__.split("+")[0].rsplit(".", 1)[0]
    there = table.versions["torch"].split("+")[0].rsplit(".", 1)[0]
    if here != there:
        _warn_once(table, "torch", f"measured with torch {table.versions['torch']}, this is {torch.__version__}; "
                   "re-run python -m weavepass.tune to measure this version")
    if device.type == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name(device)
        if table.machine.get("device_name") not in (None, name):
            _warn_once(table, "device", f"measured on {table.machine.get('device_name')}, this is {name}; "
                       "re-run python -m weavepass.tune on this machine")


def _graph_facts(sites: list[FusedAllReduceRMSNormSite]) -> tuple[Reason | None, TokenCount]:
    """``(problem, token count)``: the sites must share group, hidden size, dtype and token count
    to be one table lookup."""
    first = sites[0]
    tokens = TokenCount.of(first.partial)
    for site in sites[1:]:
        count = TokenCount.of(site.partial)
        if (site.group_name, site.hidden, site.dtype) != (first.group_name, first.hidden, first.dtype):
            return Reason(ReasonCode.TUNING_TABLE_SITES_DIFFER), tokens
        if (str(count.value), count.hint) != (str(tokens.value), tokens.hint):  # str: no guard
            return Reason(ReasonCode.TUNING_TABLE_TOKEN_COUNTS), tokens
    return None, tokens


def tuned_decision(sites: list[FusedAllReduceRMSNormSite], config: WeaveConfig, world: int | None,
                   cudagraphs: bool) -> TunedDecision | None:
    """The table's call for a graph with ``sites`` on a group of ``world`` ranks, compiled with
    (``cudagraphs``) or without Inductor CUDA graphs; None when no table is asked for
    (``split != "auto"``, ``tuning_table="none"``) or the graph has no site.

    A symbolic token count installs guards for the range it is decided on."""
    if config.split != "auto" or not sites:
        return None
    table = load_table(config.tuning_table)
    if table is None:
        return None
    site = sites[0]
    problem, tokens = _graph_facts(sites)
    device_type = table.machine["device_type"]
    dtype = str(site.dtype).removeprefix("torch.")
    mode = "reduce-overhead" if cudagraphs else "default"
    widths = frozenset(k for k in (inner_width(s.matmul) for s in sites if s.matmul is not None) if k)
    if problem is not None:
        return _not_applicable(table, problem)
    if site.device.type != device_type:
        return _not_applicable(table, Reason.of(ReasonCode.TUNING_TABLE_DEVICE, measured=device_type,
                                                device=site.device.type))
    if world != table.world:
        return _not_applicable(table, Reason.of(ReasonCode.TUNING_TABLE_WORLD, measured=table.world, world=world))
    if dtype != table.dtype:
        return _not_applicable(table, Reason.of(ReasonCode.TUNING_TABLE_DTYPE, measured=table.dtype, dtype=dtype))
    entry = table.entry(mode, site.hidden, widths)
    if entry is None:
        measured = "; ".join(sorted({f"{e.widths.describe()} ({e.mode})" for e in table.entries})) or "nothing"
        return _not_applicable(table, Reason.of(ReasonCode.TUNING_TABLE_NO_ENTRY, hidden=site.hidden,
                                                widths=tuple(sorted(widths)), mode=mode, entries=measured))
    _check_versions(table, site.device)
    if tokens.symbolic:
        region, choice = region_of(entry, tokens.hint, table.min_gain)
        low, high = region.low, region.high
        # Comparing the SymInt installs one guard per finite bound: a batch outside [low, high)
        # compiles its own graph, decided for its own range.
        if not ((low is None or tokens.value >= low) and (high is None or tokens.value < high)):
            raise AssertionError(f"token hint {tokens.hint} outside its own range [{low}, {high})")
        static = None
        window = None
        if choice.rewrite == "split" and low is not None and high is not None:  # split ranges are bounded
            window = (max(2, low), max(2, high - 1))
    else:
        choice = choose(entry, tokens.hint, table.min_gain)  # the hint is the static count here
        static, low, high = tokens.hint, None, None
        # (below 2 tokens the split refuses before it reads the window: "nothing to split")
        window = (max(2, tokens.hint), max(2, tokens.hint)) if choice.rewrite == "split" else None
    reason = Reason.of(_CODES[choice.rewrite], tokens=static, low=low, high=high, basis=choice.basis,
                       fuse=choice.ratios("fuse"), split=choice.ratios("split"), at=choice.at,
                       min_gain=table.min_gain, table=table.label, shape=entry.shape, mode=mode, world=table.world)
    return TunedDecision(choice.rewrite, reason, window)
