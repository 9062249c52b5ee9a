"""The quantized epilogue: all_reduce + add + RMSNorm + FP8 / int8 quantization in one fused op.

Graph-level tests run in this process on a fake group (which forms are fused, the quantization gone
from the graph, match counts, the reason codes of what stays outside); the numbers run on 2 and 3
gloo ranks (codes, scales and the scaled matmul's output against eager and an fp32 reference).

Tolerance (``_check_numbers``), and why:

* Given the same normed rows, the fused op's codes and scales are eager's bit for bit: it runs the
  graph's own quantization steps in the graph's dtypes (``weavepass.runtime.quant``). Checked
  exactly against eager's quantizer applied to the op's normed rows.
* The normed rows themselves differ from eager's by dtype rounding: eager rounds the all_reduce's
  sum in the model dtype (once per rank added, in gloo) and weave sums in fp32 and rounds once.
  Where a normed value differs, its code may differ only by one code step (an adjacent fp8 value, or
  +-1 in int8): the value lies within that rounding of a code boundary. Where a row's largest
  magnitude differs, its dynamic scale differs by the same relative amount (at most
  ``NORMED_ULPS`` roundings of the activation dtype); elsewhere the scales are equal exactly.
* The scaled matmul's output, against the fp32 product of the same normed rows and the unquantized
  weight, is within the quantization's own error bound: every product term carries a relative
  error of at most ``(1 + e_a)(1 + e_w) - 1`` (``e = 2^-4``, half an e4m3 step) plus half a
  subnormal step of its scale (fp8), or an absolute ``s / 2`` per factor (int8), and the output is
  rounded once to the activation dtype. Static scales saturate at +-448: the reference is clamped
  the same way.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing._internal.distributed.fake_pg import FakeStore

import weavepass
from weavepass import WeaveConfig
from weavepass.compile.patterns import find_allreduce_rmsnorm_sites
from weavepass.compile.planner import _plan_quant
from weavepass.compile.reasons import Reason, ReasonCode
from weavepass.runtime.reference import fused_allreduce_rmsnorm_reference
from weavepass.testing.distributed import spawn
from weavepass.testing.models import TPConfig, build_tp_model, random_token_ids
from weavepass.testing.quant import ACT_QUANTS, FP8, FP8_MAX, FUSED_FORMS, QuantLinear
from weavepass.testing.quant_steps import form_steps

QUANT = "weave.fused_allreduce_rmsnorm_quant.default"
FUSED = "weave.fused_allreduce_rmsnorm.default"
AR = "_c10d_functional.all_reduce.default"
H, N_OUT = 256, 64
LABELS = {"fp8_static": "fp8 per-tensor static quant", "fp8_static_inv": "fp8 per-tensor static quant",
          "fp8_row": "fp8 per-row quant", "fp8_row_torchao": "fp8 per-row quant",
          "fp8_group": "fp8 per-group-of-128 quant", "int8_row": "int8 per-row quant"}
QUANT_STEPS = {"aten.abs.default", "aten.amax.default", "aten.round.default", "aten.reciprocal.default",
               "aten.clamp_min.default", "aten.clamp_max.default"}
NORMED_ULPS = 1
"""Roundings of the activation dtype by which the op's normed rows may differ from the reference's:
the two sum the same fp32 values in another order, which can move the rounded sum by one step."""


def llama_norm(x, weight, eps=1e-6):
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def site_fn(linear, group, also_normed=False):
    """``linear(rmsnorm(all_reduce(p) + r))`` (and the normed rows themselves, if asked)."""
    def f(p, r, w):
        h = funcol.all_reduce(p, "sum", group) + r
        normed = llama_norm(h, w)
        return (linear(normed), h, normed) if also_normed else (linear(normed), h)
    return f


def site_inputs(dtype, tokens=(2, 3), seed=0, rank=0):
    """Partial sums (per rank), a residual and a norm weight with a few large entries (normed values
    near and beyond the static scale's range: they saturate at +-448) and a few tiny ones (fp8
    subnormals and zeros)."""
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(*tokens, H, generator=torch.Generator().manual_seed(seed + 1 + rank)).to(dtype)
    r = torch.randn(*tokens, H, generator=g).to(dtype)
    w = 1 + 0.1 * torch.randn(H, generator=g)
    w[:8] = 12.0
    w[8:16] = 1e-3
    return p, r, w.to(dtype)


@pytest.fixture(scope="module")
def fake_world():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield dist.group.WORLD
    dist.destroy_process_group()


def compile_report(fn, *args, config=None):
    backend = weavepass.make_backend(config)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(fn, backend=backend, fullgraph=True)(*args)
    (graph,) = backend.report.graphs
    return graph


def traced_site(fn, *args, linear=None):
    """The one site ``find_allreduce_rmsnorm_sites`` finds in ``fn``'s post-grad-like graph
    (``traced_graph``)."""
    sites, rejected = find_allreduce_rmsnorm_sites(traced_graph(fn, *args, linear=linear))
    assert not rejected, rejected
    (site,) = sites
    return site


def traced_graph(fn, *args, linear=None):
    """``fn``'s post-grad-like graph. With ``linear``, its static scale is a graph input, as Dynamo
    makes a buffer (``make_fx`` would make each read of it a constant of its own)."""
    from torch._inductor.decomposition import select_decomp_table

    def traced(*inputs):
        if linear is None:
            return fn(*inputs)
        saved, linear.act_scale = linear.act_scale, inputs[-1]
        try:
            return fn(*inputs[:-1])
        finally:
            linear.act_scale = saved

    extra = (linear.act_scale,) if linear is not None else ()
    return make_fx(traced, decomposition_table=select_decomp_table())(*args, *extra).graph


# ---------------------------------------------------------------- graph level (fake group)


@pytest.mark.parametrize("form", FUSED_FORMS)
def test_each_form_fused_and_its_quantization_gone(fake_world, form):
    linear = QuantLinear(torch.randn(N_OUT, H), form)
    graph = compile_report(site_fn(linear, fake_world), *site_inputs(torch.bfloat16))
    assert graph.ops_after[QUANT] == 1 and graph.ops_after[FUSED] == 0 and graph.ops_after[AR] == 0
    assert graph.ops_before[AR] == 1 and graph.rewritten == graph.matched == 1
    assert not QUANT_STEPS & set(graph.ops_after), graph.ops_after  # the quantization is in the op
    assert QUANT_STEPS & set(graph.ops_before)
    matmul = "aten._int_mm.default" if form == "int8_row" else "aten._scaled_mm.default"
    if form != "fp8_group":  # (the group form's matmul is the dequantize-then-matmul fallback)
        assert graph.ops_after[matmul] == graph.ops_before[matmul] == 1
    (record,) = graph.records
    assert f"+ {LABELS[form]}," in record.kind and record.quant_left is None, record.kind


def test_fp16_site_fused(fake_world):
    linear = QuantLinear(torch.randn(N_OUT, H), "fp8_row")
    graph = compile_report(site_fn(linear, fake_world), *site_inputs(torch.float16))
    assert graph.ops_after[QUANT] == 1 and not QUANT_STEPS & set(graph.ops_after)


def test_dynamic_per_tensor_scale_stays_outside(fake_world):
    linear = QuantLinear(torch.randn(N_OUT, H), "fp8_tensor_dynamic")
    args = site_inputs(torch.bfloat16)
    site = traced_site(site_fn(linear, fake_world), *args)
    assert site.quant is None and site.quant_left.code is ReasonCode.QUANT_GLOBAL_SCALE
    graph = compile_report(site_fn(linear, fake_world), *args)
    assert graph.ops_after[FUSED] == 1 and graph.ops_after[QUANT] == 0  # the norm is fused all the same
    assert graph.ops_after["aten.amax.default"] == 1
    (record,) = graph.records
    assert record.quant_left == Reason(ReasonCode.QUANT_GLOBAL_SCALE), record.kind


def test_quant_steps_are_the_graphs(fake_world):
    site = traced_site(site_fn(QuantLinear(torch.randn(N_OUT, H), "fp8_row"), fake_world),
                       *site_inputs(torch.bfloat16))
    quant = site.quant
    assert (quant.static, quant.group_size, quant.return_normed) == (False, 0, False)
    assert quant.scale_steps == "abs|amax|convert:float32|div:448.0|clamp_min:4.359654017857143e-06"
    assert quant.code_steps == (
        "convert:float32|mul_scale_reciprocal|clamp_min:-448.0|clamp_max:448.0|convert:float8_e4m3fn")
    group = traced_site(site_fn(QuantLinear(torch.randn(N_OUT, H), "fp8_group"), fake_world),
                        *site_inputs(torch.bfloat16)).quant
    assert group.group_size == 128 and group.code_steps.startswith("div_scale|")


@pytest.mark.parametrize("form", ["fp8_row", "int8_row"])
def test_quantization_arguments_given_by_keyword_are_read_by_name(fake_world, form):
    """``amax(x, dim=[-1], keepdim=True)``, ``clamp_min(x, min=...)``, ``clamp(x, min=..., max=...)``
    by keyword are the quantization they are positionally: the finder reads their arguments by
    schema name (read by position, a keyword keepdim was False and the per-row scale a global one,
    left outside the fused op)."""
    from torch._inductor.decomposition import select_decomp_table

    aten = torch.ops.aten
    fn = site_fn(QuantLinear(torch.randn(N_OUT, H), form), fake_world)
    graphs = [make_fx(fn, decomposition_table=select_decomp_table())(*site_inputs(torch.bfloat16)).graph
              for _ in range(2)]
    moved = [n for n in graphs[1].nodes if n.target in (
        aten.amax.default, aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default)]
    assert aten.amax.default in {n.target for n in moved} and len(moved) >= 2, moved
    for node in moved:
        names = [a.name for a in node.target._schema.arguments]
        assert len(node.args) > 1 and not node.kwargs  # as traced: positional
        node.args, node.kwargs = node.args[:1], dict(zip(names[1:], node.args[1:]))
    (positional,), _ = find_allreduce_rmsnorm_sites(graphs[0])
    (keyword,), _ = find_allreduce_rmsnorm_sites(graphs[1])
    assert positional.quant is not None and keyword.quant is not None, keyword.quant_left
    assert (keyword.quant.group_size, keyword.quant.scale_steps, keyword.quant.code_steps) == (
        positional.quant.group_size, positional.quant.scale_steps, positional.quant.code_steps)
    assert keyword.quant.scale_steps.startswith("abs|amax|")


def _after(node: torch.fx.Node) -> set[str]:
    """The names of the calls that read ``node``, directly or not."""
    found, stack = set(), list(node.users)
    while stack:
        user = stack.pop()
        if user.op == "call_function" and user.name not in found:
            found.add(user.name)
            stack.extend(user.users)
    return found


@pytest.mark.parametrize("form", FUSED_FORMS)
def test_quantization_and_its_matmuls_given_by_keyword(fake_world, form):
    """Every call after the normed rows (the row and group views, the quantization's steps, the
    matmuls and the dequantizing products) given all its arguments by keyword, as a pass chained
    before weave's may: the finder reads the views' inputs, the divisions' and products' operands
    by the schema's names and finds the same quantization (read by position: IndexError, or
    ``mul(self=q, other=reciprocal(s))`` an unproven inverse, left outside)."""
    linear = QuantLinear(torch.randn(N_OUT, H), form)
    static = form.startswith("fp8_static")
    fn = site_fn(linear, fake_world)
    graphs = [traced_graph(fn, *site_inputs(torch.bfloat16), linear=linear if static else None) for _ in range(2)]
    (positional,), rejected = find_allreduce_rmsnorm_sites(graphs[0])
    assert not rejected and positional.quant is not None
    names = _after(positional.norm.output)
    moved = 0
    for node in graphs[1].nodes:
        if node.name in names and isinstance(node.target, torch._ops.OpOverload):
            schema = [a.name for a in node.target._schema.arguments]
            node.args, node.kwargs = (), {**dict(zip(schema, node.args)), **node.kwargs}
            moved += 1
    assert moved >= 6, moved
    (keyword,), rejected = find_allreduce_rmsnorm_sites(graphs[1])
    assert not rejected and keyword.quant is not None, keyword.quant_left
    a, b = positional.quant, keyword.quant
    assert (b.static, b.group_size, b.scale_steps, b.code_steps, b.return_normed, b.others) == (
        a.static, a.group_size, a.scale_steps, a.code_steps, a.return_normed, a.others)
    for field in ("codes", "scales", "nodes", "consumers"):
        assert [n.name for n in getattr(b, field)] == [n.name for n in getattr(a, field)], field


def test_normed_rows_read_elsewhere_are_returned(fake_world):
    linear = QuantLinear(torch.randn(N_OUT, H), "int8_row")
    fn = site_fn(linear, fake_world, also_normed=True)
    assert traced_site(fn, *site_inputs(torch.bfloat16)).quant.return_normed
    graph = compile_report(fn, *site_inputs(torch.bfloat16))
    assert graph.ops_after[QUANT] == 1


def test_a_later_linears_quantization_is_not_the_sites(fake_world):
    """The normed rows feed a plain linear; the next linear quantizes that linear's output."""
    later = QuantLinear(torch.randn(N_OUT, N_OUT), "fp8_row")
    w1 = torch.randn(N_OUT, H).to(torch.bfloat16)
    site = traced_site(site_fn(lambda x: later(torch.nn.functional.silu(x @ w1.t())), fake_world),
                       *site_inputs(torch.bfloat16))
    assert site.quant is None and site.quant_left is None
    assert "quant" not in site.kind


