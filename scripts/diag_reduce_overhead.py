"""Diagnostic (GPU, 2 ranks): where does the split model go wrong under ``mode="reduce-overhead"``?

Runs the reduce-overhead test's model in several variants and prints, per call (0 warm-up,
1 recording, 2-4 replays), the max abs error against eager and which token rows are wrong.
Usage: python3 scripts/diag_reduce_overhead.py [variant ...]
"""

from __future__ import annotations

import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's weavepass

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from weavepass import WeaveConfig  # noqa: E402
from weavepass.backend import WeaveBackend  # noqa: E402
from weavepass.testing import TPConfig, build_tp_model, random_token_ids, spawn  # noqa: E402

CFG = TPConfig(vocab=512, hidden=1024, n_layers=2, n_heads=16, n_kv_heads=4, head_dim=64, intermediate=2048)
TOKENS = 384

VARIANTS = {
    # name: (split, lowering, inductor config patch, same_stream)
    "split": ("force", "auto", {}, False),
    "split_no_partition": ("force", "auto", {"graph_partition": False}, False),
    "split_no_trees": ("force", "auto", {"triton.cudagraph_trees": False}, False),
    "split_portable": ("force", "portable", {}, False),
    "split_same_stream": ("force", "auto", {}, True),
    "fuse_only": ("off", "auto", {}, False),
}


def _variant(rank, name, model):
    from torch._dynamo.utils import counters

    from weavepass.runtime import streams

    split, lowering, patch, same_stream = VARIANTS[name]
    device = torch.device("cuda", rank)
    original = streams.comm_stream
    if same_stream:
        streams.comm_stream = lambda dev: torch.cuda.current_stream(dev)
    torch._dynamo.reset()
    counters.clear()
    lines = []
    try:
        with torch._inductor.config.patch(patch):
            backend = WeaveBackend(WeaveConfig(split=split, lowering=lowering, cuda_min_tokens=1,
                                               allow_inductor_cudagraphs=True))
            compiled = torch.compile(model, backend=backend, mode="reduce-overhead")
            with torch.no_grad():
                for seed in range(5):
                    ids = random_token_ids(CFG, 1, TOKENS, seed=seed, device=device)
                    got = compiled(ids).clone()
                    torch.cuda.synchronize()
                    want = model(ids)
                    diff = (got.float() - want.float()).abs().reshape(-1, got.shape[-1]).amax(-1)
                    tol = 0.1 + 0.05 * want.float().abs().reshape(-1, got.shape[-1]).amax(-1)
                    bad = (diff > tol).nonzero().flatten().tolist()
                    rows = f"{len(bad)}/{diff.numel()} rows wrong" + (f" [{bad[0]}..{bad[-1]}]" if bad else "")
                    lines.append(f"  call {seed}: max err {diff.max().item():.4g}, {rows}")
        graph = backend.report.graphs[0]
        lines.append(f"  note: {graph.note[:120]}")
        lines.append(f"  ops_after weave: { {k: v for k, v in graph.ops_after.items() if 'weave' in k} }")
        lines.append(f"  inductor counters: {dict(counters['inductor'])}")
    except Exception:
        lines.append("  EXCEPTION: " + traceback.format_exc()[-1500:])
    finally:
        streams.comm_stream = original
    return lines


def _run(rank, world, names):
    device = torch.device("cuda", rank)
    model = build_tp_model(CFG, rank, world, dist.group.WORLD, device=device, dtype=torch.bfloat16)
    out = [f"graph_partition default: {torch._inductor.config.graph_partition}"]
    if rank == 0 and os.environ.get("DIAG_LOGS"):  # generated code and partition decisions
        torch._logging.set_logs(output_code=True, cudagraphs=True)
    for name in names:
        dist.barrier()
        out.append(f"== {name}")
        out.extend(_variant(rank, name, model))
    return out


if __name__ == "__main__":
    names = sys.argv[1:] or list(VARIANTS)
    for rank, lines in enumerate(spawn(_run, 2, "nccl", names, timeout_s=600)):
        print(f"##### rank {rank}")
        print("\n".join(lines), flush=True)
