"""Tiny, randomly initialised Hugging Face models, loaded tensor-parallel the way users load them.

Every family here ships a ``base_model_tp_plan``. ``save_family`` writes a tiny random checkpoint
(in the parent process); ``run_families`` runs on every rank of a ``spawn``ed group: it loads each
checkpoint with ``from_pretrained(path, tp_plan="auto", device_mesh=...)``, lets Dynamo trace it once, compiles
the traced graphs with the weave backend under each of several ``WeaveConfig`` s, and returns, per
family and config, the difference from the graphs run eagerly and the explain report (or the
error, so that one family's failure does not hide the others'). One spawned pair of ranks serves
every family, and one Dynamo trace every config: spawning, loading and tracing cost seconds each.

Needs ``transformers`` (>= 5.17) and ``accelerate``, imported only when these functions run.
"""

from __future__ import annotations

import copy
import math
import os
import time
import traceback
from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree

from weavepass.config import WeaveConfig
from weavepass.report import GraphReport
from weavepass.testing.hf_catalogue import VOCAB, save_tiny

FAMILIES: dict[str, str] = {
    # family (the tests' name) -> model type; sizes and per-family config overrides: ``hf_catalogue``
    "llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "gemma": "gemma",
    "gemma2": "gemma2", "gemma3": "gemma3_text", "phi3": "phi3", "olmo2": "olmo2", "granite": "granite",
    "cohere": "cohere", "mixtral": "mixtral", "qwen2_moe": "qwen2_moe", "qwen3_moe": "qwen3_moe",
    "deepseek_v3": "deepseek_v3", "gpt_oss": "gpt_oss",
    # biased row-parallel layers (GPT-NeoX, GPT-J, Phi: parallel residual), a scaled MoE sum behind a
    # view (MiniMax), the routed experts' sum over experts (Llama4), post-norm (OLMo3, Exaone4)
    "gpt_neox": "gpt_neox", "gptj": "gptj", "phi": "phi", "codegen": "codegen", "starcoder2": "starcoder2",
    "minimax": "minimax", "llama4": "llama4_text", "olmo3": "olmo3", "exaone4": "exaone4",
    # a gated shared expert's sum (Qwen3-Next), a scaled MoE output (GraniteMoeHybrid); both hybrids
    # of attention and linear-attention / Mamba layers
    "qwen3_next": "qwen3_next", "granitemoehybrid": "granitemoehybrid",
}

CONFIGS: dict[str, WeaveConfig] = {
    "fuse": WeaveConfig(),
    "split": WeaveConfig(split="force"),
    "flashcomm": WeaveConfig(enable_flashcomm=True, flashcomm_min_prefill_tokens=1),
}
"""The strategies each family is compiled with: fuse-only (the default), the split forced,
FlashComm forced (every token count is above its threshold)."""

BATCH, SEQ = 1, 9
"""One sequence of an odd length: the split cuts inside it, FlashComm pads it to the world size."""


@dataclass
class FamilyRun:
    """One family compiled with one ``WeaveConfig`` on one rank."""

    rel_diff: float = float("nan")
    """max over the graphs' outputs of max |compiled - eager| / max(1, max |eager|)"""
    graphs: list[GraphReport] = field(default_factory=list)
    error: str = ""
    """the exception's traceback when compiling or running failed"""
    seconds: float = 0.0


def save_family(name: str, path: str, seed: int = 0) -> None:
    """Write a tiny random ``name`` checkpoint (fp32) to ``path`` (``hf_catalogue.save_tiny``)."""
    save_tiny(FAMILIES[name], path, seed)


