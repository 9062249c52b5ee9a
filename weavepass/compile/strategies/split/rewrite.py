"""The rewrite of an analysed region: every token node copied once per half, laid out per segment
so that one half's communication at a site runs while the other half computes::

    [segment k, half A] [site k+1, A: comm stream] [segment k, half B] [site k+1, B: comm stream]

Each async op is joined by one ``weave::join_async(normed, residual_out, [partial, residual,
weight])`` placed right before the first read of either output: the compute stream waits there, and
the comm stream reads the op's inputs until then. Token nodes read outside the region are joined by ``cat``.
"""

from __future__ import annotations

import operator

import torch
from torch._ops import OpOverload
from torch.fx import Graph, Node
from torch.fx.node import Argument, Target, map_arg

from weavepass.compile.fx_args import arg_node, arguments, as_list, unexpected
from weavepass.config import WeaveConfig
from weavepass.ops import (
    ASYNC_FUSED_OPS,
    FUSED_ALLREDUCE_LAYERNORM,
    FUSED_ALLREDUCE_LAYERNORM_ASYNC,
    FUSED_ALLREDUCE_RMSNORM_ASYNC,
    FUSED_ALLREDUCE_RMSNORM_PUSH_ASYNC,
    JOIN_ASYNC,
)

from .attention import ATTENTION, emit_attention, emit_keys_hidden_check
from .routing import emit_block_const
from .rules import VIEWS, half_view_size
from .scores import mask_blocks
from .state import Analysis
from .symbolic import emit_new

aten = torch.ops.aten

HALVES = ("A", "B")
JOIN_READS = ("partial", "residual", "weight", "bias")
"""The async fused op's arguments its join reads (``weave.join_async``'s ``inputs``), by schema name:
the tensors the communication stream reads (``bias``: the LayerNorm op's)."""


def rewrite(graph: Graph, info: Analysis, config: WeaveConfig, push: bool = False) -> None:
    """Replace the region of ``info`` by its two halves (``info`` from ``analyse`` at the planned cut);
    ``push``: the sites become the push variant's op (``WeaveConfig.split_comm="push"``)."""
    Rewrite(graph, info, config, push).run()


