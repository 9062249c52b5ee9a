"""Sites of the Hugging Face families beyond the project's matrix, as small graphs.

* Biased row-parallel layers: the layer's replicated bias ``b`` (``[H]``) is added after its
  all_reduce. ``(S + b) + r`` (StarCoder2), ``((S_m + b_m) + (S_a + b_a)) + r`` (GPT-NeoX's
  parallel residual), ``(S_a + (S_m + b_m)) + r`` (GPT-J), ``((S_a + b_a) + (S_m + b_m)) + r``
  (Phi): the biases move onto the residual, the sums share one all_reduce (``SumTree``).
* MiniMax: the experts' ``[T, H]`` sum viewed as ``[B, S, H]`` and scaled (``residual * alpha +
  h * beta``).
* Llama4: the routed experts' sum ``all_reduce(p).view(E, T, H).sum(0)`` added to the shared
  expert's all_reduce: one all_reduce of ``p.view(E, T, H).sum(0) + p_shared``.
* Qwen3-Next: the shared expert's sum gated per token (``sigmoid(gate(x)) * S_shared``) added to the
  routed experts' sum: one all_reduce of ``p + g * p_shared``.
* GraniteMoeHybrid: ``r + (S + s) * c`` (the experts' sum plus the replicated shared MLP, scaled):
  the scale is distributed, hoisted onto the partial, and ``s * c`` moves onto the residual.
* Every record names where in the model its all_reduce is (``weavepass.compile.where``).

Graph-level tests compile on a fake group of 2 (``test_patterns``'s helpers); the numbers are
checked on 2 gloo ranks against eager and the fp32 function (``check_against_eager``), fuse-only,
split forced and FlashComm forced.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from test_patterns import (  # noqa: F401  (fake_world: the fake group every test here compiles on)
    AR,
    FUSED,
    FUSED_LN,
    WAIT,
    H,
    ar,
    cohere_layer_norm,
    compile_report,
    fake_world,
    inputs,
    llama_norm,
)

import weavepass
from weavepass import WeaveConfig
from weavepass.compile.reasons import Reason, ReasonCode
from weavepass.compile.where import GRAPH_INPUT, module_path, source_line, where_reduced
from weavepass.report import WeaveReport

ADD = "aten.add.Tensor"


def biases(dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(1)
    return torch.randn(H, generator=g).to(dtype), torch.randn(H, generator=g).to(dtype)


def starcoder2(x, w, r, weight, b, b2):
    h = (ar(x @ w) + b) + r
    return llama_norm(h, weight), h


def neox_layer(xa, xm, w, r, weight, b, b2):
    """The attention reads ``xa``, the MLP ``xm`` (GPT-NeoX: each its own LayerNorm of the stream)."""
    a = ar(xa @ w)
    m = ar(xm @ w.flip(0))
    h = ((m + b2) + (a + b)) + r
    return cohere_layer_norm(h, weight), h


def gpt_neox(x, w, r, weight, b, b2):
    return neox_layer(x, x, w, r, weight, b, b2)


def gpt_j(x, w, r, weight, b, b2):
    a = ar(x @ w)  # no bias on the attention's output projection
    h = (a + (ar(x @ w.flip(0)) + b2)) + r
    return cohere_layer_norm(h, weight), h


def phi(x, w, r, weight, b, b2):
    h = ((ar(x @ w) + b) + (ar(x @ w.flip(0)) + b2)) + r
    return cohere_layer_norm(h, weight), h


def test_biased_sum_moves_its_bias_onto_the_residual():
    graph = compile_report(starcoder2, *inputs(), *biases())
    assert graph.ops_after[FUSED] == 1 and graph.ops_after[AR] == graph.ops_after[WAIT] == 0
    (record,) = graph.records
    assert record.lowering == "portable" and record.matmul == "mm", record
    assert "bias row(s) arg2_1 of the row-parallel layer(s) added to the residual" in record.kind, record.kind
    # (S + b) + r and the norm's eps: only the new b + r is left, the op adds the sum and norms
    assert (graph.ops_before[ADD], graph.ops_after[ADD]) == (3, 1)


@pytest.mark.parametrize("form", [gpt_neox, gpt_j, pytest.param(phi, marks=pytest.mark.full(
    covered_by="test_parallel_biased_branches_share_one_all_reduce[gpt_neox]: both branches biased"))])
def test_parallel_biased_branches_share_one_all_reduce(form):
    graph = compile_report(form, *inputs(), *biases())
    assert graph.ops_before[AR] == 2 and graph.ops_after[AR] == graph.ops_after[WAIT] == 0
    assert graph.ops_after[FUSED_LN] == 1
    (record,) = graph.records  # the merged all_reduce has no record of its own
    assert record.kind.startswith("residual, summed with all_reduce_1: one all_reduce"), record.kind
    assert "bias row(s)" in record.kind and record.matmul == "", record
    assert "all_reduce_1 is summed with all_reduce's sum into one all_reduce" in graph.note, graph.note
    # the branches' adds, the biases' and the residual's are gone: the partials' sum, the biases'
    # sum (two biases) and bias + residual are left (the LayerNorm's own adds are in the op)
    assert graph.ops_after[ADD] == (2 if form is gpt_j else 3), graph.ops_after


def test_biased_sum_without_a_norm_says_so():
    def f(x, w, r, weight, b, b2):
        return ar(x @ w) + b

    graph = compile_report(f, *inputs(), *biases())
    assert graph.ops_after == graph.ops_before
    (record,) = graph.records
    assert record.reasons == [Reason.of(ReasonCode.BIAS_NO_NORM, bias="arg2_1")], record.reasons


def test_biased_sum_read_elsewhere_is_a_term_of_the_other_tree():
    """A biased sum that is also returned is not inside the other sum's tree: it is one more
    replicated term there (moved onto the residual), and its own site is refused (no norm)."""
    def f(x, w, r, weight, b, b2):
        a = ar(x @ w) + b
        h = (ar(x @ w.flip(0)) + b2) + a + r
        return llama_norm(h, weight), h, a

    graph = compile_report(f, *inputs(), *biases())
    kept, fused = graph.records
    assert not kept.matched and kept.reasons[0].find(ReasonCode.BIAS_NO_NORM) is not None, kept
    assert fused.lowering and "bias row(s) arg3_1 " in fused.kind and ", and add as well" in fused.kind, fused.kind
    assert graph.ops_after[FUSED] == 1 and graph.ops_after[AR] == 1


def minimax(x, w, r, weight, b, b2):
    """The experts' sum ``[T, H]`` viewed as ``[1, T, H]``, then ``residual * alpha + h * beta``."""
    h = r.view(1, *r.shape) * 0.5 + ar(x @ w).view(1, x.shape[0], H) * 0.25
    return llama_norm(h, weight), h


