"""``weavepass.inductor_pass``: the pass alone, patched into plain ``torch.compile`` (Inductor), gives
what ``backend="weave"`` gives, chains with a pass already set, and says what it cannot do without
its Inductor settings. Graph dumps (``WeaveConfig.dump_graphs_dir``, ``WEAVE_DUMP_GRAPHS``).

The in-process tests use a gloo group of one rank with ``min_world_size=1``, so the sites are
rewritten (portable lowering: reduce_scatter / all_gather over one rank); the comparison with the
backend runs the reference model on 2 gloo ranks."""

from __future__ import annotations

import logging
import re

import pytest
import torch
import torch.distributed as dist
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.utils import run_and_get_code

import weavepass
from weavepass import WeaveConfig
from weavepass.backend import WeaveBackend
from weavepass.compile import dump, graph_pass
from weavepass.compile.reasons import ReasonCode
from weavepass.compile.strategies import STRATEGIES
from weavepass.compile.strategies.split import inductor_config_patches
from weavepass.testing import TPConfig, build_tp_model, random_token_ids, spawn

ONE_RANK = WeaveConfig(min_world_size=1, check_plan_across_ranks=False)
MODEL = TPConfig(vocab=100, hidden=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, intermediate=96)
SITES = 2 * MODEL.n_layers + 1  # two per layer and the embedding's
FUSED_OP = "weave.fused_allreduce_rmsnorm.default"


@pytest.fixture
def group(tmp_path):
    torch._dynamo.reset()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()


def _model(group):
    return build_tp_model(MODEL, 0, 1, group), random_token_ids(MODEL, 1, 6)


def _without_aot_id(code: str) -> str:
    """Generated code without its first line, ``# AOT ID: ['<n>_inference']``: ``n`` counts the
    process's compiles."""
    return re.sub(r"^# AOT ID: .*\n", "", code)


def _weave_calls(code: str) -> list[str]:
    return re.findall(r"extern_kernels\.(weave_\w+)\(", code)


class CountingPass(CustomGraphPass):
    """A user's pass: records the all_reduces it saw (before weave replaced them)."""

    def __init__(self, uuid="user-pass-v1"):
        self.all_reduces_seen: list[int] = []
        self._uuid = uuid

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.all_reduces_seen.append(sum("all_reduce" in str(n.target) for n in graph.nodes))

    def uuid(self):
        return self._uuid


# ------------------------------------------------------------------ the same as backend="weave"


def _same_as_backend_rank(rank: int, world: int) -> dict:
    model = build_tp_model(MODEL, rank, world, dist.group.WORLD)
    ids = random_token_ids(MODEL, 2, 7, seed=world)
    config = WeaveConfig()
    with torch.no_grad():
        eager = model(ids)
        backend = WeaveBackend(config)
        torch._dynamo.reset()
        by_backend, backend_code = run_and_get_code(torch.compile(model, backend=backend), ids)
        pass_ = weavepass.inductor_pass(config)
        torch._dynamo.reset()
        with inductor_config.patch(pass_.config_patches()):
            by_pass, pass_code = run_and_get_code(torch.compile(model), ids)
        in_options = weavepass.inductor_pass(config)
        torch._dynamo.reset()
        by_options, options_code = run_and_get_code(torch.compile(model, options=in_options.config_patches()), ids)
    return dict(
        backend_calls=_weave_calls(backend_code[0]), pass_calls=_weave_calls(pass_code[0]),
        options_calls=_weave_calls(options_code[0]),
        same_code=_without_aot_id(backend_code[0]) == _without_aot_id(pass_code[0]) == _without_aot_id(options_code[0]),
        backend_report=str(backend.report), pass_report=str(pass_.report), rewritten=pass_.report.rewritten,
        options_report=str(in_options.report),
        pass_equal=torch.equal(by_backend, by_pass), options_equal=torch.equal(by_backend, by_options),
        max_abs=(by_pass.float() - eager.float()).abs().max().item(),
    )


