"""The ``cuda_symm`` kernels with 2, 4 and 8 simulated ranks on one GPU (weavepass.testing.kernel_sim).

Every algorithm (one-shot, flat two-shot, pipelined two-shot with and without software-pipelined
loads, Lamport) against the fp32-accumulating reference,
at world sizes the lent machines do not have, with poisoned workspaces and back-to-back calls that
mix algorithms (each call must leave every signal slot at 0). The link itself is
``test_cuda_kernel.py``'s (real GPUs, symmetric memory).
"""

from __future__ import annotations

import pytest
import torch

from weavepass.runtime.cuda.launch_plan import LaunchOverrides
from weavepass.runtime.reference import fused_allreduce_rmsnorm_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

EPS = 1e-6
# Tolerances: as tests/gpu/test_cuda_kernel.py (one final rounding of residual_out; 2 ulp for normed
# because rsqrt.approx and the sum-of-squares order move the fp32 value by ~1e-6 relative).
RESIDUAL_TOL = {torch.bfloat16: (2**-7, 1e-5), torch.float16: (2**-10, 1e-5), torch.float32: (1e-6, 1e-6)}
NORMED_TOL = {torch.bfloat16: (2**-6, 2**-6), torch.float16: (2**-9, 2**-9), torch.float32: (2e-5, 2e-5)}

ALGORITHMS = {
    "one_shot": LaunchOverrides(one_shot=True),
    "two_shot": LaunchOverrides(one_shot=False, pipelined=False),
    "pipelined": LaunchOverrides(one_shot=False, pipelined=True, num_ctas=16),
    "lamport": LaunchOverrides(lamport=True),
    # the pipelined kernel with software-pipelined loads (16 KiB tiles, 8 per chunk, one ahead)
    "pipelined_loads": LaunchOverrides(one_shot=False, pipelined=True, num_ctas=16, tile_elements=8192,
                                       chunk_tiles=8, load_stages=2),
}


def _serves(name, tokens, hidden, dtype):
    """Whether algorithm ``name`` can take this batch (one-shot up to 1024 tokens here; Lamport up to
    its slot of 256 KiB per rank)."""
    if name == "one_shot":
        return tokens <= 1024
    if name == "lamport":
        return tokens * hidden * torch.empty((), dtype=dtype).element_size() <= 256 << 10
    return True


def _inputs(seed, world, tokens, hidden, dtype, with_residual=True):
    gen = torch.Generator(device="cuda")
    gen.manual_seed(seed)
    draw = lambda *shape: torch.randn(*shape, generator=gen, device="cuda")  # noqa: E731
    partials = [draw(tokens, hidden).to(dtype) for _ in range(world)]
    residual = draw(tokens, hidden).to(dtype) if with_residual else None
    weight = (1 + 0.1 * draw(hidden)).to(dtype)
    return partials, residual, weight


def _check(outputs, partials, residual, weight, dtype, label):
    want_normed, want_res = fused_allreduce_rmsnorm_reference(partials, residual, weight, EPS, dtype)
    for rank, (normed, res_out) in enumerate(outputs):
        torch.testing.assert_close(res_out, want_res, rtol=RESIDUAL_TOL[dtype][0], atol=RESIDUAL_TOL[dtype][1],
                                   msg=lambda m: f"{label} rank {rank} residual_out: {m}")
        torch.testing.assert_close(normed, want_normed, rtol=NORMED_TOL[dtype][0], atol=NORMED_TOL[dtype][1],
                                   msg=lambda m: f"{label} rank {rank} normed: {m}")


