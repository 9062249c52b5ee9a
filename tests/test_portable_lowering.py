"""Property tests: the portable lowering equals the reference math and eager, on real gloo groups.

Every rank runs the same derandomized hypothesis search (same examples in the same order), so the
collectives inside each example line up across ranks. Shrinking is off: a rank that shrank alone
would call collectives its peers never join.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

import weavepass  # noqa: F401  (registers torch.ops.weave.*)
from weavepass.runtime.cuda.workspace import DEFAULT_WORKSPACE_TOKENS as WORKSPACE  # portable ignores it
from weavepass.runtime.reference import fused_allreduce_rmsnorm_reference
from weavepass.testing.distributed import spawn

# Tolerances of the fused op against the fp32 reference math. The portable path and the reference
# differ only in the order of an fp32 sum of N terms; that can flip one rounding of residual_out
# (1 ulp), which moves normed by at most 1 ulp, on top of normed's own rounding: 2 ulps of the
# output dtype, i.e. rtol = 2 * eps(dtype). atol covers outputs that round to (near) zero.
OP_TOL = {
    torch.float32: dict(rtol=2 * 2**-23, atol=1e-6),
    torch.bfloat16: dict(rtol=2 * 2**-7, atol=2 * 2**-7 * 1e-2),
    torch.float16: dict(rtol=2 * 2**-10, atol=2 * 2**-10 * 1e-2),
}
# Against eager (all_reduce in the model dtype, then add, then LlamaRMSNorm) element-wise closeness
# is the wrong question: eager rounds after the sum and again after the add, so where the sum and
# the residual cancel its relative error is unbounded. The question users care about is whether
# weave is less accurate than eager: measured against the fp32 reference, the portable path's
# largest error may exceed eager's largest error by at most one rounding step at the tensor's
# scale (eps(dtype) * max|reference|).
EPS = {torch.float32: 2**-23, torch.bfloat16: 2**-7, torch.float16: 2**-10}


def assert_not_less_accurate(ours, eager, reference, dtype):
    reference = reference.double()
    ours_err = (ours.double() - reference).abs().max().item()
    eager_err = (eager.double() - reference).abs().max().item()
    allowed = eager_err + EPS[dtype] * reference.abs().max().item()
    assert ours_err <= allowed, f"weave error {ours_err:.3g} > eager error {eager_err:.3g} + 1 step"


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _partials(seed: int, world: int, tokens: int, hidden: int, dtype):
    return [
        torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed * 16 + r)).to(dtype)
        for r in range(world)
    ]


def _eager(partial, residual, weight, eps):
    """What a TP model computes without weave: all_reduce in its dtype, add, LlamaRMSNorm."""
    summed = partial.clone()
    dist.all_reduce(summed)
    h = summed if residual is None else summed + residual
    x = h.float()
    normed = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)
    return weight * normed, h


def _edge_cases(rank: int, world: int) -> None:
    """1 token, fewer tokens than ranks, and a [B, S, H] input, with and without residual."""
    group_name = dist.group.WORLD.group_name
    for shape in [(1, 16), (world - 1, 16), (2, 3, 16), (1, 1, 16)]:
        tokens = int(torch.tensor(shape[:-1]).prod())
        partials = [p.reshape(shape) for p in _partials(5, world, tokens, 16, torch.float32)]
        for residual in (None, torch.randn(shape, generator=torch.Generator().manual_seed(1))):
            weight = torch.rand(16, generator=torch.Generator().manual_seed(2)) + 0.5
            normed, res_out = torch.ops.weave.fused_allreduce_rmsnorm(
                partials[rank], residual, weight, 1e-6, group_name, torch.float32, "portable", WORKSPACE
            )
            ref_normed, ref_res = fused_allreduce_rmsnorm_reference(
                partials, residual, weight, 1e-6, torch.float32
            )
            assert normed.shape == res_out.shape == shape
            torch.testing.assert_close(res_out, ref_res, **OP_TOL[torch.float32])
            torch.testing.assert_close(normed, ref_normed, **OP_TOL[torch.float32])


def _property_rank(rank: int, world: int, max_examples: int) -> int:
    group_name = dist.group.WORLD.group_name
    checked = []

    @settings(max_examples=max_examples, derandomize=True, database=None, deadline=None,
              phases=[Phase.explicit, Phase.generate], report_multiple_bugs=False)
    @given(
        tokens=st.integers(1, 300),
        hidden=st.sampled_from([8, 24, 64, 136]),
        eps=st.sampled_from([1e-6, 1e-5, 3.3e-4, 0.1]),
        dtype=st.sampled_from(DTYPES),
        with_residual=st.booleans(),
        seed=st.integers(0, 2**16),
    )
    def check(tokens, hidden, eps, dtype, with_residual, seed):
        partials = _partials(seed, world, tokens, hidden, dtype)
        g = torch.Generator().manual_seed(seed + 7)
        residual = torch.randn(tokens, hidden, generator=g).to(dtype) if with_residual else None
        weight = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)

        normed, res_out = torch.ops.weave.fused_allreduce_rmsnorm(
            partials[rank], residual, weight, eps, group_name, dtype, "portable", WORKSPACE
        )
        ref_normed, ref_res = fused_allreduce_rmsnorm_reference(partials, residual, weight, eps, dtype)
        assert normed.dtype == dtype and res_out.dtype == dtype
        assert normed.shape == res_out.shape == (tokens, hidden)
        torch.testing.assert_close(res_out, ref_res, **OP_TOL[dtype])
        torch.testing.assert_close(normed, ref_normed, **OP_TOL[dtype])

        # fp32 reference: the same math, nothing rounded before the end.
        exact_normed, exact_res = fused_allreduce_rmsnorm_reference(
            [p.float() for p in partials], None if residual is None else residual.float(),
            weight.float(), eps, torch.float32,
        )
        eager_normed, eager_res = _eager(partials[rank], residual, weight, eps)
        assert_not_less_accurate(res_out, eager_res, exact_res, dtype)
        assert_not_less_accurate(normed, eager_normed, exact_normed, dtype)
        checked.append(tokens % world)

    _edge_cases(rank, world)
    check()
    # The search must have produced token counts that are not multiples of the world size.
    assert any(checked), "no example needed padding"
    return len(checked)


@pytest.mark.parametrize("world", [2, 3])
def test_portable_lowering_matches_reference_and_eager(world):
    """Edge shapes (1 token, fewer tokens than ranks, [B, S, H]) first, then the random search."""
    counts = spawn(_property_rank, world, "gloo", 40)
    assert counts == [counts[0]] * world and counts[0] >= 20


def _eager_layer_norm(partial, residual, weight, bias, eps):
    """What a TP model with a LayerNorm computes without weave: all_reduce in its dtype, add,
    ``F.layer_norm``."""
    summed = partial.clone()
    dist.all_reduce(summed)
    h = summed if residual is None else summed + residual
    return torch.nn.functional.layer_norm(h, (h.shape[-1],), weight, bias, eps), h


def _layer_norm_rank(rank: int, world: int) -> int:
    """``weave.fused_allreduce_layernorm`` on the portable lowering against the reference math
    (``OP_TOL`` for the residual; for ``normed`` see below) and against eager (not less accurate,
    measured against the fp32 reference), over dtypes, odd token counts, with and without residual,
    weight and bias."""
    group_name = dist.group.WORLD.group_name
    checked = 0
    for dtype in DTYPES:
        for seed, (tokens, hidden, residual_on, affine) in enumerate([
            (1, 24, True, "weight+bias"), (max(world - 1, 1), 64, False, "weight"), (9, 64, True, "bias"),
            (37, 136, True, "none"), (37, 136, False, "weight+bias"),
        ]):
            partials = _partials(seed, world, tokens, hidden, dtype)
            g = torch.Generator().manual_seed(seed + 7)
            residual = torch.randn(tokens, hidden, generator=g).to(dtype) if residual_on else None
            weight = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype) if "weight" in affine else None
            bias = (0.1 * torch.randn(hidden, generator=g)).to(dtype) if "bias" in affine else None
            normed, res_out = torch.ops.weave.fused_allreduce_layernorm(
                partials[rank], residual, weight, bias, 1e-5, group_name, dtype, "portable", WORKSPACE)
            ref_normed, ref_res = fused_allreduce_rmsnorm_reference(
                partials, residual, weight, 1e-5, dtype, bias=bias, layer_norm=True)
            assert normed.dtype == res_out.dtype == dtype and normed.shape == res_out.shape == (tokens, hidden)
            torch.testing.assert_close(res_out, ref_res, **OP_TOL[dtype])
            # A 1-ulp flip of one residual_out element x_i (the fp32 sums' order, as in OP_TOL)
            # moves normed_i by up to eps(dtype) * |x_i| * rstd * |w_i|: unlike RMSNorm's, that is
            # not relative to normed_i (x_i - mean may be ~0), so the bound is absolute, at the
            # largest |x_i| * rstd of the rows; plus normed's own rounding (rtol).
            x = ref_res.double()
            spread = (x.abs() / x.std(-1, correction=0, keepdim=True)).max().item()
            w_max = 1.0 if weight is None else weight.double().abs().max().item()
            torch.testing.assert_close(normed, ref_normed, rtol=2 * EPS[dtype], atol=2 * EPS[dtype] * spread * w_max)

            # The exact values, in fp64 and through F.layer_norm (not the code under test).
            exact_res = sum(p.double() for p in partials) + (0 if residual is None else residual.double())
            exact_normed = torch.nn.functional.layer_norm(
                exact_res, (hidden,), None if weight is None else weight.double(),
                None if bias is None else bias.double(), 1e-5)
            eager_normed, eager_res = _eager_layer_norm(partials[rank], residual, weight, bias, 1e-5)
            assert_not_less_accurate(res_out, eager_res, exact_res, dtype)
            assert_not_less_accurate(normed, eager_normed, exact_normed, dtype)
            checked += 1
    return checked


def test_portable_layer_norm_matches_reference_and_eager():
    assert spawn(_layer_norm_rank, 2, "gloo") == [15, 15]


def test_unknown_lowering_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown weave lowering 'nccl'"):
        torch.ops.weave.fused_allreduce_rmsnorm(
            torch.ones(2, 8), None, None, 1e-6, "0", torch.float32, "nccl", WORKSPACE
        )
