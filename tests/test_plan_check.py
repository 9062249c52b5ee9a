"""Issue 31: the cross-rank plan check never stops a healthy job, recovers after a mismatch, sees a
dead peer within seconds and keeps the store's key count bounded (docs/reliability.md).

The exchange itself is tested with one thread per simulated rank over one in-process store (fast);
three spawned gloo worlds of 2 test it as a job meets it: a rank-local recompile, a mismatch and
its recovery, a recompile with other collectives on one rank, 50 recompiles of a server, and a peer
killed before and after its first compile.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import weavepass
from weavepass import WeaveConfig
from weavepass.compile.plan_check import (
    PeerGoneError,
    PlanExchange,
    PlanMismatchError,
    _heartbeat_key,
    check_plan_across_ranks,
)
from weavepass.testing.distributed import check_plans_in_threads, spawn

H = 16


def _line(rows: int) -> list[tuple[str, str]]:
    return [("all_reduce", f"_c10d_functional.all_reduce(float32[{rows}, {H}], 'sum', '0')")]


def test_a_recompile_on_one_rank_passes_and_the_next_graph_still_lines_up():
    """Rank 1 compiles graph A twice (a stride guard failed on rank 1 only), rank 0 once; then both
    compile B. Before: rank 1 waited for rank 0's second graph and failed after the timeout; rank
    1's B then sat one position after rank 0's."""
    a, b = _line(4), _line(8)
    assert check_plans_in_threads([[a, b], [a, a, b]], timeout_s=10.0) == [None, None]
    # It can still fail: a recompile with other collectives on one rank is not a recompile of A.
    errors = check_plans_in_threads([[a], [a, _line(5)]], timeout_s=0.5)
    assert errors[0] is None and "rank 0 published no plan for this point within 0.5 s" in errors[1], errors
    assert "float32[5, 16]" in errors[1] and "float32[4, 16]" in errors[1], errors  # both ranks' plans


def test_a_mismatch_leaves_the_exchange_clean_for_the_next_compile():
    """Rank 0 compiles a split graph (two collectives), rank 1 a fuse-only one (one): both raise.
    Then both compile the same graph: it passes. Before, the failed compile had moved the ranks'
    positions by different amounts and every later compile failed."""
    store, exchanges = dist.HashStore(), [PlanExchange(), PlanExchange()]
    split = [("a", "weave.fused(float32[4, 16])"), ("b", "weave.fused(float32[4, 16])")]
    fused = [("a", "weave.fused(float32[8, 16])")]
    errors = check_plans_in_threads([[split], [fused]], store, exchanges)
    assert all(e and "would run different collectives" in e for e in errors), errors
    assert all("is reset (epoch 1)" in e and "no restart needed" in e for e in errors), errors
    assert check_plans_in_threads([[fused, _line(3)], [fused, _line(3)]], store, exchanges) == [None, None]
    assert [x.groups["0"].offset for x in exchanges] == [2, 2]  # realigned: both at the same position


class _PeerFailsDuringTheRead(dist.HashStore):
    """Rank 1's plan is in the store when rank 0's wait sees it, and gone when rank 0 reads it: rank 1's
    check failed in between (its note written, the epoch moved, its plan deleted). The read must not
    wait for the key (``plan_check._get_if_present``; ``Store.get`` waits up to the store's timeout,
    2026-12-04) nor take an empty value for a plan (CI, 2026-12-03: a JSONDecodeError instead of the
    mismatch)."""

    def compare_set(self, key, expected, desired):
        if key == "weavepass/plan/0/0/1/0" and self.check([key]):
            self.set("weavepass/plan/0/failed/1", '[0, "rank 1 saw other collectives"]')
            self.add("weavepass/plan/0/epoch", 1)
            self.delete_key(key)
        return super().compare_set(key, expected, desired)


def test_a_plan_deleted_between_the_wait_and_the_read_is_the_peers_failure():
    store = _PeerFailsDuringTheRead()
    store.set("weavepass/plan/0/0/1/0", json.dumps([["a", "weave.fused(float32[8, 16])", 0]]))
    with pytest.raises(PlanMismatchError, match="rank 1's plan check failed while rank 0 read its plan.*"
                                                "rank 1 saw other collectives"):
        PlanExchange().check(store, "0", 0, [0, 1], [("a", "weave.fused(float32[4, 16])")], 0, 5.0)


def test_a_rank_that_raised_alone_realigns_through_the_epoch():
    """Rank 0 gives up on a silent rank 1 (timeout) and moves the epoch; rank 1 later compiles the
    retried graph in the new epoch at position 0, as rank 0 does: both pass."""
    store, exchanges = dist.HashStore(), [PlanExchange(), PlanExchange()]
    errors = check_plans_in_threads([[_line(4)], []], store, exchanges, timeout_s=0.3)
    assert "rank 1 published no plan" in errors[0] and errors[1] is None, errors
    assert check_plans_in_threads([[_line(4)], [_line(4)]], store, exchanges) == [None, None]


def test_store_keys_stay_bounded_over_50_recompiles():
    """A server recompiling 50 times (a new batch size each time, a mismatch every tenth time that
    it recovers from): the store keeps a bounded number of keys. Before, every chunk stayed."""
    store, exchanges = dist.HashStore(), [PlanExchange(), PlanExchange()]
    counts = []
    for step in range(50):
        rows = [step + 1, step + 1 if step % 10 else step + 100]
        check_plans_in_threads([[_line(rows[0])], [_line(rows[1])]], store, exchanges)
        counts.append(store.num_keys())
    assert max(counts) <= 6, counts  # epoch + 2 failure notes + at most a chunk and its read count
    assert exchanges[0].groups["0"].epoch == 5  # five mismatches, each recovered from


def test_a_peer_whose_heartbeat_stopped_is_named_within_seconds():
    """Rank 1's heartbeat counter stands still (its process was killed after it beat once): rank
    0's wait names rank 1 as gone after ``gone_after_s``, not at the (long) timeout."""
    store = dist.HashStore()
    store.add(_heartbeat_key(1), 1)
    exchange = PlanExchange(gone_after_s=0.5)
    began = time.monotonic()
    with pytest.raises(PeerGoneError, match="rank 1 is gone: its heartbeat stopped"):
        exchange.check(store, "0", 0, [0, 1], _line(4), 0, timeout_s=60.0)
    assert time.monotonic() - began < 5.0


