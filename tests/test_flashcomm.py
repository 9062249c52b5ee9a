"""FlashComm (issue 5) on CPU: the decision, the graph rewrite, and numerics on gloo.

Graph tests trace on a fake process group (no communication). Numeric tests spawn gloo worlds of 2
and 3 ranks and compare each compiled model with its eager self against an fp32 eager reference of
the same TP model (``check_against_eager``: ``err_compiled <= 2 * err_eager + atol[dtype] *
max(1, max|ref|)``, atol = 2^-7 for bf16, 2^-10 for fp16 (one ulp: the shard's norm may round once
differently from eager), 1e-4 for fp32). The NPU path runs against
``weavepass.testing.npu_emulator``: the real torch_npu schemas, the wrapper's and CANN's documented
checks per chip, and CANN's reference rounding for ``npu_add_rms_norm`` (on Ascend910B/910_93 it
rounds ``x * rstd`` to bf16 before the gamma multiply, or multiplies gamma in fp16, as eager's
``w * normed.to(dtype)`` does; on Ascend950 it rounds once from fp32). Every compile uses
``dynamic=False``: FlashComm qualifies static token counts only.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from weavepass import WeaveConfig, make_backend
from weavepass.compile.reasons import Reason, ReasonCode
from weavepass.compile.strategies.flashcomm import force_device_kind
from weavepass.compile.tokens import TokenCount
from weavepass.runtime import npu
from weavepass.testing import (
    TPConfig,
    build_tp_model,
    check_against_eager,
    fake_process_group,
    random_token_ids,
    spawn,
)
from weavepass.testing.npu_emulator import (
    TORCH_NPU_SCHEMAS,
    EmulatedTorchNPU,
    add_rms_norm_reference,
    bind,
    emulated_torch_npu,
)

# o_proj's k = 4 * 128 / world and down_proj's k = 512 / world are >= 256 for world 2, so MMRS
# applies there; at world 3 the emulated op refuses the world size and everything falls back.
DENSE = TPConfig(vocab=100, hidden=64, n_layers=1, n_heads=6, n_kv_heads=6, head_dim=96,
                 intermediate=516, dtype=torch.bfloat16)
MOE = TPConfig(vocab=100, hidden=64, n_layers=1, n_heads=6, n_kv_heads=6, head_dim=96,
               intermediate=516, n_experts=2, top_k=1, dtype=torch.bfloat16)
ON = dict(enable_flashcomm=True, flashcomm_min_prefill_tokens=1, split="off")


def _compile(config: WeaveConfig):
    backend = make_backend(config)
    return backend, lambda m: torch.compile(m, backend=backend, dynamic=False)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class TwoSites(nn.Module):
    """``h`` [T, H] from outside -> two row-parallel MLP sites (``ks[i]`` columns per rank) -> norm.

    The first site's residual is the graph input (FlashComm shards it with ``flashcomm_shard_rows``).
    With ``biases[i]`` site i's down projection is an addmm (bias / world per rank: added once).
    """

    def __init__(self, ks, biases, dtype, rank: int, world: int, hidden: int = 64):
        # hidden >= 256 lets npu_all_gather_base_mm take the gather before up[1] (k = hidden)
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        p = lambda t: nn.Parameter(t.to(dtype), requires_grad=False)  # noqa: E731
        self.up, self.down, self.bias, self.norms = nn.ParameterList(), nn.ParameterList(), [], nn.ParameterList()
        for k, bias in zip(ks, biases):
            up = torch.randn(k * world, hidden, generator=gen) / math.sqrt(hidden)
            down = torch.randn(hidden, k * world, generator=gen) / math.sqrt(k * world)
            self.up.append(p(up[rank * k:(rank + 1) * k]))
            self.down.append(p(down[:, rank * k:(rank + 1) * k]))
            self.bias.append(p(torch.randn(hidden, generator=gen) / world) if bias else None)
        for _ in range(3):
            self.norms.append(p(1 + 0.1 * torch.randn(hidden, generator=gen)))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for i in range(2):
            y = F.silu(F.linear(_rms(h, self.norms[i]), self.up[i]))
            h = h + funcol.all_reduce(F.linear(y, self.down[i], self.bias[i]), "sum", dist.group.WORLD)
        return _rms(h, self.norms[2])


class SharedExpertTwoSites(TwoSites):
    """``TwoSites`` with Qwen2-MoE's shared expert at both sites: a replicated, gated branch of the
    normed rows added to the experts' sum before the residual add, ``(S + x) + h``. At the first
    site ``h`` comes from outside; at the second it is the carried stream."""

    def __init__(self, dtype, rank: int, world: int):
        super().__init__((256, 256), (False, False), dtype, rank, world)
        gate = torch.randn(1, 64, generator=torch.Generator().manual_seed(1)) / 8
        self.gate = nn.Parameter(gate.to(dtype), requires_grad=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for i in range(2):
            x = _rms(h, self.norms[i])
            shared = torch.sigmoid(F.linear(x, self.gate)) * torch.tanh(x)
            y = F.silu(F.linear(x, self.up[i]))
            h = funcol.all_reduce(F.linear(y, self.down[i]), "sum", dist.group.WORLD) + shared + h
        return _rms(h, self.norms[2])


class BrokenStream(nn.Module):
    """The second site's residual is ``2 * h``, not the first site's output: not shardable."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(64, 64), requires_grad=False)
        self.g = nn.Parameter(torch.ones(64), requires_grad=False)

    def forward(self, h):
        h = h + funcol.all_reduce(h @ self.w, "sum", dist.group.WORLD)
        y = _rms(h, self.g)
        h = 2 * h + funcol.all_reduce(y @ self.w, "sum", dist.group.WORLD)
        return _rms(h, self.g)


@contextlib.contextmanager
def symm_mem_on_cpu():
    """PyTorch's symmetric-memory fused ops as their unfused fallbacks, also on CPU.

    The fused ops have CUDA kernels only; their reference fallbacks (functional collectives) run
    anywhere, so the CUDA rewrite's graph (padding, slicing, weight order) is checked on gloo.
    """
    import torch.distributed._symmetric_memory as symm_mem

    lib = torch.library.Library("symm_mem", "IMPL")
    lib.impl("fused_matmul_reduce_scatter", symm_mem._fused_matmul_reduce_scatter_fallback, "CPU")
    lib.impl("fused_all_gather_matmul", symm_mem._fused_all_gather_matmul_fallback, "CPU")
    try:
        with symm_mem._test_mode():
            yield
    finally:
        lib._destroy()