def load_tp(path: str, mesh, dtype: torch.dtype = torch.float32):
    """``from_pretrained`` with the model's own TP plan on ``mesh``, in ``dtype``, the family's default
    attention (SDPA where it supports it; Gemma2's softcapping needs the eager attention)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, tp_plan="auto", device_mesh=mesh, dtype=dtype)
    return model.eval()


def run_families(rank: int, world: int, paths: dict[str, str], configs: dict[str, WeaveConfig],
                 bf16: tuple[str, ...] = (), strategies: dict[str, tuple[str, ...]] | None = None):
    """On one rank: every family of ``paths`` (family -> checkpoint), under every config (or the
    configs ``strategies[family]`` names); for the families in ``bf16`` also a bf16 run
    (``"bf16"``, fuse-only) checked by ``check_against_eager``.

    Returns ``{family: {config name: FamilyRun}}``.
    """
    from torch.distributed.device_mesh import init_device_mesh

    # transformers >= 5.18 derives the TP size from WORLD_SIZE; 5.17 takes the mesh.
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    mesh = init_device_mesh("cpu", (world,))
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    runs = {
        name: _run_family(load_tp(path, mesh), ids,
                          configs if strategies is None else {c: configs[c] for c in strategies[name]})
        for name, path in paths.items()
    }
    for name in bf16:
        runs[name]["bf16"] = _run_bf16(paths[name], mesh, ids)
    return runs


def run_catalogue_family(rank: int, world: int, model_type: str, path: str,
                         configs: dict[str, WeaveConfig]) -> dict:
    """On one rank of the sweep (scripts/hf_sweep.py): rank 0 writes ``model_type``'s tiny
    checkpoint to ``path`` (``hf_catalogue.save_tiny``) while the other ranks wait; every rank then
    loads it and runs every config (``run_families``' work for one family).

    Returns ``{"build_error": text}`` when the checkpoint cannot be built (on every rank), else
    ``{"runs": {config name: FamilyRun}, "phases": {"build", "load", "trace": seconds}}``.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    start = time.perf_counter()
    error = [None]
    if rank == 0:
        try:
            save_tiny(model_type, path)
        except Exception as exc:
            error = [f"{type(exc).__name__}: {exc}"]
    dist.broadcast_object_list(error, src=0)
    if error[0] is not None:
        return {"build_error": error[0]}
    phases = {"build": time.perf_counter() - start}
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    mesh = init_device_mesh("cpu", (world,))
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    start = time.perf_counter()
    try:
        model = load_tp(path, mesh)
        phases["load"] = time.perf_counter() - start
        captured, eager = _trace(model, ids, phases)
    except Exception:
        return {"model_error": traceback.format_exc()}
    return {"runs": _compile_all(captured, eager, configs), "phases": phases}


def _run_bf16(path, mesh, ids) -> FamilyRun:
    """The bf16 model compiled fuse-only vs eager bf16, both against the fp32 model: the fused op
    rounds at other points than eager (``check_against_eager`` says how much that may cost)."""
    from weavepass.backend import WeaveBackend
    from weavepass.testing.harness import check_against_eager

    model, reference = load_tp(path, mesh, torch.bfloat16), load_tp(path, mesh)
    backend = WeaveBackend(WeaveConfig())
    torch._dynamo.reset()
    run = FamilyRun()
    try:
        report = check_against_eager(lambda x: model(x).logits, (ids,), lambda f: torch.compile(f, backend=backend),
                                     lambda x: reference(x).logits, torch.bfloat16,
                                     raise_on_failure=False)
        run.rel_diff = report.max_rel_diff
        run.error = "" if report.passed else str(report)
    except Exception:
        run.error = traceback.format_exc()
    run.graphs = backend.report.graphs
    return run


def _run_family(model, ids, configs) -> dict[str, FamilyRun]:
    """Dynamo traces the model once; every config compiles the same graphs (what ``backend="weave"``
    receives), and each compiled graph is checked against the graph run eagerly on the same inputs
    (run once per graph: every config compares with the same eager outputs)."""
    captured, eager = _trace(model, ids)
    return _compile_all(captured, eager, configs)


def _trace(model, ids, phases: dict[str, float] | None = None) -> tuple[list, list]:
    """The graphs Dynamo hands a backend for ``model(ids)``, with their example inputs, and each
    graph's eager outputs; ``phases["trace"]``: the seconds this took."""
    captured = []

    def capture(gm, example_inputs):
        captured.append((gm, list(example_inputs)))
        return gm.forward

    start = time.perf_counter()
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=capture)(ids)
        eager = [gm(*_fresh(inputs)) for gm, inputs in captured]
    if phases is not None:
        phases["trace"] = time.perf_counter() - start
    return captured, eager


