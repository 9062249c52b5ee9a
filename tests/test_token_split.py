"""The two-way split on CPU/gloo: same answers as eager, the graph and the
generated code have the documented shape, and token counts do not multiply compiles.

On CPU the communication stream is a no-op, so these tests prove the rewrite's math and order;
tests/gpu/test_overlap_gpu.py covers the streams.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import weavepass.compile.strategies.split as token_split
from weavepass import WeaveConfig
from weavepass.backend import WeaveBackend
from weavepass.compile.reasons import Reason, ReasonCode
from weavepass.compile.wave_model import TokenSplitPlan
from weavepass.testing import ATOL, TPConfig, build_tp_model, check_against_eager, random_token_ids, spawn
from weavepass.testing.distributed import fake_process_group

# One layer (three sites) keeps Inductor's CPU compile, the cost of these tests, short.
DENSE = TPConfig(vocab=100, hidden=64, n_layers=1, n_heads=12, n_kv_heads=6, head_dim=8, intermediate=80)
MOE = TPConfig(vocab=100, hidden=64, n_layers=1, n_heads=6, n_kv_heads=6, head_dim=8, intermediate=40, n_experts=4)
MASKED = TPConfig(vocab=100, hidden=64, n_layers=1, n_heads=12, n_kv_heads=6, head_dim=8, intermediate=80,
                  explicit_mask=True)  # attention with a boolean attn_mask tensor, not is_causal
EAGER = TPConfig(vocab=100, hidden=64, n_layers=1, n_heads=12, n_kv_heads=6, head_dim=8, intermediate=80,
                 eager_attention=True)  # attention as bmm + softmax + bmm (HF's eager attention)
CONFIGS = {"dense": DENSE, "moe": MOE, "mask": MASKED, "eager": EAGER}
FORCE = WeaveConfig(split="force")
ASYNC = "weave.fused_allreduce_rmsnorm_async.default"
FUSED = "weave.fused_allreduce_rmsnorm.default"
MM = "aten.mm.default"
BMM = "aten.bmm.default"
SDPA = "aten._scaled_dot_product_flash_attention_for_cpu.default"

# (model, batch, seq, half B's share: None = the planner's cut, else "tiny" = one token/sequence)
CASES = [
    ("dense", 4, 3, None),      # several short sequences: cut between sequences
    ("moe", 1, 7, None),        # odd: one sequence cut inside, B attends to A's keys
    ("mask", 1, 13, None),      # explicit mask, one sequence cut: B's rows of the mask over all keys
    ("eager", 1, 11, None),     # bmm attention, one sequence cut: B's scores over A's and B's keys
]
CASES_WORLD_3 = [
    ("dense", 1, 2, None),      # the smallest cut: one token per half
    ("eager", 1, 5, "tiny"),    # bmm attention with a one-token half B
]
FULL_CASES = {  # the full tier's (tests/conftest.py): edges the cases above already cross
    2: [("dense", 1, 1, None),       # one token: nothing to split (fuse-only; test_scheduler plans it)
        ("dense", 1, 33, "tiny")],   # a one-token half B at the end of a long sequence
    3: [("dense", 3, 5, "tiny"),     # a one-sequence half B
        ("mask", 2, 6, None)],       # explicit [S, S] mask shared by the sequences of both halves
}


def _tiny_second_half(tokens, batch, *args, **kwargs):
    plan = _plan_split(tokens, batch, *args, **kwargs)
    step = 1 if plan.mode == "sequence" else plan.tokens // batch
    return TokenSplitPlan(plan.tokens, plan.tokens - step, plan.mode, "", False)


_plan_split = token_split.plan_split


def _compile_and_compare(rank, world, cfg_name, batch, seq, config=FORCE):
    cfg = CONFIGS[cfg_name]
    torch._dynamo.reset()
    backend = WeaveBackend(config)
    model = build_tp_model(cfg, rank, world, dist.group.WORLD)
    report = check_against_eager(
        model, random_token_ids(cfg, batch, seq, seed=batch * 100 + seq),
        lambda m: torch.compile(m, backend=backend), build_tp_model(cfg),
    )
    assert len(backend.report.graphs) == 1
    return report.max_abs_diff, backend.report.graphs[0]


def _numerics(rank, world, cases):
    results = []
    for cfg_name, batch, seq, share in cases:
        token_split.plan_split = _tiny_second_half if share == "tiny" else _plan_split
        diff, graph = _compile_and_compare(rank, world, cfg_name, batch, seq)
        results.append((diff, graph.note, graph.reasons, dict(graph.ops_before), dict(graph.ops_after)))
    token_split.plan_split = _plan_split
    return results


def _check_case(case, result):
    (cfg_name, batch, seq, share), (diff, note, reasons, before, after) = case, result
    assert diff < 1e-5, (case, diff)
    if batch * seq < 2:
        (reason,) = reasons
        too_few = Reason.of(ReasonCode.SPLIT_TOO_FEW_TOKENS, tokens=1)
        assert reason == Reason.of(ReasonCode.SPLIT_PLAN, cause=too_few), note
        assert after.get(ASYNC, 0) == 0
        return
    assert note.startswith("split"), (case, note)
    assert ("sequence" in note) == (batch == 1), note
    if share == "tiny":
        assert (f"/ B = {seq} tokens" if batch > 1 else "/ B = 1 tokens") in note, note
    sites = 2 * CONFIGS[cfg_name].n_layers + 1
    # Every site is one async fused op per half; no synchronous fused op is left.
    assert after.get(ASYNC) == 2 * sites and after.get(FUSED, 0) == 0
    # Token-wise ops exist twice: every GEMM, every attention. A cut sequence's attention is one
    # call for A and two for B (B's queries over A's keys, then over its own, merged by log-sum-exp).
    assert after[MM] == 2 * before[MM]
    if SDPA in before:
        merged = batch == 1 and cfg_name != "mask"
        assert after[SDPA] == (3 if merged else 2) * before[SDPA], (case, after[SDPA])
    if BMM in before:  # q @ k^T and probabilities @ v, once per half
        assert after[BMM] == 2 * before[BMM] == 4 * CONFIGS[cfg_name].n_layers, (case, after[BMM])
    # One join per async op (both outputs and the inputs), and no wait_tensor of the split's.
    assert after["weave.join_async.default"] == 2 * sites, after
    assert after.get("_c10d_functional.wait_tensor.default", 0) == 0, after


FULL_SPLIT = pytest.mark.full(covered_by="the CI cases of test_split_matches_eager (the same cuts on other shapes)")


@pytest.mark.parametrize("world_size,tier", [(2, "ci"), (3, "ci"),
                                             pytest.param(2, "full", marks=FULL_SPLIT),
                                             pytest.param(3, "full", marks=FULL_SPLIT)])
def test_split_matches_eager(world_size, tier):
    cases = FULL_CASES[world_size] if tier == "full" else CASES if world_size == 2 else CASES_WORLD_3
    results = spawn(_numerics, world_size, "gloo", cases)
    for rank_results in results:
        for case, result in zip(cases, rank_results):
            _check_case(case, result)


def _push_numerics(rank, world):
    diff, graph = _compile_and_compare(rank, world, "dense", 1, 9, WeaveConfig(split="force", split_comm="push"))
    return diff, graph.note, dict(graph.ops_after)


def test_push_variant_matches_eager_on_cpu():
    """``split_comm="push"`` on gloo: off CUDA the push op is the plain fused op, so the numbers
    are those of the fused split (same tolerance), and every site is a push op."""
    for diff, note, after in spawn(_push_numerics, 2, "gloo"):
        assert diff < 1e-5, (diff, note)  # as the fused split's cases (test_split_matches_eager)
        assert note.startswith("split (sequence)") and "communication: push" in note, note
        assert after.get("weave.fused_allreduce_rmsnorm_push_async.default") == 2 * 3, after
        assert after.get(ASYNC, 0) == 0


def _generated_code(rank, world):
    from torch._inductor.utils import run_and_get_code

    model = build_tp_model(DENSE, rank, world, dist.group.WORLD)
    with torch.no_grad():  # the backend itself applies split.inductor_config_patches()
        _, code = run_and_get_code(torch.compile(model, backend=WeaveBackend(FORCE)), random_token_ids(DENSE, 1, 9))
    return code[0]


@pytest.fixture(scope="module")
def generated_code() -> str:
    code = spawn(_generated_code, 2)[0]
    return code[code.index("def call("):]


def test_generated_code_interleaves_halves(generated_code):
    """Inductor keeps the schedule: A's fused op, B's compute, B's fused op, then A's next compute
    after a wait, for every site (cut 4 / 5 tokens: the halves are told apart by their rows)."""
    body = generated_code
    events = []
    for line in body.splitlines():
        fused = re.search(
            r"extern_kernels\.weave_fused_allreduce_rmsnorm_async\(reinterpret_tensor\(\w+, \(1, (\d), 64\)", line)
        if fused:
            events.append("A" if fused.group(1) == "4" else "B")
        elif "extern_kernels.mm(" in line:
            events.append("mm")
        elif "join_async" in line:
            events.append("join")
    fused = [e for e in events if e in "AB"]
    assert fused == ["A", "B"] * 3, fused
    # Between A's fused op and B's at the same site, B computes (its GEMMs run while A
    # communicates); the only waits there are for B's own previous site.
    a_positions = [i for i, e in enumerate(events) if e == "A"]
    b_positions = [i for i, e in enumerate(events) if e == "B"]
    for a, b in list(zip(a_positions, b_positions))[1:]:
        assert "mm" in events[a:b], events[a:b]
    assert "extern_kernels.weave_fused_allreduce_rmsnorm(" not in body  # every fused op is split
    assert not re.search(r"torch\.ops\.weave\.\w+\.default\(", body)  # direct calls only (direct_calls)


def _top_level_args(call: str) -> list[str]:
    """The arguments of the first call in ``call`` (text), split at top-level commas."""
    args, depth, current = [], 0, ""
    for char in call[call.index("(") + 1:]:
        if char in "([":
            depth += 1
        elif char in ")]":
            if depth == 0:
                break
            depth -= 1
        if char == "," and depth == 0:
            args.append(current.strip())
            current = ""
        else:
            current += char
    return args + [current.strip()]


def test_generated_code_keeps_async_inputs_until_the_join(generated_code):
    """The communication stream reads an async op's partial and residual after the op returns, so
    Inductor must neither free nor reuse their buffers (``del bufN``, ``bufM = bufN; del bufN  #
    reuse``) before the join that makes the compute stream wait for it; and nothing may read the op's
    outputs before that join. ``join_async(normed, residual_out, [partial, residual])`` is the inputs'
    last reader and, declared to mutate both outputs, the first thing that touches them. Without
    such a reader, Inductor's CUDA-graph partitions reused a partial's buffer for the next GEMM
    (wrong answers under mode="reduce-overhead" on 2 x H200); here on CPU, the partial of every op
    was ``del``-ed on the line after the op."""
    lines = generated_code.splitlines()
    calls = [i for i, line in enumerate(lines) if "extern_kernels.weave_fused_allreduce_rmsnorm_async(" in line]
    assert len(calls) == 2 * 3, len(calls)
    for i in calls:
        args = [arg for arg in _top_level_args(lines[i])[:2] if "buf" in arg]  # partial, residual
        inputs = {name for arg in args for name in re.findall(r"\bbuf\d+\b", arg)}
        assert inputs, lines[i]
        result = re.match(r"\s*(buf\d+) = ", lines[i]).group(1)
        outputs = [m.group(1) for line in lines[i + 1:i + 12]
                   if (m := re.match(rf"\s*(buf\d+) = {result}\[[01]\]", line))]
        assert len(outputs) == 2, (lines[i].strip(), outputs)
        joins = [j for j in range(i + 1, len(lines)) if "extern_kernels.weave_join_async(" in lines[j]
                 and _top_level_args(lines[j])[:2] == outputs]
        assert len(joins) == 1, f"not one join_async of {outputs} after: {lines[i].strip()}"
        join = joins[0]
        assert all(arg in _top_level_args(lines[join])[2] for arg in args), (args, lines[join].strip())
        released = [lines[j].strip() for j in range(i + 1, join) for name in inputs
                    if re.search(rf"\bdel {name}\b", lines[j])]
        assert not released, (lines[i].strip(), released)
        checks = re.compile(rf"\s*(#|assert_size_stride\(|assert_alignment\(|(\w+) = {result}\[[01]\])")
        early = [lines[j].strip() for j in range(i + 1, join) for name in outputs
                 if re.search(rf"\b{name}\b", lines[j]) and not checks.match(lines[j])]
        assert not early, (lines[i].strip(), early)  # no read of an output before its join


def _recompiles(rank, world, sizes):
    torch._dynamo.reset()
    backend = WeaveBackend(FORCE)
    model = build_tp_model(DENSE, rank, world, dist.group.WORLD)
    compiled = torch.compile(model, backend=backend)
    worst = 0.0  # a NaN difference counts as inf: max(0.0, nan) is 0.0
    for seq in sizes:
        ids = random_token_ids(DENSE, 1, seq, seed=seq)
        with torch.no_grad():
            worst = max(worst, (compiled(ids) - model(ids)).abs().max().nan_to_num(torch.inf).item())
    return len(backend.report.graphs), [g.note for g in backend.report.graphs], worst


def test_token_counts_do_not_multiply_compiles():
    """20 token counts: one static compile for the first, one symbolic for every other (automatic
    dynamic shapes); the symbolic graph computes the cut at run time, so sizes add no guard."""
    sizes = [5, 6, 7, 9, 11, 13, 16, 17, 23, 29, 31, 32, 40, 47, 50, 63, 64, 70, 97, 300]
    compiles, notes, worst = spawn(_recompiles, 2, "gloo", sizes)[0]
    assert compiles <= 2, notes
    assert worst < 1e-5
    assert notes[0].startswith("split"), notes
    assert "run time from the symbolic size" in notes[-1], notes


def _int_valued_nodes(graph) -> list[str]:
    """Nodes whose value is a plain int: Inductor's fake-tensor update after the post-grad passes
    rejects them (seen with torch 2.11 on CUDA)."""
    return [n.name for n in graph.nodes if type(n.meta.get("val")) is int]


def _auto_threshold(rank, world, sizes, low=24, high=45):
    torch._dynamo.reset()
    backend = WeaveBackend(WeaveConfig(split="auto", split_min_tokens=low, split_min_tokens_moe=low,
                                       split_max_tokens=high))
    model = build_tp_model(DENSE, rank, world, dist.group.WORLD)
    int_nodes = []
    compiled = torch.compile(model, backend=backend,
                             options={"post_grad_custom_post_pass": lambda g: int_nodes.extend(_int_valued_nodes(g))})
    worst, graphs_after = 0.0, []
    for seq in sizes:
        ids = random_token_ids(DENSE, 1, seq, seed=seq)
        with torch.no_grad():
            worst = max(worst, (compiled(ids) - model(ids)).abs().max().nan_to_num(torch.inf).item())
        graphs_after.append(len(backend.report.graphs))
    assert not int_nodes, int_nodes
    return graphs_after, [g.note for g in backend.report.graphs], worst, [g.reasons for g in backend.report.graphs]


def test_auto_threshold_is_a_guard_on_symbolic_sizes():
    """split="auto" on a dynamic graph: the window [24, 45] is compared as guards, so a graph
    split for one batch never serves a batch outside the window. Sizes crossing both bounds make
    four compiles (static 5; symbolic below; inside; above), and no more after that."""
    sizes = [5, 9, 13, 30, 40, 17, 50, 8, 24, 23, 45, 46, 60]
    graphs_after, notes, worst, reasons = spawn(_auto_threshold, 2, "gloo", sizes)[0]
    assert worst < 1e-5
    assert graphs_after == [1, 2, 2, 3, 3, 3, 4, 4, 4, 4, 4, 4, 4], (graphs_after, notes)
    below, above = ReasonCode.SPLIT_BELOW_WINDOW, ReasonCode.SPLIT_ABOVE_WINDOW
    (static,), (symbolic_below,), (), (symbolic_above,) = reasons  # one decline per graph, none when split
    assert static.find(below) == Reason.of(below, tokens=5, low=24, kind="dense"), notes
    assert symbolic_below.find(below) == Reason.of(below, tokens=None, low=24, kind="dense"), notes  # a guard
    assert notes[2].startswith("split") and "run time" in notes[2], notes
    assert symbolic_above.find(above) == Reason.of(above, tokens=None, high=45), notes


def _one_size_window(rank, world):
    """The default-style window of one size: dynamic sizes (automatic dynamic after the second
    call) are never split and keep one graph; a static compile at exactly that size splits."""
    graphs_after, notes, worst, reasons = _auto_threshold(rank, world, [5, 9, 32, 40, 31], 32, 32)
    torch._dynamo.reset()
    backend = WeaveBackend(WeaveConfig(split="auto", split_min_tokens=32, split_min_tokens_moe=32,
                                       split_max_tokens=32))
    model = build_tp_model(DENSE, rank, world, dist.group.WORLD)
    ids = random_token_ids(DENSE, 1, 32, seed=32)
    with torch.no_grad():
        got = torch.compile(model, backend=backend, dynamic=False)(ids)
        worst = max(worst, (got - model(ids)).abs().max().nan_to_num(torch.inf).item())
    return graphs_after, notes, worst, reasons, backend.report.graphs[0].note


def test_auto_window_of_one_size():
    """split="auto" with split_min_tokens == split_max_tokens (the defaults). Guards for a
    one-size window would pin a dynamic token count to that size (a ConstraintViolationError for
    ``mark_dynamic`` inputs, seen on 2 H200s), so a symbolic count is not split and is not guarded:
    one graph serves 9, 32, 40 and 31 tokens. A static batch of exactly the size is split."""
    graphs_after, notes, worst, reasons, static_note = spawn(_one_size_window, 2)[0]
    assert worst < 1e-5
    assert graphs_after == [1, 2, 2, 2, 2], (graphs_after, notes)
    (pinned,) = reasons[1]
    assert pinned.find(ReasonCode.SPLIT_WINDOW_PINS_SIZE) == Reason.of(ReasonCode.SPLIT_WINDOW_PINS_SIZE, low=32,
                                                                       kind="dense"), notes
    assert static_note.startswith("split"), static_note


class _TokenMixer(torch.nn.Module):
    """Two sites with a cumulative sum over the tokens between them: not splittable."""

    def __init__(self, hidden: int):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(hidden, hidden) / hidden**0.5, requires_grad=False)

    def forward(self, x):
        h = funcol.all_reduce(x, "sum", dist.group.WORLD)
        y = torch.nn.functional.rms_norm(h, (x.shape[-1],), eps=1e-6)
        y = torch.cumsum(y @ self.w, dim=1)
        h = h + funcol.all_reduce(y, "sum", dist.group.WORLD)
        return torch.nn.functional.rms_norm(h, (x.shape[-1],), eps=1e-6)


def _token_mixer(rank, world):
    torch.manual_seed(0)
    model, x = _TokenMixer(16), torch.randn(1, 6, 16)
    backend = WeaveBackend(FORCE)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model, backend=backend)(x), model(x))
    auto = WeaveBackend(WeaveConfig(split="auto", split_min_tokens=1024))
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(build_tp_model(DENSE, rank, world, dist.group.WORLD), backend=auto)(random_token_ids(DENSE, 1, 9))
    forced, auto_graph = backend.report.graphs[0], auto.report.graphs[0]
    return forced.reasons, dict(forced.ops_after), auto_graph.reasons


def test_unsupported_op_and_small_batches_stay_fuse_only():
    (reason,), after, (auto_reason,) = spawn(_token_mixer, 2)[0]
    assert reason.code is ReasonCode.SPLIT_NOT_POSSIBLE, reason
    assert reason.field("cause").code is ReasonCode.SPLIT_ALONG_TOKEN_DIM and reason.field("cause").field(
        "op") == "cumsum.default", reason
    assert after.get(ASYNC, 0) == 0 and after.get(FUSED) == 2
    assert auto_reason.code is ReasonCode.SPLIT_PLAN and auto_reason.field("cause").code is (
        ReasonCode.SPLIT_BELOW_WINDOW) and auto_reason.field("cause").field("low") == 1024, auto_reason


def _heads_view_model(x, w_in, w_heads, w_out, weight):
    """Two sites with Hugging Face's attention views between them: ``view(*tokens, -1, head_dim)``
    and ``reshape(*tokens, -1)`` leave a non-token size to inference."""
    h = funcol.all_reduce(x @ w_in, "sum", dist.group.WORLD)
    y = torch.nn.functional.rms_norm(h, (h.shape[-1],), eps=1e-6)
    heads = (y @ w_heads).view(*y.shape[:-1], -1, 8)
    heads = torch.softmax(heads, dim=-1)
    h = h + funcol.all_reduce(heads.reshape(*y.shape[:-1], -1) @ w_out, "sum", dist.group.WORLD)
    return torch.nn.functional.rms_norm(h, (h.shape[-1],), eps=1e-6)


def _split_on_fake_group(fn, args):
    """``fn`` compiled with the split forced on a fake group of 2 (graph only: no sums are computed);
    returns its one graph's report, which must say the split applied."""
    backend = WeaveBackend(FORCE)
    with fake_process_group(2), torch.no_grad():
        torch._dynamo.reset()
        torch.compile(fn, backend=backend, fullgraph=True)(*args)
    (graph,) = backend.report.graphs
    assert graph.note.startswith("split"), graph.note
    return graph


