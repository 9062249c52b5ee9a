"""``split="auto"`` from a measured table (``weavepass.tune``): the table's schema and its errors,
the decision rule, the decisions on graphs traced with ``make_fx`` on a fake group (ops present or
absent, reason codes), and the tuning command on CPU (a dry run, and a tiny run whose table then
drives a compile)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.fx.experimental.proxy_tensor import make_fx

from weavepass import WeaveConfig
from weavepass.compile.graph_pass import op_counts
from weavepass.compile.patterns import find_allreduce_rmsnorm_sites
from weavepass.compile.planner import plan_sites
from weavepass.compile.reasons import Reason, ReasonCode
from weavepass.compile.strategies import GraphRewrite
from weavepass.compile.strategies.fuse import FuseStrategy
from weavepass.compile.strategies.split.strategy import SplitStrategy
from weavepass.compile.tuned import inner_width
from weavepass.report import AllReduceRecord, GraphReport
from weavepass.testing import fake_process_group, spawn
from weavepass.tune import command
from weavepass.tune.table import (
    Cell,
    Entry,
    LayerWidths,
    TuningTableError,
    choose,
    load_table,
    parse_table,
    regions,
)

H = 64
ALL_REDUCE = "_c10d_functional.all_reduce.default"
FUSED = "weave.fused_allreduce_rmsnorm.default"
ASYNC = "weave.fused_allreduce_rmsnorm_async.default"
# The widths of ``two_sites``: its row-parallel matmuls have inner widths 32 and 64.
TWO_SITES = {"hidden": H, "heads": 4, "kv_heads": 2, "head_dim": 8, "mlp": 64}


def _rms(h, g):
    return g * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))


def two_sites(x, r, w1, g1, w2, g2):
    """Two row-parallel layers on one residual stream (``x @ w1``: K 32; ``.. @ w2``: K 64)."""
    h1 = funcol.all_reduce(x @ w1, "sum", dist.group.WORLD) + r
    h2 = funcol.all_reduce(torch.relu(_rms(h1, g1)) @ w2, "sum", dist.group.WORLD) + h1
    return _rms(h2, g2), h2


def _args(tokens: int, dtype=torch.float32):
    return tuple(t.to(dtype) for t in (torch.randn(tokens, 32), torch.randn(tokens, H), torch.randn(32, H),
                                       torch.randn(H), torch.randn(H, H), torch.randn(H)))


def _table(cells: dict[int, dict[str, float]], *, world=2, device_type="cpu", dtype="float32", mode="default",
           widths=TWO_SITES, torch_version=torch.__version__, min_gain=0.02) -> dict:
    """A hand-written table: ``cells`` maps tokens to each rewrite's time relative to Inductor."""
    return {
        "schema": "weavepass-tuning-table", "version": 1, "source": "hand-written for tests/test_tuning.py",
        "created_utc": "2026-12-03T00:00:00Z", "machine": {"device_type": device_type},
        "versions": {"torch": torch_version}, "world": world, "dtype": dtype, "layers": 1, "sequences": 1,
        "time_unit": "relative", "timing": "none: hand-written", "min_gain": min_gain,
        "entries": [{"shape": "two_sites", **widths, "mode": mode,
                     "cells": [{"tokens": t, "times": {"inductor": 1.0, **times}}
                               for t, times in sorted(cells.items())]}],
    }


def _write(tmp_path: Path, data, name="table.json") -> str:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def _compile(config: WeaveConfig, tokens: int = 640, mode: str = "fake", dtype=torch.float32) -> GraphRewrite:
    """``two_sites`` traced at ``tokens`` and rewritten as ``WeavePass`` would: plan, fuse, split.
    ``rewrite.decisions``: the two strategies' decisions."""
    graph = make_fx(two_sites, tracing_mode=mode)(*_args(tokens, dtype)).graph
    sites, _ = find_allreduce_rmsnorm_sites(graph)
    plans = plan_sites(sites, config)
    report = GraphReport(0, ops_before=op_counts(graph))
    report.records = [AllReduceRecord(p.site.all_reduce.name, True,
                                      [p.reason] if p.code is not ReasonCode.NONE else [], p.site.kind)
                      for p in plans]
    rewrite = GraphRewrite(graph, plans, config, report)
    rewrite.decisions = []
    for strategy in (FuseStrategy(), SplitStrategy()):
        decision = strategy.decide(rewrite)
        rewrite.decisions.append(decision)
        if decision.use:
            strategy.apply(rewrite, decision)
        elif decision.code is not ReasonCode.NOT_ASKED:
            strategy.decline(rewrite, decision)
    return rewrite


