"""Graph-level tests: which all_reduces are rewritten, what the graph holds before and after.

These run on a fake process group (no real communication): every test compiles a small function
with a fresh ``WeaveBackend`` and asserts on the op counts the pass recorded before and after its
rewrite, and on the per-all_reduce records of the explain report.
"""

from __future__ import annotations

import functools
import re

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch.testing._internal.distributed.fake_pg import FakeStore

import weavepass
from weavepass import WeaveConfig
from weavepass.compile.reasons import Reason, ReasonCode

AR = "_c10d_functional.all_reduce.default"
WAIT = "_c10d_functional.wait_tensor.default"
FUSED = "weave.fused_allreduce_rmsnorm.default"
FUSED_LN = "weave.fused_allreduce_layernorm.default"
H = 64


@pytest.fixture(scope="module", autouse=True)
def fake_world():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield dist.group.WORLD
    dist.destroy_process_group()


def ar(x, op="sum"):
    return funcol.all_reduce(x, op, dist.group.WORLD)


def llama_norm(x, weight, eps=1e-6):
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def compile_report(fn, *args, config=None, options=None):
    backend = weavepass.make_backend(config)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(fn, backend=backend, fullgraph=True, options=options)(*args)
    (graph,) = backend.report.graphs
    return graph


def assert_fused(graph, n_fused, n_kept=0):
    """``n_fused`` sites became weave ops, and their all_reduces and waits are gone."""
    assert graph.ops_after[FUSED] == n_fused, graph.records
    assert graph.ops_after[AR] == n_kept
    assert graph.ops_after[WAIT] == n_kept
    assert graph.ops_before[AR] == n_fused + n_kept
    assert graph.rewritten == n_fused
    assert graph.matched == n_fused


def assert_unchanged(graph, code, **fields):
    """The pass left the graph exactly as it was and said why: a reason with ``code`` (the record's
    own or one it carries: where the reading stopped) and (at least) ``fields``."""
    assert graph.ops_after == graph.ops_before
    assert graph.ops_after[FUSED] == 0
    (record,) = graph.records
    assert not record.matched
    (reason,) = record.reasons
    found = reason.find(code)
    assert found is not None and all(found.field(k) == v for k, v in fields.items()), reason


def inputs(tokens=6, dtype=torch.bfloat16, hidden=H):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, 32, generator=g).to(dtype)
    w = torch.randn(32, hidden, generator=g).to(dtype)
    r = torch.randn(tokens, hidden, generator=g).to(dtype)
    weight = torch.randn(hidden, generator=g).to(dtype)
    return x, w, r, weight


# ----- sites that must be matched ---------------------------------------------------------------


def test_llama_norm_with_residual_records_matmul():
    def f(x, w, r, weight):
        h = ar(x @ w) + r
        return llama_norm(h, weight), h

    graph = compile_report(f, *inputs())
    assert_fused(graph, 1)
    (record,) = graph.records
    assert record.lowering == "portable"
    assert record.matmul.startswith("mm")
    assert "residual" in record.kind and "fp32-upcast" in record.kind


@pytest.mark.parametrize("residual_first", [False, True])
def test_either_operand_order_of_the_add(residual_first):
    def f(x, w, r, weight):
        y = ar(x @ w)
        h = r + y if residual_first else y + r
        return llama_norm(h, weight), h

    assert_fused(compile_report(f, *inputs()), 1)


def test_new_residual_unused_later():
    def f(x, w, r, weight):
        return llama_norm(ar(x @ w) + r, weight)

    assert_fused(compile_report(f, *inputs()), 1)


def test_no_residual_embedding_site_keeps_sum_for_later_use():
    def f(x, w, r, weight):
        h = ar(x @ w)  # like a vocab-parallel embedding: the sum is the residual stream
        return llama_norm(h, weight), h * 2

    graph = compile_report(f, *inputs())
    assert_fused(graph, 1)
    assert "no-residual" in graph.records[0].kind


def _granite_residual(x, w, r, weight):
    h = r + ar(x @ w) * 0.22  # GraniteDecoderLayer: residual + branch * residual_multiplier
    return llama_norm(h, weight), h


def _granite_embedding(x, w, r, weight):
    h = ar(x @ w) * 12.0  # GraniteModel: embeddings * embedding_multiplier
    return llama_norm(h, weight), h


def _gemma_embedding(x, w, r, weight):
    h = ar(x @ w) * torch.tensor(H**0.5, dtype=x.dtype)  # GemmaModel: embeddings * sqrt(hidden)
    return llama_norm(h, weight), h


@pytest.mark.parametrize("fn, kind", [
    (_granite_residual, "residual, sum scaled by 0.22"),
    (_granite_embedding, "no-residual, sum scaled by 12.0"),
    (_gemma_embedding, "no-residual, sum scaled by 8.0"),
])
def test_scaled_sum_is_a_site(fn, kind):
    """``all_reduce(p) * c`` for a scalar c is ``all_reduce(p * c)``: the scale moves onto the
    partial, and the rest is an ordinary site (numbers: tests/test_hf_models.py, Granite and Gemma)."""
    graph = compile_report(fn, *inputs())
    assert_fused(graph, 1)
    assert graph.records[0].kind.startswith(kind), graph.records[0].kind


def test_scale_by_a_token_tensor_is_not_a_site():
    def f(x, w, r, weight):
        gate = torch.sigmoid(x[:, :1])  # one value per token, not a scalar: not linear in the sum
        return llama_norm(r + ar(x @ w) * gate, weight)

    assert_unchanged(compile_report(f, *inputs()), ReasonCode.NO_NORM, first_user="aten.mul.Tensor")


