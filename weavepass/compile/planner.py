"""The plan: which accepted sites to rewrite, and which lowering each one runs on.

Data flows one way: graph -> matches (``weavepass.compile.patterns``) -> plan (here) -> lowering. The plan
depends only on shapes, dtypes, the process group's size and the config, never on the rank, so every
rank of a group makes the same choice (a different choice on one rank would deadlock).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch.distributed as dist

from weavepass.config import WeaveConfig
from weavepass.compile.patterns import FusedAllReduceRMSNormSite
from weavepass.compile.reasons import ReasonCode
from weavepass.compile.tokens import TokenCount
from weavepass.compile.tuned import TunedDecision, tuned_decision


@dataclass
class SitePlan:
    """What to do with one site: rewrite it on ``lowering`` or skip it for ``reason``."""

    site: FusedAllReduceRMSNormSite
    lowering: str | None
    reason: str = ""
    """Why not the first choice, for users (empty: nothing to say)."""
    code: ReasonCode = ReasonCode.NONE
    """What ``reason`` says, for code and tests."""
    tuned: TunedDecision | None = None
    """The tuning table's call for the whole graph (``overlap="auto"``), the same on every plan of
    it; None where no table was asked (no site to rewrite, another overlap mode, no table)."""


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
    return cuda_site_unsupported_reason(site.dtype, site.hidden, site.device, site.group_name, site.norm.out_dtype)


CUDA_COPY_NOTE = ("the kernel copies the partial sums into the symmetric workspace (the producing "
                  "matmul does not write there directly)")
"""Said on every ``cuda_symm`` site: one extra read of the partial per site (docs/cuda_kernel.md)."""


INDUCTOR_CUDAGRAPHS_NOTE = (
    "left as all_reduce: Inductor CUDA graphs (mode='reduce-overhead') are on and "
    "WeaveConfig.allow_inductor_cudagraphs is False"
)
"""Said on every CUDA site of a graph Inductor wraps in CUDA-graph trees when the config forbids it."""


def inductor_cudagraphs_on() -> bool:
    """Whether Inductor wraps this compile in CUDA graphs (``mode="reduce-overhead"``)."""
    from torch._inductor import config as inductor_config

    return bool(inductor_config.triton.cudagraphs)


def choose_lowering(
    site: FusedAllReduceRMSNormSite, config: WeaveConfig
) -> tuple[str | None, ReasonCode, str]:
    """``(lowering, code, note)``: the lowering for ``site`` (None: leave it alone) and, if not the
    first choice, why.

    On CUDA, ``auto`` rewrites a site only when the fused kernel can run it: the portable path
    (fp32 reduce_scatter + all_gather through NCCL) moves twice the bytes of the model's own
    all_reduce, and a rewrite must never make a batch slower than the plain compiled model.
    """
    auto = config.lowering == "auto"
    wanted = ("cuda_symm" if site.device.type == "cuda" else "portable") if auto else config.lowering
    if wanted != "cuda_symm":
        return wanted, ReasonCode.NONE, ""
    reason = _cuda_unsupported_reason(site)
    if reason is None:
        tokens = TokenCount.of(site.partial).static
        if auto and tokens is not None and tokens < config.cuda_min_tokens and not inductor_cudagraphs_on():
            return None, ReasonCode.CUDA_MIN_TOKENS, (
                f"left as all_reduce: {tokens} tokens < cuda_min_tokens={config.cuda_min_tokens} "
                "without CUDA graphs (host-bound: the fused op's launch costs more than it saves); "
                "set cuda_min_tokens=1 if you capture CUDA graphs yourself (torch.cuda.graph)"
            )
        return wanted, ReasonCode.CUDA_COPY, CUDA_COPY_NOTE
    if auto:
        return None, ReasonCode.CUDA_UNSUPPORTED, f"left as all_reduce: the CUDA kernel cannot run it ({reason})"
    return "portable", ReasonCode.PORTABLE_FALLBACK, f"portable instead of cuda_symm: {reason}"


def inductor_cudagraphs_reason(sites: list[FusedAllReduceRMSNormSite], config: WeaveConfig) -> str | None:
    """``INDUCTOR_CUDAGRAPHS_NOTE`` when Inductor wraps this graph in CUDA-graph trees, the graph has
    CUDA sites and the config does not allow rewriting there; else None. Graph-wide: it stops
    every strategy (fused sites, the token split and FlashComm), not one lowering."""
    if config.allow_inductor_cudagraphs or not inductor_cudagraphs_on():
        return None
    return INDUCTOR_CUDAGRAPHS_NOTE if any(site.device.type == "cuda" for site in sites) else None


def graph_tuned_decision(sites: list[FusedAllReduceRMSNormSite], config: WeaveConfig) -> TunedDecision | None:
    """The tuning table's call for a graph with ``sites`` (``weavepass.compile.tuned``), on the
    first site's group size and this compile's CUDA-graph mode; None when no table is asked for."""
    if not sites:
        return None
    return tuned_decision(sites, config, group_size(sites[0].group_name), inductor_cudagraphs_on())


def plan_sites(sites: list[FusedAllReduceRMSNormSite], config: WeaveConfig) -> list[SitePlan]:
    """One plan per site, in order. Reads shapes, dtypes, the group's size, the config and which
    lowerings this process has; never the rank."""
    blocked = inductor_cudagraphs_reason(sites, config)
    if blocked is not None:
        return [SitePlan(site, None, blocked, ReasonCode.INDUCTOR_CUDAGRAPHS) for site in sites]
    tuned = functools.cache(lambda: graph_tuned_decision(sites, config))  # asked once, where a site is rewritten
    plans = []
    for site in sites:
        size = group_size(site.group_name)
        if size is None:
            plans.append(SitePlan(site, None, f"process group {site.group_name!r} is not known here",
                                  ReasonCode.GROUP_UNKNOWN))
        elif size < config.min_world_size:
            plans.append(SitePlan(
                site, None, f"group of {size} rank(s) < min_world_size={config.min_world_size}",
                ReasonCode.GROUP_TOO_SMALL,
            ))
        else:
            lowering, code, note = choose_lowering(site, config)
            decision = tuned() if lowering is not None else None
            if decision is not None and decision.code is ReasonCode.TUNED_NO_REWRITE:
                lowering, code, note = None, decision.code, f"left as all_reduce: {decision.text}"
            plans.append(SitePlan(site, lowering, note, code, decision))
    return plans
