"""The GPU benchmarks' ``--smoke`` modes (CPU processes on gloo, tiny shapes; the fused-kernel and
overlap benchmarks on 4 ranks, the world-size path of issues 16 and 17), so the scripts do not rot
between the rare device runs: each runs, writes its CSV with the expected rows and says why it
skips its CUDA-only variants. Plus the pure arithmetic of the reports and of the P2P bound."""

from __future__ import annotations

import csv
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _benchmarks():
    """``benchmarks/`` importable (its modules import each other by bare name)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import bench_fused_allreduce_rmsnorm
        import bench_overlap
        import report
    finally:
        sys.path.remove(str(BENCHMARKS))
    return bench_fused_allreduce_rmsnorm, bench_overlap, report


def _smoke(script: str, out: Path, *args: str, csv_name: str | None = None) -> tuple[str, list[dict]]:
    """Run ``script --smoke`` and return its output and the rows of the CSV it wrote (``csv_name``,
    default the script's name)."""
    # One compile thread: a worker pool per rank only costs start-up time on a small CPU machine.
    env = {**os.environ, "PYTHONPATH": str(BENCHMARKS.parent), "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--smoke", "--out", str(out), *args],
        capture_output=True, text=True, timeout=150, env=env, cwd=BENCHMARKS.parent,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    name = csv_name or script.removesuffix(".py")
    with open(out / f"{name}.csv") as f:
        return done.stdout, list(csv.DictReader(f))


@pytest.mark.slow
def test_overlap_smoke(tmp_path):
    text, rows = _smoke("bench_overlap.py", tmp_path, "--world", "4", "--variants", "eager,weave_fuse,inductor_cg",
                        "--tokens", "16", csv_name="bench_overlap_tp4")
    assert {(r["shape"], r["world"], r["variant"], r["tokens"]) for r in rows} == {
        ("tiny", "4", v, "16") for v in ("eager", "weave_fuse")
    }
    assert all(float(r["ms"]) > 0 for r in rows)
    assert "inductor_cg skipped on the CPU" in text


@pytest.mark.slow
def test_overlap_smoke_gemm_epilogue_one_rank(tmp_path):
    """``weave_gemm_epilogue`` at ``--world 1`` (a group of one rank; on the CPU the op's portable
    lowering): the rewrite moved the tiny model's two row-parallel matmuls (o_proj, down_proj of
    its one layer) into the op, weave_fuse none, and no call fell back."""
    pytest.importorskip("triton")
    text, rows = _smoke("bench_overlap.py", tmp_path, "--world", "1", "--variants",
                        "weave_fuse,weave_gemm_epilogue,weave_gemm_epilogue_cg", "--tokens", "16",
                        csv_name="bench_overlap_tp1")
    got = {r["variant"]: (r["world"], r["matmuls_moved"], r["fallbacks"]) for r in rows}
    assert got == {"weave_fuse": ("1", "0", ""), "weave_gemm_epilogue": ("1", "2", "0")}, got
    assert "weave_gemm_epilogue_cg skipped on the CPU" in text
    assert "FALLBACK" not in text


def test_overlap_fallback_count_is_loud(capsys, monkeypatch):
    """A warm-up in which the cuda_symm matmul op ran the portable lowering is counted for its cell
    and printed as a FALLBACK line; one without is silent; fallbacks in the timed rounds too."""
    pytest.importorskip("triton")
    _, bench_overlap, _ = _benchmarks()
    from weavepass.runtime.cuda import matmul

    monkeypatch.setattr(matmul, "FALLBACKS", type(matmul.FALLBACKS)())
    count = bench_overlap._FallbackCount()
    count.start()
    count.stop(("weave_gemm_epilogue", 16))
    assert "FALLBACK" not in capsys.readouterr().out
    count.start()
    matmul.FALLBACKS["a workspace past the limit"] += 3
    count.stop(("weave_gemm_epilogue", 32))
    assert count.cells == {("weave_gemm_epilogue", 16): 0, ("weave_gemm_epilogue", 32): 3}
    out = capsys.readouterr().out
    assert "FALLBACK: weave_gemm_epilogue at 32 tokens: 3 call(s)" in out and "past the limit" in out
    count.after_rounds(0)
    assert "FALLBACK" not in capsys.readouterr().out
    matmul.FALLBACKS["a workspace past the limit"] += 1
    count.after_rounds(0)
    assert "FALLBACK: 1 call(s) of the cuda_symm matmul op ran the portable lowering during the timed rounds" \
        in capsys.readouterr().out


@pytest.mark.slow
def test_decode_smoke(tmp_path):
    text, rows = _smoke("bench_decode.py", tmp_path, "--variants", "eager,weave_min1,weave_cg",
                        "--layers", "1", "--batches", "2")
    assert {(r["variant"], r["batch"]) for r in rows} == {("eager", "2"), ("weave_min1", "2")}
    # weave rewrote every site of the KV-cache decode step: 2 per layer + the embedding's.
    assert {r["variant"]: r["sites_fused"] for r in rows} == {"eager": "", "weave_min1": "3/3"}
    assert all(float(r["ms"]) > 0 and r["context"] == "8" for r in rows)
    assert "weave_cg skipped on the CPU" in text


@pytest.mark.slow
def test_decode_smoke_one_rank(tmp_path):
    """``--world 1`` (a group of one rank: what one GPU can measure): weave still rewrites every
    site (the benchmark lets it, ``report.weave_config``), and the output carries the world."""
    text, rows = _smoke("bench_decode.py", tmp_path, "--world", "1", "--variants", "eager,weave_min1",
                        "--layers", "1", "--batches", "2", csv_name="bench_decode_tp1")
    assert {(r["variant"], r["world"]) for r in rows} == {("eager", "1"), ("weave_min1", "1")}
    assert {r["variant"]: r["sites_fused"] for r in rows} == {"eager": "", "weave_min1": "3/3"}


@pytest.mark.slow
def test_fused_allreduce_rmsnorm_smoke(tmp_path):
    text, rows = _smoke("bench_fused_allreduce_rmsnorm.py", tmp_path, "--world", "4", "--tokens", "1", "6", "8",
                        csv_name="bench_fused_allreduce_rmsnorm_tp4")
    # The reduce-scatter form needs a token count divisible by the 4 ranks: not at 1 or 6 tokens.
    assert {(r["tokens"], r["method"]) for r in rows} == {
        ("1", "nccl"), ("6", "nccl"), ("8", "nccl"), ("8", "nccl_rs_ag")}
    assert {r["world"] for r in rows} == {"4"}
    # The fastest baseline is one measured at the same size (which one depends on timing: not asserted).
    measured = {(r["tokens"], r["method"]) for r in rows}
    assert all((r["tokens"], r["best_baseline"]) in measured for r in rows)
    assert "nccl_symm skipped on the CPU" in text


@pytest.mark.slow
def test_gemm_smoke(tmp_path):
    """bench_gemm through Triton's interpreter: every GEMM of the tiny preset, the scatter variants on
    the row-parallel ones only, every checked output "ok" against the fp32 product."""
    pytest.importorskip("triton")
    _, rows = _smoke("bench_gemm.py", tmp_path, "--tokens", "24", "--repeat", "2")
    plain = {"cublas", "triton"}
    scatters = {"scatter2", "scatter2_nosig", "scatter2_ptr", "scatter2_tilesig"}
    row_parallel = plain | scatters | {"triton_ptr"}  # (the TMA config's pointer-store twin)
    want = {(g, v) for g in ("o", "down") for v in row_parallel} | {(g, v) for g in ("qkv", "gate_up")
                                                                    for v in plain}
    for repeat in ("0", "1"):
        assert {(r["gemm"], r["variant"]) for r in rows if r["repeat"] == repeat} == want
    assert all(float(r["ms"]) > 0 and r["tokens"] == "24" for r in rows)
    checked = [r["check"] for r in rows if r["variant"] in {"triton"} | scatters]
    assert checked == ["ok"] * 2 * (4 + 2 * 4), checked  # per repeat: the plain GEMM of 4, 4 scatters of 2
    # The smoke's config stores through TMA, which the scatter takes over one allocation; the _ptr and
    # _tilesig variants store through pointers by definition, and say why.
    stores = {(r["variant"], r["stores"], r["stores_why"]) for r in rows if r["variant"] in scatters}
    assert stores == {("scatter2", "tma", ""), ("scatter2_nosig", "tma", ""),
                      ("scatter2_ptr", "pointers", "the config stores through pointers"),
                      ("scatter2_tilesig", "pointers", "the config stores through pointers")}, stores


def test_overlap_report_hidden_fraction(tmp_path):
    _, bench_overlap, _ = _benchmarks()
    assert bench_overlap.hidden_fraction(7.0, 10.0, 6.0) == pytest.approx(0.75)
    assert bench_overlap.hidden_fraction(5.0, 10.0, 6.0) == pytest.approx(1.25)  # beats the floor
    assert bench_overlap.hidden_fraction(7.0, 6.0, 6.0) is None  # nothing to hide
    assert bench_overlap.hidden_fraction(7.0, None, 6.0) is None
    rows = [{"shape": "tiny", "variant": v, "sequences": 1, "tokens": 16, "ms": ms}
            for v, ms in (("inductor", 10.0), ("no_comm", 6.0), ("weave_overlap", 7.0), ("eager", 12.0))]
    bench_overlap.report(rows, tmp_path, layers=1)
    with open(tmp_path / "bench_overlap.csv") as f:
        hidden = {r["variant"]: r["hidden"] for r in csv.DictReader(f)}
    # Only weave variants get the fraction.
    assert hidden == {"inductor": "", "no_comm": "", "weave_overlap": "0.75", "eager": ""}


def test_overlap_report_ratio_to_the_same_mode(tmp_path, capsys):
    """``vs_mode`` divides by Inductor of the variant's own compile mode: ``weave_auto_cg`` by
    ``inductor_cg``, ``weave_auto`` by ``inductor``; the auto check flags a slower auto."""
    _, bench_overlap, _ = _benchmarks()
    rows = [{"shape": "tiny", "variant": v, "sequences": 1, "tokens": 16, "ms": ms}
            for v, ms in (("inductor", 10.0), ("weave_auto", 9.0), ("inductor_cg", 8.0), ("weave_auto_cg", 8.8))]
    bench_overlap.report(rows, tmp_path, layers=1)
    with open(tmp_path / "bench_overlap.csv") as f:
        got = {r["variant"]: (float(r["vs_inductor"]), float(r["vs_mode"])) for r in csv.DictReader(f)}
    assert got["weave_auto"] == pytest.approx((0.9, 0.9))
    assert got["weave_auto_cg"] == pytest.approx((0.88, 1.1))
    assert got["inductor_cg"] == pytest.approx((0.8, 1.0))
    check = capsys.readouterr().out.split("auto check")[1]
    assert "weave_auto  1 seq     16 tokens: 0.900x inductor  ok" in check
    assert "weave_auto_cg  1 seq     16 tokens: 1.100x inductor_cg  SLOWER" in check


def test_local_cost_sim_configs_and_minimum_bytes():
    """``--sim-configs`` items (CTAs, tile KiB, warps, and the pipelined kernel's tiles per chunk and
    load stages), and the two-shot minimum local bytes per rank of docs/cuda_kernel.md
    (5.5 S at 2 ranks, 6.25 S at 4, 6.625 S at 8; 4 S at a group of one)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import bench_local_cost
    finally:
        sys.path.remove(str(BENCHMARKS))
    assert bench_local_cost.sim_config("32:64:16") == (32, 64, 16, None, None)
    assert bench_local_cost.sim_config("16") == (16, None, None, None, None)
    assert bench_local_cost.sim_config("-:16:") == (None, 16, None, None, None)
    assert bench_local_cost.sim_config("32:16:16:8:2") == (32, 16, 16, 8, 2)  # chunk tiles, load stages
    with pytest.raises(ValueError):
        bench_local_cost.sim_config("1:2:3:4:5:6")
    s = 100 * 8192 * 2
    assert [bench_local_cost.local_bytes_per_rank(n, 100, 8192, 2) / s for n in (1, 2, 4, 8)] == \
        pytest.approx([4.0, 5.5, 6.25, 6.625])


@pytest.mark.parametrize("world", [2, 4, 8])
def test_p2p_bound_slots(world):
    """Every rank stores ``2 S / N`` elements into each peer, each sender into its own slot of the
    receiver's buffer: the N - 1 slots of one buffer are disjoint and fill ``(N - 1) * per_peer``
    elements from its start. Buffers at made-up addresses, 10**6 bytes apart."""
    bench, _, _ = _benchmarks()
    per_peer, elem = 30, 2
    ptrs = [(5 + r) * 10**6 for r in range(world)]
    landed = {peer: [] for peer in range(world)}  # element offsets in the receiver's buffer
    for rank in range(world):
        peers = [p for p in range(world) if p != rank]
        for peer, delta in zip(peers, bench.peer_store_deltas(ptrs, rank, per_peer, elem)):
            start = (ptrs[rank] + delta * elem - ptrs[peer]) // elem
            landed[peer].append(start)
        assert bench.bound_grid(32, world) == (max(1, 32 // (world - 1)), world - 1)
    for peer, starts in landed.items():
        assert sorted(starts) == [slot * per_peer for slot in range(world - 1)], (peer, starts)


def test_world_in_names_and_presets():
    """Output names carry the world when it is not 2; the TP=4/8 presets are 70B's per-rank widths
    at that degree (70B: 64 q / 8 kv heads, MLP 28672), real at their own world and a simulation
    elsewhere; 70b_tp8sim is 70b_tp8's widths under the name of the 2-GPU tables."""
    _, bench_overlap, report = _benchmarks()
    assert [report.world_name("bench_overlap", w) for w in (2, 4, 8)] == [
        "bench_overlap", "bench_overlap_tp4", "bench_overlap_tp8"]
    shapes = bench_overlap.SHAPES
    for tp in (2, 4, 8):
        shape = shapes[f"70b_tp{tp}"]
        assert (shape.hidden, shape.heads * tp, shape.kv_heads * tp, shape.mlp * tp, shape.tp) == (
            8192, 64, 8, 28672, tp)
        assert shape.simulation_note(tp) is None
    assert shapes["70b_tp8sim"] == shapes["70b_tp8"]
    assert "with the all_reduce of 2 ranks" in shapes["70b_tp8sim"].simulation_note(2)
    assert shapes["tiny"].simulation_note(4) is None


def test_split_cost_smoke(tmp_path):
    """bench_split_cost on the CPU: every cut of every token count measured against the whole, with
    the wave model's prediction; halves that add up to the tokens."""
    _, rows = _smoke("bench_split_cost.py", tmp_path)
    cuts = ("wave", "tile", "half", "5/8")
    assert {(r["tokens"], r["cut"]) for r in rows} == {(t, c) for t in ("256", "384") for c in cuts}
    assert all(int(r["first"]) + int(r["second"]) == int(r["tokens"]) and float(r["halves_ms"]) > 0 for r in rows)
    assert all(float(r["predicted"]) >= 1.0 for r in rows)  # the wave model: a split never saves waves


def test_auto_check_decides_from_paired_rounds_and_the_aa_band(tmp_path, capsys):
    """The auto check's rule (``bench_overlap.AUTO_CHECK_RULE``): per-round ratios to Inductor of
    the same mode; ok at a median <= 1.00; SLOWER only above 1 + the A/A control's band with every
    round above 1.00; else unresolved, and the target is then "not shown", never "met"."""
    _, bench_overlap, _ = _benchmarks()
    verdict = bench_overlap.auto_verdict
    base, aa = [10.0, 10.0, 10.0], [10.2, 9.9, 10.1]  # A/A band 2 %
    assert verdict([9.9, 10.1, 9.8], base, aa)[2] == "ok"  # median 0.99
    assert verdict([10.1, 10.15, 9.9], base, aa)[2] == "unresolved"  # 1.01: inside the band
    assert verdict([10.3, 10.4, 10.35], base, aa)[2] == "SLOWER"  # 1.035 > 1.02, every round slower
    assert verdict([10.3, 10.4, 9.95], base, aa)[2] == "unresolved"  # one round saw auto as fast
    assert verdict([10.1, 10.1, 10.1], base, None)[2] == "SLOWER"  # no control: band 0, as before
    ratio, band, _ = verdict([10.1, 10.15, 9.9], base, aa)
    assert ratio == pytest.approx(1.01) and band == pytest.approx(0.02)
    rows = [{"shape": "tiny", "variant": v, "sequences": 1, "tokens": 16, "ms": statistics.median(ms),
             "ms_rounds": " ".join(map(str, ms))}
            for v, ms in (("inductor", base), ("inductor_aa", aa), ("weave_auto", [10.1, 10.15, 9.9]),
                          ("inductor_cg", [8.0] * 3), ("weave_auto_cg", [7.9, 7.8, 8.1]))]
    bench_overlap.report(rows, tmp_path, layers=1)
    check = capsys.readouterr().out.split("auto check")[1]
    assert "rule: per cell, r_i = weave_auto / Inductor" in check
    assert "weave_auto  1 seq     16 tokens: 1.010x inductor  unresolved (A/A band 2.0%)" in check
    assert "weave_auto_cg  1 seq     16 tokens: 0.988x inductor_cg  ok (no A/A control)" in check
    assert "1 ok, 1 unresolved, 0 SLOWER of 2 cells: target not shown" in check


def test_parallel_pytest_runs_each_test_alone_and_fails_on_a_failure(tmp_path):
    """benchmarks/parallel_pytest.py (the simulated-rank GPU tests, one process per test): the
    total counts every test's outcome and the exit status says a test failed."""
    case = tmp_path / "test_case.py"
    case.write_text("import os\n"
                    "def test_a(): assert os.getpid()\n"
                    "def test_b(): assert False, 'b fails'\n"
                    "def test_c(): pass\n")
    cmd = [sys.executable, str(BENCHMARKS / "parallel_pytest.py"), "--jobs", "2", "--log-dir",
           str(tmp_path / "logs"), str(case), "--", "-p", "no:cacheprovider"]
    failed = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert "parallel_pytest total: 1 failed, 2 passed" in failed.stdout
    assert "b fails" in failed.stdout  # the failing test's own log is printed
    assert len(list((tmp_path / "logs").glob("test_*.log"))) == 3
    passed = subprocess.run(cmd[:-3] + ["-k", "not test_b", "--", "-p", "no:cacheprovider"],
                            capture_output=True, text=True, cwd=tmp_path)
    assert passed.returncode == 0, passed.stdout + passed.stderr
    assert "parallel_pytest total: 2 passed" in passed.stdout


def _bench_gemm():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import bench_gemm
    finally:
        sys.path.remove(str(BENCHMARKS))
    return bench_gemm


def test_gemm_table_rule_on_hand_made_rows():
    """``bench_gemm.measured_table`` (``TABLE_RULE``) on made-up CSV rows: a key enters only with
    >= 2 repeats whose speeds agree within 5 %; its config is the lowest total time; a row-parallel
    key's speed is the scatter's the op runs (``scatter1`` at one rank, ``scatterN_ptr`` at N > 1:
    the TMA-stored ``scatterN`` needs one allocation, which N GPUs' stagings are not; the slowest
    owner count), not the plain GEMM's; keys that fail are listed with why."""
    pytest.importorskip("triton")
    bench_gemm = _bench_gemm()
    from weavepass.runtime.cuda.gemm import GPU_CONFIGS

    fast, slow = GPU_CONFIGS[0].label(), GPU_CONFIGS[4].label()

    def tune(n, k, m, rep, config, ms, cublas=1.0):
        return {"n": str(n), "k": str(k), "m": str(m), "repeat": str(rep), "config": config, "ms": str(ms),
                "cublas_ms": str(cublas)}

    def bench(n, k, m, rep, variant, ms):
        return {"n": str(n), "k": str(k), "m": str(m), "repeat": str(rep), "variant": variant, "ms": str(ms)}

    tune_rows, bench_rows = [], []
    for rep, ms in ((0, 1.0), (1, 1.02)):  # plain, bucket 2048 (two token counts): speeds 1.0 and 0.980
        for m in (2048, 4096):
            tune_rows += [tune(1280, 8192, m, rep, fast, ms), tune(1280, 8192, m, rep, slow, 1.2)]
    for rep in (0, 1):  # row-parallel: plain 1.11x cuBLAS, the op's scatter at 8 ranks 0.8x
        tune_rows.append(tune(8192, 1024, 8192, rep, fast, 0.9))
        bench_rows += [bench(8192, 1024, 8192, rep, "scatter1", 1.1 + 0.02 * rep),
                       bench(8192, 1024, 8192, rep, "scatter8_ptr", 1.25),
                       # not the op's GEMM at their group size: ignored
                       bench(8192, 1024, 8192, rep, "scatter8", 0.9),  # one allocation: 1 rank only
                       bench(8192, 1024, 8192, rep, "scatter1_ptr", 0.9),
                       bench(8192, 1024, 8192, rep, "scatter8_nosig", 0.5),
                       bench(8192, 1024, 8192, rep, "cublas", 1.0)]
    tune_rows += [tune(4096, 2048, 2048, 0, fast, 1.0), tune(4096, 2048, 2048, 1, fast, 1.2)]  # 18 % apart
    tune_rows.append(tune(7168, 8192, 2048, 0, fast, 1.0))  # one repeat
    tune_rows += [tune(4096, 7168, 8192, rep, fast, 1.0) for rep in (0, 1)]
    bench_rows.append(bench(4096, 7168, 8192, 0, "scatter2_ptr", 1.0))  # the scatter in one repeat only
    configs, speeds, left_out = bench_gemm.measured_table(tune_rows, bench_rows)
    assert configs == {(1280, 8192, 2048): GPU_CONFIGS[0], (8192, 1024, 8192): GPU_CONFIGS[0]}
    # only the scatter's speed is written: a plain key's (N, K) may be another model's row-parallel GEMM
    assert speeds == {(8192, 1024, 8192): pytest.approx(0.8)}
    assert set(left_out) == {(4096, 2048, 2048), (7168, 8192, 2048), (4096, 7168, 8192)}
    # (1.0 - 0.833) / median 0.917
    assert left_out[(4096, 2048, 2048)] == "the repeats disagree: speeds 1.000, 0.833 spread 18.2% > 5%"
    assert left_out[(7168, 8192, 2048)] == "measured in 1 repeat(s), fewer than 2"
    assert left_out[(4096, 7168, 8192)].startswith("a scatter variant was not measured in every cell")
    source = bench_gemm.table_source(configs, speeds, left_out)
    assert "# left out (4096, 2048, 2048): the repeats disagree" in source
    assert "    (8192, 1024, 8192): 0.800," in source and "at least 2 repeats" in source
    namespace: dict = {}
    exec(source, {"GemmConfig": type(GPU_CONFIGS[0])}, namespace)  # the proposal is valid source
    assert namespace["MEASURED_CONFIGS"] == configs
    assert namespace["MEASURED_SPEED"] == {key: round(v, 3) for key, v in speeds.items()}
