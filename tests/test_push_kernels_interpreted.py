"""The split's push kernels (``WeaveConfig.split_comm="push"``) on CPU through Triton's
interpreter (tests/push_interpreter_case.py): indexing, the rank-order reduce with the reference's
rounding, the staging slot per half, the self-advancing signals, and the CONSUMED wait that keeps a
rank that runs ahead from overwriting a slot its peer has not read. Skipped where Triton is not
installed (the CPU CI machine); the GPU machine has it. What the interpreter cannot show: memory
ordering across GPUs, CUDA-graph replay, and the streams (tests/gpu/test_kernel_sim_one_gpu.py and
tests/gpu/test_overlap_gpu.py cover those)."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
from interpreted import run_interpreted  # tests/interpreted.py

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (interpreter)")

CASE = pathlib.Path(__file__).with_name("push_interpreter_case.py")


@pytest.mark.parametrize("schedule, residual, dtype", [
    ("in_step", "residual", "float32"),
    ("skewed", "residual", "float32"),  # rank 1 reduces late: rank 0's pushes must wait for it
    ("in_step", "no_residual", "bfloat16"),
])
def test_push_kernels_match_reference(schedule, residual, dtype):
    run_interpreted(CASE.name, schedule, residual, dtype, ok="push kernels: OK")
