#!/usr/bin/env bash
# The test command. On a fresh machine: creates .venv (unless a virtualenv is active), installs
# atb-plugin editable with its test extra (scripts/bootstrap.sh), then, with no arguments, runs
# `ruff check` (ruff.toml) and the whole pytest suite: what CI runs. Exit code = ruff's if it
# fails, else pytest's (5 = no tests collected).
# Extra arguments go to pytest alone, e.g. scripts/run_tests.sh tests/test_shm_codec.py -x or
# scripts/run_tests.sh -m "not slow" (the quick loop): a focused run is not stopped by a lint
# finding elsewhere in the tree.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
source scripts/bootstrap.sh
if [ "$#" -eq 0 ]; then
  python -m ruff check .
fi
exec python -m pytest "$@"
