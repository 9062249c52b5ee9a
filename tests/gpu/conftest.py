"""GPU tests: marked ``gpu``, run with ``python3 -m pytest -m gpu tests/gpu`` on a machine with GPUs.

NVLink multicast must never be used on the lent machines (docs/cuda_kernel.md): the variables that
keep NCCL, PyTorch symmetric memory and NVSHMEM off it are set here, before any test starts a process.
"""

from weavepass.env import disable_multicast

disable_multicast(override=True)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA GPUs (skipped when there are too few)")
