"""One runner for the ``tests/*_case.py`` scripts that run Triton kernels in its interpreter: each in a
process of its own, because ``TRITON_INTERPRET`` is read when the kernels are defined (at import),
so it cannot be switched inside the test process."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

TESTS = pathlib.Path(__file__).resolve().parent


def run_interpreted(script: str, *args: str, ok: str, timeout: int = 300) -> None:
    """Run ``tests/<script> args...`` with ``TRITON_INTERPRET=1`` and the checkout importable; fail
    with the tail of its output unless it exits 0 and prints ``ok``."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(TESTS.parent))
    result = subprocess.run([sys.executable, str(TESTS / script), *args], env=env, capture_output=True, text=True,
                            timeout=timeout, check=False)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert ok in result.stdout, result.stdout[-4000:]
