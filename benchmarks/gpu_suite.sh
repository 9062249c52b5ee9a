#!/usr/bin/env bash
# GPU suite: the GPU tests under tests/gpu, then the benchmarks. One log ($OUT/suite.log) plus each
# benchmark's CSV and PNG go to $OUT (the device tool returns at most 8 files, 2 folder levels).
#
# Usage (repository root): OUT=/some/dir [WORLD=N] [STEPS=a,b,...] bash benchmarks/gpu_suite.sh [--quick]
#
# WORLD (default 2) is the number of ranks, one GPU each, of every multi-GPU test (WEAVE_GPU_WORLD)
# and benchmark (--world). When it is not 2 every output name carries it (suite_tp4.log,
# bench_overlap_tp4.csv, ...: benchmarks/report.py world_name), so TP=4 and TP=8 tables sit beside
# the 2-GPU ones in one $OUT. The model-benchmark shapes follow the world: real per-rank widths of
# that TP degree where a preset exists (70b_tp4 at 4; 70b_tp8 and 8b_tp8 at 8); a step with no
# preset for the world says so and runs nothing (override with OVERLAP_SHAPES, OVERLAP2_SHAPES,
# DECODE_SHAPES, DECODE70_SHAPES).
#
# Issues 16 and 17 (TP=8 and TP=4; NVLink multicast stays off, set below). Durations at 4 and 8
# ranks are not measured yet: the test limits are the 2-GPU ones, and the overlap, fused and
# flashcomm steps, one per call below, get 540 s at WORLD other than 2 (200-240 s at 2); a step
# killed by its limit still leaves the rows it printed in the log. One call each, in this order:
#   kind nvidia-h200-x4 (issue 17):
#     WORLD=4 STEPS=tests OUT=$OUT bash benchmarks/gpu_suite.sh
#     WORLD=4 STEPS=kernel OUT=$OUT bash benchmarks/gpu_suite.sh
#     WORLD=4 STEPS=fused OUT=$OUT bash benchmarks/gpu_suite.sh --quick
#     WORLD=4 STEPS=overlap OUT=$OUT bash benchmarks/gpu_suite.sh --quick
#   kind nvidia-h200-x8 (issue 16; its first 4 GPUs also serve issue 17's WORLD=4 calls):
#     WORLD=8 STEPS=tests OUT=$OUT bash benchmarks/gpu_suite.sh
#     WORLD=8 STEPS=kernel OUT=$OUT bash benchmarks/gpu_suite.sh
#     WORLD=8 STEPS=fused OUT=$OUT bash benchmarks/gpu_suite.sh --quick
#     WORLD=8 STEPS=overlap OUT=$OUT bash benchmarks/gpu_suite.sh --quick
#     WORLD=8 STEPS=flashcomm OUT=$OUT bash benchmarks/gpu_suite.sh --quick
#   then, as device time allows: WORLD=8 STEPS=decode70,host --quick; the same without --quick.
# With the one-GPU kind only (nvidia-h200): STEPS=onegpu, STEPS=sim, STEPS=peerwait (a call each),
# STEPS=local (issue 33: the op's local cost against Inductor and the HBM floor, ~4 min), then
# WORLD=1 STEPS=host,overlap,decode --quick:
# a group of one rank, so nothing is communicated; the model benchmarks then measure what weave's
# rewrites cost without the communication they hide (benchmarks/report.py model_world_size), and
# the fused, flashcomm and hf steps refuse a world of 1.
# Issue 33 on 2 GPUs (kind nvidia-h200-x2; what a group of one cannot show: the fraction of the
# communication hidden once the local cost is gone, and a world-2 tuning table), one call each:
#     WORLD=2 STEPS=auto OUT=$OUT bash benchmarks/gpu_suite.sh     ($OUT/tuning_table_w2.json: a table holds
#                                   one world size, so it ships beside the built-in world-1 table, not in it)
#     WORLD=2 STEPS=fused OUT=$OUT bash benchmarks/gpu_suite.sh --quick
#     WORLD=2 STEPS=overlap OUT=$OUT bash benchmarks/gpu_suite.sh   (without --quick: the _cg variants too)
# SHARED=1 (with the one-GPU kind): the WORLD ranks of the tests and kernel steps share one GPU
# (weavepass/testing/shared_gpu.py: gloo stands in for NCCL, CUDA IPC for the symmetric-memory
# rendezvous). It checks the multi-rank compile path and arithmetic, not speed, and not the kernels'
# synchronisation across GPUs (one L2, kernels taking turns); the log is suite_shared.log. Tests
# whose check needs NCCL or real timings skip with the reason (FlashComm's file: gloo's functional
# reduce_scatter on CUDA tensors segfaults). On one H200 (2026-12-01) the model, overlap and push
# files took ~290 s together; the kernel file did not finish in 160 s, so it gets a call of its own:
#   SHARED=1 STEPS=tests OUT=$OUT bash benchmarks/gpu_suite.sh
#   SHARED=1 STEPS=kernel KERNEL_TIMEOUT_S=540 OUT=$OUT bash benchmarks/gpu_suite.sh
# Issue 34 (GEMM with a scatter epilogue; docs/gemm_epilogue.md): with the one-GPU kind,
#   STEPS=gemm OUT=$OUT bash benchmarks/gpu_suite.sh --quick      (then without --quick: 64 cells)
#   STEPS=gather OUT=$OUT bash benchmarks/gpu_suite.sh --quick    (issue 34 item 3: the gather prologue; its op on
#                                   2 ranks sharing the GPU: WEAVE_GPU_SHARED=1 python3 -m pytest -m gpu -q -rA
#                                   tests/gpu/test_gather_gpu.py -k real_ranks; on 2 GPUs without the variable)
#   SHARED=1 STEPS=gemmop OUT=$OUT bash benchmarks/gpu_suite.sh   (the cuda_symm lowering of the matmul ops:
#                                   simulated ranks, then 2 ranks sharing the GPU; on kind nvidia-h200-x2
#                                   without SHARED, the same on 2 GPUs)
#   STEPS=gemmspeed OUT=$OUT bash benchmarks/gpu_suite.sh        (the GEMM and scatter speed twice, then
#                                   the table proposal by bench_gemm.TABLE_RULE: $OUT/gemm_table_proposal.py)
#   WORLD=1 STEPS=gemmmodel OUT=$OUT bash benchmarks/gpu_suite.sh  (the model with the op at a group of one
#                                   rank against Inductor, both modes: the issue's <= 1.00x target)
# and later, on 2 GPUs (kind nvidia-h200-x2), the model benchmark:
#   WORLD=2 STEPS=overlap OVERLAP_VARIANTS=inductor,weave_fuse,weave_overlap,weave_gemm_epilogue,no_comm \
#     OUT=$OUT bash benchmarks/gpu_suite.sh --quick
#   (target: >= 75 % of the removable communication hidden at 70b_tp8sim >= 4K tokens; moonshot: the
#   no_comm time)
# A session has 30 minutes of device time in all (10 per call): the four WORLD=8 calls may leave
# no room for the three WORLD=4 ones, which then go to a later session.
# At WORLD other than 2 the fused step measures hidden 8192 only, 1 .. 16K tokens (the issues'
# range; --quick: 1 8 128 1024 4096 16384 and 16 / 32 CTAs).
#
# STEPS picks the steps to run (default: all, in the order below), so the suite can be split into
# device calls of at most 10 minutes each. Steps:
#   tests      GPU tests: model, overlap and FlashComm end to end, then the push variant's (each
#              file spawns its ranks once and runs all its cases there, tests/gpu/gpu_cases.py; all
#              run on WORLD ranks)
#   kernel     the kernel's own GPU tests on WORLD ranks (tests/gpu/test_cuda_kernel.py)
#   onegpu     the tests that need only one GPU: the launch path at world 1
#              (tests/gpu/test_cuda_kernel_one_gpu.py), then tests/gpu/test_overlap_gpu.py on a group
#              of one rank (~75 s on 2026-12-01); a step for the `nvidia-h200` kind
#   peerwait   bounded waits: a simulated peer that never comes (every kernel kind), then a stalled
#              peer process sharing GPU 0 (runtime.cuda.peer_wait); one GPU, ~100 s
#   sim        the kernels of 2, 4 and 8 ranks simulated on one GPU (SIM_JOBS=N: N tests at a time,
#              one process each, benchmarks/parallel_pytest.py)
#              (tests/gpu/test_kernel_sim_one_gpu.py, mostly compiling every rank's kernels: with the
#              onegpu file it ran out of 420 s after 16 of 20 tests on 2026-12-01); one GPU
#   gemm       issue 34's kernels on one GPU: tests/gpu/test_gemm_gpu.py (the persistent Triton GEMM
#              against torch.mm, its scatter epilogue and the owners' reduce with 2, 4 and 8 ranks
#              simulated, bf16 and fp16), then bench_gemm (Triton GEMM plain and scattered to 2/4/8
#              simulated owners vs cuBLAS; --quick: 70b_tp8 and 8b_tp2 at 2K and 8K tokens); a step
#              for the `nvidia-h200` kind, not yet timed on the device
#   gather     issue 34's gather prologue on one GPU: tests/gpu/test_gather_gpu.py (push + gather GEMM,
#              2/4/8 ranks simulated, bf16/fp16, ragged, CUDA-graph replay, an owner that never
#              pushes), then bench_gather_prologue (the gather GEMM with 2/4/8 owners vs the plain
#              Triton GEMM and cuBLAS); `nvidia-h200` kind, not yet run on the device
#   tests34    issue 34's GPU tests on simulated ranks (test_gemm_gpu, test_gather_gpu, test_gemm_op_gpu but
#              their real-rank cases), each test its own process, GEMM34_JOBS (8) at a time; one GPU
#   gemmop     issue 34's cuda_symm lowering of the matmul ops: tests/gpu/test_gemm_op_gpu.py, the real
#              ranks' cases first (the ops at 1-1030 tokens, the decoder with gemm_epilogue="force",
#              reduce-overhead; WORLD=2 GPUs, or SHARED=1), then the simulated ranks (2 and 4, each in a
#              process of its own) and a CUDA-graph replay; bounded waits give up after 60 s
#              (WEAVE_PEER_TIMEOUT_S) rather than hang. SHARED=1 on one H200 (2026-12-03): 119 s and
#              116 s, 246 s for the call
#   gemmspeed  issue 34: bench_gemm --quick --repeat 2 (70b_tp8 and 8b_tp2, 2K and 8K tokens, 1, 2 and 8
#              simulated owners (1: the op at a group of one): the plain GEMM tuned, the scatter through TMA with deferred signals,
#              with pointer stores, and the second version's per-tile signals), then --table-from on its
#              CSVs: $OUT/gemm_table_proposal.py (gemm.MEASURED_CONFIGS / MEASURED_SPEED from the keys
#              whose two repeats agree). Limits 420 + 60 s; not yet timed (one repeat took 68 s on
#              2026-12-03 with fewer scatter variants)
#   gemmmodel  issue 34: bench_overlap (--quick, 2K-16K tokens, one sequence) at 70b_tp8sim and 8b_tp2 with
#              inductor, weave_fuse, weave_gemm_epilogue, inductor_cg, weave_gemm_epilogue_cg
#              (bench_overlap_gemm*.csv; meant for WORLD=1: the op's local cost against Inductor), 5 rounds
#              of 6 calls (3 rounds of 2 moved CUDA-graph cells by up to 8 points between runs); limit
#              480 s, ~100 s on one H200 (2026-12-04); a FALLBACK line in the log means a cell did not
#              time the kernels
#   splitcost  issue 33 (b): bench_split_cost, one layer's seven GEMMs on all tokens against the two
#              halves of the wave model's, the tile, the half and a 5/8 cut (70b_tp8sim, 8b_tp2, 2K-16K),
#              measured against the wave model's prediction; one GPU, well under a minute
#   simsweep   issue 33 (a), the profile of the simulated ranks: 2 and 4 ranks at 8192 tokens, the
#              rule's pipelined kernel on 32 and 16 CTAs per rank, tiles of 64 KiB x 16 warps (the
#              rule's), 32 KiB x 16 and x 8, 16 KiB x 16 and x 8 (the rule's 64 KiB tile spills at 16
#              warps: scripts/kernel_resources.py), each against a copy of the minimum bytes on the
#              whole GPU and a grid-stride copy on the ranks' CTAs, with the kernel's registers and
#              spills; then 8 ranks at 8192 tokens (pipelined, 16 CTAs): 16 KiB tiles x 16 and x 8
#              warps, then the rule's 64 KiB in a process of its own, each with
#              CUDA_DEVICE_MAX_CONNECTIONS=32 (8 rank streams on the default 8 hardware queues may
#              serialise two ranks' kernels); one GPU. On 2026-12-03 the sweep took 103 s; the first
#              8-rank call did not finish in 40 s (8 ranks = 8 kernel compiles: RANK is a constexpr),
#              hence 240 s each now
#   simloads   issue 33 (a), software-pipelined loads in the pipelined kernel (LaunchOverrides
#              load_stages): 2 and 4 ranks at 8192 tokens, 32 CTAs per rank, CTAS:KIB:WARPS:CHUNK:STAGES =
#              the rule's 64 KiB x 16 warps x 2 tiles per chunk (the before, in the same process and the
#              bit reference), 16 KiB tiles x 8 per chunk without (control) and with 2 or 3 stages,
#              16 tiles per chunk, 32 KiB tiles, 8 warps, the 64 KiB tile with 2 stages (2 ranks only:
#              shared memory); then 8 ranks at 8192 tokens (16 CTAs): 16 KiB x 8 x 2 stages, then the
#              rule's, each in its own process; then the simulator tests of the new loads (bit
#              identity, back to back at 2 ranks). Limits 240 + 75 + 75 + 130 s. On 2026-12-03
#              (one H200): 168 s, 64 s, the rule's 8 ranks did not finish in 75 s, and the tests
#              stopped at 130 s after 2 passed (the third, no_bit[4], passed alone in 51 s)
#   auto       issue 33: python -m weavepass.tune (70b_tp8sim, 8b_tp2, 2K-16K, 2 layers) into
#              $OUT/tuning_table_w<WORLD>.json (WORLD=1: reduce-overhead only, merged with the built-in
#              table's default-mode entries; else both modes at WORLD ranks), then bench_overlap at
#              those cells (2 layers) with inductor, weave_auto, inductor_cg, weave_auto_cg deciding
#              from that table, with the A/A controls inductor_aa(_cg), 8 interleaved rounds: its
#              "auto check" lines give each cell's verdict by bench_overlap.AUTO_CHECK_RULE (ok /
#              unresolved within the A/A band / SLOWER; met only if every cell is ok). WORLD=1 took
#              166 s on one H200 (2026-12-03) before the A/A controls and 8 rounds (not timed since);
#              WORLD=2 is not timed (AUTO_TABLE=path: verify that table instead of measuring one;
#              AUTO_VARIANTS)
#   host       bench_host_overhead (host cost per fused-op call, and per call of issue 34's matmul op,
#              planned once per signature and, for comparison, planned every call)
#   local      bench_local_cost: the op at a group of one rank against Inductor's add + RMSNorm and the
#              HBM floor, then simulated ranks (2, 4 and flat-kernel 8 at 2048 tokens) against a copy of
#              their minimum local bytes; one GPU (docs/cuda_kernel.md, "Local cost")
#   overlap    bench_overlap at 70b_tp8sim and 8b_tp2 (WORLD 4: 70b_tp4; 8: 70b_tp8 and 8b_tp8),
#              2K/4K/8K/16K tokens, one sequence
#              (--quick: inductor, weave_fuse, weave_overlap, weave_auto, no_comm; else
#              all default variants + weave_fuse_cg / weave_overlap_cg / inductor_cg)
#   overlap2   the same for 70b_tp2 and 8b_tp8sim (bench_overlap_2.csv / .png; WORLD 2 only)
#   decode     bench_decode at 8b_tp2, 16 layers, 2K cached tokens (--quick: batches 1, 32, 256;
#              without the default-mode `weave` variant and weave_min1_lamport; the _lamport
#              variants switch the Lamport one-shot kernel on, which the launch rule leaves off
#              until it is measured)
#              (WORLD 8: 8b_tp8; 4: none)
#   decode70   the same at 70b_tp8sim (bench_decode_70b.csv / .png; WORLD 4: 70b_tp4, 8: 70b_tp8)
#   fused      bench_fused_allreduce_rmsnorm, hidden 8192 and 4096 (--quick: fewer sizes and CTAs)
#   flashcomm  bench_flashcomm
#   hf         bench_hf_llama: HF Llama at Llama-3-8B widths (2 layers, random bf16), tp_plan="auto" on
#              2 GPUs, weave fuse / split / FlashComm vs eager and Inductor, checked against fp32
#              (--quick: 4096 tokens; else 2048 and 8192)
# Splitting into calls of <= 600 s (sums of the step limits; typical runs should be shorter, but
# compile times of the new presets and of the 16-layer decode model, one compile per variant and
# batch size, are not measured on the device yet):
#   call 1: STEPS=tests                            (limits 330 + 200 s; tests + kernel took ~435 s on
#                                                   2026-11-30, when every test still spawned its own ranks)
#   call 2: STEPS=overlap,decode --quick           (limits 240 + 300 s)
#   call 3: STEPS=kernel,host,fused --quick        (limits 200 + 150 + 200 s)
#   call 4: STEPS=decode70,flashcomm --quick       (limits 300 + 200 s)
#   call 5: STEPS=overlap2 --quick
# With only two calls, run 1 and 2: they cover issues 11 and 15 and the NCCL-symmetric variants of
# issue 18 inside the models. Rows of every benchmark but bench_host_overhead are also printed to the
# log as they are measured, so a step stopped by its limit still leaves its numbers in the log.
# Each step is bounded by its own timeout (env *_TIMEOUT_S); a failing step is reported and the
# suite goes on (the exit status says if any failed). Add a step with one `step NAME SECONDS
# command...` line below and its name in ALL_STEPS.
set -uo pipefail
# NVLink multicast must never be used on the lent machines (docs/cuda_kernel.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # benchmarks import weavepass from the checkout
OUT="${OUT:-gpu_suite_out}"
QUICK="${1:-}"
WORLD="${WORLD:-2}"
export WEAVE_GPU_WORLD="$WORLD"  # the GPU tests' world (tests/gpu/gpu_cases.py gpu_world)
TP=""  # what every output name carries: nothing at 2 ranks, _tpN else (benchmarks/report.py world_name)
[ "$WORLD" = 2 ] || TP="_tp$WORLD"
SHARED="${SHARED:-}"
if [ "$SHARED" = 1 ]; then
  # WORLD ranks on one GPU (weavepass/testing/shared_gpu.py): gloo for NCCL, CUDA IPC for the
  # symmetric workspace. Correctness only: the ranks time-slice one GPU, so no timing means anything.
  export WEAVE_GPU_SHARED=1
  TP="${TP}_shared"
