"""Compiled graphs call the hot ops' kernels directly (``weavepass.compile.direct_calls``): the
generated code names ``extern_kernels.weave_<op>`` instead of ``torch.ops.weave.<op>.default``, in
weave compiles only, and the numbers are the op's.

On a gloo group of one rank, so the portable lowering's result is ``rmsnorm(partial + residual)``:
exact equality with the op called eagerly is expected (the very same function runs), and an fp64
reference bounds both."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from torch._inductor.utils import run_and_get_code

from weavepass.backend import WeaveBackend
from weavepass.compile import direct_calls
from weavepass.ops import (
    FUSED_ALLREDUCE_LAYERNORM,
    FUSED_ALLREDUCE_RMSNORM,
    FUSED_ALLREDUCE_RMSNORM_ASYNC,
    HOT_OP_KERNELS,
    JOIN_ASYNC,
)


@pytest.fixture
def group(tmp_path):
    torch._dynamo.reset()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield dist.group.WORLD.group_name
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()


def _sync_graph(group_name):
    def f(p, r, w):
        normed, res = FUSED_ALLREDUCE_RMSNORM(p, r, w, 1e-6, group_name, p.dtype, "portable", 64)
        return normed * 2, res + 1

    return f


def _async_graph(group_name):
    def f(p, r, w, b):
        normed, res = FUSED_ALLREDUCE_RMSNORM_ASYNC(p, r, w, 1e-6, group_name, p.dtype, "portable", 64, 0)
        JOIN_ASYNC(normed, res, [p, r, w])
        ln, ln_res = FUSED_ALLREDUCE_LAYERNORM(normed, res, w, b, 1e-5, group_name, p.dtype, "portable", 64)
        return ln * 2, ln_res

    return f


def _inputs(tokens=5, hidden=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(tokens, hidden, generator=g), torch.randn(tokens, hidden, generator=g),
            torch.rand(hidden, generator=g) + 0.5]


def _calls(code: str) -> tuple[list[str], list[str]]:
    """(direct calls, dispatcher calls) of weave ops in generated code."""
    return (re.findall(r"extern_kernels\.(weave_\w+)\(", code),
            re.findall(r"torch\.ops\.weave\.(\w+)\.default\(", code))


def test_weave_compile_calls_the_kernels_directly(group):
    p, r, w = _inputs()
    expected = _sync_graph(group)(p, r, w)  # the op through the dispatcher, eagerly
    got, code = run_and_get_code(torch.compile(_sync_graph(group), backend=WeaveBackend()), p, r, w)
    direct, dispatched = _calls(code[0])
    assert direct == ["weave_fused_allreduce_rmsnorm"]
    assert dispatched == []
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # a one-rank all_reduce is the identity: normed = rmsnorm(p + r) * w, in fp64 here; the
    # fp32 op differs by rounding only (default fp32 tolerances: rtol 1.3e-6, atol 1e-5)
    x = (p + r).double()
    ref_normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    torch.testing.assert_close(got[0], (ref_normed * 2).float())
    torch.testing.assert_close(got[1], (x + 1).float())


def test_async_join_and_layer_norm_ops_are_direct_too(group):
    p, r, w = _inputs(seed=1)
    b = torch.randn(32)
    expected = _async_graph(group)(p, r, w, b)
    got, code = run_and_get_code(torch.compile(_async_graph(group), backend=WeaveBackend()), p, r, w, b)
    direct, dispatched = _calls(code[0])
    assert sorted(direct) == ["weave_fused_allreduce_layernorm", "weave_fused_allreduce_rmsnorm_async",
                              "weave_join_async"]
    assert dispatched == []
    for a, e in zip(got, expected):
        torch.testing.assert_close(a, e, rtol=0, atol=0)


def test_direct_calls_show_in_profiler_traces(group):
    """Traces keep the ops' host ranges (``weavepass.testing.trace`` reads them): one
    ``weave::fused_allreduce_rmsnorm`` range per call of the compiled graph, as through the dispatcher."""
    p, r, w = _inputs()
    compiled = torch.compile(_sync_graph(group), backend=WeaveBackend())
    compiled(p, r, w)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            compiled(p, r, w)
    names = [e.name for e in prof.events()]
    assert names.count("weave::fused_allreduce_rmsnorm") == 3, sorted(set(names))


def test_plain_inductor_keeps_the_dispatcher_call(group):
    """Only weave compiles are renamed: a plain Inductor module may be cached and loaded by a
    process that never installed the direct calls."""
    direct_calls.install()
    p, r, w = _inputs()
    _, code = run_and_get_code(torch.compile(_sync_graph(group), backend="inductor"), p, r, w)
    assert _calls(code[0]) == ([], ["fused_allreduce_rmsnorm"])


def test_switch_off_keeps_the_dispatcher_call(group, monkeypatch):
    monkeypatch.setenv("WEAVE_DIRECT_CALLS", "0")
    p, r, w = _inputs()
    _, code = run_and_get_code(torch.compile(_sync_graph(group), backend=WeaveBackend()), p, r, w)
    assert _calls(code[0]) == ([], ["fused_allreduce_rmsnorm"])


def test_every_hot_op_is_installed_as_its_own_kernel():
    """The direct call is the function the op's dispatcher kernel runs, for every hot op."""
    import importlib

    from torch._inductor.select_algorithm import extern_kernels

    assert direct_calls.install()
    assert sorted(op._opname for op in HOT_OP_KERNELS) == [  # the quantized op joined them (issue 36)
        "fused_allreduce_layernorm", "fused_allreduce_layernorm_async", "fused_allreduce_rmsnorm",
        "fused_allreduce_rmsnorm_async", "fused_allreduce_rmsnorm_push_async", "fused_allreduce_rmsnorm_quant",
        "fused_allreduce_rmsnorm_train", "join_async", "matmul_reduce_scatter_rmsnorm",
        "matmul_reduce_scatter_rmsnorm_shard",
    ]
    for op, path in HOT_OP_KERNELS.items():
        module_name, attr = path.split(":")
        direct = getattr(extern_kernels, direct_calls.extern_name(op))
        assert direct.__wrapped__ is getattr(importlib.import_module(module_name), attr)
    assert dist.is_initialized() is False


