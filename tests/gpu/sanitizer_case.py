"""One small case of the cuda_symm lowering on 2 ranks (``WEAVE_GPU_WORLD`` ranks when set), to run
under compute-sanitizer:

    compute-sanitizer --tool racecheck --target-processes all python3 tests/gpu/sanitizer_case.py

Prints ``PASS`` once per rank when every rank matched the reference. NVLink multicast stays off: ``spawn`` sets
the variables before the ranks start (this process starts no NCCL itself).
"""

import os
import sys

# Multicast stays off in the ranks: ``spawn`` applies weavepass.env before starting them (this
# process itself starts no NCCL communicator or symmetric allocation).
sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), os.getcwd()]

from gpu_cases import gpu_world  # noqa: E402
from test_cuda_kernel import small_case_worker  # noqa: E402

from weavepass.testing.distributed import spawn  # noqa: E402

if __name__ == "__main__":
    print(spawn(small_case_worker, gpu_world(), "nccl", timeout_s=float(os.environ.get("CASE_TIMEOUT_S", 240)))[0])