fi
case "$WORLD" in
  1) SHAPES_OVERLAP="70b_tp8sim 8b_tp2" SHAPES_OVERLAP2="" SHAPES_DECODE="8b_tp2" SHAPES_DECODE70="70b_tp8sim" ;;
  2) SHAPES_OVERLAP="70b_tp8sim 8b_tp2" SHAPES_OVERLAP2="70b_tp2 8b_tp8sim"
     SHAPES_DECODE="8b_tp2" SHAPES_DECODE70="70b_tp8sim" ;;
  4) SHAPES_OVERLAP="70b_tp4" SHAPES_OVERLAP2="" SHAPES_DECODE="" SHAPES_DECODE70="70b_tp4" ;;
  8) SHAPES_OVERLAP="70b_tp8 8b_tp8" SHAPES_OVERLAP2="" SHAPES_DECODE="8b_tp8" SHAPES_DECODE70="70b_tp8" ;;
  *) SHAPES_OVERLAP="" SHAPES_OVERLAP2="" SHAPES_DECODE="" SHAPES_DECODE70="" ;;
esac
OVERLAP_SHAPES="${OVERLAP_SHAPES-$SHAPES_OVERLAP}"
OVERLAP2_SHAPES="${OVERLAP2_SHAPES-$SHAPES_OVERLAP2}"
DECODE_SHAPES="${DECODE_SHAPES-$SHAPES_DECODE}"
DECODE70_SHAPES="${DECODE70_SHAPES-$SHAPES_DECODE70}"
ALONE_LIMIT=540  # a benchmark step that has a device call to itself at 4 or 8 ranks
[ "$WORLD" = 2 ] && ALONE_LIMIT=""
ALL_STEPS="tests,kernel,onegpu,sim,peerwait,gemm,gemmop,gather,tests34,gemmspeed,gemmmodel,local,splitcost,simsweep,simloads,auto,host,overlap,overlap2,decode,decode70,fused,flashcomm,hf"
STEPS="${STEPS:-$ALL_STEPS}"
mkdir -p "$OUT"
LOG="$OUT/suite$TP.log"
status=0

