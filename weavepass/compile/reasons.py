"""Reason codes: why a site or a graph is (not) rewritten the way it could be.

Every plan and strategy decision carries a ``ReasonCode`` and a text. Code branches and tests on the
code; the text is what users read (explain report, logger ``weavepass``) and may change freely.
"""

from __future__ import annotations

import enum


class ReasonCode(enum.Enum):
    NONE = "none"
    """Nothing to say: the first choice was taken."""
    NOT_ASKED = "not_asked"
    """The config does not ask for this strategy (nothing is reported)."""

    # Per site (``planner.SitePlan``)
    GROUP_UNKNOWN = "group_unknown"
    """The process group is not known in this process."""
    GROUP_TOO_SMALL = "group_too_small"
    """The group has fewer than ``min_world_size`` ranks."""
    TRAINING = "training"
    """A training graph: the norm's inverse RMS is saved for backward (a lowering or strategy that
    does not return it refuses)."""
    CUDA_UNSUPPORTED = "cuda_unsupported"
    """The CUDA kernel cannot run the site; ``auto`` leaves it as all_reduce."""
    CUDA_MIN_TOKENS = "cuda_min_tokens"
    """Too few tokens for the CUDA kernel to pay off without CUDA graphs."""
    PORTABLE_FALLBACK = "portable_fallback"
    """``cuda_symm`` was asked for but cannot run: portable instead."""
    CUDA_COPY = "cuda_copy"
    """Information only: the CUDA kernel copies the partial sums into its workspace."""
    INDUCTOR_CUDAGRAPHS = "inductor_cudagraphs"
    """Graph-wide: Inductor CUDA graphs are on and the config forbids rewriting under them."""

    # Per graph (strategy decisions)
    NO_SITES = "no_sites"
    MIXED_GROUPS = "mixed_groups"
    SYMBOLIC_TOKENS = "symbolic_tokens"
    UNEQUAL_SITES = "unequal_sites"
    """Sites with different token counts or hidden sizes."""
    TOO_FEW_TOKENS = "too_few_tokens"
    STREAM_BROKEN = "stream_broken"
    """The residual stream does not run from one site to the next."""
    NO_TOKEN_DIM = "no_token_dim"
    """A site's norm reads a 1-D ``[H]`` value: its ops name dims of a tensor without a token dim."""

    # ``overlap="auto"`` with a tuning table (``weavepass.compile.tuned``, docs/overlap.md)
    TUNED_NO_REWRITE = "tuned_no_rewrite"
    """The table measured every rewrite slower than Inductor (or not ``min_gain`` faster) at the
    neighbouring cells: the sites stay all_reduce."""
    TUNED_FUSE_ONLY = "tuned_fuse_only"
    """The table chose fuse-only: the split was not measured faster at the neighbouring cells."""
    TUNED_SPLIT = "tuned_split"
    """The table chose the split (information; the split may still find the graph unsplittable)."""
    TUNING_TABLE_NOT_APPLICABLE = "tuning_table_not_applicable"
    """The table has no entry for this graph (another world size, device, dtype, compile mode or layer
    widths): the overlap window (``overlap_min_tokens``..``overlap_max_tokens``) decides."""
