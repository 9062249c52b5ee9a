"""Import hygiene: no torch_npu, no triton at import, and the backend found by name in a fresh process."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def run_fresh(code: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_import_weavepass_without_torch_npu():
    out = run_fresh(
        """
        import sys, importlib.util
        import torch, weavepass
        print(importlib.util.find_spec("torch_npu") is None, "torch_npu" in sys.modules)
        """
    )
    assert out.split() == ["True", "False"]


def test_backend_found_by_name_without_importing_weavepass():
    out = run_fresh(
        """
        import sys, torch
        from torch._dynamo.backends.registry import lookup_backend
        listed = "weave" in torch._dynamo.list_backends()
        backend = lookup_backend("weave")
        print(listed, type(backend).__name__)
        """
    )
    assert out.split() == ["True", "WeaveBackend"]


def test_compile_by_name_in_fresh_process():
    out = run_fresh(
        """
        import torch
        f = torch.compile(lambda x: torch.nn.functional.rms_norm(x, (8,)) * 2, backend="weave")
        x = torch.randn(3, 8)
        torch.testing.assert_close(f(x), torch.nn.functional.rms_norm(x, (8,)) * 2)
        import weavepass
        print(len(weavepass.last_report().graphs), weavepass.last_report().rewritten)
        """
    )
    assert out.split() == ["1", "0"]