for s in ${STEPS//,/ }; do
  case ",$ALL_STEPS," in
    *",$s,"*) ;;
    *) echo "unknown step '$s'; known: $ALL_STEPS" | tee -a "$LOG"; exit 2 ;;
  esac
  if [ "$SHARED" = 1 ] && [ "$s" != tests ] && [ "$s" != kernel ] && [ "$s" != gemmop ]; then
    echo "SHARED=1 runs the steps tests, kernel and gemmop only (correctness; ranks sharing a GPU time nothing), not '$s'" | tee -a "$LOG"
    exit 2
  fi
done

wanted() { [[ ",$STEPS," == *",$1,"* ]]; }

with_shapes() {  # with_shapes STEP "SHAPES": false (and says why) when the world has no preset
    [ -n "$2" ] && return 0
    echo "=== $1: no shape preset for WORLD=$WORLD; skipped (set its *_SHAPES to run it)" | tee -a "$LOG"
    return 1
}

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
  echo "steps: $STEPS ${QUICK}; world $WORLD"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "gpus", torch.cuda.device_count(), "nccl", torch.cuda.nccl.version())'
} 2>&1 | tee -a "$LOG"

OVERLAP_TOKENS="2048 4096 8192 16384"
if [ -n "$QUICK" ]; then
  OVERLAP_VARIANTS="${OVERLAP_VARIANTS:-inductor,weave_fuse,weave_overlap,weave_auto,no_comm}"  # inductor_nccl_symm aborted both ranks here (docs/cuda_kernel.md)
