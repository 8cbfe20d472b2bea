#!/usr/bin/env bash
# Builds the real vLLM engine image for the local cluster offline, from the CPU environment that
# scripts/install-vllm-cpu.sh made, and imports it into the local cluster's containerd
# (scripts/local-cluster.sh up first):
#
#   scripts/local-vllm-image.sh [--no-import]
#
#   localhost/capyctl/vllm-cpu:0.32.0
#
# What it holds (the equivalent of `FROM scratch` and COPY lines; no registry is reachable, so no
# vllm/vllm-openai): the environment's venv (vLLM 0.32.0 CPU build, torch, ...) and the Python it
# was made with, both at the paths they were made at (a venv's scripts and links name them:
# ${CAPYCTL_VLLM_HOME:-~/.cache/capyctl-vllm}/venv and the interpreter's prefix), the Python
# standard library (less its tests, its own site-packages and tkinter/idle), every shared library
# outside those trees that the interpreter, the venv's and the standard library's extension
# modules load (ldd), the dynamic loader, bash, env and scripts/vllm-cpu-wrapper.sh (the engine
# command: it drops --enable-sleep-mode, which vLLM refuses on CPU, and execs vLLM), lscpu (vLLM
# reads the CPU topology with it), /etc/passwd and /etc/group, /tmp. User root, as vllm/vllm-openai.
# The models are not in it: they are mounted from the node (values-local-vllm.yaml: the model
# cache's hostPath is the environment's models/ directory).
#
# No C compiler is in it, so vLLM must not compile the model with torch.compile (inductor writes
# C++ on CPU): run it with --enforce-eager (the objects of README's "A local cluster" do).
#
# The layer is gzip-compressed and streamed into `ctr images import -`: no archive is kept (the
# image is about 6.5 GB unpacked; containerd keeps the compressed blob and the unpacked snapshot,
# about 10 GB together). --no-import writes target/local-images/vllm-cpu.oci.tar instead.
# `scripts/local-cluster.sh down --wipe` removes it with the other images.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT=$ROOT/target/local-images
SOCK=/run/capyctl-local/containerd.sock
VHOME=${CAPYCTL_VLLM_HOME:-$HOME/.cache/capyctl-vllm}
VENV=$VHOME/venv
REF=localhost/capyctl/vllm-cpu:0.32.0
IMPORT=1
for a in "$@"; do
  case $a in
    --no-import) IMPORT=0 ;;
    *) echo "usage: $0 [--no-import]" >&2; exit 2 ;;
  esac