@pytest.mark.parametrize(
    "norm",
    [
        pytest.param(lambda h, w: F.rms_norm(h, (H,), w, eps=1e-5), id="F.rms_norm"),
        pytest.param(lambda h, w: F.rms_norm(h, (H,), w.float(), eps=1e-5), id="fp32-weight"),
        pytest.param(lambda h, w: F.rms_norm(h, (H,), None, eps=1e-5), id="no-weight"),
        pytest.param(lambda h, w: llama_norm(h, w, eps=3.3e-4), id="odd-eps"),
        pytest.param(lambda h, w: h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * w,
                     id="div-sqrt"),
        pytest.param(lambda h, w: w * (h * torch.rsqrt((h * h).mean(dim=-1, keepdim=True) + 1e-6)),
                     id="mul-square-weight-first"),
    ],
)
def test_norm_forms(norm):
    def f(x, w, r, weight):
        h = ar(x @ w) + r
        return norm(h, weight), h

    assert_fused(compile_report(f, *inputs()), 1)


def test_nn_rmsnorm_module_in_fp32_model():
    norm = torch.nn.RMSNorm(H, eps=1e-5)

    def f(x, w, r, weight):
        h = ar(x @ w) + r
        return norm(h), h

    graph = compile_report(f, *inputs(dtype=torch.float32))
    assert_fused(graph, 1)
    assert "float32" in graph.records[0].kind


def test_eps_is_read_from_the_graph():
    eps = 7.25e-3

    def f(x, w, r, weight):
        return llama_norm(ar(x @ w) + r, weight, eps=eps)

    backend = weavepass.make_backend()
    captured = {}

    def spy(graph):
        for node in graph.nodes:
            if node.target is torch.ops.weave.fused_allreduce_rmsnorm.default:
                captured["eps"] = node.args[3]

    torch._dynamo.reset()
    with torch.no_grad(), torch._inductor.config.patch(post_grad_custom_post_pass=spy):
        torch.compile(f, backend=backend)(*inputs())
    assert captured["eps"] == pytest.approx(eps)


def test_views_between_steps_do_not_hide_sites():
    def f(x, w, r, weight):
        # [B*S, H] all_reduce -> [B, S, H] add -> norm; then [B, S, H] -> [B*S, H] -> norm.
        y = ar(x @ w).view(2, 3, H)
        h = y + r.view(2, 3, H)
        out1 = llama_norm(h, weight)
        y2 = ar(out1 * 3)
        h2 = (h + y2).reshape(6, H)
        return llama_norm(h2, weight), h2

    graph = compile_report(f, *inputs())
    assert_fused(graph, 2)


def test_three_dim_all_reduce_with_flattening_norm_input():
    def f(x, w, r, weight):
        y = ar((x @ w).view(2, 3, H))
        return llama_norm(y.view(6, H), weight), y

    assert_fused(compile_report(f, *inputs()), 1)


def test_in_place_c10d_all_reduce_is_matched():
    def f(x, w, r, weight):
        y = x @ w
        dist.all_reduce(y)
        h = y + r
        return llama_norm(h, weight), h

    assert_fused(compile_report(f, *inputs()), 1)


SCRATCH_FORMS = ("rows", "layer")


def scratch_buffer(x, w, r, weight, form="rows", keep=False):
    """An engine that reduces in place into part of a scratch buffer and reads the same part back:
    rows (``buf[:T]``) or one layer's slot (``buf[i]``). Functionalised, the sum is written into a
    copy of the buffer (``slice_scatter`` / ``select_scatter``) and read back (``slice`` /
    ``select`` of the same part), which is the sum itself. With ``keep`` the buffer (holding the
    sum) is also returned: the sum is needed beside the site's residual add, which the fused op
    does not return."""
    tokens, hidden = x.shape[0], w.shape[1]
    if form == "rows":
        buf, part = torch.zeros(2 * tokens, hidden, dtype=x.dtype), slice(0, tokens)
    else:
        buf, part = torch.zeros(3, tokens, hidden, dtype=x.dtype), 1
    buf[part] = x @ w
    dist.all_reduce(buf[part])
    h = buf[part] + r
    return (llama_norm(h, weight), h) + ((buf,) if keep else ())


@pytest.mark.parametrize("form", SCRATCH_FORMS)
def test_in_place_all_reduce_into_a_scratch_buffer_is_matched(form):
    assert_fused(compile_report(functools.partial(scratch_buffer, form=form), *inputs()), 1)


def test_scratch_buffer_holding_the_sum_read_elsewhere_is_kept():
    graph = compile_report(functools.partial(scratch_buffer, keep=True), *inputs())
    assert graph.ops_after[FUSED] == 0 and graph.ops_after[AR] == 1
    (record,) = graph.records
    assert record.codes == [ReasonCode.SUM_OTHER_READERS], record.reason


def _scratch_buffer_rank(rank: int, world: int) -> dict:
    """The scratch-buffer forms in fp32 and bf16, compiled vs eager vs the fp32 function, on gloo."""
    from weavepass.testing.harness import check_against_eager

    g = torch.Generator().manual_seed(0)
    x, r, weight = torch.randn(7, 32, generator=g), torch.randn(7, H, generator=g), torch.randn(H, generator=g)
    w = [torch.randn(32, H, generator=g) / 4 for _ in range(world)][rank]
    results = {}
    for form, keep in [(form, False) for form in SCRATCH_FORMS] + [("rows", True)]:
        f = functools.partial(scratch_buffer, form=form, keep=keep)
        for dtype in (torch.float32, torch.bfloat16):
            backend = weavepass.make_backend()
            torch._dynamo.reset()
            comparison = check_against_eager(f, tuple(t.to(dtype) for t in (x, w, r, weight)),
                                             lambda f: torch.compile(f, backend=backend), f, dtype,
                                             raise_on_failure=False)
            results[form, keep, str(dtype)] = (comparison.passed, str(comparison), backend.report.rewritten)
    return results


