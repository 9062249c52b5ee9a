"""The split's planner: the wave model (TokenWeave's) of a GEMM and where to cut the tokens in two.

Reads only shapes, the config and the device's SM count (``device_wave_model``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from weavepass.compile.reasons import Reason, ReasonCode
from weavepass.compile.tokens import TokenCount
from weavepass.config import WeaveConfig

# --- The two-way split ---------------------------------------------------------------------------
#
# Wave model. A GEMM ``[T, K] x [K, N]`` runs as ``C(T) = ceil(T / tile_m) * ceil(N / tile_n)`` CTAs
# (output tiles) on ``sms`` SMs in ``W(C) = ceil(C / sms)`` waves; one wave costs about the same
# time whatever the number of CTAs in it, because a partly filled last wave still takes a whole
# tile's time. Splitting T into T1 + T2 runs each GEMM twice, in ``W(C1) + W(C2)`` waves. Since
# ``ceil(a) + ceil(b) >= ceil(a + b)`` and ``C1 + C2 >= C``, the split never saves waves; it is
# free exactly when ``W(C1) + W(C2) <= W(C)`` (then equal). The planner looks for such a T1 near T/2
# and, when none exists, takes the one that wastes the fewest tile-times (``waves * K * tile area``,
# summed over the dominant GEMMs), breaking ties towards balance, then towards the smaller T1.


@dataclass(frozen=True)
class GemmShape:
    """One dominant GEMM of a layer, per token: ``[T, k] x [k, n]`` (``n`` output columns)."""

    n: int
    k: int


@dataclass(frozen=True)
class WaveModel:
    """Tiles and SMs of the wave model. ``sms=None`` (CPU, unknown device): no waves, only tiles."""

    sms: int | None = None
    tile_m: int = 128
    tile_n: int = 256

    def ctas(self, tokens: int, gemm: GemmShape) -> int:
        """Output tiles (CTAs) of ``gemm`` on ``tokens`` rows."""
        return -(-tokens // self.tile_m) * -(-gemm.n // self.tile_n)

    def waves(self, ctas: int) -> int:
        """``ceil(ctas / sms)``; with no SM count every CTA is its own wave (tiles only)."""
        return ctas if self.sms is None else -(-ctas // self.sms)

    def cost(self, tokens: int, gemms: list[GemmShape]) -> int:
        """Tile-times of all ``gemms`` on ``tokens`` rows: ``sum waves(C) * k`` (tile area is common)."""
        return sum(self.waves(self.ctas(tokens, g)) * g.k for g in gemms) if tokens > 0 else 0

    def split_is_free(self, tokens: int, first: int, gemms: list[GemmShape]) -> bool:
        """``ceil(C1/SMs) + ceil(C2/SMs) <= ceil(C/SMs)`` for every GEMM."""
        return all(
            self.waves(self.ctas(first, g)) + self.waves(self.ctas(tokens - first, g))
            <= self.waves(self.ctas(tokens, g))
            for g in gemms
        )


@dataclass(frozen=True)
class TokenSplitPlan:
    """Where to cut the tokens: ``first`` tokens go to half A, the rest to half B.

    ``mode`` is ``"batch"`` (cut between sequences: A = the first ``first // seq`` sequences) or
    ``"sequence"`` (one sequence cut after ``first`` tokens). ``first is None`` means fuse-only, for
    ``reason`` (a ``SPLIT_*`` code of the planner). ``free`` says whether the wave inequality holds
    for the chosen cut.
    """

    tokens: int
    first: int | None
    mode: str
    reason: Reason | None = None
    free: bool = False


def dominant_gemms(gemms: list[GemmShape], share: float = 0.25) -> list[GemmShape]:
    """The distinct GEMMs whose per-token work ``n * k`` is at least ``share`` of the largest."""
    distinct = sorted(set(gemms), key=lambda g: (-g.n * g.k, g.n, g.k))
    if not distinct:
        return []
    top = distinct[0].n * distinct[0].k
    return [g for g in distinct if g.n * g.k >= share * top]


def choose_split_point(
    tokens: int, candidates: list[int], gemms: list[GemmShape], model: WaveModel
) -> tuple[int, bool]:
    """``(first, free)``: the candidate cut that wastes the fewest tile-times, then the most balanced.

    ``candidates`` are the allowed sizes of half A (each in ``[1, tokens - 1]``).
    """
    whole = model.cost(tokens, gemms)

    def key(first: int) -> tuple[int, int, int]:
        waste = model.cost(first, gemms) + model.cost(tokens - first, gemms) - whole
        return waste, abs(2 * first - tokens), first

    first = min(candidates, key=key)
    return first, model.split_is_free(tokens, first, gemms)


def split_candidates(tokens: int, model: WaveModel, seq_len: int | None) -> list[int]:
    """Allowed sizes of half A: sequence boundaries (``seq_len`` given), else tile multiples and the
    two middle points. Kept within the middle half ``[T/4, 3T/4]`` so both halves have work to hide
    the other's communication behind."""
    raw: Iterable[int]
    if seq_len is not None:
        raw = range(seq_len, tokens, seq_len)
    else:
        raw = {*range(model.tile_m, tokens, model.tile_m), tokens // 2, (tokens + 1) // 2}
    middle = [c for c in raw if 0 < c < tokens and 4 * c >= tokens and 4 * c <= 3 * tokens]
    return sorted(middle or [c for c in raw if 0 < c < tokens])


def split_window_reason(tokens: int | torch.SymInt, config: WeaveConfig, moe: bool = False) -> Reason | None:
    """Why ``split="auto"`` does not split ``tokens`` (outside ``[split_min_tokens(_moe),
    split_max_tokens]``), or None (inside, or another split mode).

    ``tokens`` may be a SymInt: each comparison then installs a guard, so a graph compiled for one
    side of a bound never serves a batch on the other side (that batch recompiles once, into its
    own bucket). Without the guards a graph split for one batch would also split batches the
    benchmark shows are slower split."""
    if config.split != "auto":
        return None
    low = config.split_min_tokens_moe if moe else config.split_min_tokens
    kind = "MoE" if moe else "dense"
    symbolic = not isinstance(tokens, int)
    if symbolic and low == config.split_max_tokens:  # no comparison: it would pin the size
        return Reason.of(ReasonCode.SPLIT_WINDOW_PINS_SIZE, low=low, kind=kind)
    shown = None if symbolic else tokens  # a symbolic count is not one number
    if tokens < low:
        return Reason.of(ReasonCode.SPLIT_BELOW_WINDOW, tokens=shown, low=low, kind=kind)
    if tokens > config.split_max_tokens:
        return Reason.of(ReasonCode.SPLIT_ABOVE_WINDOW, tokens=shown, high=config.split_max_tokens)
    return None


def split_mode(batch: int) -> str:
    """How ``batch`` sequences (hint) are cut: ``"batch"`` (between sequences) for several,
    ``"sequence"`` (inside the one sequence) otherwise."""
    return "batch" if batch >= 2 else "sequence"


def too_few_tokens_reason(tokens: int) -> Reason | None:
    """Why ``tokens`` (a hint) cannot be cut in two, or None."""
    return Reason.of(ReasonCode.SPLIT_TOO_FEW_TOKENS, tokens=tokens) if tokens < 2 else None


def plan_token_split(
    batch: int,
    seq_len: int,
    gemms: list[GemmShape],
    config: WeaveConfig,
    model: WaveModel,
    moe: bool = False,
) -> TokenSplitPlan:
    """Decide the two-way split of ``batch`` sequences of ``seq_len`` tokens (all ranks agree: only
    shapes, config and the device model enter). Several sequences are cut between sequences; one
    sequence is cut inside (half B then attends to A's keys too)."""
    tokens = batch * seq_len
    mode = split_mode(batch)
    too_few = too_few_tokens_reason(tokens)
    if too_few is not None:
        return TokenSplitPlan(tokens, None, mode, too_few)
    outside = split_window_reason(tokens, config, moe)
    if outside is not None:
        return TokenSplitPlan(tokens, None, mode, outside)
    gemms = dominant_gemms(gemms)
    candidates = split_candidates(tokens, model, seq_len if mode == "batch" else None)
    first, free = choose_split_point(tokens, candidates, gemms, model)
    return TokenSplitPlan(tokens, first, mode, None, free)


def device_wave_model(device: torch.device | None) -> WaveModel:
    """The wave model of ``device``: its SM count on CUDA, no waves elsewhere."""
    if getattr(device, "type", None) == "cuda" and torch.cuda.is_available():
        return WaveModel(sms=torch.cuda.get_device_properties(device).multi_processor_count)
    return WaveModel()


def plan_split(
    tokens: TokenCount,
    batch: int,
    gemms: list[GemmShape],
    config: WeaveConfig,
    device: torch.device | None,
    moe: bool = False,
) -> TokenSplitPlan:
    """The split's one call into the planner: where to cut ``tokens``, ``batch`` sequences of
    ``tokens.hint // batch`` tokens (hint values; ``batch`` is 1 when the tokens are one
    sequence), on ``device``'s wave model.

    A symbolic count is first checked against the split window on its ``value`` (installing the
    window's guards, see ``split_window_reason``); the cut is then planned on the hints, so a
    symbolic count that passes the window always gets a cut (its position is computed at run time
    by the split). A static count is planned directly."""
    if tokens.symbolic:
        outside = split_window_reason(tokens.value, config, moe)
        if outside is not None:
            return TokenSplitPlan(tokens.hint, None, split_mode(batch), outside)
    return plan_token_split(batch, tokens.hint // batch, gemms, config, device_wave_model(device), moe)
