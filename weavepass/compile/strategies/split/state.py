"""What the split's modules share about the region being analysed: ``Analysis``, which the
per-op rules read and fill and the rewrite reads, and the first-argument token dim most rules map.
Below every rule module (``rules``, ``attention``, ``scores``, ``routing``) and the analysis and
rewrite that drive them: none of them imports another to know its type."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch.fx import Node

from weavepass.compile.fx_args import unexpected
from weavepass.compile.reasons import Reason, ReasonCode
from weavepass.compile.wave_model import GemmShape

from .base import Unsupported, op_name
from .symbolic import Cut

TokenDims = int | tuple[int | None, ...] | None
"""A node's token dim: an int; for an op with several outputs a tuple with one entry per output
(None: that output carries no tokens); None for a token-free value (a size)."""


@dataclass
class Analysis:
    """What the rewrite needs to know about the region; the rules read and fill it."""

    cut: Cut
    sites: list[Node]
    """the fused sites, in graph order"""
    region: list[Node] = field(default_factory=list)
    token: dict[Node, TokenDims] = field(default_factory=dict)
    """token node -> its token dim (int), or a tuple of dims (None: not a token tensor) for tuples"""
    sliced: dict[Node, dict[Node, int]] = field(default_factory=dict)
    """token node -> {token-free input that must be sliced: the dim to slice}"""
    keys: dict[Node, int] = field(default_factory=dict)
    """attention score node -> its dim over the key tokens (``scores``: half A's copy has A's keys,
    half B's all keys)"""
    key_operands: dict[Node, dict[Node, int]] = field(default_factory=dict)
    """bmm node -> {its k^T or v: their token dim}, read by half B over all keys (A's and B's copies)"""
    key_sliced: dict[Node, dict[Node, int]] = field(default_factory=dict)
    """score node -> {token-free input lined up with the keys: the dim}, read in A's keys by half A"""
    segment: dict[Node, int] = field(default_factory=dict)
    """token node -> the site it follows (0: between the first and the second)"""
    roles: dict[Node, object] = field(default_factory=dict)
    """node of an MoE routing block -> its role (``routing``: rows in a sort's order, positions,
    expert counts; a tuple per output for ``sort``); token tensors in token order have none"""
    block_consts: dict[Node, set[Node]] = field(default_factory=dict)
    """token-free constant as long as a routing block's rows, rebuilt per half -> the scatters that
    read it as the block's constant, its only allowed readers (``routing``)"""
    gemms: list[GemmShape] = field(default_factory=list)
    moe: bool = False
    run_time_masks: list[Node] = field(default_factory=list)
    """attention masks (inputs) whose hiding of half B's keys from half A's queries is checked only
    at run time (sequence mode: ``attention.emit_keys_hidden_check``), in graph order"""

    def dim(self, node: Node) -> int:
        """The token dim of ``node``, a token tensor (one output, not a size)."""
        d = self.token[node]
        if not isinstance(d, int):
            raise unexpected(node, "token dim", d, "an int (a token tensor)")
        return d


def input_token_dim(node: Node, info: Analysis) -> int:
    """The token dim of ``node``'s first argument, the one most rules map to the output; a token
    tensor anywhere else is refused."""
    x = node.args[0]
    d = info.token.get(x) if isinstance(x, Node) else None
    if d is None:
        raise Unsupported(Reason.of(ReasonCode.SPLIT_TOKEN_ARGUMENT_POSITION, node=node.name, op=op_name(node.target)))
    if isinstance(d, tuple):  # (an op with several outputs is read through getitems only)
        raise unexpected(node, "argument 0", x, "a node with one output")
    return d
