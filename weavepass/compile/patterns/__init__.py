"""Site finders: each walks a post-grad graph and returns match dataclasses that can replace themselves."""

from weavepass.compile.patterns.allreduce_rmsnorm import (
    FusedAllReduceRMSNormSite,
    RejectedAllReduce,
    distribute_scales,
    find_allreduce_rmsnorm_sites,
    fold_sums_read_back,
    prepare,
)
from weavepass.compile.patterns.rmsnorm import RMSNormMatch, match_rmsnorm

__all__ = [
    "FusedAllReduceRMSNormSite",
    "RMSNormMatch",
    "RejectedAllReduce",
    "distribute_scales",
    "find_allreduce_rmsnorm_sites",
    "fold_sums_read_back",
    "match_rmsnorm",
    "prepare",
]
