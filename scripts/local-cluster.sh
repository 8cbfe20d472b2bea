#!/usr/bin/env bash
# A one-node Kubernetes cluster on this machine, for running the chart end to end (issue 29).
#
#   scripts/local-cluster.sh up          start it (idempotent; prints the kubeconfig's path)
#   scripts/local-cluster.sh down        stop everything `up` started; no process, mount, network
#                                        namespace, bridge or iptables rule of it is left
#   scripts/local-cluster.sh down --wipe the same, and delete the cluster's state (etcd, images)
#   scripts/local-cluster.sh status      what runs
#   scripts/local-cluster.sh restart kubelet   stop the kubelet (SIGTERM: its Pods run on), then
#                                        `up` again (it starts what is missing) until the node is
#                                        Ready as the new kubelet reports it (a fault the
#                                        end-to-end test injects)
#
# What `up` starts, each a process of its own (logs and pids under $STATE/logs and $STATE/run):
#   etcd, kube-apiserver (on every address: Pods reach it through the `kubernetes` Service),
#   kube-controller-manager, kube-scheduler   the control plane, as ../shared/tools/k8s/k8s-up.sh
#                                             starts it, plus what a node needs (below)
#   containerd    Debian's, with its own socket, root and state (nothing of a system containerd
#                 is touched); Pod sandboxes run a pause image built here from
#                 scripts/local-cluster/pause.c (no registry is reachable)
#   kubelet       registers the node $NODE_NAME (cgroup v1 with the cgroupfs driver)
#   a CNI bridge  capyctl0, Pods get 10.244.0.0/16 addresses from host-local (Debian's
#                 containernetworking-plugins)
#   kube-proxy    iptables mode: ClusterIP Services (the router's, `kubernetes` for in-cluster
#                 clients) work from Pods and from this machine
# No DNS add-on runs (no CoreDNS image can be had offline): Pods get this machine's resolv.conf,
# so Service names do not resolve; CapyCTL's parts reach each other by Pod IP and the API server
# by the KUBERNETES_SERVICE_HOST address, which is all the chart needs.
#
# Binaries: kube-* and kubectl from $CAPYCTL_K8S_HOME/bin (../shared/tools/k8s/build.sh builds
# them; CAPYCTL_K8S_HOME defaults to ~/.cache/capyctl-k8s), etcd from Debian (build.sh installs
# it). Debian packages the node needs (containerd, runc, containernetworking-plugins, iptables,
# conntrack, gcc, libc6-dev) are installed when missing. Must run as root.
#
# Env: CAPYCTL_LOCAL_CLUSTER_DIR (state, default $CAPYCTL_K8S_HOME/local-cluster),
#      CAPYCTL_NODE_NAME (capyctl-node), CAPYCTL_NODE_IP (the address of the default route's
#      interface), LOCAL_CLUSTER_API_PORT (6444), LOCAL_CLUSTER_ETCD_PORT (2389; the peer port is
#      the next one), LOCAL_CLUSTER_TIMEOUT (seconds to wait for each part, 120).
# The ports differ from k8s-up.sh's, so that its control plane can run beside this cluster.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
EXT=${CAPYCTL_K8S_HOME:-$HOME/.cache/capyctl-k8s}
BIN=$EXT/bin
STATE=${CAPYCTL_LOCAL_CLUSTER_DIR:-$EXT/local-cluster}
PKI=$STATE/pki
RUN=$STATE/run
LOGS=$STATE/logs
DATA=$STATE/data
KCFG=$STATE/kubeconfig
# containerd's state and socket (tmpfs-like, gone at reboot), kept apart from a system containerd
CRUN=/run/capyctl-local
SOCK=$CRUN/containerd.sock
CNI_CONF=$STATE/cni/net.d
CNI_BIN=/usr/lib/cni
KUBELET_ROOT=$STATE/kubelet
NODE_NAME=${CAPYCTL_NODE_NAME:-capyctl-node}
API_PORT=${LOCAL_CLUSTER_API_PORT:-6444}
ETCD_PORT=${LOCAL_CLUSTER_ETCD_PORT:-2389}
ETCD_PEER_PORT=$((ETCD_PORT + 1))
TIMEOUT=${LOCAL_CLUSTER_TIMEOUT:-120}
POD_CIDR=10.244.0.0/16
SERVICE_CIDR=10.96.0.0/12
BRIDGE=capyctl0
CNI_NET=capyctl-local
PAUSE_IMAGE=localhost/capyctl/pause:1
KUBECTL=$BIN/kubectl
ETCD=$(command -v etcd || echo /usr/bin/etcd)

