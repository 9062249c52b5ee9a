"""Output and command line shared by the benchmarks: the CSV, the optional matplotlib figure, and the
arguments every model benchmark (bench_overlap, bench_decode) takes."""

from __future__ import annotations

import argparse
import csv
import os
from pathlib import Path


def write_csv(path: str | Path, rows: list[dict], fields: list[str] | None = None) -> Path:
    """``rows`` as CSV at ``path`` (folder created); columns ``fields``, else every key in first-seen
    order (rows may differ in their keys: a missing one is an empty cell)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = fields or list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    return path


def pyplot():
    """``matplotlib.pyplot`` on the file-only Agg backend, or None (said once) where matplotlib is
    missing: the device machine may lack it, and the CSV alone is still the result."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return None
    return plt


def save_figure(fig, path: str | Path, dpi: int = 110, **savefig) -> Path:
    """Write ``fig`` to ``path`` and say where."""
    fig.savefig(path, dpi=dpi, **savefig)
    print(f"wrote {path}")
    return Path(path)


def world_size(text: str) -> int:
    """``--world`` of the kernel and FlashComm benchmarks: ranks, one GPU each; at least 2 (an
    all-reduce needs peers)."""
    world = int(text)
    if world < 2:
        raise argparse.ArgumentTypeError(f"--world must be at least 2 (an all-reduce needs peers), got {world}")
    return world


def model_world_size(text: str) -> int:
    """``--world`` of the model benchmarks: ranks, one GPU each, at least 1. At 1 the all_reduce
    has no peers: the run measures everything weave's rewrites cost except the communication they
    hide (the split's halved GEMMs, its streams and host work, the fused op's host cost in a
    model), the part of a comparison one GPU can make (``weave_config`` lets weave rewrite a
    group of one rank there)."""
    world = int(text)
    if world < 1:
        raise argparse.ArgumentTypeError(f"--world must be at least 1, got {world}")
    return world


def weave_config(**options):
    """The ``WeaveConfig`` of a model benchmark's weave variant: ``options``, plus
    ``min_world_size=1`` when the run's group has one rank (``model_world_size``)."""
    import torch.distributed as dist

    from weavepass import WeaveConfig

    if dist.is_initialized() and dist.get_world_size() == 1:
        options.setdefault("min_world_size", 1)
    return WeaveConfig(**options)


def world_name(stem: str, world: int) -> str:
    """File name (no suffix) of a benchmark's output at ``world`` ranks: ``stem`` at 2, the world of
    every table measured before the 4- and 8-GPU machines, else ``stem_tpN``, so TP=4 and TP=8
    tables sit beside the 2-GPU ones."""
    return stem if world == 2 else f"{stem}_tp{world}"


def model_bench_parser(doc: str, name: str, quick_help: str, shape_choices, shape_help: str,
                       layers_help: str) -> argparse.ArgumentParser:
    """The options of a model benchmark: --quick, --smoke, --world, --out, --name, --shape, --layers.
    ``--name`` defaults to None: take ``world_name(name, args.world)``."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shape on --world CPU processes (gloo), wall-clock timed: checks the script runs")
    parser.add_argument("--world", type=model_world_size, default=2,
                        help="ranks, one GPU each (default 2; 1: no communication, report.model_world_size)")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench_out"), help="folder for CSV and PNG")
    parser.add_argument("--name", default=None,
                        help=f"file name of the CSV and PNG, without suffix (default {name}, with _tpN when "
                             "--world is not 2)")
    parser.add_argument("--shape", nargs="+", choices=sorted(shape_choices), default=None, help=shape_help)
    parser.add_argument("--layers", type=int, default=None, help=layers_help)
    return parser


def parse_variants(parser: argparse.ArgumentParser, args: argparse.Namespace, known) -> list[str]:
    """``args.variants`` (comma-separated) as a list; a parser error naming any unknown one."""
    variants = args.variants.split(",")
    unknown = set(variants) - set(known)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; known: {', '.join(known)}")
    return variants
