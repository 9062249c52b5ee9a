"""CUDA runtime of the fused op: symmetric-memory Triton kernels (``kernels``) and their host side
(``dispatch``)."""
