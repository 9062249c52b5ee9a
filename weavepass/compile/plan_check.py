"""Cross-rank plan agreement: ranks of a group must not run different collectives at the same point.

The plan is rank-independent by construction (``weavepass/compile/planner.py``), but the graphs it is
made from need not be: a graph break on one rank only (``if dist.get_rank() == 0: print(...)`` in
forward) gives that rank different graphs, so its sites are cut differently, and it runs plain
all_reduces where its peers run weave ops. Plain Inductor survives that (an all_reduce is an
all_reduce on both sides); the rewritten graphs would wait on each other until the group timeout.

So, at compile time, after the rewrite and before the graph can run, each rank describes the
collectives the graph will run on each group (op, group, shapes, dtypes, lowering: one line each)
and checks them against its peers, through the default group's store (docs/reliability.md):

1. **A graph whose lines this rank has already checked passes at once** (its digest is known): a
   recompile on one rank only (a stride, ``requires_grad`` or other rank-local guard, the recompile
   limit) runs the same collectives as the graph it replaces, and publishes nothing.
2. **Otherwise its lines are compared by position in the group's stream of new collective lines**:
   each rank publishes them at its running offset (lines of graphs that passed step 1 take no place
   in it), and compares them with its peers' lines at the same positions. A harmless rank-dependent
   break (the same collectives, cut into more graphs on one rank) passes: the lines agree where they
   overlap. A rank waits only for a peer that has published nothing overlapping its graph's first line.
3. **A failure leaves the exchange clean**: the failing rank moves the group to a new *epoch* (a
   counter in the store), drops its positions and deletes its keys; every rank reads the epoch
   before publishing, so the next compile on every rank starts afresh at position 0.
4. **A peer that is gone is named within seconds**: each process that checks keeps a heartbeat (a
   store counter, bumped every ``HEARTBEAT_S`` by a daemon thread on its own store connection); a
   wait sees a heartbeat that stopped for ``GONE_AFTER_S``, or a store that no longer answers (its
   host, rank 0, is gone), and says so. No wait is longer than the group's own timeout.
5. **Keys are removed once every peer has read them** (a read counter per key), so a server that
   recompiles keeps a bounded number of keys: one heartbeat, one epoch and one failure note per
   rank and group, plus the lines of graphs a peer has not reached yet.

Cost: nothing for a graph already checked; for a new graph a few store round trips (epoch, one
``set``, one ``get`` and one ``add`` per peer); nothing per step.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

from weavepass.compile.planner import group_size
from weavepass.config import Lowering

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store
    from torch.distributed.distributed_c10d import GroupName

Line = list[Any]
"""A peer's line as it travels through the store (JSON): ``[node name, line, graph index]``."""

callback_handler: Any
try:  # imported here, not in the first check: importing Dynamo takes seconds, which a peer would wait
    from torch._dynamo.callback import callback_handler
except ImportError:
    callback_handler = None

COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d_functional", "weave", "symm_mem")
"""Ops whose calls can talk to other ranks: the functional collectives, weave's own ops (fused,
FlashComm) and the symmetric-memory fused matmuls."""

LABELS = {"weave.check_replicated": ("site",)}
"""Arguments (by schema name) that only name things in an op's error message: left out of its
line. ``check_replicated``'s ``site`` is the site's node name, which differs between ranks whose
graphs are cut differently by a harmless rank-dependent break, as the collectives do not."""

WORKSPACE_LOWERINGS: tuple[Lowering, ...] = (Lowering.CUDA_SYMM,)
"""Lowerings that read a weave op's ``workspace_tokens``: the symmetric workspace is allocated with
that capacity on every rank, so it must agree. The other lowerings ignore the argument, and it is
left out of their lines: a per-rank ``cuda_workspace_tokens`` is harmless there."""

HEARTBEAT_S = 0.5
"""How often a checking process bumps its heartbeat counter in the store."""

