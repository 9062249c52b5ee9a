"""A site's token count, derived once: exact value (int or SymInt), whether it is static, its hint,
and the padding rules that depend on it.

API (for the planner, the strategies and the split)::

    count = TokenCount.of(node)      # node: an FX node whose meta["val"] is [..., H]; tokens = prod(shape[:-1])
    count.value                      # int (static) or torch.SymInt (symbolic): compare it to install guards
    count.static                     # int when static (a SymInt with a constant value counts), else None
    count.symbolic                   # count.static is None
    count.hint                       # int: the example value, read without installing a guard
    count.padded(world_size)         # FlashComm's padding: a multiple of TOKEN_ALIGNMENT * world_size (static only)
    count.rows_per_rank(world_size)  # count.padded(world_size) // world_size
    TokenCount(n).padded(world)      # the padding rule on a plain int

Reading ``value`` in a comparison installs a guard; ``static``, ``symbolic`` and ``hint`` never do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.fx import Node

TOKEN_ALIGNMENT = 16
"""Tokens are padded to a multiple of ``world_size * TOKEN_ALIGNMENT``: each rank's shard then has a
multiple of 16 rows, which keeps fused kernels (MMRS tiles, vectorised norms) on aligned shapes."""


def size_hint(size: int | torch.SymInt) -> int:
    """A concrete value for a possibly symbolic size (its example value), read guard-free."""
    if isinstance(size, torch.SymInt):
        return size.node.hint if size.node.hint is not None else int(size.node.expr.subs({}))
    return int(size)


@dataclass(frozen=True)
class TokenCount:
    """The number of tokens (rows) of a ``[..., H]`` tensor: the product of every dim but the last."""

    value: int | torch.SymInt
    """The exact count; a SymInt under dynamic shapes (comparing it installs a guard)."""

    @classmethod
    def of(cls, node: Node) -> TokenCount:
        """The token count of ``node``'s value (``node.meta["val"]``, shaped ``[..., H]``)."""
        return cls(math.prod(node.meta["val"].shape[:-1]))

    @property
    def static(self) -> int | None:
        """The count when static (a SymInt with a constant value counts), else None; guard-free."""
        if isinstance(self.value, int):
            return self.value
        from torch.fx.experimental.symbolic_shapes import is_concrete_int

        return int(self.value) if is_concrete_int(self.value) else None

    @property
    def symbolic(self) -> bool:
        return self.static is None

    @property
    def hint(self) -> int:
        """The example value (equal to ``static`` when static); guard-free."""
        return size_hint(self.value)

    def padded(self, world_size: int) -> int:
        """FlashComm's padded count: ``static`` rounded up to a multiple of ``world_size * 16``."""
        if self.static is None:
            raise ValueError("padding needs a static token count")
        align = world_size * TOKEN_ALIGNMENT
        return -(-self.static // align) * align

    def rows_per_rank(self, world_size: int) -> int:
        """Rows of each rank's shard after FlashComm's padding."""
        return self.padded(world_size) // world_size
