"""Worlds of 4 and 8 ranks on the CPU: the launch rule of the CUDA kernel, the split planner at the
per-rank widths of Llama-3-70B at TP=2/4/8, and the rewrite of a traced graph on every rank of a
fake group of 4 and 8 (the same collectives on every rank, and the cross-rank plan check passes).

Everything weavepass measured so far was on 2 GPUs; these tests pin what the rules decide at 4 and 8
ranks before the 4- and 8-GPU runs (issues 16 and 17) say whether those decisions are right."""

from __future__ import annotations

import dataclasses

import pytest
from test_compile_units import FLASHCOMM, _args, _exchange, _trace, two_sites  # tests/test_compile_units.py

from weavepass import WeaveConfig
from weavepass.compile.graph_pass import WeavePass
from weavepass.compile.plan_check import collective_lines
from weavepass.compile.reasons import Reason, ReasonCode
from weavepass.compile.tokens import TokenCount
from weavepass.compile.wave_model import GemmShape, WaveModel, plan_token_split
from weavepass.runtime.cuda import launch_plan
from weavepass.runtime.cuda.launch_plan import LaunchOverrides, choose_launch_plan
from weavepass.testing import fake_process_group

WORLDS = (2, 4, 8)
BF16 = 2

# --- the launch rule -------------------------------------------------------------------------------


@pytest.mark.parametrize("world, largest", [(2, 16), (4, 5), (8, 2)])
def test_one_shot_threshold_is_in_bytes_pushed_per_rank(world, largest):
    """One-shot while ``(N - 1) * T * H * elem <= ONE_SHOT_MAX_BYTES``: a rank pushes its whole
    partial to every peer, so the largest one-shot batch shrinks with the world (H=8192 bf16: 16
    tokens at 2 ranks, where it was measured, 5 at 4, 2 at 8). Whether 4 and 8 ranks want the same
    pushed-bytes bound is what ``weave_one_shot`` / ``weave_two_shot`` of the fused benchmark measure."""
    assert (world - 1) * largest * 8192 * BF16 <= launch_plan.ONE_SHOT_MAX_BYTES
    assert choose_launch_plan(largest, 8192, BF16, world).one_shot
    assert not choose_launch_plan(largest + 1, 8192, BF16, world).one_shot


TWO_SHOT_TOKENS = (3, 6, 37, 127, 1000, 4097, 8191, 16384, 16385, 32768)


