"""Graph-level unit tests of the compile steps, one at a time: the finder, the token count, the
planner and the strategies' decisions, on graphs traced with ``make_fx`` on a fake process group
(no Inductor, no spawned processes; numbers are not checked here, the end-to-end tests do that)."""

from __future__ import annotations

import dataclasses
import json
import math
import threading
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.fx.experimental.proxy_tensor import make_fx

import weavepass
from weavepass import WeaveConfig
from weavepass.compile.graph_pass import WeavePass, op_counts
from weavepass.compile.patterns import find_allreduce_rmsnorm_sites
from weavepass.compile.patterns.rmsnorm import LAYER_NORM
from weavepass.compile.plan_check import PlanExchange, PlanMismatchError, _key, collective_lines
from weavepass.compile.planner import plan_sites
from weavepass.compile.reasons import Reason, ReasonCode
from weavepass.compile.strategies import STRATEGIES, ContractError, GraphRewrite, check_order, inductor_patches
from weavepass.compile.strategies.base import check_writes, snapshot
from weavepass.compile.strategies.flashcomm import FlashCommStrategy, decide_flashcomm, force_device_kind
from weavepass.compile.strategies.fuse import FuseStrategy
from weavepass.compile.strategies.split.strategy import SplitStrategy
from weavepass.compile.tokens import TokenCount
from weavepass.compile.wave_model import GemmShape, WaveModel, plan_split, plan_token_split
from weavepass.report import AllReduceRecord, GraphReport
from weavepass.runtime.issue import Unsupported
from weavepass.runtime.reference import add_rmsnorm_local
from weavepass.testing import fake_process_group
from weavepass.testing.distributed import check_plans_in_threads

H = 64


def _rms(h, g):
    return g * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))


def two_sites(x, r, w1, g1, w2, g2):
    """Two row-parallel layers on one residual stream: ``h1 = AR(x @ w1) + r``, ``h2 = AR(relu(norm
    h1) @ w2) + h1``; returns the last norm and the stream."""
    h1 = funcol.all_reduce(x @ w1, "sum", dist.group.WORLD) + r
    h2 = funcol.all_reduce(torch.relu(_rms(h1, g1)) @ w2, "sum", dist.group.WORLD) + h1
    return _rms(h2, g2), h2


def broken_stream(x, r, w1, g1, w2, g2):
    """Like ``two_sites``, but the second site's residual is ``r`` again, not the stream ``h1``."""
    h1 = funcol.all_reduce(x @ w1, "sum", dist.group.WORLD) + r
    h2 = funcol.all_reduce(torch.relu(_rms(h1, g1)) @ w2, "sum", dist.group.WORLD) + r
    return _rms(h2, g2), h2


def layer_norm_sites(x, r, w1, g1, w2, g2):
    """``two_sites`` with ``F.layer_norm`` (weight and bias): ``native_layer_norm`` under make_fx."""
    def norm(h, g):
        return torch.nn.functional.layer_norm(h, (H,), g, g.flip(0), 1e-5)

    h1 = funcol.all_reduce(x @ w1, "sum", dist.group.WORLD) + r
    h2 = funcol.all_reduce(torch.relu(norm(h1, g1)) @ w2, "sum", dist.group.WORLD) + h1
    return norm(h2, g2), h2


def no_norm(x, w):
    return funcol.all_reduce(x @ w, "sum", dist.group.WORLD) * 2


def _args(*tokens: int):
    """``two_sites``' arguments for ``tokens`` rows: ``[T, 32]`` or ``[B, S, 32]`` inputs."""
    return (torch.randn(*tokens, 32), torch.randn(*tokens, H), torch.randn(32, H), torch.randn(H),
            torch.randn(H, H), torch.randn(H))


def _trace(fn, *args, mode: str = "fake") -> torch.fx.Graph:
    return make_fx(fn, tracing_mode=mode)(*args).graph


def _rewrite(graph: torch.fx.Graph, config: WeaveConfig) -> GraphRewrite:
    """What ``WeavePass`` hands the strategies: the plans and one record per site."""
    sites, _ = find_allreduce_rmsnorm_sites(graph)
    plans = plan_sites(sites, config)
    report = GraphReport(0, ops_before=op_counts(graph))
    report.records = [AllReduceRecord(p.site.all_reduce.name, True, [p.reason] if p.code is not ReasonCode.NONE else [],
                                      p.site.kind) for p in plans]
    return GraphRewrite(graph, plans, config, report)


def _as_training(rewrite) -> None:
    """Mark the first site of ``rewrite`` as a training graph's: its norm's rsqrt saved for backward
    (the finder sets this from a forward graph's outputs; the strategies read only the flag)."""
    plan = rewrite.plans[0]
    rsqrt = next(n for n in plan.site.norm.nodes if n.target is torch.ops.aten.rsqrt.default)
    site = dataclasses.replace(plan.site, norm=dataclasses.replace(plan.site.norm, saved_inv_rms=rsqrt))
    rewrite.plans[0] = dataclasses.replace(plan, site=site)
    rewrite.training = site.training
    assert rewrite.training


@pytest.fixture
def world2():
    with fake_process_group(2) as group:
        yield group


# --- the finder ----------------------------------------------------------------------------------


def test_finder_match_fields(world2):
    graph = _trace(two_sites, *_args(40))
    sites, rejected = find_allreduce_rmsnorm_sites(graph)
    assert rejected == []
    assert [s.all_reduce.name for s in sites] == ["all_reduce", "all_reduce_1"]
    first, second = sites
    assert first.group_name == "0" and first.wait.target is torch.ops._c10d_functional.wait_tensor.default
    assert first.matmul.target is torch.ops.aten.mm.default and first.partial is first.all_reduce.args[0]
    assert first.add.target is torch.ops.aten.add.Tensor and first.residual.name == "r_1"
    assert (first.hidden, first.dtype, first.training) == (H, torch.float32, False)
    assert first.norm.eps == 1e-6 and first.norm.form == "decomposed" and first.norm.weight.name == "g1_1"
    assert first.norm.input is first.add  # the norm reads the new residual stream
    assert second.residual is first.add and second.norm.weight.name == "g2_1"


