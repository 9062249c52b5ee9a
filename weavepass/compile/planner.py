"""The plan: which accepted sites to rewrite, and which lowering each one runs on.

Data flows one way: graph -> matches (``weavepass.compile.patterns``) -> plan (here) -> lowering. The plan
depends only on shapes, dtypes, the process group's size and the config, never on the rank, so every
rank of a group makes the same choice (a different choice on one rank would deadlock).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch.distributed as dist

from weavepass.compile.patterns import FusedAllReduceRMSNormSite
from weavepass.compile.patterns.row_matmul import RowParallelMatmul, find_row_parallel_matmul, site_form_reason
from weavepass.compile.reasons import Reason, ReasonCode, runtime_issue_reason
from weavepass.compile.tokens import TokenCount
from weavepass.compile.tuned import TunedDecision, tuned_decision
from weavepass.config import Lowering, WeaveConfig

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import GroupName


NO_REASON = Reason(ReasonCode.NONE)


@dataclass(frozen=True)
class SitePlan:
    """What to do with one site (the finder's match): rewrite it on ``lowering`` or skip it (None),
    and why not the first choice (``reason``; ``ReasonCode.NONE``: nothing to say)."""

    site: FusedAllReduceRMSNormSite
    lowering: Lowering | None
    reason: Reason = NO_REASON

    @property
    def code(self) -> ReasonCode:
        return self.reason.code
    tuned: TunedDecision | None = None
    """The tuning table's call for the whole graph (``split="auto"``), the same on every plan of
    it; None where no table was asked (no site to rewrite, another split mode, no table)."""
    matmul: RowParallelMatmul | None = None
    """The row-parallel matmul the fused op takes in (``WeaveConfig.gemm_epilogue``,
    ``choose_gemm_epilogue``): the site becomes ``weave.matmul_reduce_scatter_rmsnorm``. None: the
    plain fused op (or nothing, without a lowering)."""
    epilogue: Reason = NO_REASON
    """Why the matmul is (``GEMM_EPILOGUE``) or is not taken in (``GEMM_EPILOGUE_*``); ``NONE``
    with ``gemm_epilogue="off"`` or without a lowering."""


def group_size(group_name: str) -> int | None:
    """World size of the group a functional collective names, or None when it cannot be resolved."""
    try:
        from torch._C._distributed_c10d import _resolve_process_group

        return _resolve_process_group(cast("GroupName", group_name)).size() if dist.is_initialized() else None
    except (RuntimeError, ValueError, KeyError):
        return None


def _cuda_unsupported_reason(site: FusedAllReduceRMSNormSite) -> Reason | None:
    # Only asks: the workspace size travels in the op call (``WeaveConfig.cuda_workspace_tokens``),
    # and larger batches fall back to portable at run time.
    try:
        from weavepass.runtime.cuda.support import cuda_site_unsupported_reason
    except ImportError as error:  # the module not built for this torch
        return Reason.of(ReasonCode.CUDA_UNAVAILABLE, error=str(error))
    issue = cuda_site_unsupported_reason(site.dtype, site.hidden, site.device, site.group_name, site.norm.out_dtype)
    return None if issue is None else runtime_issue_reason(issue)


def unsupported_reason(site: FusedAllReduceRMSNormSite, lowering: Lowering) -> Reason | None:
    """Can ``lowering`` run ``site`` in this process? Why not (a ``CUDA_*`` code of the runtime's
    support check), or None. The portable lowering runs any site."""
    return _cuda_unsupported_reason(site) if lowering is Lowering.CUDA_SYMM else None


def unprofitable_reason(site: FusedAllReduceRMSNormSite, lowering: Lowering, config: WeaveConfig) -> Reason | None:
    """Should ``auto`` run ``site`` on ``lowering``, which can run it? Why not, or None. Below
    ``cuda_min_tokens`` static tokens, without CUDA graphs, the CUDA kernel's launch costs more
    than it saves (host-bound)."""
    if lowering is not Lowering.CUDA_SYMM:
        return None
    tokens = TokenCount.of(site.partial).static
    if tokens is not None and tokens < config.cuda_min_tokens and not inductor_cudagraphs_on():
        return Reason.of(ReasonCode.CUDA_MIN_TOKENS, tokens=tokens, min_tokens=config.cuda_min_tokens)
    return None


CUDA_COPY = Reason(ReasonCode.CUDA_COPY)
"""Said on every ``cuda_symm`` site (information): the kernel reads the partial once, pushing the
peers' rows into their workspaces; no copy pass (docs/cuda_kernel.md, "Local cost")."""

INDUCTOR_CUDAGRAPHS = Reason(ReasonCode.INDUCTOR_CUDAGRAPHS)
"""Said on every CUDA site of a graph Inductor wraps in CUDA-graph trees when the config forbids it."""


def inductor_cudagraphs_on() -> bool:
    """Whether Inductor wraps this compile in CUDA graphs (``mode="reduce-overhead"``)."""
    from torch._inductor import config as inductor_config

    return bool(inductor_config.triton.cudagraphs)


def choose_lowering(
    site: FusedAllReduceRMSNormSite, config: WeaveConfig
) -> tuple[Lowering | None, Reason]:
    """``(lowering, reason)``: the lowering for ``site`` (None: leave it alone) and, if not the
    first choice, why. Chosen once, here: the config's choice, or under ``auto`` the device's
    (``cuda_symm`` on CUDA, else portable); then "can it run" (``unsupported_reason``), then,
    under ``auto`` only, "should it run" (``unprofitable_reason``).

    On CUDA, ``auto`` rewrites a site only when the fused kernel can run it: the portable path
    (fp32 reduce_scatter + all_gather through NCCL) moves twice the bytes of the model's own
    all_reduce, and a rewrite must never make a batch slower than the plain compiled model.
    """
    auto = config.lowering == "auto"
    if auto:
        wanted = Lowering.CUDA_SYMM if site.device.type == "cuda" else Lowering.PORTABLE
    else:
        wanted = Lowering(config.lowering)
    cause = unsupported_reason(site, wanted)
    if cause is not None:
        if auto:
            return None, Reason.of(ReasonCode.CUDA_UNSUPPORTED, cause=cause)
        return Lowering.PORTABLE, Reason.of(ReasonCode.PORTABLE_FALLBACK, cause=cause)
    unprofitable = unprofitable_reason(site, wanted, config) if auto else None
    if unprofitable is not None:
        return None, unprofitable
    return wanted, CUDA_COPY if wanted is Lowering.CUDA_SYMM else NO_REASON


def choose_gemm_epilogue(site: FusedAllReduceRMSNormSite, lowering: str | None, mode: str, *,
                         split: str = "off") -> tuple[RowParallelMatmul | None, Reason]:
    """``(matmul, reason)``: the row-parallel matmul that ``site``'s op on ``lowering`` takes in
    under ``WeaveConfig.gemm_epilogue`` = ``mode``, or None and why not (``NONE``: ``mode`` is
    ``"off"`` or there is no lowering). In order: the site's form (an RMSNorm inference site without
    quantization), its producer (``find_row_parallel_matmul``), the split (``split``: it
    rewrites fused ops), then under ``auto`` the measurement (``runtime.matmul_measured_speed``: the
    op's GEMM at least as fast as the plain matmul for the shape; only ``cuda_symm`` has a table), and
    whether the lowering carries the op (``runtime.matmul_unsupported_reason``). Reads the graph and the config only:
    every rank decides the same. FlashComm asks too, for its sharded form (``lowering``: its
    form's)."""
    from weavepass.runtime import matmul_unsupported_reason

    if mode == "off" or lowering is None:
        return None, NO_REASON
    refused = site_form_reason(site)
    if refused is not None:
        return None, refused
    found = find_row_parallel_matmul(site)
    if isinstance(found, Reason):
        return None, found
    if split != "off":
        return None, Reason.of(ReasonCode.GEMM_EPILOGUE_SPLIT, split=split)
    cause = matmul_unsupported_reason(lowering)
    if mode == "auto":
        speed = None if cause is not None else _measured_speed(site, found, lowering)
        if speed is None:
            return None, Reason.of(ReasonCode.GEMM_EPILOGUE_UNMEASURED, lowering=str(lowering))
        if speed < 1.0:
            return None, Reason.of(ReasonCode.GEMM_EPILOGUE_SLOWER, lowering=str(lowering), speed=round(speed, 3))
    if cause is not None:
        return None, Reason.of(ReasonCode.GEMM_EPILOGUE_LOWERING, mode=mode, lowering=str(lowering), cause=cause)
    return found, Reason.of(ReasonCode.GEMM_EPILOGUE, mode=mode, matmul=found.mm.name)


def _measured_speed(site: FusedAllReduceRMSNormSite, found: RowParallelMatmul, lowering: str) -> float | None:
    """The measured speed of ``lowering``'s GEMM for the site's matmul against the plain one
    (``runtime.matmul_measured_speed``: static token counts read their bucket, symbolic ones the
    slowest), or None: not measured, or a matmul of unknown width."""
    from weavepass.compile.patterns.rmsnorm import val
    from weavepass.runtime import matmul_measured_speed

    x = val(found.x)
    k = x.shape[-1] if x is not None else None
    if not isinstance(k, int):
        return None
    return matmul_measured_speed(lowering, TokenCount.of(site.partial).static, site.hidden, k)


def gemm_epilogue_warns(reason: Reason, mode: str) -> bool:
    """Whether a site's ``GEMM_EPILOGUE*`` reason is a warning: a matmul that ``"force"`` asked to
    move stays outside. A site whose sum no matmul makes (an embedding's) is information."""
    return mode == "force" and reason.code not in (
        ReasonCode.NONE, ReasonCode.GEMM_EPILOGUE, ReasonCode.GEMM_EPILOGUE_NO_MATMUL)


def inductor_cudagraphs_reason(sites: list[FusedAllReduceRMSNormSite], config: WeaveConfig) -> Reason | None:
    """``INDUCTOR_CUDAGRAPHS`` when Inductor wraps this graph in CUDA-graph trees, the graph has
    CUDA sites and the config does not allow rewriting there; else None. Graph-wide: it stops
    every strategy (fused sites, the split and FlashComm), not one lowering."""
    if config.allow_inductor_cudagraphs or not inductor_cudagraphs_on():
        return None
    return INDUCTOR_CUDAGRAPHS if any(site.device.type == "cuda" for site in sites) else None


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
        return [SitePlan(site, None, blocked) for site in sites]
    tuned = functools.cache(lambda: graph_tuned_decision(sites, config))  # asked once, where a site is rewritten
    plans = []
    for site in sites:
        size = group_size(site.group_name)
        if size is None:
            plans.append(SitePlan(site, None, Reason.of(ReasonCode.GROUP_UNKNOWN, group=site.group_name)))
        elif size < config.min_world_size:
            plans.append(SitePlan(site, None, Reason.of(ReasonCode.GROUP_TOO_SMALL, size=size,
                                                        min_world_size=config.min_world_size)))
        else:
            lowering, reason = choose_lowering(site, config)
            decision = tuned() if lowering is not None else None
            if decision is not None and decision.code is ReasonCode.TUNED_NO_REWRITE:
                lowering, reason = None, decision.reason
            site = _plan_quant(site, lowering)
            matmul, epilogue = choose_gemm_epilogue(site, lowering, config.gemm_epilogue, split=config.split)
            plans.append(SitePlan(site, lowering, reason, decision, matmul, epilogue))
    return plans


def _plan_quant(site: FusedAllReduceRMSNormSite, lowering: Lowering | None) -> FusedAllReduceRMSNormSite:
    """``site``, with its quantization left outside the fused op where its lowering does not carry
    it (``runtime.quant_unsupported_reason``: a ``QuantIssue``, as its ``ReasonCode``; the CUDA kernel answers with its
    own check); the norm is fused all the same, and the site's kind says why."""
    from weavepass.compile.patterns.rmsnorm import val
    from weavepass.runtime import quant_unsupported_reason

    quant = site.quant
    if quant is None or lowering is None:
        return site
    scale = val(quant.static_scale) if quant.static else None
    cause = quant_unsupported_reason(
        lowering, quant.static, quant.group_size, quant.scale_steps, quant.code_steps,
        out_dtype=site.norm.out_dtype, hidden=site.hidden, device=site.device,
        static_scale=None if scale is None else (scale.dtype, scale.dim()), return_normed=quant.return_normed)
    return site if cause is None else site.without_quant(
        Reason.of(ReasonCode.QUANT_LOWERING, cause=runtime_issue_reason(cause)))