def _scale_mismatch(group):
    """The codes are divided by the row scale, but the matmul multiplies by another number."""
    w = torch.randn(N_OUT, H).to(FP8)

    def linear(x):
        q, s = ACT_QUANTS["fp8_row"](x.reshape(-1, H))
        return torch._scaled_mm(q, w.t(), scale_a=torch.ones_like(s), scale_b=torch.ones(1, N_OUT),
                                out_dtype=x.dtype)
    return linear


def _codes_returned(group):
    return lambda x: ACT_QUANTS["fp8_row"](x.reshape(-1, H))[0]


@pytest.mark.parametrize("make, code, field", [
    (_scale_mismatch, ReasonCode.QUANT_SCALE_MISMATCH, ("op", "_scaled_mm")),
    (_codes_returned, ReasonCode.QUANT_NOT_A_MATMUL, ("reader", "output")),
])
def test_chain_not_matched_when_the_matmul_scale_is_not_the_quantizations(fake_world, make, code, field):
    site = traced_site(site_fn(make(fake_world), fake_world), *site_inputs(torch.bfloat16))
    assert site.quant is None
    assert site.quant_left.code is code and site.quant_left.reason.field(field[0]) == field[1]


@pytest.mark.parametrize("form", FUSED_FORMS)
def test_cuda_kernel_carries_every_fused_form(fake_world, form, monkeypatch):
    import weavepass.runtime as runtime
    from weavepass.compile.patterns.rmsnorm import val
    from weavepass.runtime.cuda.quant_epilogue import QuantEpilogue
    from weavepass.runtime.cuda.support import cuda_quant_epilogue

    linear = QuantLinear(torch.randn(N_OUT, H), form)
    site = traced_site(site_fn(linear, fake_world), *site_inputs(torch.bfloat16), linear=linear)
    quant = site.quant
    # the programs the kernel tests and benchmarks call the op with are the graphs'
    assert (quant.scale_steps, quant.code_steps, quant.group_size) == form_steps(form, torch.bfloat16)
    scale = val(quant.static_scale) if quant.static else None
    epilogue = cuda_quant_epilogue(site.norm.out_dtype, site.hidden, site.device,
                                   None if scale is None else (scale.dtype, scale.dim()), quant.group_size,
                                   quant.scale_steps, quant.code_steps, quant.return_normed)
    assert isinstance(epilogue, QuantEpilogue), epilogue  # the kernel's form of it: runtime.cuda.quant_epilogue
    # verified on a GPU (tests/gpu/test_quant_epilogue_gpu.py): the planner fuses the quantization
    assert runtime.CUDA_QUANT_EPILOGUE_VERIFIED
    planned = _plan_quant(site, "cuda_symm")
    assert planned.quant is quant and planned.quant_left is None
    assert f"+ {LABELS[form]}" in planned.kind
    # the gate still works: an unverified kernel keeps the quantization outside, with the reason
    monkeypatch.setattr(runtime, "CUDA_QUANT_EPILOGUE_VERIFIED", False)
    planned = _plan_quant(site, "cuda_symm")
    assert planned.quant is None and planned.quant_left.code is ReasonCode.QUANT_LOWERING
    assert list(planned.quant_left.reason.codes()) == [ReasonCode.QUANT_LOWERING, ReasonCode.QUANT_CUDA_UNVERIFIED]
    assert f"+ {LABELS[form]}" not in planned.kind and planned.quant_left.text in planned.kind


