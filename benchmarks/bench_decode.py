"""Decode-step benchmark: one step of a 16-layer TP decoder with a static KV cache, N GPUs
(``--world``, default 2), bf16.

The model is the reference decoder (``weavepass.testing.models``) with per-rank widths from
``bench_overlap.SHAPES`` (default ``8b_tp2`` and ``70b_tp8sim``) and a static KV cache
(``TPDecoder.attach_static_kv_cache``) of ``--context`` cached tokens (random keys and values;
default 2048) plus one slot for the new token. One decode step is a batch of ``B`` sequences with
one new token each (``B`` in 1, 8, 32, 128, 256: the all_reduces move ``B`` rows), which attends
to every cached token. Variants, in the same processes:

    eager               the model as written (NCCL all_reduce, unfused)
    inductor            torch.compile, default mode
    inductor_cg         torch.compile, mode="reduce-overhead" (Inductor CUDA graphs)
    weave               backend weave, default mode, default ``WeaveConfig`` (the default a user
                        gets; since ``cuda_min_tokens`` defaults to 1, the same graphs as weave_min1)
    weave_min1          the same with ``cuda_min_tokens=1`` written out: every site fused
    weave_cg            backend weave, mode="reduce-overhead" (every size fused under Inductor's
                        CUDA graphs, ``allow_inductor_cudagraphs``)
    weave_cg_lamport, weave_min1_lamport
                        weave_cg / weave_min1 with the Lamport one-shot kernel switched on in the
                        launch rule (``launch_plan.LAMPORT_BY_DEFAULT``, off by default until
                        measured; the lowering's launch cache is cleared around the variant)
    inductor_nccl_symm  inductor with every allocation in a MemPool registered as NCCL
                        symmetric windows (benchmarks/nccl_symm.py), so NCCL may run its
                        symmetric all_reduce kernels; default mode only (CUDA-graph trees
                        allocate from their own private pool, which cannot be a window pool).
                        Skipped with the reason printed where this torch cannot register windows.

Batches are static (``dynamic=False``): one compile per variant and batch size, which is what
``cuda_min_tokens`` needs (it applies only to static token counts). Times are medians of
CUDA-event-timed steps (rank 0's), the variants compiled side by side and measured in interleaved
rounds (``_measure_interleaved``: the host's speed drifts between and within runs). Output: a table
(ms and the ratio to Inductor in the same mode), ``<out>/bench_decode.csv`` (with ``sites_fused``:
fused / all all_reduce sites of each weave variant's graph, from its report; the reasons for kept
sites are printed) and
``<out>/bench_decode.png`` (``bench_decode_tpN.*`` when ``--world`` is not 2).
``--quick``: batches 1, 32, 256 and fewer iterations. ``--smoke``: the ``tiny`` shape, 2 layers,
on ``--world`` CPU processes (gloo), wall-clock timed, CUDA-only variants skipped with the reason.
Run: ``python3 benchmarks/bench_decode.py --quick --shape 8b_tp2``.
NVLink multicast is never used (gpu_env and the spawn helper set NCCL_NVLS_ENABLE=0 and friends).
"""

from __future__ import annotations

import statistics
from pathlib import Path

import gpu_env  # noqa: F401  (must precede torch: multicast off, checkout on sys.path)
import torch
import torch.distributed as dist
from bench_overlap import SHAPES, VOCAB_PER_RANK, build_model  # benchmarks/bench_overlap.py
from report import (  # benchmarks/report.py
    model_bench_parser,
    parse_variants,
    pyplot,
    save_figure,
    weave_config,
    world_name,
    write_csv,
)
from timing import interleaved_ms, progress_bar, times_ms  # benchmarks/timing.py

VARIANTS = ("eager", "inductor", "inductor_cg", "weave", "weave_min1", "weave_cg", "weave_min1_lamport",
            "weave_cg_lamport", "inductor_nccl_symm")
CUDA_ONLY = {
    "inductor_cg": 'mode="reduce-overhead" records CUDA graphs',
    "weave_cg": 'mode="reduce-overhead" records CUDA graphs',
    "weave_cg_lamport": "the Lamport kernel is CUDA's",
    "weave_min1_lamport": "the Lamport kernel is CUDA's",
    "inductor_nccl_symm": "NCCL symmetric-memory windows need NCCL on CUDA",
}
# The Inductor variant each one is compared with: the same compile mode.
BASELINE = {"inductor_cg": "inductor_cg", "weave_cg": "inductor_cg", "weave_cg_lamport": "inductor_cg"}


def compilers(model) -> dict:
    """Variant name -> a function returning the compiled (or plain) model and, for weave
    variants, its backend (whose report says which sites were fused)."""
    from weavepass.backend import WeaveBackend

    def plain(**options):
        return lambda: (torch.compile(model, dynamic=False, **options), None)

    def weave(mode=None, **config):
        def make():
            backend = WeaveBackend(weave_config(**config))
            return torch.compile(model, backend=backend, mode=mode, dynamic=False), backend

        return make

    return {
        "eager": lambda: (model, None),
        "inductor": plain(),
        "inductor_cg": plain(mode="reduce-overhead"),
        "weave": weave(),
        "weave_min1": weave(cuda_min_tokens=1),
        "weave_cg": weave("reduce-overhead", allow_inductor_cudagraphs=True),
        "weave_min1_lamport": weave(cuda_min_tokens=1),
        "weave_cg_lamport": weave("reduce-overhead", allow_inductor_cudagraphs=True),
        "inductor_nccl_symm": plain(),  # run in a window pool, per batch (_run_rank)
    }