def test_scratch_buffer_forms_equal_eager_on_gloo():
    from weavepass.testing.distributed import spawn

    for rank_results in spawn(_scratch_buffer_rank, 2, "gloo"):
        for (form, keep, dtype), (passed, table, rewritten) in rank_results.items():
            assert rewritten == (not keep), (form, keep, dtype)
            assert passed, (form, keep, dtype, table)


def test_every_site_of_a_stack_is_rewritten():
    layers = 4

    def f(x, w, r, weight):
        h = ar(x @ w)  # embedding-like site without residual
        for _ in range(layers):
            normed = llama_norm(h, weight)
            h = h + ar(normed * 0.5)   # attention-like
            normed = llama_norm(h, weight)
            h = h + ar(normed * 0.25)  # MLP-like
        return llama_norm(h, weight)

    assert_fused(compile_report(f, *inputs()), 2 * layers + 1)


# ----- all_reduces that must be left alone ------------------------------------------------------


@pytest.mark.parametrize("op", ["max", "avg"])
def test_reject_non_sum_all_reduce(op):
    def f(x, w, r, weight):
        return llama_norm(ar(x @ w, op) + r, weight)

    assert_unchanged(compile_report(f, *inputs()), ReasonCode.REDUCE_OP_NOT_SUM, op=op)


def test_reject_all_reduce_result_with_other_users():
    def f(x, w, r, weight):
        y = ar(x @ w)
        return llama_norm(y + r, weight), y

    assert_unchanged(compile_report(f, *inputs()), ReasonCode.SUM_OTHER_READERS)


@pytest.mark.parametrize("form", ["in-place all_reduce", "copy_ into a buffer"])
def test_sum_written_back_into_an_input_is_named_in_the_reason(form):
    """Engines reduce in place into a tensor they were given, or copy the sum into a preallocated
    buffer passed in: the graph then writes the sum back into that input at its end, a reader of
    the sum that the user's code does not show. The reason names it, and the other readers."""
    def f(x, y, r, weight, out):
        if form == "in-place all_reduce":
            dist.all_reduce(y)
        else:
            out.copy_(ar(y))
            y = out
        h = y + r
        return llama_norm(h, weight), h, y * 2

    x, w, r, weight = inputs()
    graph = compile_report(f, x, x @ w, r, weight, torch.zeros_like(r))
    (record,) = graph.records
    assert not record.matched
    (reason,) = record.reasons
    assert reason.code is ReasonCode.SUM_OTHER_READERS, reason
    readers = dict(reason.field("readers"))
    assert len(readers) == 2 and len([written for written in readers.values() if written]) == 1, readers
    assert any(name.startswith("mul") for name in readers) and any(name.startswith("copy_") for name in readers)


def test_reject_norm_over_another_dim():
    def f(x, w, r, weight):
        h = ar(x @ w) + r
        hf = h.float()
        return (hf * torch.rsqrt(hf.pow(2).mean(0, keepdim=True) + 1e-6)).to(h.dtype) * weight

    assert_unchanged(compile_report(f, *inputs()), ReasonCode.NORM_NOT_LAST_DIM, dims=[0])


def test_reject_norm_intermediate_used_elsewhere():
    def f(x, w, r, weight):
        h = ar(x @ w) + r
        hf = h.float()
        inv = torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (hf * inv).to(h.dtype) * weight, inv

    assert_unchanged(compile_report(f, *inputs()), ReasonCode.READ_BY_OUTPUT)


def test_reject_all_reduce_without_norm():
    def f(x, w, r, weight):
        return (ar(x @ w) + r) @ w.t()

    graph = compile_report(f, *inputs())
    assert_unchanged(graph, ReasonCode.NO_NORM)
    # The add may not be a residual add (a shared expert, another all_reduce): the reason names
    # what was added and does not call it a residual.
    assert ReasonCode.AFTER_ADD in graph.records[0].reasons[0].codes(), graph.records[0].reason
    assert not any(code.name.startswith("RESIDUAL") for code in graph.records[0].reasons[0].codes())


def cohere_layer_norm(x, weight, eps=1e-5):
    """CohereLayerNorm as written: mean-subtracted, fp32, weight after."""
    dtype = x.dtype
    x = x.to(torch.float32)
    mean = x.mean(-1, keepdim=True)
    variance = (x - mean).pow(2).mean(-1, keepdim=True)
    return (weight.to(torch.float32) * ((x - mean) * torch.rsqrt(variance + eps))).to(dtype)


def torch_layer_norm(affine: str):
    """``F.layer_norm`` with the weight and bias that ``affine`` names (Inductor: ``var_mean``)."""
    def norm(h, weight):
        w = weight if "weight" in affine else None
        b = weight.flip(0) if "bias" in affine else None
        return F.layer_norm(h, (h.shape[-1],), w, b, 1e-5)
    return norm