@pytest.fixture
def world2():
    with fake_process_group(2) as group:
        yield group


# --- the table: schema, round trip, errors --------------------------------------------------------


def test_builtin_table_round_trips():
    """The built-in table loads (its stored choices agree with the rule: checked on load) and
    survives a write and a read. Only what every regeneration keeps is asserted: one GPU, a group
    of one rank, the two shapes of the device command in default mode (docs/usage.md)."""
    table = load_table("builtin")
    assert (table.world, table.machine["device_type"], table.dtype) == (1, "cuda", "bfloat16")
    assert table.source
    assert {("70b_tp8sim", "default"), ("8b_tp2", "default")} <= {(e.shape, e.mode) for e in table.entries}
    assert table.entry("default", 8192, frozenset({1024, 3584})) is not None  # 70b_tp8sim's widths
    again = parse_table(json.loads(json.dumps(table.to_json())), table.label, table.digest)
    assert again == table


def test_saved_table_loads_back(tmp_path):
    table = parse_table(_table({512: {"fuse": 0.9, "split": 1.1}, 1024: {"fuse": 0.95}}))
    path = table.save(tmp_path / "t.json")
    loaded = load_table(str(path))
    assert loaded.entries == table.entries and loaded.min_gain == table.min_gain
    assert [c["choice"] for c in json.loads(path.read_text())["entries"][0]["cells"]] == ["fuse", "fuse"]


def _broken(change):
    data = _table({512: {"fuse": 0.9, "split": 1.1}, 1024: {"fuse": 0.95}})
    change(data)
    return data


def _cells(data):
    return data["entries"][0]["cells"]


MALFORMED = {
    "schema": (lambda d: d.update(schema="something-else"), "schema must be 'weavepass-tuning-table'"),
    "version": (lambda d: d.update(version=2), "version 2 is not supported"),
    "missing world": (lambda d: d.pop("world"), "missing field 'world'"),
    "world 0": (lambda d: d.update(world=0), "'world' must be >= 1"),
    "dtype": (lambda d: d.update(dtype="bf16"), "'dtype' must be one of"),
    "device type": (lambda d: d["machine"].update(device_type="npu"), "'device_type' must be one of"),
    "min_gain": (lambda d: d.update(min_gain=0.7), "min_gain must be in [0, 0.5)"),
    "mode": (lambda d: d["entries"][0].update(mode="max-autotune"), "'mode' must be one of"),
    "width": (lambda d: d["entries"][0].update(mlp=-1), "'mlp' must be >= 1"),
    "no cells": (lambda d: d["entries"][0].update(cells=[]), "no cells"),
    "no baseline": (lambda d: _cells(d)[0]["times"].pop("inductor"), "times has no 'inductor'"),
    "bad time": (lambda d: _cells(d)[0]["times"].update(fuse=0.0), "time of 'fuse' must be a positive finite"),
    "nan time": (lambda d: _cells(d)[0]["times"].update(fuse=float("nan")), "positive finite"),
    "unknown rewrite": (lambda d: _cells(d)[0]["times"].update(flashcomm=0.5), "unknown rewrite(s) ['flashcomm']"),
    "unsorted": (lambda d: _cells(d).reverse(), "strictly increasing"),
    "duplicate": (lambda d: d["entries"].append(copy.deepcopy(d["entries"][0])), "measure the same layer widths"),
    "wrong choice": (lambda d: _cells(d)[0].update(choice="split"), "choice 'split' disagrees with its times"),
}


@pytest.mark.parametrize("name", MALFORMED)
def test_malformed_table_is_refused_with_its_problem(name, tmp_path):
    change, message = MALFORMED[name]
    with pytest.raises(TuningTableError) as error:
        WeaveConfig(split="auto", tuning_table=_write(tmp_path, _broken(change)))
    assert message in str(error.value), str(error.value)