def test_finder_layer_norm_fields(world2):
    graph = _trace(layer_norm_sites, *_args(40))
    sites, rejected = find_allreduce_rmsnorm_sites(graph)
    assert rejected == [] and len(sites) == 2
    first, second = sites
    assert (first.norm.kind, first.norm.eps, first.norm.form) == (LAYER_NORM, 1e-5, "aten.native_layer_norm.default")
    assert first.norm.weight.name == "g1_1" and first.norm.bias.target is torch.ops.aten.flip.default
    assert first.norm.input is first.add and second.residual is first.add
    assert "aten.native_layer_norm.default, weight torch.float32, bias torch.float32" in first.kind


def _site_with(norm):
    def f(x, r, w1, g1, w2, g2):
        h = funcol.all_reduce(x @ w1, "sum", dist.group.WORLD) + r
        return norm(h, g1), h
    return f


def _centred_norm(var):
    """``(h - mean) * rsqrt(var(h) + eps) * g``, written out; ``var`` computes the variance."""
    def norm(h, g):
        d = h - h.mean(-1, keepdim=True)
        return d * torch.rsqrt(var(h, d) + 1e-5) * g
    return norm


@pytest.mark.parametrize("norm, form, weight, bias", [
    (lambda h, g: torch.nn.functional.layer_norm(h, (H,)), "aten.native_layer_norm.default", False, False),
    (lambda h, g: torch.nn.functional.layer_norm(h, (H,), None, g), "aten.native_layer_norm.default", False, True),
    (_centred_norm(lambda h, d: d.pow(2).mean(-1, keepdim=True)), "LayerNorm (decomposed)", True, False),
    (_centred_norm(lambda h, d: (d * d).mean(-1, keepdim=True)), "LayerNorm (decomposed)", True, False),
])
def test_finder_layer_norm_forms(world2, norm, form, weight, bias):
    """make_fx graphs (aten, not decomposed by Inductor): the undecomposed op with or without
    weight and bias, and the written-out form with either square."""
    (site,), rejected = find_allreduce_rmsnorm_sites(_trace(_site_with(norm), *_args(8)))
    assert rejected == [] and site.norm.kind == LAYER_NORM and site.norm.form == form
    assert (site.norm.weight is not None, site.norm.bias is not None) == (weight, bias)
    assert site.norm.input is site.add and site.norm.eps == 1e-5


@pytest.mark.parametrize("norm, reason", [
    # torch.var_mean without correction: unbiased.
    (_centred_norm(lambda h, d: torch.var_mean(h, -1, keepdim=True)[0]),
     Reason.of(ReasonCode.UNBIASED_VARIANCE, correction=1)),
    # Mean-subtracted, then scaled by the input's inverse RMS, not the deviation's: neither norm.
    (_centred_norm(lambda h, d: h.pow(2).mean(-1, keepdim=True)), Reason(ReasonCode.INV_RMS_NOT_SCALING_INPUT)),
])
def test_finder_rejects_what_is_not_a_layer_norm(world2, norm, reason):
    sites, (rejected,) = find_allreduce_rmsnorm_sites(_trace(_site_with(norm), *_args(8)))
    assert sites == [] and rejected.reason.find(reason.code) == reason, rejected.reason


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("op", [torch.ops.aten.rms_norm.default, torch.ops.aten._fused_rms_norm.default])
def test_undecomposed_rms_norm_without_eps_gets_the_eps_eager_uses(world2, dtype, op):
    """``aten.rms_norm`` / ``_fused_rms_norm`` with ``eps=None`` (kept by a pre-dispatch trace) add
    the eps of the dtype they compute in (fp32 for bf16 and fp16), not the input's: the fused op's
    math with the eps the finder read must give eager's rows. Rows of RMS ~1e-3, where bf16's own
    eps (2^-7) would dominate the mean of squares."""
    def norm(h, g):
        out = op(h, [H], g, None)
        return out if op is torch.ops.aten.rms_norm.default else out[0]

    gen = torch.Generator().manual_seed(0)
    h, g = (torch.randn(8, H, generator=gen) * 1e-3).to(dtype), (1 + torch.randn(H, generator=gen) / 8).to(dtype)
    graph = make_fx(_site_with(norm), tracing_mode="fake", pre_dispatch=True)(
        *(t.to(dtype) for t in (torch.randn(8, 32), h, torch.randn(32, H), g, torch.randn(H, H), g)))
    (site,), rejected = find_allreduce_rmsnorm_sites(graph.graph)
    assert rejected == [] and site.norm.form == str(op)
    ours, _ = add_rmsnorm_local(h, None, g, site.norm.eps, dtype, dtype)
    ulp = torch.finfo(dtype).eps
    torch.testing.assert_close(ours, norm(h, g), rtol=2 * ulp, atol=2 * ulp)


def test_finder_rejects_all_reduce_without_norm(world2):
    graph = _trace(no_norm, torch.randn(8, 32), torch.randn(32, H))
    sites, rejected = find_allreduce_rmsnorm_sites(graph)
    assert sites == [] and [r.all_reduce.name for r in rejected] == ["all_reduce"]
    assert rejected[0].reason == Reason.of(ReasonCode.NO_NORM, first_user="output", place="")  # (the output: no module)


# --- the token count -----------------------------------------------------------------------------


def test_token_count_static_and_padding(world2):
    site = find_allreduce_rmsnorm_sites(_trace(two_sites, *_args(40)))[0][0]
    count = TokenCount.of(site.partial)
    assert (count.value, count.static, count.symbolic, count.hint) == (40, 40, False, 40)
    assert count.padded(2) == 64 and count.rows_per_rank(2) == 32  # multiple of 16 * world
    assert TokenCount(33).padded(3) == 48 and TokenCount(48).rows_per_rank(3) == 16


def test_token_count_symbolic(world2):
    site = find_allreduce_rmsnorm_sites(_trace(two_sites, *_args(40), mode="symbolic"))[0][0]
    count = TokenCount.of(site.partial)
    assert isinstance(count.value, torch.SymInt) and count.symbolic and count.static is None
    assert count.hint == 40
    with pytest.raises(ValueError, match="static"):
        count.padded(2)


