"""Import hygiene: no torch_npu, no triton at import, and the backend found by name in a fresh process."""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys
import textwrap

import weavepass


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


PACKAGE = pathlib.Path(weavepass.__file__).parent


def _imported_modules(path: pathlib.Path, top_level_only: bool = False) -> set[str]:
    """Modules ``path`` imports (``from a.b import c`` counts as ``a.b``), anywhere in the file or
    only at module level."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    names = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_runtime_never_imports_ops_or_compile():
    """The dependency rule: runtime code runs the ops; it neither defines nor emits them."""
    for path in sorted((PACKAGE / "runtime").rglob("*.py")):
        bad = {m for m in _imported_modules(path) if m.startswith(("weavepass.ops", "weavepass.compile"))}
        assert not bad, f"{path.relative_to(PACKAGE)} imports {bad}"


def test_ops_import_runtime_only_lazily():
    """``weavepass.ops`` imports its kernels on first call, so defining the ops loads no lowering
    (and so neither triton nor torch_npu)."""
    top = _imported_modules(PACKAGE / "ops" / "__init__.py", top_level_only=True)
    assert not {m for m in top if m.startswith("weavepass")}, top


def test_every_weave_op_is_defined_in_the_ops_package():
    definers = ('custom_op("weave::', 'Library("weave"', "define_hot_op(")
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.parent.name == "ops":
            continue
        text = path.read_text()
        assert not [d for d in definers if d in text], f"{path.relative_to(PACKAGE)} defines a weave op"


def test_multicast_policy_keeps_a_users_choice_unless_told_to_override(monkeypatch):
    from weavepass.env import MULTICAST_OFF, disable_multicast

    for name in MULTICAST_OFF:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")  # the user's choice
    disable_multicast(override=False)
    assert os.environ["NCCL_NVLS_ENABLE"] == "1"
    assert os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    assert os.environ["NVSHMEM_DISABLE_NVLS"] == "1"
    disable_multicast(override=True)
    assert {name: os.environ[name] for name in MULTICAST_OFF} == MULTICAST_OFF
