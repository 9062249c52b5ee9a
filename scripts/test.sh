#!/usr/bin/env bash
# Set up, then run the test suite (GPU tests skip themselves where CUDA is missing).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python -m pytest -q -p no:cacheprovider "$@"