@pytest.mark.parametrize("batch", [1, 3])
def test_views_that_infer_a_non_token_size(batch):
    """A view may infer one size: the split writes ``-1`` at the token dim of each half's view, so
    a ``-1`` the model wrote elsewhere is replaced by its (static) size. HF Llama's q/k/v views
    crashed the compile with "only one dimension can be inferred" before. Graph only (a fake group
    computes no sums); the numbers are tested on HF Llama in tests/test_hf_models.py."""
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(batch, 7, 16, generator=g), torch.randn(16, 32, generator=g),
            torch.randn(32, 32, generator=g) / 6, torch.randn(32, 32, generator=g) / 6, None]
    graph = _split_on_fake_group(_heads_view_model, args)
    assert graph.ops_after[ASYNC] == 4 and graph.ops_after.get(FUSED, 0) == 0
    assert graph.ops_after[MM] == 1 + 2 * 2  # x @ w_in stays before the first site; the rest per half


def _biased_projection_model(x, w_in, w_qkv, bias, w_out):
    """Two sites with a biased linear between them (Qwen2's q/k/v): ``addmm(bias, rows, w)``."""
    h = funcol.all_reduce(x @ w_in, "sum", dist.group.WORLD)
    y = torch.nn.functional.rms_norm(h, (h.shape[-1],), eps=1e-6)
    qkv = torch.nn.functional.linear(y, w_qkv, bias)
    h = h + funcol.all_reduce(torch.relu(qkv) @ w_out, "sum", dist.group.WORLD)
    return torch.nn.functional.rms_norm(h, (h.shape[-1],), eps=1e-6)


