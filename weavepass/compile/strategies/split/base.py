"""What every module of the split shares: the exception that carries a reason not to split, and
reading a node's example value."""

from __future__ import annotations

from typing import Any

from torch.fx import Node

from weavepass.compile.reasons import Reason


class Unsupported(Exception):
    """The split cannot handle a node: ``reason`` says why (a ``SPLIT_*`` code and its fields)."""

    def __init__(self, reason: Reason) -> None:
        super().__init__(reason.render())
        self.reason = reason


def val(node: object) -> Any:
    """``node``'s example value (``meta["val"]``); None for a non-node argument."""
    return node.meta.get("val") if isinstance(node, Node) else None


def norm_dim(dim: int, rank: int) -> int:
    return dim + rank if dim < 0 else dim


def op_name(target: object) -> str:
    """How a reason names an op: ``cumsum.default``, ``getitem``."""
    return getattr(target, "__name__", str(target))
