#!/usr/bin/env bash
# GPU check for a machine with an NVIDIA GPU and driver: builds the host agent's inventory
# example with NVML, prints the NVML inventory (failing when NVML does not load or finds no
# GPU), then makes one engine-free 512 MiB allocation through the CUDA driver API (python3 and
# ctypes on libcuda.so.1; no torch needed) and checks that NVML's per-process reading of it is
# at least 512 MiB. Exits non-zero on any failure.
# Run from anywhere: bash node-agent/scripts/gpu-check.sh   (CARGO_TARGET_DIR is honoured)
set -euo pipefail
cd "$(dirname "$0")/../.."

ALLOC_BYTES=$((512 * 1024 * 1024))
TARGET_DIR="${CARGO_TARGET_DIR:-target}"
BIN="$TARGET_DIR/debug/examples/gpu-inventory"

fail() {
  echo "gpu-check: FAILED: $*" >&2
  exit 1
}

echo "== build (--features nvml)"
cargo build -p capyctl-node-agent --features nvml --example gpu-inventory
[ -x "$BIN" ] || fail "no binary at $BIN (is CARGO_TARGET_DIR the one cargo used?)"

echo "== NVML inventory"
"$BIN" --require-gpu || fail "NVML did not load or found no GPU (see above)"

echo "== per-process memory of one 512 MiB allocation (CUDA driver API)"
command -v python3 >/dev/null || fail "python3 is needed for the allocation"
WORK="$(mktemp -d)"
ALLOC=""
cleanup() {
  if [ -n "$ALLOC" ]; then kill "$ALLOC" 2>/dev/null || true; wait "$ALLOC" 2>/dev/null || true; fi
  rm -rf "$WORK"
}
trap cleanup EXIT

# Allocates ALLOC_BYTES on CUDA device 0, writes to it, prints one line, then holds it.
python3 - "$ALLOC_BYTES" >"$WORK/alloc.out" 2>"$WORK/alloc.err" <<'PY' &
import ctypes
import sys
import time

size = int(sys.argv[1])
try:
    cuda = ctypes.CDLL("libcuda.so.1")
except OSError as e:
    sys.exit(f"cannot load libcuda.so.1 (the NVIDIA driver's CUDA library): {e}")

cuda.cuInit.argtypes = [ctypes.c_uint]
cuda.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
cuda.cuDeviceGetName.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int]
cuda.cuCtxCreate_v2.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint, ctypes.c_int]
cuda.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
cuda.cuMemsetD8_v2.argtypes = [ctypes.c_uint64, ctypes.c_ubyte, ctypes.c_size_t]
cuda.cuCtxSynchronize.argtypes = []
cuda.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]


def check(call, rc):
    if rc != 0:
        text = ctypes.c_char_p()
        cuda.cuGetErrorString(rc, ctypes.byref(text))
        why = text.value.decode() if text.value else "unknown error"
        sys.exit(f"{call} failed: CUDA error {rc} ({why})")


check("cuInit", cuda.cuInit(0))
dev = ctypes.c_int()
check("cuDeviceGet(0)", cuda.cuDeviceGet(ctypes.byref(dev), 0))
name = ctypes.create_string_buffer(256)
check("cuDeviceGetName", cuda.cuDeviceGetName(name, 256, dev.value))
ctx = ctypes.c_void_p()
check("cuCtxCreate", cuda.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev.value))
ptr = ctypes.c_uint64()
check("cuMemAlloc", cuda.cuMemAlloc_v2(ctypes.byref(ptr), size))
check("cuMemsetD8", cuda.cuMemsetD8_v2(ptr.value, 1, size))
check("cuCtxSynchronize", cuda.cuCtxSynchronize())
print(f"allocated {size >> 20} MiB on {name.value.decode()}", flush=True)
time.sleep(300)
PY
ALLOC=$!

# Wait (bounded) for the allocation, or for the allocator to fail.
for _ in $(seq 1 120); do
  if grep -q '^allocated' "$WORK/alloc.out" 2>/dev/null; then break; fi
  if ! kill -0 "$ALLOC" 2>/dev/null; then
    cat "$WORK/alloc.err" >&2
    fail "the allocation failed (above)"
  fi
  sleep 0.5
done
grep -q '^allocated' "$WORK/alloc.out" || fail "no allocation within 60 s: $(cat "$WORK/alloc.err")"
cat "$WORK/alloc.out"

# NVML may show a new process a moment late: retry the reading (bounded), then show it.
for _ in $(seq 1 20); do
  if "$BIN" --pid "$ALLOC" --min-bytes "$ALLOC_BYTES" >/dev/null 2>&1; then break; fi
  sleep 0.5
done
"$BIN" --pid "$ALLOC" --min-bytes "$ALLOC_BYTES" \
  || fail "NVML's reading of pid $ALLOC is below 512 MiB (a PID namespace of its own hides host pids from NVML: compare with 'NVML lists' above)"
echo "gpu-check: passed (NVML inventory, per-process reading of pid $ALLOC >= 512 MiB)"
