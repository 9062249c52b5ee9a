"""One spawned group of ranks serving many GPU test cases, and the checks several GPU files share.

Starting the ranks (NCCL set-up, CUDA context, Triton and Inductor warm-up) cost most of each GPU
test's time when every test spawned its own. A test module instead lists its cases (test name ->
rank function and arguments) and builds two fixtures with ``shared_ranks``: a module-scoped one that
spawns the ranks once and runs every selected case in them, and ``case_result``, which hands a test
its own case's per-rank return values (or fails with that case's error). pytest still reports each
case as its own test, and ``-k`` runs only the selected cases.

A case that raises on any rank stops those ranks (a peer may be waiting in a collective the failed
rank will never join): its test fails with the ranks' tracebacks, and the cases after it run in a
freshly spawned group, so one failure does not hide the others' results.
"""

from __future__ import annotations

import os
import pickle
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from weavepass.testing import random_token_ids
from weavepass.testing.distributed import spawn
from weavepass.testing.shared_gpu import enabled as shared_gpu_enabled
from weavepass.testing.shared_gpu import gpus_needed


def gpu_world() -> int:
    """The ranks the multi-GPU tests run on: ``WEAVE_GPU_WORLD`` (set by ``--gpu-world``), default 2."""
    return int(os.environ.get("WEAVE_GPU_WORLD", "2"))


def needs_gpus(world: int):
    """The skip mark of a test of ``world`` ranks: ``world`` CUDA GPUs, or one when the ranks share it
    (``WEAVE_GPU_SHARED=1``, weavepass.testing.shared_gpu)."""
    return pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < gpus_needed(world),
        reason=f"needs {gpus_needed(world)} CUDA GPU{'s' if gpus_needed(world) > 1 else ''}",
    )


@dataclass(frozen=True)
class Case:
    """``fn(rank, world, *args)`` run on every rank; ``timeout_s`` bounds it alone."""

    fn: Callable[..., Any]
    args: tuple = ()
    timeout_s: float = 300.0


@dataclass
class CaseResults:
    """Per case name: the ranks' return values in rank order, or the error that stopped the case."""

    values: dict[str, list[Any]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)

    def of(self, name: str) -> list[Any]:
        if name in self.errors:
            pytest.fail(f"case {name} failed in the shared ranks:\n{self.errors[name]}", pytrace=False)
        return self.values[name]


def _run_cases(rank: int, world: int, cases: list[tuple[int, Case]], folder: str) -> None:
    """Rank body: the cases in order, each one's return value saved as soon as it is known (so the
    driver sees which cases finished if a later one kills the ranks)."""
    for index, case in cases:
        torch._dynamo.reset()  # each case compiles from scratch, as in a process of its own
        value = case.fn(rank, world, *case.args)
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
        dist.barrier()  # every rank finished the case before any starts the next
        with open(Path(folder) / f"{index}.{rank}", "wb") as f:
            pickle.dump(value, f)


def run_cases(cases: dict[str, Case], world: int, backend: str = "nccl") -> CaseResults:
    """Every case in ``cases`` (in order) on ``world`` ranks, spawned once (again after a failure)."""
    names = list(cases)
    results = CaseResults()
    start = 0
    while start < len(names):
        todo = [(i, cases[names[i]]) for i in range(start, len(names))]
        with tempfile.TemporaryDirectory(prefix="weave_gpu_cases_") as folder:
            error = None
            try:
                spawn(_run_cases, world, backend, todo, folder,
                      timeout_s=sum(case.timeout_s for _, case in todo), allow_shared_gpu=True)
            except (RuntimeError, TimeoutError) as err:
                error = str(err)
            for i, _ in todo:
                saved = [Path(folder) / f"{i}.{r}" for r in range(world)]
                if not all(p.exists() for p in saved):
                    break
                results.values[names[i]] = [pickle.loads(p.read_bytes()) for p in saved]
                start = i + 1
            else:
                return results
        # Case ``start`` stopped the ranks; the rest go on in a fresh group.
        results.errors[names[start]] = error or "the ranks stopped without an error"
        start += 1
    return results


