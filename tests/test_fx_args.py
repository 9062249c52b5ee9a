"""The typed FX argument accessors (``weavepass.compile.fx_args``): each returns the argument a
matcher checked for and raises ``UnexpectedArgument``, naming the node, its op and what was
expected, when the graph holds something else; ``set_argument`` writes one by its schema name, as
``replication.insert_checks`` does. Hand-built graphs, no tracing."""

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
    positional,
    set_argument,
    tensor,
    with_argument,
)
from weavepass.compile.replication import insert_checks
from weavepass.ops import CHECK_REPLICATED, FUSED_ALLREDUCE_LAYERNORM, FUSED_ALLREDUCE_RMSNORM

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


def test_set_argument_writes_by_schema_name_where_the_call_gives_it():
    """Positional stays positional, keyword stays keyword, a default the call left out is given by
    keyword; a name the schema lacks is an internal error. ``with_argument`` leaves the node."""
    g, n = _graph()
    y = g.placeholder("y")
    assert with_argument(n["t"], "dim1", 0) == ((n["x"], 0, 0), {})
    assert n["t"].args == (n["x"], 0, 1)  # unchanged
    set_argument(n["t"], "self", y)  # positional
    assert n["t"].args == (y, 0, 1) and n["t"].kwargs == {}
    set_argument(n["s"], "keepdim", False)  # a keyword
    assert n["s"].args == (n["x"], [1]) and n["s"].kwargs == {"keepdim": False}
    set_argument(n["s"], "dtype", torch.float64)  # a default the call left out
    assert arguments(n["s"]) == {"self": n["x"], "dim": [1], "keepdim": False, "dtype": torch.float64}
    set_argument(n["c"], "dim", 1)  # past the positional ones
    assert n["c"].args == ([n["x"], n["t"]],) and arg_int(n["c"], 1) == 1
    with pytest.raises(UnexpectedArgument, match="argument 'bias'"):
        set_argument(n["t"], "bias", y)


def _fused_call(op, positional: int, absent: set[str]) -> torch.fx.Node:
    """A graph with one call of the fused op ``op``: its first ``positional`` schema arguments
    given by position, the rest by keyword; its tensors placeholders, but None for those ``absent``."""
    g = Graph()
    names = [a.name for a in op._schema.arguments]
    values: dict[str, object] = {"eps": 1e-6, "group_name": "tp", "out_dtype": torch.float32,
                                 "lowering": "portable", "workspace_tokens": 64}
    for name in ("partial", "residual", "weight", "bias"):
        if name in names:
            values[name] = None if name in absent else g.placeholder(name)
            if values[name] is not None:
                values[name].meta["val"] = torch.empty(4) if name in ("weight", "bias") else torch.empty(2, 4)
    return g.call_function(op, tuple(values[name] for name in names[:positional]),
                           {name: values[name] for name in names[positional:]})


@pytest.mark.parametrize("op,positional,absent,checked,compared", [
    (FUSED_ALLREDUCE_RMSNORM, 1, set(), "residual", "weight"),
    (FUSED_ALLREDUCE_RMSNORM, 1, {"residual"}, "weight", None),
    (FUSED_ALLREDUCE_LAYERNORM, 1, {"residual", "weight"}, "bias", None),
    (FUSED_ALLREDUCE_LAYERNORM, 9, set(), "residual", "weight"),
], ids=["rms_keywords", "rms_weight_keyword", "layer_norm_bias_keyword", "layer_norm_positional"])
def test_replication_checks_write_the_argument_by_name(op, positional, absent, checked, compared):
    """``insert_checks`` routes the argument it checks through ``weave.check_replicated`` and
    writes the check into the fused op by the argument's schema name, given by keyword or by
    position: only that argument changes."""
    node = _fused_call(op, positional, absent)
    before = arguments(node)
    assert insert_checks(node.graph, {"all_reduce_1": node}) == 1
    after = arguments(node)
    check = after[checked]
    assert isinstance(check, torch.fx.Node) and check.target is CHECK_REPLICATED
    assert after == {**before, checked: check}
    what = {"residual": "residual", "weight": "norm weight", "bias": "norm bias"}[checked]
    bias = before.get("bias") if checked != "bias" else None
    assert check.args == (before[checked], before[compared] if compared else None, what, "all_reduce_1", "tp", bias)


def test_replication_checks_skip_a_site_without_tensors_to_compare():
    node = _fused_call(FUSED_ALLREDUCE_RMSNORM, 1, {"residual", "weight"})
    before = (node.args, dict(node.kwargs))
    assert insert_checks(node.graph, {"all_reduce_1": node}) == 0
    assert (node.args, node.kwargs) == before


def test_positional_gives_positional_arguments_by_position():
    """``positional``: a call's schema-positional arguments by position (a default filling a gap),
    its keyword-only ones by keyword; a positional call and a target without a schema as they are."""
    g, n = _graph()
    x = n["x"]
    view = g.call_function(aten.view.default, (), {"size": [3, 2], "self": x})
    assert positional(view) == ((x, [3, 2]), {})
    part = g.call_function(aten.slice.Tensor, (x,), {"end": 2})  # dim and start: their defaults fill the gap
    assert positional(part) == ((x, 0, None, 2), {})
    mm = g.call_function(aten.addmm.default, (), {"self": x, "mat1": x, "mat2": x, "beta": 2})
    assert positional(mm) == ((x, x, x), {"beta": 2})  # beta: keyword-only
    assert positional(n["s"]) == ((x, [1], True), {})  # keepdim: positional in the schema
    assert positional(n["t"]) == ((x, 0, 1), {}) and positional(n["t"])[0] is n["t"].args  # as it is
    item = g.call_function(operator.getitem, (n["c"], 0))
    assert positional(item) == ((n["c"], 0), {})