# --- the planner ---------------------------------------------------------------------------------


def test_plan_sites_codes(world2, monkeypatch):
    sites, _ = find_allreduce_rmsnorm_sites(_trace(two_sites, *_args(40)))
    plans = plan_sites(sites, WeaveConfig())
    assert [(p.lowering, p.code) for p in plans] == [("portable", ReasonCode.NONE)] * 2
    small = plan_sites(sites, WeaveConfig(min_world_size=4))
    assert [(p.lowering, p.code) for p in small] == [(None, ReasonCode.GROUP_TOO_SMALL)] * 2
    assert small[0].reason == Reason.of(ReasonCode.GROUP_TOO_SMALL, size=2, min_world_size=4)
    monkeypatch.setattr("weavepass.compile.planner._cuda_unsupported_reason", lambda site: "no kernel")
    fallback = plan_sites(sites, WeaveConfig(lowering="cuda_symm"))
    assert [(p.lowering, p.code) for p in fallback] == [("portable", ReasonCode.PORTABLE_FALLBACK)] * 2
    monkeypatch.setattr("weavepass.compile.planner.group_size", lambda name: None)
    unknown = plan_sites(sites, WeaveConfig())
    assert [(p.lowering, p.code) for p in unknown] == [(None, ReasonCode.GROUP_UNKNOWN)] * 2


def test_plan_gives_layer_norm_sites_every_lowering(world2, monkeypatch):
    """Every lowering carries a LayerNorm (``weave.fused_allreduce_layernorm``): LayerNorm sites
    take the lowering an RMSNorm site would."""
    sites, _ = find_allreduce_rmsnorm_sites(_trace(layer_norm_sites, *_args(40)))
    assert [(p.lowering, p.code) for p in plan_sites(sites, WeaveConfig())] == [("portable", ReasonCode.NONE)] * 2
    monkeypatch.setattr("weavepass.compile.planner._cuda_unsupported_reason", lambda site: None)
    plans = plan_sites(sites, WeaveConfig(lowering="cuda_symm"))
    assert [(p.lowering, p.code) for p in plans] == [("cuda_symm", ReasonCode.CUDA_COPY)] * 2


# --- the strategies' decisions -------------------------------------------------------------------

FLASHCOMM = dict(enable_flashcomm=True, flashcomm_min_prefill_tokens=1, split="off")


def test_flashcomm_decision_fields(world2):
    rewrite = _rewrite(_trace(two_sites, *_args(40)), WeaveConfig(**FLASHCOMM))
    decision = FlashCommStrategy().decide(rewrite)
    assert decision.use and decision.code is ReasonCode.NONE
    assert (decision.group_name, decision.world_size, decision.num_tokens) == ("0", 2, 40)
    assert (decision.padded_tokens, decision.rows_per_rank) == (64, 32)


@pytest.mark.parametrize("fn, mode, config, code, stopped_at, fields", [
    (two_sites, "fake", dict(enable_flashcomm=False), ReasonCode.NOT_ASKED, "", {}),
    (two_sites, "fake", dict(FLASHCOMM, flashcomm_min_prefill_tokens=41), ReasonCode.TOO_FEW_TOKENS, "",
     dict(tokens=40, min_tokens=41)),
    (two_sites, "fake", dict(FLASHCOMM, min_world_size=4), ReasonCode.GROUP_TOO_SMALL, "",
     dict(size=2, min_world_size=4)),
    (two_sites, "symbolic", FLASHCOMM, ReasonCode.SYMBOLIC_TOKENS, "all_reduce", dict(site="all_reduce")),
    (broken_stream, "fake", FLASHCOMM, ReasonCode.STREAM_BROKEN, "all_reduce_1",
     dict(previous="all_reduce", site="all_reduce_1", residual="r_1", stream="add")),
])
def test_flashcomm_decision_reasons(world2, fn, mode, config, code, stopped_at, fields):
    rewrite = _rewrite(_trace(fn, *_args(40), mode=mode), WeaveConfig(**config))
    decision = decide_flashcomm(rewrite.plans, rewrite.config)
    assert (decision.use, decision.stopped_at) == (False, stopped_at)
    assert decision.reason == Reason.of(code, **fields), decision.reason


def test_flashcomm_strategy_refuses_training_and_not_asked_is_silent(world2):
    rewrite = _rewrite(_trace(two_sites, *_args(40)), WeaveConfig(**FLASHCOMM))
    _as_training(rewrite)
    decision = FlashCommStrategy().decide(rewrite)
    assert (decision.use, decision.code) == (False, ReasonCode.TRAINING)
    FlashCommStrategy().decline(rewrite, decision)
    assert rewrite.report.codes == [ReasonCode.TRAINING]
    assert rewrite.report.notes == [f"FlashComm not used: {decision.reason.render()}"]
    off = _rewrite(_trace(two_sites, *_args(40)), WeaveConfig())
    assert FlashCommStrategy().decide(off).code is ReasonCode.NOT_ASKED


def test_flashcomm_apply_takes_the_graph(world2):
    rewrite = _rewrite(_trace(two_sites, *_args(40)), WeaveConfig(**FLASHCOMM))
    strategy = FlashCommStrategy()
    assert strategy.apply(rewrite, strategy.decide(rewrite)) is True
    ops = op_counts(rewrite.graph)
    assert "_c10d_functional.all_reduce.default" not in ops
    assert ops["_c10d_functional.reduce_scatter_tensor.default"] == 2
    assert [r.lowering for r in rewrite.report.records] == ["flashcomm:portable"] * 2
    assert rewrite.report.notes[0] == "FlashComm (portable): 40 tokens padded to 64, 32 rows per rank on 2 ranks"


