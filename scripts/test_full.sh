#!/usr/bin/env bash
# The whole suite: CI's tests, the ``full``-tier cases CI skips (tests/conftest.py) and every
# Hugging Face family with every strategy. About twice CI's time on 2 CPU cores.
set -euo pipefail
cd "$(dirname "$0")/.."
WEAVE_TEST_FULL=1 bash scripts/test.sh "$@"