GONE_AFTER_S = 5.0
"""A peer whose heartbeat has not moved for this long is reported gone (exited, killed, frozen).
Ten beats: a busy process (compiling, in a collective) still beats, as the thread needs only the GIL
for a moment."""

POLL_S = 0.05
"""How often a wait looks at the store (the awaited key, the epoch, the peers' heartbeats)."""

LIKELY_CAUSE = (
    "Likely cause: control flow that depends on the rank (e.g. `if dist.get_rank() == 0: print(...)`) "
    "or another graph break in forward on some ranks only, so the ranks compiled different graphs. "
    "Make forward identical on every rank (log outside the compiled region, or under "
    "torch.compiler.is_compiling()), or set WeaveConfig(check_plan_across_ranks=False) to skip this check"
)


class PlanMismatchError(RuntimeError):
    """The ranks of a group compiled graphs that would run different collectives."""


class PeerGoneError(PlanMismatchError):
    """A peer of the group stopped (its heartbeat stopped, or the store's host is unreachable)
    while this rank waited for its plan."""


def collective_lines(graph: torch.fx.Graph) -> dict[str, list[tuple[str, str]]]:
    """``{group name: [(node name, line), ...]}``: in graph order, every call that names a
    process group, with a line that says what it runs (op, tensor dtypes and shapes, scalars)."""
    by_group: dict[str, list[tuple[str, str]]] = {}
    is_group: dict[str, bool] = {}  # resolving a group name costs a C++ call: once per name
    for node in graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        if target.namespace not in COLLECTIVE_NAMESPACES:
            continue
        op = f"{target.namespace}.{target._opname}"
        names = _argument_names(target)
        named = dict(zip(names, node.args))
        named.update(node.kwargs)
        left_out = set(LABELS.get(op, ()))
        if "workspace_tokens" in named and named.get("lowering") not in WORKSPACE_LOWERINGS:
            left_out.add("workspace_tokens")
        args = [a for name, a in zip(names, node.args) if name not in left_out]
        args += [v for k, v in sorted(node.kwargs.items()) if k not in left_out]
        groups = []
        for a in args:
            if isinstance(a, str):
                if a not in is_group:
                    is_group[a] = group_size(a) is not None
                if is_group[a]:
                    groups.append(a)
        if not groups:  # weave.join_async and the like: no communication
            continue
        line = f"{op}({', '.join(_describe(a) for a in args)})"
        by_group.setdefault(groups[0], []).append((node.name, line))
    return by_group


_ARGUMENT_NAMES: dict[torch._ops.OpOverload, tuple[str, ...]] = {}


def _argument_names(op: torch._ops.OpOverload) -> tuple[str, ...]:
    """The op's argument names in schema order (``op._schema`` builds new objects on every access)."""
    names = _ARGUMENT_NAMES.get(op)
    if names is None:
        names = _ARGUMENT_NAMES[op] = tuple(a.name for a in op._schema.arguments)
    return names


def _describe(arg: object) -> str:
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


def digest(lines: list[tuple[str, str]]) -> str:
    """What a graph runs on one group, as a short hash of its lines (node names left out)."""
    return hashlib.sha1("\n".join(line for _, line in lines).encode()).hexdigest()[:16]


def check_plan_across_ranks(graph: torch.fx.Graph, graph_index: int, timeout_s: float) -> None:
    """Check this graph's collective lines per group against every peer's (``PlanExchange.check``).

    Raises ``PlanMismatchError`` naming the ranks, the position, both ranks' lines and the likely
    cause when they differ, or when a peer publishes nothing for ``min(timeout_s, the group's
    timeout)`` (a peer's first graph on the group: the group's timeout); ``PeerGoneError`` when a
    peer stopped. Groups of one rank and fake process groups (no peers, no working store) are skipped.
    """
    from torch._C._distributed_c10d import _resolve_process_group
    from torch.distributed.distributed_c10d import _get_default_store

    from weavepass.runtime.portable import group_timeout_s

    for group_name, lines in collective_lines(graph).items():
        group = _resolve_process_group(cast("GroupName", group_name))
        if group.size() < 2 or dist.get_backend(group) == "fake":
            continue
        store = _get_default_store()
        me = dist.get_rank()
        start_heartbeat(store, me)
        group_s = group_timeout_s(group_name)
        _EXCHANGE.check(store, group_name, me, dist.get_process_group_ranks(group), lines, graph_index,
                        min(timeout_s, group_s), first_timeout_s=group_s)


