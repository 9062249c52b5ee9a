"""The gather prologue (``runtime.cuda.gather``: the owners' push and the gather GEMM) run by Triton's
interpreter on CPU, all simulated ranks in one process (``testing.gemm_sim.SimulatedGatherRanks``:
every rank's push, then every rank's GEMMs, one after another, so each wait is met when reached).

Run by tests/test_gather_interpreted.py as ``TRITON_INTERPRET=1 python tests/gather_interpreter_case.py
<case>``; prints ``<case>: OK`` after its checks, raises otherwise.

bf16 and fp16: Triton 3.9's interpreter multiplies bf16 ``tl.dot`` operands as raw 16-bit integers
(tests/gemm_interpreter_case.py says how), so under the interpreter the gather GEMM widens bf16
operands to fp32 first (``DOT_IN_FP32``: the same products, exactly); on the GPU it does not
(tests/gpu/test_gather_gpu.py).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch

from weavepass.runtime.cuda.gather import SLOTS
from weavepass.runtime.cuda.gemm import INTERPRETER_CONFIG, owner_row_starts
from weavepass.testing.gemm_sim import SimulatedGatherRanks

SIGNAL_ROWS = 16  # = INTERPRETER_CONFIG.block_m: several flags per owner at these sizes
# Against the fp32 product of the same rows: the kernel accumulates exact products in fp32 (another
# order than torch's fp32 mm: <= K * 2^-24 * sum |x||w|, ~1e-5 at K <= 48, ~1e-4 at K = 512) and
# rounds once to the dtype (<= half an ulp: 2^-11 relative in fp16, 2^-8 in bf16); rtol of one ulp
# covers both, atol the values near 0.
GEMM_TOL = dict(rtol=2**-10, atol=1e-4)
TOL = {torch.float16: GEMM_TOL, torch.bfloat16: dict(rtol=2**-7, atol=1e-3)}


def _draw(gen, dtype, *shape):
    return torch.randn(*shape, generator=gen).to(dtype)


def _calls(world: int, counts: list[int], hidden: int, outs: list[int], calls: int, desc: bool, parts: int,
           signal_rows: int = SIGNAL_ROWS, dtype: torch.dtype = torch.float16) -> None:
    """``calls`` back-to-back calls: new rows each call (old ones would hide a stale slot); checks every
    rank's outputs against the fp32 product, every rank equal to the bit, the slot's rows and
    residual_out rows as pushed, the flags and the call counts."""
    gen = torch.Generator().manual_seed(world * 1000 + sum(counts))
    tokens = sum(counts)
    starts = owner_row_starts(tokens, world, counts)
    capacity = max(max(counts), 1)
    sim = SimulatedGatherRanks(world, hidden, capacity, dtype, "cpu", parts=parts, signal_rows=signal_rows)
    weights = [_draw(gen, dtype, n, hidden) for n in outs]
    for call in range(1, calls + 1):
        full = _draw(gen, dtype, tokens, hidden)
        extra = _draw(gen, dtype, tokens, hidden)
        # each owner's rows, with 3 padding rows after them (FlashComm's shards are padded): never pushed
        rows = [torch.cat([full[starts[r]:starts[r + 1]], torch.full((3, hidden), 7.0, dtype=dtype)])
                for r in range(world)]
        extras = None if parts == 1 else [extra[starts[r]:starts[r + 1]].contiguous() for r in range(world)]
        got = sim.run(rows, weights, counts, extras=extras, use_descriptors=desc)
        what = f"world {world} counts {counts} call {call} desc={desc} {dtype}"
        for i, w in enumerate(weights):
            want = full.float() @ w.float().T
            for r in range(world):
                torch.testing.assert_close(got[r][i].float(), want, **TOL[dtype],
                                           msg=lambda e: f"{what} w{i} r{r}: {e}")
                assert torch.equal(got[r][i], got[0][i]), f"{what}: rank {r} differs from rank 0"
        slot = call % SLOTS
        for r, ws in enumerate(sim.workspaces):
            assert torch.equal(ws.rows(slot)[:tokens], full), f"{what}: rank {r}'s gathered rows"
            if parts == 2:
                assert torch.equal(ws.rows(slot, 1)[:tokens], extra), f"{what}: rank {r}'s residual_out rows"
            assert torch.isnan(ws.rows(slot)[tokens:]).all(), f"{what}: a push wrote past the tokens"
        assert sim.sequence_numbers() == [call] * world, (what, sim.sequence_numbers())
    for r, ws in enumerate(sim.workspaces):  # FLAG[slot][owner][b] = the last call that used the slot
        for slot in range(SLOTS):
            last = max((c for c in range(1, calls + 1) if c % SLOTS == slot), default=0)
            for j in range(world):
                blocks = -(-counts[j] // signal_rows)
                flags = ws.flags(slot)[j]
                assert flags[:blocks].tolist() == [last] * blocks, (r, slot, j, flags.tolist())
                assert not flags[blocks:].any(), f"rank {r}: a flag past owner {j}'s rows"
        lay = sim.layout  # the push's chunk counts (after the FLAG table) are back to 0
        assert not ws.pad[len(ws.pad) - lay.num_blocks:].any(), f"rank {r}: chunk counts {ws.pad.tolist()}"


def case_gather() -> None:
    """World 2, 3 and 4, ragged splits: token counts divisible neither by the world nor by the tile,
    an owner with no rows, counts not multiples of the flag's row block; two weights (the second
    releases the slot); both load paths; bf16 and fp16; three calls (both slots, the second reused)."""
    fp16, bf16 = torch.float16, torch.bfloat16
    for world, counts, desc, dtype in ((2, [21, 18], False, fp16), (2, [21, 18], True, bf16),
                                       (3, [17, 17, 5], True, fp16), (3, [0, 33, 2], False, bf16),
                                       (4, [9, 9, 9, 1], True, fp16), (4, [9, 9, 9, 1], False, bf16)):
        _calls(world, counts, hidden=40, outs=[24, 17], calls=3, desc=desc, parts=1, dtype=dtype)
    print("gather: OK")


def case_chunks() -> None:
    """Row blocks of two push chunks each (hidden 512: 16-row chunks, 32-row flags): the CTA that
    completes a block's chunks releases its flag, and the counts are back to 0 after each call."""
    from weavepass.runtime.cuda.gather import push_arguments

    meta = push_arguments(512, 2, 32)
    assert 32 // meta["CHUNK"] == 2, meta
    _calls(3, [37, 0, 30], hidden=512, outs=[24], calls=2, desc=True, parts=1, signal_rows=32)
    print("chunks: OK")