def test_plain_torch_compile_with_the_pass_equals_the_backend():
    """Same generated code (the direct calls included; all but the compile's serial number), report
    and numbers as ``backend="weave"``,
    through ``torch._inductor.config.patch`` and through ``options=``. The numbers are bitwise equal
    (the same code runs); against eager, fp32 with reductions reordered: 1e-4."""
    for result in spawn(_same_as_backend_rank, 2, "gloo"):
        assert result["backend_calls"] == ["weave_fused_allreduce_rmsnorm"] * SITES, result
        assert result["pass_calls"] == result["backend_calls"]
        assert result["options_calls"] == result["backend_calls"]
        assert result["same_code"]
        assert result["rewritten"] == SITES
        assert result["pass_report"] == result["backend_report"] == result["options_report"]
        assert result["pass_equal"] and result["options_equal"]
        assert result["max_abs"] < 1e-4


# ------------------------------------------------------------------ chaining


def test_a_pass_already_set_is_chained_and_runs_first(group):
    model, ids = _model(group)
    user = CountingPass()
    with inductor_config.patch(post_grad_custom_pre_pass=user):
        pass_ = weavepass.inductor_pass(ONE_RANK)
    assert pass_.chain == (user,)
    with torch.no_grad(), inductor_config.patch(pass_.config_patches()):
        got = torch.compile(model)(ids)
        want = model(ids)
    assert user.all_reduces_seen == [SITES]  # it ran, before weave replaced the all_reduces
    assert pass_.report.rewritten == SITES
    assert pass_.report.graphs[0].ops_after[FUSED_OP] == SITES
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # fp32, one rank: rounding only


def test_chained_uuid_keeps_inductors_cache_semantics():
    own = weavepass.inductor_pass(ONE_RANK, chain=None).uuid()
    assert isinstance(own, str) and own
    chained = weavepass.inductor_pass(ONE_RANK, chain=CountingPass("v1"))
    assert chained.uuid() == (own, "v1")
    assert weavepass.inductor_pass(ONE_RANK, chain=CountingPass("v2")).uuid() != chained.uuid()
    # A plain function has no uuid, nor a pass whose uuid() is None: Inductor then bypasses its
    # cache, as it would for that pass alone.
    assert weavepass.inductor_pass(ONE_RANK, chain=lambda graph: None).uuid() is None
    assert weavepass.inductor_pass(ONE_RANK, chain=CountingPass(None)).uuid() is None
    # A list (torch 2.13 takes one there) chains every pass, in order.
    a, b = CountingPass("a"), CountingPass("b")
    assert weavepass.inductor_pass(ONE_RANK, chain=[a, b]).chain == (a, b)


def test_a_weave_pass_already_set_is_replaced_not_run_twice():
    user = CountingPass()
    first = weavepass.inductor_pass(ONE_RANK, chain=user)
    second = weavepass.inductor_pass(ONE_RANK.replace(lowering="portable"), chain=first)
    assert second.chain == (user,)
    with pytest.raises(TypeError, match="not a graph pass"):
        weavepass.inductor_pass(ONE_RANK, chain=42)


def test_backend_chains_a_users_pass(group):
    """``backend="weave"`` chains the pass in ``options=`` or, without one, the global one (before,
    it replaced them)."""
    model, ids = _model(group)
    in_options, in_config = CountingPass(), CountingPass()
    with torch.no_grad():
        backend = WeaveBackend(ONE_RANK)
        torch.compile(model, backend=backend, options={"post_grad_custom_pre_pass": in_options})(ids)
        assert in_options.all_reduces_seen == [SITES] and backend.report.rewritten == SITES
        torch._dynamo.reset()
        backend = WeaveBackend(ONE_RANK)
        with inductor_config.patch(post_grad_custom_pre_pass=in_config):
            torch.compile(model, backend=backend)(ids)
        assert in_config.all_reduces_seen == [SITES] and backend.report.rewritten == SITES


