"""Import first in every benchmark: the environment the lent GPU machines require, and the checkout
on ``sys.path``. NVLink multicast must never be used there (docs/cuda_kernel.md); the variables
must be set before torch starts NCCL or symmetric memory."""

import os
import sys

for _name, _value in (
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
):
    os.environ[_name] = _value
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