def _use_lamport(on: bool) -> None:
    """Switch the Lamport one-shot kernel on or off in the CUDA lowering's launch rule; cached
    launch plans are dropped so that the next call of every signature plans again."""
    if not torch.cuda.is_available():
        return
    from weavepass.runtime.cuda import dispatch, launch_plan

    if launch_plan.LAMPORT_BY_DEFAULT != on:
        launch_plan.LAMPORT_BY_DEFAULT = on
        dispatch._LAUNCHES.clear()


def _fused_sites(backend, seen: int) -> tuple[str, list[str], int]:
    """For the graphs ``backend`` compiled after its first ``seen``: ``"fused/all"`` sites, the
    reasons of the kept ones, and the new count of graphs."""
    graphs = backend.report.graphs[seen:]
    records = [r for g in graphs for r in g.records]
    kept = sorted({r.reason for r in records if not r.lowering})
    return f"{sum(g.rewritten for g in graphs)}/{len(records)}", kept, len(backend.report.graphs)


def _run_rank(rank: int, world: int, args: dict) -> list[dict]:
    from bench_overlap import _nccl_symm_call

    smoke = args["smoke"]
    device = torch.device("cpu") if smoke else torch.device("cuda", rank)
    dtype = torch.float32 if smoke else torch.bfloat16
    group = dist.group.WORLD
    variants = [v for v in args["variants"] if not (smoke and v in CUDA_ONLY)]
    if rank == 0:
        for v in args["variants"]:
            if v not in variants:
                print(f"{v} skipped on the CPU: {CUDA_ONLY[v]}", flush=True)
    # One compile per variant and batch size (static shapes), for every shape.
    torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
    context = args["context"]
    position = torch.tensor([context], device=device)
    rows = []
    progress = progress_bar(len(args["shapes"]) * len(variants) * len(args["batches"]), "bench_decode") \
        if rank == 0 else None
    for shape_name in args["shapes"]:
        model = build_model(SHAPES[shape_name], group, device, args["layers"], dtype)
        model.attach_static_kv_cache(max(args["batches"]), context + 1)
        gen = torch.Generator(device=device).manual_seed(rank)
        for layer in model.layers:  # the prompt's keys and values: any finite numbers will do
            layer.attention.k_cache.normal_(generator=gen)
            layer.attention.v_cache.normal_(generator=gen)
        made = compilers(model)
        torch._dynamo.reset()
        rows += _measure_interleaved(shape_name, made, [v for v in variants if v != "inductor_nccl_symm"],
                                     args, world, rank, position, device, progress)
        if "inductor_nccl_symm" in variants:  # its own window pool per batch: measured on its own
            torch._dynamo.reset()
            compiled, _ = made["inductor_nccl_symm"]()
            for batch in args["batches"]:
                ids = torch.randint(0, VOCAB_PER_RANK * world, (batch, 1), device=device)
                call = _nccl_symm_call(lambda ids: compiled(ids, cache_position=position), ids, group, device, rank)
                if call is not None:
                    ms = statistics.median(times_ms(call, ids, args["warmup"], args["iters"]))
                    rows.append({"shape": shape_name, "world": world, "variant": "inductor_nccl_symm",
                                 "batch": batch, "context": context, "ms": ms, "sites_fused": ""})
                    if rank == 0:
                        print(f"row: {rows[-1]}", flush=True)
                    call.close()
                if progress is not None:
                    progress.update()
        del model, made
        if not smoke:
            torch.cuda.empty_cache()
    if progress is not None:
        progress.close()
    return rows


def _measure_interleaved(shape_name, made, variants, args, world, rank, position, device, progress) -> list[dict]:
    """Every variant compiled side by side and measured in interleaved rounds (``timing.interleaved_ms``:
    default-mode decode steps are host-bound, and the host's speed drifts). The Lamport switch is
    set before each cell's calls (under CUDA graphs it was fixed when the graph was captured, at the
    warm-up)."""
    compiled = {v: made[v]() for v in variants}  # Dynamo keeps one cache entry per backend and batch
    cells = [(v, b) for v in variants for b in args["batches"]]
    inputs = {b: torch.randint(0, VOCAB_PER_RANK * world, (b, 1), device=device,
                               generator=torch.Generator(device=device).manual_seed(b))
              for b in args["batches"]}
    seen = {v: 0 for v in variants}
    sites = {}

    def warmed(cell):
        variant, batch = cell
        backend = compiled[variant][1]
        if backend is not None:
            sites[cell], kept, seen[variant] = _fused_sites(backend, seen[variant])
            if rank == 0:
                print(f"{shape_name} {variant} batch {batch}: sites fused {sites[cell]}"
                      + (f"; kept because: {'; '.join(kept)}" if kept else ""), flush=True)
        if progress is not None:
            progress.update()

    times = interleaved_ms(
        cells, lambda cell: (lambda ids, m=compiled[cell[0]][0]: m(ids, cache_position=position)),
        lambda cell: inputs[cell[1]], args["warmup"], args["iters"], args["rounds"],
        prepare=lambda cell: _use_lamport(cell[0].endswith("_lamport")), warmed=warmed)
    _use_lamport(False)
    rows = []
    for variant, batch in cells:
        rows.append({"shape": shape_name, "world": world, "variant": variant, "batch": batch,
                     "context": args["context"], "ms": times[variant, batch],
                     "sites_fused": sites.get((variant, batch), "")})
        if rank == 0:
            print(f"row: {rows[-1]}", flush=True)
    return rows