log() { echo "local-cluster: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }
kc() { "$KUBECTL" --kubeconfig "$KCFG" --request-timeout=10s "$@"; }
ctr_() { ctr --address "$SOCK" -n k8s.io "$@"; }

# pid_alive NAME PATTERN: run/NAME.pid names a live process whose command line has PATTERN
pid_alive() {
  local f=$RUN/$1.pid pid
  [ -s "$f" ] || return 1
  pid=$(cat "$f")
  [ -d "/proc/$pid" ] || return 1
  tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | grep -qF -- "$2"
}

# ------------------------------------------------------------------------------------------
# down
# ------------------------------------------------------------------------------------------

# stop NAME PATTERN: TERM the recorded pid if it still runs PATTERN; KILL after 20 s
stop() {
  local name=$1 pat=$2 f=$RUN/$1.pid pid i
  [ -s "$f" ] || return 0
  pid=$(cat "$f")
  if [ -d "/proc/$pid" ] && tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | grep -qF -- "$pat"; then
    log "stopping $name (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true
    for i in $(seq 1 40); do [ -d "/proc/$pid" ] || break; sleep 0.5; done
    if [ -d "/proc/$pid" ]; then log "$name did not stop, SIGKILL"; kill -KILL "$pid" 2>/dev/null || true; sleep 0.5; fi
  fi
  rm -f "$f"
}

# every mount point at or under $1, deepest first
mounts_under() {
  awk -v p="$1" '{ m=$2; gsub(/\\040/, " ", m); if (m == p || index(m, p "/") == 1) print m }' /proc/self/mounts \
    | awk '{ print length($0) " " $0 }' | sort -rn | cut -d' ' -f2-
}

# CNI DEL of one sandbox, as containerd would have done at StopPodSandbox: the bridge plugin
# removes the veth, host-local gives the address back
cni_del() { # sandbox-id netns-path
  local id=$1 ns=$2
  [ -f "$CNI_CONF/10-$CNI_NET.conflist" ] || return 0
  python3 - "$CNI_CONF/10-$CNI_NET.conflist" <<'PY' | while IFS= read -r conf; do
import json, sys
c = json.load(open(sys.argv[1]))
for p in reversed(c["plugins"]):
    p = dict(p, name=c["name"], cniVersion=c["cniVersion"])
    print(json.dumps(p))
PY
    plugin=$(printf '%s' "$conf" | python3 -c 'import json,sys; print(json.load(sys.stdin)["type"])')
    printf '%s' "$conf" | CNI_COMMAND=DEL CNI_CONTAINERID="$id" CNI_NETNS="$ns" CNI_IFNAME=eth0 \
      CNI_PATH=$CNI_BIN "$CNI_BIN/$plugin" >/dev/null 2>&1 || log "CNI DEL ($plugin) of sandbox ${id:0:12} failed (ignored)"
  done || true
}

# the kubelet's own chains (KUBE-FIREWALL, which drops outside packets to 127.0.0.0/8, the
# canaries, the hint) and whatever kube-proxy left: every KUBE-* chain and every jump to one, in
# IPv4 and IPv6 (nothing else on this machine names its chains KUBE-)
kube_iptables_cleanup() {
  local ipt table rule chain
  for ipt in iptables ip6tables; do
    command -v "$ipt" >/dev/null || continue
    for table in filter nat mangle; do
      "$ipt" -t "$table" -S 2>/dev/null | grep -E '^-A [A-Z]+ .*-j KUBE-' | grep -vE '^-A KUBE-' \
        | while IFS= read -r rule; do
            # shellcheck disable=SC2086 # the rule's words, as iptables -S printed them
            eval "$ipt -t $table ${rule/-A/-D}" 2>/dev/null || true
          done || true
      for chain in $("$ipt" -t "$table" -S 2>/dev/null | awk '$1 == "-N" && $2 ~ /^KUBE-/ { print $2 }'); do
        "$ipt" -t "$table" -F "$chain" 2>/dev/null || true
      done
      for chain in $("$ipt" -t "$table" -S 2>/dev/null | awk '$1 == "-N" && $2 ~ /^KUBE-/ { print $2 }'); do
        "$ipt" -t "$table" -X "$chain" 2>/dev/null || log "could not delete $ipt -t $table chain $chain"
      done
    done
  done
}

down() {
  local wipe=${1:-0} ids id ns shim pid m left
  mkdir -p "$RUN"
  # the node first, so that nothing restarts what is stopped below
  stop kubelet "$BIN/kubelet"
  stop kube-proxy "$BIN/kube-proxy"
  # every container and sandbox of containerd's CRI namespace: kill, delete, and tear the
  # sandboxes' networks down (CNI DEL, then the network namespace)
  if [ -S "$SOCK" ] && pid_alive containerd "$STATE/containerd.toml"; then
    ids=$(ctr_ containers ls -q 2>/dev/null || true)
    : > "$RUN/netns.list"
    for id in $ids; do
      ns=$(ctr_ containers info "$id" 2>/dev/null | python3 -c '
import json, sys
try:
    c = json.load(sys.stdin)
except ValueError:
    sys.exit(0)
if c.get("Labels", {}).get("io.cri-containerd.kind") == "sandbox":
    for n in c.get("Spec", {}).get("linux", {}).get("namespaces", []):
        if n.get("type") == "network" and n.get("path"):
            print(n["path"])
' || true)
      [ -n "$ns" ] && echo "$id $ns" >> "$RUN/netns.list"
      ctr_ tasks kill -s SIGKILL "$id" >/dev/null 2>&1 || true
    done
    for id in $ids; do
      for _ in $(seq 1 20); do
        ctr_ tasks delete "$id" >/dev/null 2>&1 && break
        ctr_ tasks ls -q 2>/dev/null | grep -qx "$id" || break
        sleep 0.25
      done
      ctr_ containers delete "$id" >/dev/null 2>&1 || log "could not delete container ${id:0:12}"
    done
    [ -z "$ids" ] || log "removed $(echo "$ids" | wc -w) container(s) and sandbox(es)"
  fi
  stop containerd "$STATE/containerd.toml"
  # shims of this containerd that outlived it (they name its socket on their command line)
  for pid in $(pgrep -f "containerd-shim-runc-v2 .*-address $SOCK" || true); do
    log "killing leftover shim $pid"; kill -KILL "$pid" 2>/dev/null || true
  done
  if [ -s "$RUN/netns.list" ]; then
    while read -r id ns; do
      cni_del "$id" "$ns"
      if [ -e "$ns" ]; then umount "$ns" 2>/dev/null || true; rm -f "$ns"; fi
    done < "$RUN/netns.list"
  fi
  rm -f "$RUN/netns.list"
  stop kube-scheduler "$BIN/kube-scheduler"
  stop kube-controller-manager "$BIN/kube-controller-manager"
  stop kube-apiserver "$BIN/kube-apiserver"
  stop etcd "--data-dir $DATA/etcd"
  # the kubelet's volumes (secrets, projected tokens: tmpfs) and containerd's sandbox /dev/shm
  for m in $(mounts_under "$KUBELET_ROOT") $(mounts_under "$CRUN") $(mounts_under "$STATE/containerd"); do
    umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || log "could not unmount $m"
  done
  rm -rf "$CRUN"
  # the bridge, kube-proxy's rules, host-local's leases
  if ip link show "$BRIDGE" >/dev/null 2>&1; then ip link delete "$BRIDGE" && log "deleted bridge $BRIDGE"; fi
  if [ -x "$BIN/kube-proxy" ] && [ -f "$RUN/kube-proxy.used" ]; then
    "$BIN/kube-proxy" --cleanup >/dev/null 2>&1 || log "kube-proxy --cleanup failed (ignored)"
    rm -f "$RUN/kube-proxy.used"
  fi
  kube_iptables_cleanup
  rm -rf "$STATE/cni/networks"
  # the sysctls `up` changed, back to what they were
  if [ -s "$RUN/sysctl.saved" ]; then
    while read -r key val; do sysctl -qw "$key=$val" >/dev/null 2>&1 || true; done < "$RUN/sysctl.saved"
    rm -f "$RUN/sysctl.saved"
  fi
  left=$(mounts_under "$STATE"; mounts_under "$CRUN")
  [ -z "$left" ] || log "WARNING: mounts left: $left"
  if [ "$wipe" = 1 ]; then
    log "wiping $STATE (etcd data, images, kubelet state; certificates kept)"
    rm -rf "$DATA" "$STATE/containerd" "$KUBELET_ROOT" "$STATE/images"
  fi
  echo "local cluster down"
}

# ------------------------------------------------------------------------------------------
# up
# ------------------------------------------------------------------------------------------

install_packages() {
  local need=()
  command -v containerd >/dev/null || need+=(containerd)
  command -v runc >/dev/null || need+=(runc)
  command -v ctr >/dev/null || need+=(containerd)
  [ -x "$CNI_BIN/bridge" ] && [ -x "$CNI_BIN/host-local" ] && [ -x "$CNI_BIN/loopback" ] || need+=(containernetworking-plugins)
  command -v iptables >/dev/null || need+=(iptables)
  command -v conntrack >/dev/null || need+=(conntrack)
  command -v gcc >/dev/null || need+=(gcc)
  [ -f /usr/lib/x86_64-linux-gnu/libc.a ] || [ -n "$(find /usr/lib -name libc.a -print -quit 2>/dev/null)" ] || need+=(libc6-dev)
  command -v python3 >/dev/null || need+=(python3)
  [ ${#need[@]} -eq 0 ] && return 0
  log "installing Debian packages: ${need[*]}"
  apt-get -o DPkg::Lock::Timeout=300 update -qq
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  # a packaged containerd may have been started by the package's service: it is not ours, and
  # this cluster's containerd has its own socket, so it is left alone
}

node_ip() {
  local ip=${CAPYCTL_NODE_IP:-}
  [ -n "$ip" ] || ip=$(ip -4 route get 1.1.1.1 2>/dev/null | sed -n 's/.* src \([0-9.]*\).*/\1/p' | head -1)
  [ -n "$ip" ] || ip=$(ip -4 -o addr show scope global 2>/dev/null | awk '{ split($4, a, "/"); print a[1]; exit }')
  [ -n "$ip" ] || die "no IPv4 address for the node (set CAPYCTL_NODE_IP to one of this machine's)"
  echo "$ip"
}

gen_cert() { # name CN O eku san(or empty)
  local name=$1 cn=$2 o=$3 eku=$4 san=$5 cnf
  if [ -s "$PKI/$name.crt" ] && [ -s "$PKI/$name.key" ] && [ "$(cat "$PKI/$name.san" 2>/dev/null)" = "$san" ]; then
    return 0
  fi
  cnf=$PKI/$name.cnf
  {
    echo "[req]"; echo "distinguished_name=dn"; echo "prompt=no"; echo "[dn]"
    [ -n "$o" ] && echo "O=$o"
    echo "CN=$cn"
    echo "[ext]"
    echo "basicConstraints=critical,CA:FALSE"
    echo "keyUsage=critical,digitalSignature,keyEncipherment"
    echo "extendedKeyUsage=$eku"
    echo "subjectKeyIdentifier=hash"
    echo "authorityKeyIdentifier=keyid,issuer"
    [ -n "$san" ] && echo "subjectAltName=$san"
  } > "$cnf"
  openssl genrsa -out "$PKI/$name.key" 2048 2>/dev/null
  openssl req -new -key "$PKI/$name.key" -config "$cnf" -out "$PKI/$name.csr"
  openssl x509 -req -in "$PKI/$name.csr" -CA "$PKI/ca.crt" -CAkey "$PKI/ca.key" -CAcreateserial \
    -days 3650 -sha256 -extfile "$cnf" -extensions ext -out "$PKI/$name.crt" 2>/dev/null
  rm -f "$PKI/$name.csr"
  echo "$san" > "$PKI/$name.san"
}

write_kubeconfig() { # file user cert key [server]
  local tmp=$1.tmp b64
  b64() { base64 -w0 < "$1"; }
  cat > "$tmp" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: capyctl-local
  cluster:
    server: ${5:-https://127.0.0.1:$API_PORT}
    certificate-authority-data: $(b64 "$PKI/ca.crt")
users:
- name: $2
  user:
    client-certificate-data: $(b64 "$3")
    client-key-data: $(b64 "$4")
contexts:
- name: capyctl-local
  context:
    cluster: capyctl-local
    user: $2
    namespace: default
current-context: capyctl-local
EOF
  chmod 600 "$tmp"
  mv "$tmp" "$1"
}

pki() {
  local ip=$1
  mkdir -p "$PKI"
  if [ ! -s "$PKI/ca.crt" ] || [ ! -s "$PKI/ca.key" ]; then
    log "generating PKI in $PKI"
    rm -f "$PKI"/*.crt "$PKI"/*.key "$PKI"/*.srl "$PKI"/*.san
    printf '[req]\ndistinguished_name=dn\nprompt=no\nx509_extensions=ca\n[dn]\nCN=capyctl-local-ca\n[ca]\nbasicConstraints=critical,CA:TRUE\nkeyUsage=critical,digitalSignature,keyCertSign,cRLSign\nsubjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid:always\n' > "$PKI/ca.cnf"
    openssl genrsa -out "$PKI/ca.key" 2048 2>/dev/null
    openssl req -x509 -new -key "$PKI/ca.key" -config "$PKI/ca.cnf" -days 3650 -sha256 -out "$PKI/ca.crt"
  fi
  gen_cert apiserver kube-apiserver "" serverAuth \
    "DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,IP:127.0.0.1,IP:10.96.0.1,IP:$ip"
  gen_cert admin kubernetes-admin system:masters clientAuth ""
  gen_cert controller-manager system:kube-controller-manager "" clientAuth ""
  gen_cert scheduler system:kube-scheduler "" clientAuth ""
  gen_cert kube-proxy system:kube-proxy "" clientAuth ""
  gen_cert kubelet "system:node:$NODE_NAME" system:nodes clientAuth ""
  # the API server's client certificate towards the kubelet (exec, logs, port-forward)
  gen_cert apiserver-kubelet-client kube-apiserver-kubelet-client system:masters clientAuth ""
  if [ ! -s "$PKI/sa.key" ]; then
    openssl genrsa -out "$PKI/sa.key" 2048 2>/dev/null
    openssl rsa -in "$PKI/sa.key" -pubout -out "$PKI/sa.pub" 2>/dev/null
  fi
  chmod 600 "$PKI"/*.key
  write_kubeconfig "$KCFG" admin "$PKI/admin.crt" "$PKI/admin.key"
  local c
  for c in controller-manager scheduler kube-proxy kubelet; do
    write_kubeconfig "$PKI/$c.kubeconfig" "$c" "$PKI/$c.crt" "$PKI/$c.key"
  done
}

# start NAME BINARY ARGS...: detached (own session), pid recorded; PATTERN names it for pid_alive
start() {
  local name=$1; shift
  if pid_alive "$name" "${start_pat:-$1}"; then return 0; fi
  log "starting $name (log $LOGS/$name.log)"
  setsid "$@" >>"$LOGS/$name.log" 2>&1 </dev/null &
  echo $! > "$RUN/$name.pid"
}

wait_for() { # what pid-name check...
  local what=$1 name=$2; shift 2
  local deadline=$((SECONDS + TIMEOUT))
  until "$@" >/dev/null 2>&1; do
    [ -d "/proc/$(cat "$RUN/$name.pid" 2>/dev/null || echo none)" ] || die "$what exited (see $LOGS/$name.log)"
    [ $SECONDS -lt $deadline ] || die "timed out after ${TIMEOUT}s waiting for $what (see $LOGS/$name.log)"
    sleep 0.5
  done
}

set_sysctl() { # key value: remember the old value for `down`
  local key=$1 val=$2 old
  old=$(sysctl -n "$key" 2>/dev/null) || die "sysctl $key is missing (kernel module br_netfilter?)"
  [ "$old" = "$val" ] && return 0
  grep -q "^$key " "$RUN/sysctl.saved" 2>/dev/null || echo "$key $old" >> "$RUN/sysctl.saved"
  sysctl -qw "$key=$val"
}

pause_image() {
  ctr_ images ls -q 2>/dev/null | grep -qxF "$PAUSE_IMAGE" && return 0
  mkdir -p "$STATE/images"
  gcc -static -Os -s -o "$STATE/images/pause" "$ROOT/scripts/local-cluster/pause.c"
  python3 "$ROOT/scripts/local-cluster/oci-archive.py" --out "$STATE/images/pause.oci.tar" \
    --name "$PAUSE_IMAGE" --add "$STATE/images/pause=/pause:755" --entrypoint /pause --user 65535:65535 >&2
  ctr_ images import "$STATE/images/pause.oci.tar" >/dev/null
  log "imported $PAUSE_IMAGE"
}

write_configs() {
  local ip=$1
  mkdir -p "$CNI_CONF" "$STATE/cni/networks" "$KUBELET_ROOT" "$CRUN"
  cat > "$STATE/containerd.toml" <<EOF
# containerd of the local cluster (scripts/local-cluster.sh): its own socket, root and state
version = 2
root = "$STATE/containerd"
state = "$CRUN/state"
oom_score = 0
[grpc]
  address = "$SOCK"
[ttrpc]
  address = "$CRUN/containerd.sock.ttrpc"
[debug]
  address = ""
[metrics]
  address = ""
[plugins."io.containerd.internal.v1.opt"]
  path = "$STATE/containerd/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$PAUSE_IMAGE"
  # this machine does not let a process lower its oom_score_adj (no CAP_SYS_RESOURCE): without
  # this every sandbox fails with runc's "can't get final child's PID from pipe"
  restrict_oom_score_adj = true
  disable_apparmor = true
  enable_selinux = false
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "$CNI_BIN"
    conf_dir = "$CNI_CONF"
    max_conf_num = 1
EOF
  cat > "$CNI_CONF/10-$CNI_NET.conflist" <<EOF
{
  "cniVersion": "0.4.0",
  "name": "$CNI_NET",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "$BRIDGE",
      "isGateway": true,
      "ipMasq": false,
      "hairpinMode": true,
      "ipam": {
        "type": "host-local",
        "ranges": [[{"subnet": "$POD_CIDR"}]],
        "routes": [{"dst": "0.0.0.0/0"}],
        "dataDir": "$STATE/cni/networks"
      }
    }
  ]
}
EOF
  cat > "$STATE/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
containerRuntimeEndpoint: unix://$SOCK
# this kernel mounts cgroup v1 (cpu, memory, ... under /sys/fs/cgroup)
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupsPerQOS: false
enforceNodeAllocatable: []
failSwapOn: false
address: 0.0.0.0
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: false}
  x509: {clientCAFile: $PKI/ca.crt}
# only clients with a certificate of this cluster's CA get in (the API server's, an admin's)
authorization: {mode: AlwaysAllow}
clusterDomain: cluster.local
clusterDNS: []
resolvConf: /etc/resolv.conf
# the disk and memory are shared with other work: evict only when nearly nothing is left, and
# never garbage-collect images (they cannot be pulled again, only rebuilt)
evictionHard: {memory.available: 100Mi, nodefs.available: 1%, nodefs.inodesFree: 1%, imagefs.available: 1%}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
serializeImagePulls: false
maxPods: 60
# Pods are never resized in place here; with the gate on, the kubelet 1.34.9 crashed once on
# this node (a nil pointer in doPodResizeAction, after "Missing actuated resource record" for a
# Pod it had just started)
featureGates: {InPlacePodVerticalScaling: false}
EOF
  cat > "$STATE/kube-proxy.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: $PKI/kube-proxy.kubeconfig}
hostnameOverride: $NODE_NAME
mode: iptables
clusterCIDR: $POD_CIDR
bindAddress: 0.0.0.0
healthzBindAddress: 127.0.0.1:10256
metricsBindAddress: 127.0.0.1:10249
# leave this machine's conntrack settings and route_localnet as they are
conntrack: {maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
iptables: {localhostNodePorts: false, masqueradeAll: false}
nodePortAddresses: [primary]
EOF
}

up() {
  local t0=$SECONDS ip started
  started=$(date -u +%s)
  [ "$(id -u)" = 0 ] || die "must run as root (containerd, kubelet, iptables)"
  for b in kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy kubectl; do
    [ -x "$BIN/$b" ] || die "$BIN/$b missing (build it: ../shared/tools/k8s/build.sh, see its README)"
  done
  [ -x "$ETCD" ] || die "etcd not found (../shared/tools/k8s/build.sh installs Debian's etcd-server)"
  install_packages
  mkdir -p "$RUN" "$LOGS" "$DATA"
  ip=$(node_ip)
  pki "$ip"
  write_configs "$ip"

  # ---------- network: forwarding and bridged traffic through iptables (Services) ----------
  [ -d /proc/sys/net/bridge ] || modprobe br_netfilter 2>/dev/null || true
  set_sysctl net.ipv4.ip_forward 1
  set_sysctl net.bridge.bridge-nf-call-iptables 1

  # ---------- etcd ----------
  mkdir -p "$DATA/etcd"; chmod 700 "$DATA/etcd"
  start_pat="--data-dir $DATA/etcd" start etcd "$ETCD" \
    --name local --data-dir "$DATA/etcd" \
    --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
    --initial-cluster "local=http://127.0.0.1:$ETCD_PEER_PORT" --initial-cluster-state new \
    --unsafe-no-fsync --log-level warn
  etcd_ok() { curl -fsS --max-time 3 "http://127.0.0.1:$ETCD_PORT/health" | grep -q '"health":"true"'; }
  wait_for etcd etcd etcd_ok

  # ---------- containerd (meanwhile the API server starts) ----------
  start_pat="$STATE/containerd.toml" start containerd containerd --config "$STATE/containerd.toml"

  # ---------- kube-apiserver ----------
  # on every address with the node's as the advertised one: the `kubernetes` Service's endpoint
  # is $ip:$API_PORT, which Pods reach through kube-proxy
  start kube-apiserver "$BIN/kube-apiserver" \
    --bind-address=0.0.0.0 --secure-port="$API_PORT" --advertise-address="$ip" \
    --etcd-servers="http://127.0.0.1:$ETCD_PORT" \
    --tls-cert-file="$PKI/apiserver.crt" --tls-private-key-file="$PKI/apiserver.key" \
    --client-ca-file="$PKI/ca.crt" \
    --kubelet-client-certificate="$PKI/apiserver-kubelet-client.crt" \
    --kubelet-client-key="$PKI/apiserver-kubelet-client.key" \
    --kubelet-preferred-address-types=InternalIP \
    --authorization-mode=Node,RBAC \
    --service-account-issuer=https://kubernetes.default.svc.cluster.local \
    --service-account-key-file="$PKI/sa.pub" --service-account-signing-key-file="$PKI/sa.key" \
    --service-cluster-ip-range="$SERVICE_CIDR" \
    --allow-privileged=true --profiling=false --v=1
  wait_for containerd containerd ctr --address "$SOCK" version
  pause_image
  api_ok() { kc get --raw /readyz; }
  wait_for kube-apiserver kube-apiserver api_ok

  # ---------- controller manager, scheduler ----------
  # every controller but node IPAM (host-local hands out the Pod addresses). Unlike k8s-up.sh,
  # the OpenShift fork's publisher of the "openshift-service-ca.crt" ConfigMap stays on: the
  # fork's ServiceAccount admission projects that ConfigMap into every Pod's API access volume,
  # and without it no Pod with a ServiceAccount token ever starts (FailedMount)
  start kube-controller-manager "$BIN/kube-controller-manager" \
    --kubeconfig="$PKI/controller-manager.kubeconfig" --secure-port=0 --leader-elect=false \
    --use-service-account-credentials=true \
    --controllers='*,-node-ipam-controller' \
    --service-account-private-key-file="$PKI/sa.key" --root-ca-file="$PKI/ca.crt" \
    --cluster-signing-cert-file="$PKI/ca.crt" --cluster-signing-key-file="$PKI/ca.key" \
    --service-cluster-ip-range="$SERVICE_CIDR" --v=1
  start kube-scheduler "$BIN/kube-scheduler" \
    --kubeconfig="$PKI/scheduler.kubeconfig" --secure-port=0 --leader-elect=false --v=1

  # ---------- kubelet, kube-proxy ----------
  start kubelet "$BIN/kubelet" --config="$STATE/kubelet.yaml" --kubeconfig="$PKI/kubelet.kubeconfig" \
    --hostname-override="$NODE_NAME" --node-ip="$ip" --root-dir="$KUBELET_ROOT" \
    --cert-dir="$STATE/kubelet-pki" --v=1
  touch "$RUN/kube-proxy.used"
  start kube-proxy "$BIN/kube-proxy" --config="$STATE/kube-proxy.yaml" --v=1

  kcm_ok() { kc -n default get serviceaccount default; }
  wait_for kube-controller-manager kube-controller-manager kcm_ok
  # Ready as this kubelet reported it (etcd keeps the last run's Node, Ready included)
  node_ready() {
    local c
    c=$(kc get node "$NODE_NAME" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status} {.status.conditions[?(@.type=="Ready")].lastHeartbeatTime}')
    [ "${c%% *}" = True ] && [ "$(date -u -d "${c#* }" +%s)" -ge "$((started - 1))" ]
  }
  wait_for "node $NODE_NAME Ready" kubelet node_ready
  proxy_ok() { curl -fsS --max-time 2 http://127.0.0.1:10256/healthz; }
  wait_for kube-proxy kube-proxy proxy_ok
  pid_alive kube-scheduler "$BIN/kube-scheduler" || die "kube-scheduler exited (see $LOGS/kube-scheduler.log)"
  log "up in $((SECONDS - t0)) s: node $NODE_NAME ($ip), API server https://127.0.0.1:$API_PORT"
  echo "KUBECONFIG=$KCFG"
}

status() {
  local n pat
  for n in etcd containerd kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy; do
    case $n in
      etcd) pat="--data-dir $DATA/etcd" ;;
      containerd) pat="$STATE/containerd.toml" ;;
      *) pat="$BIN/$n" ;;
    esac
    if pid_alive "$n" "$pat"; then echo "$n: running (pid $(cat "$RUN/$n.pid"))"; else echo "$n: stopped"; fi
  done
  echo "KUBECONFIG=$KCFG"
}

case "${1:-}" in
  up) up ;;
  down)
    case "${2:-}" in
      --wipe) down 1 ;;
      "") down 0 ;;
      *) die "usage: $0 down [--wipe]" ;;
    esac ;;
  status) status ;;
  restart)
    [ "${2:-}" = kubelet ] || die "usage: $0 restart kubelet"
    stop kubelet "$BIN/kubelet"
    up ;;
  *) echo "usage: $0 up | down [--wipe] | status | restart kubelet" >&2; exit 2 ;;
esac