else
  OVERLAP_VARIANTS="${OVERLAP_VARIANTS:-eager,inductor,weave_fuse,weave_overlap,weave_auto,no_comm,inductor_cg,weave_fuse_cg,weave_overlap_cg}"
fi
# The push variant (split_comm="push"): its kernels passed the simulator tests (step sim) on
# one H200, and its pytest_push tests with 2 ranks sharing one H200 (SHARED=1, 2026-12-01); add
# weave_overlap_push and weave_overlap_push_cg (environment OVERLAP_VARIANTS overrides the lists
# above) once the pytest_push step has passed on 2 GPUs.

# Measured on 2 x H200 (2026-11-30, one spawn per test): the model + overlap files take ~205 s, the
# flashcomm file ~80 s, the kernel file ~150 s; the limits leave room for compile-cache misses (a
# step killed by its limit prints no summary at all).
if wanted tests; then
  step pytest_models "${E2E_TIMEOUT_S:-330}" python3 -m pytest -m gpu -q -rA --durations=10 \
      tests/gpu/test_model_gpu.py tests/gpu/test_overlap_gpu.py tests/gpu/test_flashcomm_gpu.py
  # In its own spawn: the push variant's kernels are new and a wrong wait would hang its ranks.
  step pytest_push "${PUSH_TIMEOUT_S:-200}" python3 -m pytest -m gpu -q -rA --durations=10 \
      tests/gpu/test_overlap_push_gpu.py
