"""The persistent Triton GEMM (``weavepass.runtime.cuda.gemm``) against cuBLAS (``torch.mm``) on one GPU,
plain and with its scatter epilogue to N = 2, 4, 8 simulated owners (issue 34).

For every per-rank GEMM of the model presets (``weavepass.tune.shapes.SHAPES``; ``y = x[T, K] @ W[N, K]^T``):

* ``o``: K = heads * head_dim, N = hidden;  ``down``: K = mlp, N = hidden (row-parallel: these get the
  scatter epilogue);
* ``qkv``: K = hidden, N = (heads + 2 kv_heads) * head_dim;  ``gate_up``: K = hidden, N = 2 mlp
  (column-parallel: their form is the gather prologue, not built yet, so plain only);

at each token count, bf16, the variants:

* ``cublas``: ``torch.mm(x, W.T, out=y)``, reduced-precision reductions left at torch's defaults;
* ``triton``: the plain persistent GEMM, the fastest of ``gemm.GPU_CONFIGS`` for this cell
  (``gemm.tune``), tensor-descriptor (TMA) loads where the GPU and Triton support them; if that path
  fails to compile, a printed notice and the pointer loads instead (column ``path``);
* ``triton_ptr`` (row-parallel GEMMs, where the fastest config stores through a tensor descriptor):
  the same config storing through pointers, as the scatter across GPUs must (separate allocations):
  what the TMA stores gain, apart from the routing;
* ``scatterN``: the same GEMM (the same config) as rank 0 of N simulated ranks (``testing.gemm_sim``),
  the op's GEMM as a group of one runs it: every rank's staging in one allocation (whole tiles per
  source), so the tiles leave through one tensor descriptor (TMA) where the config stores through one
  (``gemm.scatter_store_reason``; columns ``stores`` and ``stores_why``), with the deferred signals
  (one release per CTA and owner). No owner reduces: the owners' REDUCE_SEQ is set far ahead once,
  so the GEMM's wait for the previous call's readers passes at once and nothing else runs in the
  timed loop. ``scatterN_nosig``: the stores alone (routing cost without the signals);
  ``scatterN_ptr``: pointer stores with the deferred signals (the form across GPUs, whose stagings
  are separate allocations); ``scatterN_tilesig``: pointer stores with a release after every tile
  (the second version's scatter: the before of this one).

``--repeat N`` measures every cell N times in one process, interleaved (every cell once, then every
cell again; column ``repeat``), the tuning included; ``--table-from`` fills ``gemm.MEASURED_CONFIGS``
and ``MEASURED_SPEED`` only from keys whose repeats agree (``TABLE_RULE``, printed with the table):
the speed of a row-parallel key is the scatter's, the GEMM the op runs.

The plain Triton result and rank 0's own staged rows of each scatter are checked against the fp32
product (column ``check``: "ok" or why not; a failed check is printed and the run goes on). Times are
``triton.testing.do_bench`` medians (``--rep`` ms per variant; each call launched from Python after
an L2 flush, so a launch whose host work outlasts the flush shows in the time), every variant of a
cell in the same process right after the others; ``graph_ms`` (cuBLAS, plain Triton, the scatters
with signals; ``--no-graph`` leaves it out): ``triton.testing.do_bench_cudagraph`` medians, back-to-back
calls replayed from a CUDA graph, so no host work and a warm L2: the kernels alone, as under
reduce-overhead. Columns: ``speed_vs_cublas`` = cuBLAS time / time (above 1: faster than cuBLAS),
``graph_speed_vs_cublas`` the same of the graph times, ``vs_triton`` = plain Triton time / time and
``graph_vs_triton`` the same of the graph times.
The issue's targets: plain >= 0.97x cuBLAS at >= 4K tokens and >= 0.93x at 2K; scatter >= 0.97x plain.

Writes ``bench_gemm.csv`` (after every cell, so a run cut short keeps what it measured),
``bench_gemm_tune.csv`` (every config's time per cell: what ``gemm.MEASURED_CONFIGS`` is read from)
and ``bench_gemm.png`` under ``--out``. ``--configs`` limits the tuning to some of
``gemm.GPU_CONFIGS`` (indices), to fit a short device lease. ``--quick``: 70b_tp8 and 8b_tp2 at 2K
and 8K tokens. ``--smoke``: Triton's interpreter on the CPU (``TRITON_INTERPRET=1``, set by the script),
a tiny shape, fp16, 2 owners, wall-clock times that mean nothing: it checks the script and the outputs.

Run: ``python3 benchmarks/bench_gemm.py --quick --out $OUT``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import os
import statistics
import sys
import time

if "--smoke" in sys.argv:  # before Triton defines the kernels: the interpreter is chosen then
    os.environ["TRITON_INTERPRET"] = "1"

import gpu_env  # noqa: F401  (must precede torch: multicast off, checkout on sys.path)
import torch
from report import pyplot, save_figure, write_csv  # benchmarks/report.py
from timing import progress_bar  # benchmarks/timing.py

from weavepass.runtime.cuda import gemm
from weavepass.runtime.cuda.gemm_kernels import REDUCE_SEQ
from weavepass.testing.gemm_sim import SimulatedScatterRanks
from weavepass.tune.shapes import SHAPES  # shared with bench_overlap and python -m weavepass.tune

MODELS = ("70b_tp8", "70b_tp4", "70b_tp2", "8b_tp2")
QUICK_MODELS = ("70b_tp8", "8b_tp2")
TOKENS = (2048, 4096, 8192, 16384)
QUICK_TOKENS = (2048, 8192)
GEMMS = ("o", "down", "qkv", "gate_up")
ROW_PARALLEL = ("o", "down")
OWNERS = (2, 4, 8)
FAR_AHEAD = 1 << 30
"""REDUCE_SEQ the simulated owners are given: the GEMM's wait for readers of the previous call passes."""


