"""``runtime.cuda.launcher`` on the CPU: which launcher ``_bare_launcher`` picks for a Triton
launcher object, and what that costs per new signature (the launches themselves need a GPU:
tests/gpu/test_cuda_kernel_one_gpu.py)."""

from __future__ import annotations

import inspect

import torch

from weavepass.runtime.cuda import launcher


class _Triton36Launcher:
    """Triton 3.6's ``CudaLauncher`` as far as ``_bare_launcher`` reads it."""

    launch_cooperative_grid = False
    launch_pdl = True
    global_scratch_size = 0
    profile_scratch_size = 0

    def launch(self, *args):
        return args

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        global_scratch = profile_scratch = None
        self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl,
                    global_scratch, profile_scratch, *args)


class _OtherLauncher(_Triton36Launcher):
    """Another Triton's: its ``__call__`` passes other arguments to ``launch``."""

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        self.launch(gridX, gridY, gridZ, stream, function, args)


def test_bare_launcher_reads_the_wrapper_source_once_per_type(monkeypatch):
    """The C ``launch`` with the wrapper's four arguments for Triton 3.6's wrapper, the wrapper
    itself for another; the wrapper's source read once per launcher type, not at every new
    signature's first launch (``inspect.getsource`` costs ~0.5 ms: the matmul op plans one
    signature per token count, ``gemm.ScatterPlan``)."""
    monkeypatch.setattr(launcher, "_BARE_LAUNCH", True)
    reads = []
    getsource = inspect.getsource
    monkeypatch.setattr(inspect, "getsource", lambda obj: reads.append(obj) or getsource(obj))
    for _ in range(3):
        run = _Triton36Launcher()
        assert launcher._bare_launcher(run) == (run.launch, (False, True, None, None))
        other = _OtherLauncher()
        assert launcher._bare_launcher(other) == (other, ())
    assert len(reads) == 2, reads
    scratch = _Triton36Launcher()
    scratch.global_scratch_size = 8
    assert launcher._bare_launcher(scratch) == (scratch, ())


class _Compiled:
    """What Triton's dispatch returns, as far as ``DirectLauncher`` reads it; its ``run`` records
    the direct launches."""

    function = 0
    packed_metadata = None

    def __init__(self, calls: list) -> None:
        self.run = lambda *args: calls.append("direct")


class _Kernel:
    """A ``JITFunction`` of two pointer parameters whose dispatch (``kernel[grid](...)``) records
    the launch and returns the compiled kernel."""

    arg_names = ["x", "w"]

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getitem__(self, grid):
        def dispatch(*args, **meta):
            self.calls.append("triton")
            return _Compiled(self.calls)

        return dispatch


def test_direct_launch_needs_each_pointer_aligned_as_at_the_first_launch(monkeypatch):
    """Triton specialises each pointer on its own 16-byte alignment: after a first launch with x
    off alignment and w on it, only launches of that pattern go direct; w off alignment (x on it)
    takes Triton's dispatch, though again not every pointer is aligned."""
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 0, raising=False)
    monkeypatch.setattr(launcher, "DIRECT_LAUNCH", True)
    buf = torch.zeros(64, dtype=torch.float16)
    on, off = buf[16:32], buf[1:17]
    assert on.data_ptr() % 16 == 0 and off.data_ptr() % 16
    kernel = _Kernel()
    direct = launcher.DirectLauncher(kernel, (1,), (), {})
    expected = []
    for tensors, path in [((off, on), "triton"), ((off, on), "direct"), ((on, off), "triton"),
                          ((on, on), "triton"), ((off, off), "triton"), ((off, on), "direct")]:
        direct.launch(tensors)
        expected.append(path)
        assert kernel.calls == expected, (tensors, kernel.calls)
