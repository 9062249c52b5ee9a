"""Reliability: ranks that disagree fail fast and clearly (docs/reliability.md).

- the cross-rank plan check (``WeaveConfig.check_plan_across_ranks``): a graph break on one rank
  only raises ``PlanMismatchError`` within seconds instead of hanging until the group timeout;
- the replicated-input check (``WeaveConfig.check_replicated``);
- one backend per config for ``weavepass.weave`` and ``weavepass.explain`` (Dynamo's recompile limit);
- the pass's cache key (``WeavePass.uuid``) covers the process groups and the device.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import weavepass
from weavepass import WeaveConfig
from weavepass.compile.reasons import Reason, ReasonCode
from weavepass.testing.distributed import fake_process_group, spawn

H = 16
FUSED = "weave.fused_allreduce_rmsnorm.default"
AR = "_c10d_functional.all_reduce.default"


def rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def two_layers(x, r, w1, w2, talk_on_rank=None):
    """Two all_reduce -> add -> RMSNorm sites; ``talk_on_rank`` prints (a graph break) between
    the first site's all_reduce and its norm on that rank only."""
    h = r + funcol.all_reduce(x, "sum", dist.group.WORLD)
    if talk_on_rank is not None and dist.get_rank() == talk_on_rank:
        print("rank", talk_on_rank, "says hello")
    y = rms(h, w1)
    h2 = h + funcol.all_reduce(y * 2, "sum", dist.group.WORLD)
    return rms(h2, w2), h2


def _inputs(rank, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, H, generator=g) + rank  # partial sums differ by rank
    r = torch.randn(6, H, generator=g)
    return x, r, torch.rand(H, generator=g) + 0.5, torch.rand(H, generator=g) + 0.5


def _plan_check_rank(rank, world, talk_on_rank, timeout_s):
    from weavepass.compile.plan_check import PlanMismatchError

    config = WeaveConfig(plan_check_timeout_s=timeout_s)
    compiled = torch.compile(lambda *a: two_layers(*a, talk_on_rank=talk_on_rank),
                             backend=weavepass.make_backend(config))
    args = _inputs(rank)
    start = time.monotonic()
    try:
        with torch.no_grad():
            out = compiled(*args)
    except Exception as error:  # Dynamo wraps backend errors; the message carries ours
        assert "PlanMismatchError" in f"{type(error).__name__}{error!r}" or isinstance(error, PlanMismatchError)
        return {"error": str(error), "seconds": time.monotonic() - start}
    eager = two_layers(*args)
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)  # fp32 throughout
    return {"error": None, "seconds": time.monotonic() - start}


def test_graph_break_on_one_rank_raises_clear_error_fast():
    """Rank 0 breaks the first site in two (its all_reduce in one graph, its norm in the next);
    rank 1 fuses it. Without the check both ranks block in different collectives for 30 min."""
    results = spawn(_plan_check_rank, 2, "gloo", 0, 20.0, timeout_s=120)
    for rank, result in enumerate(results):
        error = result["error"]
        assert error is not None, f"rank {rank} ran on"
        assert "weavepass: ranks" in error and "would run different collectives" in error, error
        assert "graph break" in error and "check_plan_across_ranks=False" in error, error
        assert "_c10d_functional.all_reduce" in error and "weave.fused_allreduce_rmsnorm" in error, error
        assert result["seconds"] < 20.0, result  # a mismatch is seen at once, not at the timeout


SCENARIOS = {  # per rank, the graphs it compiles, each a list of all_reduce row counts
    "same collectives, split differently": ([[4, 4, 4]], [[4], [4, 4]]),
    "a different shape": ([[4, 4]], [[4, 5]]),
    "a graph one rank never compiles": ([[4]], [[4], [5]]),
    "a recompile on one rank only": ([[4], [6]], [[4], [4], [6]]),  # the same collectives: healthy
    "a peer's first graph comes late": ([[4], [5]], [[4], [5]]),  # rank 1 starts SLOW_START_S late
}
SLOW_START_S = 4.0  # longer than the 3 s timeout: start-up skew before a group's first graph


