"""The fused op on a second, high-priority CUDA stream: the kernels of
``weave::fused_allreduce_rmsnorm_async`` and ``weave::hold_inputs`` (schemas: ``weavepass.ops``).

The token split puts one of these per half and site into the graph, and a
``_c10d_functional.wait_tensor`` on each output right before its first consumer. The pair works
like a functional collective, which Inductor already knows how to order:

* fork: the op makes the communication stream wait for the current stream (an event), runs the
  chosen lowering there, and records a "done" event;
* join: it registers a ``Work`` for each output (``_register_work``) whose ``wait()`` makes the
  *current* stream wait for the done event; Inductor emits ``wait_tensor(buf)`` where the graph
  has it, and never moves reads of ``buf`` above it (the wait is a mutation of ``buf`` to Inductor).

Events and stream waits are recorded into a CUDA graph during capture, so the fork/join replays.
No stream reuses a block the other still reads:

* the caching allocator: the join holds the inputs until the outputs are waited on, and the
  outputs' blocks are only reused on the communication stream after a later fork (``_StreamJoin``
  says why this, not ``record_stream``);
* Inductor: it reuses a buffer in place (``bufN = bufM; del bufM  # reuse``) as soon as its last
  reader in the graph has been *launched*, which for the async op is long before the
  communication stream has read it. Only functional collectives get their inputs kept alive up
  to the wait; this op is a plain fallback kernel to Inductor. So the split puts
  ``weave::hold_inputs(waited, [partial, residual])`` right after the first wait of each async op:
  a later reader of the inputs, which Inductor must keep them for. Without it, Inductor's graph
  partitions (on by default under ``mode="reduce-overhead"`` in torch 2.11) reused the partial's
  buffer for the next GEMM while the fused kernel was still reading it (wrong answers on
  2 x H200, 2026-11-30).

On CPU (and every non-CUDA device) the op is the plain fused op and ``wait_tensor`` finds no
work: both are no-ops around the same math.

``weave::fused_allreduce_rmsnorm_push_async`` (``WeaveConfig.overlap_comm="push"``) forks only the
push of the partial rows (``weavepass.runtime.cuda.push``); its join (``_PushJoin``) launches the
reduce + add + RMSNorm of all rows on the waiting stream. Off CUDA, off the ``cuda_symm`` lowering,
and for calls the push kernels cannot serve, it is the fused async op.
"""

from __future__ import annotations


import torch
import torch.distributed as dist

from weavepass.runtime import get_lowering

_COMM_STREAMS: dict[int, torch.cuda.Stream] = {}


