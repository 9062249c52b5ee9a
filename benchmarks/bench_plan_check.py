"""Compile-time cost of the cross-rank plan check on a 32-layer graph (docs/reliability.md).

A 32-layer row-parallel stream (64 all_reduce -> add -> RMSNorm sites, 128 tokens, hidden 256) is
traced with fake tensors on a fake world of 2 and rewritten by ``WeavePass`` (fuse-only and the
token split). Then, per rewritten graph, it times (median of ``--repeats``):

    lines_ms    ``collective_lines``: describing the graph's collectives (one line each)
    new_ms      ``PlanExchange.check`` of a graph no rank has checked yet, 2 ranks (one thread each,
                a store client each) over a real ``TCPStore`` on 127.0.0.1: epoch read, publish,
                wait for and read the peer's lines, mark them read, delete them
    known_ms    the same graph checked again (a recompile on one rank): the digest is known

Nothing runs per step. Output: a table on stdout and ``<out>/bench_plan_check.csv``.
Run: ``python3 benchmarks/bench_plan_check.py`` (CPU only).
"""

from __future__ import annotations

import argparse
import csv
import statistics
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.fx.experimental.proxy_tensor import make_fx

from weavepass import WeaveConfig
from weavepass.compile.graph_pass import WeavePass
from weavepass.compile.plan_check import PlanExchange, collective_lines
from weavepass.testing.distributed import fake_process_group, free_port

LAYERS, TOKENS, HIDDEN = 32, 128, 256


def _rms(h, g):
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * g


def stream(x, r, *weights):
    """``LAYERS`` layers of two row-parallel sites each (attention out, MLP down)."""
    h = r
    for i in range(LAYERS):
        wo, g1, wd, g2 = weights[4 * i:4 * i + 4]
        h = funcol.all_reduce(_rms(h, g2) @ wo, "sum", dist.group.WORLD) + h
        h = funcol.all_reduce(torch.relu(_rms(h, g1) @ wd), "sum", dist.group.WORLD) + h
    return _rms(h, weights[-1]), h


def describe_rewritten_graph(config: WeaveConfig, repeats: int) -> tuple[list, list[float]]:
    """The rewritten graph's collective lines, and the times (ms) ``collective_lines`` took."""
    weights = []
    for _ in range(LAYERS):
        weights += [torch.randn(HIDDEN, HIDDEN), torch.rand(HIDDEN), torch.randn(HIDDEN, HIDDEN), torch.rand(HIDDEN)]
    with fake_process_group(2):
        graph = make_fx(stream, tracing_mode="fake")(torch.randn(TOKENS, HIDDEN), torch.randn(TOKENS, HIDDEN),
                                                     *weights, torch.rand(HIDDEN)).graph
        WeavePass(config)(graph)  # its own check skips the fake group
        described = []
        for _ in range(repeats):
            began = time.perf_counter()
            by_group = collective_lines(graph)
            described.append((time.perf_counter() - began) * 1e3)
    (lines,) = by_group.values()
    return lines, described


def time_exchange(lines, repeats: int) -> tuple[list[float], list[float]]:
    """Per repeat, rank 0's time for a new graph's check and for the same graph again."""
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, 2, True, wait_for_workers=False)
    stores = [master, dist.TCPStore("127.0.0.1", port, 2, False)]
    new, known = [], []
    for repeat in range(repeats):
        group = f"bench{repeat}"  # a fresh group: nothing checked yet
        exchanges = [PlanExchange(poll_s=0.0005), PlanExchange(poll_s=0.0005)]
        barrier = threading.Barrier(2)
        seconds = [0.0, 0.0]

        def rank(r: int) -> None:
            barrier.wait()
            began = time.perf_counter()
            exchanges[r].check(stores[r], group, r, [0, 1], lines, 0, 10.0)
            seconds[r] = time.perf_counter() - began

        threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        new.append(max(seconds) * 1e3)
        began = time.perf_counter()
        exchanges[0].check(stores[0], group, 0, [0, 1], lines, 1, 10.0)
        known.append((time.perf_counter() - began) * 1e3)
    return new, known


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    rows = []
    for name, config in [("fuse-only", WeaveConfig(lowering="portable")),
                         ("split", WeaveConfig(lowering="portable", split="force"))]:
        lines, described = describe_rewritten_graph(config, args.repeats)
        new, known = time_exchange(lines, args.repeats)
        rows.append({"graph": name, "collectives": len(lines), "lines_ms": statistics.median(described),
                     "new_ms": statistics.median(new), "known_ms": statistics.median(known)})
    print(f"{'graph':10} {'collectives':>11} {'lines_ms':>9} {'new_ms':>8} {'known_ms':>9}")
    for row in rows:
        print(f"{row['graph']:10} {row['collectives']:>11} {row['lines_ms']:>9.2f} {row['new_ms']:>8.2f} "
              f"{row['known_ms']:>9.3f}")
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "bench_plan_check.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    main()
