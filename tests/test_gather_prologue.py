"""The gather prologue in the compiler and its portable lowering (issue 34 item 3):
``weave.all_gather_matmul`` takes FlashComm's all_gather of a normed shard and the column-parallel
matmuls that read the gathered rows (QKV, gate_up) under ``gemm_epilogue="force"``.

Graph level on a fake group: which matmuls are replaced, which collectives remain, the match count,
the notes (``auto`` keeps the gather and says why). Numbers on 2 and 3 gloo ranks: the op against
``torch.mm`` on the gathered rows (the portable lowering is all_gather + ``torch.mm``: equal to the
bit) and the fp32 product (tolerance below), the ``cuda_symm`` lowering's fallback on CPU tensors,
and the TP model with FlashComm under ``force`` against eager and the fp32 reference
(``check_against_eager``'s rule). The kernels: tests/test_gather_interpreted.py, tests/gpu/test_gather_gpu.py.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from test_gemm_epilogue import (
    CFG,
    FLASHCOMM,
    MM,
    RS,
    SHARD_OP,
    _check_model,
    _dumped_after,
    model_report,
)
from test_gemm_epilogue import fake_world as fake_world_fixture  # noqa: F401 (a fixture)

from weavepass import WeaveConfig
from weavepass.compile.patterns.allreduce_rmsnorm import VIEWS
from weavepass.compile.patterns.rmsnorm import is_target
from weavepass.compile.reasons import ReasonCode
from weavepass.testing.distributed import spawn

GATHER_OP = "weave.all_gather_matmul.default"
AG = "_c10d_functional.all_gather_into_tensor.default"
FUSED_AG = "symm_mem.fused_all_gather_matmul.default"
NORM_SITES = 2 * CFG.n_layers  # the norms before each layer's attention and MLP; the final norm feeds the output
# The product against the fp32 one of the same rounded rows: torch.mm in bf16/fp16 accumulates in fp32 (on
# CPU in another order) and rounds once: half an ulp plus the order's fp32 error, within one ulp (rtol).
# atol: that order error is absolute, at most K 2^-24 sum|a b| = 24 2^-24 32 ~ 5e-5 for these rows
# (sum|a b| <= 30 here), which one ulp of an output near 0 does not cover; the same in both dtypes.
PRODUCT_TOL = {torch.bfloat16: dict(rtol=2**-7, atol=1e-4), torch.float16: dict(rtol=2**-10, atol=1e-4)}


@pytest.mark.usefixtures("fake_world_fixture")
def test_force_moves_the_consumer_matmuls_into_the_op():
    plain = model_report(WeaveConfig(**FLASHCOMM))
    graph = model_report(WeaveConfig(gemm_epilogue="force", **FLASHCOMM))
    assert plain.ops_after[GATHER_OP] == 0 and plain.ops_after[AG] == NORM_SITES + 1
    assert graph.ops_after[GATHER_OP] == NORM_SITES  # q, k, v and gate, up of each layer, one op per norm
    assert graph.ops_after[AG] == 1  # the final norm's gather: its reader is the graph output, not a matmul
    assert graph.ops_after[MM] == 0 and plain.ops_after[MM] == 7 * CFG.n_layers  # o and down: the shard op
    assert graph.ops_after[SHARD_OP] == 2 * CFG.n_layers and graph.ops_after[RS] == 1
    *layers, final = graph.records
    for record in layers:
        fused = [r for r in record.notes if r.code is ReasonCode.FLASHCOMM_CONSUMERS_FUSED]
        assert len(fused) == 1 and fused[0].field("op") == "weave.all_gather_matmul", record.notes
    (kept,) = [r for r in final.notes if r.code is ReasonCode.FLASHCOMM_GATHER_NOT_FUSED]
    assert kept.field("cause").code is ReasonCode.FLASHCOMM_READER_NOT_MM


def _summed(node: torch.fx.Node) -> bool:
    """Whether ``node`` reaches an all_reduce through views: a row-parallel matmul's output."""
    return any(is_target(u, {torch.ops._c10d_functional.all_reduce.default})
               or (is_target(u, VIEWS) and _summed(u)) for u in node.users)


KEYWORD_MMS: list[str] = []


def _consumer_mms_by_keyword(graph: torch.fx.Graph) -> None:
    """A pass chained before weave's (``post_grad_custom_pre_pass``) that gives the column-parallel
    ``aten.mm.default`` calls (q, k, v, gate, up: those no all_reduce sums) their arguments by
    keyword, ``mm(self=rows, mat2=weight)``; their names into ``KEYWORD_MMS``."""
    for node in graph.nodes:
        if node.target is torch.ops.aten.mm.default and not _summed(node):
            node.args, node.kwargs = (), {"self": node.args[0], "mat2": node.args[1]}
            KEYWORD_MMS.append(node.name)