def comm_stream(device: torch.device) -> torch.cuda.Stream:
    """The high-priority stream every async fused op of ``device`` runs on (one per device, so
    the fused ops of both halves stay in program order among themselves)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _COMM_STREAMS:
        _, highest = torch.cuda.Stream.priority_range()
        _COMM_STREAMS[index] = torch.cuda.Stream(device=index, priority=highest)
    return _COMM_STREAMS[index]


class _StreamJoin(dist.Work):
    """``wait()`` makes the waiting thread's current stream wait for ``event`` (no host sync).

    It also holds the op's inputs until the last output is waited on: their blocks belong to the
    main stream, and the communication stream reads them, so they must not go back to the caching
    allocator (and be handed to a later main-stream kernel) before the main stream has waited for
    that read. Holding them is how c10d's own collectives protect their inputs; ``record_stream``
    would also be safe, but it keeps freed blocks allocated until the allocator polls an event,
    which CUDA-graph trees report as live tensors not tracked as outputs."""

    def __init__(self, event: torch.cuda.Event, device: torch.device, keep: tuple):
        super().__init__()
        self.event = event
        self.device = device
        self.keep = keep

    def wait(self, timeout=None) -> bool:
        torch.cuda.current_stream(self.device).wait_event(self.event)
        return True


def fused_allreduce_rmsnorm_async(partial, residual, weight, eps, group_name, out_dtype, lowering,
                                  workspace_tokens, num_ctas=0):
    """``weave.fused_allreduce_rmsnorm`` (a ``FusedLowering`` named ``lowering``) on the
    communication stream; wait on each output with ``_c10d_functional.wait_tensor`` before reading
    it (a no-op off CUDA). ``num_ctas`` > 0 sets the CUDA kernel's grid
    (``WeaveConfig.overlap_comm_ctas``); other lowerings ignore it.

    Host cost matters here (one call per half and site, every forward pass): no context managers,
    one join object for both outputs (benchmarks/bench_host_overhead.py measures it)."""
    run = get_lowering(lowering)
    options = {"max_workspace_tokens": workspace_tokens}
    if num_ctas and lowering == "cuda_symm":
        options["num_ctas"] = num_ctas
    device = partial.device
    if device.type != "cuda":
        return run(partial, residual, weight, eps, group_name, out_dtype, **options)
    main = torch.cuda.current_stream(device)
    side = comm_stream(device)
    side.wait_stream(main)  # fork: the inputs are ready
    torch.cuda.set_stream(side)
    try:
        normed, residual_out = run(partial, residual, weight, eps, group_name, out_dtype, **options)
        done = side.record_event()
    finally:
        torch.cuda.set_stream(main)
    # The outputs' blocks come from the communication stream's pool and are freed on the main
    # stream after its wait; the side stream only reuses such a block in a later call, after that
    # call's fork has made it wait for everything the main stream had queued (the reads included).
    join = _StreamJoin(done, device, (partial, residual, weight))
    for out in (normed, residual_out):
        torch._C._distributed_c10d._register_work(out, join)
    return normed, residual_out


class _PushJoin(dist.Work):
    """The join of a push call: the first ``wait()`` makes the current stream (the one that called
    the op) wait for the push, then launches the reduce there; it writes both outputs, so a
    second ``wait()`` (the other output's) does nothing. ``pending`` holds the reduce's arguments,
    the op's inputs among them, until then: the push reads the partial on the side stream, and
    the reduce reads all inputs on this stream, so after the launch the allocator may hand their
    blocks to later kernels of this stream (stream order puts those after the reduce)."""

    def __init__(self, event: torch.cuda.Event, stream: torch.cuda.Stream, call, pending: tuple):
        super().__init__()
        self.event = event
        self.stream = stream
        self.call = call
        self.pending = pending

    def wait(self, timeout=None) -> bool:
        if self.pending is not None:
            current = torch.cuda.current_stream(self.stream.device)
            if current != self.stream:  # the outputs were allocated for, and are written on, that stream
                raise RuntimeError("weave push op: waited on another stream than the one that called it")
            current.wait_event(self.event)
            self.call.reduce(*self.pending)
            self.pending = None
        return True


def fused_allreduce_rmsnorm_push_async(partial, residual, weight, eps, group_name, out_dtype, lowering,
                                       workspace_tokens, num_ctas, slot):
    """``weave.fused_allreduce_rmsnorm`` split in two (``WeaveConfig.overlap_comm="push"``): the
    push of this rank's partial rows into the peer's staging slot ``slot`` (0: half A, 1: half B)
    on the communication stream now, and the reduce + add + RMSNorm of all rows on the calling
    stream when an output is first waited for (``_c10d_functional.wait_tensor``). Both outputs
    must be waited on, on the calling stream, before the next call with the same ``slot`` (the
    split does: a half's next site reads this one's outputs); a peer's push of the next call into
    ``slot`` waits for this rank's reduce.

    The outputs are allocated on the calling stream, which alone writes and reads them. Calls the
    push kernels cannot serve, and every call off CUDA or off ``lowering="cuda_symm"``, run as
    ``fused_allreduce_rmsnorm_async`` (same numbers; every rank decides the same, from the call's
    shapes and group)."""
    call = None
    if partial.device.type == "cuda" and lowering == "cuda_symm":
        from weavepass.runtime.cuda.push import prepare_push

        call = prepare_push(partial, residual, weight, group_name, out_dtype, workspace_tokens, num_ctas)
    if call is None:
        return fused_allreduce_rmsnorm_async(partial, residual, weight, eps, group_name, out_dtype, lowering,
                                             workspace_tokens, num_ctas)
    device = partial.device
    main = torch.cuda.current_stream(device)
    normed = torch.empty_like(partial, dtype=out_dtype)
    residual_out = torch.empty_like(partial)
    side = comm_stream(device)
    side.wait_stream(main)  # fork: the partial is ready
    torch.cuda.set_stream(side)
    try:
        call.push(partial, slot)
        done = side.record_event()
    finally:
        torch.cuda.set_stream(main)
    join = _PushJoin(done, main, call, (partial, residual, weight, normed, residual_out, eps, slot))
    for out in (normed, residual_out):
        torch._C._distributed_c10d._register_work(out, join)
    return normed, residual_out


def hold_inputs(joined: torch.Tensor, inputs: list[torch.Tensor]) -> None:
    """Does nothing at run time. In a graph it reads the async op's ``inputs`` after the wait on
    ``joined`` (an output of the same op), so Inductor keeps their buffers, and reuses none of them
    in place, until the communication stream is done with them (module docstring). ``joined`` is
    declared mutated so that the op stays in the graph (no dead-code elimination in any supported
    torch) and after the wait that produced it."""
