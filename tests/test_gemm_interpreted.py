"""The persistent GEMM with its scatter epilogue and the owners' reduce (``runtime.cuda.gemm``) on CPU
through Triton's interpreter (tests/gemm_interpreter_case.py, one process per case because
``TRITON_INTERPRET`` is read when the kernels are defined): the GEMM against ``torch.mm``, the routing
of every tile to its owner at world 2, 3 and 4 with ragged splits, the reduce against the reference,
the signals' values after back-to-back calls, and that a captured call's tensors outlive the capture.
Skipped where Triton is not installed. What the interpreter cannot show: the waits under concurrency,
memory ordering, TMA on the device, bf16 dots (the case file says why); tests/gpu/test_gemm_gpu.py
covers those on one GPU."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
from interpreted import run_interpreted  # tests/interpreted.py

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (interpreter)")

CASE = pathlib.Path(__file__).with_name("gemm_interpreter_case.py")


@pytest.mark.parametrize("case", [
    "gemm", "scatter",
    # 38 s of CI's 2 cores; the same paths run as kernels in tests/gpu/test_gemm_gpu.py (one H200, 2026-12-04)
    pytest.param("scatter_paths", marks=pytest.mark.full(
        covered_by="test_gemm_kernels_interpreted[scatter] (the default paths) and tests/gpu/test_gemm_gpu.py")),
    "reduce", "capture", "matmul_op", "matmul_entry", "planned"])
def test_gemm_kernels_interpreted(case):
    run_interpreted(CASE.name, case, ok=f"{case}: OK")


def test_owner_row_starts():
    from weavepass.runtime.cuda.gemm import owner_row_starts

    assert owner_row_starts(10, 4) == [0, 3, 6, 9, 10]  # the fused op's split: ceil(T / N) per owner
    assert owner_row_starts(5, 4) == [0, 2, 4, 5, 5]  # the last owner may have none
    assert owner_row_starts(7, 3, [0, 7, 0]) == [0, 0, 7, 7]
    with pytest.raises(ValueError, match="do not split"):
        owner_row_starts(7, 3, [1, 2, 3])


def test_scatter_refuses_rows_past_the_staging_capacity():
    """An owner with more rows than the staging holds is refused before any launch, with the reason."""
    import torch

    from weavepass.runtime.cuda.gemm import (
        INTERPRETER_CONFIG,
        OwnerRows,
        ScatterLayout,
        ScatterWorkspace,
        scatter_matmul,
    )

    layout = ScatterLayout(world=2, hidden=16, capacity=8, signal_rows=16)
    ws = ScatterWorkspace(layout, 0, torch.zeros(layout.staging_elements, dtype=torch.float16),
                          torch.zeros(layout.pad_slots, dtype=torch.int32), torch.zeros(2, dtype=torch.int64),
                          torch.zeros(2, dtype=torch.int64))
    x, w = torch.zeros(16, 16, dtype=torch.float16), torch.zeros(16, 16, dtype=torch.float16)
    with pytest.raises(ValueError, match="exceed the staging capacity"):
        scatter_matmul(x, w, ws, OwnerRows.build(16, 2, "cpu", [16, 0]), INTERPRETER_CONFIG, use_descriptors=False)


def test_select_config_reads_the_measured_table(monkeypatch):
    """The plain GEMM's config: the measured table's entry for (N, K, token bucket), else the default;
    every entry is one of the configs the benchmark tunes over (the table is its winners)."""
    import torch

    from weavepass.runtime.cuda import gemm

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cuda = torch.device("cuda", 0)  # only the device type is read: no GPU needed
    assert all(config in gemm.GPU_CONFIGS for config in gemm.MEASURED_CONFIGS.values())
    assert all(bucket in (2048, 8192) for _, _, bucket in gemm.MEASURED_CONFIGS)
    # one run wrote both; a speed only where the scatter was measured (row-parallel keys)
    assert set(gemm.MEASURED_SPEED) <= set(gemm.MEASURED_CONFIGS)
    table = {(8192, 1024, 2048): gemm.GPU_CONFIGS[3]}
    monkeypatch.setattr(gemm, "MEASURED_CONFIGS", table)
    assert gemm.select_config(2048, 8192, 1024, cuda) == gemm.GPU_CONFIGS[3]
    assert gemm.select_config(4096, 8192, 1024, cuda) == gemm.GPU_CONFIGS[3]  # up to 4096 rows: the 2K entry
    assert gemm.select_config(4097, 8192, 1024, cuda) == gemm.DEFAULT_GPU_CONFIG  # no 8K entry
    assert gemm.select_config(2048, 8192, 1024, torch.device("cpu")) == gemm.INTERPRETER_CONFIG
    monkeypatch.setattr(gemm, "MEASURED_SPEED", {(8192, 1024, 2048): 0.95})
    assert gemm.measured_speed(3000, 8192, 1024) == 0.95 and gemm.measured_speed(8192, 8192, 1024) is None


def test_reduce_tiles_follow_the_fused_kernels_rule():
    """The owners' reduce takes the fused kernel's large tiles (``LARGE_TILE_BYTES``: 4 bf16 rows of
    8192, 16 warps) where its rows fill every program with them, else one-row small tiles; a tile
    never spans two signal blocks (its rows divide ``signal_rows``). One-row tiles made the reduce
    1.3x the fused op's kernel on one H200 (each tile waits for its block's signals first)."""
    from weavepass.runtime.cuda.gemm import reduce_arguments

    large = reduce_arguments(8192, 2, 128, count=8192, num_ctas=132)
    assert (large["ROWS"], large["num_warps"]) == (4, 16)
    assert reduce_arguments(8192, 2, 128, count=4 * 132 - 1, num_ctas=132)["ROWS"] == 1  # too few rows
    assert reduce_arguments(8192, 2, 128)["ROWS"] == 1  # no count given: the small tile
    assert reduce_arguments(4096, 2, 128, count=8192, num_ctas=132)["ROWS"] == 8
    assert reduce_arguments(24, 2, 16, count=10**6, num_ctas=4)["ROWS"] == 16  # capped by the signal rows