@pytest.mark.parametrize("norm, residual, dtype, form", [
    ("cohere", True, torch.bfloat16, "LayerNorm (decomposed+fp32-upcast), weight torch.float32,"),
    ("cohere", False, torch.float32, "LayerNorm (decomposed), weight torch.float32,"),
    ("weight+bias", True, torch.bfloat16,
     "LayerNorm (var_mean+fp32-upcast), weight torch.bfloat16, bias torch.bfloat16,"),
    ("weight+bias", False, torch.float32, "LayerNorm (var_mean), weight torch.float32, bias torch.float32,"),
    ("weight", True, torch.float32, "LayerNorm (var_mean), weight torch.float32, sum torch.float32"),
    ("bias", True, torch.bfloat16, "LayerNorm (var_mean+fp32-upcast), bias torch.bfloat16,"),
    ("none", True, torch.bfloat16, "LayerNorm (var_mean+fp32-upcast), sum torch.bfloat16"),
])
def test_layer_norm_is_a_site(norm, residual, dtype, form):
    """Every LayerNorm form Inductor's post-grad graph holds becomes one
    ``weave.fused_allreduce_layernorm``; the report names the LayerNorm, its weight and bias."""
    layer_norm = cohere_layer_norm if norm == "cohere" else torch_layer_norm(norm)

    def f(x, w, r, weight):
        h = ar(x @ w) + r if residual else ar(x @ w)
        return layer_norm(h, weight), h

    graph = compile_report(f, *inputs(dtype=dtype))
    assert graph.ops_after[FUSED_LN] == 1 and graph.ops_after[FUSED] == 0, graph.records
    assert graph.ops_after[AR] == graph.ops_after[WAIT] == 0
    assert graph.ops_after["aten.var_mean.correction"] == graph.ops_after["aten.rsqrt.default"] == 0
    (record,) = graph.records
    assert record.lowering == "portable"
    assert record.kind.startswith(f"{'residual' if residual else 'no-residual'}, {form}"), record.kind


@pytest.mark.parametrize("norm, reason", [
    # torch.var_mean's default variance is unbiased: not LayerNorm's.
    (lambda h: (h - h.mean(-1, keepdim=True)) * torch.rsqrt(torch.var_mean(h, -1, keepdim=True)[0] + 1e-5),
     (ReasonCode.UNBIASED_VARIANCE, {"correction": 1})),
    # The inverse deviation scales the input, not the mean-subtracted input.
    (lambda h: h * torch.rsqrt((h - h.mean(-1, keepdim=True)).pow(2).mean(-1, keepdim=True) + 1e-5),
     (ReasonCode.INV_STD_NOT_SCALING_CENTRED, {})),
    # Mean-subtracted over the tokens, not the hidden dim: no norm at all.
    (lambda h: h - h.mean(0, keepdim=True), (ReasonCode.NO_NORM, {})),
])
def test_not_a_layer_norm_is_rejected_with_its_reason(norm, reason):
    def f(x, w, r, weight):
        return norm((ar(x @ w) + r).float())

    code, fields = reason
    assert_unchanged(compile_report(f, *inputs(dtype=torch.float32)), code, **fields)


def test_layer_norm_mean_used_elsewhere_is_rejected():
    def f(x, w, r, weight):
        h = ar(x @ w) + r
        mean = h.mean(-1, keepdim=True)
        d = h - mean
        return d * torch.rsqrt(d.pow(2).mean(-1, keepdim=True) + 1e-5) * weight, mean

    graph = compile_report(f, *inputs(dtype=torch.float32))
    assert_unchanged(graph, ReasonCode.READ_BY_OUTPUT, node="mean")



@pytest.mark.parametrize("stats", ["decomposed", "var_mean"])
def test_mean_subtracted_with_alpha_is_not_a_layer_norm(stats):
    """``x - 2 * mean`` (``sub(x, mean, alpha=2)``) is not LayerNorm's centring: the fused op
    would subtract the mean once (the probe before the fix: rewritten, 0.23 off eager in bf16)."""
    def f(x, w, r, weight):
        h = ar(x @ w) + r
        hf = h.float()
        if stats == "var_mean":
            var, mean = torch.var_mean(hf, -1, keepdim=True, correction=0)
            d = torch.sub(hf, mean, alpha=2)
        else:
            d = torch.sub(hf, hf.mean(-1, keepdim=True), alpha=2)
            var = d.pow(2).mean(-1, keepdim=True)
        return (d * torch.rsqrt(var + 1e-5)).to(h.dtype), h

    assert_unchanged(compile_report(f, *inputs()), ReasonCode.MEAN_SUB_ALPHA, alpha=2)


@pytest.mark.parametrize("norm", [llama_norm, cohere_layer_norm])
def test_fp32_norm_of_an_fp64_sum_is_left_alone(norm):
    """``h.to(float32)`` of an fp64 ``h`` narrows: eager normalises in fp32, the fused op would in
    fp64 (the probe before the fix: 4e-7 off eager, the fp64 tolerance is 1e-12)."""
    def f(x, w, r, weight):
        h = ar(x @ w) + r
        return norm(h, weight), h

    assert_unchanged(compile_report(f, *inputs(dtype=torch.float64)), ReasonCode.NARROWING_CAST,
                     dtype=torch.float64, acc_dtype=torch.float64)


@pytest.mark.parametrize("form", ["residual", "shared", "weight", "bias", "scale"])
def test_input_computed_from_the_partial_sum_is_left_alone(form):
    """The residual, a value added to the sum, the norm's weight or bias, or the factor of a scaled
    sum computed from this rank's own partial sum differs between ranks: the fused op normalises
    each rank's rows with their owner's copy (the probe before the fix: rewritten, off eager by 2.3
    and more), and ``ar(p) * c_r`` is not ``ar(p * c_r)`` (rewritten, off eager by 1.3 on gloo, fp32).
    The factor is before the all_reduce only where Inductor's inference ``reorder_for_locality``
    (which moves it down to its reader) is off, an option users may set."""
    def f(x, w, r, weight):
        p = x @ w
        if form == "scale":
            c = p.abs().amax()  # one number, this rank's
            h = ar(p) * c + r
        elif form == "residual":
            h = ar(p) + p
        elif form == "shared":
            h = (ar(p) + torch.tanh(p)).view(1, *p.shape) + r.view(1, *r.shape)
        elif form == "weight":
            h, weight = ar(p) + r, weight * p.amax(0)
        else:
            h = ar(p) + r
            return F.layer_norm(h, (H,), weight, p.amax(0), 1e-5), h
        return llama_norm(h, weight), h

    options = {"reorder_for_locality": False} if form == "scale" else None
    assert_unchanged(compile_report(f, *inputs(), options=options), ReasonCode.RANK_LOCAL_INPUT)