def test_scale_after_a_view_of_the_sum():
    graph = compile_report(minimax, *inputs(), *biases())
    assert graph.ops_after[FUSED] == 1 and graph.ops_after[AR] == 0
    (record,) = graph.records
    assert record.kind.startswith("residual, sum scaled by 0.25"), record.kind


def llama4(x, w, r, weight, b, b2):
    """Llama4's MoE: 4 experts' rows ``[4 T, H]`` all_reduced, summed over experts, added to the
    shared expert's all_reduce (the routed one comes first in the graph)."""
    t = x.shape[0]
    scales = torch.arange(1, 5, dtype=x.dtype).view(4, 1, 1) / 4  # each expert its own weight
    experts = torch.bmm(x.unsqueeze(0).expand(4, t, 32), w.unsqueeze(0) * scales)  # [4, T, H], as HF's bmm
    routed = ar(experts.view(-1, H)).view(4, t, H).sum(0)
    h = (ar(x @ w.flip(0)) + routed).view(1, t, H) + r.view(1, t, H)
    return llama_norm(h, weight), h


def test_routed_experts_sum_over_experts_joins_the_shared_experts_all_reduce():
    graph = compile_report(llama4, *inputs(), *biases())
    assert graph.ops_before[AR] == 2 and graph.ops_after[AR] == graph.ops_after[WAIT] == 0
    assert graph.ops_after[FUSED] == 1
    assert graph.ops_after["aten.sum.dim_IntList"] == 1  # now on the partial, before the collective
    (record,) = graph.records  # the routed all_reduce, merged, has no record (not even a rejection)
    assert record.node == "all_reduce_1" and "summed with all_reduce (" in record.kind, record.kind
    assert "all_reduce is summed with all_reduce_1's sum into one all_reduce" in graph.note, graph.note


def qwen3_next(x, w, r, weight, b, b2):
    """Qwen3-Next's MoE: the shared expert's all_reduce gated per token by ``sigmoid(gate(x))``
    (``[T, 1]``, replicated), added to the routed experts' all_reduce, then to the residual."""
    shared = torch.sigmoid(x[:, :1]) * ar(x @ w.flip(0))  # (the gate reads the replicated input)
    h = (ar(x @ w) + shared) + r
    return llama_norm(h, weight), h


