#!/usr/bin/env bash
# Set up, then compile a tensor-parallel Llama with backend="weave" on N ranks (gloo on CPU when
# there is no GPU) and print the explain report and the difference against eager.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python scripts/demo.py "$@"
