"""The CUDA lowering's launch rule (weavepass.runtime.cuda.launch_plan): pure host code, no GPU."""

import pytest

from weavepass.runtime.cuda import launch_plan
from weavepass.runtime.cuda.launch_plan import LaunchOverrides, choose_launch_plan


def test_lamport_only_when_forced_while_off_by_default():
    assert not launch_plan.LAMPORT_BY_DEFAULT
    plan = choose_launch_plan(1, 4096, 2, 2)
    assert plan.one_shot and not plan.lamport
    forced = choose_launch_plan(1, 4096, 2, 2, LaunchOverrides(lamport=True))
    assert forced.one_shot and forced.lamport and not forced.pipelined


def test_lamport_forced_implies_one_shot():
    # 64 tokens x 4096 bf16 = 512 KiB pushed: the rule alone would pick two-shot.
    assert not choose_launch_plan(64, 4096, 2, 2).one_shot
    assert choose_launch_plan(32, 4096, 2, 2, LaunchOverrides(lamport=True)).one_shot


@pytest.mark.parametrize("tokens, hidden, elem, world, one_shot", [
    (33, 4096, 2, 2, None),  # 264 KiB per rank: more than a slot
    (8, 4096, 2, 1, None),  # no peers
    (8, 4096, 2, 2, False),  # contradicts a forced two-shot
])
def test_lamport_refuses_what_it_cannot_serve(tokens, hidden, elem, world, one_shot):
    with pytest.raises(ValueError, match="Lamport"):
        choose_launch_plan(tokens, hidden, elem, world, LaunchOverrides(lamport=True, one_shot=one_shot))


def test_lamport_rule_when_on(monkeypatch):
    monkeypatch.setattr(launch_plan, "LAMPORT_BY_DEFAULT", True)
    assert choose_launch_plan(8, 8192, 2, 2).lamport  # 128 KiB
    assert choose_launch_plan(16, 8192, 2, 2).lamport  # 256 KiB: one slot exactly
    # 32 tokens x 8192 bf16: 512 KiB per rank, two-shot by the one-shot rule already.
    assert not choose_launch_plan(32, 8192, 2, 2).lamport
    assert not choose_launch_plan(8, 8192, 2, 1).lamport  # one rank: nothing to exchange
    assert not choose_launch_plan(8, 8192, 2, 2, LaunchOverrides(lamport=False)).lamport


def _push_workspace(rank, world, capacity):
    """A ``_Workspace`` standing in for the push variant's (host arithmetic only: never launched)."""
    import torch

    from weavepass.runtime.cuda.workspace import _Workspace

    deltas = tuple(range(8))
    return _Workspace(torch.empty(0), torch.empty(0, dtype=torch.int32), capacity, deltas, deltas, rank, world,
                      watch=4096, timeout_ns=600 * 10**9)


def test_push_arguments_address_the_call_slot_and_its_signals():
    """The push variant's two launches for 1000 bf16 rows of 8192 into slot 1 of a 2-rank workspace:
    the slot's region (``slot * capacity``) and signal block (``slot * (4 + 2 * WORLD)``) in both
    kernels, the push on the asked CTAs with 64 KiB tiles, the reduce on one 16 KiB tile (one row
    here) per CTA up to its cap."""
    from weavepass.runtime.cuda.push import push_arguments, signal_slots

    ws = _push_workspace(1, 2, 1024 * 8192)
    args = push_arguments(ws, 1000, 8192, 2, 1, True, push_ctas=16, reduce_ctas=528)
    assert signal_slots(2) == 8
    # push: ..., rows, slot region, signal block, then the bounded wait's record and limit (peer_wait)
    assert args.push_tail[-5:] == (1000, 1024 * 8192, 8, ws.watch, ws.timeout_ns)
    assert args.reduce_tail[-3:] == (1000, 1024 * 8192, 8)  # the reduce waits for nothing
    assert args.push_grid == (16,) and args.push_meta["ROWS"] == 4 and args.push_meta["num_warps"] == 16
    assert args.reduce_grid == (528,) and args.reduce_meta["ROWS"] == 1 and args.reduce_meta["HAS_RESIDUAL"]
    assert args.push_meta["RANK"] == args.reduce_meta["RANK"] == 1
    small = push_arguments(ws, 3, 8192, 2, 0, False, push_ctas=16, reduce_ctas=528)
    assert small.push_grid == (1,) and small.reduce_grid == (3,)  # no CTA without rows
    assert small.push_tail[-5:-2] == (3, 0, 0)