# ------------------------------------------------------------------ what the pass alone lacks


def test_a_strategy_whose_inductor_settings_are_missing_is_declined_with_a_warning(group, caplog, monkeypatch):
    """The pass patched in alone (not ``config_patches()``) with the split asked for: the graph
    is fused but not split, with a warning naming the settings; with the settings it is split."""
    monkeypatch.setattr(graph_pass, "_WARNED", set())  # warned once per process
    model, ids = _model(group)
    config = ONE_RANK.replace(split="force")
    split = next(s for s in STRATEGIES if s.name == "split")
    alone = weavepass.inductor_pass(config, chain=None)
    with inductor_config.patch(post_grad_custom_pre_pass=alone, reorder_for_peak_memory=True,
                               fx_graph_cache=False):
        decision = alone._unmet_settings_decision(split)
        assert decision is not None and decision.code is ReasonCode.INDUCTOR_SETTINGS
        assert decision.reason.field("strategy") == "split"
        assert ("reorder_for_peak_memory", False, True) in decision.reason.field("settings")
        with torch.no_grad(), caplog.at_level(logging.WARNING, logger="weavepass"):
            torch.compile(model)(ids)
    ops = alone.report.graphs[0].ops_after
    assert ops[FUSED_OP] == SITES and ops["weave.fused_allreduce_rmsnorm_async.default"] == 0
    assert alone.report.graphs[0].codes == [ReasonCode.INDUCTOR_SETTINGS]
    # rendering test: the warning names the setting, its needed and its current value, and the fix
    assert any("reorder_for_peak_memory=False (this compile: True)" in r.getMessage()
               and "config_patches()" in r.getMessage() for r in caplog.records)

    torch._dynamo.reset()
    patched = weavepass.inductor_pass(config, chain=None)
    with torch.no_grad(), inductor_config.patch(patched.config_patches()):
        assert patched._unmet_settings_decision(split) is None
        torch.compile(model)(ids)
    assert patched.report.graphs[0].ops_after["weave.fused_allreduce_rmsnorm_async.default"] == 2 * SITES  # 2 halves


class SettingsProbe(CustomGraphPass):
    """A user's pass, chained before weave's: records, for every compile that reaches the post-grad
    passes, the split's Inductor settings as that compile has them."""

    def __init__(self):
        self.seen: list[dict[str, object]] = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.seen.append({key: graph_pass.current_setting(key) for key in inductor_config_patches()})

    def uuid(self):
        return "settings-probe-v1"


def test_auto_compiles_a_graph_it_does_not_split_with_inductors_own_settings(group):
    """``split="auto"`` used to patch the split's settings (no peak-memory reordering, no shape
    padding) into every compile before the graph was seen, also into graphs it then did not split.
    Now a graph auto leaves unsplit compiles with Inductor's declared defaults, and a graph it
    splits is compiled again with the split's settings (one graph in the report, the same number)."""
    needed = inductor_config_patches()
    defaults = {key: inductor_config._config[key].default for key in needed}
    assert {key: graph_pass.current_setting(key) for key in needed} == defaults  # nothing patched globally
    assert any(needed[key] != defaults[key] for key in needed)  # the split's settings are not Inductor's
    model, ids = _model(group)  # 6 tokens, outside auto's default window (16384)

    probe, backend = SettingsProbe(), WeaveBackend(ONE_RANK.replace(split="auto"))
    with torch.no_grad():
        torch.compile(model, backend=backend, options={"post_grad_custom_pre_pass": probe})(ids)
    assert probe.seen == [defaults]
    (graph,) = backend.report.graphs
    assert graph.ops_after[FUSED_OP] == SITES and graph.ops_after["weave.fused_allreduce_rmsnorm_async.default"] == 0
    assert "Inductor settings" not in graph.note

    torch._dynamo.reset()  # the same model where auto splits: a window that holds its 6 tokens
    probe = SettingsProbe()
    backend = WeaveBackend(ONE_RANK.replace(split="auto", split_min_tokens=2, split_min_tokens_moe=2,
                                                  split_max_tokens=64))
    with torch.no_grad():
        torch.compile(model, backend=backend, options={"post_grad_custom_pre_pass": probe})(ids)
    assert probe.seen == [defaults, {**defaults, **needed}]  # the first compile stopped at the split's decision
    (graph,) = backend.report.graphs
    assert graph.graph_index == 0
    assert graph.ops_after["weave.fused_allreduce_rmsnorm_async.default"] == 2 * SITES  # 2 halves
    assert "compiled with the split strategy's Inductor settings (reorder_for_peak_memory=False" in graph.note

    torch._dynamo.reset()  # "force" splits wherever it can: its settings are patched in at once
    probe = SettingsProbe()
    with torch.no_grad():
        torch.compile(model, backend=WeaveBackend(ONE_RANK.replace(split="force")),
                      options={"post_grad_custom_pre_pass": probe})(ids)
    assert probe.seen == [{**defaults, **needed}]


