"""Cross-rank plan agreement: every rank of a group must run the same collectives in the same order.

The plan is rank-independent by construction (``weavepass/compile/planner.py``), but the graphs it is
made from need not be: a graph break on one rank only (``if dist.get_rank() == 0: print(...)`` in
forward) gives that rank different graphs, so its sites are cut differently, and it runs plain
all_reduces where its peers run weave ops. Plain Inductor survives that (an all_reduce is an
all_reduce on both sides); the rewritten graphs would wait on each other until the group timeout.

So, at compile time, after the rewrite and before the graph can run, each rank publishes the
collectives the graph will run on each group (op, group, shapes, dtypes, lowering: one line each)
in the default group's store, and compares them with its peers' lines.

Positions, not graph counts, are compared: every rank keeps, per group, a running offset into the
stream of collective lines it has compiled, and a graph's lines are published at the offset it
starts at. A harmless rank-dependent graph break (one that cuts no site) splits the same stream
into more graphs on one rank, and the lines still agree where they overlap. A rank waits for a
peer only when the peer has published nothing that overlaps its graph's first line; a peer that
then fails to publish within ``WeaveConfig.plan_check_timeout_s`` either compiled a different
number of graphs (a graph break, a recompile, a cache hit on one rank only) or is slow; both are
reported. A peer's first lines on a group are awaited for as long as the group's own timeout (what
its first collective would wait): ranks reach their first compile as far apart as their start-up
(loading weights, earlier compiles) leaves them, and a healthy job must not fail there. Cost: one store ``set`` and one ``get`` per peer, once per compiled graph with
collectives.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from weavepass.compile.planner import group_size

COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d_functional", "weave", "symm_mem")
"""Ops whose calls can talk to other ranks: the functional collectives, weave's own ops (fused,
FlashComm) and the symmetric-memory fused matmuls."""

LABELS = {"weave.check_replicated": ("site",)}
"""Arguments (by schema name) that only name things in an op's error message: left out of its
line. ``check_replicated``'s ``site`` is the site's node name, which differs between ranks whose
graphs are cut differently by a harmless rank-dependent break, as the collectives do not."""

LIKELY_CAUSE = (
    "Likely cause: control flow that depends on the rank (e.g. `if dist.get_rank() == 0: print(...)`) "
    "or another graph break in forward on some ranks only, so the ranks compiled different graphs. "
    "Make forward identical on every rank (log outside the compiled region, or under "
    "torch.compiler.is_compiling()), or set WeaveConfig(check_plan_across_ranks=False) to skip this check"
)


class PlanMismatchError(RuntimeError):
    """The ranks of a group compiled graphs that would run different collectives."""


@dataclass
class _PeerStream:
    """What this rank has read of one peer's published lines for one group."""

    lines: list[list[str]] = field(default_factory=list)  # [node name, line, graph index]

    @property
    def end(self) -> int:
        return len(self.lines)


def collective_lines(graph: torch.fx.Graph) -> dict[str, list[tuple[str, str]]]:
    """``{group name: [(node name, line), ...]}``: in graph order, every call that names a
    process group, with a line that says what it runs (op, tensor dtypes and shapes, scalars)."""
    by_group: dict[str, list[tuple[str, str]]] = {}
    for node in graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        if target.namespace not in COLLECTIVE_NAMESPACES:
            continue
        op = f"{target.namespace}.{target._opname}"
        labels = [i for i, a in enumerate(target._schema.arguments) if a.name in LABELS.get(op, ())]
        args = [a for i, a in enumerate(node.args) if i not in labels]
        args += [v for k, v in sorted(node.kwargs.items()) if k not in LABELS.get(op, ())]
        groups = [a for a in args if isinstance(a, str) and group_size(a) is not None]
        if not groups:  # weave.join_async and the like: no communication
            continue
        line = f"{op}({', '.join(_describe(a) for a in args)})"
        by_group.setdefault(groups[0], []).append((node.name, line))
    return by_group


def _describe(arg) -> str:
    if isinstance(arg, torch.fx.Node):
        val = arg.meta.get("val")
        if isinstance(val, torch.Tensor):
            return f"{str(val.dtype).removeprefix('torch.')}{list(val.shape)}"
        if isinstance(val, (list, tuple)):
            return "[" + ", ".join(f"{str(v.dtype).removeprefix('torch.')}{list(v.shape)}"
                                   for v in val if isinstance(v, torch.Tensor)) + "]"
        return arg.name if val is None else str(val)
    if isinstance(arg, (list, tuple)):
        return "[" + ", ".join(_describe(a) for a in arg) + "]"
    return repr(arg)


