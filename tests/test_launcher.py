"""``runtime.cuda.launcher`` on the CPU: which launcher ``_bare_launcher`` picks for a Triton
launcher object, and what that costs per new signature (the launches themselves need a GPU:
tests/gpu/test_cuda_kernel_one_gpu.py)."""

from __future__ import annotations

import inspect

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