def test_a_store_that_stops_answering_names_its_host():
    """The store lives on rank 0: when it stops answering while rank 1 waits, rank 0 is gone."""

    class Dying(dist.HashStore):
        def check(self, keys):
            raise RuntimeError("Connection reset by peer")

    with pytest.raises(PeerGoneError, match="rank 0 is gone"):
        PlanExchange().check(Dying(), "0", 1, [0, 1], _line(4), 0, timeout_s=60.0)


# --- as a job meets it: gloo, 2 ranks --------------------------------------------------------------

def rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def two_layers(x, r, w1, w2):
    h = r + funcol.all_reduce(x, "sum", dist.group.WORLD)
    y = rms(h, w1)
    h2 = h + funcol.all_reduce(y * 2, "sum", dist.group.WORLD)
    return rms(h2, w2), h2


def _inputs(rank, rows=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, H, generator=g) + rank  # partial sums differ by rank
    r = torch.randn(rows, H, generator=g)
    return x, r, torch.rand(H, generator=g) + 0.5, torch.rand(H, generator=g) + 0.5


def _run(compiled, args) -> str | None:
    """The error text of one compiled step (None: it ran and matched eager, fp32 throughout)."""
    try:
        with torch.no_grad():
            out = compiled(*args)
    except Exception as error:  # noqa: BLE001  (Dynamo wraps backend errors; the text carries ours)
        return f"{type(error).__name__}: {error}"
    torch.testing.assert_close(out, two_layers(*args), rtol=1e-5, atol=1e-5)
    return None