def check_plan_across_ranks(graph: torch.fx.Graph, graph_index: int, timeout_s: float) -> None:
    """Publish this graph's collective lines per group and compare them with every peer's.

    Raises ``PlanMismatchError`` naming the ranks, the position, both ranks' lines and the likely
    cause when they differ, or when a peer publishes nothing for ``timeout_s``. Groups of one
    rank and fake process groups (no peers, no working store) are skipped.
    """
    from torch.distributed.distributed_c10d import _get_default_store, _resolve_process_group

    from weavepass.runtime.portable import group_timeout_s

    for group_name, lines in collective_lines(graph).items():
        group = _resolve_process_group(group_name)
        if group.size() < 2 or dist.get_backend(group) == "fake":
            continue
        _EXCHANGE.check(_get_default_store(), group_name, dist.get_rank(),
                        dist.get_process_group_ranks(group), lines, graph_index, timeout_s,
                        first_timeout_s=max(timeout_s, group_timeout_s(group_name)))


class PlanExchange:
    """One process's side of the check: where it stands in each group's stream of collective
    lines, and what it has read of its peers' streams. A process has one (``check_plan_across_ranks``);
    tests make one per simulated rank over a shared store."""

    def __init__(self):
        self.offsets: dict[str, int] = {}
        """group name -> lines this process has published for it (its position in the stream)."""
        self.peers: dict[tuple[str, int], _PeerStream] = {}
        """(group name, peer rank) -> the peer's lines read so far."""

    def check(self, store, group_name: str, me: int, ranks: list[int], lines: list[tuple[str, str]],
              graph_index: int, timeout_s: float, first_timeout_s: float | None = None) -> None:
        """Publish ``lines`` (one graph's, on ``group_name``) as global rank ``me`` in ``store``
        and compare them with every other rank of ``ranks``.

        ``first_timeout_s`` (default ``timeout_s``) bounds the wait for a peer's *first* lines on
        the group: start-up skew (a peer still loading its weights or compiling its first graph)
        is healthy for as long as the group's own collectives would wait, so
        ``check_plan_across_ranks`` passes the group's timeout. Later lines come from ranks that
        have met in the group's collectives since, and ``timeout_s`` bounds them."""
        start = self.offsets.get(group_name, 0)
        self.offsets[group_name] = start + len(lines)
        mine = [[name, line, graph_index] for name, line in lines]
        store.set(_key(group_name, me, start), json.dumps(mine))
        for peer in ranks:
            if peer != me:
                self._compare_with_peer(store, group_name, me, peer, start, mine, timeout_s,
                                        timeout_s if first_timeout_s is None else first_timeout_s)

    def _compare_with_peer(self, store, group_name, me, peer, start, mine, timeout_s, first_timeout_s) -> None:
        stream = self.peers.setdefault((group_name, peer), _PeerStream())
        # Read the peer's chunks up to our first line. Waiting further could deadlock: a peer that
        # compiled the same lines as several graphs publishes its next one only after running this
        # one's collectives with us; it checks those lines against ours when it compiles them.
        while stream.end <= start:
            key = _key(group_name, peer, stream.end)
            limit = first_timeout_s if stream.end == 0 else timeout_s
            try:
                store.wait([key], timedelta(seconds=limit))
            except RuntimeError:  # DistStoreError on timeout
                raise PlanMismatchError(
                    f"weavepass: rank {peer} published no plan for collective #{stream.end} on group "
                    f"{group_name!r} within {limit:g} s, while rank {me} compiled graph "
                    f"{mine[0][2]}, which runs {len(mine)} collective(s) from #{start} on: "
                    f"first {mine[0][0]}: {mine[0][1]}. Rank {peer} compiled fewer graphs with "
                    f"collectives (a graph break or recompile on some ranks only, or a graph that "
                    f"one rank loaded from a cache) or is slow to reach this compile (then raise "
                    f"WeaveConfig.plan_check_timeout_s). {LIKELY_CAUSE}"
                ) from None
            stream.lines.extend(json.loads(store.get(key)))
        theirs = stream.lines[start:start + len(mine)]
        for i, (a, b) in enumerate(zip(mine, theirs)):
            if a[1] != b[1]:
                raise PlanMismatchError(
                    f"weavepass: ranks {me} and {peer} would run different collectives on group "
                    f"{group_name!r} at collective #{start + i}: rank {me} (graph {a[2]}, node "
                    f"{a[0]}) runs {a[1]}; rank {peer} (graph {b[2]}, node {b[0]}) runs {b[1]}. "
                    f"Running on would hang until the group timeout. {LIKELY_CAUSE}"
                )


def _key(group_name: str, rank: int, offset: int) -> str:
    return f"weavepass/plan/{group_name}/{rank}/{offset}"


_EXCHANGE = PlanExchange()
