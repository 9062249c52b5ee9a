"""The fused op on a second, high-priority CUDA stream: the kernels of
``weave::fused_allreduce_rmsnorm_async`` and ``weave::join_async`` (schemas: ``weavepass.ops``).

The split puts one async op per half and site into the graph, and one ``join_async`` on its
two outputs and its inputs right before the first read of either output:

* fork: the op makes the communication stream wait for the current stream (an event), runs the
  chosen lowering there, records a "done" event, and files the join under its first output's data
  pointer (``_PENDING``);
* join: ``join_async`` takes that entry and makes the *current* stream wait for the done event (no
  host sync). To Inductor it mutates both outputs, so every later read of them stays after it, and
  it reads the op's inputs, so Inductor keeps their buffers until then.

Events and stream waits are recorded into a CUDA graph during capture, so the fork/join replays.
No stream reuses a block the other still reads:

* the caching allocator: the pending entry holds the inputs and the outputs until the join
  (``_Join`` says why this, not ``record_stream``). The ``cuda_symm`` lowering, in the steady state,
  allocates the outputs on the calling stream and launches on the communication stream by its
  handle, without making it current; the calling stream frees them only after its join. Other
  calls run with the communication stream current, and their outputs' blocks are only reused on
  that stream after a later fork;
* Inductor: it reuses a buffer in place (``bufN = bufM; del bufM  # reuse``) as soon as its last
  reader in the graph has been *launched*, which for the async op is long before the
  communication stream has read it. The join is that last reader. (Before the join op, the split
  read outputs through ``_c10d_functional.wait_tensor`` and kept inputs with a separate
  ``hold_inputs``: without that op, Inductor's graph partitions under ``mode="reduce-overhead"``
  reused the partial's buffer for the next GEMM while the fused kernel still read it, wrong
  answers on 2 x H200, 2026-11-30.)

Host cost is the point of this layout (one call per half and site, every forward pass): one op call
joins both outputs (two ``wait_tensor`` calls went through PyTorch's Python autograd wrapper of the
functional collective, about 10 us each on the H200 host), events come from a pool and are
recorded and waited on through the C methods, the current stream is looked up by its raw handle
(``_current``), not ``torch.cuda.current_stream``, and the ``cuda_symm`` lowering launches on the
communication stream without two stream switches (``_run_async``).

On CPU (and every non-CUDA device) the op is the plain fused op and the join finds no entry: both
are no-ops around the same math.

``weave::fused_allreduce_rmsnorm_push_async`` (``WeaveConfig.split_comm="push"``) forks only the
push of the partial rows (``weavepass.runtime.cuda.push``); its join (``_PushJoin``) launches the
reduce + add + RMSNorm of all rows on the joining stream. Off CUDA, off the ``cuda_symm`` lowering,
and for calls the push kernels cannot serve, it is the fused async op.
"""

from __future__ import annotations

import torch

from weavepass.config import Lowering
from weavepass.runtime import fused_allreduce_layernorm, get_lowering

_COMM_STREAMS: dict[int, torch.cuda.Stream] = {}
_STREAMS: dict[tuple[int, int], torch.cuda.Stream] = {}  # (device, raw handle) -> stream (``_current``)
_EVENTS: dict[int, list[torch.cuda.Event]] = {}  # device -> its free events (``_event``)
_PENDING: dict[int, object] = {}
"""An async op's join (``_Join`` or ``_PushJoin``) by the data pointer of its first output, until
``join_async`` takes it. Outputs with no elements file nothing (no kernel writes them)."""
_SWEEP_ABOVE = 256
"""Pending joins from which filing a new one first drops the fused ops' joins whose kernels are
done (``_file``). A run keeps a few pending at a time; only a graph that raised between an async op
and its join (an out-of-memory error, say) leaves one behind, holding that op's inputs, and a
serving loop that retries could pile them up. Dropping a done ``_Join`` is safe even if its join
is still to come: the wait it would add is already satisfied. A ``_PushJoin`` is never dropped
(its join launches the reduce)."""