def _unclamped_fp8_row(group):
    """A per-row fp8 cast without the clamp to +-448 (eager makes an overflow NaN)."""
    w = torch.randn(N_OUT, H).to(FP8)

    def linear(x):
        rows = x.reshape(-1, H)
        s = rows.abs().amax(-1, keepdim=True).to(torch.float32) / FP8_MAX
        return torch._scaled_mm((rows.to(torch.float32) / s).to(FP8), w.t(), scale_a=s,
                                scale_b=torch.ones(1, N_OUT), out_dtype=x.dtype)
    return linear


def test_cuda_lowering_keeps_a_form_it_does_not_carry_outside(fake_world):
    site = traced_site(site_fn(_unclamped_fp8_row(fake_world), fake_world), *site_inputs(torch.bfloat16))
    assert site.quant is not None  # the portable lowering carries it
    site = _plan_quant(site, "cuda_symm")
    assert site.quant is None and site.quant_left.code is ReasonCode.QUANT_LOWERING
    assert list(site.quant_left.reason.codes()) == [
        ReasonCode.QUANT_LOWERING, ReasonCode.QUANT_CUDA_FORM, ReasonCode.QUANT_FORM_FP8_NOT_CLAMPED]
    assert "+ fp8" not in site.kind and site.quant_left.text in site.kind


