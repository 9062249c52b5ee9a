"""A Hugging Face Llama at Llama-3-8B widths, loaded tensor-parallel with ``tp_plan="auto"`` on two GPUs:
weave fuse-only, split and FlashComm against eager and default Inductor, checked and timed.

What a user does: ``LlamaForCausalLM.from_pretrained(path, tp_plan="auto")``, then
``torch.compile(model, backend="weave")``. The checkpoint is written once by the parent process:
random bf16 weights at Llama-3-8B widths (hidden 4096, 32 q / 8 kv heads of 128, MLP 14336),
``--layers`` decoder layers (default 2) and a 32000-token vocabulary (the real 128256 only makes the
embedding and the head larger). Per rank, in one process each, for every ``--tokens`` (one sequence,
prefill):

    eager            the model as loaded (DTensor/funcol all_reduce, unfused)
    inductor         torch.compile, default backend
    weave_fuse       backend weave, default config (fused all_reduce + RMSNorm)
    weave_split      backend weave, split="force" (the two-way token split)
    weave_flashcomm  backend weave, FlashComm forced (enable_flashcomm, every size)

Every compiled variant's logits are checked against an fp32 copy of the model, as the tests do
(``weavepass.testing.harness.check_against_eager``: compiled error <= 2 x eager's error + bf16 atol);
the table says ``ok`` or the failure, and how many sites each graph fused (the explain report).
Times are medians of CUDA-event-timed forward passes (rank 0's). Output: a table, ``<out>/
bench_hf_llama.csv``. ``--smoke``: a tiny model (hidden 64) on 2 CPU processes (gloo), fp32,
wall-clock timed: it checks the script, not the speed.
Run: ``python3 benchmarks/bench_hf_llama.py --tokens 2048 8192``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

import gpu_env  # noqa: F401  (must precede torch: multicast off, checkout on sys.path)
import torch  # noqa: E402
from report import write_csv  # noqa: E402  (benchmarks/report.py)
from timing import progress_bar, times_ms  # noqa: E402  (benchmarks/timing.py)

from weavepass.testing.distributed import spawn  # noqa: E402

WIDTHS = {
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
               vocab_size=32000, max_position_embeddings=16384, rope_theta=500000.0),
    "tiny": dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                 vocab_size=128, max_position_embeddings=256),
}
VARIANTS = ("eager", "inductor", "weave_fuse", "weave_split", "weave_flashcomm")


def _config(variant: str):
    from weavepass import WeaveConfig

    return {
        "weave_fuse": WeaveConfig(),
        "weave_split": WeaveConfig(split="force"),
        "weave_flashcomm": WeaveConfig(enable_flashcomm=True, flashcomm_min_prefill_tokens=1),
    }.get(variant)


def save_checkpoint(path: str, widths: str, layers: int, dtype: torch.dtype) -> None:
    import transformers

    config = transformers.LlamaConfig(**WIDTHS[widths], num_hidden_layers=layers)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(path)


def _rank(rank: int, world: int, path: str, tokens_list, variants, dtype, iters: int):
    import transformers
    from torch.distributed.device_mesh import init_device_mesh

    from weavepass.backend import WeaveBackend
    from weavepass.testing.harness import check_against_eager

    cuda = torch.cuda.is_available() and dtype != torch.float32
    device = "cuda" if cuda else "cpu"
    # transformers >= 5.18 derives the TP size from WORLD_SIZE; 5.17 takes the mesh.
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    mesh = init_device_mesh(device, (world,))

    def load(load_dtype):
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, tp_plan="auto", device_mesh=mesh, dtype=load_dtype)
        return model.eval()

    model, reference = load(dtype), load(torch.float32)
    vocab = model.config.vocab_size
    rows = []
    progress = progress_bar(len(tokens_list) * len(variants), "cases") if rank == 0 else None
    for tokens in tokens_list:
        ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(tokens)).to(device)
        for variant in variants:
            torch._dynamo.reset()
            backend = None
            if variant == "eager":
                fn = model
            elif variant == "inductor":
                fn = torch.compile(model)
            else:
                backend = WeaveBackend(_config(variant))
                fn = torch.compile(model, backend=backend)
            row = dict(variant=variant, tokens=tokens, world=world, layers=model.config.num_hidden_layers,
                       hidden=model.config.hidden_size, dtype=str(dtype).removeprefix("torch."))
            # No try/except: a rank failing inside a forward pass would leave its peer waiting in a
            # collective; a failing variant stops the run (spawn reports every rank's traceback).
            if variant != "eager":
                report = check_against_eager(
                    lambda x: model(x).logits, (ids,), lambda _: (lambda x: fn(x).logits),
                    lambda x: reference(x).logits, dtype, raise_on_failure=False)
                row["check"] = "ok" if report.passed else "FAILED"
                row["max_rel_diff"] = f"{report.max_rel_diff:.3g}"
            if backend is not None:
                graphs = backend.report.graphs
                row["sites_fused"] = sum(g.rewritten for g in graphs)
                row["sites"] = sum(len(g.records) for g in graphs)
                row["notes"] = " / ".join(g.note for g in graphs if g.note)[:300]
            row["ms"] = statistics.median(times_ms(lambda x: fn(x), ids, warmup=2, iters=iters))
            rows.append(row)
            if progress is not None:
                progress.update(1)
                print(f"  {row}", flush=True)
    if progress is not None:
        progress.close()
    return rows


def _annotate(rows):
    base = {r["tokens"]: r.get("ms") for r in rows if r["variant"] == "inductor"}
    for r in rows:
        if r.get("ms") and base.get(r["tokens"]):
            r["vs_inductor"] = f"{r['ms'] / base[r['tokens']]:.3f}"
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--tokens", type=int, nargs="+", default=None, help="prefill lengths (default 2048 8192)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--smoke", action="store_true", help="tiny model, 2 CPU processes (gloo), fp32")
    parser.add_argument("--timeout-s", type=float, default=540)
    args = parser.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    os.makedirs(args.out, exist_ok=True)
    if args.smoke:
        widths, dtype, backend, tokens = "tiny", torch.float32, "gloo", args.tokens or [16]
    else:
        widths, dtype, backend, tokens = "8b", torch.bfloat16, "nccl", args.tokens or [2048, 8192]
    with tempfile.TemporaryDirectory() as path:
        save_checkpoint(path, widths, args.layers, dtype)
        rows = spawn(_rank, 2, backend, path, tokens, variants, dtype, args.iters, timeout_s=args.timeout_s)[0]
    rows = _annotate(rows)
    fields = ["variant", "tokens", "world", "layers", "hidden", "dtype", "ms", "vs_inductor", "check",
              "max_rel_diff", "sites_fused", "sites", "notes"]
    print("| " + " | ".join(fields) + " |")
    print("|" + "---|" * len(fields))
    for r in rows:
        print("| " + " | ".join(str(r.get(f, "")) if not isinstance(r.get(f), float) else f"{r[f]:.3f}"
                                for f in fields) + " |")
    print(f"wrote {write_csv(os.path.join(args.out, 'bench_hf_llama.csv'), rows, fields)}")


if __name__ == "__main__":
    main()
