"""One Triton kernel of fixed specialisation, launched with as little host work as possible.

Every hot kernel of this package (the fused op's, the push variant's push and reduce) runs once per
site and forward pass, and at small batches the host cost of a launch, not the kernel, sets the
time (benchmarks/bench_host_overhead.py). Triton's own dispatch (``JITFunction[grid](...)``)
re-derives the specialisation from every argument on every call: ~23 us per launch on the H200
host, against ~5 us for the compiled kernel's launcher (scripts/profile_host_cost.py).

A ``DirectLauncher`` holds a kernel's grid, constexprs and trailing arguments (the workspace:
tensors that outlive every launch, and integers) for one call signature. Its first launch goes
through Triton's dispatch, which compiles and specialises integer arguments and pointer alignment,
and records the compiled kernel; later launches call that kernel's launcher directly:

* with the tensors' addresses, not the tensors: Triton 3.6's launcher calls a tensor argument's
  ``data_ptr`` method and then ``cuPointerGetAttribute`` (a driver call) for every pointer. The
  addresses are needed anyway for the 16-byte alignment check (a call whose pointers are not each
  aligned as at the first launch takes Triton's path, which picks its own specialisation), the
  caller's signature key fixes every tensor's device, and the workspace's addresses are taken once;
* on Triton 3.6, through the C ``launch`` function without the Python wrapper around it
  (``_bare_launcher``);
* on the current stream, or on a stream it is handed, by handle (the split's communication stream:
  ``weavepass.runtime.streams``), without making that stream current;
* with tensor descriptors (``triton.tools.tensor_descriptor.TensorDescriptor``, the Triton GEMM's
  TMA operands) passed as they are: Triton's launcher wrapper (``wrap_handle_tensordesc`` in 3.6)
  turns each into its ``CUtensorMap`` and sizes at every launch, as its own path does; the
  alignment checked is the descriptor's base address.

Launch hooks (a profiler) get what Triton's own path gives them, tensors included. The direct path
is valid while the specialisation cannot change: the integer arguments are part of the caller's
signature key, and each pointer is checked for the alignment the first launch saw for it.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

DIRECT_LAUNCH = os.environ.get("WEAVE_TRITON_DIRECT_LAUNCH", "1") != "0"
"""Debugging switch: ``WEAVE_TRITON_DIRECT_LAUNCH=0`` sends every launch through Triton's dispatch
(read at each launch as ``launcher.DIRECT_LAUNCH``; tests and benchmarks set it)."""
_BARE_LAUNCH = os.environ.get("WEAVE_TRITON_BARE_LAUNCH", "1") != "0"
"""Debugging switch: ``WEAVE_TRITON_BARE_LAUNCH=0`` keeps Triton's Python launcher wrapper (``_bare_launcher``)."""


@dataclass
class DirectLauncher:
    """``kernel[grid](*tensors, *tail, *scalars, **meta)``, launched directly after the first call
    (module docstring). ``tensors`` and ``scalars`` change per call; the rest is fixed."""

    kernel: object  # triton JITFunction
    grid: tuple[int]
    tail: tuple  # per-signature arguments after the tensors: workspace tensors and integers
    meta: dict  # constexprs and num_warps
    compiled: object = None  # triton CompiledKernel, after the first launch
    constexprs: tuple = ()  # the kernel's constexpr arguments in parameter order (the launcher skips them)
    misaligned: int = 0  # which tensor pointers the first launch saw off 16-byte alignment (``_misaligned``)
    tail_ptrs: tuple = ()  # ``tail`` with the workspace tensors as addresses (they outlive the launch)
    runtime: object = None  # triton.knobs.runtime: the launch hooks, read at every launch
    idle_enter: object = None  # the launch-enter hook chain seen at the first launch (``_idle_chain``)
    idle_exit: object = None  # the same for the exit hook
    bare: object = None  # the launcher to call (``_bare_launcher``) and its extra arguments
    bare_fixed: tuple = ()
    descriptors: bool = False  # whether ``tensors`` holds tensor descriptors (TMA operands), seen at the first launch

    def launch(self, tensors: tuple, scalars: tuple = (), stream: torch.cuda.Stream | None = None) -> None:
        """Launch on ``tensors`` (all on one CUDA device) and ``scalars``, on ``stream`` (default:
        the current stream)."""
        compiled = self.compiled
        if compiled is not None and DIRECT_LAUNCH:
            first = tensors[0]
            if self.descriptors:  # tensor descriptors pass as they are (Triton's launcher expands them)
                ptrs = [t.data_ptr() if isinstance(t, torch.Tensor) else t for t in tensors]
                misaligned = _misaligned([_address(t) for t in tensors])
                if not isinstance(first, torch.Tensor):
                    first = first.base
            else:
                ptrs = [t.data_ptr() for t in tensors]
                misaligned = _misaligned(ptrs)
            if misaligned == self.misaligned:
                raw = (torch._C._cuda_getCurrentRawStream(first.device.index) if stream is None
                       else stream.cuda_stream)
                runtime = self.runtime
                enter = runtime.launch_enter_hook
                exit_hook = runtime.launch_exit_hook
                if (enter is None or enter is self.idle_enter and not enter.calls) and (
                        exit_hook is None or exit_hook is self.idle_exit and not exit_hook.calls):
                    self.bare(self.grid[0], 1, 1, raw, compiled.function, *self.bare_fixed, compiled.packed_metadata,
                              None, None, None, *ptrs, *self.tail_ptrs, *scalars, *self.constexprs)
                else:
                    enter, exit_hook = _hook(enter), _hook(exit_hook)
                    args = (*tensors, *self.tail, *scalars)
                    metadata = None if enter is None else compiled.launch_metadata(self.grid, raw, *args)
                    compiled.run(self.grid[0], 1, 1, raw, compiled.function, compiled.packed_metadata,
                                 metadata, enter, exit_hook, *args, *self.constexprs)
                return
        if stream is not None:
            with torch.cuda.stream(stream):
                self.launch(tensors, scalars)
            return
        result = self.kernel[self.grid](*tensors, *self.tail, *scalars, **self.meta)
        runtime = _triton_runtime_knobs()
        if compiled is None and runtime is not None and hasattr(result, "packed_metadata"):
            names = self.kernel.arg_names[len(tensors) + len(self.tail) + len(scalars):]
            if set(names) <= set(self.meta):  # every remaining parameter is a constexpr we pass
                self.constexprs = tuple(self.meta[name] for name in names)
                self.descriptors = not all(isinstance(t, torch.Tensor) for t in tensors)
                self.misaligned = _misaligned([_address(t) for t in tensors])
                self.tail_ptrs = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in self.tail)
                self.runtime = runtime
                self.idle_enter = _idle_chain(runtime.launch_enter_hook)
                self.idle_exit = _idle_chain(runtime.launch_exit_hook)
                self.bare, self.bare_fixed = _bare_launcher(result.run)
                self.compiled = result


