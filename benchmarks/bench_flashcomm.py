"""FlashComm on N GPUs (TP=N, ``--world``, default 2; one process per GPU): a 4-layer
Llama-3-70B-width prefill stack.

The 70B model's widths (hidden 8192, 64 query / 8 kv heads of dim 128, MLP width 28672) split over
the N ranks: per rank 64/N query and 8/N kv heads and an MLP of 28672/N (TP=2: 32 / 4 / 14336;
TP=8: 8 / 1 / 3584), bf16. N must divide 8 (whole kv heads per rank). For each token count, in the
same process and against the same weights:

* ``inductor``: plain ``torch.compile`` (all_reduce after every row-parallel linear), the baseline;
* ``flashcomm``: weave with ``enable_flashcomm`` (reduce_scatter / add+RMSNorm on 1/N of the tokens /
  all_gather; NCCL functional collectives);
* ``flashcomm_mmrs``: the same plus ``enable_mmrs_fusion`` (symmetric-memory
  ``fused_matmul_reduce_scatter`` and ``fused_all_gather_matmul``);
* ``split``: weave's split (TokenWeave's design) (``split="force"``), no FlashComm.

Timing: CUDA events around each forward, a fixed number of iterations on every rank (so collectives
stay matched), median of rank 0. Prints a table (ms, speedup over inductor), writes
``bench_flashcomm.csv`` and ``bench_flashcomm.png`` under ``--out`` (``bench_flashcomm_tpN.*`` when
N is not 2; the CSV has a ``world`` column). ``--quick`` runs 8K and 16K tokens with fewer
iterations. NVLink multicast is kept off. Every rank draws the whole model's fp32 weights on the CPU
before taking its shard (``build_tp_model``): about 14 GB of host memory per rank.

    python benchmarks/bench_flashcomm.py --out /tmp/bench [--quick] [--world 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import gpu_env  # noqa: F401,E402  (must precede torch: multicast off, checkout on sys.path)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from report import pyplot, save_figure, world_name, world_size, write_csv  # noqa: E402  (benchmarks/report.py)
from timing import progress_bar, times_ms  # noqa: E402  (benchmarks/timing.py)

from weavepass import WeaveConfig, make_backend  # noqa: E402
from weavepass.testing import TPConfig, build_tp_model, random_token_ids, spawn  # noqa: E402

LLAMA70B = TPConfig(vocab=4096, hidden=8192, n_layers=4, n_heads=64, n_kv_heads=8, head_dim=128,
                    intermediate=28672, rms_eps=1e-5, dtype=torch.bfloat16)
TOKENS = (4096, 8192, 16384, 32768)
QUICK_TOKENS = (8192, 16384)
MODES = ("inductor", "flashcomm", "flashcomm_mmrs", "split")


def _compiled(model, mode: str):
    torch._dynamo.reset()  # a fresh cache per (mode, size): no recompile limit, no automatic dynamic
    if mode == "inductor":
        return torch.compile(model, backend="inductor", dynamic=False), None
    if mode == "split":  # TokenWeave's strategy, for comparison (docs/overlap.md)
        config = WeaveConfig(split="force")
    else:
        config = WeaveConfig(enable_flashcomm=True, flashcomm_min_prefill_tokens=1, split="off",
                             enable_mmrs_fusion=mode == "flashcomm_mmrs")
    backend = make_backend(config)
    return torch.compile(model, backend=backend, dynamic=False), backend


def _bench(rank, world, tokens_list, modes, warmup, iters):
    torch.manual_seed(0)
    device = torch.device("cuda", rank)
    model = build_tp_model(LLAMA70B, rank, world, dist.group.WORLD, device=device)
    jobs = [(t, m) for t in tokens_list for m in modes]
    progress = progress_bar(len(jobs), "bench_flashcomm") if rank == 0 else None
    rows = []
    for tokens, mode in jobs:
        ids = random_token_ids(LLAMA70B, 1, tokens, seed=tokens, device=device)
        fn, backend = _compiled(model, mode)
        times = times_ms(fn, ids, warmup, iters)
        lowerings = sorted({r.lowering for r in backend.report.records}) if backend else []
        rows.append({"world": world, "tokens": tokens, "mode": mode, "median_ms": statistics.median(times),
                     "min_ms": min(times), "lowerings": " ".join(lowerings)})
        if rank == 0:  # in the log as it comes, should a time limit stop the run before the table
            print(f"row: {rows[-1]}", flush=True)
        if progress is not None:
            progress.update()
    if progress is not None:
        progress.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--world", type=world_size, default=2, help="ranks (TP degree), one GPU each; divides 8")
    parser.add_argument("--name", default=None,
                        help="file name of the CSV and PNG, without suffix (default bench_flashcomm, "
                             "with _tpN when --world is not 2)")
    parser.add_argument("--quick", action="store_true", help="8K and 16K tokens, fewer iterations")
    parser.add_argument("--tokens", type=int, nargs="*", help="token counts (default: 4K..32K)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(MODES))
    args = parser.parse_args()
    world = args.world
    try:
        LLAMA70B.check_world_size(world)
    except ValueError as err:
        parser.error(str(err))
    if torch.cuda.device_count() < world:
        sys.exit(f"--world {world} needs {world} GPUs, found {torch.cuda.device_count()}")
    tokens = tuple(args.tokens or (QUICK_TOKENS if args.quick else TOKENS))
    warmup, iters = (2, 5) if args.quick else (3, 15)
    modes = args.modes.split(",")
    unknown = set(modes) - set(MODES)
    if unknown or "inductor" not in modes:
        sys.exit(f"--modes must include inductor and come from {MODES}; got {args.modes}")
    rows = spawn(_bench, world, "nccl", tokens, modes, warmup, iters, timeout_s=3000)[0]

    base = {r["tokens"]: r["median_ms"] for r in rows if r["mode"] == "inductor"}
    for r in rows:
        r["speedup"] = base[r["tokens"]] / r["median_ms"]
    print(f"{'tokens':>7} {'mode':<16} {'median ms':>10} {'min ms':>8} {'vs inductor':>11}  lowerings")
    for r in rows:
        print(f"{r['tokens']:>7} {r['mode']:<16} {r['median_ms']:>10.3f} {r['min_ms']:>8.3f} "
              f"{r['speedup']:>10.3f}x  {r['lowerings']}")
    name = args.name or world_name("bench_flashcomm", world)
    print(f"wrote {write_csv(os.path.join(args.out, f'{name}.csv'), rows)}")
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for mode in modes:
        pts = [(r["tokens"], r["speedup"]) for r in rows if r["mode"] == mode]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens")
    ax.set_ylabel("speedup over inductor (median)")
    ax.set_title(f"FlashComm, 4-layer Llama-3-70B width, TP={world}, bf16")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, os.path.join(args.out, f"{name}.png"), dpi=120)


if __name__ == "__main__":
    main()
