"""The plan: which accepted sites to rewrite, and which lowering each one runs on.

Data flows one way: graph -> matches (``weavepass.compile.patterns``) -> plan (here) -> lowering. The plan
depends only on shapes, dtypes, the process group's size and the config, never on the rank, so every
rank of a group makes the same choice (a different choice on one rank would deadlock).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from weavepass.config import WeaveConfig
from weavepass.runtime import TRAINING_LOWERINGS
from weavepass.compile.patterns import FusedAllReduceRMSNormSite


@dataclass
class SitePlan:
    """What to do with one site: rewrite it on ``lowering`` or skip it for ``reason``."""

    site: FusedAllReduceRMSNormSite
    lowering: str | None
    reason: str = ""


def group_size(group_name: str) -> int | None:
    """World size of the group a functional collective names, or None when it cannot be resolved."""
    try:
        from torch.distributed.distributed_c10d import _resolve_process_group

        return _resolve_process_group(group_name).size() if dist.is_initialized() else None
    except (RuntimeError, ValueError, KeyError):
        return None


def _cuda_unsupported_reason(site: FusedAllReduceRMSNormSite) -> str | None:
    # Only asks: the workspace size travels in the op call (``WeaveConfig.cuda_workspace_tokens``),
    # and larger batches fall back to portable at run time.
    try:
        from weavepass.runtime.cuda.support import cuda_site_unsupported_reason
    except ImportError as error:  # the module not built for this torch
        return f"CUDA lowering unavailable ({error})"
    return cuda_site_unsupported_reason(site.dtype, site.hidden, site.device, site.group_name)


CUDA_COPY_NOTE = ("the kernel copies the partial sums into the symmetric workspace (the producing "
                  "matmul does not write there directly)")
"""Said on every ``cuda_symm`` site: one extra read of the partial per site (docs/cuda_kernel.md)."""


INDUCTOR_CUDAGRAPHS_NOTE = (
    "left as all_reduce: Inductor CUDA graphs (mode='reduce-overhead') are on and "
    "WeaveConfig.allow_inductor_cudagraphs is False"
)
"""Said on every CUDA site of a graph Inductor wraps in CUDA-graph trees when the config forbids it."""


def _static_tokens(site: FusedAllReduceRMSNormSite) -> int | None:
    """The site's token count (rows of the partial) when static, else None (read guard-free)."""
    shape = site.partial.meta["val"].shape[:-1]
    if any(isinstance(s, torch.SymInt) for s in shape):
        return None
    return math.prod(int(s) for s in shape)


def inductor_cudagraphs_on() -> bool:
    """Whether Inductor wraps this compile in CUDA graphs (``mode="reduce-overhead"``)."""
    from torch._inductor import config as inductor_config

    return bool(inductor_config.triton.cudagraphs)


def choose_lowering(site: FusedAllReduceRMSNormSite, config: WeaveConfig) -> tuple[str | None, str]:
    """``(lowering, note)``: the lowering for ``site`` (None: leave it alone) and, if not the
    first choice, why.

    On CUDA, ``auto`` rewrites a site only when the fused kernel can run it: the portable path
    (fp32 reduce_scatter + all_gather through NCCL) moves twice the bytes of the model's own
    all_reduce, and a rewrite must never make a batch slower than the plain compiled model.
    """
    auto = config.lowering == "auto"
    wanted = ("cuda_symm" if site.device.type == "cuda" else "portable") if auto else config.lowering
    if site.training and wanted not in TRAINING_LOWERINGS:
        # Never portable instead: on CUDA it is slower than the model's own NCCL all_reduce.
        return None, (f"left as all_reduce: training: the norm's inverse RMS is saved for "
                      f"backward, and the {wanted} lowering does not return it (only "
                      f"{', '.join(TRAINING_LOWERINGS)} does)")
    if wanted != "cuda_symm":
        return wanted, ""
    reason = _cuda_unsupported_reason(site)
    if reason is None:
        tokens = _static_tokens(site)
        if auto and tokens is not None and tokens < config.cuda_min_tokens and not inductor_cudagraphs_on():
            return None, (
                f"left as all_reduce: {tokens} tokens < cuda_min_tokens={config.cuda_min_tokens} "
                "without CUDA graphs (host-bound: the fused op's launch costs more than it saves); "
                "set cuda_min_tokens=1 if you capture CUDA graphs yourself (torch.cuda.graph)"
            )
        return wanted, CUDA_COPY_NOTE
    if auto:
        return None, f"left as all_reduce: the CUDA kernel cannot run it ({reason})"
    return "portable", f"portable instead of cuda_symm: {reason}"