@dataclass
class _PeerStream:
    """What this rank has read of one peer's new lines on one group in the current epoch:
    ``lines[i]`` is the peer's line at position ``base + i``, as ``[node name, line, graph index]``."""

    base: int = 0
    lines: list[Line] = field(default_factory=list)
    last_graph: list[Line] = field(default_factory=list)  # the peer's latest chunk, for messages

    @property
    def end(self) -> int:
        return self.base + len(self.lines)

    def forget_before(self, position: int) -> None:
        """Drop lines before ``position``: this rank's later graphs start at or after it."""
        drop = min(max(0, position - self.base), len(self.lines))
        del self.lines[:drop]
        self.base += drop


@dataclass
class _GroupState:
    """One rank's side of one group's exchange."""

    epoch: int = 0
    offset: int = 0
    """New lines this rank has published in the epoch: where its next new graph starts."""
    verified: set[str] = field(default_factory=set)
    """Digests of graphs on this group that passed the check: their recompiles pass at once."""
    published: deque[str] = field(default_factory=lambda: deque(maxlen=256))
    """This rank's latest keys in this epoch, which its peers may not all have read yet (deleted
    when the epoch moves; the last reader deletes each one before that)."""
    peers: dict[int, _PeerStream] = field(default_factory=dict)
    """peer rank -> ``_PeerStream``."""


