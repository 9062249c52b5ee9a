"""Hugging Face models loaded with their own tensor-parallel plan, compiled with the weave backend.

Tiny random checkpoints of every family that ships a ``base_model_tp_plan``
(``weavepass/testing/hf_models.py``) are loaded with ``from_pretrained(..., tp_plan="auto")`` on a
gloo group of 2 and compiled fuse-only (the default), with the split forced and with
FlashComm forced. Per family and strategy the test asserts what a user reads in the explain
report: how many all_reduces were fused, the reason for each one kept, the graph-wide note, and
that the compiled graphs equal the eager ones (fp32: ``ATOL[float32]`` relative to the output).

``test_generation_with_a_static_cache`` runs greedy ``generate`` with a static cache on Llama,
compiled, against eager, and counts the graphs Dynamo compiles.

One spawned pair of ranks serves every family (spawn, load and Dynamo trace cost seconds each; the
results come back to this process and the assertions are parametrized over them). CI runs
``CI_FAMILIES``; ``WEAVE_TEST_FULL=1`` runs every family here (``bash scripts/test_hf_full.sh`` sweeps
every family of the installed transformers, without these per-cell expectations: docs/models.md).

The expectations were observed with transformers 5.24: a family's TP plan may differ in other
versions (5.24 shards Phi3's and OLMo2's projections with gathers, GPT-OSS only its embedding).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from weavepass.compile.reasons import ReasonCode  # noqa: E402
from weavepass.report import WeaveReport  # noqa: E402
from weavepass.testing import ATOL, spawn  # noqa: E402
from weavepass.testing import hf_models as hf  # noqa: E402

SPLIT = "split (sequence)"
FLASHCOMM = "FlashComm (portable): 9 tokens padded to 32"
AR = "_c10d_functional.all_reduce.default"
NO_STREAM = ReasonCode.NO_RESIDUAL_ADD


@dataclass(frozen=True)
class Expected:
    """What one family's explain report says, per strategy."""

    fused: int
    kept: tuple[ReasonCode, ...] = ()
    """per all_reduce kept, in graph order: a code of its reason (its own or one it carries)"""
    split: str | ReasonCode = SPLIT
    """with the split forced: a substring of the graph note (used), or the code of its decline"""
    flashcomm: str | ReasonCode = FLASHCOMM
    """with FlashComm forced: a substring of the graph note (used), or the code of its decline"""
    merged: int = 0
    """all_reduces whose sum another site's collective carries (no record of their own)"""