# ---------------------------------------------------------------------------------------------
# Decision and graph (fake process group)


def test_padding_rule():
    assert TokenCount(1).padded(2) == 32
    assert TokenCount(32).padded(2) == 32
    assert TokenCount(33).padded(2) == 64
    assert TokenCount(2).padded(3) == 48
    assert TokenCount(8192).padded(8) == 8192


A2, A3, A950 = "Ascend910B3", "Ascend910_9382", "Ascend950PR"


def _target(chip: str, mode: str = "auto") -> npu.FusedCommTarget:
    with emulated_torch_npu(chip):
        return npu.fused_comm_target(mode)


@pytest.mark.parametrize("chip, mode, resolved, issue, fields", [
    (A2, "auto", "aiv", None, {}),
    (A3, "auto", "aiv", None, {}),
    (A950, "auto", "ccu", None, {}),
    (A2, "ai_cpu", "ai_cpu", None, {}),
    (A2, "none", "none", None, {}),
    (A950, "ccu", "ccu", None, {}),
    (A2, "ccu", "ccu", npu.NpuIssue.COMM_MODE, {"mode": "ccu", "family": "Atlas A2"}),
    (A950, "aiv", "aiv", npu.NpuIssue.COMM_MODE, {"mode": "aiv", "family": "Ascend 950"}),
    (A950, "none", "none", npu.NpuIssue.COMM_MODE, {"mode": "none", "family": "Ascend 950"}),
    ("Ascend310P3", "auto", "auto", npu.NpuIssue.UNKNOWN_CHIP, {"chip": "Ascend310P3"}),
])
def test_comm_mode_per_chip(chip, mode, resolved, issue, fields):
    target = _target(chip, mode)
    assert (target.device_name, target.comm_mode) == (chip, resolved)
    if issue is None:
        assert target.reason is None
    else:
        assert target.reason is not None and target.reason.issue is issue
        assert {k: v for k, v in target.reason.fields if k in fields} == fields, target.reason


def test_unreadable_chip_name_turns_the_fused_ops_off(monkeypatch):
    monkeypatch.setattr(npu, "resolve_torch_npu", lambda: (_ for _ in ()).throw(RuntimeError("no torch_npu")))
    reason = npu.fused_comm_target("auto").reason
    assert reason is not None and reason.issue is npu.NpuIssue.NO_CHIP_NAME
    assert str(reason) == "cannot read the NPU chip name: no torch_npu"  # rendering test: a runtime issue


_OK = dict(x_shape=(64, 256), x_stride=(256, 1), x_dtype=torch.bfloat16, w_shape=(256, 32),
           w_stride=(32, 1), w_dtype=torch.bfloat16, world_size=2, has_bias=False)


@pytest.mark.parametrize("op", [npu.MMRS, npu.AGMM])
def test_matmul_comm_conditions(op):
    a2 = _target(A2)
    assert npu.matmul_comm_unsupported_reason(op, a2, **_OK) is None
    assert npu.matmul_comm_unsupported_reason(op, a2, **{**_OK, "w_stride": (1, 256)}) is None  # w.t()
    issue = npu.NpuIssue
    for chip, change, code in [
        (A2, dict(x_shape=(64, 128), x_stride=(128, 1), w_shape=(128, 32)), issue.K_RANGE),
        (A2, dict(has_bias=True), issue.BIAS),
        (A2, dict(x_dtype=torch.float32, w_dtype=torch.float32), issue.DTYPES),
        (A2, dict(w_dtype=torch.float16), issue.DTYPES),
        (A2, dict(world_size=3), issue.WORLD_SIZE),
        (A2, dict(world_size=16), issue.WORLD_SIZE),
        (A3, dict(world_size=16), issue.WORLD_SIZE_FAILING),
        (A3, dict(world_size=32), issue.WORLD_SIZE_FAILING),
        (A950, dict(world_size=16), issue.WORLD_SIZE_FAILING),
        (A2, dict(x_stride=(1, 64)), issue.X1_LAYOUT),
        (A2, dict(w_stride=(64, 1)), issue.X2_LAYOUT),
        (A2, dict(w_stride=(1, 512)), issue.X2_LAYOUT),
        (A2, dict(x_shape=(64, 65535), w_shape=(65535, 32), x_stride=(65535, 1)), issue.K_RANGE),
    ]:
        reason = npu.matmul_comm_unsupported_reason(op, _target(chip), **{**_OK, **change})
        assert reason is not None and reason.issue is code, (chip, change, reason)
    k_small = npu.matmul_comm_unsupported_reason(op, a2, **{**_OK, "x_shape": (64, 128), "x_stride": (128, 1),
                                                             "w_shape": (128, 32)})
    assert str(k_small) == "k=128 is outside [256, 65535)"  # rendered
    odd_m = npu.matmul_comm_unsupported_reason(op, a2, **{**_OK, "x_shape": (63, 256)})
    assert (odd_m is not None and odd_m.issue is issue.M_NOT_DIVISIBLE) if op == npu.MMRS else odd_m is None
    huge = dict(x_shape=(2**20, 4096), x_stride=(4096, 1), w_shape=(4096, 32))  # 16 GiB gathered on 2
    too_much = npu.matmul_comm_unsupported_reason(npu.AGMM, _target(A950), **{**_OK, **huge})
    assert too_much is not None and too_much.issue is issue.GATHER_BYTES