def _job_rank(rank, world):
    """Issue 31's three probes in one world, in order; the last leaves the ranks out of step."""
    from torch.distributed.distributed_c10d import _get_default_store


    out = {}
    # 1. At step 2 rank 1's activations arrive column-major: Dynamo recompiles on rank 1 only.
    backend = weavepass.make_backend(WeaveConfig(plan_check_timeout_s=3.0))
    compiled = torch.compile(two_layers, backend=backend, dynamic=False)
    steps = []
    for step in range(3):
        x, *rest = _inputs(rank, seed=step)
        if step == 2 and rank == 1:
            x = x.t().contiguous().t()
        steps.append(_run(compiled, (x, *rest)))
    out["recompile"] = (steps, len(backend.report.graphs))

    # 2. A mismatch (rank 0 splits, rank 1 fuses only), then a correct compile after a reset.
    torch._dynamo.reset()
    plain = WeaveConfig(plan_check_timeout_s=3.0)
    config = plain.replace(split="force") if rank == 0 else plain
    out["mismatch"] = _run(torch.compile(two_layers, backend=weavepass.make_backend(config)), _inputs(rank))
    torch._dynamo.reset()
    out["after"] = _run(torch.compile(two_layers, backend=weavepass.make_backend(plain)), _inputs(rank, seed=5))

    # 3. A server's 50 recompiles, checked as the pass checks them (graphs traced with fake tensors):
    # a new batch size each time. The default store's key count stays bounded.
    from torch.fx.experimental.proxy_tensor import make_fx

    store = _get_default_store()
    keys = []
    for step in range(50):
        trace = make_fx(lambda t: funcol.all_reduce(t, "sum", dist.group.WORLD), tracing_mode="fake")
        gm = trace(torch.randn(step + 1, H))
        check_plan_across_ranks(gm.graph, step, timeout_s=3.0)
        keys.append(store.num_keys())
    out["keys"] = keys

    # 4. A recompile with other collectives on rank 1 only (its batch has more rows): rank 1 waits
    # for a plan rank 0 never compiles, raises, and stops; rank 0, in the old graph's collective,
    # then fails with rank 1's reason instead of "Connection closed by peer".
    dist.barrier()
    torch._dynamo.reset()
    compiled = torch.compile(two_layers, backend=weavepass.make_backend(WeaveConfig(plan_check_timeout_s=3.0)),
                             dynamic=False)
    first = _run(compiled, _inputs(rank, rows=48))  # a new graph: the last plan each rank published
    began = time.monotonic()
    out["changed"] = (first, _run(compiled, _inputs(rank, rows=48 + 8 * rank, seed=1)), time.monotonic() - began)
    return out


def test_a_job_survives_a_rank_local_recompile_recovers_from_a_mismatch_and_stops_a_changed_one():
    rank0, rank1 = spawn(_job_rank, 2, "gloo", timeout_s=240)
    # 1. Healthy: every step ran and matched eager; rank 1 compiled one more graph than rank 0.
    assert rank0["recompile"] == ([None] * 3, 1) and rank1["recompile"] == ([None] * 3, 2), (rank0, rank1)
    # 2. The mismatch raised on both ranks; the next compile passed and matched eager.
    for result in (rank0, rank1):
        assert "PlanMismatchError" in result["mismatch"] and "would run different collectives" in result["mismatch"]
        assert "no restart needed" in result["mismatch"], result["mismatch"]
        assert result["after"] is None, result["after"]
    # 3. Bounded: the heartbeats, the epoch, failure notes, and at most the chunks in flight.
    assert max(rank0["keys"]) - min(rank0["keys"]) <= 2, rank0["keys"]
    # 4. Both ranks raise PlanMismatchError, naming both plans (48 rows on rank 0, 56 on rank 1).
    for rank, result in enumerate((rank0, rank1)):
        first, error, seconds = result["changed"]
        assert first is None and "PlanMismatchError" in error, (rank, error)
        assert "float32[56, 16]" in error and "float32[48, 16]" in error, (rank, error)
        assert seconds < 30, (rank, seconds)
    assert "rank 1 stopped before this collective" in rank0["changed"][1], rank0["changed"][1]


