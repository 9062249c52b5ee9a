"""The split's planner and the per-site plan: wave model, thresholds, edge cases, reason codes
(agreement across ranks: tests/test_compile_units.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weavepass import WeaveConfig
from weavepass.compile.reasons import Reason, ReasonCode
from weavepass.compile.wave_model import (
    GemmShape,
    WaveModel,
    choose_split_point,
    dominant_gemms,
    plan_token_split,
    split_candidates,
)

H200 = WaveModel(sms=132)
# Llama-3-70B at TP=2 per rank: qkv, o_proj, gate/up, down_proj.
LLAMA70B_TP2 = [GemmShape(5120, 8192), GemmShape(8192, 4096), GemmShape(28672, 8192), GemmShape(8192, 14336)]
FORCE = WeaveConfig(split="force")
AUTO = WeaveConfig(split="auto", split_min_tokens=1024, split_min_tokens_moe=4096, split_max_tokens=8192)


def test_wave_model_counts_ctas_and_waves():
    gemm = GemmShape(n=8192, k=14336)
    assert H200.ctas(4096, gemm) == 32 * 32
    assert H200.waves(1024) == 8  # ceil(1024 / 132)
    assert WaveModel().waves(7) == 7  # no SM count: tiles only


@settings(max_examples=200, deadline=None)
@given(tokens=st.integers(2, 40000), sms=st.sampled_from([None, 8, 78, 114, 132]))
def test_chosen_split_is_valid_and_never_worse_than_halving(tokens, sms):
    model = WaveModel(sms=sms)
    gemms = dominant_gemms(LLAMA70B_TP2)
    candidates = split_candidates(tokens, model, None)
    first, free = choose_split_point(tokens, candidates, gemms, model)
    assert 1 <= first <= tokens - 1
    whole = model.cost(tokens, gemms)
    waste = model.cost(first, gemms) + model.cost(tokens - first, gemms) - whole
    half = tokens // 2
    assert waste <= model.cost(half, gemms) + model.cost(tokens - half, gemms) - whole
    assert waste >= 0  # splitting never saves waves
    # ``free`` is exactly the documented inequality, for every dominant GEMM.
    assert free == all(
        model.waves(model.ctas(first, g)) + model.waves(model.ctas(tokens - first, g))
        <= model.waves(model.ctas(tokens, g)) for g in gemms
    )
    assert free == (waste == 0)


@pytest.mark.parametrize("tokens", [2048, 4096, 8192, 16384])
def test_wave_inequality_holds_at_llama70b_sizes(tokens):
    plan = plan_token_split(1, tokens, LLAMA70B_TP2, FORCE, H200)
    assert plan.first is not None and plan.free, plan
    assert tokens / 4 <= plan.first <= 3 * tokens / 4
    for g in dominant_gemms(LLAMA70B_TP2):  # the small qkv GEMM is not dominant here
        c, c1, c2 = (H200.ctas(t, g) for t in (tokens, plan.first, tokens - plan.first))
        assert -(-c1 // 132) + -(-c2 // 132) <= -(-c // 132)


def test_wave_aware_split_differs_from_naive_half():
    # 3000 tokens: halving gives 1500 rows = 12 row tiles each (24 > 23.4 -> 24 tiles vs 24 total);
    # the planner picks a tile multiple so no tile is half empty twice.
    plan = plan_token_split(1, 3000, LLAMA70B_TP2, FORCE, H200)
    assert plan.first % 128 == 0


def test_edge_cases_and_thresholds():
    one = plan_token_split(1, 1, LLAMA70B_TP2, FORCE, H200)
    assert one.first is None and one.reason == Reason.of(ReasonCode.SPLIT_TOO_FEW_TOKENS, tokens=1)
    two = plan_token_split(1, 2, LLAMA70B_TP2, FORCE, H200)
    assert two.first == 1
    odd = plan_token_split(1, 7, LLAMA70B_TP2, FORCE, WaveModel())
    assert odd.first in (3, 4)
    below = plan_token_split(1, 1023, LLAMA70B_TP2, AUTO, H200)
    assert below.first is None and below.reason == Reason.of(ReasonCode.SPLIT_BELOW_WINDOW, tokens=1023, low=1024,
                                                             kind="dense")
    at = plan_token_split(1, 1024, LLAMA70B_TP2, AUTO, H200)
    assert at.first is not None
    above = plan_token_split(1, 1025, LLAMA70B_TP2, AUTO, H200)
    assert above.first is not None and 256 <= above.first <= 769
    moe = plan_token_split(1, 2048, LLAMA70B_TP2, AUTO, H200, moe=True)
    assert moe.first is None and moe.reason == Reason.of(ReasonCode.SPLIT_BELOW_WINDOW, tokens=2048, low=4096,
                                                         kind="MoE")
    assert plan_token_split(1, 8192, LLAMA70B_TP2, AUTO, H200).first is not None
    over = plan_token_split(1, 8193, LLAMA70B_TP2, AUTO, H200)
    assert over.first is None and over.reason == Reason.of(ReasonCode.SPLIT_ABOVE_WINDOW, tokens=8193, high=8192)
    batches = plan_token_split(4, 4096, LLAMA70B_TP2, AUTO, H200)  # 16K tokens in 4 sequences
    assert batches.first is None and batches.reason.code is ReasonCode.SPLIT_ABOVE_WINDOW
    assert batches.reason.field("tokens") == 16384


def test_planner_reasons_render():  # rendering test
    """The planner's codes render the sentences the report shows (the rest branch on codes)."""
    assert str(Reason.of(ReasonCode.SPLIT_TOO_FEW_TOKENS, tokens=1)) == "1 token(s): nothing to split"
    assert str(plan_token_split(1, 1023, LLAMA70B_TP2, AUTO, H200).reason) == (
        "1023 tokens < split threshold 1024 (dense): fuse-only pays more")
    assert str(plan_token_split(1, 8193, LLAMA70B_TP2, AUTO, H200).reason) == (
        "8193 tokens > split_max_tokens 8192: measured slower split")
    assert str(Reason.of(ReasonCode.SPLIT_ABOVE_WINDOW, tokens=None, high=8192)) == (
        "symbolic token count above split_max_tokens 8192; guarded, so a batch inside the window compiles "
        "its own graph")


