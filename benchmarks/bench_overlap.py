"""TokenWeave overlap benchmark: 4 decoder layers at Llama-3-70B TP=2 widths, bf16, two GPUs.

Per rank: hidden 8192, 32 query / 4 kv heads of 128, MLP 14336 (SwiGLU). For each token count
(512 .. 16K) and layout (one sequence; 8 sequences) it times, in the same processes:

    eager          the model as written (NCCL all_reduce, unfused)
    inductor       torch.compile default backend
    weave_fuse     backend weave, overlap="off" (fused all_reduce + RMSNorm, no split)
    weave_overlap  backend weave, overlap="force" (two-way split, comm on a second stream)
    weave_overlap_c8  the same with the fused kernel on 8 CTAs (``overlap_comm_ctas=8``)
    weave_auto     backend weave, overlap="auto": the per-size strategy (split, fuse-only or plain
                   all_reduce, whichever the scheduler picks for the batch), what a user gets
    no_comm        the same model without any all_reduce, torch.compile default (the floor)
    weave_overlap_smN  (N in 8, 16, 32) weave_overlap with the fused kernel on N CTAs and N SMs
                   carved out of every cuBLAS matmul (``torch._C._set_sm_carveout_experimental``),
                   so the GEMMs never hold the SMs the communication needs (an experiment)
    inductor_cg, weave_fuse_cg, weave_overlap_cg
                   the same as inductor, weave_fuse and weave_overlap with mode="reduce-overhead"
                   (Inductor CUDA graphs: no host cost per kernel; one graph recorded per size).
                   (weave rewrites there by default, ``allow_inductor_cudagraphs``)

Times are medians of CUDA-event-timed forward passes (rank 0's; ranks are in lock-step through
the collectives). Output: a table on stdout, ``<out>/bench_overlap.csv`` and
``<out>/bench_overlap.png`` (latency normalised to ``inductor``, like TokenWeave's Figure 11).

Compiled variants mark the token dim dynamic, so each compiles once per layout (the split point
is computed at run time; docs/overlap.md). ``--quick`` runs three token counts, one layout and
fewer iterations, for scarce device time. Run: ``python3 benchmarks/bench_overlap.py --quick``.
NVLink multicast is never used (the spawn helper sets NCCL_NVLS_ENABLE=0 and friends).
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
from pathlib import Path

import gpu_env  # noqa: F401  (must precede torch: multicast off, checkout on sys.path)
import torch
import torch.distributed as dist
from timing import cuda_event_times_ms  # benchmarks/timing.py

VARIANTS = ("eager", "inductor", "weave_fuse", "weave_overlap", "weave_overlap_c8", "weave_auto", "no_comm",
            "inductor_cg", "weave_fuse_cg", "weave_overlap_cg",
            "weave_overlap_sm8", "weave_overlap_sm16", "weave_overlap_sm32")
CARVEOUT = {"weave_overlap_sm8": 8, "weave_overlap_sm16": 16, "weave_overlap_sm32": 32}
DEFAULT_VARIANTS = ("eager", "inductor", "weave_fuse", "weave_overlap", "weave_auto", "no_comm")


def build_model(group, device, n_layers: int, seed: int = 0):
    """Rank-local shard at Llama-3-70B TP=2 widths, random bf16 weights drawn on the GPU."""
    from weavepass.testing.models import (
        RMSNorm, RotaryEmbedding, TPAttention, TPDecoder, TPDecoderLayer, TPSwiGLU, TPConfig,
        VocabParallelEmbedding,
    )

    hidden, heads, kv_heads, head_dim, mlp, vocab = 8192, 32, 4, 128, 14336, 4096
    gen = torch.Generator(device=device).manual_seed(seed)

    def w(*shape):
        t = torch.randn(*shape, generator=gen, device=device, dtype=torch.bfloat16) * shape[-1] ** -0.5
        return torch.nn.Parameter(t, requires_grad=False)

    def norm():
        return RMSNorm(torch.nn.Parameter(torch.ones(hidden, device=device, dtype=torch.bfloat16),
                                          requires_grad=False), 1e-5, "llama")

    layers = []
    for _ in range(n_layers):
        attention = TPAttention(w(heads * head_dim, hidden), w(kv_heads * head_dim, hidden),
                                w(kv_heads * head_dim, hidden), w(hidden, heads * head_dim),
                                heads, kv_heads, head_dim)
        layers.append(TPDecoderLayer(norm(), attention, norm(),
                                     TPSwiGLU(w(mlp, hidden), w(mlp, hidden), w(hidden, mlp)), group))
    rank = dist.get_rank() if group is not None else 0
    cfg = TPConfig(vocab=vocab * 2, hidden=hidden, n_layers=n_layers, n_heads=2 * heads,
                   n_kv_heads=2 * kv_heads, head_dim=head_dim, intermediate=2 * mlp, dtype=torch.bfloat16)
    embed = VocabParallelEmbedding(w(vocab, hidden), rank * vocab, group)
    return TPDecoder(cfg, embed, RotaryEmbedding(head_dim, 10000.0, device), layers, norm()).eval()


def _time(fn, ids, warmup: int, iters: int) -> float:
    """Median milliseconds of ``fn(ids)`` over ``iters`` CUDA-event-timed calls."""
    return statistics.median(cuda_event_times_ms(fn, ids, warmup, iters))


def _profile(fn, ids, rank: int) -> str:
    """One profiled call: the kernels that cost most and how much communication overlapped compute."""
    from weavepass.testing.trace import profile_stream_overlap

    with torch.no_grad():
        fn(ids)
        torch.cuda.synchronize()
        dist.barrier()
        result = profile_stream_overlap(fn, ids)
    if rank != 0:
        return ""
    lines = [result.summary()]
    lines += [f"  {t / 1e3:9.3f} ms {c:5d}x  {n[:110]}" for t, c, n in result.top]
    return "\n".join(lines)


class _Lines:
    """A progress counter printing one line per step (when tqdm is not installed)."""

    def __init__(self, total: int):
        self.total, self.done = total, 0

    def update(self) -> None:
        self.done += 1
        print(f"bench_overlap: {self.done}/{self.total}", flush=True)


def _run_rank(rank: int, world: int, args: dict) -> list[dict]:
    from weavepass import WeaveConfig
    from weavepass.backend import WeaveBackend

    device = torch.device("cuda", rank)
    group = dist.group.WORLD
    model = build_model(group, device, args["layers"])
    no_comm = build_model(None, device, args["layers"])
    compiled = {
        "eager": lambda layout: model,
        "inductor": lambda layout: torch.compile(model),
        "weave_fuse": lambda layout: torch.compile(model, backend=WeaveBackend(WeaveConfig(overlap="off"))),
        "weave_overlap": lambda layout: torch.compile(model, backend=WeaveBackend(WeaveConfig(overlap="force"))),
        "weave_overlap_c8": lambda layout: torch.compile(
            model, backend=WeaveBackend(WeaveConfig(overlap="force", overlap_comm_ctas=8))),
        "weave_auto": lambda layout: torch.compile(model, backend=WeaveBackend(WeaveConfig(overlap="auto"))),
        "no_comm": lambda layout: torch.compile(no_comm),
        "inductor_cg": lambda layout: torch.compile(model, mode="reduce-overhead"),
        "weave_fuse_cg": lambda layout: torch.compile(
            model, backend=WeaveBackend(WeaveConfig(overlap="off", allow_inductor_cudagraphs=True)),
            mode="reduce-overhead"),
        "weave_overlap_cg": lambda layout: torch.compile(
            model, backend=WeaveBackend(WeaveConfig(overlap="force", allow_inductor_cudagraphs=True)),
            mode="reduce-overhead"),
    }
    for name, sms in CARVEOUT.items():
        compiled[name] = lambda layout, sms=sms: torch.compile(
            model, backend=WeaveBackend(WeaveConfig(overlap="force", overlap_comm_ctas=sms)))
    rows = []
    work = [(v, seqs, t) for v in args["variants"] for seqs in args["layouts"] for t in args["tokens"]]
    progress = None
    if rank == 0:
        try:
            from tqdm import tqdm
        except ImportError:  # the device machine may lack it: plain lines instead
            tqdm = None
        progress = tqdm(total=len(work), desc="bench_overlap") if tqdm else _Lines(len(work))
    for variant in args["variants"]:
        for seqs in args["layouts"]:
            torch._dynamo.reset()
            torch._C._set_sm_carveout_experimental(CARVEOUT.get(variant))
            fn = compiled[variant](seqs)
            for tokens in args["tokens"]:
                ids = torch.randint(0, 2 * 4096, (seqs, tokens // seqs), device=device)
                if variant != "eager":
                    torch._dynamo.mark_dynamic(ids, 1)
                ms = _time(fn, ids, args["warmup"], args["iters"])
                rows.append({"variant": variant, "sequences": seqs, "tokens": tokens, "ms": ms})
                if args["profile"] and variant != "eager":
                    summary = _profile(fn, ids, rank)
                    if rank == 0:
                        print(f"\n[profile] {variant}, {seqs} seq, {tokens} tokens: {ms:.3f} ms\n{summary}", flush=True)
                if progress is not None:
                    progress.update()
    torch._C._set_sm_carveout_experimental(None)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 token counts, 1 layout, few iterations")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench_out"), help="folder for CSV and PNG")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                        help=f"comma-separated, from {','.join(VARIANTS)}")
    parser.add_argument("--tokens", type=int, nargs="+", help="token counts (default: 512 .. 16K)")
    parser.add_argument("--layouts", type=int, nargs="+", help="sequences per batch (default: 1 8)")
    parser.add_argument("--profile", action="store_true",
                        help="also profile one call per case: top kernels and comm/compute overlap")
    args = parser.parse_args()
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    if torch.cuda.device_count() < 2:
        raise SystemExit("bench_overlap needs 2 GPUs")
    from weavepass.testing import spawn

    config = {
        "layers": args.layers,
        "variants": args.variants.split(","),
        "tokens": args.tokens or ([1024, 4096, 16384] if args.quick else [512, 1024, 2048, 4096, 8192, 16384]),
        "layouts": args.layouts or ([1] if args.quick else [1, 8]),
        "profile": args.profile,
        "warmup": 2 if args.quick else 5,
        "iters": 5 if args.quick else 20,
    }
    rows = spawn(_run_rank, 2, "nccl", config, timeout_s=3000.0)[0]
    report(rows, Path(args.out))


def report(rows: list[dict], out: Path) -> None:
    """Table on stdout, CSV and a PNG normalised to the ``inductor`` variant."""
    out.mkdir(parents=True, exist_ok=True)
    base = {(r["sequences"], r["tokens"]): r["ms"] for r in rows if r["variant"] == "inductor"}
    for r in rows:
        ref = base.get((r["sequences"], r["tokens"]))
        r["vs_inductor"] = r["ms"] / ref if ref else float("nan")
    with open(out / "bench_overlap.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["variant", "sequences", "tokens", "ms", "vs_inductor"])
        writer.writeheader()
        writer.writerows(rows)
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    keys = sorted({(r["sequences"], r["tokens"]) for r in rows})
    table = {(r["variant"], r["sequences"], r["tokens"]): r for r in rows}
    print(f"{'seqs':>4} {'tokens':>6} " + " ".join(f"{v:>20}" for v in variants))
    for seqs, tokens in keys:
        cells = []
        for v in variants:
            r = table.get((v, seqs, tokens))
            cells.append(f"{r['ms']:8.3f} ms ({r['vs_inductor']:.2f}x)" if r else " " * 20)
        print(f"{seqs:>4} {tokens:>6} " + " ".join(f"{c:>20}" for c in cells))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    layouts = sorted({s for s, _ in keys})
    fig, axes = plt.subplots(1, len(layouts), figsize=(6 * len(layouts), 4), squeeze=False)
    for ax, seqs in zip(axes[0], layouts):
        tokens = [t for s, t in keys if s == seqs]
        width = 0.8 / len(variants)
        for i, v in enumerate(variants):
            ys = [table[(v, seqs, t)]["vs_inductor"] if (v, seqs, t) in table else 0 for t in tokens]
            ax.bar([j + i * width for j in range(len(tokens))], ys, width, label=v)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(tokens))], [str(t) for t in tokens])
        ax.set_xlabel("tokens")
        ax.set_ylabel("latency / inductor default")
        ax.set_title(f"4 layers, Llama-3-70B TP=2, {seqs} sequence(s)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "bench_overlap.png", dpi=120)
    print(f"wrote {out / 'bench_overlap.csv'} and {out / 'bench_overlap.png'}")


if __name__ == "__main__":
    main()