def test_unreadable_table_is_refused(tmp_path):
    with pytest.raises(TuningTableError, match="cannot read it"):
        WeaveConfig(tuning_table=str(tmp_path / "missing.json"))
    with pytest.raises(TuningTableError, match="not JSON"):
        WeaveConfig(tuning_table=_write(tmp_path, "{not json"))
    with pytest.raises(ValueError, match="tuning_table must be"):
        WeaveConfig(tuning_table="")
    assert WeaveConfig(tuning_table="none").tuning_table == "none"


# --- the rule --------------------------------------------------------------------------------------

WIDTHS = LayerWidths(**TWO_SITES)


def _entry(cells: dict[int, dict[str, float]]) -> Entry:
    return Entry("e", WIDTHS, "default", tuple(Cell(t, {"inductor": 1.0, **v}) for t, v in sorted(cells.items())))


RULE = _entry({1024: {"fuse": 0.97, "split": 0.99}, 2048: {"fuse": 0.95, "split": 0.90},
               4096: {"fuse": 0.97, "split": 0.85}, 8192: {"fuse": 1.01, "split": 0.92}})


@pytest.mark.parametrize("tokens, rewrite, basis", [
    (1024, "fuse", "cell"),       # split 0.99: not 2 % faster
    (2048, "split", "cell"),
    (3000, "split", "between"),   # split allowed at 2048 and 4096: worse ratio 0.90 beats fuse's 0.97
    (1500, "fuse", "between"),    # split not allowed at 1024: never chosen between 1024 and 2048
    (6000, "split", "between"),   # fuse measured slower at 8192, split 0.85/0.92
    (8192, "split", "cell"),
    (512, "fuse", "below"),       # fuse extended below the range (0.97 at 1024)
    (16384, "inductor", "above"),  # fuse slower at 8192; the split is never extrapolated
])
def test_rule(tokens, rewrite, basis):
    choice = choose(RULE, tokens, 0.02)
    assert (choice.rewrite, choice.basis) == (rewrite, basis)


def test_rule_never_picks_a_rewrite_slower_at_a_neighbouring_cell():
    """For every token count from 1 to 20000: the chosen rewrite was measured faster than Inductor
    by min_gain at each neighbouring cell (and a split only inside the measured range)."""
    for tokens in range(1, 20000, 7):
        choice = choose(RULE, tokens, 0.02)
        if choice.rewrite != "inductor":
            assert all(cell.ratio(choice.rewrite) <= 0.98 for cell in choice.neighbours), tokens
        if choice.rewrite == "split":
            assert 1024 <= tokens <= 8192


def test_ties_and_min_gain():
    tie = _entry({100: {"fuse": 0.9, "split": 0.9}})
    assert choose(tie, 100, 0.02).rewrite == "fuse"  # a tie goes to the rewrite that changes less
    close = _entry({100: {"fuse": 0.99}})
    assert choose(close, 100, 0.02).rewrite == "inductor"
    assert choose(close, 100, 0.0).rewrite == "fuse"
    # Between two cells the margin holds at both: 0.97 and 0.99 is not enough, nor a missing cell.
    assert choose(_entry({100: {"fuse": 0.97}, 200: {"fuse": 0.99}}), 150, 0.02).rewrite == "inductor"
    assert choose(_entry({100: {"fuse": 0.9, "split": 0.5}, 200: {"fuse": 0.9}}), 150, 0.02).rewrite == "fuse"


def test_regions_of_a_symbolic_count_merge_and_cover_everything():
    merged = regions(RULE, 0.02)
    assert [(r.low, r.high, r.choice.rewrite) for r in merged] == [
        (None, 2048, "fuse"), (2048, 8193, "split"), (8193, None, "inductor")]
    for tokens in range(1, 20000, 13):  # each range's rewrite is allowed at both cells bounding it
        region = next(r for r in merged if tokens in r)
        if region.choice.rewrite == "split":
            assert choose(RULE, tokens, 0.02).rewrite == "split"


# --- decisions on graphs --------------------------------------------------------------------------


