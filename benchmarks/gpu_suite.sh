#!/usr/bin/env bash
# GPU suite: every GPU test under tests/gpu, then the benchmarks. One log ($OUT/suite.log) plus
# each benchmark's CSV and PNG go to $OUT (the device tool returns at most 8 files).
# Usage (repository root): OUT=/some/dir bash benchmarks/gpu_suite.sh [--quick]
# Add a benchmark by appending one `step NAME SECONDS command...` line. Each step is bounded by
# its own timeout; a failing step is reported and the suite goes on (the exit status says if any failed).
set -uo pipefail
# NVLink multicast must never be used on the lent machines (docs/cuda_kernel.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # benchmarks import weavepass from the checkout
OUT="${OUT:-gpu_suite_out}"
QUICK="${1:-}"
mkdir -p "$OUT"
LOG="$OUT/suite.log"
status=0

step() {  # step NAME TIMEOUT_S command...: runs command, appends its output to the suite log
    local name="$1" limit="$2"
    shift 2
    echo "=== $name (limit ${limit}s): $*" | tee -a "$LOG"
    local start=$SECONDS
    timeout --signal=TERM --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc after $((SECONDS - start))s" | tee -a "$LOG"
    [ "$rc" -eq 0 ] || status=1
}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "gpus", torch.cuda.device_count())'
} 2>&1 | tee -a "$LOG"

# End-to-end GPU tests first, the kernel's own (long) tests after the overlap benchmark, so a
# short device lease still measures every issue. Measured on 2 x H200 (2026-11-30): the model +
# overlap files take ~205 s, the flashcomm file ~80 s, the kernel file ~150 s; the limits leave
# room for compile-cache misses (a step killed by its limit prints no summary at all).
step pytest_models "${E2E_TIMEOUT_S:-480}" python3 -m pytest -m gpu -q -rA --durations=10 \
    tests/gpu/test_model_gpu.py tests/gpu/test_overlap_gpu.py tests/gpu/test_flashcomm_gpu.py
step bench_overlap "${OVERLAP_TIMEOUT_S:-300}" python3 benchmarks/bench_overlap.py --out "$OUT" $QUICK
step bench_host_overhead "${HOST_TIMEOUT_S:-120}" python3 benchmarks/bench_host_overhead.py --out "$OUT"
step pytest_kernel "${KERNEL_TIMEOUT_S:-420}" python3 -m pytest -m gpu -q -rA --durations=10 \
    tests/gpu/test_cuda_kernel.py
step bench_fused_allreduce_rmsnorm "${BENCH_TIMEOUT_S:-300}" \
    python3 benchmarks/bench_fused_allreduce_rmsnorm.py --out "$OUT" \
    ${QUICK:+--tokens 1 128 1024 4096 16384 --ctas 8 16 32 --replays 10 --compare-kernels}
step bench_flashcomm "${FLASHCOMM_TIMEOUT_S:-300}" python3 benchmarks/bench_flashcomm.py --out "$OUT" $QUICK
exit $status
