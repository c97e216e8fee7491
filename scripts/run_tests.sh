#!/usr/bin/env bash
# The test command. On a fresh machine: creates .venv (unless a virtualenv is active), installs
# atb-plugin editable with its test extra (scripts/bootstrap.sh), then runs the whole pytest
# suite. Exit code = pytest's (5 = no tests collected).
# Extra arguments go to pytest, e.g. scripts/run_tests.sh tests/test_shm_codec.py -x
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
source scripts/bootstrap.sh
exec python -m pytest "$@"