# Two layers: 2 sites each + the embedding's (MoE families: the experts' sum is a site too).
EXPECTED: dict[str, Expected] = {
    "llama": Expected(5),
    "mistral": Expected(5),
    "qwen2": Expected(5),
    "qwen3": Expected(5),
    # Gemma scales the embedding sum by sqrt(hidden); Granite every sum by its multipliers.
    "gemma": Expected(5),
    # Gemma2/3 and OLMo2 norm the branch before the residual add (sandwich / post-norm): their
    # sites have no residual add, and FlashComm needs one to keep the stream sharded.
    "gemma2": Expected(5, flashcomm=NO_STREAM),
    "gemma3": Expected(5, flashcomm=NO_STREAM),
    "phi3": Expected(5),
    # Post-norm: the embedding's sum is read by the first layer's projections, never normed.
    "olmo2": Expected(4, (ReasonCode.POST_NORM_SUM,), flashcomm=NO_STREAM),
    "olmo3": Expected(4, (ReasonCode.POST_NORM_SUM,), flashcomm=NO_STREAM),
    "exaone4": Expected(4, (ReasonCode.POST_NORM_SUM,), flashcomm=NO_STREAM),
    "granite": Expected(5),
    # Attention and MLP in parallel, then a LayerNorm: (residual + attn) + mlp -> one all_reduce
    # of both partials per layer (5 all_reduces, 3 LayerNorm sites).
    "cohere": Expected(3, merged=2),
    "mixtral": Expected(5),
    # The replicated shared expert is added to the experts' sum before the residual add: it moves
    # onto the residual (before the op); FlashComm adds its rows of the shard to the carried stream.
    "qwen2_moe": Expected(5),
    "qwen3_moe": Expected(5),
    # The routed and the shared experts' all_reduces are summed before the residual add: one
    # collective carries both (4 all_reduces, 3 sites). Attention is not sharded (5.24's plan), so
    # the MLP's residual is not the embedding's stream value.
    "deepseek_v3": Expected(3, merged=1, flashcomm=ReasonCode.STREAM_BROKEN),
    "gpt_oss": Expected(1, split=ReasonCode.SPLIT_ONE_SITE),
    # Biased row-parallel layers: the replicated bias rows move onto the residual. StarCoder2 adds
    # each layer's sum to the stream in turn; GPT-NeoX, GPT-J, CodeGen and Phi run attention and MLP
    # in parallel: one all_reduce of both partials per layer (5 all_reduces, 3 LayerNorm sites).
    "starcoder2": Expected(5),
    "gpt_neox": Expected(3, merged=2),
    "gptj": Expected(3, merged=2),
    "codegen": Expected(3, merged=2),
    "phi": Expected(3, merged=2),
    # MiniMax: the experts' [T, H] sum, viewed as [B, S, H], then ``residual * alpha + h * beta``;
    # its scaled residual is not the stream (FlashComm), and its lightning attention's bmm has no
    # split rule.
    "minimax": Expected(4, split=ReasonCode.SPLIT_NOT_POSSIBLE, flashcomm=ReasonCode.STREAM_BROKEN),
    # Llama4: the routed experts' all_reduce, summed over experts, joins the shared expert's
    # (7 all_reduces, 5 sites); its rotary embedding (view_as_complex) has no split rule.
    "llama4": Expected(5, merged=2, split=ReasonCode.SPLIT_NOT_POSSIBLE),
    # Qwen3-Next: the shared expert's sum, gated per token by sigmoid(gate(h)), joins the routed
    # experts' all_reduce (6 all_reduces, 4 sites). GraniteMoeHybrid: (experts + shared MLP) *
    # residual_multiplier, the scale distributed over both. Both hybrids' linear-attention / Mamba
    # layers (a causal conv1d) have no split rule; the MoE layer's residual is not the stream.
    "qwen3_next": Expected(4, merged=2, split=ReasonCode.SPLIT_NOT_POSSIBLE, flashcomm=ReasonCode.STREAM_BROKEN),
    "granitemoehybrid": Expected(3, split=ReasonCode.SPLIT_NOT_POSSIBLE, flashcomm=ReasonCode.STREAM_BROKEN),
}
assert set(EXPECTED) == set(hf.FAMILIES)

CI_FAMILIES = ("llama", "gemma3", "granite", "cohere", "qwen2_moe", "deepseek_v3", "gpt_neox", "olmo2",
               "granitemoehybrid")
CI_STRATEGIES = {
    "llama": ("fuse", "split", "flashcomm"),  # the family most users serve: every strategy
    "gemma3": ("flashcomm",),  # sites without a residual add: FlashComm's refusal, then fuse-only
    "granite": ("fuse",),  # every sum scaled (Gemma scales only the embedding's); and bf16
    "cohere": ("split",),  # LayerNorm sites, merged parallel branches, split; and bf16 (fuse-only)
    "qwen2_moe": ("split", "flashcomm"),  # MoE routing per half; the shared expert
    "deepseek_v3": ("flashcomm",),  # merged routed + shared sums; FlashComm's refusal, then fuse-only
    "gpt_neox": ("flashcomm",),  # biased parallel branches in one all_reduce, LayerNorm, FlashComm
    "olmo2": ("fuse",),  # post-norm: the embedding's sum is never normed (POST_NORM_SUM)
    "granitemoehybrid": ("fuse",),  # a Mamba hybrid; its MoE output scaled (distributed over 2 terms)
}
"""The strategies CI compiles per family: each family's distinct case (the comments), the rest of
the grid is ``WEAVE_TEST_FULL=1``'s. A refused FlashComm compiles fuse-only, and test_family checks
the fused count of every run, so those families' fuse-only runs would repeat it. Every compile
costs ~10 s of the 2-core CI machine."""
BF16_FAMILIES = ("gemma", "granite", "cohere")
"""Also run in bf16 (fuse-only, against the fp32 model): Gemma's and Granite's sums are scaled, and
the scale moves onto each rank's partial; Cohere's parallel branches share one all_reduce and its
LayerNorm runs in the fused op: the fused op rounds at other points than eager."""
BF16_KINDS = {"gemma": "sum scaled by", "granite": "sum scaled by", "cohere": "LayerNorm"}
"""What each bf16 family's fused sites say that makes them differ from eager's rounding."""
FULL = os.environ.get("WEAVE_TEST_FULL") == "1"
FAMILIES = tuple(hf.FAMILIES) if FULL else CI_FAMILIES
STRATEGIES = {f: tuple(hf.CONFIGS) if FULL else CI_STRATEGIES[f] for f in FAMILIES}


