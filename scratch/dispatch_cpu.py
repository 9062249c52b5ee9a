import time, statistics, torch
lib = torch.library.Library("wb", "DEF")
outs = {}
def impl8(p, r, w, eps, g, dt, low, cap): return p, r
def impl3(p, r, w): return p, r
def impl4(p, r, w, i): return p, r
lib.define("e8(Tensor partial, Tensor? residual, Tensor? weight, float eps, str group_name, ScalarType out_dtype, str lowering, int workspace_tokens) -> (Tensor, Tensor)")
lib.define("e3(Tensor p, Tensor? r, Tensor? w) -> (Tensor, Tensor)")
lib.define("e4(Tensor p, Tensor? r, Tensor? w, int i) -> (Tensor, Tensor)")
lib.define("j(Tensor(a!) t) -> ()")
lib.impl("e8", impl8, "CompositeExplicitAutograd"); lib.impl("e3", impl3, "CompositeExplicitAutograd"); lib.impl("e4", impl4, "CompositeExplicitAutograd")
lib.impl("j", lambda t: None, "CompositeExplicitAutograd")
p = torch.randn(4, 8); r = torch.randn(4, 8); w = torch.randn(8)
def t(name, fn, n=20000):
    for _ in range(500): fn()
    xs=[]
    for _ in range(5):
        t0=time.perf_counter()
        for _ in range(n): fn()
        xs.append((time.perf_counter()-t0)*1e6/n)
    print(f"{name:>30}: {statistics.median(xs):.2f} us")
E8=torch.ops.wb.e8.default; E3=torch.ops.wb.e3.default; E4=torch.ops.wb.e4.default; J=torch.ops.wb.j.default
W=torch.ops._c10d_functional.wait_tensor.default
with torch.no_grad():
    t("python impl8", lambda: impl8(p, r, w, 1e-5, "0", torch.bfloat16, "cuda_symm", 16384))
    t("e8", lambda: E8(p, r, w, 1e-5, "0", torch.bfloat16, "cuda_symm", 16384))
    t("e3", lambda: E3(p, r, w))
    t("e4", lambda: E4(p, r, w, 3))
    t("j (mutating)", lambda: J(p))
    t("wait_tensor (no work)", lambda: W(p))
    t("empty_like", lambda: torch.empty_like(p))
t("e8 grad mode", lambda: E8(p, r, w, 1e-5, "0", torch.bfloat16, "cuda_symm", 16384))
t("wait_tensor grad mode", lambda: W(p))
lib.define("es(Tensor p, Tensor? r, Tensor? w, str spec) -> (Tensor, Tensor)")
lib.impl("es", lambda p, r, w, s: (p, r), "CompositeExplicitAutograd")
ES = torch.ops.wb.es.default
with torch.no_grad():
    t("es (one str)", lambda: ES(p, r, w, "1e-05|0|bf16|cuda_symm|16384"))
import torch.distributed._functional_collectives
import torch.distributed as dist
with torch.no_grad():
    t("wait_tensor after funcol import", lambda: W(p))
