"""GPU tests: marked ``gpu``, run with ``python3 -m pytest -m gpu tests/gpu`` on a machine with GPUs.

NVLink multicast must never be used on the lent machines (docs/cuda_kernel.md): the variables that
keep NCCL, PyTorch symmetric memory and NVSHMEM off it are set here, before any test starts a process.
"""

import os

from weavepass.env import disable_multicast

disable_multicast(override=True)


def pytest_addoption(parser):
    # Read only where tests/gpu is named on the command line (pytest loads this file early then);
    # WEAVE_GPU_WORLD works everywhere.
    parser.addoption("--gpu-world", type=int, default=None,
                     help="ranks (GPUs) of the multi-GPU kernel tests; default WEAVE_GPU_WORLD or 2")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA GPUs (skipped when there are too few)")
    world = config.getoption("--gpu-world", default=None)
    if world is not None:  # before the test modules import and read it (gpu_cases.gpu_world)
        os.environ["WEAVE_GPU_WORLD"] = str(world)
