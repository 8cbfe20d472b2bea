#!/usr/bin/env bash
# GPU check for a machine with an NVIDIA GPU and driver: builds the host agent with NVML, prints
# the NVML inventory, then one engine-free allocation's per-process GPU memory reading.
# Run from anywhere: bash node-agent/scripts/gpu-check.sh
set -euo pipefail
cd "$(dirname "$0")/../.."

echo "== build (--features nvml)"
cargo build -p capyctl-node-agent --features nvml --example gpu-inventory
BIN=target/debug/examples/gpu-inventory

echo "== NVML inventory"
"$BIN"

echo "== per-process memory of one allocation"
if command -v python3 >/dev/null && python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  python3 - <<'PY' &
import time, torch
x = torch.empty(512 * 1024 * 1024, dtype=torch.uint8, device="cuda")  # 512 MiB
torch.cuda.synchronize()
print("allocated 512 MiB on", torch.cuda.get_device_name(0), flush=True)
time.sleep(30)
PY
  ALLOC=$!
  trap 'kill $ALLOC 2>/dev/null || true' EXIT
  for _ in $(seq 1 60); do
    if "$BIN" --pid "$ALLOC" | grep -q 'descendants: [1-9]'; then break; fi
    sleep 0.5
  done
  "$BIN" --pid "$ALLOC"
  echo "expected: at least 512 MiB (plus the CUDA context) for pid $ALLOC"
else
  echo "no allocator available (python3 with CUDA-enabled torch not found); skipped the per-process reading"
fi
