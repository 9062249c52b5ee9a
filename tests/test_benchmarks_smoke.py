"""The GPU benchmarks' ``--smoke`` modes (2 CPU processes on gloo, tiny shapes), so the scripts do
not rot between the rare device runs: each runs, writes its CSV with the expected rows and says
why it skips its CUDA-only variants. Plus the pure arithmetic of the overlap report."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _smoke(script: str, out: Path, *args: str) -> tuple[str, list[dict]]:
    """Run ``script --smoke`` and return its output and the rows of the CSV it wrote."""
    # One compile thread: a worker pool per rank only costs start-up time on a small CPU machine.
    env = {**os.environ, "PYTHONPATH": str(BENCHMARKS.parent), "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--smoke", "--out", str(out), *args],
        capture_output=True, text=True, timeout=150, env=env, cwd=BENCHMARKS.parent,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    name = script.removesuffix(".py")
    with open(out / f"{name}.csv") as f:
        return done.stdout, list(csv.DictReader(f))


@pytest.mark.slow
def test_overlap_smoke(tmp_path):
    text, rows = _smoke("bench_overlap.py", tmp_path, "--variants", "eager,weave_fuse,inductor_cg",
                        "--tokens", "16")
    assert {(r["shape"], r["variant"], r["tokens"]) for r in rows} == {
        ("tiny", v, "16") for v in ("eager", "weave_fuse")
    }
    assert all(float(r["ms"]) > 0 for r in rows)
    assert "inductor_cg skipped on the CPU" in text


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
def test_fused_allreduce_rmsnorm_smoke(tmp_path):
    text, rows = _smoke("bench_fused_allreduce_rmsnorm.py", tmp_path)
    # The reduce-scatter form needs a token count divisible by the 2 ranks: not at 1 token.
    assert {(r["tokens"], r["method"]) for r in rows} == {("1", "nccl"), ("8", "nccl"), ("8", "nccl_rs_ag")}
    # The fastest baseline is one measured at the same size (which one depends on timing: not asserted).
    measured = {(r["tokens"], r["method"]) for r in rows}
    assert all((r["tokens"], r["best_baseline"]) in measured for r in rows)
    assert "nccl_symm skipped on the CPU" in text


def test_overlap_report_hidden_fraction(tmp_path):
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import bench_overlap
    finally:
        sys.path.remove(str(BENCHMARKS))
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