def _ctas(world, overrides):
    """All ranks' grids must be resident together: at most 128 CTAs in all."""
    if overrides.num_ctas is not None:
        return LaunchOverrides(**{**overrides.__dict__, "num_ctas": min(overrides.num_ctas, 128 // world)})
    return LaunchOverrides(**{**overrides.__dict__, "num_ctas": 128 // world if world > 4 else None})


# World 2 gets the whole matrix; 4 and 8 a slice of it (every rank is its own compiled kernel, and
# compiling dominates this file's time).
MATRIX = {
    2: dict(dtypes=(torch.bfloat16, torch.float32), tokens=(1, 3, 16, 127, 1024, 4099), residual=(True, False)),
    4: dict(dtypes=(torch.bfloat16,), tokens=(3, 127, 4099), residual=(True,)),
    8: dict(dtypes=(torch.bfloat16,), tokens=(3,), residual=(True,)),
}


@pytest.mark.parametrize("world", sorted(MATRIX))
def test_every_algorithm_matches_reference(world):
    from weavepass.testing.kernel_sim import SimulatedRanks

    hidden, matrix = 4096, MATRIX[world]
    sim = {dtype: SimulatedRanks(world, hidden, 4099, dtype) for dtype in matrix["dtypes"]}
    for name, overrides in ALGORITHMS.items():
        for dtype in matrix["dtypes"]:
            for tokens in matrix["tokens"]:
                if not _serves(name, tokens, hidden, dtype):
                    continue
                for with_residual in matrix["residual"]:
                    label = f"world={world} {name} {dtype} T={tokens} residual={with_residual}"
                    partials, residual, weight = _inputs(tokens, world, tokens, hidden, dtype, with_residual)
                    sim[dtype].poison()
                    outputs = sim[dtype].run(partials, residual, weight, EPS, dtype, _ctas(world, overrides))
                    _check(outputs, partials, residual, weight, dtype, label)
                    assert sim[dtype].signals_clear(), f"{label}: signal slots left set"
                    assert sim[dtype].lamport_clear(), f"{label}: Lamport region not left empty"


@pytest.mark.parametrize("world", (2, 4))
def test_back_to_back_calls_mixing_algorithms(world):
    """200 calls without synchronising between them, every algorithm on every size in turn (an
    algorithm for 5 calls in a row: two Lamport calls back to back, on both parities, between
    barrier kernels): a kernel that leaves a signal set, or overwrites a peer's rows before the
    peer read them, shows. (Size and algorithm used to advance together: 4 sizes and 4 algorithms
    paired each algorithm with one size, and the Lamport kernel's, 2048 tokens, never ran.)"""
    from weavepass.testing.kernel_sim import SimulatedRanks

    hidden, dtype = 8192, torch.bfloat16
    sim = SimulatedRanks(world, hidden, 2048, dtype)
    cases = []
    for i, tokens in enumerate((1, 16, 17, 512, 2048)):  # 16: the Lamport slot's largest batch
        partials, residual, weight = _inputs(100 + i, world, tokens, hidden, dtype)
        cases.append((tokens, partials, residual, weight))
    results = []
    for call in range(200):
        tokens, partials, residual, weight = cases[call % len(cases)]
        name = list(ALGORITHMS)[call // len(cases) % len(ALGORITHMS)]
        if not _serves(name, tokens, hidden, dtype):
            name = "two_shot"
        overrides = ALGORITHMS[name]
        outputs = sim.run(partials, residual, weight, EPS, dtype, _ctas(world, overrides), wait=False)
        results.append((call, name, tokens, outputs))
    sim.wait_all("200 back-to-back calls")
    assert sim.lamport_clear()
    for call, name, tokens, outputs in results:
        _, partials, residual, weight = next(c for c in cases if c[0] == tokens)
        _check(outputs, partials, residual, weight, dtype, f"call {call} {name} T={tokens}")
    assert sim.signals_clear()


@pytest.mark.parametrize("world", (2, 4))
def test_pipelined_loads_change_no_bit(world):
    """The software-pipelined loads only move when each tile's bytes arrive: on the same tiles,
    chunks and warps, both outputs equal the kernel without them bit for bit (the sum in rank order
    in fp32 and the norm's reduction are the same code), with poisoned staging and signals left
    clear."""
    from weavepass.testing.kernel_sim import SimulatedRanks

    hidden, dtype = 8192, torch.bfloat16
    sim = SimulatedRanks(world, hidden, 4099, dtype)
    for tokens in (4099, 2048):
        partials, residual, weight = _inputs(7 + tokens, world, tokens, hidden, dtype)
        outputs = {}
        for stages in (1, 2, 3):
            overrides = LaunchOverrides(one_shot=False, pipelined=True, num_ctas=16, tile_elements=hidden,
                                        chunk_tiles=8, load_stages=stages)
            sim.poison()
            outputs[stages] = sim.run(partials, residual, weight, EPS, dtype, overrides)
            assert sim.signals_clear(), f"world {world} T={tokens} load stages {stages}: signal slots left set"
        _check(outputs[1], partials, residual, weight, dtype, f"world {world} T={tokens} load stages 1")
        for stages in (2, 3):
            for rank, ((n, r), (n1, r1)) in enumerate(zip(outputs[stages], outputs[1])):
                assert torch.equal(r, r1), f"world {world} T={tokens} stages {stages} rank {rank}: residual_out"
                assert torch.equal(n, n1), f"world {world} T={tokens} stages {stages} rank {rank}: normed"


@pytest.mark.parametrize("world", (2,))
def test_lamport_negative_zero_partials(world):
    """Negative zero is the Lamport kernel's "empty" value: partials full of -0.0 must still arrive
    (pushed as +0.0, equal in every sum) instead of leaving the readers polling forever."""
    from weavepass.testing.kernel_sim import SimulatedRanks

    hidden = 4096
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        sim = SimulatedRanks(world, hidden, 16, dtype)
        partials, residual, weight = _inputs(7, world, 8, hidden, dtype)
        for p in partials:
            p[:, : hidden // 2] = -0.0  # half of every row, on every rank
        partials[0][3] = -0.0  # one whole row of one rank
        outputs = sim.run(partials, residual, weight, EPS, dtype, ALGORITHMS["lamport"], timeout_s=20)
        _check(outputs, partials, residual, weight, dtype, f"world={world} {dtype} -0.0 partials")
        assert sim.lamport_clear() and sim.signals_clear()


def test_inverse_rms_for_training():
    """Every algorithm also writes the per-row inverse RMS a training graph saves for backward
    (``return_inv_rms``), for the rows each rank reduces and those it finalises from its peers."""
    from weavepass.runtime.reference import accumulation_dtype, add_rmsnorm_local
    from weavepass.testing.kernel_sim import SimulatedRanks

    world, hidden = 2, 4096
    for dtype in (torch.bfloat16, torch.float32):
        sim = SimulatedRanks(world, hidden, 1024, dtype)
        for name, overrides in ALGORITHMS.items():
            for tokens in (3, 16, 1024):
                if not _serves(name, tokens, hidden, dtype):
                    continue
                partials, residual, weight = _inputs(5 + tokens, world, tokens, hidden, dtype)
                outputs = sim.run(partials, residual, weight, EPS, dtype, overrides, return_inv_rms=True)
                summed = torch.stack([p.to(accumulation_dtype(dtype)) for p in partials]).sum(0)
                want = add_rmsnorm_local(summed, residual, weight, EPS, dtype, dtype, return_inv_rms=True)
                label = f"{name} {dtype} T={tokens}"
                _check([o[:2] for o in outputs], partials, residual, weight, dtype, label)
                for rank, (_, _, inv_rms) in enumerate(outputs):
                    # fp32 either way: rsqrt.approx and the sum-of-squares order, ~1e-6 relative.
                    torch.testing.assert_close(inv_rms, want[2], rtol=2e-5, atol=0,
                                               msg=lambda m: f"{label} rank {rank} inv_rms: {m}")


def test_layer_norm_sites():
    """Every algorithm with a LayerNorm (``weave.fused_allreduce_layernorm``'s CUDA lowering), with
    and without bias, against the reference's ``add_layernorm_local``."""
    from weavepass.testing.kernel_sim import SimulatedRanks

    world, hidden = 2, 4096
    for dtype in (torch.bfloat16, torch.float32):
        sim = SimulatedRanks(world, hidden, 1024, dtype)
        for name, overrides in ALGORITHMS.items():
            for tokens in (3, 1024):
                if not _serves(name, tokens, hidden, dtype):
                    continue
                for with_bias in (False, True):
                    partials, residual, weight = _inputs(9 + tokens, world, tokens, hidden, dtype)
                    partials = [p + 0.5 for p in partials]  # a non-zero mean to subtract
                    bias = (0.1 * torch.randn(hidden, device="cuda")).to(dtype) if with_bias else None
                    outputs = sim.run(partials, residual, weight, EPS, dtype, overrides, layer_norm=True, bias=bias)
                    want_normed, want_res = fused_allreduce_rmsnorm_reference(
                        partials, residual, weight, EPS, dtype, bias=bias, layer_norm=True)
                    label = f"LayerNorm {name} {dtype} T={tokens} bias={with_bias}"
                    for rank, (normed, res_out) in enumerate(outputs):
                        torch.testing.assert_close(res_out, want_res, rtol=RESIDUAL_TOL[dtype][0],
                                                   atol=RESIDUAL_TOL[dtype][1], msg=lambda m: f"{label} {rank}: {m}")
                        # As for RMSNorm, plus the mean's fp32 summation order: an absolute error of
                        # ~1e-7 x |mean| / std on centred values near 0, inside atol.
                        torch.testing.assert_close(normed, want_normed, rtol=NORMED_TOL[dtype][0],
                                                   atol=NORMED_TOL[dtype][1], msg=lambda m: f"{label} {rank}: {m}")


# ------------------------------------------------------------------ the split's push variant


def _push_calls(world, tokens, hidden, dtype, count, with_residual=True, seed=0):
    """``count`` calls (half ``i % 2`` of site ``i // 2``), each the ranks' partials and a residual."""
    calls = []
    for i in range(count):
        partials, residual, _ = _inputs(seed + i, world, tokens, hidden, dtype, with_residual)
        calls.append((partials, residual))
    return calls


def _check_push(sim, calls, outputs, weight, dtype, label):
    for i, (partials, residual) in enumerate(calls):
        _check([outputs[r][i] for r in range(sim.world)], partials, residual, weight, dtype,
               f"{label} call {i} (half {'AB'[i % 2]})")


def _push_signals_settled(sim, calls_per_slot):
    """Every slot after ``calls_per_slot`` calls each: PUSH_SEQ and REDUCE_SEQ there, the DONE counts
    back to 0, every peer's PUSHED and CONSUMED at that sequence number."""
    from weavepass.runtime.cuda.push import STAGING_SLOTS, signal_slots

    n = signal_slots(sim.world)
    for rank, pad in enumerate(sim.signals()):
        peers = [0 if src == rank else calls_per_slot for src in range(sim.world)]
        for slot in range(STAGING_SLOTS):
            assert pad[slot * n:(slot + 1) * n] == [calls_per_slot, 0, calls_per_slot, 0, *peers, *peers], (
                rank, slot, pad)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
def test_push_variant_back_to_back_alternating_slots(dtype):
    """The push kernels as the split runs them (simulated world 2, a side and a main stream per
    rank): 3 sizes x 40 calls alternating halves A/B (slots 0/1) without synchronising, poisoned
    staging, with and without residual, against the reference; the signals advance by exactly one
    per call and slot. Then with rank 1's reduces delayed (its main stream spins before each), so
    rank 0's pushes run ahead into slots rank 1 has not read: only the CONSUMED wait keeps them
    from being overwritten (tests/push_interpreter_case.py showed the wrong rows without it)."""
    from weavepass.testing.kernel_sim import SimulatedPushRanks

    world, hidden = 2, 4096
    sim = SimulatedPushRanks(hidden, 4099, dtype, world)
    sim.poison()
    weight = _inputs(99, world, 1, hidden, dtype)[2]
    per_slot = 0
    for tokens, with_residual in ((1, True), (127, False), (4099, True)):
        calls = _push_calls(world, tokens, hidden, dtype, 40, with_residual, seed=tokens)
        outputs = sim.split_schedule(calls, weight, EPS, dtype)
        torch.cuda.synchronize()
        _check_push(sim, calls, outputs, weight, dtype, f"{dtype} T={tokens}")
        per_slot += 20
        _push_signals_settled(sim, per_slot)
    calls = _push_calls(world, 512, hidden, dtype, 12, seed=7)
    outputs = sim.split_schedule(calls, weight, EPS, dtype, delay_reduce_cycles={1: 2_000_000})
    torch.cuda.synchronize()
    _check_push(sim, calls, outputs, weight, dtype, f"{dtype} rank 1 late")
    _push_signals_settled(sim, per_slot + 6)


def test_push_variant_replays_in_cuda_graph():
    """The split's push schedule captured once in a CUDA graph and replayed 5 times with new
    inputs: the kernels keep no host state (sequence numbers live in the pads and advance on the
    device), so every replay matches the reference and the signals end 5 calls per slot further."""
    from weavepass.testing.kernel_sim import SimulatedPushRanks

    world, hidden, dtype, tokens = 2, 4096, torch.bfloat16, 257
    sim = SimulatedPushRanks(hidden, tokens, dtype, world)
    weight = _inputs(98, world, 1, hidden, dtype)[2]
    calls = _push_calls(world, tokens, hidden, dtype, 4)
    sim.split_schedule(calls, weight, EPS, dtype)  # compiles and loads the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    capture = torch.cuda.Stream()
    capture.wait_stream(torch.cuda.current_stream())
    with torch.cuda.graph(graph, stream=capture):
        outputs = sim.split_schedule(calls, weight, EPS, dtype)
    torch.cuda.synchronize()
    _push_signals_settled(sim, 2)  # captured, not run
    for replay in range(5):
        fresh = _push_calls(world, tokens, hidden, dtype, 4, seed=50 + 10 * replay)
        for (partials, residual), (new_partials, new_residual) in zip(calls, fresh):
            for p, q in zip(partials, new_partials):
                p.copy_(q)
            residual.copy_(new_residual)
        sim.poison()
        graph.replay()
        torch.cuda.synchronize()
        _check_push(sim, calls, outputs, weight, dtype, f"replay {replay}")
    _push_signals_settled(sim, 2 + 2 * 5)


@pytest.mark.parametrize("kind,site", [
    ("one_shot", "the two-shot barrier: the peer's signal never came"),
    ("two_shot", "the two-shot barrier: the peer's signal never came"),
    ("pipelined", "the pipelined kernel's chunk counters"),
    ("lamport", "the Lamport one-shot"),
    ("push", "the push variant's push: the peer's rows never came"),
])
def test_a_peer_that_never_comes_stops_the_kernel(kind, site):
    """A dead or stalled peer: only simulated rank 0 launches, with its waits bounded at 2 s. The
    kernel must give up, trap and leave the reason in weave's message, and the process must fail
    (not hang, not return wrong rows). Before the bounded waits (``runtime.cuda.peer_wait``) this
    case spun for ever; the limit here is 90 s for the whole process (CUDA start-up, one compile)."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    case = Path(__file__).with_name("peer_wait_case.py")
    start = time.monotonic()
    done = subprocess.run([sys.executable, str(case), kind], capture_output=True, text=True, timeout=90,
                          cwd=Path(__file__).parents[2])
    elapsed = time.monotonic() - start
    output = done.stdout + done.stderr
    assert done.returncode != 0 and "UNREACHED" not in output, output[-3000:]
    assert "weave: rank 0 of a 2-rank group waited 2 s for rank 1" in output, output[-3000:]
    assert site in output, output[-3000:]
    assert "CUDA" in output and elapsed < 90, (elapsed, output[-3000:])
