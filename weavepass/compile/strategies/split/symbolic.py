"""Sizes of the split: where the token dim is cut (``Cut``), in hint values for the analysis and as
graph arithmetic for the rewrite, which works for static and symbolic token counts alike.

A symbolic token count gets its cut computed at run time from the symbol (half the sequences; or
half the tokens rounded down to the GEMM row tile), so one graph serves every size from
``MIN_SYMBOLIC_UNITS`` units on; every other size is a ``-1`` in a view or an end of ``int64`` max
in a slice, so nothing else needs arithmetic.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import Graph, Node
from torch.fx.node import Argument, Target, map_arg

from weavepass.compile.fx_args import arguments, as_node
from weavepass.compile.reasons import Reason, ReasonCode
from weavepass.compile.tokens import size_hint
from weavepass.compile.wave_model import device_wave_model, split_mode

from .base import Unsupported, val

aten = torch.ops.aten

MIN_SYMBOLIC_UNITS = 4
"""A symbolic token count is split only when it has at least this many units (tokens, or sequences
in batch mode), through one guard. Below it a half could be a single unit, and size-1 dims are
special to shape checks and Inductor (contiguity, broadcasting): they guard on ``half != 1`` in
many places, and 2 and 3 units then compiled a graph each (3 compiles for one ``mark_dynamic``
input). With the guard, sizes of 4 and more share one graph and 2-3 share one fuse-only graph."""

Emit = Callable[..., "Node | int"]
"""``emit(target, args, kwargs=None)``: a new node computing ``target``, or the int it folds to
(``emit_new`` bound to a graph)."""


hint = size_hint
"""A concrete value for a possibly symbolic size (its example value); reading it adds no guard."""


def shape(node: Node) -> list[int]:
    return [hint(s) for s in val(node).shape]


@dataclass
class Cut:
    """The token dim of the first site's input (``[B, S, H]`` or ``[T, H]``) and where it is cut.

    Token dims count in units: sequences (batch mode, ``B >= 2``: cut between sequences) or tokens
    of the one sequence (sequence mode: cut inside it)."""

    partial: Node
    """the first site's input: a symbolic count is read from its size at run time"""
    batch: int | torch.SymInt
    seq: int | torch.SymInt
    mode: str  # "batch" or "sequence"
    units: int | torch.SymInt
    entry_dim: int
    """the token dim of ``partial``"""
    device: torch.device
    first: int = 1
    """half A's units (hint); 1 until planned, since the analysis needs a cut to check views against"""

    @classmethod
    def of(cls, first_site: Node) -> Cut:
        partial = as_node(arguments(first_site)["partial"], first_site, "partial")
        value = val(partial)
        if value.dim() == 3:
            batch, seq = value.shape[0], value.shape[1]
        elif value.dim() == 2:
            batch, seq = 1, value.shape[0]
        else:
            raise Unsupported(Reason.of(ReasonCode.SPLIT_INPUT_SHAPE, shape=tuple(value.shape)))
        mode = split_mode(hint(batch))
        return cls(partial, batch, seq, mode, batch if mode == "batch" else seq,
                   0 if mode == "batch" or value.dim() == 2 else 1, value.device)

    def first_units(self, size: int) -> int:
        """Half A's share of a token dim of ``size`` (hint values)."""
        units = hint(self.units)
        if size % units:
            raise Unsupported(Reason.of(ReasonCode.SPLIT_UNITS_DO_NOT_DIVIDE, size=size, units=units, mode=self.mode))
        return size // units * self.first

    def emit_split_point(self, emit: Emit) -> Node | int:
        """Half A's number of units: an int, or a SymInt node for a symbolic token count
        (``units // 2``; tokens rounded down to a GEMM row tile when there are 2+ tiles)."""
        if not isinstance(self.units, torch.SymInt):
            return self.first
        units = self.emit_units(emit)
        half = emit(operator.floordiv, (units, 2))
        if self.mode == "batch":
            return half
        tile = device_wave_model(self.device).tile_m
        tiles = emit(operator.mul, (emit(operator.floordiv, (half, tile)), tile))
        small = emit(torch.sym_min, (half, tile - 1))
        return emit(torch.sym_max, (tiles, small))

    def emit_units(self, emit: Emit) -> Node | int:
        """The number of units: an int, or a SymInt node read from the first site's input."""
        if not isinstance(self.units, torch.SymInt):
            return self.units
        return emit(aten.sym_size.int, (self.partial, 0 if self.mode == "batch" else self.entry_dim))

    def emit_bounds(self, emit: Emit, split_point: Node | int, node: Node, dim: int,
                    half: str) -> tuple[Node | int, Node | int]:
        """``(start, end)`` of ``half`` along token dim ``dim`` of ``node`` (full size there);
        ``split_point`` is what ``emit_split_point`` emitted."""
        size = val(node).shape[dim]
        if isinstance(split_point, int) and not isinstance(size, torch.SymInt):
            # exact where a view packs several units into one row: ``view_dim`` accepts the view
            # only when the cut falls between rows (``size // units`` would be 0 rows per unit)
            cut = size * split_point // hint(self.units)
        else:
            size_node = emit(aten.sym_size.int, (node, dim))
            per_unit = emit(operator.floordiv, (size_node, self.emit_units(emit)))
            cut = emit(operator.mul, (per_unit, split_point))
        return (0, cut) if half == "A" else (cut, torch.iinfo(torch.int64).max)


def emit_new(graph: Graph, target: Target, args: tuple[Argument, ...],
             kwargs: dict[str, Argument] | None = None) -> Node | int:
    """A new node of ``graph`` computing ``target(*args)``, or the plain int when it computes a number.

    Size arithmetic on a symbolic token count that guards have pinned to one value yields ints,
    and Inductor rejects graph nodes whose value is a plain int, so those are folded into their
    users' arguments. (The one-size ``auto`` window used to pin it; it no longer compares a
    symbolic count at all, but guards from the model itself can still pin one.)"""
    if isinstance(target, str):  # (a node's target type allows a str: a method or module name)
        raise TypeError(f"weavepass internal error: emit_new({target!r}): not a function or an op")
    kwargs = kwargs or {}
    args_v, kwargs_v = map_arg(args, lambda n: n.meta["val"]), map_arg(kwargs, lambda n: n.meta["val"])
    value = _fake_call(target, args_v, kwargs_v)
    if type(value) is int:
        return value
    node = graph.call_function(target, args, kwargs)
    node.meta["val"] = value
    return node


def _fake_call(target: Callable[..., Any], args: tuple[Argument, ...], kwargs: dict[str, Argument]) -> object:
    from torch._guards import detect_fake_mode

    mode = detect_fake_mode([a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)])
    if mode is None:
        return target(*args, **kwargs)
    with mode:
        return target(*args, **kwargs)