def parallel_branches(norm):
    """Cohere's layer: attention and MLP read one normed input; ``(h + attn) + mlp``, each a sum."""
    def layer(x, w, r, weight):
        a = ar(x @ w)
        m = ar(x @ w.flip(0))
        h = r + a + m
        return norm(h, weight), h
    return layer


@pytest.mark.parametrize("norm", [cohere_layer_norm, llama_norm])
def test_parallel_branch_sums_become_one_all_reduce(norm):
    """``(r + S_a) + S_m -> norm``: one all_reduce of both partials, then the residual add (either
    norm kind); the second all_reduce has no record of its own."""
    graph = compile_report(parallel_branches(norm), *inputs())
    assert graph.ops_before[AR] == 2 and graph.ops_after[AR] == graph.ops_after[WAIT] == 0
    assert graph.ops_after[FUSED_LN if norm is cohere_layer_norm else FUSED] == 1
    (record,) = graph.records
    assert record.kind.startswith("residual, summed with all_reduce_1, which the next add adds"), record.kind
    assert record.matmul == ""  # the op reads the partials' sum
    assert "all_reduce_1 is summed with all_reduce's sum into one all_reduce" in graph.note, graph.note


def _two_layer_norm_sites(x, w, r, weight):
    h1 = ar(x @ w) + r
    h2 = ar(cohere_layer_norm(h1, weight)[:, :32] @ w) + h1
    return cohere_layer_norm(h2, weight), h2


def test_token_split_takes_layer_norm_sites():
    """LayerNorm sites split like RMSNorm ones: each becomes the LayerNorm async op once per half,
    each joined once; no synchronous fused op and no all_reduce is left. (Numbers: Cohere in
    tests/test_hf_models.py, split on gloo ranks against eager; this group is fake.)"""
    graph = compile_report(_two_layer_norm_sites, *inputs(), config=WeaveConfig(split="force"))
    assert graph.ops_after["weave.fused_allreduce_layernorm_async.default"] == 4, graph.ops_after
    assert graph.ops_after["weave.join_async.default"] == 4
    assert graph.ops_after[FUSED_LN] == 0 and graph.ops_after[AR] == 0
    assert graph.note.startswith("split"), graph.note


def test_push_variant_keeps_the_fused_kernel_for_layer_norm_sites():
    graph = compile_report(_two_layer_norm_sites, *inputs(),
                           config=WeaveConfig(split="force", split_comm="push"))
    assert graph.ops_after["weave.fused_allreduce_layernorm_async.default"] == 4
    assert "weave.fused_allreduce_rmsnorm_push_async.default" not in graph.ops_after
    assert graph.reasons == [Reason(ReasonCode.PUSH_LAYER_NORM)], graph.note


def test_reject_group_below_min_world_size():
    def f(x, w, r, weight):
        return llama_norm(ar(x @ w) + r, weight)

    graph = compile_report(f, *inputs(), config=WeaveConfig(min_world_size=4))
    assert graph.ops_after == graph.ops_before
    (record,) = graph.records
    assert record.matched and not record.lowering
    assert record.reasons == [Reason.of(ReasonCode.GROUP_TOO_SMALL, size=2, min_world_size=4)]


def test_disabled_config_leaves_graph_alone():
    def f(x, w, r, weight):
        return llama_norm(ar(x @ w) + r, weight)

    graph = compile_report(f, *inputs(), config=WeaveConfig(enabled=False))
    assert graph.ops_after == graph.ops_before
    assert "enabled is False" in graph.note


def test_mixed_graph_rewrites_only_valid_sites():
    def f(x, w, r, weight):
        h = ar(x @ w) + r
        normed = llama_norm(h, weight)
        m = ar(normed, "max")
        return normed, m

    graph = compile_report(f, *inputs())
    assert_fused(graph, 1, n_kept=1)
    kept = [r for r in graph.records if not r.matched]
    assert len(kept) == 1 and kept[0].codes == [ReasonCode.REDUCE_OP_NOT_SUM], kept


# ----- config, report and uuid -----------------------------------------------------------------


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="lowering"):
        WeaveConfig(lowering="nccl")
    with pytest.raises(ValueError, match="split"):
        WeaveConfig(split="sometimes")
    with pytest.raises(TypeError, match="WeaveConfig"):
        weavepass.make_backend({"lowering": "portable"})


def test_uuid_changes_with_config():
    from weavepass.compile.graph_pass import WeavePass

    a = WeavePass(WeaveConfig()).uuid()
    assert a == WeavePass(WeaveConfig()).uuid()
    assert a != WeavePass(WeaveConfig(lowering="portable")).uuid()


def test_report_text_lists_every_all_reduce():
    def f(x, w, r, weight):
        h = ar(x @ w) + r
        normed = llama_norm(h, weight)
        return normed, ar(normed, "max")

    backend = weavepass.make_backend()
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(f, backend=backend)(*inputs())
    text = str(backend.report)
    assert "1 rewritten" in text
    assert "fused  -> portable" in text
    assert [r.reasons for r in backend.report.records if not r.matched] == [
        [Reason.of(ReasonCode.REDUCE_OP_NOT_SUM, op="max")]]


