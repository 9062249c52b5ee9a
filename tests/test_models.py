"""The reference TP decoder, the eager-vs-compiled harness and the process-group helpers, on CPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from weavepass.testing import (
    ComparisonReport,
    TPConfig,
    build_tp_model,
    check_against_eager,
    fake_process_group,
    random_token_ids,
    spawn,
)

# Heads divisible by 1, 2, 3 and 6, so every world size below gets whole heads (GQA: 2 query heads
# per kv head); vocab and intermediate deliberately do not divide by 3 (uneven slices must work).
DENSE = TPConfig(
    vocab=100, hidden=64, n_layers=2, n_heads=12, n_kv_heads=6, head_dim=8, intermediate=80
)
MOE = dataclasses.replace(DENSE, n_heads=6, intermediate=40, n_experts=4)
TORCH_NORM = dataclasses.replace(DENSE, n_layers=1, norm_impl="torch")
CONFIGS = {"dense": DENSE, "moe": MOE, "torch_norm": TORCH_NORM}

# fp32 TP vs unsharded: the only difference is the order of the sums (a matmul over the full
# inner dim vs per-rank partial matmuls added by the all_reduce), ~1e-7 relative per sum. Over two
# layers and the attention softmax this stays below 1e-5 on O(1) normed outputs, while a wrong
# shard (a swapped head, an off-by-one vocab slice) gives O(1) errors.
TP_ATOL = 1e-5


def _tp_matches_unsharded(rank: int, world_size: int) -> dict[str, float]:
    """On each rank: every config's TP output equals the single-process model's output."""
    errors = {}
    ids = random_token_ids(DENSE, batch=2, seq=7, seed=1)
    positions = torch.arange(3, 10)  # not starting at 0: RoPE must take the given positions
    for name, cfg in CONFIGS.items():
        tp = build_tp_model(cfg, rank, world_size, dist.group.WORLD)
        unsharded = build_tp_model(cfg)
        with torch.no_grad():
            got, want = tp(ids, positions), unsharded(ids, positions)
        torch.testing.assert_close(got, want, atol=TP_ATOL, rtol=0, msg=lambda m: f"{name}: {m}")
        errors[name] = (got - want).abs().max().item()
    return errors


def test_world_of_one_on_gloo_matches_unsharded_model():
    # In this process: a spawned world of one would spend seconds importing torch for nothing.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert set(_tp_matches_unsharded(0, 1)) == set(CONFIGS)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world_size", [2, 3])
def test_tp_model_matches_unsharded_model(world_size):
    errors = spawn(_tp_matches_unsharded, world_size, "gloo")
    assert len(errors) == world_size and all(set(e) == set(CONFIGS) for e in errors)


def test_model_output_shape_dtype_and_sensitivity():
    cfg = TPConfig(hidden=64, n_layers=2)
    ids = random_token_ids(cfg, batch=2, seq=5)
    with torch.no_grad():
        out = build_tp_model(cfg, dtype=torch.bfloat16)(ids)
        other_seed = build_tp_model(TPConfig(hidden=64, n_layers=2, seed=1))(ids)
        same_seed = build_tp_model(cfg)(ids)
    assert out.shape == (2, 5, 64) and out.dtype == torch.bfloat16
    assert torch.isfinite(out).all()
    assert (other_seed - same_seed).abs().max() > 0.1
    # Causal attention: the first token's output cannot depend on later tokens.
    changed = ids.clone()
    changed[:, 1:] = (changed[:, 1:] + 1) % cfg.vocab
    with torch.no_grad():
        torch.testing.assert_close(build_tp_model(cfg)(changed)[:, 0], same_seed[:, 0])


def test_norm_impls_agree():
    ids = random_token_ids(DENSE, batch=1, seq=6)
    with torch.no_grad():
        llama = build_tp_model(DENSE)(ids)
        torch_norm = build_tp_model(dataclasses.replace(DENSE, norm_impl="torch"))(ids)
    torch.testing.assert_close(llama, torch_norm, atol=1e-5, rtol=1e-5)


def test_static_kv_cache_prefill_then_decode_matches_full_sequence():
    # fp32, one process: prefill 5 tokens into the cache, then two decode steps of one token per
    # sequence; each must equal the full-sequence forward at that position (same sums, but SDPA
    # over the padded cache adds masked-out slots: 1e-5 as for TP vs unsharded). MoE covers the
    # routed MLP beside the cached attention.
    for cfg in (DENSE, MOE):
        ids = random_token_ids(cfg, batch=3, seq=7)
        with torch.no_grad():
            full = build_tp_model(cfg)(ids)
            cached = build_tp_model(cfg).attach_static_kv_cache(batch=3, max_len=9)
            prefill = cached(ids[:, :5], cache_position=torch.arange(5))
            steps = [cached(ids[:, t : t + 1], cache_position=torch.tensor([t])) for t in (5, 6)]
            # A smaller batch uses the cache's first rows (slot 7 is still free in every row).
            first = cached(ids[:1, 6:7], cache_position=torch.tensor([7]))
        torch.testing.assert_close(prefill, full[:, :5], atol=TP_ATOL, rtol=TP_ATOL)
        for t, step in zip((5, 6), steps):
            assert step.shape == (3, 1, cfg.hidden)
            torch.testing.assert_close(step[:, 0], full[:, t], atol=TP_ATOL, rtol=TP_ATOL)
        # The cache holds what the steps wrote: a step at slot 6 that ignored slot 5 would differ.
        layer = cached.layers[0].attention
        assert layer.k_cache[:, :, :7].abs().sum(-1).gt(0).all()
        assert layer.k_cache[0, :, 7].abs().sum() > 0 and layer.k_cache[1:, :, 7:].abs().sum() == 0
        assert layer.k_cache[:, :, 8].abs().sum() == 0
        assert torch.isfinite(first).all() and not torch.allclose(first[0, 0], steps[1][0, 0])


def test_static_kv_cache_needs_cache_position():
    model = build_tp_model(DENSE).attach_static_kv_cache(batch=1, max_len=4)
    with torch.no_grad(), pytest.raises(ValueError, match="cache_position"):
        model(random_token_ids(DENSE, batch=1, seq=2))


def test_build_rejects_world_size_that_splits_heads():
    with fake_process_group(4) as group, pytest.raises(ValueError, match="must divide n_heads"):
        build_tp_model(DENSE, 0, 4, group)


def test_harness_passes_on_eager_model_and_reports():
    ids = random_token_ids(DENSE, batch=1, seq=6)
    reference = build_tp_model(DENSE)
    for dtype in (torch.float32, torch.bfloat16):
        model = build_tp_model(DENSE, dtype=dtype)
        report = check_against_eager(model, ids, lambda m: m, reference)
        assert isinstance(report, ComparisonReport) and report.passed
        assert report.dtype == dtype and report.max_abs_diff == 0.0
        assert "err compiled" in str(report) and "ok" in str(report)


def test_harness_raises_on_wrong_compiled_model():
    ids = random_token_ids(DENSE, batch=1, seq=6)
    model = build_tp_model(DENSE, dtype=torch.bfloat16)

    def off_by_a_tenth(m):
        return lambda *args: m(*args) + 0.1

    with pytest.raises(AssertionError, match="less accurate than eager") as info:
        check_against_eager(model, ids, off_by_a_tenth, build_tp_model(DENSE))
    assert "FAIL" in str(info.value)
    reference = build_tp_model(DENSE)
    report = check_against_eager(model, ids, off_by_a_tenth, reference, raise_on_failure=False)
    assert not report.passed and report.max_abs_diff == pytest.approx(0.1, rel=0.05)


def test_a_nan_output_is_a_failure_not_a_zero_difference():
    """NaN compares False: ``max(0.0, nan)`` is 0.0, and the HF tests' ``rel_diff`` read an all-NaN
    compiled output as no difference. Both checks must fail it."""
    from weavepass.testing.hf_models import _rel_diff

    eager = torch.randn(1, 9, 16)
    compiled = eager.clone()
    compiled[0, 3, 5] = float("nan")
    assert _rel_diff(compiled, eager) == float("inf")
    assert _rel_diff((eager.clone(), compiled), (eager, eager)) == float("inf")  # a later output too
    assert _rel_diff(eager.clone(), eager) == 0.0
    ids = random_token_ids(DENSE, batch=1, seq=6)
    model = build_tp_model(DENSE)
    report = check_against_eager(model, ids, lambda m: lambda *a: m(*a) * float("nan"), model,
                                 raise_on_failure=False)
    assert not report.passed and "non-finite" in str(report)


def test_harness_with_torch_compile():
    ids = random_token_ids(TORCH_NORM, batch=1, seq=6)
    model = build_tp_model(TORCH_NORM, dtype=torch.bfloat16)
    report = check_against_eager(
        model, ids, lambda m: torch.compile(m, backend="aot_eager"), build_tp_model(TORCH_NORM)
    )
    assert report.passed, report


def _count_all_reduces(cfg: TPConfig, world_size: int, kv_cache: bool = False) -> int:
    """All_reduces in the one graph Dynamo traces (``fullgraph``: a graph break fails); with
    ``kv_cache``, of a decode step of 2 sequences with a static KV cache."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm

    batch, seq = (2, 1) if kv_cache else (1, 4)
    with fake_process_group(world_size) as group:
        model = build_tp_model(cfg, 0, world_size, group)
        kwargs = {}
        if kv_cache:
            model.attach_static_kv_cache(batch, max_len=8)
            kwargs["cache_position"] = torch.tensor([5])
        torch._dynamo.reset()
        with torch.no_grad():
            compiled = torch.compile(model, backend=record, fullgraph=True)
            out = compiled(random_token_ids(cfg, batch, seq), **kwargs)
    assert out.shape == (batch, seq, cfg.hidden) and len(graphs) == 1
    all_reduce = torch.ops._c10d_functional.all_reduce  # Dynamo records the overload packet
    return sum(node.target in (all_reduce, all_reduce.default) for node in graphs[0].graph.nodes)


@pytest.mark.parametrize("cfg", [DENSE, MOE], ids=["dense", "moe"])
def test_fake_process_group_traces_one_all_reduce_per_site(cfg):
    assert _count_all_reduces(cfg, world_size=6) == 2 * cfg.n_layers + 1
    assert not dist.is_initialized()


def test_decode_step_with_static_kv_cache_traces_as_one_graph():
    # The cache update (index_copy_ into a slice of a buffer) must not break the graph: the
    # decode benchmark compiles the whole step, and every site must be in the graph weave sees.
    assert _count_all_reduces(DENSE, world_size=2, kv_cache=True) == 2 * DENSE.n_layers + 1


def _fail_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("rank one is unhappy")
    return rank


def test_spawn_returns_results_and_propagates_child_tracebacks():
    with pytest.raises(RuntimeError, match="rank 1") as info:
        spawn(_fail_on_rank_one, 2)
    assert "ValueError: rank one is unhappy" in str(info.value)
    assert "_fail_on_rank_one" in str(info.value)  # the child's traceback, not just the message
