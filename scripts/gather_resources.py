"""Registers, spills, shared memory and the software-pipelining depth of the gather prologue's
kernels (``runtime.cuda.gather_kernels``), compiled for sm_90 on a machine WITHOUT a GPU.

    PYTHONPATH=/tmp/t36:$PWD python scripts/gather_resources.py [--worlds 2 8] [--hidden 8192]

For the gather GEMM with ``gather.DEFAULT_CONFIG`` (tensor-descriptor loads and pointer loads) and
the push kernel with ``gather.push_arguments``' tile, per world size: ``REG``/``STACK`` (cuobjdump),
``SHARED`` (bytes per CTA; sm_90 allows 232448), the kernel's ``num_stages``, and counts in the SASS
and PTX that show the loop's form: TMA loads (``UTMALDG``), ``wgmma`` (``HGMMA``), 128-bit global
stores (``STG.E.128``, the push's vectors and the GEMM's epilogue), local memory (``LDL``/``STL``)
and the async-proxy fence after the wait (``fence.proxy.async`` in the PTX). Run with the GPU
machine's Triton (3.6: ``pip install --target /tmp/t36 triton==3.6.0``) for its allocation.
"""

from __future__ import annotations

import argparse
import re

import triton
from kernel_resources import cuobjdump  # scripts/kernel_resources.py (this folder is on sys.path)
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from weavepass.runtime.cuda import gather_kernels
from weavepass.runtime.cuda.gather import DEFAULT_CONFIG, SIGNAL_ROWS, push_arguments

INT64 = {"watch_addr", "timeout_ns"}
DIVISIBLE = {"N", "K", "HIDDEN"}
"""Integers Triton specialises as multiples of 16 at these shapes (its launcher does the same)."""
SASS = ("UTMALDG", "HGMMA", "STG.E.128", "LDG.E.128", "LDL", "STL")


def compile_sm90(fn, types: dict, constants: dict, num_warps: int, num_stages: int):
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if fn.params[i].is_constexpr:
            signature[name], constexprs[(i,)] = "constexpr", constants[name]
            continue
        signature[name] = types.get(name) or ("*bf16" if name.endswith("_ptr") else "i64" if name in INT64 else "i32")
        if signature[name].startswith("*") or name in DIVISIBLE:
            attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn, signature, constexprs, attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def resources(compiled) -> str:
    usage, sass = cuobjdump(compiled)
    fields = " ".join(re.findall(r"REG:\d+|STACK:\d+", usage))
    counts = " ".join(f"{name} {sass.count(name)}" for name in SASS)
    fence = compiled.asm["ptx"].count("fence.proxy.async")
    return f"{fields} SHARED:{compiled.metadata.shared}  {counts}  fence.proxy.async {fence}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--hidden", type=int, default=8192)
    args = parser.parse_args()
    c = DEFAULT_CONFIG
    print(f"triton {triton.__version__}; gather GEMM {c.label()}; push at hidden {args.hidden}")
    for world in args.worlds:
        for desc in (True, False):
            x, w = ((f"tensordesc<bf16[{c.block_m}, {c.block_k}]>", f"tensordesc<bf16[{c.block_n}, {c.block_k}]>")
                    if desc else ("*bf16", "*bf16"))
            constants = dict(RANK=0, WORLD=world, BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
                             GROUP_M=c.group_m, SIGNAL_ROWS=SIGNAL_ROWS, USE_DESC=desc, FENCE_PROXY=desc,
                             EPILOGUE_SPLIT=c.epilogue_split, DOT_IN_FP32=False)
            types = {"x": x, "w": w, "starts_ptr": "*i32", "pad_ptr": "*i32"}
            compiled = compile_sm90(gather_kernels.gather_gemm_kernel, types, constants, c.num_warps, c.num_stages)
            print(f"gather_gemm world {world} {'descriptors' if desc else 'pointers'} stages {c.num_stages}: "
                  f"{resources(compiled)}", flush=True)
        meta = push_arguments(args.hidden, 2, SIGNAL_ROWS)
        warps = meta.pop("num_warps")
        types = {"deltas_ptr": "*i64", "pad_ptr": "*i32", "pad_deltas_ptr": "*i64"}
        compiled = compile_sm90(gather_kernels.push_gather_rows_kernel, types,
                                dict(meta, RANK=0, WORLD=world, PARTS=1), warps, 1)
        print(f"push world {world} ROWS {meta['ROWS']} warps {warps}: {resources(compiled)}", flush=True)


if __name__ == "__main__":
    main()