@pytest.mark.parametrize("cells, tokens, code, fused, split, measured", [
    ({640: {"fuse": 1.05, "split": 1.2}}, 640, ReasonCode.TUNED_NO_REWRITE, 0, 0,
     {"basis": "cell", "fuse": "1.05x", "split": "1.20x", "at": "640"}),
    ({640: {"fuse": 0.9, "split": 1.1}}, 640, ReasonCode.TUNED_FUSE_ONLY, 2, 0,
     {"basis": "cell", "fuse": "0.90x", "split": "1.10x", "at": "640"}),
    ({640: {"fuse": 0.9, "split": 0.8}}, 640, ReasonCode.TUNED_SPLIT, 0, 4,
     {"basis": "cell", "fuse": "0.90x", "split": "0.80x", "at": "640"}),
    ({512: {"fuse": 0.9, "split": 0.8}, 1024: {"fuse": 0.9, "split": 1.01}}, 640, ReasonCode.TUNED_FUSE_ONLY, 2, 0,
     {"basis": "between", "split": "0.80x/1.01x", "at": "512/1024"}),
    ({256: {"fuse": 0.9, "split": 0.5}}, 640, ReasonCode.TUNED_FUSE_ONLY, 2, 0, {"basis": "above", "at": "256"}),
    ({1024: {"fuse": 1.0, "split": 0.5}}, 640, ReasonCode.TUNED_NO_REWRITE, 0, 0,
     {"basis": "below", "fuse": "1.00x", "at": "1024"}),
], ids=["inductor", "fuse", "split", "between", "above", "below"])
def test_auto_follows_the_table(world2, tmp_path, cells, tokens, code, fused, split, measured):
    path = _write(tmp_path, _table(cells))
    rewrite = _compile(WeaveConfig(split="auto", tuning_table=path), tokens)
    ops = op_counts(rewrite.graph)
    assert (ops[FUSED], ops[ASYNC], ops[ALL_REDUCE]) == (fused, split, 2 if fused + split == 0 else 0)
    assert {plan.tuned.code for plan in rewrite.plans} == {code}
    tuned = rewrite.report.tuned
    assert tuned is not None and tuned.code is code and rewrite.report.notes[0] == tuned.render()
    assert {k: tuned.field(k) for k in ("tokens", "table", "shape", "mode", "world")} == {
        "tokens": tokens, "table": path, "shape": "two_sites", "mode": "default", "world": 2}, tuned
    assert {k: tuned.field(k) for k in measured} == measured, tuned
    if code is ReasonCode.TUNED_NO_REWRITE:
        assert [(p.lowering, p.code) for p in rewrite.plans] == [(None, code)] * 2
        assert all(r.codes == [code] for r in rewrite.report.records)
        assert rewrite.decisions[-1].code is code
    elif code is ReasonCode.TUNED_FUSE_ONLY:
        assert (rewrite.decisions[-1].use, rewrite.decisions[-1].code) == (False, code)
    else:
        assert rewrite.report.notes[1].startswith("split (sequence)"), rewrite.report.notes


@pytest.mark.parametrize("table, why", [
    ({"world": 4}, Reason.of(ReasonCode.TUNING_TABLE_WORLD, measured=4, world=2)),
    ({"device_type": "cuda"}, Reason.of(ReasonCode.TUNING_TABLE_DEVICE, measured="cuda", device="cpu")),
    ({"dtype": "bfloat16"}, Reason.of(ReasonCode.TUNING_TABLE_DTYPE, measured="bfloat16", dtype="float32")),
    ({"mode": "reduce-overhead"}, Reason.of(
        ReasonCode.TUNING_TABLE_NO_ENTRY, hidden=64, widths=(32, 64), mode="default",
        entries="hidden 64, 4/2 heads of 8, MLP 64 (reduce-overhead)")),
    ({"widths": {**TWO_SITES, "mlp": 128}}, Reason.of(
        ReasonCode.TUNING_TABLE_NO_ENTRY, hidden=64, widths=(32, 64), mode="default",
        entries="hidden 64, 4/2 heads of 8, MLP 128 (default)")),
], ids=["world", "device", "dtype", "mode", "widths"])
def test_a_table_without_an_entry_leaves_it_to_the_window(world2, tmp_path, table, why):
    """Another world size, device, dtype, compile mode or layer widths: the table is not used, the
    report says why, and the split window decides as without a table (here: fuse-only, 640
    tokens below the default threshold)."""
    path = _write(tmp_path, _table({640: {"fuse": 1.5, "split": 1.5}}, **table))
    rewrite = _compile(WeaveConfig(split="auto", tuning_table=path))
    assert {plan.tuned.code for plan in rewrite.plans} == {ReasonCode.TUNING_TABLE_NOT_APPLICABLE}
    assert op_counts(rewrite.graph)[FUSED] == 2
    (declined,) = rewrite.report.reasons
    assert declined.find(ReasonCode.SPLIT_BELOW_WINDOW) == Reason.of(ReasonCode.SPLIT_BELOW_WINDOW, tokens=640,
                                                                     low=16384, kind="dense"), declined
    assert rewrite.report.tuned == Reason.of(ReasonCode.TUNING_TABLE_NOT_APPLICABLE, table=path, cause=why)


