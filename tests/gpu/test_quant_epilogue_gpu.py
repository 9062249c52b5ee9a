"""The CUDA kernels' quantized norm epilogue on one GPU: every carried form (FP8 e4m3 static,
per-row, per-group of 128; int8 per-row) at a group of one rank and with 2 and 4 simulated ranks
(weavepass.testing.kernel_sim), and the op's CUDA lowering called as a compiled graph calls it.

Tolerance: the codes and scales are eager's bit for bit, eager being the graph's own quantization
(``quantize_rows``, run on this GPU, where ATen divides by a number as a multiplication by its
fp32 reciprocal, as the kernel does: ``runtime.cuda.quant_epilogue``) applied to the kernel's own
normed rows; the normed rows and ``residual_out`` against the fp32 reference within the kernel
tests' tolerances (test_kernel_sim_one_gpu.py). Values reach the formats' limits (saturation at the
static scale's +-448, the largest dynamic code, fp8 subnormals). The kernels run as launches do by
default (``quant_epilogue.FAST_ARITHMETIC``: the division through one reciprocal per scale, the
hardware fp8 cast without the +-448 clamps); benchmarks/bench_local_cost.py ``--quant`` checks that
the other setting gives the same codes.
"""

from __future__ import annotations

import pytest
import torch

from weavepass.runtime.cuda.launch_plan import LaunchOverrides
from weavepass.runtime.quant import quantize_rows
from weavepass.runtime.reference import fused_allreduce_rmsnorm_reference
from weavepass.testing.quant import FP8, FP8_MAX, FUSED_FORMS, STATIC_ACT_SCALE
from weavepass.testing.quant_steps import form_steps

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
                       reason="fp8 codes need sm_89+"),
]

EPS = 1e-6
RESIDUAL_TOL = {torch.bfloat16: (2**-7, 1e-5), torch.float16: (2**-10, 1e-5)}
NORMED_TOL = {torch.bfloat16: (2**-6, 2**-6), torch.float16: (2**-9, 2**-9)}
ALGORITHMS = {
    "rule": LaunchOverrides(),
    "one_shot": LaunchOverrides(one_shot=True, lamport=False),
    "two_shot": LaunchOverrides(one_shot=False, pipelined=False),
    "pipelined": LaunchOverrides(one_shot=False, pipelined=True, num_ctas=16),
    "lamport": LaunchOverrides(lamport=True),
}
# (world, algorithm, forms, dtype, hidden, tokens): every form at one and two ranks; the other
# kernels and four ranks on the per-row and per-group forms (each rank compiles its own kernel).
CASES = [
    (1, "rule", FUSED_FORMS, torch.bfloat16, 8192, (1, 1024, 4099)),
    (1, "rule", ("fp8_row", "fp8_group", "int8_row"), torch.float16, 4096, (127,)),
    (2, "two_shot", FUSED_FORMS, torch.bfloat16, 4096, (127,)),
    (2, "one_shot", ("fp8_row", "fp8_group"), torch.bfloat16, 4096, (16,)),
    (2, "pipelined", ("fp8_group", "int8_row"), torch.bfloat16, 4096, (1024,)),
    (2, "lamport", ("fp8_row", "fp8_group"), torch.bfloat16, 4096, (16,)),
    (4, "two_shot", ("fp8_row", "fp8_group"), torch.bfloat16, 4096, (127,)),
]