fi
wanted kernel && step pytest_kernel "${KERNEL_TIMEOUT_S:-200}" python3 -m pytest -m gpu -q -rA --durations=10 \
    tests/gpu/test_cuda_kernel.py
# A simulated rank spinning on a GPU cannot be interrupted from Python: where pytest-timeout is
# installed, its thread method ends the process after a test's limit and prints every stack.
HANG_GUARD=""
python3 -c "import pytest_timeout" 2>/dev/null && HANG_GUARD="--timeout ${TEST_TIMEOUT_S:-240} --timeout-method thread"
wanted onegpu && step pytest_one_gpu "${ONEGPU_TIMEOUT_S:-240}" python3 -m pytest -m gpu -q -rA \
    --durations=10 $HANG_GUARD tests/gpu/test_cuda_kernel_one_gpu.py
# SIM_JOBS=N (N > 1): each test in a process of its own, N at a time (benchmarks/parallel_pytest.py):
# the file's time is the host compiling every simulated rank's kernels, and serially it did not
# finish in one call (2026-12-04: 4 of 13 tests in 555 s).
if wanted sim && [ "${SIM_JOBS:-1}" -gt 1 ]; then
  step pytest_kernel_sim "${SIM_TIMEOUT_S:-480}" python3 benchmarks/parallel_pytest.py --jobs "$SIM_JOBS" \
      tests/gpu/test_kernel_sim_one_gpu.py -k "not peer_that_never" -- -m gpu $HANG_GUARD