def test_check_replicated_reads_the_layer_norm_op_by_argument_name(world2):
    """The LayerNorm op has a bias after the weight: the check gets the residual, the weight and
    the group from their names, not from the RMSNorm op's positions."""
    rewrite = _rewrite(_trace(layer_norm_sites, *_args(40)), WeaveConfig(check_replicated=True))
    FuseStrategy().apply(rewrite, FuseStrategy().decide(rewrite))
    checks = [n for n in rewrite.graph.nodes if n.target is torch.ops.weave.check_replicated.default]
    fused = [n for n in rewrite.graph.nodes if n.target is torch.ops.weave.fused_allreduce_layernorm.default]
    assert len(checks) == len(fused) == 2
    for check, op in zip(checks, fused):
        x, weight, what, site, group, bias = check.args
        assert (what, group) == ("residual", "0") and weight is op.args[2] and op.args[1] is check
        assert bias is op.args[3] and bias is not None  # the bias is compared across ranks too


@pytest.mark.parametrize("kind, norm_note", [
    ("portable", []),
    ("npu", [[ReasonCode.FLASHCOMM_NORM_ATEN, ReasonCode.NPU_NORM_LAYER_NORM]]),
])
def test_flashcomm_carries_layer_norm_sites(world2, kind, norm_note):
    """FlashComm replays the site's own LayerNorm nodes on the shard; on NPU not as
    ``npu_add_rms_norm`` (an RMSNorm), with the reason on each record."""
    rewrite = _rewrite(_trace(layer_norm_sites, *_args(40)), WeaveConfig(**FLASHCOMM))
    strategy = FlashCommStrategy()
    with force_device_kind(kind):
        assert strategy.apply(rewrite, strategy.decide(rewrite)) is True
    ops = op_counts(rewrite.graph)
    assert "_c10d_functional.all_reduce.default" not in ops and "weave.npu_add_rms_norm.default" not in ops
    assert ops["_c10d_functional.reduce_scatter_tensor.default"] == 2
    assert ops["aten.native_layer_norm.default"] == 2  # replayed on the [R, H] shards
    assert [r.lowering for r in rewrite.report.records] == ["flashcomm:portable"] * 2
    assert [[list(n.codes()) for n in r.notes] for r in rewrite.report.records] == [norm_note] * 2


def test_split_decision(world2):
    strategy = SplitStrategy()
    assert strategy.decide(_rewrite(_trace(two_sites, *_args(40)), WeaveConfig())).code is ReasonCode.NOT_ASKED
    rewrite = _rewrite(_trace(two_sites, *_args(640)), WeaveConfig(split="force"))
    FuseStrategy().apply(rewrite, FuseStrategy().decide(rewrite))
    assert list(rewrite.fused) == ["all_reduce", "all_reduce_1"]
    decision = strategy.decide(rewrite)
    assert decision.use and decision.code is ReasonCode.NONE
    assert strategy.apply(rewrite, decision) is False  # later strategies may still run
    ops = op_counts(rewrite.graph)
    assert ops["weave.fused_allreduce_rmsnorm_async.default"] == 4
    assert "weave.fused_allreduce_rmsnorm.default" not in ops
    assert rewrite.report.notes == ["split (sequence): A = 256 / B = 384 tokens, wave inequality holds; "
                                    "2 sites x 2 halves"]


def _split(config: WeaveConfig) -> GraphRewrite:
    """``two_sites`` at 640 tokens, fused, then split under ``config`` (a fake group must be active)."""
    rewrite = _rewrite(_trace(two_sites, *_args(640)), config)
    FuseStrategy().apply(rewrite, FuseStrategy().decide(rewrite))
    SplitStrategy().apply(rewrite, SplitStrategy().decide(rewrite))
    return rewrite


def test_split_note_when_no_site_was_fused(world2):
    """``split="force"`` on a graph whose sites all stay unfused (here: a group smaller than
    ``min_world_size``, as with TP=1): the graph note says no site was fused and points at the site
    lines, not at missing compute (what it said before, which sent a user looking in the model)."""
    rewrite = _split(WeaveConfig(split="force", min_world_size=4))
    assert not rewrite.fused
    assert "_c10d_functional.all_reduce.default" in op_counts(rewrite.graph)
    assert rewrite.report.codes == [ReasonCode.SPLIT_NOTHING_FUSED]
    assert all(r.codes == [ReasonCode.GROUP_TOO_SMALL] for r in rewrite.report.records), rewrite.report.records


def gemma_norm_sites(x, r, w1, g1, w2, g2):
    """``two_sites`` with Gemma's norm scale ``1 + g``: a weight the graph computes."""
    h1 = funcol.all_reduce(x @ w1, "sum", dist.group.WORLD) + r
    h2 = funcol.all_reduce(torch.relu(_rms(h1, 1 + g1)) @ w2, "sum", dist.group.WORLD) + h1
    return _rms(h2, 1 + g2), h2


@pytest.mark.parametrize("fn", [two_sites, gemma_norm_sites])
def test_split_join_reads_every_input_of_its_op(world2, fn):
    """The communication stream reads an async op's partial, residual and weight until the join,
    so the join reads all three: Inductor then neither frees nor reuses their buffers before it.
    The weight matters where the graph computes it (Gemma's ``1 + w``): reading only the partial
    and the residual, the generated code ``del``-ed that buffer right after half B's op."""
    rewrite = _rewrite(_trace(fn, *_args(640)), WeaveConfig(split="force"))
    FuseStrategy().apply(rewrite, FuseStrategy().decide(rewrite))
    SplitStrategy().apply(rewrite, SplitStrategy().decide(rewrite))
    forks = [n for n in rewrite.graph.nodes if n.target is torch.ops.weave.fused_allreduce_rmsnorm_async.default]
    joins = [n for n in rewrite.graph.nodes if n.target is torch.ops.weave.join_async.default]
    assert len(forks) == len(joins) == 4
    computed = 0
    for join in joins:
        normed, residual_out, inputs = join.args
        (fork,) = {normed.args[0], residual_out.args[0]}  # both outputs of one op
        assert inputs == [a for a in fork.args[:3] if isinstance(a, torch.fx.Node)], (join, fork.args)
        computed += fork.args[2].op != "placeholder"
    assert computed == (4 if fn is gemma_norm_sites else 0)  # the weight is a graph node there


PUSH_ASYNC = torch.ops.weave.fused_allreduce_rmsnorm_push_async.default