@pytest.mark.usefixtures("fake_world_fixture")
def test_consumer_matmuls_given_by_keyword_move_into_the_op():
    """``row_matmuls`` reads each reader's rows by the schema's name (``self``): matmuls whose
    arguments a chained pass gave by keyword move into the op as positional ones do. (Reading
    ``reader.args[0]`` raised IndexError on them.)"""
    import torch._inductor.config as inductor_config

    KEYWORD_MMS.clear()
    with inductor_config.patch(post_grad_custom_pre_pass=_consumer_mms_by_keyword):
        graph = model_report(WeaveConfig(gemm_epilogue="force", **FLASHCOMM))
    assert len(KEYWORD_MMS) == 5 * CFG.n_layers  # every layer's q, k, v, gate, up
    assert graph.ops_after[GATHER_OP] == NORM_SITES and graph.ops_after[AG] == 1 and graph.ops_after[MM] == 0
    *layers, _ = graph.records
    for record in layers:
        fused = [r for r in record.notes if r.code is ReasonCode.FLASHCOMM_CONSUMERS_FUSED]
        assert len(fused) == 1, record.notes


@pytest.mark.usefixtures("fake_world_fixture")
def test_auto_keeps_the_gather_and_says_why():
    graph = model_report(WeaveConfig(gemm_epilogue="auto", **FLASHCOMM))
    assert graph.ops_after[GATHER_OP] == 0 and graph.ops_after[AG] == NORM_SITES + 1
    for record in graph.records:
        (note,) = [r for r in record.notes if r.code is ReasonCode.FLASHCOMM_GATHER_NOT_FUSED]
        assert note.field("cause").code is ReasonCode.GEMM_EPILOGUE_UNMEASURED
    off = model_report(WeaveConfig(**FLASHCOMM))
    assert not any(r.code is ReasonCode.FLASHCOMM_GATHER_NOT_FUSED for rec in off.records for r in rec.notes)


@pytest.mark.usefixtures("fake_world_fixture")
def test_the_cuda_form_runs_the_op_on_cuda_symm(tmp_path):
    """FlashComm's CUDA form under ``force``: the op with lowering ``cuda_symm``, not PyTorch's
    ``fused_all_gather_matmul`` even with ``enable_mmrs_fusion`` (the graph is what is checked; on
    CPU tensors the run falls back to portable)."""
    graph = model_report(WeaveConfig(gemm_epilogue="force", enable_mmrs_fusion=True, dump_graphs_dir=str(tmp_path),
                                     **FLASHCOMM), kind="cuda")
    assert graph.ops_after[GATHER_OP] == NORM_SITES and graph.ops_after[FUSED_AG] == 0 and graph.ops_after[MM] == 0
    calls = [line for line in _dumped_after(tmp_path).splitlines() if "all_gather_matmul.default(" in line]
    assert len(calls) == NORM_SITES and all("'cuda_symm'" in line for line in calls)


# ---------------------------------------------------------------- numbers (gloo)


def _shard(rank, per_rank, tokens, k, dtype):
    """Rank ``rank``'s FlashComm shard of ``tokens`` rows (zero padding past them) and the full rows."""
    full = torch.randn(tokens, k, generator=torch.Generator().manual_seed(tokens)).to(dtype)
    shard = torch.zeros(per_rank, k, dtype=dtype)
    lo, hi = min(rank * per_rank, tokens), min((rank + 1) * per_rank, tokens)
    shard[: hi - lo] = full[lo:hi]
    return shard, full


