"""Diagnose the CUDA quantized epilogue against eager on one GPU (issue 36).

For each form at a group of one rank (the launch rule's grid), run the kernel through
``testing.kernel_sim`` and compare its codes and scales with eager's quantization of the kernel's own
normed rows (``runtime.quant.quantize_rows``, as tests/gpu/test_quant_epilogue_gpu.py does). For the
mismatches, print the normed value, the scale, the quotient computed several ways (IEEE division,
multiplication by the fp32 reciprocal, fp64) and whether it sits on an fp8/int8 rounding boundary;
also whether the kernel's normed rows equal the reference's. Writes each quantizing kernel's PTX
under ``--out`` (a folder) so that the arithmetic the compiler emitted can be read.

    python scripts/quant_epilogue_diag.py --tokens 1 1024 --out /tmp/diag
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import re

import torch
import triton

from weavepass.runtime.cuda.launch_plan import LaunchOverrides
from weavepass.runtime.cuda.quant_epilogue import QuantEpilogue, plan_quant_epilogue
from weavepass.runtime.quant import quantize_rows
from weavepass.runtime.reference import fused_allreduce_rmsnorm_reference
from weavepass.testing.kernel_sim import SimulatedRanks
from weavepass.testing.quant import FP8, FUSED_FORMS, STATIC_ACT_SCALE
from weavepass.testing.quant_steps import form_steps

_COMPILED: list = []
_warmup = triton.runtime.jit.JITFunction.warmup


def _capture(self, *args, **kwargs):
    compiled = _warmup(self, *args, **kwargs)
    _COMPILED.append(compiled)
    return compiled


triton.runtime.jit.JITFunction.warmup = _capture


def _inputs(world, tokens, hidden, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    draw = lambda *shape: torch.randn(*shape, generator=gen, device="cuda")  # noqa: E731
    partials = [draw(tokens, hidden).to(dtype) for _ in range(world)]
    residual = draw(tokens, hidden).to(dtype)
    weight = 1 + 0.1 * draw(hidden)
    weight[:8] = 12.0
    weight[8:16] = 1e-3
    return partials, residual, weight.to(dtype)


def _ptx_summary(ptx: str) -> str:
    ops = collections.Counter(re.findall(r"\b(div\.[a-z.]+f32|rcp\.[a-z.]+f32|fma\.[a-z.]+f32|"
                                         r"cvt\.[a-z.0-9]*e4m3[a-z0-9.]*|cvt\.rn[a-z.]*bf16[a-z0-9.]*|"
                                         r"max\.[a-z.]*f32|min\.[a-z.]*f32|neg\.f32|add\.[a-z.]*f32)", ptx))
    return ", ".join(f"{k} x{v}" for k, v in sorted(ops.items()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=8192)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 1024])
    ap.add_argument("--forms", nargs="+", default=list(FUSED_FORMS))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    out = pathlib.Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    sim = SimulatedRanks(args.world, args.hidden, max(args.tokens), dtype)
    for form in args.forms:
        static = (torch.tensor(STATIC_ACT_SCALE, dtype=torch.float32, device="cuda")
                  if form.startswith("fp8_static") else None)
        scale_steps, code_steps, group = form_steps(form, dtype)
        quant = plan_quant_epilogue(dtype, args.hidden, None if static is None else (torch.float32, 0), group,
                                    scale_steps, code_steps, True)
        assert isinstance(quant, QuantEpilogue), quant
        for t in args.tokens:
            label = f"{form} world={args.world} T={t}"
            partials, residual, weight = _inputs(args.world, t, args.hidden, dtype, seed=t)
            sim.poison()
            _COMPILED.clear()
            outputs = sim.run(partials, residual, weight, 1e-6, dtype, LaunchOverrides(), quant=quant,
                              static_scale=static)
            if out and _COMPILED and t == args.tokens[-1] and form in ("fp8_static", "fp8_row"):
                ptx = _COMPILED[0].asm.get("ptx", "")
                (out / f"{form}_T{t}.ptx").write_text(ptx)
                print(f"[ptx] {label}: {_ptx_summary(ptx)}")
            want_normed, _ = fused_allreduce_rmsnorm_reference(partials, residual, weight, 1e-6, dtype)
            normed, _, codes, scales = outputs[0]
            same_normed = int((normed.view(torch.int16) != want_normed.view(torch.int16)).sum())
            want_codes, want_scales = quantize_rows(normed, static, group, scale_steps, code_steps)
            kc = codes.reshape(want_codes.shape)
            diff = kc.view(torch.uint8) != want_codes.view(torch.uint8)
            nd = int(diff.sum())
            scale_diff = int((scales.reshape(want_scales.shape) != want_scales).sum())
            print(f"[{'OK' if nd == 0 and scale_diff == 0 else 'MISMATCH'}] {label}: codes differ {nd} of "
                  f"{kc.numel()}, scales differ {scale_diff} of {want_scales.numel()}, normed != reference "
                  f"{same_normed} of {normed.numel()}", flush=True)
            if scale_diff:
                idx = (scales.reshape(want_scales.shape) != want_scales).nonzero()[:5]
                for i in idx.tolist():
                    print("   scale", i, float(scales.reshape(want_scales.shape)[tuple(i)]),
                          float(want_scales[tuple(i)]))
            if not nd:
                continue
            # which arithmetic do the kernel's codes follow?
            x = normed if not group else normed.unflatten(-1, (args.hidden // group, group))
            s = want_scales
            xf = x.float()
            variants = {
                "ieee_div": xf / s,
                "mul_recip_fp32": xf * s.reciprocal(),
                "div_fp64": (xf.double() / s.double()).float(),
            }
            lo, hi = (-128, 127) if want_codes.dtype == torch.int8 else (-448.0, 448.0)
            for name, q in variants.items():
                if want_codes.dtype == torch.int8:
                    c = q.round().clamp(lo, hi).to(torch.int8)
                else:
                    c = q.clamp(lo, hi).to(FP8)
                nv = int((c.view(torch.uint8) != kc.view(torch.uint8)).sum())
                print(f"   kernel codes vs eager with {name}: {nv} differ")
            where = diff.nonzero()[:12]
            for i in where.tolist():
                i = tuple(i)
                v = x[i]
                sv = s[i[:-1] + (0,)] if s.dim() else s
                q_ieee = float(variants["ieee_div"][i])
                q64 = float(xf.double()[i] / sv.double())
                bits = torch.tensor([q_ieee], dtype=torch.float32).view(torch.int32).item()
                print(f"   at {i}: normed {float(v)!r} (bits {v.view(torch.int16).item() & 0xffff:#06x}) scale "
                      f"{float(sv)!r} q_ieee {q_ieee!r} (bits {bits & 0xffffffff:#010x}) q_fp64 {q64!r} "
                      f"q_recip {float(variants['mul_recip_fp32'][i])!r} kernel {float(kc[i].float())!r} "
                      f"({kc[i].view(torch.uint8).item():#04x}) eager {float(want_codes[i].float())!r} "
                      f"({want_codes[i].view(torch.uint8).item():#04x})")
    print("diag done", flush=True)


if __name__ == "__main__":
    main()