def test_biased_linear_between_sites_is_split():
    """``addmm``'s first argument is the bias: the rule for it must not require tokens there (the
    split refused Qwen2 with "token tensor in an unsupported argument position")."""
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(1, 7, 16, generator=g), torch.randn(16, 32, generator=g),
            torch.randn(48, 32, generator=g), torch.randn(48, generator=g), torch.randn(48, 32, generator=g)]
    graph = _split_on_fake_group(_biased_projection_model, args)
    assert graph.ops_after["aten.addmm.default"] == 2 * graph.ops_before["aten.addmm.default"]


def _masked_attention_model(x, w_in, w_qkv, w_out, mask, form):
    """Two sites with attention between them whose mask is an input: SDPA with a boolean mask
    (``form="sdpa"``), or Hugging Face's eager attention (``bmm`` + mask + softmax + ``bmm``) with
    the mask added (``"additive"``), as ``where(mask, scores, low)`` (``"where"``: True shows a key)
    or as ``masked_fill(mask, low)`` (``"masked_fill"``: True hides a key; Inductor decomposes it to
    ``where(mask, low, scores)``)."""
    h = funcol.all_reduce(x @ w_in, "sum", dist.group.WORLD)
    y = torch.nn.functional.rms_norm(h, (h.shape[-1],), eps=1e-6)
    heads = (y @ w_qkv).view(*y.shape[:-1], -1, 8).transpose(1, 2)  # [B, 2, T, 8]
    if form == "sdpa":
        out = torch.nn.functional.scaled_dot_product_attention(heads, heads, heads, attn_mask=mask)
    else:
        scores = heads @ heads.transpose(2, 3) * 8**-0.5
        low = torch.finfo(scores.dtype).min
        if form == "additive":
            scores = scores + mask
        elif form == "where":
            scores = torch.where(mask, scores, low)
        else:
            scores = scores.masked_fill(mask, low)
        out = torch.softmax(scores, dim=-1) @ heads
    h = h + funcol.all_reduce(out.transpose(1, 2).reshape(*y.shape[:-1], -1) @ w_out, "sum", dist.group.WORLD)
    return torch.nn.functional.rms_norm(h, (h.shape[-1],), eps=1e-6)