def _inputs(world, tokens, hidden, dtype, seed=0):
    """Partials, residual, and a weight with large entries (saturating the static scale, the
    largest dynamic codes) and tiny ones (fp8 subnormals)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    draw = lambda *shape: torch.randn(*shape, generator=gen, device="cuda")  # noqa: E731
    partials = [draw(tokens, hidden).to(dtype) for _ in range(world)]
    residual = draw(tokens, hidden).to(dtype)
    weight = 1 + 0.1 * draw(hidden)
    weight[:8] = 12.0
    weight[8:16] = 1e-3
    return partials, residual, weight.to(dtype)


def _static_scale(form):
    return torch.tensor(STATIC_ACT_SCALE, dtype=torch.float32, device="cuda") if form.startswith("fp8_static") else None


def _check_codes(codes, scales, normed, static, form, dtype, label):
    """Bit for bit against eager's quantization of ``normed`` (this GPU); the formats' limits reached."""
    scale_steps, code_steps, group = form_steps(form, dtype)
    want_codes, want_scales = quantize_rows(normed, static, group, scale_steps, code_steps)
    assert torch.equal(codes.reshape(want_codes.shape).view(torch.uint8), want_codes.view(torch.uint8)), label
    assert torch.equal(scales.reshape(want_scales.shape), want_scales), label
    values = want_codes.float()
    assert (values.abs() == (127 if want_codes.dtype == torch.int8 else FP8_MAX)).any(), label
    if want_codes.dtype == FP8 and normed.shape[0] > 1:
        assert ((values.abs() < 2.0**-6) & (values != 0)).any(), label


@pytest.mark.parametrize("world, algorithm, forms, dtype, hidden, tokens", CASES,
                         ids=[f"world{c[0]}-{c[1]}-{str(c[3])[6:]}-H{c[4]}" for c in CASES])
def test_simulated_ranks(world, algorithm, forms, dtype, hidden, tokens):
    from weavepass.runtime.cuda.quant_epilogue import plan_quant_epilogue
    from weavepass.testing.kernel_sim import SimulatedRanks

    sim = SimulatedRanks(world, hidden, max(tokens), dtype)
    overrides = ALGORITHMS[algorithm]
    for form in forms:
        static = _static_scale(form)
        scale_steps, code_steps, group = form_steps(form, dtype)
        quant = plan_quant_epilogue(dtype, hidden, None if static is None else (torch.float32, 0), group,
                                    scale_steps, code_steps, True)
        for t in tokens:
            label = f"{form} world={world} {algorithm} {dtype} H={hidden} T={t}"
            partials, residual, weight = _inputs(world, t, hidden, dtype, seed=t)
            sim.poison()
            outputs = sim.run(partials, residual, weight, EPS, dtype, overrides, quant=quant, static_scale=static)
            want_normed, want_res = fused_allreduce_rmsnorm_reference(partials, residual, weight, EPS, dtype)
            normed0, _, codes0, scales0 = outputs[0]
            for rank, (normed, res_out, codes, scales) in enumerate(outputs):
                torch.testing.assert_close(res_out, want_res, rtol=RESIDUAL_TOL[dtype][0], atol=RESIDUAL_TOL[dtype][1],
                                           msg=lambda m: f"{label} rank {rank} residual_out: {m}")
                torch.testing.assert_close(normed, want_normed, rtol=NORMED_TOL[dtype][0], atol=NORMED_TOL[dtype][1],
                                           msg=lambda m: f"{label} rank {rank} normed: {m}")
                assert torch.equal(normed, normed0), label  # every rank normalises the same rows
                _check_codes(codes, scales, normed, static, form, dtype, f"{label} rank {rank}")
                assert torch.equal(codes.view(torch.uint8), codes0.view(torch.uint8)) and torch.equal(scales, scales0)
            assert sim.signals_clear() and sim.lamport_clear(), f"{label}: signals or Lamport region left set"


def _dispatch_rank(rank, world):
    """The op's CUDA lowering as a compiled graph calls it (``runtime.fused_allreduce_rmsnorm_quant``)
    at a group of one rank: outputs shaped and typed as the portable lowering's; codes and scales
    eager's on the kernel's normed rows; the same codes without the normed rows; a static scale's
    copy; a form the kernel does not carry runs the portable lowering."""
    import torch.distributed as dist

    from weavepass.runtime import fused_allreduce_rmsnorm_quant as op

    group = dist.group.WORLD.group_name
    dtype = torch.bfloat16
    checked = []
    for form in FUSED_FORMS:
        static = _static_scale(form)
        scale_steps, code_steps, group_size = form_steps(form, dtype)
        for lead in ((3, 5), (4099,)):  # a [B, S, H] site and a [T, H] one
            (p,), r, weight = _inputs(1, lead[0] * (lead[-1] if len(lead) > 1 else 1), 4096, dtype)
            p, r = p.reshape(*lead, -1), r.reshape(*lead, -1)
            args = (p, r, weight, EPS, group, dtype, static, group_size, scale_steps, code_steps)
            codes, scales, res_out, normed = op(*args, True, "cuda_symm", 8192)
            portable = op(*args, True, "portable", 8192)
            label = f"{form} {lead}"
            for ours, theirs in zip((codes, scales, res_out, normed), portable):
                assert ours.shape == theirs.shape and ours.dtype == theirs.dtype, (label, ours.shape, theirs.shape)
            torch.testing.assert_close(normed, portable[3], rtol=2**-6, atol=2**-6)
            _check_codes(codes, scales, normed, static, form, dtype, label)
            if form in ("fp8_row", "fp8_group") and len(lead) == 1:  # (each option is a kernel to compile)
                again = op(*args, False, "cuda_symm", 8192)
                assert again[3].numel() == 0 and torch.equal(again[0].view(torch.uint8), codes.view(torch.uint8))
            if static is not None:
                assert torch.equal(scales, static) and scales.data_ptr() != static.data_ptr()
            checked.append(label)
    # a form the kernel does not carry (no clamp before the fp8 cast): the portable lowering's answer
    unclamped = "convert:float32|div_scale|convert:float8_e4m3fn"
    args = (p, r, weight, EPS, group, dtype, None, 0, "abs|amax|convert:float32|div:448.0", unclamped, False)
    with pytest.warns(RuntimeWarning, match="not clamped"):
        fallback = op(*args, "cuda_symm", 8192)
    assert all(torch.equal(a.view(torch.uint8) if a.dtype == FP8 else a, b.view(torch.uint8) if b.dtype == FP8 else b)
               for a, b in zip(fallback, op(*args, "portable", 8192)))
    return checked


def test_op_lowering_at_a_group_of_one():
    from weavepass.testing import spawn

    (checked,) = spawn(_dispatch_rank, 1, "nccl", timeout_s=600.0)
    assert len(checked) == 2 * len(FUSED_FORMS)
