"""Training compiles: the forward graph's sites fuse into ``weave.fused_allreduce_rmsnorm_train``.

AOT autograd's forward graph of a training compile returns the norm's inverse RMS (``rsqrt``) as a
tensor saved for backward. The training op returns it as a third output, gathered like the other
two, and the backward graph reads that output instead. Graph checks run on the fake process group;
forward outputs and gradients are compared with eager on a real gloo group of 2 ranks.
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

import weavepass
from weavepass.compile.reasons import Reason, ReasonCode
from weavepass.ops import FUSED_ALLREDUCE_RMSNORM_TRAIN
from weavepass.testing.distributed import fake_process_group, spawn
from weavepass.testing.harness import check_against_eager

HIDDEN, INNER = 8, 16
TRAIN_OP = "weave.fused_allreduce_rmsnorm_train.default"
LAYER_NORM_OP = "weave.fused_allreduce_layernorm.default"
ALL_REDUCES = ("_c10d_functional.all_reduce.default", "_c10d_functional.all_reduce_.default")


class _RowParallelSum(torch.autograd.Function):
    """all_reduce(sum) of a row-parallel matmul's partial sums; its backward is the identity
    (every rank already holds the full gradient of the replicated output)."""

    @staticmethod
    def forward(ctx, partial, group):
        return funcol.all_reduce(partial, "sum", group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, upcast: bool) -> torch.Tensor:
    """LlamaRMSNorm; ``upcast=False`` normalises in the activation dtype itself."""
    dtype = x.dtype
    x = x.to(torch.float32) if upcast else x
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    return weight * x.to(dtype)


def _layer_norm(x: torch.Tensor, weight: torch.Tensor, upcast: bool) -> torch.Tensor:
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), weight, None, 1e-5)


class TwoSites(nn.Module):
    """Two row-parallel sums, each followed by a residual add and an RMSNorm; every weight trains.

    Rank ``rank`` holds its own shard of the two matmuls; the norms are replicated.
    """

    def __init__(self, group, rank: int, dtype: torch.dtype, upcast: bool = True, norm=_rms_norm):
        super().__init__()
        gen = torch.Generator().manual_seed(rank)
        self.group, self.upcast, self.norm = group, upcast, norm
        self.w1 = nn.Parameter((torch.randn(INNER, HIDDEN, generator=gen) / 4).to(dtype))
        self.w2 = nn.Parameter((torch.randn(HIDDEN, HIDDEN, generator=gen) / 3).to(dtype))
        gen = torch.Generator().manual_seed(100)  # the norm weights are the same on every rank
        self.norm1 = nn.Parameter((1 + torch.randn(HIDDEN, generator=gen) / 8).to(dtype))
        self.norm2 = nn.Parameter((1 + torch.randn(HIDDEN, generator=gen) / 8).to(dtype))

    def forward(self, x, residual):
        residual = _RowParallelSum.apply(x @ self.w1, self.group) + residual
        h = self.norm(residual, self.norm1, self.upcast)
        residual = _RowParallelSum.apply(h @ self.w2, self.group) + residual
        return self.norm(residual, self.norm2, self.upcast), residual


class EmbeddingThenLayer(TwoSites):
    """HF Llama's start: the embedding's sum normed without a residual, then a layer whose residual
    is that sum. AOT autograd saves the embedding's sum (the first norm's input) and would save the
    layer's sum too, recomputing ``e + S`` in the backward, unless the residual add is marked to be
    saved (``weavepass.compile.joint_pass``)."""

    def forward(self, x, residual):
        e = _RowParallelSum.apply(x @ self.w1, self.group)
        h = _RowParallelSum.apply(self.norm(e, self.norm1, self.upcast) @ self.w2, self.group) + e
        return self.norm(h, self.norm2, self.upcast), h * residual


class TrainStep:
    """``(x, residual) -> (outputs, gradients of inputs and parameters)`` of ``module``.

    The loss weighs each output by a fixed random cotangent, so every gradient is non-trivial.
    ``parameters_of`` is the module whose parameters are differentiated (the eager one when
    ``module`` is its compiled wrapper).
    """

    def __init__(self, module, parameters_of: nn.Module | None = None):
        self.module = module
        self.parameters_of = parameters_of or module

    def __call__(self, x, residual):
        with torch.enable_grad():
            x, residual = (t.detach().requires_grad_() for t in (x, residual))
            outputs = self.module(x, residual)
            gen = torch.Generator().manual_seed(7)
            loss = sum((o.float() * torch.randn(o.shape, generator=gen)).sum() for o in outputs)
            params = [p for _, p in sorted(self.parameters_of.named_parameters())]
            grads = torch.autograd.grad(loss, [x, residual, *params])
        return tuple(o.detach() for o in outputs), grads


def _inputs(dtype: torch.dtype):
    gen = torch.Generator().manual_seed(1)
    return (torch.randn(2, 5, INNER, generator=gen).to(dtype),
            torch.randn(2, 5, HIDDEN, generator=gen).to(dtype))


def _train_compile(config: weavepass.WeaveConfig, dtype: torch.dtype, upcast: bool = True, norm=_rms_norm,
                   module=TwoSites, options=None):
    """One training step of ``TwoSites`` compiled on a fake group of 2; returns the backend and
    the post-grad graphs after the weave pass, in compile order (forward, then backward)."""
    graphs = []

    def capture(graph: torch.fx.Graph) -> None:
        graphs.append(graph)

    backend = weavepass.make_backend(config)
    torch._dynamo.reset()
    with fake_process_group(2) as group, torch._inductor.config.patch(
        post_grad_custom_post_pass=capture, fx_graph_cache=False
    ):
        model = module(group, 0, dtype, upcast, norm)
        TrainStep(torch.compile(model, backend=backend, options=options), model)(*_inputs(dtype))
    return backend, graphs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_training_forward_graph_fuses_and_returns_the_saved_inverse_rms(dtype):
    backend, graphs = _train_compile(weavepass.WeaveConfig(), dtype)
    forward_report, backward_report = backend.report.graphs
    assert forward_report.ops_after[TRAIN_OP] == 2
    assert not any(forward_report.ops_after[op] for op in ALL_REDUCES)
    assert [r.lowering for r in forward_report.records] == ["portable", "portable"]
    assert TRAIN_OP not in backward_report.ops_after
    # Every inverse RMS the forward graph saves for backward is the op's third output.
    forward = graphs[0]
    returned = next(n for n in forward.nodes if n.op == "output").args[0]
    saved_fp32 = [n for n in returned if n.meta["val"].dtype == torch.float32
                  and n.meta["val"].shape[-1] == 1]
    assert len(saved_fp32) == 2
    for node in saved_fp32:
        assert node.target is operator.getitem and node.args[1] == 2
        assert node.args[0].target is FUSED_ALLREDUCE_RMSNORM_TRAIN
    assert not any(n.target is torch.ops.aten.rsqrt.default for n in forward.nodes)


class _NoJointPass(torch._inductor.custom_graph_pass.CustomGraphPass):
    def __call__(self, graph):
        pass

    def uuid(self):
        return "none"


@pytest.mark.parametrize("joint_pass", [True, False])
def test_training_saves_the_residual_add_not_the_sum(joint_pass):
    """With weave's joint pass (the default) the forward graph returns the residual add for
    backward, and both sites fuse; with another joint pass given in ``options`` (weave's is then
    not installed) the partitioner saves the layer's sum, which keeps that site (the control)."""
    options = None if joint_pass else {"joint_custom_post_pass": _NoJointPass()}
    backend, _ = _train_compile(weavepass.WeaveConfig(), torch.float32, module=EmbeddingThenLayer, options=options)
    forward_report = backend.report.graphs[0]
    first, second = forward_report.records
    assert first.lowering == "portable" and first.kind.startswith("no-residual"), first
    if joint_pass:
        assert forward_report.ops_after[TRAIN_OP] == 2 and second.lowering == "portable", second
        assert not any(forward_report.ops_after[op] for op in ALL_REDUCES)
    else:
        assert not second.matched and second.codes == [ReasonCode.SUM_OTHER_READERS], second
        assert [name for name, _ in second.reasons[0].field("readers")][-1] == "output", second.reasons