def test_split_refuses_quantized_sites(fake_world):
    linear = QuantLinear(torch.randn(N_OUT, H), "fp8_row")
    graph = compile_report(site_fn(linear, fake_world), *site_inputs(torch.bfloat16),
                           config=WeaveConfig(split="force"))
    assert graph.ops_after[QUANT] == 1  # fuse-only, the quantization in the fused op
    assert graph.codes == [ReasonCode.QUANT_SPLIT], graph.note


def test_check_replicated_on_a_quantized_site(fake_world):
    linear = QuantLinear(torch.randn(N_OUT, H), "fp8_group")
    graph = compile_report(site_fn(linear, fake_world), *site_inputs(torch.bfloat16),
                           config=WeaveConfig(check_replicated=True))
    assert graph.ops_after[QUANT] == 1 and graph.ops_after["weave.check_replicated.default"] == 1


def test_flashcomm_leaves_the_quantization_outside(fake_world):
    linear = QuantLinear(torch.randn(N_OUT, H), "fp8_row")
    graph = compile_report(site_fn(linear, fake_world), *site_inputs(torch.bfloat16),
                           config=WeaveConfig(enable_flashcomm=True, flashcomm_min_prefill_tokens=1))
    assert graph.ops_after[QUANT] == 0 and graph.ops_after["aten.amax.default"] == 1
    (record,) = graph.records
    assert record.lowering.startswith("flashcomm:")
    assert record.quant_left == Reason(ReasonCode.QUANT_FLASHCOMM), record.kind