def runs_of(family: str) -> tuple[str, ...]:
    """The runs this session makes of ``family``: its strategies, and "bf16" where it has one."""
    if family not in FAMILIES:
        return ()
    return STRATEGIES[family] + (("bf16",) if family in BF16_FAMILIES else ())


assert set(CI_STRATEGIES) == set(CI_FAMILIES) and all(set(s) <= set(hf.CONFIGS) for s in CI_STRATEGIES.values())


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict[str, hf.FamilyRun]]:
    """Rank 0's and rank 1's runs of every family: ``{family: {strategy: [run per rank]}}``."""
    root = tmp_path_factory.mktemp("hf")
    paths = {name: str(root / name) for name in FAMILIES}
    for name, path in paths.items():
        hf.save_family(name, path)
    bf16 = tuple(f for f in BF16_FAMILIES if f in FAMILIES)
    per_rank = spawn(hf.run_families, 2, "gloo", paths, hf.CONFIGS, bf16, STRATEGIES, timeout_s=1200)
    return {name: {s: [rank[name][s] for rank in per_rank] for s in rank_runs}
            for name, rank_runs in per_rank[0].items()}


def _describe(run: hf.FamilyRun) -> str:
    return run.error or str(WeaveReport(run.graphs))


@pytest.mark.parametrize(("family", "strategy"), [(f, s) for f in FAMILIES for s in STRATEGIES[f]])
def test_family(runs, family, strategy):
    expected = EXPECTED[family]
    for run in runs[family][strategy]:  # every rank made the same decisions and got eager's numbers
        assert not run.error, run.error
        (graph,) = run.graphs  # HF's forward is one graph: no graph break
        kept = [r for r in graph.records if not r.lowering]
        assert graph.rewritten == expected.fused, _describe(run)
        assert len(kept) == len(expected.kept), _describe(run)
        # Every all_reduce has a record or was merged into a site's one collective; the fused and
        # the merged ones are gone (FlashComm: replaced by its reduce_scatters).
        assert graph.ops_before[AR] == len(graph.records) + expected.merged, _describe(run)
        assert graph.ops_after[AR] == len(kept), _describe(run)
        for record, code in zip(kept, expected.kept):
            assert code in record.reasons[0].codes(), _describe(run)
        if strategy in ("split", "flashcomm"):
            said = expected.split if strategy == "split" else expected.flashcomm
            assert said in graph.codes if isinstance(said, ReasonCode) else said in graph.note, _describe(run)
        if strategy == "flashcomm":
            if expected.flashcomm == FLASHCOMM:
                assert all(r.lowering.startswith("flashcomm:") for r in graph.records if r.lowering)
        # fp32: the eager graph is the reference; reassociated sums stay far below this bound.
        assert run.rel_diff <= ATOL[torch.float32], (run.rel_diff, _describe(run))


@pytest.mark.parametrize("family", [f for f in BF16_FAMILIES if f in FAMILIES])
def test_rounding_changes_in_bf16(runs, family):
    """Fused (every site) and not less accurate than eager bf16 beyond one rounding
    (``check_against_eager``'s bound against the fp32 model; the table is the failure message)."""
    for run in runs[family]["bf16"]:
        assert not run.error, run.error
        (graph,) = run.graphs
        assert graph.rewritten == EXPECTED[family].fused == len(graph.records), _describe(run)
        assert any(BF16_KINDS[family] in r.kind for r in graph.records), _describe(run)


MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")
"""Families whose routing sorts the token-expert pairs by expert (transformers' grouped_mm experts)."""


@pytest.mark.parametrize("family", [f for f in MOE_FAMILIES if f in FAMILIES and "split" in STRATEGIES[f]])
def test_moe_routing_runs_once_per_half(runs, family):
    """With the split forced, every routing block (sort by expert, expert counts, grouped matmuls)
    runs once per half on the half's tokens; test_family checks the numbers."""
    for run in runs[family]["split"]:
        (graph,) = run.graphs
        sorts = graph.ops_before["aten.sort.default"]
        assert sorts >= 1 and graph.ops_after["aten.sort.default"] == 2 * sorts, _describe(run)
        assert graph.ops_after["aten.histc.default"] == 2 * graph.ops_before["aten.histc.default"], _describe(run)


@pytest.mark.parametrize("strategy", [s for s in ("fuse", "bf16") if s in runs_of("cohere")])
def test_cohere_fuses_layer_norm_sites(runs, strategy):
    """Every Cohere site is a LayerNorm site (``weave.fused_allreduce_layernorm``), its
    parallel attention and MLP sums in one all_reduce; the report says so (fuse-only: fp32, and
    the bf16 run, the one CI compiles)."""
    # Cohere's LayerNorm upcasts a bf16 stream to fp32 and its weight with it
    form = "decomposed+fp32-upcast" if strategy == "bf16" else "decomposed"
    for run in runs["cohere"][strategy]:
        (graph,) = run.graphs
        assert graph.ops_after["weave.fused_allreduce_layernorm.default"] == 3, _describe(run)
        assert graph.ops_after["weave.fused_allreduce_rmsnorm.default"] == 0, _describe(run)
        assert all(f", LayerNorm ({form}), weight torch.float32," in r.kind for r in graph.records), _describe(run)
        assert [r.kind.split(",")[0] for r in graph.records] == ["no-residual", "residual", "residual"]
        assert all("which the next add adds (parallel branches" in r.kind for r in graph.records[1:]), _describe(run)


GENERATION_PROMPTS = (9, 6, 7)
"""Three prompt lengths: the second prefill recompiles with a symbolic length (Dynamo's automatic
dynamic shapes), and the third reuses that graph unless a backend guarded it on the length."""


def test_generation_with_a_static_cache(tmp_path):
    """Greedy ``generate`` (static cache, ``model.forward`` compiled with ``fullgraph=True``) gives
    eager's tokens, Dynamo hands weave exactly the graphs it hands a backend that adds no guards
    (prefill, decode, the symbolic prefill that serves the later prompts: no recompile comes from
    weave), and every site of the decode graph (one token) is fused."""
    path = str(tmp_path / "llama")
    hf.save_family("llama", path)
    per_rank = spawn(hf.run_generation, 2, "gloo", path, GENERATION_PROMPTS, 8, timeout_s=600)
    for run in per_rank:
        assert run.tokens["weave"] == run.eager == run.tokens["eager"]
        assert [len(t) for t in run.eager] == [n + 8 for n in GENERATION_PROMPTS]
        assert run.frames["weave"] == run.frames["eager"], run.frames
        assert len(run.frames["weave"]) == 3 and run.frames["weave"][1] == (1, 1), run.frames
        assert len(run.graphs) == len(run.frames["weave"])
        decode = run.graphs[1]
        assert decode.rewritten == EXPECTED["llama"].fused == len(decode.records), str(WeaveReport(run.graphs))


def test_catalogue_shrinks_the_families_configs():
    """``hf_catalogue`` (the sweep's and this file's checkpoints): every family here has a TP plan,
    and its tiny config the shared sizes (MLA: the rotary head dim as the head dim)."""
    from weavepass.testing import hf_catalogue

    for model_type in hf.FAMILIES.values():
        config = hf_catalogue.tiny_config(model_type)
        assert config.base_model_tp_plan, model_type
        assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (64, 2, hf_catalogue.VOCAB)
    assert hf_catalogue.tiny_config("deepseek_v3").head_dim == 8  # qk_rope_head_dim