def comm_stream(device: torch.device) -> torch.cuda.Stream:
    """The high-priority stream every async fused op of ``device`` runs on (one per device, so
    the fused ops of both halves stay in program order among themselves)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _COMM_STREAMS:
        _, highest = torch.cuda.Stream.priority_range()
        _COMM_STREAMS[index] = torch.cuda.Stream(device=index, priority=highest)
    return _COMM_STREAMS[index]


def _current(index: int) -> torch.cuda.Stream:
    """The current stream of device ``index``, found by its raw handle (``torch.cuda.current_stream``
    costs several microseconds of Python per call). Keyed by the device too: the default stream's
    handle is 0 on every device."""
    key = (index, torch._C._cuda_getCurrentRawStream(index))
    stream = _STREAMS.get(key)
    if stream is None:
        stream = _STREAMS[key] = torch.cuda.current_stream(index)
    return stream


def _event(index: int) -> torch.cuda.Event:
    """A free event of device ``index`` (an event records only on the device it was first
    recorded on). Events go back to their device's pool (``_free``) once every wait on them has
    been enqueued: a stream wait uses the event as recorded when the wait is enqueued, so
    re-recording it later (also inside CUDA-graph capture) changes nothing already waited for."""
    free = _EVENTS.get(index)
    return free.pop() if free else torch.cuda.Event()


def _free(index: int, event: torch.cuda.Event) -> None:
    _EVENTS.setdefault(index, []).append(event)


_EVENT_BASE = getattr(torch._C, "_CudaEventBase", None)
_record = getattr(_EVENT_BASE, "record", None) or (lambda event, stream: event.record(stream))
"""``event.record(stream)`` and ``event.wait(stream)`` (``stream`` waits for ``event``) through the C
methods, without the Python wrappers of ``torch.cuda.Event`` and ``Stream.wait_event`` (0.5 us per
fork on the H200 host). A build without CUDA has no such methods (and no async calls on CUDA)."""
_wait = getattr(_EVENT_BASE, "wait", None) or (lambda event, stream: event.wait(stream))


def _fork(index: int, main: torch.cuda.Stream, side: torch.cuda.Stream) -> None:
    """Make ``side`` wait for the work queued on ``main`` so far (both streams of device ``index``)."""
    fork = _event(index)
    _record(fork, main)
    _wait(fork, side)
    _free(index, fork)


def _file(key: int, entry) -> None:
    """``_PENDING[key] = entry``, after the sweep ``_SWEEP_ABOVE`` describes (not during CUDA-graph
    capture, where an event cannot be queried)."""
    if len(_PENDING) >= _SWEEP_ABOVE and not torch.cuda.is_current_stream_capturing():
        for done in [k for k, e in _PENDING.items() if isinstance(e, _Join) and e.event.query()]:
            del _PENDING[done]
    _PENDING[key] = entry


class _Join:
    """The pending join of a fused async op: ``join()`` makes the current stream wait for ``event``.

    It also holds the op's inputs (and its outputs: ``_run_async``) until then: their blocks belong
    to the main stream, and the communication stream reads them, so they must not go back to the
    caching allocator (and be handed to a later main-stream kernel) before the main stream has
    waited for that read. Holding them is how c10d's own collectives protect their inputs;
    ``record_stream`` would also be safe, but it keeps freed blocks allocated until the allocator
    polls an event, which CUDA-graph trees report as live tensors not tracked as outputs."""

    __slots__ = ("event", "keep")

    def __init__(self, event: torch.cuda.Event, keep: tuple):
        self.event = event
        self.keep = keep

    def join(self, index: int) -> None:
        _wait(self.event, _current(index))
        _free(index, self.event)
        self.keep = None


def fused_allreduce_rmsnorm_async(partial, residual, weight, eps, group_name, out_dtype, lowering,
                                  workspace_tokens, num_ctas=0):
    """``weave.fused_allreduce_rmsnorm`` (a ``FusedLowering`` named ``lowering``) on the
    communication stream; call ``join_async`` on both outputs before reading either (a no-op off
    CUDA). ``num_ctas`` > 0 sets the CUDA kernel's grid (``WeaveConfig.split_comm_ctas``); other
    lowerings ignore it.

    Host cost matters here (module docstring; benchmarks/bench_host_overhead.py measures it)."""
    run = get_lowering(lowering)
    if num_ctas and lowering == Lowering.CUDA_SYMM:
        options = {"max_workspace_tokens": workspace_tokens, "num_ctas": num_ctas}
    else:
        options = {"max_workspace_tokens": workspace_tokens}
    return _run_async(run, (partial, residual, weight, eps, group_name, out_dtype), options,
                      (partial, residual, weight), lowering == Lowering.CUDA_SYMM)


def fused_allreduce_layernorm_async(partial, residual, weight, bias, eps, group_name, out_dtype, lowering,
                                    workspace_tokens, num_ctas=0):
    """``weave.fused_allreduce_layernorm`` on the communication stream, joined as the RMSNorm form
    (``fused_allreduce_rmsnorm_async``); the join also holds the bias."""
    cuda_symm = lowering == Lowering.CUDA_SYMM
    options = {"num_ctas": num_ctas} if num_ctas and cuda_symm else {}
    return _run_async(fused_allreduce_layernorm,
                      (partial, residual, weight, bias, eps, group_name, out_dtype, lowering, workspace_tokens),
                      options, (partial, residual, weight, bias), cuda_symm)


def _run_async(run, args: tuple, options: dict, inputs: tuple, takes_stream: bool = False):
    """``run(*args, **options)`` (a lowering: ``(normed, residual_out)``; ``inputs[0]`` is the
    partial) on the communication stream of its device, its join filed; plainly off CUDA.

    ``takes_stream``: ``run`` takes the stream as its ``stream`` argument (the ``cuda_symm``
    lowering: ``fused_allreduce_rmsnorm_cuda`` says what it does with it); other lowerings run with
    the communication stream made current."""
    device = inputs[0].device
    if device.type != "cuda":
        return run(*args, **options)
    index = device.index
    main = _current(index)
    side = _COMM_STREAMS.get(index)
    if side is None:
        side = comm_stream(device)
    _fork(index, main, side)  # the inputs are ready
    if takes_stream:
        normed, residual_out = run(*args, stream=side, **options)
    else:
        torch.cuda.set_stream(side)
        try:
            normed, residual_out = run(*args, **options)
        finally:
            torch.cuda.set_stream(main)
    done = _event(index)
    _record(done, side)
    # Until the join the entry holds the outputs too: blocks of the calling stream's pool (the
    # direct launch's) must not be reused by that stream while the kernel may still write them,
    # even if the graph raised before its join. Blocks of the communication stream's pool (the
    # other calls') are freed on the main stream after the join; the side stream only reuses such a
    # block in a later call, after that call's fork has made it wait for everything the main stream
    # had queued (the reads included).
    if normed.numel():
        _file(normed.data_ptr(), _Join(done, (*inputs, normed, residual_out)))
    return normed, residual_out


class _PushJoin:
    """The join of a push call: ``join()`` makes the current stream (the one that called the op)
    wait for the push, then launches the reduce there; it writes both outputs. ``pending`` holds
    the reduce's arguments, the op's inputs among them, until then: the push reads the partial on
    the side stream, and the reduce reads all inputs on this stream, so after the launch the
    allocator may hand their blocks to later kernels of this stream (stream order puts those after
    the reduce)."""

    __slots__ = ("event", "stream", "call", "pending")

    def __init__(self, event: torch.cuda.Event, stream: torch.cuda.Stream, call, pending: tuple):
        self.event = event
        self.stream = stream
        self.call = call
        self.pending = pending

    def join(self, index: int) -> None:
        current = _current(index)
        if current != self.stream:  # the outputs were allocated for, and are written on, that stream
            raise RuntimeError("weave push op: joined on another stream than the one that called it")
        _wait(self.event, current)
        _free(index, self.event)
        self.call.reduce(*self.pending)
        self.pending = None


def fused_allreduce_rmsnorm_push_async(partial, residual, weight, eps, group_name, out_dtype, lowering,
                                       workspace_tokens, num_ctas, slot):
    """``weave.fused_allreduce_rmsnorm`` split in two (``WeaveConfig.split_comm="push"``): the
    push of this rank's partial rows into the peer's staging slot ``slot`` (0: half A, 1: half B)
    on the communication stream now, and the reduce + add + RMSNorm of all rows on the calling
    stream at the join (``join_async``). The join must run on the calling stream before the next
    call with the same ``slot`` (the split's does: a half's next site reads this one's outputs); a
    peer's push of the next call into ``slot`` waits for this rank's reduce.

    The outputs are allocated on the calling stream, which alone writes and reads them. Calls the
    push kernels cannot serve, and every call off CUDA or off the ``cuda_symm`` lowering, run as
    ``fused_allreduce_rmsnorm_async`` (same numbers; every rank decides the same, from the call's
    shapes and group)."""
    call = None
    if partial.device.type == "cuda" and lowering == Lowering.CUDA_SYMM:
        from weavepass.runtime.cuda.push import prepare_push

        call = prepare_push(partial, residual, weight, group_name, out_dtype, workspace_tokens, num_ctas)
    if call is None:
        return fused_allreduce_rmsnorm_async(partial, residual, weight, eps, group_name, out_dtype, lowering,
                                             workspace_tokens, num_ctas)
    device = partial.device
    index = device.index
    main = _current(index)
    normed = torch.empty_like(partial, dtype=out_dtype)
    residual_out = torch.empty_like(partial)
    side = comm_stream(device)
    _fork(index, main, side)  # the partial is ready
    call.push(partial, slot, side)  # launched there by handle (the workspace was set up before the fork)
    done = _event(index)
    _record(done, side)
    # prepare_push serves no empty call (a zero-row reduce would have nothing to file under)
    _file(normed.data_ptr(), _PushJoin(done, main, call, (partial, residual, weight, normed, residual_out, eps, slot)))
    return normed, residual_out


def join_async(normed: torch.Tensor, residual_out: torch.Tensor, inputs: list[torch.Tensor]) -> None:
    """The kernel of ``weave::join_async``: the current stream waits for the async op that made
    ``normed`` and ``residual_out`` (and, for a push op, computes them). A no-op for outputs with no
    pending join: off CUDA, empty outputs, or a join already done. ``inputs`` are only read by the
    graph (module docstring)."""
    if _PENDING:
        entry = _PENDING.pop(normed.data_ptr(), None)
        if entry is not None:
            entry.join(normed.device.index)