def test_split_push_variant_passes_one_slot_per_half(world2):
    """``split_comm="push"``: every site becomes the push op, half A's with staging slot 0 and
    B's with slot 1 (a slot is reused only by the same half's next site, after its join), the
    CTA count travels as before, and the joins are those of the fused async op (one per op).
    On this CPU graph the sites' lowering is portable: the note says the op runs there as the fused
    async op."""
    rewrite = _split(WeaveConfig(split="force", split_comm="push", split_comm_ctas=12))
    ops = op_counts(rewrite.graph)
    assert ops["weave.fused_allreduce_rmsnorm_push_async.default"] == 4
    assert "weave.fused_allreduce_rmsnorm_async.default" not in ops
    assert "weave.fused_allreduce_rmsnorm.default" not in ops
    assert ops["weave.join_async.default"] == 4 and "_c10d_functional.wait_tensor.default" not in ops
    pushes = [n for n in rewrite.graph.nodes if n.target is PUSH_ASYNC]
    # In graph order: site 1 A, site 1 B, site 2 A, site 2 B; rows of A before B's (A = 256 rows).
    assert [n.args[-1] for n in pushes] == [0, 1, 0, 1]
    assert [n.args[-2] for n in pushes] == [12] * 4
    assert [n.args[0].meta["val"].shape[0] for n in pushes] == [256, 384, 256, 384]
    assert rewrite.report.notes == [
        "split (sequence): A = 256 / B = 384 tokens, wave inequality holds; 2 sites x 2 halves; "
        "communication: push (slot 0 for A, 1 for B); sites on lowering portable run it as the fused "
        "async op (the push kernels are cuda_symm's)"]


def test_split_push_variant_refused_beyond_two_ranks():
    """On 3 ranks the push variant would move 2 S per rank against two-shot's 1.33 S: the split
    keeps the fused async op, and the note says why."""
    with fake_process_group(3):
        rewrite = _split(WeaveConfig(split="force", split_comm="push"))
    ops = op_counts(rewrite.graph)
    assert ops["weave.fused_allreduce_rmsnorm_async.default"] == 4
    assert "weave.fused_allreduce_rmsnorm_push_async.default" not in ops
    assert rewrite.report.reasons == [Reason.of(ReasonCode.PUSH_WORLD_SIZE, world=3, peers=2, two_shot=4 / 3)]
    (note,) = rewrite.report.notes
    assert note.startswith("split (sequence)") and "communication: fused kernel" in note, note


def test_overlap_comm_is_validated():
    with pytest.raises(ValueError, match="split_comm must be one of"):
        WeaveConfig(split_comm="lean")
    assert WeaveConfig().split_comm == "fused"  # off by default: not measured on GPUs yet


@pytest.mark.parametrize("seconds", [float("inf"), 1e15])
def test_plan_check_timeout_must_be_a_wait_the_store_can_take(seconds):
    """``inf`` ("wait for ever") was accepted, and every compile with collectives then failed in the
    plan check's first wait with ``OverflowError: cannot convert float infinity to integer``."""
    with pytest.raises(ValueError, match="plan_check_timeout_s must be"):
        WeaveConfig(plan_check_timeout_s=seconds)
    longest = WeaveConfig(plan_check_timeout_s=timedelta.max.days * 86400.0)  # about 2.7 million years
    store = dist.HashStore()
    line = [("ar", "_c10d_functional.all_reduce(float32[4, 16], 'sum', '0')")]
    store.set(_key("0", 0, 1, 0), json.dumps([["ar", line[0][1], 0]]))  # rank 1 published already
    PlanExchange().check(store, "0", 0, [0, 1], line, 0, longest.plan_check_timeout_s)


@pytest.mark.parametrize("tokens, mode", [((640,), "fake"), ((640,), "symbolic"), ((4, 10), "symbolic"),
                                          ((1, 40), "symbolic")], ids=["static", "T", "BxS", "1xS"])
def test_split_plans_on_the_planners_token_count(world2, monkeypatch, tokens, mode):
    """The split plans its cut through one ``plan_split`` call on the planner's ``TokenCount`` of the
    sites: the same value (for ``[B, S, H]`` the product of both symbols, not one of them), the same
    hint, and the plan is for that hint."""
    calls = []

    def spy(count, *args, **kwargs):
        calls.append((count, plan_split(count, *args, **kwargs)))
        return calls[-1][1]

    monkeypatch.setattr("weavepass.compile.strategies.split.plan_split", spy)
    rewrite = _rewrite(_trace(two_sites, *_args(*tokens), mode=mode), WeaveConfig(split="force"))
    planned = [TokenCount.of(plan.site.partial) for plan in rewrite.plans]
    FuseStrategy().apply(rewrite, FuseStrategy().decide(rewrite))
    SplitStrategy().apply(rewrite, SplitStrategy().decide(rewrite))
    ((count, plan),) = calls
    for site_count in planned:  # str: comparing SymInts would install a guard
        want = (str(site_count.value), site_count.static, site_count.hint)
        assert (str(count.value), count.static, count.hint) == want
    assert count.symbolic == (mode == "symbolic")
    assert plan.tokens == count.hint == math.prod(tokens)
    assert plan.first is not None and rewrite.report.notes[-1].startswith("split"), rewrite.report.notes


def test_split_refuses_training_after_fuse(world2):
    rewrite = _rewrite(_trace(two_sites, *_args(640)), WeaveConfig(split="force"))
    FuseStrategy().apply(rewrite, FuseStrategy().decide(rewrite))
    _as_training(rewrite)
    decision = SplitStrategy().decide(rewrite)
    assert (decision.use, decision.code) == (False, ReasonCode.TRAINING)


def test_strategy_order_is_checked_against_the_contract():
    """The contract each strategy states (``reads``, ``writes``, ``takes_graph``) holds the order:
    FlashComm, which rewrites the sites and takes the graph, before fuse, which rewrites them too;
    the split, which reads the fused ops, after fuse, which writes them."""
    flashcomm, fuse, split = STRATEGIES
    check_order(STRATEGIES)
    with pytest.raises(ContractError, match="read\\(s\\) the sites after fuse"):
        check_order((fuse, flashcomm, split))
    with pytest.raises(ContractError, match="reads 'fused', written by fuse"):
        check_order((flashcomm, split, fuse))


