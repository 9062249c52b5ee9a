"""End to end on real gloo groups: the reference TP model compiled with the weave backend vs eager.

Each case is one spawn; every rank compiles each of the case's model variants (CI: all three on 2
ranks, one on 3; the full tier adds the other two on 3), runs it eagerly, compiled and as an fp32
reference, and checks (through ``check_against_eager``) that the compiled model is not
less accurate than eager beyond the dtype's rounding. The rewrite is checked too: every
all_reduce -> RMSNorm site of the model (2 per layer + 1 for the embedding) became a weave op.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import weavepass
from weavepass.testing.distributed import spawn
from weavepass.testing.harness import check_against_eager
from weavepass.testing.models import TPConfig, build_tp_model, random_token_ids


def variants(world: int) -> dict[str, TPConfig]:
    heads = dict(n_heads=2 * world, n_kv_heads=world)  # whole heads on every rank
    return {
        "dense-bf16-llama-norm": TPConfig(n_layers=2, dtype=torch.bfloat16, **heads),
        "dense-fp32-torch-norm": TPConfig(n_layers=2, norm_impl="torch", **heads),
        "moe-bf16": TPConfig(n_layers=2, n_experts=4, top_k=2, dtype=torch.bfloat16, **heads),
    }


def _rank(rank: int, world: int, batch: int, seq: int, split: str, names: tuple[str, ...]) -> dict:
    group = dist.group.WORLD
    results = {}
    for name, cfg in variants(world).items():
        if name not in names:
            continue
        model = build_tp_model(cfg, rank, world, group)
        reference = build_tp_model(cfg, rank, world, group, dtype=torch.float32)
        ids = random_token_ids(cfg, batch, seq, seed=world)
        backend = weavepass.make_backend(weavepass.WeaveConfig(split=split))
        torch._dynamo.reset()
        comparison = check_against_eager(
            model, (ids,), lambda m: torch.compile(m, backend=backend), reference, cfg.dtype
        )
        results[name] = dict(
            rewritten=backend.report.rewritten,
            all_reduces=len(backend.report.records),
            kept=[r.reason for r in backend.report.records if not r.lowering],
            max_abs=comparison.max_abs_diff,
        )
    return results


ALL = ("dense-bf16-llama-norm", "dense-fp32-torch-norm", "moe-bf16")


@pytest.mark.parametrize("world,batch,seq,names", [
    (2, 2, 7, ALL),
    # 3 ranks (5 tokens do not divide among them): one variant in CI, every one in the full tier
    (3, 1, 5, ("dense-bf16-llama-norm",)),
    pytest.param(3, 1, 5, ALL[1:], marks=pytest.mark.full(
        covered_by="test_reference_model_matches_eager[2-2-7]: these variants on 2 ranks")),
], ids=["2-2-7", "3-1-5", "3-1-5-more"])
def test_reference_model_matches_eager(world, batch, seq, names):
    assert set(names) <= set(variants(world))
    results = spawn(_rank, world, "gloo", batch, seq, "off", names)
    for name in names:
        cfg = variants(world)[name]
        sites = 2 * cfg.n_layers + 1
        for rank_result in results:
            got = rank_result[name]
            assert got["rewritten"] == sites, (name, got)
            assert got["all_reduces"] == sites, (name, got)