@pytest.mark.parametrize("world", (4, 8))
@pytest.mark.parametrize("hidden", (4096, 8192))
def test_two_shot_grid_depends_only_on_the_rows_a_rank_owns(world, hidden):
    """In two-shot every choice (tile, warps, CTAs, flat or pipelined, chunk) is made on the rows a
    rank owns, ``ceil(T / N)`` (the last ranks own fewer or none when N does not divide T): a batch
    of T tokens on N ranks launches like one of ``2 * ceil(T / N)`` on 2 ranks. Every owned row is
    covered by a tile unless the grid is at its cap. One exception, by design: from
    ``PIPELINED_LOADS_MIN_WORLD`` ranks a pipelined launch takes smaller tiles with loads ahead
    (same chunks, same grid; measured faster at 4 ranks, slower at 2)."""
    for tokens in TWO_SHOT_TOKENS:
        plan = choose_launch_plan(tokens, hidden, BF16, world, LaunchOverrides(one_shot=False))
        owned = -(-tokens // world)
        on_two = choose_launch_plan(2 * owned, hidden, BF16, 2, LaunchOverrides(one_shot=False))
        assert plan.num_ctas * plan.rows_per_tile >= owned or plan.num_ctas == launch_plan.MAX_CTAS, plan
        if plan.pipelined:
            assert world >= launch_plan.PIPELINED_LOADS_MIN_WORLD and plan.load_stages > 1 and on_two.load_stages == 1
            assert plan.rows_per_tile * BF16 * plan.block_h == launch_plan.PIPELINED_LOADS_TILE_BYTES
            plan = dataclasses.replace(plan, rows_per_tile=on_two.rows_per_tile, push_rows=on_two.push_rows,
                                       num_warps=on_two.num_warps, load_stages=1)
        assert plan == on_two, (tokens, plan, on_two)


@pytest.mark.parametrize("world, first", [(2, 4096), (4, 8192), (8, 16384)])
def test_pipelined_kernel_starts_at_the_same_owned_rows(world, first):
    """The pipelined two-shot kernel needs 8 chunks per CTA at 16+ CTAs: at H=8192 bf16 that is
    2048 owned rows, reached at 4096 tokens on 2 ranks (measured there), 8192 on 4 and 16384 on 8."""
    batches = [2**k for k in range(16)]
    pipelined = [t for t in batches if choose_launch_plan(t, 8192, BF16, world).pipelined]
    assert pipelined and pipelined[0] == first, pipelined
    assert pipelined == [t for t in batches if t >= first]


@pytest.mark.parametrize("world", (4, 8))
def test_lamport_rule_when_on_serves_only_one_shot_batches(monkeypatch, world):
    """With the Lamport kernel on, it takes the one-shot batches that fit a slot, and at 4 and 8
    ranks the one-shot bound (bytes pushed to all peers) is the tighter one: 5 and 2 tokens at
    H=8192 bf16, not the 16 a slot holds."""
    monkeypatch.setattr(launch_plan, "LAMPORT_BY_DEFAULT", True)
    lamport = [t for t in range(1, 33) if choose_launch_plan(t, 8192, BF16, world).lamport]
    one_shot = [t for t in range(1, 33) if choose_launch_plan(t, 8192, BF16, world).one_shot]
    assert lamport == one_shot == list(range(1, {4: 6, 8: 3}[world]))


# --- the split planner at the per-rank widths of TP=2/4/8 ------------------------------------------


def llama70b_gemms(tp: int) -> list[GemmShape]:
    """The per-rank GEMMs of one Llama-3-70B layer at TP=tp: qkv, o_proj, gate/up, down_proj."""
    heads, kv_heads, mlp = 64 // tp, 8 // tp, 28672 // tp
    return [GemmShape((heads + 2 * kv_heads) * 128, 8192), GemmShape(8192, heads * 128),
            GemmShape(2 * mlp, 8192), GemmShape(8192, mlp)]


@pytest.mark.parametrize("tp", WORLDS)
def test_auto_split_at_70b_widths_is_free_and_balanced(tp):
    """``split="auto"`` splits only inside its window (16K tokens by default, measured on 2 GPUs;
    the thresholds do not depend on the world yet). There, at the per-rank widths of every TP degree
    on an H200's 132 SMs, the cut costs no extra GEMM wave and is within 3 % of the middle, and a
    batch below the window is left fuse-only with the reason."""
    h200, auto = WaveModel(sms=132), WeaveConfig(split="auto")
    plan = plan_token_split(1, 16384, llama70b_gemms(tp), auto, h200)
    assert plan.free and abs(plan.first - 8192) <= 0.03 * 16384, plan
    below = plan_token_split(1, 8192, llama70b_gemms(tp), auto, h200)
    assert below.first is None and below.reason == Reason.of(ReasonCode.SPLIT_BELOW_WINDOW, tokens=8192, low=16384,
                                                             kind="dense")


# --- the rewrite on every rank of a fake group -----------------------------------------------------

CUDA_SYMM = WeaveConfig(lowering="cuda_symm")
TOKENS = 40
CONFIGS = {
    "fuse": WeaveConfig(),
    "split": WeaveConfig(split="force"),
    # split="auto" with the 40 tokens inside its window, and below it (fuse-only, the reason said)
    "auto_split": WeaveConfig(split="auto", split_min_tokens=32, split_min_tokens_moe=32, split_max_tokens=64),
    "auto_below": WeaveConfig(split="auto", split_min_tokens=48, split_min_tokens_moe=48, split_max_tokens=64),
    "flashcomm": WeaveConfig(**FLASHCOMM),
    "cuda_symm": CUDA_SYMM,
}
SPLITS = {"split", "auto_split"}


def _lines(world: int, rank: int, config: WeaveConfig, tokens: int = TOKENS) -> list[tuple[str, str]]:
    """The collective lines rank ``rank`` of ``world`` publishes for ``two_sites`` on ``tokens``."""
    with fake_process_group(world, rank):
        graph = _trace(two_sites, *_args(tokens))
        WeavePass(config)(graph)  # its own plan check skips fake groups
        return collective_lines(graph)["0"]


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("world", (4, 8))
def test_every_rank_rewrites_the_same_way(monkeypatch, world, name):
    """Fuse, split (forced, and ``auto`` inside and below its window), FlashComm and the CUDA
    lowering (its availability check stubbed: no GPU here) on all ranks of 4 and 8: every rank
    publishes the same collectives and the cross-rank check passes. What the world changes is only
    FlashComm's shard (tokens padded to a multiple of ``16 * N``, ``padded / N`` rows per rank) and
    the group size in its collectives; the fused and split graphs are those of 2 ranks."""
    monkeypatch.setattr("weavepass.compile.planner._cuda_unsupported_reason", lambda site: None)
    config = CONFIGS[name]
    lines = [_lines(world, rank, config) for rank in range(world)]
    assert all(mine == lines[0] for mine in lines), name
    assert _exchange(lines) == [None] * world
    ops = [text for _, text in lines[0]]
    if name == "flashcomm":
        padded = TokenCount(TOKENS).padded(world)
        assert padded % (16 * world) == 0 and padded >= TOKENS
        assert ops[0] == f"_c10d_functional.reduce_scatter_tensor(float32[{padded}, 64], 'sum', {world}, '0')"
        assert f"all_gather_into_tensor(float32[{padded // world}, 64], {world}, '0')" in ops[-1]
        assert not any("all_reduce" in op for op in ops)
    else:
        assert lines[0] == _lines(2, 0, config)  # the world enters only through FlashComm's shard
        lowering = "'cuda_symm'" if config is CUDA_SYMM else "'portable'"
        assert all(op.startswith("weave.fused_allreduce_rmsnorm") and lowering in op for op in ops), ops
        assert len(ops) == (4 if name in SPLITS else 2)  # two sites, each in two halves when split


def test_a_rank_that_splits_differently_is_named_at_world_8(monkeypatch):
    """The plan check at 8 ranks: one rank whose GPU has an SM count (the others: none, as on the
    CPU) cuts 640 tokens elsewhere (320/320 against 256/384, tests/test_compile_units.py), and every
    rank raises naming the differing collective."""
    split = WeaveConfig(split="force")
    lines = [_lines(8, rank, split, 640) for rank in range(7)]
    h200 = WaveModel(sms=132)
    monkeypatch.setattr("weavepass.compile.wave_model.device_wave_model", lambda device: h200)
    monkeypatch.setattr("weavepass.compile.strategies.split.device_wave_model", lambda device: h200,
                        raising=False)
    lines.append(_lines(8, 7, split, 640))
    assert "float32[256, 64]" in lines[0][0][1] and "float32[320, 64]" in lines[7][0][1]
    errors = _exchange(lines)
    assert all(e is not None and "would run different collectives on group '0' at collective #0" in e
               for e in errors), errors