def _dead_peer_rank(rank, world, when):
    """Rank 1 is killed (SIGKILL) before or after its first checked graph; rank 0 then checks a new
    graph and must name rank 1 as gone within seconds (the group's timeout is 60 s). Graphs are
    traced with fake tensors and checked as the pass checks them (no Inductor compile: fast)."""
    from torch.fx.experimental.proxy_tensor import make_fx


    def graph(rows):
        return make_fx(lambda t: funcol.all_reduce(t, "sum", dist.group.WORLD), tracing_mode="fake")(
            torch.randn(rows, H)).graph

    weavepass.make_backend(WeaveConfig())  # a weave backend: this process's heartbeat starts
    if when == "after":
        check_plan_across_ranks(graph(4), 0, timeout_s=60.0)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(1.0)  # rank 1 is dead by now
    began = time.monotonic()
    try:
        check_plan_across_ranks(graph(8), 1, timeout_s=60.0)
        error = None
    except PlanMismatchError as raised:
        error = f"{type(raised).__name__}: {raised}"
    return error, time.monotonic() - began


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_peer_killed_before_or_after_its_first_compile_is_named_within_seconds(when):
    error, seconds = spawn(_dead_peer_rank, 2, "gloo", when, timeout_s=120, group_timeout_s=60.0, may_die=(1,))[0]
    assert error is not None
    assert error.startswith("PeerGoneError: weavepass: rank 1 is gone: its heartbeat stopped"), error
    assert "restart every rank" in error, error
    assert seconds < 10.0, seconds  # the heartbeat limit (5 s), far from the 60 s of the group


def test_workspace_tokens_is_in_the_line_only_where_the_lowering_reads_it():
    """``cuda_workspace_tokens`` set differently per rank: harmless on the portable lowering (which
    ignores it), so its lines agree; the ``cuda_symm`` workspace is allocated with it on every
    rank, so there the lines differ and the check stops the job."""
    from torch.fx.experimental.proxy_tensor import make_fx

    import weavepass.ops  # noqa: F401  (registers torch.ops.weave)
    from weavepass.compile.plan_check import collective_lines
    from weavepass.testing.distributed import fake_process_group

    def lines(lowering: str, tokens: int) -> list[str]:
        def f(p, r, w):
            return torch.ops.weave.fused_allreduce_rmsnorm(p, r, w, 1e-6, "0", torch.float32, lowering, tokens)

        with fake_process_group(2):
            graph = make_fx(f, tracing_mode="fake")(torch.randn(4, H), torch.randn(4, H), torch.randn(H)).graph
            return [line for _, line in collective_lines(graph)["0"]]

    assert lines("portable", 1024) == lines("portable", 4096)
    assert "4096" not in lines("portable", 4096)[0]
    assert lines("cuda_symm", 1024) != lines("cuda_symm", 4096) and "4096" in lines("cuda_symm", 4096)[0]


def test_explain_names_an_async_all_reduce_that_broke_the_graph():
    """``dist.all_reduce(..., async_op=True)`` breaks the graph and runs eagerly: correct, not
    rewritten. The report used to say nothing about it; ``explain`` lists it as not compiled."""
    from weavepass.testing.distributed import fake_process_group

    def f(x, r, w):
        work = dist.all_reduce(x, async_op=True)
        work.wait()
        return rms(r + x, w)

    torch._dynamo.reset()
    with fake_process_group(2):
        report = weavepass.explain(f, torch.randn(4, H), torch.randn(4, H), torch.rand(H),
                                   config=WeaveConfig(lowering="portable"))
    assert len(report.not_compiled) == 1 and report.not_compiled[0].startswith("all_reduce: Dynamo broke"), report
    assert "not in a compiled graph: all_reduce: Dynamo broke the graph there (async_op=True" in str(report)
