"""Run a function on every rank of a fresh process group, or trace graphs on a fake one.

``spawn`` starts one process per rank (gloo on CPU, NCCL on GPUs), each on its own free port, and
re-raises a child's exception in the caller with the child's traceback, so pytest shows where a rank
failed. ``fake_process_group`` gives a single process a group of any size whose collectives do no
communication: enough for torch.compile to trace and rewrite the graph.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import socket
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from weavepass.env import disable_multicast
from weavepass.testing import shared_gpu


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    backend: str = "gloo",
    *args: Any,
    timeout_s: float = 300.0,
    allow_shared_gpu: bool = False,
    group_timeout_s: float | None = None,
    may_die: tuple[int, ...] = (),
    start_method: str = "spawn",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes sharing one process group.

    ``fn`` must be picklable (a module-level function): the children are started with the
    ``spawn`` method. Each child initialises the default group with ``backend`` ("gloo", or "nccl"
    with rank r on ``cuda:r``), runs ``fn`` and destroys the group. Returns the children's return
    values in rank order (they travel through ``pickle``; tensors are copied). With
    ``allow_shared_gpu`` (the GPU tests' driver, tests/gpu/gpu_cases.py) and ``WEAVE_GPU_SHARED=1``,
    an "nccl" group puts every rank on ``cuda:0`` over gloo (``weavepass.testing.shared_gpu``);
    other callers (the benchmarks) never share a GPU, whatever the environment says. If a child raises, a
    RuntimeError carrying every failed rank's traceback is raised here once all children have
    stopped (peers still blocked in a collective are terminated 2 s after the first failure); if the
    children are still running after ``timeout_s`` they are terminated and TimeoutError is raised.
    ``group_timeout_s`` is the group's own timeout (``init_process_group(timeout=...)``; the
    backend's default where None). Ranks in ``may_die`` may exit without reporting (tests of a dead
    peer): their result is None, and their exit is not a failure that stops the others.
    ``start_method="fork"`` (the Hugging Face sweep, scripts/hf_sweep.py) starts the children as
    copies of this process, with its imports and warmed caches; the caller must not have started
    threads or pools the children would use (no parallel torch op, Inductor's ``compile_threads=1``).
    """
    share = allow_shared_gpu and backend == "nccl" and shared_gpu.enabled()
    if backend == "nccl" and torch.cuda.device_count() < (1 if share else world_size):
        raise RuntimeError(f"nccl needs {1 if share else world_size} GPUs, found {torch.cuda.device_count()}")
    # Every NCCL and symmetric-memory user in the children must agree: set before they start.
    disable_multicast(override=True)
    ctx = mp.get_context(start_method)
    results = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(target=_run_rank, args=(fn, rank, world_size, backend, port, args, results, share,
                                            group_timeout_s))
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()

    outcomes: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout_s
    failed_at = None
    # Drain while waiting: a child blocks in put() on a full pipe, so joining first could hang.
    while len(outcomes) < world_size and time.monotonic() < deadline:
        while not results.empty():
            rank, ok, payload = results.get()
            outcomes[rank] = (ok, payload)
        for rank in may_die:
            if rank not in outcomes and procs[rank].exitcode is not None:
                outcomes[rank] = (True, pickle.dumps(None))
        crashed = any(p.exitcode not in (None, 0) for r, p in enumerate(procs) if r not in may_die)
        if failed_at is None and (crashed or any(not ok for ok, _ in outcomes.values())):
            failed_at = time.monotonic()
        # After a failure the other ranks may wait forever in a collective: give them a moment
        # to report their own errors, then stop them.
        if failed_at is not None and time.monotonic() - failed_at > 2.0:
            break
        time.sleep(0.01)
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
        proc.join()

    failures = [f"--- rank {r} ---\n{tb}" for r, (ok, tb) in sorted(outcomes.items()) if not ok]
    if failures:
        raise RuntimeError(f"{len(failures)} of {world_size} ranks failed:\n" + "\n".join(failures))
    missing = [r for r in range(world_size) if r not in outcomes]
    if missing:
        codes = {r: procs[r].exitcode for r in missing}
        if time.monotonic() >= deadline:
            raise TimeoutError(f"ranks {missing} still running after {timeout_s} s (codes {codes})")
        raise RuntimeError(f"ranks {missing} died without reporting (exit codes {codes})")
    return [pickle.loads(outcomes[r][1]) for r in range(world_size)]


def _run_rank(fn, rank, world_size, backend, port, args, results, share=False, group_timeout_s=None) -> None:
    """Child body: init the group, run ``fn``, report ``(rank, ok, result or traceback)``."""
    if share:  # every rank on cuda:0 over gloo, workspaces through CUDA IPC
        torch.cuda.set_device(0)
        shared_gpu.install()
        backend = "gloo"
    elif backend == "nccl":
        torch.cuda.set_device(rank)
    # Ranks share the CPU cores: oversubscribed intra-op threads make gloo runs crawl, and on GPUs
    # the CPU work (e.g. drawing a model's fp32 weights, 8 ranks on one host) would too.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        timeout = {} if group_timeout_s is None else {"timeout": datetime.timedelta(seconds=group_timeout_s)}
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, **timeout
        )
        payload = pickle.dumps(fn(rank, world_size, *args))
        results.put((rank, True, payload))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0) -> Iterator[dist.ProcessGroup]:
    """A default process group of ``world_size`` in this process whose collectives do nothing.

    Collectives return their input unchanged, so numbers are wrong for ``world_size > 1``, but
    shapes, dtypes and the traced graph are those of a real run: use it for graph-level tests.
    Yields the group; destroys it on exit.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a default process group already exists; destroy it first")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def check_plans_in_threads(per_rank: list[list[list[tuple[str, str]]]], store: Any = None,
                           exchanges: list[Any] | None = None, timeout_s: float = 5.0) -> list[str | None]:
    """The cross-rank plan check with one thread per simulated rank: rank ``r`` checks the graphs
    ``per_rank[r]`` (each a list of ``(name, line)`` collective lines) in order, ranks concurrently,
    over ``store`` (a fresh ``HashStore`` by default). Returns each rank's ``PlanMismatchError``
    text (None: every check passed); any other exception in a thread is re-raised here (a thread's
    exception is otherwise only a warning). ``exchanges`` (one ``PlanExchange`` per rank) carries
    state across calls."""
    from weavepass.compile.plan_check import PlanExchange, PlanMismatchError

    store = store if store is not None else dist.HashStore()
    exchanges = exchanges if exchanges is not None else [PlanExchange() for _ in per_rank]
    ranks = list(range(len(per_rank)))
    errors: list[str | None] = [None] * len(per_rank)
    crashed: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            for index, lines in enumerate(per_rank[rank]):
                exchanges[rank].check(store, "0", rank, ranks, lines, index, timeout_s)
        except PlanMismatchError as error:
            errors[rank] = f"{type(error).__name__}: {error}"
        except Exception as error:  # noqa: BLE001
            crashed.append(error)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in ranks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if crashed:
        raise crashed[0]
    return errors