@pytest.mark.parametrize("form", ["sdpa", "additive", "where", "masked_fill"])
def test_a_mask_that_shows_keys_after_the_cut_stops_the_run(form):
    """Half A runs before half B's keys exist, so a sequence cut is right only for masks that hide
    every key after the cut from every query before it. The mask is an input: the split asserts that
    at run time (once per mask), so a bidirectional mask stops the run with a message instead of a
    wrong answer, and a causal one passes. ``masked_fill``'s condition hides where it is True: the
    check read it as where()'s (False hides) before, so a bidirectional mask ran (a wrong answer)
    and a causal one stopped. Graph only (a fake group computes no sums)."""
    seq = 7
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(1, seq, 16, generator=g), torch.randn(16, 16, generator=g),
            torch.randn(16, 16, generator=g) / 4, torch.randn(16, 16, generator=g) / 4]
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    everything = torch.ones(seq, seq, dtype=torch.bool)
    if form == "additive":  # Hugging Face's additive form: the dtype's lowest value where a key is hidden
        low = torch.finfo(torch.float32).min
        causal, everything = (torch.zeros(seq, seq).masked_fill(~m, low) for m in (causal, everything))
    elif form == "masked_fill":  # True where a key is hidden
        causal, everything = ~causal, ~everything
    backend = WeaveBackend(FORCE)
    fn = torch.compile(_masked_attention_model, backend=backend, fullgraph=True)
    with fake_process_group(2), torch.no_grad():
        torch._dynamo.reset()
        fn(*args, causal, form)
        (graph,) = backend.report.graphs
        assert graph.note.startswith("split (sequence)"), graph.note
        assert graph.ops_after["aten._assert_async.msg"] == 1
        with pytest.raises(RuntimeError, match="bidirectional attention"):
            fn(*args, everything, form)