def test_a_strategy_that_changes_what_it_does_not_declare_is_stopped(world2):
    class Undeclared(FuseStrategy):
        writes = frozenset({"sites", "records", "notes"})  # fills rewrite.fused all the same

    rewrite = _rewrite(_trace(two_sites, *_args(40)), WeaveConfig())
    before = snapshot(rewrite)
    strategy = Undeclared()
    strategy.apply(rewrite, strategy.decide(rewrite))
    with pytest.raises(ContractError, match=r"changed \['fused'\]"):
        check_writes(strategy, before, rewrite)
    check_writes(FuseStrategy(), before, rewrite)  # the real one declares it


def test_inductor_patches_come_from_the_strategies():
    assert inductor_patches(WeaveConfig(split="off")) == {}
    assert inductor_patches(WeaveConfig(split="off", enable_flashcomm=True)) == {"shape_padding": False}
    # Inductor's overlap scheduler (where this torch has it) would move a split's joins after the
    # reads they guard (split.OVERLAP_SCHEDULING): off in split graphs, whatever the user set.
    import torch._inductor.config as inductor_config

    from weavepass.compile.strategies.split import OVERLAP_SCHEDULING

    # Shape padding pads token rows only where a benchmark says so (timing-dependent graphs,
    # possibly different per rank) and the split has no rule for the pad: off too.
    expected = {"reorder_for_peak_memory": False, "shape_padding": False}
    if hasattr(inductor_config, "aten_distributed_optimizations"):
        expected[OVERLAP_SCHEDULING] = False
    assert inductor_patches(WeaveConfig(split="force")) == expected
    with inductor_config.patch(inductor_patches(WeaveConfig(split="force"))):  # a key Inductor knows
        assert inductor_config.reorder_for_peak_memory is False
        assert inductor_config.shape_padding is False


def test_user_option_the_split_overrides_is_warned():
    """A user's Inductor option that the split must override is not dropped silently: one warning
    names it (then the split's value is used)."""
    from weavepass import backend

    backend._OVERRIDDEN_WARNED.clear()
    with pytest.warns(RuntimeWarning, match="reorder_for_peak_memory=True is overridden with False"):
        backend._warn_overridden({"reorder_for_peak_memory": True}, {"reorder_for_peak_memory": False})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # the same value as required, or not set by the user (Inductor's default True): nothing to say
        backend._warn_overridden({"reorder_for_peak_memory": False}, {"reorder_for_peak_memory": False})
        backend._warn_overridden({}, {"reorder_for_peak_memory": False})
    import torch._inductor.config as inductor_config

    with inductor_config.patch(reorder_for_peak_memory=True, fx_graph_cache=False):  # set globally, = default
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            backend._warn_overridden({}, {"reorder_for_peak_memory": False})
    if hasattr(inductor_config, "aten_distributed_optimizations"):  # set globally, not the default
        from weavepass.compile.strategies.split import OVERLAP_SCHEDULING

        with inductor_config.patch({OVERLAP_SCHEDULING: True}):
            with pytest.warns(RuntimeWarning, match="enable_overlap_scheduling=True is overridden"):
                backend._warn_overridden({}, {OVERLAP_SCHEDULING: False})


def test_plan_split_is_the_planner_call_of_the_split(world2):
    """Static counts are planned as ``plan_token_split`` plans them; a symbolic count outside the
    split window is refused on its value (the guard) before any cut is planned."""
    gemms = [GemmShape(n=8192, k=8192)]
    auto = WeaveConfig(split="auto", split_min_tokens=1024, split_min_tokens_moe=4096, split_max_tokens=8192)
    assert plan_split(TokenCount(4096), 1, gemms, auto, torch.device("cpu")) == \
        plan_token_split(1, 4096, gemms, auto, WaveModel())
    site = find_allreduce_rmsnorm_sites(_trace(two_sites, *_args(40), mode="symbolic"))[0][0]
    refused = plan_split(TokenCount.of(site.partial), 1, gemms, auto, torch.device("cpu"))
    assert refused.first is None and refused.reason == Reason.of(ReasonCode.SPLIT_BELOW_WINDOW, tokens=None, low=1024,
                                                                 kind="dense")


# --- what may differ between ranks ---------------------------------------------------------------
#
# Every rank must rewrite the same way. The plan reads shapes, the config and the group's size,
# never the rank (tested below); but some inputs of the plan are read locally and can differ in a
# badly set up job: the GPU's SM count (the wave model of the split), whether a lowering can run
# here (triton importable, the kernel built), whether the group is known. For those, the
# cross-rank plan check (``weavepass.compile.plan_check``) must stop the compile with both ranks' lines
# rather than let the ranks hang in mismatched collectives. The exchange runs over one in-process
# store, one thread per simulated rank, as it runs over the default group's store.

SPLIT = WeaveConfig(split="force")


def _lines_on_rank(rank: int, config: WeaveConfig) -> list[tuple[str, str]]:
    """The collective lines rank ``rank`` of 2 publishes for ``two_sites`` on 640 tokens."""
    with fake_process_group(2, rank):
        graph = _trace(two_sites, *_args(640))
        WeavePass(config)(graph)  # its own plan check skips fake groups
        return collective_lines(graph)["0"]


def _exchange(lines: list[list[tuple[str, str]]]) -> list[str | None]:
    """Each rank's ``PlanMismatchError`` text (None: the check passed), ranks checking concurrently."""
    return _streams([[rank_lines] for rank_lines in lines])