def test_quantized_decoder(fake_world):
    """Every site whose norm feeds quantized linears (q/k/v, gate/up: one quantization each, shared
    by its linears) carries it; the final norm (the model's output) is a plain site."""
    cfg = TPConfig(hidden=H, intermediate=2 * H, quant="int8_row", dtype=torch.bfloat16)
    model = build_tp_model(cfg, 0, 2, fake_world)
    graph = compile_report(model, random_token_ids(cfg, 2, 5))
    assert graph.ops_after[QUANT] == 2 * cfg.n_layers and graph.ops_after[FUSED] == 1
    assert not {"aten.amax.default", "aten.round.default"} & set(graph.ops_after)
    assert graph.rewritten == graph.matched == 2 * cfg.n_layers + 1


# ---------------------------------------------------------------- numbers (gloo)


def _ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of ``x``'s dtype at each |x|."""
    a = x.abs()
    return torch.nextafter(a, torch.full_like(a, float("inf"))) - a


def _e4m3_step(v: torch.Tensor) -> torch.Tensor:
    """The spacing of float8_e4m3fn at each |v| (3 mantissa bits; subnormals below 2^-6 step 2^-9)."""
    a = v.abs()
    normal = torch.exp2(torch.floor(torch.log2(a.clamp_min(2.0**-6))) - 3)
    return torch.where(a < 2.0**-6, torch.full_like(a, 2.0**-9), normal)