def _zero_filled_attention_model(x, w_in, w_qkv, w_out, mask):
    """``_masked_attention_model``'s eager attention with ``where(mask, scores, 0)``: a False
    element scores 0, which the softmax still weighs, so no mask value hides a key."""
    h = funcol.all_reduce(x @ w_in, "sum", dist.group.WORLD)
    y = torch.nn.functional.rms_norm(h, (h.shape[-1],), eps=1e-6)
    heads = (y @ w_qkv).view(*y.shape[:-1], -1, 8).transpose(1, 2)
    scores = torch.where(mask, heads @ heads.transpose(2, 3) * 8**-0.5, 0.0)
    out = torch.softmax(scores, dim=-1) @ heads
    h = h + funcol.all_reduce(out.transpose(1, 2).reshape(*y.shape[:-1], -1) @ w_out, "sum", dist.group.WORLD)
    return torch.nn.functional.rms_norm(h, (h.shape[-1],), eps=1e-6)


def test_a_where_mask_that_cannot_hide_a_key_is_refused():
    """``where(mask, scores, 0)`` hides no key whatever the mask holds, so half A leaving out B's
    keys would answer wrong even for a causal mask (it ran before, and the check passed): the split
    refuses it at compile time, with a reason."""
    seq = 7
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(1, seq, 16, generator=g), torch.randn(16, 16, generator=g),
            torch.randn(16, 16, generator=g) / 4, torch.randn(16, 16, generator=g) / 4,
            torch.ones(seq, seq, dtype=torch.bool).tril()]
    backend = WeaveBackend(FORCE)
    with fake_process_group(2), torch.no_grad():
        torch._dynamo.reset()
        torch.compile(_zero_filled_attention_model, backend=backend, fullgraph=True)(*args)
    (graph,) = backend.report.graphs
    (reason,) = graph.reasons
    assert reason.code is ReasonCode.SPLIT_NOT_POSSIBLE, graph.note
    assert reason.field("cause").code is ReasonCode.SPLIT_KEYS_NOT_MASK, graph.note


