"""CUDA runtime of the fused op: symmetric-memory Triton kernels (``kernels``) and their host side:
``support`` (what the kernel can serve), ``launch_plan`` (the launch rule), ``workspace`` (the
symmetric buffers) and ``dispatch`` (the lowering's entry)."""