class PlanExchange:
    """One process's side of the check (``check_plan_across_ranks``); tests make one per simulated
    rank over a shared store. ``gone_after_s`` is how long a peer's heartbeat may stand still."""

    def __init__(self, gone_after_s: float = GONE_AFTER_S, poll_s: float = POLL_S):
        self.groups: dict[str, _GroupState] = {}
        self.gone_after_s = gone_after_s
        self.poll_s = poll_s
        self._reset_marker = lambda *args: None
        """A compile-start callback that does nothing: its absence says that Dynamo was reset."""
        self.stores: dict[str, tuple[Store, int, list[int]]] = {}
        """group name -> (store, this rank, ranks): where to look for a peer's failure note when a
        compiled graph's collective fails at run time (``explain_run_failure``)."""

    def check(self, store: Store, group_name: str, me: int, ranks: list[int], lines: list[tuple[str, str]],
              graph_index: int, timeout_s: float, first_timeout_s: float | None = None) -> None:
        """Check ``lines`` (one graph's, on ``group_name``) as global rank ``me`` against every
        other rank of ``ranks``, through ``store``.

        ``timeout_s`` bounds the wait for a peer's lines once the peer has published some in this
        epoch; ``first_timeout_s`` (default ``timeout_s``) bounds the wait for its first: start-up
        skew (a peer still loading its weights) is healthy for as long as the group's own
        collectives would wait, so ``check_plan_across_ranks`` passes the group's timeout."""
        self._forget_checked_graphs_after_dynamo_reset()
        state = self.groups.setdefault(group_name, _GroupState())
        self.stores[group_name] = (store, me, ranks)
        key = digest(lines)
        if key in state.verified:
            return  # a recompile of a graph already checked: the same collectives
        try:
            self._follow_epoch(store, group_name, state)
            start = state.offset
            mine = [[name, line, graph_index] for name, line in lines]
            chunk = _key(group_name, state.epoch, me, start)
            store.set(chunk, json.dumps(mine))
            state.published.append(chunk)
            for peer in ranks:
                if peer != me:
                    self._compare_with_peer(store, group_name, state, me, peer, ranks, start, mine, timeout_s,
                                            timeout_s if first_timeout_s is None else first_timeout_s)
        except PlanMismatchError as error:
            state_note = self._fail(store, group_name, state, me, str(error))
            raise type(error)(f"{error} {state_note}") from None
        state.offset = start + len(mine)
        state.verified.add(key)
        for stream in state.peers.values():
            stream.forget_before(state.offset)
        _delete(store, _failed_key(group_name, me))  # this rank is past any earlier failure

    def _forget_checked_graphs_after_dynamo_reset(self) -> None:
        """``torch._dynamo.reset()`` starts compiling afresh, as a new process would: graphs compiled
        after it are checked again, not passed as recompiles of graphs checked before it. Seen
        through a compile-start callback of this exchange's, which the reset clears."""
        if callback_handler is None:  # a torch without compile callbacks: no reset is seen
            return
        if self._reset_marker not in callback_handler.start_callbacks:
            for state in self.groups.values():
                state.verified.clear()
            callback_handler.register_start_callback(self._reset_marker)

    def _follow_epoch(self, store: Store, group_name: str, state: _GroupState) -> None:
        """Start afresh (position 0, nothing read, own keys deleted) when some rank's failed check
        moved the group to a new epoch since this rank's last check."""
        epoch = int(store.add(_epoch_key(group_name), 0))
        if epoch != state.epoch:
            self._clear(store, state)
            state.epoch = epoch

    def _clear(self, store: Store, state: _GroupState) -> None:
        for chunk in state.published:
            _delete(store, chunk)
            _delete(store, chunk + "/read")
        state.published.clear()
        state.peers.clear()
        state.offset = 0

    def _fail(self, store: Store, group_name: str, state: _GroupState, me: int, message: str) -> str:
        """Leave the exchange clean after a failed check: a note peers can read, the group moved to
        the next epoch (once, whichever rank fails first), this rank's keys deleted. Returns what
        the error adds about the job's state."""
        failed_epoch = state.epoch
        try:
            store.set(_failed_key(group_name, me), json.dumps([failed_epoch, message]))
            store.compare_set(_epoch_key(group_name), str(failed_epoch), str(failed_epoch + 1))
            self._clear(store, state)
            state.epoch = int(store.add(_epoch_key(group_name), 0))
        except Exception:  # noqa: BLE001  (the store's host is gone: nothing left to clean)
            return "The store is unreachable: restart every rank."
        return (f"The plan check of group {group_name!r} is reset (epoch {state.epoch}): the graph was "
                "not run, and the next compile on every rank is checked afresh, so a job whose ranks "
                "all raised may fix the cause and compile again (no restart needed). A rank that did "
                "not raise runs on and waits in its collectives until the group's timeout.")

    def _compare_with_peer(self, store: Store, group_name: str, state: _GroupState, me: int, peer: int,
                           ranks: list[int], start: int, mine: list[Line], timeout_s: float,
                           first_timeout_s: float) -> None:
        stream = state.peers.setdefault(peer, _PeerStream())
        # Read the peer's chunks up to our first line. Waiting further could deadlock: a peer that
        # compiled the same lines as several graphs publishes its next one only after running this
        # one's collectives with us; it checks those lines against ours when it compiles them.
        while stream.end <= start:
            key = _key(group_name, state.epoch, peer, stream.end)
            limit = first_timeout_s if stream.end == 0 else timeout_s
            self._wait(store, group_name, state, me, peer, key, limit, start, mine, stream)
            raw = _get_if_present(store, key)
            if not raw:  # it was there at the wait and gone at the read: the peer's check failed and
                # cleared its plan (``_fail``); a TCPStore then answers the read with an empty value
                raise PlanMismatchError(
                    f"weavepass: rank {peer}'s plan check failed while rank {me} read its plan on group "
                    f"{group_name!r}: {_failure_note(store, group_name, peer)}")
            chunk = json.loads(raw)
            if int(store.add(key + "/read", 1)) >= len(ranks) - 1:  # every peer has read it
                _delete(store, key)
                _delete(store, key + "/read")
            stream.lines.extend(chunk)
            stream.last_graph = chunk
        theirs = stream.lines[start - stream.base:start - stream.base + len(mine)]
        for i, (a, b) in enumerate(zip(mine, theirs)):
            if a[1] != b[1]:
                raise PlanMismatchError(
                    f"weavepass: ranks {me} and {peer} would run different collectives on group "
                    f"{group_name!r} at collective #{start + i}: rank {me} (graph {a[2]}, node "
                    f"{a[0]}) runs {a[1]}; rank {peer} (graph {b[2]}, node {b[0]}) runs {b[1]}. "
                    f"Running on would hang until the group timeout. {LIKELY_CAUSE}"
                )

    def _wait(self, store: Store, group_name: str, state: _GroupState, me: int, peer: int, key: str,
              limit: float, start: int, mine: list[Line], stream: _PeerStream) -> None:
        """Wait up to ``limit`` s for ``key`` (the peer's next chunk), polling, so that a peer that
        is gone or a failure elsewhere is seen within seconds instead of at the limit."""
        heartbeat = _heartbeat_key(peer)
        began = time.monotonic()
        beat, beat_seen_at = None, began
        where = (f"while rank {me} compiled graph {mine[0][2]}, which runs {len(mine)} new collective(s) "
                 f"on group {group_name!r} from #{start} on (first {mine[0][0]}: {mine[0][1]})")
        while True:
            try:
                if store.check([key]):
                    return
                epoch = int(store.add(_epoch_key(group_name), 0))
                now = time.monotonic()
                value = _get_if_present(store, heartbeat)
                if value:
                    if value != beat:
                        beat, beat_seen_at = value, now
            except PlanMismatchError:
                raise
            except Exception as error:  # noqa: BLE001  (the store's connection is lost)
                raise PeerGoneError(
                    f"weavepass: the store (hosted by rank 0 of the default group) stopped answering "
                    f"({type(error).__name__}: {error}) {where}: rank 0 is gone. The job cannot go on: "
                    f"restart every rank.") from None
            if epoch != state.epoch:
                raise PlanMismatchError(
                    f"weavepass: rank {peer}'s or another rank's plan check failed {where}: "
                    f"{_failure_note(store, group_name, peer)}")
            if beat is not None and now - beat_seen_at > self.gone_after_s:
                raise PeerGoneError(
                    f"weavepass: rank {peer} is gone: its heartbeat stopped {now - beat_seen_at:.1f} s ago "
                    f"(the process exited, was killed or is frozen) {where}. The job cannot go on: "
                    f"restart every rank.")
            if now - began > limit:
                raise PlanMismatchError(self._silent_peer_message(peer, limit, where, stream, beat is not None))
            time.sleep(self.poll_s)

    @staticmethod
    def _silent_peer_message(peer: int, limit: float, where: str, stream: _PeerStream, alive: bool) -> str:
        if stream.last_graph:
            last = stream.last_graph
            theirs = (f"Rank {peer}'s last new graph (graph {last[0][2]}) runs {len(last)} collective(s), "
                      f"first {last[0][0]}: {last[0][1]}.")
        else:
            theirs = f"Rank {peer} has published no graph on this group yet."
        life = ("Its heartbeat is alive: it compiled no graph with these collectives (a recompile with "
                "other collectives, or a graph break, on some ranks only), or it waits in a collective, "
                "or it is slow to reach this compile (then raise WeaveConfig.plan_check_timeout_s)."
                if alive else
                "It has no heartbeat: it has not reached a weave compile yet (still starting) or it "
                "stopped before it did; either way it did not reach this point within the group's timeout.")
        return (f"weavepass: rank {peer} published no plan for this point within {limit:g} s, {where}. "
                f"{theirs} {life} {LIKELY_CAUSE}")

    def explain_run_failure(self) -> str | None:
        """When a compiled graph's collective failed at run time: the failure note a peer left in
        the store in this epoch or the last (its plan check stopped it: the cause of the
        failure), or None."""
        for group_name, (store, me, ranks) in self.stores.items():
            for peer in ranks:
                if peer == me:
                    continue
                try:
                    if store.check([_failed_key(group_name, peer)]):
                        epoch, message = json.loads(store.get(_failed_key(group_name, peer)))
                        return (f"weavepass: rank {peer} stopped before this collective, as its plan check "
                                f"failed (epoch {epoch}): {message}")
                except Exception:  # noqa: BLE001  (the store's host is gone too)
                    return None
        return None