def test_fx_graph_cache_left_on_is_a_warning(group, caplog, tmp_path, monkeypatch):
    """What the pass alone loses with Inductor's cache on: a cache hit skips it (the report misses
    the graph; the cached code is the rewritten one). The warning comes with the cache lookup."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(graph_pass, "_WARNED", set())  # warned once per process
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    model, ids = _model(group)
    pass_ = weavepass.inductor_pass(ONE_RANK, chain=None)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="weavepass"), \
            inductor_config.patch(post_grad_custom_pre_pass=pass_, fx_graph_cache=True):
        torch.compile(model)(ids)
        hits = counters["inductor"]["fxgraph_cache_hit"]
        torch._dynamo.reset()
        got = torch.compile(model)(ids)
        assert counters["inductor"]["fxgraph_cache_hit"] == hits + 1
        torch.testing.assert_close(got, model(ids), rtol=1e-4, atol=1e-4)  # fp32, one rank: rounding only
    assert len(pass_.report.graphs) == 1 and pass_.report.rewritten == SITES  # the hit is not in it
    assert any("FX-graph cache is on" in r.getMessage() for r in caplog.records)


def test_making_the_pass_installs_the_direct_calls(monkeypatch):
    """Before any compile: a graph loaded from Inductor's cache calls them without running the pass
    (``test_plain_torch_compile_with_the_pass_equals_the_backend`` checks the generated calls)."""
    from weavepass.compile import direct_calls

    calls = []
    monkeypatch.setattr(direct_calls, "install", lambda: calls.append(1) or True)
    weavepass.inductor_pass(ONE_RANK, chain=None)
    assert calls == [1]


# ------------------------------------------------------------------ graph dumps


def test_dumps_before_and_after_each_strategy(group, tmp_path):
    model, ids = _model(group)
    out = tmp_path / "dumps"
    pass_ = weavepass.inductor_pass(ONE_RANK.replace(dump_graphs_dir=str(out)), chain=None)
    with torch.no_grad(), inductor_config.patch(pass_.config_patches()):
        torch.compile(model)(ids)
    folders = sorted((out / "rank0").iterdir())
    assert len(folders) == 1 and re.fullmatch(r"graph\d{3}", folders[0].name)
    files = sorted(p.name for p in folders[0].iterdir())
    assert files == ["00_before.txt", "01_after_fuse.txt", "report.txt"]
    before, after = (folders[0] / files[0]).read_text(), (folders[0] / files[1]).read_text()
    all_reduce = "= torch.ops._c10d_functional.all_reduce.default("
    fused = "= torch.ops.weave.fused_allreduce_rmsnorm.default("
    assert before.count(all_reduce) == SITES and fused not in before
    assert after.count(fused) == SITES and all_reduce not in after
    assert (folders[0] / "report.txt").read_text() == str(pass_.report) + "\n"
    assert all(p.is_relative_to(out) for p in tmp_path.rglob("*") if p.is_file() and p.suffix == ".txt")


def test_dumps_from_the_environment_variable_and_off_by_default(group, tmp_path, monkeypatch):
    monkeypatch.delenv(dump.ENV_VAR, raising=False)
    assert dump.directory(WeaveConfig()) is None
    model, ids = _model(group)
    plain = weavepass.inductor_pass(ONE_RANK, chain=None)
    without = plain.uuid()
    monkeypatch.setenv(dump.ENV_VAR, str(tmp_path / "env"))  # read when Inductor compiles
    assert plain.uuid() != without  # a graph to dump is never a cache hit
    with torch.no_grad(), inductor_config.patch(plain.config_patches()):
        torch.compile(model)(ids)
    assert len(list((tmp_path / "env" / "rank0").glob("graph*/01_after_fuse.txt"))) == 1


def test_dump_names_are_sanitised():
    assert dump.safe_name("the split") == "the_split"
    assert dump.safe_name("../../etc/passwd") == "etc_passwd"
    assert dump.safe_name("..") == "unnamed" and dump.safe_name("") == "unnamed"
    assert dump.safe_name("FlashComm/NPU\\x") == "flashcomm_npu_x"


def test_dumps_never_leave_the_directory(tmp_path, caplog):
    """A ``rank0`` (or a file) inside the directory that is a symlink to elsewhere is not followed:
    nothing is written there, and a warning says why."""
    root, outside = tmp_path / "dumps", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "rank0").symlink_to(outside, target_is_directory=True)
    graph = torch.fx.Graph()
    graph.output(graph.placeholder("x"))
    report = weavepass.GraphReport(0)
    with caplog.at_level(logging.WARNING, logger="weavepass"):
        dumps = dump.GraphDumps.start(WeaveConfig(dump_graphs_dir=str(root)), graph, report)
        assert dumps is not None
        dumps.after("../../escape", graph)
        dumps.finish(graph, report)
    assert list(outside.iterdir()) == []
    assert sum("resolves outside the dump directory" in r.getMessage() for r in caplog.records) == 3

    (root / "rank0").unlink()  # a file that is a symlink out of the directory
    safe = tmp_path / "safe"
    target = outside / "victim.txt"
    target.write_text("keep")
    dumps = dump.GraphDumps(safe.resolve(), safe.resolve() / "rank0" / "graph000")
    (safe / "rank0" / "graph000").mkdir(parents=True)
    (safe / "rank0" / "graph000" / "00_before.txt").symlink_to(target)
    assert dumps.write("00_before.txt", "overwritten") is False
    assert target.read_text() == "keep"


def test_the_window_precheck_rules_out_only_counts_auto_never_splits():
    """``may_be_in_window``: what decides whether a compile needs the split's settings before its
    matmuls are read. Static counts outside both windows (dense and MoE) are ruled out; a symbolic
    count only where both windows are one size (auto never splits it); ``force`` always may."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from weavepass.compile.strategies.split import may_be_in_window
    from weavepass.compile.tokens import TokenCount

    auto = WeaveConfig(split="auto", split_min_tokens=1024, split_min_tokens_moe=4096, split_max_tokens=8192)
    assert [may_be_in_window(TokenCount(t), auto) for t in (1023, 1024, 4095, 8192, 8193)] == [
        False, True, True, True, False]
    moe_lower = auto.replace(split_min_tokens=4096, split_min_tokens_moe=2048)
    assert may_be_in_window(TokenCount(2048), moe_lower)  # the MoE window is known only after the analysis
    symbol = ShapeEnv().create_unbacked_symint()
    assert may_be_in_window(TokenCount(symbol), auto)
    assert not may_be_in_window(TokenCount(symbol), WeaveConfig(split="auto"))  # 16384 only: never split
    assert may_be_in_window(TokenCount(1), WeaveConfig(split="force"))
