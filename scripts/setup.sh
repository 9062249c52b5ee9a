#!/usr/bin/env bash
# Install weavepass and what its tests need into the current Python. torch is pinned to the
# 2.13.0 CPU build on purpose: a looser pin makes pip fetch a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch, sys; sys.exit(0 if torch.__version__.startswith(('2.11', '2.12', '2.13')) else 1)" 2>/dev/null \
  || python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test,lint]"