def test_builtin_table_does_not_apply_on_cpu_and_off_asks_no_table(world2):
    rewrite = _compile(WeaveConfig(split="auto"))
    assert rewrite.report.tuned == Reason.of(ReasonCode.TUNING_TABLE_NOT_APPLICABLE, table="builtin", cause=Reason.of(
        ReasonCode.TUNING_TABLE_DEVICE, measured="cuda", device="cpu"))
    configs = (WeaveConfig(split="off"), WeaveConfig(split="force"),
               WeaveConfig(split="auto", tuning_table="none"))
    for config in configs:
        rewrite = _compile(config)
        assert all(plan.tuned is None for plan in rewrite.plans)
        assert rewrite.report.tuned is None


def test_another_torch_version_warns_and_still_decides(world2, tmp_path):
    path = _write(tmp_path, _table({640: {"fuse": 1.5, "split": 1.5}}, torch_version="2.9.1"))
    with pytest.warns(UserWarning, match="measured with torch 2.9.1"):
        rewrite = _compile(WeaveConfig(split="auto", tuning_table=path))
    assert {plan.tuned.code for plan in rewrite.plans} == {ReasonCode.TUNED_NO_REWRITE}


def test_bfloat16_graph_uses_a_bfloat16_table(world2, tmp_path):
    path = _write(tmp_path, _table({640: {"fuse": 0.9, "split": 1.5}}, dtype="bfloat16"))
    rewrite = _compile(WeaveConfig(split="auto", tuning_table=path), dtype=torch.bfloat16)
    assert {plan.tuned.code for plan in rewrite.plans} == {ReasonCode.TUNED_FUSE_ONLY}


def test_symbolic_token_count_is_decided_per_range_with_guards(world2, tmp_path):
    """A symbolic count (hint 640) is decided for the range it lies in, [512, 1024) here (split
    faster at 512 and 1024, not at 2048), and the comparison installs guards for both bounds, so a
    batch in another range recompiles; the split's window is that range."""
    path = _write(tmp_path, _table({512: {"fuse": 0.9, "split": 0.8}, 1024: {"fuse": 0.9, "split": 0.8},
                                    2048: {"fuse": 0.9, "split": 1.1}}))
    rewrite = _compile(WeaveConfig(split="auto", tuning_table=path), mode="symbolic")
    (tuned,) = {plan.tuned for plan in rewrite.plans}
    assert (tuned.code, tuned.window) == (ReasonCode.TUNED_SPLIT, (512, 1023))
    assert [tuned.reason.field(k) for k in ("tokens", "low", "high")] == [None, 512, 1024], tuned.reason
    assert op_counts(rewrite.graph)[ASYNC] == 4
    symbol = next(iter(rewrite.graph.nodes)).meta["val"].shape[0]
    guards = [str(g.expr) for g in symbol.node.shape_env.guards]
    assert any("512" in g for g in guards) and any("1024" in g or "1023" in g for g in guards), guards


def test_inner_width_reads_the_weight_operand(world2):
    graph = make_fx(two_sites, tracing_mode="fake")(*_args(16)).graph
    sites, _ = find_allreduce_rmsnorm_sites(graph)
    assert [inner_width(site.matmul) for site in sites] == [32, 64]