def _cached_rank(rank, world):
    """A weave compile with Inductor's FX-graph cache on, in a fresh process: (cache hits, max
    difference to eager, the report's lowerings)."""
    from torch._dynamo.utils import counters

    from weavepass import WeaveConfig
    from weavepass.testing import TPConfig, build_tp_model, random_token_ids

    config = TPConfig(vocab=100, hidden=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, intermediate=96)
    model = build_tp_model(config, rank, world, dist.group.WORLD)
    ids = random_token_ids(config, 1, 9)
    backend = WeaveBackend(WeaveConfig(fx_graph_cache=True))
    with torch.no_grad():
        diff = (torch.compile(model, backend=backend, dynamic=False)(ids) - model(ids)).abs().max().item()
    return counters["inductor"]["fxgraph_cache_hit"], diff, [r.lowering for r in backend.report.records]


def test_a_cached_weave_module_runs_in_a_fresh_process(tmp_path, monkeypatch):
    """The generated module names ``extern_kernels.weave_*``: a process that loads it from the FX
    graph cache (fresh processes, one cache directory) must have installed them first. The second
    run hits the cache and still equals eager (fp32: reductions reordered, 1e-4)."""
    from weavepass.testing import spawn

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    first = spawn(_cached_rank, 2, "gloo", timeout_s=300)
    second = spawn(_cached_rank, 2, "gloo", timeout_s=300)
    for hits, diff, lowerings in first:
        assert hits == 0 and diff < 1e-4 and lowerings and all(low == "portable" for low in lowerings)
    for hits, diff, _ in second:
        assert hits > 0, "the second run did not load the module from the cache"
        assert diff < 1e-4