def test_push_arguments_refuse_a_third_slot_and_an_overfull_one():
    from weavepass.runtime.cuda.push import push_arguments

    ws = _push_workspace(0, 2, 16 * 64)
    with pytest.raises(ValueError, match="slot 2"):
        push_arguments(ws, 16, 64, 2, 2, True, 16, 64)
    with pytest.raises(ValueError, match="exceed a staging slot"):
        push_arguments(ws, 17, 64, 2, 0, True, 16, 64)


def test_push_variant_serves_two_ranks_only():
    from weavepass.runtime.cuda.support import CudaIssue, push_unsupported_reason

    assert push_unsupported_reason(2) is None
    reason = push_unsupported_reason(8)
    assert reason.issue is CudaIssue.PUSH_WORLD_SIZE
    assert dict(reason.fields) == {"world": 8, "peers": 7, "two_shot": 1.75}  # (N-1) S pushed, 2 (N-1)/N S two-shot


@pytest.mark.parametrize("hidden, rows", [(8192, 1), (4096, 2), (1032, 4)])
def test_a_group_of_one_gets_one_cta_per_tile_uncapped(hidden, rows):
    """No peers: no barrier slot per CTA and no residency across ranks, so the grid is one CTA per
    16 KiB tile, as many as the batch has (Inductor's shape), not the 32 a group of several ranks
    is capped at (measured 1.7-1.8x the HBM floor at 32 CTAs, docs/cuda_kernel.md)."""
    for tokens in (1, 5, 1000, 4096, 16384):
        plan = choose_launch_plan(tokens, hidden, 2, 1)
        assert plan.one_shot and not plan.pipelined and not plan.lamport
        assert plan.rows_per_tile == rows and plan.num_warps == launch_plan.LOCAL_NUM_WARPS
        assert plan.num_ctas == -(-tokens // rows)
    assert choose_launch_plan(16384, hidden, 2, 1, LaunchOverrides(num_ctas=64)).num_ctas == 64
    assert choose_launch_plan(16384, hidden, 2, 1, LaunchOverrides(num_warps=16)).num_warps == 16


@pytest.mark.parametrize("world", (2, 4, 8))
def test_groups_of_several_ranks_keep_the_capped_grid(world):
    for tokens in (1, 128, 1000, 4096, 16384):
        plan = choose_launch_plan(tokens, 8192, 2, world)
        assert launch_plan.MIN_CTAS <= plan.num_ctas <= launch_plan.MAX_CTAS
    assert choose_launch_plan(16384, 8192, 2, world, LaunchOverrides(num_ctas=64)).num_ctas == launch_plan.MAX_CTAS


@pytest.mark.parametrize("world, stages", [(2, 1), (3, 1), (4, 3), (8, 2)])
def test_pipelined_loads_from_four_ranks_keep_the_chunk_and_fit_shared_memory(world, stages):
    """From ``PIPELINED_LOADS_MIN_WORLD`` (4) ranks the rule's pipelined launch keeps its chunk of
    rows in 16 KiB tiles (one row of 8192 bf16) with software-pipelined loads, fewer stages where the
    reduce's ``WORLD + 1`` tensors' tiles ahead would not fit the shared-memory budget (8 ranks: 9 x
    16 KiB x 2 = 288 KiB > 200 KiB, so one tile ahead); 2 and 3 ranks keep the 64 KiB tile without
    (measured slower with them at 2 ranks); overrides still win, uncapped."""
    plan = choose_launch_plan(16384, 8192, 2, world)
    assert plan.pipelined and plan.chunk_rows == 8 and plan.load_stages == stages
    if stages == 1:
        assert plan.rows_per_tile == 4 and plan.push_rows == 8
    else:
        assert plan.rows_per_tile == 1 and plan.push_rows == 2
        assert plan.num_warps == launch_plan.PIPELINED_LOADS_NUM_WARPS
    assert (world + 1) * 8192 * 2 * plan.rows_per_tile * (plan.load_stages - 1) <= launch_plan.SHARED_BYTES_PER_CTA
    forced = choose_launch_plan(16384, 8192, 2, world, LaunchOverrides(load_stages=4, tile_elements=8192,
                                                                       chunk_tiles=8))
    assert forced.load_stages == 4 and forced.rows_per_tile == 1 and forced.chunk_rows == 8
    assert choose_launch_plan(16384, 8192, 2, world, LaunchOverrides(load_stages=1)).rows_per_tile == 4
    assert not choose_launch_plan(1000, 8192, 2, world).pipelined  # small batches: the flat kernel, as before
