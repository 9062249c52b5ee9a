#!/usr/bin/env bash
# Every Hugging Face family of tests/test_hf_models.py (CI runs a subset): tiny random checkpoints
# loaded with tp_plan="auto" on 2 gloo ranks, compiled fuse-only, split and FlashComm.
# About 3x the CI subset's time (several minutes on 2 CPU cores).
set -euo pipefail
cd "$(dirname "$0")/.."
WEAVE_TEST_FULL=1 bash scripts/test.sh tests/test_hf_models.py "$@"