def test_training_norm_in_bf16_is_refused_with_a_training_reason():
    """A norm computed in bf16 saves a bf16 rsqrt; the op's inverse RMS is fp32, so it cannot
    stand in for it."""
    backend, _ = _train_compile(weavepass.WeaveConfig(), torch.bfloat16, upcast=False)
    forward_report = backend.report.graphs[0]
    assert TRAIN_OP not in forward_report.ops_after
    assert len(forward_report.records) == 2
    for record in forward_report.records:
        assert ReasonCode.SAVED_FOR_BACKWARD in record.reasons[0].codes(), record.reason


def test_training_layer_norm_fuses_where_backward_saves_only_its_outputs():
    """AOT autograd saves the first LayerNorm's normalised rows and ``rsqrt / H`` (the LayerNorm op
    returns neither: refused with a training reason) and recomputes the last one from the residual
    stream, the op's ``residual_out`` (fused)."""
    backend, _ = _train_compile(weavepass.WeaveConfig(), torch.float32, norm=_layer_norm)
    forward_report = backend.report.graphs[0]
    assert forward_report.ops_after["weave.fused_allreduce_layernorm.default"] == 1
    first, second = forward_report.records
    saved = first.reasons[0].find(ReasonCode.SAVED_FOR_BACKWARD)
    assert not first.lowering and saved == Reason.of(ReasonCode.SAVED_FOR_BACKWARD, node="rsqrt", user="div_1",
                                                     norm_kind="LayerNorm"), first.reason
    assert second.lowering == "portable" and "LayerNorm (var_mean)" in second.kind