elif wanted sim; then
  step pytest_kernel_sim "${SIM_TIMEOUT_S:-480}" python3 -m pytest -m gpu -q -rA \
      --durations=0 $HANG_GUARD tests/gpu/test_kernel_sim_one_gpu.py -k "not peer_that_never"
fi
# Bounded waits (runtime.cuda.peer_wait): a peer that never comes, per kernel kind (simulated ranks,
# one process each), then a stalled peer process with both ranks on GPU 0 (~100 s on one H200).
wanted peerwait && step pytest_peer_wait_sim "${PEERWAIT_TIMEOUT_S:-150}" python3 -m pytest -m gpu -q -rA \
    $HANG_GUARD tests/gpu/test_kernel_sim_one_gpu.py -k peer_that_never
wanted peerwait && WEAVE_GPU_SHARED=1 step pytest_peer_wait_shared "${PEERWAIT_TIMEOUT_S:-150}" python3 -m pytest \
    -m gpu -q -rA $HANG_GUARD tests/gpu/test_cuda_kernel.py -k stalled_peer
# Issue 34: the GEMM's own tests (simulated ranks spin on signals: HANG_GUARD), then its benchmark.
wanted gemm && step pytest_gemm "${GEMM_TEST_TIMEOUT_S:-240}" python3 -m pytest -m gpu -q -rA --durations=10 \
    $HANG_GUARD tests/gpu/test_gemm_gpu.py
wanted gemm && step bench_gemm "${GEMM_TIMEOUT_S:-420}" python3 benchmarks/bench_gemm.py --out "$OUT" $QUICK
# Issue 34 item 3: the gather prologue's tests (simulated GEMMs spin on flags: HANG_GUARD), then its benchmark.
wanted gather && step pytest_gather "${GATHER_TEST_TIMEOUT_S:-300}" python3 -m pytest -m gpu -q -rA --durations=10 \
    $HANG_GUARD tests/gpu/test_gather_gpu.py -k "not world8"
wanted gather && step pytest_gather8 "${GATHER_TEST_TIMEOUT_S:-300}" python3 -m pytest -m gpu -q -rA --durations=10 \
    $HANG_GUARD tests/gpu/test_gather_gpu.py -k world8
wanted gather && step bench_gather "${GATHER_TIMEOUT_S:-300}" python3 benchmarks/bench_gather_prologue.py --out "$OUT" \
    $QUICK
# Issue 34's simulated-rank GPU tests of all three files in one step, each test its own process,
# GEMM34_JOBS at a time (their time is compiling every simulated rank's kernels; correctness only).
wanted tests34 && step pytest_issue34_parallel "${TESTS34_TIMEOUT_S:-420}" python3 benchmarks/parallel_pytest.py \
    --jobs "${GEMM34_JOBS:-8}" tests/gpu/test_gemm_gpu.py tests/gpu/test_gather_gpu.py tests/gpu/test_gemm_op_gpu.py \
    -k "not real_ranks and not reference_model" -- -m gpu $HANG_GUARD
# Issue 34: the cuda_symm lowering of the matmul ops, real (or shared) ranks first, then simulated.
wanted gemmop && WEAVE_PEER_TIMEOUT_S="${WEAVE_PEER_TIMEOUT_S:-60}" step pytest_gemm_op_ranks \
    "${GEMMOP_TIMEOUT_S:-300}" python3 -m pytest -m gpu -q -s -rA --durations=10 tests/gpu/test_gemm_op_gpu.py \
    -k "real_ranks or reference_model"
wanted gemmop && step pytest_gemm_op_sim "${GEMMOP_SIM_TIMEOUT_S:-240}" python3 -m pytest -m gpu -q -rA \
    --durations=10 tests/gpu/test_gemm_op_gpu.py -k "simulated or cuda_graph"
# Issue 34: the GEMM and scatter speed in two interleaved repeats, then the measured table's proposal.
wanted gemmspeed && step bench_gemm_speed "${GEMMSPEED_TIMEOUT_S:-420}" python3 benchmarks/bench_gemm.py --quick \
    --repeat 2 --rep 20 --owners 1 2 8 --out "$OUT"
wanted gemmspeed && step gemm_table "${GEMMTABLE_TIMEOUT_S:-60}" python3 benchmarks/bench_gemm.py \
    --table-from "$OUT/bench_gemm_tune.csv" --table-out "$OUT/gemm_table_proposal.py"
# Issue 34: the model with the scatter-epilogue op against Inductor (a group of one rank: WORLD=1).
wanted gemmmodel && with_shapes gemmmodel "$OVERLAP_SHAPES" && step bench_overlap_gemm "${GEMMMODEL_TIMEOUT_S:-480}" \
    python3 benchmarks/bench_overlap.py --out "$OUT" --world "$WORLD" --name "bench_overlap_gemm$TP" --quick \
    --shape $OVERLAP_SHAPES --tokens $OVERLAP_TOKENS --layouts 1 \
    --rounds "${GEMMMODEL_ROUNDS:-5}" --iters "${GEMMMODEL_ITERS:-30}" \
    --variants "${GEMMMODEL_VARIANTS:-inductor,weave_fuse,weave_gemm_epilogue,inductor_cg,weave_gemm_epilogue_cg}"
