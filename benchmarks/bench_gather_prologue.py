"""The gather GEMM (``weavepass.runtime.cuda.gather``) against the plain Triton GEMM and cuBLAS on one
GPU, with 2, 4 and 8 simulated owners (issue 34 item 3).

For the column-parallel GEMMs of the model presets (``qkv``: K = hidden, N = (heads + 2 kv_heads)
head_dim; ``gate_up``: K = hidden, N = 2 mlp; per rank, ``bench_gemm.gemm_dims``) at each token
count, bf16, the variants:

* ``cublas``: ``torch.mm(x, W.T, out=y)``;
* ``triton``: the plain persistent GEMM (``gemm.matmul``, ``gemm.select_config``'s config:
  flattened, TMA loads and stores where supported);
* ``triton_unflat``: the plain GEMM with the gather GEMM's tiling (``gather.DEFAULT_CONFIG``:
  unflattened, pointer stores): what the gather's loop form costs, apart from its waits;
* ``gatherN``: rank 0's gather GEMM of N simulated owners over rows already in its gather buffer
  (pushed once; the flags and the owners' call counts set far ahead, so every wait passes at once
  and nothing else runs in the timed loop): the cost of the per-tile flag reads and the own-first
  tile order;
* ``gatherN_push``: the same with rank 0's push of its own rows into all N buffers before it (the
  push's stores and flags in the timed call; the peers' rows are not pushed, their flags far ahead).

Checks (column ``check``): the plain Triton output and rank 0's gather outputs (with and without
its push) against the fp32 product (``bench_gemm._check``'s tolerance). Times:
``triton.testing.do_bench`` medians (``--rep`` ms per variant, an L2 flush before each call),
``graph_ms``: ``do_bench_cudagraph`` medians (replayed from a CUDA graph: no host work, warm L2;
``--no-graph`` leaves it out). ``speed_vs_cublas`` = cuBLAS time / time, ``vs_triton`` = plain
Triton time / time (and ``graph_*`` of the graph times).
The issue's target: the gather >= 0.97x the plain Triton GEMM.

Writes ``bench_gather_prologue.csv`` (after every cell) and ``.png`` under ``--out``. ``--quick``:
70b_tp8 and 8b_tp2 at 2K and 8K tokens (meant to finish in under 2 minutes on one H200; not yet
run). ``--smoke``: Triton's interpreter on the CPU, a tiny shape, fp16, 2 owners: checks the script
and the outputs; its times mean nothing.

Run: ``python3 benchmarks/bench_gather_prologue.py --quick --out $OUT``.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import sys

if "--smoke" in sys.argv:  # before Triton defines the kernels: the interpreter is chosen then
    os.environ["TRITON_INTERPRET"] = "1"

import gpu_env  # noqa: F401  (must precede torch: multicast off, checkout on sys.path)
import torch
from bench_gemm import (  # benchmarks/bench_gemm.py: one list of models and token counts
    MODELS,
    QUICK_MODELS,
    QUICK_TOKENS,
    TOKENS,
    _check,
    _graph_timer,
    _timer,
    gemm_dims,
    plot,
)
from report import write_csv  # benchmarks/report.py
from timing import progress_bar  # benchmarks/timing.py

from weavepass.runtime.cuda import gather, gemm
from weavepass.testing.gemm_sim import SimulatedGatherRanks
from weavepass.tune.shapes import SHAPES

GEMMS = ("qkv", "gate_up")
OWNERS = (2, 4, 8)
FAR_AHEAD = 1 << 30
"""What the flags and the peers' call counts are set to: every wait of the timed calls passes."""


def _simulated(owners: int, k: int, tokens: int, x: torch.Tensor, device) -> tuple[SimulatedGatherRanks,
                                                                                  gemm.OwnerRows]:
    """N simulated ranks whose gather buffers hold ``x``'s rows in both slots, every flag and every
    rank's call count far ahead."""
    table = gemm.OwnerRows.build(tokens, owners, device)
    sim = SimulatedGatherRanks(owners, k, max(table.count(j) for j in range(owners)), x.dtype, device)
    for ws in sim.workspaces:
        for slot in range(gather.SLOTS):
            ws.rows(slot)[:tokens].copy_(x)
            ws.flags(slot).fill_(FAR_AHEAD)
    for pad in sim.pads[1:]:
        pad[0] = FAR_AHEAD  # GATHER_SEQ: the peers read every slot long ago, so rank 0's push never waits
    return sim, table


