#!/usr/bin/env bash
# Set up, then run the test suite (GPU tests skip themselves where CUDA is missing).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Inductor's CPU kernels as scalar C++: the tests check the pass's rewrites and their numbers, not
# Inductor's CPU vectorizer, and its vector headers were most of the C++ compile time. Cold cache,
# 2 cores, 2026-12-02: the whole suite took 1108 s with them, and 667 s without them and with 6
# fewer HF compiles (tests/test_hf_models.py CI_STRATEGIES); tests/test_token_split.py's
# test_split_matches_eager[3] alone took 54 s with them and 43 s without. Set it to 1 to test with
# vectorized kernels.
export TORCHINDUCTOR_VEC_ISA_OK="${TORCHINDUCTOR_VEC_ISA_OK:-0}"
python -m pytest -q -p no:cacheprovider "$@"
