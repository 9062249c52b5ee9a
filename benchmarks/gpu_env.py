"""Import first in every benchmark: the environment the lent GPU machines require, and the checkout
on ``sys.path``. NVLink multicast must never be used there (docs/cuda_kernel.md); the variables
must be set before torch starts NCCL or symmetric memory."""

import importlib.util
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# weavepass/env.py loaded by path: importing the package would import torch first.
_spec = importlib.util.spec_from_file_location("weavepass_env", os.path.join(_ROOT, "weavepass", "env.py"))
_env = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_env)
_env.disable_multicast(override=True)
sys.path.insert(0, _ROOT)