def granite_hybrid(x, w, r, weight, b, b2):
    """GraniteMoeHybrid's MoE: the experts' sum viewed ``[1, T, H]``, plus the replicated shared
    MLP's output, the two scaled by ``residual_multiplier`` and added to the residual."""
    t = x.shape[0]
    shared = torch.cat([x, x], -1).view(1, t, H)  # (replicated: the shared MLP is not sharded)
    h = r.view(1, t, H) + (ar(x @ w).view(1, t, H) + shared) * 0.22
    return llama_norm(h, weight), h


def test_gated_shared_expert_joins_the_routed_experts_all_reduce():
    """``S_routed + g * S_shared`` with ``g`` a replicated per-token gate: one all_reduce of
    ``p_routed + g * p_shared`` (``g`` moves onto the shared expert's partial)."""
    graph = compile_report(qwen3_next, *inputs(), *biases())
    assert graph.ops_before[AR] == 2 and graph.ops_after[AR] == graph.ops_after[WAIT] == 0
    assert graph.ops_after[FUSED] == 1 and graph.ops_after["aten.sigmoid.default"] == 1
    (record,) = graph.records
    assert record.node == "all_reduce_1" and "summed with all_reduce (mul, its sum scaled by sigmoid" in record.kind
    assert "all_reduce is summed with all_reduce_1's sum into one all_reduce" in graph.note, graph.note
    # the gate's product now on the partial, the partials' sum, the residual add inside the op
    assert (graph.ops_before[ADD], graph.ops_after[ADD]) == (3, 1), graph.ops_after


def test_gate_from_a_partial_or_a_product_of_sums_is_not_merged():
    """A gate computed from a rank's own partial differs between ranks, and a product of two sums
    is not linear in either: neither moves onto a partial."""
    def rank_local_gate(x, w, r, weight, b, b2):
        p = x @ w
        h = (ar(p) + torch.sigmoid(p[:, :1]) * ar(x @ w.flip(0))) + r
        return llama_norm(h, weight), h

    def product(x, w, r, weight, b, b2):
        h = (ar(x @ w) + ar(x @ w) * ar(x @ w.flip(0))) + r
        return llama_norm(h, weight), h

    graph = compile_report(rank_local_gate, *inputs(), *biases())
    assert graph.ops_after[AR] == 2 and graph.ops_after[FUSED] == 0, graph.records
    local = graph.records[0].reasons[0].find(ReasonCode.RANK_LOCAL_INPUT)
    assert local is not None and local.field("partial") == "mm", graph.records[0].reasons
    graph = compile_report(product, *inputs(), *biases())
    assert graph.ops_after[AR] == 2 and graph.ops_after[FUSED] == 1, graph.records  # the first sum: x = S2 * S3
    assert not any("summed with" in r.kind for r in graph.records), graph.records


def test_scale_of_a_sum_plus_a_replicated_term_is_distributed():
    """``r + (S + s) * c``: the scale is distributed (``S * c + s * c``), hoisted onto the partial,
    and ``s * c`` moves onto the residual: the site is fused, no all_reduce is left."""
    graph = compile_report(granite_hybrid, *inputs(), *biases())
    assert graph.ops_after[FUSED] == 1 and graph.ops_after[AR] == graph.ops_after[WAIT] == 0
    (record,) = graph.records
    assert record.kind.startswith("residual, sum scaled by 0.22, the scale of (sum + x) distributed"), record.kind
    # (S + s) * c + r: the scales of S and s, and s * c + r are left (the op adds the sum)
    assert (graph.ops_after["aten.mul.Tensor"], graph.ops_after[ADD]) == (2, 1), graph.ops_after


def test_scale_of_a_sum_that_reaches_no_norm_is_not_distributed():
    def f(x, w, r, weight, b, b2):
        return (ar(x @ w) + r) * 0.5

    graph = compile_report(f, *inputs(), *biases())
    assert graph.ops_after == graph.ops_before
    assert graph.ops_after["aten.mul.Tensor"] == 1 and not graph.records[0].matched


