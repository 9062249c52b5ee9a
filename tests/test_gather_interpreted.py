"""The gather prologue (``runtime.cuda.gather``) on CPU through Triton's interpreter
(tests/gather_interpreter_case.py, one process per case because ``TRITON_INTERPRET`` is read when the
kernels are defined): the gather GEMM at world 2, 3 and 4, bf16 and fp16, with ragged splits against the fp32 product
of the gathered rows, every rank equal to the bit, the pushed rows, flags and call counts after
back-to-back calls; a push whose row blocks span several CTAs' chunks; the full stream's two-part
push; the push in bf16 and fp16; the ``cuda_symm`` op's entry point at a gloo group of one. What the
interpreter cannot show (the waits under concurrency, giving up, memory ordering, TMA, tensor-core dots):
tests/gpu/test_gather_gpu.py on one GPU."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
from interpreted import run_interpreted  # tests/interpreted.py

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (interpreter)")

CASE = pathlib.Path(__file__).with_name("gather_interpreter_case.py")


@pytest.mark.parametrize("case", ["gather", "chunks", "full_stream", "push_dtypes", "op_entry", "op_signatures"])
def test_gather_kernels_interpreted(case):
    run_interpreted(CASE.name, case, ok=f"{case}: OK")


def test_gather_refuses_what_it_cannot_serve():
    """Rows past an owner's capacity, a flattened tile loop (it would hoist loads above the wait) and
    a residual_out push into a one-part layout are refused before any launch, with the reason."""
    import dataclasses

    import torch

    from weavepass.runtime.cuda.gather import PrologueLayout, PrologueWorkspace, gather_matmul, push_gather_rows
    from weavepass.runtime.cuda.gemm import INTERPRETER_CONFIG, OwnerRows

    lay = PrologueLayout(world=2, hidden=16, owner_capacity=8, signal_rows=16)
    ws = PrologueWorkspace(lay, 0, torch.zeros(lay.elements, dtype=torch.float16),
                           torch.zeros(lay.pad_slots, dtype=torch.int32), torch.zeros(2, dtype=torch.int64),
                           torch.zeros(2, dtype=torch.int64))
    rows, w = torch.zeros(16, 16, dtype=torch.float16), torch.zeros(8, 16, dtype=torch.float16)
    with pytest.raises(ValueError, match="exceed the gather buffer"):
        push_gather_rows(ws, rows, OwnerRows.build(16, 2, "cpu", [16, 0]))
    with pytest.raises(ValueError, match="exactly when the layout has 2 parts"):
        push_gather_rows(ws, rows, OwnerRows.build(16, 2, "cpu", [8, 8]), extra=rows)
    with pytest.raises(ValueError, match="not flattened"):
        gather_matmul(ws, w, OwnerRows.build(16, 2, "cpu", [8, 8]),
                      config=dataclasses.replace(INTERPRETER_CONFIG, flatten=True), use_descriptors=False)
    with pytest.raises(ValueError, match="do not fit"):
        gather_matmul(ws, w, OwnerRows.build(18, 2, "cpu", [9, 9]), use_descriptors=False)


def test_every_launch_passes_only_its_kernels_parameters():
    """Triton on the GPU refuses a keyword its kernel does not declare, where the interpreter lets it
    pass (the scatter's DEFER_SIGNALS reached the gather GEMM through ``GemmConfig.meta`` and failed
    every gather launch on one H200, 2026-12-04): the compile-time arguments each GEMM launch builds
    from a config must be parameters of its kernel, for every config."""
    from weavepass.runtime.cuda.gather import kernel_meta
    from weavepass.runtime.cuda.gather_kernels import gather_gemm_kernel
    from weavepass.runtime.cuda.gemm import GPU_CONFIGS, INTERPRETER_CONFIG
    from weavepass.runtime.cuda.gemm_kernels import persistent_gemm_kernel

    options = {"num_stages", "num_warps"}
    for config in (*GPU_CONFIGS, INTERPRETER_CONFIG):
        extra = set(kernel_meta(config)) - options - set(gather_gemm_kernel.arg_names)
        assert not extra, f"gather GEMM given {sorted(extra)} by {config.label()}"
        for store_desc in (False, True):
            extra = set(config.meta(store_desc)) - options - set(persistent_gemm_kernel.arg_names)
            assert not extra, f"scatter GEMM given {sorted(extra)} by {config.label()}"


def test_every_launch_site_names_only_its_kernels_parameters():
    """What a launch adds by hand, beside a config's dict (above): the keywords written at every
    ``kernel[grid](...)`` of weavepass/ (read from the source) and the row kernels' argument builders
    (``push_arguments``, ``reduce_arguments``, ``copy_arguments``) are parameters of the kernel they
    launch: the GPU refuses any other, the interpreter does not."""
    import ast

    from weavepass.runtime.cuda import gather, gather_kernels, gemm, gemm_kernels, kernels

    jitted = {name: fn for module in (kernels, gemm_kernels, gather_kernels)
              for name, fn in vars(module).items() if hasattr(fn, "arg_names") and name.endswith("_kernel")}
    options = {"num_stages", "num_warps"}
    root = pathlib.Path(gather.__file__).parents[2]
    launches = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript):
                name = ast.unparse(node.func.value).split(".")[-1]
                if name in jitted:
                    given = {k.arg for k in node.keywords if k.arg is not None}
                    launches.append(name)
                    extra = given - options - set(jitted[name].arg_names)
                    assert not extra, f"{path.name}:{node.lineno}: {name} given {sorted(extra)}"
    # the GEMM, scatter reduce, push/collect, gather push and gather GEMM launches at least
    assert {"persistent_gemm_kernel", "reduce_scattered_rows_kernel", "push_rows_kernel", "collect_rows_kernel",
            "push_gather_rows_kernel", "gather_gemm_kernel"} <= set(launches), launches
    built = {"push_gather_rows_kernel": gather.push_arguments(8192, 2, 128),
             "reduce_scattered_rows_kernel": gemm.reduce_arguments(8192, 2, 128),
             "push_rows_kernel": gemm.copy_arguments(8192, 2), "collect_rows_kernel": gemm.copy_arguments(8192, 2)}
    # The GEMM's and the scatter reduce's launch builders (the plain, scatter and planned launches):
    # their hand-written keywords are in the dict they return, not at the launch site.
    from types import SimpleNamespace

    import torch

    x, table = torch.zeros(32, 16, dtype=torch.float16), torch.zeros(2, dtype=torch.int64)
    for store_desc in (False, True):
        _, _, built[f"gemm store_desc={store_desc}"] = gemm._gemm_arguments(
            x, x, table, table, table, table, 16, 32, 1, 0, 0, 0, 1, 128, gemm.GPU_CONFIGS[0], True, True, 4, None,
            store_desc, x)
    stub = SimpleNamespace(layout=gemm.ScatterLayout(2, 8192, 128), staging=torch.zeros(1, dtype=torch.bfloat16),
                           rank=0, watch=0, timeout_ns=0)
    _, _, built["reduce"] = gemm._reduce_arguments(stub, 100, 1e-6, 4, True)  # type: ignore[arg-type]
    kernel_of = {"gemm store_desc=False": "persistent_gemm_kernel", "gemm store_desc=True": "persistent_gemm_kernel",
                 "reduce": "reduce_scattered_rows_kernel"}
    for label, meta in built.items():
        name = kernel_of.get(label, label)
        extra = set(meta) - options - set(jitted[name].arg_names)
        assert not extra, f"{label} given {sorted(extra)} by its argument builder"


@pytest.mark.slow
def test_bench_gather_prologue_smoke(tmp_path):
    """bench_gather_prologue through Triton's interpreter: both GEMMs of the tiny preset, every
    variant, the plain and gather outputs "ok" against the fp32 product."""
    from test_benchmarks_smoke import _smoke

    _, rows = _smoke("bench_gather_prologue.py", tmp_path, "--tokens", "24")
    variants = ("cublas", "triton", "triton_unflat", "gather2", "gather2_push")
    assert [(r["gemm"], r["variant"]) for r in rows] == [(g, v) for g in ("qkv", "gate_up") for v in variants]
    assert all(float(r["ms"]) > 0 and r["tokens"] == "24" for r in rows)
    checked = [r["check"] for r in rows if r["variant"] in ("triton", "gather2", "gather2_push")]
    assert checked == ["ok"] * 6, checked
