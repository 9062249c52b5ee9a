"""Reads of FX node arguments, by the op's schema, typed; and of example values.

``arguments(node)`` is the one reading of an op call's arguments: by their schema names, positional
or keyword, the schema's defaults filled in (code reads ``arguments(node)["group_name"]``, never
``node.args[4]``, which holds only for one op's schema: the LayerNorm op has a bias after the
weight). ``arg(node, index)`` reads the argument at a schema position through it, so a keyword
argument is found where a positional one would be. ``set_argument(node, name, value)`` (and
``with_argument``, which returns the new ``(args, kwargs)``) writes one the same way;
``positional(node)`` is the call with its positional arguments by position, to rebuild it.

torch types every ``node.args`` / ``node.kwargs`` entry as ``Argument``, a union of all a graph can
hold (nodes, numbers, lists, dtypes, ...). A matcher knows more: it has checked the op, so argument
0 of a ``view`` is a node and argument 1 of a ``transpose.int`` an int. The typed accessors
(``arg_node``, ``arg_int``, ...) say so to the type checker and check it when the graph is read. A
graph that is not what the matcher expected raises ``UnexpectedArgument``: an internal error (the
matcher and the op's schema disagree), never a silently wrong read.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.fx import Node
from torch.fx.node import Argument


class UnexpectedArgument(TypeError):
    """An op's argument (or example value) is not what the matcher reading it checked for: a bug
    in weavepass, or a torch whose op schema changed, not a problem of the user's model."""


def unexpected(node: Node, where: str, value: object, expected: str) -> UnexpectedArgument:
    """The error to raise when ``where`` of ``node`` (``"argument 1"``, ``'meta["val"]'``) is
    ``value`` where the matcher checked for ``expected``."""
    return UnexpectedArgument(
        f"weavepass internal error: {where} of node {node.name} ({node.target}) is {value!r} "
        f"({type(value).__name__}), where {expected} was expected; please report this with the "
        "graph (WEAVE_DUMP_GRAPHS)")


def _where(index: int, name: str | None) -> str:
    return f"argument {index}" + (f" ({name})" if name else "")


def _schema(node: Node) -> torch.FunctionSchema | None:
    schema = getattr(node.target, "_schema", None)
    return schema if isinstance(schema, torch.FunctionSchema) else None


def arguments(node: Node) -> dict[str, Argument]:
    """The arguments of a call of an op (``node.target``, an ``OpOverload``) by their schema names,
    positional or keyword, defaults filled in."""
    schema = _schema(node)
    if schema is None:
        raise unexpected(node, "target", node.target, "an op with a schema")
    given: dict[str, Argument] = dict(zip((a.name for a in schema.arguments), node.args))
    given.update(node.kwargs)
    for argument in schema.arguments:
        if argument.name not in given and argument.has_default_value():
            given[argument.name] = argument.default_value
    return given


def with_argument(node: Node, name: str, value: Argument) -> tuple[tuple[Argument, ...], dict[str, Argument]]:
    """``node``'s ``(args, kwargs)`` with its op's argument ``name`` (by the schema) set to
    ``value``: where the call gives it, positional or keyword, it is replaced there; a schema default
    the call left out is given by keyword. ``node`` is not changed (``set_argument`` changes it)."""
    schema = _schema(node)
    names = [a.name for a in schema.arguments] if schema is not None else []
    if name not in names:
        raise unexpected(node, f"argument {name!r}", None, f"an argument of {node.target}'s schema")
    index = names.index(name)
    args, kwargs = list(node.args), dict(node.kwargs)
    if index < len(args):
        args[index] = value
    else:
        kwargs[name] = value
    return tuple(args), kwargs


def set_argument(node: Node, name: str, value: Argument) -> None:
    """Set ``node``'s argument ``name`` (by its op's schema) to ``value`` (``with_argument``)."""
    node.args, node.kwargs = with_argument(node, name, value)