def test_scale_computed_after_the_sum_from_earlier_values_moves_up():
    """MiniCPM3's embedding: ``embed(ids) * self.embed_scale.to(dtype)``, the scale a buffer
    converted after the embedding's all_reduce: the computation moves before the all_reduce and
    the scale onto the partial. A scale computed from the sum itself stays."""
    def minicpm3(x, w, r, weight, b, b2):
        h = ar(x @ w) * (b[0].float() * 2).to(x.dtype)  # (a 0-d value of a replicated input)
        return llama_norm(h, weight), h

    def from_the_sum(x, w, r, weight, b, b2):
        s = ar(x @ w)
        h = s * s[0, 0]
        return llama_norm(h, weight), h

    graph = compile_report(minicpm3, *inputs(), *biases())
    assert graph.ops_after[FUSED] == 1 and graph.ops_after[AR] == 0, graph.records
    assert graph.records[0].kind.startswith("no-residual, sum scaled by "), graph.records[0].kind
    graph = compile_report(from_the_sum, *inputs(), *biases())
    assert graph.ops_after[FUSED] == 0 and graph.ops_after[AR] == 1, graph.records


def test_rms_norm_written_with_pow():
    """Gemma3n's and Gemma4's RMSNorm: ``x * torch.pow(mean(x^2) + eps, -0.5)`` is an RMSNorm."""
    def f(x, w, r, weight, b, b2):
        h = ar(x @ w) + r
        hf = h.float()
        return (hf * torch.pow(hf.pow(2).mean(-1, keepdim=True) + 1e-6, -0.5) * weight.float()).type_as(h), h

    graph = compile_report(f, *inputs(), *biases())
    assert graph.ops_after[FUSED] == 1 and graph.ops_after[AR] == 0, graph.records
    assert graph.ops_after["aten.pow.Tensor_Scalar"] == 0, graph.ops_after


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.down_proj = torch.nn.Linear(32, H, bias=False, dtype=torch.bfloat16)

    def forward(self, x, r, weight):
        summed = funcol.all_reduce(self.down_proj(x), "sum", dist.group.WORLD)
        return llama_norm(summed + r, weight), funcol.all_reduce(self.down_proj(x), "sum", dist.group.WORLD)


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([_Block()])

    def forward(self, x, r, weight):
        return self.layers[0](x, r, weight)


def test_records_name_the_module_and_source_line():
    x, _, r, weight = inputs()
    graph = compile_report(_Model(), x, r, weight)
    fused, kept = graph.records
    assert fused.lowering and not kept.matched
    for record in graph.records:
        assert record.where.startswith("layers.0 (test_family_forms.py:"), record.where
        assert "funcol.all_reduce(self.down_proj(x)" in record.where, record.where
    assert f"in {kept.where}" in str(WeaveReport([graph]))  # rendering test: the report names the module


def test_module_path_and_source_line_of_hand_made_metadata():
    """Dynamo's spellings of the root module and of list indices; the innermost frame's code line
    (not the caret line under it)."""
    node = torch.fx.Graph().placeholder("x")
    for key, expected in ((r"L['self'].model.layers[0].mlp", "model.layers.0.mlp"),
                          (r"L['args'][0].model.layers.1.mlp.fc2", "model.layers.1.mlp.fc2"),
                          (r"L['self']._modules['model'].embed_tokens", "model.embed_tokens")):
        node.meta["nn_module_stack"] = {"a": ("L['self']", object), "b": (key, object)}
        assert module_path(node) == expected
    node.meta["stack_trace"] = ('  File "/x/modeling_a.py", line 3, in forward\n    h = self.f(x)\n'
                                '  File "/x/modeling_b.py", line 7, in forward\n    return self.down(x)\n'
                                '           ^^^^^^^^^^^^\n')
    assert source_line(node) == "modeling_b.py:7: return self.down(x)"
    assert module_path(torch.fx.Graph().placeholder("y")) == source_line(torch.fx.Graph().placeholder("y")) == ""