# The split end to end on a group of one rank (no peers; streams, joins and CUDA graphs as on more).
wanted onegpu && WEAVE_GPU_WORLD=1 step pytest_overlap_one_gpu "${OVERLAP1_TIMEOUT_S:-180}" python3 -m pytest -m gpu \
    -q -rA --durations=10 $HANG_GUARD tests/gpu/test_overlap_gpu.py
wanted local && step bench_local_cost "${LOCAL_TIMEOUT_S:-300}" \
    python3 benchmarks/bench_local_cost.py --out "$OUT" --sim 2 4
wanted local && step bench_local_cost_sim8 "${LOCAL_TIMEOUT_S:-300}" \
    python3 benchmarks/bench_local_cost.py --out "$OUT" --no-op --sim 8 --sim-tokens 2048 --name bench_local_cost_sim8
wanted splitcost && step bench_split_cost "${SPLITCOST_TIMEOUT_S:-120}" python3 benchmarks/bench_split_cost.py --out "$OUT"
wanted simsweep && step bench_local_cost_sim_sweep "${SWEEP_TIMEOUT_S:-200}" \
    python3 benchmarks/bench_local_cost.py --out "$OUT" --no-op --sim 2 4 --name bench_local_cost_sweep \
    --sim-configs 32:64:16 16:64:16 32:32:16 32:32:8 32:16:16 32:16:8
wanted simsweep && CUDA_DEVICE_MAX_CONNECTIONS=32 step bench_local_cost_sim8_8192 "${SIM8_TIMEOUT_S:-240}" \
    python3 benchmarks/bench_local_cost.py --out "$OUT" --no-op --sim 8 --sim-configs 16:16:16 16:16:8 \
    --sim-timeout 15 --name bench_local_cost_sim8_8192
wanted simsweep && CUDA_DEVICE_MAX_CONNECTIONS=32 step bench_local_cost_sim8_8192_rule "${SIM8_TIMEOUT_S:-240}" \
    python3 benchmarks/bench_local_cost.py --out "$OUT" --no-op --sim 8 --sim-configs 16:64:16 \
    --sim-timeout 15 --name bench_local_cost_sim8_8192_rule
wanted simloads && step bench_local_cost_sim_loads "${LOADS_TIMEOUT_S:-240}" \
    python3 benchmarks/bench_local_cost.py --out "$OUT" --no-op --sim 2 4 --name bench_local_cost_sim_loads \
    --sim-configs 32:64:16:2:1 32:16:16:8:1 32:16:16:8:2 32:16:16:8:3 32:16:16:16:3 32:32:16:4:2 32:64:16:2:2 \
    32:16:8:8:3
# 8 ranks: each launch in a process of its own (a rank that gives up ends its process), the new
# loads first (the rule's 64 KiB pipelined kernel never finished at 8 ranks x 8192 tokens so far)
wanted simloads && CUDA_DEVICE_MAX_CONNECTIONS=32 step bench_local_cost_sim8_loads "${SIM8_TIMEOUT_S:-75}" \
    python3 benchmarks/bench_local_cost.py --out "$OUT" --no-op --sim 8 --sim-configs 16:16:16:8:2 \
    --sim-timeout 20 --name bench_local_cost_sim8_loads
wanted simloads && CUDA_DEVICE_MAX_CONNECTIONS=32 step bench_local_cost_sim8_rule "${SIM8_TIMEOUT_S:-75}" \
    python3 benchmarks/bench_local_cost.py --out "$OUT" --no-op --sim 8 --sim-configs 16:64:16:2:1 \
    --sim-timeout 20 --name bench_local_cost_sim8_rule
wanted simloads && step pytest_kernel_sim_loads "${LOADS_TEST_TIMEOUT_S:-130}" python3 -m pytest -m gpu -q -rA \
    --durations=0 $HANG_GUARD tests/gpu/test_kernel_sim_one_gpu.py -k "pipelined_loads_change_no_bit or back_to_back_calls_mixing_algorithms[2]"
