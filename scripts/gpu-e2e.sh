#!/usr/bin/env bash
# The GPU run (issue 28, item 6): on an NVIDIA machine, CapyCTL standalone drives the real vLLM
# (GPU build) serving a model made here, large enough that a park and a wake move real memory,
# and prints:
#   - NVML's memory in use: before the start, ready, parked, woken;
#   - the engine's own sleep and wake times (from its log: "It took ... seconds to fall asleep",
#     "It took ... seconds to wake up");
#   - CapyCTL's wake-to-first-token: a streamed request to the parked model, from the request
#     sent to its first token;
#   - CapyCTL's own share: wake-to-first-token minus the engine's wake, and the switch record's
#     phases.
# Finishes in under 8 minutes (each step has a timeout; the whole run is bounded by TOTAL_S).
#
#   scripts/gpu-e2e.sh                      # prints the figures; exits non-zero on a failure
#
# Needs: nvidia-smi; a vLLM 0.32 GPU build (CAPYCTL_GPU_VLLM: the `vllm` program; else `vllm`
# on PATH; else it is installed with pip into ${CAPYCTL_VLLM_GPU_HOME:-~/.cache/capyctl-vllm-gpu},
# which needs PyPI); capyctl built with NVML (CAPYCTL_BIN; else target/release/capyctl when it
# was built with `--features nvml`; else it is built with cargo).
set -euo pipefail
SELF="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$SELF")/.."
TOTAL_S=${TOTAL_S:-470}
# The whole run is bounded: the script runs again under `timeout`, which ends it (and the trap
# below stops CapyCTL and its engine) past TOTAL_S.
if [[ -z "${CAPYCTL_GPU_E2E_BOUNDED:-}" ]]; then
  CAPYCTL_GPU_E2E_BOUNDED=1 exec timeout --signal=TERM --kill-after=30 "$TOTAL_S" "$SELF" "$@"
fi
START_S=$(date +%s)
log() { echo "gpu-e2e [$(($(date +%s) - START_S))s]: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }
left() { echo $((TOTAL_S - ($(date +%s) - START_S))); }

command -v nvidia-smi >/dev/null || die "nvidia-smi not found: this script needs an NVIDIA GPU"
gpu_used_mib() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 0 | tr -d ' '; }
GPU_TOTAL_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0 | tr -d ' ')
log "GPU 0: $(nvidia-smi --query-gpu=name --format=csv,noheader -i 0), ${GPU_TOTAL_MIB} MiB"

# --- vLLM (GPU build) ---
VLLM=${CAPYCTL_GPU_VLLM:-}
if [[ -z "$VLLM" ]] && command -v vllm >/dev/null; then VLLM=$(command -v vllm); fi
if [[ -z "$VLLM" ]]; then
  HOME_DIR=${CAPYCTL_VLLM_GPU_HOME:-$HOME/.cache/capyctl-vllm-gpu}
  if [[ ! -x "$HOME_DIR/venv/bin/vllm" ]]; then
    log "installing vllm==0.32.0 (GPU build) into $HOME_DIR"
    python3 -m venv "$HOME_DIR/venv"
    timeout 300 "$HOME_DIR/venv/bin/pip" install -q "vllm==0.32.0" \
      || die "vllm 0.32.0 could not be installed (no PyPI here?); set CAPYCTL_GPU_VLLM to an installed vllm"
  fi
  VLLM=$HOME_DIR/venv/bin/vllm
fi
PY=$(dirname "$VLLM")/python3
[[ -x "$PY" ]] || PY=python3
log "vllm: $VLLM ($("$VLLM" --version 2>/dev/null | tail -n1))"

# --- capyctl with NVML ---
BIN=${CAPYCTL_BIN:-}
if [[ -z "$BIN" ]]; then
  if [[ -x target/release/capyctl ]] && strings target/release/capyctl | grep -q libnvidia-ml; then
    BIN=target/release/capyctl
  else
    log "building capyctl with NVML"
    cargo build --release -q -p capyctl --features nvml
    BIN=target/release/capyctl
  fi
fi

# --- the model: about 1.0 B parameters in bf16 (2 GB of weights), so parks move memory ---
WORK=$(mktemp -d /tmp/capyctl-gpu-e2e.XXXXXX)
MODEL=$WORK/model
log "writing the model in $MODEL"
timeout 120 "$PY" scripts/make-tiny-model.py "$MODEL" --seed 7 --hidden 2048 --layers 20 \
  --heads 16 --intermediate 5632 --dtype bfloat16 >/dev/null

free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
INF=$(free_port); MGMT=$(free_port)
DATA=$WORK/data
cat >"$WORK/standalone.yaml" <<YAML
server:
  listen: {inference: "127.0.0.1:$INF", management: "127.0.0.1:$MGMT"}
host:
  id: gpu-e2e
  engines:
    vllm:
      command: ["$VLLM"]
