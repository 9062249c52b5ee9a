"""Environment policy: NVLink multicast (NVLS, multimem, ``cuMulticastCreate``) stays off.

weavepass's kernels only use unicast peer pointers, and the lent GPU machines forbid multicast
(docs/cuda_kernel.md). NCCL, PyTorch symmetric memory and NVSHMEM each read their own variable when
they start, so ``disable_multicast`` must run before the first communicator or symmetric allocation
of the process (benchmarks and GPU tests run it before importing torch).

This module imports nothing but ``os``, so a script can load it by path before torch is imported
(``benchmarks/gpu_env.py``).
"""

from __future__ import annotations

import os

MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
"""The variables that keep NCCL, PyTorch symmetric memory and NVSHMEM off multicast."""


def disable_multicast(*, override: bool) -> None:
    """Set ``MULTICAST_OFF`` in ``os.environ`` (inherited by processes started later).

    ``override=True`` (tests, benchmarks, spawned ranks on the lent machines) replaces values the
    process already had; ``override=False`` (the library) leaves a variable the user set alone.
    """
    for name, value in MULTICAST_OFF.items():
        if override:
            os.environ[name] = value
        else:
            os.environ.setdefault(name, value)