def _check_op(rank, world):
    group_name = dist.group.WORLD.group_name
    checked = []
    for dtype in (torch.bfloat16, torch.float16):
        for tokens in (1, 7, 37):  # fewer than the ranks, and counts no multiple of N or 16
            per_rank = -(-tokens // (16 * world)) * 16
            shard, full = _shard(rank, per_rank, tokens, 24, dtype)
            g = torch.Generator().manual_seed(99)
            mat2s = [torch.randn(24, n, generator=g).to(dtype) for n in (40, 8)]
            out = torch.ops.weave.all_gather_matmul(shard, mat2s, group_name, tokens, "portable", 0)
            with warnings.catch_warnings(record=True):  # CPU tensors: cuda_symm falls back to portable, warned
                warnings.simplefilter("always")
                fallback = torch.ops.weave.all_gather_matmul(shard, mat2s, group_name, tokens, "cuda_symm", 1024)
            for got, again, mat2 in zip(out, fallback, mat2s, strict=True):
                assert got.shape == (tokens, mat2.shape[1])
                assert torch.equal(got, torch.mm(full, mat2)) and torch.equal(again, got)
                torch.testing.assert_close(got.float(), full.float() @ mat2.float(), **PRODUCT_TOL[dtype])
            checked.append((str(dtype), tokens))
    return checked


def _numbers_rank(rank, world):
    checked = _check_op(rank, world)
    dtype = torch.bfloat16 if world == 2 else torch.float16
    _, replaced = _check_model(rank, world, dtype, WeaveConfig(gemm_epilogue="force", **FLASHCOMM))
    return checked, replaced


@pytest.mark.parametrize("world", [2, 3])
def test_numbers_against_torch_mm_eager_and_the_reference(world):
    for checked, replaced in spawn(_numbers_rank, world, "gloo"):
        assert len(checked) == 6 and replaced == 2 * CFG.n_layers


@pytest.mark.usefixtures("fake_world_fixture")
def test_force_on_a_lowering_without_the_op_says_why_the_gather_stays():
    """The NPU form without ``enable_mmrs_fusion`` runs its matmuls on the ``npu`` lowering, which
    has no kernel of ``weave.all_gather_matmul``: under ``force`` every site keeps its gather and
    its note says so, as the row-parallel side's ``GEMM_EPILOGUE_LOWERING`` does (it said nothing)."""
    from weavepass.testing.npu_emulator import emulated_torch_npu

    with emulated_torch_npu():
        graph = model_report(WeaveConfig(gemm_epilogue="force", **FLASHCOMM), kind="npu")
    assert graph.ops_after[GATHER_OP] == 0 and graph.ops_after[AG] == NORM_SITES + 1
    for record in graph.records:
        (note,) = [r for r in record.notes if r.code is ReasonCode.FLASHCOMM_GATHER_NOT_FUSED]
        cause = note.field("cause")
        assert cause.code is ReasonCode.GEMM_EPILOGUE_LOWERING and cause.field("lowering") == "npu", note
        assert "weave.all_gather_matmul" in note.render(), note.render()


def test_the_cuda_symm_reason_names_the_dtypes_it_refuses():
    """``gather_op.unsupported_reason`` on CUDA operands (fake tensors: no GPU needed) names every
    dtype of a mixed call, as the scatter op's reason does; it said ``not torch.bfloat16`` for bf16
    rows with fp16 weights, as if bf16 were refused."""
    pytest.importorskip("triton")
    from torch._subclasses.fake_tensor import FakeTensorMode

    from weavepass.runtime.cuda import gather_op

    with FakeTensorMode():
        shard = torch.empty(16, 64, dtype=torch.bfloat16, device="cuda")
        mixed = [torch.empty(64, 32, dtype=torch.bfloat16, device="cuda"),
                 torch.empty(64, 8, dtype=torch.float16, device="cuda")]
        fp32 = [torch.empty(16, 64, dtype=torch.float32, device="cuda"),
                torch.empty(64, 32, dtype=torch.float32, device="cuda")]
    why = gather_op.unsupported_reason(shard, mixed, "unused", 16)
    assert why is not None and "torch.float16" in why and why.endswith("not torch.bfloat16 rows and "
                                                                      "torch.bfloat16, torch.float16 weights"), why
    why = gather_op.unsupported_reason(fp32[0], fp32[1:], "unused", 16)
    assert why is not None and why.endswith("not torch.float32 rows and torch.float32 weights"), why


def _capture_causes_rank(rank, world):
    """``all_gather_matmul_cuda`` inside a (pretended) CUDA-graph capture at a gloo group of one, the
    symmetric allocation replaced by CPU tensors: a split new there, then a workspace new there. Both
    run the portable lowering (no kernel launches); returns the causes warned."""
    from weavepass.runtime.cuda import gather_op, workspace

    workspace.new_symmetric = lambda group_name, dtype, device, numel, pad_slots: workspace.SymmetricBuffer(
        torch.zeros(numel, dtype=dtype), torch.zeros(pad_slots, dtype=torch.int32), [0], [0], 0, 1)
    workspace.outside_graph_pools = lambda make, device: make()
    gather_op.unsupported_reason = lambda *args: None  # CPU tensors stand for CUDA ones
    group = dist.group.WORLD.group_name
    k = 16
    assert gather_op.get_workspace(group, torch.float16, torch.device("cpu"), k, 32, 1024) is not None  # warm-up
    gather_op._capturing = lambda: True
    mat2s = [torch.randn(k, 8).to(torch.float16)]
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        gather_op.all_gather_matmul_cuda(torch.randn(32, k).to(torch.float16), mat2s, group, 20,
                                         max_workspace_tokens=1024)  # fits the cached workspace; new split
        gather_op.all_gather_matmul_cuda(torch.randn(600, k).to(torch.float16), mat2s, group, 600,
                                         max_workspace_tokens=1024)  # needs a new workspace
    from weavepass.runtime.cuda.matmul import FALLBACKS

    return sorted(gather_op._WARNED), dict(FALLBACKS)


def test_a_fallback_inside_capture_names_what_is_new():
    """A call whose split is new inside CUDA-graph capture (its workspace exists) says so, as the
    scatter op does; it said the tokens needed a workspace past the limit and to raise
    ``cuda_workspace_tokens``, which would not help. Each fallback is counted in
    ``runtime.cuda.matmul.FALLBACKS`` as the matmul ops' are (benchmarks read it)."""
    pytest.importorskip("triton")
    ((causes, counted),) = spawn(_capture_causes_rank, 1, "gloo")
    assert counted == {cause: 1 for cause in causes}  # every fallback counted (matmul.FALLBACKS), once each
    split_cause = "the split of 20 tokens is new inside CUDA-graph capture (a warm-up call builds it)"
    assert split_cause in causes and len(causes) == 2, causes
    (workspace_cause,) = set(causes) - {split_cause}
    assert workspace_cause.startswith("600 tokens need a gather workspace") and "capture" in workspace_cause