done
log() { echo "local-vllm-image: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

[ -f "$VHOME/ready" ] && [ -x "$VENV/bin/python3" ] \
  || die "no vLLM environment at $VHOME: run scripts/install-vllm-cpu.sh (CAPYCTL_VLLM_HOME)"
if [ "$IMPORT" = 1 ]; then
  [ -S "$SOCK" ] || die "the local cluster's containerd is not running ($SOCK): scripts/local-cluster.sh up"
fi
t0=$SECONDS
PY=$(readlink -f "$VENV/bin/python3")
PREFIX=$(dirname "$(dirname "$PY")")
PYVER=$("$VENV/bin/python3" -c 'import sys; print("python%d.%d" % sys.version_info[:2])')
STDLIB=$PREFIX/lib/$PYVER
[ -d "$STDLIB" ] || die "no standard library at $STDLIB"
need=$(du -sm "$VENV" "$STDLIB" | awk '{ s += $1 } END { print int(s * 1.6 / 1024) + 1 }')
avail=$(df -Pm "$ROOT/target" | awk 'NR == 2 { print int($4 / 1024) }')
log "about ${need} GB of disk needed (a compressed layer while it is written, containerd's blob and snapshot); ${avail} GB free"
[ "$avail" -gt "$need" ] || die "not enough disk: ${avail} GB free, about ${need} GB needed"

# Every shared library outside the venv and the interpreter's prefix that an ELF file of these
# loads (ldd follows their dependencies), and the loader; "not found" ones (CUDA's driver
# library, which the CPU build never loads) are left out.
mkdir -p "$OUT"
libs=$OUT/vllm-cpu.libs
log "finding the shared libraries (ldd of the interpreter and every extension module)"
{
  echo "$PY"; command -v bash; command -v lscpu; command -v env
  find "$VENV" "$STDLIB/lib-dynload" -name '*.so*' -type f
} | sort -u | xargs -r -n 64 ldd 2>/dev/null | awk '
    $2 == "=>" && $3 ~ /^\// { print $3 }
    $1 ~ /^\// && $2 ~ /^\(/ { print $1 }' \
  | grep -v -e "^$VENV/" -e "^$PREFIX/" | sort -u > "$libs"
log "$(wc -l < "$libs") libraries"

mkdir -p "$OUT/vllm-base"
printf 'root:x:0:0:root:/root:/bin/bash\nnobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin\n' > "$OUT/vllm-base/passwd"
printf 'root:x:0:\nnobody:x:65534:\n' > "$OUT/vllm-base/group"
args=(--name "$REF" --gzip
  --tree "$VENV=$VENV"
  --tree "$STDLIB=$STDLIB" --exclude "$STDLIB/test" --exclude "$STDLIB/site-packages"
  --exclude "$STDLIB/idlelib" --exclude "$STDLIB/tkinter" --exclude "$STDLIB/ensurepip"
  --add "$PY=$PY:755"
  --add "$(command -v bash)=/bin/bash:755" --link /bin/sh=bash
  --add "$(command -v lscpu)=/usr/bin/lscpu:755"
  --add "$(command -v env)=/usr/bin/env:755"
  --add "$ROOT/scripts/vllm-cpu-wrapper.sh=/usr/local/bin/vllm-cpu-wrapper.sh:755"
  --add "$OUT/vllm-base/passwd=/etc/passwd:644" --add "$OUT/vllm-base/group=/etc/group:644"
  --dir /tmp=1777 --dir /root=700
  --env "CAPYCTL_VLLM_HOME=$VHOME" --env HOME=/root --env VLLM_TARGET_DEVICE=cpu
  --user 0:0 --entrypoint /usr/local/bin/vllm-cpu-wrapper.sh)
# the links from the venv's python to the interpreter (python3 -> python3.11 in its bin/)
for name in python3 python; do
  [ -L "$PREFIX/bin/$name" ] && args+=(--link "$PREFIX/bin/$name=$(readlink "$PREFIX/bin/$name")")
done
for so in "$PREFIX"/lib/lib"$PYVER"*.so*; do
  [ -e "$so" ] && args+=(--add "$so=$so:755")
done
while read -r lib; do args+=(--add "$lib=$lib:755"); done < "$libs"
if [ "$IMPORT" = 1 ]; then
  # One copy only: an image of the same name goes first, with the CRI plugin's reference to it by
  # ID (CRI names every image it uses also by its digest), so that containerd's garbage
  # collection frees its blob and snapshot before the new one is written.
  previous=$(ctr --address "$SOCK" -n k8s.io images ls | awk -v r="$REF" '$1 == r { print $3 }')
  if [ -n "$previous" ]; then
    mapfile -t names < <(ctr --address "$SOCK" -n k8s.io images ls | awk -v d="$previous" '$3 == d { print $1 }')
    log "removing the previous $REF (${names[*]})"
    ctr --address "$SOCK" -n k8s.io images rm --sync "${names[@]}" >/dev/null
  fi
  log "writing the image and importing it into the local cluster's containerd (streamed)"
  # (the layer's temporary file in target/, not in /tmp)
  TMPDIR=$OUT python3 scripts/local-cluster/oci-archive.py --out - "${args[@]}" \
    | ctr --address "$SOCK" -n k8s.io images import - >/dev/null
  log "imported: $REF"
else
  python3 scripts/local-cluster/oci-archive.py --out "$OUT/vllm-cpu.oci.tar" "${args[@]}"
fi
echo "$REF"
log "done in $((SECONDS - t0)) s"