def test_plan_check_waits_longer_for_a_peers_first_graph_than_for_later_ones():
    """Rank 1 publishes each of two different graphs 1 s after rank 0 (timeout 0.3 s). Its first graph on the group
    is awaited up to ``first_timeout_s`` (the group's timeout in a real job: start-up skew is
    healthy); its second is late by the ordinary limit and fails, naming the silent rank."""
    import time

    store = dist.HashStore()
    lines = [[("ar", f"_c10d_functional.all_reduce float32[{rows}, 16] sum")] for rows in (4, 5)]
    exchanges = [PlanExchange(), PlanExchange()]
    errors: dict[tuple[int, int], str | None] = {}

    def rank_main(rank: int) -> None:
        for graph in range(2):
            if rank == 1:
                time.sleep(1.0)
            try:
                exchanges[rank].check(store, "0", rank, [0, 1], lines[graph], graph, timeout_s=0.3,
                                      first_timeout_s=5.0)
                errors[(rank, graph)] = None
            except PlanMismatchError as error:
                errors[(rank, graph)] = str(error)
                return

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors[(0, 0)] is None and errors[(1, 0)] is None  # the first graph: 1 s late is fine
    assert "rank 1 published no plan for this point within 0.3 s" in errors[(0, 1)], errors
    assert "from #1 on" in errors[(0, 1)], errors


def test_a_peer_chunk_gone_between_the_wait_and_the_read_fails_at_once(monkeypatch):
    """A peer's failed check deletes its chunks (``_fail``); if that happens between this rank's wait
    seeing the chunk and its read, the read must not wait for the key: ``Store.get`` waits up to the
    store's timeout (300 s by default; a CI run hung there, 2026-12-04). It fails at once, naming the
    peer. The store's timeout is 20 s here, so the old read fails the time bound below."""
    import time

    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=20))
    monkeypatch.setattr(PlanExchange, "_wait", lambda self, *args: None)  # "the chunk was there"
    began = time.monotonic()
    with pytest.raises(PlanMismatchError, match="rank 1's plan check failed while rank 0 read its plan"):
        PlanExchange().check(store, "0", 0, [0, 1], [("ar", "_c10d_functional.all_reduce float32[4, 16] sum")],
                             0, timeout_s=5.0)
    assert time.monotonic() - began < 5.0


@pytest.mark.parametrize("config", [WeaveConfig(), SPLIT, WeaveConfig(**FLASHCOMM)],
                         ids=["fuse", "split", "flashcomm"])
def test_plan_does_not_depend_on_the_rank(config):
    lines = [_lines_on_rank(rank, config) for rank in (0, 1)]
    assert lines[0] == lines[1]
    assert lines[0][0][1].startswith(("weave.", "_c10d_functional.reduce_scatter"))  # rewritten
    assert _exchange(lines) == [None, None]


def test_local_sm_count_changes_the_split_and_the_plan_check_stops_it(monkeypatch):
    """The split's cut depends on the local SM count (``device_wave_model``): on 640 tokens, with
    132 SMs every cut in the middle costs one extra wave and the balanced 320/320 wins; with no SM
    count (tiles only) 256/384 wastes fewer tiles. Two ranks on GPUs of different SM counts (MIG
    slices, mixed nodes) would split differently: the plan check names both cuts."""
    lines = []
    for rank, model in enumerate((WaveModel(sms=132), WaveModel())):
        monkeypatch.setattr("weavepass.compile.wave_model.device_wave_model", lambda device, m=model: m)
        lines.append(_lines_on_rank(rank, SPLIT))
    assert "float32[320, 64]" in lines[0][0][1] and "float32[256, 64]" in lines[1][0][1]
    for me, error in enumerate(_exchange(lines)):
        assert error is not None and "would run different collectives on group '0' at collective #0" in error
        assert lines[me][0][1] in error and lines[1 - me][0][1] in error and "Likely cause" in error


def test_lowering_available_on_one_rank_only_is_stopped(monkeypatch):
    """``lowering="cuda_symm"`` where only rank 0 can run the kernel (triton missing on rank 1):
    rank 1 falls back to portable; the lowering is part of the op call, so the check sees it."""
    lines = []
    for rank, reason in enumerate((None, "CUDA lowering unavailable (No module named 'triton')")):
        monkeypatch.setattr("weavepass.compile.planner._cuda_unsupported_reason", lambda site, r=reason: r)
        lines.append(_lines_on_rank(rank, WeaveConfig(lowering="cuda_symm")))
    assert "'cuda_symm'" in lines[0][0][1] and "'portable'" in lines[1][0][1]
    errors = _exchange(lines)
    assert all(e is not None and "'cuda_symm'" in e and "'portable'" in e for e in errors), errors


def test_group_unknown_on_one_rank_is_stopped(monkeypatch):
    """A rank that cannot resolve the group leaves its all_reduces alone; its peers fuse them."""
    lines = [_lines_on_rank(0, WeaveConfig())]
    monkeypatch.setattr("weavepass.compile.planner.group_size", lambda name: None)
    lines.append(_lines_on_rank(1, WeaveConfig()))
    assert lines[0][0][1].startswith("weave.fused_allreduce_rmsnorm(")
    assert lines[1][0][1].startswith("_c10d_functional.all_reduce(")
    errors = _exchange(lines)
    assert all(e is not None and "weave.fused_allreduce_rmsnorm(" in e and "_c10d_functional.all_reduce(" in e
               for e in errors), errors


def first_site(x, r, w1, g1):
    """``two_sites`` up to its first norm: rank 0's first graph when a break follows that norm."""
    h1 = funcol.all_reduce(x @ w1, "sum", dist.group.WORLD) + r
    return torch.relu(_rms(h1, g1)), h1


def second_site(n1, h1, w2, g2):
    """The rest of ``two_sites``, from the first norm's output: rank 0's second graph."""
    h2 = funcol.all_reduce(n1 @ w2, "sum", dist.group.WORLD) + h1
    return _rms(h2, g2), h2


def _streams(per_rank: list[list[list[tuple[str, str]]]]) -> list[str | None]:
    """Each rank's ``PlanMismatchError`` text (None: the check passed) for ranks that compiled
    several graphs each, checked in order, ranks checking concurrently."""
    return check_plans_in_threads(per_rank, timeout_s=10.0)


