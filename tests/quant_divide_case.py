"""``kernels._divide_rn`` (the quantized epilogue's division by a scale through one reciprocal per
scale) under Triton's interpreter on CPU, against IEEE fp32 division (numpy's, which ``div.rn.f32``
and eager's tensor division on CUDA also give): run by tests/test_quant_kernels_interpreted.py as
``TRITON_INTERPRET=1 python tests/quant_divide_case.py``; prints ``divide_rn: OK``.

Dividends: every finite bf16 value, every fp16 value, every 5th fp32 significand in [1, 2) (every
11th scaled by -2^-5), and special values (signed zeros, infinities, NaN, subnormals, the fp32
limits). Divisors: scales near the ends of a binade (where ``RN(x * RN(1 / s))`` is furthest from
the quotient), the test models' static and dynamic scales, tiny and huge scales (the rescaling by
2^+-64), 0 and inf. Required: the quotient bit for bit wherever ``|x / s| >= 2^-11`` (any quotient
that can reach a nonzero fp8 or int8 code; NaNs compare as NaN), and for smaller quotients the
same sign and at most one ulp apart (their codes are all +-0).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from weavepass.runtime.cuda.kernels import _divide_rn, _scale_reciprocals

f32 = np.float32
BLOCK = 1 << 20


@triton.jit
def _divide_kernel(x_ptr, s_ptr, out_ptr, N: tl.constexpr):
    offs = tl.program_id(0) * N + tl.arange(0, N)
    _, sk, neg_r, neg_k = _scale_reciprocals(tl.load(s_ptr))  # one scale, as the static form's (a scalar)
    tl.store(out_ptr + offs, _divide_rn(tl.load(x_ptr + offs), sk, neg_r, neg_k))


@triton.jit
def _divide_rows_kernel(x_ptr, s_ptr, out_ptr, ROWS: tl.constexpr, N: tl.constexpr):
    rows = tl.arange(0, ROWS)
    offs = rows[:, None] * N + tl.arange(0, N)[None, :]
    _, sk, neg_r, neg_k = _scale_reciprocals(tl.load(s_ptr + rows))  # one scale per row (broadcast)
    tl.store(out_ptr + offs, _divide_rn(tl.load(x_ptr + offs), sk[:, None], neg_r[:, None], neg_k[:, None]))


def dividends() -> np.ndarray:
    bf16 = (np.arange(1 << 16, dtype=np.uint32) << 16).view(np.float32)
    fp16 = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
    significands = (np.arange(1 << 23, dtype=np.uint32) | (127 << 23)).view(np.float32)
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 1e-40, -1e-40, 1.17549435e-38,
                         3.4028235e38, -3.4028235e38, 2.0**-10, -(2.0**-10), 448.0, -448.0], dtype=f32)
    x = np.concatenate([bf16[np.isfinite(bf16)], fp16, significands[::5], -significands[3::11] * f32(2.0**-5),
                        specials])
    return np.ascontiguousarray(np.resize(x, -(-len(x) // BLOCK) * BLOCK).astype(f32))  # whole blocks


SCALES = [1.0, 1.5, float(np.nextafter(f32(2), f32(0))), 1.0000001, 1.9999, 3.0 / 448, 4.0 / 448, 1 / 127.0,
          1 / (448 * 512.0), 1e-10 / 448, 2.0**-64, 2.0**-65, 1.37 * 2.0**-100, 1e-41, 1e-45, 2.0**64, 2.0**65,
          1.37 * 2.0**100, 2.0**126, 3.4e38, 0.0, float("inf"), -4.0 / 448]


def check(x: np.ndarray, s: np.ndarray, got: np.ndarray, label: str) -> int:
    with np.errstate(all="ignore"):
        want = (x / s).astype(f32)
    same = (want.view(np.int32) == got.view(np.int32)) | (np.isnan(want) & np.isnan(got))
    small = np.abs(want) < f32(2.0**-11)
    ulp = np.abs(np.nextafter(want, f32(np.inf)) - want)
    near = small & (np.signbit(want) == np.signbit(got)) & (np.abs(got - want) <= ulp)
    bad = ~(same | near)
    assert not bad.any(), (label, x[bad][:4], s[bad][:4] if s.ndim else s, want[bad][:4], got[bad][:4])
    return int((~same).sum())


def main() -> None:
    x = dividends()
    out = np.empty_like(x)
    off_by_ulp = 0
    for scale in SCALES:
        s = np.array([scale], dtype=f32)
        _divide_kernel[(x.size // BLOCK,)](torch.from_numpy(x), torch.from_numpy(s), torch.from_numpy(out), N=BLOCK)
        off_by_ulp += check(x, s[0], out, f"scale {scale}")
    # one scale per row: rows of every other fp16 dividend, each row its own scale
    scales = np.resize(np.array(SCALES, dtype=f32), 32)  # rows: a power of two
    rows = np.ascontiguousarray(np.resize(np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(f32)[::2],
                                          (len(scales), 1 << 15)))
    out = np.empty_like(rows)
    _divide_rows_kernel[(1,)](torch.from_numpy(rows), torch.from_numpy(scales), torch.from_numpy(out),
                              ROWS=len(scales), N=1 << 15)
    off_by_ulp += check(rows, scales[:, None], out, "per row")
    print(f"divide_rn: OK ({off_by_ulp} quotients below 2^-11 one ulp off, same sign)")


if __name__ == "__main__":
    main()
