"""The finder reads op arguments by their schema names (``weavepass.compile.fx_args.arguments``), so a graph
whose collectives and norms take their arguments by keyword is matched and rewritten as the same
graph with positional arguments (a position holds only for one schema: LayerNorm has a bias after
the weight, ``rms_norm`` has not; a keyword holds for every schema that names it).

On a gloo group of one rank with ``min_world_size=1``: the fused op's portable lowering then runs
for real, and its result is compared with the function run eagerly."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.fx.experimental.proxy_tensor import make_fx

from weavepass import WeaveConfig
from weavepass.compile.fx_args import arguments
from weavepass.compile.graph_pass import WeavePass
from weavepass.compile.patterns import find_allreduce_rmsnorm_sites
from weavepass.ops import FUSED_ALLREDUCE_LAYERNORM, FUSED_ALLREDUCE_RMSNORM

H = 32
C10D = torch.ops._c10d_functional
KEYWORD_OPS = {C10D.all_reduce.default, torch.ops.aten.mean.dim, torch.ops.aten.var_mean.correction,
               torch.ops.aten.native_layer_norm.default}
"""The ops whose arguments the test moves into keywords: the ones the finder reads arguments of
beyond the first (the group, the reduce op, the mean's dims and keepdim, the norm's weight, bias, eps)."""


@pytest.fixture
def group(tmp_path):
    torch._dynamo.reset()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _rms(h, g):
    return g * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))


def _var_mean_norm(h, g):
    var, mean = torch.var_mean(h, -1, correction=0, keepdim=True)
    return (h - mean) * torch.rsqrt(var + 1e-5) * g


def _layer_norm(h, g):
    return torch.nn.functional.layer_norm(h, (H,), g, g.flip(0), 1e-5)  # native_layer_norm under make_fx


def _two_sites(norm):
    def f(x, r, w1, g1, w2, g2):
        h1 = funcol.all_reduce(x @ w1, "sum", dist.group.WORLD) + r
        h2 = funcol.all_reduce(torch.relu(norm(h1, g1)) @ w2, "sum", dist.group.WORLD) + h1
        return norm(h2, g2), h2

    return f


def _inputs(tokens=5):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(tokens, 16, generator=g), torch.randn(tokens, H, generator=g),
            torch.randn(16, H, generator=g), torch.rand(H, generator=g) + 0.5,
            torch.randn(H, H, generator=g) / 4, torch.rand(H, generator=g) + 0.5)


def _trace(norm, args) -> torch.fx.GraphModule:
    """The post-grad-like graph of ``_two_sites(norm)``; fake tracing gives every node's ``val`` one
    fake mode, as Inductor's graphs have (the pass runs the fused ops' fakes on them)."""
    return make_fx(_two_sites(norm), tracing_mode="fake")(*args)


def _by_keyword(gm: torch.fx.GraphModule) -> int:
    """Give every call of ``KEYWORD_OPS`` in ``gm`` all its arguments by keyword; returns how many."""
    moved = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in KEYWORD_OPS:
            names = [a.name for a in node.target._schema.arguments]  # the op's own names (``self``)
            node.args, node.kwargs = (), {**dict(zip(names, node.args)), **node.kwargs}
            moved += 1
    gm.recompile()
    return moved


def test_arguments_reads_keywords_and_defaults(group):
    gm = _trace(_rms, _inputs())
    assert _by_keyword(gm) == 4  # two all_reduces, two means
    ar = next(n for n in gm.graph.nodes if n.target is C10D.all_reduce.default)
    mean = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.mean.dim)
    assert ar.args == () and mean.args == ()
    assert arguments(ar) == {"input": ar.kwargs["input"], "reduce_op": "sum", "group_name": group.group_name}
    assert arguments(mean)["dim"] == [-1] and arguments(mean)["keepdim"] is True
    assert arguments(mean)["dtype"] is None  # a default the call left out


@pytest.mark.parametrize("norm", [_rms, _var_mean_norm, _layer_norm], ids=["rms", "var_mean", "layer_norm"])
def test_keyword_arguments_match_and_rewrite_as_positional(group, norm):
    args = _inputs()
    positional, keyword = _trace(norm, args), _trace(norm, args)
    assert _by_keyword(keyword) >= 4
    # the finder: the same matches, field by field
    expected, rejected = find_allreduce_rmsnorm_sites(positional.graph)
    assert rejected == [] and len(expected) == 2
    found, rejected = find_allreduce_rmsnorm_sites(keyword.graph)
    assert rejected == [] and len(found) == 2
    for a, b in zip(expected, found):
        assert (b.all_reduce.name, b.group_name, b.partial.name, b.add.name) == (
            a.all_reduce.name, a.group_name, a.partial.name, a.add.name)
        assert (b.norm.kind, b.norm.eps, b.norm.weight.name) == (a.norm.kind, a.norm.eps, a.norm.weight.name)
        assert (b.norm.bias is None) == (a.norm.bias is None)
        assert (b.residual.name if b.residual is not None else None) == (
            a.residual.name if a.residual is not None else None)
    # the rewrite: both sites fused, no all_reduce left, the very graph of the positional one (the
    # nodes that took keywords are all replaced), and the numbers of the eager function
    config = WeaveConfig(lowering="portable", min_world_size=1, check_plan_across_ranks=False)
    for gm in (positional, keyword):
        WeavePass(config)(gm.graph)
        gm.recompile()
    fused = FUSED_ALLREDUCE_RMSNORM if norm is _rms else FUSED_ALLREDUCE_LAYERNORM
    targets = [n.target for n in keyword.graph.nodes]
    assert targets.count(fused) == 2 and not KEYWORD_OPS & set(targets)
    assert keyword.code == positional.code
    # A group of one rank: the sum is the partial, the fused op adds and normalises in fp32 as
    # eager does, in another order of operations: default fp32 tolerances (rtol 1.3e-6, atol 1e-5).
    for got, want in zip(keyword(*args), _two_sites(norm)(*args)):
        torch.testing.assert_close(got, want)


# ---------------------------------------------------------------- every op of the norm by keyword


def _rms_sqrt_div(h, g):
    return g * (h / torch.sqrt((h * h).mean(-1, keepdim=True) + 1e-6))


def _rms_pow(h, g):  # Gemma3n's ``pow(var + eps, -0.5)``
    return (h * (h.pow(2).mean(-1, keepdim=True) + 1e-6).pow(-0.5)) * g


def _upcast_rms(h, g):  # LlamaRMSNorm on bf16 rows: the fp32 upcast and the downcast
    hf = h.to(torch.float32)
    return g * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype)


def _written_layer_norm(h, g):  # CohereLayerNorm's mean, centring and variance written out, with a bias
    d = h - h.mean(-1, keepdim=True)
    return d * torch.rsqrt(d.pow(2).mean(-1, keepdim=True) + 1e-5) * g + g.flip(0)


def _written_layer_norm_div(h, g):
    d = h - h.mean(-1, keepdim=True)
    return g * (d / torch.sqrt((d * d).mean(-1, keepdim=True) + 1e-5))


NORM_FORMS = {"rms": (_rms, False), "sqrt_div": (_rms_sqrt_div, False), "pow": (_rms_pow, False),
              "upcast_to_copy": (_upcast_rms, False), "upcast_convert": (_upcast_rms, True),
              "var_mean": (_var_mean_norm, False), "written_layer_norm": (_written_layer_norm, False),
              "written_layer_norm_div": (_written_layer_norm_div, False)}
"""``(norm, decompose)``: ``decompose`` traces with Inductor's decompositions (``.to`` as
``prims.convert_element_type``, not ``aten._to_copy``)."""


def _norm_ops_by_keyword(gm: torch.fx.GraphModule, names: set[str]) -> int:
    """Give the calls named ``names`` (a norm's nodes; ``operator.getitem`` takes no keywords) all
    their arguments by keyword, as a chained pass may; returns how many."""
    moved = 0
    for node in gm.graph.nodes:
        if node.name in names and isinstance(node.target, torch._ops.OpOverload):
            schema_names = [a.name for a in node.target._schema.arguments]
            node.args, node.kwargs = (), {**dict(zip(schema_names, node.args)), **node.kwargs}
            moved += 1
    gm.recompile()
    return moved


@pytest.mark.parametrize("form", list(NORM_FORMS))
def test_norm_ops_given_by_keyword_match_and_rewrite_as_positional(group, form):
    """``match_rmsnorm`` reads the operands of the norm's pow, mul, div, add, mean, sub and casts by
    the schema's names: with every op of both norms given by keyword, the same matches and the
    very rewritten graph (the positional reads raised IndexError, or missed the LayerNorm's
    centring and left the site alone)."""
    from torch._inductor.decomposition import select_decomp_table

    norm, decompose = NORM_FORMS[form]
    args = _inputs()
    if form.startswith("upcast"):
        args = tuple(a.to(torch.bfloat16) for a in args)
    table = select_decomp_table() if decompose else None

    def trace() -> torch.fx.GraphModule:
        return make_fx(_two_sites(norm), decomposition_table=table, tracing_mode="fake")(*args)

    positional, keyword = trace(), trace()
    expected, rejected = find_allreduce_rmsnorm_sites(positional.graph)
    assert rejected == [] and len(expected) == 2
    names = {n.name for site in expected for n in site.norm.nodes}
    assert _norm_ops_by_keyword(keyword, names) >= 2 * 4
    found, rejected = find_allreduce_rmsnorm_sites(keyword.graph)
    assert rejected == [] and len(found) == 2, rejected
    for a, b in zip(expected, found):
        assert (b.norm.form, b.norm.kind, b.norm.eps, b.norm.input.name, b.norm.output.name) == (
            a.norm.form, a.norm.kind, a.norm.eps, a.norm.input.name, a.norm.output.name)
        assert [n.name for n in b.norm.nodes] == [n.name for n in a.norm.nodes]
        assert [getattr(b.norm, f) and getattr(b.norm, f).name for f in ("weight", "bias")] == [
            getattr(a.norm, f) and getattr(a.norm, f).name for f in ("weight", "bias")]
    config = WeaveConfig(lowering="portable", min_world_size=1, check_plan_across_ranks=False)
    for gm in (positional, keyword):
        WeavePass(config)(gm.graph)
        gm.recompile()
    assert keyword.code == positional.code