def report(rows: list[dict], out: Path, layers: int, name: str = "bench_decode") -> None:
    """Table on stdout, CSV and PNG; ratios against Inductor in the same compile mode."""
    out.mkdir(parents=True, exist_ok=True)
    by_key = {(r["shape"], r["variant"], r["batch"]): r["ms"] for r in rows}
    for r in rows:
        ref = by_key.get((r["shape"], BASELINE.get(r["variant"], "inductor"), r["batch"]))
        r["vs_inductor_same_mode"] = round(r["ms"] / ref, 4) if ref else ""
    csv_path = write_csv(out / f"{name}.csv", rows, ["shape", "world", "variant", "batch", "context", "ms",
                                                     "vs_inductor_same_mode", "sites_fused"])
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    keys = sorted({(r["shape"], r["batch"]) for r in rows})
    table = {(r["shape"], r["variant"], r["batch"]): r for r in rows}
    print("cells: ms (x Inductor in the same mode: inductor_cg for *_cg, else inductor)")
    print(f"{'shape':>10} {'batch':>5} " + " ".join(f"{v:>20}" for v in variants))
    for shape, batch in keys:
        cells = []
        for v in variants:
            r = table.get((shape, v, batch))
            ratio = r and r["vs_inductor_same_mode"]
            cells.append(f"{r['ms']:8.3f} ({ratio:.2f}x)" if r and ratio != "" else (f"{r['ms']:8.3f}" if r else ""))
        print(f"{shape:>10} {batch:>5} " + " ".join(f"{c:>20}" for c in cells))
    print(f"wrote {csv_path}")
    plt = pyplot()
    if plt is None:
        return
    shapes = list(dict.fromkeys(s for s, _ in keys))
    fig, axes = plt.subplots(1, len(shapes), figsize=(7 * len(shapes), 4.5), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        for v in variants:
            points = sorted((b, table[(shape, v, b)]["ms"]) for s, b in keys if s == shape and (shape, v, b) in table)
            if points:
                ax.plot(*zip(*points), marker="o", label=v)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequences in the step (one new token each)")
        ax.set_ylabel("ms per decode step")
        ax.set_title(f"{shape}, {layers} layers, {rows[0]['context']} cached tokens")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, out / f"{name}.png")


def main() -> None:
    parser = model_bench_parser(
        __doc__, "bench_decode", "batches 1, 32, 256; few iterations", SHAPES,
        "per-rank width presets (default 8b_tp2 70b_tp8sim; tiny with --smoke)",
        "decoder layers (default 16; 2 with --smoke)",
    )
    parser.add_argument("--context", type=int, default=None, help="cached tokens (default 2048; 8 with --smoke)")
    parser.add_argument("--batches", type=int, nargs="+", help="sequences per step (default 1 8 32 128 256)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {','.join(VARIANTS)}")
    args = parser.parse_args()
    variants = parse_variants(parser, args, VARIANTS)
    if not args.smoke and torch.cuda.device_count() < args.world:
        raise SystemExit(f"bench_decode --world {args.world} needs {args.world} GPUs (or --smoke)")
    from weavepass.testing import spawn

    if args.smoke:
        batches, warmup, iters, rounds = [1, 4], 1, 2, 2
    elif args.quick:
        batches, warmup, iters, rounds = [1, 32, 256], 3, 12, 3
    else:
        batches, warmup, iters, rounds = [1, 8, 32, 128, 256], 5, 30, 5
    config = {
        "smoke": args.smoke,
        "shapes": args.shape or (["tiny"] if args.smoke else ["8b_tp2", "70b_tp8sim"]),
        "layers": args.layers or (2 if args.smoke else 16),
        "context": args.context or (8 if args.smoke else 2048),
        "batches": args.batches or batches,
        "variants": variants,
        "warmup": warmup,
        "iters": iters,
        "rounds": rounds,
    }
    rows = spawn(_run_rank, args.world, "gloo" if args.smoke else "nccl", config, timeout_s=3000.0)[0]
    report(rows, Path(args.out), config["layers"], args.name or world_name("bench_decode", args.world))


if __name__ == "__main__":
    main()