def inductor_cudagraphs_reason(sites: list[FusedAllReduceRMSNormSite], config: WeaveConfig) -> str | None:
    """``INDUCTOR_CUDAGRAPHS_NOTE`` when Inductor wraps this graph in CUDA-graph trees, the graph has
    CUDA sites and the config does not allow rewriting there; else None. Graph-wide: it stops
    every strategy (fused sites, the token split and FlashComm), not one lowering."""
    if config.allow_inductor_cudagraphs or not inductor_cudagraphs_on():
        return None
    return INDUCTOR_CUDAGRAPHS_NOTE if any(site.device.type == "cuda" for site in sites) else None


def plan_sites(sites: list[FusedAllReduceRMSNormSite], config: WeaveConfig) -> list[SitePlan]:
    blocked = inductor_cudagraphs_reason(sites, config)
    if blocked is not None:
        return [SitePlan(site, None, blocked) for site in sites]
    plans = []
    for site in sites:
        size = group_size(site.group_name)
        if size is None:
            plans.append(SitePlan(site, None, f"process group {site.group_name!r} is not known here"))
        elif size < config.min_world_size:
            plans.append(SitePlan(
                site, None, f"group of {size} rank(s) < min_world_size={config.min_world_size}"
            ))
        else:
            lowering, note = choose_lowering(site, config)
            plans.append(SitePlan(site, lowering, note))
    return plans


# --- TokenWeave two-way token split -----------------------------------------------------------------
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
    ``reason``. ``free`` says whether the wave inequality holds for the chosen cut.
    """

    tokens: int
    first: int | None
    mode: str
    reason: str = ""
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
    if seq_len is not None:
        raw = range(seq_len, tokens, seq_len)
    else:
        raw = {*range(model.tile_m, tokens, model.tile_m), tokens // 2, (tokens + 1) // 2}
    middle = [c for c in raw if 0 < c < tokens and 4 * c >= tokens and 4 * c <= 3 * tokens]
    return sorted(middle or [c for c in raw if 0 < c < tokens])


def overlap_window_reason(tokens, config: WeaveConfig, moe: bool = False) -> str | None:
    """Why ``overlap="auto"`` does not split ``tokens`` (outside ``[overlap_min_tokens(_moe),
    overlap_max_tokens]``), or None (inside, or another overlap mode).

    ``tokens`` may be a SymInt: each comparison then installs a guard, so a graph compiled for one
    side of a bound never serves a batch on the other side (that batch recompiles once, into its
    own bucket). Without the guards a graph split for one batch would also split batches the
    benchmark shows are slower split."""
    if config.overlap != "auto":
        return None
    low = config.overlap_min_tokens_moe if moe else config.overlap_min_tokens
    kind = "MoE" if moe else "dense"
    symbolic = not isinstance(tokens, int)
    if symbolic and low == config.overlap_max_tokens:  # no comparison: it would pin the size
        return (f"symbolic token count and a window of one size ({low} tokens, {kind}): guards for "
                "it would pin the dynamic size to one value, so only a static batch of that size "
                "is split (widen overlap_min_tokens..overlap_max_tokens to split dynamic batches)")
    if tokens < low:
        if symbolic:
            return (f"symbolic token count below the overlap threshold {low} ({kind}); guarded, so "
                    "a batch at or above it compiles its own graph")
        return f"{tokens} tokens < overlap threshold {low} ({kind}): fuse-only pays more"
    if tokens > config.overlap_max_tokens:
        if symbolic:
            return (f"symbolic token count above overlap_max_tokens {config.overlap_max_tokens}; "
                    "guarded, so a batch inside the window compiles its own graph")
        return f"{tokens} tokens > overlap_max_tokens {config.overlap_max_tokens}: measured slower split"
    return None


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
    mode = "batch" if batch >= 2 else "sequence"
    if tokens < 2:
        return TokenSplitPlan(tokens, None, mode, f"{tokens} token(s): nothing to split")
    outside = overlap_window_reason(tokens, config, moe)
    if outside is not None:
        return TokenSplitPlan(tokens, None, mode, outside)
    gemms = dominant_gemms(gemms)
    candidates = split_candidates(tokens, model, seq_len if mode == "batch" else None)
    first, free = choose_split_point(tokens, candidates, gemms, model)
    return TokenSplitPlan(tokens, first, mode, "", free)


def device_wave_model(device) -> WaveModel:
    """The wave model of ``device``: its SM count on CUDA, no waves elsewhere."""
    if getattr(device, "type", None) == "cuda" and torch.cuda.is_available():
        return WaveModel(sms=torch.cuda.get_device_properties(device).multi_processor_count)
    return WaveModel()
