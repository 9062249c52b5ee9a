#!/usr/bin/env bash
# Set up, then lint (ruff: pycodestyle, pyflakes, import order, bugbear, pyupgrade) and type-check
# (mypy: the modules pyproject.toml's [tool.mypy] lists, strictly where it says). Both read their
# settings from pyproject.toml. Fails when either finds something.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
status=0
echo "lint: ruff check ."
python -m ruff check . || status=1
echo "lint: mypy"
python -m mypy || status=1
exit "$status"
