"""The GEMM-epilogue lowering in the compiler (issue 34, ``WeaveConfig.gemm_epilogue``): the
row-parallel matmul of a site moves into ``weave.matmul_reduce_scatter_rmsnorm`` (FlashComm: its
sharded form), portable lowering.

Graph-level tests run in this process on a fake group: which matmuls are replaced, the all_reduce and
the matmul gone, match counts, the reason codes where the matmul stays outside (hand-built graphs
through ``make_fx``), the planner's choice per lowering and mode. The numbers run on 2 and 3 gloo
ranks, one spawn per world size.

Tolerances (``_check_ops``), and why:

* The op computes each rank's partial as the graph's matmul did (``torch.mm`` in the input dtype,
  rounded once) and then the fused op's math (``runtime.reference``). Against the reference applied
  to the same partials (every rank rebuilds every rank's inputs from seeds), the two differ only in
  the order of an fp32 sum of N terms (the group's reduce_scatter against ``torch.stack().sum``):
  that can flip one rounding of ``residual_out`` by 1 ulp, which moves ``normed`` by at most 1 ulp on
  top of its own rounding: ``rtol = 2 eps(dtype)`` (``OP_TOL``, as tests/test_portable_lowering.py);
  at N = 2 the sum has one order, and the two are equal exactly (checked).
* Against the existing portable fused op fed with the same matmul's output, the op is equal to the
  bit: the same reduce_scatter, the same roundings (the contract this lowering keeps).
* The compiled model with the lowering against the compiled model with the plain fused op is equal
  to the bit (both compute the matmul with ``aten.mm`` on the same rows, then the same fused math);
  against eager and the fp32 reference model, ``check_against_eager``'s rule
  (``err <= 2 err_eager + atol(dtype) max(1, max|ref|)``, weavepass/testing/harness.py).
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing._internal.distributed.fake_pg import FakeStore

import weavepass
from weavepass import WeaveConfig
from weavepass.compile.patterns import find_allreduce_rmsnorm_sites
from weavepass.compile.patterns.allreduce_rmsnorm import VIEWS
from weavepass.compile.patterns.row_matmul import RowParallelMatmul, find_row_parallel_matmul
from weavepass.compile.planner import choose_gemm_epilogue
from weavepass.compile.reasons import Reason, ReasonCode
from weavepass.compile.strategies.flashcomm import force_device_kind
from weavepass.config import Lowering
from weavepass.runtime.reference import fused_allreduce_rmsnorm_reference
from weavepass.testing import check_against_eager
from weavepass.testing.distributed import spawn
from weavepass.testing.models import TPConfig, build_tp_model, random_token_ids

OP = "weave.matmul_reduce_scatter_rmsnorm.default"
SHARD_OP = "weave.matmul_reduce_scatter_rmsnorm_shard.default"
FUSED = "weave.fused_allreduce_rmsnorm.default"
AR = "_c10d_functional.all_reduce.default"
RS = "_c10d_functional.reduce_scatter_tensor.default"
MM = "aten.mm.default"
CFG = TPConfig(vocab=100, hidden=64, n_layers=2, n_heads=6, n_kv_heads=6, head_dim=16, intermediate=96)
MATMUL_SITES = 2 * CFG.n_layers  # o_proj and down_proj of each layer; the embedding's sum is no matmul
FLASHCOMM = dict(enable_flashcomm=True, flashcomm_min_prefill_tokens=1)
H, K = 64, 48
OP_TOL = {
    torch.float32: dict(rtol=2 * 2**-23, atol=1e-6),
    torch.bfloat16: dict(rtol=2 * 2**-7, atol=2 * 2**-7 * 1e-2),
    torch.float16: dict(rtol=2 * 2**-10, atol=2 * 2**-10 * 1e-2),
}


@pytest.fixture(scope="module")
def fake_world():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield dist.group.WORLD
    dist.destroy_process_group()


def compile_report(fn, *args, config=None, dynamic=False):
    backend = weavepass.make_backend(config)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(fn, backend=backend, fullgraph=True, dynamic=dynamic)(*args)
    (graph,) = backend.report.graphs
    return graph


def model_report(config, kind="portable"):
    model = build_tp_model(CFG, 0, 2, dist.group.WORLD, dtype=torch.bfloat16)
    with force_device_kind(kind):
        return compile_report(model, random_token_ids(CFG, 1, 9), config=config)


def llama_norm(x, weight, eps=1e-6):
    dtype = x.dtype
    x = x.to(torch.float32)
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)


def traced_sites(fn, *args):
    from torch._inductor.decomposition import select_decomp_table

    graph = make_fx(fn, decomposition_table=select_decomp_table())(*args).graph
    sites, rejected = find_allreduce_rmsnorm_sites(graph)
    assert not rejected, rejected
    return sites


def rows(tokens=5, k=K, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, k, generator=g).to(dtype), torch.randn(H, k, generator=g).to(dtype),
            torch.randn(tokens, H, generator=g).to(dtype), (1 + 0.1 * torch.randn(H, generator=g)).to(dtype))


# ---------------------------------------------------------------- graph level (fake group)


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.WARNING and "gemm_epilogue" in r.getMessage()]


def test_row_parallel_matmuls_move_into_the_op(fake_world, caplog):
    plain = model_report(WeaveConfig())
    with caplog.at_level(logging.INFO, logger="weavepass"):
        graph = model_report(WeaveConfig(gemm_epilogue="force"))
    assert not _warnings(caplog)  # the embedding's sum has no matmul to move: information, not a warning
    assert plain.ops_after[FUSED] == MATMUL_SITES + 1 and plain.ops_after[OP] == 0
    assert graph.ops_after[OP] == MATMUL_SITES and graph.ops_after[FUSED] == 1 and graph.ops_after[AR] == 0
    assert graph.ops_after[MM] == plain.ops_after[MM] - MATMUL_SITES
    embedding, *layers = graph.records
    assert embedding.codes == [ReasonCode.GEMM_EPILOGUE_NO_MATMUL]
    assert embedding.reasons[0].field("module") == "embed"
    for record in layers:
        assert record.codes == [ReasonCode.GEMM_EPILOGUE] and record.lowering == "portable"
        assert record.reasons[0].field("matmul") == record.matmul  # the finder's matmul is the one taken in
    assert not any(r.codes for r in plain.records)  # "off": not a word about it


def test_auto_keeps_the_fused_op_and_says_why(fake_world):
    graph = model_report(WeaveConfig(gemm_epilogue="auto"))
    assert graph.ops_after[FUSED] == MATMUL_SITES + 1 and graph.ops_after[OP] == 0
    codes = [r.codes for r in graph.records]
    assert codes == [[ReasonCode.GEMM_EPILOGUE_NO_MATMUL]] + [[ReasonCode.GEMM_EPILOGUE_UNMEASURED]] * MATMUL_SITES


def test_the_token_split_keeps_the_matmul_outside(fake_world, caplog):
    with caplog.at_level(logging.INFO, logger="weavepass"):
        graph = model_report(WeaveConfig(gemm_epilogue="force", split="force"))
    assert graph.ops_after[OP] == 0
    assert len(_warnings(caplog)) == 1 and f"{MATMUL_SITES} site(s)" in _warnings(caplog)[0]  # asked, not done
    assert [r.codes[-1] for r in graph.records[1:]] == [ReasonCode.GEMM_EPILOGUE_SPLIT] * MATMUL_SITES


def test_check_replicated_reads_the_residual_of_the_matmul_op(fake_world):
    graph = model_report(WeaveConfig(gemm_epilogue="force", check_replicated=True))
    assert graph.ops_after[OP] == MATMUL_SITES and graph.ops_after["weave.check_replicated.default"] == MATMUL_SITES + 1


def test_flashcomm_sharded_form(fake_world):
    graph = model_report(WeaveConfig(gemm_epilogue="force", **FLASHCOMM))
    assert graph.ops_after[SHARD_OP] == MATMUL_SITES and graph.ops_after[OP] == 0
    assert graph.ops_after[RS] == 1  # the embedding's sum only
    # the consumers' matmuls after each norm go into weave.all_gather_matmul (tests/test_gather_prologue.py)
    assert graph.ops_after[MM] == 0 and model_report(WeaveConfig(**FLASHCOMM)).ops_after[MM] == 7 * CFG.n_layers
    assert [r.lowering for r in graph.records] == ["flashcomm:portable"] + ["flashcomm:gemm_epilogue"] * MATMUL_SITES


def _row_chain(node: torch.fx.Node) -> list[torch.fx.Node]:
    """``node`` and the views after it to the all_reduce that sums it, each read only by the next
    (a row-parallel matmul's chain); [] when no all_reduce sums ``node`` so."""
    chain = [node]
    while len(node.users) == 1:
        (node,) = node.users
        if node.target is torch.ops._c10d_functional.all_reduce.default:
            return chain
        if node.target not in VIEWS:
            return []
        chain.append(node)
    return []


KEYWORD_CALLS: list[str] = []


def _row_matmuls_by_keyword(graph: torch.fx.Graph) -> None:
    """A pass chained before weave's (``post_grad_custom_pre_pass``) that gives each row-parallel
    ``aten.mm`` (o_proj, down_proj: an all_reduce sums it) and the views from it to the all_reduce
    every argument by keyword, ``mm(self=x, mat2=w)``, ``view(self=p, size=s)``; their names into
    ``KEYWORD_CALLS``."""
    for node in list(graph.nodes):
        if node.target is torch.ops.aten.mm.default:
            for call in _row_chain(node):
                names = [a.name for a in call.target._schema.arguments]
                call.args, call.kwargs = (), {**dict(zip(names, call.args)), **call.kwargs}
                KEYWORD_CALLS.append(call.name)


@pytest.mark.parametrize("flashcomm", [False, True], ids=["plain", "flashcomm"])
def test_row_parallel_matmuls_given_by_keyword_move_into_the_op(fake_world, flashcomm):
    """The finder and ``RowParallelMatmul`` read the matmul's operands and its views' inputs by the
    schema's names, and ``absorb`` replays the views by position: a chained pass giving them by
    keyword changes nothing (the positional reads raised IndexError)."""
    import torch._inductor.config as inductor_config

    extra = FLASHCOMM if flashcomm else {}
    op = SHARD_OP if flashcomm else OP
    want = model_report(WeaveConfig(gemm_epilogue="force", **extra))
    KEYWORD_CALLS.clear()
    with inductor_config.patch(post_grad_custom_pre_pass=_row_matmuls_by_keyword):
        graph = model_report(WeaveConfig(gemm_epilogue="force", **extra))
    assert sum(name.startswith("mm") for name in KEYWORD_CALLS) == MATMUL_SITES
    assert graph.ops_after[op] == want.ops_after[op] == MATMUL_SITES
    assert graph.ops_after == want.ops_after
    assert [r.codes for r in graph.records] == [r.codes for r in want.records]


def test_a_row_parallel_matmul_and_its_views_by_keyword(fake_world):
    """``F.linear`` of ``[B, S, K]`` rows: ``view -> mm -> view`` (``_unsafe_view``) before the
    all_reduce, the mm and the view after it given by keyword (``_row_matmuls_by_keyword``): the op
    takes the matmul in, its outputs viewed back as the positional graph's are."""
    import torch._inductor.config as inductor_config

    def f(x, w, r, nw):
        return llama_norm(funcol.all_reduce(F.linear(x, w), "sum", fake_world) + r, nw)

    x, w, r, nw = rows(tokens=6)
    args = (x.view(2, 3, K), w, r.view(2, 3, H), nw)
    want = compile_report(f, *args, config=WeaveConfig(gemm_epilogue="force"))
    KEYWORD_CALLS.clear()
    with inductor_config.patch(post_grad_custom_pre_pass=_row_matmuls_by_keyword):
        graph = compile_report(f, *args, config=WeaveConfig(gemm_epilogue="force"))
    assert len(KEYWORD_CALLS) == 2, KEYWORD_CALLS  # the mm and the view of its output
    assert graph.ops_after[OP] == want.ops_after[OP] == 1 and graph.ops_after[MM] == 0
    assert graph.ops_after == want.ops_after


def _dumped_after(tmp_path) -> str:
    """The text of every graph dumped after a strategy under ``tmp_path`` (``WeaveConfig.dump_graphs_dir``)."""
    return "\n".join(p.read_text() for p in sorted(tmp_path.rglob("*_after_*.txt")))


def test_flashcomm_on_cuda_runs_the_sharded_op_on_cuda_symm(fake_world, tmp_path, monkeypatch):
    """The CUDA form of FlashComm under ``force``: the sharded op with lowering ``cuda_symm`` replaces
    the matmul and its reduce_scatter (the run on CPU tensors falls back to the portable lowering at
    run time, with a warning: the graph is what is checked here)."""
    from weavepass.runtime.cuda import matmul

    monkeypatch.setattr(matmul, "_WARNED", set())
    graph = model_report(WeaveConfig(gemm_epilogue="force", dump_graphs_dir=str(tmp_path), **FLASHCOMM), kind="cuda")
    assert graph.ops_after[SHARD_OP] == MATMUL_SITES and graph.ops_after[RS] == 1  # the embedding's sum only
    for record in graph.records[1:]:
        assert record.lowering == "flashcomm:gemm_epilogue"
        assert not any(r.code is ReasonCode.GEMM_EPILOGUE_LOWERING for r in record.reasons)
    calls = [line for line in _dumped_after(tmp_path).splitlines()
             if "matmul_reduce_scatter_rmsnorm_shard.default(" in line]
    assert len(calls) == MATMUL_SITES and all("'cuda_symm'" in line for line in calls)


def test_fused_sites_on_cuda_symm_move_their_matmul(fake_world, tmp_path, monkeypatch):
    """A graph planned on ``cuda_symm`` (the planner's CUDA check answered yes, as on a GPU): ``force``
    moves every row-parallel matmul into the op with lowering ``cuda_symm``; the reason the lowering
    did not carry it is gone. (The run on CPU tensors falls back to portable at run time.)"""
    from weavepass.compile import planner

    monkeypatch.setattr(planner, "_cuda_unsupported_reason", lambda site: None)
    plain = model_report(WeaveConfig(lowering="cuda_symm"))
    graph = model_report(WeaveConfig(lowering="cuda_symm", gemm_epilogue="force", dump_graphs_dir=str(tmp_path)))
    assert graph.ops_after[OP] == MATMUL_SITES and graph.ops_after[FUSED] == 1 and graph.ops_after[AR] == 0
    assert graph.ops_after[MM] == plain.ops_after[MM] - MATMUL_SITES
    for record in graph.records[1:]:
        assert record.lowering == "cuda_symm" and ReasonCode.GEMM_EPILOGUE in record.codes
        assert ReasonCode.GEMM_EPILOGUE_LOWERING not in record.codes
    calls = [line for line in _dumped_after(tmp_path).splitlines() if "matmul_reduce_scatter_rmsnorm.default(" in line]
    assert len(calls) == MATMUL_SITES and all("'cuda_symm'" in line for line in calls)
    auto = model_report(WeaveConfig(lowering="cuda_symm", gemm_epilogue="auto"))
    assert auto.ops_after[OP] == 0
    assert [r.codes[-1] for r in auto.records[1:]] == [ReasonCode.GEMM_EPILOGUE_UNMEASURED] * MATMUL_SITES


def _o_proj(group, bias=False):
    """``norm(all_reduce(x @ w^T [+ b]) + r)``: a row-parallel linear feeding a site."""
    def f(x, w, r, nw):
        h = funcol.all_reduce(F.linear(x, w, torch.ones(H, dtype=x.dtype) if bias else None), "sum", group) + r
        return llama_norm(h, nw), h
    return f


@pytest.mark.parametrize("make, code, field", [
    (lambda g: lambda x, w, r, nw: llama_norm(funcol.all_reduce(F.linear(x, w), "sum", g) * 2.0 + r, nw),
     ReasonCode.GEMM_EPILOGUE_SCALED, ("factor", "2.0")),
    (lambda g: _o_proj(g, bias=True), ReasonCode.GEMM_EPILOGUE_MATMUL_BIAS, None),
    (lambda g: lambda x, w, r, nw: (llama_norm(funcol.all_reduce(F.linear(x, w), "sum", g) + r, nw),
                                    F.linear(x, w).sum()),
     None, None),  # the same product computed twice is two nodes: still replaceable
    (lambda g: lambda x, w, r, nw: _read_twice(x, w, r, nw, g), ReasonCode.GEMM_EPILOGUE_MATMUL_READ, None),
    (lambda g: lambda x, w, r, nw: llama_norm(funcol.all_reduce(F.linear(x, w).relu(), "sum", g) + r, nw),
     ReasonCode.GEMM_EPILOGUE_NO_MATMUL, None),
    (lambda g: lambda x, w, r, nw: llama_norm(
        funcol.all_reduce(torch.bmm(x.unsqueeze(0), w.t().unsqueeze(0)).squeeze(0), "sum", g) + r, nw),
     ReasonCode.GEMM_EPILOGUE_NOT_MM, None),
    (lambda g: lambda x, w, r, nw: llama_norm(
        funcol.all_reduce(F.linear(x, w), "sum", g) + funcol.all_reduce(F.linear(x, w) * 0.5, "sum", g) + r, nw),
     ReasonCode.GEMM_EPILOGUE_MERGED_SUMS, None),
    (lambda g: lambda x, w, r, nw: F.layer_norm((funcol.all_reduce(F.linear(x, w), "sum", g) + r).float(), (H,),
                                                nw.float()),
     ReasonCode.GEMM_EPILOGUE_SITE_FORM, ("form", "a LayerNorm site")),
])
def test_where_the_matmul_stays_outside(fake_world, make, code, field):
    (site,) = traced_sites(make(fake_world), *rows())
    matmul, reason = choose_gemm_epilogue(site, Lowering.PORTABLE, "force")
    if code is None:
        assert isinstance(matmul, RowParallelMatmul) and reason.code is ReasonCode.GEMM_EPILOGUE
        return
    assert matmul is None and reason.code is code, reason
    if field is not None:
        assert reason.field(field[0]) == field[1]


def _read_twice(x, w, r, nw, group):
    p = F.linear(x, w)
    return llama_norm(funcol.all_reduce(p, "sum", group) + r, nw), p * 2


def test_a_matmul_whose_rows_are_not_the_tokens(fake_world):
    """``x @ w^T`` of width H/2 viewed as ``[T/2, H]`` rows: the sum is the matmul's, but its rows
    are not the site's tokens."""
    def f(x, w, r, nw):
        return llama_norm(funcol.all_reduce(F.linear(x, w).view(-1, H), "sum", fake_world) + r, nw)

    x, w, r, nw = rows(tokens=6)
    (site,) = traced_sites(f, x, w[: H // 2], r[:3], nw)
    found = find_row_parallel_matmul(site)
    assert isinstance(found, Reason) and found.code is ReasonCode.GEMM_EPILOGUE_MATMUL_SHAPE
    assert found.field("shape") == [6, H // 2] and found.field("hidden") == H


def test_a_bias_moved_onto_the_residual_leaves_a_plain_matmul(fake_world):
    """StarCoder2's ``(S + b) + r``: the family form adds the bias row to the residual, so the sum is
    the matmul's output alone."""
    def f(x, w, r, nw, b):
        return llama_norm(funcol.all_reduce(F.linear(x, w), "sum", fake_world) + b + r, nw)

    (site,) = traced_sites(f, *rows(), torch.randn(H).to(torch.bfloat16))
    found = find_row_parallel_matmul(site)
    assert isinstance(found, RowParallelMatmul) and found.mm is site.matmul
    graph = compile_report(f, *rows(), torch.randn(H).to(torch.bfloat16), config=WeaveConfig(gemm_epilogue="force"))
    assert graph.ops_after[OP] == 1 and graph.ops_after[MM] == 0 and graph.ops_after[AR] == 0


def test_choice_per_lowering_and_mode(fake_world):
    (site,) = traced_sites(_o_proj(fake_world), *rows())
    assert choose_gemm_epilogue(site, Lowering.PORTABLE, "off") == (None, Reason(ReasonCode.NONE))
    assert choose_gemm_epilogue(site, None, "force") == (None, Reason(ReasonCode.NONE))
    for lowering in Lowering:  # both carry the op now
        matmul, reason = choose_gemm_epilogue(site, lowering, "force")
        assert isinstance(matmul, RowParallelMatmul) and reason.code is ReasonCode.GEMM_EPILOGUE
    matmul, reason = choose_gemm_epilogue(site, "npu", "force")
    assert matmul is None and reason.code is ReasonCode.GEMM_EPILOGUE_LOWERING
    for lowering in Lowering:
        _, reason = choose_gemm_epilogue(site, lowering, "auto")
        assert reason.code is ReasonCode.GEMM_EPILOGUE_UNMEASURED
    _, reason = choose_gemm_epilogue(site, Lowering.PORTABLE, "force", split="auto")
    assert reason.code is ReasonCode.GEMM_EPILOGUE_SPLIT


@pytest.mark.parametrize("speed, moved", [(1.02, True), (1.0, True), (0.97, False), (None, False)])
def test_auto_reads_the_measured_table(fake_world, monkeypatch, speed, moved):
    """``auto`` on ``cuda_symm`` moves the matmul where ``gemm.MEASURED_SPEED`` says the Triton GEMM is
    at least cuBLAS's speed for the shape (static tokens: their bucket), keeps it outside with the
    measured speed where slower, and says unmeasured where the table has no entry; the portable
    lowering has no table (its GEMM is the plain one)."""
    from weavepass.runtime.cuda import gemm

    tokens = 5
    (site,) = traced_sites(_o_proj(fake_world), *rows(tokens=tokens))
    table = {} if speed is None else {(H, K, gemm.token_bucket(tokens)): speed}
    monkeypatch.setattr(gemm, "MEASURED_SPEED", table)
    matmul, reason = choose_gemm_epilogue(site, Lowering.CUDA_SYMM, "auto")
    if moved:
        assert isinstance(matmul, RowParallelMatmul) and reason.code is ReasonCode.GEMM_EPILOGUE
        assert reason.field("mode") == "auto"
    elif speed is None:
        assert matmul is None and reason.code is ReasonCode.GEMM_EPILOGUE_UNMEASURED
    else:
        assert matmul is None and reason.code is ReasonCode.GEMM_EPILOGUE_SLOWER
        assert reason.field("speed") == speed and f"{speed}x" in str(reason)
    _, portable = choose_gemm_epilogue(site, Lowering.PORTABLE, "auto")
    assert portable.code is ReasonCode.GEMM_EPILOGUE_UNMEASURED


def test_auto_with_a_symbolic_count_needs_every_bucket(monkeypatch):
    """A symbolic token count is served by every bucket: the slowest decides, and a bucket missing
    from the table leaves it unmeasured."""
    from weavepass.runtime import matmul_measured_speed
    from weavepass.runtime.cuda import gemm

    monkeypatch.setattr(gemm, "MEASURED_SPEED", {(H, K, 2048): 1.1})
    assert matmul_measured_speed("cuda_symm", None, H, K) is None
    assert matmul_measured_speed("cuda_symm", 100, H, K) == 1.1
    monkeypatch.setattr(gemm, "MEASURED_SPEED", {(H, K, 2048): 1.1, (H, K, 8192): 0.99})
    assert matmul_measured_speed("cuda_symm", None, H, K) == 0.99
    assert matmul_measured_speed("portable", 100, H, K) is None


def test_symbolic_token_count(fake_world):
    f = _o_proj(fake_world)
    inputs = rows(tokens=6)
    for t in (inputs[0], inputs[2]):
        torch._dynamo.mark_dynamic(t, 0)
    backend = weavepass.make_backend(WeaveConfig(gemm_epilogue="force"))
    torch._dynamo.reset()
    with torch.no_grad():
        compiled = torch.compile(f, backend=backend, fullgraph=True)
        normed, h = compiled(*inputs)
        again = compiled(*rows(tokens=11))
    (graph,) = backend.report.graphs  # one graph for both token counts
    assert graph.ops_after[OP] == 1 and graph.ops_after[MM] == 0
    assert normed.shape == h.shape == (6, H) and again[0].shape == (11, H)


def test_config_is_validated():
    with pytest.raises(ValueError, match="gemm_epilogue"):
        WeaveConfig(gemm_epilogue="on")


# ---------------------------------------------------------------- numbers (gloo)


def _rank_inputs(rank, tokens, dtype):
    """Rank ``rank``'s ``x [T, K]`` and ``mat2 [K, H]`` (its slice of a row-parallel linear), and the
    replicated residual and norm weight."""
    g = torch.Generator().manual_seed(1000 * tokens + rank)
    x, w = torch.randn(tokens, K, generator=g), torch.randn(H, K, generator=g) / K**0.5
    shared = torch.Generator().manual_seed(tokens)
    r, nw = torch.randn(tokens, H, generator=shared), 1 + 0.1 * torch.randn(H, generator=shared)
    return x.to(dtype), w.t().to(dtype), r.to(dtype), nw.to(dtype)


def _check_ops(rank, world):
    """Both ops on 1 (< N), 7 and 10 tokens (not multiples of N), every dtype; returns what was checked."""
    group_name = dist.group.WORLD.group_name
    checked = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for tokens in (1, 7, 10):
            x, mat2, r, nw = _rank_inputs(rank, tokens, dtype)
            partials = [torch.mm(*_rank_inputs(peer, tokens, dtype)[:2]) for peer in range(world)]
            ref_normed, ref_res = fused_allreduce_rmsnorm_reference(partials, r, nw, 1e-6, dtype)
            normed, res = torch.ops.weave.matmul_reduce_scatter_rmsnorm(x, mat2, r, nw, 1e-6, group_name, dtype,
                                                                      "portable", 0)
            fused = torch.ops.weave.fused_allreduce_rmsnorm(torch.mm(x, mat2), r, nw, 1e-6, group_name, dtype,
                                                            "portable", 0)
            assert torch.equal(normed, fused[0]) and torch.equal(res, fused[1])  # the fused op's contract
            tol = OP_TOL[dtype] if world > 2 else dict(rtol=0, atol=0)
            torch.testing.assert_close(res, ref_res, **tol)
            torch.testing.assert_close(normed, ref_normed, **tol)
            # The sharded form: this rank's rows of a stream padded to 16 N rows (FlashComm's), the
            # residual's shard added; padding rows are zero.
            per_rank = -(-tokens // (16 * world)) * 16
            lo, hi = min(rank * per_rank, tokens), min((rank + 1) * per_rank, tokens)
            shard_r = torch.zeros(per_rank, H, dtype=dtype)
            shard_r[: hi - lo] = r[lo:hi]
            s_normed, s_res = torch.ops.weave.matmul_reduce_scatter_rmsnorm_shard(
                x, mat2, shard_r, nw, 1e-6, group_name, dtype, per_rank, "portable", 0)
            assert s_normed.shape == s_res.shape == (per_rank, H)
            torch.testing.assert_close(s_res[: hi - lo], ref_res[lo:hi], **tol)
            torch.testing.assert_close(s_normed[: hi - lo], ref_normed[lo:hi], **tol)
            assert not s_normed[hi - lo:].any() and not s_res[hi - lo:].any()
            checked.append((str(dtype), tokens))
    return checked


def _check_model(rank, world, dtype, config, kind="portable"):
    """The TP model compiled with ``config`` against eager and the fp32 reference; returns its
    output and the report's lowerings."""
    def model_fn(d):
        return build_tp_model(CFG, rank, world, dist.group.WORLD, dtype=d or dtype)

    backend = weavepass.make_backend(config)
    outputs = []

    def compile_fn(model):
        compiled = torch.compile(model, backend=backend, dynamic=False)
        return lambda *args: outputs.append(compiled(*args)) or outputs[-1]

    torch._dynamo.reset()
    with force_device_kind(kind):
        check_against_eager(model_fn(None), random_token_ids(CFG, 1, 7, seed=3), compile_fn, model_fn(torch.float32))
    (graph,) = backend.report.graphs
    return outputs[0], graph.ops_after[OP] + graph.ops_after[SHARD_OP]


def _check_symbolic(rank, world):
    """One site compiled with a symbolic token count, run at 7 and 10 tokens (one graph): the outputs
    against the reference on every rank's partials (``OP_TOL``: the fp32 sum's order)."""
    backend = weavepass.make_backend(WeaveConfig(gemm_epilogue="force"))
    torch._dynamo.reset()
    compiled = torch.compile(_o_proj(dist.group.WORLD), backend=backend, fullgraph=True)
    for tokens in (7, 10):
        x, mat2, r, nw = _rank_inputs(rank, tokens, torch.bfloat16)
        for t in (x, r):
            torch._dynamo.mark_dynamic(t, 0)
        with torch.no_grad():
            normed, h = compiled(x, mat2.t(), r, nw)
        partials = [torch.mm(*_rank_inputs(peer, tokens, torch.bfloat16)[:2]) for peer in range(world)]
        ref_normed, ref_res = fused_allreduce_rmsnorm_reference(partials, r, nw, 1e-6, torch.bfloat16)
        torch.testing.assert_close(h, ref_res, **OP_TOL[torch.bfloat16])
        torch.testing.assert_close(normed, ref_normed, **OP_TOL[torch.bfloat16])
    (graph,) = backend.report.graphs
    return graph.ops_after[OP]


def _numbers_rank(rank, world):
    checked = _check_ops(rank, world)
    symbolic = _check_symbolic(rank, world) if world == 3 else None
    dtype = torch.bfloat16 if world == 2 else torch.float16
    plain, _ = _check_model(rank, world, dtype, WeaveConfig())
    out, replaced = _check_model(rank, world, dtype, WeaveConfig(gemm_epilogue="force"))
    assert replaced == MATMUL_SITES and torch.equal(out, plain)
    flashcomm = None
    if world == 2:  # the sharded form: the fused op's math on the shard, not the graph's own norm ops
        _, flashcomm = _check_model(rank, world, dtype, WeaveConfig(gemm_epilogue="force", **FLASHCOMM))
    return checked, replaced, flashcomm, symbolic


@pytest.mark.parametrize("world", [2, 3])
def test_numbers_against_eager_and_the_reference(world):
    results = spawn(_numbers_rank, world, "gloo")
    for checked, replaced, flashcomm, symbolic in results:
        assert len(checked) == 9 and replaced == MATMUL_SITES
        assert flashcomm == (MATMUL_SITES if world == 2 else None)
        assert symbolic == (1 if world == 3 else None)