def arg(node: Node, index: int, name: str | None = None, default: Argument = None) -> Argument:
    """``node``'s argument at position ``index`` of its op's schema, read by the schema's name for
    that position (``arguments``; ``default`` where neither the call nor the schema gives it). A
    target without a schema (``operator.getitem``, a Python function): position ``index``, else
    keyword ``name``, else ``default``."""
    schema = _schema(node)
    if schema is not None and index < len(schema.arguments):
        return arguments(node).get(schema.arguments[index].name, default)
    if index < len(node.args):
        return node.args[index]
    return node.kwargs.get(name, default) if name is not None else default


def positional(node: Node) -> tuple[tuple[Argument, ...], dict[str, Argument]]:
    """``node``'s ``(args, kwargs)`` with every argument its op's schema takes positionally given by
    position (a schema default filling a gap before the last one given), the keyword-only ones by
    keyword: the form the rest of weavepass writes, for a node rebuilt from one a chained pass may
    have given keywords (``view(self=x, size=s)`` -> ``((x, s), {})``). A call that gives no
    positional argument by keyword is returned as it is; a target without a schema too."""
    schema = _schema(node)
    if schema is None:
        return tuple(node.args), dict(node.kwargs)
    leading = [a for a in schema.arguments if not a.kwarg_only]
    if not any(a.name in node.kwargs for a in leading):
        return tuple(node.args), dict(node.kwargs)
    given = arguments(node)
    last = max(i for i, a in enumerate(leading) if i < len(node.args) or a.name in node.kwargs)
    args = tuple(given[a.name] for a in leading[:last + 1])
    kwargs = {name: value for name, value in node.kwargs.items() if name not in {a.name for a in leading}}
    return args, kwargs


def as_node(value: object, node: Node, where: str) -> Node:
    """``value`` (``where`` of ``node``: ``"argument 0"``, ``"partial"``) as the node it must be."""
    if not isinstance(value, Node):
        raise unexpected(node, where, value, "a node")
    return value


def as_optional_node(value: object, node: Node, where: str) -> Node | None:
    """``value`` (``where`` of ``node``) as a node or None (an optional tensor argument)."""
    return None if value is None else as_node(value, node, where)


def as_str(value: object, node: Node, where: str) -> str:
    """``value`` (``where`` of ``node``) as the str it must be (a group name)."""
    if not isinstance(value, str):
        raise unexpected(node, where, value, "a str")
    return value


def arg_node(node: Node, index: int, name: str | None = None) -> Node:
    """``node``'s argument ``index`` (or keyword ``name``), a tensor: its node."""
    return as_node(arg(node, index, name), node, _where(index, name))


def arg_int(node: Node, index: int, name: str | None = None, default: int | None = None) -> int:
    """``node``'s argument ``index`` (or keyword ``name``, else ``default``), an int (a dim)."""
    value = arg(node, index, name, default)
    if not isinstance(value, int):
        raise unexpected(node, _where(index, name), value, "an int")
    return value


def arg_ints(node: Node, index: int, name: str | None = None) -> list[int]:
    """``node``'s argument ``index`` (or keyword ``name``), a list of ints (dims)."""
    value = arg(node, index, name)
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, int) for v in value):
        raise unexpected(node, _where(index, name), value, "a list of ints")
    return [v for v in value if isinstance(v, int)]


def arg_list(node: Node, index: int, name: str | None = None) -> list[Argument]:
    """``node``'s argument ``index`` (or keyword ``name``), a list (of nodes, sizes, ...)."""
    return as_list(arg(node, index, name), node, _where(index, name))


def as_list(value: object, node: Node, where: str) -> list[Argument]:
    """``value`` (``where`` of ``node``) as the list (or tuple) it must be, as a new list."""
    if not isinstance(value, (list, tuple)):
        raise unexpected(node, where, value, "a list")
    return list(value)


def node_list(values: Sequence[object], node: Node, where: str) -> list[Node]:
    """``values`` (``where`` of ``node``), a list of tensors: their nodes."""
    return [as_node(v, node, f"{where}[{i}]") for i, v in enumerate(values)]


def tensor(node: Node) -> torch.Tensor:
    """``node``'s example value (``meta["val"]``), which the matcher has checked is a tensor."""
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        raise unexpected(node, 'meta["val"]', value, "a tensor")
    return value