@pytest.mark.parametrize("check_replicated", [False, True])
def test_a_harmless_break_on_one_rank_passes_the_plan_check(check_replicated):
    """Rank 0 breaks the graph after the first site's norm (a rank-dependent print), rank 1 does
    not: the same collectives, in two graphs on rank 0, whose nodes are named afresh in each graph
    (its second all_reduce is ``all_reduce``, rank 1's ``all_reduce_1``). With ``check_replicated``
    the check op carried the site's node name, a label for its error message, into the plan line:
    a healthy job failed with ``PlanMismatchError``."""
    config = WeaveConfig(check_replicated=check_replicated)
    args = _args(640)
    with fake_process_group(2, 0):
        graphs = [_trace(first_site, *args[:4]), _trace(second_site, torch.randn(640, H), args[1], *args[4:])]
        for graph in graphs:
            WeavePass(config)(graph)
        broken = [collective_lines(graph)["0"] for graph in graphs]
    whole = _lines_on_rank(1, config)
    assert len(whole) == sum(map(len, broken)) == (4 if check_replicated else 2)
    assert _streams([broken, [whole]]) == [None, None]
    # The check can fail: a different shape in rank 0's second graph is still named (by rank 0,
    # which compares it; rank 1 compared its lines with rank 0's first graph only).
    wrong = [(name, line.replace("[640, 64]", "[641, 64]")) for name, line in broken[1]]
    error = _streams([[broken[0], wrong], [whole]])[0]
    assert error is not None and "[641, 64]" in error and "would run different collectives" in error


# --- what the CUDA lowering is asked -------------------------------------------------------------

def test_cuda_lowering_is_asked_about_the_norms_output_dtype(world2, monkeypatch):
    """A bf16 site whose norm weight is fp64 writes an fp64 normed output, which the CUDA kernel
    cannot: the planner asks the support check with the output dtype, and the check refuses it
    (before, the site was planned onto cuda_symm and its first call raised ValueError)."""
    from weavepass.runtime.cuda import support

    assert support.cuda_site_unsupported_reason(torch.bfloat16, H, torch.device("cuda"), "0", torch.float64) == \
        Unsupported.of(support.CudaIssue.OUT_DTYPE, dtype=torch.float64)
    fp32 = support.cuda_site_unsupported_reason(torch.bfloat16, H, torch.device("cuda"), "0", torch.float32)
    assert fp32 is None or fp32.issue is not support.CudaIssue.OUT_DTYPE  # (no triton: another issue)
    asked = []
    refused = Unsupported(support.CudaIssue.NO_TRITON)
    monkeypatch.setattr(support, "cuda_site_unsupported_reason", lambda *a: asked.append(a[4]) or refused)
    args = [a.to(torch.bfloat16) for a in _args(8)]
    args[3] = args[3].to(torch.float64)  # the first norm's weight: its output is fp64
    sites, _ = find_allreduce_rmsnorm_sites(_trace(two_sites, *args))
    plans = plan_sites(sites, WeaveConfig(lowering="cuda_symm"))
    assert asked[0] == torch.float64 and all(p.lowering == "portable" for p in plans), (asked, plans)


@pytest.mark.parametrize("config, fn, level", [
    (WeaveConfig(split="force", min_world_size=4), "split", "WARNING"),  # asked for, not split
    (WeaveConfig(split="auto", min_world_size=4), "split", "INFO"),  # the cost model's call
    (WeaveConfig(enable_flashcomm=True, flashcomm_min_prefill_tokens=1), "broken_stream", "WARNING"),
    (WeaveConfig(enable_flashcomm=True, flashcomm_min_prefill_tokens=641), "two_sites", "INFO"),  # too few
])
def test_a_strategy_asked_for_and_not_used_is_a_warning(world2, caplog, config, fn, level):
    """``split="force"`` not splitting, or FlashComm not used for another reason than a graph
    too small for it, is logged as a warning (the report alone would be silent unless read)."""
    with caplog.at_level("INFO", logger="weavepass"):
        if fn == "split":
            rewrite = _split(config)
        else:
            rewrite = _rewrite(_trace(globals()[fn], *_args(640)), config)
            strategy = FlashCommStrategy()
            strategy.decline(rewrite, strategy.decide(rewrite))
    (record,) = [r for r in caplog.records if any(words in r.getMessage() for words in (
        "split skipped", "FlashComm not used"))]
    assert record.levelname == level, record.getMessage()


def test_explains_graph_numbers_match_the_log(world2, caplog):
    """``explain`` numbers its graphs from 0, but its backend (one per config, shared) logs the
    number it gave the graph among all it compiled: the report names that number too, so a warning
    about "graph 1" can be found in a report that says "graph 0"."""
    config = WeaveConfig(split="force", plan_check_timeout_s=61.0)  # a backend of its own

    def one_site(x, r, w1, g1, w2, g2):
        return _rms(funcol.all_reduce(x @ w1, "sum", dist.group.WORLD) + r, g1)

    torch._dynamo.reset()
    weavepass.explain(two_sites, *_args(40), config=config)  # the backend's graph 0
    with caplog.at_level("WARNING", logger="weavepass"):
        report = weavepass.explain(one_site, *_args(40), config=config)
    (warning,) = [r.getMessage() for r in caplog.records if "split skipped" in r.getMessage()]
    assert "graph 1:" in warning
    text = str(report)
    assert report.graphs[0].graph_index == 0 and "graph 0 (graph 1 in weavepass's log): 1/1" in text, text


def test_a_fallback_shared_by_many_sites_is_one_warning(world2, caplog):
    """``lowering="cuda_symm"`` on CPU tensors: every site falls back for the same reason; the log
    says so once per graph, naming the sites, not once per site (65 lines for 32 layers)."""
    torch._dynamo.reset()
    with caplog.at_level("WARNING", logger="weavepass"):
        report = weavepass.explain(two_sites, *_args(40), config=WeaveConfig(lowering="cuda_symm"))
    warnings = [r.getMessage() for r in caplog.records if "instead of cuda_symm" in r.getMessage()]
    assert len(warnings) == 1, warnings
    # rendering test: a warning's text, once for the sites that share its reason
    assert "all_reduce, all_reduce_1" in warnings[0] and "2 site(s)" in warnings[0], warnings
    assert all(r.codes == [ReasonCode.PORTABLE_FALLBACK] for r in report.records)