def gemm_dims(model: str, name: str) -> tuple[int, int]:
    """``(N, K)`` of GEMM ``name`` of preset ``model`` (per rank)."""
    s = SHAPES[model]
    return {
        "o": (s.hidden, s.heads * s.head_dim),
        "down": (s.hidden, s.mlp),
        "qkv": ((s.heads + 2 * s.kv_heads) * s.head_dim, s.hidden),
        "gate_up": (2 * s.mlp, s.hidden),
    }[name]


def _timer(rep_ms: int):
    """Median ms of a callable: do_bench on a GPU, a few wall-clock calls in the interpreter."""
    if _on_gpu():
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=max(5, rep_ms // 4), rep=rep_ms, return_mode="median")

    def wall(fn):
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    return wall


def _on_gpu() -> bool:
    return torch.cuda.is_available() and not gemm.interpreting()


def _graph_timer(rep_ms: int):
    """Median ms of a callable replayed from a CUDA graph (no host work per call), or None off the GPU."""
    if not _on_gpu():
        return None
    from triton.testing import do_bench_cudagraph

    return lambda fn: do_bench_cudagraph(fn, rep=rep_ms, return_mode="median")


def choose_path(dtype, device, config, owner_counts) -> bool:
    """Whether the tensor-descriptor loads serve this run: the plain GEMM and the scatter GEMM of every
    owner count (each a kernel of its own) must compile and run on a small problem; if not, say why
    (the pointer loads run everywhere, so the variants stay comparable). Also compiles the kernels."""
    x = torch.randn(256, 256, device=device).to(dtype)
    why = gemm.descriptor_unsupported_reason(x, x)
    if why is None:
        try:
            gemm.matmul(x, x, config=config, use_descriptors=True)
            for owners in owner_counts:
                sim = SimulatedScatterRanks(owners, 256, 256, dtype, device)
                for signals in (True, False):
                    gemm.scatter_matmul(x, x, sim.workspaces[0], gemm.OwnerRows.build(256, owners, device), config,
                                        True, signals=signals)
            if x.is_cuda:
                torch.cuda.synchronize()
            return True
        except Exception as error:  # noqa: BLE001 (a compile failure of this Triton: fall back, said below)
            why = f"it failed: {type(error).__name__}: {str(error).strip().splitlines()[-1][:300]}"
    print(f"NOTICE: the Triton GEMM runs with pointer loads, not tensor descriptors: {why}", flush=True)
    return False


def measure_cell(model, name, tokens, dtype, device, path, time_ms, configs, owner_counts, check, graph_ms=None,
                 tuned=None, repeat: int = 0) -> list[dict]:
    """The cell's rows (one per variant); ``tuned`` (a list), if given, gets a row per tried config;
    ``repeat``: the round of ``--repeat`` (a column of both)."""
    n, k = gemm_dims(model, name)
    gen = torch.Generator(device=device).manual_seed(tokens + n + k)
    x = torch.randn(tokens, k, generator=gen, device=device).to(dtype)
    w = (torch.randn(n, k, generator=gen, device=device) * k**-0.5).to(dtype)
    y = torch.empty(tokens, n, dtype=dtype, device=device)
    base = dict(model=model, gemm=name, tokens=tokens, m=tokens, n=n, k=k, dtype=str(dtype).removeprefix("torch."),
                repeat=repeat)
    flop = 2.0 * tokens * n * k
    rows = []

    def row(variant, ms, config=None, fn=None, **extra):
        graph = round(graph_ms(fn), 4) if graph_ms is not None and fn is not None else ""
        rows.append(dict(base, variant=variant, path=("descriptors" if path else "pointers") if config else "",
                         config=config.label() if config else "", ms=ms, tflops=round(flop / ms / 1e9, 1),
                         graph_ms=graph, **extra))

    cublas = functools.partial(torch.mm, x, w.T, out=y)
    cublas_ms = time_ms(cublas)
    row("cublas", cublas_ms, fn=cublas)
    best = configs[0]
    if len(configs) > 1:
        best, results = gemm.tune(lambda c: gemm.matmul(x, w, out=y, config=c, use_descriptors=path), configs)
        if tuned is not None:
            tuned += [dict(base, config=c.label(), ms=round(ms, 4) if isinstance(ms, float) else "",
                           error="" if isinstance(ms, float) else ms, cublas_ms=round(cublas_ms, 4))
                      for c, ms in results.items()]
    plain = functools.partial(gemm.matmul, x, w, out=y, config=best, use_descriptors=path)
    triton_ms = time_ms(plain)
    if len(configs) == 1 and tuned is not None:  # nothing tuned: the one config's time is its tuning row
        tuned.append(dict(base, config=best.label(), ms=round(triton_ms, 4), error="", cublas_ms=round(cublas_ms, 4)))
    reference = (x.float() @ w.float().T) if check else None
    y.fill_(float("nan"))  # poisoned: the check below sees every element the timed calls' GEMM wrote
    plain()
    row("triton", triton_ms, best, fn=plain, check=_check(y, reference))
    if name in ROW_PARALLEL and best.store_desc and path:
        pointers = dataclasses.replace(best, store_desc=False)
        row("triton_ptr", time_ms(functools.partial(gemm.matmul, x, w, out=y, config=pointers, use_descriptors=path)),
            pointers)
    if name in ROW_PARALLEL:
        pointers = dataclasses.replace(best, store_desc=False)
        scatters = (("", best, True), ("_nosig", best, False), ("_ptr", pointers, True),
                    ("_tilesig", dataclasses.replace(pointers, defer_signals=False), True))
        for owners in owner_counts:
            # Every rank's staging in one allocation, whole tiles per source: the scatter may store
            # through one descriptor (scatter_store_reason), as the op at a group of one does.
            per_owner = -(-tokens // owners)
            capacity = -(-per_owner // best.block_m) * best.block_m
            sim = SimulatedScatterRanks(owners, n, capacity, dtype, device, one_allocation=True)
            for pad in sim.pads[1:]:
                pad[REDUCE_SEQ.value] = FAR_AHEAD
            table = gemm.OwnerRows.build(tokens, owners, device)
            for suffix, config, signals in scatters:
                call = functools.partial(gemm.scatter_matmul, x, w, sim.workspaces[0], table, config, path,
                                         signals=signals)
                ms = time_ms(call)
                verdict = ""
                if check:  # rank 0's own rows, stored last into its own staging: the slot of its latest
                    # call with signals (read from its pad), slot 0 without
                    slot = sim.workspaces[0].last_slot() if signals else 0
                    verdict = _check(sim.workspaces[0].staged(0, table.count(0), slot), reference[table.rows(0)])
                why = gemm.scatter_store_reason(sim.workspaces[0], config, path, signals)
                row(f"scatter{owners}{suffix}", ms, config, fn=call if signals else None, check=verdict,
                    stores="pointers" if why else "tma", stores_why=why or "")
            del sim
    cublas_graph, triton_graph = rows[0]["graph_ms"], next(r["graph_ms"] for r in rows if r["variant"] == "triton")
    for r in rows:
        r["speed_vs_cublas"] = round(cublas_ms / r["ms"], 3)
        r["graph_speed_vs_cublas"] = round(cublas_graph / r["graph_ms"], 3) if r["graph_ms"] else ""
        r["vs_triton"] = round(triton_ms / r["ms"], 3)
        r["graph_vs_triton"] = round(triton_graph / r["graph_ms"], 3) if r["graph_ms"] else ""
        r["ms"] = round(r["ms"], 4)
    return rows


def _check(got: torch.Tensor, reference: torch.Tensor | None) -> str:
    """"ok", or the first line of why ``got`` is not the fp32 ``reference`` rounded (one ulp of the
    dtype relative, atol for values near 0: tests/gpu/test_gemm_gpu.py's tolerance), printed too: a
    wrong cell is reported and the run goes on."""
    if reference is None:
        return ""
    try:
        torch.testing.assert_close(got.float(), reference, rtol=2**-7 if got.dtype == torch.bfloat16 else 2**-10,
                                   atol=1e-3)
    except AssertionError as error:
        text = " ".join(str(error).split())[:200]
        print(f"CHECK FAILED: {text}", flush=True)
        return text
    return "ok"


def plot(rows: list[dict], path, key: str = "speed_vs_cublas", baseline: str = "cublas",
         ylabel: str = "speed vs cuBLAS") -> None:
    """One panel per (model, GEMM): each variant but ``baseline``'s ``key`` over the token count, the
    median over ``--repeat``; lines at 1 and at the issue's 0.97 (bench_gather_prologue uses it too)."""
    plt = pyplot()
    if plt is None:
        return
    models = list(dict.fromkeys(r["model"] for r in rows))
    names = list(dict.fromkeys(r["gemm"] for r in rows))
    fig, axes = plt.subplots(len(models), len(names), figsize=(3.6 * len(names), 2.8 * len(models)),
                             squeeze=False, sharey=True)
    for (i, model), (j, name) in itertools.product(enumerate(models), enumerate(names)):
        ax = axes[i][j]
        cell = [r for r in rows if r["model"] == model and r["gemm"] == name and r["variant"] != baseline]
        for variant in dict.fromkeys(r["variant"] for r in cell):
            tokens = sorted({r["tokens"] for r in cell if r["variant"] == variant})
            points = [(t, statistics.median(r[key] for r in cell  # median over --repeat
                                            if r["variant"] == variant and r["tokens"] == t)) for t in tokens]
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=variant)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.axhline(0.97, color="grey", lw=0.6, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{model} {name}", fontsize=9)
        if j == 0:
            ax.set_ylabel(ylabel)
        if i == len(models) - 1:
            ax.set_xlabel("tokens")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)


TABLE_RULE = (
    "a (N, K, token bucket) key enters the table only when it was measured in at least "
    "{min_repeats} repeats (bench_gemm --repeat) and its speed agrees across them: (max - min) / median "
    "of the per-repeat speeds <= {spread:.0%}. Its config: the one with the lowest time summed over the "
    "bucket's token counts and the repeats, among the configs that ran in all of them. Its speed per "
    "repeat: cuBLAS's time / the GEMM's, each summed over the bucket's token counts; for a row-parallel "
    "GEMM (scatter rows measured) the scatter the op runs at each group size (scatter1: one rank, its "
    "staging one allocation; scatterN_ptr at N > 1: each rank's staging its own allocation, pointer "
    "stores), the slowest owner count, else the plain GEMM's with that config, which decides the key's "
    "entry but is not written: "
    "MEASURED_SPEED holds the scatter's speeds alone, since the planner reads it for row-parallel sites, "
    "and another model's row-parallel GEMM may have a column-parallel key's (N, K). MEASURED_SPEED holds "
    "the median over the repeats. Keys that fail are left out and listed with why"
)
"""How ``--table-from`` fills ``gemm.MEASURED_CONFIGS`` / ``MEASURED_SPEED`` (``measured_table``).
The second version's one run disagreed with itself by up to 0.5x between timers at 2K tokens
(docs/gemm_epilogue.md), so one run decides nothing."""
TABLE_MIN_REPEATS = 2
TABLE_MAX_SPREAD = 0.05


def measured_table(tune_rows: list[dict], bench_rows: list[dict], min_repeats: int = TABLE_MIN_REPEATS,
                   max_spread: float = TABLE_MAX_SPREAD) -> tuple[dict, dict, dict]:
    """``(configs, speeds, left_out)`` by ``TABLE_RULE`` from the rows of ``bench_gemm_tune.csv``
    (every config's time per cell and repeat, with cuBLAS's) and of ``bench_gemm.csv`` (the scatter
    variants' times; cuBLAS's per cell): ``configs[key]`` a ``gemm.GPU_CONFIGS`` entry for the keys
    that pass, and ``speeds[key]`` cuBLAS time / the scatter's time (above 1: faster than cuBLAS) for
    those of them with scatter rows,
    ``left_out[key]`` why each other key is not in the table. Keys: ``(N, K, token bucket)``."""
    index = {c.label(): i for i, c in enumerate(gemm.GPU_CONFIGS)}

    def key_of(r):
        return int(r["n"]), int(r["k"]), gemm.token_bucket(int(r["m"]))

    times: dict = {}  # key -> config index -> {(repeat, m): ms}
    cublas: dict = {}  # key -> {(repeat, m): ms}
    for r in tune_rows:
        key, cell = key_of(r), (int(r.get("repeat") or 0), int(r["m"]))
        cublas.setdefault(key, {})[cell] = float(r["cublas_ms"])
        if r["ms"] and r["config"] in index:
            times.setdefault(key, {}).setdefault(index[r["config"]], {})[cell] = float(r["ms"])
    scatter: dict = {}  # key -> owners -> {(repeat, m): ms}
    for r in bench_rows:
        owners = op_scatter_owners(r["variant"])
        if owners is not None and r["ms"]:
            scatter.setdefault(key_of(r), {}).setdefault(owners, {})[(int(r.get("repeat") or 0), int(r["m"]))] = \
                float(r["ms"])
    configs, speeds, left_out = {}, {}, {}
    for key in sorted(cublas):
        cells = set(cublas[key])
        repeats = sorted({rep for rep, _ in cells})
        complete = {i: ms for i, ms in times.get(key, {}).items() if set(ms) == cells}
        if not complete:
            left_out[key] = "no config of gemm.GPU_CONFIGS ran in every cell of the bucket"
            continue
        best = min(complete, key=lambda i: sum(complete[i].values()))
        if key in scatter:
            measured = [ms for ms in scatter[key].values() if set(ms) == cells]
            if len(measured) != len(scatter[key]):
                left_out[key] = "a scatter variant was not measured in every cell of the bucket"
                continue
        else:
            measured = [complete[best]]

        def speed(rep: int, ms: dict) -> float:
            return (sum(t for (r, _), t in cublas[key].items() if r == rep)
                    / sum(t for (r, _), t in ms.items() if r == rep))

        per_repeat = [min(speed(rep, ms) for ms in measured) for rep in repeats]
        if len(repeats) < min_repeats:
            left_out[key] = f"measured in {len(repeats)} repeat(s), fewer than {min_repeats}"
            continue
        middle = statistics.median(per_repeat)
        spread = (max(per_repeat) - min(per_repeat)) / middle
        if spread > max_spread:
            left_out[key] = (f"the repeats disagree: speeds {', '.join(f'{v:.3f}' for v in per_repeat)} spread "
                             f"{spread:.1%} > {max_spread:.0%}")
            continue
        configs[key] = gemm.GPU_CONFIGS[best]
        if key in scatter:  # the planner reads a speed for a row-parallel site only: the scatter's
            speeds[key] = round(middle, 3)
    return configs, speeds, left_out


def op_scatter_owners(variant: str) -> int | None:
    """The owner count N of a ``bench_gemm.csv`` row that times the scatter the ``cuda_symm`` op runs
    at a group of N ranks, or None: ``scatter1`` at one rank (its staging is one allocation: TMA stores
    where ``gemm.scatter_store_reason`` allows), ``scatterN_ptr`` at N > 1 (each rank's staging is its
    own allocation: pointer stores; ``scatterN``, one allocation, is no group's form there)."""
    if variant == "scatter1":
        return 1
    if variant.startswith("scatter") and variant.endswith("_ptr") and variant[7:-4].isdigit():
        owners = int(variant[7:-4])
        return owners if owners > 1 else None
    return None


def table_source(configs: dict, speeds: dict, left_out: dict) -> str:
    """``measured_table``'s result as the Python source of ``gemm.MEASURED_CONFIGS`` and
    ``MEASURED_SPEED``, with the keys left out as comments."""
    lines = [f"# {TABLE_RULE.format(min_repeats=TABLE_MIN_REPEATS, spread=TABLE_MAX_SPREAD)}"]
    lines += [f"# left out {key}: {why}" for key, why in left_out.items()]
    lines.append("MEASURED_CONFIGS: dict[tuple[int, int, int], GemmConfig] = {")
    lines += [f"    {key}: {_literal(config)}," for key, config in configs.items()]
    lines += ["}", "MEASURED_SPEED: dict[tuple[int, int, int], float] = {"]
    lines += [f"    {key}: {speed:.3f}," for key, speed in speeds.items()]
    return "\n".join(lines + ["}"])


def _read_csv(path: str) -> list[dict]:
    import csv

    with open(path) as f:
        return list(csv.DictReader(f))


def _literal(config: gemm.GemmConfig) -> str:
    """``config`` as the shortest ``GemmConfig(...)`` source: the six numbers, then what is not default."""
    c = config
    extra = [f"{f.name}={getattr(c, f.name)!r}" for f in dataclasses.fields(c)[6:]
             if getattr(c, f.name) != f.default]
    numbers = [str(n) for n in (c.block_m, c.block_n, c.block_k, c.group_m, c.num_stages, c.num_warps)]
    return f"GemmConfig({', '.join(numbers + extra)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="70b_tp8 and 8b_tp2 at 2K and 8K tokens")
    parser.add_argument("--smoke", action="store_true", help="the interpreter on the CPU, a tiny shape")
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--models", nargs="+", choices=MODELS)
    parser.add_argument("--tokens", nargs="+", type=int)
    parser.add_argument("--owners", nargs="+", type=int, help="simulated owners of the scatter variants "
                        "(default 2 4 8; 2 with --smoke; 1: the op's GEMM at a group of one rank)")
    parser.add_argument("--rep", type=int, default=100, help="do_bench repetition time per variant, ms")
    parser.add_argument("--configs", nargs="+", type=int, help="indices into gemm.GPU_CONFIGS to tune over "
                        "(default all)")
    parser.add_argument("--no-graph", action="store_true", help="leave out the CUDA-graph replay times")
    parser.add_argument("--repeat", type=int, default=1, help="independent rounds over every cell in this "
                        "process, interleaved (round 1 of every cell, then round 2, ...): column repeat; "
                        "--table-from needs >= 2")
    parser.add_argument("--table-from", nargs="+", metavar="TUNE_CSV", help="print gemm.MEASURED_CONFIGS and "
                        "MEASURED_SPEED by TABLE_RULE from bench_gemm_tune.csv files (each read with the "
                        "bench_gemm.csv beside it: the scatter's times), and exit")
    parser.add_argument("--table-out", help="with --table-from: also write the table's source to this file")
    args = parser.parse_args()
    if args.table_from:
        bench_rows = []
        for tune_csv in args.table_from:
            beside = os.path.join(os.path.dirname(tune_csv), "bench_gemm.csv")
            bench_rows += _read_csv(beside) if os.path.exists(beside) else []
        source = table_source(*measured_table([r for f in args.table_from for r in _read_csv(f)], bench_rows))
        print(source)
        if args.table_out:
            with open(args.table_out, "w") as f:
                f.write(source + "\n")
            print(f"wrote {args.table_out}")
        return
    if args.smoke:
        SHAPES["smoke"] = SHAPES["tiny"]
        models, tokens, device = ["smoke"], args.tokens or [40], "cpu"
        # TMA stores as GPU_CONFIGS' (the interpreter's bf16 dot is wrong: fp16)
        configs, dtype = [dataclasses.replace(gemm.INTERPRETER_CONFIG, store_desc=True)], torch.float16
        owner_counts = args.owners or [2]
    else:
        if not torch.cuda.is_available():
            sys.exit("bench_gemm needs a CUDA GPU (or --smoke)")
        models = args.models or list(QUICK_MODELS if args.quick else MODELS)
        tokens = args.tokens or list(QUICK_TOKENS if args.quick else TOKENS)
        configs = [gemm.GPU_CONFIGS[i] for i in args.configs] if args.configs else list(gemm.GPU_CONFIGS)
        device, dtype = "cuda", torch.bfloat16
        owner_counts = args.owners or list(OWNERS)
        print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}", flush=True)
    time_ms = _timer(args.rep)
    graph_ms = None if args.no_graph else _graph_timer(max(10, args.rep // 2))
    path = choose_path(dtype, device, configs[0], owner_counts)
    cells = [(rep, *cell) for rep in range(args.repeat) for cell in itertools.product(models, GEMMS, tokens)]
    progress = progress_bar(len(cells), "bench_gemm")
    rows: list[dict] = []
    tuned: list[dict] = []
    for rep, model, name, count in cells:
        try:
            cell = measure_cell(model, name, count, dtype, device, path, time_ms, configs, owner_counts,
                                check=True, graph_ms=graph_ms, tuned=tuned, repeat=rep)
        except RuntimeError as error:
            if not path or "no GEMM config ran" not in str(error):
                raise
            print(f"NOTICE: no descriptor config ran for {model} {name} {count} ({error}); pointer loads from now",
                  flush=True)
            path = False
            cell = measure_cell(model, name, count, dtype, device, path, time_ms, configs, owner_counts,
                                check=True, graph_ms=graph_ms, tuned=tuned, repeat=rep)
        for r in cell:
            print(" ".join(f"{key}={r[key]}" for key in (
                "repeat", "model", "gemm", "tokens", "variant", "ms", "graph_ms", "speed_vs_cublas",
                "graph_speed_vs_cublas", "vs_triton", "graph_vs_triton", "config")), flush=True)
        rows += cell
        write_csv(os.path.join(args.out, "bench_gemm.csv"), rows)  # after every cell: a cut run keeps these
        if tuned:
            write_csv(os.path.join(args.out, "bench_gemm_tune.csv"), tuned)
        progress.update()
    progress.close()
    print(f"wrote {os.path.join(args.out, 'bench_gemm.csv')}")
    plot(rows, os.path.join(args.out, "bench_gemm.png"))


if __name__ == "__main__":
    main()