def _failure_note(store: Store, group_name: str, peer: int) -> str:
    try:
        if store.check([_failed_key(group_name, peer)]):
            return str(json.loads(store.get(_failed_key(group_name, peer)))[1])
    except Exception:  # noqa: BLE001
        pass
    return "another rank's check failed first (see its error)."


_ABSENT = "\x00weavepass: no such key"


def _get_if_present(store: Store, key: str) -> bytes:
    """``key``'s value, or ``b""`` when it is not there, without waiting: ``Store.get`` waits for a
    missing key up to the store's timeout (300 s by default), and a key seen a moment ago may be gone
    by the read (a peer's failed check deletes its chunks, ``_fail``). ``compare_set`` with an expected
    value no key holds returns the current value when the key exists, and that expected value,
    creating nothing, when it does not."""
    value = store.compare_set(key, _ABSENT, _ABSENT)
    return b"" if value == _ABSENT.encode() else value


def _delete(store: Store, key: str) -> None:
    try:
        store.delete_key(key)
    except Exception:  # noqa: BLE001  (a store without delete, or its host gone)
        pass


def _key(group_name: str, epoch: int, rank: int, offset: int) -> str:
    return f"weavepass/plan/{group_name}/{epoch}/{rank}/{offset}"


def _epoch_key(group_name: str) -> str:
    return f"weavepass/plan/{group_name}/epoch"