def _skipped_by_mark(item) -> bool:
    """Whether ``item``'s skip / skipif marks skip it, by pytest's own evaluation (string
    conditions, ``condition=``, several conditions): its case is not run in the ranks."""
    from _pytest.skipping import evaluate_skip_marks

    return evaluate_skip_marks(item) is not None


def shared_gpu_skip(reason: str):
    """Skip mark for a test whose check means nothing when the ranks share one GPU
    (``WEAVE_GPU_SHARED=1``, weavepass.testing.shared_gpu)."""
    return pytest.mark.skipif(shared_gpu_enabled(), reason=f"ranks sharing one GPU: {reason}")


def shared_ranks(cases: dict[str, Case], world: int, backend: str = "nccl"):
    """The fixtures ``gpu_ranks`` (module scope: the selected cases of the module, run once) and
    ``case_result`` (the running test's own case), for a module to bind at its top level."""

    @pytest.fixture(scope="module", name="gpu_ranks")
    def gpu_ranks(request) -> CaseResults:
        selected = {item.name for item in request.session.items
                    if item.module is request.module and "case_result" in item.fixturenames
                    and not _skipped_by_mark(item)}
        assert selected <= set(cases), f"tests without a case: {sorted(selected - set(cases))}"
        return run_cases({name: case for name, case in cases.items() if name in selected}, world, backend)

    @pytest.fixture(name="case_result")
    def case_result(request, gpu_ranks: CaseResults) -> list[Any]:
        return gpu_ranks.of(request.node.name)

    return gpu_ranks, case_result


def check_replays_match_eager(compiled, model, cfg, tokens: int, calls: int, device) -> float:
    """``calls`` calls of ``compiled`` (under ``mode="reduce-overhead"``: 0 warm-up, 1 recording, the
    rest replays on new inputs), each against eager ``model`` on the same ids, bf16 tolerance
    atol 0.1 / rtol 0.05 (two layers of differently ordered bf16 sums). The error is reported per
    call, so a failure shows which phase of the CUDA-graph tree goes wrong. Returns the worst max
    abs error."""
    errors = []
    with torch.no_grad():
        for seed in range(calls):
            ids = random_token_ids(cfg, 1, tokens, seed=seed, device=device)
            got = compiled(ids).clone()  # the tree reuses its output buffers on the next replay
            want = model(ids)
            close = torch.allclose(got.float(), want.float(), atol=0.1, rtol=0.05)
            errors.append((seed, round((got.float() - want.float()).abs().max().item(), 4), close))
    assert all(close for _, _, close in errors), f"(call, max abs error, within tolerance): {errors}"
    return max(err for _, err, _ in errors)


def replays_on_new_inputs(compiled, model, cfg, device, seeds: tuple[int, ...], tokens: int = 384) -> float:
    """Capture one call of ``compiled`` in a ``torch.cuda.CUDAGraph`` (after three calls on a side
    stream: compile and warm up outside the capture) and replay it once per seed on new ids copied
    into the captured input, each replay against eager ``model`` on those ids, bf16 tolerance
    atol 0.1 / rtol 0.05 (as ``check_replays_match_eager``). Several seeds: the kernels' sequence
    numbers advance on the device between replays. Returns the worst max abs error."""
    ids = random_token_ids(cfg, 1, tokens, device=device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        for _ in range(3):
            compiled(ids)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        captured = compiled(ids)
    worst = 0.0
    for seed in seeds:
        new_ids = random_token_ids(cfg, 1, tokens, seed=seed, device=device)
        ids.copy_(new_ids)
        graph.replay()
        torch.cuda.synchronize()
        with torch.no_grad():
            expected = model(new_ids)
        torch.testing.assert_close(captured, expected, atol=0.1, rtol=0.05, msg=lambda e, s=seed: f"seed {s}: {e}")
        worst = max(worst, (captured.float() - expected.float()).abs().max().item())
    return worst