def test_a_collective_without_metadata_is_placed_by_what_it_reduces():
    """LongCat-Flash (the sweep): an all_reduce that carries no module metadata is named by the
    value it reduces (up through views and casts), or as a graph input after a graph break,
    never by its node name alone."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    mm = g.call_function(torch.ops.aten.mm.default, (x, x))
    mm.meta["nn_module_stack"] = {"a": ("L['self'].mlps[1].down_proj", object)}
    view = g.call_function(torch.ops.aten.view.default, (mm, [-1]))
    ar = g.call_function(torch.ops._c10d_functional.all_reduce.default, (view, "sum", "0"))
    assert module_path(ar) == source_line(ar) == ""
    assert where_reduced(ar) == "mlps.1.down_proj"
    from_input = g.call_function(torch.ops._c10d_functional.all_reduce.default, (x, "sum", "0"))
    assert where_reduced(from_input) == GRAPH_INPUT
    ar.meta["nn_module_stack"] = {"a": ("L['self'].layers[0]", object)}
    assert where_reduced(ar) == "layers.0"  # its own metadata first


# ----- numbers on 2 gloo ranks -------------------------------------------------------------------


def biased_stack(x, w, r, weight, b, b2):
    """An embedding-like sum, then a StarCoder2 and a GPT-NeoX layer (its MLP reads a second,
    unfused LayerNorm of the stream) and a Qwen3-Next MoE: the stream runs from site to site (6
    all_reduces, 4 sites)."""
    e = ar(x @ w)
    n0 = llama_norm(e, weight)
    n1, h1 = starcoder2(n0[:, :32], w, e, weight, b, b2)
    n2, h2 = neox_layer(n1[:, :32], torch.nn.functional.layer_norm(h1, (H,))[:, :32], w, h1, weight, b, b2)
    return qwen3_next(n2[:, :32], w, h2, weight, b, b2)


def stream_stack(x, w, r, weight, b, b2):
    """``biased_stack``, then a Llama4 MoE layer: FlashComm keeps the stream sharded throughout
    (8 all_reduces, 5 sites)."""
    n2, h2 = biased_stack(x, w, r, weight, b, b2)
    return llama4(n2[:, :32], w, h2, weight, b, b2)


def scaled_stack(x, w, r, weight, b, b2):
    """``stream_stack`` and then MiniMax's scaled residual (its ``residual * alpha`` is not the
    stream: FlashComm refuses it) and a GraniteMoeHybrid MoE, 10 all_reduces, 7 sites."""
    n3, h3 = stream_stack(x, w, r, weight, b, b2)
    n4, h4 = minimax(n3[0, :, :32], w, h3[0], weight, b, b2)
    return granite_hybrid(n4[0, :, :32], w, h4[0], weight, b, b2)


STACKS = {"fuse": (scaled_stack, 7), "split": (biased_stack, 4), "flashcomm": (stream_stack, 5)}
"""The graph each strategy compiles and its site count: the split has no rule for the experts'
``bmm`` of this Llama4 stand-in (a batch of experts), and FlashComm needs the stream carried."""


CONFIGS = {"fuse": WeaveConfig(), "split": WeaveConfig(split="force"),
           "flashcomm": WeaveConfig(enable_flashcomm=True, flashcomm_min_prefill_tokens=1)}


RUNS = ("split-torch.float32", "flashcomm-torch.float32", "fuse-torch.float32", "fuse-torch.bfloat16")
"""Strategy and dtype of each gloo run; CI compiles the first two (the split's graph is fused first,
every form but MiniMax's and Llama4's; FlashComm's has Llama4's), ``WEAVE_TEST_FULL=1`` all four."""
FULL = os.environ.get("WEAVE_TEST_FULL") == "1"


def _forms_rank(rank: int, world: int, runs: tuple[str, ...]) -> dict:
    """``STACKS[strategy]`` compiled vs eager vs the fp32 function on a gloo group: fp32 with every
    strategy, bf16 fuse-only. Each rank's partials are its own matmuls (its weight shard); x, r,
    the norm weight and the biases are the same on every rank, as tensor parallelism keeps them."""
    from weavepass.testing.harness import check_against_eager

    g = torch.Generator().manual_seed(0)
    x, r, weight = torch.randn(7, 32, generator=g), torch.randn(7, H, generator=g), torch.randn(H, generator=g)
    w = [torch.randn(32, H, generator=g) / 4 for _ in range(world)][rank]
    b, b2 = biases(torch.float32)
    results = {}
    for run in runs:
        name, dtype = run.split("-")[0], getattr(torch, run.split(".")[1])
        backend = weavepass.make_backend(CONFIGS[name])
        torch._dynamo.reset()
        fn = STACKS[name][0]
        comparison = check_against_eager(fn, tuple(t.to(dtype) for t in (x, w, r, weight, b, b2)),
                                         lambda f: torch.compile(f, backend=backend), fn, dtype,
                                         raise_on_failure=False)
        (graph,) = backend.report.graphs
        results[f"{name}-{dtype}"] = (comparison.passed, str(comparison), str(backend.report),
                                      graph.ops_after[AR], [rec.lowering for rec in graph.records], graph.note)
    return results


@pytest.fixture(scope="module")
def forms_on_gloo():
    from weavepass.testing.distributed import spawn

    return spawn(_forms_rank, 2, "gloo", RUNS if FULL else RUNS[:2], timeout_s=600)


@pytest.mark.parametrize("run", [*RUNS[:2], *(pytest.param(run, marks=pytest.mark.full(
    covered_by="the split's run (fused, then split) and the graph tests")) for run in RUNS[2:])])
def test_forms_equal_eager_on_gloo(forms_on_gloo, run):
    """Every site fused (``STACKS``' counts; the merged all_reduces have no record), no all_reduce left, on both ranks
    alike, and within ``check_against_eager``'s per-dtype bound of the fp32 function: the rewrites
    only reorder the sums, biases and scales (where each is rounded)."""
    first = forms_on_gloo[0][run]
    for rank_results in forms_on_gloo:
        passed, table, report, left, lowerings, note = rank_results[run]
        assert (lowerings, note) == first[4:], (report, first[2])  # every rank decided the same
        assert left == 0 and len(lowerings) == STACKS[run.split("-")[0]][1] and all(lowerings), report
        if run.startswith("flashcomm"):
            assert all(lw.startswith("flashcomm:") for lw in lowerings), report
        if run.startswith("split"):
            assert "split" in note and "fuse-only" not in note, report
        assert passed, table


def test_post_norm_embedding_sum_says_what_it_is():
    """OLMo2's start: the embedding's sum feeds the first layer's projections directly, and the
    branch is normed before it is added (post-norm): no norm follows the sum. The finder's
    rejection carries ``ReasonCode.POST_NORM_SUM`` (read again from the rewritten graph, where the
    all_reduce is left as it was)."""
    from weavepass.compile.patterns.allreduce_rmsnorm import find_allreduce_rmsnorm_sites
    from weavepass.compile.reasons import ReasonCode

    def f(x, w, r, weight, b, b2):
        e = ar(x @ w)
        attn = ar(e @ w.T @ w)  # a layer reads the sum itself
        return e + llama_norm(attn, weight)

    graphs = []
    with torch._inductor.config.patch(post_grad_custom_post_pass=graphs.append):
        graph = compile_report(f, *inputs(), *biases())
    first, second = graph.records
    assert not first.matched and [r.code for r in first.reasons] == [ReasonCode.POST_NORM_SUM], first.reasons
    assert second.lowering, second  # the branch's own sum, normed without a residual
    sites, (rejected,) = find_allreduce_rmsnorm_sites(graphs[0])
    assert not sites and rejected.code is ReasonCode.POST_NORM_SUM, rejected


def test_post_norm_sum_read_by_matmuls_given_by_keyword():
    """``_post_norm_sum`` tells the layer's input from its weight by the schema's name (``mat2``):
    with every ``aten.mm`` of the post-grad graph given its arguments by keyword, as a pass chained
    before weave's may, the finder gives the same records (``node.args[-1]`` raised IndexError on
    them). The pass gives the positional calls back before weave's runs: Inductor's own lowering of
    a keyword ``mm`` left in the graph fails (``tuned_mm() got an unexpected keyword argument 'self'``)."""
    from weavepass.compile.patterns.allreduce_rmsnorm import find_allreduce_rmsnorm_sites

    def f(x, w, r, weight, b, b2):
        e = ar(x @ w)
        return e + llama_norm(ar(e @ w.T @ w), weight)  # (test_post_norm_embedding_sum_says_what_it_is)

    found = []

    def find_with_keyword_mms(graph: torch.fx.Graph) -> None:
        found.append(find_allreduce_rmsnorm_sites(graph))
        mms = {n: n.args for n in graph.nodes if n.target is torch.ops.aten.mm.default}
        for node, args in mms.items():
            node.args, node.kwargs = (), {"self": args[0], "mat2": args[1]}
        found.append(find_allreduce_rmsnorm_sites(graph))
        for node, args in mms.items():
            node.args, node.kwargs = args, {}
        found.append(len(mms))

    with torch._inductor.config.patch(post_grad_custom_pre_pass=find_with_keyword_mms):
        compile_report(f, *inputs(), *biases())
    (want_sites, (want,)), (sites, (rejected,)), mms = found
    assert mms == 3 and want.code is ReasonCode.POST_NORM_SUM, want
    assert rejected.code is ReasonCode.POST_NORM_SUM and rejected.reason == want.reason, rejected
    assert [s.all_reduce.name for s in sites] == [s.all_reduce.name for s in want_sites] and len(sites) == 1