def test_cuda_lowering_requested_on_cpu_falls_back_with_reason():
    def f(x, w, r, weight):
        return llama_norm(ar(x @ w) + r, weight)

    graph = compile_report(f, *inputs(), config=WeaveConfig(lowering="cuda_symm"))
    assert_fused(graph, 1)
    (record,) = graph.records
    assert record.lowering == "portable"
    assert record.codes == [ReasonCode.PORTABLE_FALLBACK]
    assert record.reasons[0].field("cause").code is ReasonCode.CUDA_NOT_ON_CUDA, record.reasons


def test_dynamic_true_eps_input_is_reported_and_specialize_float_fixes_it():
    class Block(torch.nn.Module):
        eps = 1e-5  # a float attribute, as in most norm modules: dynamic=True lifts it

        def forward(self, x, w, r, weight):
            return llama_norm(ar(x @ w) + r, weight, eps=self.eps)

    f = Block()

    def run(**dynamo_config):
        backend = weavepass.make_backend()
        torch._dynamo.reset()
        with torch.no_grad(), torch._dynamo.config.patch(**dynamo_config):
            compiled = torch.compile(f, backend=backend, dynamic=True)
            compiled(*inputs(tokens=6))
            compiled(*inputs(tokens=11))  # a new token count: no new graph
        (graph,) = backend.report.graphs
        return graph

    lifted = run(specialize_float=False)
    assert lifted.ops_after == lifted.ops_before
    assert ReasonCode.EPS_NOT_CONSTANT in lifted.records[0].reasons[0].codes()
    assert_fused(run(specialize_float=True), 1)