def _failed_key(group_name: str, rank: int) -> str:
    return f"weavepass/plan/{group_name}/failed/{rank}"


def _heartbeat_key(rank: int) -> str:
    return f"weavepass/alive/{rank}"


class _Heartbeat:
    """A daemon thread that bumps ``weavepass/alive/<rank>`` every ``HEARTBEAT_S`` on a store
    connection of its own (``store.clone()``, where the store has it), until the default group is
    destroyed or the store stops answering."""

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()

    def start(self, store: Store, rank: int) -> None:
        with self.lock:
            if self.thread is not None and self.thread.is_alive():
                return
            clone = getattr(store, "clone", None)  # (not in every store, nor in torch's stubs)
            try:
                own = clone() if clone is not None else store
            except Exception:  # noqa: BLE001  (an older store: share the connection)
                own = store
            own.add(_heartbeat_key(rank), 1)  # visible before the first wait of any peer
            self.thread = threading.Thread(target=self._beat, args=(own, rank), name="weavepass-heartbeat",
                                           daemon=True)
            self.thread.start()

    @staticmethod
    def _beat(store: Store, rank: int) -> None:
        while dist.is_initialized():
            try:
                store.add(_heartbeat_key(rank), 1)
            except Exception:  # noqa: BLE001  (the store's host is gone: nothing to tell)
                return
            time.sleep(HEARTBEAT_S)


_HEARTBEAT = _Heartbeat()


def start_heartbeat(store: Store | None = None, rank: int | None = None) -> None:
    """Start this process's heartbeat (idempotent) where a real group of 2+ ranks exists, so that
    peers waiting in a plan check can tell this process is alive. The backend calls it on its first
    compile, before Inductor runs, and ``check_plan_across_ranks`` before it publishes."""
    if store is None:
        if not dist.is_initialized() or dist.get_world_size() < 2 or dist.get_backend() == "fake":
            return
        from torch.distributed.distributed_c10d import _get_default_store

        store, rank = _get_default_store(), dist.get_rank()
    if rank is None:
        raise ValueError("start_heartbeat: a store needs its rank")
    _HEARTBEAT.start(store, rank)


_EXCHANGE = PlanExchange()