def test_batch_split_is_between_sequences():
    plan = plan_token_split(8, 1000, LLAMA70B_TP2, FORCE, H200)
    assert plan.mode == "batch" and plan.first % 1000 == 0 and 2000 <= plan.first <= 6000
    two = plan_token_split(2, 3, LLAMA70B_TP2, FORCE, H200)
    assert two.mode == "batch" and two.first == 3
    uneven = plan_token_split(3, 5, LLAMA70B_TP2, FORCE, WaveModel())
    assert uneven.first in (5, 10)


def test_config_rejects_bad_thresholds():
    with pytest.raises(ValueError, match="split_min_tokens"):
        WeaveConfig(split_min_tokens=1)
    with pytest.raises(ValueError, match="split_max_tokens"):
        WeaveConfig(split_min_tokens=4096, split_max_tokens=2048)
    with pytest.raises(ValueError, match="split_comm_ctas"):
        WeaveConfig(split_comm_ctas=64)


def test_cuda_site_report_says_the_partial_is_copied(monkeypatch):
    """A site on the CUDA kernel says in the report that its partial sums are copied into the
    symmetric workspace (the matmul does not write there yet)."""
    import types

    import torch

    from weavepass.compile import planner as scheduler

    monkeypatch.setattr(scheduler, "_cuda_unsupported_reason", lambda site: None)
    partial = types.SimpleNamespace(meta={"val": torch.empty(2, 1024, 8)})  # 2048 tokens
    site = types.SimpleNamespace(device=torch.device("cuda", 0), partial=partial, training=False)
    lowering, reason = scheduler.choose_lowering(site, WeaveConfig())
    assert lowering == "cuda_symm" and reason == Reason(ReasonCode.CUDA_COPY)
    # A training site needs the inverse RMS: the CUDA kernel writes it too (return_inv_rms), so
    # training sites take the same lowering as inference ones.
    training = types.SimpleNamespace(device=torch.device("cuda", 0), partial=partial, training=True)
    for config in (WeaveConfig(), WeaveConfig(lowering="cuda_symm")):
        assert scheduler.choose_lowering(training, config)[0] == "cuda_symm"
    assert scheduler.choose_lowering(training, WeaveConfig(lowering="portable"))[0] == "portable"
    odd = Reason.of(ReasonCode.CUDA_HIDDEN_NOT_MULTIPLE, hidden=12)
    monkeypatch.setattr(scheduler, "_cuda_unsupported_reason", lambda site: odd)
    assert scheduler.choose_lowering(site, WeaveConfig()) == (None, Reason.of(ReasonCode.CUDA_UNSUPPORTED, cause=odd))