def _routed_model(x, w_in, router, w_up, w_down):
    """Two sites around a Hugging Face style MoE block (``weavepass.testing.routing``; fp32 through
    transformers' grouped-matmul fallback) whose rows go back onto their tokens by ``index_add``
    (Inductor: ``index_put(full(0), [perm // k], rows, accumulate=True)``). The inverse-permutation
    form HF uses is checked on HF's MoE families in tests/test_hf_models.py."""
    from weavepass.testing import routing

    h = funcol.all_reduce(x @ w_in, "sum", dist.group.WORLD)
    y = torch.nn.functional.rms_norm(h, (h.shape[-1],), eps=1e-6).view(-1, h.shape[-1])
    _, perm, weights, offsets = routing.route(y, router, 2)
    rows = routing.experts(y, perm, offsets, w_up, w_down, 2, torch.ops.transformers.grouped_mm_fallback)
    moe = torch.zeros_like(y).index_add(0, perm // 2, rows * weights.unsqueeze(-1))
    h = h + funcol.all_reduce(moe.view(h.shape) / dist.get_world_size(), "sum", dist.group.WORLD)
    return torch.nn.functional.rms_norm(h, (h.shape[-1],), eps=1e-6)


def _routed_numerics(rank, world):
    import transformers.integrations.moe  # noqa: F401  (registers transformers::grouped_mm_fallback)

    from weavepass.testing import routing

    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(64, 64, generator=g) / 8, *routing.moe_weights(64, 48, 4, g)]
    x = torch.randn(1, 11, 64, generator=torch.Generator().manual_seed(rank))
    backend = WeaveBackend(FORCE)
    with torch.no_grad():
        eager = _routed_model(x, *weights)
        compiled = torch.compile(_routed_model, backend=backend, fullgraph=True)(x, *weights)
    (graph,) = backend.report.graphs
    return graph.note, dict(graph.ops_after), (compiled - eager).abs().max().item()


