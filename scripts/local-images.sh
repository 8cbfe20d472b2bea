#!/usr/bin/env bash
# Builds CapyCTL's images offline from this workspace's own binaries and imports them into the
# local cluster's containerd (scripts/local-cluster.sh up first), for
# `helm install capyctl charts/capyctl -f charts/capyctl/values-local.yaml`.
#
#   scripts/local-images.sh [--no-build] [--no-import]
#
# No registry is reachable here, so instead of docker/*.Dockerfile (a Rust builder stage, then
# gcr.io/distroless/cc-debian12:nonroot) each image is what those Dockerfiles' final stage holds,
# written as an OCI archive by scripts/local-cluster/oci-archive.py (the equivalent of
# `FROM scratch`): the release binary at /usr/local/bin, the shared libraries it loads (ldd) and
# the dynamic loader, /etc/passwd and /etc/group with the nonroot user (65532), /tmp, the CA
# bundle; user 65532:65532, the binary as entrypoint.
#
#   localhost/capyctl/capyctl-operator:$VERSION     cargo build --release -p capyctl-operator
#   localhost/capyctl/capyctl-node-agent:$VERSION   ... -p capyctl-node-agent --features nvml
#                                                  (NVML is loaded at run time: no GPU here, the
#                                                  chart's host.gpus stands in)
#   localhost/capyctl/engine-sim:$VERSION           ... -p capyctl-engine-sim --bin engine-sim
#   localhost/capyctl/busybox:$VERSION              Debian's busybox-static (sh, chmod, chown): the
#                                                  chart's init container that gives the node
#                                                  agent's data directory to its user
# $VERSION is the chart's appVersion. The archives stay in target/local-images/.
# Env: CAPYCTL_LOCAL_IMAGES_NICE (nice level of the cargo build, 10).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT=$ROOT/target/local-images
REPO=localhost/capyctl
SOCK=/run/capyctl-local/containerd.sock
NICE=${CAPYCTL_LOCAL_IMAGES_NICE:-10}
VERSION=$(awk '$1 == "appVersion:" { gsub(/"/, "", $2); print $2 }' charts/capyctl/Chart.yaml)
BUILD=1
IMPORT=1
for a in "$@"; do
  case $a in
    --no-build) BUILD=0 ;;
    --no-import) IMPORT=0 ;;
    *) echo "usage: $0 [--no-build] [--no-import]" >&2; exit 2 ;;
  esac
done

log() { echo "local-images: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }
[ -n "$VERSION" ] || die "no appVersion in charts/capyctl/Chart.yaml"

if ! [ -x /bin/busybox ]; then
  [ "$(id -u)" = 0 ] || die "Debian's busybox-static is needed (apt-get install busybox-static)"
  log "installing Debian's busybox-static"
  apt-get -o DPkg::Lock::Timeout=300 update -qq
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends busybox-static >/dev/null
fi

t0=$SECONDS
if [ "$BUILD" = 1 ]; then
  log "cargo build --release (nice $NICE): capyctl-operator, capyctl-node-agent (nvml), engine-sim"
  nice -n "$NICE" cargo build --release --locked \
    -p capyctl-operator --bin capyctl-operator \
    -p capyctl-node-agent --bin capyctl-node-agent --features capyctl-node-agent/nvml \
    -p capyctl-engine-sim --bin engine-sim
  log "built in $((SECONDS - t0)) s"
fi

mkdir -p "$OUT/base"
# what distroless/cc-debian12:nonroot has besides glibc: the users, a writable /tmp, CA roots
printf 'root:x:0:0:root:/root:/sbin/nologin\nnobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n' > "$OUT/base/passwd"
printf 'root:x:0:\nnobody:x:65534:\nnonroot:x:65532:\n' > "$OUT/base/group"
printf 'hosts: files dns\n' > "$OUT/base/nsswitch.conf"
base_args=(--add "$OUT/base/passwd=/etc/passwd:644" --add "$OUT/base/group=/etc/group:644"
  --add "$OUT/base/nsswitch.conf=/etc/nsswitch.conf:644" --dir /tmp=1777)
[ -f /etc/ssl/certs/ca-certificates.crt ] \
  && base_args+=(--add "/etc/ssl/certs/ca-certificates.crt=/etc/ssl/certs/ca-certificates.crt:644")

# libs BINARY: --add arguments for every shared library BINARY loads, and the loader, at the
# paths ldd names (their content, links followed)
libs() {
  ldd "$1" | awk '
    $2 == "=>" && $3 ~ /^\// { print $3 }
    $1 ~ /^\// { print $1 }' | sort -u | while read -r lib; do
    printf -- '--add\n%s=%s:755\n' "$lib" "$lib"
  done
}

image() { # name binary
  local name=$1 bin=$2 ref=$REPO/$1:$VERSION
  [ -x "$bin" ] || die "$bin missing (run without --no-build)"
  mapfile -t lib_args < <(libs "$bin")
  python3 scripts/local-cluster/oci-archive.py --out "$OUT/$name.oci.tar" --name "$ref" \
    --add "$bin=/usr/local/bin/$(basename "$bin"):755" "${lib_args[@]}" "${base_args[@]}" \
    --user 65532:65532 --entrypoint "/usr/local/bin/$(basename "$bin")" >&2
  echo "$ref"
}

refs=()
refs+=("$(image capyctl-operator target/release/capyctl-operator)")
refs+=("$(image capyctl-node-agent target/release/capyctl-node-agent)")
refs+=("$(image engine-sim target/release/engine-sim)")

# (Debian's dynamic busybox, when it is the one installed, brings its libraries)
mapfile -t bb_libs < <(ldd /bin/busybox >/dev/null 2>&1 && libs /bin/busybox)
python3 scripts/local-cluster/oci-archive.py --out "$OUT/busybox.oci.tar" --name "$REPO/busybox:$VERSION" \
  --add /bin/busybox=/bin/busybox:755 "${bb_libs[@]}" --link /bin/sh=busybox --link /bin/chmod=busybox \
  --link /bin/chown=busybox --link /bin/ls=busybox --link /bin/cat=busybox "${base_args[@]}" \
  --cmd /bin/sh >&2
refs+=("$REPO/busybox:$VERSION")

if [ "$IMPORT" = 1 ]; then
  [ -S "$SOCK" ] || die "the local cluster's containerd is not running ($SOCK): scripts/local-cluster.sh up, then run again with --no-build (the archives are in $OUT)"
  for f in capyctl-operator capyctl-node-agent engine-sim busybox; do
    ctr --address "$SOCK" -n k8s.io images import "$OUT/$f.oci.tar" >/dev/null
  done
  log "imported into the local cluster's containerd:"
fi
printf '%s\n' "${refs[@]}"
log "done in $((SECONDS - t0)) s"
