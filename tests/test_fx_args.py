"""The typed FX argument accessors (``weavepass.compile.fx_args``): each returns the argument a
matcher checked for and raises ``UnexpectedArgument``, naming the node, its op and what was
expected, when the graph holds something else. Hand-built graphs, no tracing."""

from __future__ import annotations

import operator

import pytest
import torch
from torch.fx import Graph

from weavepass.compile.fx_args import (
    UnexpectedArgument,
    arg,
    arg_int,
    arg_ints,
    arg_list,
    arg_node,
    arguments,
    as_optional_node,
    as_str,
    node_list,
    tensor,
)

aten = torch.ops.aten


def _graph() -> tuple[Graph, dict[str, torch.fx.Node]]:
    g = Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(2, 3)
    t = g.call_function(aten.transpose.int, (x, 0, 1))
    p = g.call_function(aten.permute.default, (x, [1, 0]))
    s = g.call_function(aten.sum.dim_IntList, (x, [1]), {"keepdim": True})
    c = g.call_function(aten.cat.default, ([x, t],))
    return g, {"x": x, "t": t, "p": p, "s": s, "c": c}


def test_accessors_return_the_checked_arguments():
    _, n = _graph()
    assert arg_node(n["t"], 0) is n["x"]
    assert (arg_int(n["t"], 1), arg_int(n["t"], 2)) == (0, 1)
    assert arg_ints(n["p"], 1) == [1, 0]
    assert arg_list(n["c"], 0) == [n["x"], n["t"]]
    assert node_list(arg_list(n["c"], 0), n["c"], "argument 0") == [n["x"], n["t"]]
    assert tensor(n["x"]).shape == (2, 3)
    assert as_optional_node(None, n["t"], "bias") is None
    assert as_str("tp", n["t"], "group_name") == "tp"


def test_a_schema_position_is_read_by_its_name():
    """``arg`` reads through ``arguments``: the schema's name for the position, given positionally
    or as a keyword, else the schema's default, else ``default``."""
    g, n = _graph()
    assert arg(n["s"], 2, "keepdim", False) is True  # a keyword
    assert arg(n["s"], 2) is True  # the schema names position 2 keepdim: no name needed
    assert arg(n["s"], 1, "dim") == [1]  # positional
    assert arguments(n["s"]) == {"self": n["x"], "dim": [1], "keepdim": True, "dtype": None}
    assert arg_int(n["c"], 1) == 0  # cat's dim: the schema's default
    assert arg(n["t"], 5, "missing", 7) == 7  # past the schema: neither given, the default
    assert arg_int(n["t"], 3, "dim", -1) == -1
    item = g.call_function(operator.getitem, (n["x"], 1))  # no schema: by position, then keyword
    assert arg_int(item, 1) == 1 and arg(item, 2, "missing", 3) == 3
    with pytest.raises(UnexpectedArgument, match="an op with a schema"):
        arguments(item)


@pytest.mark.parametrize("read,expected", [
    (lambda n: arg_int(n["t"], 0), "an int"),  # a node where an int was expected
    (lambda n: arg_node(n["t"], 1), "a node"),  # an int where a node was expected
    (lambda n: arg_ints(n["c"], 0), "a list of ints"),  # a list of nodes
    (lambda n: arg_list(n["t"], 1), "a list"),
    (lambda n: tensor(n["t"]), "a tensor"),  # no meta["val"]
    (lambda n: as_str(3, n["t"], "group_name"), "a str"),
    (lambda n: node_list([n["x"], 2], n["c"], "argument 0"), "a node"),
])
def test_an_unexpected_argument_is_an_internal_error_naming_the_node(read, expected):
    _, n = _graph()
    with pytest.raises(UnexpectedArgument, match="weavepass internal error") as error:
        read(n)
    assert "transpose" in str(error.value) or "cat" in str(error.value)
    assert f"where {expected} was expected" in str(error.value)
    assert isinstance(error.value, TypeError)
