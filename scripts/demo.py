"""Compile a tensor-parallel decoder with the weave backend and check it against eager.

    python scripts/demo.py [--world-size 2] [--layers 2] [--tokens 64] [--dtype bf16] [--moe]

Starts one process per rank (NCCL when there are enough GPUs, gloo on the CPU otherwise), builds
the seeded reference model of ``weavepass.testing.models``, compiles it with
``torch.compile(model, backend="weave")`` and runs it under ``torch.no_grad()``. Rank 0 prints the
explain report (which sites were rewritten, and why the others were not) and the harness table:
eager and compiled errors against an fp32 copy of the model, and compiled vs eager differences.
Exits with status 1 when a rank's compiled output is less accurate than the harness allows.
"""

from __future__ import annotations

import argparse
import os
import sys

# The checkout this script belongs to, not whichever weavepass is installed (python puts scripts/,
# not the working directory, on sys.path).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import weavepass  # noqa: E402  (registers backend="weave")
from weavepass.testing import TPConfig, build_tp_model, check_against_eager, random_token_ids, spawn  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
WORLD_SIZES = (1, 2, 4, 8)  # the ones that divide demo_config's 16 query and 8 kv heads


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python scripts/demo.py", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--world-size", type=int, default=2, help="TP ranks (1, 2, 4 or 8)")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (2L + 1 sites)")
    parser.add_argument("--tokens", type=int, default=64, help="sequence length (batch of 1)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--moe", action="store_true", help="4 experts, top-2, not a dense MLP")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the token ids")
    args = parser.parse_args(argv)
    if args.world_size not in WORLD_SIZES:
        parser.error(
            f"--world-size {args.world_size}: the demo model's 16 query / 8 kv heads split evenly "
            f"only over 1, 2, 4 or 8 ranks"
        )
    return args


def demo_config(args: argparse.Namespace) -> TPConfig:
    """Small enough for two CPU cores; 16 query / 8 kv heads split over 1, 2, 4 or 8 ranks."""
    return TPConfig(
        vocab=512,
        hidden=128,
        n_layers=args.layers,
        n_heads=16,
        n_kv_heads=8,
        head_dim=16,
        intermediate=256,
        n_experts=4 if args.moe else 0,
        top_k=2,
        dtype=DTYPES[args.dtype],
        seed=args.seed,
    )


def run_rank(rank: int, world_size: int, args: argparse.Namespace) -> bool:
    """One rank: build, compile, compare; rank 0 prints. Returns whether this rank passed."""
    on_gpu = dist.get_backend() == "nccl"
    device = torch.device("cuda", rank) if on_gpu else torch.device("cpu")
    cfg = demo_config(args)
    group = dist.group.WORLD
    model = build_tp_model(cfg, rank, world_size, group, device)
    reference = build_tp_model(cfg, rank, world_size, group, device, dtype=torch.float32)
    input_ids = random_token_ids(cfg, batch=1, seq=args.tokens, seed=args.seed, device=device)

    def compile_fn(m):
        return torch.compile(m, backend="weave")

    report = check_against_eager(model, input_ids, compile_fn, reference, raise_on_failure=False)
    if rank == 0:
        kind = "MoE" if cfg.n_experts else "dense"
        print(
            f"weavepass demo: {world_size} ranks ({dist.get_backend()} on {device.type}), backend "
            f"'weave', {kind} decoder, {cfg.n_layers} layers ({2 * cfg.n_layers + 1} "
            f"all_reduce -> RMSNorm sites), {args.tokens} tokens, {args.dtype}\n"
        )
        print(weavepass.last_report())
        print()
        print(report)
        print(
            f"\nmax abs diff vs eager {report.max_abs_diff:.3e}, max rel diff vs eager "
            f"{report.max_rel_diff:.3e}: {'PASS' if report.passed else 'FAIL'} (rank 0)"
        )
    return report.passed


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    demo_config(args).check_world_size(args.world_size)
    enough_gpus = torch.cuda.is_available() and torch.cuda.device_count() >= args.world_size
    backend = "nccl" if enough_gpus else "gloo"
    passed = spawn(run_rank, args.world_size, backend, args)
    failed = [rank for rank, ok in enumerate(passed) if not ok]
    if failed:
        print(f"ranks {failed} failed the accuracy check", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