class Rewrite:
    """The state of one rewrite: each token node's copy per half and what was emitted once."""

    def __init__(self, graph: Graph, info: Analysis, config: WeaveConfig, push: bool = False):
        self.graph = graph
        self.info = info
        self.config = config
        self.push = push
        # (a size's copy may be an int: ``emit_size``)
        self.copies: dict[str, dict[Node, Node | int]] = {h: {} for h in HALVES}
        self.joined_ops: set[Node] = set()  # async ops whose join_async is emitted
        self.slices: dict[tuple[Node, int, str], Node] = {}
        self.joins: dict[Node, Node] = {}  # attention's k^T and v over both halves (half B)
        self.merged: dict[tuple[Node, str], Node] = {}  # (attention node, half) -> its output 0, already merged
        # (mask, how it hides): its [A rows, B keys] block asserted hidden
        self.checked_masks: set[tuple[Node, str | None]] = set()
        self.block_consts: dict[tuple[Node, str], Node] = {}  # (routing block constant, half) -> its copy
        self.split_point: Node | int | None = None

    def emit_size(self, target: Target, args: tuple[Argument, ...],
                  kwargs: dict[str, Argument] | None = None) -> Node | int:
        """A new node computing a size, or the int it folds to (``emit_new``)."""
        return emit_new(self.graph, target, args, kwargs)

    def emit(self, target: Target, args: tuple[Argument, ...], kwargs: dict[str, Argument] | None = None) -> Node:
        """A new node computing a tensor (or tensors): never folded to an int."""
        node = emit_new(self.graph, target, args, kwargs)
        if not isinstance(node, Node):
            raise TypeError(f"weavepass internal error: {target} computed the int {node}, not a tensor")
        return node

    def run(self) -> None:
        info, sites = self.info, self.info.sites
        anchor = info.region[-1].next
        while anchor.op != "output" and anchor.target is operator.getitem and anchor.args[0] is sites[-1]:
            anchor = anchor.next
        with self.graph.inserting_before(anchor):
            self.split_point = info.cut.emit_split_point(self.emit_size)
            by_segment: dict[int, list[Node]] = {}
            for node in info.region:
                if node in info.token and node not in sites:
                    by_segment.setdefault(info.segment[node], []).append(node)
            for half in HALVES:
                self.copy(sites[0], half)
            for k in range(len(sites)):
                for half in HALVES:
                    for node in by_segment.get(k, []):
                        self.copy(node, half)
                    if k + 1 < len(sites):
                        self.copy(sites[k + 1], half)
            outside = [n for n in info.token if any(u not in info.token for u in n.users)]
            for node in outside:
                if info.token[node] is None:  # a size of a non-token dim: half A's copy serves both
                    joined: Node | int = self.read_value(node, "A")
                else:
                    joined = self.emit(aten.cat.default, ([self.read(node, h) for h in HALVES], info.token[node]))
                for user in [u for u in node.users if u not in info.token]:
                    _replace_input(user, node, joined)
            for half in HALVES:  # join every fork, also where an output is never read
                for node in list(self.copies[half]):
                    self.read_value(node, half)
        for node in reversed(list(info.token)):
            self.graph.erase_node(node)
        for node in info.block_consts:  # read by the block only, whose nodes are gone
            self.graph.erase_node(node)

    def bounds(self, node: Node, dim: int, half: str) -> tuple[Node | int, Node | int]:
        """``(start, end)`` of ``half`` along token dim ``dim`` of ``node``."""
        if self.split_point is None:
            raise RuntimeError("Rewrite.bounds before run() emitted the split point")
        return self.info.cut.emit_bounds(self.emit_size, self.split_point, node, dim, half)

    def slice(self, node: Node, dim: int, half: str) -> Node:
        """``half`` of token-free ``node`` along ``dim`` (emitted once)."""
        key = (node, dim, half)
        if key not in self.slices:
            start, end = self.bounds(node, dim, half)
            self.slices[key] = self.emit(aten.slice.Tensor, (node, dim, start, end))
        return self.slices[key]

    def joined(self, node: Node, dim: int) -> Node:
        """Token node ``node`` over both halves, A's copy then B's, along ``dim`` (emitted once)."""
        if node not in self.joins:
            self.joins[node] = self.emit(aten.cat.default, ([self.read(node, h) for h in HALVES], dim))
        return self.joins[node]

    def read(self, node: Node, half: str) -> Node:
        """Token tensor ``node``'s copy for ``half`` (``read_value``)."""
        copy = self.read_value(node, half)
        if not isinstance(copy, Node):
            raise unexpected(node, f"half {half}'s copy", copy, "a node")
        return copy

    def read_value(self, node: Node, half: str) -> Node | int:
        """``node``'s copy for ``half``, or the int a size's copy folded to (``emit_size``); an async
        fused op's output is joined first (once per op)."""
        copy = self.copies[half][node]
        if isinstance(copy, int):
            return copy
        fork = arg_node(copy, 0) if copy.target is operator.getitem else None
        if fork is not None and fork.target in ASYNC_FUSED_OPS:
            if fork not in self.joined_ops:
                self.joined_ops.add(fork)
                outputs = [self.output(fork, i) for i in (0, 1)]
                # partial, residual, weight (and a LayerNorm's bias): all read by the comm stream.
                # The weight too: Gemma's (1 + w) is a buffer of the graph, freed after the op's
                # launch without this read.
                given = arguments(fork)
                inputs = [a for name in JOIN_READS if isinstance(a := given.get(name), Node)]
                self.emit(JOIN_ASYNC, (*outputs, inputs))
        return copy

    def output(self, op: Node, index: int) -> Node:
        """Output ``index`` of multi-output node ``op``: its existing ``getitem``, else a new one."""
        for user in op.users:
            if user.target is operator.getitem and user.args[1] == index:
                return user
        return self.emit(operator.getitem, (op, index))

    def copy(self, node: Node, half: str) -> None:
        """Emit ``half``'s copy of token node ``node``."""
        info = self.info
        sliced = info.sliced.get(node, {})
        key_sliced = info.key_sliced.get(node, {}) if half == "A" else {}
        all_keys = info.key_operands.get(node, {}) if half == "B" else {}

        def arg(a: Node) -> Node | int:
            if a in all_keys:  # attention's k^T or v, over A's keys and B's
                return self.joined(a, all_keys[a])
            if a in info.token:
                return self.read_value(a, half)
            if a in info.block_consts:
                if (a, half) not in self.block_consts:
                    self.block_consts[(a, half)] = emit_block_const(self, a, half)
                return self.block_consts[(a, half)]
            if a in sliced or a in key_sliced:
                if a in key_sliced:  # half A leaves out B's keys: the mask must hide them
                    emit_keys_hidden_check(self, a, sliced.get(a), key_sliced[a],
                                           mask_blocks(node, a, info.keys))
                part = self.slice(a, sliced[a], half) if a in sliced else a
                return self.slice(part, key_sliced[a], "A") if a in key_sliced else part
            return a

        if node.target is operator.getitem and (node.args[0], half) in self.merged:
            self.copies[half][node] = self.merged[(arg_node(node, 0), half)]  # output 0, the only one read
            return
        args, kwargs = map_arg(node.args, arg), map_arg(node.kwargs, arg)
        target = node.target
        if node in info.sites:
            extra: dict[str, Argument] = {"num_ctas": self.config.split_comm_ctas}
            if self.push:  # one staging slot per half: a slot is reused only after its join
                target = FUSED_ALLREDUCE_RMSNORM_PUSH_ASYNC
                extra["slot"] = HALVES.index(half)
            else:
                layer_norm = target is FUSED_ALLREDUCE_LAYERNORM
                target = FUSED_ALLREDUCE_LAYERNORM_ASYNC if layer_norm else FUSED_ALLREDUCE_RMSNORM_ASYNC
            args, kwargs = _async_arguments(node, target, args, kwargs, extra), {}
        elif target in VIEWS:
            size = half_view_size(node, info.dim(node), args[1])
            if node in info.keys:  # the half's key count, from the scores it views
                size[info.keys[node]] = self.emit_size(aten.sym_size.int, (args[0], info.keys[arg_node(node, 0)]))
            args = (args[0], size, *args[2:])
        elif target is aten.expand.default:
            size = as_list(args[1], node, "argument 1")
            for dim in (info.dim(node), info.keys.get(node)):
                if dim is not None:
                    size[dim] = -1  # keep the half's own size, whatever the cut
            args = (args[0], size, *args[2:])
        elif target is aten.sym_size.int:
            self.copies[half][node] = self.copies["A"][node] if half == "B" else self.emit_size(target, args)
            return
        elif target in ATTENTION and info.cut.mode == "sequence":
            self.copies[half][node] = emit_attention(self, node, half, args, kwargs)
            return
        self.copies[half][node] = self.emit(target, args, kwargs)


def _replace_input(user: Node, old: Node, new: Node | int) -> None:
    """``user`` reads ``new`` where it read ``old``; ``new`` may be the int a size folded to, which
    ``Node.replace_input_with`` does not take."""
    user.args, user.kwargs = map_arg((user.args, user.kwargs), lambda n: new if n is old else n)


def _async_arguments(site: Node, target: OpOverload, args: tuple[Argument, ...], kwargs: dict[str, Argument],
                     extra: dict[str, Argument]) -> tuple[Argument, ...]:
    """The positional arguments of async op ``target`` for fused op ``site`` (its arguments, copied
    for a half: ``args`` and ``kwargs``), by schema name: the site's, then ``extra`` (``num_ctas``,
    the push's ``slot``)."""
    schema = getattr(site.target, "_schema", None)
    if not isinstance(schema, torch.FunctionSchema):
        raise unexpected(site, "target", site.target, "an op with a schema")
    given = {**dict(zip((a.name for a in schema.arguments), args)), **kwargs, **extra}
    return tuple(given[a.name] for a in target._schema.arguments)