def test_moe_routing_block_split_matches_eager():
    """A routing block that sorts the token-expert pairs by expert runs once per half, with the
    half's own sort, counts, offsets and ``full``/``index_put`` sized for the half, and gives every
    token eager's answer (fp32: ``ATOL``)."""
    pytest.importorskip("transformers")
    for note, after, diff in spawn(_routed_numerics, 2):
        assert note.startswith("split (sequence): A = 5 / B = 6 tokens"), note
        assert after[ASYNC] == 4 and after["aten.sort.default"] == after["aten.histc.default"] == 2, after
        assert after["transformers.grouped_mm_fallback.default"] == 4 and after["aten.full.default"] == 2, after
        assert diff <= ATOL[torch.float32], diff


@pytest.mark.parametrize("form", ["sdpa", "additive"])
def test_auto_does_not_cut_a_sequence_whose_mask_is_an_input(form):
    """With ``split="auto"`` a sequence is not cut where attention takes an input mask: a
    bidirectional one would stop the run (on CUDA a device-side assertion ends the process), and
    ``auto`` must never make a model fail where it ran before; the note says why. Between sequences
    (batch mode) the mask's rows are sliced with them and nothing is checked at run time, so ``auto``
    splits there. Graph only (fake group)."""
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(16, 16, generator=g), torch.randn(16, 16, generator=g) / 4,
               torch.randn(16, 16, generator=g) / 4]
    auto = WeaveConfig(split="auto", split_min_tokens=2, split_min_tokens_moe=2, split_max_tokens=64)
    for batch, seq, codes in ((1, 7, [ReasonCode.SPLIT_RUN_TIME_MASK]), (4, 5, [])):
        mask = torch.ones(seq, seq, dtype=torch.bool).tril()
        if form == "additive":
            mask = torch.zeros(seq, seq).masked_fill(~mask, torch.finfo(torch.float32).min)
        backend = WeaveBackend(auto)
        fn = torch.compile(_masked_attention_model, backend=backend, fullgraph=True)
        with fake_process_group(2), torch.no_grad():
            torch._dynamo.reset()
            fn(torch.randn(batch, seq, 16, generator=g), *weights, mask, form)
        (graph,) = backend.report.graphs
        assert graph.codes == codes, graph.note
        if batch == 1:
            assert graph.ops_after.get(ASYNC, 0) == 0 and graph.ops_after.get("aten._assert_async.msg", 0) == 0
        else:
            assert graph.note.startswith("split (batch)"), graph.note
            assert graph.ops_after[ASYNC] == 4 and graph.ops_after.get("aten._assert_async.msg", 0) == 0


