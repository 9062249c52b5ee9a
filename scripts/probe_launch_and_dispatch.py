"""Host cost probes on one GPU (2026-12-01): a Triton kernel launch with 8 against 28 arguments, through
Triton's launcher (tensor and int pointers) and PyTorch's static launcher, and the torch.ops dispatch of an
empty op with the fused op's schema against a compact one (3 tensors + 1 string) and the join's.
Run: ``python3 scripts/probe_launch_and_dispatch.py`` (docs/cuda_kernel.md, *Host cost*)."""

import statistics
import time

import torch
import triton
import triton.language as tl


@triton.jit
def k8(a, b, c, d, e, f, g, h, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    if pid < 0:
        tl.store(a + n, tl.load(b) + tl.load(c) + tl.load(d) + tl.load(e) + tl.load(f) + tl.load(g) + tl.load(h))


@triton.jit
def k28(
    a,
    b,
    c,
    d,
    e,
    f,
    g,
    h,
    i0,
    i1,
    i2,
    i3,
    i4,
    i5,
    i6,
    i7,
    j0,
    j1,
    j2,
    j3,
    j4,
    j5,
    j6,
    j7,
    n,
    m,
    q,
    eps,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid < 0:
        s = i0 + i1 + i2 + i3 + i4 + i5 + i6 + i7 + j0 + j1 + j2 + j3 + j4 + j5 + j6 + j7 + m + q
        tl.store(
            a + n + s, (tl.load(b) + tl.load(c) + tl.load(d) + tl.load(e) + tl.load(f) + tl.load(g) + tl.load(h)) * eps
        )


def t(name, fn, n=5000):
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    xs = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        xs.append((time.perf_counter() - t0) * 1e6 / n)
        torch.cuda.synchronize()
    print(f"{name:>44}: {statistics.median(xs):6.2f} us", flush=True)


x = torch.zeros(1024, device="cuda", dtype=torch.bfloat16)
ptrs = [x] * 8
ints = [1 << 20] * 16
c8 = k8[(16,)](*ptrs, 7, BLOCK=128)
c28 = k28[(16,)](*ptrs, *ints, 7, 9, 11, 1e-5, BLOCK=128)
s = torch._C._cuda_getCurrentRawStream(0)
t("k8  compiled.run", lambda: c8.run(16, 1, 1, s, c8.function, c8.packed_metadata, None, None, None, *ptrs, 7, 128))
t(
    "k28 compiled.run",
    lambda: c28.run(
        16, 1, 1, s, c28.function, c28.packed_metadata, None, None, None, *ptrs, *ints, 7, 9, 11, 1e-5, 128
    ),
)
ip = [p.data_ptr() for p in ptrs]
t(
    "k8  compiled.run int pointers",
    lambda: c8.run(16, 1, 1, s, c8.function, c8.packed_metadata, None, None, None, *ip, 7, 128),
)
t("empty kernel torch (x.zero_)", lambda: x.zero_())
L = torch._C._StaticCudaLauncher._launch_kernel
t(
    "k8 static",
    lambda: L(
        c8.function, 16, 1, 1, c8.metadata.num_warps, c8.metadata.shared, "OOOOOOOOiOO", (*ptrs, 7, None, None), s
    ),
)

lib = torch.library.Library("wb", "DEF")
lib.define(
    "e8(Tensor partial, Tensor? residual, Tensor? weight, float eps, str group_name, ScalarType out_dtype, "
    "str lowering, int workspace_tokens) -> (Tensor, Tensor)"
)
lib.define("es(Tensor p, Tensor? r, Tensor? w, str spec) -> (Tensor, Tensor)")
lib.define("j(Tensor(a!) a, Tensor(b!) b, Tensor[] i) -> ()")
lib.impl("e8", lambda p, r, w, eps, g, dt, low, cap: (p, r), "CompositeExplicitAutograd")
lib.impl("es", lambda p, r, w, sp: (p, r), "CompositeExplicitAutograd")
lib.impl("j", lambda a, b, i: None, "CompositeExplicitAutograd")
E8, ES, J = torch.ops.wb.e8.default, torch.ops.wb.es.default, torch.ops.wb.j.default
with torch.no_grad():
    t("op e8 (today's schema)", lambda: E8(x, x, x, 1e-5, "0", torch.bfloat16, "cuda_symm", 16384))
    t("op es (3 tensors + 1 str)", lambda: ES(x, x, x, "1e-05|0|bfloat16|cuda_symm|16384"))
    t("op j (join schema)", lambda: J(x, x, [x, x]))
    t("torch.cuda.set_stream x2", lambda: (torch.cuda.set_stream(torch.cuda.current_stream()),))