deployments:
  - name: big
    engine: vllm
    model: $MODEL
    resources: {gpu_memory: 20GiB, weights_memory: 3GiB}
    extra_args: ["--gpu-memory-utilization", "0.2", "--max-model-len", "2048", "--enforce-eager"]
YAML

USED_BEFORE=$(gpu_used_mib)
"$BIN" start standalone --file "$WORK/standalone.yaml" --data-dir "$DATA" >"$WORK/capyctl.log" 2>&1 &
CAPYCTL_PID=$!
cleanup() {
  kill -TERM "$CAPYCTL_PID" 2>/dev/null || true
  for _ in $(seq 1 25); do kill -0 "$CAPYCTL_PID" 2>/dev/null || break; sleep 1; done
  kill -KILL "$CAPYCTL_PID" 2>/dev/null || true
  pkill -f -- "serve $MODEL" 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT
for _ in $(seq 1 60); do
  [[ -f "$DATA/admin-token" ]] && curl -fsS "http://127.0.0.1:$MGMT/readyz" >/dev/null 2>&1 && break
  kill -0 "$CAPYCTL_PID" 2>/dev/null || { cat "$WORK/capyctl.log" >&2; die "capyctl exited"; }
  sleep 1
done
# The token goes by the environment, not the command line (which `ps` shows).
CAPYCTL_ADMIN_TOKEN=$(cat "$DATA/admin-token")
export CAPYCTL_ADMIN_TOKEN
CLI=("$BIN" --server "http://127.0.0.1:$MGMT")

# Time to the first streamed token of a chat request, in seconds (prints "SECONDS TEXT").
first_token() {
  "$PY" - "$INF" "$1" <<'PY'
import json, sys, time, urllib.request
port, timeout = sys.argv[1], float(sys.argv[2])
body = json.dumps({"model": "big", "stream": True, "max_tokens": 8, "temperature": 0,
                   "messages": [{"role": "user", "content": "Say hello."}]}).encode()
req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                             {"content-type": "application/json"})
t0 = time.monotonic()
with urllib.request.urlopen(req, timeout=timeout) as r:
    for line in r:
        if line.startswith(b"data: {"):
            print(f"{time.monotonic() - t0:.3f}")
            break
    for _ in r:
        pass
PY
}

log "cold start (a first request)"
COLD=$(first_token "$(left)") || true
[[ -n "$COLD" ]] || die "the first request gave no token: $(tail -n 20 "$WORK/capyctl.log")"
USED_READY=$(gpu_used_mib)

log "park"
"${CLI[@]}" park deployment big >/dev/null
for _ in $(seq 1 120); do
  "${CLI[@]}" list deployments | grep -q '^big .*parked' && break
  sleep 0.5
done
"${CLI[@]}" list deployments | grep -q '^big .*parked' || die "big did not park: $("${CLI[@]}" list deployments)"
USED_PARKED=$(gpu_used_mib)

log "wake (a request to the parked model)"
WAKE_TTFT=$(first_token 120) || true
[[ -n "$WAKE_TTFT" ]] || die "the request to the parked model gave no token"
USED_WOKEN=$(gpu_used_mib)

ENGINE_LOG=$(ls "$DATA"/engines/*.log | head -n1)
SLEEP_S=$(grep -oE 'took [0-9.]+ seconds to fall asleep' "$ENGINE_LOG" | tail -n1 | grep -oE '[0-9.]+' || echo "?")
WAKE_S=$(grep -oE 'took [0-9.]+ seconds to wake up' "$ENGINE_LOG" | tail -n1 | grep -oE '[0-9.]+' || echo "?")
SWITCH=$("${CLI[@]}" switches --deployment big | tail -n1)

echo
echo "== gpu-e2e figures (GPU 0: ${GPU_TOTAL_MIB} MiB; model $(du -sh "$MODEL" | cut -f1) of bf16 weights)"
printf '%-44s %s\n' "NVML memory used before start (MiB)" "$USED_BEFORE"
printf '%-44s %s\n' "NVML memory used, ready (MiB)" "$USED_READY"
printf '%-44s %s\n' "NVML memory used, parked (MiB)" "$USED_PARKED"
printf '%-44s %s\n' "NVML memory used, woken (MiB)" "$USED_WOKEN"
printf '%-44s %s\n' "cold start to first token (s)" "$COLD"
printf '%-44s %s\n' "engine's own sleep (s, its log)" "$SLEEP_S"
printf '%-44s %s\n' "engine's own wake (s, its log)" "$WAKE_S"
printf '%-44s %s\n' "CapyCTL wake-to-first-token (s)" "$WAKE_TTFT"
if [[ "$WAKE_S" != "?" ]]; then
  printf '%-44s %s\n' "CapyCTL's own share (s, wake-to-first-token - engine wake)" \
    "$("$PY" -c "print(f'{$WAKE_TTFT - $WAKE_S:.3f}')")"
fi
echo "last switch: $SWITCH"
[[ $USED_PARKED -lt $USED_READY ]] || die "the park moved no GPU memory ($USED_READY -> $USED_PARKED MiB)"
log "done"