def _quantized_site(form, dtype, group, rank):
    """One form's linear, its site function, inputs, and the fused op's outputs on them."""
    torch.manual_seed(0)
    linear = QuantLinear(torch.randn(N_OUT, H), form)
    fn = site_fn(linear, group)
    p, r, w = site_inputs(dtype, tokens=(7,), rank=rank)  # 7 tokens: not divisible by 2 or 3
    quant = traced_site(fn, p, r, w, linear=linear).quant
    outputs = torch.ops.weave.fused_allreduce_rmsnorm_quant(
        p, r, w, 1e-6, group.group_name, dtype, linear.act_scale if quant.static else None,
        quant.group_size, quant.scale_steps, quant.code_steps, True, "portable", 0)
    return linear, fn, (p, r, w), quant, outputs


def _per_value(scales: torch.Tensor) -> torch.Tensor:
    """``[7, 1]`` or ``[7, H / 128]`` scales repeated to ``[7, H]``: each value's scale."""
    rows = scales.reshape(7, -1)
    return rows.repeat_interleave(H // rows.shape[1], 1)


def _check_numbers(form, dtype, group, rank):
    """One form, one dtype: the op against eager (module docstring); returns how many codes could
    differ from eager's (their normed value or scale differs by a rounding)."""
    linear, _, (p, r, w), quant, (codes, scales, residual, normed) = _quantized_site(form, dtype, group, rank)
    quantize = ACT_QUANTS[form]

    # 1. Given the op's normed rows, eager's quantizer gives the op's codes and scales bit for bit;
    # the inputs reach the format's limits (the largest code, saturation, fp8 subnormals).
    own_codes, own_scales = quantize(normed, linear.act_scale)
    assert torch.equal(codes.reshape(own_codes.shape).view(torch.uint8), own_codes.view(torch.uint8))
    assert torch.equal(scales.reshape(own_scales.shape), own_scales)
    ours = own_codes.reshape(7, H).float()
    assert (ours.abs() == (127 if own_codes.dtype == torch.int8 else FP8_MAX)).any()
    if quant.static:
        assert (normed.float().abs() > FP8_MAX * linear.act_scale).any()  # saturated at +-448
    if own_codes.dtype == FP8:
        assert ((ours.abs() < 2.0**-6) & (ours != 0)).any()

    # 2. Against eager's quantizer on the reference normed rows (every rank's partials summed in
    # fp32, rounded once: ``reference.py``; they differ from the op's only in the order of that fp32
    # sum): the normed rows within one rounding; codes equal where the normed value and its scale
    # are, else one code step apart; dynamic scales within one rounding.
    partials = [site_inputs(dtype, tokens=(7,), rank=k)[0] for k in range(group.size())]
    eager_normed, eager_h = fused_allreduce_rmsnorm_reference(partials, r, w, 1e-6, dtype)
    assert ((residual.float() - eager_h.float()).abs() <= NORMED_ULPS * _ulp(eager_h).float()).all()
    normed_diff = (normed.float() - eager_normed.float()).abs()
    assert (normed_diff <= NORMED_ULPS * _ulp(eager_normed).float()).all()
    eager_codes, eager_scales = quantize(eager_normed, linear.act_scale)
    same_scale = torch.ones(7, H, dtype=torch.bool)
    if not quant.static:
        same_scale = _per_value(own_scales) == _per_value(eager_scales)
        rel = ((own_scales - eager_scales).abs() / eager_scales).max().item()
        assert rel <= NORMED_ULPS * _ulp(torch.ones((), dtype=dtype)).item(), rel
    theirs = eager_codes.reshape(7, H).float()
    exact = (normed_diff.reshape(7, H) == 0) & same_scale
    assert torch.equal(ours[exact], theirs[exact])
    if own_codes.dtype == torch.int8:
        step = torch.ones_like(ours)
    else:
        step = torch.maximum(_e4m3_step(ours), _e4m3_step(theirs))
    assert ((ours - theirs).abs() <= step).all()

    # 3. The library's scaled matmul of the op's codes and scales within the quantization's error
    # bound of the fp32 product (the compiled model's output: ``_compiled_rank``).
    out = linear.matmul(codes.reshape(7, H), scales.reshape(own_scales.shape) if not quant.static else scales, dtype)
    _assert_within_quant_bound(out, normed, own_scales, linear, quant.static, dtype)
    return int((~exact).sum())


def _assert_within_quant_bound(out, normed, scales, linear, static, dtype):
    """``out`` ``[7, N]`` against the fp32 product of ``normed`` (clamped to a static scale's range)
    and the unquantized weight: the bound of the module docstring."""
    x = normed.float()
    if static:
        x = x.clamp(-FP8_MAX * linear.act_scale, FP8_MAX * linear.act_scale)
    w32 = linear.weight_fp32
    exact_out = x @ w32.t()
    if linear.w_codes.dtype == torch.int8:  # |dx| <= s_x / 2, |dw| <= s_w / 2 per factor
        half_x, half_w = scales.reshape(7, 1) / 2, linear.w_scale.reshape(1, -1) / 2
        bound = (half_x * w32.abs().sum(1)[None, :] + x.abs().sum(1, keepdim=True) * half_w
                 + H * half_x * half_w)
    else:  # |dx| <= e |x| + a_x (a: half the smallest subnormal times the scale), the same for w
        e = 2.0**-4
        a_x = (linear.act_scale * torch.ones(7, H) if static else _per_value(scales)) * 2.0**-10
        a_w = (linear.w_scale.reshape(-1, 1) * 2.0**-10).expand(N_OUT, H)
        dx, dw = e * x.abs() + a_x, e * w32.abs() + a_w
        bound = dx @ w32.abs().t() + x.abs() @ dw.t() + dx @ dw.t()
    bound = bound + exact_out.abs() * _ulp(torch.ones((), dtype=dtype)).item() + 1e-6
    err = (out.float().reshape(7, -1) - exact_out).abs()
    assert (err <= bound).all(), (err - bound).max().item()


def _compiled_checks(group, rank):
    """One compiled graph with one site per fused form (bf16): each site rewritten, and each scaled
    matmul's output within the quantization bound of the fp32 product of the op's normed rows."""
    sites = [_quantized_site(form, torch.bfloat16, group, rank) for form in FUSED_FORMS]

    def every_form(*inputs):
        return [fn(*inputs[3 * i: 3 * i + 3])[0] for i, (_, fn, *_) in enumerate(sites)]

    backend = weavepass.make_backend()
    torch._dynamo.reset()
    with torch.no_grad():
        outs = torch.compile(every_form, backend=backend, fullgraph=True)(*[a for s in sites for a in s[2]])
    (graph,) = backend.report.graphs
    assert graph.ops_after[AR] == 0
    for out, (linear, _, _, quant, (_, scales, _, normed)) in zip(outs, sites):
        _assert_within_quant_bound(out, normed, scales, linear, quant.static, torch.bfloat16)
    return graph.ops_after[QUANT]


def _numbers_rank(rank, world, compiled):
    """Every fused form in bf16 and fp16 at the op; with ``compiled``, also the compiled graph
    (``_compiled_checks``: one compile, the costly part)."""
    group = dist.group.WORLD
    checked = {(form, str(dtype)): _check_numbers(form, dtype, group, rank)
               for form in FUSED_FORMS for dtype in (torch.bfloat16, torch.float16)}
    return checked, _compiled_checks(group, rank) if compiled else None


@pytest.mark.parametrize("world", [2, 3])
def test_codes_scales_and_matmul_against_eager(world):
    results = spawn(_numbers_rank, world, "gloo", world == 2)
    assert all(res == results[0] for res in results)  # every rank sees the same gathered rows
    checked, fused = results[0]
    assert set(checked) == {(f, str(d)) for f in FUSED_FORMS for d in (torch.bfloat16, torch.float16)}
    assert fused == (len(FUSED_FORMS) if world == 2 else None)


def test_quant_unsupported_reason_answers_with_codes():
    """The runtime answers with a ``QuantIssue`` (its fields), the planner's ``Reason`` has the same
    code, and the sentence is the runtime's."""
    from weavepass import runtime
    from weavepass.compile.reasons import runtime_issue_reason

    kwargs = dict(out_dtype=torch.bfloat16, hidden=H, device=torch.device("cpu"))
    other = runtime.quant_unsupported_reason("npu", False, 0, "", "", **kwargs)
    assert other is not None and other.issue is runtime.QuantIssue.LOWERING
    assert dict(other.fields) == {"lowering": "npu"}
    reason = runtime_issue_reason(other)
    assert reason.code is ReasonCode.QUANT_LOWERING_NOT_CARRIED
    assert reason.render() == str(other)  # rendering test: the runtime's sentence
    no_dtype = runtime.quant_unsupported_reason("cuda_symm", True, 0, "", "", static_scale=None, **kwargs)
    assert no_dtype is not None and runtime_issue_reason(no_dtype).code is ReasonCode.QUANT_CUDA_STATIC_SCALE_DTYPE