def test_inductor_cuda_graphs_leave_cuda_sites_alone_only_when_forbidden():
    """With allow_inductor_cudagraphs=False, under mode="reduce-overhead" (Inductor CUDA-graph trees)
    a graph with CUDA sites gets the reason on every site, whatever the lowering, size or strategy;
    CPU graphs (no CUDA graphs there) and the default (allowed) are not stopped."""
    import types

    import torch
    from torch._inductor import config as inductor_config

    from weavepass.compile import planner as scheduler

    def site(device):
        return types.SimpleNamespace(device=torch.device(device), group_name="0",
                                     partial=types.SimpleNamespace(meta={"val": torch.empty(4096, 8)}))

    mixed = [site("cuda:0"), site("cuda:0")]
    note = scheduler.INDUCTOR_CUDAGRAPHS
    with inductor_config.patch({"triton.cudagraphs": True}):
        for fields in ({}, {"lowering": "portable"}, {"split": "force"}, {"enable_flashcomm": True}):
            config = WeaveConfig(allow_inductor_cudagraphs=False, **fields)
            assert scheduler.inductor_cudagraphs_reason(mixed, config) == note
            assert [(p.lowering, p.reason) for p in scheduler.plan_sites(mixed, config)] == [(None, note)] * 2
        forbidden = WeaveConfig(allow_inductor_cudagraphs=False)
        assert scheduler.inductor_cudagraphs_reason([site("cpu")], forbidden) is None
        assert scheduler.inductor_cudagraphs_reason(mixed, WeaveConfig()) is None  # the default allows
    assert scheduler.inductor_cudagraphs_reason(mixed, forbidden) is None  # graphs off


def test_small_cuda_batches_stay_all_reduce_without_cuda_graphs(monkeypatch):
    """Below cuda_min_tokens, without Inductor CUDA graphs, the host cost of the fused op measured
    slower than NCCL: auto leaves the all_reduce and says why; with the knob lowered, when the user
    asked for cuda_symm, or under Inductor CUDA graphs that the config allows, the site is fused."""
    import types

    import torch
    from torch._inductor import config as inductor_config

    from weavepass.compile import planner as scheduler

    monkeypatch.setattr(scheduler, "_cuda_unsupported_reason", lambda site: None)

    def site(*shape):
        return types.SimpleNamespace(device=torch.device("cuda", 0), training=False,
                                     partial=types.SimpleNamespace(meta={"val": torch.empty(*shape)}))

    assert scheduler.choose_lowering(site(1, 8), WeaveConfig())[0] == "cuda_symm"  # the default fuses every size
    gated = WeaveConfig(cuda_min_tokens=1024)
    lowering, reason = scheduler.choose_lowering(site(512, 8), gated)
    assert lowering is None and reason == Reason.of(ReasonCode.CUDA_MIN_TOKENS, tokens=512, min_tokens=1024)
    assert scheduler.choose_lowering(site(1, 1024, 8), gated)[0] == "cuda_symm"  # at the bound
    assert scheduler.choose_lowering(site(512, 8), gated.replace(lowering="cuda_symm"))[0] == "cuda_symm"
    with inductor_config.patch({"triton.cudagraphs": True}):
        allowed = gated.replace(allow_inductor_cudagraphs=True)
        assert scheduler.choose_lowering(site(1, 8), allowed)[0] == "cuda_symm"
    with pytest.raises(ValueError, match="cuda_min_tokens"):
        WeaveConfig(cuda_min_tokens=0)