@pytest.mark.parametrize("config,note", [
    (weavepass.WeaveConfig(split="force"), "fuse-only: "),
    (weavepass.WeaveConfig(enable_flashcomm=True), "FlashComm not used: "),
])
def test_training_graphs_skip_the_split_and_flashcomm_with_a_note(config, note):
    backend, _ = _train_compile(config, torch.float32)
    forward_report = backend.report.graphs[0]
    assert forward_report.ops_after[TRAIN_OP] == 2
    assert forward_report.codes == [ReasonCode.TRAINING], forward_report.notes
    assert any(n.startswith(note) for n in forward_report.notes), forward_report.notes


def _rank(rank: int, world: int) -> dict:
    group = dist.group.WORLD
    results = {}
    for dtype, norm, module in ((torch.float32, _rms_norm, TwoSites), (torch.bfloat16, _rms_norm, TwoSites),
                                (torch.float32, _layer_norm, TwoSites),
                                (torch.float32, _rms_norm, EmbeddingThenLayer)):
        model = module(group, rank, dtype, norm=norm)
        reference = module(group, rank, torch.float32, norm=norm)
        backend = weavepass.make_backend()
        torch._dynamo.reset()
        comparison = check_against_eager(
            TrainStep(model), _inputs(dtype),
            lambda step: TrainStep(torch.compile(step.module, backend=backend), step.module),
            TrainStep(reference), dtype,
        )
        forward_report = backend.report.graphs[0]
        results[f"{dtype} {norm.__name__} {module.__name__}"] = dict(
            fused=forward_report.ops_after[TRAIN_OP] + forward_report.ops_after[LAYER_NORM_OP],
            compared=len(comparison.outputs),
            max_abs=comparison.max_abs_diff,
        )
    return results


def test_training_outputs_and_gradients_match_eager_on_gloo():
    """Forward outputs and the gradients of inputs and every weight, as accurate as eager's
    (``check_against_eager``: against an fp32 reference, per-dtype tolerance)."""
    for rank_result in spawn(_rank, 2, "gloo"):
        for dtype, got in rank_result.items():
            # 2 outputs + gradients of x, residual and the 4 parameters; LayerNorm: the last site
            # (test_training_layer_norm_fuses_where_backward_saves_only_its_outputs).
            assert got["fused"] == (1 if "layer_norm" in dtype else 2) and got["compared"] == 8, (dtype, got)
