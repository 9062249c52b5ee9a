"""The plan: which accepted sites to rewrite, and which lowering each one runs on.

Data flows one way: graph -> matches (``weavepass.patterns``) -> plan (here) -> lowering. The plan
depends only on shapes, dtypes, the process group's size and the config, never on the rank, so every
rank of a group makes the same choice (a different choice on one rank would deadlock).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from weavepass.config import WeaveConfig
from weavepass.patterns import FusedAllReduceRMSNormSite


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
    try:
        from weavepass.lowering.cuda_symm import cuda_unsupported_reason
    except ImportError as error:  # triton missing, or the module not built for this torch
        return f"CUDA lowering unavailable ({error})"
    return cuda_unsupported_reason(site.dtype, site.hidden, site.device, site.group_name)


def choose_lowering(site: FusedAllReduceRMSNormSite, config: WeaveConfig) -> tuple[str, str]:
    """``(lowering, note)``: the lowering for ``site`` and, on a fallback, why."""
    wanted = config.lowering
    if wanted == "auto":
        wanted = "cuda_symm" if site.device.type == "cuda" else "portable"
    if wanted == "cuda_symm":
        reason = _cuda_unsupported_reason(site)
        if reason is not None:
            return "portable", f"portable instead of cuda_symm: {reason}"
    return wanted, ""


def plan_sites(sites: list[FusedAllReduceRMSNormSite], config: WeaveConfig) -> list[SitePlan]:
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