@pytest.mark.parametrize("config,expected", [
    (FORCE, False),  # the split: no shape padding (a per-GPU benchmark would decide the pads)
    (WeaveConfig(split="off"), None),  # fuse-only: Inductor's own setting, untouched
])
def test_shape_padding_is_off_while_a_split_graph_is_rewritten(monkeypatch, config, expected):
    """Inductor's ``pad_mm`` pads a matmul's token rows when a benchmark on the GPU finds it faster:
    then the graph the split sees depends on a timing, which can differ between ranks, and the split
    refused it ("no rule for constant_pad_nd": 2 ranks sharing one H200, 257 tokens). ``pad_mm``
    runs on CUDA only, so here the check is that ``shape_padding`` is off in the compile that runs
    the weave pass (the config patch reaches the joint-graph passes before it)."""
    import torch._inductor.config as inductor_config

    from weavepass.compile.graph_pass import WeavePass

    seen = []
    original = WeavePass.__call__

    def spy(self, graph):
        seen.append(inductor_config.shape_padding)
        return original(self, graph)

    monkeypatch.setattr(WeavePass, "__call__", spy)
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(1, 7, 16, generator=g), torch.randn(16, 32, generator=g),
            torch.randn(32, 32, generator=g) / 6, torch.randn(32, 32, generator=g) / 6, None]
    backend = WeaveBackend(config)
    with fake_process_group(2), torch.no_grad():
        torch._dynamo.reset()
        torch.compile(_heads_view_model, backend=backend, fullgraph=True)(*args)
    assert seen, "the weave pass did not run"
    want = inductor_config.shape_padding if expected is None else expected
    assert seen == [want] * len(seen), seen
