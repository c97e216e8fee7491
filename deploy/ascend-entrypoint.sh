#!/usr/bin/env bash
# The Ascend image's entry point: CANN's and the ATB operator library's (NNAL) environment for
# every process the service starts, then the server with the container's arguments.
set -eo pipefail
source /usr/local/Ascend/ascend-toolkit/set_env.sh
source /usr/local/Ascend/nnal/atb/set_env.sh
exec python -m atb_plugin.server "$@"
