"""``WeaveConfig``: every choice the pass makes that a user can steer, one documented field each.

Knobs are passed explicitly (``weavepass.weave(config=...)`` or ``weavepass.make_backend(config)``);
importing weavepass never changes global Inductor config.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

LOWERINGS = ("auto", "portable", "cuda_symm")


@dataclass(frozen=True)
class WeaveConfig:
    enabled: bool = True
    """Run the rewrite at all. When False the backend is plain Inductor (the report says so)."""

    lowering: str = "auto"
    """How fused sites run: ``"auto"`` picks per device (CUDA: the symmetric-memory Triton kernel
    when it supports the site, else portable); ``"portable"`` forces reduce_scatter -> add+RMSNorm
    -> all_gather through ``torch.distributed``; ``"cuda_symm"`` asks for the CUDA kernel (sites it
    cannot run still fall back to portable, with the reason in the report)."""

    min_world_size: int = 2
    """Groups smaller than this are left alone: with one rank the all_reduce is already a no-op,
    and the reduce_scatter/all_gather pair would only add work."""

    cuda_workspace_tokens: int = 16384
    """Rows of symmetric memory the CUDA lowering reserves per group and dtype (x hidden). Batches
    with more tokens run on the portable lowering, with a one-time warning."""

    fx_graph_cache: bool = False
    """Let Inductor load compiled graphs from its FX-graph cache. The cache key includes the pass's
    ``uuid()``, so results stay correct, but a cache hit skips the pass and the explain report then
    has no entries for that graph. Off by default so the report is always complete."""

    def __post_init__(self) -> None:
        if self.lowering not in LOWERINGS:
            raise ValueError(f"WeaveConfig.lowering must be one of {LOWERINGS}, got {self.lowering!r}")
        if self.min_world_size < 1:
            raise ValueError(f"WeaveConfig.min_world_size must be >= 1, got {self.min_world_size}")
        if self.cuda_workspace_tokens < 1:
            raise ValueError(
                f"WeaveConfig.cuda_workspace_tokens must be >= 1, got {self.cuda_workspace_tokens}"
            )

    def replace(self, **changes) -> "WeaveConfig":
        return dataclasses.replace(self, **changes)