# --- the command ----------------------------------------------------------------------------------


def test_dry_run_says_what_it_would_measure(capsys, tmp_path):
    command.main(["--shape", "70b_tp8sim", "mine:hidden=5120,heads=40,kv_heads=8,mlp=13824", "--world", "1",
                  "--tokens", "4096", "2048", "--out", str(tmp_path / "t.json"), "--dry-run"])
    out = capsys.readouterr().out
    assert "LOCAL COST of the rewrites only" in out
    assert "mine: hidden 5120, 40/8 heads of 128, MLP 13824" in out
    assert "2 entries x 3 compiles, 12 cells" in out and "tokens 2048 4096" in out
    assert not (tmp_path / "t.json").exists()


@pytest.mark.parametrize("argv, message", [
    (["--shape", "nope"], "unknown shape 'nope'"),
    (["--shape", "x:hidden=64,heads=4"], "needs a name and kv_heads, mlp"),
    (["--shape", "x:hidden=64,heads=3,kv_heads=2,mlp=8"], "must be a multiple of kv_heads"),
    (["--device", "cpu", "--modes", "reduce-overhead"], "records CUDA graphs"),
    (["--shape", "tiny", "--tokens", "1"], "every token count must be >= 2"),
])
def test_command_line_errors(capsys, argv, message):
    with pytest.raises(SystemExit):
        command.parse_args(argv)
    assert message in capsys.readouterr().err


def test_merge_joins_entries_of_tables_measured_alike(tmp_path, capsys):
    default = _write(tmp_path, _table({512: {"fuse": 0.9}}), "a.json")
    cuda_graphs = _write(tmp_path, _table({512: {"fuse": 1.1}}, mode="reduce-overhead"), "b.json")
    command.main(["--merge", default, cuda_graphs, "--out", str(tmp_path / "c.json")])
    merged = load_table(str(tmp_path / "c.json"))
    assert [(e.mode, choose(e, 512, merged.min_gain).rewrite) for e in merged.entries] == [
        ("default", "fuse"), ("reduce-overhead", "inductor")]
    assert "auto picks" in capsys.readouterr().out
    other_world = _write(tmp_path, _table({512: {"fuse": 0.9}}, world=4, mode="reduce-overhead"), "d.json")
    with pytest.raises(TuningTableError, match="cannot merge .*d.json.*: world 4 != 2"):
        command.main(["--merge", default, other_world, "--out", str(tmp_path / "e.json")])
    with pytest.raises(TuningTableError, match="measure the same layer widths"):
        command.main(["--merge", default, default, "--out", str(tmp_path / "f.json")])


def _compile_with_table(rank, world, path, tokens):
    from weavepass.backend import WeaveBackend
    from weavepass.tune.shapes import SHAPES, build_model

    model = build_model(SHAPES["tiny"], dist.group.WORLD, torch.device("cpu"), 1, torch.float32)
    backend = WeaveBackend(WeaveConfig(split="auto", min_world_size=1, tuning_table=path))
    with torch.no_grad():
        torch.compile(model, backend=backend, dynamic=False)(torch.randint(0, 4096, (1, tokens)))
    return backend.report.graphs[0].tuned


@pytest.mark.slow
def test_tune_on_cpu_writes_a_table_that_drives_auto(tmp_path):
    """The command end to end on one CPU process (tiny shape, 1 layer, 16 and 32 tokens): it says
    it measures the local cost only, writes a valid table with every rewrite timed, and a compile
    with ``split="auto"`` and that table decides from it (CPU times: the check is the plumbing,
    not which rewrite wins)."""
    out = tmp_path / "cpu.json"
    env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "1",
           "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    done = subprocess.run([sys.executable, "-m", "weavepass.tune", "--device", "cpu", "--iters", "3", "--rounds", "3",
                           "--warmup", "1", "--out", str(out)], capture_output=True, text=True, timeout=300, env=env,
                          check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "LOCAL COST of the rewrites only" in done.stdout and "auto picks" in done.stdout
    table = load_table(str(out))
    assert (table.world, table.machine["device_type"], table.dtype, table.time_unit) == (1, "cpu", "float32", "ms")
    (entry,) = table.entries
    assert (entry.shape, entry.mode, [c.tokens for c in entry.cells]) == ("tiny", "default", [16, 32])
    assert all(set(c.times) == {"inductor", "fuse", "split"} and min(c.times.values()) > 0 for c in entry.cells)
    tuned = spawn(_compile_with_table, 1, "gloo", str(out), 16)[0]
    expected = {"inductor": ReasonCode.TUNED_NO_REWRITE, "fuse": ReasonCode.TUNED_FUSE_ONLY,
                "split": ReasonCode.TUNED_SPLIT}[choose(entry, 16, table.min_gain).rewrite]
    assert (tuned.code, tuned.field("tokens"), tuned.field("table")) == (expected, 16, str(out)), tuned


