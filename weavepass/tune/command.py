"""``python -m weavepass.tune``: measure plain Inductor, fuse-only and the split on this machine's
GPUs for your layer shapes, and write the tuning table ``split="auto"`` decides from.

    python -m weavepass.tune --shape 70b_tp8sim 8b_tp2 --world 2 --out tuning.json
    WeaveConfig(split="auto", tuning_table="tuning.json")

For each shape and compile mode it builds a model of ``--layers`` Llama-style decoder layers at the
shape's per-rank widths (``weavepass.tune.shapes``), compiles it three ways in the same processes
(``inductor``: ``torch.compile``; ``fuse``: backend weave with ``split="off"``; ``split``: weave
with ``split="force"``), the token dim dynamic (one compile each), and times every
(rewrite, token count) cell in interleaved rounds with CUDA events (``weavepass.tune.timing``; a
cell's time is the median of its rounds' medians, the Inductor baseline measured in the same
rounds). A rewrite whose compiled graph did not get it (a split the graph refused) is not recorded.

``--world N`` runs N ranks, one GPU each, over NCCL: it measures the communication and how much of
it the split hides. ``--world 1`` (one GPU) measures the local cost only: nothing is communicated,
so the table says what the rewrites cost, not what they save; such a table applies to groups of
one rank. Ranks are spawned here, or, under ``torchrun --nproc-per-node N``, the ranks are
torchrun's. ``--device cpu`` runs the ranks on CPU processes over gloo (float32, wall-clock): it
checks the command, not the speed. ``--dry-run`` prints what would be measured and exits.
``--merge A B --out C`` writes the entries of tables measured alike as one table (e.g. a
default-mode and a reduce-overhead run).

The table is written after every (shape, mode) entry, so a run stopped by ``--time-budget-s`` or
a time limit keeps what it measured. Schema: ``weavepass.tune.table``; docs/usage.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_TOKENS = (1024, 2048, 4096, 8192, 16384)
VARIANTS = {"inductor": None, "fuse": "off", "split": "force"}
"""Each timed rewrite and the ``WeaveConfig.split`` it compiles with (None: plain Inductor)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from weavepass.tune.shapes import SHAPES, parse_shape
    from weavepass.tune.table import MODES

    parser = argparse.ArgumentParser(prog="python -m weavepass.tune", description=__doc__.split("\n")[0])
    parser.add_argument("--shape", nargs="+", default=None,
                        help=f"per-rank layer shapes: presets ({', '.join(sorted(SHAPES))}) or "
                             "name:hidden=H,heads=A,kv_heads=K,mlp=M[,head_dim=D] (default: tiny with "
                             "--device cpu, else required)")
    parser.add_argument("--world", type=int, default=1, help="ranks, one GPU each (default 1: local cost only)")
    parser.add_argument("--tokens", type=int, nargs="+", default=None,
                        help=f"token counts per batch (default {' '.join(map(str, DEFAULT_TOKENS))}; 16 32 on cpu)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=["default"],
                        help="compile modes (reduce-overhead: Inductor CUDA graphs); default: default")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers per model (default 4; 1 on cpu)")
    parser.add_argument("--sequences", type=int, default=1, help="sequences per batch (default 1)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                        help="default bfloat16 (float32 on cpu)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up calls per cell (default 2)")
    parser.add_argument("--iters", type=int, default=25,
                        help="timed calls per cell, over all rounds (default 25: compiling costs far more)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--min-gain", type=float, default=0.02,
                        help="a rewrite is chosen only where it is at least this much faster than "
                             "Inductor (default 0.02: cells move by a few percent between runs)")
    parser.add_argument("--time-budget-s", type=float, default=None,
                        help="start no new (shape, mode) entry once the next one would likely end past "
                             "this many seconds (the table keeps what was measured)")
    parser.add_argument("--out", default=None,
                        help="the table's path (default tuning_table_w<world>.json in $OUT or here)")
    parser.add_argument("--source", default="", help="text the table's source field starts with")
    parser.add_argument("--dry-run", action="store_true", help="print what would be measured; measure nothing")
    parser.add_argument("--merge", nargs="+", metavar="TABLE", default=None,
                        help="measure nothing: write the entries of these tables (same device, world, "
                             "dtype, layers, sequences, time unit, min_gain, torch) as one table to --out")
    args = parser.parse_args(argv)
    cpu = args.device == "cpu"
    if args.merge:
        if not args.out:
            parser.error("--merge needs --out")
        args.out = Path(args.out)
        return args
    args.shape = args.shape or (["tiny"] if cpu else None)
    if not args.shape:
        parser.error("--shape is required (a preset or name:hidden=H,heads=A,kv_heads=K,mlp=M[,head_dim=D])")
    try:
        args.shapes = [parse_shape(text) for text in args.shape]
    except ValueError as error:
        parser.error(str(error))
    args.tokens = sorted(set(args.tokens or ([16, 32] if cpu else DEFAULT_TOKENS)))
    args.layers = args.layers or (1 if cpu else 4)
    args.dtype = args.dtype or ("float32" if cpu else "bfloat16")
    if args.world < 1:
        parser.error(f"--world must be >= 1, got {args.world}")
    if any(t < 2 or t % args.sequences for t in args.tokens):
        parser.error(f"every token count must be >= 2 and a multiple of --sequences ({args.sequences})")
    if cpu and "reduce-overhead" in args.modes:
        parser.error("--modes reduce-overhead records CUDA graphs: not on --device cpu")
    if min(args.warmup, args.iters, args.rounds) < 1 or args.iters < args.rounds:
        parser.error("--warmup, --rounds >= 1 and --iters >= --rounds")
    if not 0 <= args.min_gain < 0.5:
        parser.error(f"--min-gain must be in [0, 0.5), got {args.min_gain}")
    default_out = Path(os.environ.get("OUT", ".")) / f"tuning_table_w{args.world}.json"
    args.out = Path(args.out) if args.out else default_out
    return args


def scope_note(world: int) -> str:
    """What a run at ``world`` ranks measures."""
    if world == 1:
        return ("world 1: a group of one rank, nothing is communicated. This measures the LOCAL COST of "
                "the rewrites only (what they add where there is nothing to hide), not what they save on "
                "several GPUs; the table applies to groups of one rank. Run with --world N on N GPUs to "
                "measure communication and overlap.")
    return (f"world {world}: {world} ranks, one GPU each, NCCL: the rewrites' cost and the communication "
            "they save or hide, as your model will see them at this world size.")


def plan_lines(args: argparse.Namespace) -> list[str]:
    """The measurement plan, for ``--dry-run`` and the start of a run."""
    lines = [scope_note(args.world),
             (f"device {args.device}, dtype {args.dtype}, {args.layers} layer(s), {args.sequences} sequence(s) "
              f"per batch, tokens {' '.join(map(str, args.tokens))}, modes {' '.join(args.modes)}"),
             (f"rewrites timed: {', '.join(VARIANTS)} (interleaved: {args.rounds} rounds, {args.iters} calls "
              f"per cell, {args.warmup} warm-up)")]
    for name, shape in args.shapes:
        lines.append(f"  {name}: {shape.widths.describe()}")
    entries = len(args.shapes) * len(args.modes)
    lines.append(f"{entries} entr{'y' if entries == 1 else 'ies'} x {len(VARIANTS)} compiles, "
                 f"{entries * len(VARIANTS) * len(args.tokens)} cells; table -> {args.out}")
    return lines


def _versions() -> dict[str, str]:
    import torch

    versions = {"torch": torch.__version__, "python": platform.python_version()}
    try:
        import triton

        versions["triton"] = triton.__version__
    except ImportError:
        pass
    if torch.version.cuda:
        versions["cuda"] = torch.version.cuda
    if os.environ.get("WEAVEPASS_COMMIT"):  # a copy without its own git metadata (the device's) says it
        versions["weavepass"] = os.environ["WEAVEPASS_COMMIT"]
        return versions
    try:
        here = Path(__file__).resolve().parent
        commit = subprocess.run(["git", "-C", str(here), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10, check=False).stdout.strip()
        if commit:
            versions["weavepass"] = commit
    except (OSError, subprocess.SubprocessError):
        pass
    return versions


def _machine(device_type: str, world: int) -> dict:
    import torch

    if device_type == "cuda":
        props = torch.cuda.get_device_properties(0)
        return {"device_type": "cuda", "device_name": props.name, "sms": props.multi_processor_count, "gpus": world}
    return {"device_type": "cpu", "device_name": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "processes": world}


def _compiled(model, rewrite: str, mode: str):
    """``model`` compiled for ``rewrite`` in ``mode`` and, for weave, its backend (its report says
    whether the rewrite happened)."""
    import torch

    from weavepass import WeaveConfig
    from weavepass.backend import WeaveBackend

    compile_mode = None if mode == "default" else mode
    split = VARIANTS[rewrite]
    if split is None:
        return torch.compile(model, mode=compile_mode), None
    # min_world_size=1: a group of one rank is rewritten too; no table: measure, do not decide.
    config = WeaveConfig(split=split, min_world_size=1, tuning_table="none")
    backend = WeaveBackend(config)
    return torch.compile(model, backend=backend, mode=compile_mode), backend


def _missing_rewrite(rewrite: str, backend) -> str | None:
    """Why ``rewrite``'s compiled graph does not have it (None: it does)."""
    if backend is None:
        return None
    graphs = backend.report.graphs
    if not graphs or not any(g.rewritten for g in graphs):
        notes = "; ".join(g.note for g in graphs) or "no graph compiled"
        return f"no site was fused ({notes})"
    if rewrite == "split" and not any(n.startswith("split (") for g in graphs for n in g.notes):
        return f"the graph was not split ({'; '.join(g.note for g in graphs)})"
    return None


def _entry_rows(rank: int, world: int, args: dict, name: str, shape, mode: str, say) -> dict:
    """Times of every (rewrite, tokens) cell of one shape in one mode: ``{tokens: {rewrite: ms}}``."""
    import torch
    import torch.distributed as dist

    from weavepass.tune.shapes import VOCAB_PER_RANK, build_model
    from weavepass.tune.timing import interleaved_ms, progress_bar

    device = torch.device("cpu") if args["device"] == "cpu" else torch.device("cuda", rank)
    dtype = getattr(torch, args["dtype"])
    torch._dynamo.reset()
    model = build_model(shape, dist.group.WORLD, device, args["layers"], dtype)
    seqs = args["sequences"]
    inputs = {}
    for tokens in args["tokens"]:
        ids = torch.randint(0, VOCAB_PER_RANK * world, (seqs, tokens // seqs), device=device,
                            generator=torch.Generator(device=device).manual_seed(tokens))
        torch._dynamo.mark_dynamic(ids, 1)
        inputs[tokens] = ids
    compiled, backends = {}, {}
    for rewrite in VARIANTS:
        compiled[rewrite], backends[rewrite] = _compiled(model, rewrite, mode)
    cells = [(r, t) for r in VARIANTS for t in args["tokens"]]
    progress = progress_bar(len(cells), f"{name} {mode}: compile + warm-up") if rank == 0 else None
    started = time.monotonic()
    times = interleaved_ms(cells, lambda cell: compiled[cell[0]], lambda cell: inputs[cell[1]], args["warmup"],
                           args["iters"], args["rounds"],
                           warmed=lambda cell: progress is not None and progress.update())
    if progress is not None:
        progress.close()
    say(f"{name} {mode}: measured {len(cells)} cells in {time.monotonic() - started:.0f} s")
    rows: dict[int, dict[str, float]] = {t: {} for t in args["tokens"]}
    for rewrite in VARIANTS:
        missing = _missing_rewrite(rewrite, backends[rewrite])
        if missing is not None:
            say(f"{name} {mode}: {rewrite} not recorded: {missing}")
            continue
        for tokens in args["tokens"]:
            rows[tokens][rewrite] = times[rewrite, tokens]
    return rows


def _stop(elapsed: float, longest: float, budget: float | None, world: int) -> bool:
    """Whether to start no further entry (rank 0 decides; every rank follows, so all agree)."""
    import torch.distributed as dist

    flag = [budget is not None and elapsed + longest > budget]
    if world > 1:
        dist.broadcast_object_list(flag, src=0)
    return flag[0]


def measure_rank(rank: int, world: int, args: dict) -> list[dict]:
    """Run every (shape, mode) entry on this rank; rank 0 writes the table after each one.
    Returns the entries measured (JSON objects)."""
    import torch

    from weavepass.tune.table import WIDTHS, parse_table

    def say(text: str) -> None:
        if rank == 0:
            print(f"[weavepass.tune {time.monotonic() - t0:6.0f} s] {text}", flush=True)

    t0 = time.monotonic()
    head = {
        "schema": "weavepass-tuning-table", "version": 1,
        "source": (f"{args['source']}{'; ' if args['source'] else ''}python -m weavepass.tune "
                   f"{' '.join(args['argv'])}: {scope_note(world)}"),
        "created_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": _machine(args["device"], world), "versions": _versions(), "world": world,
        "dtype": args["dtype"], "layers": args["layers"], "sequences": args["sequences"], "time_unit": "ms",
        "timing": (f"{'CUDA events' if args['device'] == 'cuda' else 'time.perf_counter'} per forward call, rank 0; "
                   f"the three rewrites' cells interleaved in {args['rounds']} rounds of "
                   f"{args['iters'] // args['rounds']} calls after {args['warmup']} warm-up; "
                   "a cell is the median of its rounds' medians; token dim dynamic (one compile per rewrite)"),
        "min_gain": args["min_gain"], "entries": [],
    }
    for line in args["plan"]:
        say(line)
    longest, skipped = 0.0, []
    # Modes outer: with a time budget, every shape's default-mode entry comes first.
    todo = [(name, shape, mode) for mode in args["modes"] for name, shape in args["shapes"]]
    for i, (name, shape, mode) in enumerate(todo):
        if _stop(time.monotonic() - t0, longest, args["time_budget_s"], world):
            skipped = [f"{n} ({m})" for n, _, m in todo[i:]]
            say(f"time budget {args['time_budget_s']:.0f} s: not measured: {', '.join(skipped)}")
            break
        started = time.monotonic()
        say(f"{name} ({shape.widths.describe()}), {mode} mode: compiling inductor, fuse, split")
        rows = _entry_rows(rank, world, args, name, shape, mode, say)
        if args["device"] == "cuda":  # the entry's model and compiled graphs are gone with its frame
            torch.cuda.empty_cache()
        longest = max(longest, time.monotonic() - started)
        head["entries"].append({
            "shape": name, **{w: getattr(shape.widths, w) for w in WIDTHS}, "mode": mode,
            "cells": [{"tokens": t, "times": rows[t]} for t in args["tokens"]],
        })
        if rank == 0:
            table = parse_table(head, str(args["out"]))  # validates what is written
            table.save(args["out"])
            say(f"wrote {args['out']} ({len(head['entries'])} of {len(todo)} entries)")
    return head["entries"]


def print_table(path: Path) -> None:
    """The written table as text: times, ratios to Inductor, and the choice per cell."""
    from weavepass.tune.table import choose, read_table

    table = read_table(path)
    print(f"\n{path}: world {table.world}, {table.machine.get('device_name')}, torch {table.versions['torch']}, "
          f"min_gain {table.min_gain:.0%}")
    print(f"{'shape':>12} {'mode':>15} {'tokens':>7} {'inductor ms':>12} {'fuse':>7} {'split':>7}  auto picks")
    for entry in table.entries:
        for cell in entry.cells:
            ratios = [f"{cell.ratio(r):.3f}x" if cell.ratio(r) is not None else "-" for r in ("fuse", "split")]
            print(f"{entry.shape:>12} {entry.mode:>15} {cell.tokens:>7} {cell.times['inductor']:>12.3f} "
                  f"{ratios[0]:>7} {ratios[1]:>7}  {choose(entry, cell.tokens, table.min_gain).rewrite}")


def merge_tables(paths: list[str], out: Path) -> Path:
    """One table with every entry of ``paths`` (each measured alike: ``TuningTableError`` names the
    first field that differs), written to ``out``; e.g. a default-mode and a reduce-overhead run,
    each short enough for one device call."""
    from weavepass.tune.table import TuningTableError, parse_table, read_table

    tables = [read_table(path) for path in paths]
    first = tables[0]
    for table in tables[1:]:
        for name in ("world", "dtype", "layers", "sequences", "time_unit", "min_gain"):
            if getattr(table, name) != getattr(first, name):
                raise TuningTableError(f"cannot merge {table.label} with {first.label}: {name} "
                                       f"{getattr(table, name)!r} != {getattr(first, name)!r}")
        for where, name in (("machine", "device_type"), ("machine", "device_name"), ("versions", "torch")):
            if getattr(table, where).get(name) != getattr(first, where).get(name):
                raise TuningTableError(f"cannot merge {table.label} with {first.label}: {where} {name} "
                                       f"{getattr(table, where).get(name)!r} != {getattr(first, where).get(name)!r}")
    data = first.to_json()
    data["entries"] = [entry for table in tables for entry in table.to_json()["entries"]]
    data["source"] = " + ".join(dict.fromkeys(table.source for table in tables))
    return parse_table(data, str(out)).save(out)  # parse: two entries for one layer and mode are refused


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.merge:
        print_table(merge_tables(args.merge, args.out))
        return
    plan = plan_lines(args)
    if args.dry_run:
        print("\n".join(["weavepass.tune --dry-run (nothing measured):", *plan]))
        return
    from weavepass.env import disable_multicast

    disable_multicast(override=True)  # before NCCL starts, in this process and the ranks
    config = {"device": args.device, "dtype": args.dtype, "layers": args.layers, "sequences": args.sequences,
              "tokens": args.tokens, "modes": args.modes, "shapes": args.shapes, "warmup": args.warmup,
              "iters": args.iters, "rounds": args.rounds, "min_gain": args.min_gain,
              "time_budget_s": args.time_budget_s, "out": args.out, "source": args.source, "argv": argv,
              "plan": plan}
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:  # under torchrun: the ranks are ours
        _under_torchrun(args, config)
    else:
        import torch

        from weavepass.testing import spawn

        if args.device == "cuda" and torch.cuda.device_count() < args.world:
            raise SystemExit(f"--world {args.world} needs {args.world} GPUs, found {torch.cuda.device_count()} "
                             "(--device cpu checks the command on CPU processes)")
        spawn(measure_rank, args.world, "nccl" if args.device == "cuda" else "gloo", config, timeout_s=6 * 3600.0)
    if "RANK" not in os.environ or os.environ["RANK"] == "0":
        print_table(args.out)


def _under_torchrun(args: argparse.Namespace, config: dict) -> None:
    import torch
    import torch.distributed as dist

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if world != args.world:
        raise SystemExit(f"--world {args.world} but torchrun started {world} ranks")
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    try:
        measure_rank(rank, world, config)
    finally:
        dist.destroy_process_group()