@pytest.mark.parametrize("op", [npu.MMRS, npu.AGMM])
def test_chip_rules_agree_with_the_emulated_op(op):
    """Every (chip, comm_mode, world size) the policy accepts runs on the emulated op, and every one
    the emulator (torch_npu's wrapper + CANN's docs, written independently) rejects is refused. The
    one stricter policy rule is vllm-ascend's 16-rank limit."""
    refused_by_field_rule = 0
    for chip in (A2, A3, A950):
        for mode in ("aiv", "ai_cpu", "ccu", "none"):
            for world in (2, 4, 8, 16, 32):
                target = _target(chip, mode)
                reason = npu.matmul_comm_unsupported_reason(op, target, **{**_OK, "world_size": world})
                with fake_process_group(world) as group:
                    emulator = EmulatedTorchNPU(chip)
                    x, w = torch.ones(64, 256, dtype=torch.bfloat16), torch.ones(256, 32, dtype=torch.bfloat16)
                    kwargs = {} if mode == "none" else {"comm_mode": mode}
                    try:
                        getattr(emulator, op)(x, w, emulator.hccl_comm_name(group), world, **kwargs)
                        emulated_error = None
                    except RuntimeError as error:
                        emulated_error = str(error)
                if reason is None:
                    assert emulated_error is None, (chip, mode, world, emulated_error)
                elif emulated_error is None:
                    assert reason.issue is npu.NpuIssue.WORLD_SIZE_FAILING, (chip, mode, world, reason)
                    refused_by_field_rule += 1
    assert refused_by_field_rule == 2 * 2 + 2  # A3 ai_cpu/none at 16 and 32, A950 ccu at 16 and 32


def test_emulator_binds_by_the_real_schema():
    x, w = torch.ones(64, 256, dtype=torch.bfloat16), torch.ones(256, 32, dtype=torch.bfloat16)
    assert set(TORCH_NPU_SCHEMAS) == {"npu_mm_reduce_scatter_base", "npu_all_gather_base_mm", "npu_add_rms_norm"}
    bound = bind("npu_mm_reduce_scatter_base", (x, w, "hcom", 2), {"comm_mode": "aiv"})
    assert (bound["reduce_op"], bound["bias"], bound["comm_turn"], bound["comm_mode"]) == ("sum", None, 0, "aiv")
    assert bind("npu_add_rms_norm", (x, x, w[:, 0]), {})["epsilon"] == 1e-6
    with pytest.raises(TypeError, match="unexpected keyword argument 'input'"):
        bind("npu_mm_reduce_scatter_base", (), dict(input=x, x2=w, hcom="h", world_size=2))
    with pytest.raises(TypeError, match="positional"):  # reduce_op is keyword-only
        bind("npu_mm_reduce_scatter_base", (x, w, "h", 2, "sum"), {})
    with pytest.raises(TypeError, match="'world_size' must be int"):
        bind("npu_all_gather_base_mm", (x, w, "h", "2"), {})
    with pytest.raises(TypeError, match="missing required argument 'gamma'"):
        bind("npu_add_rms_norm", (x, x), {})