def _stream_rank(rank, world):
    """Runs ``check_plan_across_ranks`` on graphs traced with fake tensors (nothing runs), one
    fresh group per scenario so that each starts its own collective stream."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from weavepass.compile.plan_check import PlanMismatchError, check_plan_across_ranks

    outcomes = {}
    for name, per_rank in SCENARIOS.items():
        group = dist.new_group([0, 1])
        outcomes[name] = []
        if name == "a peer's first graph comes late" and rank == 1:
            time.sleep(SLOW_START_S)  # e.g. still loading its weights
        for index, rows in enumerate(per_rank[rank]):
            def f(*xs):
                return [funcol.all_reduce(x, "sum", group) for x in xs]

            gm = make_fx(f, tracing_mode="fake")(*[torch.randn(n, H) for n in rows])
            try:
                check_plan_across_ranks(gm.graph, index, timeout_s=3.0)
                outcomes[name].append("ok")
            except PlanMismatchError as error:
                outcomes[name].append(str(error))
                break
    return outcomes


def test_plan_check_compares_stream_positions():
    """What may differ between ranks, without running the graphs: the same collectives split into
    more graphs on one rank pass (a harmless rank-dependent break); a different shape fails on
    both ranks; a graph a peer never compiles fails within the 3 s timeout, naming the silent rank;
    a recompile of the same collectives on one rank passes, and the next graph still lines up."""
    rank0, rank1 = spawn(_stream_rank, 2, "gloo", timeout_s=60)
    assert rank0["same collectives, split differently"] == ["ok"]
    assert rank1["same collectives, split differently"] == ["ok", "ok"]
    for outcome in (rank0["a different shape"], rank1["a different shape"]):
        assert "at collective #1" in outcome[-1] and "float32[5, 16]" in outcome[-1], outcome
    assert rank0["a graph one rank never compiles"] == ["ok"]
    extra = rank1["a graph one rank never compiles"]
    assert extra[0] == "ok" and "rank 0 published no plan for this point within 3 s" in extra[1], extra
    assert "from #1 on" in extra[1] and "float32[5, 16]" in extra[1], extra
    assert rank0["a recompile on one rank only"] == ["ok", "ok"]
    assert rank1["a recompile on one rank only"] == ["ok", "ok", "ok"]
    # A peer's first graph on a group is awaited for the group's own timeout (gloo's default 30 min
    # here), not the 3 s: a rank that starts late is healthy, as its first collective would find it.
    assert rank0["a peer's first graph comes late"] == rank1["a peer's first graph comes late"] == ["ok", "ok"]


def test_plan_check_passes_same_plans_and_a_harmless_rank_dependent_break_and_check_replicated():
    """The normal case (identical graphs), then a break after every collective on rank 0 only
    (the ranks' graphs differ, their collectives do not): both run, checked against eager. In the
    same processes (one spawn): ``check_replicated`` passes replicated inputs and raises on a
    residual or a norm weight that differs on rank 1."""
    with pytest.raises(ValueError, match="plan_check_timeout_s"):
        WeaveConfig(plan_check_timeout_s=0)
    for normal, rewritten, replicated in spawn(_harmless_break_rank, 2, "gloo", timeout_s=120):
        assert (normal, rewritten) == (None, 1)
        assert replicated["same"] is None
        for name in ("residual", "norm weight", "norm bias"):
            error = replicated[name]
            assert f"the {name} of site" in error and "ranks [1] differ from rank 0" in error, error
            assert "ReplicationError" in error and "replicated" in error, error


def _check_replicated_rank(rank):
    """Errors (or None) of a ``check_replicated`` compile with replicated inputs, then with a
    residual and a weight that differ on rank 1."""
    backend = weavepass.make_backend(WeaveConfig(check_replicated=True))
    compiled = torch.compile(two_layers, backend=backend)
    x, r, w1, w2 = _inputs(rank)
    errors = {}
    for name, args in [("same", (x, r, w1, w2)), ("residual", (x, r + rank, w1, w2)),
                       ("norm weight", (x, r, w1, w2 * (1 + rank)))]:
        try:
            with torch.no_grad():
                out = compiled(*args)
            torch.testing.assert_close(out, two_layers(*args), rtol=1e-5, atol=1e-5)
            errors[name] = None
        except Exception as error:  # noqa: BLE001  (the message is what is checked)
            errors[name] = f"{type(error).__name__}: {error}"
    assert "check_replicated: the residual and norm weight of 2 site(s)" in backend.report.graphs[0].note
    from weavepass.runtime.replication import check_replicated  # a LayerNorm site's bias, checked directly

    try:
        check_replicated(r, w1, "residual", "add_7", dist.group.WORLD.group_name, bias=w1 * (1 + rank))
        errors["norm bias"] = None
    except Exception as error:  # noqa: BLE001
        errors["norm bias"] = f"{type(error).__name__}: {error}"
    return errors


def _harmless_break_rank(rank, world):
    normal = _plan_check_rank(rank, world, None, 20.0)["error"]
    replicated = _check_replicated_rank(rank)
    torch._dynamo.reset()

    def f(x, r, w1, w2):
        out, _ = two_layers(x, r, w1, w2)
        if dist.get_rank() == 0:
            print("after every collective")
        return out * 2

    backend = weavepass.make_backend(WeaveConfig(plan_check_timeout_s=20.0))
    args = _inputs(rank)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(f, backend=backend)(*args), f(*args), rtol=1e-5, atol=1e-5)
    return normal, len([g for g in backend.report.graphs if g.rewritten]), replicated


class _Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.rand(H) + 0.5)

    def forward(self, x, r):
        return rms(r + funcol.all_reduce(x, "sum", dist.group.WORLD), self.w)


def test_weave_and_explain_reuse_one_backend_past_the_recompile_limit():
    """Ten layers wrapped with ``weavepass.weave`` (as functions and as modules) and ten
    ``explain`` calls: each runs the rewritten graph, none falls back to eager after Dynamo's
    recompile limit of 8 (a fresh backend per call did), and each report is non-empty."""
    config = WeaveConfig(lowering="portable")
    torch._dynamo.reset()
    x, r = torch.randn(4, H), torch.randn(4, H)
    with fake_process_group(2), torch.no_grad():
        layers = [_Layer() for _ in range(10)]
        wrapped = [weavepass.weave(layer.forward, config=config) for layer in layers]
        wrapped += [weavepass.weave(layer, config=config) for layer in layers]
        for fn in wrapped:
            fn(x, r)
            (graph,) = fn.weave_report.graphs
            assert graph.ops_after[FUSED] == 1 and graph.ops_after[AR] == 0
        reports = [weavepass.explain(layers[0], x, r, config=config) for _ in range(10)]
        assert all(report.rewritten == 1 for report in reports), [str(r) for r in reports]
        # rendering test: the report states the assumption it rests on
        assert "assumes: the residual stream and the norm weights are the same on every rank" in str(reports[-1])
        # one compile for all of them: the shared backend saw one graph per distinct code
        assert len(weavepass.shared_backend(config).report.graphs) <= 2


def test_cache_key_covers_the_process_groups():
    """``WeavePass.uuid`` (part of Inductor's FX-graph cache key) changes with the world size and
    the set of groups, and not with the rank: a FlashComm graph bakes in the world size, so one
    cached at world 2 must not be loaded at world 4."""
    from weavepass.compile.graph_pass import WeavePass

    config = WeaveConfig(enable_flashcomm=True, fx_graph_cache=True)
    keys = {}
    for world, rank in [(2, 0), (2, 1), (4, 0)]:
        with fake_process_group(world, rank):
            keys[world, rank] = WeavePass(config).uuid()
            if (world, rank) == (4, 0):
                dist.new_group([0, 1])
                keys["world 4 with a subgroup"] = WeavePass(config).uuid()
    assert keys[2, 0] == keys[2, 1]
    assert len({keys[2, 0], keys[4, 0], keys["world 4 with a subgroup"]}) == 3


def test_cache_key_covers_the_sm_count(monkeypatch):
    """The split cuts where this GPU's GEMM waves fall, so a graph cached on a GPU with another SM
    count (same capability: H100 PCIe 114 SMs, SXM 132) must not be loaded."""
    import types

    from weavepass.compile.graph_pass import environment_key

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    keys = []
    for sms in (132, 114, 132):
        props = types.SimpleNamespace(multi_processor_count=sms)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a, props=props: props)
        keys.append(environment_key())
    assert keys[0] != keys[1] and keys[0] == keys[2]


def test_symbolic_token_split_compiles_once_per_size_class():
    """``split="force"`` with a ``mark_dynamic`` sequence: every size from 4 tokens on runs one
    split graph, 2 and 3 tokens one fuse-only graph (a one-token half guarded ``half != 1`` and
    compiled 3 graphs for 9, 2, 3 and 17 tokens)."""
    from weavepass.testing import TPConfig, build_tp_model, random_token_ids

    cfg = TPConfig(vocab=100, hidden=64, n_layers=1, n_heads=12, n_kv_heads=6, head_dim=8, intermediate=80)
    backend = weavepass.make_backend(WeaveConfig(split="force"))
    torch._dynamo.reset()
    with fake_process_group(2), torch.no_grad():
        compiled = torch.compile(build_tp_model(cfg, 0, 2, dist.group.WORLD), backend=backend)
        for seq in [9, 2, 3, 17, 4]:
            ids = random_token_ids(cfg, 1, seq, seed=seq)
            torch._dynamo.mark_dynamic(ids, 1)
            compiled(ids)
    notes = [g.note for g in backend.report.graphs]
    assert len(notes) == 2, notes
    assert notes[0].startswith("split (sequence): computed at run time"), notes
    assert [g.reasons for g in backend.report.graphs] == [
        [], [Reason.of(ReasonCode.SPLIT_FEW_SYMBOLIC_UNITS, units=2, mode="sequence", min_units=4)]], notes



def test_many_backends_for_one_config_warn(caplog):
    """The 9th ``make_backend`` with one config says that Dynamo would run eagerly past its
    recompile limit, and what to use instead."""
    config = WeaveConfig(cuda_min_tokens=4321)  # a config no other test makes
    with caplog.at_level("WARNING", logger="weavepass"):
        for _ in range(8):
            weavepass.make_backend(config)
        assert not caplog.records
        weavepass.make_backend(config)
    (record,) = caplog.records
    assert "9 backends made with one WeaveConfig" in record.getMessage()
    assert "weavepass.shared_backend(config)" in record.getMessage()


def _flashcomm_cached_rank(rank, world):
    """FlashComm with Inductor's FX-graph cache on. The model's per-rank shapes and strides do not
    depend on the world size, so only the pass's key tells a world-2 graph from a world-3 one."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_flashcomm import ON, TwoSites

    model = TwoSites((256, 256), (False, False), torch.float32, rank, world)
    for param in model.parameters():  # shards are column slices: strides would name the world size
        param.data = param.data.contiguous()
    h = torch.randn(20, 64, generator=torch.Generator().manual_seed(0))
    backend = weavepass.make_backend(WeaveConfig(**ON, fx_graph_cache=True))
    with torch.no_grad():
        out = torch.compile(model, backend=backend, dynamic=False)(h)
        torch.testing.assert_close(out, model(h), rtol=1e-4, atol=1e-4)  # fp32, reductions reordered
    return [r.lowering for r in backend.report.records]


def test_fx_graph_cache_is_not_shared_across_world_sizes(tmp_path, monkeypatch):
    """One cache directory, world 2 then world 3: the world-3 run compiles (the pass runs and
    reports) instead of loading the world-2 FlashComm graph, whose shapes assume 2 ranks."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    for world in (2, 3):
        for lowerings in spawn(_flashcomm_cached_rank, world, "gloo", timeout_s=180):
            assert lowerings and all(low.startswith("flashcomm") for low in lowerings), (world, lowerings)
