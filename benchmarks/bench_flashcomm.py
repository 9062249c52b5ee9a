"""FlashComm on 2 GPUs (TP=2, one process per GPU): a 4-layer Llama-3-70B-width prefill stack.

Per rank: hidden 8192, 32 query / 4 kv heads of dim 128, MLP width 14336 (the 70B model split over
two ranks), bf16. For each token count, in the same process and against the same weights:

* ``inductor``: plain ``torch.compile`` (all_reduce after every row-parallel linear), the baseline;
* ``flashcomm``: weave with ``enable_flashcomm`` (reduce_scatter / add+RMSNorm on 1/2 of the tokens /
  all_gather; NCCL functional collectives);
* ``flashcomm_mmrs``: the same plus ``enable_mmrs_fusion`` (symmetric-memory
  ``fused_matmul_reduce_scatter`` and ``fused_all_gather_matmul``);
* ``overlap``: weave's TokenWeave split (``overlap="force"``), no FlashComm.

Timing: CUDA events around each forward, a fixed number of iterations on every rank (so collectives
stay matched), median of rank 0. Prints a table (ms, speedup over inductor), writes
``bench_flashcomm.csv`` and ``bench_flashcomm.png`` under ``--out``. ``--quick`` runs 8K and 16K
tokens with fewer iterations. NVLink multicast is kept off.

    python benchmarks/bench_flashcomm.py --out /tmp/bench [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import gpu_env  # noqa: F401,E402  (must precede torch: multicast off, checkout on sys.path)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from report import pyplot, save_figure, write_csv  # noqa: E402  (benchmarks/report.py)
from timing import progress_bar, times_ms  # noqa: E402  (benchmarks/timing.py)

from weavepass import WeaveConfig, make_backend  # noqa: E402
from weavepass.testing import TPConfig, build_tp_model, random_token_ids, spawn  # noqa: E402

WORLD = 2
LLAMA70B_TP2 = TPConfig(vocab=4096, hidden=8192, n_layers=4, n_heads=32 * WORLD, n_kv_heads=4 * WORLD,
                        head_dim=128, intermediate=14336 * WORLD, rms_eps=1e-5, dtype=torch.bfloat16)
TOKENS = (4096, 8192, 16384, 32768)
QUICK_TOKENS = (8192, 16384)
MODES = ("inductor", "flashcomm", "flashcomm_mmrs", "overlap")


def _compiled(model, mode: str):
    torch._dynamo.reset()  # a fresh cache per (mode, size): no recompile limit, no automatic dynamic
    if mode == "inductor":
        return torch.compile(model, backend="inductor", dynamic=False), None
    if mode == "overlap":  # TokenWeave's strategy, for comparison (docs/overlap.md)
        config = WeaveConfig(overlap="force")
    else:
        config = WeaveConfig(enable_flashcomm=True, flashcomm_min_prefill_tokens=1, overlap="off",
                             enable_mmrs_fusion=mode == "flashcomm_mmrs")
    backend = make_backend(config)
    return torch.compile(model, backend=backend, dynamic=False), backend


def _bench(rank, world, tokens_list, modes, warmup, iters):
    torch.manual_seed(0)
    device = torch.device("cuda", rank)
    model = build_tp_model(LLAMA70B_TP2, rank, world, dist.group.WORLD, device=device)
    jobs = [(t, m) for t in tokens_list for m in modes]
    progress = progress_bar(len(jobs), "bench_flashcomm") if rank == 0 else None
    rows = []
    for tokens, mode in jobs:
        ids = random_token_ids(LLAMA70B_TP2, 1, tokens, seed=tokens, device=device)
        fn, backend = _compiled(model, mode)
        times = times_ms(fn, ids, warmup, iters)
        lowerings = sorted({r.lowering for r in backend.report.records}) if backend else []
        rows.append({"tokens": tokens, "mode": mode, "median_ms": statistics.median(times),
                     "min_ms": min(times), "lowerings": " ".join(lowerings)})
        if progress is not None:
            progress.update()
    if progress is not None:
        progress.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--quick", action="store_true", help="8K and 16K tokens, fewer iterations")
    parser.add_argument("--tokens", type=int, nargs="*", help="token counts (default: 4K..32K)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(MODES))
    args = parser.parse_args()
    if torch.cuda.device_count() < WORLD:
        sys.exit(f"needs {WORLD} GPUs, found {torch.cuda.device_count()}")
    tokens = tuple(args.tokens or (QUICK_TOKENS if args.quick else TOKENS))
    warmup, iters = (2, 5) if args.quick else (3, 15)
    modes = args.modes.split(",")
    unknown = set(modes) - set(MODES)
    if unknown or "inductor" not in modes:
        sys.exit(f"--modes must include inductor and come from {MODES}; got {args.modes}")
    rows = spawn(_bench, WORLD, "nccl", tokens, modes, warmup, iters, timeout_s=3000)[0]

    base = {r["tokens"]: r["median_ms"] for r in rows if r["mode"] == "inductor"}
    for r in rows:
        r["speedup"] = base[r["tokens"]] / r["median_ms"]
    print(f"{'tokens':>7} {'mode':<16} {'median ms':>10} {'min ms':>8} {'vs inductor':>11}  lowerings")
    for r in rows:
        print(f"{r['tokens']:>7} {r['mode']:<16} {r['median_ms']:>10.3f} {r['min_ms']:>8.3f} "
              f"{r['speedup']:>10.3f}x  {r['lowerings']}")
    print(f"wrote {write_csv(os.path.join(args.out, 'bench_flashcomm.csv'), rows)}")
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
    ax.set_title("FlashComm, 4-layer Llama-3-70B width, TP=2, bf16")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, os.path.join(args.out, "bench_flashcomm.png"), dpi=120)


if __name__ == "__main__":
    main()