def _compile_all(captured: list, eager: list, configs: dict[str, WeaveConfig]) -> dict[str, FamilyRun]:
    """Every config compiles every captured graph, checked against its eager outputs."""
    from weavepass.backend import WeaveBackend

    runs = {}
    for config_name, config in configs.items():
        run = runs[config_name] = FamilyRun(rel_diff=0.0)
        backend = WeaveBackend(config)
        start = time.perf_counter()
        try:
            for (gm, inputs), expected in zip(captured, eager, strict=True):
                with torch.no_grad():
                    compiled = backend(copy.deepcopy(gm), inputs)(*_fresh(inputs))
                run.rel_diff = max(run.rel_diff, _rel_diff(compiled, expected))
        except Exception:
            run.error = traceback.format_exc()
        run.seconds = time.perf_counter() - start
        run.graphs = backend.report.graphs
    return runs


def _fresh(inputs: list) -> list:
    """A copy of a graph's inputs for one run: a graph that writes into an input (a cache buffer,
    ``copy_``) would otherwise hand the next run other values than the first one had."""
    return [x.clone() if isinstance(x, torch.Tensor) else x for x in inputs]


def _rel_diff(compiled, eager) -> float:
    worst = 0.0
    for c, e in zip(pytree.tree_leaves(compiled), pytree.tree_leaves(eager), strict=True):
        if isinstance(e, torch.Tensor) and e.is_floating_point() and e.numel():
            diff = ((c - e).abs().max() / e.abs().max().clamp(min=1)).item()
            # NaN compares False: max(0.0, nan) is 0.0, and a NaN output would read as no difference
            worst = max(worst, math.inf if math.isnan(diff) else diff)
    return worst


@dataclass
class GenerationRun:
    """``generate`` on one rank: eager, and with the forward compiled by a frame-counting backend."""

    eager: list[list[int]] = field(default_factory=list)
    """eager's tokens, per prompt"""
    tokens: dict[str, list[list[int]]] = field(default_factory=dict)
    """backend name -> the compiled model's tokens, per prompt"""
    frames: dict[str, list[tuple]] = field(default_factory=dict)
    """backend name -> the token shape of every graph Dynamo handed it, in order"""
    graphs: list[GraphReport] = field(default_factory=list)
    """the weave backend's report, one graph per frame"""


def run_generation(rank: int, world: int, path: str, prompt_lengths: tuple[int, ...],
                   max_new_tokens: int) -> GenerationRun:
    """On one rank: greedy ``generate`` with a static cache, one prompt per length in turn, eager and
    with ``model.forward`` compiled (``fullgraph=True``, as Hugging Face recommends for a static
    cache) by the weave backend and by a backend that returns the graph uncompiled ("eager"). Both
    backends count the graphs Dynamo gives them: guards a backend adds to a graph (reading a
    symbolic size, say) show up as extra graphs on later calls.
    """
    from torch.distributed.device_mesh import init_device_mesh

    from weavepass.backend import WeaveBackend

    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    mesh = init_device_mesh("cpu", (world,))
    prompts = [torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(n))
               for n in prompt_lengths]

    def generate(model) -> list[list[int]]:
        return [model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0,
                               cache_implementation="static", max_new_tokens=max_new_tokens)[0].tolist()
                for ids in prompts]

    run = GenerationRun(eager=generate(load_tp(path, mesh)))
    weave = WeaveBackend(WeaveConfig())
    for name, backend in (("eager", lambda gm, inputs: gm.forward), ("weave", weave)):
        frames = run.frames[name] = []

        def counting(gm, inputs, backend=backend, frames=frames):
            ids = next(i for i in inputs if isinstance(i, torch.Tensor) and i.dtype == torch.int64 and i.dim() == 2)
            frames.append(tuple(s if isinstance(s, int) else str(s) for s in ids.shape))
            return backend(gm, inputs)

        model = load_tp(path, mesh)
        torch._dynamo.reset()
        model.forward = torch.compile(model.forward, backend=counting, fullgraph=True)
        run.tokens[name] = generate(model)
    run.graphs = weave.report.graphs
    return run