def _ulp_errors(y: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|y - ref| / (u |ref|), u the unit roundoff of y's dtype, where ref is a normal number of
    that dtype (below, fp16 subnormals round with a fixed absolute step, not a relative one)."""
    info = torch.finfo(y.dtype)
    normal = ref.abs() >= 2 * info.tiny
    return (y.double() - ref).abs()[normal] / (ref.abs()[normal] * info.eps / 2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_add_rms_norm_rounds_like_cann(dtype):
    """On Ascend910B/910_93 y rounds twice (``x * rstd``, then the gamma product); on Ascend950
    once. Either way each rounding is at most half an ulp, so y is within 2 unit roundoffs (u) of
    the exact ``x * rstd * gamma`` (of the op's rounded ``x`` on A2/A3, of the exact sum on
    Ascend950; plus u^2); the two-rounding chip
    must exceed 1 u somewhere (a single rounding never does), or the rule is not in force."""
    gen = torch.Generator().manual_seed(0)
    x1, x2 = (torch.randn(64, 256, generator=gen).to(dtype) for _ in range(2))
    gamma = (1 + 0.5 * torch.randn(256, generator=gen)).to(dtype)
    worst = {}
    for chip in (A2, A3, A950):
        y, rstd, x = EmulatedTorchNPU(chip).npu_add_rms_norm(x1, x2, gamma, epsilon=1e-5)
        assert y.dtype == x.dtype == dtype and rstd.dtype == torch.float32 and rstd.shape == (64, 1)
        # A2/A3 normalise the op's rounded x; Ascend950 the unrounded sum
        xd = x.double() if chip != A950 else x1.double() + x2.double()
        exact = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * gamma.double()
        worst[chip] = _ulp_errors(y, exact).max().item()
        assert torch.equal(y, add_rms_norm_reference(x1, x2, gamma, 1e-5, chip)[0])
    u = torch.finfo(dtype).eps / 2
    assert worst[A2] <= 2 + 4 * u and worst[A3] == worst[A2], worst
    assert worst[A2] > 1.0, worst  # two roundings
    assert worst[A950] <= 1.0 + 1e-3, worst  # one rounding (rstd itself is fp32: ~2^-24 slack)
    single = (x1.float() + x2.float())
    single = (single * torch.rsqrt(single.pow(2).mean(-1, keepdim=True) + 1e-5) * gamma.float()).to(dtype)
    legacy = EmulatedTorchNPU(A2).npu_add_rms_norm(x1, x2, gamma, 1e-5)[0]
    assert (legacy != single).float().mean() > 0.05  # the old single-rounding emulator was off here


def _dense_graph(min_prefill_tokens: int):
    """The graph report of the dense model (2 x 5 tokens) compiled on a fake group of 2."""
    with fake_process_group(2):
        model = build_tp_model(DENSE, 0, 2, dist.group.WORLD)
        backend, compile_fn = _compile(WeaveConfig(**{**ON, "flashcomm_min_prefill_tokens": min_prefill_tokens}))
        with torch.no_grad():
            compile_fn(model)(random_token_ids(DENSE, 2, 5))
    return backend.report.graphs[0]


def test_graph_over_threshold_has_no_all_reduce():
    graph = _dense_graph(8)
    sites = 2 * DENSE.n_layers + 1
    assert not any("all_reduce" in op for op in graph.ops_after), graph.ops_after
    assert graph.ops_after["_c10d_functional.reduce_scatter_tensor.default"] == sites
    assert graph.ops_after["_c10d_functional.all_gather_into_tensor.default"] == sites
    assert graph.ops_after["aten.constant_pad_nd.default"] == sites  # 10 tokens -> 32
    assert [r.lowering for r in graph.records] == ["flashcomm:portable"] * sites
    assert "10 tokens padded to 32" in graph.note


def test_graph_under_threshold_is_left_to_the_fuse_path():
    graph = _dense_graph(8192)
    assert graph.reasons == [Reason.of(ReasonCode.TOO_FEW_TOKENS, tokens=10, min_tokens=8192)], graph.note
    assert not any(r.lowering.startswith("flashcomm") for r in graph.records)
    assert "_c10d_functional.all_gather_into_tensor.default" not in graph.ops_after
    assert graph.ops_after["weave.fused_allreduce_rmsnorm.default"] == 2 * DENSE.n_layers + 1


def test_graph_stopped_under_inductor_cuda_graphs_stays_unchanged(monkeypatch):
    """The CUDA-graph-tree stop is graph-wide: with FlashComm and the split both asked for, a graph
    the scheduler stops keeps every all_reduce and gains no weave op, and the report says why. (The
    stop itself needs CUDA sites; here the scheduler's decision is stubbed on a CPU graph.)"""
    from weavepass.compile import planner as scheduler

    monkeypatch.setattr(scheduler, "inductor_cudagraphs_reason",
                        lambda sites, config: scheduler.INDUCTOR_CUDAGRAPHS)
    with fake_process_group(2):
        model = build_tp_model(DENSE, 0, 2, dist.group.WORLD)
        backend, compile_fn = _compile(WeaveConfig(**{**ON, "flashcomm_min_prefill_tokens": 8, "split": "force"}))
        with torch.no_grad():
            compile_fn(model)(random_token_ids(DENSE, 2, 5))
    graph = backend.report.graphs[0]
    assert graph.ops_after == graph.ops_before
    assert not any(op.startswith("weave.") for op in graph.ops_after)
    assert graph.codes == [ReasonCode.INDUCTOR_CUDAGRAPHS]
    assert graph.note == f"not rewritten: {scheduler.INDUCTOR_CUDAGRAPHS.render()}"
    assert [r.codes for r in graph.records] == [[ReasonCode.INDUCTOR_CUDAGRAPHS]] * (2 * DENSE.n_layers + 1)


def test_broken_residual_stream_names_the_boundary():
    with fake_process_group(2):
        backend, compile_fn = _compile(WeaveConfig(**ON))
        with torch.no_grad():
            compile_fn(BrokenStream())(torch.randn(8, 64))
    graph = backend.report.graphs[0]
    (reason,) = graph.reasons
    assert reason.code is ReasonCode.STREAM_BROKEN, graph.note
    assert (reason.field("previous"), reason.field("site")) == ("all_reduce", "all_reduce_1"), reason
    assert graph.records[1].codes == [ReasonCode.FLASHCOMM_DECLINED] and graph.records[1].reasons[0].field(
        "cause") == reason, graph.records[1]
    assert not any(r.lowering.startswith("flashcomm") for r in graph.records)


def test_shared_expert_sites_keep_the_stream_sharded():
    """``(S + x) + h`` with a replicated ``x``: the op's residual is ``x + h``; FlashComm adds
    ``x``'s rows of this rank's shard to the carried shard, so the stream is never gathered: one
    all_gather per site (its norm output), and ``x`` sharded like the first site's residual."""
    with fake_process_group(2):
        backend, compile_fn = _compile(WeaveConfig(**ON))
        with torch.no_grad():
            compile_fn(SharedExpertTwoSites(torch.float32, 0, 2))(torch.randn(7, 64))
    graph = backend.report.graphs[0]
    assert [r.lowering for r in graph.records] == ["flashcomm:portable"] * 2, graph
    assert all("moved onto the residual" in r.kind for r in graph.records), graph.records
    assert not any("all_reduce" in op for op in graph.ops_after), graph.ops_after
    assert graph.ops_after["_c10d_functional.all_gather_into_tensor.default"] == 2, graph.ops_after
    # the first site's residual h + x, and the second site's x
    assert graph.ops_after["weave.flashcomm_shard_rows.default"] == 2, graph.ops_after


def test_shared_expert_site_off_the_stream_names_the_residual_not_the_shared_output():
    """``(S + x) + 2h``: the stream stops at the residual ``2h``; the reason names it, not ``x``."""
    def f(h, w, g):
        h = h + funcol.all_reduce(h @ w, "sum", dist.group.WORLD)
        y = _rms(h, g)
        shared = torch.sigmoid(y[:, :1]) * torch.tanh(y)
        h = funcol.all_reduce(y @ w, "sum", dist.group.WORLD) + shared + 2 * h
        return _rms(h, g)

    with fake_process_group(2):
        backend, compile_fn = _compile(WeaveConfig(**ON))
        with torch.no_grad():
            compile_fn(f)(torch.randn(8, 64), torch.randn(64, 64) / 8, torch.ones(64))
    graph = backend.report.graphs[0]
    (reason,) = graph.reasons
    assert reason.code is ReasonCode.STREAM_BROKEN and reason.field("site") == "all_reduce_1", graph.note
    residual = reason.field("residual")
    kind = graph.records[1].kind
    shared = kind.split(" added to the sum before the residual add")[0].split(", ")[-1]
    assert residual.startswith("mul") and shared.startswith("mul") and residual != shared, (residual, kind)


def test_symbolic_token_count_is_declined():
    with fake_process_group(2):
        backend = make_backend(WeaveConfig(**ON))
        h = torch.randn(24, 64)
        torch._dynamo.mark_dynamic(h, 0)
        with torch.no_grad():
            torch.compile(TwoSites((256, 256), (False, False), torch.float32, 0, 2), backend=backend)(h)
    assert backend.report.graphs[0].codes == [ReasonCode.SYMBOLIC_TOKENS], backend.report.graphs[0].note


def _residual_view(h, w1, w2, g):
    """The second site adds the ``[B, S, H]`` stream through a ``[T, H]`` view nothing else reads."""
    h = h + funcol.all_reduce(h @ w1, "sum", dist.group.WORLD)
    y = _rms(h, g)
    h = h.view(-1, h.shape[-1]) + funcol.all_reduce(y.view(-1, h.shape[-1]) @ w2, "sum", dist.group.WORLD)
    return _rms(h, g)


def test_residual_read_through_a_view_is_not_gathered():
    """The stream stays sharded through the view: one all_gather per site (a gather of the whole
    stream for the view, read by nobody, once ran at every such boundary). Numerics: the
    ``residual view`` case of ``test_norm_dims_are_replayed_on_shard_rows_gloo``."""
    w = torch.randn(64, 64) / 8
    with fake_process_group(2):
        backend, compile_fn = _compile(WeaveConfig(**ON))
        with torch.no_grad():
            compile_fn(_residual_view)(torch.randn(2, 5, 64), w, w, torch.ones(64))
    graph = backend.report.graphs[0]
    assert [r.lowering for r in graph.records] == ["flashcomm:portable"] * 2, graph.records
    assert graph.ops_after["_c10d_functional.all_gather_into_tensor.default"] == 2, graph.ops_after


def _npu_graph(chip: str = A2, world: int = 2, dtype=torch.bfloat16, **config):
    """TwoSites (hidden 320; down-projection k of 256 and 384) compiled for NPU on a fake group of
    ``world`` with MMRS on; returns the graph report and the emulated torch_npu calls."""
    with fake_process_group(world), force_device_kind("npu"), emulated_torch_npu(chip) as emulator:
        backend, compile_fn = _compile(WeaveConfig(**ON, enable_mmrs_fusion=True, **config))
        with torch.no_grad():
            compile_fn(TwoSites((256, 384), (False, False), dtype, 0, world, hidden=320))(
                torch.randn(20, 320).to(dtype))
    return backend.report.graphs[0], emulator.calls


def _calls(calls, op):
    return [args for name, args in calls if name == op]


def _note(record, code: ReasonCode) -> Reason:
    """The record's FlashComm note with ``code`` (there is one)."""
    found = [n for n in record.notes if n.code is code]
    assert len(found) == 1, (code, record.notes)
    return found[0]


def test_npu_graph_calls_mmrs_all_gather_mm_and_add_rms_norm():
    graph, calls = _npu_graph()
    assert graph.ops_after["weave.npu_mm_reduce_scatter.default"] == 2
    assert graph.ops_after["weave.npu_all_gather_mm.default"] == 1  # up[1] reads site 0's norm
    assert graph.ops_after["weave.npu_add_rms_norm.default"] == 2
    assert graph.ops_after["weave.flashcomm_shard_rows.default"] == 1  # the input residual
    assert graph.ops_after["_c10d_functional.all_gather_into_tensor.default"] == 1  # the output norm
    assert "_c10d_functional.reduce_scatter_tensor.default" not in graph.ops_after
    assert [r.lowering for r in graph.records] == ["flashcomm:npu_mmrs"] * 2
    assert [n.code for n in graph.records[0].notes] == [
        ReasonCode.FLASHCOMM_NORM_NPU, ReasonCode.FLASHCOMM_CONSUMERS_FUSED], graph.records[0].notes
    assert graph.records[0].notes[1].field("matmul") == "mm_2"
    # rendering test: a FlashComm note's sentence, in the record's reason
    assert "consumers: npu_all_gather_base_mm (mm_2)" in graph.records[0].reason, graph.records[0].reason
    not_fused = _note(graph.records[1], ReasonCode.FLASHCOMM_GATHER_NOT_FUSED)
    assert list(not_fused.codes()) == [ReasonCode.FLASHCOMM_GATHER_NOT_FUSED, ReasonCode.FLASHCOMM_NO_ROWS_MM]
    mmrs = _calls(calls, "npu_mm_reduce_scatter_base")
    assert [(a["self"], a["x2"]) for a in mmrs] == [
        (((32, 256), torch.bfloat16), ((256, 320), torch.bfloat16)),  # 20 tokens padded to 32
        (((32, 384), torch.bfloat16), ((384, 320), torch.bfloat16))]
    assert {(a["world_size"], a["reduce_op"], a["bias"], a["comm_turn"], a["comm_mode"]) for a in mmrs} == \
        {(2, "sum", None, 0, "aiv")}
    (agmm,) = _calls(calls, "npu_all_gather_base_mm")
    assert (agmm["self"], agmm["x2"]) == (((16, 320), torch.bfloat16), ((320, 384), torch.bfloat16))
    assert (agmm["gather_index"], agmm["gather_output"], agmm["comm_mode"]) == (0, True, "aiv")
    norms = _calls(calls, "npu_add_rms_norm")
    assert norms[0]["x1"] == ((16, 320), torch.bfloat16) and norms[0]["epsilon"] == 1e-5


def test_npu_graph_on_ascend950_uses_ccu():
    _, calls = _npu_graph(A950)
    fused = _calls(calls, "npu_mm_reduce_scatter_base") + _calls(calls, "npu_all_gather_base_mm")
    assert len(fused) == 3 and {a["comm_mode"] for a in fused} == {"ccu"}


@pytest.mark.parametrize("chip, world, config, code, words", [
    (A950, 2, dict(mmrs_comm_mode="aiv"), ReasonCode.NPU_COMM_MODE, "comm_mode 'aiv' is not taken on Ascend 950"),
    (A2, 2, dict(mmrs_comm_mode="ccu"), ReasonCode.NPU_COMM_MODE, "comm_mode 'ccu' is not taken on Atlas A2"),
    (A3, 16, {}, ReasonCode.NPU_WORLD_SIZE_FAILING, "world size 16: npu_mm_reduce_scatter_base is off from 16 ranks"),
    (A2, 16, {}, ReasonCode.NPU_WORLD_SIZE,
     "world size 16 is not one of (2, 4, 8) documented for npu_mm_reduce_scatter_base on Atlas A2"),
])
def test_npu_chip_rule_refusals_fall_back_with_the_reason(chip, world, config, code, words):
    graph, calls = _npu_graph(chip, world, **config)
    assert [r.lowering for r in graph.records] == ["flashcomm:portable"] * 2
    for record in graph.records:
        assert list(_note(record, ReasonCode.FLASHCOMM_MMRS_SKIPPED).codes()) == [
            ReasonCode.FLASHCOMM_MMRS_SKIPPED, code], record.notes
    _note(graph.records[0], ReasonCode.FLASHCOMM_GATHER_NOT_FUSED)
    assert graph.ops_after["_c10d_functional.reduce_scatter_tensor.default"] == 2
    assert not any(name.startswith(("npu_mm", "npu_all_gather")) for name, _ in calls), calls
    assert len(_calls(calls, "npu_add_rms_norm")) == 2  # the norm does not depend on the chip rules


class MergedSumsFirst(nn.Module):
    """The first site sums two all_reduces and has no residual add, ``all_reduce(a) +
    all_reduce(b) -> RMSNorm`` (two vocab-parallel embeddings added, say): one collective of the
    partials' sum, whose wait is a node made while the site is prepared, and its normed rows
    feed a matmul with k = 320 that all-gather + matmul takes. Then a ``TwoSites`` site."""

    def __init__(self, dtype, rank: int, world: int):
        super().__init__()
        self.two = TwoSites((256, 384), (False, False), dtype, rank, world, hidden=320)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        two = self.two
        h = funcol.all_reduce(a, "sum", dist.group.WORLD) + funcol.all_reduce(b, "sum", dist.group.WORLD)
        y = F.silu(F.linear(_rms(h, two.norms[0]), two.up[1]))
        h = h + funcol.all_reduce(F.linear(y, two.down[1]), "sum", dist.group.WORLD)
        return _rms(h, two.norms[2])


@pytest.mark.parametrize("kind", ["npu", "cuda"])
def test_fused_gather_after_merged_sums_without_residual(kind):
    """The fused all-gather + matmul after a site whose insertion point ``prepare`` made (the one
    wait of two merged sums) once raised KeyError: wait_tensor_default while compiling."""
    a, b = (torch.randn(20, 320).bfloat16() for _ in range(2))
    patch = emulated_torch_npu() if kind == "npu" else symm_mem_on_cpu()
    with fake_process_group(2), force_device_kind(kind), patch:
        backend, compile_fn = _compile(WeaveConfig(**ON, enable_mmrs_fusion=True))
        with torch.no_grad():
            compile_fn(MergedSumsFirst(torch.bfloat16, 0, 2))(a, b)
    graph = backend.report.graphs[0]
    assert [r.lowering.startswith("flashcomm:") for r in graph.records] == [True, True], graph.records
    fused = {"npu": "weave.npu_all_gather_mm.default", "cuda": "symm_mem.fused_all_gather_matmul.default"}
    assert graph.ops_after[fused[kind]] == 1, graph.ops_after


def _cuda_mmrs_graph():
    """The dense model's graph report, compiled as a CUDA graph (symm_mem emulated on CPU) with
    FlashComm and MMRS fusion asked for."""
    with fake_process_group(2), symm_mem_on_cpu(), force_device_kind("cuda"):
        model = build_tp_model(DENSE, 0, 2, dist.group.WORLD)
        backend, compile_fn = _compile(WeaveConfig(**ON, enable_mmrs_fusion=True))
        with torch.no_grad():
            compile_fn(model)(random_token_ids(DENSE, 1, 7))
    return backend.report.graphs[0]


def test_cuda_graph_uses_fused_matmul_reduce_scatter_and_all_gather_matmul():
    graph = _cuda_mmrs_graph()
    sites = 2 * DENSE.n_layers + 1
    assert [r.lowering for r in graph.records] == ["flashcomm:portable"] + ["flashcomm:cuda_symm"] * (sites - 1)
    assert graph.ops_after["symm_mem.fused_matmul_reduce_scatter.default"] == sites - 1
    # QKV and gate/up read the shards through the fused op; the final norm's gather is an output.
    assert graph.ops_after["symm_mem.fused_all_gather_matmul.default"] == sites - 1
    assert graph.ops_after["_c10d_functional.all_gather_into_tensor.default"] == 1
    assert not any("all_reduce" in op for op in graph.ops_after)


def test_cuda_graph_under_inductor_cuda_graphs_uses_plain_collectives(monkeypatch):
    """Under mode="reduce-overhead" the symm_mem fused matmul ops are not used (their workspace
    lands in the CUDA-graph pool and the trees raise, seen on 2 H200s): every site reduce-scatters
    and gathers with plain collectives and says why."""
    import weavepass.compile.strategies.flashcomm as flashcomm

    monkeypatch.setattr(flashcomm, "inductor_cudagraphs_on", lambda: True)
    graph = _cuda_mmrs_graph()
    sites = 2 * DENSE.n_layers + 1
    assert [r.lowering for r in graph.records] == ["flashcomm:portable"] * sites
    assert not any(op.startswith("symm_mem.") for op in graph.ops_after), graph.ops_after
    assert graph.ops_after["_c10d_functional.reduce_scatter_tensor.default"] == sites
    for record in graph.records[1:]:  # (the first site's sum has no producer matmul)
        skipped = _note(record, ReasonCode.FLASHCOMM_MMRS_SKIPPED)
        assert skipped.field("cause") == Reason(ReasonCode.FLASHCOMM_SYMM_MEM_CUDAGRAPHS), record.notes
        assert list(_note(record, ReasonCode.FLASHCOMM_GATHER_NOT_FUSED).codes())[1:] == [
            ReasonCode.FLASHCOMM_SYMM_MEM_CUDAGRAPHS]
    assert _note(graph.records[0], ReasonCode.FLASHCOMM_MMRS_SKIPPED).field("cause") == Reason(
        ReasonCode.FLASHCOMM_NO_PRODUCER_MATMUL)


# ---------------------------------------------------------------------------------------------
# Numerics on gloo


def _check(model_fn, inputs, config, kind, chip=A2):
    """Compile ``model_fn(dtype)`` with ``config`` as device ``kind`` (NPU: the emulated ``chip``);
    return (report, npu calls)."""
    backend, compile_fn = _compile(config)
    with force_device_kind(kind), emulated_torch_npu(chip) as emulator:
        check_against_eager(model_fn(None), inputs, compile_fn, model_fn(torch.float32))
    return backend.report, [name for name, _ in emulator.calls]


def _tp(cfg, rank, world):
    return lambda dtype: build_tp_model(cfg, rank, world, dist.group.WORLD, dtype=dtype)


def _numerics_world_2(rank, world):
    mmrs = WeaveConfig(**ON, enable_mmrs_fusion=True)
    results = {}
    # 1 token (< world size) and 7 tokens (not a multiple of 16 * world): MMRS through the emulator.
    for name, cfg, tokens, config, kind in [
        ("dense-1-mmrs", DENSE, 1, mmrs, "npu"),
        ("dense-7", DENSE, 7, WeaveConfig(**ON), "portable"),
        ("moe-3-mmrs", MOE, 3, mmrs, "npu"),
    ]:
        ids = random_token_ids(cfg, 1, tokens, seed=tokens)
        results[name] = _check(_tp(cfg, rank, world), ids, config, kind)
    with symm_mem_on_cpu():  # the CUDA rewrite, its fused ops run as their reference fallbacks
        ids = random_token_ids(DENSE, 1, 7, seed=7)
        results["dense-7-cuda"] = _check(_tp(DENSE, rank, world), ids, mmrs, "cuda")
    # All three NPU ops (MMRS, all-gather + matmul, add + RMSNorm) in bf16 on A2 and fp16 on A950:
    # the two add_rms_norm roundings of CANN's reference.
    for name, dtype, chip in [("agmm-bf16-a2", torch.bfloat16, A2), ("agmm-fp16-a950", torch.float16, A950)]:
        h = torch.randn(5, 320, generator=torch.Generator().manual_seed(2)).to(dtype)
        model_fn = lambda d, dtype=dtype: TwoSites((256, 384), (False, False), d or dtype, rank, world, hidden=320)  # noqa: E731
        results[name] = _check(model_fn, h, mmrs, "npu", chip)
    # Two merged sums without a residual add (a wait that prepare makes), then all-gather + matmul.
    ab = tuple(torch.randn(5, 320, generator=torch.Generator().manual_seed(s)).bfloat16() for s in (5, 6))
    results["merged-first"] = _check(lambda d: MergedSumsFirst(d or torch.bfloat16, rank, world), ab, mmrs, "npu")
    # Qwen2-MoE's shared expert at both sites: the op's residual x + h built on the shard.
    h = torch.randn(7, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    results["shared-expert"] = _check(lambda d: SharedExpertTwoSites(d or torch.bfloat16, rank, world), h,
                                      WeaveConfig(**ON), "portable")
    # Fallbacks: each site falls back to mm -> reduce_scatter with its reason, and stays correct.
    for name, ks, biases, dtype in [("k128+bias", (128, 256), (False, True), torch.bfloat16),
                                    ("fp32", (256, 256), (False, False), torch.float32)]:
        h = torch.randn(5, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
        model_fn = lambda d, ks=ks, biases=biases, dtype=dtype: TwoSites(ks, biases, d or dtype, rank, world)  # noqa: E731
        results[name] = _check(model_fn, h, mmrs, "npu")
    return {name: (str(report), [r.lowering for r in report.records], _record_codes(report), calls)
            for name, (report, calls) in results.items()}


def _record_codes(report) -> list[list[ReasonCode]]:
    """Each record's codes: its reasons' and notes' chains, in order."""
    return [[code for why in (*r.reasons, *r.notes) for code in why.codes()] for r in report.records]


def _numerics_world_3(rank, world):
    results = {}
    for name, cfg, tokens, config in [
        ("dense-2-mmrs", DENSE, 2, WeaveConfig(**ON, enable_mmrs_fusion=True)),
        ("moe-5", MOE, 5, WeaveConfig(**ON)),
    ]:
        ids = random_token_ids(cfg, 1, tokens, seed=tokens)
        report, calls = _check(_tp(cfg, rank, world), ids, config, "npu")
        results[name] = ([r.lowering for r in report.records], _record_codes(report), calls)
    return results


@pytest.mark.slow
def test_numerics_world_2_gloo():
    results = spawn(_numerics_world_2, 2)[0]
    sites = 2 * DENSE.n_layers + 1
    _, lowerings, reasons, calls = results["dense-1-mmrs"]
    # The embedding site has no matmul; o_proj and down_proj run as emulated MMRS.
    assert lowerings == ["flashcomm:portable"] + ["flashcomm:npu_mmrs"] * (sites - 1)
    assert ReasonCode.FLASHCOMM_NO_PRODUCER_MATMUL in reasons[0], reasons[0]
    assert calls.count("npu_mm_reduce_scatter_base") == sites - 1
    assert calls.count("npu_add_rms_norm") == sites - 1
    assert results["dense-7"][1] == ["flashcomm:portable"] * sites
    assert results["dense-7-cuda"][1] == ["flashcomm:portable"] + ["flashcomm:cuda_symm"] * (sites - 1)
    assert "flashcomm:npu_mmrs" in results["moe-3-mmrs"][1]
    assert results["shared-expert"][1] == ["flashcomm:portable"] * 2, results["shared-expert"][0]
    _, lowerings, reasons, calls = results["merged-first"]
    assert lowerings == ["flashcomm:portable", "flashcomm:npu_mmrs"], reasons
    assert calls.count("npu_all_gather_base_mm") == 1, calls
    for name in ("agmm-bf16-a2", "agmm-fp16-a950"):
        _, lowerings, reasons, calls = results[name]
        assert lowerings == ["flashcomm:npu_mmrs"] * 2, (name, reasons)
        assert [calls.count(op) for op in ("npu_mm_reduce_scatter_base", "npu_all_gather_base_mm",
                                           "npu_add_rms_norm")] == [2, 1, 2], (name, calls)
    for name, codes in [("k128+bias", [ReasonCode.NPU_K_RANGE, ReasonCode.NPU_BIAS]),
                        ("fp32", [ReasonCode.NPU_DTYPES, ReasonCode.NPU_DTYPES])]:
        _, lowerings, reasons, calls = results[name]
        assert lowerings == ["flashcomm:portable"] * 2, name
        assert all(r[r.index(ReasonCode.FLASHCOMM_MMRS_SKIPPED) + 1] is code for code, r in zip(codes, reasons)), (
            name, reasons)
        assert "npu_mm_reduce_scatter_base" not in calls


@pytest.mark.slow
def test_numerics_world_3_gloo():
    results = spawn(_numerics_world_3, 3)[0]
    lowerings, reasons, calls = results["dense-2-mmrs"]
    assert lowerings == ["flashcomm:portable"] * 3
    assert all(ReasonCode.NPU_WORLD_SIZE in r for r in reasons[1:]), reasons
    assert "npu_mm_reduce_scatter_base" not in calls
    assert results["moe-5"][0] == ["flashcomm:portable"] * 3


def _gemma_like(x, w, weight_1, weight_2):
    """Gemma's shape of the stream: an embedding-like sum scaled by a constant, norms weighted by
    ``1 + w``."""
    h = funcol.all_reduce(x, "sum", dist.group.WORLD) * torch.tensor(8.0)
    y = _rms(h, 1.0 + weight_1)
    h = h + funcol.all_reduce(y @ w, "sum", dist.group.WORLD)
    return _rms(h, 1.0 + weight_2)


def test_scaled_sum_goes_to_flashcomm():
    """Both sites go to FlashComm, the scaled sum too: the scale moves onto the partial. (HF Gemma,
    whose late ``1 + w`` norm weight FlashComm once read before its definition, is run end to end
    in tests/test_hf_models.py.)"""
    g = torch.Generator().manual_seed(0)
    args = (torch.randn(8, 64, generator=g), torch.randn(64, 64, generator=g) / 8,
            torch.randn(64, generator=g), torch.randn(64, generator=g))
    with fake_process_group(2):
        backend, compile_fn = _compile(WeaveConfig(**ON))
        with torch.no_grad():
            compile_fn(_gemma_like)(*args)
    graph = backend.report.graphs[0]
    assert [r.lowering for r in graph.records] == ["flashcomm:portable"] * 2, graph.records
    assert "sum scaled by 8.0" in graph.records[0].kind
    assert not any("all_reduce" in op for op in graph.ops_after), graph.ops_after


class ScaledTwoSites(TwoSites):
    """``TwoSites`` with Granite's ``h + branch * residual_multiplier``."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for i in range(2):
            y = F.silu(F.linear(_rms(h, self.norms[i]), self.up[i]))
            h = h + funcol.all_reduce(F.linear(y, self.down[i]), "sum", dist.group.WORLD) * 0.25
        return _rms(h, self.norms[2])


def test_npu_mmrs_keeps_a_scaled_sum():
    """The scale moved onto the partial sits between the matmul and the reduce_scatter: MMRS
    (matmul + reduce_scatter in one op) would drop it, so it is skipped with the reason."""
    with fake_process_group(2), force_device_kind("npu"), emulated_torch_npu():
        backend, compile_fn = _compile(WeaveConfig(**ON, enable_mmrs_fusion=True))
        with torch.no_grad():
            compile_fn(ScaledTwoSites((256, 256), (False, False), torch.bfloat16, 0, 2))(torch.randn(20, 64).bfloat16())
    graph = backend.report.graphs[0]
    assert "weave.npu_mm_reduce_scatter.default" not in graph.ops_after
    assert graph.ops_after["_c10d_functional.reduce_scatter_tensor.default"] == 2
    assert [r.lowering for r in graph.records] == ["flashcomm:portable"] * 2
    assert all(_note(r, ReasonCode.FLASHCOMM_MMRS_SKIPPED).field("cause").code is ReasonCode.FLASHCOMM_PRODUCER_NOT_VIEW
               and "sum scaled by 0.25" in r.kind for r in graph.records), graph.records


# ---------------------------------------------------------------------------------------------
# The norm's own dims, replayed on [R, H] shard rows (fp32, gloo world 2)


def _ln_sites(h, w1, w2, g, b):
    """Two sites with ``F.layer_norm``: decomposed, its ``var_mean`` names dims counted from the
    front (``[2]`` for a ``[B, S, H]`` stream, ``[0]`` for a 1-D ``[H]`` one)."""
    h = h + funcol.all_reduce(h @ w1, "sum", dist.group.WORLD)
    y = F.layer_norm(h, (h.shape[-1],), g, b)
    h = h + funcol.all_reduce(y @ w2, "sum", dist.group.WORLD)
    return F.layer_norm(h, (h.shape[-1],), g, b)


def _view_read_elsewhere(h, w1, w2, g):
    """The norm reads a ``[T, H]`` view of the ``[B, S, H]`` stream that a sum over tokens reads too."""
    h = h + funcol.all_reduce(h @ w1, "sum", dist.group.WORLD)
    rows = h.view(-1, h.shape[-1])
    y = _rms(rows, g)
    h = h + funcol.all_reduce((y @ w2).view(h.shape), "sum", dist.group.WORLD)
    return _rms(h, g), rows.sum(0)


def _norm_dims(rank, world):
    g = torch.Generator().manual_seed(4)
    w1, w2 = (torch.randn(32, 32, generator=g) / 16 for _ in range(2))
    gamma, beta = 1 + 0.1 * torch.randn(32, generator=g), 0.1 * torch.randn(32, generator=g)
    results = {}
    for name, fn, args in [
        ("1-D", _ln_sites, (torch.randn(32, generator=g), w1, w2, gamma, beta)),
        ("3-D", _ln_sites, (torch.randn(2, 5, 32, generator=g), w1, w2, gamma, beta)),
        ("shared view", _view_read_elsewhere, (torch.randn(2, 5, 32, generator=g), w1, w2, gamma)),
        ("residual view", _residual_view, (torch.randn(2, 5, 32, generator=g), w1, w2, gamma)),
    ]:
        torch._dynamo.reset()
        backend, compile_fn = _compile(WeaveConfig(**ON))
        check_against_eager(fn, args, compile_fn, fn)  # fp32: only the reduction order may differ
        graph = backend.report.graphs[0]
        results[name] = ([r.lowering for r in graph.records], graph.note, graph.reasons)
    return results


@pytest.mark.slow
def test_norm_dims_are_replayed_on_shard_rows_gloo():
    """A 1-D ``[H]`` norm input is refused: its dim 0 would be the token dim of the shard, and the
    replayed LayerNorm averaged the token with the padding rows (max error 5.6, no error raised).
    A ``[B, S, H]`` LayerNorm (``var_mean`` over dim 2) once crashed the compile, and so did a
    view before the norm that another op reads."""
    results = spawn(_norm_dims, 2)[0]
    lowerings, note, reasons = results["1-D"]
    assert lowerings == ["portable"] * 2 and [r.code for r in reasons] == [ReasonCode.NO_TOKEN_DIM], note
    for name in ("3-D", "shared view", "residual view"):
        lowerings, note, _ = results[name]
        assert lowerings == ["flashcomm:portable"] * 2, (name, note)
        assert "10 tokens padded to 32" in note, (name, note)
