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


def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: pathlib.Path) -> dict[str, set[str]]:
    """Each module of ``package`` -> the modules of ``package`` it imports, anywhere in the file:
    at module level, inside functions and under ``TYPE_CHECKING`` (an import that runs later is
    still a dependency). ``from a import b`` counts as ``a.b`` where that is a module, else ``a``;
    relative imports are resolved."""
    root = package.parent
    modules = {_module_name(p, root): p for p in package.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else []))
                targets.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycles_between_weavepass_modules():
    """No module of the package imports, through any chain, one that imports it back; function-level
    and ``TYPE_CHECKING`` imports count (they hide a cycle, they do not remove it)."""
    graph = import_graph(PACKAGE)
    cycles = import_cycles(graph)
    assert not cycles, "import cycles: " + "; ".join(
        " <-> ".join(c) + " (" + ", ".join(f"{a} -> {sorted(graph[a] & set(c))}" for a in c) + ")" for c in cycles)


def test_the_cycle_check_sees_function_level_and_type_checking_imports(tmp_path):
    """The check can fail: a package whose modules import each other only inside a function, or
    only for type checking, has a cycle; one with the imports one way has none."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.sub import b\n")
    (package / "sub" / "b.py").write_text("def f():\n    from .c import g\n")
    (package / "sub" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..a import x\n")
    assert import_cycles(import_graph(package)) == [["pkg.a", "pkg.sub.b", "pkg.sub.c"]]
    (package / "sub" / "c.py").write_text("")
    assert import_cycles(import_graph(package)) == []


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
