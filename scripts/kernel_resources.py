"""Registers, stack (spills) and the width of global loads/stores of the two-shot CUDA kernels,
compiled for sm_90 on a machine WITHOUT a GPU (Triton's compiler and its bundled ``cuobjdump``).

    python scripts/kernel_resources.py [--worlds 2 4 8] [--tiles 4:16 1:8 ...] [--hidden 8192]
    python scripts/kernel_resources.py --gemm [0 4 ...] [--worlds 1 2 8]

``--gemm``: the persistent GEMM of issue 34 (``runtime/cuda/gemm_kernels.py``) instead, for the given
``gemm.GPU_CONFIGS`` indices (default all), with descriptor loads, bf16: per world its scatter with
signals through pointers (per-tile and deferred signals) and, for configs with TMA stores, through
one descriptor (deferred); ``MEMBAR.SYS`` counts the system-scope fences in the SASS (static, not
per tile).

A tile is ``ROWS:WARPS`` (rows of ``hidden`` bf16 per tile, warps per CTA); the launch rule's
choices are in ``weavepass/runtime/cuda/launch_plan.py``. Per kernel it prints ``REG`` (registers per
thread), ``STACK`` (bytes of local memory per thread: spills), ``SHARED`` (bytes of shared memory
per CTA; at most 227 KiB on sm_90), and the counts of 128-bit global loads/stores, asynchronous
copies into shared memory (``LDGSTS``: software-pipelined loads) and local loads/stores
(``LDL``/``STL``) in the SASS. The GPU machine's Triton may
allocate differently: this is a lead, ``bench_local_cost.py --sim`` reads the compiled kernel's
registers and spills there (docs/cuda_kernel.md, "What holds the N-rank kernels back").
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from weavepass.runtime.cuda import kernels
from weavepass.runtime.cuda.launch_plan import MAX_CTAS

POINTERS = {"inv_rms_ptr": "*fp32", "pad_ptr": "*i32", "scales_ptr": "*fp32", "static_scale_ptr": "*fp32",
            "qconst_ptr": "*fp32"}
ADDRESS_DELTAS = {"recv_offset"} | {f"wd{i}" for i in range(8)} | {f"pd{i}" for i in range(8)}
INT64 = ADDRESS_DELTAS | {"watch_addr", "timeout_ns"}
SASS = {"LDG.E.128": "LDG.E.128", "STG.E.128": "STG.E.128", "LDGSTS": "LDGSTS", "LDL": "LDL", "STL": "STL",
        "UTMASTG": "UTMASTG", "MEMBAR.SYS": "MEMBAR.SC.SYS|MEMBAR.ALL.SYS"}


def compile_sm90(fn, constants: dict, num_warps: int):
    """``fn`` compiled for sm_90 with the dispatcher's argument types (bf16 tensors, 16-divisible
    pointers and address deltas, as ``dispatch.kernel_arguments`` passes them)."""
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if fn.params[i].is_constexpr:
            signature[name], constexprs[(i,)] = "constexpr", constants[name]
            continue
        if name.endswith("_ptr"):
            signature[name] = POINTERS.get(name, "*bf16")
        else:
            signature[name] = "i64" if name in INT64 else "fp32" if name == "eps" else "i32"
        if name.endswith("_ptr") or name in ADDRESS_DELTAS:
            attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn, signature, constexprs, attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


def cuobjdump(compiled) -> tuple[str, str]:
    """``(resource usage, SASS)`` of a compiled kernel, from Triton's bundled ``cuobjdump``
    (scripts/gather_resources.py reads them too)."""
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as folder:
        cubin = os.path.join(folder, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        usage = subprocess.run([f"{tools}/cuobjdump", "-res-usage", cubin], capture_output=True, text=True).stdout
        sass = subprocess.run([f"{tools}/cuobjdump", "-sass", cubin], capture_output=True, text=True).stdout
    return usage, sass


def resources(compiled) -> str:
    usage, sass = cuobjdump(compiled)
    fields = " ".join(re.findall(r"REG:\d+|STACK:\d+", usage))
    counts = " ".join(f"{name} {len(re.findall('|'.join(map(re.escape, pattern.split('|'))), sass))}"
                      for name, pattern in SASS.items())
    return f"{fields} SHARED:{compiled.metadata.shared}  {counts}"


def compile_gemm_sm90(config, world: int, signals: bool, store_desc: bool, defer: bool):
    """``persistent_gemm_kernel`` compiled for sm_90 as ``gemm.scatter_matmul`` launches it on a GPU
    (descriptor loads, bf16, rank 0 of ``world``)."""
    import dataclasses

    from weavepass.runtime.cuda.gemm import SIGNAL_ROWS
    from weavepass.runtime.cuda.gemm_kernels import persistent_gemm_kernel as fn

    c = dataclasses.replace(config, defer_signals=defer)
    meta = dict(c.meta(store_desc), RANK=0, WORLD=world, SIGNAL_ROWS=SIGNAL_ROWS, USE_DESC=True,
                HAS_SIGNALS=signals, THREADS=c.num_warps * 32, GPU_FENCES=True)
    num_stages, num_warps = meta.pop("num_stages"), meta.pop("num_warps")
    types = {"x": f"tensordesc<bf16[{c.block_m}, {c.block_k}]>", "w": f"tensordesc<bf16[{c.block_n}, {c.block_k}]>",
             "y_desc": f"tensordesc<bf16[{c.block_m}, {c.block_n // c.epilogue_split}]>" if store_desc else "*bf16",
             "staging_ptr": "*bf16", "starts_ptr": "*i32", "pad_ptr": "*i32", "deltas_ptr": "*i64",
             "pad_deltas_ptr": "*i64", "watch_addr": "i64", "timeout_ns": "i64"}
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if fn.params[i].is_constexpr:
            signature[name], constexprs[(i,)] = "constexpr", meta[name]
            continue
        signature[name] = types.get(name, "i32")
        # N and K are specialised at launch (multiples of 16 on every model shape), M and the rest not
        if name.endswith("_ptr") or name in ("N", "K"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn, signature, constexprs, attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def gemm_main(indices: list[int], worlds: list[int]) -> None:
    from weavepass.runtime.cuda.gemm import GPU_CONFIGS

    print(f"triton {triton.__version__}")
    for i in indices or range(len(GPU_CONFIGS)):
        config = GPU_CONFIGS[i]
        for world in worlds:
            cases = [("pointers, per-tile signals", False, False), ("pointers, deferred signals", False, True)]
            if config.store_desc:
                cases.append(("TMA, deferred signals", True, True))
            for name, store_desc, defer in cases:
                compiled = compile_gemm_sm90(config, world, True, store_desc, defer)
                print(f"[{i}] {config.label():34} world {world} {name:27}: {resources(compiled)}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gemm", type=int, nargs="*", help="the persistent GEMM's configs (indices; none: all)")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--tiles", nargs="+", default=["4:16", "1:8"],
                        help="ROWS:WARPS[:CHUNK_TILES[:LOAD_STAGES]] per tile (the pipelined kernel's chunk, "
                             "default 2 tiles, and software-pipelined loads, default 1: none)")
    parser.add_argument("--hidden", type=int, default=8192)
    args = parser.parse_args()
    if args.gemm is not None:
        gemm_main(args.gemm, args.worlds)
        return
    block_h = 1 << (args.hidden - 1).bit_length()
    for world in args.worlds:
        for tile in args.tiles:
            rows, warps, chunk_tiles, stages = (int(x) for x in (tile.split(":") + ["2", "1"])[:4])
            base = dict(RANK=0, WORLD=world, HIDDEN=args.hidden, BLOCK_H=block_h, ROWS=rows, HAS_RESIDUAL=True,
                        MAX_CTAS=MAX_CTAS, HAS_INV_RMS=False, NORM=0, QUANT=0)
            cases = {
                "pipelined": (kernels.fused_allreduce_rmsnorm_pipelined_kernel,
                              dict(base, CHUNK_ROWS=chunk_tiles * rows, PUSH_ROWS=min(chunk_tiles, 2) * rows,
                                   LOAD_STAGES=stages)),
                "flat": (kernels.fused_allreduce_rmsnorm_kernel, dict(base, ONE_SHOT=False)),
            }
            for name, (fn, constants) in cases.items():
                if name == "flat" and (chunk_tiles, stages) != (2, 1):
                    continue  # the flat kernel has no chunks and no pipelined loads
                print(f"{name:>9} world {world} tile {tile} (rows:warps:chunk tiles:load stages): "
                      f"{resources(compile_sm90(fn, constants, warps))}", flush=True)


if __name__ == "__main__":
    main()