@contextlib.contextmanager
def _group_of_one() -> Iterator[str]:
    """A gloo group of one rank (its name), the entry point's symmetric allocation replaced by
    ordinary CPU tensors (its only peer is itself) and its CUDA checks by None (the CPU tensors: the
    interpreter runs the kernels)."""
    import os
    import tempfile

    import torch.distributed as dist

    from weavepass.runtime.cuda import gather_op, workspace

    def cpu_symmetric(group_name, dtype, device, numel, pad_slots):
        return workspace.SymmetricBuffer(torch.full((numel,), float("nan"), dtype=dtype),
                                         torch.zeros(pad_slots, dtype=torch.int32), [0], [0], 0, 1)

    workspace.new_symmetric = cpu_symmetric
    workspace.outside_graph_pools = lambda make, device: make()
    gather_op.unsupported_reason = lambda *args: None
    with tempfile.TemporaryDirectory() as folder:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(folder, 'store')}", rank=0, world_size=1)
        try:
            yield dist.group.WORLD.group_name
        finally:
            dist.destroy_process_group()


def case_op_entry() -> None:
    """The ``cuda_symm`` entry point (``gather_op.all_gather_matmul_cuda``) at a gloo group of one
    rank (``_group_of_one``): FlashComm's shards with padding rows (never pushed, never computed),
    two weights, the size classes (a larger shard allocates the next, a smaller one reuses the
    smallest that fits), the splits held per (tokens, rows per owner), a non-contiguous mat2 copied
    with a warning, and the portable fallback past the limit, said once."""
    import warnings

    from weavepass.runtime.cuda import gather_op

    gen = torch.Generator().manual_seed(4)
    with _group_of_one() as group:
        k = 32
        for tokens in (300, 21, 300, 600):
            per = -(-tokens // 16) * 16 + 16  # FlashComm's rows and padding past them
            shard = _draw(gen, torch.float16, per, k)
            mat2s = [_draw(gen, torch.float16, 24, k).t(), _draw(gen, torch.float16, 16, k).t()]
            got = gather_op.all_gather_matmul_cuda(shard, mat2s, group, tokens, max_workspace_tokens=1024)
            for out, mat2 in zip(got, mat2s, strict=True):
                torch.testing.assert_close(out.float(), shard[:tokens].float() @ mat2.float(), **GEMM_TOL)
        (cached,) = gather_op._WORKSPACES.values()
        assert [ws.layout.owner_capacity for ws in cached] == [512, 1024], [ws.layout.owner_capacity for ws in cached]
        assert sorted(gather_op._SPLITS) == [(21, 48, 1, None), (300, 320, 1, None), (600, 624, 1, None)]
        assert not gather_op._WARNED, gather_op._WARNED
        shard = _draw(gen, torch.float16, 64, k)
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            strided = _draw(gen, torch.float16, k, 48)[:, ::2]  # not a transposed contiguous weight
            got = gather_op.all_gather_matmul_cuda(shard, [strided], group, 50, max_workspace_tokens=1024)
            torch.testing.assert_close(got[0].float(), shard[:50].float() @ strided.float(), **GEMM_TOL)
            assert gather_op._WARNED == {"mat2"}, gather_op._WARNED
            big = _draw(gen, torch.float16, 1100, k)  # past the 1024-token limit: the portable lowering
            got = gather_op.all_gather_matmul_cuda(big, mat2s, group, 1100, max_workspace_tokens=1024)
            assert torch.equal(got[0], torch.mm(big, mat2s[0]))
            assert len(gather_op._WARNED) == 2 and any("1024-token limit" in w for w in gather_op._WARNED)
    print("op_entry: OK")


def case_op_signatures() -> None:
    """The entry point's per-signature state (``gather_op._served``) at a gloo group of one: the
    first call of a signature validates it (``unsupported_reason``, the group, the workspace, the
    split); later calls of the signature, on new rows and weights, do none of that and give what a
    validated call gives, to the bit; a signature that differs in one property (the tokens, the
    shard's rows, a weight's width, the number of weights, the dtype, the limit, the group) is
    validated anew; a call that falls back is validated every time; ``matmul.PLAN_CALLS`` off
    validates every call."""
    import warnings
    from collections import Counter

    import torch.distributed as dist

    from weavepass.runtime.cuda import gather_op, matmul

    gen = torch.Generator().manual_seed(6)
    with _group_of_one() as group:
        steps: Counter[str] = Counter()

        def counted(name, fn):
            def call(*args, **kwargs):
                steps[name] += 1
                return fn(*args, **kwargs)
            return call

        gather_op.unsupported_reason = counted("checks", gather_op.unsupported_reason)
        gather_op.resolve_group = counted("group", gather_op.resolve_group)
        gather_op.get_workspace = counted("workspace", gather_op.get_workspace)
        gather_op.owners = counted("split", gather_op.owners)
        k = 32

        def inputs(rows, widths, dtype=torch.float16):
            return _draw(gen, dtype, rows, k), [_draw(gen, dtype, n, k).t() for n in widths]

        def call(shard, mat2s, tokens, validated: bool, group_name=group, limit=1024):
            """The op's outputs, checked against the fp32 product; ``validated``: whether the call
            went through the checks, the workspace and the split (each once), else none of them."""
            before = dict(steps)
            got = gather_op.all_gather_matmul_cuda(shard, mat2s, group_name, tokens, max_workspace_tokens=limit)
            done = {name: steps[name] - before.get(name, 0) for name in steps}
            if validated:
                assert done["checks"] == done["workspace"] == done["split"] == 1 and done["group"] >= 1, done
            else:
                assert not any(done.values()), f"a call of a served signature validated again: {done}"
            for out, mat2 in zip(got, mat2s, strict=True):
                torch.testing.assert_close(out.float(), shard[:tokens].float() @ mat2.float(), **TOL[shard.dtype])
            return got

        shard, mat2s = inputs(80, (24, 16))  # 50 tokens: FlashComm's 64 rows and padding past them
        first = call(shard, mat2s, 50, validated=True)
        again = call(shard, mat2s, 50, validated=False)
        assert all(torch.equal(a, b) for a, b in zip(again, first, strict=True))
        shard, mat2s = inputs(80, (24, 16))  # new rows and weights, the same signature
        looked_up = call(shard, mat2s, 50, validated=False)
        matmul.PLAN_CALLS = False  # every call validated: the reference for the looked-up call
        checked = call(shard, mat2s, 50, validated=True)
        checked_again = call(shard, mat2s, 50, validated=True)
        matmul.PLAN_CALLS = True
        assert all(torch.equal(a, b) for a, b in zip(looked_up, checked, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(checked, checked_again, strict=True))
        assert len(gather_op._SERVED) == 1, list(gather_op._SERVED)
        other = dist.new_group([0])  # another group of the one rank: another name
        assert other.group_name != group
        for shard, mat2s, tokens, kwargs in (
                (*inputs(80, (24, 16)), 49, {}),  # the tokens
                (*inputs(96, (24, 16)), 50, {}),  # the shard's rows
                (*inputs(80, (24, 8)), 50, {}),  # a weight's width
                (*inputs(80, (24,)), 50, {}),  # the number of weights
                (*inputs(80, (24, 16), torch.bfloat16), 50, {}),  # the dtype
                (*inputs(80, (24, 16)), 50, {"limit": 2048}),  # the limit
                (*inputs(80, (24, 16)), 50, {"group_name": other.group_name})):  # the group
            call(shard, mat2s, tokens, validated=True, **kwargs)
            call(shard, mat2s, tokens, validated=False, **kwargs)
        assert len(gather_op._SERVED) == 8, list(gather_op._SERVED)
        # A strided weight of the same shape: strides are not read by the checks, the call is looked
        # up, and the weight is copied as on a validated call (warned).
        shard, _ = inputs(80, ())
        strided = [_draw(gen, torch.float16, k, 48)[:, ::2], _draw(gen, torch.float16, 16, k).t()]
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            call(shard, strided, 50, validated=False)
        assert gather_op._WARNED == {"mat2"}, gather_op._WARNED
        # Past the limit: the portable lowering, validated at every call (a fallback is not kept).
        big, mat2s = inputs(1100, (24,))
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            for _ in range(2):
                before = steps["checks"]
                got = gather_op.all_gather_matmul_cuda(big, mat2s, group, 1100, max_workspace_tokens=1024)
                assert steps["checks"] == before + 1 and torch.equal(got[0], torch.mm(big, mat2s[0]))
        (cause,) = [c for c in matmul.FALLBACKS if "1024-token limit" in c]
        assert matmul.FALLBACKS[cause] == 2 and len(gather_op._SERVED) == 8
        dist.destroy_process_group(other)
    print("op_signatures: OK")


def case_full_stream() -> None:
    """The two-part layout (the full residual stream): the residual_out rows travel with the rows."""
    _calls(3, [11, 11, 10], hidden=24, outs=[32], calls=2, desc=True, parts=2, dtype=torch.bfloat16)
    print("full_stream: OK")


def case_push_dtypes() -> None:
    """The push alone moves rows bit-exactly in bf16 and fp16 (no dot: the interpreter is exact)."""
    from weavepass.runtime.cuda.gather import push_gather_rows
    from weavepass.runtime.cuda.gemm import OwnerRows

    gen = torch.Generator().manual_seed(5)
    for dtype in (torch.bfloat16, torch.float16):
        counts = [13, 0, 12]
        sim = SimulatedGatherRanks(3, 24, 13, dtype, "cpu", signal_rows=SIGNAL_ROWS)
        owners = OwnerRows.build(25, 3, "cpu", counts)
        full = _draw(gen, dtype, 25, 24)
        for r in range(3):
            push_gather_rows(sim.workspaces[r], full[owners.rows(r)].contiguous() if counts[r] else full[:1], owners)
        for ws in sim.workspaces:
            assert torch.equal(ws.rows(1)[:25], full), dtype
    print("push_dtypes: OK")


if __name__ == "__main__":
    assert INTERPRETER_CONFIG.block_m == SIGNAL_ROWS
    {"gather": case_gather, "chunks": case_chunks, "full_stream": case_full_stream, "op_entry": case_op_entry,
     "op_signatures": case_op_signatures, "push_dtypes": case_push_dtypes}[sys.argv[1]]()