# Issue 33 (c): a tuning table for both compile modes, then auto against Inductor per mode. At WORLD=1
# only the reduce-overhead entries are measured and merged with the built-in table's default-mode
# ones; at WORLD=N > 1 both modes are measured at N ranks (the table auto needs there: the built-in
# one is world 1).
AUTO_SHAPES="70b_tp8sim 8b_tp2"
AUTO_TOKENS="2048 4096 8192 16384"
if wanted auto; then
  if [ -z "${AUTO_TABLE:-}" ]; then
    AUTO_TABLE="$OUT/tuning_table_w$WORLD.json"
    if [ "$WORLD" = 1 ]; then
      step tune_reduce_overhead "${TUNE_TIMEOUT_S:-300}" python3 -m weavepass.tune --world 1 --shape $AUTO_SHAPES \
          --tokens $AUTO_TOKENS --layers 2 --modes reduce-overhead \
          --out "$OUT/tuning_cg_w1.json" --source "weavepass reduce-overhead entries (one H200, group of one rank, commit ${WEAVEPASS_COMMIT:-unknown})"
      step tune_merge 60 python3 -m weavepass.tune --merge weavepass/tune/builtin_table.json \
          "$OUT/tuning_cg_w1.json" --out "$AUTO_TABLE"
    else
      step tune_w$WORLD "${TUNE_TIMEOUT_S:-420}" python3 -m weavepass.tune --world "$WORLD" --shape $AUTO_SHAPES \
          --tokens $AUTO_TOKENS --layers 2 --modes default reduce-overhead --out "$AUTO_TABLE" \
          --source "weavepass table measured at world $WORLD (commit ${WEAVEPASS_COMMIT:-unknown})"
    fi
    if [ ! -f "$AUTO_TABLE" ]; then
      echo "=== auto: no table was written; verifying the built-in one" | tee -a "$LOG"
      AUTO_TABLE=builtin
    fi
  fi
  step bench_overlap_auto "${AUTO_TIMEOUT_S:-360}" python3 benchmarks/bench_overlap.py --out "$OUT" --world "$WORLD" \
      --name "bench_overlap_auto$TP" --layers 2 --shape $AUTO_SHAPES --tokens $AUTO_TOKENS --layouts 1 \
      --rounds 8 --iters 48 \
      --variants "${AUTO_VARIANTS:-inductor,inductor_aa,weave_auto,inductor_cg,inductor_aa_cg,weave_auto_cg}" \
      --tuning-table "$AUTO_TABLE"
fi
wanted host && step bench_host_overhead "${HOST_TIMEOUT_S:-150}" \
    python3 benchmarks/bench_host_overhead.py --out "$OUT" --world "$WORLD"
wanted overlap && with_shapes overlap "$OVERLAP_SHAPES" && step bench_overlap "${OVERLAP_TIMEOUT_S:-${ALONE_LIMIT:-240}}" \
    python3 benchmarks/bench_overlap.py --out "$OUT" --world "$WORLD" $QUICK --shape $OVERLAP_SHAPES \
    --tokens $OVERLAP_TOKENS --layouts 1 --variants "$OVERLAP_VARIANTS"
wanted overlap2 && with_shapes overlap2 "$OVERLAP2_SHAPES" && step bench_overlap_2 "${OVERLAP2_TIMEOUT_S:-240}" \
    python3 benchmarks/bench_overlap.py --out "$OUT" --world "$WORLD" --name "bench_overlap_2$TP" $QUICK \
    --shape $OVERLAP2_SHAPES --tokens $OVERLAP_TOKENS --layouts 1 --variants "$OVERLAP_VARIANTS"
if [ -n "$QUICK" ]; then
  DECODE_VARIANTS="eager,inductor,inductor_cg,weave_min1,weave_cg,weave_cg_lamport,inductor_nccl_symm"
else
  DECODE_VARIANTS="eager,inductor,inductor_cg,weave,weave_min1,weave_cg,weave_min1_lamport,weave_cg_lamport,inductor_nccl_symm"
fi
wanted decode && with_shapes decode "$DECODE_SHAPES" && step bench_decode "${DECODE_TIMEOUT_S:-300}" \
    python3 benchmarks/bench_decode.py --out "$OUT" --world "$WORLD" $QUICK --shape $DECODE_SHAPES \
    --variants "$DECODE_VARIANTS"
wanted decode70 && with_shapes decode70 "$DECODE70_SHAPES" && step bench_decode_70b "${DECODE70_TIMEOUT_S:-300}" \
    python3 benchmarks/bench_decode.py --out "$OUT" --world "$WORLD" --name "bench_decode_70b$TP" $QUICK \
    --shape $DECODE70_SHAPES --variants "$DECODE_VARIANTS"
FUSED_SIZES=()  # at 2 ranks both hidden sizes, 1 .. 32K tokens (the script's defaults)
[ "$WORLD" = 2 ] || FUSED_SIZES=(--hidden 8192 --tokens 1 8 32 128 512 1024 2048 4096 8192 16384)
[ -n "$QUICK" ] && FUSED_SIZES=(${FUSED_SIZES[@]:0:2} --tokens 1 8 128 1024 4096 16384 --ctas 16 32 --replays 10)
wanted fused && step bench_fused_allreduce_rmsnorm "${FUSED_TIMEOUT_S:-${ALONE_LIMIT:-200}}" \
    python3 benchmarks/bench_fused_allreduce_rmsnorm.py --out "$OUT" --world "$WORLD" "${FUSED_SIZES[@]}"
wanted flashcomm && step bench_flashcomm "${FLASHCOMM_TIMEOUT_S:-${ALONE_LIMIT:-200}}" \
    python3 benchmarks/bench_flashcomm.py --out "$OUT" --world "$WORLD" $QUICK
HF_TOKENS="2048 8192"
[ -n "$QUICK" ] && HF_TOKENS="4096"
wanted hf && [ "$WORLD" = 2 ] && step bench_hf_llama "${HF_TIMEOUT_S:-420}" \
    python3 benchmarks/bench_hf_llama.py --out "$OUT" --tokens $HF_TOKENS
exit $status