def _auto_by_table(rank, world, path, sizes):
    from weavepass.backend import WeaveBackend
    from weavepass.testing import TPConfig, build_tp_model, random_token_ids

    dense = TPConfig(vocab=100, hidden=64, n_layers=1, n_heads=12, n_kv_heads=6, head_dim=8, intermediate=80)
    torch._dynamo.reset()
    backend = WeaveBackend(WeaveConfig(split="auto", tuning_table=path))
    model = build_tp_model(dense, rank, world, dist.group.WORLD)
    compiled = torch.compile(model, backend=backend)
    worst, graphs_after = 0.0, []
    for seq in sizes:
        ids = random_token_ids(dense, 1, seq, seed=seq)
        with torch.no_grad():
            worst = max(worst, (compiled(ids) - model(ids)).abs().max().item())
        graphs_after.append(len(backend.report.graphs))
    return graphs_after, [(g.notes, g.tuned) for g in backend.report.graphs], worst


@pytest.mark.slow
def test_auto_by_table_on_a_dynamic_model_matches_eager(tmp_path):
    """2 ranks on gloo, the reference model with its token count dynamic after the first call: the
    table's ranges (fuse below 16 tokens, split in [16, 32), fuse from 32 on) are guards, so the
    sizes compile four graphs (static 5; symbolic below, inside, above) and no more, each decided
    as the table says, and every answer equals eager's."""
    # Per rank at world 2: 6 heads of 8 (o_proj K = 48), MLP 40.
    widths = {"hidden": 64, "heads": 6, "kv_heads": 3, "head_dim": 8, "mlp": 40}
    path = _write(tmp_path, _table({16: {"fuse": 0.9, "split": 0.8}, 32: {"fuse": 0.9, "split": 0.8},
                                    48: {"fuse": 0.9, "split": 1.2}}, widths=widths))
    sizes = [5, 9, 20, 40, 12, 24, 60, 31, 33]
    graphs_after, notes, worst = spawn(_auto_by_table, 2, "gloo", path, sizes)[0]
    assert worst < 1e-5
    assert graphs_after == [1, 2, 3, 4, 4, 4, 4, 4, 4], (graphs_after, notes)
    tuned = [(t.code, t.field("tokens"), t.field("low"), t.field("high"), t.field("basis")) for _, t in notes]
    assert tuned == [
        (ReasonCode.TUNED_FUSE_ONLY, 5, None, None, "below"),
        (ReasonCode.TUNED_FUSE_ONLY, None, None, 16, "below"),
        (ReasonCode.TUNED_SPLIT, None, 16, 32, "between"),
        (ReasonCode.TUNED_FUSE_ONLY, None, 32, None, "between"),
    ], notes
    assert notes[2][0][1].startswith("split (sequence): computed at run time"), notes


def test_the_tables_contents_are_part_of_the_cache_key(tmp_path):
    """``WeavePass.uuid()`` changes when the table file does, not only when its path does."""
    from weavepass.compile.graph_pass import WeavePass

    path = _write(tmp_path, _table({512: {"fuse": 0.9}}))
    config = WeaveConfig(split="auto", tuning_table=path)
    before = WeavePass(config).uuid()
    _write(tmp_path, _table({512: {"fuse": 0.9}, 1024: {"fuse": 1.5}}))
    assert WeavePass(config).uuid() != before
    assert WeavePass(WeaveConfig(split="auto", tuning_table="none")).uuid() != before