def _address(t) -> int:
    """A tensor's address, or a tensor descriptor's base address (``triton.tools.tensor_descriptor``)."""
    return t.data_ptr() if isinstance(t, torch.Tensor) else t.base.data_ptr()


def _misaligned(addresses: list[int]) -> int:
    """Which addresses are not 16-byte aligned, as a bit mask (bit ``i``: ``addresses[i]``; 0: all
    aligned). Triton specialises each pointer argument on its own alignment: a launch whose pattern
    differs from the first launch's (not only one whose every address is aligned) needs another
    compiled kernel."""
    bits = 0
    for address in addresses:
        bits |= address
    if not bits & 15:
        return 0
    return sum(1 << i for i, address in enumerate(addresses) if address & 15)


def _idle_chain(hook):
    """``hook`` when it is a hook chain (Triton 3.6's ``HookChain``: a launch hook is idle while its
    ``calls`` list is empty, read at every launch), else an object no hook is."""
    return hook if isinstance(getattr(hook, "calls", None), list) else _NOT_A_CHAIN


_NOT_A_CHAIN = object()


def _hook(hook):
    """A Triton launch hook, or None when there is none to call: Triton 3.6 keeps an empty
    ``HookChain`` where older ones keep None."""
    if hook is None:
        return None
    calls = getattr(hook, "calls", None)
    return hook if calls is None or calls else None


_TRITON_36_CALL = (
    "self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl, "
    "global_scratch, profile_scratch, *args)"
)


def _bare_launcher(run):
    """``(launch, fixed)``: what to call instead of Triton's launcher object ``run`` as
    ``launch(gridX, gridY, gridZ, stream, function, *fixed, *args)``.

    Triton 3.6's ``CudaLauncher.__call__`` allocates global and profile scratch when the kernel
    needs it (ours need none) and then calls its C ``launch`` with two of its own attributes and
    the two scratch buffers inserted. That wrapper cost 1.3 us per launch on the H200 host (A/B in
    one process, scripts/profile_host_cost.py). When the wrapper is exactly that code and the
    kernel needs no scratch, the C function (for a kernel with tensor descriptors, Triton's
    ``wrap_handle_tensordesc`` around it) is returned with those four arguments; otherwise (another
    Triton, scratch needed, ``WEAVE_TRITON_BARE_LAUNCH=0``) ``run`` itself with none."""
    if not _BARE_LAUNCH:
        return run, ()
    try:
        fixed = (run.launch_cooperative_grid, run.launch_pdl, None, None)
        no_scratch = run.global_scratch_size == 0 and run.profile_scratch_size == 0
    except AttributeError:
        return run, ()
    if _calls_launch_as_36(type(run)) and no_scratch and callable(getattr(run, "launch", None)):
        return run.launch, fixed
    return run, ()


@functools.cache
def _calls_launch_as_36(launcher_type: type) -> bool:
    """Whether ``launcher_type.__call__`` calls its ``launch`` as Triton 3.6's does (``_bare_launcher``).
    Read once per type: ``inspect.getsource`` costs ~0.5 ms, paid at every new signature's first
    launch otherwise (the matmul op plans one per token count)."""
    try:
        import inspect

        source = " ".join(inspect.getsource(launcher_type.__call__).split())
    except (AttributeError, OSError, TypeError):
        return False
    return _TRITON_36_CALL in source


@functools.cache
def _triton_runtime_knobs():
    """``triton.knobs.runtime`` (where launch hooks live), or None in a Triton without it (then
    every launch goes through Triton's dispatch)."""
    try:
        from triton import knobs
    except ImportError:
        return None
    return getattr(knobs, "runtime", None)
