#!/usr/bin/env bash
# The Hugging Face sweep: every family of the installed transformers with a TP plan (about 116 in
# 5.24), a tiny random checkpoint each, fuse-only / split forced / FlashComm forced on 2 gloo ranks
# against eager, one process per family; regenerates docs/models.md's "Every family" table.
# CPU-heavy (about 15 s per family on 2 idle cores, 117 families: docs/models.md has the last run's
# time): niced. Arguments go to scripts/hf_sweep.py
# (model types to run only those, --timeout, --table-only). The families tests/test_hf_models.py
# asserts cell by cell: WEAVE_TEST_FULL=1 bash scripts/test.sh tests/test_hf_models.py
set -euo pipefail
cd "$(dirname "$0")/.."
export TORCHINDUCTOR_VEC_ISA_OK="${TORCHINDUCTOR_VEC_ISA_OK:-0}"
exec nice -n 19 python scripts/hf_sweep.py "$@"