def measure_cell(model, name, tokens, dtype, device, path, time_ms, owner_counts, graph_ms=None) -> list[dict]:
    n, k = gemm_dims(model, name)
    gen = torch.Generator(device=device).manual_seed(tokens + n + k)
    x = torch.randn(tokens, k, generator=gen, device=device).to(dtype)
    w = (torch.randn(n, k, generator=gen, device=device) * k**-0.5).to(dtype)
    y = torch.empty(tokens, n, dtype=dtype, device=device)
    reference = x.float() @ w.float().T
    base = dict(model=model, gemm=name, tokens=tokens, m=tokens, n=n, k=k, dtype=str(dtype).removeprefix("torch."))
    flop = 2.0 * tokens * n * k
    rows: list[dict] = []

    def row(variant, fn, config=None, check=""):
        ms = time_ms(fn)
        graph = round(graph_ms(fn), 4) if graph_ms is not None else ""
        rows.append(dict(base, variant=variant, config=config.label() if config else "", ms=ms,
                         tflops=round(flop / ms / 1e9, 1), graph_ms=graph, check=check))

    row("cublas", functools.partial(torch.mm, x, w.T, out=y))
    plain_config = gemm.select_config(tokens, n, k, x.device)
    plain = functools.partial(gemm.matmul, x, w, out=y, config=plain_config, use_descriptors=path)
    y.fill_(float("nan"))
    plain()
    row("triton", plain, plain_config, _check(y, reference))
    unflat = gather.default_config(x.device)
    row("triton_unflat", functools.partial(gemm.matmul, x, w, out=y, config=unflat, use_descriptors=path), unflat)
    for owners in owner_counts:
        sim, table = _simulated(owners, k, tokens, x, device)
        ws = sim.workspaces[0]
        out = torch.full((tokens, n), float("nan"), dtype=dtype, device=device)
        call = functools.partial(gather.gather_matmul, ws, w, table, out, config=unflat, use_descriptors=path)
        call()
        row(f"gather{owners}", call, unflat, _check(out, reference))

        def push_and_gather(ws=ws, table=table, out=out):
            gather.push_gather_rows(ws, x[table.rows(0)], table)
            gather.gather_matmul(ws, w, table, out, config=unflat, use_descriptors=path)

        out.fill_(float("nan"))
        push_and_gather()
        row(f"gather{owners}_push", push_and_gather, unflat, _check(out, reference))
        del sim
    cublas, triton = rows[0], rows[1]
    for r in rows:
        r["speed_vs_cublas"] = round(cublas["ms"] / r["ms"], 3)
        r["vs_triton"] = round(triton["ms"] / r["ms"], 3)
        r["graph_speed_vs_cublas"] = round(cublas["graph_ms"] / r["graph_ms"], 3) if r["graph_ms"] else ""
        r["graph_vs_triton"] = round(triton["graph_ms"] / r["graph_ms"], 3) if r["graph_ms"] else ""
    for r in rows:
        r["ms"] = round(r["ms"], 4)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="70b_tp8 and 8b_tp2 at 2K and 8K tokens")
    parser.add_argument("--smoke", action="store_true", help="the interpreter on the CPU, a tiny shape")
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--models", nargs="+", choices=MODELS)
    parser.add_argument("--tokens", nargs="+", type=int)
    parser.add_argument("--owners", nargs="+", type=int, help="simulated owners (default 2 4 8)")
    parser.add_argument("--rep", type=int, default=50, help="do_bench repetition time per variant, ms")
    parser.add_argument("--no-graph", action="store_true", help="leave out the CUDA-graph replay times")
    args = parser.parse_args()
    if args.smoke:
        SHAPES["smoke"] = SHAPES["tiny"]
        models, tokens, device, dtype = ["smoke"], args.tokens or [40], "cpu", torch.float16
        owner_counts = args.owners or [2]
    else:
        if not torch.cuda.is_available():
            sys.exit("bench_gather_prologue needs a CUDA GPU (or --smoke)")
        models = args.models or list(QUICK_MODELS if args.quick else MODELS)
        tokens = args.tokens or list(QUICK_TOKENS if args.quick else TOKENS)
        device, dtype = "cuda", torch.bfloat16
        owner_counts = args.owners or list(OWNERS)
        print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}", flush=True)
    probe = torch.empty(256, 256, dtype=dtype, device=device)
    why = gemm.descriptor_unsupported_reason(probe, probe)
    path = why is None
    if why:
        print(f"NOTICE: pointer loads, not tensor descriptors: {why}", flush=True)
    time_ms = _timer(args.rep)
    graph_ms = None if args.no_graph else _graph_timer(max(10, args.rep // 2))
    cells = list(itertools.product(models, GEMMS, tokens))
    progress = progress_bar(len(cells), "bench_gather_prologue")
    rows: list[dict] = []
    for model, name, count in cells:
        cell = measure_cell(model, name, count, dtype, device, path, time_ms, owner_counts, graph_ms)
        for r in cell:
            print(" ".join(f"{key}={r[key]}" for key in ("model", "gemm", "tokens", "variant", "ms", "graph_ms",
                                                         "speed_vs_cublas", "vs_triton", "graph_vs_triton",
                                                         "check")), flush=True)
        rows += cell
        write_csv(os.path.join(args.out, "bench_gather_prologue.csv"), rows)
        progress.update()
    progress.close()
    print(f"wrote {os.path.join(args.out, 'bench_gather_prologue.csv')}")
    plot(rows, os.path.join(args.out, "bench_gather_prologue.png"), key="vs_triton", baseline="triton",
         ylabel="speed vs plain Triton")


if __name__ == "__main__":
    main()