def test_dtensor_rowwise_parallel_site_is_matched():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    class MLPBlock(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up = torch.nn.Linear(H, 2 * H, bias=False)
            self.down = torch.nn.Linear(2 * H, H, bias=False)
            self.norm = torch.nn.RMSNorm(H)

        def forward(self, x, r):
            h = r + self.down(torch.relu(self.up(x)))
            return self.norm(h), h

    block = MLPBlock()
    parallelize_module(block, init_device_mesh("cpu", (2,)), {"up": ColwiseParallel(),
                                                               "down": RowwiseParallel()})
    graph = compile_report(block, torch.randn(5, H), torch.randn(5, H))
    assert_fused(graph, 1)
    assert graph.records[0].matmul.startswith("mm")


def test_32_layer_model_has_65_sites_all_rewritten():
    """2 sites per layer (attention and MLP outputs) + 1 for the embedding, in one graph. The
    pass alone on the model's ``make_fx`` graph: a 32-layer Inductor compile took 35 s of CI, and
    the compiled 2-layer models (tests/test_end_to_end.py) check Inductor's side."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from weavepass.compile.graph_pass import WeavePass
    from weavepass.testing.models import TPConfig, build_tp_model, random_token_ids

    cfg = TPConfig(n_layers=32, hidden=16, n_heads=2, n_kv_heads=2, head_dim=8, intermediate=16,
                   vocab=32, dtype=torch.bfloat16)
    model = build_tp_model(cfg, 0, 2, dist.group.WORLD)
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}  # graph inputs, as Dynamo's

    def forward(state, ids):
        return torch.func.functional_call(model, state, (ids,))

    with torch.no_grad():
        graph = make_fx(forward, tracing_mode="fake")(state, random_token_ids(cfg, 1, 4)).graph
    reports = []
    WeavePass(WeaveConfig(), on_report=reports.append)(graph)
    (report,) = reports
    assert_fused(report, 65)


def test_compile_mode_and_options_reach_inductor(monkeypatch):
    """``mode=`` and ``options=`` of torch.compile mean what they mean for Inductor (a custom
    backend receives them as keyword arguments): the pass runs under the mode's config, and a bad
    mode or option is an error, not silently ignored."""
    from torch._inductor import config as inductor_config

    from weavepass.compile import graph_pass

    seen = []
    original = graph_pass.WeavePass.__call__

    def spy(self, graph):
        seen.append((inductor_config.triton.cudagraphs, inductor_config.max_autotune_gemm_backends))
        return original(self, graph)

    monkeypatch.setattr(graph_pass.WeavePass, "__call__", spy)

    def f(x, w, r, weight):
        h = ar(x @ w) + r
        return llama_norm(h, weight), h

    backend = weavepass.make_backend()
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(f, backend=backend, mode="reduce-overhead", fullgraph=True)(*inputs())
        torch._dynamo.reset()
        torch.compile(f, backend=backend, options={"max_autotune_gemm_backends": "ATEN"},
                      fullgraph=True)(*inputs())
    assert seen == [(True, inductor_config.max_autotune_gemm_backends), (False, "ATEN")], seen
    assert [g.rewritten for g in backend.report.graphs] == [1, 1]
    for kwargs, message in ((dict(mode="fastest"), "Unrecognized mode"),
                            (dict(options={"no_such_option": 1}), "unknown Inductor option")):
        torch._dynamo.reset()
        with pytest.raises(Exception, match=message):
            torch.compile(f, backend=weavepass.make_backend(), fullgraph=True, **kwargs)(*inputs())


def test_explain_numbers_its_own_graphs_from_0():
    """Graph numbers are per backend: a fresh backend (``explain``) starts at 0 whatever this
    process compiled before, and counts every graph it compiles (here two, around a graph break)."""

    def f(x, w, r, weight):
        h = ar(x @ w) + r
        torch._dynamo.graph_break()
        return llama_norm(ar(h @ w.T @ w) + h, weight)

    torch._dynamo.reset()
    compile_report(lambda *a: llama_norm(ar(a[0] @ a[1]) + a[2], a[3]), *inputs())  # an earlier graph
    for _ in range(2):
        torch._dynamo.reset()
        report = weavepass.explain(f, *inputs())
        assert [g.graph_index for g in report.graphs] == [0, 1]
        # (the backend, shared by every explain of this config, logs its own count: shown beside)
        logged = r"( \(graph \d+ in weavepass's log\))?"
        assert re.search(rf"\ngraph 0{logged}: 0/1 rewritten", str(report)), str(report)
        assert re.search(rf"\ngraph 1{logged}: 1/1 rewritten", str(report)), str(report)


# ----- MoE sums: a replicated shared expert, or a second all_reduce, added before the residual ---

ADD = "aten.add.Tensor"


def _shared_expert(x, r):
    """A replicated, gated shared-expert output (Qwen2-MoE): every rank computes it from the same
    (replicated) tensors."""
    return torch.sigmoid(x[:, :1]) * torch.tanh(r.flip(-1))


def qwen2_moe_shared(x, w, r, weight):
    h = ar(x @ w) + _shared_expert(x, r)  # the experts' sum plus the shared expert
    h = h.view(1, *h.shape) + r.view(1, *r.shape)  # then the residual add, in [B, S, H]
    return llama_norm(h, weight), h


def deepseek_two_sums(x, w, r, weight):
    routed = ar(x @ w).view(1, x.shape[0], H)  # the routed experts' sum, viewed like DeepSeek's
    h = routed + ar((x @ w).view(1, x.shape[0], H) * 0.5) + r.view(1, *r.shape)  # + the shared experts'
    return llama_norm(h, weight), h


def test_shared_expert_sum_is_a_site_and_its_add_is_not_called_a_residual_add():
    graph = compile_report(qwen2_moe_shared, *inputs())
    assert_fused(graph, 1)
    (record,) = graph.records
    # ``(S + s) + r`` became ``S + (s + r)``: of the three adds (two and the norm's eps) only the
    # new ``s + r`` is left; the op does ``S + (s + r)`` and the norm.
    assert (graph.ops_before[ADD], graph.ops_after[ADD]) == (3, 1)
    assert "added to the sum before the residual add: moved onto the residual" in record.kind, record.kind
    assert "rounding order differs" in record.kind


def test_shared_expert_without_a_later_residual_add_is_a_plain_site():
    def f(x, w, r, weight):
        return llama_norm(ar(x @ w) + _shared_expert(x, r), weight)

    graph = compile_report(f, *inputs())
    assert_fused(graph, 1)
    assert graph.records[0].kind.startswith("residual,"), graph.records[0].kind


def test_shared_add_read_elsewhere_is_not_folded():
    def f(x, w, r, weight):
        moe = ar(x @ w) + _shared_expert(x, r)
        return llama_norm(moe + r, weight), moe  # the MoE output itself is returned too

    graph = compile_report(f, *inputs())
    assert_unchanged(graph, ReasonCode.SUM_OTHER_READERS)


@pytest.mark.parametrize("residual", [True, False])
def test_two_sums_on_one_group_become_one_all_reduce(residual):
    def no_residual(x, w, r, weight):
        return llama_norm(ar(x @ w) + ar(x @ w.flip(0)), weight)

    graph = compile_report(deepseek_two_sums if residual else no_residual, *inputs())
    assert graph.ops_before[AR] == 2
    assert graph.ops_after[AR] == graph.ops_after[WAIT] == 0  # both replaced, by one fused op
    assert graph.ops_after[FUSED] == 1
    (record,) = graph.records  # the merged all_reduce has no record of its own: the site names it
    assert record.lowering == "portable"
    assert record.kind.startswith("residual," if residual else "no-residual,"), record.kind
    assert "summed with all_reduce_1" in record.kind and "one all_reduce" in record.kind, record.kind
    assert record.matmul == ""  # the fused op reads the partials' sum, not a matmul
    assert f"all_reduce_1 is summed with {record.node}'s sum into one all_reduce" in graph.note, graph.note


def test_two_sums_on_different_groups_are_not_merged():
    other = dist.new_group([0, 1])

    def f(x, w, r, weight):
        h = ar(x @ w) + funcol.all_reduce(x @ w, "sum", other) + r
        return llama_norm(h, weight), h

    graph = compile_report(f, *inputs())
    assert graph.ops_after == graph.ops_before
    assert len(graph.records) == 2 and not any(rec.matched for rec in graph.records)
    for rec in graph.records:
        assert rec.codes == [ReasonCode.PARTNER_UNFIT], rec.reason
        assert rec.reasons[0].field("cause").code is ReasonCode.PARTNER_OTHER_GROUP, rec.reason


def test_two_sums_on_different_groups_normed_directly_claim_the_add_once():
    """``S_a + S_b -> norm``: each all_reduce could read the other's sum as its residual; the
    first one's site takes the add, the second is refused and stays an all_reduce (its sum is the
    first site's residual)."""
    other = dist.new_group([0, 1])

    def f(x, w, r, weight):
        return llama_norm(ar(x @ w) + funcol.all_reduce(x @ w.flip(0), "sum", other), weight)

    graph = compile_report(f, *inputs())
    assert graph.ops_after[FUSED] == 1 and graph.ops_after[AR] == 1
    first, second = graph.records
    assert first.lowering == "portable" and first.kind.startswith("residual,"), first
    assert not second.matched and second.reasons == [
        Reason.of(ReasonCode.ALREADY_CLAIMED, node="add", site=first.node)], second


def moe_sums(x, w, r, weight):
    """Both forms in one graph (one compile per dtype): the shared expert and the two sums."""
    return qwen2_moe_shared(x, w, r, weight), deepseek_two_sums(x, w, r, weight)


def _moe_sums_rank(rank: int, world: int) -> dict:
    """``moe_sums`` in fp32 and bf16, compiled vs eager vs the fp32 function, on a gloo group.
    Each rank's partial is its own matmul (its weight shard); x, r, the norm weight and the shared
    expert's output are the same on every rank, as tensor parallelism keeps them."""
    from weavepass.testing.harness import check_against_eager

    g = torch.Generator().manual_seed(0)
    x, r, weight = torch.randn(7, 32, generator=g), torch.randn(7, H, generator=g), torch.randn(H, generator=g)
    w = [torch.randn(32, H, generator=g) / 4 for _ in range(world)][rank]
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        backend = weavepass.make_backend()
        torch._dynamo.reset()
        comparison = check_against_eager(moe_sums, tuple(t.to(dtype) for t in (x, w, r, weight)),
                                         lambda f: torch.compile(f, backend=backend), moe_sums, dtype,
                                         raise_on_failure=False)
        results[str(dtype)] = (comparison.passed, str(comparison), backend.report.rewritten,
                               [rec.kind for rec in backend.report.records])
    return results


@pytest.fixture(scope="module")
def moe_sums_on_gloo():
    from weavepass.testing.distributed import spawn

    return spawn(_moe_sums_rank, 2, "gloo")


@pytest.mark.parametrize("dtype", ["torch.float32", "torch.bfloat16"])
def test_moe_sums_equal_eager_on_gloo(moe_sums_on_gloo, dtype):
    """Reassociated (shared) and merged (two sums) on both ranks, and within
    ``check_against_eager``'s per-dtype bound of the fp32 function (every output, both forms): the
    rewrites change only where the sums are rounded."""
    for rank_results in moe_sums_on_gloo:
        passed, table, rewritten, kinds = rank_results[dtype]
        assert rewritten == 2, kinds
        assert "moved onto the residual" in kinds[0] and "one all_reduce" in kinds[1], kinds
        assert passed, table


def test_flashcomm_takes_merged_parallel_branch_sites():
    """FlashComm on Cohere-like layers (embedding sum -> LayerNorm, then ``(h + S_a) + S_m``):
    the merged all_reduce gets a new name when the site is prepared; its record is the site's."""
    def f(x, w, r, weight):
        h = ar(x @ w)  # the embedding's sum
        return parallel_branches(cohere_layer_norm)(cohere_layer_norm(h, weight)[:, :32], w, h, weight)

    graph = compile_report(f, *inputs(), config=WeaveConfig(enable_flashcomm=True, flashcomm_min_prefill_tokens=1))
    assert graph.ops_after[AR] == 0 and graph.ops_after["_c10d_functional.reduce_scatter_tensor.default"] == 2
    assert [r.lowering for r in graph.records] == ["flashcomm:portable"] * 2, graph.records


def test_dynamic_true_eps_input_is_given_once_per_site():
    """A site whose residual is another all_reduce's sum (the embedding's, in a vocab-parallel
    model) is read two ways (that sum as the residual, or as a second sum added first); when both
    stop at the lifted eps, the reason says so once, not twice."""

    class Block(torch.nn.Module):
        eps = 1e-5

        def forward(self, x, w, r, weight):
            h0 = ar(x @ w)
            h1 = ar(llama_norm(h0, weight, eps=self.eps) @ w.T @ w) + h0
            h2 = ar(llama_norm(h1, weight, eps=self.eps) @ w.T @ w) + h1
            return llama_norm(h2, weight, eps=self.eps)

    backend = weavepass.make_backend()
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(Block(), backend=backend, dynamic=True)(*inputs(tokens=6))
    (graph,) = backend.report.graphs
    assert len(graph.records) == 3 and graph.rewritten == 0
    for record in graph.records:
        assert ReasonCode.EPS_NOT_CONSTANT in record.reasons[0].codes(), record.reason
    # every sum does feed an RMSNorm here: the graph's note must not say that none does
    assert "feeds an" not in graph.note and "each one's reason is listed" in graph.note, graph.note


@pytest.mark.parametrize("given,expected", [
    ({"dim": [0]}, True),
    ({"dim": [0], "keepdim": False, "dtype": None}, True),
    ({"dim": [0, 1]}, True),
    ({"dim": [0], "keepdim": True}, False),  # keeps the experts' dim: not [T, H]
    ({"dim": [0], "dtype": torch.float32}, False),  # a cast besides the sum
    ({"dim": [-1]}, False),  # over the hidden dim
], ids=["dim", "all_defaults_given", "two_leading_dims", "keepdim", "dtype", "hidden_dim"])
def test_a_sum_over_experts_is_read_by_schema_name(given, expected):
    """``_is_expert_sum`` reads the sum's dims, keepdim and dtype by schema name: given by keyword
    they mean what they mean positionally (read by position, any keyword refused the sum)."""
    from torch.fx import Graph

    from weavepass.compile.patterns.allreduce_rmsnorm import _is_expert_sum

    names = [a.name for a in torch.ops.aten.sum.dim_IntList._schema.arguments][1:]
    answers = []
    for keywords in (True, False):
        graph = Graph()
        x = graph.placeholder("x")
        x.meta["val"] = torch.empty(4, 3, 8)
        if keywords:
            node = graph.call_function(torch.ops.aten.sum.dim_IntList, (x,), dict(given))
        else:  # the same call positionally: the schema's defaults before the last given argument
            last = max(names.index(k) for k in given)
            defaults = {"keepdim": False, "dtype": None}
            node = graph.call_function(torch.ops.aten.sum.dim_IntList,
                                       (x, *(given.get(n, defaults.get(n)) for n in names[:last + 1])))
        node.meta["val"] = torch.sum(x.meta["val"], **given)
        answers.append(_is_expert_sum(node))
    assert answers == [expected, expected]
