"""The benchmarks' timing is ``weavepass.tune.timing`` (shared with ``python -m weavepass.tune``):
whole forward calls, ranks in step, CUDA events on CUDA."""

from weavepass.tune.timing import LineProgress, interleaved_ms, progress_bar, times_ms  # noqa: F401
