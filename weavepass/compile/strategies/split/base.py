"""What every module of the split shares: the exception that carries a reason not to split, and
reading a node's example value."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch.fx import Node

from weavepass.compile.reasons import Reason, ReasonCode

if TYPE_CHECKING:
    from .analysis import Analysis


class Unsupported(Exception):
    """The split cannot handle a node: ``reason`` says why (a ``SPLIT_*`` code and its fields)."""

    def __init__(self, reason: Reason) -> None:
        super().__init__(reason.render())
        self.reason = reason


def val(node):
    """``node``'s example value (``meta["val"]``); None for a non-node argument."""
    return node.meta.get("val") if isinstance(node, Node) else None


def norm_dim(dim: int, rank: int) -> int:
    return dim + rank if dim < 0 else dim


def op_name(target) -> str:
    """How a reason names an op: ``cumsum.default``, ``getitem``."""
    return getattr(target, "__name__", str(target))


def input_token_dim(node: Node, info: Analysis) -> int:
    """The token dim of ``node``'s first argument, the one most rules map to the output; a token
    tensor anywhere else is refused."""
    x = node.args[0]
    d = info.token.get(x) if isinstance(x, Node) else None
    if d is None:
        raise Unsupported(Reason.of(ReasonCode.SPLIT_TOKEN_ARGUMENT_POSITION, node=node.name, op=op_name(node.target)))
    return d
