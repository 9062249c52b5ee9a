"""Probe: can two ranks share one GPU well enough to run the multi-rank code paths (not timings)?

Only the one-GPU kind has been lent for several sessions. If two processes on cuda:0 can form a
group (gloo, CUDA tensors), rendezvous symmetric memory and run the fused kernel, the 2-rank tests
can at least check correctness on one GPU. Prints one line per step: ok / FAILED with the error.

Measured on one H200 (2026-12-01): NCCL refuses ("Duplicate GPU detected"); gloo carries CUDA
tensors for all_reduce, reduce_scatter_tensor and all_gather_into_tensor through ``dist``, but the
functional ``_c10d_functional.reduce_scatter_tensor`` segfaults (mode ``funcol``); symm_mem's
rendezvous refuses two ranks on one device, and the workspace through CUDA IPC
(``weavepass.testing.shared_gpu``, ``PROBE_IPC=1``, the default) runs the fused kernel and the
reference model compiled with weave (fuse and split) correctly.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")


def _step(rank, name, fn):
    t0 = time.perf_counter()
    try:
        out = fn()
        print(f"[rank {rank}] {name}: ok ({time.perf_counter() - t0:.2f} s) {out if out is not None else ''}",
              flush=True)
        return True
    except Exception as exc:  # noqa: BLE001 - a probe reports every failure
        print(f"[rank {rank}] {name}: FAILED {type(exc).__name__}: {str(exc)[:400]}", flush=True)
        if os.environ.get("PROBE_TB"):
            traceback.print_exc()
        return False


def _gloo_rank(rank, world, port):
    torch.cuda.set_device(0)
    if os.environ.get("PROBE_IPC", "1") == "1":  # the workspace through CUDA IPC (symm_mem refuses)
        from weavepass.testing import shared_gpu
        os.environ[shared_gpu.ENV] = "1"
        shared_gpu.install()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    dev = torch.device("cuda", 0)

    def allreduce():
        x = torch.full((4, 8), float(rank + 1), device=dev)
        dist.all_reduce(x)
        assert x[0, 0].item() == sum(range(1, world + 1)), x
    _step(rank, "gloo all_reduce on cuda tensors", allreduce)

    def funcol():
        import torch.distributed._functional_collectives as fc
        x = torch.full((4, 8), float(rank + 1), device=dev)
        y = fc.all_reduce(x, "sum", dist.group.WORLD)
        y = fc.wait_tensor(y) if hasattr(y, "wait") or True else y
        assert y[0, 0].item() == sum(range(1, world + 1))
    _step(rank, "funcol all_reduce (gloo, cuda)", funcol)

    def rs_ag():
        x = torch.arange(world * 4 * 8, device=dev, dtype=torch.float32).view(world * 4, 8)
        out = torch.empty(4, 8, device=dev)
        dist.reduce_scatter_tensor(out, x)
        ag = torch.empty(world * 4, 8, device=dev)
        dist.all_gather_into_tensor(ag, out)
        assert torch.equal(ag, x * world)
    _step(rank, "reduce_scatter_tensor + all_gather_into_tensor (gloo, cuda)", rs_ag)

    def kernel():
        from weavepass.runtime.cuda.dispatch import fused_allreduce_rmsnorm_cuda
        from weavepass.runtime.reference import fused_allreduce_rmsnorm_reference
        worst = 0.0
        for tokens in (1, 128, 1024, 4097):
            gen = torch.Generator(device=dev)
            gen.manual_seed(tokens)
            partials = [torch.randn(tokens, 4096, generator=gen, device=dev).bfloat16() for _ in range(world)]
            residual = torch.randn(tokens, 4096, generator=gen, device=dev).bfloat16()
            weight = torch.randn(4096, generator=gen, device=dev).bfloat16()
            want, want_res = fused_allreduce_rmsnorm_reference(partials, residual, weight, 1e-6, torch.bfloat16)
            got, got_res = fused_allreduce_rmsnorm_cuda(
                partials[rank], residual, weight, 1e-6, dist.group.WORLD.group_name, torch.bfloat16
            )
            torch.cuda.synchronize()
            worst = max(worst, (got.float() - want.float()).abs().max().item(),
                        (got_res.float() - want_res.float()).abs().max().item())
        assert worst < 0.1, worst
        return f"max abs diff {worst:.3g}"
    _step(rank, "weave fused kernel, 2 ranks on one GPU (PROBE_IPC=0: symm_mem rendezvous)", kernel)

    def many_calls():
        from weavepass.runtime.cuda.dispatch import fused_allreduce_rmsnorm_cuda
        x = torch.randn(1024, 4096, device=dev).bfloat16()
        w = torch.ones(4096, device=dev).bfloat16()
        t0 = time.perf_counter()
        for _ in range(50):
            fused_allreduce_rmsnorm_cuda(x, x, w, 1e-6, dist.group.WORLD.group_name, torch.bfloat16)
        torch.cuda.synchronize()
        return f"50 calls in {time.perf_counter() - t0:.2f} s"
    _step(rank, "50 back-to-back kernel calls", many_calls)

    def compiled_model():
        import weavepass
        from weavepass.testing.harness import check_against_eager
        from weavepass.testing.models import TPConfig, build_tp_model, random_token_ids
        cfg = TPConfig(vocab=512, hidden=512, n_layers=2, n_heads=8, n_kv_heads=4, head_dim=64,
                       intermediate=1024, dtype=torch.bfloat16)
        results = []
        for split in ("off", "force"):
            torch._dynamo.reset()
            model = build_tp_model(cfg, rank, world, dist.group.WORLD, device=dev)
            ref = build_tp_model(cfg, rank, world, dist.group.WORLD, device=dev, dtype=torch.float32)
            ids = random_token_ids(cfg, 1, 512, seed=3, device=dev)
            backend = weavepass.make_backend(weavepass.WeaveConfig(split=split, cuda_min_tokens=1))
            cmp = check_against_eager(model, (ids,), lambda m: torch.compile(m, backend=backend), ref, cfg.dtype)
            results.append((split, sorted({r.lowering for r in backend.report.records}), cmp.max_abs_diff))
        return results
    _step(rank, "reference model compiled with weave (fuse, split)", compiled_model)
    dist.destroy_process_group()


def _funcol_rank(rank, world, port):
    """Plain functional reduce_scatter + all_gather on gloo with CUDA tensors: eager, then compiled by
    default Inductor (no weave): what FlashComm's unfused lowering runs."""

    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    name = dist.group.WORLD.group_name

    def f(x):
        s = torch.ops._c10d_functional.reduce_scatter_tensor(x * 2, "sum", world, name)
        s = torch.ops._c10d_functional.wait_tensor(s)
        g = torch.ops._c10d_functional.all_gather_into_tensor(s + 1, world, name)
        return torch.ops._c10d_functional.wait_tensor(g)

    x = torch.randn(64, 128, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    want = None

    def eager():
        nonlocal want
        want = f(x)
        torch.cuda.synchronize()
    _step(rank, "funcol reduce_scatter + all_gather, eager (gloo, cuda)", eager)

    def compiled():
        got = torch.compile(f)(x)
        torch.cuda.synchronize()
        return f"max diff {(got - want).abs().max().item():.3g}"
    _step(rank, "the same compiled by default Inductor", compiled)
    dist.destroy_process_group()


def _nccl_rank(rank, world, port):
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)

    def ar():
        x = torch.ones(4, device="cuda")
        dist.all_reduce(x)
        torch.cuda.synchronize()
        return x[0].item()
    _step(rank, "NCCL with two ranks on one GPU", ar)
    dist.destroy_process_group()


def _launch(target, world, timeout):
    from weavepass.testing.distributed import free_port
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(1.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            print(f"{target.__name__}: rank still running after {timeout} s; terminated", flush=True)
            p.kill()
            p.join()


if __name__ == "__main__":
    which = sys.argv[1:] or ["gloo", "nccl"]
    if "gloo" in which:
        _launch(_gloo_rank, 2, 240)
    if "funcol" in which:
        _launch(_funcol_rank, 2, 150)
    if "nccl" in which:
        _launch(_nccl_rank, 2, 60)
