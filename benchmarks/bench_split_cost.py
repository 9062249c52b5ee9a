"""What cutting the tokens in two costs one decoder layer's GEMMs, against the wave model's
prediction (issue 33, lever 3: "the cut on GEMM tile/wave boundaries that this GPU actually rewards").

For each shape (per-rank widths, ``weavepass.tune.shapes``) and token count T, the layer's seven
GEMMs (q, k, v, o_proj, gate, up, down; ``F.linear`` as the reference model calls them) run on all
T rows, then on the two halves in sequence, for these cuts:

    wave   the wave model's cut for a static count (``plan_token_split`` on this GPU's SM count)
    tile   the cut of a symbolic count: half the tokens floored to the 128-row tile
    half   T // 2
    5/8    5T/8, an unbalanced cut

Per cut: the halves' time over the whole's (``measured``, medians of ``triton.testing.do_bench``,
the whole and every cut measured in the same process in interleaved rounds) and the wave model's
prediction (``predicted``: tile-times of the halves over the whole's, ``WaveModel.cost`` on all
seven GEMMs; 1.0 = free), and whether the model calls the cut free (its dominant GEMMs only). One
GPU, nothing communicated: the split's compute cost alone, before any overlap.

Output: a table on stdout and ``<out>/bench_split_cost.csv``. ``--smoke``: the ``tiny`` shape on
the CPU, wall-clock medians (checks the script, not the speed).
Run: ``python3 benchmarks/bench_split_cost.py --shape 70b_tp8sim 8b_tp2 --tokens 2048 4096 8192 16384``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import gpu_env  # noqa: F401  (must precede torch: multicast off, checkout on sys.path)
import torch
import torch.nn.functional as F
from report import write_csv  # benchmarks/report.py

from weavepass import WeaveConfig
from weavepass.compile.wave_model import GemmShape, WaveModel, dominant_gemms, plan_token_split
from weavepass.tune.shapes import SHAPES, Shape

CUTS = ("wave", "tile", "half", "5/8")


def layer_gemms(shape: Shape) -> dict[str, GemmShape]:
    """The layer's GEMMs per token, ``[T, k] x [k, n]``, named as the reference model's weights."""
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    return {"q": GemmShape(q, shape.hidden), "k": GemmShape(kv, shape.hidden), "v": GemmShape(kv, shape.hidden),
            "o_proj": GemmShape(shape.hidden, q), "gate": GemmShape(shape.mlp, shape.hidden),
            "up": GemmShape(shape.mlp, shape.hidden), "down": GemmShape(shape.hidden, shape.mlp)}


def cut_points(tokens: int, gemms: list[GemmShape], model: WaveModel) -> dict[str, int]:
    """Half A's size for each cut of ``CUTS`` (the wave cut as the split plans a static count)."""
    plan = plan_token_split(1, tokens, gemms, WeaveConfig(split="force", tuning_table="none"), model)
    half = tokens // 2
    tile = max(half // model.tile_m * model.tile_m, min(half, model.tile_m - 1))
    return {"wave": plan.first, "tile": tile, "half": half, "5/8": 5 * tokens // 8}


def predicted_ratio(tokens: int, first: int, gemms: list[GemmShape], model: WaveModel) -> float:
    """The wave model's tile-times of the two halves over the whole's (1.0: the cut is free)."""
    return (model.cost(first, gemms) + model.cost(tokens - first, gemms)) / model.cost(tokens, gemms)


def _median_ms(fn, smoke: bool) -> float:
    if smoke:
        times = []
        for _ in range(5):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=40, return_mode="median")


def measure(shape: Shape, tokens: int, firsts: dict[str, int], device, dtype, rounds: int, smoke: bool) -> dict:
    """``{"whole": ms, cut: ms}``: the seven GEMMs on all rows, and on the two halves of each cut,
    each a median over ``rounds`` interleaved rounds of medians."""
    gen = torch.Generator(device=device).manual_seed(tokens)
    gemms = layer_gemms(shape)
    weights = {name: torch.randn(g.n, g.k, generator=gen, device=device, dtype=dtype) * g.k ** -0.5
               for name, g in gemms.items()}
    widths = {g.k for g in gemms.values()}
    inputs = {k: torch.randn(tokens, k, generator=gen, device=device, dtype=dtype) for k in widths}

    def layer(lo: int, hi: int) -> None:
        for name, g in gemms.items():
            F.linear(inputs[g.k][lo:hi], weights[name])

    def halves(first: int):
        return lambda: (layer(0, first), layer(first, tokens))

    cases = {"whole": lambda: layer(0, tokens), **{cut: halves(first) for cut, first in firsts.items()}}
    samples = {case: [] for case in cases}
    for _ in range(rounds):
        for case, fn in cases.items():
            samples[case].append(_median_ms(fn, smoke))
    return {case: statistics.median(values) for case, values in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", nargs="+", choices=sorted(SHAPES), default=None,
                        help="per-rank widths (default 70b_tp8sim 8b_tp2; tiny with --smoke)")
    parser.add_argument("--tokens", type=int, nargs="+", default=None, help="default 2048 4096 8192 16384")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--smoke", action="store_true", help="tiny shape on the CPU, wall clock")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench_out"), help="folder for the CSV")
    args = parser.parse_args()
    smoke = args.smoke
    shapes = args.shape or (["tiny"] if smoke else ["70b_tp8sim", "8b_tp2"])
    tokens_list = args.tokens or ([256, 384] if smoke else [2048, 4096, 8192, 16384])
    if not smoke and not torch.cuda.is_available():
        raise SystemExit("bench_split_cost needs a GPU (or --smoke)")
    device = torch.device("cpu") if smoke else torch.device("cuda", 0)
    dtype = torch.float32 if smoke else torch.bfloat16
    sms = None if smoke else torch.cuda.get_device_properties(device).multi_processor_count
    model = WaveModel(sms=sms)
    rows = []
    for name in shapes:
        shape = SHAPES[name]
        gemms = list(layer_gemms(shape).values())
        for tokens in tokens_list:
            firsts = cut_points(tokens, gemms, model)
            times = measure(shape, tokens, firsts, device, dtype, args.rounds, smoke)
            for cut, first in firsts.items():
                rows.append({"shape": name, "tokens": tokens, "cut": cut, "first": first, "second": tokens - first,
                             "whole_ms": round(times["whole"], 4), "halves_ms": round(times[cut], 4),
                             "measured": round(times[cut] / times["whole"], 4),
                             "predicted": round(predicted_ratio(tokens, first, gemms, model), 4),
                             "model_free": model.split_is_free(tokens, first, dominant_gemms(gemms))})
                print(f"row: {rows[-1]}", flush=True)
    path = write_csv(os.path.join(args.out, "bench_split_cost.csv"), rows)
    print(f"wrote {path}")
    print(f"{'shape':>10} {'tokens':>6} {'cut':>5} {'A / B':>13} {'whole ms':>9} {'halves ms':>9} "
          f"{'measured':>8} {'predicted':>9} free")
    for r in rows:
        print(f"{r['shape']:>10} {r['tokens']:>6} {r['cut']:>5} {r['first']:>6}/{r['second']:<6} {r['whole_ms']:>9.3f} "
              f"{r['halves_ms']:>9.3f} {r['measured']:>7.3f}x {r['predicted']:>8.3f}x {r['model_free']}")


if __name__ == "__main__":
    main()
