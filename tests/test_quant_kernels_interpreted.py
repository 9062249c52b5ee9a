"""The CUDA kernels' quantized norm epilogue on CPU through Triton's interpreter
(tests/quant_interpreter_case.py): every carried form's codes and scales bit for bit against eager's
quantization as ATen computes it on CUDA, and within one fp32 rounding of the scale against eager on
the CPU, at a group of one rank and at two simulated ranks through every kernel (flat one-shot and
two-shot, pipelined, Lamport), bf16 and fp16. Skipped where Triton is not installed. What the
interpreter cannot show: the GPU's own casts and memory ordering (tests/gpu/test_quant_epilogue_gpu.py)."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (interpreter)")

CASE = pathlib.Path(__file__).with_name("quant_interpreter_case.py")


@pytest.mark.parametrize("world, algorithm, dtype", [
    (1, "one_shot", "bfloat16"),
    (1, "one_shot", "float16"),
    (2, "two_shot", "bfloat16"),
    (2, "one_shot", "float16"),
    (2, "pipelined", "bfloat16"),
    (2, "lamport", "bfloat16"),
])
def test_quantized_epilogue_matches_eager(world, algorithm, dtype):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(CASE.parent.parent))
    result = subprocess.run([sys.executable, str(CASE), str(world), algorithm, dtype], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "quant kernels: OK" in result.stdout
